"""The old import path of the ``linattn linearize`` pipeline: the product lives in :mod:`linattn.linearized` now
(:mod:`linattn.linearized.job`), apart from the measuring tools; this module keeps
``linattn.evaluate.linearize_job`` working."""

from __future__ import annotations

from ..linearized.folder import DISK_MARGIN, check_disk, prepare_out
from ..linearized.job import STAGES, Job, Stages, cli

__all__ = [
    "DISK_MARGIN",
    "Job",
    "STAGES",
    "Stages",
    "check_disk",
    "cli",
    "prepare_out",
]
