"""Per-feature gates' capability rules: the "gated" routes (the additive forms' reasons; the chunk 64 measured best
of 16/32/64, docs/decay.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .._table import Route
from ..additive.rules import global_only, none

ROUTES: tuple[Route, ...] = (
    Route("gated", "parallel", None, none),
    Route("gated", "global", None, global_only),
    Route("gated", "chunked", 64, none),
    Route("gated", "recurrent", None, none),
)
STEPS: dict[str, Callable[[nn.Module, Any, dict[str, Any]], list[str]]] = {}  # decoded by the composed step
