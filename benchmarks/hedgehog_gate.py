"""What hedgehog's key gate e^{u·k} costs: the library's map against the same map without the gate.

The gate multiplies each key's features by one scalar per token (fused with the positivity floor), so it should
cost little next to the projection and softmax. Both maps share their parameters; the script checks that they
agree when u = 0, then times ``linear_attention`` with each, alternating the two in every round so that a
change of machine load hits both alike, forward only (inference) and forward+backward (training).

    .venv/bin/python benchmarks/hedgehog_gate.py [--n 4096] [--heads 12] [--rounds 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import linattn
from linattn.feature_maps import FeatureMap, HedgehogFeatureMap


class Ungated(FeatureMap):
    """Plain Hedgehog: the wrapped map's features with no key gate."""

    def __init__(self, gated: HedgehogFeatureMap) -> None:
        super().__init__()
        self.gated = gated

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return self.gated.features(x, is_query=True)  # tied projection: the query path has no gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gated = HedgehogFeatureMap(32, num_features=64, num_heads=args.heads, tied=True)
    plain = Ungated(gated)
    q, k, v = torch.randn(3, 1, args.heads, args.n, 32).unbind(0)
    for causal in (False, True):
        same = [linattn.linear_attention(q, k, v, feature_map=m, causal=causal) for m in (gated, plain)]
        torch.testing.assert_close(same[0], same[1], rtol=1e-6, atol=1e-6)  # u = 0: the same attention
    with torch.no_grad():
        gated.gate.normal_(std=0.1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"B=1 H={args.heads} N={args.n} d=32 F=128 fp32; median of {args.rounds} alternating rounds (ms)")
    print(f"{'attention':<24}{'gated':>9}{'no gate':>9}{'ratio':>8}")
    for causal in (False, True):
        for training in (False, True):
            times: dict[str, list[float]] = {"gated": [], "plain": []}
            for _ in range(args.rounds + 1):
                for label, fmap in (("gated", gated), ("plain", plain)):
                    leaves = [t.clone().requires_grad_(training) for t in (q, k, v)]
                    start = time.perf_counter()
                    with torch.set_grad_enabled(training):
                        out = linattn.linear_attention(*leaves, feature_map=fmap, causal=causal)
                        if training:
                            out.sum().backward()
                    times[label].append(time.perf_counter() - start)
            gated_ms, plain_ms = (statistics.median(times[x][1:]) * 1e3 for x in ("gated", "plain"))
            label = f"{'causal' if causal else 'non-causal'} {'fwd+bwd' if training else 'forward'}"
            print(f"{label:<24}{gated_ms:>9.1f}{plain_ms:>9.1f}{gated_ms / plain_ms:>8.2f}")


if __name__ == "__main__":
    main()
