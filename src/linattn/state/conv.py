"""A layer's state when it convolves its projections over time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LinearAttentionError
from .linear import DeltaRuleState, LinearAttentionState
from .window import WindowAttentionState


@dataclass
class ShortConvState:
    """A layer's state when it convolves its projections over time (``LinearAttention(short_conv=K)``).

    ``attention``  the attention core's state after these tokens (a :class:`LinearAttentionState`,
                   :class:`WindowAttentionState` or :class:`DeltaRuleState`)
    ``conv``       (B, K−1, C) the last K−1 projected inputs of the convolution (q, k and v side by side, before
                   it), oldest first; zeros stand for positions before the first token. In the projections' dtype.

    Size O(F·Dv) per head plus (K−1)·C per row: still constant per generated token.
    """

    attention: LinearAttentionState | WindowAttentionState | DeltaRuleState
    conv: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.attention.num_tokens

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ShortConvState:
        """Move and/or cast both parts; returns a new state."""
        return ShortConvState(self.attention.to(device, dtype), self.conv.to(device=device, dtype=dtype))

    def detach(self) -> ShortConvState:
        """Cut the autograd history (for truncated back-propagation through time)."""
        return ShortConvState(self.attention.detach(), self.conv.detach())

    def index_select(self, dim: int, index: torch.Tensor) -> ShortConvState:
        """Select batch rows (e.g. to reorder beams); the convolution's inputs have one leading dim, the batch."""
        if dim != 0:
            raise LinearAttentionError(f"dim: a layer's state selects batch rows (dim 0), got {dim}")
        return ShortConvState(self.attention.index_select(0, index), self.conv.index_select(0, index))
