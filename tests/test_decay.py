"""Decays and per-token gates in every causal form against the float64 recurrence of tests/decay_reference.py."""

from __future__ import annotations

import pytest
import torch

import linattn
from decay_reference import decayed_recurrence
from linattn.kinds.additive.forms import causal_fn
from maps_for_tests import DoubledElu, LogExp
from reference import HALF_ROUNDING_FACTOR, elu_plus_one, plain_dtype_recurrence, rel_error, rounding_error

FORMS = ["parallel", "recurrent", "chunked"]
MAPS = ["elu", "module-F2D", "identity-unnormalized", "logspace-F13"]
GATES = ["decay-float", "decay-heads", "gate", "decay+gate", "zero", "all-30", "mixed"]
BATCH, N, DK, DV, CHUNK = (2, 3), 37, 6, 5, 8


def make_map(name: str):
    """(feature_map argument, float64 φ, extra kwargs)."""
    if name == "elu":
        return "elu", elu_plus_one, {}
    if name == "module-F2D":
        fmap = DoubledElu()
        return fmap, fmap, {}
    if name == "identity-unnormalized":
        return "identity", (lambda x: x), {"normalize": False}
    if name == "logspace-F13":
        fmap = LogExp(DK, 13).double()
        # eps acts in the stabilised scale of a log-space map: compare with eps = 0, where both agree exactly
        return fmap, fmap.reference, {"eps": 0.0}
    raise AssertionError(name)


def make_gate(kind: str, batch: tuple[int, ...], n: int, generator: torch.Generator):
    """(library kwargs, the per-token log-decay for the reference (..., N))."""
    heads = batch[-1]
    if kind == "decay-float":
        return {"decay": 0.9}, torch.full((), 0.9, dtype=torch.float64).log()
    if kind == "decay-heads":
        rates = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float64))  # RetNet's schedule
        return {"decay": rates}, rates.log().unsqueeze(-1)
    gate = -3 * torch.rand(*batch, n, generator=generator, dtype=torch.float64)
    if kind == "gate":
        return {"log_gate": gate}, gate
    if kind == "decay+gate":
        return {"decay": 0.75, "log_gate": gate}, gate + torch.tensor(0.75, dtype=torch.float64).log()
    if kind == "zero":
        gate = torch.zeros(*batch, n, dtype=torch.float64)
    elif kind == "all-30":
        gate = torch.full((*batch, n), -30.0, dtype=torch.float64)
    elif kind == "mixed":  # runs of −30, exact 0 and small gates side by side
        choice = torch.randint(0, 3, (*batch, n), generator=generator)
        gate = torch.where(choice == 0, -30.0, torch.where(choice == 1, 0.0, gate / 30))
    return {"log_gate": gate}, gate


def inputs(batch, n, generator, dtype=torch.float64, dv=DV):
    q = torch.randn(*batch, n, DK, generator=generator, dtype=dtype)
    k = torch.randn(*batch, n, DK, generator=generator, dtype=dtype)
    v = torch.randn(*batch, n, dv, generator=generator, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("gate_kind", GATES)
@pytest.mark.parametrize("map_name", MAPS)
@pytest.mark.parametrize("form", [*FORMS, "chunked-many-blocks"])
def test_forms_match_recurrence_fp64(form, map_name, gate_kind, monkeypatch):
    if form == "chunked-many-blocks":  # a block per chunk: the state crosses block boundaries in the Function
        monkeypatch.setattr(causal_fn, "BLOCK_ELEMENTS", 1)
        form = "chunked"
    generator = torch.Generator().manual_seed(0)
    q, k, v = inputs(BATCH, N, generator)
    fmap, phi, extra = make_map(map_name)
    kwargs, g = make_gate(gate_kind, BATCH, N, generator)
    out, state = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=True, form=form, chunk_size=CHUNK, return_state=True, **kwargs, **extra
    )
    expected, s_n, z_n = decayed_recurrence(q, k, v, phi, g, **extra)
    assert rel_error(out, expected) <= 1e-10
    # the state keeps its meaning: the true decayed sums are kv·e^shift
    scale = torch.exp(state.shift)
    assert rel_error(state.kv * scale[..., None, None], s_n) <= 1e-10
    assert rel_error(state.k_sum * scale[..., None], z_n) <= 1e-10
    assert state.num_tokens == N


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("map_name", ["elu", "logspace-F13"])
def test_mask_gqa_min_denom(form, map_name):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, N, DK, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 2, N, DK, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 2, N, DV, generator=generator, dtype=torch.float64)
    keep = torch.rand(2, N, generator=generator) > 0.3
    keep[:, :5] = False  # leading masked keys: the log-space scale starts at -inf
    gate_kv = -torch.rand(2, 2, N, generator=generator, dtype=torch.float64)  # per k/v head: repeated for GQA
    fmap, phi, extra = make_map(map_name)
    extra = {**extra, "min_denom": 1e-3} if map_name == "elu" else extra
    out = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=True, form=form, chunk_size=CHUNK, key_padding_mask=keep,
        log_gate=gate_kv, decay=torch.tensor([0.9, 0.8, 0.7, 1.0], dtype=torch.float64), **extra,
    )
    g = gate_kv.repeat_interleave(2, dim=-2) + torch.tensor([0.9, 0.8, 0.7, 1.0], dtype=torch.float64).log()[:, None]
    expected, _, _ = decayed_recurrence(q, k, v, phi, g, keep=keep[:, None, :], **extra)
    assert rel_error(out, expected) <= 1e-10


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("map_name", ["elu", "logspace-F13", "identity-unnormalized"])
def test_continuation_across_calls(form, map_name):
    generator = torch.Generator().manual_seed(2)
    q, k, v = inputs(BATCH, N, generator)
    fmap, phi, extra = make_map(map_name)
    g = -2 * torch.rand(*BATCH, N, generator=generator, dtype=torch.float64)
    pieces, state = [], None
    for start, end in ((0, 13), (13, 14), (14, N)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], feature_map=fmap, causal=True,
            form=form, chunk_size=CHUNK, log_gate=g[..., start:end], decay=0.95, initial_state=state,
            return_state=True, **extra,
        )
        pieces.append(out)
    expected, s_n, _ = decayed_recurrence(q, k, v, phi, g + torch.tensor(0.95, dtype=torch.float64).log(), **extra)
    assert rel_error(torch.cat(pieces, -2), expected) <= 1e-10
    assert rel_error(state.kv * state.shift.exp()[..., None, None], s_n) <= 1e-10


@pytest.mark.parametrize("form", FORMS)
def test_explicit_initial_state(form):
    generator = torch.Generator().manual_seed(3)
    q, k, v = inputs(BATCH, N, generator)
    s0 = torch.randn(*BATCH, DK, DV, generator=generator, dtype=torch.float64)
    z0 = torch.rand(*BATCH, DK, generator=generator, dtype=torch.float64) * 5
    # stored at shift log 2: the true sums are twice the stored ones
    state = linattn.LinearAttentionState(s0 / 2, z0 / 2, torch.full(BATCH, 2.0, dtype=torch.float64).log(), 7)
    g = -torch.rand(*BATCH, N, generator=generator, dtype=torch.float64)
    out = linattn.linear_attention(
        q, k, v, causal=True, form=form, chunk_size=CHUNK, log_gate=g, initial_state=state
    )
    expected, _, _ = decayed_recurrence(q, k, v, elu_plus_one, g, s0=s0, z0=z0)
    assert rel_error(out, expected) <= 1e-10


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("map_name", ["elu", "logspace-F13"])
def test_gradcheck(form, map_name, monkeypatch):
    monkeypatch.setattr(causal_fn, "BLOCK_ELEMENTS", 1)  # several blocks in the chunked form
    generator = torch.Generator().manual_seed(4)
    q, k, v = (x.requires_grad_() for x in inputs((1, 2), 8, generator, dv=3))
    gate = (-0.05 - torch.rand(1, 2, 8, generator=generator, dtype=torch.float64)).requires_grad_()
    rates = torch.tensor([0.9, 0.6], dtype=torch.float64, requires_grad=True)
    fmap, _, extra = make_map(map_name)

    def run(q, k, v, gate, rates):
        out, state = linattn.linear_attention(
            q, k, v, feature_map=fmap, causal=True, form=form, chunk_size=3, log_gate=gate, decay=rates,
            return_state=True, **extra,
        )
        return out, state.kv * state.shift.exp()[..., None, None]

    assert torch.autograd.gradcheck(run, (q, k, v, gate, rates))


@pytest.mark.parametrize("gate_kind", ["decay-heads", "gate", "mixed"])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_fp32_within_1e5(form, gate_kind):
    generator = torch.Generator().manual_seed(5)
    batch, n = (1, 3), 300
    q, k, v = inputs(batch, n, generator)
    kwargs, g = make_gate(gate_kind, batch, n, generator)
    kwargs32 = {name: x.float() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
    out = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, form=form, **kwargs32)
    # the reference sees the fp32-rounded gates and inputs the library saw
    expected, _, _ = decayed_recurrence(q.float(), k.float(), v.float(), elu_plus_one, g.float())
    assert out.dtype == torch.float32
    assert rel_error(out, expected) <= 1e-5


def test_large_cumulative_decay_stays_local_in_fp32(monkeypatch):
    """A block whose first half decays by −30 per token and whose second half barely decays: the scales reach
    ~−1000·… in the block while the weights that matter differ by ~0.01; fp32 must see only local differences."""
    monkeypatch.setattr(causal_fn, "BLOCK_ELEMENTS", 1 << 12)
    generator = torch.Generator().manual_seed(6)
    batch, n = (1, 1), 512
    q, k, v = inputs(batch, n, generator)
    g = torch.where(torch.arange(n) % 256 < 128, -30.0, -0.01).double().expand(*batch, n)
    out = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, log_gate=g.float(), chunk_size=16)
    expected, _, _ = decayed_recurrence(q.float(), k.float(), v.float(), elu_plus_one, g.float())
    assert rel_error(out, expected) <= 1e-5


@pytest.mark.parametrize("kwargs", [{"decay": 0.5}, {"log_gate": -30.0}], ids=["decay-0.5", "gate-30"])
def test_65536_tokens_finite_and_exact(kwargs):
    """G reaches −45000 (γ = 0.5) or −2·10⁶ (g = −30): finite, and the last outputs equal the recurrence over the
    last 300 tokens (older keys weigh at most 0.5^100 ≈ 1e-30 there)."""
    generator = torch.Generator().manual_seed(7)
    n = 65536
    q, k, v = inputs((1, 1), n, generator, dtype=torch.float32)
    if "log_gate" in kwargs:
        kwargs = {"log_gate": torch.full((1, 1, n), kwargs["log_gate"])}
    out, state = linattn.linear_attention(q, k, v, causal=True, return_state=True, **kwargs)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(state.kv).all())
    tail = slice(n - 300, n)
    g = torch.full((1, 1, 300), 0.5).log() if "decay" in kwargs else kwargs["log_gate"][..., tail]
    expected, s_n, _ = decayed_recurrence(q[..., tail, :], k[..., tail, :], v[..., tail, :], elu_plus_one, g)
    assert rel_error(out[..., -200:, :], expected[..., -200:, :]) <= 1e-5
    assert rel_error(state.kv * state.shift.exp(), s_n) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_fp32_state(dtype):
    """Half-precision inputs with a decay and a gate keep an fp32 state: the error against the float64 recurrence is
    at most HALF_ROUNDING_FACTOR (1.1) × that of rounding the exact result to the dtype (measured 1.000×: 1.9e-4
    fp16, 1.6e-3 bf16; see tests/reference.py). Negative control: the same recurrence with its state in the dtype
    (2.3–2.4×) fails the same bound."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = (x.to(dtype) for x in inputs(BATCH, N, generator))
    g = -torch.rand(*BATCH, N, generator=generator)
    out, state = linattn.linear_attention(q, k, v, causal=True, log_gate=g, decay=0.9, return_state=True)
    assert out.dtype == dtype and state.kv.dtype == torch.float32 and state.shift.dtype == torch.float32
    g = g.double() + torch.tensor(0.9, dtype=torch.float64).log()
    expected, _, _ = decayed_recurrence(q, k, v, elu_plus_one, g)
    bound = HALF_ROUNDING_FACTOR * rounding_error(expected, dtype)
    assert rel_error(out, expected) <= bound
    assert rel_error(plain_dtype_recurrence(q, k, v, elu_plus_one, g), expected) > bound  # rejects a dtype state


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decay": 0.9, "causal": False}, "causal=True"),
        ({"decay": 1.5, "causal": True}, "decay: rates must lie in"),
        ({"decay": 0.0, "causal": True}, "decay: rates must lie in"),
        ({"decay": torch.ones(5), "causal": True}, "one rate per query head"),
        ({"log_gate": torch.ones(2, 3, N), "causal": True}, "must be ≤ 0"),
        ({"log_gate": torch.full((2, 3, N), float("nan")), "causal": True}, "must be ≤ 0"),
        ({"log_gate": -torch.ones(2, 3, N + 1), "causal": True}, "one log-decay per token"),
        ({"log_gate": torch.full((2, 3, N), float("-inf")), "causal": True}, "-inf"),
        ({"log_gate": -torch.ones(2, 3, N, 4), "causal": True}, "per-feature"),
        ({"log_gate": [0.0], "causal": True}, "log_gate: expected a floating tensor"),
    ],
)
def test_bad_decay_arguments_raise(kwargs, match):
    q, k, v = inputs(BATCH, N, torch.Generator().manual_seed(9), dtype=torch.float32)
    with pytest.raises(linattn.LinearAttentionError, match=match):
        linattn.linear_attention(q, k, v, **kwargs)
