"""What both decoding steps share: the feature map of one token, and the grouped-query head repeat."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import LinearAttentionError
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


def check_memory(kv: torch.Tensor) -> None:
    """A state's memory as a step takes it: batch shape (B, H), fp32 or fp64 sums."""
    if kv.dim() != 4:
        raise LinearAttentionError(
            f"state: a decode step needs a state of batch shape (B, H), got kv of shape {tuple(kv.shape)}"
        )
    if kv.dtype not in (torch.float32, torch.float64):
        raise LinearAttentionError(
            f"state: kv in {kv.dtype}; the steps keep fp32 or fp64 sums (as linear_attention returns them): convert "
            "it with state.to(dtype=torch.float32)"
        )


def check_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                memory: torch.Tensor) -> None:
    """One token's inputs against a step's memory: floating q, k, v on the memory's device, a bool ``keep``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            seen = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(f"{name}: expected a floating tensor (B, H, 1, d), got {seen}")
        if x.device != memory.device:
            raise LinearAttentionError(
                f"{name}: on {x.device}, the step's state on {memory.device}; move the token (or the state, before "
                "making the step) to one device"
            )
    if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool):
        seen = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise LinearAttentionError(f"keep: expected a bool tensor (B, 1) where True keeps the token, got {seen}")


def check_token_options(beta: torch.Tensor | None, log_decay: torch.Tensor | None) -> None:
    """A step's per-token β in [0, 2] and log-decay ≤ 0 (finite), as ``linear_attention`` takes them: β > 2 or a
    positive log-decay would make the memory grow without bound, silently. (Two small reductions a token; on a GPU
    each reads one value back.)"""
    if beta is not None:
        if not isinstance(beta, torch.Tensor) or not beta.is_floating_point():
            raise LinearAttentionError(f"beta: expected a floating tensor (B, H), got {type(beta).__name__}")
        if not bool(((beta >= 0) & (beta <= 2)).all()):
            raise LinearAttentionError(
                f"beta: values from {float(beta.min())} to {float(beta.max())} (or NaN); the write strength must "
                "lie in [0, 2] (e.g. torch.sigmoid(x @ w)): beyond it the delta memory grows without bound"
            )
    if log_decay is not None:
        if not isinstance(log_decay, torch.Tensor) or not log_decay.is_floating_point():
            raise LinearAttentionError(
                f"log_decay: expected a floating tensor (B, H) or (B, H, F), got {type(log_decay).__name__}"
            )
        if not bool(((log_decay <= 0) & (log_decay > float("-inf"))).all()):
            raise LinearAttentionError(
                f"log_decay: values from {float(log_decay.min())} to {float(log_decay.max())} (or NaN); a log-decay "
                "must be finite and ≤ 0 (e.g. F.logsigmoid(x)), since the state may only shrink"
            )
