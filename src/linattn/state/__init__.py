"""The recurrent state of linear attention: what streaming, chunk-by-chunk runs and decoding carry forward.

:mod:`.linear` holds the linear part's states (the additive sums, the delta rule's memory), :mod:`.window` the
window op's (buffers beside a linear state), :mod:`.sparse` the sparse exact cache's, :mod:`.conv` a layer's with
a short convolution. Every name is importable from ``linattn.state``.
"""

from __future__ import annotations

from .conv import ShortConvState
from .linear import DeltaRuleState, LinearAttentionState
from .sparse import SCORES, SparseCache, SparseCacheState
from .window import Linear, WindowAttentionState

__all__ = [
    "SCORES", "DeltaRuleState", "Linear", "LinearAttentionState", "ShortConvState", "SparseCache", "SparseCacheState",
    "WindowAttentionState",
]
