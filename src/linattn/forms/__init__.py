"""Computation forms. Each takes features (never feature maps' internals) and returns (output, state)."""

from __future__ import annotations

from ..kinds.additive.forms.chunked import causal_chunked_attention, noncausal_chunked_attention
from ..kinds.additive.forms.global_ import global_attention
from ..kinds.additive.forms.parallel import parallel_attention
from ..kinds.additive.forms.recurrent import recurrent_attention

FORMS = ("auto", "parallel", "global", "chunked", "recurrent")

__all__ = [
    "FORMS",
    "causal_chunked_attention",
    "global_attention",
    "noncausal_chunked_attention",
    "parallel_attention",
    "recurrent_attention",
]
