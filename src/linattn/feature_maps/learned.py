"""Learned feature maps: a trainable projection followed by a positive nonlinearity.

The seed's compromise between ELU+1 (fast, poor) and FAVOR+ (better, random): a deterministic map with learned
projections, fitted to mimic softmax attention (see :mod:`linattn.train.distill`).

- ``t2r`` (Kasai et al., "Finetuning Pretrained Transformers into RNNs", 2021): φ(x) = relu(Wx + b), F = m.
- ``hedgehog`` (Zhang et al., "The Hedgehog & the Porcupine", 2024): z = Wx + b,
  φ(x) = [softmax(z), softmax(−z)], F = 2m, and for keys a learned weight e^{u·k} (linattn's addition; u = 0 at
  initialisation). Identity initialisation (W = I, b = 0 for m = d).

Both take ``num_features`` (m, default d), ``num_heads`` (one projection per head, applied along dim −3; ``None``
shares one projection across heads), ``tied`` (one projection for queries and keys, or one each), ``init``
(``"identity"``: the first min(m, d) rows of W are the identity, further rows small Gaussian; ``"random"``:
Gaussian rows of norm ≈ 1), ``init_scale`` (W is multiplied by it) and ``seed`` (the random rows).
"""

from __future__ import annotations

from typing import Any, ClassVar

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
    mirrored = False  # True: project() returns [Wx + b, −(Wx + b)] (2m columns), for maps that use both signs

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

    def project(self, x: torch.Tensor, *, is_query: bool, mirror: bool = True) -> torch.Tensor:
        """z = W x + b: (..., [H,] N, d) → (..., [H,] N, m) (2m: [z, −z] when ``mirrored``, unless ``mirror=False``
        asks for z alone), with the query or key projection of each head."""
        if x.shape[-1] != self.head_dim:
            raise LinearAttentionError(
                f"{type(self).__name__}: input last dimension {x.shape[-1]} does not match head_dim={self.head_dim} "
                "the map was built for"
            )
        index = 0 if is_query or self.tied else 1
        weight = self.weight[index].to(x.dtype)  # (H, m, d)
        bias = self.bias[index].to(x.dtype)  # (H, m)
        if self.mirrored and mirror:
            if x.numel() < weight.numel():  # few rows (decoding): negate the output, not a copy of the weights
                z = self._project(x, weight, bias)
                return torch.cat((z, z.neg()), dim=-1)
            # z and −z from one matmul: (H, 2m, d)
            weight, bias = torch.cat((weight, -weight), dim=-2), torch.cat((bias, -bias), dim=-1)
        return self._project(x, weight, bias)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.num_heads is None:
            return x @ weight[0].transpose(0, 1) + bias[0]
        if x.dim() < 3 or x.shape[-3] != self.num_heads:
            raise LinearAttentionError(
                f"{type(self).__name__}: built with num_heads={self.num_heads} (one projection per head along "
                f"dim -3), got input of shape {tuple(x.shape)}; pass (..., {self.num_heads}, N, {self.head_dim})"
            )
        # (..., H, N, d) @ (H, d, m) → (..., H, N, m); bias (H, 1, m) broadcasts over tokens
        if x.dim() == 3:  # the bias added inside the matmul: one pass less over the output
            return torch.baddbmm(bias.unsqueeze(-2), x, weight.transpose(-1, -2))
        return x @ weight.transpose(-1, -2) + bias.unsqueeze(-2)

    def activate(self, z: torch.Tensor) -> torch.Tensor:  # pragma: no cover - subclasses override
        raise NotImplementedError

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return self.activate(self.project(x, is_query=is_query))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """φ with the query projection (the two projections coincide when ``tied``)."""
        return self.features(x, is_query=True)

    def scaled_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        """c·φ(x) for x (..., [H,] N, d), c > 0 a constant per head (and per query row) of this call: what a loss
        on normalised attention weights needs, which the constant leaves unchanged (used in fitting)."""
        return self.features(x, is_query=is_query)

    def head_slice(self, start: int, stop: int) -> LearnedProjectionMap:
        """A copy holding heads ``start:stop`` only (e.g. one layer out of a map fitted on all layers at once)."""
        if self.num_heads is None:
            raise LinearAttentionError(f"{type(self).__name__}: head_slice needs a per-head map (num_heads set)")
        if not 0 <= start < stop <= self.num_heads:
            raise LinearAttentionError(f"head_slice: need 0 ≤ start < stop ≤ {self.num_heads}, got {start}, {stop}")
        return self.head_select(torch.arange(start, stop))

    def head_select(self, index: torch.Tensor) -> LearnedProjectionMap:
        """A copy holding the heads ``index`` (h,) only, in that order (detached: new parameters, of this map's
        dtype and device)."""
        if self.num_heads is None:
            raise LinearAttentionError(f"{type(self).__name__}: head_select needs a per-head map (num_heads set)")
        part = type(self)(self.head_dim, num_features=self.num_features, num_heads=int(index.numel()),
                          tied=self.tied).to(self.weight)
        with torch.no_grad():  # every parameter is (P, H, ...): the head is dim 1
            for name, param in part.named_parameters():
                param.copy_(getattr(self, name).index_select(1, index.to(param.device)))
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
    """φ(x) = [softmax(z), softmax(−z)], z = Wx + b (Hedgehog), and for keys a learned weight e^{u·k}.
    x (..., N, d) → (..., N, 2m); learned.

    Each half is a probability vector over the m features, so φ(q)·φ(k) = Σ_f e^{z_f(q)+z_f(k)}/(Z(q)Z(k)) + the
    mirrored term: a sum of exponentials of the projected scores, which is what lets it mimic softmax's spikiness.

    The key gate e^{u·k} (``gate``: u per head, zero at initialisation, so the map starts as plain Hedgehog) lets
    a key draw more or less attention from every query, as softmax's sink tokens do, which the normalised
    features 1/Z(k) alone cannot: on MiniLM-L6 it lowers the held-out row KL of a fitted map by 0.025 at the same
    fitting cost (docs/evaluation.md). A query gate would cancel in the normalisation, so queries have none.
    u·k is clipped to ±``GATE_LIMIT`` (30): key features then stay below 2e^30 ≈ 2e13, so sums over a million
    tokens stay far inside fp32's range (fitted gates on MiniLM span |u·k| ≤ 6). Strictly positive: the dtype's
    smallest normal number is added (softmax of far-apart scores underflows to 0 otherwise).
    """

    mirrored = True
    GATE_LIMIT: ClassVar[float] = 30.0

    def __init__(self, head_dim: int | None = None, **options: Any) -> None:
        super().__init__(head_dim, **options)
        self.gate = nn.Parameter(torch.zeros(1, self.num_heads or 1, self.head_dim))  # (1, H, d): u per head

    def output_dim(self, head_dim: int) -> int:
        return 2 * self.num_features

    def activate(self, z: torch.Tensor) -> torch.Tensor:
        # z = [Wx + b, −(Wx + b)]: one softmax over its (..., 2, m) view
        return z.unflatten(-1, (2, self.num_features)).softmax(dim=-1).flatten(-2)

    def key_weight(self, x: torch.Tensor) -> torch.Tensor:
        """e^{u·k}, u·k clipped to ±GATE_LIMIT, for keys x (..., [H,] N, d) → (..., [H,] N, 1)."""
        gate = self.gate[0].to(x.dtype)  # (H, d)
        log_weight = x @ gate[0].unsqueeze(-1) if self.num_heads is None else x @ gate.unsqueeze(-1)
        return log_weight.clamp(-self.GATE_LIMIT, self.GATE_LIMIT).exp()

    def scaled_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        # as features(), without the floor (one pass less in fitting)
        phi = self.activate(self.project(x, is_query=is_query))
        return phi if is_query else phi * self.key_weight(x)

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        phi = self.activate(self.project(x, is_query=is_query))
        floor = torch.tensor(torch.finfo(x.dtype).tiny, dtype=x.dtype, device=x.device)
        # keys: floor + φ·e^{u·k} in one fused pass
        return phi + floor if is_query else torch.addcmul(floor, phi, self.key_weight(x))
