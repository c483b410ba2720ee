"""The causal promise under bad values: a call's output rows before a NaN or inf key or value are what finite
inputs give, bit for bit (:func:`run_causally`, around every causal runner of :mod:`linattn._dispatch`)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from ._dispatch import Job, Result, Runner
from .state import SparseCacheState


def run_causally(run: Runner, job: Job) -> Result:
    """``run(job)``, with the causal promise kept under bad values: a NaN or inf in a key or value at token t
    leaves every output row before t as finite values there would (bit for bit), and rows from t on non-finite.

    The fast forms mask by multiplication (the causal mask of a chunk's Q·Kᵀ, the 0/1 matrix that carries each
    chunk's update to the later ones), and 0 × NaN = NaN, so one bad key or value reaches earlier rows of its chunk
    or block. Both guards rerun or run the call with the bad tokens zeroed, which rests on each form being causal to
    the bit for finite values (a finite change at t moves no row before t): tests/test_causal_bad_values.py checks
    that for every route of the capability table, tests/test_causal_guard_device.py the two guards against each
    other.

    - On the CPU (:func:`_guard_on_host`) the output is summed and the sum read: only when it is not finite is the
      call run again. The read costs nothing there.
    - On any other device (:func:`_guard_on_device`) a read is a synchronisation a call (measured on a GPU in
      docs/benchmarks.md), so nothing is read: every call runs once with the bad tokens zeroed, then the rows from
      each one on are set to NaN. What it costs instead is a few elementwise passes over k, v and the output.

    They differ only past the bad token. The host's rows from t on are what the forms make of it (an infinite key
    that a map sends to a finite feature, as elu(−inf) + 1 = 0, may leave them finite); the device's are NaN. The
    host's final state is its first run's (non-finite where the bad value reached it), the device's NaN throughout
    for the batch elements that read one. With a loss on the rows before t the device's gradients are those of
    finite inputs, the host's NaN (its first run's backward meets the bad value).

    Under ``torch.compile`` and CUDA-graph capture the output is as the forms make it (no guard)."""
    device = job.k.device
    if not job.causal or torch.compiler.is_compiling() or _capturing(device):
        return run(job)
    return (_guard_on_host if device.type == "cpu" else _guard_on_device)(run, job)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _guard_on_host(run: Runner, job: Job) -> Result:
    """The promise checked by reading one sum back: a rerun with the bad elements zeroed only when the output is
    not finite, its rows before the first bad token (of each sequence, when packed) taken."""
    out, final = run(job)
    if bool(torch.isfinite(_total(out))):
        return out, final
    bad = _kept(_unusable(job), job)
    if not bool(bad.any()):  # the inputs are finite: something else (a state, a map's overflow) made it
        return out, final
    zeroed = replace(job, k=_finite_or_zero(job.k), v=_finite_or_zero(job.v))
    clean, _ = run(zeroed)
    return torch.where(_rows_from(bad, job.segments).unsqueeze(-1), out, clean), final


def _guard_on_device(run: Runner, job: Job) -> Result:
    """The promise with nothing read back: one run with the key and value of every token that has a NaN or inf in
    either zeroed (masked tokens too: they reach no row either way), then NaN in the rows from a kept bad token on
    (to the end of its sequence when packed) and in every floating tensor of a final state that read one, per batch
    element (:func:`_poisoned`).

    Whole tokens are zeroed, not single elements: the ``where`` then keeps a flag per token for its backward, not a
    mask of k's size. For finite inputs the output and gradients are bit for bit the unguarded call's (a ``where``
    that keeps an element passes it and its gradient unchanged); the NaN rows pass no gradient back."""
    unusable = _unusable(job)
    bad = _kept(unusable, job)
    flags = unusable.unsqueeze(-1)
    out, final = run(replace(job, k=torch.where(flags, 0.0, job.k), v=torch.where(flags, 0.0, job.v)))
    out = torch.where(_rows_from(bad, job.segments).unsqueeze(-1), float("nan"), out)
    return out, _poisoned(final, bad.any(-1))


def _total(out: torch.Tensor) -> torch.Tensor:
    """Σ out, non-finite when an element is (or, harmlessly, when a huge sum overflows): summed in its own dtype,
    1.2 ms against 420 ms for the causal chunked form at 8×16384×64 fp32 on one thread (fp64: 67 ms), fp32 for
    half-precision outputs."""
    return out.sum(dtype=torch.float32) if out.dtype in (torch.float16, torch.bfloat16) else out.sum()


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _unusable(job: Job) -> torch.Tensor:
    """(..., N) bool: the tokens with a NaN or inf in their key or value."""
    return ~(_finite_rows(job.k) & _finite_rows(job.v))


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., N) bool: whether every element of each row is finite, from the row's extremes (a NaN propagates to
    both): one pass over x, where ``isfinite(x).all(-1)`` writes and reads a bool tensor of x's size too."""
    low, high = torch.aminmax(x, dim=-1)
    return torch.isfinite(low) & torch.isfinite(high)


def _kept(flags: torch.Tensor, job: Job) -> torch.Tensor:
    return flags & job.keep if job.keep is not None else flags


def _rows_from(bad: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """(..., N) bool: the rows at or after a bad token (in the same sequence when packed: ``segments`` changes
    where a sequence starts). No host branch: the device guard calls it."""
    index = torch.arange(bad.shape[-1], device=bad.device)
    last_bad = torch.where(bad, index, -1).cummax(-1).values  # (..., N): the latest bad token so far
    if segments is None:
        return last_bad >= 0
    starts = torch.ones_like(index, dtype=torch.bool)
    starts[1:] = segments[1:] != segments[:-1]
    return last_bad >= torch.where(starts, index, 0).cummax(-1).values


def _poisoned(state: Any, flags: torch.Tensor) -> Any:
    """``state`` with NaN in every floating tensor (of a state dataclass, nested ones too) of the batch elements
    ``flags`` (..., ) marks. A sparse cache's state is left as it is: its packed keys and values hold every batch
    element's in one list (the window's buffers and linear sums beside it are poisoned)."""
    if isinstance(state, SparseCacheState):
        return state
    if isinstance(state, torch.Tensor):
        if not state.is_floating_point() or state.shape[: flags.dim()] != flags.shape:
            return state
        return torch.where(flags.reshape(flags.shape + (1,) * (state.dim() - flags.dim())), float("nan"), state)
    if is_dataclass(state) and not isinstance(state, type):
        return replace(state, **{f.name: _poisoned(getattr(state, f.name), flags) for f in fields(state) if f.init})
    return state
