"""Measure linear attention against exact softmax attention, on real activations from transformers models.

- :func:`attention_metrics`: output error, row KL and entropies of one feature map on q, k, v (float64);
- :func:`load_model`, :func:`capture_attention`: per-layer, per-head q, k, v from a model on given text;
- :func:`capture_metrics`: the metrics averaged over every layer and head of a capture;
- :mod:`linattn.evaluate.compare`: the ``linattn compare`` job (table, Markdown report, plots).

transformers is imported only when a model is loaded or captured.
"""

from __future__ import annotations

from .capture import AttentionCapture, capture_attention, default_model_path, load_model, split_sequences
from .metrics import (
    SoftmaxReference,
    attention_metrics,
    capture_metrics,
    capture_references,
    linear_weights,
    softmax_reference,
    softmax_weights,
)

__all__ = [
    "AttentionCapture",
    "SoftmaxReference",
    "attention_metrics",
    "capture_attention",
    "capture_metrics",
    "capture_references",
    "default_model_path",
    "linear_weights",
    "load_model",
    "softmax_reference",
    "softmax_weights",
    "split_sequences",
]
