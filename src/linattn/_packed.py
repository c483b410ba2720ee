"""Packed variable-length input (``cu_seqlens``): sequences laid end to end in one row, each attending to itself.

Two paths, both exact:
- **One call** (causal, ordinary feature maps, no initial or returned state: packed training): a boundary is a
  decay to zero. Adding J·s to the log-scale of every token of sequence s (J = 128 for fp32, 1024 for fp64) makes
  every factor e^{ref_j − ref_t} across a boundary e^{≤ −J}, which is exactly 0 in the compute dtype (fp32 and
  fp64 exponentials underflow to 0 below −104 and −745), while differences within a sequence are unchanged. The
  forms already form scale differences in fp64 (see :mod:`.forms._common`), so J adds no rounding there.
- **One core call per sequence** otherwise (non-causal forms, per-sequence initial or final states, log-space
  maps, whose running maximum would have to restart at each boundary): each sequence is the very computation it
  would be alone. Cost: one core call per sequence (measured in docs/decay.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _validate
from .errors import LinearAttentionError
from .features import is_log_space, resolve_feature_map
from .state import DeltaRuleState, LinearAttentionState


def vectorised(q: object, causal: bool, initial_state: object, return_state: bool, feature_map: object) -> bool:
    """Whether the one-call path applies (see the module docstring)."""
    if not causal or initial_state is not None or return_state or not isinstance(q, torch.Tensor) or q.dim() < 2:
        return False
    if not q.is_floating_point():
        return False
    fmap = resolve_feature_map(feature_map, q.shape[-1], device=q.device)  # type: ignore[arg-type]
    return not is_log_space(fmap)


def segment_jumps(cu_seqlens: object, q: torch.Tensor) -> torch.Tensor:
    """J·s for every token of sequence s: (N,) fp64, added to the tokens' log-scales."""
    offsets = _validate.cu_seqlens(cu_seqlens, q.shape[-2])
    jump = 1024.0 if q.dtype == torch.float64 else 128.0
    starts = torch.zeros(q.shape[-2], dtype=torch.float64, device=q.device)
    starts[torch.tensor(offsets[1:-1], dtype=torch.long, device=q.device)] = jump
    return torch.cumsum(starts, dim=0)


def _state_of(state: LinearAttentionState | DeltaRuleState, index: int) -> LinearAttentionState | DeltaRuleState:
    if isinstance(state, DeltaRuleState):
        return DeltaRuleState(state.kv[index], 0)
    return LinearAttentionState(state.kv[index], state.k_sum[index], state.shift[index], 0)


def _per_token(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0


def _slice(x: Any, start: int, end: int, name: str, num_tokens: int) -> Any:
    """x[..., start:end] along the token dimension (the last one) of a per-token tensor, or x if None."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != num_tokens:
        seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise LinearAttentionError(
            f"{name}: with cu_seqlens, expected a tensor (..., N) over all {num_tokens} packed tokens, got {seen}"
        )
    return x[..., start:end]


def _per_feature(log_gate: Any, q: torch.Tensor) -> bool:
    """A per-feature gate (..., N, F), sliced along its token dimension −2."""
    return isinstance(log_gate, torch.Tensor) and log_gate.dim() == q.dim() and log_gate.shape[-2] == q.shape[-2]


def packed_attention(
    attend: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Any,
    *,
    initial_state: LinearAttentionState | DeltaRuleState | None,
    return_state: bool,
    key_padding_mask: Any,
    log_gate: Any,
    beta: Any = None,
    **options: Any,
) -> Any:
    """``attend`` (linear_attention) once per packed sequence; outputs concatenated along N, states stacked on a new
    leading dimension S (``num_tokens`` of the stacked state: all packed tokens plus the initial states' count)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise LinearAttentionError(f"{name}: expected a tensor of shape (..., N, D) for packed input")
    num_tokens = q.shape[-2]
    if k.shape[-2] != num_tokens:
        raise LinearAttentionError(
            f"cu_seqlens: q has {num_tokens} packed tokens and k has {k.shape[-2]}; pack queries and keys alike"
        )
    offsets = _validate.cu_seqlens(cu_seqlens, num_tokens)
    count = len(offsets) - 1
    if initial_state is not None:
        if not isinstance(initial_state, (LinearAttentionState, DeltaRuleState)) or initial_state.kv.dim() < 3:
            raise LinearAttentionError(
                "initial_state: with cu_seqlens, expected a LinearAttentionState (DeltaRuleState for "
                "update='delta') with one state per sequence on a "
                f"leading dimension (S = {count}, *batch, F, Dv)"
            )
        if initial_state.kv.shape[0] != count:
            raise LinearAttentionError(
                f"initial_state: {initial_state.kv.shape[0]} states on the leading dimension for {count} packed "
                "sequences; pass one state per sequence"
            )
    outs, finals = [], []
    for index in range(count):
        start, end = offsets[index], offsets[index + 1]
        state = _state_of(initial_state, index) if initial_state is not None else None
        result = attend(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :],
            key_padding_mask=_slice(key_padding_mask, start, end, "key_padding_mask", num_tokens),
            log_gate=log_gate[..., start:end, :] if _per_feature(log_gate, q) else _slice(
                log_gate, start, end, "log_gate", num_tokens),
            beta=_slice(beta, start, end, "beta", num_tokens) if _per_token(beta) else beta,
            initial_state=state, return_state=return_state, **options,
        )
        if return_state:
            outs.append(result[0])
            finals.append(result[1])
        else:
            outs.append(result)
    out = torch.cat(outs, dim=-2)
    if not return_state:
        return out
    seen = num_tokens + (initial_state.num_tokens if initial_state is not None else 0)
    if isinstance(finals[0], DeltaRuleState):
        return out, DeltaRuleState(torch.stack([s.kv for s in finals]), seen)
    final = LinearAttentionState(
        torch.stack([s.kv for s in finals]),
        torch.stack([s.k_sum for s in finals]),
        torch.stack([s.shift for s in finals]),
        seen,
    )
    return out, final
