"""Causal linear attention token by token: S_t = a_t S_{t−1} + φ(k_t)v_tᵀ. Decoding, and a second reference.

A decay a_t = e^{g_t} arrives inside ``ref`` (ref = r − G, see :mod:`._common`): moving the state from scale ref_{t−1}
to ref_t multiplies it by e^{r_{t−1} − r_t}·a_t, so one factor does both the log-space rescale and the decay."""

from __future__ import annotations

import torch

from ....state import LinearAttentionState
from ._common import NEG_INF, finalize, scale_between


def recurrent_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    ref: torch.Tensor | None,
    state: LinearAttentionState | None,
    normalize: bool,
    eps: float,
    min_denom: float | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    batch = qf.shape[:-2]
    features, values = kf.shape[-1], v.shape[-1]
    if state is not None:
        kv, k_sum, shift, seen = state.kv, state.k_sum, state.shift, state.num_tokens
    else:
        kv = qf.new_zeros(*batch, features, values)
        k_sum = qf.new_zeros(*batch, features)
        shift = qf.new_full(batch, NEG_INF) if ref is not None else qf.new_zeros(batch)
        seen = 0
    if ref is not None:  # the running scale in ref's dtype (fp64 with a decay): it can grow large
        shift = shift.to(ref.dtype)
    outs = []
    for t in range(qf.shape[-2]):
        k_t, v_t = kf[..., t, :], v[..., t, :]  # (..., F), (..., Dv)
        if ref is not None:
            carry = scale_between(shift, ref[..., t]).to(kv.dtype)  # (...)
            kv = kv * carry[..., None, None]
            k_sum = k_sum * carry[..., None]
            shift = ref[..., t]
        kv = kv + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        k_sum = k_sum + k_t
        q_t = qf[..., t, :].unsqueeze(-2)  # (..., 1, F)
        num = (q_t @ kv).squeeze(-2)  # (..., Dv)
        den = (q_t @ k_sum.unsqueeze(-1)).squeeze(-1).squeeze(-1)  # (...)
        outs.append(finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom))
    out = torch.stack(outs, dim=-2)
    return out, LinearAttentionState(kv, k_sum, shift, seen + qf.shape[-2])
