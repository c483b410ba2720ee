"""What the elu feature map costs inside causal linear attention: the library's one-Function form against the
textbook ``torch.where`` form it replaced.

φ(x) = elu(x) + 1 equals exp(min(x, 0)) + max(x, 0), and its derivative is min(φ(x), 1): the library's map is one
autograd Function that saves φ(x) alone. The script checks that the two forms agree (float64, values and
gradients) and times both, alone and inside ``linear_attention(causal=True)``, with the peak memory of
forward+backward.

    .venv/bin/python benchmarks/elu_cost.py [--n 16384] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import linattn
from linattn.feature_maps import FeatureMap, create
from linattn.measure import peak_memory


class WhereElu(FeatureMap):
    """The textbook form: a branch select, φ = x + 1 (x > 0) or exp(x) (floored like the library's map)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiny = torch.finfo(x.dtype).tiny
        return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)).clamp(min=tiny))


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
    library, where = create("elu", head_dim=64), WhereElu()
    x = (torch.randn(4, 7, 64, dtype=torch.float64) * 6).requires_grad_()
    assert torch.allclose(library(x), where(x), rtol=1e-15, atol=0)
    assert torch.autograd.gradcheck(library, (x[:1, :3, :5].detach().clone().requires_grad_(),))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"B=1 H=8 N={args.n} D=64 fp32, median of 3 (wall)")
    shape = (1, 8, args.n, 64)
    q, k, v, grad = (torch.randn(shape) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    io_bytes = 4 * q.numel() * 4
    for name, fmap in (("torch.where elu", where), ("library elu", library)):
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

        peak = peak_memory(attention_training, torch.device("cpu"))
        print(f"{name:>15}: map forward {median_time(map_forward) * 1e3:7.1f} ms | causal attention forward "
              f"{median_time(attention_forward) * 1e3:7.1f} ms, forward+backward "
              f"{median_time(attention_training) * 1e3:7.1f} ms, peak {peak / io_bytes:.2f}× bytes(q,k,v,out)")


if __name__ == "__main__":
    main()
