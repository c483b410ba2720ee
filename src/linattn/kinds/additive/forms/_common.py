"""Pieces shared by the forms: log-scale bookkeeping, the normaliser, and the running-sum state.

Notation used by every form (leading dims ``...`` are batch and heads):
    qf  (..., Nq, F)  query features
    kf  (..., Nk, F)  key features; for log-space maps stored at log-scale ``ref`` (true φ(k_j) = kf_j·e^ref_j)
    v   (..., Nk, Dv) values (zero at masked keys)
    ref None for ordinary maps; (..., Nk) non-decreasing for causal forms; (..., 1) for non-causal ones.
        With a decay (causal only) ref is r − G in fp64, G the cumulative log-decay: see below.
Outputs are num / (den + eps) in the stabilised scale: eps guards the division, it is not a regulariser.

Scalar decays as a change of log-scale (:func:`decayed_ref`): S_t = a_t·S_{t−1} + φ(k_t)v_tᵀ with a_t = e^{g_t},
g_t ≤ 0.

With G_t = Σ_{i≤t} g_i (G_0 = 0 before the first token), query t weighs key j ≤ t by φ(q_t)·φ(k_j)·e^{G_t − G_j}
and an initial state by e^{G_t}. Every causal form already weighs key j, stored at log-scale ref_j, by
e^{ref_j − ref_t} when query t reads at ref_t (log-space maps: ref = r, the running maximum). So a decay is the
change ref' = r − G (ordinary maps: ref' = −G): ref' stays non-decreasing because g ≤ 0, every factor stays
e^{(≤ 0)}, and the gradient of G flows through the forms' existing gradient of ref.

G grows without bound (γ = 0.5 over 65536 tokens: G ≈ −45000), so it is summed in fp64 and ref' is handed to the
forms in fp64; they form differences in fp64 and cast only the resulting factors (the chunked Function re-bases each
chunk to its own end first, see :class:`.causal_fn._Block`).

State convention: forms return sums stored at scale ref'_N; since ref'_N = r_N − G_N, the true decayed sums are
``kv·e^{r_N}`` — so the returned state's ``shift`` is r_N (0 for ordinary maps), exactly the meaning it has without a
decay, and a later call continues from it unchanged.
"""

from __future__ import annotations

import torch

from ....features import NEG_INF, scale_between
from ....state import LinearAttentionState

__all__ = [
    "NEG_INF", "accumulate_state", "cumulative", "decayed_ref", "empty_state", "finalize", "rowdot", "scale_between",
    "state_contribution",
]


def rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_d x_d·y_d over the last dim, (..., D) × (..., D) → (...), as a contraction: ``(x * y).sum(-1)`` and
    ``torch.linalg.vecdot`` first write the whole product (measured on one CPU thread at 8×16384×64 fp32: 15.5 ms
    against 2.3 ms)."""
    return torch.einsum("...d,...d->...", x, y)


def finalize(
    num: torch.Tensor, den: torch.Tensor, *, normalize: bool, eps: float, min_denom: float | None
) -> torch.Tensor:
    """num / max(den + eps, min_denom), or num alone when ``normalize`` is False.

    A denominator that is exactly 0 (eps=0 and no visible key) divides by 1 instead: with non-negative features
    every weight, so the numerator too, is then 0, and the output is 0 rather than 0/0.
    """
    if not normalize:
        return num
    den = den + eps
    if min_denom is not None:
        den = den.clamp(min=min_denom)
    den = torch.where(den == 0, torch.ones_like(den), den)
    return num / den.unsqueeze(-1)


def empty_state(batch_shape: torch.Size, features: int, values: int, like: torch.Tensor) -> LinearAttentionState:
    return LinearAttentionState.zeros(
        tuple(batch_shape), features, values, dtype=like.dtype, device=like.device
    )


def accumulate_state(
    kf: torch.Tensor,
    v: torch.Tensor,
    ref: torch.Tensor | None,
    state: LinearAttentionState | None,
) -> LinearAttentionState:
    """The state after all keys: Σ φ(k_j) v_jᵀ and Σ φ(k_j) (plus ``state``), at the last key's log-scale."""
    num_tokens = kf.shape[-2] + (state.num_tokens if state is not None else 0)
    if ref is None:
        kv = kf.transpose(-1, -2) @ v  # (..., F, Dv)
        k_sum = kf.sum(-2)
        shift = torch.zeros(kf.shape[:-2], dtype=kf.dtype, device=kf.device)
        if state is not None:
            kv = kv + state.kv
            k_sum = k_sum + state.k_sum
        return LinearAttentionState(kv, k_sum, shift, num_tokens)
    last = ref[..., -1]  # (...)
    weights = scale_between(ref, last.unsqueeze(-1)).to(kf.dtype).unsqueeze(-1)  # (..., Nk, 1)
    kf = kf * weights
    kv = kf.transpose(-1, -2) @ v
    k_sum = kf.sum(-2)
    if state is not None:
        carry = scale_between(state.shift.to(last.dtype), last).to(kf.dtype)
        kv = kv + state.kv * carry[..., None, None]
        k_sum = k_sum + state.k_sum * carry[..., None]
    return LinearAttentionState(kv, k_sum, last, num_tokens)


def state_contribution(
    qf: torch.Tensor, state: LinearAttentionState, ref: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """φ(q)·S and φ(q)·z for a carried-in state, moved to each query's log-scale ``ref`` (broadcast over Nq)."""
    num = qf @ state.kv  # (..., Nq, Dv)
    den = (qf @ state.k_sum.unsqueeze(-1)).squeeze(-1)  # (..., Nq)
    if ref is not None:
        carry = scale_between(state.shift.to(ref.dtype).unsqueeze(-1), ref).to(qf.dtype)  # (..., Nq) or (..., 1)
        num = num * carry.unsqueeze(-1)
        den = den * carry
    return num, den


def cumulative(log_decay: torch.Tensor) -> torch.Tensor:
    """G (..., N) in fp64 from per-token log-decays g (..., N) ≤ 0."""
    return torch.cumsum(log_decay.to(torch.float64), dim=-1)


def decayed_ref(ref: torch.Tensor | None, log_decay: torch.Tensor) -> torch.Tensor:
    """ref' = r − G in fp64 (r = 0 for ordinary maps); non-decreasing when r is and g ≤ 0."""
    total = cumulative(log_decay)
    if ref is None:
        return -total
    return ref.to(torch.float64) - total
