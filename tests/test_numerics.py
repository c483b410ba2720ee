"""Precision, NumPy in/out, positivity and finiteness: the numerics policy of DESIGN.md, checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import linattn
from linattn.feature_maps import EluFeatureMap
from reference import (
    HALF_ROUNDING_FACTOR,
    SHAPE_ULPS,
    elu_plus_one,
    reference_attention,
    rel_error,
    rounding_error,
    ulps_of_scale,
)


def plain_torch_attention(q, k, v, causal):
    """What plain PyTorch computes in the inputs' own dtype (the flash-attention tolerance rule's yardstick)."""
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    weights = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        weights = torch.tril(weights)
    return (weights @ v) / (weights.sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_half_precision_error_is_the_output_rounding_alone(dtype, causal):
    """Half-precision inputs are accumulated in fp32 and rounded once: the error against float64 is at most
    HALF_ROUNDING_FACTOR (1.1) × that of rounding the exact result to the dtype (measured 1.000× for bf16 and
    fp16, 1.68e-3 / 2.1e-4; see tests/reference.py). Negative control: plain PyTorch computing the same thing in
    the dtype (what losing the fp32 accumulation gives: 2.0× in bf16, 1000–4700× in fp16) fails the same bound."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2048, 32, generator=generator).to(dtype) for _ in range(3))
    out = linattn.linear_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = reference_attention(q, k, v, elu_plus_one, causal=causal)
    bound = HALF_ROUNDING_FACTOR * rounding_error(exact, dtype)
    assert rel_error(out, exact) <= bound
    assert rel_error(plain_torch_attention(q, k, v, causal), exact) > bound  # the bound rejects plain accumulation


def test_bf16_long_causal_sequence_stays_accurate():
    """64k tokens of bf16: sums of this many terms in bf16 itself lose most digits; ours accumulate in fp32."""
    generator = torch.Generator().manual_seed(1)
    n = 65536
    q, k, v = (torch.randn(1, 1, n, 16, generator=generator) for _ in range(3))
    out = linattn.linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    exact = linattn.linear_attention(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), causal=True)
    assert torch.isfinite(out).all()
    # bf16 has an 8-bit mantissa: 2^-8 ≈ 0.4 % is the output rounding itself
    assert rel_error(out, exact) <= 5e-3


def test_elu_feature_map_strictly_positive_in_bf16():
    x = torch.tensor([-1e4, -200.0, -90.0, -8.0, -1.0, 0.0, 3.0], dtype=torch.bfloat16)
    naive = torch.nn.functional.elu(x) + 1
    assert (naive[:4] == 0).any()  # the failure the map is written to avoid
    features = EluFeatureMap()(x)
    assert (features > 0).all()
    for dtype in (torch.float16, torch.float32, torch.float64):
        assert (EluFeatureMap()(x.to(dtype)) > 0).all()


def test_elu_feature_map_gradient_finite_for_large_inputs():
    x = torch.tensor([-1e4, -5.0, 0.5, 100.0, 1e4], dtype=torch.float64, requires_grad=True)
    EluFeatureMap()(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    expected = torch.where(x > 0, torch.ones_like(x), torch.exp(x.detach()))
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e3])
@pytest.mark.parametrize("map_name", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_finite_inputs_never_give_nan(scale, map_name, causal):
    generator = torch.Generator().manual_seed(2)
    q, k, v = (scale * torch.randn(2, 50, 8, generator=generator) for _ in range(3))
    q = q.requires_grad_()
    out = linattn.linear_attention(q, k, v, feature_map=map_name, causal=causal, chunk_size=16)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("causal", [False, True])
def test_all_keys_masked_gives_zero_not_nan(causal):
    q, k, v = (torch.randn(2, 7, 4) for _ in range(3))
    keep = torch.zeros(2, 7, dtype=torch.bool)
    for eps in (1e-6, 0.0):  # eps = 0: the 0/0 case
        out = linattn.linear_attention(q, k, v, causal=causal, key_padding_mask=keep, eps=eps)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_in_numpy_out(dtype, causal):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 20, 6)).astype(dtype) for _ in range(3))
    out = linattn.linear_attention(q, k, v, causal=causal)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (3, 20, 6)
    expected = reference_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), elu_plus_one,
                                   causal=causal)
    assert rel_error(torch.from_numpy(out), expected) <= (1e-10 if dtype == np.float64 else 1e-5)


def test_numpy_callable_feature_map_receives_numpy():
    seen = []

    def relu_np(x):
        seen.append(type(x))
        return np.maximum(x, 0)

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((20, 6)) for _ in range(3))
    out = linattn.linear_attention(q, k, v, feature_map=relu_np)
    assert set(seen) == {np.ndarray}
    expected = reference_attention(*(torch.from_numpy(x) for x in (q, k, v)), torch.relu)
    assert rel_error(torch.from_numpy(out), expected) <= 1e-10


@pytest.mark.parametrize("form", ["parallel", "chunked", "recurrent"])
def test_causal_outputs_do_not_depend_on_later_tokens(form):
    """The first t outputs are the same, to rounding, whether or not (much larger) tokens follow."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 96, 8, generator=generator) for _ in range(3))
    t = 64
    short = linattn.linear_attention(q[:, :t], k[:, :t], v[:, :t], causal=True, form=form, chunk_size=32)
    later = 10 * torch.randn(2, 96 - t, 8, generator=generator)
    long = linattn.linear_attention(
        torch.cat([q[:, :t], later], 1), torch.cat([k[:, :t], later], 1), torch.cat([v[:, :t], later], 1),
        causal=True, form=form, chunk_size=32,
    )
    # 64 against 96 tokens: other GEMM shapes may round differently (tests/reference.py, SHAPE_ULPS)
    assert ulps_of_scale(long[:, :t], short) <= SHAPE_ULPS


def test_fp64_inputs_accumulate_in_fp64_state():
    q = k = v = torch.randn(2, 10, 4, dtype=torch.float64)
    _, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
    assert state.kv.dtype == torch.float64
    _, state = linattn.linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, return_state=True)
    assert state.kv.dtype == torch.float32 and state.k_sum.dtype == torch.float32


def test_named_random_map_is_drawn_once_and_reused():
    """A random map given by name keeps its projections across calls (no silent redraw per call)."""
    q, k, v = (torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(4)) for _ in range(3))
    first = linattn.linear_attention(q, k, v, feature_map="favor+")
    torch.manual_seed(123)  # a later change of the global generator must not matter either
    second = linattn.linear_attention(q, k, v, feature_map="favor+")
    assert torch.equal(first, second)  # bit for bit: same inputs, shapes and projections take the same kernels


@pytest.mark.parametrize(("causal", "form"), [(False, "global"), (False, "chunked"), (True, "chunked"),
                                              (True, "recurrent"), (True, "parallel")])
def test_autocast_does_not_lower_the_accumulation_precision(causal, form):
    """Under torch.autocast(bf16) the core still accumulates in fp32: same result as without autocast."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=generator) for _ in range(3))
    plain = linattn.linear_attention(q, k, v, causal=causal, form=form, chunk_size=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = linattn.linear_attention(q, k, v, causal=causal, form=form, chunk_size=64)
    assert autocast.dtype == torch.float32
    assert torch.equal(autocast, plain)  # bit for bit: same shapes and dtypes, so the very same kernels run


def test_backward_inside_autocast_region():
    """backward() called inside torch.autocast recomputes in fp32 too (the causal chunked Function recomputes)."""
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=generator, requires_grad=True) for _ in range(3))
    plain = linattn.linear_attention(q, k, v, causal=True, chunk_size=64)
    expected = torch.autograd.grad(plain.square().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linattn.linear_attention(q, k, v, causal=True, chunk_size=64)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
