"""What both decoding steps share: the feature map of one token, and the grouped-query head repeat."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..features import repeat_kv_heads


class _Step:
    """What both decode steps share: the feature map of one token."""

    fmap: nn.Module
    features: Any

    def _map(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.features is not None:
            return self.features(x, is_query=is_query)
        return self.fmap(x)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: (B, Hkv, 1, ·) → (B, H, 1, ·), each key/value head serving H / Hkv query heads."""
    return repeat_kv_heads(x, heads // x.shape[1], dim=1)
