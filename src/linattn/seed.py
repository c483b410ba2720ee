"""The source document's two NumPy functions, with their signatures, built on :func:`linear_attention`.

Differences from the document's code, on purpose:
- ``stable_linear_attention`` adds ``eps`` to the denominator before the ``min_denom`` clip (the document
  declares ``eps`` but never uses it).
- ``chunked_linear_attention`` applies the feature map chunk by chunk (the document maps all of K first), and
  accepts feature maps whose output dimension F differs from d_k (the document allocates KV as (d_k, d_v)).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import LinearAttentionError
from .functional import linear_attention


def _check_2d(**arrays: Any) -> None:
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            shape = getattr(x, "shape", None)
            raise LinearAttentionError(
                f"{name}: the seed API takes 2-D NumPy arrays (N, D), got {type(x).__name__} of shape {shape}; "
                "for batches, heads or tensors use linattn.linear_attention"
            )


def stable_linear_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, feature_map: Any, eps: float = 1e-6, min_denom: float = 1e-4
) -> np.ndarray:
    """Non-causal linear attention with the denominator max(φ(Q)Σφ(K) + eps, min_denom). (N, D) arrays."""
    _check_2d(Q=Q, K=K, V=V)
    return linear_attention(Q, K, V, feature_map=feature_map, eps=eps, min_denom=min_denom, form="global")


def chunked_linear_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, feature_map: Any, chunk_size: int = 512, eps: float = 1e-6
) -> np.ndarray:
    """Non-causal linear attention accumulating φ(K)ᵀV chunk by chunk: memory O(chunk·F + F·d_v)."""
    _check_2d(Q=Q, K=K, V=V)
    return linear_attention(Q, K, V, feature_map=feature_map, chunk_size=chunk_size, eps=eps, form="chunked")
