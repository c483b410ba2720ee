"""linattn: linear attention for PyTorch and NumPy.

>>> import torch, linattn
>>> q = k = v = torch.randn(1, 8, 1000, 64)
>>> out, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
>>> out.shape, state.kv.shape
(torch.Size([1, 8, 1000, 64]), torch.Size([1, 8, 64, 64]))
"""

from __future__ import annotations

from . import feature_maps, nn
from .allocator import reuse_freed_memory
from .errors import LinearAttentionError
from .feature_maps import FeatureMap
from .forms import FORMS
from .functional import linear_attention
from .seed import chunked_linear_attention, stable_linear_attention
from .state import (
    DeltaRuleState,
    LinearAttentionState,
    ShortConvState,
    SparseCache,
    SparseCacheState,
    WindowAttentionState,
)

__version__ = "0.1.0"

__all__ = [
    "FORMS",
    "DeltaRuleState",
    "FeatureMap",
    "LinearAttentionError",
    "LinearAttentionState",
    "ShortConvState",
    "SparseCache",
    "SparseCacheState",
    "WindowAttentionState",
    "__version__",
    "chunked_linear_attention",
    "feature_maps",
    "linear_attention",
    "nn",
    "reuse_freed_memory",
    "stable_linear_attention",
]
