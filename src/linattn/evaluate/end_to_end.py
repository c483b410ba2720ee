"""Moved to :mod:`linattn.train.end_to_end` (training the maps on the model's next-token distribution); the names
are re-exported here (with the private helpers that tests and benchmarks import) so that code written against
``linattn.evaluate.end_to_end`` keeps working."""

from __future__ import annotations

from ..train.end_to_end import (
    TOP_TOKENS,
    cache_split,
    coarse_kl,
    copying_sequences,
    copying_weights,
    fit_end_to_end,
    retrieval_scores,
    sample_texts,
    top_heads,
)
from ..train.end_to_end import _coarse_teacher as _coarse_teacher
from ..train.end_to_end import _copy_plans as _copy_plans
from ..train.end_to_end import _log_probs as _log_probs

__all__ = [
    "TOP_TOKENS",
    "cache_split",
    "coarse_kl",
    "copying_sequences",
    "copying_weights",
    "fit_end_to_end",
    "retrieval_scores",
    "sample_texts",
    "top_heads",
]
