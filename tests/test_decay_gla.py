"""Per-feature gates (GLA, log_gate of shape (..., N, F)) in every causal form against the float64 recurrence."""

from __future__ import annotations

import pytest
import torch

import linattn
from decay_reference import decayed_recurrence
from linattn.kinds.gated import forms as gated
from maps_for_tests import DoubledElu, LogExp
from reference import HALF_ROUNDING_FACTOR, elu_plus_one, plain_dtype_recurrence, rel_error, rounding_error

FORMS = ["parallel", "recurrent", "chunked", "chunked-many-blocks", "chunked-sub3"]
BATCH, N, DK, DV = (2, 3), 37, 6, 5
NO_DECAY = torch.zeros((), dtype=torch.float64)


def make_map(name: str):
    if name == "elu":
        return "elu", elu_plus_one, {}, DK
    if name == "module-F2D":
        fmap = DoubledElu()
        return fmap, fmap, {}, 2 * DK
    if name == "identity-unnormalized":
        return "identity", (lambda x: x), {"normalize": False}, DK
    fmap = LogExp(DK, 13).double()
    return fmap, fmap.reference, {"eps": 0.0}, 13


def make_gate(kind: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    gate = -3 * torch.rand(*shape, generator=generator, dtype=torch.float64)
    if kind == "zero":
        return torch.zeros(shape, dtype=torch.float64)
    if kind == "all-30":
        return torch.full(shape, -30.0, dtype=torch.float64)
    if kind == "mixed":  # per feature: some features forget at once, some never, some slowly
        choice = torch.randint(0, 3, shape, generator=generator)
        return torch.where(choice == 0, -30.0, torch.where(choice == 1, 0.0, gate / 30))
    return gate


def inputs(generator, batch=BATCH, n=N, dv=DV):
    return (
        torch.randn(*batch, n, DK, generator=generator, dtype=torch.float64),
        torch.randn(*batch, n, DK, generator=generator, dtype=torch.float64),
        torch.randn(*batch, n, dv, generator=generator, dtype=torch.float64),
    )


def resolve(form: str, monkeypatch) -> str:
    if form == "chunked-many-blocks":  # blocks of one chunk: states cross checkpointed blocks; sub-chunks of 1
        monkeypatch.setattr(gated, "GATED_BLOCK_TOKENS", 1)
        monkeypatch.setattr(gated, "SUB_CHUNK", 1)
        return "chunked"
    if form == "chunked-sub3":  # chunks of 4 split into sub-chunks of 3 and 1 where gates are strong
        monkeypatch.setattr(gated, "SUB_CHUNK", 3)
        return "chunked"
    return form


@pytest.mark.parametrize("gate_kind", ["random", "zero", "all-30", "mixed"])
@pytest.mark.parametrize("map_name", ["elu", "module-F2D", "identity-unnormalized", "logspace-F13"])
@pytest.mark.parametrize("form", FORMS)
def test_per_feature_gate_matches_recurrence(form, map_name, gate_kind, monkeypatch):
    form = resolve(form, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    q, k, v = inputs(generator)
    fmap, phi, extra, features = make_map(map_name)
    gate = make_gate(gate_kind, (*BATCH, N, features), generator)
    out, state = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=True, form=form, chunk_size=4, log_gate=gate, return_state=True,
        **extra,
    )
    expected, s_n, z_n = decayed_recurrence(q, k, v, phi, NO_DECAY, feature_decay=gate, **extra)
    assert rel_error(out, expected) <= 1e-10
    scale = state.shift.exp()
    assert rel_error(state.kv * scale[..., None, None], s_n) <= 1e-10
    assert rel_error(state.k_sum * scale[..., None], z_n) <= 1e-10


@pytest.mark.parametrize("form", FORMS)
def test_composed_with_decay_mask_gqa_and_continuation(form, monkeypatch):
    form = resolve(form, monkeypatch)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, DK, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 2, N, DK, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 2, N, DV, generator=generator, dtype=torch.float64)
    keep = torch.rand(2, N, generator=generator) > 0.3
    gate = -torch.rand(2, 2, N, DK, generator=generator, dtype=torch.float64)  # per k/v head: repeated (GQA)
    rates = torch.tensor([0.9, 0.8, 0.7, 1.0], dtype=torch.float64)
    pieces, state = [], None
    for start, end in ((0, 11), (11, 12), (12, N)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True, form=form, chunk_size=4,
            key_padding_mask=keep[:, start:end], log_gate=gate[..., start:end, :], decay=rates,
            initial_state=state, return_state=True,
        )
        pieces.append(out)
    expected, s_n, _ = decayed_recurrence(
        q, k, v, elu_plus_one, rates.log()[:, None], keep=keep[:, None, :],
        feature_decay=gate.repeat_interleave(2, dim=1),
    )
    assert rel_error(torch.cat(pieces, -2), expected) <= 1e-10
    assert rel_error(state.kv, s_n) <= 1e-10


@pytest.mark.parametrize(
    ("form", "map_name"),
    [(f, "elu") for f in FORMS] + [("parallel", "logspace-F13"), ("chunked-many-blocks", "logspace-F13")],
)
def test_per_feature_gradcheck(form, map_name, monkeypatch):
    form = resolve(form, monkeypatch)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (x.requires_grad_() for x in inputs(generator, (1, 2), 7, 3))
    fmap, _, extra, features = make_map(map_name)
    gate = (-0.05 - torch.rand(1, 2, 7, features, generator=generator, dtype=torch.float64)).requires_grad_()

    def run(q, k, v, gate):
        out, state = linattn.linear_attention(
            q, k, v, feature_map=fmap, causal=True, form=form, chunk_size=3, log_gate=gate, decay=0.9,
            return_state=True, **extra,
        )
        return out, state.kv * state.shift.exp()[..., None, None]

    assert torch.autograd.gradcheck(run, (q, k, v, gate))


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_per_feature_fp32_within_1e5(form):
    generator = torch.Generator().manual_seed(3)
    q, k, v = inputs(generator, (1, 2), 300)
    gate = make_gate("mixed", (1, 2, 300, DK), generator)
    out = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, form=form, log_gate=gate.float())
    expected, _, _ = decayed_recurrence(
        q.float(), k.float(), v.float(), elu_plus_one, NO_DECAY, feature_decay=gate.float()
    )
    assert out.dtype == torch.float32
    assert rel_error(out, expected) <= 1e-5


def test_per_feature_long_gate_finite_and_exact():
    """−30 in half of the features, −0.7 in the others, over 16384 tokens (G down to −5·10⁵): finite, and the last
    outputs equal the recurrence over the last 300 tokens (older keys weigh at most e^{−0.7·100} there)."""
    generator = torch.Generator().manual_seed(4)
    n = 16384
    q, k, v = (x.float() for x in inputs(generator, (1, 1), n))
    gate = torch.where(torch.arange(DK) % 2 == 0, -30.0, -0.7).expand(1, 1, n, DK)
    out, state = linattn.linear_attention(q, k, v, causal=True, log_gate=gate, return_state=True)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(state.kv).all())
    tail = slice(n - 300, n)
    expected, s_n, _ = decayed_recurrence(
        q[..., tail, :], k[..., tail, :], v[..., tail, :], elu_plus_one, NO_DECAY, feature_decay=gate[..., tail, :]
    )
    assert rel_error(out[..., -200:, :], expected[..., -200:, :]) <= 1e-5
    assert rel_error(state.kv, s_n) <= 1e-5


def test_per_feature_gate_with_wrong_width_raises():
    q, k, v = inputs(torch.Generator().manual_seed(5))
    with pytest.raises(linattn.LinearAttentionError, match="F=6"):
        linattn.linear_attention(q, k, v, causal=True, log_gate=-torch.ones(*BATCH, N, 4, dtype=torch.float64))


@pytest.mark.parametrize("form", ["chunked-many-blocks", "chunked-sub3"])
def test_per_feature_gradcheck_strong_gates(form, monkeypatch):
    """Gates down to −40 per token: chunk spans beyond GEMM_SPAN take the sub-chunk path; its gradients too."""
    form = resolve(form, monkeypatch)
    generator = torch.Generator().manual_seed(6)
    q, k, v = (x.requires_grad_() for x in inputs(generator, (1, 1), 8, 2))
    gate = (-0.05 - 40 * torch.rand(1, 1, 8, DK, generator=generator, dtype=torch.float64)).requires_grad_()

    def run(q, k, v, gate):
        return linattn.linear_attention(q, k, v, causal=True, form=form, chunk_size=4, log_gate=gate)

    assert torch.autograd.gradcheck(run, (q, k, v, gate))


def test_per_feature_gate_bf16_inputs_fp32_state():
    """bf16 inputs and per-feature gates keep an fp32 state: the error against the float64 recurrence is at most
    HALF_ROUNDING_FACTOR (1.1) × that of rounding the exact result to bf16 (measured 1.000×, 1.56e-3; see
    tests/reference.py). Negative control: the same recurrence with its state in bf16 (2.7×) fails the bound."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = (x.bfloat16() for x in inputs(generator))
    gate = make_gate("mixed", (*BATCH, N, DK), generator).bfloat16()
    out, state = linattn.linear_attention(q, k, v, causal=True, log_gate=gate, chunk_size=8, return_state=True)
    assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
    expected, _, _ = decayed_recurrence(q, k, v, elu_plus_one, NO_DECAY, feature_decay=gate)
    bound = HALF_ROUNDING_FACTOR * rounding_error(expected, torch.bfloat16)
    assert rel_error(out, expected) <= bound
    plain = plain_dtype_recurrence(q, k, v, elu_plus_one, NO_DECAY, feature_decay=gate)
    assert rel_error(plain, expected) > bound  # the bound rejects a bf16 state
