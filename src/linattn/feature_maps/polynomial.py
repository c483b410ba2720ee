"""Polynomial feature maps: exact finite features for polynomial kernels (Taylor, ReBased) and DPFP.

The quadratic maps use the symmetric layout: for x ∈ R^d the d(d+1)/2 products x_i·x_j with i ≤ j, weighted
1/√2 on the diagonal and 1 off it, so that  Σ_{i≤j} w_ij² x_i x_j y_i y_j = (x·y)²/2  exactly. That halves the
feature count of the plain x ⊗ x layout (d²) with the same kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import LinearAttentionError
from .base import FeatureMap


def _check_head_dim(name: str, head_dim: int | None) -> int:
    if head_dim is None or not isinstance(head_dim, int) or head_dim < 1:
        raise LinearAttentionError(
            f"{name}: head_dim must be a positive int (the last dimension of q and k), got {head_dim!r}"
        )
    return head_dim


def _check_input(name: str, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    if x.shape[-1] != head_dim:
        raise LinearAttentionError(
            f"{name}: inputs have last dimension {x.shape[-1]}, but the map was built for head_dim={head_dim}; "
            f"create it with head_dim={x.shape[-1]}"
        )
    # products of bf16 numbers lose the kernel's digits; fp32 and fp64 inputs are kept as they are
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _SymmetricSquare(torch.nn.Module):
    """x (..., N, r) → (..., N, r(r+1)/2) with features·features = (x·y)²/2 (the symmetric layout above)."""

    rows: torch.Tensor
    cols: torch.Tensor
    diagonal: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(dim, dim)
        # index tables derived from dim alone: not state worth saving. The 1/√2 weight is applied as a Python
        # scalar in the input's dtype, so no float buffer can be rounded by a module-wide .to(dtype)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("diagonal", rows == cols, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = x[..., self.rows] * x[..., self.cols]  # (..., N, r(r+1)/2)
        return torch.where(self.diagonal, products * math.sqrt(0.5), products)


class TaylorFeatureMap(FeatureMap):
    """Second-order Taylor features of exp (as in Based; Arora et al., 2024): φ(q)·φ(k) = 1 + s + s²/2.

    s = x̃·ỹ with x̃ = P·x·d^{-1/4} (P = identity by default), so s = q·k/√d and the kernel is the 2nd-order Taylor
    expansion of the softmax kernel exp(q·k/√d). Layout [1, x̃, symmetric x̃⊗x̃/√2]:
    F = (r + 1)(r + 2)/2 for r = ``projection_dim`` or d (d = 64 gives F = 2145; r = 16 gives F = 153).

    ``projection_dim=r`` first applies a fixed random P ∈ R^{r×d} with N(0, 1/r) entries (a buffer, ``seed``
    reproduces it), so E[(Pq)·(Pk)] = q·k; a trained projection belongs in the q/k projections before the map,
    which it composes with. Cost O(N·r²) per head.

    The features are signed, but the kernel 1 + s + s²/2 = ((1 + s)² + 1)/2 ≥ 1/2 for every pair, so the
    normaliser φ(q)·Σφ(k) is positive: the map is flagged ``positive`` and works with ``normalize=True``.
    Not random without ``projection_dim``; not learned.
    """

    projection: torch.Tensor | None

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        projection_dim: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = _check_head_dim("TaylorFeatureMap", head_dim)
        if scale is not None and not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise LinearAttentionError(f"TaylorFeatureMap: scale must be a positive finite number, got {scale!r}")
        self.scale = float(scale) if scale is not None else self.head_dim**-0.25
        if projection_dim is None:
            self.register_buffer("projection", None)
            inner = self.head_dim
        else:
            if not isinstance(projection_dim, int) or projection_dim < 1:
                raise LinearAttentionError(
                    f"TaylorFeatureMap: projection_dim must be a positive int, got {projection_dim!r}"
                )
            generator = torch.Generator()
            generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            matrix = torch.randn(projection_dim, self.head_dim, generator=generator, dtype=torch.float64)
            self.register_buffer("projection", (matrix / math.sqrt(projection_dim)).to(torch.get_default_dtype()))
            inner = projection_dim
        self.inner_dim = inner
        self.square = _SymmetricSquare(inner)

    def output_dim(self, head_dim: int) -> int:
        return (self.inner_dim + 1) * (self.inner_dim + 2) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input("TaylorFeatureMap", x, self.head_dim) * self.scale
        if self.projection is not None:
            x = x @ self.projection.to(device=x.device, dtype=x.dtype).T  # (..., N, r)
        ones = torch.ones_like(x[..., :1])
        return torch.cat([ones, x, self.square(x)], dim=-1)  # (..., N, (r+1)(r+2)/2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, inner_dim={self.inner_dim}"


class RebasedFeatureMap(FeatureMap):
    """ReBased's quadratic kernel on normalised inputs (Aksenov et al., 2024): φ(q)·φ(k) = (q̃·k̃)².

    x̃ = layer_norm(x)·d^{-1/4} (zero mean, unit variance over the head dimension, no affine parameters: ReBased's
    learnable affine pair can live in the q/k projections), so q̃·k̃ ∈ [−√d, √d] whatever the input norms. Features
    are the symmetric x̃⊗x̃ layout scaled by √2, F = d(d+1)/2; signed entries but a kernel ≥ 0, so the normaliser
    is non-negative (it is 0 only if q̃ is orthogonal to every key; eps then guards it). Deterministic, O(N·d²).
    """

    def __init__(self, head_dim: int | None = None, *, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.head_dim = _check_head_dim("RebasedFeatureMap", head_dim)
        if not (isinstance(norm_eps, int | float) and norm_eps > 0):
            raise LinearAttentionError(f"RebasedFeatureMap: norm_eps must be > 0, got {norm_eps!r}")
        self.norm_eps = float(norm_eps)
        self.square = _SymmetricSquare(self.head_dim)

    def output_dim(self, head_dim: int) -> int:
        return self.head_dim * (self.head_dim + 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input("RebasedFeatureMap", x, self.head_dim)
        x = F.layer_norm(x, (self.head_dim,), eps=self.norm_eps) * self.head_dim**-0.25
        return self.square(x) * math.sqrt(2.0)  # (..., N, d(d+1)/2), φ·φ = (x̃·ỹ)²


class DpfpFeatureMap(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al., "Linear Transformers Are Secretly Fast Weight
    Programmers", 2021).

    r = [relu(x), relu(−x)] ∈ R^{2d};  φ(x) = [r_i · r_{(i+j) mod 2d}]  for j = 1..ν, i = 1..2d.
    F = 2dν (``nu``, default 1). Every feature is a product of two non-negative numbers, so φ ≥ 0 exactly
    (also in bf16); a row can be all zero (e.g. d = 1), and the denominator is then eps. Deterministic, O(N·d·ν).
    """

    def __init__(self, head_dim: int | None = None, *, nu: int = 1) -> None:
        super().__init__()
        self.head_dim = _check_head_dim("DpfpFeatureMap", head_dim)
        if not isinstance(nu, int) or not 1 <= nu <= 2 * self.head_dim - 1:
            raise LinearAttentionError(
                f"DpfpFeatureMap: nu must be an int in [1, 2·head_dim − 1] = [1, {2 * self.head_dim - 1}], got {nu!r}"
            )
        self.nu = nu

    def output_dim(self, head_dim: int) -> int:
        return 2 * self.head_dim * self.nu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input("DpfpFeatureMap", x, self.head_dim)
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)  # (..., N, 2d)
        # roll by -j pairs r_i with r_{i+j}
        return torch.cat([r * torch.roll(r, shifts=-j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, nu={self.nu}"
