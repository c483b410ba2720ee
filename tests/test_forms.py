"""Every computation form against the float64 quadratic definition: outputs, gradients, masks, states, GQA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import linattn
from maps_for_tests import DoubledElu, LogExp
from reference import elu_plus_one, reference_attention, rel_error, relu

NONCAUSAL_FORMS = ["parallel", "global", "chunked"]
CAUSAL_FORMS = ["parallel", "chunked", "recurrent"]
FORM_CASES = [(False, f) for f in NONCAUSAL_FORMS] + [(True, f) for f in CAUSAL_FORMS]
FORM_IDS = [f"{'causal' if c else 'noncausal'}-{f}" for c, f in FORM_CASES]


@dataclass(frozen=True)
class Shape:
    batch: tuple[int, ...]
    n: int
    dk: int
    dv: int
    chunk: int


SHAPES = {
    "N1": Shape((2,), 1, 4, 3, 4),
    "ragged-N37-C8": Shape((2, 3), 37, 8, 5, 8),
    "exact-N64-C16": Shape((1, 2), 64, 16, 16, 16),
    "2d-N19-C5": Shape((), 19, 6, 7, 5),
    "chunk-gt-N": Shape((3,), 5, 4, 4, 64),
}


def make_map(name: str, dk: int):
    """(feature_map argument, float64 reference φ, extra kwargs)."""
    if name == "elu":
        return "elu", elu_plus_one, {}
    if name == "relu":
        return "relu", relu, {}
    if name == "callable-F2D":
        return (lambda x: torch.cat([elu_plus_one(x), elu_plus_one(-x)], -1)), (
            lambda x: torch.cat([elu_plus_one(x), elu_plus_one(-x)], -1)
        ), {}
    if name == "module-F2D":
        fmap = DoubledElu()
        return fmap, fmap, {}
    if name == "identity-unnormalized":
        return "identity", (lambda x: x), {"normalize": False}
    if name == "logspace-F13":
        fmap = LogExp(dk, 13).double()
        return fmap, fmap.reference, {}
    raise AssertionError(name)


MAPS = ["elu", "relu", "callable-F2D", "module-F2D", "identity-unnormalized", "logspace-F13"]


def inputs(shape: Shape, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape.batch, shape.n, shape.dk, generator=generator, dtype=dtype)
    k = torch.randn(*shape.batch, shape.n, shape.dk, generator=generator, dtype=dtype)
    v = torch.randn(*shape.batch, shape.n, shape.dv, generator=generator, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("map_name", MAPS)
@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_form_matches_float64_definition(causal, form, shape_id, map_name, masked):
    shape = SHAPES[shape_id]
    q, k, v = inputs(shape)
    fmap, phi, extra = make_map(map_name, shape.dk)
    keep = None
    if masked:
        keep = torch.rand(*shape.batch, shape.n, generator=torch.Generator().manual_seed(1)) > 0.3
        keep[..., 0] = True  # log-space maps: a query that sees no key at all has the 0/0 case tested elsewhere
    eps = 0.0 if map_name.startswith("logspace") else 1e-6  # log-space eps acts in the stabilised scale
    out = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=shape.chunk, key_padding_mask=keep,
        eps=eps, **extra,
    )
    expected = reference_attention(q, k, v, phi, causal=causal, keep=keep, eps=eps, **extra)
    assert out.shape == expected.shape and out.dtype == torch.float64
    assert rel_error(out, expected) <= 1e-10


@pytest.mark.parametrize("map_name", ["elu", "module-F2D", "logspace-F13"])
@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_form_float32_within_1e5(causal, form, map_name):
    shape = SHAPES["ragged-N37-C8"]
    q, k, v = inputs(shape, torch.float32)
    fmap, phi, extra = make_map(map_name, shape.dk)
    if isinstance(fmap, torch.nn.Module):
        fmap = fmap.float()
    eps = 0.0 if map_name.startswith("logspace") else 1e-6
    out = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=shape.chunk, eps=eps
    )
    assert out.dtype == torch.float32
    phi64 = make_map(map_name, shape.dk)[1]
    expected = reference_attention(q, k, v, phi64, causal=causal, eps=eps)
    assert rel_error(out, expected) <= 1e-5


@pytest.mark.parametrize("map_name", ["elu", "callable-F2D", "logspace-F13"])
@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_gradients_match_reference(causal, form, map_name):
    shape = SHAPES["ragged-N37-C8"]
    q, k, v = (x.requires_grad_() for x in inputs(shape))
    fmap, phi, extra = make_map(map_name, shape.dk)
    keep = torch.rand(*shape.batch, shape.n, generator=torch.Generator().manual_seed(2)) > 0.2
    keep[..., 0] = True
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(*shape.batch, shape.n, shape.dv, generator=generator, dtype=torch.float64)
    out = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=shape.chunk, key_padding_mask=keep, eps=0.0
    )
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = reference_attention(q, k, v, phi, causal=causal, keep=keep, eps=0.0)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert torch.isfinite(got).all(), name
        assert rel_error(got, want) <= 1e-9, name


@pytest.mark.parametrize("map_name", ["elu", "logspace-F13"])
@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_gradcheck(causal, form, map_name):
    shape = Shape((2,), 6, 3, 2, 4)
    q, k, v = (x.requires_grad_() for x in inputs(shape, seed=5))
    fmap, _, _ = make_map(map_name, shape.dk)
    keep = torch.tensor([[True, False, True, True, False, True], [True, True, True, False, True, True]])

    def run(q, k, v):
        return linattn.linear_attention(
            q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=shape.chunk, key_padding_mask=keep
        )

    assert torch.autograd.gradcheck(run, (q, k, v))


@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
@pytest.mark.parametrize("map_name", ["elu", "logspace-F13"])
def test_state_continuation_equals_one_call(causal, form, map_name):
    """A sequence fed in pieces, passing the state along, equals one call over the whole sequence."""
    shape = SHAPES["ragged-N37-C8"]
    q, k, v = inputs(shape)
    fmap, phi, _ = make_map(map_name, shape.dk)
    eps = 0.0
    whole, whole_state = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=causal, form="parallel", return_state=True, eps=eps
    )
    cuts = [0, 1, 10, 11, 30, 37]
    state = None
    outs = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        piece = slice(start, end)
        out, state = linattn.linear_attention(
            q[..., piece, :], k[..., piece, :], v[..., piece, :], feature_map=fmap, causal=causal, form=form,
            chunk_size=shape.chunk, initial_state=state, return_state=True, eps=eps,
        )
        outs.append(out)
    assert state.num_tokens == shape.n
    # the final state summarises the same keys, whatever the pieces (compare true sums: kv · e^shift)
    def true_sums(s):
        scale = torch.exp(s.shift)
        return s.kv * scale[..., None, None], s.k_sum * scale[..., None]

    for got, want in zip(true_sums(state), true_sums(whole_state), strict=True):
        assert rel_error(got, want) <= 1e-10
    if causal:
        assert rel_error(torch.cat(outs, dim=-2), whole) <= 1e-10
    else:
        # non-causal: each piece's queries see its own keys plus everything before
        last = outs[-1]
        expected = reference_attention(
            q[..., 30:, :], k[..., 30:, :], v[..., 30:, :], phi, prefix_k=k[..., :30, :], prefix_v=v[..., :30, :],
            eps=eps,
        )
        assert rel_error(last, expected) <= 1e-10


@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_padded_batch_equals_unpadded_runs(causal, form):
    """Right-padded sequences of different lengths give the same outputs as each sequence run alone."""
    lengths = [9, 4, 13]
    generator = torch.Generator().manual_seed(7)
    heads, n, d = 2, max(lengths), 5
    q, k, v = (torch.randn(len(lengths), heads, n, d, generator=generator, dtype=torch.float64) for _ in range(3))
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, N): read as (B, 1, N)
    # padding holds garbage: it must not leak into numerator or denominator
    k = torch.where(keep[:, None, :, None], k, torch.full_like(k, 1e4))
    v = torch.where(keep[:, None, :, None], v, torch.full_like(v, float("nan")))
    out = linattn.linear_attention(q, k, v, causal=causal, form=form, chunk_size=4, key_padding_mask=keep)
    for b, length in enumerate(lengths):
        alone = linattn.linear_attention(
            q[b, :, :length], k[b, :, :length], v[b, :, :length], causal=causal, form=form, chunk_size=4
        )
        assert rel_error(out[b, :, :length], alone) <= 1e-12
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_grouped_query_attention_equals_repeated_heads(causal, form):
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 21, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 2, 21, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 2, 21, 4, generator=generator, dtype=torch.float64)
    out = linattn.linear_attention(q, k, v, causal=causal, form=form, chunk_size=8)
    repeated = linattn.linear_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=causal, form="parallel"
    )
    assert out.shape == (2, 6, 21, 4)
    assert rel_error(out, repeated) <= 1e-12
    assert rel_error(out, reference_attention(q, k, v, elu_plus_one, causal=causal)) <= 1e-10


def test_noncausal_cross_attention_lengths_differ():
    generator = torch.Generator().manual_seed(12)
    q = torch.randn(3, 17, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(3, 40, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(3, 40, 6, generator=generator, dtype=torch.float64)
    expected = reference_attention(q, k, v, elu_plus_one)
    for form in NONCAUSAL_FORMS:
        out = linattn.linear_attention(q, k, v, form=form, chunk_size=7)
        assert out.shape == (3, 17, 6)
        assert rel_error(out, expected) <= 1e-10


@pytest.mark.parametrize(("causal", "form"), FORM_CASES, ids=FORM_IDS)
def test_min_denom_clamps_after_eps(causal, form):
    """relu features of all-negative keys give a zero denominator: clamped to min_denom, never NaN."""
    q = torch.rand(1, 12, 4, dtype=torch.float64)
    k = -torch.rand(1, 12, 4, dtype=torch.float64) - 0.1
    k[:, 5] = 0.5  # one key with features: the rest contribute nothing
    v = torch.randn(1, 12, 3, dtype=torch.float64)
    for min_denom in (None, 1e-2):
        out = linattn.linear_attention(
            q, k, v, feature_map="relu", causal=causal, form=form, chunk_size=4, min_denom=min_denom
        )
        expected = reference_attention(q, k, v, relu, causal=causal, min_denom=min_denom)
        assert torch.isfinite(out).all()
        assert rel_error(out, expected) <= 1e-10


def test_auto_form_for_long_noncausal_inputs_equals_the_definition():
    """Beyond 4096 keys "auto" runs the non-causal chunked form; results agree with the global form."""
    generator = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 5000, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    auto, state = linattn.linear_attention(q, k, v, return_state=True)
    expected, expected_state = linattn.linear_attention(q, k, v, form="global", return_state=True)
    assert rel_error(auto, expected) <= 1e-12
    assert rel_error(state.kv, expected_state.kv) <= 1e-12
