"""What the causal guard costs on a GPU: ``linear_attention(q, k, v, causal=True)`` through each guard of
:mod:`linattn._causal` and with the runner called directly, alternating, B=4, H=32, D=128, bf16, CUDA events:

- ``sync``: the host's guard (:func:`linattn._causal._guard_on_host`): one sum over the output, read back to the
  host (a synchronisation a call), a rerun only when it is not finite;
- ``device``: the GPU's guard (:func:`linattn._causal._guard_on_device`): nothing read back; the bad tokens zeroed
  and the rows from them on set to NaN, on the device, every call;
- ``none``: the runner called directly (no promise under bad values).

First some checks, printed: the device guard's rows before a NaN key bit for bit the sync guard's (and the finite
call's), the rows from it NaN; NaN and ±inf found per row on the GPU; and the synchronisations one call makes under
each variant (``torch.cuda.set_sync_debug_mode``). Then medians (and the range over the rounds) and the ratios
against no guard, forward and forward+backward.

    PYTHONPATH=src python3 benchmarks/gpu_guard.py [--lengths 2048 8192 16384] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import linattn
import linattn.functional as functional
from linattn import _causal

Guard = Callable[[Callable[[Any], Any], Any], Any]
VARIANTS: dict[str, Guard] = {
    "sync": lambda run, job: _causal._guard_on_host(run, job) if job.causal else run(job),
    "device": lambda run, job: _causal._guard_on_device(run, job) if job.causal else run(job),
    "none": lambda run, job: run(job),
}


@contextmanager
def _variant(name: str) -> Iterator[None]:
    """``linear_attention`` with its causal calls through the named variant."""
    guarded = functional.run_causally
    functional.run_causally = VARIANTS[name]  # type: ignore[assignment]
    try:
        yield
    finally:
        functional.run_causally = guarded


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


def _check(n: int = 4096, t: int = 1000) -> None:
    """The promise on the GPU (a NaN key at token t, inside a chunk) and each variant's synchronisations."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    k_bad = k.clone()
    k_bad[..., t, 3] = float("nan")
    outs = {}
    for name in ("sync", "device"):
        with _variant(name):
            outs[name] = linattn.linear_attention(q, k_bad, v, causal=True)
    with _variant("sync"):
        clean = linattn.linear_attention(q, k, v, causal=True)
    before = torch.equal(outs["device"][..., :t, :], outs["sync"][..., :t, :])
    finite = torch.equal(outs["device"][..., :t, :], clean[..., :t, :])
    after = bool(torch.isnan(outs["device"][..., t:, :]).all())
    print(f"check: rows before a NaN key at {t} of {n}: device = sync {before}, device = finite call {finite}; "
          f"rows from it NaN: {after}")
    planted = k.clone()
    planted[0, 0, 7, 5], planted[0, 1, 9, 0], planted[0, 2, 11, 127] = float("nan"), float("inf"), float("-inf")
    rows = _causal._finite_rows(planted)
    print(f"check: finite rows from aminmax = isfinite().all(): {torch.equal(rows, torch.isfinite(planted).all(-1))}"
          f" ({int((~rows).sum())} bad rows of 3)")
    counts = {}
    for name in VARIANTS:
        with _variant(name), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                linattn.linear_attention(q, k, v, causal=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in caught)
    listed = ", ".join(f"{name} {count}" for name, count in counts.items())
    print(f"check: synchronisations in one forward call: {listed}")


def _measure(n: int, steps: int, rounds: int) -> None:
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def forward() -> None:
        with torch.no_grad():
            linattn.linear_attention(q, k, v, causal=True)

    def training() -> None:
        linattn.linear_attention(q, k, v, causal=True).backward(grad)

    for mode, call in (("fwd", forward), ("fwd+bwd", training)):
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:
                with _variant(name):
                    times[name].append(_time(call, steps))
        med = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
        spread = ", ".join(f"{name} {med[name]:.3f} ms ({min(v):.3f}–{max(v):.3f})" for name, v in times.items())
        print(f"N={n:6d} {mode:8s} {spread}; against none: sync {med['sync'] / med['none']:.2f}×, "
              f"device {med['device'] / med['none']:.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_guard.py times CUDA calls; no CUDA device here")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, B=4, H=32, D=128, bf16, "
          f"median of {args.rounds} alternating rounds of {args.steps} calls")
    _check()
    for n in args.lengths:
        _measure(n, args.steps, args.rounds)


if __name__ == "__main__":
    main()
