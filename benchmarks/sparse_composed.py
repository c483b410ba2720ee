"""What the sparse exact cache costs beside each linear part (docs/sparse_cache.md, "Beside a decayed, gated or
delta-rule state"): the causal chunked window op (W = 64, 4 sinks) with its linear part of each kind, without a
cache and with λ pairs per head (the recall and the attention score), forward+backward at N tokens. Every variant
runs once per round, in turn, so a change of machine load hits all alike; the figure is the median over rounds of
the process's CPU time (``--clock cpu``) or the wall clock.

    .venv/bin/python benchmarks/sparse_composed.py [--n 4096] [--heads 8] [--dim 64] [--size 128] [--rounds 3]
        [--threads 1] [--kinds additive gated feature-gated delta gated-delta] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import linattn
from linattn import SparseCache

KINDS = ("additive", "gated", "feature-gated", "delta", "gated-delta")


def linear_options(kind: str, n: int, heads: int, dim: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    gate = F.logsigmoid(torch.randn(1, heads, n, generator=g) + 3)
    beta = torch.rand(1, heads, n, generator=g)
    return {
        "additive": {},
        "gated": {"log_gate": gate},
        "feature-gated": {"log_gate": F.logsigmoid(torch.randn(1, heads, n, dim, generator=g) + 3)},
        "delta": {"update": "delta", "beta": beta},
        "gated-delta": {"update": "delta", "beta": beta, "log_gate": gate},
    }[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.n, args.dim, generator=g) for _ in range(3))
    caches = {"none": None, "recall": SparseCache(args.size), "attention": SparseCache(args.size, score="attention")}

    def run(kind: str, cache: SparseCache | None) -> Callable[[], float]:
        options = linear_options(kind, args.n, args.heads, args.dim) | ({"sparse_cache": cache} if cache else {})

        def once() -> float:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            start = clock()
            out = linattn.linear_attention(*leaves, causal=True, window=64, sinks=4, **options)
            out.sum().backward()
            return clock() - start

        return once

    variants = {(kind, name): run(kind, cache) for kind in args.kinds for name, cache in caches.items()}
    for once in variants.values():  # warm-up
        once()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, once in variants.items():
            times[key].append(once())
    print(f"N = {args.n}, H = {args.heads}, D = {args.dim}, λ = {args.size}, {args.threads} thread(s), "
          f"{args.clock} clock, median of {args.rounds} rounds, forward+backward")
    print(f"{'linear part':<14} {'no cache s':>10} {'recall s':>9} {'attention s':>11} {'recall ×':>9} "
          f"{'attention ×':>11}")
    for kind in args.kinds:
        none, recall, attention = (statistics.median(times[(kind, name)]) for name in caches)
        print(f"{kind:<14} {none:>10.3f} {recall:>9.3f} {attention:>11.3f} {recall / none:>9.2f} "
              f"{attention / none:>11.2f}")


if __name__ == "__main__":
    main()
