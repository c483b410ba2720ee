"""The causal promise under bad values: a call's output rows before a NaN or inf key or value are what finite
inputs give, bit for bit (:func:`run_causally`, around every causal runner of :mod:`linattn._dispatch`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ._dispatch import Job, Result, Runner


def run_causally(run: Runner, job: Job) -> Result:
    """``run(job)``, with the causal promise kept under bad values: a NaN or inf in a key or value at token t
    leaves every output row before t as finite values there would (bit for bit), and rows from t on non-finite.

    The fast forms mask by multiplication (the causal mask of a chunk's Q·Kᵀ, the 0/1 matrix that carries each
    chunk's update to the later ones), and 0 × NaN = NaN, so one bad key or value reaches earlier rows of its chunk
    or block. The check is one sum over the output (a NaN or inf in it makes the sum non-finite); only then are the
    bad tokens found and the call run again with them zeroed, its rows before the first bad token (of each
    sequence, when packed) taken. That needs each form to be causal to the bit for finite values, which
    tests/test_causal_bad_values.py checks for every route of the capability table. On a GPU the check reads one
    value back (a synchronisation a call)."""
    out, final = run(job)
    # a compiled graph or a captured CUDA graph cannot branch on values: there the output is as the forms make it
    if not job.causal or torch.compiler.is_compiling() or _capturing(out) or bool(torch.isfinite(_total(out))):
        return out, final
    poisoned = _poisoned_rows(job)
    if poisoned is None:  # the inputs are finite: something else (a state, a map's overflow) made it
        return out, final
    zeroed = replace(job, k=_finite_or_zero(job.k), v=_finite_or_zero(job.v))
    clean, _ = run(zeroed)
    return torch.where(poisoned.unsqueeze(-1), out, clean), final


def _capturing(out: torch.Tensor) -> bool:
    return out.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _total(out: torch.Tensor) -> torch.Tensor:
    """Σ out, non-finite when an element is (or, harmlessly, when a huge sum overflows): summed in its own dtype,
    1.2 ms against 420 ms for the causal chunked form at 8×16384×64 fp32 on one thread (fp64: 67 ms), fp32 for
    half-precision outputs."""
    return out.sum(dtype=torch.float32) if out.dtype in (torch.float16, torch.bfloat16) else out.sum()


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _poisoned_rows(job: Job) -> torch.Tensor | None:
    """(..., N) bool: rows at or after a kept key or value with a NaN or inf (in the same sequence when packed);
    None when there is none."""
    bad = ~(torch.isfinite(job.k).all(-1) & torch.isfinite(job.v).all(-1))  # (..., N)
    if job.keep is not None:
        bad &= job.keep
    if not bool(bad.any()):
        return None
    index = torch.arange(bad.shape[-1], device=bad.device)
    last_bad = torch.where(bad, index, -1).cummax(-1).values  # (..., N): the latest bad token so far
    if job.segments is None:
        return last_bad >= 0
    starts = torch.ones_like(index, dtype=torch.bool)  # packed: a sequence starts where the jump changes
    starts[1:] = job.segments[1:] != job.segments[:-1]
    return last_bad >= torch.where(starts, index, 0).cummax(-1).values
