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


# ------------------------------------------------------------------------ weights that are blocks of integer codes
# The two GGUF block kinds as llama.cpp's reference quantizers make them (written here from the format's definition):
# Q4_1 keeps per block of 32 m = fp16(min) and d = fp16((max − min) / 15), codes q = min(15, ⌊(x − min)/d + ½⌋);
# Q8_0 keeps d = fp16(max|x| / 127), codes round(x / d). A reader's fp32 weights are then d·q + m (Q8_0: d·q).

def _q4_1(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // 32, 32, generator=gen) * 0.05
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    q = torch.floor((x - low) * torch.where(d > 0, 1 / d, torch.zeros(())) + 0.5).clamp(max=15)
    return (d * q + m).reshape(rows, cols)


def _q8_0(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols // 32, 32, generator=gen) * 0.05
    d = (x.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(x / d).clamp(-127, 127)
    return (d * q).reshape(rows, cols)


@pytest.mark.parametrize(("make", "nibbles", "bits"), [(_q4_1, True, 4), (_q8_0, False, 8)])
def test_block_weights_find_both_kinds_and_rebuild_every_weight_exactly(make, nibbles, bits):
    w = make(40, 96)
    blocks = token_linear.block_weights(w)
    assert blocks is not None and blocks.nibbles is nibbles
    assert torch.equal(blocks.weight(), w)  # bit for bit: the same weights
    assert blocks.codes.numel() * blocks.codes.element_size() == w.numel() * bits // 8


def test_weights_that_are_not_blocks_have_none():
    assert token_linear.block_weights(torch.randn(8, 64)) is None  # learnt or given in fp32
    nearly = _q4_1(8, 64)
    nearly[3, 17] += 1e-6  # one weight off its block's grid
    assert token_linear.block_weights(nearly) is None
    assert token_linear.block_weights(_q4_1(8, 64)[:, :48].contiguous()) is None  # rows not whole blocks
    assert token_linear.block_weights(_q4_1(8, 64).double()) is None
    assert token_linear.block_weights(_q4_1(8, 64).t()) is None  # not contiguous


def _block_layer(make, inp: int, out: int, bias: bool) -> TokenLinear:
    layer = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(make(out, inp, seed=1))
    lean_linears(layer)
    assert layer.blocks is not None
    return layer  # type: ignore[return-value]


@needs_kernels
@pytest.mark.parametrize("make", [_q4_1, _q8_0])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8])
def test_the_blocks_kernel_is_within_the_dot_products_rounding_bound_of_float64(monkeypatch, make, tokens):
    kernels = native.module()
    seen = []

    def blocks_kernel(*args):
        seen.append(tuple(args[0].shape))
        return kernels.linear_token_blocks(*args)

    monkeypatch.setattr(token_linear.native, "module", lambda name="decode": SimpleNamespace(
        linear_token=kernels.linear_token, linear_token_blocks=blocks_kernel))
    for inputs in (576, 544, 32):  # 18 blocks (9 groups of two), 17 (a half group last), 1 (the half group alone)
        seen.clear()
        layer = _block_layer(make, inputs, 200, bias=True)
        x = torch.randn(tokens, inputs)
        with torch.no_grad():
            got = layer(x)
        assert seen == [(tokens, inputs)]
        w64, x64, b64 = layer.weight.double(), x.double(), layer.bias.double()
        exact = F.linear(x64, w64, b64)
        bound = (inputs + 1) * 2.0**-24 * F.linear(x64.abs(), w64.abs(), b64.abs())
        assert ((got.double() - exact).abs() <= bound).all()


@needs_kernels
def test_a_weight_changed_after_its_codes_were_found_is_read_as_it_now_is():
    layer = _block_layer(_q4_1, 64, 16, bias=False)
    x = torch.randn(1, 64)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place (an optimizer's step): the codes are stale
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-6)
        layer.weight = nn.Parameter(_q8_0(16, 64))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-6)
    assert layer.blocks is not None and not layer.blocks.current(layer.weight)
    assert "blocks" not in "".join(layer.state_dict())  # the codes are not part of the layer's state


@needs_kernels
def test_a_copied_or_saved_layer_reads_its_own_weight():
    import copy
    import io

    layer = _block_layer(_q4_1, 64, 16, bias=True)
    x = torch.randn(1, 64)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert other.blocks is not None and not other.blocks.current(other.weight)  # codes of no weight of its own
        with torch.no_grad():
            other.weight.mul_(-1.0)
            torch.testing.assert_close(other(x), F.linear(x, other.weight, other.bias), rtol=1e-5, atol=1e-6)
    assert layer.blocks is not None and layer.blocks.current(layer.weight)  # the original keeps reading its codes
