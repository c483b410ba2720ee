"""KDA (the delta rule with a per-feature gate) on the Triton backend: its rows in the capability table, the reasons
a call is not covered, and the kernels in the interpreter (tests/triton_kda_interpreted.py, in a child process, as
tests/test_triton_delta.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import linattn
from linattn import LinearAttentionError
from linattn.capabilities import Call, choose_backend, choose_route

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _inputs(n: int = 20, d: int = 8, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """q, k, v (1, 2, n, d), β (1, 2, n), per-feature log-gates (1, 2, n, d)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=generator).to(dtype) for _ in range(3))
    return [q, k, v, torch.rand(1, 2, n, generator=generator).to(dtype),
            -torch.rand(1, 2, n, d, generator=generator).to(dtype)]


def _kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
         **options: object) -> torch.Tensor:
    return linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, log_gate=gate,  # type: ignore
                                    feature_map="identity", **options)


def test_kernels_in_the_interpreter() -> None:
    """tests/triton_kda_interpreted.py in its own pytest process with TRITON_INTERPRET=1: forward, gradients,
    strong gates, decoding steps and the in-place step against the float64 recurrence and the torch form."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs",
               os.path.join(HERE, "triton_kda_interpreted.py")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
    # fla's reference is optional; every other test runs
    assert "skipped" not in result.stdout or "1 skipped" in result.stdout


def test_auto_on_cpu_is_the_torch_path() -> None:
    inputs = _inputs()
    assert torch.equal(_kda(*inputs), _kda(*inputs, backend="torch"))


def test_forced_triton_lists_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reason the KDA kernels do not cover a call: a chunk length other than 16, dtype, device."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(LinearAttentionError) as caught:
        _kda(*_inputs(dtype=torch.float64), chunk_size=64, backend="triton")
    message = str(caught.value)
    for reason in ("chunk_size=64: the KDA kernels (per-feature gates) use chunks of 16", "dtype torch.float64",
                   "device cpu"):
        assert reason in message, (reason, message)


def test_per_feature_gates_are_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-feature gates (with a decay too) are in the KDA kernels: the table picks triton for a covered device
    (here a CPU tensor under TRITON_INTERPRET=1), chunk_size unset or 16. No kernel runs."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = _inputs()[0]
    for chunk in (None, 16):
        gated = Call("delta", True, "auto", 20, 20, chunk_size=chunk, normalize=False,
                     options=(("decay", 0.9), ("log_gate", torch.zeros(1, 2, 20, 8)), ("cu_seqlens", None)))
        route = choose_route(gated)
        assert route.name == "delta.chunked"
        assert choose_backend("triton", gated, route, q, torch.bfloat16) == "triton"


def test_wide_features_are_refused_once_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """F and Dv > 128 are known only once the feature map has run: a forced call raises naming both (before any
    kernel is loaded)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 1, 10, 160)
    with pytest.raises(LinearAttentionError, match=r"F=160 > 128[\s\S]*Dv=160 > 128"):
        _kda(x, x, x, torch.rand(1, 1, 10), -torch.rand(1, 1, 10, 160), backend="triton")
