"""Strict JSON for every results file: a number that is not finite (NaN, ±Inf: "not measured", "no value yet")
is written ``null``, never Python's ``NaN``/``Infinity`` (which are not JSON, and which other readers refuse)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None, tuples as lists, and numpy or torch scalars
    as Python numbers (walks dicts, lists and tuples; anything else is left for ``json``'s ``default``)."""
    if isinstance(value, Mapping):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) or (hasattr(value, "item") and getattr(value, "ndim", None) == 0):
        number = value.item() if hasattr(value, "item") else float(value)
        if isinstance(number, float):
            return number if math.isfinite(number) else None
        return number
    return value


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, **options: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(value)`` with ``allow_nan=False``: strict JSON, ``null`` where a number
    is missing. ``default`` converts other objects (its results go through :func:`finite` too)."""
    convert = None if default is None else (lambda item: finite(default(item)))
    return json.dumps(finite(value), allow_nan=False, default=convert, **options)
