"""The window's exact part in prefill: the softmax average over the band and the sinks through torch's CPU flash
kernel (``exact/forms/flash_band.py``) against the tiled autograd Function it replaces where no gradient is needed
(``exact/forms/fused.py``), alternating, at the shipped SmolLM2 student's shapes (9 heads, D = 64, W = 192, 4 sinks,
the queries in the layout a transformers attention layer hands over).

    python benchmarks/window_band.py                    # N = 512, 1536, 4096, 8192; 2 threads; 15 rounds
    python benchmarks/window_band.py --sizes 1536 --rounds 30 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from linattn.exact.forms import flash_band, fused


def _pair(n: int, heads: int, dim: int, window: int, sinks: int) -> tuple[Callable[[], torch.Tensor],
                                                                          Callable[[], torch.Tensor]]:
    """The flash kernel's and the tiled Function's softmax average of one seeded call of n tokens."""
    width, scale = window - 1, dim ** -0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, heads, dim, generator=g).transpose(1, 2).reshape(heads, n, dim)  # (B, H, N, D) view
    k, v = torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g)
    empty = torch.zeros(heads, width, dim)
    sees = (torch.arange(sinks) <= (torch.arange(n) - window).unsqueeze(-1)).expand(heads, n, sinks)

    def kernel() -> torch.Tensor:
        return flash_band.band_average(q, (empty, k), (empty, v), scale, width, width,
                                       (k[:, :sinks], v[:, :sinks], sees))[0]

    def function() -> torch.Tensor:
        num, den = fused.exact_part(q, scale, False, (empty, k), (empty, v), None, fused.tile_size(width), width,
                                    width, (k[:, :0], v[:, :0], None, sees, sinks))[:2]
        assert den is not None
        return num / den.unsqueeze(-1)

    return kernel, function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1536, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, dim, window, sinks = 9, 64, 192, 4
    print(f"torch {torch.__version__}, {args.threads} threads, {heads} heads, D={dim}, W={window}, {sinks} sinks, "
          f"{args.rounds} rounds (alternating); ms, median [min–max]")
    print(f"{'N':>6} {'flash kernel':>22} {'tiled Function':>22} {'ratio':>6}")
    for n in args.sizes:
        kernel, function = _pair(n, heads, dim, window, sinks)
        with torch.no_grad():
            gap = (kernel() - function()).abs().max().item()
            times: dict[str, list[float]] = {"kernel": [], "function": []}
            for name in ("kernel", "function"):  # warm-up
                (kernel if name == "kernel" else function)()
            for r in range(args.rounds):
                order = ("kernel", "function") if r % 2 == 0 else ("function", "kernel")
                for name in order:
                    start = time.perf_counter()
                    (kernel if name == "kernel" else function)()
                    times[name].append(1e3 * (time.perf_counter() - start))
        a, b = statistics.median(times["kernel"]), statistics.median(times["function"])
        print(f"{n:>6} {a:9.2f} [{min(times['kernel']):5.1f}–{max(times['kernel']):5.1f}] "
              f"{b:9.2f} [{min(times['function']):5.1f}–{max(times['function']):5.1f}] {a / b:6.2f}"
              f"   (max |difference| {gap:.1e})")


if __name__ == "__main__":
    main()
