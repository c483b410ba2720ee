"""The feature-map interface: what every map, built-in or user-written, provides to the forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from ..errors import LinearAttentionError


class FeatureMap(nn.Module):
    """Base class of feature maps φ: (..., N, D) → (..., N, F).

    A map may treat queries and keys differently (override :meth:`features`), hold parameters and buffers
    (they live in ``state_dict``), and hold per-head parameters applied along dim −3.

    Class flags, read by :func:`linattn.linear_attention` and shown in the catalogue:

    - ``positive``: the kernel φ(q)·φ(k) is ≥ 0 for all inputs (features ≥ 0, or a kernel such as Taylor's
      1 + s + s²/2 that is non-negative although its features are signed), so the normaliser cannot be negative.
      Other maps must be used with ``normalize=False`` (or a ``min_denom`` clamp).
    - ``log_space``: :meth:`features` returns log φ rather than φ. The core exponentiates it with an exact,
      causal-safe shift (a running maximum over keys carried in the state), so exponential maps such as FAVOR+
      neither overflow nor underflow. Such maps need ``normalize=True``: the shift cancels only in the ratio.
    - ``random`` / ``learned``: documentation flags.
    """

    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = False
    random: ClassVar[bool] = False
    learned: ClassVar[bool] = False

    def output_dim(self, head_dim: int) -> int:
        """Feature dimension F for inputs whose last dimension is ``head_dim``."""
        return head_dim

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        """φ(x) (or log φ(x) when ``log_space``) for queries (``is_query=True``) or keys."""
        return self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - subclasses override
        raise NotImplementedError(f"{type(self).__name__} must implement forward() or features()")


class CallableFeatureMap(FeatureMap):
    """Wraps a plain callable ``fn(x) -> features`` (torch, or NumPy for NumPy inputs) as a feature map.

    The callable is applied to queries and keys alike. Its positivity is unknown, so under ``normalize=True``
    (without ``min_denom``) the core checks that its features are ≥ 0 and refuses negative ones, which could make
    the denominator zero or negative; a map with a positive kernel but signed features declares it as a
    :class:`FeatureMap` subclass instead.
    """

    def __init__(self, fn: Callable[..., object], *, numpy: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.numpy = numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numpy:
            result = self.fn(x.detach().cpu().numpy())
            return torch.from_numpy(np.ascontiguousarray(result)).to(device=x.device, dtype=x.dtype)
        result = self.fn(x)
        if isinstance(result, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(result)).to(device=x.device, dtype=x.dtype)
        if not isinstance(result, torch.Tensor):
            name = getattr(self.fn, "__name__", repr(self.fn))
            raise LinearAttentionError(
                f"feature_map {name!r}: returned {type(result).__name__}; it must return a tensor (or a NumPy "
                f"array) of shape {tuple(x.shape[:-1])} + (F,)"
            )
        return result

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))
