"""The old import path of the ``linattn linearize`` pipeline: the product lives in :mod:`linattn.linearized` now
(:mod:`linattn.linearized.job`), apart from the measuring tools; this module keeps
``linattn.evaluate.linearize_job`` working."""

from __future__ import annotations

from ..linearized.job import (
    DISK_MARGIN,
    STAGES,
    Job,
    Stages,
    check_disk,
    cli,
    prepare_out,
)

__all__ = [
    "DISK_MARGIN",
    "Job",
    "STAGES",
    "Stages",
    "check_disk",
    "cli",
    "prepare_out",
]
