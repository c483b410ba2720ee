"""The tuned causal chunked path (custom autograd Function over blocks of chunks) and the bench utilities.

Correctness only, never timing: the Function against the float64 quadratic definition with several blocks
(forward, backward, gradcheck including the log-scales and the carried state), and the bench's accounting.
"""

from __future__ import annotations

import json

import pytest
import torch

import linattn
from linattn import bench, measure
from linattn.kinds.additive.forms import causal_fn
from maps_for_tests import LogExp
from reference import elu_plus_one, reference_attention, rel_error


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of a chunk or two, so that every test crosses several block boundaries."""
    monkeypatch.setattr(causal_fn, "BLOCK_ELEMENTS", 1)


def _inputs(shape, dk, dv, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, dk, generator=generator, dtype=torch.float64)
    k = torch.randn(*shape, dk, generator=generator, dtype=torch.float64)
    v = torch.randn(*shape, dv, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("n", [1, 7, 37, 64], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("map_name", ["elu", "logspace"])
def test_blocks_match_reference_forward_and_backward(tiny_blocks, n, map_name):
    q, k, v = _inputs((2, 3, n), 6, 5)
    if map_name == "elu":
        fmap, phi = "elu", elu_plus_one
    else:
        log_map = LogExp(6, 11).double()
        fmap, phi = log_map, log_map.reference
    keep = torch.rand(2, n, generator=torch.Generator().manual_seed(1)) > 0.3
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    eps = 0.0 if map_name == "logspace" else 1e-6  # log-space maps add eps in the stabilised scale
    out = linattn.linear_attention(
        *leaves, feature_map=fmap, causal=True, chunk_size=4, key_padding_mask=keep, eps=eps
    )
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*ref_leaves, phi, causal=True, keep=keep[:, None, :], eps=eps)
    assert rel_error(out.detach(), expected.detach()) <= 1e-12
    weights = torch.randn_like(expected)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        # atol: at N=1 the q/k gradients come from eps alone (~1e-8), so their relative roundoff is large
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("normalize", [True, False])
def test_state_through_blocks_matches_one_call(tiny_blocks, normalize):
    """Carried state in and out across pieces; gradients reach the earlier piece through the state."""
    q, k, v = _inputs((2, 30), 4, 3, seed=2)
    options = {"feature_map": "elu" if normalize else "identity", "causal": True, "normalize": normalize}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    first, state = linattn.linear_attention(*(x[:, :13] for x in leaves), chunk_size=4, return_state=True, **options)
    second, final = linattn.linear_attention(
        *(x[:, 13:] for x in leaves), chunk_size=4, initial_state=state, return_state=True, **options
    )
    whole_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    whole, whole_state = linattn.linear_attention(*whole_leaves, form="parallel", return_state=True, **options)
    assert rel_error(torch.cat([first, second], -2).detach(), whole.detach()) <= 1e-12
    for got, want in ((final.kv, whole_state.kv), (final.k_sum, whole_state.k_sum)):
        assert rel_error(got.detach(), want.detach()) <= 1e-12
    loss = second.square().sum() + final.kv.sum() + final.k_sum.square().sum()
    loss.backward()
    (whole[:, 13:].square().sum() + whole_state.kv.sum() + whole_state.k_sum.square().sum()).backward()
    for got, want in zip(leaves, whole_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("with_ref", [False, True], ids=["plain", "log-scales"])
@pytest.mark.parametrize("min_denom", [None, 0.5])
def test_function_gradcheck(with_ref, min_denom):
    """Every input of the Function, the log-scales r and the initial state's scale included, in float64."""
    generator = torch.Generator().manual_seed(3)
    n, features, values = 8, 3, 2
    qf = torch.rand(2, n, features, generator=generator, dtype=torch.float64) + 0.1
    kf = torch.rand(2, n, features, generator=generator, dtype=torch.float64) + 0.1
    v = torch.randn(2, n, values, generator=generator, dtype=torch.float64)
    state0 = torch.rand(2, features, values + 1, generator=generator, dtype=torch.float64)
    ref = scale0 = None
    if with_ref:
        scale0 = torch.tensor([0.2, -0.3], dtype=torch.float64)
        ref = torch.randn(2, n, generator=generator, dtype=torch.float64).cummax(-1).values + 0.5
        ref = torch.maximum(ref, scale0.unsqueeze(-1))  # the core's invariant: r_t ≥ the carried state's scale
    inputs = tuple(x.requires_grad_() if x is not None else None for x in (qf, kf, v, ref, state0, scale0))

    def run(*args):
        return causal_fn.CausalChunkedFunction.apply(*args, 3, 6, True, 1e-3, min_denom)

    assert torch.autograd.gradcheck(run, inputs, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("early, blank", [(4, 0), (4, 6), (2, 1), (10, 3)], ids=["lag4", "lag4-blank6", "lag2-blank1",
                                                                                  "all-head"])
def test_lagged_keys_and_values_equal_a_shifted_copy(early, blank):
    """k_head / v_head read K and V E rows late ([head; K[:N−E]], the first ``blank`` key rows zero) block by block
    (blocks of 6 rows, chunks of 3: the head and the blank rows span several blocks) — the same outputs, final state
    and gradients as the Function on the shifted copies, in float64; the last E rows of K and V get zero gradient."""
    generator = torch.Generator().manual_seed(5)
    n, features, values = 10, 3, 2
    early = min(early, n)  # a head longer than the sequence: every row read is the head's

    def make(*shape, positive=True):
        x = torch.rand(*shape, generator=generator, dtype=torch.float64)
        return (x + 0.1 if positive else x - 0.5).requires_grad_()

    qf, kf, v = make(2, n, features), make(2, n, features), make(2, n, values, positive=False)
    k_head, v_head = make(2, early, features), make(2, early, values, positive=False)
    state0 = make(2, features, values + 1)
    args = (None, state0, None, 3, 6, True, 0.0, None, True)
    got = causal_fn.CausalChunkedFunction.apply(qf, kf, v, *args, k_head, v_head, blank)
    shifted_k = torch.cat([k_head, kf[:, : n - early]], 1).clone()
    shifted_k[:, :blank] = 0.0
    shifted_v = torch.cat([v_head, v[:, : n - early]], 1)
    want = causal_fn.CausalChunkedFunction.apply(qf, shifted_k, shifted_v, *args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    weights = [torch.randn(x.shape, generator=generator, dtype=torch.float64) for x in want]
    leaves = (qf, kf, v, k_head, v_head, state0)
    grads_got = torch.autograd.grad([(w * x).sum() for w, x in zip(weights, got, strict=True)], leaves)
    grads_want = torch.autograd.grad([(w * x).sum() for w, x in zip(weights, want, strict=True)], leaves)
    for a, b in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not grads_got[1][:, n - early :].any() and not grads_got[2][:, n - early :].any()

    def run(qf, kf, v, k_head, v_head):
        return causal_fn.CausalChunkedFunction.apply(qf, kf, v, *args, k_head, v_head, blank)

    assert torch.autograd.gradcheck(run, (qf, kf, v, k_head, v_head), atol=1e-7, fast_mode=True)


def test_gradcheck_through_the_public_api(tiny_blocks):
    q, k, v = (x.requires_grad_() for x in _inputs((1, 2, 9), 3, 2, seed=4))
    log_map = LogExp(3, 5).double()

    def run(q, k, v):
        return linattn.linear_attention(q, k, v, feature_map=log_map, causal=True, chunk_size=2)

    assert torch.autograd.gradcheck(run, (q, k, v), fast_mode=True)


def test_block_rule():
    assert causal_fn.block_tokens(8, 64, 64, 64) == 1024
    assert causal_fn.block_tokens(1, 64, 64, 64) == 8192
    assert causal_fn.block_tokens(10**6, 64, 64, 48) == 48  # never less than one chunk
    assert causal_fn.block_tokens(3, 100, 7, 10) % 10 == 0


def test_float32_blocks_agree_with_float64_definition():
    q, k, v = _inputs((2, 4, 300), 16, 16, seed=5)
    out = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, chunk_size=32)
    expected = reference_attention(q, k, v, elu_plus_one, causal=True)
    plain = reference_attention(q.float(), k.float(), v.float(), elu_plus_one, causal=True)  # fp32 quadratic
    assert rel_error(out.double(), expected) <= max(2 * rel_error(plain.double(), expected), 1e-6)


def test_useful_flops_and_matmul_peak():
    assert measure.useful_flops("linear", n=128, heads=2, batch=3, features=8, values=4) == 4 * 128 * 8 * 4 * 6
    assert measure.useful_flops("sdpa", n=128, heads=1, batch=1, features=8, values=8, causal=False) == 4 * 128**2 * 8
    assert measure.useful_flops("sdpa", n=128, heads=1, batch=1, features=8, values=8, causal=True) == 2 * 128**2 * 8
    assert measure.matmul_peak(size=128, repeats=2) > 0


def test_peak_memory_sees_a_known_allocation():
    size = 1 << 22

    def allocate() -> None:
        block = torch.ones(size, dtype=torch.float32)
        block.add_(1)

    measured = measure.peak_memory(allocate, torch.device("cpu"))
    assert 4 * size <= measured <= 4 * size * 2


def test_bench_writes_table_files(tmp_path):
    config = bench.BenchConfig(sizes=[64, 128], heads=2, dim=8, repeats=2, decode_contexts=[64, 128], out=tmp_path,
                               peak_size=128)
    results, decode = bench.run(config)
    assert {r.impl for r in results} >= {"linattn chunked elu", "sdpa"}
    assert all(r.median_s > 0 and r.peak_bytes > 0 for r in results)
    files = bench.write(results, decode, config, plot=False)
    # strict JSON: a number not measured is null, never NaN (which is not JSON)
    data = json.loads((tmp_path / "bench.json").read_text(), parse_constant=lambda c: pytest.fail(f"bench.json: {c}"))
    assert data["meta"]["threads"] == torch.get_num_threads()
    assert len(data["results"]) == len(results) and len(data["decode"]) == len(decode)
    assert (tmp_path / "bench.csv").read_text().count("\n") == len(results) + 1
    assert all(path.exists() for path in files)
