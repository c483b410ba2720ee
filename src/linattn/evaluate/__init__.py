"""Measure linear attention against exact softmax attention, on real activations from transformers models.

- :func:`attention_metrics`: output error, row KL and entropies of one feature map on q, k, v (float64);
- :func:`load_model`, :func:`capture_attention`: per-layer, per-head q, k, v from a model on given text
  (encoders, and decoders such as the shipped SmolLM2: ``load_model("smollm2")``);
- :func:`perplexity`, :func:`long_range_probes`: causal LMs scored on text, repeated passages and passkeys;
- :func:`capture_metrics`: the metrics averaged over every layer and head of a capture;
- :mod:`linattn.evaluate.compare`: the ``linattn compare`` job on encoders (table, Markdown report, plots);
  :mod:`linattn.evaluate.lm_compare` the same on causal LMs (perplexity and long-range probes per row). Neither is
  imported here: they load the training code (:mod:`linattn.train`).

transformers is imported only when a model is loaded or captured. The product built on these tools (``linattn
linearize``, the linearized folder, its card, ``linattn generate``) is :mod:`linattn.linearized`; its old paths
here (``linattn.evaluate.linearized``, ``linearize_job``, ``linearize_budget``, ``card``, ``generate``) re-export it.
"""

from __future__ import annotations

from .capture import AttentionCapture, capture_attention, split_sequences
from .metrics import (
    SoftmaxReference,
    attention_metrics,
    capture_metrics,
    capture_references,
    linear_weights,
    softmax_reference,
    softmax_weights,
)
from .models import default_model_path, is_causal_lm, load_model
from .perplexity import Perplexity, perplexity
from .probes import long_range_probes, passkey_accuracy, passkeys, repeat_perplexity, repeated_passages

__all__ = [
    "AttentionCapture",
    "Perplexity",
    "SoftmaxReference",
    "attention_metrics",
    "capture_attention",
    "capture_metrics",
    "capture_references",
    "default_model_path",
    "is_causal_lm",
    "linear_weights",
    "load_model",
    "long_range_probes",
    "passkey_accuracy",
    "passkeys",
    "perplexity",
    "repeat_perplexity",
    "repeated_passages",
    "softmax_reference",
    "softmax_weights",
    "split_sequences",
]
