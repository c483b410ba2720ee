"""What the elu feature map costs inside causal linear attention, and what a single-Function form of it would save.

φ(x) = elu(x) + 1 equals exp(min(x, 0)) + max(x, 0), and its derivative is min(φ(x), 1): a custom autograd
Function can save φ(x) alone (which the attention kernel saves anyway) instead of the library map's several
intermediates. This script checks that the two agree (float64, values and gradients) and times both, alone and
inside ``linear_attention(causal=True)``, with the peak memory of forward+backward. A proposal measured, not used
by the library.

    .venv/bin/python benchmarks/elu_cost.py [--n 16384] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import linattn
from linattn import bench
from linattn.feature_maps import FeatureMap, create


class _EluPlusOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        y = x.clamp(max=0).exp_().clamp_(min=torch.finfo(x.dtype).tiny)  # the library map's floor, too
        y += x.clamp(min=0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (y,) = ctx.saved_tensors
        return grad * y.clamp(max=1)


class OnePassElu(FeatureMap):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _EluPlusOne.apply(x)


def median_time(fn, repeats: int = 3) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    library, one_pass = create("elu", head_dim=64), OnePassElu()
    x = (torch.randn(4, 7, 64, dtype=torch.float64) * 6).requires_grad_()
    assert torch.allclose(library(x), one_pass(x), rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(one_pass, (x[:1, :3, :5].detach().clone().requires_grad_(),))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"B=1 H=8 N={args.n} D=64 fp32, median of 3 (wall)")
    shape = (1, 8, args.n, 64)
    q, k, v, grad = (torch.randn(shape) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    io_bytes = 4 * q.numel() * 4
    for name, fmap in (("library elu", library), ("one-pass elu", one_pass)):
        def map_forward(fmap=fmap) -> None:
            with torch.no_grad():
                fmap(q)

        def attention_forward(fmap=fmap) -> None:
            with torch.no_grad():
                linattn.linear_attention(q, k, v, feature_map=fmap, causal=True)

        def attention_training(fmap=fmap) -> None:
            for leaf in leaves:
                leaf.grad = None
            linattn.linear_attention(*leaves, feature_map=fmap, causal=True).backward(grad)

        peak = bench.peak_memory(attention_training, torch.device("cpu"))
        print(f"{name:>13}: map forward {median_time(map_forward) * 1e3:7.1f} ms | causal attention forward "
              f"{median_time(attention_forward) * 1e3:7.1f} ms, forward+backward "
              f"{median_time(attention_training) * 1e3:7.1f} ms, peak {peak / io_bytes:.2f}× bytes(q,k,v,out)")


if __name__ == "__main__":
    main()
