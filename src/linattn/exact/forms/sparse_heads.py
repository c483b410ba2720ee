"""A split budget's heads apart: the heads that keep no pair on the composed route, the others on the sparse form.

Heads never mix, and a head whose budget is 0 computes the composed op (the window and the memory, no cache;
:mod:`.sparse_composed`). So a call whose budget leaves some heads nothing (``SparseCache.split(..., top=K)``
leaves most heads nothing) runs those heads on the composed route (native kernels, the flash band), and the
sparse form on the heads that keep pairs alone, whose slots are then as wide as their own budgets need; the
output and the state take each head's rows from its own route (:func:`joined_state`).

The sparse form maps the keys of the heads it runs with the call's map through :class:`HeadRows`, which puts them
among zero rows of the other heads, so a map with parameters per head sees each head at its own index. Only beside
the delta family, whose unit features cancel any scale a map might take from the whole tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...feature_maps import HedgehogFeatureMap
from ...feature_maps.base import FeatureMap
from ...features import map_features
from ...state import DeltaRuleState, SparseCache, SparseCacheState, WindowAttentionState
from .sparse import _queries_since

# one Hedgehog map's features of x in C++, or None where the kernels do not take the call (backends/native)
NativeMap = Callable[[HedgehogFeatureMap, torch.Tensor, bool], "torch.Tensor | None"]


class HeadRows(FeatureMap):
    """The map ``inner`` of H heads applied to the heads ``index`` (h,) only: inputs (..., h, N, D). ``native``
    (given by the native backend): a per-head Hedgehog map's features of those heads alone in C++ where no gradient
    is needed (a copy of their parameters, made once), as the composed route's are; else the other heads' rows are
    zeros the map also runs on."""

    def __init__(self, inner: torch.nn.Module, index: torch.Tensor, heads: int,
                 native: NativeMap | None = None) -> None:
        super().__init__()
        self.inner, self.heads = inner, heads
        self.rows: torch.Tensor = index  # made for one call: a plain attribute, not a buffer
        self.positive = getattr(inner, "positive", True)  # type: ignore[misc]
        self.log_space = getattr(inner, "log_space", False)  # type: ignore[misc]
        self.native = native if type(inner) is HedgehogFeatureMap and inner.num_heads == heads else None
        self._own: HedgehogFeatureMap | None = None  # the heads' own map, made at the first native call

    def _native(self, x: torch.Tensor, is_query: bool) -> torch.Tensor | None:
        inner = self.inner
        if self.native is None or not isinstance(inner, HedgehogFeatureMap) or (
                torch.is_grad_enabled() and any(param.requires_grad for param in inner.parameters())):
            return None
        if self._own is None:
            own = inner.head_select(self.rows)
            assert isinstance(own, HedgehogFeatureMap)
            self._own = own.requires_grad_(False)
        return self.native(self._own, x, is_query)

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        # the checks (finite, nonnegative) run on the rows returned, by the caller's map_features
        made = self._native(x, is_query)
        if made is not None:
            return made
        full = x.new_zeros(*x.shape[:-3], self.heads, *x.shape[-2:]).index_copy(-3, self.rows, x)
        return map_features(self.inner, full, is_query=is_query).index_select(-3, self.rows)


def split_heads(cache: SparseCache, heads: int) -> tuple[torch.Tensor, SparseCache] | None:
    """(the heads that keep pairs (h,), a cache of their budgets alone) where some head keeps none and some keep
    pairs; None otherwise (one budget, no head without pairs, the oracle, or a linear weight other than 1 on a head
    without pairs, which the composed route does not read)."""
    if isinstance(cache.size, int) or cache.keep is not None:
        return None
    sizes = cache.sizes_for((heads,))
    keeping = (sizes > 0).nonzero().squeeze(-1)
    if keeping.numel() in (0, heads):
        return None
    weights = cache.linear_weight
    if isinstance(weights, tuple):
        if any(weights[h] != 1 for h in range(heads) if sizes[h] == 0):
            return None
        weights = tuple(weights[h] for h in keeping.tolist())
    elif weights != 1:
        return None
    return keeping, SparseCache(size=tuple(int(sizes[h]) for h in keeping.tolist()), score=cache.score,
                                block=cache.block, linear_weight=weights)


def head_rows(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, index)``, contiguous, made by one copy a head: the heads' dim of a transformers query
    is not its outer stride ((B, N, H, d) in memory), where torch's CPU ``index_select`` along it was slow in a
    profile of a long prefill, and each head's copy is a plain strided one."""
    out = x.new_empty(*x.shape[:dim], index.numel(), *x.shape[dim + 1:])
    for j, h in enumerate(index.tolist()):
        out.select(dim, j).copy_(x.select(dim, h))
    return out


def other_heads(keeping: torch.Tensor, heads: int) -> torch.Tensor:
    """The heads of ``heads`` not in ``keeping`` (ascending)."""
    mask = torch.ones(heads, dtype=torch.bool, device=keeping.device)
    mask[keeping] = False
    return mask.nonzero().squeeze(-1)


def _rows_of(head: int, others: torch.Tensor, of_others: torch.Tensor, keeping: torch.Tensor,
             of_keeping: torch.Tensor) -> torch.Tensor:
    """One tensor of every head: the rows of the heads ``others`` and ``keeping`` (dim ``head``) from their own."""
    shape = list(of_others.shape)
    shape[head] += of_keeping.shape[head]
    out = of_others.new_empty(shape)
    return out.index_copy_(head, others, of_others).index_copy_(head, keeping, of_keeping.to(out.dtype))


def joined_window(keeping: torch.Tensor, others: torch.Tensor, composed: WindowAttentionState,
                  part: WindowAttentionState, cache: SparseCacheState | None = None) -> WindowAttentionState:
    """The state of every head: the memory and the buffers of the heads ``others`` from ``composed`` and of the heads
    ``keeping`` from ``part``, beside the joined ``cache`` state (None: none)."""
    linear, kept = composed.linear, part.linear
    assert isinstance(linear, DeltaRuleState) and isinstance(kept, DeltaRuleState)
    head = composed.keep.dim() - 2  # the heads' dim among the batch dims

    def rows(of_others: torch.Tensor, of_keeping: torch.Tensor) -> torch.Tensor:
        return _rows_of(head, others, of_others, keeping, of_keeping)

    memory = DeltaRuleState(rows(linear.kv, kept.kv), linear.num_tokens)
    # the buffered write strengths as the sparse form keeps them: 0 at padding (which writes nothing either way)
    betas = None
    if composed.betas is not None and part.betas is not None:
        betas = rows(composed.betas * composed.keep.to(composed.betas.dtype), part.betas)
    return WindowAttentionState(memory, rows(composed.keys, part.keys), rows(composed.values, part.values),
                                rows(composed.keep, part.keep), rows(composed.sink_keys, part.sink_keys),
                                rows(composed.sink_values, part.sink_values), rows(composed.sink_keep, part.sink_keep),
                                composed.window, composed.sinks, composed.num_tokens, cache, betas)


def joined_state(cache: SparseCache, keeping: torch.Tensor, others: torch.Tensor, composed: WindowAttentionState,
                 sparse: WindowAttentionState, queries: torch.Tensor) -> WindowAttentionState:
    """The state of every head: the composed route's state of the heads ``others`` and the sparse form's of the
    heads ``keeping`` (its memory, its buffers and its cache). ``queries``: the carried queries and the call's
    (..., H, ·, Dk), the last at the state's last position (the attention score keeps those since the last
    boundary, every head's; none for the other scores)."""
    assert sparse.cache is not None
    head = composed.keep.dim() - 2  # the heads' dim among the batch dims
    held = sparse.cache
    block = held.block
    if cache.score == "attention":
        end = composed.num_tokens
        queries = _queries_since(queries, end - queries.shape[-2], end, block)
    else:
        queries = queries[..., :0, :]
    batch = (*composed.keep.shape[:head], composed.keep.shape[head] + sparse.keep.shape[head])
    # heads without pairs hold none: the packed rows of the heads that keep pairs, in order, are every head's
    joined = SparseCacheState(cache.sizes_for(batch, held.sizes.device), held.packed_positions, held.packed_keys,
                              held.packed_values, queries, block, held.packed_betas)
    return joined_window(keeping, others, composed, sparse, joined)
