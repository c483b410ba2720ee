"""Learned feature maps: a trainable projection followed by a positive nonlinearity.

The seed's compromise between ELU+1 (fast, poor) and FAVOR+ (better, random): a deterministic map with learned
projections, fitted to mimic softmax attention (see :mod:`linattn.distill`).

- ``t2r`` (Kasai et al., "Finetuning Pretrained Transformers into RNNs", 2021): φ(x) = relu(Wx + b), F = m.
- ``hedgehog`` (Zhang et al., "The Hedgehog & the Porcupine", 2024): z = Wx + b,
  φ(x) = [softmax(z), softmax(−z)], F = 2m. Identity initialisation (W = I, b = 0 for m = d).

Both take ``num_features`` (m, default d), ``num_heads`` (one projection per head, applied along dim −3; ``None``
shares one projection across heads), ``tied`` (one projection for queries and keys, or one each), ``init``
(``"identity"``: the first min(m, d) rows of W are the identity, further rows small Gaussian; ``"random"``:
Gaussian rows of norm ≈ 1), ``init_scale`` (W is multiplied by it) and ``seed`` (the random rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LinearAttentionError
from .base import FeatureMap


class LearnedProjectionMap(FeatureMap):
    """Shared machinery: parameters ``weight (P, H, m, d)`` and ``bias (P, H, m)``.

    P = 1 when ``tied`` (queries and keys share the projection), else 2 (index 0 queries, 1 keys); H = ``num_heads``
    or 1 when the projection is shared by all heads. Subclasses define the nonlinearity in :meth:`activate`.
    """

    learned = True

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        num_features: int | None = None,
        num_heads: int | None = None,
        tied: bool = False,
        init: str = "identity",
        init_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if head_dim is None or int(head_dim) < 1:
            raise LinearAttentionError(f"{name}: head_dim must be a positive int (the input's last dimension), "
                                       f"got {head_dim!r}")
        if num_features is None:
            num_features = head_dim
        if int(num_features) < 1:
            raise LinearAttentionError(f"{name}: num_features must be ≥ 1, got {num_features!r}")
        if num_heads is not None and int(num_heads) < 1:
            raise LinearAttentionError(f"{name}: num_heads must be ≥ 1 or None (shared), got {num_heads!r}")
        if init not in ("identity", "random"):
            raise LinearAttentionError(f"{name}: init must be 'identity' or 'random', got {init!r}")
        self.head_dim = int(head_dim)
        self.num_features = int(num_features)
        self.num_heads = None if num_heads is None else int(num_heads)
        self.tied = bool(tied)
        copies = 1 if self.tied else 2
        heads = self.num_heads or 1
        generator = torch.Generator().manual_seed(int(seed))
        weight = torch.randn(copies, heads, self.num_features, self.head_dim, generator=generator)
        weight /= self.head_dim**0.5  # rows of norm ≈ 1
        if init == "identity":
            rows = min(self.num_features, self.head_dim)
            weight[:, :, :rows] = torch.eye(rows, self.head_dim)
            weight[:, :, rows:] *= 0.1  # extra features start small, near-uniform, and are shaped by fitting
        self.weight = nn.Parameter(weight * float(init_scale))  # (P, H, m, d)
        self.bias = nn.Parameter(torch.zeros(copies, heads, self.num_features))  # (P, H, m)

    def project(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        """z = W x + b: (..., [H,] N, d) → (..., [H,] N, m), with the query or key projection of each head."""
        if x.shape[-1] != self.head_dim:
            raise LinearAttentionError(
                f"{type(self).__name__}: input last dimension {x.shape[-1]} does not match head_dim={self.head_dim} "
                "the map was built for"
            )
        index = 0 if is_query or self.tied else 1
        weight = self.weight[index].to(x.dtype)  # (H, m, d)
        bias = self.bias[index].to(x.dtype)  # (H, m)
        if self.num_heads is None:
            return x @ weight[0].transpose(0, 1) + bias[0]
        if x.dim() < 3 or x.shape[-3] != self.num_heads:
            raise LinearAttentionError(
                f"{type(self).__name__}: built with num_heads={self.num_heads} (one projection per head along "
                f"dim -3), got input of shape {tuple(x.shape)}; pass (..., {self.num_heads}, N, {self.head_dim})"
            )
        # (..., H, N, d) @ (H, d, m) → (..., H, N, m); bias (H, 1, m) broadcasts over tokens
        return x @ weight.transpose(-1, -2) + bias.unsqueeze(-2)

    def activate(self, z: torch.Tensor) -> torch.Tensor:  # pragma: no cover - subclasses override
        raise NotImplementedError

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return self.activate(self.project(x, is_query=is_query))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """φ with the query projection (the two projections coincide when ``tied``)."""
        return self.features(x, is_query=True)

    def head_slice(self, start: int, stop: int) -> LearnedProjectionMap:
        """A copy holding heads ``start:stop`` only (e.g. one layer out of a map fitted on all layers at once)."""
        if self.num_heads is None:
            raise LinearAttentionError(f"{type(self).__name__}: head_slice needs a per-head map (num_heads set)")
        if not 0 <= start < stop <= self.num_heads:
            raise LinearAttentionError(f"head_slice: need 0 ≤ start < stop ≤ {self.num_heads}, got {start}, {stop}")
        part = type(self)(self.head_dim, num_features=self.num_features, num_heads=stop - start, tied=self.tied)
        with torch.no_grad():
            part.weight.copy_(self.weight[:, start:stop])
            part.bias.copy_(self.bias[:, start:stop])
        return part

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, num_heads={self.num_heads}, "
                f"tied={self.tied}")


class T2RFeatureMap(LearnedProjectionMap):
    """φ(x) = relu(Wx + b)  (T2R). x (..., N, d) → (..., N, m); non-negative (a row may be all zero), learned."""

    def output_dim(self, head_dim: int) -> int:
        return self.num_features

    def activate(self, z: torch.Tensor) -> torch.Tensor:
        return F.relu(z)


class HedgehogFeatureMap(LearnedProjectionMap):
    """φ(x) = [softmax(z), softmax(−z)], z = Wx + b  (Hedgehog). x (..., N, d) → (..., N, 2m); learned.

    Each half is a probability vector over the m features, so φ(q)·φ(k) = Σ_f e^{z_f(q)+z_f(k)}/(Z(q)Z(k)) + the
    mirrored term: a sum of exponentials of the projected scores, which is what lets it mimic softmax's spikiness.
    Strictly positive: features are floored at the dtype's smallest normal number (softmax of far-apart scores
    underflows to 0 otherwise).
    """

    def output_dim(self, head_dim: int) -> int:
        return 2 * self.num_features

    def activate(self, z: torch.Tensor) -> torch.Tensor:
        tiny = torch.finfo(z.dtype).tiny
        return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1).clamp(min=tiny)
