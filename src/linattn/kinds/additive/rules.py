"""The additive state's capability rules: its routes (kind "plain": every form), its lean decoding step's reasons and
its Triton kernels' reasons (the kernels: :mod:`linattn.kinds.additive.triton`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...backends import triton as triton_backend
from ...state import LinearAttentionState
from .._table import STEP_OPTIONS, Call, Route, step_common


def none(_: Call) -> list[str]:
    return []


def causal_only(call: Call) -> list[str]:
    return [] if call.causal else ["form='recurrent' is the causal token-by-token form; pass causal=True"]


def global_only(call: Call) -> list[str]:
    return ["form='global' is non-causal; pass causal=False, or form='chunked'"] if call.causal else []



ROUTES: tuple[Route, ...] = (
    Route("plain", "parallel", None, none),
    Route("plain", "global", None, global_only),
    Route("plain", "chunked", 64, none),  # non-causal: 1024, see linattn.capabilities.chunk_size
    Route("plain", "recurrent", None, causal_only),
)


def plain_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why :class:`~linattn.decode.DecodeStep` does not continue ``state`` as ``linear_attention(..., **options)``."""
    if type(state) is not LinearAttentionState:
        return [f"state {type(state).__name__}: the step continues a LinearAttentionState"]
    return step_common(fmap, state.kv, options, STEP_OPTIONS)


STEPS = {"plain": plain_step_reasons}


def triton_reasons(call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Why the plain kernels do not cover the call (before the feature map runs); [] when they do. Routes of kinds
    without kernels of their own get the kernels' reasons and one more: their kind."""
    found = triton_backend.reasons(
        q, causal=call.causal, form=route.form, log_space=call.log_space, chunk_size=call.chunk_size, dtype=dtype
    )
    if route.kind != "plain":
        found.append(f"{route.kind} attention: the kernels compute plain causal linear attention and the delta rule")
    return found + triton_backend.option_reasons(dict(call.options))


def step_kernel_reasons(kv: torch.Tensor, log_space: bool, eps: float) -> list[str]:
    """Why the Triton decoding kernel does not run a :class:`~linattn.decode.DecodeStep` on this state."""
    found = []
    if not (kv.device.type == "cuda" or (kv.device.type == "cpu" and triton_backend.interpreting())):
        found.append(f"device {kv.device}: the kernel runs on CUDA tensors (on CPU under TRITON_INTERPRET=1)")
    if kv.dtype != torch.float32:
        found.append(f"state in {kv.dtype}: the kernel keeps fp32 sums")
    if log_space:
        found.append("a log-space feature map")
    if eps <= 0:
        found.append("eps ≤ 0")
    if max(kv.shape[-2:]) > triton_backend.MAX_DIM:
        found.append(f"F or Dv > {triton_backend.MAX_DIM}")
    error = triton_backend.import_error() if not found else None
    return found + ([error] if error else [])
