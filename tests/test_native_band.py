"""The window's band average in C++ (causal.cpp ``band_average``, through
linattn.backends.native.forms.band_average) against the dense float64 definition of test_flash_band, the flash
kernel it stands in for, and the composed call with and without it.

Tolerances: float64 1e-12 (the same sums in another order); fp32 1e-5 against float64 on outputs of order 1 (about
200 terms summed in fp32 in the kernel's own order; never bit-identical across instruction sets).
"""

from __future__ import annotations

import os

import pytest
import torch

import linattn
from linattn.backends import native
from linattn.backends.native import forms as native_forms
from linattn.exact.forms import flash_band, fused
from test_flash_band import dense, operands

pytestmark = pytest.mark.skipif(os.environ.get("LINATTN_NATIVE") == "0", reason="native kernels turned off")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    found = native.module("causal")
    if found is None:
        pytest.skip(f"no native kernels here: {native.status()}")
    return found


@pytest.mark.parametrize(("n", "width", "front", "prefix", "sinks"), [
    (1, 0, 0, 0, 0),  # one query, its own key
    (37, 5, 5, 5, 0),  # a fresh causal call: the band's first rows empty
    (100, 31, 10, 31, 3),  # a carried window: 21 real prefix rows
    (257, 63, 0, 63, 4),  # a full carried window; N not a multiple of the block (128 queries)
    (300, 64, 64, 64, 4),  # the shipped student's window (B + 1 = 65 keys: one lane past whole vectors)
    (64, 40, 40, 40, 2),  # a band of most of the call
    (90, 20, 10, 10, 0),  # the non-causal layout: B = 2·front, keys past the last row empty
    (70, 150, 0, 150, 1),  # a band wider than the block and the call
])
def test_the_average_equals_the_dense_definition(n, width, front, prefix, sinks):
    q, keys, values, sink = operands(3, n, prefix, 16, sinks)
    found = native_forms.band_average(q, keys, values, 0.25, width, front, sink)
    assert found is not None
    a, lse = found
    want, want_lse = dense(q, torch.cat(keys, 1), torch.cat(values, 1), 0.25, width, front, sink)
    assert a.shape == want.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(a, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_keys_and_values_of_other_widths():
    """D = 24 keys (no whole vector of lanes) beside Dv = 32 values."""
    g = torch.Generator().manual_seed(5)
    q, k, k_pre = (torch.randn(2, n, 24, generator=g, dtype=torch.float64) for n in (50, 50, 9))
    v, v_pre = (torch.randn(2, n, 32, generator=g, dtype=torch.float64) for n in (50, 9))
    found = native_forms.band_average(q, (k_pre, k), (v_pre, v), 0.3, 9, 2, None)
    assert found is not None
    want, want_lse = dense(q, torch.cat([k_pre, k], 1), torch.cat([v_pre, v], 1), 0.3, 9, 2, None)
    torch.testing.assert_close(found[0], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(found[1], want_lse, rtol=0, atol=1e-12)


def test_fp32_is_within_its_rounding():
    q, keys, values, sink = operands(4, 300, 64, 64, 4, dtype=torch.float32, seed=1)
    found = native_forms.band_average(q, keys, values, 0.125, 64, 20, sink)
    assert found is not None and found[0].dtype == torch.float32
    want, want_lse = dense(*(x.double() for x in (q, torch.cat(keys, 1), torch.cat(values, 1))), 0.125, 64, 20,
                           (sink[0].double(), sink[1].double(), sink[2]))
    assert (found[0].double() - want).abs().max() < 1e-5
    assert (found[1].double() - want_lse).abs().max() < 1e-5


def test_it_leaves_what_it_does_not_take():
    q, keys, values, _ = operands(1, 10, 3, 16, 0)
    assert native_forms.band_average(q.requires_grad_(True), keys, values, 0.25, 3, 0, None) is None
    q = q.detach()
    odd = (values[0][..., :12], values[1][..., :12])  # Dv = 12: no compiled width
    assert native_forms.band_average(q, keys, odd, 0.25, 3, 0, None) is None
    half = tuple(x.half() for x in keys)
    assert native_forms.band_average(q.half(), half, tuple(x.half() for x in values), 0.25, 3, 0, None) is None


def test_exact_part_takes_it_before_the_flash_kernel():
    """fused.exact_part with the native band gives the flash kernel's average (float64, 1e-12)."""
    q, keys, values, sink = operands(2, 120, 47, 16, 3)
    sinks = (sink[0], sink[1], None, sink[2], 0)
    calls = []

    def band(*args):
        calls.append(1)
        return native_forms.band_average(*args)

    with torch.no_grad():
        fast = fused.exact_part(q, 0.25, False, keys, values, None, fused.tile_size(47), 47, 30, sinks, average=True,
                                band=band)
        plain = fused.exact_part(q, 0.25, False, keys, values, None, fused.tile_size(47), 47, 30, sinks,
                                 average=True)
    assert calls == [1]
    torch.testing.assert_close(fast[0], plain[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(fast[3], plain[3], rtol=0, atol=1e-12)


@pytest.mark.skipif(not flash_band.takes(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)),
                    reason="no CPU flash kernel in this torch")
def test_the_window_beside_the_delta_rule_natively():
    """The composed call (window + sinks beside the gated delta rule, Hedgehog-sized D = Dv = 16) on the native
    backend, where the band runs in C++, against the torch backend (float64, 1e-12)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(1, 2, 150, generator=g, dtype=torch.float64)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, 2, 150, generator=g, dtype=torch.float64) + 2)
    opts = dict(causal=True, update="delta", beta=beta, log_gate=gate, window=40, sinks=3, form="chunked")
    with torch.no_grad():
        fast = linattn.linear_attention(q, k, v, backend="native", **opts)
        slow = linattn.linear_attention(q, k, v, backend="torch", **opts)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)


def test_strided_rows_as_attention_layers_give_them():
    """Queries, keys and values as views of (N, heads, D) tensors (rows R apart by D, tokens by R·D), as a layer's
    projections give them: the kernel reads them in place, with the contiguous call's result (float64, 1e-12)."""
    q, keys, values, sink = operands(3, 80, 16, 16, 2)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, *keys, *values)]
    assert strided[0].stride(1) == 3 * 16 and not strided[0].is_contiguous()
    found = native_forms.band_average(strided[0], tuple(strided[1:3]), tuple(strided[3:5]), 0.25, 16, 0, sink)
    want = native_forms.band_average(q, keys, values, 0.25, 16, 0, sink)
    assert found is not None and want is not None
    torch.testing.assert_close(found[0], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(found[1], want[1], rtol=0, atol=1e-12)
