"""Training: what changes a model's attention to imitate its softmax attention.

- :mod:`linattn.train.distill`: learned feature maps fitted per head to softmax rows
  (:func:`fit_feature_map`, :func:`fit_model_feature_maps`, giving a
  :class:`~linattn.feature_maps.fitted.FittedFeatureMaps`);
- :mod:`linattn.train.end_to_end`: those maps trained on a causal LM's next-token distribution
  (:func:`fit_end_to_end`), and the training text for it (sampled, copying sequences, key-retrieval sequences,
  retrieval heads);
- :mod:`linattn.train.lora`: peft LoRA adapters on the attention projections, trained by :func:`fit_end_to_end`
  (needs peft; imported on its own, not here).

Training uses the layers (:mod:`linattn.hf`, :mod:`linattn.nn`, the functional core) and never the evaluation
package: measuring what was trained is :mod:`linattn.evaluate`'s job.
"""

from __future__ import annotations

from .distill import fit_feature_map, fit_model_feature_maps
from .end_to_end import (
    coarse_kl,
    copying_sequences,
    copying_weights,
    fit_end_to_end,
    key_sequences,
    retrieval_scores,
    sample_texts,
    top_heads,
)

__all__ = [
    "coarse_kl",
    "copying_sequences",
    "copying_weights",
    "fit_end_to_end",
    "fit_feature_map",
    "fit_model_feature_maps",
    "key_sequences",
    "retrieval_scores",
    "sample_texts",
    "top_heads",
]
