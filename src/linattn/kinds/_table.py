"""What every kind's capability rules are written in: a :class:`Call` (what is known of a ``linear_attention`` call
before it runs), a :class:`Route` (one computation: kind × form) and the checks the decoding steps share. Each
kind's folder writes its rules in its ``rules.py`` (its routes, its steps' reasons, its kernels' reasons);
:mod:`linattn.capabilities` collects them into one table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..features import is_signed

# linear_attention options every step reproduces; any other option (window=, sinks=, min_denom=, ...) is left to it
STEP_OPTIONS = frozenset({"eps", "chunk_size", "form"})


@dataclass(frozen=True)
class Call:
    """What a path needs to know of a ``linear_attention`` call to say whether it covers it."""

    kind: str  # "plain", "gated" (per-feature gates), "window" (the window + sinks op), "sparse" (the window op
    # with a sparse exact cache), "delta" (the delta rule) or "composed" (the window beside a decayed or gated
    # linear part, or the delta rule)
    causal: bool
    form: str  # as asked: "auto" or a name of FORMS
    num_queries: int
    num_keys: int
    chunk_size: int | None = None
    carries_state: bool = False  # an initial state is given
    normalize: bool = True
    log_space: bool = False
    # options a backend may not know (decays, gates, packing), with their values: each one given is a reason
    options: tuple[tuple[str, Any], ...] = ()
    update: str = "add"  # the state's update rule: "add" or "delta"


@dataclass(frozen=True)
class Route:
    """One computation: ``kind`` × ``form``, its default chunk length, and why it cannot run a call."""

    kind: str
    form: str
    chunk: int | None
    reasons: Callable[[Call], list[str]]

    @property
    def name(self) -> str:
        return self.form if self.kind == "plain" else f"{self.kind}.{self.form}"


def step_common(fmap: nn.Module, kv: torch.Tensor, options: dict[str, Any], allowed: frozenset[str]) -> list[str]:
    found = []
    if kv.dtype not in (torch.float32, torch.float64):
        found.append(f"state in {kv.dtype}: the steps keep fp32 or fp64 sums")
    unknown = sorted(set(options) - allowed)
    if unknown:
        found.append(f"options {', '.join(unknown)}: not reproduced by the step")
    if not options.get("normalize", True):
        found.append("normalize=False: the steps compute normalised attention")
    if is_signed(fmap):
        found.append("a signed feature map: the steps take positive maps")
    return found



def fixed_option_reasons(options: dict[str, Any]) -> list[str]:
    """A step's fixed β and decay options: one β in [0, 2], a decay rate as a float or one per head."""
    found = []
    beta = options.get("beta")
    if beta is not None and not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta <= 2):
        found.append("beta: the step takes one float in [0, 2] as an option (per-token β with each call)")
    decay = options.get("decay")
    if isinstance(decay, torch.Tensor) and decay.dim() > 1:
        found.append("decay: the step takes a float or one rate per head (H,)")
    return found

