"""The lean step of the window op with a sparse exact cache (``linear_attention(..., window=W, sinks=S,
sparse_cache=...)``), one token per call: :class:`SparseDecodeStep`.

It is :class:`~linattn.decode.WindowDecodeStep` with up to λ more exact slots per query head beside the sinks and the
ring, holding the cached pairs (keys, values, features φ(k)) and their positions. Per token t:

- at a boundary (t = b·B, b ≥ 1, before the token's output) the candidates — the cache and the B pairs of the ring
  that leave the window before the next boundary — are scored against the linear sums as the previous query read
  them (``"recall"``), the B stored queries (``"attention"``) or the oracle's positions, and chosen, by the
  functions that define the op (:mod:`linattn.exact.forms.boundary`); the cached pairs not chosen enter the linear
  sums there, and each leaving ring pair is marked to stay or not;
- key t − W leaves the window: into the linear sums unless the last boundary kept it (per head);
- the output is the window step's over every exact slot, a cached pair exact once it has left the window
  (position + W ≤ t).

Boundaries cost O((λ + B)·(λ + F·Dv)) per row once every B tokens; a token between them costs the window step's
ops on S + W slots, the cache's pairs scored and summed under the same row maximum, and two small ops more (the
leaving key's flag, the cache's exact flags; a third stores the query for ``"attention"``). The cache is per query
head and packed as :class:`~linattn.SparseCacheState` packs it: each head holds its own size's slots (keys, values,
features φ(k), positions) in flat buffers, row after row, so a budget split across heads costs its total, not the
largest head's size for every head. With every head at the same size the buffers are (B·H, λ, ·) as they lie and
join the ring's batched products; else a token scores each packed slot against its row's query (by index) and sums
each row's slots as one bag (no padding). A boundary decides each group of heads of one budget width (the least
power of two that holds its sizes) on that many slots, read from the packed buffers and written back into them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from .._validate import sparse_cache
from ..errors import LinearAttentionError
from ..features import is_log_space
from ..state import SparseCache, SparseCacheState, WindowAttentionState
from .forms.boundary import NEVER, by_budget, choose, scores_for
from .forms.hybrid import Hybrid
from .window_step import WindowDecodeStep


class _Group(NamedTuple):
    """Rows of one budget width for the boundary decisions: the query-head rows (R_g,), the same as an index into
    the per-query-head buffers and into the key/value buffers (None: all their rows, as they lie), each row's slots
    in the packed buffers (R_g, width) and which of them it holds, the width, and the cache as these rows see it
    (the oracle's positions per row)."""

    rows: torch.Tensor
    select: torch.Tensor | None
    kv_select: torch.Tensor | None
    where: torch.Tensor
    held: torch.Tensor
    width: int
    cache: SparseCache


class SparseDecodeStep(WindowDecodeStep):
    """The causal window op with a sparse exact cache one token at a time, from the
    :class:`~linattn.WindowAttentionState` (with its ``cache``) that ``linear_attention(..., window=W, sinks=S,
    sparse_cache=cache, return_state=True)`` returned (see the module docstring).

    Args:
        fmap: the feature map the state was built with (an ordinary map: features, not log-features).
        state: batch shape (B, H), carrying a :class:`~linattn.SparseCacheState`. Copied once into the buffers.
        cache: the :class:`~linattn.SparseCache` the state was made with (its size, score, block, oracle keep).
        eps, window_factor, softmax_scale, kv_heads: as :class:`~linattn.decode.WindowDecodeStep`.

    ``state()`` returns the state after every token stepped, cache included; ``index_select`` selects batch rows.
    Left-padded batches whose rows keep their own sinks (:meth:`WindowDecodeStep.stack`) are not covered.
    """

    def __init__(
        self, fmap: nn.Module, state: WindowAttentionState, cache: SparseCache, *, eps: float = 1e-6,
        window_factor: Any = None, softmax_scale: float | None = None, kv_heads: int | None = None,
    ) -> None:
        carried = state.cache
        if carried is None:
            raise LinearAttentionError(
                "state: made without sparse_cache=; continue it with WindowDecodeStep, or prefill with sparse_cache="
            )
        if is_log_space(fmap):
            raise LinearAttentionError(
                f"feature_map {type(fmap).__name__}: a log-space map (FAVOR+ and kin); this step, on the window "
                "step, keeps every sum at scale 1: continue the state with SparseComposedDecodeStep (lean_step "
                "chooses it)"
            )
        block, slots = cache.block_for(state.window), cache.largest
        if carried.block != block or carried.slots != slots:
            raise LinearAttentionError(
                f"cache: the state's cache was made with block={carried.block} and {carried.slots} "
                f"slots; this SparseCache has block={block} and {slots}: pass the same sparse_cache"
            )
        wrong = cache.score_mismatch(carried, state.num_tokens)
        if wrong is not None:
            raise LinearAttentionError(f"cache: {wrong}")
        super().__init__(fmap, state, eps=eps, window_factor=window_factor, softmax_scale=softmax_scale,
                         kv_heads=kv_heads)
        batch, heads, features, values = self._shape
        wrong = cache.heads_mismatch(heads)
        if wrong is not None:
            raise LinearAttentionError(f"cache: {wrong} (the state's)")
        if not cache.made(carried.sizes):
            raise LinearAttentionError(f"cache: the state's cache was made with other per-head sizes (largest "
                                       f"{carried.slots}); this SparseCache has {cache.size!r}: pass the same one")
        self.cache, self.block, self.slots = cache, block, slots
        rows, dim = batch * heads, self.keys.shape[-1]
        dtype, device = self.kv.dtype, self.kv.device
        # the linear part's weight β per row (B·H,), or None for β = 1
        self.linear_weight = None if cache.linear_weight == 1 else torch.as_tensor(
            cache.linear_weight, dtype=dtype, device=device).expand(batch, heads).reshape(-1).clone()
        self.ring_slots = self.sinks + self.window
        self.sizes = cache.sizes_for((batch, heads), device)  # (B, H)
        # the hybrid's options as the scores take them (the "attention" score's softmax scale); the map through fmap,
        # not through this step (no reference cycle keeping the buffers alive after the step is dropped)
        self.hybrid = Hybrid(lambda x, is_query: fmap(x), log_space=False, window=self.window, sinks=self.sinks,
                             factor=None, scale=self.scale, eps=self.eps, min_denom=None)
        with torch.no_grad():
            # the cache packed as the state holds it: row r = b·H + h has its own size's slots, row after row
            self._index_packing()
            self.even = slots > 0 and bool((self.sizes == slots).all())  # every row at λ: (B·H, λ, ·)
            held = carried.positions.to(device)  # (B, H, λ), −1 where empty or beyond a head's size
            filled = held >= 0
            cached_features = (self._map(carried.keys.detach().to(device=device, dtype=dtype), False)
                               .masked_fill(~filled.unsqueeze(-1), 0.0)
                               if slots else self.key_features.new_zeros(batch, heads, 0, features))
            mask = self._slot_mask()
            self.cached_keys = carried.packed_keys.detach().to(device=device, dtype=dtype).clone()  # (M, d)
            self.cached_values = carried.packed_values.detach().to(device=device, dtype=dtype).clone()  # (M, Dv)
            self.cached_features = cached_features.reshape(rows, slots, features)[mask]  # (M, F)
            # positions, NEVER in an empty slot: a cached pair is exact at t when its position ≤ t − W
            packed = carried.packed_positions.to(device)
            self.positions = torch.where(packed >= 0, packed, NEVER)  # (M,)
            self.exact = torch.zeros_like(self.positions, dtype=torch.bool)  # (M,): an exact key now
            # per ring slot (position p in p mod W): whether the last boundary kept the pair, so it stays exact when
            # it leaves the window (set at the boundary that decides p, which comes before p leaves)
            self.stays = torch.zeros(rows, self.window, dtype=torch.bool, device=device)
            t = self.num_tokens
            ring = torch.arange(max(0, t - self.window), t, device=device)
            if ring.numel() and slots:
                kept = (ring.view(1, -1, 1) == held.reshape(rows, 1, slots)).any(-1)  # (B·H, ring)
                self.stays[:, ring % self.window] = kept
            torch.le(self.positions, t - self.window, out=self.exact)
            # "attention": the queries since the last boundary, position p in slot p mod B
            self.queries: torch.Tensor | None = None
            if cache.score == "attention":
                self.queries = torch.zeros(rows, block, dim, dtype=dtype, device=device)
                since = carried.queries.shape[-2]
                if since:
                    at = torch.arange(t - since, t, device=device) % block
                    self.queries[:, at] = carried.queries.detach().to(dtype).reshape(rows, since, dim)

    def _index_packing(self) -> None:
        """The packed buffers' layout from ``sizes``: each slot's row (``row_of``, (M,)), the slots in order
        (``slot_index``) and each row's first slot (``starts``, (B·H,)), for the sums per row."""
        sizes = self.sizes.reshape(-1)
        self.row_of = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes)  # (M,)
        self.slot_index = torch.arange(self.row_of.numel(), device=sizes.device)
        self.starts = torch.cumsum(sizes, 0) - sizes

    def _slot_mask(self) -> torch.Tensor:
        """(B·H, λ) bool: the slots each row holds (the packing of the cache buffers)."""
        return SparseCacheState.slot_mask(self.sizes.reshape(-1), self.slots)

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        Inference only; output in q's dtype, the buffers in the state's."""
        out_dtype = q.dtype
        q, k, v, qf, kf, kept = self._inputs(q, k, v, keep)
        t, window, sinks = self.num_tokens, self.window, self.sinks
        if t and t % self.block == 0 and self.slots:
            self._decide(t)
        slot = sinks + t % window
        if t >= window:  # key t − W leaves the window: a sink or a kept pair stays exact, any other enters the sums
            if t - window < sinks:
                self.live[:, t - window] = self.live[:, slot]
            else:
                stays = self.stays[:, t % window].unsqueeze(-1)
                self._enter_linear(slot, self.key_features[:, slot].masked_fill(stays, 0.0))
        self._write(t, slot, k, v, kf, kept)
        if self.queries is not None:
            self.queries[:, t % self.block] = q.reshape(-1, q.shape[-1])
        self.num_tokens = t + 1
        # the cached pairs that have left the window are exact
        torch.le(self.positions, t - window, out=self.exact)
        dead = ~self.live
        if self.even:
            dead = torch.cat([dead, ~self.exact.view(dead.shape[0], -1)], 1)
        return self._output(q, qf, dead, out_dtype)

    # The exact part. With every row at the same size (``even``) the packed buffers are (B·H, λ, ·) as they lie:
    # the cache's slots join the ring's in the window step's one softmax (batched products, below). Else each packed
    # slot is scored against its row's query through ``row_of`` and summed per row as a bag (_exact, _row_sums).

    def _scores(self, q: torch.Tensor) -> torch.Tensor:
        ring = super()._scores(q)
        if not self.even:
            return ring
        rows = ring.shape[0]
        keys = self.cached_keys.view(rows, self.slots, -1)
        return torch.cat([ring, torch.bmm(q.reshape(rows, 1, -1), keys.transpose(1, 2)).view(rows, -1)], 1)

    def _weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        if not self.even:
            return super()._weighted_values(probs)
        ring, rows = self.ring_slots, probs.shape[0]
        values = self.cached_values.view(rows, self.slots, -1)
        cached = torch.bmm(probs[:, ring:].unsqueeze(1), values).squeeze(1)
        return super()._weighted_values(probs[:, :ring]).add_(cached)

    def _feature_weights(self, qf: torch.Tensor) -> torch.Tensor:
        ring = super()._feature_weights(qf)
        if not self.even:
            return ring
        features = self.cached_features.view(ring.shape[0], self.slots, -1)
        return torch.cat([ring, torch.bmm(qf, features.transpose(1, 2)).squeeze(1)], 1)

    def _linear(self, qf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lin_num, lin_den = super()._linear(qf)
        if self.linear_weight is None:
            return lin_num, lin_den
        return lin_num.mul_(self.linear_weight.unsqueeze(-1)), lin_den.mul_(self.linear_weight)

    def _exact(self, q: torch.Tensor, qf: torch.Tensor, dead: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.even or not self.slots:  # (even: ``dead`` covers the cache's slots too)
            return super()._exact(q, qf, dead)
        dtype, row_of, rows = self.kv.dtype, self.row_of, dead.shape[0]
        ring = self._scores(q).mul_(self.scale).masked_fill_(dead, float("-inf"))  # (B·H, S + W)
        queries = q.reshape(rows, -1).index_select(0, row_of)  # (M, d)
        cached = (queries * self.cached_keys).sum(-1).mul_(self.scale).masked_fill_(~self.exact, float("-inf"))
        top = ring.amax(-1).scatter_reduce_(0, row_of, cached, "amax").clamp_(min=-torch.finfo(dtype).max)
        probs = ring.sub_(top.unsqueeze(-1)).exp_()
        cached_probs = cached.sub_(top.index_select(0, row_of)).exp_()  # 0 where not exact
        win_num = self._weighted_values(probs).add_(self._row_sums(self.cached_values, cached_probs))
        win_den = probs.sum(-1).index_add_(0, row_of, cached_probs)
        if self.gamma is not None:
            return win_num, win_den, None
        # the exact cached pairs' mass φ(q)·Σ φ(k): their features summed per row, then one product per row
        exact_features = self._row_sums(self.cached_features, self.exact.to(dtype))  # (B·H, F)
        cached_mass = torch.bmm(qf, exact_features.unsqueeze(-1)).view(rows)
        mass = self._feature_weights(qf).masked_fill_(dead, 0.0).sum(-1)
        return win_num, win_den, mass.add_(cached_mass)

    def _row_sums(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ weights·x over each row's packed slots: x (M, ·), weights (M,) → (B·H, ·). The slots of a row lie
        together, so this is a weighted sum of bags (``embedding_bag``), a few times faster on CPU than adding
        each slot into its row by index."""
        return torch.nn.functional.embedding_bag(self.slot_index, x, self.starts, mode="sum",
                                                 per_sample_weights=weights)

    def _budget_groups(self) -> list[_Group]:
        """The rows grouped by budget as the chunked form groups them
        (:func:`~linattn.exact.forms.boundary.by_budget`: each at the least power of two that holds its size),
        with each group's slots in the packed buffers; a boundary decides each group at its own width, so a head
        with a small budget does not score as many candidates as the largest. Made at each boundary from ``sizes``
        (a few small ops), so the step holds nothing more than the packed cache and its layout."""
        sizes = self.sizes.reshape(-1)
        device = sizes.device
        starts = torch.cumsum(sizes, 0) - sizes
        keep = self.cache.keep
        keep_rows = None
        if keep is not None:  # the oracle's positions per row (B·H, P)
            keep_rows = keep.to(device).expand(*self._shape[:2], keep.shape[-1]).reshape(sizes.numel(), -1)
        groups = []
        for index, width in by_budget(sizes, self.slots):
            rows = torch.arange(sizes.numel(), device=device) if index is None else index
            held = torch.arange(width, device=device) < sizes.index_select(0, rows).unsqueeze(-1)  # (R_g, width)
            where = (starts.index_select(0, rows).unsqueeze(-1) + torch.arange(width, device=device)).masked_fill(
                ~held, 0)
            cache = self.cache if keep_rows is None else dataclasses.replace(
                self.cache, size=sizes.index_select(0, rows).cpu(), keep=keep_rows.index_select(0, rows))
            kv_select = None if index is None and self.group == 1 else rows // self.group
            groups.append(_Group(rows, index, kv_select, where, held, width, cache))
        return groups

    def _decide(self, t0: int) -> None:
        """The boundary t0: score the candidates (the cache and the ring's pairs t0 − W … t0 − W + B − 1), keep the
        best ``size`` per head (``choose``), let the cached pairs not kept enter the linear sums, and mark which
        leaving pairs stay exact. Each group of rows (:meth:`_budget_groups`) decides on its slots, taken from the
        packed buffers at the group's width, and writes its choice back into them."""
        for group in self._budget_groups():
            self._decide_rows(t0, group)

    def _decide_rows(self, t0: int, group: _Group) -> None:
        _, _, features, values = self._shape
        rows, width, block, window = group.rows, group.width, self.block, self.window
        count, device = rows.numel(), self.kv.device
        leaving = torch.arange(t0 - window, t0 - window + block, device=device)  # (B,) positions
        at = self.sinks + leaving % window  # their ring slots
        def ring(x: torch.Tensor, kv_rows: bool) -> torch.Tensor:  # the leaving pairs' ring slots (R_g, B[, ·])
            index = group.kv_select if kv_rows else group.select
            return (x if index is None else x.index_select(0, index))[:, at]

        leaving_valid = (leaving >= self.sinks) & ring(self.live, False)  # not sinks, not padding, seen
        flat = group.where.reshape(-1)

        def held(x: torch.Tensor, fill: float) -> torch.Tensor:  # the group's slots (R_g, width[, ·]) of a buffer
            out = x.index_select(0, flat).view(count, width, *x.shape[1:])
            mask = group.held if x.dim() == 1 else group.held.unsqueeze(-1)
            return out.masked_fill_(~mask, fill)

        old_positions = held(self.positions, NEVER)  # (R_g, width) ascending, NEVER in empty slots
        old_valid = old_positions != NEVER
        old_features, old_values = held(self.cached_features, 0.0), held(self.cached_values, 0.0)
        positions = torch.cat([old_positions.masked_fill(~old_valid, -1), leaving.expand(count, -1)], 1)  # (R_g, C)
        valid = torch.cat([old_valid, leaving_valid], 1)
        keys = torch.cat([held(self.cached_keys, 0.0), ring(self.keys, True)], 1)
        vals = torch.cat([old_values, ring(self.values, True)], 1)
        feats = torch.cat([old_features, ring(self.key_features, False)], 1)
        kv = self.kv.view(-1, features, values).index_select(0, rows)
        k_sum = self.k_sum.view(-1, features).index_select(0, rows)
        queries = self.queries.index_select(0, rows) if self.queries is not None else keys  # ("attention" only)
        scores = scores_for(group.cache, self.hybrid, kf=feats, v=vals, keys=keys, positions=positions, valid=valid,
                            kv=kv, k_sum=k_sum, queries=queries,
                            query_positions=torch.arange(t0 - block, t0, device=device))
        sizes = self.sizes.reshape(-1).index_select(0, rows)
        chosen = choose(scores, positions, valid, sizes, width)[0]
        chosen = chosen.masked_fill(chosen < 0, NEVER)  # ascending, NEVER in empty slots (as ``positions``)

        def among_chosen(x: torch.Tensor) -> torch.Tensor:  # whether each position of x (R_g, X) was chosen
            found = torch.searchsorted(chosen, x).clamp_(max=width - 1)
            return chosen.gather(1, found) == x

        # the cached pairs not kept enter the linear sums at the boundary (they have all left the window)
        evicted = old_features * (old_valid & ~among_chosen(old_positions)).unsqueeze(-1)
        self.kv.view(-1, features, values).index_add_(0, rows, torch.bmm(evicted.transpose(1, 2), old_values))
        self.k_sum.view(-1, features).index_add_(0, rows, evicted.sum(1))
        # the new cache: each chosen pair's row among the candidates, an old slot (found among the ascending old
        # positions) or a leaving pair (by its position); empty slots get zeros. A row keeps at most its size, at
        # the front, so its first ``size`` slots are its packed ones
        first, candidates = t0 - window, width + block
        index = torch.where(chosen < first, torch.searchsorted(old_positions, chosen), width + chosen - first)
        index = index.clamp_(max=candidates - 1) + torch.arange(count, device=device).unsqueeze(-1) * candidates
        index, filled = index[group.held], (chosen != NEVER)[group.held]  # the packed slots, in order
        dest = group.where[group.held]

        def picked(x: torch.Tensor) -> torch.Tensor:  # candidates (R_g, C, ·) → the packed slots' rows (M_g, ·)
            return x.reshape(count * candidates, -1).index_select(0, index).mul_(filled.unsqueeze(-1))

        self.cached_keys.index_copy_(0, dest, picked(keys))
        self.cached_values.index_copy_(0, dest, picked(vals))
        self.cached_features.index_copy_(0, dest, picked(feats))
        self.stays[rows.unsqueeze(-1), (leaving % window).unsqueeze(0)] = among_chosen(
            leaving.expand(count, -1).contiguous())
        self.positions.index_copy_(0, dest, chosen[group.held])

    @classmethod
    def stack(cls, steps: list[WindowDecodeStep], pads: list[int]) -> WindowDecodeStep:
        """Refused: the rows of a left-padded batch would each need their own boundaries and sinks."""
        raise LinearAttentionError(
            "stack: a step with a sparse cache does not join left-padded rows (each row would need its own sinks and "
            "boundaries); step the rows one by one, or prefill them without padding"
        )

    def state(self) -> WindowAttentionState:
        """The state after every token stepped, its cache included (new tensors: the step may go on)."""
        out = super().state()
        batch, heads, _, _ = self._shape
        dim, t = self.keys.shape[-1], self.num_tokens
        held = (t - 1) % self.block + 1 if t else 0  # the queries since the last boundary, the first in slot 0
        if self.queries is not None:
            queries = self.queries[:, :held].clone().view(batch, heads, held, dim)
        else:
            queries = self.cached_keys.new_zeros(batch, heads, 0, dim)
        out.cache = SparseCacheState(self.sizes.clone(), self.positions.masked_fill(self.positions == NEVER, -1),
                                     self.cached_keys.clone(), self.cached_values.clone(), queries, self.block)
        return out

    def index_select(self, dim: int, index: torch.Tensor) -> SparseDecodeStep:
        """A step on the selected batch rows (beam search; ``dim`` 0, the batch), its buffers indexed."""
        new = super().index_select(dim, index)
        assert isinstance(new, SparseDecodeStep)
        heads = self._shape[1]
        index = index.to(self.kv.device)
        rows = (index.unsqueeze(-1) * heads + torch.arange(heads, device=index.device)).reshape(-1)
        new.stays = self.stays.index_select(0, rows)
        if self.linear_weight is not None:
            new.linear_weight = self.linear_weight.index_select(0, rows)
        if self.queries is not None:
            new.queries = self.queries.index_select(0, rows)
        # the packed slots of the selected rows, row after row
        sizes = self.sizes.reshape(-1)
        starts = torch.cumsum(sizes, 0) - sizes
        counts = sizes.index_select(0, rows)
        offsets = torch.arange(int(counts.sum()), device=index.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)
        picked = torch.repeat_interleave(starts.index_select(0, rows), counts) + offsets
        new.positions, new.exact = self.positions.index_select(0, picked), self.exact.index_select(0, picked)
        new.cached_keys, new.cached_values, new.cached_features = (
            x.index_select(0, picked) for x in (self.cached_keys, self.cached_values, self.cached_features))
        new.sizes = self.sizes.index_select(0, index)
        new._index_packing()
        keep = self.cache.keep
        if keep is not None and keep.dim() >= 3 and keep.shape[-3] > 1:  # an oracle given per batch row
            new.cache = dataclasses.replace(self.cache, keep=keep.index_select(-3, index.to(keep.device)))
        return new


def sparse_step(fmap: nn.Module, state: WindowAttentionState, options: dict[str, Any], kv_heads: int
                ) -> SparseDecodeStep:
    """The lean sparse-cache step from ``state`` with the call's ``linear_attention`` options (``sparse_cache``: an
    int or a :class:`~linattn.SparseCache`)."""
    cache = sparse_cache(options["sparse_cache"], state.window, "add", None)
    assert cache is not None
    return SparseDecodeStep(fmap, state, cache, eps=options.get("eps", 1e-6),
                            window_factor=options.get("window_factor"), softmax_scale=options.get("softmax_scale"),
                            kv_heads=kv_heads)

