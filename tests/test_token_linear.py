"""TokenLinear: nn.Linear whose few-token calls without gradients run the native ``linear_token`` kernel.

The kernel sums each output's ``in_features`` products in its own order, so it is checked against float64 with the
standard bound on a dot product's rounding, |error| <= n * u * sum|w_i x_i| (u = 2^-24 in fp32), not against
``F.linear``'s bits: BLAS picks its own order by CPU, shape and thread count.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linattn.backends import native
from linattn.nn import token_linear
from linattn.nn.token_linear import MAX_TOKENS, TokenLinear, lean_linears

needs_kernels = pytest.mark.skipif(native.module() is None, reason="the native kernels are not built here")


def _layer(inp: int, out: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> TokenLinear:
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias, dtype=dtype)
    lean_linears(layer)
    return layer  # type: ignore[return-value]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The input shapes that reached the kernel."""
    seen: list[tuple[int, ...]] = []
    kernels = native.module()

    def linear_token(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return kernels.linear_token(x, weight, bias)

    monkeypatch.setattr(token_linear.native, "module", lambda name="decode": SimpleNamespace(linear_token=linear_token))
    return seen


@needs_kernels
@pytest.mark.parametrize(("shape", "inp", "out", "bias"), [((1, 1, 576), 576, 1536, False), ((3, 37), 37, 19, True),
                                                          ((2, 2, 1536), 1536, 576, True), ((1, 5), 5, 49, False)])
def test_the_kernel_is_within_the_dot_products_rounding_bound_of_float64(calls, shape, inp, out, bias):
    layer = _layer(inp, out, bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        got = layer(x)
    assert calls == [tuple(x.shape)]  # it ran the kernel, not F.linear
    w64, x64 = layer.weight.double(), x.double()
    b64 = layer.bias.double() if bias else None
    exact = F.linear(x64, w64, b64)
    magnitude = F.linear(x64.abs(), w64.abs(), b64.abs() if bias else None)
    bound = (inp + 1) * 2.0**-24 * magnitude
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernels
def test_float64_takes_the_kernel_and_agrees_with_F_linear(calls):
    layer = _layer(64, 33, True, torch.float64)
    x = torch.randn(4, 64, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)
    assert calls == [(4, 64)]
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-12)


@needs_kernels
def test_gradients_many_rows_and_other_dtypes_go_to_F_linear(calls):
    layer = _layer(16, 8, True)
    x = torch.randn(2, 16, requires_grad=True)
    y = layer(x)  # gradients recorded: nn.Linear's own call, so backward works as before
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        layer(torch.randn(MAX_TOKENS + 1, 16))  # a prompt's rows: BLAS's GEMM
        layer.double()(torch.randn(2, 16, dtype=torch.float64))  # float64 weights and input: the kernel
        layer.half()(torch.randn(2, 16).half())  # fp16: F.linear
    assert calls == [(2, 16)]


def test_a_wrong_width_gets_nn_linears_error_and_the_results_do_not_depend_on_the_kernel(monkeypatch):
    layer = _layer(16, 8, True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        layer(torch.randn(1, 15))
    monkeypatch.setattr(token_linear.native, "module", lambda name="decode": None)  # not built: nn.Linear's call
    x = torch.randn(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_lean_linears_switches_plain_linears_in_place_and_keeps_the_state_dict():
    class Wrapped(nn.Linear):  # a subclass (a quantized or adapter layer) keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2), Wrapped(2, 2)))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    first = model[0]
    assert lean_linears(model) == 2
    assert model[0] is first and type(first) is TokenLinear and type(model[2][1]) is Wrapped
    assert lean_linears(model) == 0  # already switched
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
