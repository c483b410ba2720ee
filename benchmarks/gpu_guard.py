"""What the causal guard costs on a GPU: ``linear_attention(q, k, v, causal=True)`` with the guard
(:func:`linattn._causal.run_causally`: one sum over the output, read back to the host) and with the runner called
directly, alternating, B=4, H=32, D=128, bf16, CUDA events.

    PYTHONPATH=src python3 benchmarks/gpu_guard.py [--lengths 2048 8192 16384] [--steps 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import linattn
import linattn.functional as functional


def _unguarded(run: Callable[[Any], Any], job: Any) -> Any:
    return run(job)


def _time(call: Callable[[], None], steps: int) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _measure(n: int, steps: int, rounds: int) -> None:
    guarded = functional.run_causally
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def forward() -> None:
        with torch.no_grad():
            linattn.linear_attention(q, k, v, causal=True)

    def training() -> None:
        linattn.linear_attention(q, k, v, causal=True).backward(grad)

    for name, call in (("fwd", forward), ("fwd+bwd", training)):
        times: dict[str, list[float]] = {"guard": [], "no guard": []}
        for _ in range(rounds):
            for mode in times:
                functional.run_causally = guarded if mode == "guard" else _unguarded  # type: ignore[assignment]
                times[mode].append(_time(call, steps))
        functional.run_causally = guarded
        med = {mode: sorted(values)[len(values) // 2] for mode, values in times.items()}
        print(f"N={n:6d} {name:8s} guard {med['guard']:.3f} ms, no guard {med['no guard']:.3f} ms, "
              f"ratio {med['guard'] / med['no guard']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_guard.py times CUDA calls; no CUDA device here")
    for n in args.lengths:
        _measure(n, args.steps, args.rounds)


if __name__ == "__main__":
    main()
