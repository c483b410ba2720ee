"""Elementwise feature maps: cheap, deterministic, F = D."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import FeatureMap


class EluFeatureMap(FeatureMap):
    """φ(x) = elu(x) + 1  (Katharopoulos et al., 2020). F = D, strictly positive, not random, not learned.

    Written as ``x + 1`` for x > 0 and ``exp(x)`` otherwise (the same function), with the exponential floored at
    the dtype's smallest normal number: ``F.elu(x) + 1`` rounds to exactly 0 in bf16 for x ≤ −8, and a zero
    feature row gives a zero denominator.
    """

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiny = torch.finfo(x.dtype).tiny
        # exp on the clamped input: the branch not taken must stay finite or its gradient is NaN
        return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)).clamp(min=tiny))


class ReluFeatureMap(FeatureMap):
    """φ(x) = max(x, 0). F = D, non-negative (a row can be all zero: the denominator is then eps)."""

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


class IdentityFeatureMap(FeatureMap):
    """φ(x) = x. F = D, signed: use ``normalize=False`` (plain linear attention without a normaliser)."""

    positive = False

    def __init__(self, head_dim: int | None = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
