"""The window's softmax average through torch's CPU flash kernel (linattn.exact.forms.flash_band) against a dense
float64 definition and the tiled Function it stands in for, and when it is taken.

Tolerances: float64 1e-12 (the same sums blocked differently); fp32 1e-5 against float64 on outputs of order 1
(the kernel sums ~200 terms in fp32, its own order of operations; never bit-identical across instruction sets).
"""

from __future__ import annotations

import pytest
import torch

import linattn
from linattn.exact.forms import flash_band, fused

pytestmark = pytest.mark.skipif(not flash_band.takes(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8),
                                                     torch.zeros(1, 1, 8)), reason="no CPU flash kernel in this torch")


def dense(q, k_all, v_all, scale, width, front, sinks):
    """The band's definition over the whole key sequence [prefix; keys] (R, P + N, ·), in float64."""
    rows, n, _ = q.shape
    end = k_all.shape[1]
    y = torch.arange(end)
    i = torch.arange(n).unsqueeze(-1)
    sees = (y >= i) & (y <= i + width) & (y >= front)  # (N, P + N)
    scores = (q @ k_all.transpose(-1, -2) * scale).masked_fill(~sees, float("-inf"))
    values = v_all
    if sinks is not None:
        sk, sv, mask = sinks
        sink_scores = (q @ sk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        scores = torch.cat([scores, sink_scores], -1)
        values = torch.cat([v_all, sv], 1)
    weights = torch.softmax(scores, -1)
    return weights @ values, torch.logsumexp(scores, -1)


def operands(rows, n, prefix, dim, sinks, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, n, dim, generator=g, dtype=dtype) for _ in range(3))
    k_pre, v_pre = (torch.randn(rows, prefix, dim, generator=g, dtype=dtype) for _ in range(2))
    sink = None
    if sinks:
        sk, sv = (torch.randn(rows, sinks, dim, generator=g, dtype=dtype) for _ in range(2))
        mask = torch.rand(rows, n, sinks, generator=g) < 0.7
        sink = (sk, sv, mask)
    return q, (k_pre, k), (v_pre, v), sink


@pytest.mark.parametrize(("n", "width", "front", "prefix", "sinks"), [
    (1, 0, 0, 0, 0),  # one query, its own key
    (37, 5, 5, 5, 0),  # a fresh causal call: the band's first rows empty
    (100, 31, 10, 31, 3),  # a carried window: 21 real prefix rows
    (257, 63, 0, 63, 4),  # a full carried window; N not a multiple of the block
    (64, 40, 40, 40, 2),  # the band wider than a block
    (90, 20, 10, 10, 0),  # the non-causal layout: B = 2·front, keys past the last row empty
])
def test_the_average_equals_the_dense_definition(n, width, front, prefix, sinks):
    q, keys, values, sink = operands(3, n, prefix, 16, sinks)
    a, lse = flash_band.band_average(q, keys, values, 0.25, width, front, sink)
    want, want_lse = dense(q, torch.cat(keys, 1), torch.cat(values, 1), 0.25, width, front, sink)
    assert a.shape == want.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(a, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_fp32_is_within_its_rounding():
    q, keys, values, sink = operands(4, 300, 63, 64, 4, dtype=torch.float32, seed=1)
    a, _ = flash_band.band_average(q, keys, values, 0.125, 63, 20, sink)
    want, _ = dense(*(x.double() for x in (q, torch.cat(keys, 1), torch.cat(values, 1))), 0.125, 63, 20,
                    (sink[0].double(), sink[1].double(), sink[2]))
    assert (a.double() - want).abs().max() < 1e-5


def test_exact_part_takes_it_only_for_the_average_without_gradients():
    """fused.exact_part gives the same average with the kernel and with the tiled Function (which a gradient needs),
    and leaves the factor form to the Function."""
    q, keys, values, sink = operands(2, 120, 47, 16, 3)
    sinks = (sink[0], sink[1], None, sink[2], 0)
    with torch.no_grad():
        fast = fused.exact_part(q, 0.25, False, keys, values, None, fused.tile_size(47), 47, 30, sinks, average=True)
    q.requires_grad_(True)
    slow = fused.exact_part(q, 0.25, False, keys, values, None, fused.tile_size(47), 47, 30, sinks, average=True)
    assert fast[1] is None and slow[1] is None  # already normalised
    torch.testing.assert_close(fast[0], slow[0].detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(fast[3], slow[3].detach(), rtol=0, atol=1e-12)
    factor = fused.exact_part(q, 0.25, False, keys, values, None, fused.tile_size(47), 47, 30, sinks)
    assert factor[1] is not None  # (Σ e^{s−m} v, Σ e^{s−m}, None, m)


def test_values_narrower_than_keys_take_the_function():
    q, keys, values, _ = operands(1, 10, 3, 8, 0)
    assert not flash_band.takes(q, keys[1], values[1][..., :4])
    assert not flash_band.takes(q.float(), keys[1].float(), values[1].float(), torch.zeros(1, dtype=torch.bfloat16))


def test_the_window_beside_the_delta_rule_is_unchanged():
    """The composed call (window + sinks beside the gated delta rule) without gradients, where the kernel serves,
    against the same call with gradients on, where the tiled Function does."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(1, 2, 150, generator=g, dtype=torch.float64)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, 2, 150, generator=g, dtype=torch.float64) + 2)
    opts = dict(causal=True, update="delta", beta=beta, log_gate=gate, window=40, sinks=3, form="chunked",
                backend="torch")
    with torch.no_grad():
        fast = linattn.linear_attention(q, k, v, **opts)
    slow = linattn.linear_attention(q.requires_grad_(True), k, v, **opts)
    torch.testing.assert_close(fast, slow.detach(), rtol=0, atol=1e-12)
