"""The choice of a lean step for a state: the capability table names the kind of step that reproduces a call
(:func:`linattn.capabilities.choose_step`), and each kind's module builds it. Kept apart from the steps so that
none of them imports another to be chosen (the sparse cache's step builds on the window's, never the reverse)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._validate import sparse_cache
from ..capabilities import choose_step
from ..exact.composed_step import ComposedDecodeStep
from ..exact.sparse_composed_step import SparseComposedDecodeStep
from ..exact.sparse_step import sparse_step
from ..exact.window_step import WindowDecodeStep, window_step
from ..kinds.additive.step import DecodeStep
from ..kinds.delta.step import DeltaDecodeStep


def lean_step(
    fmap: nn.Module, state: Any, options: dict[str, Any], kv_heads: int
) -> (DecodeStep | WindowDecodeStep | DeltaDecodeStep | ComposedDecodeStep | SparseComposedDecodeStep
      | None):
    """The lean step that continues ``state`` as ``linear_attention(..., **options)`` would, or None where no step
    reproduces the call (:func:`linattn.capabilities.step_reasons`); ``kv_heads`` as :class:`WindowDecodeStep`."""
    step = choose_step(fmap, state, options)
    if step == "plain":
        return DecodeStep(fmap, state, eps=options.get("eps", 1e-6))
    if step == "window":
        return window_step(fmap, state, options, kv_heads)
    if step == "sparse":
        return sparse_step(fmap, state, options, kv_heads)
    if step == "delta":
        return DeltaDecodeStep(fmap, state, beta=options.get("beta"), decay=options.get("decay"))
    if step == "composed":
        return ComposedDecodeStep(fmap, state, options)
    if step == "sparse_composed":
        cache = sparse_cache(options["sparse_cache"], state.window, options.get("update", "add"), None)
        assert cache is not None
        return SparseComposedDecodeStep(fmap, state, cache, options)
    return None
