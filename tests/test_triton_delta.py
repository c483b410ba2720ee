"""The delta rule on the Triton backend: its rows in the capability table, the reasons a call is not covered, and
the kernels in the interpreter (tests/triton_delta_interpreted.py, in a child process, as tests/test_triton.py)."""

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


def _qkv(n: int = 20, d: int = 8, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, d, generator=generator).to(dtype) for _ in range(3)]


def test_kernels_in_the_interpreter() -> None:
    """tests/triton_delta_interpreted.py in its own pytest process with TRITON_INTERPRET=1: forward, gradients,
    decoding steps and the in-place step against the float64 recurrence."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs",
               os.path.join(HERE, "triton_delta_interpreted.py")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_auto_on_cpu_is_the_torch_path() -> None:
    q, k, v = _qkv()
    options = {"causal": True, "update": "delta", "beta": 0.5, "decay": 0.9}
    expected = linattn.linear_attention(q, k, v, backend="torch", **options)
    assert torch.equal(linattn.linear_attention(q, k, v, **options), expected)


def test_forced_triton_lists_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reason the delta kernels do not cover a call, one per line: chunk length, dtype, device, form."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(LinearAttentionError) as caught:
        linattn.linear_attention(q, k, v, causal=True, update="delta", chunk_size=20, backend="triton")
    message = str(caught.value)
    for reason in ("chunk_size=20: the delta kernels use chunks of 16, 32, 64", "dtype torch.float64",
                   "device cpu"):
        assert reason in message, (reason, message)
    with pytest.raises(LinearAttentionError, match=r"form='parallel': the kernels compute the chunked"):
        linattn.linear_attention(*_qkv(), causal=True, update="delta", form="parallel", backend="triton")


def test_decays_are_covered_and_packing_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-token decays are in the delta kernels (the table picks triton, forced or auto, for a covered device:
    here a CPU tensor under TRITON_INTERPRET=1); an option they do not know is a reason, never ignored. No kernel
    runs."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = _qkv()[0]
    gated = Call("delta", True, "auto", 20, 20, normalize=False, log_space=True,
                 options=(("decay", 0.9), ("log_gate", torch.zeros(1, 2, 20)), ("cu_seqlens", None)))
    route = choose_route(gated)
    assert route.name == "delta.chunked"
    assert choose_backend("triton", gated, route, q, torch.bfloat16) == "triton"
    packed = Call("delta", True, "auto", 20, 20, normalize=False, options=(("cu_seqlens", torch.tensor([0, 20])),))
    with pytest.raises(LinearAttentionError, match=r"option cu_seqlens=tensor\(2,\): not in the kernels"):
        choose_backend("triton", packed, choose_route(packed), q, torch.float32)


def test_wide_features_are_refused_once_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """F and Dv > 128 are known only once the feature map has run: a forced call raises naming both (before any
    kernel is loaded)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = k = v = torch.randn(1, 1, 10, 160)
    with pytest.raises(LinearAttentionError, match=r"F=160 > 128[\s\S]*Dv=160 > 128"):
        linattn.linear_attention(q, k, v, causal=True, update="delta", feature_map="identity", backend="triton")


def test_shared_backward_of_the_torch_form() -> None:
    """kinds/delta/forms.py's chunk_backward (with the torch adjoint sweep; the triton Function runs the same with its
    kernel) against the token-by-token form's autograd, float64, 3 chunks of 8 and a padded tail, with a gate and an
    initial state: exact to rounding (1e-10 relative)."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 21, 6, generator=generator, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(1, 2, 21, generator=generator, dtype=torch.float64) * 2
    gate = -torch.rand(1, 2, 21, generator=generator, dtype=torch.float64) * 0.5
    kv0 = torch.randn(1, 2, 6, 6, generator=generator, dtype=torch.float64)
    upstream = torch.randn(1, 2, 21, 6, generator=generator, dtype=torch.float64)
    results = []
    for form in ("chunked", "recurrent"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, gate, kv0)]
        out, state = linattn.linear_attention(
            *leaves[:3], causal=True, update="delta", beta=leaves[3], log_gate=leaves[4], feature_map="identity",
            initial_state=linattn.DeltaRuleState(leaves[5], 0), return_state=True, form=form, chunk_size=8,
            backend="torch",
        )
        results.append(torch.autograd.grad([out, state.kv], leaves, [upstream, kv0]))
    for chunked, recurrent in zip(*results, strict=True):
        assert float((chunked - recurrent).norm() / recurrent.norm()) < 1e-10
