"""The window op's state: the window and sink buffers beside the linear part's state."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import torch

from .linear import DeltaRuleState, LinearAttentionState, check_num_tokens
from .sparse import SparseCacheState

Linear = TypeVar("Linear", LinearAttentionState, DeltaRuleState)


@dataclass
class WindowAttentionState(Generic[Linear]):
    """What the sliding-window hybrid (``linear_attention(..., window=W, sinks=S)``) carries between calls.

    ``linear``       LinearAttentionState of the keys that have left the window (sink tokens never enter it);
                     its ``shift`` (log-space maps) is also ≥ log φ of every key below, so one scale serves all
    ``keys``         (..., L, Dk)  the last L = min(W, num_tokens) keys, oldest first (the window buffer)
    ``values``       (..., L, Dv)  their values
    ``keep``         (..., L)      False where a key was padding
    ``sink_keys``    (..., Ls, Dk) the first Ls = min(S, num_tokens) keys of the sequence (sinks)
    ``sink_values``  (..., Ls, Dv)
    ``sink_keep``    (..., Ls)
    ``window``, ``sinks``, ``num_tokens``: W, S and the key positions consumed so far (padding included).

    ``cache``        :class:`SparseCacheState` with ``sparse_cache=``, else None
    ``betas``        (..., L) the buffered keys' write strengths when the linear part is the delta rule (they write
                     when they leave the window), else None

    ``linear`` is a :class:`DeltaRuleState` when the linear part is the delta rule (``update="delta"``): the
    memory of the keys that have left the window.

    Keys and values are kept raw (before the feature map, in the accumulation dtype): the window scores them
    exactly, and a key's features are computed when it leaves the window. Size O((W + S)·D + F·Dv) per head
    (plus the sparse cache's pairs).
    """

    linear: Linear
    keys: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sink_keep: torch.Tensor
    window: int
    sinks: int
    num_tokens: int = 0
    cache: SparseCacheState | None = None
    betas: torch.Tensor | None = None

    _TENSORS = ("keys", "values", "sink_keys", "sink_values")

    def __post_init__(self) -> None:
        check_num_tokens(self.num_tokens)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> WindowAttentionState[Linear]:
        """Move and/or cast (the masks stay bool); returns a new state."""
        moved = {name: getattr(self, name).to(device=device, dtype=dtype) for name in self._TENSORS}
        return replace(
            self, linear=self.linear.to(device, dtype), keep=self.keep.to(device=device),
            sink_keep=self.sink_keep.to(device=device), **moved,
            cache=self.cache.to(device, dtype) if self.cache is not None else None,
            betas=self.betas.to(device=device, dtype=dtype) if self.betas is not None else None,
        )

    def detach(self) -> WindowAttentionState[Linear]:
        """Cut the autograd history (for truncated back-propagation through time)."""
        detached = {name: getattr(self, name).detach() for name in self._TENSORS}
        return replace(self, linear=self.linear.detach(), **detached,
                       cache=self.cache.detach() if self.cache is not None else None,
                       betas=self.betas.detach() if self.betas is not None else None)

    def index_select(self, dim: int, index: torch.Tensor) -> WindowAttentionState:
        """Select along a batch dimension (e.g. to reorder beams). ``dim`` counts over the leading dims."""
        names = (*self._TENSORS, "keep", "sink_keep")
        return replace(
            self, linear=self.linear.index_select(dim, index),
            **{name: getattr(self, name).index_select(dim, index) for name in names},
            cache=self.cache.index_select(dim, index) if self.cache is not None else None,
            betas=self.betas.index_select(dim, index) if self.betas is not None else None,
        )
