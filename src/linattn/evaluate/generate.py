"""The old import path of ``linattn generate``: the product lives in :mod:`linattn.linearized` now
(:mod:`linattn.linearized.generate`), apart from the measuring tools; this module keeps
``linattn.evaluate.generate`` working."""

from __future__ import annotations

from ..linearized.generate import (
    Generation,
    cache_bytes,
    cli,
    generate_measured,
    plot,
)

__all__ = [
    "Generation",
    "cache_bytes",
    "cli",
    "generate_measured",
    "plot",
]
