"""The sparse exact cache beside a linear part of any kind (scalar decay or gate, per-feature gate, delta rule,
gated delta rule, KDA): ``linear_attention(..., window=W, sinks=S, sparse_cache=..., decay=/log_gate=/update=)``.

Definition (causal). The exact part and the boundaries are the sparse op's (:mod:`.sparse`): at each boundary
t0 = b·B the candidates (the cache and the pairs leaving the window before the next boundary) are scored and the
``size`` best are the cache of the queries t0 … t0 + B − 1, so every pair j has an *entry time*

    e_j = the boundary at which it left the cache,  if it was cached;
          j + W,                                   if it was never cached;
          never,                                   for sinks and padding.

The composed op's rule "a key enters the linear state when it leaves the window" becomes **a pair enters the
linear state when it leaves the exact part**. At step t the linear state takes the step's own decay a_t (a scalar
or one per feature, as the linear part alone applies it), then the writes of the pairs with e_j = t in ascending
position (the pairs leaving the cache at the boundary t, all older than t − W, then key t − W):

    additive:  S ← a_t·S,  then for each j:  S ← S + φ(k_j) v_jᵀ,   z ← a_t·z + Σ_j φ(k_j)
    delta:     S ← a_t·S,  then for each j:  S ← S + β_j·k̂_j (v_j − Sᵀk̂_j)ᵀ         (β_j: the pair's own)

so a pair's decay counts from when it enters the state. Query t reads S_t (after step t): num_lin = Sᵀφ(q_t),
den_lin = φ(q_t)·z (additive), or the read-out Sᵀφ̂(q_t) (delta). The exact part is unchanged: the window, the sinks
and the block's cached pairs j ≤ t − W, softmax. The combiner is the composed op's (:mod:`.composed`): the
additive family shares softmax's normaliser (mass form or γ), its sums times the cache's ``linear_weight`` λ; the
delta family adds λ·Sᵀφ̂(q_t) to γ·A_t, A_t the softmax average of the exact keys (γ = ``window_factor``, 1 by
default). The scores: ``"attention"`` and the oracle as without a linear kind; ``"recall"`` beside the delta family
is the memory's self-recall error ‖v_j − Sᵀk̂_j‖ (no normaliser: the read-out is a value), beside the additive
family LoLA's ‖v_j − Sᵀφ(k_j)/(zᵀφ(k_j))‖ with the decayed sums, S (and z) as query t0 − 1 read them.

Without a cache (size 0) no pair is ever cached and e_j = j + W: the composed op. A window over the sequence
writes nothing: causal softmax (the delta family; the additive one up to eps).

Forms. The boundaries are decided in one pass (no gradient: the choice is discrete), the linear state carried
from boundary to boundary (for ``"recall"`` only) by the linear op itself on that block's write stream
(:mod:`.sparse_stream`); then the linear op runs once on the call's whole write stream, with gradients, and is
read at the real query positions. ``form="parallel"`` writes the exact part's weights out and runs the linear op's
token-by-token form (the definition); ``"recurrent"`` is that one token at a time; ``"chunked"`` takes the window's
banded exact part, the cache's per-block term (:mod:`.cache_term`) and the linear op's chunked form. Log-space
maps: the delta family reads unit rows (no scale); beside the additive family each write-stream slot is stored at
its step's R and the decayed sums run on ρ − G (:mod:`.sparse_scales`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ...features import NEG_INF, finite
from ...state import DeltaRuleState, SparseCache, WindowAttentionState
from .boundary import NEVER, attention_scores, choose, gather_rows, is_member, oracle_scores, recall_scores
from .cache_term import CacheTerm, Geometry
from .chunked import causal_window_parts, empty_window_state
from .composed import add_to_average, composed_state, softmax_average
from .hybrid import Hybrid
from .sparse import _carried, _packed, _queries_since
from .sparse_scales import moved, own_scale, reading, start_scale
from .sparse_stream import Linear, LinearPart, Pairs, Stream, first_entries, run_stream, stream_piece


def _token(x: torch.Tensor | None, t: int, dim: int) -> torch.Tensor | None:
    """Token t of a per-token tensor (token dimension ``dim``) as a length-1 dimension; None stays."""
    return x.narrow(dim, t, 1) if x is not None else None


def _start(hybrid: Hybrid, part: LinearPart, k: torch.Tensor, v: torch.Tensor,
           state: WindowAttentionState | None) -> WindowAttentionState:
    if state is not None:
        return state
    features = hybrid.key_logs(k[..., :1, :], None).shape[-1]
    state = empty_window_state(hybrid, k, v, features)
    if part.delta:
        state.linear = DeltaRuleState(k.new_zeros(*k.shape[:-2], features, v.shape[-1]))
    return state


def _pairs(hybrid: Hybrid, part: LinearPart, cache: SparseCache, state: WindowAttentionState, k: torch.Tensor,
           v: torch.Tensor, keep: torch.Tensor) -> Pairs:
    """The rows X = [carried cache, sinks not in the buffer, window buffer, this call] (:mod:`.sparse_stream`)."""
    carried = _carried(state, cache, k, v)
    batch, device = k.shape[:-2], k.device
    n0, ring_len = state.num_tokens, state.keys.shape[-2]
    ring_start = n0 - ring_len
    own = min(state.sink_keys.shape[-2], ring_start)  # sinks not also in the window buffer
    slots = carried.positions.shape[-1]
    slot_valid = (carried.positions >= 0) & (carried.positions < ring_start)
    arange = torch.arange(own, device=device), torch.arange(ring_start, n0 + k.shape[-2], device=device)
    pos = torch.cat([carried.positions, *(x.expand(*batch, x.shape[0]) for x in arange)], -1)
    valid = torch.cat([slot_valid, state.sink_keep[..., :own], state.keep, keep], -1)
    keys = torch.cat([carried.keys, state.sink_keys[..., :own, :], state.keys, k], -2)
    values = torch.cat([carried.values, state.sink_values[..., :own, :], state.values, v], -2)
    phi = hybrid.key_logs(keys, valid)
    scale = reading_scales = None
    if hybrid.log_space:  # beside the additive state: rows at their own maxima, R_{n0−1} … R_{end−1}
        top = phi.amax(-1)  # R takes its gradient from the keys' maxima, as the window op's
        phi, scale = own_scale(phi)
        old = pos.shape[-1] - k.shape[-2]
        reading_scales = reading(start_scale(state.linear.shift, top[..., :old]), top[..., old:])
    beta = None
    if part.beta is not None:
        held = state.cache.betas if state.cache is not None and state.cache.betas is not None else None
        buffered = state.betas if state.betas is not None else part.beta[..., :0].expand(*batch, ring_len)
        beta = torch.cat([held if held is not None else k.new_zeros(*batch, slots),
                          k.new_zeros(*batch, own), buffered, part.beta], -1) * valid
    return Pairs(pos, valid, keys, values, phi, part.features(phi), beta, slots, slots + own, ring_start,
                 carried.positions, scale, reading_scales)


def _decide(hybrid: Hybrid, cache: SparseCache, part: LinearPart, pairs: Pairs, linear: Linear,
            queries: torch.Tensor, query_first: int, n0: int, end: int,
            chunk_size: int | None) -> tuple[dict[int, torch.Tensor], Stream]:
    """The call's boundaries in order: each block's cache (..., L) by block index and the call's write stream (from
    the entry times, each final before its step). The linear state is carried between boundaries only for the
    recall score."""
    window, block = hybrid.window, cache.block_for(hybrid.window)
    batch, device = pairs.pos.shape[:-1], pairs.pos.device
    sizes, slots = cache.sizes_for(batch, device), pairs.carried.shape[-1]
    if part.decide is not None and part.delta and cache.score == "recall" and isinstance(linear, DeltaRuleState):
        found = _decided_natively(hybrid, cache, part, pairs, linear, sizes, n0, end)
        if found is not None:
            return found
    entry = torch.cat([first_entries(pairs, window, hybrid.sinks), pairs.pos.new_full((*batch, 1), NEVER)], -1)
    spare = entry.shape[-1] - 1
    members, by_block, pieces = pairs.carried, {}, []
    cursor, decided = n0, False
    detached = replace(pairs, keys=pairs.keys.detach(), values=pairs.values.detach(), phi=pairs.phi.detach(),
                       lin=pairs.lin.detach(), beta=pairs.beta.detach() if pairs.beta is not None else None)
    for t0 in range(max(-(-n0 // block) * block, block), end, block):
        piece = stream_piece(pairs, entry[..., :-1], cursor, t0, n0, window, decided)
        pieces.append(piece)
        if cache.score == "recall":
            linear = run_stream(part, detached, piece, None, linear, chunk_size)[1]
        lo = max(t0 - window, 0)
        leaving = torch.arange(lo, max(lo, t0 - window + block), device=device)
        positions = torch.cat([members, leaving.expand(*batch, leaving.shape[0])], -1)  # (..., C)
        rows = pairs.row_of(positions)
        valid = (rows >= 0) & detached.valid.gather(-1, rows.clamp(min=0)) & (positions >= hybrid.sinks)
        positions = positions.masked_fill(~valid, -1)
        kf = gather_rows(detached.lin, rows) * valid.unsqueeze(-1)
        values = gather_rows(detached.values, rows)
        if cache.score == "recall":
            if part.delta:  # the memory's own recall error: its read-out is a value, no normaliser
                scores = torch.linalg.vector_norm(values - kf @ linear.kv, dim=-1)
            else:
                assert not isinstance(linear, DeltaRuleState)
                scores = recall_scores(kf, values, linear.kv, linear.k_sum)
        elif cache.score == "attention":
            lo = t0 - block - query_first
            scores = attention_scores(queries[..., lo : lo + block, :], torch.arange(t0 - block, t0, device=device),
                                      gather_rows(detached.keys, rows), positions, valid, hybrid.scale)
        else:
            scores = oracle_scores(cache, positions)
        chosen, _, kept = choose(scores, positions, valid, sizes, slots)
        was = torch.arange(rows.shape[-1], device=device) < members.shape[-1]
        target = torch.where(rows < 0, spare, rows)
        new = torch.where(was & valid & ~kept, t0, torch.where(kept, NEVER, entry.gather(-1, target)))
        entry.scatter_(-1, target, new)
        members, by_block[t0 // block] = chosen, chosen
        cursor, decided = t0, True
    pieces.append(stream_piece(pairs, entry[..., :-1], cursor, end, n0, window, decided))
    return by_block, Stream.join(pieces)


def _decided_natively(hybrid: Hybrid, cache: SparseCache, part: LinearPart, pairs: Pairs, linear: DeltaRuleState,
                      sizes: torch.Tensor, n0: int, end: int) -> tuple[dict[int, torch.Tensor], Stream] | None:
    """:func:`_decide` in one call of ``part.decide`` (the native kernels; None where it does not take the call)."""
    assert part.decide is not None and pairs.beta is not None
    window, block = hybrid.window, cache.block_for(hybrid.window)
    gate = part.gate()
    if gate is None and part.log_decay is not None:
        gate = part.log_decay.unsqueeze(-1)
    found = part.decide(pairs.lin.detach(), pairs.values.detach(), pairs.beta.detach(), pairs.valid, pairs.pos,
                        pairs.carried, first_entries(pairs, window, hybrid.sinks),
                        gate.detach() if gate is not None else None, linear, sizes, n0=n0, end=end, window=window,
                        sinks=hybrid.sinks, block=block, base=pairs.base, ring_start=pairs.ring_start)
    if found is None:
        return None
    chosen, _, rows, gate_at, read, step = found
    first = max(-(-n0 // block) * block, block)
    by_block = {(first + b * block) // block: chosen[..., b, :] for b in range(chosen.shape[-2])}
    return by_block, Stream(rows, gate_at, read, step)


def sparse_composed(
    hybrid: Hybrid, cache: SparseCache, part: LinearPart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    keep: torch.Tensor | None, state: WindowAttentionState | None, form: str, chunk_size: int,
    exact_term: Callable[..., tuple[torch.Tensor, ...] | None] | None = None,
) -> tuple[torch.Tensor, WindowAttentionState]:
    """The op in ``form`` ("parallel", "recurrent" or "chunked"); keep (..., N) bool or None (no padding).
    ``exact_term``: None, or a faster way (the native kernels) to the chunked form's cache term where nothing needs
    its gradient (:func:`linattn.backends.native.forms.cache_exact`'s arguments and results; None where it does
    not take them)."""
    if form == "recurrent":
        outs = []
        for t in range(q.shape[-2]):
            token = slice(t, t + 1)
            one = LinearPart(_token(part.log_decay, t, -1), _token(part.feature_gate, t, -2),
                             _token(part.beta, t, -1), part.eps, part.min_denom)
            out, state = sparse_composed(hybrid, cache, one, q[..., token, :], k[..., token, :], v[..., token, :],
                                         keep[..., token] if keep is not None else None, state, "parallel",
                                         chunk_size)
            outs.append(out)
        assert state is not None
        return torch.cat(outs, -2), state
    full_keep = keep if keep is not None else torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    state = _start(hybrid, part, k, v, state)
    n0, n = state.num_tokens, q.shape[-2]
    end, block = n0 + n, cache.block_for(hybrid.window)
    pairs = _pairs(hybrid, part, cache, state, k, v, full_keep)
    carried = _carried(state, cache, k, v)
    queries = torch.cat([carried.queries, q], -2)
    query_first = n0 - carried.queries.shape[-2]
    chunk = chunk_size if form == "chunked" else None
    with torch.no_grad():
        by_block, stream = _decide(hybrid, cache, part, pairs, state.linear, queries.detach(), query_first, n0,
                                      end, chunk)
    phi_q, c = hybrid.query_features(q)
    r = pairs.reading[..., 1:] if pairs.reading is not None else None  # log-space: query t reads at c_t + R_t
    lin_out, linear = run_stream(part, pairs, stream, part.features(phi_q), state.linear, chunk)
    assert lin_out is not None
    selections = [by_block.get(b, carried.positions) for b in range(n0 // block, (end - 1) // block + 1)]
    if form == "chunked":
        exact = _exact_chunked(hybrid, cache, pairs, q, k, v, keep, state, selections, chunk_size, exact_term)
    else:
        exact = _exact_parallel(hybrid, pairs, q, phi_q, selections, n0, block, r)
    if part.delta:
        read, _ = cache.weigh_linear((lin_out, lin_out[..., 0]))
        out = add_to_average(softmax_average(exact), read, hybrid.factor)
    else:
        out = hybrid.combine(cache.weigh_linear((lin_out[..., :-1], lin_out[..., -1])), exact, c, r)
    nxt = composed_state(state, linear, k, v, full_keep, part.beta)
    final = selections[-1]
    rows = pairs.row_of(final)
    filled = (final >= 0).unsqueeze(-1)
    kept = _queries_since(queries, query_first, end, block) if cache.score == "attention" else q[..., :0, :]
    betas = pairs.beta.gather(-1, rows.clamp(min=0)) * filled.squeeze(-1) if pairs.beta is not None else None
    nxt.cache = _packed(cache, final, gather_rows(pairs.keys, rows) * filled, gather_rows(pairs.values, rows) * filled,
                        kept, block)
    if betas is not None:
        mask = nxt.cache.slot_mask(nxt.cache.sizes, final.shape[-1])
        nxt.cache.packed_betas = betas[mask]
    return out, nxt


def _exact_parallel(hybrid: Hybrid, pairs: Pairs, q: torch.Tensor, phi_q: torch.Tensor,
                    selections: list[torch.Tensor], n0: int, block: int,
                    r: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The exact part's weights written out: (Σ e^{s−m} v, Σ e^{s−m}, mass) per query over the window, the sinks
    and the block's cached pairs j ≤ t − W (the mass form's mass φ(q)·Σ_exact φ(k); None in the γ form)."""
    window, sinks, n = hybrid.window, hybrid.sinks, q.shape[-2]
    t = torch.arange(n0, n0 + n, device=q.device)
    batch, pos = q.shape[:-2], pairs.pos
    distance = t.unsqueeze(-1) - pos.unsqueeze(-2)  # (..., N, X)
    seen = pairs.valid.unsqueeze(-2) & (distance >= 0)
    near = seen & (distance < window)
    sink = seen & (pos < sinks).unsqueeze(-2)
    first = n0 // block
    chosen = torch.stack([selections[int(b) - first] for b in (t // block).tolist()], -2)  # (..., N, L)
    cached = seen & (distance >= window) & is_member(pos.unsqueeze(-2).expand(*batch, n, pos.shape[-1]), chosen)
    exact = near | sink | cached
    scores = ((q @ pairs.keys.transpose(-1, -2)) * hybrid.scale).masked_fill(~exact, NEG_INF)
    probs = torch.exp(scores - finite(scores.amax(-1, keepdim=True)))
    mass = None
    if hybrid.factor is None:
        weights = phi_q @ pairs.phi.transpose(-1, -2)  # (..., N, X)
        if r is not None and pairs.scale is not None:  # log-space: pair j moved from m_j to R_t
            weights = weights * moved(pairs.scale, r, exact)
        mass = weights.masked_fill(~exact, 0.0).sum(-1)
    return probs @ pairs.values, probs.sum(-1), mass


def _exact_chunked(hybrid: Hybrid, cache: SparseCache, pairs: Pairs, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, keep: torch.Tensor | None, state: WindowAttentionState,
                   selections: list[torch.Tensor], chunk_size: int,
                   exact_term: Callable[..., tuple[torch.Tensor, ...] | None] | None = None
                   ) -> tuple[torch.Tensor | None, ...]:
    """The window's banded exact part and the cache's per-block term (:mod:`.cache_term`), on one shift per query:
    (Σ e^{s−top} v, Σ e^{s−top}, mass) — in the mass form already divided: (A, None, mass)."""
    n0, n, block, window = state.num_tokens, q.shape[-2], cache.block_for(hybrid.window), hybrid.window
    parts = causal_window_parts(hybrid, q, k, v, keep, state, chunk_size, linear_part=False)
    batch = q.shape[:-2]
    front = n0 % block
    blocks = len(selections)
    pad = blocks * block - front - n
    chosen = torch.stack(selections, -2)  # (..., b, L)
    if not chosen.shape[-1]:  # no cache: the window's exact part
        return parts.exact[:3]

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *x.shape[len(batch):])

    def padded(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:  # (..., N[, ·]) → (R, blocks·B[, ·])
        spec = (front, pad) if x.dim() == len(batch) + 1 else (0, 0, front, pad)
        return rows_of(torch.nn.functional.pad(x, spec, value=value))

    win_num, win_den, win_mass, ls = parts.exact
    shape_only = hybrid.factor is None
    # the linear part is the linear op's own (run on the write stream): the term's additions are not read
    geo = Geometry(n0, front, block, window, chosen.shape[-1], hybrid.scale, shape_only, linear=shape_only)
    found = None
    if exact_term is not None and not shape_only and pairs.scale is None:  # the exact sums alone, no gradient
        found = exact_term(padded(q), rows_of(pairs.keys), rows_of(pairs.values), padded(ls, NEG_INF),
                           rows_of(pairs.row_of(chosen)), rows_of(chosen), first=n0 - front, block=block,
                           window=window, scale=hybrid.scale)
    if found is not None:
        ex_num, ex_den, top = (x[:, front : front + n].reshape(*batch, n, *x.shape[2:]) for x in found)
        cache_mass = None
    else:
        terms = CacheTerm.apply(padded(q), padded(parts.qf), rows_of(pairs.keys), rows_of(pairs.values),
                                rows_of(pairs.phi), padded(ls.detach() if shape_only else ls, NEG_INF),
                                rows_of(pairs.row_of(chosen)), rows_of(chosen), None, geo,
                                None if pairs.scale is None or parts.r is None else (
                                    rows_of(pairs.scale), padded(parts.r.detach(), float("inf"))))
        _, _, ex_num, ex_den, cache_mass, top = (x[:, front : front + n].reshape(*batch, n, *x.shape[2:])
                                                 for x in terms)
        if pairs.scale is not None and parts.r is not None:  # R_t held constant in the term: its gradient restored
            cache_mass = cache_mass * torch.exp(parts.r.detach() - parts.r)
    if win_den is None:  # the fused window part: already its softmax average, at the log-scale ls
        win_den = torch.ones_like(ls)
    weight = torch.exp(ls - top)  # 0 where the window has no exact key (ls = −inf)
    num = torch.addcmul(ex_num, win_num, weight.unsqueeze(-1))
    den = torch.addcmul(ex_den, win_den, weight)
    if shape_only:
        assert win_mass is not None and cache_mass is not None
        return num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1), None, win_mass + cache_mass
    return num, den, None
