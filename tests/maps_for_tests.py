"""Small feature maps used by the core tests, each with its float64 reference φ."""

from __future__ import annotations

import math

import torch

from linattn.feature_maps import FeatureMap


class DoubledElu(FeatureMap):
    """φ(x) = [elu(x)+1, elu(−x)+1]: F = 2·D, to test F ≠ Dk."""

    def output_dim(self, head_dim: int) -> int:
        return 2 * head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.nn.functional.elu(x) + 1, torch.nn.functional.elu(-x) + 1], dim=-1)


class LogExp(FeatureMap):
    """A log-space map: log φ(x) = W x − ‖x‖²/2 − log √m (positive random features). F = m ≠ D.

    Exercises the core's exact stabilising shift, which ordinary maps never touch.
    """

    log_space = True

    def __init__(self, head_dim: int, num_features: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64))

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        return x @ weight.T - (x * x).sum(-1, keepdim=True) / 2 - 0.5 * math.log(weight.shape[0])

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.features(x.double(), is_query=False))
