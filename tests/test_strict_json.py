"""Results files are strict JSON: a number that is missing or not finite is written null, never NaN/Infinity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from linattn._json import dumps, finite
from linattn.evaluate.report import write_results

ROOT = Path(__file__).resolve().parent.parent


def strict_loads(text: str):
    """json.loads refusing NaN, Infinity and -Infinity (Python's json reads them by default; JSON has none)."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_dumps_writes_null_for_every_number_that_is_not_finite():
    value = {"nan": math.nan, "inf": [math.inf, -math.inf, 1.5], "tuple": (1, 2), "np": np.float32("nan"),
             "np_ok": np.float64(0.25), "int": np.int64(3), "tensor": torch.tensor(2.5), "nan_tensor":
             torch.tensor(float("nan")), "nested": [{"x": (math.nan, 2.0)}], "flag": True, "none": None}
    text = dumps(value, sort_keys=True)
    assert strict_loads(text) == {"nan": None, "inf": [None, None, 1.5], "tuple": [1, 2], "np": None, "np_ok": 0.25,
                                  "int": 3, "tensor": 2.5, "nan_tensor": None, "nested": [{"x": [None, 2.0]}],
                                  "flag": True, "none": None}
    assert finite(True) is True and finite(7) == 7 and finite("NaN") == "NaN"  # only numbers change
    # what `default` makes goes through the same conversion
    assert strict_loads(dumps({"x": object()}, default=lambda _: math.nan)) == {"x": None}
    with pytest.raises(TypeError):  # no default: an unknown object is still an error, not silently dropped
        dumps({"x": object()})


def test_compare_results_are_strict_json(tmp_path):
    paths = write_results({"rows": [{"rel_error": math.nan, "kl": np.float64(math.inf), "ppl": 1.5}]}, ["# r"],
                          str(tmp_path))
    assert strict_loads(Path(paths[0]).read_text()) == {"rows": [{"rel_error": None, "kl": None, "ppl": 1.5}]}


@pytest.mark.parametrize("path", sorted(p for folder in ("src", "docs", "benchmarks", "examples")
                                        for p in (ROOT / folder).rglob("*.json")),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_json_file_of_the_repository_is_strict(path):
    strict_loads(path.read_text(encoding="utf-8"))
