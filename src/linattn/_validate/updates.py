"""Checks of the update rule and what it composes with: β, decays and gates."""

from __future__ import annotations

import torch

from ..errors import LinearAttentionError

UPDATES = ("add", "delta")


def check_update(update: object, beta: object, causal: bool, normalize: bool, min_denom: object,
                 log_gate: object, q: torch.Tensor) -> None:
    """The state-update rule and what it composes with (the delta rule: causal and unnormalised; any gate)."""
    if update not in UPDATES:
        raise LinearAttentionError(f"update: unknown update rule {update!r}; choose one of {', '.join(UPDATES)}")
    if update == "add":
        if beta is not None:
            raise LinearAttentionError("beta: the write strength belongs to the delta rule; pass update='delta'")
        return
    if not causal:
        raise LinearAttentionError(
            "update='delta': the delta rule is a recurrence (each write corrects what the memory predicts from the "
            "keys before it), so it needs an order; pass causal=True"
        )
    if normalize or min_denom is not None:
        raise LinearAttentionError(
            "update='delta': the delta memory keeps no Σφ(k), so there is no denominator to normalise by; its output "
            "S_tᵀφ̂(q_t) is already bounded by the values it recalls. Pass normalize=False (the default for this "
            "update) and no min_denom (docs/delta.md)"
        )


def delta_beta(beta: object, q: torch.Tensor, kv_batch: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """β (..., N) in [0, 2] broadcast to q's (..., N) in ``dtype`` (1 when None); given per k/v head, repeated to
    the query heads (GQA)."""
    target = q.shape[:-1]
    if beta is None:
        return torch.ones(target, dtype=dtype, device=q.device)
    if isinstance(beta, (int, float)) and not isinstance(beta, bool):
        beta = torch.tensor(float(beta), dtype=dtype, device=q.device)
    if not isinstance(beta, torch.Tensor) or not beta.is_floating_point():
        raise LinearAttentionError(
            f"beta: expected a float or a floating tensor of shape (..., N), got {type(beta).__name__}"
        )
    if beta.device != q.device:
        raise LinearAttentionError(f"beta: on {beta.device}, q on {q.device}; move it to {q.device}")
    if beta.dim() >= 2 and tuple(beta.shape) == tuple(kv_batch) and tuple(kv_batch) != tuple(target):
        beta = beta.repeat_interleave(target[-2] // kv_batch[-2], dim=-2)  # (..., Hkv, N) → (..., H, N)
    try:
        beta = torch.broadcast_to(beta, target)
    except RuntimeError:
        raise LinearAttentionError(
            f"beta: shape {tuple(beta.shape)} does not broadcast to q's (..., N) = {tuple(target)}; pass one write "
            "strength per token and head"
        ) from None
    if not bool(((beta >= 0) & (beta <= 2)).all()):
        raise LinearAttentionError(
            f"beta: values from {float(beta.min())} to {float(beta.max())} (or NaN); the write strength must lie in "
            "[0, 2] (e.g. torch.sigmoid(x @ w)): with unit keys, I − β·kkᵀ is then a contraction"
        )
    return beta.to(dtype)


def log_decay(
    decay: object, log_gate: object, q: torch.Tensor, kv_batch: torch.Size, causal: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(g, g_f): the per-token log-decay (*q.shape[:-1]) in fp64 from ``decay`` γ (float or (H,)) and a per-token
    ``log_gate`` (..., N), summed when both are given; and a per-feature ``log_gate`` (..., N, F) in its own dtype
    (F checked against the feature map later). None for what is not given."""
    if decay is None and log_gate is None:
        return None, None
    if not causal:
        raise LinearAttentionError(
            "decay/log_gate: a decay weighs keys by their distance back from the query, which needs an order; "
            "pass causal=True (non-causal attention has no decayed form)"
        )
    batch = q.shape[:-1]  # (..., N)
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    if decay is not None:
        if isinstance(decay, (int, float)) and not isinstance(decay, bool):
            decay = torch.tensor(float(decay), dtype=torch.float64, device=q.device)
        if not isinstance(decay, torch.Tensor) or not decay.is_floating_point():
            raise LinearAttentionError(
                f"decay: expected a float or a floating tensor of shape (H,), got {type(decay).__name__}"
            )
        if decay.dim() > 1 or (decay.dim() == 1 and (q.dim() < 3 or decay.shape[0] not in (1, q.shape[-3]))):
            heads = q.shape[-3] if q.dim() >= 3 else "none"
            raise LinearAttentionError(
                f"decay: shape {tuple(decay.shape)}; expected a scalar or one rate per query head (H,) with "
                f"H = q.shape[-3] = {heads}"
            )
        if not bool(((decay > 0) & (decay <= 1)).all()):
            raise LinearAttentionError(
                f"decay: rates must lie in (0, 1], got values from {float(decay.min())} to {float(decay.max())}; "
                "γ multiplies the state once per token (RetNet: γ_h = 1 − 2^(−5−h))"
            )
        per_head = torch.log(decay.to(device=q.device, dtype=torch.float64))
        total = per_head.unsqueeze(-1) if per_head.dim() == 1 else per_head  # (H, 1) broadcasts over (..., H, N)
    per_feature = None
    if isinstance(log_gate, torch.Tensor) and log_gate.dim() == q.dim():
        per_feature = gate_tokens(log_gate, q, kv_batch, per_feature=True)
        if decay is None:
            return None, per_feature
    elif log_gate is not None:
        total = total + gate_tokens(log_gate, q, kv_batch)
    return torch.broadcast_to(total, batch), per_feature


def gate_tokens(log_gate: object, q: torch.Tensor, kv_batch: torch.Size, per_feature: bool = False) -> torch.Tensor:
    """A log-gate ≤ 0 as fp64: per token (..., N) broadcast to q's (..., N), or per feature (..., N, F) to
    (..., N, F); a gate given per k/v head is repeated to the query heads (GQA)."""
    if not isinstance(log_gate, torch.Tensor) or not log_gate.is_floating_point():
        raise LinearAttentionError(
            f"log_gate: expected a floating tensor of shape (..., N), got {type(log_gate).__name__}"
        )
    if log_gate.device != q.device:
        raise LinearAttentionError(f"log_gate: on {log_gate.device}, q on {q.device}; move it to {q.device}")
    # per-token gates are small (..., N): fp64 at once; per-feature gates stay in their dtype (the chunked form
    # sums them in fp64 block by block, so no (N, F) fp64 copy is made)
    gate = log_gate if per_feature else log_gate.to(torch.float64)
    target = q.shape[:-1]
    if per_feature:  # the token dimension is -2, features last
        target = torch.Size((*target, log_gate.shape[-1]))
        kv_batch = torch.Size((*kv_batch, log_gate.shape[-1]))
    at = -3 if per_feature else -2  # the head dimension of the gate
    if gate.dim() >= -at and tuple(gate.shape) == tuple(kv_batch) and tuple(kv_batch) != tuple(target):
        gate = gate.repeat_interleave(target[at] // kv_batch[at], dim=at)  # (..., Hkv, N[, F]) → (..., H, N[, F])
    if per_feature and gate.shape[-2] != target[-2]:
        raise LinearAttentionError(
            f"log_gate: per-feature shape {tuple(log_gate.shape)}; expected (..., N, F) with N = {target[-2]}"
        )
    if not per_feature and gate.shape[-1] != target[-1]:
        raise LinearAttentionError(
            f"log_gate: last dimension {gate.shape[-1]}, expected one log-decay per token, N = {target[-1]}"
        )
    try:
        gate = torch.broadcast_to(gate, target)
    except RuntimeError:
        raise LinearAttentionError(
            f"log_gate: shape {tuple(log_gate.shape)} does not broadcast to q's (..., N) = {tuple(target)}"
        ) from None
    if not bool((gate <= 0).all()):
        bad = int((~(gate <= 0)).sum())
        raise LinearAttentionError(
            f"log_gate: {bad} value(s) are > 0 or NaN; a log-decay must be ≤ 0 (e.g. F.logsigmoid(x)), since the "
            "state may only shrink"
        )
    if not bool(torch.isfinite(gate).all()):
        raise LinearAttentionError(
            "log_gate: -inf (a decay to exactly 0) is not supported; pass a finite value (e^-100 is 0 in fp32 "
            "already), or cu_seqlens to start new sequences"
        )
    return gate


def check_gate_features(gate: torch.Tensor, features: int) -> None:
    """A per-feature gate (..., N, F) must have the feature map's F."""
    if gate.shape[-1] != features:
        raise LinearAttentionError(
            f"log_gate: per-feature gate with {gate.shape[-1]} features, but the feature map gives "
            f"F={features}; pass (..., N, F) with F the feature dimension"
        )
