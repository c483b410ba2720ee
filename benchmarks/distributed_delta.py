"""What the delta rule's context-parallel summary costs, on one process: a slice's [A | B] against the slice's run.

Per rank, a context-parallel delta call runs (1) the slice's summary, the affine map S ↦ A·S + B of its tokens, and
(2) the slice itself from the folded prefix state. This times, forward + backward, on one slice of N tokens
(fp32, B·H = 8, Dk = Dv = 64, elu features so F = 64, chunk 64, one thread, rounds interleaved, median):

- ``slice``: ``linear_attention(..., update="delta", initial_state=...)`` on the slice (step 2);
- ``transition``: what linattn.distributed computes for step 1 (chunk solutions, then the chunks' maps composed
  pairwise: N·F·(C + F + Dv) + (N/C)·F²·(F + Dv) multiply-adds);
- ``identity values``: the alternative, the chunked form run from the state [I | 0] with values [0 | V], whose
  final state is [A | B] — the same solution, but Dv + F value columns through the whole form, outputs included.

    python benchmarks/distributed_delta.py                       # N = 1024, 4096, 16384
    python benchmarks/distributed_delta.py --lengths 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import linattn
from linattn.features import resolve_feature_map
from linattn.kinds.delta.distributed import slice_transition
from linattn.state import DeltaRuleState

HEADS, DIM = 8, 64


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    started = time.perf_counter()
    fn().sum().backward()
    return time.perf_counter() - started


def _measure(n: int, rounds: int, elu: torch.nn.Module) -> dict[str, float]:
    """Median ms of the three runs on one slice of n tokens."""
    q, k, v = (torch.randn(1, HEADS, n, DIM, requires_grad=True) for _ in range(3))
    beta = torch.rand(1, HEADS, n).requires_grad_()
    start = DeltaRuleState(torch.randn(1, HEADS, DIM, DIM) * 0.1)
    eye = DeltaRuleState(torch.cat([torch.eye(DIM).expand(1, HEADS, DIM, DIM), torch.zeros(1, HEADS, DIM, DIM)],
                                   dim=-1))  # [I | 0]

    def run_slice() -> torch.Tensor:
        return linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, initial_state=start)

    def run_transition() -> torch.Tensor:
        return slice_transition(q, k, v, elu, None, beta, None, None)

    def run_identity() -> torch.Tensor:
        values = torch.cat([torch.zeros(1, HEADS, n, DIM), v], dim=-1)  # (1, H, N, F + Dv): [0 | V]
        _, final = linattn.linear_attention(q, k, values, causal=True, update="delta", beta=beta,
                                            initial_state=eye, return_state=True)
        return final.kv

    runs = {"slice": run_slice, "transition": run_transition, "identity": run_identity}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 1):
        for name, fn in runs.items():
            elapsed = _timed(fn)
            if round_:  # round 0 is the warm-up
                times[name].append(elapsed)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    elu = resolve_feature_map("elu", DIM)
    print(f"fp32, B·H = {HEADS}, Dk = Dv = F = {DIM}, chunk 64, 1 thread; forward + backward, median of "
          f"{args.rounds} (after one warm-up)")
    print("| N | slice ms | transition ms | identity values ms | transition / slice | identity / transition |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        ms = _measure(n, args.rounds, elu)
        print(f"| {n} | {ms['slice']:.1f} | {ms['transition']:.1f} | {ms['identity']:.1f} | "
              f"{ms['transition'] / ms['slice']:.2f} | {ms['identity'] / ms['transition']:.2f} |")


if __name__ == "__main__":
    main()
