from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

# the float64 reference lives beside the tests
sys.path.insert(0, os.path.dirname(__file__))

# torch.compile's on-disk cache (default /tmp/torchinductor_<user>) is not keyed on ATEN_CPU_CAPABILITY: a kernel
# built by a run with one SIMD level and reused by `make test-other-kernels` with another gave NaN or a C++ compile
# error here. Each test session compiles into its own folder, removed at exit.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="linattn-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same state of each global generator (torch, numpy, random), whatever ran before
    it: a test that draws from one without a seed of its own still sees the same numbers alone or in the suite."""
    import random

    import torch

    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(0)  # noqa: NPY002  (the legacy global generator is the one to seed)
