"""Elementwise feature maps: cheap, deterministic, F = D."""

from __future__ import annotations

from typing import Any

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
        return _EluPlusOne.apply(x)


SLICE = 1 << 18  # elements (1 MiB of fp32): large enough for every thread to share each add, small enough to reuse


class _EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 = exp(min(x, 0)) + max(x, 0), with derivative min(φ, 1), in one pass each way.

    No branch select: ``torch.where`` costs several times an add here, and the usual form needs one forward and
    three backward (measured in ``benchmarks/elu_cost.py``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        features = x.clamp(max=0).exp_().clamp_(min=torch.finfo(x.dtype).tiny)
        if features.is_contiguous() and x.is_contiguous():
            # max(x, 0) added a slice at a time: a temporary as large as x would be fresh memory at every call
            # (above the allocator's reuse threshold), and touching its pages cost as much as the add itself
            for part, rows in zip(features.view(-1).split(SLICE), x.view(-1).split(SLICE), strict=True):
                part += rows.clamp(min=0)
        else:
            features += x.clamp(min=0)
        ctx.save_for_backward(features)
        return features

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (features,) = ctx.saved_tensors
        return features.clamp(max=1).mul_(grad)  # in place: one tensor of x's size, not two


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
