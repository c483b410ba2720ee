"""The sliding-window hybrid's causal cost beside plain causal linear attention (the chunked path), W = 64.

Both run through ``linear_attention(..., causal=True, form="chunked")`` with the same map (elu, F = D) and shapes;
the hybrid adds ``window=W`` (mass-preserving form by default; ``--factor`` for the γ form) and ``sinks=S``. Rounds
alternate plain / hybrid and the ratio is the median of per-round ratios (the machine is shared: ratios, not
absolute times, are the figure). Forward under no_grad, and forward + backward.

    .venv/bin/python benchmarks/window.py                     # B=1, H=8, D=64, N = 1k … 16k, 1 thread
    .venv/bin/python benchmarks/window.py --n 65536 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from linattn import linear_attention
from linattn.measure import peak_memory


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--map", default="elu", help="feature map of both paths (elu: F = D; hedgehog: F = 2D)")
    parser.add_argument("--factor", type=float, default=None, help="γ form with this factor (default: mass form)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-n", type=int, default=4096, help="N of the peak-memory row (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    form = "mass-preserving" if args.factor is None else f"γ={args.factor}"
    print(f"threads={args.threads} B=1 H={args.heads} D={args.dim} map={args.map} W={args.window} S={args.sinks} "
          f"form={form}")
    print(f"{'N':>6} {'plain fwd ms':>13} {'hybrid/plain fwd':>17} {'plain f+b ms':>13} {'hybrid/plain f+b':>17}")
    for n in args.n:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, n, args.dim, generator=gen) for _ in range(3))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        grad = torch.randn_like(q)
        hybrid = {"window": args.window, "sinks": args.sinks, "window_factor": args.factor}

        def forward(options: dict, q=q, k=k, v=v) -> None:
            with torch.no_grad():
                linear_attention(q, k, v, feature_map=args.map, causal=True, form="chunked", **options)

        def training(options: dict, leaves=leaves, grad=grad) -> None:
            for leaf in leaves:
                leaf.grad = None
            linear_attention(*leaves, feature_map=args.map, causal=True, form="chunked", **options).backward(grad)

        rows = {}
        for name, fn in (("fwd", forward), ("f+b", training)):
            fn({}), fn(hybrid)  # warm-up
            plain_times, ratios = [], []
            for _ in range(args.rounds):
                plain = timed(lambda fn=fn: fn({}))
                mixed = timed(lambda fn=fn, hybrid=hybrid: fn(hybrid))
                plain_times.append(plain)
                ratios.append(mixed / plain)
            rows[name] = (statistics.median(plain_times) * 1e3, statistics.median(ratios), min(ratios), max(ratios))
        fwd, both = rows["fwd"], rows["f+b"]
        print(f"{n:>6} {fwd[0]:>13.1f} {fwd[1]:>8.2f} ({fwd[2]:.2f}–{fwd[3]:.2f}) {both[0]:>13.1f} "
              f"{both[1]:>8.2f} ({both[2]:.2f}–{both[3]:.2f})", flush=True)


    if args.memory_n:
        n = args.memory_n
        leaves = [torch.randn(1, args.heads, n, args.dim, requires_grad=True) for _ in range(3)]
        hybrid = {"window": args.window, "sinks": args.sinks, "window_factor": args.factor}
        peaks = []
        for options in ({}, hybrid):
            def step(options: dict = options) -> None:
                linear_attention(*leaves, feature_map=args.map, causal=True, form="chunked", **options).sum().backward()
            peaks.append(peak_memory(step, torch.device("cpu")))
        inputs = 3 * leaves[0].numel() * 4 / 2**20
        print(f"peak memory of forward+backward at N={n}: plain {peaks[0] / 2**20:.1f} MiB, hybrid "
              f"{peaks[1] / 2**20:.1f} MiB ({peaks[1] / peaks[0]:.2f}×); inputs {inputs:.1f} MiB")


if __name__ == "__main__":
    main()
