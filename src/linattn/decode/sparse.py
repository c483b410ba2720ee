"""The lean step of the window op with a sparse exact cache (``linear_attention(..., window=W, sinks=S,
sparse_cache=...)``), one token per call: :class:`SparseDecodeStep`.

It is :class:`~linattn.decode.WindowDecodeStep` with λ more exact slots per query head after the sinks and the
ring, holding the cached pairs (keys, values, features φ(k)) and their positions. Per token t:

- at a boundary (t = b·B, b ≥ 1, before the token's output) the candidates — the cache and the B pairs of the ring
  that leave the window before the next boundary — are scored against the linear sums as the previous query read
  them (``"recall"``), the B stored queries (``"attention"``) or the oracle's positions, and chosen, by the
  functions of :mod:`linattn.forms.window.sparse` that define the op; the cached pairs not chosen enter the linear
  sums there, and each leaving ring pair is marked to stay or not;
- key t − W leaves the window: into the linear sums unless the last boundary kept it (per head);
- the output is the window step's over every exact slot, a cached pair exact once it has left the window
  (position + W ≤ t).

Boundaries cost O((λ + B)·(λ + F·Dv)) per row once every B tokens; a token between them costs the window step's
ops on S + W + λ slots and two small ops more (the leaving key's flag, the cache's exact flags; a third stores the
query for ``"attention"``). The cache is per query head. Without grouped-query attention its keys and values sit
in the ring's buffers after the ring's slots, so one product scores every exact key; with g > 1 query heads per
key/value head the ring holds each key once per key/value head and the cache has its own (B·H, λ, ·) buffers: two
products, joined before the one softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._validate import sparse_cache
from ..errors import LinearAttentionError
from ..features import is_log_space
from ..forms.window.hybrid import Hybrid
from ..forms.window.sparse import NEVER, choose, scores_for, sizes_for
from ..state import SparseCache, SparseCacheState, WindowAttentionState
from .window import WindowDecodeStep


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
                f"feature_map {type(fmap).__name__}: the sparse cache takes ordinary maps, not log-space ones "
                "(FAVOR+ and kin); the step keeps every sum at scale 1"
            )
        block, slots = cache.block_for(state.window), cache.largest
        if carried.block != block or carried.positions.shape[-1] != slots:
            raise LinearAttentionError(
                f"cache: the state's cache was made with block={carried.block} and {carried.positions.shape[-1]} "
                f"slots; this SparseCache has block={block} and {slots}: pass the same sparse_cache"
            )
        super().__init__(fmap, state, eps=eps, window_factor=window_factor, softmax_scale=softmax_scale,
                         kv_heads=kv_heads)
        batch, heads, features, values = self._shape
        if not isinstance(cache.size, int) and len(cache.size) != heads:
            raise LinearAttentionError(f"cache: {len(cache.size)} per-head sizes for a state of {heads} heads; give "
                                       "one per query head")
        self.cache, self.block, self.slots = cache, block, slots
        rows, group, dim = batch * heads, self.group, self.keys.shape[-1]
        dtype, device = self.kv.dtype, self.kv.device
        self.ring_slots = self.sinks + self.window
        self.sizes = sizes_for(cache, torch.Size([batch, heads]), device)  # (B, H)
        # the hybrid's options as the scores take them (the "attention" score's softmax scale); the map through fmap,
        # not through this step (no reference cycle keeping the buffers alive after the step is dropped)
        self.hybrid = Hybrid(lambda x, is_query: fmap(x), log_space=False, window=self.window, sinks=self.sinks,
                             factor=None, scale=self.scale, eps=self.eps, min_denom=None)
        with torch.no_grad():
            filled = carried.positions >= 0  # (B, H, λ)
            cached_keys = carried.keys.detach().to(dtype).reshape(rows, slots, dim)
            cached_values = carried.values.detach().to(dtype).reshape(rows, slots, values)
            cached_features = (self._map(carried.keys.detach().to(dtype), False).masked_fill(~filled.unsqueeze(-1), 0.0)
                               if slots else self.key_features.new_zeros(batch, heads, 0, features))
            # the cache's λ slots per query head after the ring's S + W: features and exact flags always; keys and
            # values too without GQA (one row per query head there), else in buffers of their own
            self.key_features = torch.cat([self.key_features, cached_features.reshape(rows, slots, features)], 1)
            self.live = torch.cat([self.live, self.live.new_zeros(rows, slots)], 1)
            self.own_keys: torch.Tensor | None = None
            self.own_values: torch.Tensor | None = None
            if group == 1:
                self.keys = torch.cat([self.keys, cached_keys], 1)
                self.values = torch.cat([self.values, cached_values], 1)
            else:
                self.own_keys, self.own_values = cached_keys.clone(), cached_values.clone()
            # positions (B·H, λ), NEVER in an empty slot: a cached pair is exact at t when its position ≤ t − W
            self.positions = torch.where(filled, carried.positions, NEVER).reshape(rows, slots).clone()
            # per ring slot (position p in p mod W): whether the last boundary kept the pair, so it stays exact when
            # it leaves the window (set at the boundary that decides p, which comes before p leaves)
            self.stays = torch.zeros(rows, self.window, dtype=torch.bool, device=device)
            t = self.num_tokens
            ring = torch.arange(max(0, t - self.window), t, device=device)
            if ring.numel() and slots:
                kept = (ring.view(1, -1, 1) == self.positions.unsqueeze(1)).any(-1)  # (B·H, ring)
                self.stays[:, ring % self.window] = kept
            # "attention": the queries since the last boundary, position p in slot p mod B
            self.queries: torch.Tensor | None = None
            if cache.score == "attention":
                self.queries = torch.zeros(rows, block, dim, dtype=dtype, device=device)
                held = carried.queries.shape[-2]
                if held:
                    at = torch.arange(t - held, t, device=device) % block
                    self.queries[:, at] = carried.queries.detach().to(dtype).reshape(rows, held, dim)

    @property
    def cached_keys(self) -> torch.Tensor:
        """The cache's keys (B·H, λ, d): a view of the buffer that holds them."""
        return self.keys[:, self.ring_slots :] if self.own_keys is None else self.own_keys

    @property
    def cached_values(self) -> torch.Tensor:
        """The cache's values (B·H, λ, Dv): a view of the buffer that holds them."""
        return self.values[:, self.ring_slots :] if self.own_values is None else self.own_values

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
        torch.le(self.positions, t - window, out=self.live[:, self.ring_slots :])
        return self._output(q, qf, ~self.live, out_dtype)

    def _scores(self, q: torch.Tensor) -> torch.Tensor:
        if self.own_keys is None:  # the cache in the ring's buffer
            return super()._scores(q)
        cached = torch.bmm(q.reshape(-1, 1, q.shape[-1]), self.own_keys.transpose(1, 2)).view(-1, self.slots)
        return torch.cat([super()._scores(q), cached], 1)

    def _weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        if self.own_values is None:
            return super()._weighted_values(probs)
        ring = self.ring_slots
        out = torch.bmm(probs[:, :ring].view(-1, self.group, ring), self.values).view(-1, self.values.shape[-1])
        return out.add_(torch.bmm(probs[:, ring:].unsqueeze(1), self.own_values).squeeze(1))

    def _decide(self, t0: int) -> None:
        """The boundary t0: score the candidates (the cache and the ring's pairs t0 − W … t0 − W + B − 1), keep the
        best ``size`` per head (``choose``), let the cached pairs not kept enter the linear sums, and mark which
        leaving pairs stay exact."""
        batch, heads, features, values = self._shape
        rows, slots, block, window, group = batch * heads, self.slots, self.block, self.window, self.group
        ring_slots, device = self.ring_slots, self.kv.device
        leaving = torch.arange(t0 - window, t0 - window + block, device=device)  # (B,) positions
        at = self.sinks + leaving % window  # their ring slots
        leaving_valid = (leaving >= self.sinks) & self.live[:, at]  # not sinks, not padding, seen

        def per_query_head(x: torch.Tensor) -> torch.Tensor:  # (B·Hkv, ·, ·) → (B·H, ·, ·)
            return x if group == 1 else x.repeat_interleave(group, dim=0)

        old_valid = self.positions != NEVER
        old_features = self.key_features[:, ring_slots:]
        old_values = self.cached_values
        positions = torch.cat([self.positions.masked_fill(~old_valid, -1), leaving.expand(rows, -1)], 1)  # (B·H, C)
        valid = torch.cat([old_valid, leaving_valid], 1)
        keys = torch.cat([self.cached_keys, per_query_head(self.keys[:, at])], 1)
        vals = torch.cat([old_values, per_query_head(self.values[:, at])], 1)
        feats = torch.cat([old_features, self.key_features[:, at]], 1)

        def heads_of(x: torch.Tensor) -> torch.Tensor:  # (B·H, ...) → (B, H, ...)
            return x.view(batch, heads, *x.shape[1:])

        queries = self.queries if self.queries is not None else keys  # (read by "attention" only)
        scores = scores_for(self.cache, self.hybrid, kf=heads_of(feats), v=heads_of(vals), keys=heads_of(keys),
                            positions=heads_of(positions), valid=heads_of(valid), kv=self.kv, k_sum=self.k_sum,
                            queries=heads_of(queries), query_positions=torch.arange(t0 - block, t0, device=device))
        chosen = choose(scores, heads_of(positions), heads_of(valid), self.sizes, slots)[0].view(rows, slots)
        chosen = chosen.masked_fill(chosen < 0, NEVER)  # ascending, NEVER in empty slots (as ``positions``)

        def among_chosen(x: torch.Tensor) -> torch.Tensor:  # whether each position of x (B·H, X) was chosen
            at = torch.searchsorted(chosen, x).clamp_(max=slots - 1)
            return chosen.gather(1, at) == x

        # the cached pairs not kept enter the linear sums at the boundary (they have all left the window)
        evicted = old_features * (old_valid & ~among_chosen(self.positions)).unsqueeze(-1)
        self.kv.view(rows, features, values).baddbmm_(evicted.transpose(1, 2), old_values)
        self.k_sum.view(rows, features).add_(evicted.sum(1))
        # the new cache: each chosen pair's row among the candidates, an old slot (found among the ascending old
        # positions) or a leaving pair (by its position); empty slots get zeros
        first = t0 - window
        index = torch.where(chosen < first, torch.searchsorted(self.positions, chosen), slots + chosen - first)
        index = index.clamp_(max=slots + block - 1)
        filled = (chosen != NEVER).unsqueeze(-1)

        def picked(x: torch.Tensor) -> torch.Tensor:
            return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1])) * filled

        self.cached_keys.copy_(picked(keys))
        self.cached_values.copy_(picked(vals))
        self.key_features[:, ring_slots:] = picked(feats)
        self.stays[:, leaving % window] = among_chosen(leaving.expand(rows, -1).contiguous())
        self.positions.copy_(chosen)

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
        slots, dim, t = self.slots, self.keys.shape[-1], self.num_tokens
        positions = self.positions.masked_fill(self.positions == NEVER, -1).view(batch, heads, slots)
        keys, cached_values = (x.clone(memory_format=torch.contiguous_format).view(batch, heads, slots, -1)
                               for x in (self.cached_keys, self.cached_values))
        held = (t - 1) % self.block + 1 if t else 0  # the queries since the last boundary, the first in slot 0
        if self.queries is not None:
            queries = self.queries[:, :held].clone().view(batch, heads, held, dim)
        else:
            queries = keys.new_zeros(batch, heads, 0, dim)
        out.cache = SparseCacheState(positions, keys, cached_values, queries, self.block)
        return out

    def index_select(self, dim: int, index: torch.Tensor) -> SparseDecodeStep:
        """A step on the selected batch rows (beam search; ``dim`` 0, the batch), its buffers indexed."""
        new = super().index_select(dim, index)
        assert isinstance(new, SparseDecodeStep)
        heads = self._shape[1]
        index = index.to(self.kv.device)
        rows = (index.unsqueeze(-1) * heads + torch.arange(heads, device=index.device)).reshape(-1)
        new.positions, new.stays = self.positions.index_select(0, rows), self.stays.index_select(0, rows)
        if self.queries is not None:
            new.queries = self.queries.index_select(0, rows)
        new.sizes = self.sizes.index_select(0, index)
        if self.own_keys is not None and self.own_values is not None:
            new.own_keys, new.own_values = self.own_keys.index_select(0, rows), self.own_values.index_select(0, rows)
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

