"""The quadratic definition: materialise the Nq×Nk weights φ(q_t)·φ(k_j). The reference, and fastest for tiny N."""

from __future__ import annotations

import torch

from ....state import LinearAttentionState
from ._common import accumulate_state, finalize, scale_between, state_contribution


def parallel_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    ref: torch.Tensor | None,
    state: LinearAttentionState | None,
    normalize: bool,
    eps: float,
    min_denom: float | None,
    want_state: bool,
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    nq, nk = qf.shape[-2], kf.shape[-2]
    weights = qf @ kf.transpose(-1, -2)  # (..., Nq, Nk)
    if causal:
        keep = torch.ones(nq, nk, dtype=torch.bool, device=qf.device).tril()
        if ref is not None:
            # key j is stored at scale ref_j, query t reads at scale ref_t ≥ ref_j (a decay's e^{G_t − G_j} is in
            # ref; the differences are formed in ref's dtype, fp64 with a decay, before the cast)
            weights = weights * scale_between(ref.unsqueeze(-2), ref.unsqueeze(-1), keep).to(weights.dtype)
        else:
            weights = weights.masked_fill(~keep, 0)
    num = weights @ v  # (..., Nq, Dv)
    den = weights.sum(-1)  # (..., Nq)
    if state is not None:
        state_num, state_den = state_contribution(qf, state, ref)
        num = num + state_num
        den = den + state_den
    out = finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom)
    return out, accumulate_state(kf, v, ref, state) if want_state else None
