"""The fused decoding token (linattn.backends.native ``layer_token``, a step's ``fused_token``): a layer's key gates,
its Hedgehog maps and the window-plus-memory token (beside the sparse cache too) in one C++ call, against the three
calls it replaces (``key_gates``, ``hedgehog_unit_features`` and the token: the same arithmetic, summed in the same
order, so float64 agrees to 1e-12) and against the chunked form of the whole sequence (1e-10); float32 within 2e-6
of the output's scale (vectorised sums in another order than torch's kernels, never bit-identical across
instruction sets). Where it does not apply (a sink, a boundary, gradients, other maps or gates) it says so by
returning None, and the step's own call runs."""

from __future__ import annotations

import pytest
import torch

import linattn
from linattn.exact.composed_step import ComposedDecodeStep
from linattn.exact.sparse_composed_step import SparseComposedDecodeStep
from linattn.feature_maps import HedgehogFeatureMap
from linattn.nn import KeyGates
from linattn.state import SparseCache
from test_native_decode import kernels  # noqa: F401 - the fixture: the built module, or a skip

pytestmark = pytest.mark.usefixtures("kernels")  # every test here needs the build

B, H, N, D, DV, WINDOW, SINKS = 2, 4, 30, 8, 16, 5, 2


def _inputs(dtype: torch.dtype, heads_kv: int, gated: bool, readout: bool = False):
    """q, k, v, the per-head Hedgehog map and the key gates (None: a fixed β and decay; ``readout``: with a
    read-out weight λ), drawn in float64."""
    gen = torch.Generator().manual_seed(5)
    fmap = HedgehogFeatureMap(head_dim=D, num_features=6, num_heads=H).double()
    gates = KeyGates(heads_kv, D, readout=readout).double() if gated else None
    with torch.no_grad():
        for parameter in [*fmap.parameters(), *(gates.parameters() if gates is not None else [])]:
            parameter.add_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 0.5)
    q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, heads_kv, N, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, heads_kv, N, DV, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), fmap.to(dtype), None if gates is None else gates.to(dtype)


def _decode(dtype: torch.dtype, heads_kv: int, gated: bool, factor: float | None, fused: bool,
            cache: SparseCache | None = None, prompt: int = 1, readout: bool = False):
    """(the stepped outputs, the chunked form's for the same tokens, the step, tokens the fused call took).
    ``readout``: key gates with a read-out weight λ, the layer A + λ·R as linattn.hf computes it (γ = 1/λ, the
    output times λ: the fused call's own, the others' here)."""
    q, k, v, fmap, gates = _inputs(dtype, heads_kv, gated, readout)
    weight = gates.readout_weight(H).detach() if readout else None
    if weight is not None:
        factor = 1.0 / weight
    common = {"window": WINDOW, "sinks": SINKS, "window_factor": factor, "update": "delta"}
    if cache is not None:
        common["sparse_cache"] = cache
    fixed = {} if gated else {"beta": 0.7, "decay": 0.95}

    def per_token(keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return gates(keys) if gates is not None else {}

    with torch.no_grad():
        whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, **common, **fixed, **per_token(k))
        _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :],
                                            feature_map=fmap, causal=True, return_state=True, **common, **fixed,
                                            **per_token(k[..., :prompt, :]))
        options = {**common, **fixed}
        step = (SparseComposedDecodeStep(fmap, state, cache, options) if cache is not None
                else ComposedDecodeStep(fmap, state, options))
        outs, taken = [], 0
        for t in range(prompt, N):
            args = (q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :])
            out = step.fused_token(*args, gates) if fused else None
            if out is None:
                arguments = gates.step_arguments(args[1], H) if gates is not None else {}
                assert gates is None or arguments is not None  # the three calls: key_gates, the maps, the token
                out = step(*args, **arguments)
                out = out if weight is None else out * weight[:, None, None]
            else:
                taken += 1
            outs.append(out)
    whole = whole if weight is None else whole * weight[:, None, None]
    return torch.cat(outs, dim=-2), whole[..., prompt:, :], step, taken


def _states_equal(mine, theirs, atol: float) -> None:
    torch.testing.assert_close(mine.linear.kv, theirs.linear.kv, rtol=0, atol=atol)
    for name in ("keys", "values", "keep", "sink_keys", "sink_values", "sink_keep", "betas"):
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), rtol=0, atol=0)
    assert (mine.num_tokens, mine.linear.num_tokens) == (theirs.num_tokens, theirs.linear.num_tokens)
    if mine.cache is not None:
        for name in ("positions", "keys", "values", "betas"):
            torch.testing.assert_close(getattr(mine.cache, name), getattr(theirs.cache, name), rtol=0, atol=atol)


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("gated", [True, False], ids=["key-gates", "fixed-beta-and-decay"])
def test_the_fused_token_equals_the_three_calls_and_the_chunked_form(heads_kv, factor, gated):
    got, whole, step, taken = _decode(torch.float64, heads_kv, gated, factor, fused=True)
    reference, _, three, none = _decode(torch.float64, heads_kv, gated, factor, fused=False)
    assert taken == N - max(1, SINKS) and none == 0  # every token but the sinks
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)
    _states_equal(step.state(), three.state(), atol=1e-12)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("gated", [True, False], ids=["key-gates", "fixed-beta-and-decay"])
def test_the_fused_token_beside_the_sparse_cache(score, gated):
    """Between two boundaries the fused call; at a boundary (and for the sinks) it declines and the step decides.
    Per-head budgets with an empty one, λ per head, GQA."""
    def cache() -> SparseCache:
        return SparseCache(size=(0, 3, 2, 4), block=3, score=score, linear_weight=(1.0, 0.5, 1.0, 0.25))

    got, whole, step, taken = _decode(torch.float64, 2, gated, 0.7, fused=True, cache=cache())
    reference, _, three, _ = _decode(torch.float64, 2, gated, 0.7, fused=False, cache=cache())
    boundaries = len([t for t in range(1, N) if t % 3 == 0])
    assert taken == N - SINKS - boundaries
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)
    _states_equal(step.state(), three.state(), atol=1e-12)


@pytest.mark.parametrize("sparse", [False, True], ids=["window", "sparse-cache"])
def test_the_fused_token_weighs_its_output_by_the_gates_read_out_weight(sparse):
    """Key gates with a read-out weight: the fused call's output is λ times the step's (A + λ·R with γ = 1/λ)."""
    def cache() -> SparseCache | None:
        return SparseCache(size=(0, 3, 2, 4), block=3, linear_weight=(1.0, 0.5, 1.0, 0.25)) if sparse else None

    got, whole, step, taken = _decode(torch.float64, 2, True, None, fused=True, cache=cache(), readout=True)
    reference, _, three, _ = _decode(torch.float64, 2, True, None, fused=False, cache=cache(), readout=True)
    unweighted, _, _, _ = _decode(torch.float64, 2, True, None, fused=False, cache=cache())
    assert taken > 0
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)
    assert float((got - unweighted).abs().max()) > 1e-3  # λ (about 0.02 before the draw) changes the output
    _states_equal(step.state(), three.state(), atol=1e-12)


@pytest.mark.parametrize("sparse", [False, True], ids=["window", "sparse-cache"])
def test_the_fused_tokens_leave_the_steps_bytes_as_they_were(sparse):
    """What the fused call keeps on a step (the map's and the gates' parameters, not copies) is not the step's
    memory: the cache's byte count (linattn.hf_cache's walk over a step's tensors) is the same before and after."""
    from linattn.hf_cache import _tensors

    def nbytes(step) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(step))

    q, k, v, fmap, gates = _inputs(torch.float64, 2, True, readout=True)
    common = {"window": WINDOW, "sinks": SINKS, "update": "delta"}
    cache = SparseCache(size=4, block=5) if sparse else None
    with torch.no_grad():
        _, state = linattn.linear_attention(q[..., :SINKS, :], k[..., :SINKS, :], v[..., :SINKS, :], feature_map=fmap,
                                            causal=True, return_state=True, sparse_cache=cache, **common,
                                            **gates(k[..., :SINKS, :]))
        step = (SparseComposedDecodeStep(fmap, state, cache, common) if sparse
                else ComposedDecodeStep(fmap, state, common))
        before, taken = nbytes(step), 0
        for t in range(SINKS, SINKS + 2):  # between two boundaries of the cache (block 5)
            token = (q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :])
            taken += step.fused_token(*token, gates) is not None
    assert taken == 2 and step._fused is not None and step._fused.arguments is not None
    assert nbytes(step) == before


@pytest.mark.parametrize("sparse", [False, True], ids=["window", "sparse-cache"])
def test_the_fused_token_float32(sparse):
    cache = SparseCache(size=4, block=3) if sparse else None
    got, _, _, taken = _decode(torch.float32, 2, True, 0.7, fused=True, cache=cache)
    exact, _, _, _ = _decode(torch.float64, 2, True, 0.7, fused=False,
                             cache=SparseCache(size=4, block=3) if sparse else None)
    assert taken > 0
    assert float((got.double() - exact).abs().max()) <= 2e-6 * float(exact.abs().max())


def test_the_fused_token_declines_what_it_does_not_take():
    """None (the step's own call runs) for gradients, per-feature gates, another dtype, a sink, a map in torch."""
    q, k, v, fmap, gates = _inputs(torch.float64, 2, True)
    common = {"window": WINDOW, "sinks": SINKS, "update": "delta"}
    with torch.no_grad():
        _, state = linattn.linear_attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], feature_map=fmap,
                                            causal=True, return_state=True, **common, **gates(k[..., :1, :]))
    token = (q[..., 1:2, :], k[..., 1:2, :], v[..., 1:2, :])
    step = ComposedDecodeStep(fmap, state, common)
    assert step.fused_token(*token, gates) is None  # position 1 is a sink
    step.num_tokens = SINKS  # (as if past the sinks: the checks below come first)
    with torch.no_grad():
        assert step.fused_token(*[x.float() for x in token], gates) is None  # another dtype
        feature = KeyGates(2, D, gate="feature", num_features=12).double()
        assert step.fused_token(*token, feature) is None
        assert step.fused_token(q[..., 1:3, :], k[..., 1:3, :], v[..., 1:3, :], gates) is None  # two tokens
        assert step.fused_token(*token, KeyGates(1, D).double()) is None  # gates for another number of key heads
        assert step.fused_token(*token, KeyGates(2, 2 * D).double()) is None  # for another head size
    with torch.enable_grad():
        assert step.fused_token(*token, gates) is None
    class Other(HedgehogFeatureMap):  # a subclass may change the map: its features stay in torch
        pass

    other = Other(head_dim=D, num_features=6, num_heads=H).double()
    assert ComposedDecodeStep(other, state, common).fused_token(*token, gates) is None


def test_a_linearized_model_generates_through_the_fused_token(monkeypatch):
    """A tiny Llama with per-head Hedgehog maps, key gates with a read-out weight, the delta rule beside the window
    and the sparse cache: generation through the transformers cache takes the fused call between boundaries and
    equals recomputing every token."""
    pytest.importorskip("transformers")
    import linattn.hf as hf
    from linattn.feature_maps import create
    from test_decoder_generate import tiny_llama
    from test_key_gates import _randomised

    calls = {"fused": 0}
    for kind in (ComposedDecodeStep, SparseComposedDecodeStep):
        original = kind.fused_token

        def counted(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            calls["fused"] += out is not None
            return out

        monkeypatch.setattr(kind, "fused_token", counted)
    maps = [create("hedgehog", head_dim=8, num_heads=4, init="random", seed=i) for i in range(2)]
    gates = [_randomised(KeyGates(2, 8, readout=True), 5 + i) for i in range(2)]
    model = hf.linearize(tiny_llama(), maps, gates=gates, update="delta", window=16, sinks=2,
                         sparse_cache=SparseCache(size=4, block=8))
    ids = torch.randint(1, 60, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        taken = calls["fused"]
        recomputed = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    # 11 steps after the prefill in 2 layers; positions 40 and 48 are boundaries
    assert taken == 2 * (11 - 2)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)
