"""What both decoding steps share: the feature map of one token, and the grouped-query head repeat."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _validate
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


def check_memory(state: object, kind: type, step: str) -> torch.Tensor:
    """The memory (B, H, F, Dv) of a state a step continues: its kind (``kind``: the state class the step takes),
    batch shape (B, H), fp32 or fp64 sums. A window state's is its linear part's."""
    if not isinstance(state, kind):
        raise LinearAttentionError(
            f"state: {step} continues a {kind.__name__}, got {type(state).__name__}; pass the state "
            "linear_attention returned for this kind of call, or let linattn.decode.lean_step choose the step"
        )
    held: Any = getattr(state, "linear", state)
    memory: torch.Tensor = held.kv
    if memory.dim() != 4:
        raise LinearAttentionError(
            f"state: a decode step needs a state of batch shape (B, H), got kv of shape {tuple(memory.shape)}"
        )
    if memory.dtype not in (torch.float32, torch.float64):
        raise LinearAttentionError(
            f"state: kv in {memory.dtype}; the steps keep fp32 or fp64 sums (as linear_attention returns them): "
            "convert it with state.to(dtype=torch.float32)"
        )
    return memory


def check_step_options(eps: object, window: int | None = None, sinks: int = 0, window_factor: object = None,
                       softmax_scale: object = None) -> None:
    """A step's fixed options, as ``linear_attention`` checks them."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < float("inf"):
        raise LinearAttentionError(f"eps: expected a number ≥ 0 and finite, got {eps!r}")
    if window is not None:
        _validate.check_window_options(window, sinks, window_factor, softmax_scale)


def check_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                memory: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """One token's inputs against a step's memory and ``shape`` (B, H, Dv): floating q (B, H, 1, d), k (B, Hkv, 1,
    d) and v (B, Hkv, 1, Dv) on the memory's device (Hkv dividing H), a bool ``keep`` of B flags."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            seen = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(f"{name}: expected a floating tensor (B, H, 1, d), got {seen}")
        if x.device != memory.device:
            raise LinearAttentionError(
                f"{name}: on {x.device}, the step's state on {memory.device}; move the token (or the state, before "
                "making the step) to one device"
            )
    batch, heads, values = shape
    if q.dim() != 4 or tuple(q.shape[:3]) != (batch, heads, 1):
        raise LinearAttentionError(
            f"q: expected one token, (B, H, 1, d) = ({batch}, {heads}, 1, d), got {tuple(q.shape)}; a step takes one "
            "token a call (run longer inputs through linear_attention with initial_state=)"
        )
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2] != 1 or heads % k.shape[1] or k.shape[-1] != q.shape[-1] \
            or tuple(v.shape) != (*k.shape[:3], values):
        raise LinearAttentionError(
            f"k, v: expected one token each, (B, Hkv, 1, d) and (B, Hkv, 1, Dv) with B = {batch}, Hkv dividing "
            f"{heads}, d = {q.shape[-1]} and Dv = {values}; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.numel() != batch):
        found = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise LinearAttentionError(f"keep: expected a bool tensor (B, 1) where True keeps the token, got {found}")


def _require(valid: torch.Tensor, x: torch.Tensor, message: Callable[[str], str]) -> None:
    """Raise ``message(the values seen)`` unless ``valid`` holds. On a GPU the check is queued with the token's
    work instead (``torch._assert_async``: it fails at the next synchronisation, as a device-side assert): reading
    a flag back every token would cost a synchronisation a step, and none can be made while a CUDA graph is
    captured."""
    if valid.device.type == "cuda":
        torch._assert_async(valid, message("values"))
    elif not bool(valid):
        raise LinearAttentionError(message(f"values from {float(x.min())} to {float(x.max())}"))


def check_token_options(beta: torch.Tensor | None, log_decay: torch.Tensor | None) -> None:
    """A step's per-token β in [0, 2] and log-decay ≤ 0 (finite), as ``linear_attention`` takes them: β > 2 or a
    positive log-decay would make the memory grow without bound, silently."""
    if beta is not None:
        if not isinstance(beta, torch.Tensor) or not beta.is_floating_point():
            raise LinearAttentionError(f"beta: expected a floating tensor (B, H), got {type(beta).__name__}")
        _require(((beta >= 0) & (beta <= 2)).all(), beta, lambda seen: (
            f"beta: {seen} (or NaN); the write strength must lie in [0, 2] (e.g. torch.sigmoid(x @ w)): beyond it "
            "the delta memory grows without bound"))
    if log_decay is not None:
        if not isinstance(log_decay, torch.Tensor) or not log_decay.is_floating_point():
            raise LinearAttentionError(
                f"log_decay: expected a floating tensor (B, H) or (B, H, F), got {type(log_decay).__name__}"
            )
        _require(((log_decay <= 0) & (log_decay > float("-inf"))).all(), log_decay, lambda seen: (
            f"log_decay: {seen} (or NaN); a log-decay must be finite and ≤ 0 (e.g. F.logsigmoid(x)), since the "
            "state may only shrink"))
