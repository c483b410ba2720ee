"""Non-causal linear attention in two GEMMs: S = φ(K)ᵀV once, then φ(Q)S."""

from __future__ import annotations

import torch

from ....state import LinearAttentionState
from ._common import accumulate_state, finalize


def global_attention(
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
    # every key shares one log-scale (ref is (..., 1)), so the queries need no rescaling
    total = accumulate_state(kf, v, ref, state)
    num = qf @ total.kv  # (..., Nq, Dv)
    den = (qf @ total.k_sum.unsqueeze(-1)).squeeze(-1)  # (..., Nq)
    return finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom), total
