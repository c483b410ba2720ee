"""Chunk size of the causal chunked form against head dimension: the measurement behind DEFAULT_CAUSAL_CHUNK.

Times the causal chunked kernel alone (features in, output out: the feature map is not what C changes), forward
and forward+backward, for each chunk size C and feature/value dimension D = F = Dv, and prints the best C per D.

    .venv/bin/python benchmarks/chunk_size.py                # B=1, H=8, N=8192, D in 32 64 128
    .venv/bin/python benchmarks/chunk_size.py --threads 1 --cpu-time   # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from linattn.kinds.additive.forms.chunked import causal_chunked_attention


def measure(fn, repeats: int, cpu_time: bool) -> float:
    clock = time.process_time if cpu_time else time.perf_counter
    fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def time_chunk(
    inputs: tuple[torch.Tensor, ...], leaves: list[torch.Tensor], grad: torch.Tensor, chunk: int, repeats: int,
    cpu_time: bool,
) -> dict[str, float]:
    def call(*features: torch.Tensor) -> torch.Tensor:
        out, _ = causal_chunked_attention(
            *features, ref=None, state=None, chunk_size=chunk, normalize=True, eps=1e-6, min_denom=None
        )
        return out

    def forward() -> None:
        with torch.no_grad():
            call(*inputs)

    def training() -> None:
        for leaf in leaves:
            leaf.grad = None
        call(*leaves).backward(grad)

    return {"forward": measure(forward, repeats, cpu_time), "training": measure(training, repeats, cpu_time)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}, "
          f"B=1 H={args.heads} N={args.n}, {'CPU' if args.cpu_time else 'wall'} time, median of {args.repeats}")
    print(f"{'D':>4} {'C':>5} {'forward ms':>11} {'fwd+bwd ms':>11}")
    for dim in args.dims:
        shape = (1, args.heads, args.n, dim)
        qf, kf = torch.rand(shape), torch.rand(shape)  # positive features, as a feature map gives
        v, grad = torch.randn(shape), torch.randn(shape)
        leaves = [x.clone().requires_grad_() for x in (qf, kf, v)]
        best: dict[str, tuple[float, int]] = {}
        for chunk in args.chunks:
            times = time_chunk((qf, kf, v), leaves, grad, chunk, args.repeats, args.cpu_time)
            for key, value in times.items():
                if key not in best or value < best[key][0]:
                    best[key] = (value, chunk)
            print(f"{dim:>4} {chunk:>5} {times['forward'] * 1e3:11.1f} {times['training'] * 1e3:11.1f}", flush=True)
        print(f"{dim:>4} best: forward C={best['forward'][1]}, forward+backward C={best['training'][1]}")


if __name__ == "__main__":
    main()
