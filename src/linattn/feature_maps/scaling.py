"""Scaling q and k so that a feature map built for the standard softmax scale 1/√d serves any scale s.

Learned and random maps imitate exp(q·k/√d). Attention at another scale s (a model's own ``scaling``) is the same
as attention at 1/√d on q and k each multiplied by c = (s·√d)^½, since (c·q)·(c·k)/√d = s·q·k. Fitting
(:mod:`linattn.train.distill`) and measuring (:mod:`linattn.evaluate.metrics`) both need this, so it lives with
the maps.
"""

from __future__ import annotations

import math

import torch

from ..errors import LinearAttentionError


def scale_for_map(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(c·q, c·k, s) with c = (s·√d)^½, so that a map built for the scale 1/√d sees the scale s."""
    head_dim = q.shape[-1]
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not s > 0 or not math.isfinite(s):
        raise LinearAttentionError(f"scale: must be a positive finite number, got {scale!r}")
    c = math.sqrt(s * math.sqrt(head_dim))
    return q * c, k * c, s
