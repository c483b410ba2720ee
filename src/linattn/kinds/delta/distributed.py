"""The delta rule across ranks: each slice is summarised by the affine map it applies to the state entering it.

    S_t = a_t·S_{t−1} + β_t·k_t(v_t − a_t·S_{t−1}ᵀk_t)ᵀ   is affine in S:   S_out = A·S_in + B  over a slice,

A (F×F) = Π_t a_t(I − β_t k_t k_tᵀ) (later tokens on the left; per-feature gates, KDA: Π_t (I − β_t k_t k_tᵀ)·diag(a_t))
and B (F×Dv) the slice's final state from S_in = 0 (:func:`linattn.kinds.delta.forms.delta_transition`,
:func:`linattn.kinds.kda.forms.kda_transition`). Rank r gathers every slice's [A_j | B_j] and folds those before it in
order, S_in = A_{r−1}(… (A_1·B_0 + B_1) …) + B_{r−1}, then runs its slice from S_in. Unlike the additive sums, the
summaries do not commute: the fold is a product, linear in every B_j and multilinear in the A_j; autograd
differentiates it, and the gathered tensor's gradient goes back to its owners by the exchange's reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import _validate
from ...capabilities import ROUTES, Call
from ...capabilities import chunk_size as route_chunk
from ...errors import LinearAttentionError
from ...features import check_feature_dims, is_log_space, map_features, repeat_kv_heads, unit_features
from .forms import delta_transition

_CHUNKED = next(route for route in ROUTES if route.kind == "delta" and route.form == "chunked")


def slice_transition(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: Any, mask: torch.Tensor | None, beta: Any,
    log_decay: torch.Tensor | None, chunk_size: int | None, feature_gate: torch.Tensor | None = None,
    per_feature: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """[A | B] (..., F, F + Dv) of this rank's slice, in the query-head layout and the state dtype (fp32, fp64 for
    fp64 inputs), prepared as ``linear_attention(..., update="delta")`` prepares its inputs: k/v heads repeated,
    unit key features, β in [0, 2] and 0 at masked keys, ``log_decay`` (..., H, N) fp64 (from
    :func:`linattn._validate.log_decay`), ``feature_gate`` (..., H, N, F) per-feature log-gates (KDA) or None.
    Raises LinearAttentionError on inputs the call would refuse."""
    group = _validate.check_qkv(q, k, v, True)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    strength = _validate.delta_beta(beta, q, k.shape[:-1], compute)  # (..., H, N)
    k, v = repeat_kv_heads(k.to(compute), group), repeat_kv_heads(v.to(compute), group)  # (..., H, N, D)
    keep = None
    if mask is not None:
        keep = _validate.key_padding_mask(mask, k)
        v = v.masked_fill(~keep.unsqueeze(-1), 0)
        strength = strength * keep.to(compute)  # masked tokens write nothing
    log_space = is_log_space(fmap)
    kf = unit_features(fmap, k, is_query=False, log_space=log_space, keep=keep)  # (..., H, N, F)
    check_feature_dims(map_features(fmap, q[..., :1, :].to(compute), is_query=True).shape[-1], kf.shape[-1], fmap)
    call = Call(kind="delta", causal=True, form="chunked", num_queries=q.shape[-2], num_keys=k.shape[-2],
                chunk_size=chunk_size, normalize=False)
    size = route_chunk(_CHUNKED, call)
    assert size is not None
    if feature_gate is not None:  # a decay adds to every feature's log-gate, as in the call
        _validate.check_gate_features(feature_gate, kf.shape[-1])
        gate = feature_gate if log_decay is None else feature_gate.to(torch.float64) + log_decay.unsqueeze(-1)
        if per_feature is None:
            raise LinearAttentionError("per-feature gates with update='delta' (KDA): the slice map is "
                                       "linattn.kinds.kda.distributed.slice_transition")
        a, b = per_feature(kf, v, beta=strength, log_gate=gate, chunk_size=size)
    else:
        a, b = delta_transition(kf, v, beta=strength, log_decay=log_decay, chunk_size=size)
    return torch.cat([a, b], dim=-1)


def prefix_state(maps: torch.Tensor, rank: int, features: int) -> torch.Tensor:
    """The state entering slice ``rank`` from the gathered [A_j | B_j] (W, ..., F, F + Dv): slices 0..rank−1
    folded in order, S ← A_j·S + B_j from S = 0 → (..., F, Dv).

    Slices from ``rank`` on enter as the identity map (I, 0) rather than being left out, so that the gathered
    tensor is in every rank's graph (rank 0 included) and every rank runs the backward collective; I·S + 0 is
    exact, so this changes no value."""
    world = maps.shape[0]
    eye = torch.eye(features, dtype=maps.dtype, device=maps.device)
    neutral = torch.cat([eye.expand(*maps.shape[1:-1], features), maps.new_zeros(maps.shape[1:-1] + (
        maps.shape[-1] - features,))], dim=-1)  # (..., F, F + Dv): [I | 0]
    state = maps.new_zeros(maps.shape[1:-1] + (maps.shape[-1] - features,))  # (..., F, Dv)
    for j in range(world):
        a, b = torch.where(torch.tensor(j < rank, device=maps.device), maps[j], neutral).split(
            [features, maps.shape[-1] - features], dim=-1)
        state = a @ state + b
    return state
