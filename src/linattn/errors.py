"""The one exception class of linattn."""

from __future__ import annotations


class LinearAttentionError(ValueError):
    """Raised for every bad input. The message names the argument, what was seen, and what to do."""
