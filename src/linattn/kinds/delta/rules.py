"""The delta family's capability rules (the delta rule, the gated delta rule, KDA: kind "delta"): its routes, its
decoding step's reasons and its Triton kernels' reasons (the kernels: :mod:`linattn.kinds.delta.triton`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...backends import triton as triton_backend
from ...state import DeltaRuleState
from .._table import STEP_OPTIONS, Call, Route, fixed_option_reasons

# the delta step: a fixed β and decay rate come as options, per-token ones with each call
DELTA_STEP_OPTIONS = STEP_OPTIONS | frozenset({"update", "normalize", "beta", "decay"})


def delta_reasons(form_reason: str | None) -> Callable[[Call], list[str]]:
    def reasons(call: Call) -> list[str]:
        found = [] if call.causal else ["update='delta' is a causal recurrence; pass causal=True"]
        if call.normalize:
            found.append("update='delta' keeps no Σφ(k) to normalise by; pass normalize=False")
        return found + ([form_reason] if form_reason else [])

    return reasons



# chunk 64 measured best of 32/64/128 at N = 16384 (docs/delta.md); "parallel" is the same UT transform over the
# whole sequence as one chunk (quadratic in N)
ROUTES: tuple[Route, ...] = (
    Route("delta", "parallel", None, delta_reasons(None)),
    Route("delta", "global", None,
          delta_reasons("form='global' is non-causal; the delta rule runs 'chunked' or 'recurrent'")),
    Route("delta", "chunked", 64, delta_reasons(None)),
    Route("delta", "recurrent", None, delta_reasons(None)),
)


def delta_step_reasons(_: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why :class:`~linattn.decode.DeltaDecodeStep` does not continue ``state``; [] when it does."""
    if type(state) is not DeltaRuleState:
        return [f"state {type(state).__name__}: the delta step continues a DeltaRuleState"]
    found = [] if state.kv.dim() == 4 else ["state: the delta step needs batch shape (B, H)"]
    if state.kv.dtype not in (torch.float32, torch.float64):
        found.append(f"state in {state.kv.dtype}: the steps keep fp32 or fp64 sums")
    unknown = sorted(set(options) - DELTA_STEP_OPTIONS)
    if unknown:
        found.append(f"options {', '.join(unknown)}: not reproduced by the step")
    if options.get("update") != "delta" or options.get("normalize"):
        found.append("the delta step computes update='delta' (normalize=False)")
    return found + fixed_option_reasons(options)



STEPS: dict[str, Callable[[nn.Module, Any, dict[str, Any]], list[str]]] = {"delta": delta_step_reasons}


def triton_reasons(call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Why the delta family's kernels do not cover the call; [] when they do. Per-token decays are in the delta
    kernels, per-feature gates (KDA) in their own (:mod:`linattn.kinds.kda.triton`)."""
    options = dict(call.options)
    gate = options.get("log_gate")
    per_feature = isinstance(gate, torch.Tensor) and gate.dim() == q.dim()
    found = triton_backend.delta_reasons(q, form=route.form, chunk_size=call.chunk_size, dtype=dtype,
                                         per_feature_gate=per_feature)
    given = {name: value for name, value in options.items() if name not in ("decay", "log_gate")}
    return found + triton_backend.option_reasons(given)
