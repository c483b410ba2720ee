"""Packed variable-length input (cu_seqlens): every form equals each sequence run alone against the float64
references, with per-sequence initial and final states, decays and masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import linattn
from decay_reference import decayed_recurrence
from maps_for_tests import LogExp
from reference import elu_plus_one, reference_attention, rel_error

LENGTHS = [5, 1, 17, 9, 12]
OFFSETS = [0, 5, 6, 23, 32, 44]
N = 44
CASES = [(True, f) for f in ("parallel", "recurrent", "chunked")]
CASES += [(False, f) for f in ("parallel", "global", "chunked")]
IDS = [f"{'causal' if c else 'noncausal'}-{f}" for c, f in CASES]


def make_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, N, 6, generator=generator, dtype=torch.float64)  # (H, N, D): one packed row per head
    k = torch.randn(2, N, 6, generator=generator, dtype=torch.float64)
    v = torch.randn(2, N, 5, generator=generator, dtype=torch.float64)
    return q, k, v, generator


def pieces(x: torch.Tensor, dim: int = -2):
    return [x.narrow(dim, a, b - a) for a, b in zip(OFFSETS[:-1], OFFSETS[1:], strict=True)]


@pytest.mark.parametrize(("causal", "form"), CASES, ids=IDS)
@pytest.mark.parametrize("map_name", ["elu", "logspace"])
def test_packed_equals_separate(causal, form, map_name):
    q, k, v, generator = make_inputs()
    if map_name == "elu":
        fmap, phi, extra = "elu", elu_plus_one, {}
    else:
        fmap = LogExp(6, 11).double()
        phi, extra = fmap.reference, {"eps": 0.0}
    keep = torch.rand(2, N, generator=generator) > 0.2
    out, state = linattn.linear_attention(
        q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=4, cu_seqlens=torch.tensor(OFFSETS),
        key_padding_mask=keep, return_state=True, **extra,
    )
    assert state.kv.shape == (len(LENGTHS), 2, 11 if map_name == "logspace" else 6, 5)
    for index, (qs, ks, vs, ms) in enumerate(zip(pieces(q), pieces(k), pieces(v), pieces(keep, -1), strict=True)):
        expected = reference_attention(qs, ks, vs, phi, causal=causal, keep=ms, **extra)
        got = out[..., OFFSETS[index] : OFFSETS[index + 1], :]
        assert rel_error(got, expected) <= 1e-10
        if causal or map_name == "elu":
            fk = phi(ks) * ms.unsqueeze(-1)
            true_kv = state.kv[index] * state.shift[index].exp()[..., None, None]
            assert rel_error(true_kv, fk.transpose(-1, -2) @ (vs * ms.unsqueeze(-1))) <= 1e-10


@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunked"])
def test_packed_decay_states_and_continuation(form):
    q, k, v, generator = make_inputs(1)
    gate = -torch.rand(2, N, generator=generator, dtype=torch.float64)
    count = len(LENGTHS)
    s0 = torch.randn(count, 2, 6, 5, generator=generator, dtype=torch.float64)
    z0 = torch.rand(count, 2, 6, generator=generator, dtype=torch.float64)
    initial = linattn.LinearAttentionState(s0, z0, torch.zeros(count, 2, dtype=torch.float64), 0)
    out, state = linattn.linear_attention(
        q, k, v, causal=True, form=form, chunk_size=4, cu_seqlens=OFFSETS, log_gate=gate, decay=0.9,
        initial_state=initial, return_state=True,
    )
    g = gate + torch.tensor(0.9, dtype=torch.float64).log()
    for index, (qs, ks, vs, gs) in enumerate(zip(pieces(q), pieces(k), pieces(v), pieces(g, -1), strict=True)):
        expected, s_n, z_n = decayed_recurrence(qs, ks, vs, elu_plus_one, gs, s0=s0[index], z0=z0[index])
        assert rel_error(out[..., OFFSETS[index] : OFFSETS[index + 1], :], expected) <= 1e-10
        assert rel_error(state.kv[index], s_n) <= 1e-10
        assert rel_error(state.k_sum[index], z_n) <= 1e-10
    assert state.num_tokens == N


def test_packed_gradcheck():
    q, k, v, generator = make_inputs(2)
    q, k, v = (x[..., :12, :].clone().requires_grad_() for x in (q, k, v))
    gate = (-0.1 - torch.rand(2, 12, generator=generator, dtype=torch.float64)).requires_grad_()

    def run(q, k, v, gate):
        return linattn.linear_attention(q, k, v, causal=True, chunk_size=2, cu_seqlens=[0, 3, 4, 12], log_gate=gate)

    assert torch.autograd.gradcheck(run, (q, k, v, gate))


def test_packed_numpy_in_numpy_out():
    q, k, v, _ = make_inputs(3)
    out = linattn.linear_attention(q.numpy(), k.numpy(), v.numpy(), causal=True, cu_seqlens=OFFSETS)
    assert isinstance(out, np.ndarray)
    expected = reference_attention(q[:, :5], k[:, :5], v[:, :5], elu_plus_one, causal=True)
    assert rel_error(torch.from_numpy(out[:, :5]), expected) <= 1e-10


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([0, 5, 40], "end at the packed length 44"),
        ([1, 44], "start at 0"),
        ([0, 5, 5, 44], "strictly increasing"),
        (torch.tensor([0.0, 44.0]), "integer tensor"),
        ("0,44", "integer tensor or a list"),
    ],
)
def test_bad_cu_seqlens_raise(offsets, match):
    q, k, v, _ = make_inputs()
    with pytest.raises(linattn.LinearAttentionError, match=match):
        linattn.linear_attention(q, k, v, causal=True, cu_seqlens=offsets)


def test_packed_initial_state_count_must_match():
    q, k, v, _ = make_inputs()
    wrong = linattn.LinearAttentionState.zeros((2, 2), 6, 5, dtype=torch.float64)
    with pytest.raises(linattn.LinearAttentionError, match="one state per sequence"):
        linattn.linear_attention(q, k, v, causal=True, cu_seqlens=OFFSETS, initial_state=wrong)


# one-call path: causal, ordinary maps, no states (a jump of the log-scale at each boundary, _packed.py)

@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunked"])
@pytest.mark.parametrize("gating", ["none", "decay+gate", "per-feature"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_one_call_path_equals_separate(form, gating, dtype, monkeypatch):
    def no_loop(*args, **kwargs):
        raise AssertionError("the per-sequence loop ran where the one-call path applies")

    monkeypatch.setattr(linattn._packed, "packed_attention", no_loop)
    q, k, v, generator = make_inputs(4)
    keep = torch.rand(2, N, generator=generator) > 0.2
    g = torch.zeros((), dtype=torch.float64)
    feature = None
    kwargs: dict = {}
    if gating == "decay+gate":
        gate = -2 * torch.rand(2, N, generator=generator, dtype=torch.float64)
        kwargs = {"decay": 0.9, "log_gate": gate.to(dtype)}
        g = gate.to(dtype).double() + torch.tensor(0.9, dtype=torch.float64).log()
    elif gating == "per-feature":
        feature = -torch.rand(2, N, 6, generator=generator, dtype=torch.float64).to(dtype).double()
        kwargs = {"log_gate": feature.to(dtype)}
    out = linattn.linear_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), causal=True, form=form, chunk_size=4, cu_seqlens=OFFSETS,
        key_padding_mask=keep, **kwargs,
    )
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for index, (a, b) in enumerate(zip(OFFSETS[:-1], OFFSETS[1:], strict=True)):
        expected, _, _ = decayed_recurrence(
            q[..., a:b, :].to(dtype), k[..., a:b, :].to(dtype), v[..., a:b, :].to(dtype), elu_plus_one,
            g[..., a:b] if g.dim() else g, keep=keep[..., a:b],
            feature_decay=feature[..., a:b, :] if feature is not None else None,
        )
        assert rel_error(out[..., a:b, :], expected) <= tolerance, index
