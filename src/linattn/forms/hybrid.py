"""``linear_attention(..., window=W)``: checks the hybrid's options and state, picks its form, runs it."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .. import _validate
from ..errors import LinearAttentionError
from ..state import WindowAttentionState
from .window import Hybrid, causal_window_chunked, noncausal_window_chunked
from .window_ref import window_parallel, window_recurrent

DEFAULT_CHUNK = 64


def run_window(
    features: Callable[[torch.Tensor, bool], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    initial_state: Any,
    *,
    causal: bool,
    window: int,
    sinks: int,
    factor: Any,
    softmax_scale: float | None,
    form: str,
    chunk_size: int | None,
    eps: float,
    min_denom: float | None,
    log_space: bool,
    return_state: bool,
) -> tuple[torch.Tensor, WindowAttentionState | None]:
    """q, k, v in the compute dtype with k/v heads already repeated to q's (GQA); v zero at masked keys."""
    batch = q.shape[:-2]
    if not causal and (initial_state is not None or return_state):
        raise LinearAttentionError(
            "initial_state / return_state: the non-causal hybrid has no state (every query sees every key); "
            "use causal=True for streaming and decoding"
        )
    state = None
    if initial_state is not None:
        dims = (k.shape[-1], v.shape[-1])
        state = _validate.check_window_state(initial_state, batch, dims, q.dtype, q.device, window, sinks)
    gamma = None
    if factor is not None:
        gamma = torch.as_tensor(factor, dtype=q.dtype, device=q.device)
        try:
            gamma = torch.broadcast_to(gamma, batch)  # a per-head factor (H,) broadcasts over (B, H)
        except RuntimeError:
            raise LinearAttentionError(
                f"window_factor: shape {tuple(gamma.shape)} does not broadcast to the batch/head dims "
                f"{tuple(batch)}; pass a float or one value per head, e.g. shape (H,)"
            ) from None
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if keep is None:
        keep = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    hybrid = Hybrid(features, log_space=log_space, window=window, sinks=sinks, factor=gamma, scale=scale, eps=eps,
                    min_denom=min_denom)
    if form == "auto":
        form = "recurrent" if causal and q.shape[-2] == 1 and state is not None else "chunked"
    guard = nullcontext()
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        guard = torch.autocast(q.device.type, enabled=False)  # type: ignore[assignment]
    with guard:
        if form == "parallel":
            return window_parallel(hybrid, q, k, v, keep, state, causal)
        if not causal:
            return noncausal_window_chunked(hybrid, q, k, v, keep, chunk_size or DEFAULT_CHUNK), None
        if form == "recurrent":
            return window_recurrent(hybrid, q, k, v, keep, state)
        return causal_window_chunked(hybrid, q, k, v, keep, state, chunk_size or DEFAULT_CHUNK)
