"""Pieces shared by the forms: log-scale bookkeeping, the normaliser, and the running-sum state.

Notation used by every form (leading dims ``...`` are batch and heads):
    qf  (..., Nq, F)  query features
    kf  (..., Nk, F)  key features; for log-space maps stored at log-scale ``ref`` (true φ(k_j) = kf_j·e^ref_j)
    v   (..., Nk, Dv) values (zero at masked keys)
    ref None for ordinary maps; (..., Nk) non-decreasing for causal forms; (..., 1) for non-causal ones.
        With a decay (causal only) ref is r − G in fp64, G the cumulative log-decay: see :mod:`.decay`.
Outputs are num / (den + eps) in the stabilised scale: eps guards the division, it is not a regulariser.
"""

from __future__ import annotations

import torch

from ..state import LinearAttentionState

NEG_INF = float("-inf")


def rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_d x_d·y_d over the last dim, (..., D) × (..., D) → (...), as a contraction: ``(x * y).sum(-1)`` and
    ``torch.linalg.vecdot`` first write the whole product (measured on one CPU thread at 8×16384×64 fp32: 15.5 ms
    against 2.3 ms)."""
    return torch.einsum("...d,...d->...", x, y)


def scale_between(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(a − b): moves sums kept at log-scale ``a`` to log-scale ``b ≥ a``.

    0 where ``a`` is −inf (empty sums) or ``keep`` is False, without a NaN in the value or the gradient.
    """
    ok = a != NEG_INF
    if keep is not None:
        ok = ok & keep
    return torch.exp(torch.where(ok, a - b, NEG_INF))


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
