"""The chunked delta family's two loops over the chunks in C++ (causal.cpp's ``delta_state_sweep`` and
``delta_adjoint_sweep``; :data:`linattn.backends.native.forms.SWEEPS`), which the torch forms' autograd Functions
run when the native backend is chosen (``backend="auto"`` on CPU) and gradients are needed.

References: the torch sweeps (kinds/delta/forms.py's ``_state_sweep`` and ``adjoint_sweep``) on the same inputs, and
the token-by-token recurrences (``delta_recurrent``, ``kda_recurrent``) differentiated by autograd in float64.
Tolerances: float64 1e-12 against the torch sweeps and 1e-10 against the recurrences (the same sums in another
order); float32 relative to the largest entry, 1e-5 (the register tiles sum in another order than BLAS, and the
sweeps carry a state through tens of chunks; never bit-identical across instruction sets or shapes).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.backends.native import forms as native_forms
from linattn.kinds.delta.forms import _state_sweep, adjoint_sweep
from test_native_causal import kernels  # noqa: F401  (a fixture: the causal extension, or a skip)

pytestmark = pytest.mark.skipif(os.environ.get("LINATTN_NATIVE") == "0", reason="native kernels turned off")


def _close(found: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().item() or 1.0
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (found - expected).abs().max().item() <= tol * scale


SHAPES = [  # rows, chunks, chunk, features, values, decay per chunk: 0 none, 1 one, F one per feature
    (3, 5, 64, 64, 64, 0),
    (3, 5, 64, 128, 64, 1),  # the students' Hedgehog features
    (2, 4, 16, 37, 32, 37),  # features not a multiple of a tile's rows
    (2, 4, 13, 20, 16, 1),  # a chunk not a multiple of a tile's rows
    (1, 3, 8, 9, 256, 0),  # the widest values the kernels take
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_sweeps_equal_the_torch_sweeps(kernels, shape, dtype):  # noqa: F811
    rows, chunks, chunk, features, dv, gates = shape
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale).to(dtype)

    w_k, w_v, k_out = rand(rows, chunks, chunk, features, scale=0.1), rand(rows, chunks, chunk, dv), \
        rand(rows, chunks, chunk, features, scale=0.1)
    last = torch.rand(rows, chunks, gates, 1, generator=gen, dtype=torch.float64).to(dtype) if gates else None
    initial = rand(rows, features, dv)

    written, states = w_v.clone(), torch.empty(rows, chunks, features, dv, dtype=dtype)
    final = _state_sweep(initial, w_k, written, k_out, last, states)
    native_written, native_states = w_v.clone(), torch.full_like(states, float("nan"))
    given = initial.clone()
    native_final = native_forms.state_sweep(initial, w_k, native_written, k_out, last, native_states)
    for found, expected in ((native_final, final), (native_written, written), (native_states, states)):
        _close(found, expected, dtype)
    assert torch.equal(initial, given)  # the initial state is read, never overwritten (the same tensor, unchanged)

    bq, d_o, p_do, d_final = rand(rows, chunks, chunk, features), rand(rows, chunks, chunk, dv), \
        rand(rows, chunks, chunk, dv), rand(rows, features, dv)
    expected = adjoint_sweep(bq, k_out, w_k, p_do.clone(), d_o, last, d_final.clone())
    found = native_forms.adjoint_sweep(bq, k_out, w_k, p_do.clone(), d_o, last, d_final)
    for a, b in zip(found, expected, strict=True):
        assert a is not None and b is not None
        _close(a, b, dtype)


def test_a_value_width_the_kernels_lack_runs_the_torch_sweeps(kernels):  # noqa: F811
    gen = torch.Generator().manual_seed(1)
    w_k, k_out = torch.randn(2, 3, 8, 5, generator=gen), torch.randn(2, 3, 8, 5, generator=gen)
    w_v = torch.randn(2, 3, 8, 12, generator=gen)  # 12 values: not a multiple of 16 fp32 lanes
    written, states = w_v.clone(), torch.empty(2, 3, 5, 12)
    final = native_forms.state_sweep(torch.zeros(2, 5, 12), w_k, written, k_out, None, states)
    ref_written, ref_states = w_v.clone(), torch.empty(2, 3, 5, 12)
    assert torch.equal(final, _state_sweep(torch.zeros(2, 5, 12), w_k, ref_written, k_out, None, ref_states))
    assert torch.equal(written, ref_written) and torch.equal(states, ref_states)


def _counted(monkeypatch):
    """SWEEPS wrapped so that each call is counted (the dispatch reads the attribute at each call)."""
    calls = {"forward": 0, "adjoint": 0}
    sweeps = native_forms.SWEEPS

    def forward(*args):
        calls["forward"] += 1
        return sweeps.forward(*args)

    def adjoint(*args):
        calls["adjoint"] += 1
        return sweeps.adjoint(*args)

    monkeypatch.setattr(native_forms, "SWEEPS", native_forms.Sweeps(forward, adjoint))
    return calls


def _delta_inputs(gate: str | None, n: int = 150, dv: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64), torch.randn(2, 3, n, 8, generator=gen,
                                                                                   dtype=torch.float64)
    v = torch.randn(2, 3, n, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 3, n, generator=gen, dtype=torch.float64)
    extra = {}
    if gate == "token":
        extra["log_gate"] = F.logsigmoid(torch.randn(2, 3, n, generator=gen, dtype=torch.float64) + 2)
    elif gate == "feature":
        extra["log_gate"] = F.logsigmoid(torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) + 2)
    return [q, k, v, beta], extra


def _grads(inputs, extra, **options):
    leaves = [x.clone().requires_grad_() for x in inputs]
    q, k, v, beta = leaves
    out = linattn.linear_attention(q, k, v, beta=beta, update="delta", causal=True, feature_map="identity",
                                   **extra, **options)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("gate", [None, "token", "feature"])
def test_training_on_cpu_runs_the_sweeps_in_cpp_with_the_recurrences_gradients(kernels, monkeypatch, gate):  # noqa: F811
    """backend="auto" with gradients: the chunked form with the C++ sweeps (both called), values and gradients as
    the token-by-token recurrence's in float64; backend="torch" calls neither."""
    inputs, extra = _delta_inputs(gate)
    calls = _counted(monkeypatch)
    found = _grads(inputs, extra, chunk_size=32)
    assert calls["forward"] >= 1 and calls["adjoint"] >= 1
    expected = _grads(inputs, extra, form="recurrent")
    for a, b in zip(found, expected, strict=True):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 1e-10 * scale
    calls.update(forward=0, adjoint=0)
    torch_found = _grads(inputs, extra, chunk_size=32, backend="torch")
    assert calls == {"forward": 0, "adjoint": 0}
    for a, b in zip(found, torch_found, strict=True):
        assert (a - b).abs().max().item() <= 1e-12 * b.abs().max().item()


@pytest.mark.parametrize("cache", [False, True])
def test_the_window_and_the_sparse_cache_train_with_the_cpp_sweeps(kernels, monkeypatch, cache):  # noqa: F811
    """The students' calls: the delta rule beside the window (and a sparse cache), with gradients; the same values
    and gradients as backend="torch" in float64."""
    inputs, extra = _delta_inputs("token", n=200)
    options = {"window": 16, "sinks": 2, "chunk_size": 32}
    if cache:
        options["sparse_cache"] = linattn.SparseCache(size=8)
    calls = _counted(monkeypatch)
    found = _grads(inputs, extra, **options)
    assert calls["forward"] >= 1 and calls["adjoint"] >= 1
    expected = _grads(inputs, extra, backend="torch", **options)
    for a, b in zip(found, expected, strict=True):
        assert (a - b).abs().max().item() <= 1e-12 * b.abs().max().item()
