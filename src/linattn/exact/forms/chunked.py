"""The window op's chunked forms: causal (linear part through the chunked Function, exact part banded) and
non-causal (two shifted causal passes and the band); the state after a call (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...features import NEG_INF, key_scales
from ...kinds.additive.forms import causal_fn
from ...state import DeltaRuleState, LinearAttentionState, WindowAttentionState
from . import fused
from .band import Band, ShiftRows, Sinks, rows_like
from .hybrid import Hybrid


def shifted_linear(
    hybrid: Hybrid, qf: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor], blank: int, r: torch.Tensor | None, state: LinearAttentionState,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, LinearAttentionState]:
    """Causal linear attention, unnormalised, after ``state``, of query i against rows 0 … i of the keys and values
    shifted by E: ``keys`` = (head (..., E, F), logs (..., N, F)) read as [head; logs[:N−E]] with the first ``blank``
    rows empty, ``values`` likewise (key rows stored at r_i for log-space maps): (num, den, state after all keys)."""
    (k_head, logs), (v_head, v) = keys, values
    n = qf.shape[-2]
    size = min(chunk_size, n)
    batch = qf.shape[:-2]
    block = causal_fn.block_tokens(batch.numel(), logs.shape[-1], v.shape[-1], size)
    lag: torch.Tensor | None = k_head
    if r is not None:  # log-space: row i is stored at the scale r_i of its reader, so the shifted rows are made
        rows = torch.arange(blank, device=qf.device) if blank else None
        logs, lag, blank = hybrid.stored(ShiftRows.apply(k_head, logs, rows, NEG_INF), r), None, 0
    merged = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # (..., F, Dv+1)
    scale0 = state.shift if r is not None else None
    num, kv, k_sum, den = causal_fn.CausalChunkedFunction.apply(
        qf, logs, v, r, merged, scale0, size, block, True, 0.0, None, True, lag, v_head, blank
    )
    shift = r[..., -1] if r is not None else torch.zeros_like(state.shift)
    return num, den, LinearAttentionState(kv, k_sum, shift, state.num_tokens)


def empty_linear(
    batch: torch.Size, features: int, values: int, like: torch.Tensor, log_space: bool
) -> LinearAttentionState:
    state = LinearAttentionState.zeros(tuple(batch), features, values, dtype=like.dtype, device=like.device)
    if not log_space:
        state.shift = torch.zeros_like(state.shift)
    return state


def _empty_rows(like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(*like.shape[:-2], 0, like.shape[-1])  # not a view: nothing to differentiate


def empty_window_state(
    hybrid: Hybrid, k: torch.Tensor, v: torch.Tensor, features: int
) -> WindowAttentionState:
    """A state that has seen nothing, for inputs like k (..., N, Dk), v (..., N, Dv)."""
    batch = k.shape[:-2]
    keep = torch.ones(*batch, 0, dtype=torch.bool, device=k.device)
    return WindowAttentionState(
        empty_linear(batch, features, v.shape[-1], k, hybrid.log_space), _empty_rows(k), _empty_rows(v), keep,
        _empty_rows(k), _empty_rows(v), keep, hybrid.window, hybrid.sinks, 0,
    )


def next_state(
    prev: WindowAttentionState, linear: LinearAttentionState | DeltaRuleState, k: torch.Tensor, v: torch.Tensor,
    keep: torch.Tensor,
) -> WindowAttentionState:
    """The buffers after this call's keys: the last min(W, seen) keys, and the first min(S, seen)."""
    n = k.shape[-2]
    total = prev.num_tokens + n
    window = min(prev.window, total)
    # window ≥ 1 (this call has a key); slice before joining: never copy the whole call
    ring = [torch.cat([old[..., max(0, old.shape[-2] + new.shape[-2] - window) :, :], new[..., -window:, :]], -2)
            for old, new in ((prev.keys, k), (prev.values, v))]
    ring_keep = torch.cat([prev.keep[..., max(0, prev.keep.shape[-1] + n - window) :], keep[..., -window:]], -1)
    new_sinks = min(k.shape[-2], max(0, prev.sinks - prev.num_tokens))
    sink_keys = torch.cat([prev.sink_keys, k[..., :new_sinks, :]], dim=-2)
    sink_values = torch.cat([prev.sink_values, v[..., :new_sinks, :]], dim=-2)
    sink_keep = torch.cat([prev.sink_keep, keep[..., :new_sinks]], dim=-1)
    linear.num_tokens = max(0, total - prev.window)
    return WindowAttentionState(
        linear, ring[0], ring[1], ring_keep, sink_keys, sink_values, sink_keep, prev.window, prev.sinks, total
    )


def masks_any(keep: torch.Tensor | None, state: WindowAttentionState | None) -> bool:
    """Whether a key of this call (``keep``, None: no mask given) or of the state's window buffer is masked: the
    fused exact part takes no padding. No mask and no buffered keys: not, without looking at any value. Under
    torch.compile a mask's values are unknown when the graph is traced (a branch on them is a data-dependent guard
    that breaks the graph), so a given mask counts as padding there: the band path is right for any mask."""
    masks = [x for x in (keep, state.keep if state is not None else None) if x is not None and x.numel()]
    if not masks:
        return False
    if torch.compiler.is_compiling():
        return True
    return not all(bool(x.all()) for x in masks)


@dataclass
class Parts:
    """The causal hybrid's pieces before they are combined: what a form that adds exact pairs (the sparse cache)
    builds on. ``exact`` is (num, den, mass, log-scale) as :meth:`.hybrid.Hybrid.exact_part` returns it."""

    qf: torch.Tensor
    c: torch.Tensor | None
    r: torch.Tensor | None
    lin: tuple[torch.Tensor, torch.Tensor] | None  # None: the exact part alone was asked for
    exact: tuple[Any, ...]
    linear: LinearAttentionState | None  # the linear sums after every key that left the window in this call
    state: WindowAttentionState  # the state the call started from (an empty one for None)
    keep: torch.Tensor  # (..., N), all True without padding
    features: torch.Tensor  # this call's key features (ordinary maps; log φ for log-space maps)
    ring_features: torch.Tensor  # the window buffer's


def causal_window_chunked(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
    state: WindowAttentionState | None, chunk_size: int,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """The causal hybrid: linear part through the chunked Function, exact part banded. keep (..., N) bool, or None
    (no padding)."""
    parts = causal_window_parts(hybrid, q, k, v, keep, state, chunk_size)
    assert parts.lin is not None and parts.linear is not None
    out = hybrid.combine(parts.lin, parts.exact, parts.c, parts.r)
    return out, next_state(parts.state, parts.linear, k, v, parts.keep)


def causal_window_parts(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
    state: WindowAttentionState | None, chunk_size: int, linear_part: bool = True, average: bool = False,
) -> Parts:
    """The pieces of :func:`causal_window_chunked`, not yet combined; ``linear_part=False``: the exact part alone
    (``lin`` and ``linear`` None), for a linear part of another kind (:mod:`.composed`); ``average``: the caller
    reads only the exact keys' softmax average (:func:`.composed.softmax_average`), which the fused path may then
    return already normalised."""
    window, sinks, n = hybrid.window, hybrid.sinks, q.shape[-2]
    padded = masks_any(keep, state)
    if keep is None:  # the state's buffers and the sink mask still take one
        keep = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    qf, c = hybrid.query_features(q)
    prev_keys = [state.sink_keys, state.keys] if state is not None else []
    prev_keep = [state.sink_keep, state.keep] if state is not None else []
    joined = (torch.cat([*prev_keys, k], dim=-2), torch.cat([*prev_keep, keep], dim=-1)) if prev_keys else (k, keep)
    logs_all = hybrid.key_logs(joined[0], joined[1] if padded else None)  # no padding: no mask to apply
    if state is None:
        state = empty_window_state(hybrid, k, v, logs_all.shape[-1])
    n0, ring_len, sink_len = state.num_tokens, state.keys.shape[-2], state.sink_keys.shape[-2]
    if sink_len + ring_len:
        sink_logs, ring_logs, logs = logs_all.split([sink_len, ring_len, n], dim=-2)
    else:  # no buffers: no split (its backward would join the gradients in a full copy)
        sink_logs = ring_logs = logs_all[..., :0, :].detach()
        logs = logs_all
    start = r = None
    if hybrid.log_space:
        start = state.linear.shift  # (...): ≥ log φ of every earlier key, and of the buffers (recomputed here)
        if sink_len + ring_len:
            start = torch.maximum(start, logs_all[..., : sink_len + ring_len, :].amax((-1, -2)))
        r = key_scales(logs, True, start)  # (..., N)
    fill = NEG_INF if hybrid.log_space else 0.0

    # linear part: position i holds key n0 − W + i (buffer while i < W, zero before the sequence, zero for sinks)
    early = min(window, n)
    zeros = min(early, window - ring_len)
    taken = early - zeros
    blank = max(0, min(n, sinks + window - n0)) if sinks else 0  # rows n0 − W + i < S hold sinks: not linear
    head = torch.cat([rows_like(logs, zeros, fill), ring_logs[..., :taken, :]], dim=-2)
    head_v = torch.cat([rows_like(v, zeros, 0.0), state.values[..., :taken, :]], dim=-2)
    lin: tuple[torch.Tensor, torch.Tensor] | None = None
    linear = None
    if linear_part:
        lin_num, lin_den, linear = shifted_linear(hybrid, qf, (head, logs), (head_v, v), blank, r, state.linear,
                                                  chunk_size)
        lin = (lin_num, lin_den)

    # exact part: query i sees keys n0 + i − W' + 1 … n0 + i (W' = W capped at what exists) as a band
    before = min(window - 1, ring_len)
    width = min(window, before + n)
    front = width - 1 - before
    ring_from = ring_len - before
    fresh = min(n, max(0, sinks - n0))  # sink tokens in this call
    sink_mask = None
    if sink_len + fresh and n0 + n - 1 - window >= 0:
        positions = torch.arange(sink_len + fresh, device=q.device)
        sees = positions <= (n0 + torch.arange(n, device=q.device) - window).unsqueeze(-1)  # (N, S)
        sink_mask = sees & torch.cat([state.sink_keep, keep[..., :fresh]], dim=-1).unsqueeze(-2)  # (..., N, S)
    if not padded and (hybrid.factor is not None or r is None):  # the banded Function (fused), both forms

        def prefix(x: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:  # the band's rows before this call's
            return torch.cat([rows_like(x, front, 0.0), ring[..., ring_from:, :]], dim=-2)  # (..., W'−1, ·)

        # ordinary maps: the mass form's features are the keys' features as they are
        features = (qf, prefix(logs, ring_logs), logs) if hybrid.factor is None else None
        sink_parts = None
        if sink_mask is not None:
            sink_parts = (state.sink_keys, state.sink_values, sink_logs, sink_mask, fresh)
        exact = fused.exact_part(
            q, hybrid.scale, hybrid.factor is None, (prefix(k, state.keys), k), (prefix(v, state.values), v),
            features, fused.tile_size(width - 1), width - 1, front, sink_parts, average=average, band=hybrid.band,
        )
    else:  # padding, or the mass form with keys at their own log-scales: the band gathered in full
        sink = None
        if sink_mask is not None:
            sink_features = sink_scales = None
            if hybrid.factor is None:
                at = None
                if start is not None and r is not None:
                    at = torch.cat([start.unsqueeze(-1).expand(*start.shape, sink_len), r[..., :fresh]], -1)
                    sink_scales = at
                sink_features = hybrid.stored(torch.cat([sink_logs, logs[..., :fresh, :]], dim=-2), at)
            sink = Sinks(
                torch.cat([state.sink_keys, k[..., :fresh, :]], dim=-2),
                torch.cat([state.sink_values, v[..., :fresh, :]], dim=-2), sink_mask, sink_features, sink_scales,
            )
        band_keys = [rows_like(k, front, 0.0), state.keys[..., ring_from:, :], k]
        band_values = [rows_like(v, front, 0.0), state.values[..., ring_from:, :], v]
        band_keep = None
        if padded:
            band_keep = torch.cat([keep.new_zeros(*keep.shape[:-1], front), state.keep[..., ring_from:], keep], dim=-1)
        band_features = band_scales = None
        if hybrid.factor is None:
            ring_at = start.unsqueeze(-1).expand(*start.shape, front + before) if start is not None else None
            old = torch.cat([rows_like(logs, front, fill), ring_logs[..., ring_from:, :]], dim=-2)
            old = hybrid.stored(old, ring_at)
            band_features = torch.cat([old, hybrid.stored(logs, r)], dim=-2)
            if r is not None and ring_at is not None:
                band_scales = torch.cat([ring_at, r], dim=-1)
        band = Band(band_keys, band_values, band_keep, front, band_features, band_scales, width - 1, n)
        exact = hybrid.exact_part(q, qf, r, band, sink)
    return Parts(qf, c, r, lin, exact, linear, state, keep, logs, ring_logs)


def noncausal_window_chunked(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, chunk_size: int
) -> torch.Tensor:
    """The non-causal hybrid (Nq = Nk): band |i − j| < W and sinks exact; the rest through two shifted causal
    passes, keys j ≤ i − W and (on the reversed sequence) j ≥ i + W. All keys at one log-scale (the maximum).
    keep (..., N) bool, or None (no padding)."""
    window, sinks, n = hybrid.window, hybrid.sinks, q.shape[-2]
    padded = masks_any(keep, None)
    qf, c = hybrid.query_features(q)
    logs = hybrid.key_logs(k, keep if padded else None)
    r = None
    if hybrid.log_space:
        top = logs.amax((-1, -2))  # (...)
        r = top.unsqueeze(-1).expand(*top.shape, n)
    features = hybrid.stored(logs, r)  # every key at the one scale: the forms below treat them as ordinary
    linear_features = features
    if sinks:
        linear_features = features.masked_fill((torch.arange(n, device=q.device) < sinks).unsqueeze(-1), 0.0)
    early = min(window, n)
    empty = empty_linear(q.shape[:-2], features.shape[-1], v.shape[-1], features, False)
    nums, dens = [], []
    for flip in (False, True):
        qs, fs, vs = (qf.flip(-2), linear_features.flip(-2), v.flip(-2)) if flip else (qf, linear_features, v)
        num, den, _ = shifted_linear(  # r=None: the keys as stored
            hybrid, qs, (rows_like(fs, early, 0.0), fs), (rows_like(vs, early, 0.0), vs), 0, None, empty, chunk_size
        )
        nums.append(num.flip(-2) if flip else num)
        dens.append(den.flip(-1) if flip else den)
    width = min(window, n)
    front = width - 1
    count = min(sinks, n)
    sink_mask = None
    if count:
        positions = torch.arange(n, device=q.device)
        outside = (positions.unsqueeze(-1) - positions[:count]).abs() >= window  # (N, S)
        sink_mask = outside & keep[..., :count].unsqueeze(-2) if keep is not None else outside
    if not padded:  # the banded Function (fused); every key at one scale, so its features serve the mass
        zero = (rows_like(k, front, 0.0), rows_like(v, front, 0.0), rows_like(features, front, 0.0))
        sink_parts = None
        if sink_mask is not None:  # all sinks are this call's first keys
            sink_parts = (k[..., :0, :], v[..., :0, :], features[..., :0, :], sink_mask, count)
        exact = fused.exact_part(
            q, hybrid.scale, hybrid.factor is None, (zero[0], k), (zero[1], v),
            (qf, zero[2], features) if hybrid.factor is None else None, fused.tile_size(2 * front), 2 * front,
            front, sink_parts,
        )
    else:
        assert keep is not None  # padding needs a mask
        band = Band(
            [rows_like(k, front, 0.0), k], [rows_like(v, front, 0.0), v],
            torch.cat([keep.new_zeros(*keep.shape[:-1], front), keep], dim=-1), front,
            torch.cat([rows_like(features, front, 0.0), features], dim=-2), None, 2 * front, n,
        )
        sink = None
        if sink_mask is not None:
            sink = Sinks(k[..., :count, :], v[..., :count, :], sink_mask, features[..., :count, :], None)
        exact = hybrid.exact_part(q, qf, None, band, sink)
    return hybrid.combine((nums[0] + nums[1], dens[0] + dens[1]), exact, c, r)
