"""tests/gpu_checks.py under pytest: the Triton backend on a CUDA device (skipped without one)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

import gpu_checks  # noqa: E402


@pytest.mark.parametrize("check", gpu_checks.CHECKS, ids=lambda c: c.__name__)
def test_on_gpu(check: Callable[[], None]) -> None:
    check()
