"""The sparse exact cache's decision at a boundary (see :mod:`linattn.exact.forms.sparse` for the definition):
the candidates' scores, the choice of the ``size`` best, and the boundaries of one call in order — one copy shared
by every form of the op (:func:`~linattn.exact.forms.sparse.sparse_parallel`, the chunked form), its decoding step
(:class:`~linattn.decode.SparseDecodeStep`) and the fit that trains maps with the cache in place
(:func:`cache_selections`), so that they agree to rounding.

Positions are token indices; a cache's positions (..., L) are ascending with −1 in the unused slots at the end.
"""

from __future__ import annotations

from typing import Any

import torch

from ...features import NEG_INF, finite
from ...state import LinearAttentionState, SparseCache
from .chunked import empty_window_state
from .hybrid import Hybrid
from .sparse_scales import carried_to, own_scale, reading, sums_at

NEVER = 1 << 62  # the entry time of a pair that never enters the linear state (in this call)



def choose(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, sizes: torch.Tensor,
           slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidates kept: per row, the ``sizes`` valid candidates of highest score (ties: the larger position).
    Returns their positions (..., slots) ascending with −1 in the unused slots at the end, their indices among the
    candidates in the same order (−1 unused), and the kept mask over the candidates (..., C)."""
    score = scores.masked_fill(~valid, NEG_INF)
    by_position = torch.argsort(positions.masked_fill(~valid, -1), dim=-1, descending=True, stable=True)
    order = by_position.gather(-1, torch.argsort(score.gather(-1, by_position), dim=-1, descending=True, stable=True))
    rank = torch.arange(order.shape[-1], device=order.device)
    take = valid.gather(-1, order) & (rank < sizes.unsqueeze(-1))  # in rank order
    kept = torch.zeros_like(valid).scatter(-1, order, take)
    index = order.masked_fill(~take, -1)
    if index.shape[-1] < slots:
        index = torch.nn.functional.pad(index, (0, slots - index.shape[-1]), value=-1)
    index = index[..., :slots]
    at = torch.where(index < 0, NEVER, positions.gather(-1, index.clamp(min=0)))
    ascending, moved = at.sort(-1)
    return torch.where(ascending == NEVER, -1, ascending), index.gather(-1, moved), kept


def recall_scores(kf: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, k_sum: torch.Tensor) -> torch.Tensor:
    """LoLA's self-recall error ‖v − Sᵀφ(k) / (zᵀφ(k))‖ of candidates kf (..., C, F), v (..., C, Dv) against the
    state kv (..., F, Dv), k_sum (..., F); an empty state (zᵀφ(k) = 0) recalls 0."""
    num = kf @ kv
    den = kf @ k_sum.unsqueeze(-1)
    seen = den > 0
    recalled = num.div_(torch.where(seen, den, 1.0)).masked_fill_(~seen, 0.0)
    return torch.linalg.vector_norm(recalled.sub_(v), dim=-1)


def attention_scores(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor,
                     positions: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """The softmax mass each candidate (keys (..., C, D) at ``positions`` (..., C)) receives from the queries
    (..., Q, D) at ``query_positions`` (Q,), the softmax taken over the candidates each query sees."""
    scores = (queries @ keys.transpose(-1, -2)) * scale  # (..., Q, C)
    sees = (positions.unsqueeze(-2) <= query_positions.unsqueeze(-1)) & valid.unsqueeze(-2)
    scores = scores.masked_fill(~sees, NEG_INF)
    top = finite(scores.amax(-1, keepdim=True))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    return (weights / torch.where(total > 0, total, torch.ones_like(total))).sum(-2)


def oracle_scores(cache: SparseCache, positions: torch.Tensor) -> torch.Tensor:
    """1 where the oracle keeps a position, else 0."""
    assert cache.keep is not None
    keep = cache.keep.to(positions.device).expand(*positions.shape[:-1], cache.keep.shape[-1])
    inside = (positions >= 0) & (positions < keep.shape[-1])
    picked = keep.gather(-1, positions.clamp(0, keep.shape[-1] - 1))
    return (picked & inside).to(torch.float64)


def scores_for(cache: SparseCache, hybrid: Hybrid, *, kf: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor, valid: torch.Tensor, kv: torch.Tensor, k_sum: torch.Tensor,
               queries: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """The candidates' scores under ``cache.score``."""
    if cache.score == "recall":
        return recall_scores(kf, v, kv, k_sum)
    if cache.score == "attention":
        return attention_scores(queries, query_positions, keys, positions, valid, hybrid.scale)
    return oracle_scores(cache, positions)


def by_budget(sizes: torch.Tensor, slots: int) -> list[tuple[torch.Tensor | None, int]]:
    """The rows (R,) grouped by budget for the boundary decisions and the cache term (here and in the decoding
    step, :class:`~linattn.decode.SparseDecodeStep`): each row's width is the least
    power of two ≥ its size (at most the slots), so a group works at most twice as wide as its rows' budgets. One
    group (all rows, index None) when every row has the same width."""
    widths = [min(slots, 1 << max(0, int(size) - 1).bit_length()) for size in sizes.tolist()]
    if len(set(widths)) <= 1:
        return [(None, slots)]
    table = torch.tensor(widths, device=sizes.device)
    return [((table == width).nonzero().squeeze(-1), width) for width in sorted(set(widths))]


def is_member(positions: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Whether each of positions (..., X) is one of members (..., L) (−1 in members matches nothing)."""
    if members.shape[-1] == 0:
        return torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    hit = positions.unsqueeze(-1) == members.unsqueeze(-2)
    return (hit & (members >= 0).unsqueeze(-2)).any(-1)


def sorted_table(members: torch.Tensor) -> torch.Tensor:
    """Cache positions (..., L), ascending with −1 in the unused slots at the end, as one ascending sequence
    (NEVER in the unused slots) for ``searchsorted``."""
    return torch.where(members >= 0, members, NEVER).contiguous()


def slot_of(positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions (*lead, X) and a sorted table (*lead', L) (:func:`sorted_table`; lead' a prefix of lead), each
    position's slot in the table and whether it is there: O(X·log L), where comparing every pair is O(X·L)."""
    extra = positions.dim() - table.dim()
    flat = positions.reshape(*positions.shape[: table.dim() - 1], -1) if extra else positions.contiguous()
    slot = torch.searchsorted(table, flat).clamp_(max=table.shape[-1] - 1)
    found = (table.gather(-1, slot) == flat) & (flat >= 0)
    return slot.view(positions.shape), found.view(positions.shape)


def in_cache(positions: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """:func:`is_member` for members (..., L) ascending with −1 at the end (every cache's positions are), by
    binary search; positions (..., X) with the same leading dims."""
    if members.shape[-1] == 0:
        return torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    return slot_of(positions, sorted_table(members))[1]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of x (..., X, D) at index (..., K) or (..., b, K) (indices < 0 give row 0; mask them yourself) →
    (..., K, D) or (..., b, K, D). Whole rows are copied (advanced indexing), not element by element."""
    batch, length = x.shape[:-2], x.shape[-2]
    flat = x.reshape(-1, x.shape[-1])  # (R·X, D)
    rows = index.clamp(min=0).reshape(batch.numel(), -1)
    rows = rows + (torch.arange(rows.shape[0], device=x.device) * length).unsqueeze(-1)
    return flat.index_select(0, rows.flatten()).reshape(*batch, *index.shape[len(batch):], x.shape[-1])


def decide(
    cache: SparseCache, hybrid: Hybrid, block: int, n0: int, end: int, slots: int, ring_start: int,
    xpos: torch.Tensor, xkeep: torch.Tensor, kf: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
    carried: torch.Tensor, linear: LinearAttentionState, index_of: Any, queries: torch.Tensor, query_first: int,
    width: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The boundaries of this call, in order, with the state's sums kept incrementally: the cache of each query
    block of the call ((..., width) each; width: the most any row holds, default the slots) and every row's entry
    time (..., X). Log-space maps: ``scales`` = (each row's own maximum m (..., X), R_{n0−1} … R_{end−1}
    (..., N + 1)), kf the rows at their own maxima, and the sums at R_{t0−1} at boundary t0
    (:mod:`.sparse_scales`).

    Between two boundaries the sums take exactly the candidates of the first that were not kept (the dropped
    cached pairs at the boundary, the other leaving pairs as they leave), so each boundary adds those in one
    product."""
    window, device = hybrid.window, xpos.device
    batch = xpos.shape[:-1]
    sizes = cache.sizes_for(batch, device)
    rows_after_slots = torch.arange(xpos.shape[-1], device=device) >= slots
    entry = torch.where(xkeep & ~in_cache(xpos, carried) & rows_after_slots, xpos + window, NEVER)
    entry = torch.cat([entry, entry.new_full((*batch, 1), NEVER)], -1)  # a spare column for the rows −1
    kv, k_sum = linear.kv, linear.k_sum
    width = slots if width is None else width
    carried = carried[..., :width]  # a row's pairs lie in its first slots (its budget ≤ width)
    selections = [] if n0 % block == 0 and n0 > 0 else [carried]
    member_rows = index_of(carried)
    at = linear.shift  # log-space maps: the sums' scale
    # (features masked to what enters, values, their scales (log-space maps) or None)
    entering: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    first = max(-(-n0 // block) * block, block)
    if first < end and first > n0:  # pairs leaving uncached between the call's start and its first boundary
        lo = max(n0 - window, ring_start, 0)
        rows = slots + torch.arange(lo - ring_start, max(lo, first - window) - ring_start, device=device)
        enters = ((entry[..., rows] >= n0) & (entry[..., rows] <= first - 1)).unsqueeze(-1)
        entering = (kf[..., rows, :] * enters, xv[..., rows, :], scales[0][..., rows] if scales else None)
    for t0 in range(first, end, block):
        if scales is not None:  # the sums moved to R_{t0−1}, the entering rows added there
            rho = scales[1][..., t0 - n0]
            kv, k_sum = carried_to(kv, k_sum, at, rho)
            at = rho
            if entering is not None and entering[2] is not None:
                added = sums_at(entering[0], entering[2], entering[1], rho)
                kv, k_sum = kv + added[0], k_sum + added[1]
        elif entering is not None:
            kv = torch.baddbmm(kv.flatten(0, -3), entering[0].flatten(0, -3).transpose(-1, -2),
                               entering[1].flatten(0, -3)).view_as(kv)
            k_sum = k_sum + entering[0].sum(-2)
        lo = max(t0 - window, 0)
        leaving = slots + torch.arange(lo - ring_start, t0 - window + block - ring_start, device=device)
        rows = torch.cat([member_rows, leaving.expand(*batch, -1)], -1)
        safe = rows.clamp(min=0)
        valid = (rows >= 0) & xkeep.gather(-1, safe)
        positions = torch.where(valid, xpos.gather(-1, safe), -1)
        features, values = gather_rows(kf, rows) * valid.unsqueeze(-1), gather_rows(xv, rows)
        start = t0 - block - query_first
        scores = scores_for(cache, hybrid, kf=features, v=values,
                            keys=gather_rows(xk, rows) if cache.score == "attention" else values,
                            positions=positions, valid=valid, kv=kv, k_sum=k_sum,
                            queries=queries[..., start : start + block, :],
                            query_positions=torch.arange(t0 - block, t0, device=device))
        chosen, index, kept = choose(scores, positions, valid, sizes, width)
        was = torch.arange(rows.shape[-1], device=device) < member_rows.shape[-1]
        target = _spare(rows, entry)
        new_entry = torch.where(was & valid & ~kept, t0, torch.where(kept, NEVER, entry.gather(-1, target)))
        entry.scatter_(-1, target, new_entry)  # (entry is this call's own tensor)
        entering = (features * (valid & ~kept).unsqueeze(-1), values,
                    scales[0].gather(-1, safe).masked_fill(~valid, NEG_INF) if scales else None)
        member_rows = rows.gather(-1, index.clamp(min=0)).masked_fill(index < 0, -1)
        selections.append(chosen)
    return selections, entry[..., :-1]


def _spare(rows: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    return torch.where(rows < 0, entry.shape[-1] - 1, rows)


def cache_selections(hybrid: Hybrid, cache: SparseCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """The cache of each query block of a sequence read from its start (no state), as every form decides it (no
    gradient): (..., ⌈N / B⌉, L) positions ascending, −1 in unused slots; query t's cache is row t // B (B the
    cache's block), of which it weighs exactly the pairs j ≤ t − W. Every other visible pair outside the window and
    the sinks is in its linear part. For fitting maps with the cache in place (the hybrid row's exact keys)."""
    window, sinks, n, device = hybrid.window, hybrid.sinks, q.shape[-2], q.device
    block, slots, batch = cache.block_for(window), cache.largest, q.shape[:-2]
    with torch.no_grad():
        keep = torch.ones(k.shape[:-1], dtype=torch.bool, device=device) if keep is None else keep
        xpos = torch.cat([torch.full((slots,), -1, device=device), torch.arange(n, device=device)])
        xpos = xpos.expand(*batch, slots + n)
        xkeep = torch.cat([torch.zeros(*batch, slots, dtype=torch.bool, device=device), keep], -1) & (xpos >= sinks)
        xk = torch.cat([k.new_zeros(*batch, slots, k.shape[-1]), k], -2)
        xv = torch.cat([v.new_zeros(*batch, slots, v.shape[-1]), v], -2)
        kf = hybrid.key_logs(xk, xkeep)
        state = empty_window_state(hybrid, k, v, kf.shape[-1])
        scales = None
        if hybrid.log_space:  # the rows at their own maxima, the sums at R_{t0−1} (sparse_scales.py)
            kf, m = own_scale(kf)
            scales = (m, reading(state.linear.shift, m[..., slots:]))
        carried = torch.full((*batch, slots), -1, dtype=torch.long, device=device)

        def index_of(positions: torch.Tensor) -> torch.Tensor:
            return torch.where(positions < 0, -1, slots + positions)

        selections, _ = decide(cache, hybrid, block, 0, n, slots, 0, xpos, xkeep, kf, xk, xv, carried,
                                state.linear, index_of, q, 0, scales=scales)
    return torch.stack(selections, -2)
