"""The old import path of the card of a linearized folder: the product lives in :mod:`linattn.linearized` now
(:mod:`linattn.linearized.card`), apart from the measuring tools; this module keeps ``linattn.evaluate.card``
working."""

from __future__ import annotations

from ..linearized.card import (
    POSITION_BINS,
    Z95,
    card_lines,
    perplexity_by_position,
    wilson_interval,
    write_card,
)

__all__ = [
    "POSITION_BINS",
    "Z95",
    "card_lines",
    "perplexity_by_position",
    "wilson_interval",
    "write_card",
]
