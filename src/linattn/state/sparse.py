"""The sparse exact cache of the window op: its options and its packed state."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import LinearAttentionError

SCORES = ("recall", "attention", "oracle")


@dataclass(frozen=True)
class SparseCache:
    """The sparse exact cache of the window op (``linear_attention(..., window=W, sinks=S, sparse_cache=...)``).

    Beside the window and the sinks, up to ``size`` key/value pairs per head that have left the window stay exact
    (softmax weights, one normaliser with the window); every other pair is in the linear state. Which pairs stay
    is decided at block boundaries, every ``block`` tokens (positions t = b·block): the candidates are the pairs
    in the cache and the ``block`` pairs that will leave the window before the next boundary; the ``size`` with
    the highest score are kept, the other cached pairs enter the linear state at the boundary, and the other
    leaving pairs enter it when they leave the window (as without a cache).

    ``size``   pairs per head: an int, or one per head (a sequence or tensor of H ints: a per-head budget)
    ``score``  ``"recall"`` (LoLA's self-recall error ‖v − Sᵀφ(k)/(zᵀφ(k))‖ against the linear state at the
               boundary: the pairs the state would recall worst stay exact), ``"attention"`` (the softmax mass
               the pair receives from the last block's queries, among the candidates: heavy hitters stay), or
               ``"oracle"`` (measurement only: the pairs at the positions where ``keep`` is True stay, up to
               ``size``, the newest first)
    ``block``  tokens between decisions; ≤ the window (the leaving pairs are in the window at the boundary).
               Default: min(64, W)
    ``keep``   ``"oracle"`` only: bool ``(..., P)`` over absolute positions 0 … P−1, broadcast against the batch
               and head dimensions; ``linear_attention`` needs it over every position it reaches (decoding steps
               past P keep no new pair)
    ``linear_weight``  β ≥ 0, a float or one per head: the linear part's sums enter the output times β (1: as the
               window op). A fitted map gives the keys beyond the window a mass that grows with their number,
               where softmax's stays about constant, so at long contexts it drowns the pairs the cache keeps exact
               (docs/sparse_cache.md); β < 1 discounts it. 0: no linear part (the exact keys alone)

    Ties in the score go to the newer pair. Memory per head: (S + W + size)·(Dk + Dv) + F·Dv, and for
    ``"attention"`` the last block's queries: constant in the sequence length. The slots are allocated at once, so
    ``size`` is at most :attr:`MAX_SIZE` (2^20) pairs per head: more than a context of a million tokens could put
    in the cache, where softmax attention over the whole context is cheaper.
    """

    MAX_SIZE = 1 << 20

    size: int | tuple[int, ...] | torch.Tensor = 128
    score: str = "recall"
    block: int | None = None
    keep: torch.Tensor | None = None
    linear_weight: float | tuple[float, ...] = 1.0

    def __post_init__(self) -> None:
        given = self.linear_weight
        weights = given.tolist() if isinstance(given, torch.Tensor) else given
        for weight in weights if isinstance(weights, list | tuple) else [weights]:
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                    or weight < 0:
                raise LinearAttentionError(
                    f"sparse_cache: linear_weight must be a finite number ≥ 0 or one per head, got {given!r}"
                )
        if isinstance(given, list | torch.Tensor):  # a tuple: hashable and comparable
            object.__setattr__(self, "linear_weight", tuple(float(w) for w in weights))
        if self.score not in SCORES:
            raise LinearAttentionError(f"sparse_cache: score {self.score!r} is not one of {', '.join(SCORES)}")
        if (self.score == "oracle") != (self.keep is not None):
            raise LinearAttentionError(
                "sparse_cache: score='oracle' takes keep= (a bool tensor over positions), and only it does"
            )
        if self.block is not None and (isinstance(self.block, bool) or not isinstance(self.block, int)
                                       or self.block < 1):
            raise LinearAttentionError(f"sparse_cache: block must be a positive int, got {self.block!r}")
        sizes = self.size.tolist() if isinstance(self.size, torch.Tensor) else self.size
        for value in sizes if isinstance(sizes, (list, tuple)) else [sizes]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LinearAttentionError(
                    f"sparse_cache: size must be an int ≥ 0 or one per head, got {self.size!r}"
                )
            if value > self.MAX_SIZE:
                raise LinearAttentionError(
                    f"sparse_cache: size {value} pairs per head is more than SparseCache.MAX_SIZE = {self.MAX_SIZE} "
                    "(the slots are allocated at once: ~1M pairs per head is beyond any context the cache serves, "
                    "and softmax attention is cheaper there); pass a size ≤ MAX_SIZE"
                )

    @property
    def holds_nothing(self) -> bool:
        """Whether the cache keeps no pair in any head and leaves the linear part's weight at 1: the window op
        without a cache computes the same (tests/test_sparse_cache.py), on its own, faster route."""
        weights = self.linear_weight if isinstance(self.linear_weight, tuple) else (self.linear_weight,)
        return self.largest == 0 and self.keep is None and all(w == 1 for w in weights)

    @property
    def largest(self) -> int:
        """The largest per-head size: the cache's slots."""
        if isinstance(self.size, int):
            return self.size
        return int(max(self.size.tolist() if isinstance(self.size, torch.Tensor) else self.size, default=0))

    @staticmethod
    def split(scores: torch.Tensor, mean: int, *, floor: int = 0, score: str = "recall",
              block: int | None = None, top: int | None = None) -> list[SparseCache]:
        """Caches for every layer from one total, ``mean`` pairs per head on average, split across heads in
        proportion to ``scores`` (layers, heads) ≥ 0 (e.g. :func:`linattn.train.end_to_end.retrieval_scores`), each
        head at least ``floor``; the largest remainders take the pairs left by rounding. One cache per layer.

        ``top=K``: what the floor leaves goes in equal parts to the K highest-scoring heads alone (the rest keep the
        floor), so that a few retrieval heads hold every pair as far back as their share reaches, where a
        proportional split gives many heads a part of the distance."""
        if scores.dim() != 2 or mean < 0 or floor < 0 or floor > mean:
            raise LinearAttentionError(
                f"scores, mean, floor: need (layers, heads) scores and 0 ≤ floor ≤ mean, got shape "
                f"{tuple(scores.shape)}, mean={mean}, floor={floor}"
            )
        if top is not None and not 1 <= top <= scores.numel():
            raise LinearAttentionError(f"top: need 1 ≤ top ≤ the {scores.numel()} heads, got {top}")
        if not bool(torch.isfinite(scores).all()):
            raise LinearAttentionError(
                f"scores: {int((~torch.isfinite(scores)).sum())} NaN or inf among the (layers, heads) scores; pass "
                "finite scores ≥ 0 (for an even split, equal ones, e.g. torch.ones(layers, heads))"
            )
        weights = scores.double().clamp(min=0).flatten()
        if top is not None:  # equal shares for the top heads (ties: the earlier head), nothing for the rest
            chosen = torch.argsort(weights, descending=True, stable=True)[:top]
            weights = torch.zeros_like(weights).index_fill_(0, chosen, 1.0)
        spare = (mean - floor) * weights.numel()
        share = weights / weights.sum() * spare if float(weights.sum()) > 0 else torch.full_like(weights, mean - floor)
        sizes = share.floor().long()
        left = spare - int(sizes.sum())
        if left > 0:
            sizes[torch.argsort(share - sizes, descending=True, stable=True)[:left]] += 1
        sizes = (sizes + floor).view(scores.shape)
        return [SparseCache(size=tuple(int(x) for x in row), score=score, block=block) for row in sizes]

    def sizes_for(self, batch: torch.Size | tuple[int, ...], device: torch.device | str | None = None
                  ) -> torch.Tensor:
        """The per-row budgets as (...) int64 for the batch dims (..., H) (per-head sizes along the last)."""
        if isinstance(self.size, int):
            return torch.full(tuple(batch), self.size, dtype=torch.long, device=device)
        return torch.as_tensor(self.size, dtype=torch.long, device=device).expand(tuple(batch))

    def made(self, sizes: torch.Tensor) -> bool:
        """Whether a cache state of per-row budgets ``sizes`` (:attr:`SparseCacheState.sizes`) has these sizes."""
        try:
            return torch.equal(sizes.cpu(), self.sizes_for(sizes.shape))
        except RuntimeError:  # per-head sizes that do not broadcast against the state's heads
            return False

    def heads_mismatch(self, heads: int) -> str | None:
        """Why this cache does not fit ``heads`` query heads (per-head sizes or linear weights of another count),
        or None."""
        for name, given in (("sizes", self.size), ("linear weights", self.linear_weight)):
            if not isinstance(given, int | float):
                count = len(given.tolist() if isinstance(given, torch.Tensor) else given)
                if count != heads:
                    return f"{count} per-head {name} for {heads} heads; give one per query head"
        return None

    def weigh_linear(self, lin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear part's (num (..., H, N, Dv), den (..., H, N)) times ``linear_weight`` (per head along H)."""
        if self.linear_weight == 1:
            return lin
        num, den = lin
        if isinstance(self.linear_weight, int | float):
            return num * self.linear_weight, den * self.linear_weight
        wrong = self.heads_mismatch(den.shape[-2] if den.dim() >= 2 else 1)
        if wrong is not None:
            raise LinearAttentionError(f"sparse_cache: {wrong}")
        beta = torch.as_tensor(self.linear_weight, dtype=den.dtype, device=den.device)
        return num * beta[:, None, None], den * beta[:, None]

    def score_mismatch(self, held: SparseCacheState, num_tokens: int) -> str | None:
        """Why a cache state ``held`` (after ``num_tokens`` tokens) was made with another score, or None: the
        attention score keeps the queries since the last boundary (one at least, once a token is seen), the recall
        and oracle scores none."""
        if not num_tokens or (held.queries.shape[-2] > 0) == (self.score == "attention"):
            return None
        made = "score='attention'" if held.queries.shape[-2] else "score='recall' or 'oracle'"
        return (f"the state's cache was made with {made}, this one has score={self.score!r}: continue it with the "
                "same sparse_cache (a cache's score does not change mid-sequence)")

    def block_for(self, window: int) -> int:
        """The block between decisions for a window of W."""
        return self.block if self.block is not None else min(64, window)


@dataclass
class SparseCacheState:
    """The sparse cache's part of a :class:`WindowAttentionState`, packed: each head holds exactly its own budget.

    ``sizes``             (...) int64: each row's budget (the batch dims (..., H); with per-head sizes they differ
                          along H). Row r's pairs are slots 0 … sizes[r] − 1 of the row; no row holds more.
    ``packed_positions``  (M,) int64, M = Σ sizes: every row's slots, row after row (row-major over the batch
                          dims), in each row ascending with −1 for an empty slot (at the end). Pairs chosen at the
                          last boundary that are still in the window are already here.
    ``packed_keys``       (M, Dk), ``packed_values`` (M, Dv): their keys and values (zeros in empty slots)
    ``queries``           (..., Lq, Dk): the queries since the last boundary (``score="attention"``; else Lq = 0)
    ``block``             the tokens between decisions it was made with
    ``packed_betas``      (M,): the cached pairs' write strengths when the linear part is the delta rule (a pair
                          writes with its own β when it leaves the cache), else None

    A split budget (one size per head) is therefore held at its total, not at the largest head's size for every
    head. :attr:`positions`, :attr:`keys` and :attr:`values` give the slots as (..., L[, D]) with L the largest
    size (new tensors; −1 / zeros where a row's budget is smaller); :meth:`from_slots` packs them.
    """

    sizes: torch.Tensor
    packed_positions: torch.Tensor
    packed_keys: torch.Tensor
    packed_values: torch.Tensor
    queries: torch.Tensor
    block: int
    packed_betas: torch.Tensor | None = None

    @staticmethod
    def slot_mask(sizes: torch.Tensor, slots: int) -> torch.Tensor:
        """(..., L) bool: the slots each row holds (slot < its size)."""
        return torch.arange(slots, device=sizes.device) < sizes.unsqueeze(-1)

    @classmethod
    def from_slots(cls, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                   block: int, sizes: torch.Tensor, betas: torch.Tensor | None = None) -> SparseCacheState:
        """Packs slots (..., L[, D]) whose rows hold at most ``sizes`` (...) pairs each, at the front."""
        mask = cls.slot_mask(sizes, positions.shape[-1])
        return cls(sizes, positions[mask], keys[mask], values[mask], queries, block,
                   betas[mask] if betas is not None else None)

    @property
    def slots(self) -> int:
        """L: the largest row budget (the width of :attr:`positions`)."""
        return int(self.sizes.max()) if self.sizes.numel() else 0

    @classmethod
    def unpack(cls, packed: torch.Tensor, sizes: torch.Tensor, slots: int, fill: float) -> torch.Tensor:
        """Packed slots (M[, D]) of rows with budgets ``sizes`` (...) as (..., L[, D]), ``fill`` beyond a budget."""
        mask = cls.slot_mask(sizes, slots)
        out = packed.new_full((*mask.shape, *packed.shape[1:]), fill)
        out[mask] = packed
        return out

    def _unpacked(self, packed: torch.Tensor, fill: float) -> torch.Tensor:
        return self.unpack(packed, self.sizes, self.slots, fill)

    @property
    def positions(self) -> torch.Tensor:
        """(..., L) int64: each row's slots, −1 where empty or beyond its budget (a new tensor)."""
        return self._unpacked(self.packed_positions, -1)

    @property
    def keys(self) -> torch.Tensor:
        """(..., L, Dk): the cached keys, zeros in empty slots (a new tensor)."""
        return self._unpacked(self.packed_keys, 0.0)

    @property
    def values(self) -> torch.Tensor:
        """(..., L, Dv): the cached values, zeros in empty slots (a new tensor)."""
        return self._unpacked(self.packed_values, 0.0)

    @property
    def betas(self) -> torch.Tensor | None:
        """(..., L): the cached pairs' write strengths (the delta rule), 0 in empty slots, or None."""
        return None if self.packed_betas is None else self._unpacked(self.packed_betas, 0.0)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SparseCacheState:
        betas = self.packed_betas
        return replace(self, sizes=self.sizes.to(device=device),
                       packed_betas=betas.to(device=device, dtype=dtype) if betas is not None else None,
                       packed_positions=self.packed_positions.to(device=device),
                       packed_keys=self.packed_keys.to(device=device, dtype=dtype),
                       packed_values=self.packed_values.to(device=device, dtype=dtype),
                       queries=self.queries.to(device=device, dtype=dtype))

    def detach(self) -> SparseCacheState:
        return replace(self, packed_keys=self.packed_keys.detach(), packed_values=self.packed_values.detach(),
                       queries=self.queries.detach(),
                       packed_betas=self.packed_betas.detach() if self.packed_betas is not None else None)

    def index_select(self, dim: int, index: torch.Tensor) -> SparseCacheState:
        """Select along a batch dimension (``dim`` counts over the leading dims, as the window state's)."""
        if dim < 0:
            dim += self.sizes.dim()
        if not 0 <= dim < self.sizes.dim():
            raise LinearAttentionError(f"dim: the cache has {self.sizes.dim()} batch dims, got {dim}")
        return self.from_slots(self.positions.index_select(dim, index), self.keys.index_select(dim, index),
                               self.values.index_select(dim, index), self.queries.index_select(dim, index),
                               self.block, self.sizes.index_select(dim, index),
                               self.betas.index_select(dim, index) if self.betas is not None else None)
