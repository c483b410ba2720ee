"""Where a causal fit's time goes (linattn.train): ``_prepare``, one training step, one evaluation.

Random q, k of SmolLM2's shapes (30 layers × 9 heads = 270 heads fitted together, 3 key/value heads per 9, d = 64)
and sequences of 512 tokens: the cost depends on the shapes only. Each part is timed 3 times, median reported.

    python benchmarks/fit_cost.py                   # 1 thread; --threads 2, --tokens 256, --sequences 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from linattn.feature_maps import create
from linattn.train.distill import _batch, _loss, _prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=270)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=3)
    parser.add_argument("--rows", type=int, default=128, help="query rows per sequence and step (the default fit's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, n, d = args.heads, args.tokens, 64
    qs = [torch.randn(heads, n, d) for _ in range(args.sequences)]
    ks = [torch.randn(heads // 3, n, d) for _ in range(args.sequences)]  # grouped-query: 3 query heads per key
    start = time.perf_counter()
    items = _prepare(qs, ks, None, d**-0.5, True)
    print(f"{heads} heads, {args.sequences} causal sequences of {n} tokens, {args.threads} thread(s)")
    print(f"_prepare: {time.perf_counter() - start:.1f} s")
    fmap = create("hedgehog", head_dim=d, num_heads=heads, num_features=2 * d, tied=True, seed=0, init_scale=2.0)
    optimiser = torch.optim.Adam(fmap.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(0)

    def step(noise: float) -> None:
        total = torch.zeros(())
        for item in items:
            rows = torch.randperm(n, generator=generator)[: args.rows].sort().values
            total = total + _loss(fmap, _batch(item, rows, None, noise, generator), 0.0).mean(-1).sum()
        optimiser.zero_grad()
        total.backward()
        optimiser.step()

    def evaluate() -> None:
        with torch.no_grad():
            for item in items:
                rows = torch.randperm(n, generator=generator)[:256].sort().values
                _loss(fmap, _batch(item, rows, None, 0.0, generator), 0.0)

    parts = ((f"training step ({args.rows} rows × all keys per sequence, noise 0.2)", lambda: step(0.2)),
             ("training step without noise", lambda: step(0.0)),
             ("evaluation (256 held-out rows per sequence, all keys)", evaluate))
    for name, fn in parts:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
