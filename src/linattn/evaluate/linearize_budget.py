"""The old import path of the step counts of ``linattn linearize --budget``: the product lives in
:mod:`linattn.linearized` now (:mod:`linattn.linearized.budget`), apart from the measuring tools; this module keeps
``linattn.evaluate.linearize_budget`` working."""

from __future__ import annotations

from ..linearized.budget import (
    EVAL_OVERHEAD,
    FIT_PROBE_STEPS,
    FIT_SHARE,
    MAX_STEPS,
    MIN_END_TO_END_STEPS,
    MIN_FIT_STEPS,
    SAFETY,
    SAMPLING_BATCH,
    SAMPLING_PROMPT,
    calibrate,
    plan_steps,
    training_sequences_of,
)

__all__ = [
    "EVAL_OVERHEAD",
    "FIT_PROBE_STEPS",
    "FIT_SHARE",
    "MAX_STEPS",
    "MIN_END_TO_END_STEPS",
    "MIN_FIT_STEPS",
    "SAFETY",
    "SAMPLING_BATCH",
    "SAMPLING_PROMPT",
    "calibrate",
    "plan_steps",
    "training_sequences_of",
]
