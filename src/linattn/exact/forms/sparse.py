"""The window op with a sparse exact cache (``linear_attention(..., window=W, sinks=S, sparse_cache=...)``).

Definition (causal). Positions t = b·B (b ≥ 1, B the cache's ``block``) are *boundaries*. At a boundary t0 the
candidates are the pairs in the cache and the pairs that leave the window before the next boundary (positions
t0 − W … t0 − W + B − 1, not sinks, not padding; B ≤ W, so they have all been seen). Each candidate gets a score
against what precedes t0 (the linear state S, z that query t0 − 1 read, the queries t0 − B … t0 − 1, or the
oracle's positions); the ``size`` best (ties: the newer) are the cache for the queries t0 … t0 + B − 1. Every pair
j then has an *entry time* e_j: the boundary at which it left the cache, j + W if it was never cached, never for
sinks and padding. Query t weighs

- exactly (softmax, one normaliser with the window and sinks): the window t − W < j ≤ t, the sinks, and the pairs of
  its block's cache with j ≤ t − W;
- linearly (φ(q_t)·φ(k_j)): every other pair with e_j ≤ t, and the carried linear state;

and combines them as the window op does (the mass form: the exact part carries the mass φ(q)·Σ_exact φ(k); or the
factor γ), the linear part's sums times the cache's ``linear_weight`` β (1 by default). Without a cache (size 0)
and with β = 1 this is the window op.

Forms. :func:`sparse_parallel` is the definition written out: every weight of every query, the states at the
boundaries as explicit sums; called one token at a time it is the decoding form (:func:`sparse_recurrent`).
:func:`sparse_chunked` runs the window op's chunked path (the linear part as keys entering at j + W, the banded
exact part), decides the boundaries in one pass with incremental state sums (no gradient: the choice is
discrete), and corrects each query block with its cache: the cached pairs that the shifted linear part counted
are taken out of it and put in the exact part (their linear weight moves into the mass, so the form's denominator
loses nothing), and pairs the state held cached before the call and that leave the cache are added to the linear
part. O(N·size) beside the window op's O(N·W).

The decision at a boundary (the scores, the choice, a call's boundaries in order) is
:mod:`linattn.exact.forms.boundary`, shared with the decoding step and the fit.

Log-space maps (FAVOR+ and kin): every pair at its own maximum, query t at c_t + R_t, the boundary sums at R_{t0−1}
(:mod:`.sparse_scales`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from ...features import NEG_INF, finite, scale_between
from ...state import LinearAttentionState, SparseCache, SparseCacheState, WindowAttentionState
from .boundary import (  # noqa: F401  (re-exported: the names' old home)
    NEVER,
    attention_scores,
    by_budget,
    cache_selections,
    choose,
    decide,
    gather_rows,
    in_cache,
    is_member,
    oracle_scores,
    recall_scores,
    scores_for,
    slot_of,
    sorted_table,
)
from .cache_term import CacheTerm, Geometry
from .chunked import causal_window_parts, empty_window_state, next_state
from .hybrid import Hybrid
from .sparse_scales import carried_to, moved, own_scale, reading, start_scale, sums_at


class _Slots(NamedTuple):
    """The carried cache as slots (..., L[, ·]), unpacked once per call (−1 / zeros in empty slots)."""

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor


def _empty_slots(cache: SparseCache, k: torch.Tensor, v: torch.Tensor) -> _Slots:
    slots, batch = cache.largest, k.shape[:-2]
    return _Slots(torch.full((*batch, slots), -1, dtype=torch.long, device=k.device),
                  k.new_zeros(*batch, slots, k.shape[-1]), v.new_zeros(*batch, slots, v.shape[-1]),
                  k.new_zeros(*batch, 0, k.shape[-1]))


def _carried(state: WindowAttentionState, cache: SparseCache, k: torch.Tensor, v: torch.Tensor) -> _Slots:
    """The cache the state carries, or an empty one (a state made before any token)."""
    if state.cache is not None:
        held = state.cache
        return _Slots(held.positions, held.keys, held.values, held.queries)
    return _empty_slots(cache, k, v)


def _packed(cache: SparseCache, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            queries: torch.Tensor, block: int) -> SparseCacheState:
    """The state's cache from slots (..., L[, ·]), each row at its own budget."""
    return SparseCacheState.from_slots(positions, keys, values, queries, block,
                                       cache.sizes_for(positions.shape[:-1], positions.device))


def empty_cache(cache: SparseCache, k: torch.Tensor, v: torch.Tensor, window: int) -> SparseCacheState:
    return _packed(cache, *_empty_slots(cache, k, v), cache.block_for(window))


def _queries_since(queries: torch.Tensor, first: int, end: int, block: int) -> torch.Tensor:
    """The rows of queries (positions first … end−1) from the last boundary ≤ end − 1 on."""
    start = ((end - 1) // block) * block if end > 0 else 0
    return queries[..., max(0, start - first) :, :]


# --- the definition, written out --------------------------------------------------------------------------------


def sparse_parallel(
    hybrid: Hybrid, cache: SparseCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """Every weight of every query (..., N, X) and the boundary states as explicit sums; keep (..., N) bool."""
    window, sinks, n, device = hybrid.window, hybrid.sinks, q.shape[-2], q.device
    block = cache.block_for(window)
    if state is None:
        state = empty_window_state(hybrid, k, v, hybrid.key_logs(k[..., :1, :], None).shape[-1])
    carried = _carried(state, cache, k, v)
    n0, end = state.num_tokens, state.num_tokens + n
    batch, slots = q.shape[:-2], carried.positions.shape[-1]
    ring_len, sink_len = state.keys.shape[-2], state.sink_keys.shape[-2]
    ring_start = n0 - ring_len
    own = min(sink_len, ring_start)  # sinks not also in the window buffer

    def per_row(x: torch.Tensor) -> torch.Tensor:
        return x.expand(*batch, x.shape[-1])

    # every pair this call can weigh: cached pairs that have left the window, sinks, the window buffer, this call
    slot_valid = (carried.positions >= 0) & (carried.positions < ring_start)
    xpos = torch.cat([carried.positions, per_row(torch.arange(own, device=device)),
                      per_row(torch.arange(ring_start, end, device=device))], -1)  # (..., X)
    xk = torch.cat([carried.keys, state.sink_keys[..., :own, :], state.keys, k], -2)
    xv = torch.cat([carried.values, state.sink_values[..., :own, :], state.values, v], -2)
    xkeep = torch.cat([slot_valid, state.sink_keep[..., :own], state.keep, keep], -1)
    kf = hybrid.key_logs(xk, xkeep)  # 0 at invalid rows (log-space: −inf)
    m = big_r = None  # log-space maps: each row at its own maximum m, R_{n0−1} … R_{end−1} (sparse_scales.py)
    if hybrid.log_space:
        top = kf.amax(-1)  # (..., X): R takes its gradient from the keys' maxima, as the window op's
        kf, m = own_scale(kf)
        old = xk.shape[-2] - n
        big_r = reading(start_scale(state.linear.shift, top[..., :old]), top[..., old:])
    is_slot = torch.zeros_like(xkeep)
    is_slot[..., :slots] = True
    member = is_member(xpos, carried.positions) & xkeep
    enters = xkeep & (xpos >= sinks) & ~member
    entry = torch.where(enters, xpos + window, NEVER)
    sizes = cache.sizes_for(batch, device)
    queries_all = torch.cat([carried.queries, q], -2)
    query_first = n0 - carried.queries.shape[-2]

    members = carried.positions
    by_block: dict[int, torch.Tensor] = {}
    first = -(-n0 // block) * block
    for t0 in range(max(first, block), end, block):
        entered = (xkeep & (entry >= n0) & (entry <= t0 - 1)).unsqueeze(-1)
        if m is not None and big_r is not None:  # the sums at R_{t0−1}
            rho = big_r[..., t0 - n0]
            kv, k_sum = carried_to(state.linear.kv, state.linear.k_sum, state.linear.shift, rho)
            add_kv, add_sum = sums_at(kf * entered, m, xv, rho)
            kv, k_sum = kv + add_kv, k_sum + add_sum
        else:
            kv = state.linear.kv + (kf * entered).transpose(-1, -2) @ xv
            k_sum = state.linear.k_sum + (kf * entered).sum(-2)
        now = is_member(xpos, members) & xkeep
        leaving = xkeep & ~is_slot & (xpos >= max(sinks, t0 - window)) & (xpos < t0 - window + block)
        candidates = (now | leaving)
        lo = t0 - block - query_first
        scores = scores_for(cache, hybrid, kf=kf, v=xv, keys=xk, positions=xpos, valid=candidates, kv=kv,
                            k_sum=k_sum, queries=queries_all[..., lo : lo + block, :],
                            query_positions=torch.arange(t0 - block, t0, device=device))
        chosen, _, kept = choose(scores, xpos, candidates, sizes, slots)
        entry = torch.where(now & ~kept, t0, torch.where(kept, NEVER, entry))
        members = chosen
        by_block[t0 // block] = chosen

    # the weights of every query
    t = torch.arange(n0, end, device=device)  # (N,)
    distance = t.unsqueeze(-1) - xpos.unsqueeze(-2)  # (..., N, X)
    seen = xkeep.unsqueeze(-2) & (distance >= 0)
    near = seen & (distance < window)
    sink = seen & (xpos < sinks).unsqueeze(-2)
    blocks = t // block
    selections = torch.stack([by_block.get(int(b), carried.positions) for b in blocks.tolist()], -2)  # (..., N, L)
    cached = seen & (distance >= window) & is_member(xpos.unsqueeze(-2).expand(*batch, n, xpos.shape[-1]),
                                                    selections)
    exact = near | sink | cached
    linear = seen & ~exact & (entry.unsqueeze(-2) <= t.unsqueeze(-1))

    qf, c = hybrid.query_features(q)
    weights = qf @ kf.transpose(-1, -2)  # (..., N, X)
    lin_from_state = (qf @ state.linear.kv, (qf @ state.linear.k_sum.unsqueeze(-1)).squeeze(-1))
    r = None
    if m is not None and big_r is not None:  # query t reads at c_t + R_t: pair j moved by e^{m_j − R_t}
        r = big_r[..., 1:]
        weights = weights * moved(m, r, seen)
        carry = scale_between(state.linear.shift.unsqueeze(-1), r)  # (..., N): the carried sums to R_t
        lin_from_state = (lin_from_state[0] * carry.unsqueeze(-1), lin_from_state[1] * carry)
    lin_weights = weights.masked_fill(~linear, 0.0)
    lin_num = lin_weights @ xv + lin_from_state[0]
    lin_den = lin_weights.sum(-1) + lin_from_state[1]
    scores = ((q @ xk.transpose(-1, -2)) * hybrid.scale).masked_fill(~exact, NEG_INF)
    probs = torch.exp(scores - finite(scores.amax(-1, keepdim=True)))
    mass = weights.masked_fill(~exact, 0.0).sum(-1) if hybrid.factor is None else None
    out = hybrid.combine(cache.weigh_linear((lin_num, lin_den)), (probs @ xv, probs.sum(-1), mass), c, r)

    end_scale = big_r[..., -1] if big_r is not None else None
    nxt = next_state(state, _linear_after(state.linear, kf, xv, xkeep, entry, n0, end, m, end_scale), k, v, keep)
    nxt.cache = _final_cache(cache, members, xpos, xkeep, xk, xv, queries_all, query_first, end, block)
    return out, nxt


def _linear_after(linear: LinearAttentionState, kf: torch.Tensor, xv: torch.Tensor, xkeep: torch.Tensor,
                  entry: torch.Tensor, n0: int, end: int, m: torch.Tensor | None = None,
                  end_scale: torch.Tensor | None = None) -> LinearAttentionState:
    """The linear sums after the call: the carried ones plus every row X (features kf, values xv) whose entry time
    falls in the call (n0 … end − 1). Log-space maps (rows at their own maxima m): at ``end_scale``, R_{end−1}."""
    entered = (xkeep & (entry >= n0) & (entry <= end - 1)).unsqueeze(-1)
    features = kf * entered
    if m is not None and end_scale is not None:
        kv, k_sum = carried_to(linear.kv, linear.k_sum, linear.shift, end_scale)
        add_kv, add_sum = sums_at(features, m, xv, end_scale)
        return LinearAttentionState(kv + add_kv, k_sum + add_sum, end_scale, linear.num_tokens)
    return LinearAttentionState(linear.kv + features.transpose(-1, -2) @ xv, linear.k_sum + features.sum(-2),
                                linear.shift, linear.num_tokens)


def _final_cache(cache: SparseCache, members: torch.Tensor, xpos: torch.Tensor, xkeep: torch.Tensor,
                 xk: torch.Tensor, xv: torch.Tensor, queries: torch.Tensor, query_first: int, end: int,
                 block: int) -> SparseCacheState:
    """The cache after the call: the members' keys and values (from the rows X where they are valid)."""
    hit = (members.unsqueeze(-1) == xpos.unsqueeze(-2)) & xkeep.unsqueeze(-2)  # (..., L, X)
    index = hit.to(torch.int8).argmax(-1)
    filled = (members >= 0).unsqueeze(-1)
    keys = gather_rows(xk, index) * filled
    values = gather_rows(xv, index) * filled
    kept = _queries_since(queries, query_first, end, block) if cache.score == "attention" else queries[..., :0, :]
    return _packed(cache, members, keys, values, kept, block)


def sparse_recurrent(
    hybrid: Hybrid, cache: SparseCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
    state: WindowAttentionState | None,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """One token at a time (the decoding form): each step sees the O(S + W + size) buffered pairs and the state."""
    outs = []
    for t in range(q.shape[-2]):
        step = slice(t, t + 1)
        out, state = sparse_parallel(hybrid, cache, q[..., step, :], k[..., step, :], v[..., step, :],
                                     keep[..., step], state)
        outs.append(out)
    assert state is not None
    return torch.cat(outs, dim=-2), state


# --- the chunked form ---------------------------------------------------------------------------------------------


def sparse_chunked(
    hybrid: Hybrid, cache: SparseCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    keep: torch.Tensor | None, state: WindowAttentionState | None, chunk_size: int,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """The window op's chunked path, then each query block's cache (see the module docstring)."""
    window, sinks, n, device = hybrid.window, hybrid.sinks, q.shape[-2], q.device
    block = cache.block_for(window)
    parts = causal_window_parts(hybrid, q, k, v, keep, state, chunk_size)
    assert parts.lin is not None and parts.linear is not None
    state, keep = parts.state, parts.keep
    carried = _carried(state, cache, k, v)
    n0, end = state.num_tokens, state.num_tokens + n
    batch, slots = q.shape[:-2], carried.positions.shape[-1]
    ring_len = state.keys.shape[-2]
    ring_start = n0 - ring_len
    if slots == 0:  # no cache: the window op
        nxt = next_state(state, parts.linear, k, v, keep)
        nxt.cache = empty_cache(cache, k, v, window)
        return hybrid.combine(cache.weigh_linear(parts.lin), parts.exact, parts.c, parts.r), nxt

    # the rows X: the cache's slots (valid where the pair has left the window), the window buffer, this call
    slot_valid = (carried.positions >= 0) & (carried.positions < ring_start)
    ring_pos = torch.arange(ring_start, end, device=device)
    xpos = torch.cat([carried.positions, ring_pos.expand(*batch, ring_pos.shape[0])], -1)
    xkeep = torch.cat([slot_valid, state.keep, keep], -1) & (xpos >= sinks)
    xk = torch.cat([carried.keys, state.keys, k], -2)
    xv = torch.cat([carried.values, state.values, v], -2)
    slot_features = hybrid.key_logs(carried.keys, slot_valid)
    kf = torch.cat([slot_features, parts.ring_features, parts.features], -2).masked_fill(
        ~xkeep.unsqueeze(-1), NEG_INF if hybrid.log_space else 0.0)
    scales = None  # log-space maps: (each row's own maximum m, R_{n0−1} … R_{end−1}) (sparse_scales.py)
    if hybrid.log_space:
        assert parts.r is not None
        kf, m = own_scale(kf)
        ring_scales = parts.ring_features.detach().amax(-1).masked_fill(~state.keep, NEG_INF)
        sink_scales = hybrid.key_logs(state.sink_keys, state.sink_keep).detach().amax(-1)
        start = start_scale(state.linear.shift, m[..., :slots], ring_scales, sink_scales)
        scales = (m, torch.cat([start.unsqueeze(-1), parts.r.detach()], -1))

    def rows_in(table: torch.Tensor) -> Any:
        def index_of(positions: torch.Tensor) -> torch.Tensor:
            """Row in X of each position (..., K) or (..., b, K) (−1: none): a slot for cached pairs older than
            the buffer (found by binary search among the carried positions, ``table``)."""
            slot = slot_of(positions, table)[0]
            row = torch.where(positions < ring_start, slot, slots + positions - ring_start)
            return torch.where(positions < 0, -1, row)

        return index_of

    index_of = rows_in(sorted_table(carried.positions))
    queries_all = torch.cat([carried.queries, q], -2)
    query_first = n0 - carried.queries.shape[-2]
    groups = by_budget(cache.sizes_for(batch, device).reshape(-1), slots)
    # with several groups, their rows concatenated in group order go back to row order by this permutation
    back = None if len(groups) == 1 else torch.argsort(torch.cat([index for index, _ in groups if index is not None]))
    with torch.no_grad():
        given = (xpos, xkeep, kf.detach(), xk.detach(), xv.detach(), carried.positions, state.linear.kv,
                 state.linear.k_sum, queries_all.detach(), state.linear.shift.expand(batch),
                 *(scales if scales is not None else ()))
        if len(groups) == 1:
            selections, entry = decide(cache, hybrid, block, n0, end, slots, ring_start, xpos, xkeep, kf.detach(),
                                        xk.detach(), xv.detach(), carried.positions, state.linear, index_of,
                                        given[8], query_first, scales=scales)
        else:  # each group of rows decides at its own width (its candidates: that many slots and the leaving pairs)
            rows_total = batch.numel()

            def flat(x: torch.Tensor) -> torch.Tensor:
                return x.reshape(rows_total, *x.shape[len(batch):])

            sizes = flat(cache.sizes_for(batch, device))
            keep_rows = None if cache.keep is None else flat(
                cache.keep.to(device).expand(*batch, cache.keep.shape[-1]))
            decided = []
            for index, width in groups:
                assert index is not None
                xp, xkp, f, xkk, xvv, members, kv, k_sum, qs, shift, *own = (flat(x).index_select(0, index)
                                                                             for x in given)
                sub = dataclasses.replace(cache, size=sizes.index_select(0, index).cpu(),
                                          keep=None if keep_rows is None else keep_rows.index_select(0, index))
                linear = LinearAttentionState(kv, k_sum, shift)
                decided.append(decide(sub, hybrid, block, n0, end, slots, ring_start, xp, xkp, f, xkk, xvv, members,
                                      linear, rows_in(sorted_table(members)), qs, query_first, width=width,
                                      scales=(own[0], own[1]) if own else None))
            assert back is not None

            def joined(parts: list[torch.Tensor]) -> torch.Tensor:  # (R_g, width) each → (..., L), −1 beyond
                wide = [torch.nn.functional.pad(x, (0, slots - x.shape[-1]), value=-1) for x in parts]
                return torch.cat(wide).index_select(0, back).view(*batch, slots)

            selections = [joined([group[0][i] for group in decided]) for i in range(len(decided[0][0]))]
            entry = torch.cat([group[1] for group in decided]).index_select(0, back).view(*batch, -1)

    # each query block against its cache: (..., b, B, 2L) with the pairs held before the call
    front = n0 % block
    blocks = -(-(front + n) // block)
    pad = blocks * block - front - n
    held = slot_valid  # pairs the state held, already out of the window: not in the shifted linear part
    chosen = torch.stack(selections, -2)  # (..., b, L)
    rows = index_of(chosen)
    with_held = bool(held.any())
    outside = None
    if with_held:
        outside = held.unsqueeze(-2) & ~in_cache(carried.positions.unsqueeze(-2).expand_as(chosen), chosen)

    def padded(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:  # (..., N[, ·]) → (R, blocks·B[, ·])
        spec = (front, pad) if x.dim() == len(batch) + 1 else (0, 0, front, pad)
        return rows_of(torch.nn.functional.pad(x, spec, value=value))

    def unpadded(x: torch.Tensor) -> torch.Tensor:
        return x[:, front : front + n].reshape(*batch, n, *x.shape[2:])

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *x.shape[len(batch):])

    win_num, win_den, win_mass, ls = parts.exact
    shape_only = hybrid.factor is None
    inputs = (padded(q), padded(parts.qf), rows_of(xk), rows_of(xv), rows_of(kf),
              padded(ls.detach() if shape_only else ls, NEG_INF))
    # log-space maps: the rows' own maxima and each query's R_t (+inf at padding: no weight), as constants
    term_scales = None if scales is None else (rows_of(scales[0]), padded(scales[1][..., 1:], float("inf")))
    chosen_rows, chosen_pos = rows_of(rows), rows_of(chosen)
    held_pos = rows_of(carried.positions.unsqueeze(-2).expand_as(chosen))
    held_out = rows_of(outside) if outside is not None else None

    def term(index: torch.Tensor | None, width: int) -> tuple[torch.Tensor, ...]:
        """The cache term of the rows ``index`` (None: all), their slots cut to ``width`` (a row of budget s
        holds its pairs in its first s slots, the rest −1)."""
        def pick(x: torch.Tensor) -> torch.Tensor:
            return x if index is None else x.index_select(0, index)

        u_rows, u_pos = pick(chosen_rows[..., :width]), pick(chosen_pos[..., :width])
        if with_held:
            u_rows = torch.cat([u_rows, torch.arange(width, device=device).expand_as(u_rows)], -1)
            u_pos = torch.cat([u_pos, pick(held_pos[..., :width])], -1)
        geo = Geometry(n0, front, block, window, width, hybrid.scale, shape_only)
        return CacheTerm.apply(*(pick(x) for x in inputs), u_rows, u_pos,
                               pick(held_out[..., :width]) if held_out is not None else None, geo,
                               None if term_scales is None else (pick(term_scales[0]), pick(term_scales[1])))

    if len(groups) == 1:
        terms = term(None, slots)
    else:  # each group of rows at its own width, then back in row order
        assert back is not None
        parts_of = [term(index, width) for index, width in groups]
        terms = tuple(torch.cat(pieces).index_select(0, back) for pieces in zip(*parts_of, strict=True))
    lin_add, lin_den_add, ex_num, ex_den, cache_mass, top = (unpadded(x) for x in terms)
    if parts.r is not None:  # at R_t held constant in the term: e^{R̂_t − R_t} (= 1) gives R_t its gradient
        restore = torch.exp(parts.r.detach() - parts.r)
        lin_add, lin_den_add = lin_add * restore.unsqueeze(-1), lin_den_add * restore
        cache_mass = cache_mass * restore
    lin = (parts.lin[0] + lin_add, parts.lin[1] + lin_den_add)
    if win_den is None:  # the fused window part: already its softmax average, at the log-scale ls
        win_den = torch.ones_like(ls)
    weight = torch.exp(ls - top)  # 0 where the window has no exact key (ls = −inf)
    num = torch.addcmul(ex_num, win_num, weight.unsqueeze(-1))
    den = torch.addcmul(ex_den, win_den, weight)
    if shape_only:
        assert win_mass is not None
        exact_part: tuple[Any, ...] = (num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1), None,
                                       win_mass + cache_mass)
    else:
        exact_part = (num, den, None)
    out = hybrid.combine(cache.weigh_linear(lin), exact_part, parts.c, parts.r)

    nxt = next_state(state, _linear_after(state.linear, kf, xv, xkeep, entry, n0, end, *_at_end(scales)), k, v,
                     keep)
    final = selections[-1] if selections else carried.positions
    final_rows = index_of(final)
    filled = (final >= 0).unsqueeze(-1)
    kept = _queries_since(queries_all, query_first, end, block) if cache.score == "attention" else q[..., :0, :]
    nxt.cache = _packed(cache, final, gather_rows(xk, final_rows) * filled, gather_rows(xv, final_rows) * filled, kept,
                        block)
    return out, nxt




def _at_end(scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the rows' own maxima, R_{end−1}) for :func:`_linear_after`, or (None, None) for ordinary maps."""
    return (None, None) if scales is None else (scales[0], scales[1][..., -1])
