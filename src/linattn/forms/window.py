"""The sliding-window hybrid: exact softmax over a window of keys, linear attention over the others, one normaliser.

Query t sees exact weights e^{s·q_t·k_j} for its *exact* keys — causal: the W most recent keys (t−W < j ≤ t) and
the first S tokens of the sequence (sinks); non-causal: the band |t − j| < W and the sinks — and linear weights
φ(q_t)·φ(k_j) for every other visible key. Two ways to put the parts on one scale (``factor``):

- mass-preserving (``factor=None``, parameter-free): the window keeps the softmax *shape* over its keys and
  carries the mass M_t = Σ_exact φ(q_t)·φ(k_j) that the map gives those keys, so
  out_t = (num_lin + M_t·softmax_exact(v)) / (den_lin + M_t) — the denominator is plain linear attention's, and
  an exact map (φ(q)·φ(k) = e^{s·q·k}) gives exact softmax.
- factor γ (LoLCATs): out_t = (num_lin + γ Σ_exact e^{s_tj − m_t} v_j) / (den_lin + γ Σ_exact e^{s_tj − m_t}),
  m_t the row maximum of the exact scores; γ a per-head tensor (or a float), learnable.

Scales. Log-space maps (FAVOR+) keep features at log-scales: query features at their own row maximum c_t, key j
at a running maximum R_j of log φ over all keys ≤ j (ring and sink keys of a carried state at the state's scale,
which is ≥ all of them), read by query t at R_t ≥ R_j. The linear sums and M_t are then both in query t's stored
scale (true = stored·e^{c_t+R_t}), so the mass form needs no further factor; form (a) puts the linear part
(×e^{c_t+R_t}) and the window part (×γ, already ≤ W+S) on the common scale u_t = max(c_t + R_t, 0): factors
e^{c_t+R_t−u_t} and γ·e^{−u_t}, both ≤ γ, so nothing overflows.

Causal linear part: plain causal linear attention of query t against the keys *shifted by W* (the Function in
:mod:`.causal_fn` in its unnormalised mode): position i of the shifted sequence holds key i − W (taken from the
carried window buffer while i < W, zero before the sequence start, zero for sink tokens), so a key enters the
linear state exactly when it leaves the window. The Function reads keys and values so, block by block, from the
inputs and the W rows before them (its lagged operands): no shifted copy is made, except of log-space keys, which
are stored at the scale of the query reading them. Non-causal: the same shifted pass gives the keys j ≤ t − W,
and a second one on the reversed sequence the keys j ≥ t + W — no subtraction, so no cancellation.

Exact part: banded, O(N·W). Without padding, one autograd Function (:mod:`.window_fast`: cache-sized tiles of query
blocks, recompute in backward, O(N) memory) gives the softmax over the exact keys and, for ordinary maps, the mass;
with padding, or for the mass form with keys at their own log-scales, :class:`.window_band.Band` gathers each
query block's keys and plain autograd differentiates (O(N·W) saved for backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..state import LinearAttentionState, WindowAttentionState
from . import causal_fn, window_fast
from ._common import NEG_INF, finalize, scale_between
from .window_band import Band, ShiftRows, Sinks, band_sums, rows_like

Features = Callable[[torch.Tensor, bool], torch.Tensor]  # (x, is_query) → φ(x), or log φ(x) for log-space maps


class Hybrid:
    """The options of one hybrid call and the pieces every form shares."""

    def __init__(
        self, features: Features, *, log_space: bool, window: int, sinks: int, factor: torch.Tensor | None,
        scale: float, eps: float, min_denom: float | None,
    ) -> None:
        self.features, self.log_space = features, log_space
        self.window, self.sinks, self.factor, self.scale = window, sinks, factor, scale
        self.eps, self.min_denom = eps, min_denom

    def query_features(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Query features and (log-space maps) the row maximum c they are stored at."""
        qf = self.features(q, True)
        if not self.log_space:
            return qf, None
        c = qf.amax(-1)  # (..., N)
        return torch.exp(qf - c.unsqueeze(-1)), c

    def key_logs(self, k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """φ(k) (ordinary maps; 0 at masked keys) or log φ(k) (log-space; −inf at masked keys)."""
        kf = self.features(k, False)
        if keep is not None:
            kf = kf.masked_fill(~keep.unsqueeze(-1), NEG_INF if self.log_space else 0.0)
        return kf

    def stored(self, logs: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
        """Key features stored at log-scale ``at`` (..., N) (log-space maps); ordinary maps as they are."""
        if at is None:
            return logs
        finite = torch.where(at == NEG_INF, 0.0, at)  # −inf only where every key so far is masked: features 0
        return torch.exp(logs - finite.unsqueeze(-1))

    def combine(
        self, lin: tuple[torch.Tensor, torch.Tensor],
        exact: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
        c: torch.Tensor | None, r: torch.Tensor | None,
    ) -> torch.Tensor:
        """The output from the linear (num, den) and the exact part's (num, den, mass), per the module docstring."""
        lin_num, lin_den = lin
        win_num, win_den, mass = exact
        if self.factor is None and win_den is None:  # the window part already normalised (window_fast)
            assert mass is not None
            return window_fast.MassCombine.apply(lin_num, lin_den, win_num, mass, self.eps, self.min_denom)
        if self.factor is None:
            assert mass is not None and win_den is not None
            share = mass / torch.where(win_den == 0, torch.ones_like(win_den), win_den)  # (..., N)
            num = lin_num + share.unsqueeze(-1) * win_num
            den = lin_den + mass
        else:
            assert win_den is not None
            gamma = self.factor.unsqueeze(-1)  # per head: (..., 1) against rows (..., N)
            if c is not None and r is not None:
                scale = c + torch.where(r == NEG_INF, 0.0, r)  # linear part's true scale: stored·e^{c+R}
                common = scale.clamp(min=0)
                lin_factor, win_factor = torch.exp(scale - common), gamma * torch.exp(-common)
                num = lin_factor.unsqueeze(-1) * lin_num + win_factor.unsqueeze(-1) * win_num
                den = lin_factor * lin_den + win_factor * win_den
            else:
                num = lin_num + gamma.unsqueeze(-1) * win_num
                den = lin_den + gamma * win_den
        return finalize(num, den, normalize=True, eps=self.eps, min_denom=self.min_denom)

    def exact_part(
        self, q: torch.Tensor, qf: torch.Tensor, r: torch.Tensor | None, band: Band, sink: Sinks | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Σ e^{s_tj − m_t} v_j, Σ e^{s_tj − m_t} over the exact keys, and (mass form) M_t = Σ φ(q_t)·φ(k_j)."""
        n = q.shape[-2]
        size, blocks = band.size, band.blocks
        pad = blocks * size - n
        queries = q * self.scale
        qb = torch.nn.functional.pad(queries, (0, 0, 0, pad)).unflatten(-2, (blocks, size))  # (..., b, C, D)
        scores = (qb @ band.keys.transpose(-1, -2)).add_(band.bias)  # (..., b, C, 2C), −inf outside the band
        # the mass form keeps only the softmax *shape* of the exact keys, so the shift cancels exactly: it needs
        # no gradient, and the scores can be turned into probabilities in place (one pass, no copy)
        shape_only = self.factor is None
        row_max = (scores.detach() if shape_only else scores).amax(-1)  # (..., b, C)
        sink_scores = None
        if sink is not None:
            sink_scores = (queries @ sink.keys.transpose(-1, -2)).masked_fill(~sink.mask, NEG_INF)  # (..., N, S)
            sink_max = (sink_scores.detach() if shape_only else sink_scores).amax(-1)
            sink_max = torch.nn.functional.pad(sink_max, (0, pad), value=NEG_INF).unflatten(-1, (blocks, size))
            row_max = torch.maximum(row_max, sink_max)
        row_max = torch.where(row_max == NEG_INF, 0.0, row_max).unsqueeze(-1)  # no exact keys: weights all 0
        probs = scores.sub_(row_max).exp_() if shape_only else torch.exp(scores - row_max)  # 0 outside the band
        win_num = (probs @ band.values).flatten(-3, -2)[..., :n, :]  # (..., N, Dv)
        win_den = probs.sum(-1).flatten(-2)[..., :n]
        if sink is not None and sink_scores is not None:
            sink_probs = torch.exp(sink_scores - row_max.flatten(-3, -2)[..., :n, :])  # (..., N, S)
            win_num = win_num + sink_probs @ sink.values
            win_den = win_den + sink_probs.sum(-1)
        if self.factor is not None:
            return win_num, win_den, None
        assert band.features is not None
        if r is None:  # every key at one scale: M_t = φ(q_t)·(sliding sum of φ(k) over the band), O(N·F)
            mass = (qf * band_sums(band.features, band.width + 1, n)).sum(-1)
        else:  # keys at their own log-scales: the band's φ(q)·φ(k) weights, moved to each query's scale
            keys = band.gather(band.features)  # (..., b, m·C, F)
            qfb = torch.nn.functional.pad(qf, (0, 0, 0, pad)).unflatten(-2, (blocks, size))  # (..., b, C, F)
            weights = qfb @ keys.transpose(-1, -2)  # (..., b, C, m·C)
            assert band.scales is not None
            rb = torch.nn.functional.pad(r, (0, pad), value=0.0).unflatten(-1, (blocks, size)).unsqueeze(-1)
            weights = weights * scale_between(band.gather_scales().unsqueeze(-2), rb, band.mask)
            mass = weights.sum(-1).flatten(-2)[..., :n]
        if sink is not None and sink.features is not None:
            sink_weights = qf @ sink.features.transpose(-1, -2)  # (..., N, S)
            if r is not None:
                assert sink.scales is not None
                sink_weights = sink_weights * scale_between(sink.scales.unsqueeze(-2), r.unsqueeze(-1), sink.mask)
            else:
                sink_weights = sink_weights.masked_fill(~sink.mask, 0.0)
            mass = mass + sink_weights.sum(-1)
        return win_num, win_den, mass


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
    prev: WindowAttentionState, linear: LinearAttentionState, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
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


def causal_window_chunked(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None, chunk_size: int,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """The causal hybrid: linear part through the chunked Function, exact part banded. keep (..., N) bool."""
    window, sinks, n = hybrid.window, hybrid.sinks, q.shape[-2]
    padded = not bool(keep.all()) or (state is not None and not bool(state.keep.all()))
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
        r = torch.maximum(torch.cummax(logs.amax(-1), dim=-1).values, start.unsqueeze(-1))  # (..., N)
    fill = NEG_INF if hybrid.log_space else 0.0

    # linear part: position i holds key n0 − W + i (buffer while i < W, zero before the sequence, zero for sinks)
    early = min(window, n)
    zeros = min(early, window - ring_len)
    taken = early - zeros
    blank = max(0, min(n, sinks + window - n0)) if sinks else 0  # rows n0 − W + i < S hold sinks: not linear
    head = torch.cat([rows_like(logs, zeros, fill), ring_logs[..., :taken, :]], dim=-2)
    head_v = torch.cat([rows_like(v, zeros, 0.0), state.values[..., :taken, :]], dim=-2)
    lin_num, lin_den, linear = shifted_linear(hybrid, qf, (head, logs), (head_v, v), blank, r, state.linear,
                                              chunk_size)

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
    if not padded and (hybrid.factor is not None or r is None):  # the banded Function (window_fast), both forms

        def prefix(x: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:  # the band's rows before this call's
            return torch.cat([rows_like(x, front, 0.0), ring[..., ring_from:, :]], dim=-2)  # (..., W'−1, ·)

        # ordinary maps: the mass form's features are the keys' features as they are
        features = (qf, prefix(logs, ring_logs), logs) if hybrid.factor is None else None
        sink_parts = None
        if sink_mask is not None:
            sink_parts = (state.sink_keys, state.sink_values, sink_logs, sink_mask, fresh)
        exact = window_fast.exact_part(
            q, hybrid.scale, hybrid.factor is None, (prefix(k, state.keys), k), (prefix(v, state.values), v),
            features, window_fast.tile_size(width - 1), width - 1, front, sink_parts,
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
    out = hybrid.combine((lin_num, lin_den), exact, c, r)
    return out, next_state(state, linear, k, v, keep)


def noncausal_window_chunked(
    hybrid: Hybrid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """The non-causal hybrid (Nq = Nk): band |i − j| < W and sinks exact; the rest through two shifted causal
    passes, keys j ≤ i − W and (on the reversed sequence) j ≥ i + W. All keys at one log-scale (the maximum)."""
    window, sinks, n = hybrid.window, hybrid.sinks, q.shape[-2]
    padded = not bool(keep.all())
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
        sink_mask = outside & keep[..., :count].unsqueeze(-2)
    if not padded:  # the banded Function (window_fast); every key at one scale, so its features serve the mass
        zero = (rows_like(k, front, 0.0), rows_like(v, front, 0.0), rows_like(features, front, 0.0))
        sink_parts = None
        if sink_mask is not None:  # all sinks are this call's first keys
            sink_parts = (k[..., :0, :], v[..., :0, :], features[..., :0, :], sink_mask, count)
        exact = window_fast.exact_part(
            q, hybrid.scale, hybrid.factor is None, (zero[0], k), (zero[1], v),
            (qf, zero[2], features) if hybrid.factor is None else None, window_fast.tile_size(2 * front), 2 * front,
            front, sink_parts,
        )
    else:
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
