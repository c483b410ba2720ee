"""The hybrid's banded exact-part Function (exact/forms/fused.py) on the shapes the small cases of test_window.py do
not reach: bands over three key blocks, several cache groups with tiles overlapping at their edges, sinks carried in
a state, and its hand-written backward (gradcheck). The reference is test_window.py's float64 N×N definition."""

from __future__ import annotations

import pytest
import torch

from linattn import linear_attention
from linattn.exact.forms import fused as window_fast
from test_window import elu1, hybrid_reference, inputs


@pytest.fixture
def small_groups(monkeypatch):
    # one or two query blocks per group, so that gradients of keys shared by two groups add up across the loop
    monkeypatch.setattr(window_fast, "GROUP_ELEMENTS", 1)
    yield
    monkeypatch.undo()


@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize(("n", "window", "sinks"), [(150, 40, 3), (70, 17, 0), (50, 64, 2), (300, 20, 2)],
                         ids=["W40-three-blocks", "W17-no-sinks", "W>=N", "W20-interior"])
def test_band_function_matches_reference(n, window, sinks, causal, factor, small_groups):
    # values and gradients; the W40 (causal) and W20 cases have blocks whose keys lie wholly in this call's keys
    # (the strided-view tiles) besides the gathered ones at the ends
    q, k, v = inputs(1, 2, n, 8, seed=20)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = hybrid_reference(*leaves, elu1, elu1, window=window, sinks=sinks, causal=causal, factor=factor)
    expected.square().sum().backward()
    reference_grads = [x.grad for x in leaves]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = linear_attention(*leaves, causal=causal, window=window, sinks=sinks, window_factor=factor, chunk_size=16)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-10)
    out.square().sum().backward()
    for got, want in zip((x.grad for x in leaves), reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
def test_band_function_gradients_through_a_carried_state(factor, small_groups):
    # ring keys and sink keys reach the second call through the state: their gradients must flow back to the first
    q, k, v = inputs(1, 2, 90, 8, seed=21)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = hybrid_reference(*leaves, elu1, elu1, window=33, sinks=3, causal=True, factor=factor)
    expected.square().sum().backward()
    reference_grads = [x.grad for x in leaves]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    options = {"causal": True, "window": 33, "sinks": 3, "window_factor": factor, "chunk_size": 8}
    first, state = linear_attention(*(x[..., :41, :] for x in leaves), return_state=True, **options)
    second = linear_attention(*(x[..., 41:, :] for x in leaves), initial_state=state, **options)
    torch.testing.assert_close(torch.cat([first, second], -2), expected.detach(), rtol=1e-10, atol=1e-10)
    torch.cat([first, second], -2).square().sum().backward()
    for got, want in zip((x.grad for x in leaves), reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("factor", [None, "tensor"], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_band_function_gradcheck(causal, factor, small_groups):
    # ordinary map (elu): the mass comes from the Function too; W = 18 > 16 → query blocks of 32 over two key blocks
    q, k, v = inputs(1, 1, 40, 4, seed=22)
    gamma = torch.tensor([1.3], dtype=torch.float64, requires_grad=True) if factor else None
    leaves = [x.requires_grad_() for x in (q, k, v)] + ([gamma] if gamma is not None else [])

    def run(*args):
        g = args[3] if len(args) > 3 else None
        return linear_attention(args[0], args[1], args[2], causal=causal, window=18, sinks=2, window_factor=g,
                                chunk_size=8)

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7)


def test_band_function_is_used_and_keeps_no_band_sized_tensor():
    # the fast path must be the one that runs without padding, and its autograd graph must hold O(N·D) tensors
    # only: every saved tensor of the hybrid's graph has at most N·max(D, Dv, F) elements per batch×head row
    q, k, v = inputs(1, 2, 256, 8, seed=23)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = linear_attention(*leaves, causal=True, window=64, sinks=4)
    names = set()
    node, todo = out.grad_fn, [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node.name() in names:
            continue
        names.add(node.name())
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    assert "BandSoftmaxBackward" in names
    assert "ShiftRowsBackward" not in names  # ordinary maps: the linear part reads the keys lagged, not a copy
    limit = 2 * 256 * (8 + 3)  # B·H rows × N × max(D, Dv): the inputs' own size
    assert max(x.numel() for x in saved) <= limit


def test_band_gradients_are_whole_tensors_summed_in_place():
    """The banded Function hands back gradients of its inputs' own shapes, not views, so that autograd sums the
    linear part's gradient of the same tensor into them in place (into a view it would allocate a new sum)."""
    q, k, v = (x.requires_grad_() for x in inputs(2, 3, 96, 8, seed=24))
    features = (q.exp(), k.exp()[..., :0, :].detach(), k.exp())
    a, _, mass, _ = window_fast.exact_part(q, 0.3, True, (k[..., :0, :].detach(), k), (v[..., :0, :].detach(), v),
                                        features, 16, 15, 0, None)
    grads = torch.autograd.grad([a.sum(), mass.sum()], [q, k, v, *(features[i] for i in (0, 2))])
    for grad, like in zip(grads, (q, k, v, q, k), strict=True):
        assert grad.shape == like.shape and grad._base is None



def test_mass_combine_matches_the_quadratic_form_with_a_clamped_denominator():
    # min_denom clamps the first rows' denominators (elu features: den grows with t): the fused combine must give
    # the quadratic form's values and gradients there too (∂L/∂den is 0 where the clamp holds)
    q, k, v = inputs(1, 2, 60, 8, seed=24)
    results = []
    for form in ("parallel", "chunked"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = linear_attention(*leaves, causal=True, window=8, sinks=2, form=form, chunk_size=16, min_denom=20.0)
        out.square().sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    # the mass form's denominator is plain causal linear attention's: Σ_{j≤t} φ(q_t)·φ(k_j)
    den = (elu1(q) @ elu1(k).transpose(-1, -2)).tril().sum(-1)
    assert bool((den < 20).any()) and bool((den > 20).any())  # the clamp holds on some rows and not on others
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_backward_inside_autocast_recomputes_in_float32():
    # a training loop may call backward() inside torch.autocast: the hybrid's Functions must recompute in the
    # forward's dtypes (bf16 GEMMs in backward moved these gradients by ~4e-2); same inputs, same call shapes, so
    # the two backward passes do the same float32 arithmetic
    gen = torch.Generator().manual_seed(25)
    q, k, v = (torch.randn(1, 2, 100, 16, generator=gen, requires_grad=True) for _ in range(3))
    grads = []
    for autocast in (False, True):
        out = linear_attention(q, k, v, causal=True, window=20, sinks=2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for plain, inside in zip(*grads, strict=True):
        torch.testing.assert_close(inside, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_band_function_with_gqa_and_per_head_factor(causal, small_groups):
    # no padding, so the banded Function runs (test_window.py's GQA case has padding: the gathered path); k and v
    # heads shared by two query heads each, γ one per query head; values and gradients against the reference
    q, k, v = inputs(2, 4, 90, 8, heads_kv=2, seed=26)
    gamma = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64)
    for factor in (None, gamma):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        expected = hybrid_reference(*leaves, elu1, elu1, window=20, sinks=2, causal=causal, factor=factor)
        expected.square().sum().backward()
        reference_grads = [x.grad for x in leaves]
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = linear_attention(*leaves, causal=causal, window=20, sinks=2, window_factor=factor, chunk_size=16)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-10)
        out.square().sum().backward()
        for got, want in zip((x.grad for x in leaves), reference_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
