"""Parts of :class:`~linattn.nn.LinearAttention` beyond the projections and the attention core: the short causal
convolution over time and the output gate (both from Gated DeltaNet; usable with either update rule), and the
checks of the update rule's options."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LinearAttentionError

RMS_EPS = 1e-5


class ShortConv(nn.Module):
    """A causal depthwise convolution over time with kernel K, then SiLU, on each channel of the projections:

        y_t = SiLU(Σ_{i<K} w_i ⊙ x_{t−K+1+i}),   x_s = 0 before the first token

    (the short convolution Mamba, DeltaNet and Gated DeltaNet apply to q, k and v). What a later call needs is the
    last K−1 inputs, carried in :class:`~linattn.ShortConvState`.
    """

    def __init__(self, channels: int, kernel: int, **factory: Any) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, kernel, **factory))  # (C, K): one filter per channel
        bound = 1 / math.sqrt(kernel)  # nn.Conv1d's default initialisation for a depthwise filter (fan-in K)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, carried: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, N, C), the K−1 inputs before it (B, K−1, C) (zeros when None), keep (B, N) bool: a masked token's
        input is 0, so padding reaches no neighbour → (y (B, N, C), the last K−1 inputs to carry on)."""
        if keep is not None:
            x = x.masked_fill(~keep.unsqueeze(-1), 0)
        batch, _, channels = x.shape
        if carried is None:
            carried = x.new_zeros(batch, self.kernel - 1, channels)
        full = torch.cat([carried.to(x.dtype), x], dim=1)  # (B, K−1+N, C)
        y = F.conv1d(full.transpose(1, 2), self.weight.unsqueeze(1).to(x.dtype), groups=channels)  # (B, C, N)
        tail = full[:, full.shape[1] - (self.kernel - 1):].clone()  # a copy: not a view of the whole sequence
        return F.silu(y.transpose(1, 2)), tail

    def step(self, x: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        """One token x (B, 1, C) after ``carried`` (B, K−1, C), which is advanced in place → y (B, 1, C)."""
        full = torch.cat([carried, x.to(carried.dtype)], dim=1)  # (B, K, C)
        y = (full * self.weight.t().to(full.dtype)).sum(1, keepdim=True)
        carried.copy_(full[:, 1:])
        return F.silu(y).to(x.dtype)


class OutputGate(nn.Module):
    """Gated DeltaNet's output gate: o ← Norm(o) ⊙ SiLU(x W_g) per head, before the output projection.

    ``norm=True``: Norm is an RMSNorm over each head's Dv with a learned scale (shared by the heads); ``norm=False``
    when the layer's ``output_norm`` (a group norm per head) normalises instead, so a head is normalised once.
    """

    def __init__(self, embed_dim: int, heads: int, head_dim: int, *, norm: bool, **factory: Any) -> None:
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(embed_dim, heads * head_dim, bias=False, **factory)
        self.weight = nn.Parameter(torch.ones(head_dim, **factory)) if norm else None

    def normalise(self, out: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head: out (B, N, H, Dv)."""
        assert self.weight is not None
        wide = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out  # the mean square in fp32
        scale = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return (wide * scale).to(out.dtype) * self.weight

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out (B, N, H, Dv) already normalised if ``norm`` is False, x (B, N, E) → gated (B, N, H, Dv)."""
        if self.weight is not None:
            out = self.normalise(out)
        return out * F.silu(self.proj(x)).unflatten(-1, (self.heads, -1))


def check_layer_update(update: object, beta_scale: object, short_conv: object, causal: bool, normalize: bool | None,
                       min_denom: object, window: object) -> None:
    """The update rule, the short convolution and the options they must (not) come with, checked when the layer
    is built."""
    if short_conv is not None and (isinstance(short_conv, bool) or not isinstance(short_conv, int) or short_conv < 1):
        raise LinearAttentionError(
            f"short_conv: expected a kernel size ≥ 1 (e.g. 4, as Gated DeltaNet) or None, got {short_conv!r}"
        )
    if update not in ("add", "delta"):
        raise LinearAttentionError(f"update: expected 'add' or 'delta', got {update!r}")
    if isinstance(beta_scale, bool) or not isinstance(beta_scale, (int, float)) or not 0 < beta_scale <= 2:
        raise LinearAttentionError(
            f"beta_scale: expected a float in (0, 2] (1: β ∈ (0, 1), DeltaNet; 2: β ∈ (0, 2), negative eigenvalues), "
            f"got {beta_scale!r}"
        )
    if update == "add":
        if beta_scale != 1:
            raise LinearAttentionError("beta_scale: the write strength belongs to the delta rule; pass update='delta'")
        return
    if not causal:
        raise LinearAttentionError(
            "update='delta': the delta rule is a recurrence (each write corrects what the memory recalls from the "
            "tokens before it), so it needs an order; build the layer with causal=True"
        )
    if normalize or min_denom is not None:
        raise LinearAttentionError(
            "update='delta': the delta memory has no Σφ(k) to normalise by; leave normalize (False for this "
            "update) and min_denom unset"
        )
