"""The window's exact part in prefill: the softmax average over the band and the sinks in C++ (causal.cpp's
``band_average``, through ``backends/native/forms.py``; the native backend's path), through torch's CPU flash kernel
(``exact/forms/flash_band.py``; the torch backend's path) and through the tiled autograd Function both replace where
no gradient is needed (``exact/forms/fused.py``), alternating, at the shipped SmolLM2 folder's shapes (9 heads,
D = 64, W = 64, 4 sinks, the queries in the layout a transformers attention layer hands over).

    python benchmarks/window_band.py                    # N = 512, 1536, 4096, 8192; 2 threads; 15 rounds
    python benchmarks/window_band.py --sizes 1536 --rounds 30 --threads 1 --window 192
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from linattn.backends.native import forms as native_forms
from linattn.backends.native import module
from linattn.exact.forms import flash_band, fused


def _ways(n: int, heads: int, dim: int, window: int, sinks: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The C++ kernel's, the flash kernel's and the tiled Function's softmax average of one seeded call of n
    tokens (the C++ one where this machine built the native kernels)."""
    width, scale = window - 1, dim ** -0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, heads, dim, generator=g).transpose(1, 2).reshape(heads, n, dim)  # (B, H, N, D) view
    k, v = torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g)
    empty = torch.zeros(heads, width, dim)
    sees = (torch.arange(sinks) <= (torch.arange(n) - window).unsqueeze(-1)).expand(heads, n, sinks)

    def native() -> torch.Tensor:
        found = native_forms.band_average(q, (empty, k), (empty, v), scale, width, width,
                                          (k[:, :sinks], v[:, :sinks], sees))
        assert found is not None
        return found[0]

    def kernel() -> torch.Tensor:
        return flash_band.band_average(q, (empty, k), (empty, v), scale, width, width,
                                       (k[:, :sinks], v[:, :sinks], sees))[0]

    def function() -> torch.Tensor:
        num, den = fused.exact_part(q, scale, False, (empty, k), (empty, v), None, fused.tile_size(width), width,
                                    width, (k[:, :0], v[:, :0], None, sees, sinks))[:2]
        assert den is not None
        return num / den.unsqueeze(-1)

    ways = {"C++ kernel": native} if module("causal") is not None else {}
    return {**ways, "flash kernel": kernel, "tiled Function": function}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1536, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, dim, window, sinks = 9, 64, args.window, 4
    print(f"torch {torch.__version__}, {args.threads} threads, {heads} heads, D={dim}, W={window}, {sinks} sinks, "
          f"{args.rounds} rounds (alternating, the order rotating); ms, median [min–max]; ratio: each against the "
          "tiled Function")
    for n in args.sizes:
        ways = _ways(n, heads, dim, window, sinks)
        names = list(ways)
        with torch.no_grad():
            results = {name: way() for name, way in ways.items()}  # and a warm-up
            gap = max((results[name] - results[names[-1]]).abs().max().item() for name in names)
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    start = time.perf_counter()
                    ways[name]()
                    times[name].append(1e3 * (time.perf_counter() - start))
        base = statistics.median(times[names[-1]])
        cells = [f"{name} {statistics.median(t):8.2f} [{min(t):5.1f}–{max(t):5.1f}] "
                 f"{statistics.median(t) / base:5.2f}" for name, t in times.items()]
        print(f"N={n:>5}  " + "  ".join(cells) + f"  (max |difference| {gap:.1e})")


if __name__ == "__main__":
    main()
