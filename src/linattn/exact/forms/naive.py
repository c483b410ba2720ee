"""The sliding-window hybrid as N×(keys) weights — the quadratic form — and token by token (decoding).

The quadratic form materialises, for every query, the weights of all keys it sees — the carried sink and window
keys of a state, then this call's keys — split by position into exact (window, sinks) and linear ones, plus the
carried linear state. It also returns the next state, so calling it on one token at a time is the recurrent form:
O(W + S) keys per token, whatever the length of the sequence. See :mod:`linattn.exact` for the
definition and scales.
"""

from __future__ import annotations

import torch

from ...features import NEG_INF, finite, scale_between
from ...features import key_scales as running_scales
from ...state import WindowAttentionState
from .chunked import Parts, empty_window_state, next_state
from .hybrid import Hybrid


def _joined(
    state: WindowAttentionState | None, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The keys a call sees beside the linear state: the carried sinks not also in the window buffer, the buffer,
    then this call's keys — (keys (..., X, Dk), values (..., X, Dv), keep (..., X), positions (X,), num_tokens before
    the call)."""
    n, device = k.shape[-2], k.device
    n0 = state.num_tokens if state is not None else 0
    old_k, old_v, old_keep, old_pos = [], [], [], []
    if state is not None:
        ring_start = n0 - state.keys.shape[-2]
        own = min(state.sink_keys.shape[-2], ring_start)  # sinks not also in the window buffer
        old_k = [state.sink_keys[..., :own, :], state.keys]
        old_v = [state.sink_values[..., :own, :], state.values]
        old_keep = [state.sink_keep[..., :own], state.keep]
        old_pos = [torch.arange(own, device=device), torch.arange(ring_start, n0, device=device)]
    xk, xv = torch.cat([*old_k, k], dim=-2), torch.cat([*old_v, v], dim=-2)  # (..., X, D)
    xkeep = torch.cat([*old_keep, keep], dim=-1)  # (..., X)
    positions = torch.cat([*old_pos, n0 + torch.arange(n, device=device)])  # (X,)
    return xk, xv, xkeep, positions, n0


def _exact_mask(
    hybrid: Hybrid, positions: torch.Tensor, n0: int, n: int, xkeep: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, near) (..., N, X): the pairs scored exactly (window and sinks, kept keys) and the band alone."""
    distance = (n0 + torch.arange(n, device=positions.device)).unsqueeze(-1) - positions  # (N, X): t − j
    near = distance.abs() < hybrid.window if not causal else (distance >= 0) & (distance < hybrid.window)
    exact = (near | ((positions < hybrid.sinks) & (distance >= 0 if causal else True))) & xkeep.unsqueeze(-2)
    return exact, near


def reading_scales(
    state: WindowAttentionState, logs: torch.Tensor, old: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-space maps, causal: (R (..., N), the joined keys' scales (..., X)) for log φ of the joined keys ``logs``
    (..., X, F), the first ``old`` carried: those at the state's scale raised to their maximum (≥ every one of them),
    this call's key t at the running maximum R_t (≥ that start), the scale query t reads every key at."""
    start = state.linear.shift
    if old:
        start = torch.maximum(start, logs[..., :old, :].amax((-1, -2)))
    r = running_scales(logs[..., old:, :], True, start)  # (..., N)
    return r, torch.cat([start.unsqueeze(-1).expand(*start.shape, old), r], dim=-1)


def maps_features(hybrid: Hybrid) -> bool:
    """Whether :func:`exact_parallel` maps q and the keys: for the mass or the log-scales. The γ form of an ordinary
    map (the delta rule's exact part included) needs neither, and leaves the O(1) keys a token writes to the linear
    part."""
    return hybrid.factor is None or hybrid.log_space


def exact_parallel(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None,
) -> Parts:
    """The causal exact part alone, with explicit weights, as :class:`.chunked.Parts` (``lin`` and ``linear`` None):
    Σ e^{s_tj − m_t} v_j and Σ e^{s_tj − m_t} over the window and sinks, the mass M_t = Σ φ(q_t)·φ(k_j) over them
    (mass form, ``hybrid.factor`` None; log-space maps: in query t's stored scale c_t + R_t) and the row maximum
    m_t — as :meth:`.hybrid.Hybrid.exact_part` returns them — with q's and the keys' features, or where
    :func:`maps_features` is False q and the keys as they are. What a linear part of any kind meets."""
    xk, xv, xkeep, positions, n0 = _joined(state, k, v, keep)
    old = xk.shape[-2] - k.shape[-2]
    exact, _ = _exact_mask(hybrid, positions, n0, q.shape[-2], xkeep, True)
    scores = ((q @ xk.transpose(-1, -2)) * hybrid.scale).masked_fill(~exact, NEG_INF)  # (..., N, X)
    row_max = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - finite(row_max))
    num, den, top = probs @ xv, probs.sum(-1), row_max.squeeze(-1)
    ring = state.keys.shape[-2] if state is not None else 0
    if not maps_features(hybrid):
        state = state if state is not None else empty_window_state(hybrid, k, v, 0)
        return Parts(q, None, None, None, (num, den, None, top), None, state, keep, k, xk[..., old - ring : old, :])
    qf, c = hybrid.query_features(q)
    logs = hybrid.key_logs(xk, xkeep)  # (..., X, F): φ (ordinary maps, 0 at masked keys) or log φ (−inf there)
    if state is None:
        state = empty_window_state(hybrid, k, v, logs.shape[-1])
    r = at = mass = None
    if hybrid.log_space:
        r, at = reading_scales(state, logs, old)
    if hybrid.factor is None:
        weights = qf @ hybrid.stored(logs, at).transpose(-1, -2)  # (..., N, X)
        if r is not None and at is not None:  # key j stored at its scale, read at R_t
            weights = weights * scale_between(at.unsqueeze(-2), r.unsqueeze(-1), exact)
        mass = weights.masked_fill(~exact, 0.0).sum(-1)
    return Parts(qf, c, r, None, (num, den, mass, top), None, state, keep, logs[..., old:, :],
                 logs[..., old - ring : old, :])


def window_parallel(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None, causal: bool,
) -> tuple[torch.Tensor, WindowAttentionState | None]:
    """The hybrid with explicit weights; keep (..., N) bool. Non-causal: Nq = Nk, no state."""
    sinks, n = hybrid.sinks, q.shape[-2]
    xk, xv, xkeep, positions, n0 = _joined(state, k, v, keep)
    old = xk.shape[-2] - n
    qf, c = hybrid.query_features(q)
    logs = hybrid.key_logs(xk, xkeep)  # (..., X, F)
    if state is None:
        state = empty_window_state(hybrid, k, v, logs.shape[-1]) if causal else None
    r = key_scales = None
    if hybrid.log_space:
        if causal:
            assert state is not None
            r, key_scales = reading_scales(state, logs, old)  # (..., N), (..., X)
        else:
            top = logs.amax((-1, -2))  # (...): one scale for all
            r = top.unsqueeze(-1).expand(*top.shape, n)
            key_scales = top.unsqueeze(-1).expand(*top.shape, xk.shape[-2])
    features = hybrid.stored(logs, key_scales)

    exact, near = _exact_mask(hybrid, positions, n0, n, xkeep, causal)
    linear = ~near & (positions >= sinks) & xkeep.unsqueeze(-2)
    if causal:
        linear = linear & (positions <= n0 + torch.arange(n, device=q.device).unsqueeze(-1))

    weights = qf @ features.transpose(-1, -2)  # (..., N, X)
    if r is not None and key_scales is not None:  # key j stored at its scale, read at r_t (0 where not seen)
        weights = weights * scale_between(key_scales.unsqueeze(-2), r.unsqueeze(-1), exact | linear)
    lin_weights = weights.masked_fill(~linear, 0.0)
    lin_num, lin_den = lin_weights @ xv, lin_weights.sum(-1)
    if causal and state is not None:  # the carried linear state, moved to each query's scale
        lin_num = lin_num + (qf @ state.linear.kv) * _carry(state.linear.shift, r).unsqueeze(-1)
        lin_den = lin_den + (qf @ state.linear.k_sum.unsqueeze(-1)).squeeze(-1) * _carry(state.linear.shift, r)

    scores = ((q @ xk.transpose(-1, -2)) * hybrid.scale).masked_fill(~exact, NEG_INF)  # (..., N, X)
    row_max = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - finite(row_max))
    mass = weights.masked_fill(~exact, 0.0).sum(-1) if hybrid.factor is None else None
    out = hybrid.combine((lin_num, lin_den), (probs @ xv, probs.sum(-1), mass), c, r)
    if not causal:
        return out, None
    assert state is not None
    return out, _advance(hybrid, state, k, v, keep, xv, features, key_scales, positions, r)


def _carry(shift: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    if r is None:
        return torch.ones_like(shift).unsqueeze(-1)
    return scale_between(shift.unsqueeze(-1), r)  # (..., N)


def _advance(
    hybrid: Hybrid, state: WindowAttentionState, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    xv: torch.Tensor, features: torch.Tensor, key_scales: torch.Tensor | None, positions: torch.Tensor,
    r: torch.Tensor | None,
) -> WindowAttentionState:
    """The next state: keys that leave the window in this call (not sinks) enter the linear sums."""
    total = state.num_tokens + k.shape[-2]
    leaving = (positions >= max(hybrid.sinks, state.num_tokens - hybrid.window)) & (positions < total - hybrid.window)
    linear = state.linear
    kf, values = features[..., leaving, :], xv[..., leaving, :]
    kv, k_sum, shift = linear.kv, linear.k_sum, linear.shift
    if r is not None and key_scales is not None:
        end = r[..., -1]  # (...): ≥ every key seen, the scale the sums are kept at
        kf = kf * scale_between(key_scales[..., leaving], end.unsqueeze(-1)).unsqueeze(-1)
        carry = scale_between(shift, end)
        kv, k_sum, shift = kv * carry[..., None, None], k_sum * carry[..., None], end
    linear = type(linear)(kv + kf.transpose(-1, -2) @ values, k_sum + kf.sum(-2), shift, linear.num_tokens)
    return next_state(state, linear, k, v, keep)


def window_recurrent(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """Causal, one token at a time: each step sees the O(W + S) buffered keys and the linear state."""
    outs = []
    for t in range(q.shape[-2]):
        step = slice(t, t + 1)
        out, state = window_parallel(hybrid, q[..., step, :], k[..., step, :], v[..., step, :], keep[..., step],
                                     state, True)
        outs.append(out)
    assert state is not None
    return torch.cat(outs, dim=-2), state
