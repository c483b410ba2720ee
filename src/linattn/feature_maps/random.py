"""Random-feature maps for the softmax kernel K(q, k) = exp(q·k/√d): FAVOR+, FAVOR++ and trigonometric features.

All three draw m projections ω_1..ω_m ~ N(0, I_d) and estimate the kernel by an average over them,
E_ω[φ(q)·φ(k)] = exp(x̂·ŷ) with x̂ = q·d^{-1/4}, ŷ = k·d^{-1/4} (``scale`` overrides d^{-1/4}).

Projections are a buffer (they travel in ``state_dict``). ``seed`` fixes them; without it they come from torch's
global generator (so ``torch.manual_seed`` makes them reproducible). Orthogonal draws (the default) take
⌈m/d⌉ independent d×d blocks, orthonormalise each by QR, and give every row an independent chi(d)-distributed
length: each ω_i is still marginally N(0, I_d), so the estimators stay unbiased, and rows within a block are
orthogonal, which lowers the kernel's mean-squared error.

``redraw()`` draws fresh projections; it works in training mode only (redrawing in eval would make evaluation
irreproducible) and raises in eval mode unless ``force=True``. :func:`redraw_random_features` redraws every
random map inside a model that is in training mode, for Performer-style redraw schedules.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..errors import LinearAttentionError
from .base import FeatureMap


def default_num_features(head_dim: int) -> int:
    """m ≈ d·ln d, the size the Performer paper suggests for the FAVOR+ estimator (at least 1)."""
    return max(1, round(head_dim * math.log(head_dim)))


def gaussian_projection(
    num_features: int, head_dim: int, *, orthogonal: bool, generator: torch.Generator
) -> torch.Tensor:
    """(m, d) float64 matrix whose rows are marginally N(0, I_d); orthogonal within blocks of d rows if asked."""
    if not orthogonal:
        return torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    blocks = -(-num_features // head_dim)
    gaussian = torch.randn(blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # batched over the blocks
    # the sign fix makes q Haar-distributed (QR alone is biased towards a positive diagonal of r)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    directions = q.transpose(-1, -2).reshape(blocks * head_dim, head_dim)[:num_features]  # (m, d), rows orthonormal
    # chi(d) lengths: the norm of an independent Gaussian vector, so each row is distributed as N(0, I_d)
    lengths = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)
    return directions * lengths.unsqueeze(-1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # half-precision inputs are mapped in fp32: log-features of size ‖x‖²/2 ≈ 10³ have no digits left in bf16
    return torch.promote_types(x.dtype, torch.float32)


class RandomFeatureMap(FeatureMap):
    """Shared machinery of the random maps: the (m, d) projection buffer, its seed, and ``redraw()``."""

    random: ClassVar[bool] = True
    projection: torch.Tensor

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        num_features: int | None = None,
        orthogonal: bool = True,
        seed: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if head_dim is None or not isinstance(head_dim, int) or head_dim < 1:
            raise LinearAttentionError(
                f"{name}: head_dim must be a positive int (the last dimension of q and k), got {head_dim!r}"
            )
        if num_features is None:
            num_features = default_num_features(head_dim)
        if not isinstance(num_features, int) or num_features < 1:
            raise LinearAttentionError(f"{name}: num_features must be a positive int, got {num_features!r}")
        if scale is not None and not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise LinearAttentionError(f"{name}: scale must be a positive finite number, got {scale!r}")
        self.head_dim = head_dim
        self.num_features = num_features
        self.orthogonal = bool(orthogonal)
        self.seed = seed
        self.scale = float(scale) if scale is not None else head_dim**-0.25
        if seed is None:  # a seed from torch's global generator: torch.manual_seed(...) makes the draw reproducible
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self._generator = torch.Generator().manual_seed(seed)
        self.register_buffer("projection", self._draw().to(torch.get_default_dtype()))

    def _draw(self) -> torch.Tensor:
        return gaussian_projection(
            self.num_features, self.head_dim, orthogonal=self.orthogonal, generator=self._generator
        )

    @torch.no_grad()
    def redraw(self, *, force: bool = False) -> None:
        """Draw new projections (the next ones of this map's seeded sequence). Training mode only, unless forced."""
        if not self.training and not force:
            raise LinearAttentionError(
                f"{type(self).__name__}.redraw(): the map is in eval mode, where projections stay fixed so that "
                "evaluation is reproducible; call .train() first, or pass force=True"
            )
        self.projection.copy_(self._draw().to(self.projection.dtype))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ωᵀx̂ (..., N, m) and ‖x̂‖²/2 (..., N, 1) in at least fp32."""
        if x.shape[-1] != self.head_dim:
            raise LinearAttentionError(
                f"{type(self).__name__}: inputs have last dimension {x.shape[-1]}, but the map was built for "
                f"head_dim={self.head_dim}; create it with head_dim={x.shape[-1]}"
            )
        dtype = _compute_dtype(x)
        x_hat = x.to(dtype) * self.scale
        projected = x_hat @ self.projection.to(device=x.device, dtype=dtype).T  # (..., N, m)
        half_sq_norm = 0.5 * (x_hat * x_hat).sum(-1, keepdim=True)  # (..., N, 1)
        return projected, half_sq_norm

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, orthogonal={self.orthogonal}, "
            f"seed={self.seed}"
        )


class FavorPlusFeatureMap(RandomFeatureMap):
    """FAVOR+ positive random features (Choromanski et al., "Rethinking Attention with Performers", 2021).

    φ(x) = exp(ωᵢᵀx̂ − ‖x̂‖²/2)/√m for i = 1..m, x̂ = x·d^{-1/4}, so E[φ(q)·φ(k)] = exp(q·k/√d) exactly.
    F = m (``num_features``, default ≈ d·ln d); strictly positive, random, not learned. O(N·d·m) per head.

    A log-space map: :meth:`features` returns log φ = ωᵀx̂ − ‖x̂‖²/2 − ln√m, and :func:`linattn.linear_attention`
    exponentiates it with an exact causal-safe shift (a running maximum carried in the state), so inputs with
    norms of 100 neither overflow nor underflow to an all-zero row. Use it with ``normalize=True``. Calling the
    module itself returns φ (unshifted: it may overflow for large inputs).

    >>> fm = FavorPlusFeatureMap(16, num_features=64, seed=0)
    >>> fm.features(torch.randn(2, 10, 16), is_query=True).shape
    torch.Size([2, 10, 64])
    """

    log_space: ClassVar[bool] = True

    def output_dim(self, head_dim: int) -> int:
        return self.num_features

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        return projected - half_sq_norm - 0.5 * math.log(self.num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.features(x, is_query=False))


class FavorPlusPlusFeatureMap(RandomFeatureMap):
    """FAVOR++: optimal positive random features (Likhosherstov et al., "Chefs' Random Tables", NeurIPS 2022).

    φ(x) = D·exp(A‖ωᵢ‖² + B·ωᵢᵀx̂ − ‖x̂‖²/2)/√m with B = √(1 − 4A), D = (1 − 4A)^{d/4} and A < 1/8. For ω ~ N(0, I)
    E[exp(2A‖ω‖² + uᵀω)] = (1 − 4A)^{-d/2} exp(‖u‖²/(2(1 − 4A))), hence E[φ(q)·φ(k)] = exp(x̂·ŷ) for every such A;
    A = 0 is FAVOR+. The second moment of one feature is
        D⁴ (1 − 8A)^{-d/2} exp(2(1 − 4A)‖x̂ + ŷ‖²/(1 − 8A) − ‖x̂‖² − ‖ŷ‖²),
    and the A minimising its logarithm averaged over query/key pairs is the closed form
        A* = (1 − 2ρ − √((2ρ + 1)² + 8ρ))/16,  ρ = mean over pairs of ‖x̂ + ŷ‖²/d   (A* ≤ 0).

    ρ must not come from the sequence being attended (A would then depend on later tokens, breaking causality),
    so A is a buffer: set by the ``rho`` option (default 2/√d, the value for q, k with i.i.d. N(0, 1) entries) or
    by :meth:`calibrate` on sample queries and keys. F = m; strictly positive, random, not learned. Log-space
    like FAVOR+ (use ``normalize=True``).
    """

    log_space: ClassVar[bool] = True
    coef_a: torch.Tensor

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        num_features: int | None = None,
        orthogonal: bool = True,
        seed: int | None = None,
        scale: float | None = None,
        rho: float | None = None,
    ) -> None:
        super().__init__(head_dim, num_features=num_features, orthogonal=orthogonal, seed=seed, scale=scale)
        if rho is None:
            rho = 2.0 / math.sqrt(self.head_dim)
        self.register_buffer("coef_a", torch.tensor(self._optimal_a(rho), dtype=torch.float64))

    @staticmethod
    def _optimal_a(rho: float) -> float:
        if not (isinstance(rho, int | float) and math.isfinite(rho) and rho >= 0):
            raise LinearAttentionError(f"FavorPlusPlusFeatureMap: rho must be a finite number ≥ 0, got {rho!r}")
        return (1.0 - 2.0 * rho - math.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0

    @torch.no_grad()
    def calibrate(self, q: torch.Tensor, k: torch.Tensor) -> float:
        """Set A to the optimum for these sample queries and keys ``(..., N, d)``; returns the statistic ρ.

        ρ = mean_{i,j} ‖x̂_i + ŷ_j‖²/d within each leading index (batch, head), averaged over them; it needs
        only O(N·d): mean‖x̂‖² + mean‖ŷ‖² + 2·mean(x̂)·mean(ŷ).
        """
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise LinearAttentionError(
                f"calibrate: q and k must have last dimension head_dim={self.head_dim}, got {q.shape} and {k.shape}"
            )
        x = q.to(torch.float64) * self.scale
        y = k.to(torch.float64) * self.scale
        pair_sq = (x * x).sum(-1).mean(-1) + (y * y).sum(-1).mean(-1) + 2 * (x.mean(-2) * y.mean(-2)).sum(-1)
        rho = float(pair_sq.mean()) / self.head_dim
        self.coef_a.fill_(self._optimal_a(rho))
        return rho

    def output_dim(self, head_dim: int) -> int:
        return self.num_features

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        dtype = projected.dtype
        a = self.coef_a.to(device=x.device, dtype=dtype)
        one_minus_4a = 1.0 - 4.0 * a
        omega = self.projection.to(device=x.device, dtype=dtype)
        # A‖ω‖² + ln D − ln√m does not depend on x: one (m,) vector
        constant = a * (omega * omega).sum(-1) + 0.25 * self.head_dim * torch.log(one_minus_4a)
        constant = constant - 0.5 * math.log(self.num_features)
        return torch.sqrt(one_minus_4a) * projected - half_sq_norm + constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.features(x, is_query=False))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, A={float(self.coef_a):.4g}"


class TrigFeatureMap(RandomFeatureMap):
    """Trigonometric random features (Rahimi & Recht, 2007; the softmax estimator of the Performer paper).

    ``kernel="softmax"`` (default): φ(x) = exp(‖x̂‖²/2)/√m · [sin(ωᵀx̂), cos(ωᵀx̂)], E[φ(q)·φ(k)] = exp(x̂·ŷ).
    ``kernel="gaussian"``: the bounded φ(x) = [sin(ωᵀx̂), cos(ωᵀx̂)]/√m, E[φ(q)·φ(k)] = exp(−‖x̂ − ŷ‖²/2).
    F = 2m. SIGNED (``positive = False``): estimates of φ(q)·Σφ(k) can be zero or negative, so use it with
    ``normalize=False`` (unnormalised attention Σ_j K(q, k_j) v_j), or with a ``min_denom`` clamp at your risk.
    Its variance grows like exp(‖x̂‖² + ‖ŷ‖²): FAVOR+ is the better softmax estimator. With the softmax kernel,
    the factor exp(‖x̂‖²/2) overflows for large inputs (‖x̂‖²/2 > 88 in fp32): the map then raises rather than
    return inf/NaN features.
    """

    positive: ClassVar[bool] = False

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        num_features: int | None = None,
        orthogonal: bool = True,
        seed: int | None = None,
        scale: float | None = None,
        kernel: str = "softmax",
    ) -> None:
        if kernel not in ("softmax", "gaussian"):
            raise LinearAttentionError(f"TrigFeatureMap: kernel must be 'softmax' or 'gaussian', got {kernel!r}")
        super().__init__(head_dim, num_features=num_features, orthogonal=orthogonal, seed=seed, scale=scale)
        self.kernel = kernel

    def output_dim(self, head_dim: int) -> int:
        return 2 * self.num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        features = torch.cat([torch.sin(projected), torch.cos(projected)], dim=-1)  # (..., N, 2m)
        log_amplitude = -0.5 * math.log(self.num_features)
        if self.kernel == "softmax":
            limit = math.log(torch.finfo(projected.dtype).max) - 1.0
            if half_sq_norm.numel() and float(half_sq_norm.max()) > limit:
                raise LinearAttentionError(
                    f"TrigFeatureMap: an input has ‖x·scale‖²/2 = {float(half_sq_norm.max()):.4g} > {limit:.4g}, so "
                    f"exp(‖x·scale‖²/2) overflows {projected.dtype}. Use favor+ (log-space, stable for any norm), "
                    "kernel='gaussian', or smaller inputs"
                )
            return features * torch.exp(half_sq_norm + log_amplitude)
        return features * math.exp(log_amplitude)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel!r}"


def redraw_random_features(module: torch.nn.Module) -> int:
    """Redraw the projections of every random feature map inside ``module`` that is in training mode.

    Maps in eval mode are left as they are. Returns the number of maps redrawn. Call it every few hundred
    optimiser steps for a Performer-style redraw schedule.
    """
    count = 0
    for child in module.modules():
        if isinstance(child, RandomFeatureMap) and child.training:
            child.redraw()
            count += 1
    return count
