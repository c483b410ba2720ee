"""The delta rule with a per-feature gate (KDA: ``update="delta"``, ``log_gate`` (..., N, F)) against a float64
token-by-token recurrence written here.

Tolerances: fp64 forms agree with the recurrence to 1e-10 absolute (the chunked form reassociates sums and solves a
unit triangular system per chunk); fp32 agrees with fla's naive recurrence (fp32, another order) to 2e-5; gradients
by gradcheck (fp64, finite differences).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import DeltaRuleState, LinearAttentionError
from linattn.capabilities import context_parallel_reasons
from linattn.decode import DeltaDecodeStep
from linattn.feature_maps import create
from linattn.kinds.kda import forms as kda
from linattn.nn import LinearAttention

FP64 = 1e-10


def recurrence(q, k, v, beta, log_gate, state=None):
    """S_t = diag(e^{g_t})S_{t−1} + β_t k̂_t(v_t − (diag(e^{g_t})S_{t−1})ᵀk̂_t)ᵀ, o_t = S_tᵀq̂_t: float64, token by
    token, identity features L2-normalised. log_gate (..., N, F)."""
    q, k, v, beta, log_gate = (x.double() for x in (q, k, v, beta, log_gate))
    qf, kf = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    s = state.double().clone() if state is not None else q.new_zeros(*q.shape[:-2], k.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        s = torch.exp(log_gate[..., t, :])[..., :, None] * s
        k_t = kf[..., t, :]
        u = beta[..., t, None] * (v[..., t, :] - torch.einsum("...f,...fd->...d", k_t, s))
        s = s + k_t[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("...f,...fd->...d", qf[..., t, :], s))
    return torch.stack(outs, dim=-2), s


def inputs(b=2, h=3, n=45, d=8, dv=5, seed=0, strength=0.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, n, d, generator=g, dtype=dtype), torch.randn(b, h, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, n, dv, generator=g, dtype=dtype)
    beta = torch.rand(b, h, n, generator=g, dtype=dtype)
    log_gate = -strength * torch.rand(b, h, n, d, generator=g, dtype=dtype)
    return q, k, v, beta, log_gate


def kda_call(q, k, v, beta, log_gate, **options):
    return linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, log_gate=log_gate,
                                    feature_map="identity", **options)


FORMS = [("recurrent", None), ("parallel", None), ("chunked", 1), ("chunked", 7), ("chunked", 16), ("chunked", 64)]


@pytest.mark.parametrize("form,chunk", FORMS, ids=[f"{f}-{c}" for f, c in FORMS])
@pytest.mark.parametrize("carried", [False, True])
def test_forms_equal_the_recurrence(form, chunk, carried):
    q, k, v, beta, log_gate = inputs()  # N = 45: not a multiple of any chunk above 1; Dk = 8 ≠ Dv = 5
    s0 = torch.randn(2, 3, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, want_state = recurrence(q, k, v, beta, log_gate, s0 if carried else None)
    out, state = kda_call(q, k, v, beta, log_gate, form=form, chunk_size=chunk, return_state=True,
                          initial_state=DeltaRuleState(s0, 10) if carried else None)
    assert isinstance(state, DeltaRuleState) and state.num_tokens == 45 + (10 if carried else 0)
    assert (out - want).abs().max() < FP64
    assert (state.kv - want_state).abs().max() < FP64


@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunked"])
def test_one_token(form):
    q, k, v, beta, log_gate = inputs(n=1)
    s0 = torch.randn(2, 3, 8, 5, dtype=torch.float64)
    want, want_state = recurrence(q, k, v, beta, log_gate, s0)
    out, state = kda_call(q, k, v, beta, log_gate, form=form, initial_state=DeltaRuleState(s0, 3), return_state=True)
    assert (out - want).abs().max() < FP64 and (state.kv - want_state).abs().max() < FP64


def test_a_decay_adds_to_every_feature():
    q, k, v, beta, log_gate = inputs(h=2)
    rates = torch.tensor([0.9, 0.6], dtype=torch.float64)
    want, _ = recurrence(q, k, v, beta, log_gate + torch.log(rates)[:, None, None])
    for form in ("chunked", "recurrent"):
        out = kda_call(q, k, v, beta, log_gate, decay=rates, form=form, chunk_size=16)
        assert (out - want).abs().max() < FP64


def test_equal_features_are_the_gated_delta_rule():
    """A gate equal in every feature is Gated DeltaNet's per-token decay: the two paths agree."""
    q, k, v, beta, log_gate = inputs()
    per_token = log_gate[..., :1]
    out = kda_call(q, k, v, beta, per_token.expand_as(log_gate), chunk_size=16)
    assert (out - kda_call(q, k, v, beta, per_token[..., 0], chunk_size=16)).abs().max() < FP64


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_gates_stay_finite_and_exact(dtype):
    """g ≈ −20 per token in some features (e^{−20·64} within a chunk: far below fp32's range) and weak in others:
    the chunk splits by sub-chunks and every factor stays ≤ 1. fp32 against the float64 recurrence: 1e-5."""
    q, k, v, beta, log_gate = inputs(n=100, dtype=dtype)
    log_gate[..., :4] = -20 + log_gate[..., :4]
    want, want_state = recurrence(q, k, v, beta, log_gate)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_gate)]
    out, state = kda_call(*leaves, chunk_size=64, return_state=True)
    (out.sum() + state.kv.sum()).backward()
    assert all(bool(torch.isfinite(x.grad).all()) for x in leaves)
    tol = FP64 if dtype == torch.float64 else 1e-5
    assert (out.double() - want).abs().max() < tol and (state.kv.double() - want_state).abs().max() < tol


def test_sub_chunk_path_equals_the_product_path(monkeypatch):
    """The two ways of forming the chunk's pair weights give the same outputs and gradients (fp64)."""
    q, k, v, beta, log_gate = inputs(n=70)
    weights = torch.randn(2, 3, 70, 5, dtype=torch.float64)
    results = []
    for span in (kda.GEMM_SPAN, -1.0):  # −1: no chunk takes the product path
        monkeypatch.setattr(kda, "GEMM_SPAN", span)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_gate)]
        out, state = kda_call(*leaves, chunk_size=64, return_state=True)
        loss = (out * weights).sum() + state.kv.square().sum()
        results.append((out, *torch.autograd.grad(loss, leaves)))
    for product, sub in zip(*results, strict=True):
        assert (product - sub).abs().max() < 1e-12


def test_fla_naive_recurrent_kda_agrees():
    """fla's naive recurrence (fp32, layout [B, T, H, K]; no normalisation of its own, scale 1)."""
    pytest.importorskip("einops")
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, beta, log_gate = inputs(b=1, h=2, n=150, d=16, dv=16, strength=0.2, dtype=torch.float32)
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    s0 = torch.randn(1, 2, 16, 16)
    out, state = kda_call(q, k, v, beta, log_gate, initial_state=DeltaRuleState(s0, 0), return_state=True)
    theirs, their_state = naive.naive_recurrent_kda(
        *(x.transpose(1, 2) for x in (qn, kn, v, log_gate)), beta.transpose(1, 2), scale=1.0, initial_state=s0,
        output_final_state=True)
    assert (out - theirs.transpose(1, 2)).abs().max() < 2e-5
    assert (state.kv - their_state).abs().max() < 2e-5


@pytest.mark.parametrize("n,chunk,strength,strong", [(10, 4, 0.5, 0), (7, 7, 0.5, 0), (20, 20, 30.0, 0),
                                                     (20, 20, 0.5, 2)],
                         ids=["chunks", "one-chunk", "strong-sub-chunks", "half-strong"])
def test_gradcheck(n, chunk, strength, strong):
    """q, k, v, β, the gate and the initial state, through the chunked form's written-out backward: the product
    path, the sub-chunks (every feature strong) and both at once (``strong`` features at g ≈ −20)."""
    q, k, v, beta, log_gate = inputs(b=1, h=2, n=n, d=4, dv=3, strength=strength)
    log_gate[..., :strong] -= 20
    s0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_gate, s0)]

    def run(q, k, v, beta, log_gate, s0):
        out, state = kda_call(q, k, v, beta, log_gate, initial_state=DeltaRuleState(s0, 0), return_state=True,
                              chunk_size=chunk)
        return out, state.kv

    assert torch.autograd.gradcheck(run, leaves)


def test_gradients_equal_the_recurrent_form():
    q, k, v, beta, log_gate = inputs(n=70)
    weights = torch.randn(2, 3, 70, 5, dtype=torch.float64)
    grads = []
    for form in ("chunked", "recurrent"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, log_gate)]
        out, state = kda_call(*leaves, form=form, chunk_size=16, return_state=True)
        grads.append(torch.autograd.grad((out * weights).sum() + state.kv.square().sum(), leaves))
    for chunked, recurrent in zip(*grads, strict=True):
        assert (chunked - recurrent).abs().max() < 1e-9


def test_two_calls_equal_one():
    q, k, v, beta, log_gate = inputs(n=50)
    full, full_state = kda_call(q, k, v, beta, log_gate, chunk_size=16, return_state=True)
    first, state = kda_call(q[..., :23, :], k[..., :23, :], v[..., :23, :], beta[..., :23], log_gate[..., :23, :],
                            chunk_size=16, return_state=True)
    second, state = kda_call(q[..., 23:, :], k[..., 23:, :], v[..., 23:, :], beta[..., 23:], log_gate[..., 23:, :],
                             chunk_size=16, initial_state=state, return_state=True)
    assert (torch.cat([first, second], dim=-2) - full).abs().max() < FP64
    assert (state.kv - full_state.kv).abs().max() < FP64 and state.num_tokens == 50


def test_masked_tokens_write_nothing_but_decay():
    q, k, v, beta, log_gate = inputs()
    keep = torch.rand(2, 45, generator=torch.Generator().manual_seed(3)) > 0.3
    want, _ = recurrence(q, k, v, beta * keep[:, None, :], log_gate)
    for form in ("chunked", "recurrent"):
        out = kda_call(q, k, v, beta, log_gate, key_padding_mask=keep, form=form, chunk_size=16)
        assert (out - want).abs().max() < FP64


def test_grouped_query_heads_and_gates_per_kv_head():
    q, _, _, beta, _ = inputs(h=4)
    _, k, v, _, log_gate = inputs(h=2, seed=1)
    out = kda_call(q, k, v, beta, log_gate, chunk_size=16)
    repeat = [x.repeat_interleave(2, dim=1) for x in (k, v, log_gate)]
    want, _ = recurrence(q, repeat[0], repeat[1], beta, repeat[2])
    assert (out - want).abs().max() < FP64


def test_packed_sequences_run_one_call_each():
    q, k, v, beta, log_gate = inputs(n=40)
    offsets = torch.tensor([0, 13, 40])
    out, state = kda_call(q, k, v, beta, log_gate, cu_seqlens=offsets, return_state=True, chunk_size=8)
    for index, (start, end) in enumerate([(0, 13), (13, 40)]):
        want, want_state = recurrence(*(x[..., start:end, :] for x in (q, k, v)), beta[..., start:end],
                                      log_gate[..., start:end, :])
        assert (out[..., start:end, :] - want).abs().max() < FP64
        assert (state.kv[index] - want_state).abs().max() < FP64


def test_decoding_steps_equal_the_chunked_form():
    """DeltaDecodeStep with a per-feature gate per token (and a fixed rate per head) after a prompt."""
    q, k, v, beta, log_gate = inputs(n=30)
    rates = torch.tensor([0.9, 0.8, 0.99], dtype=torch.float64)
    full = kda_call(q, k, v, beta, log_gate, decay=rates, chunk_size=8)
    _, state = kda_call(q[..., :20, :], k[..., :20, :], v[..., :20, :], beta[..., :20], log_gate[..., :20, :],
                        decay=rates, chunk_size=8, return_state=True)
    step = DeltaDecodeStep(create("identity", head_dim=8), state, decay=rates)
    for t in range(20, 30):
        out = step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], beta=beta[..., t],
                   log_decay=log_gate[..., t, :])
        assert (out[..., 0, :] - full[..., t, :]).abs().max() < FP64
    assert step.num_tokens == 30


def test_the_layer_runs_kda_streams_and_decodes():
    torch.manual_seed(0)
    layer = LinearAttention(32, 4, causal=True, update="delta", gate="feature", short_conv=4, output_gate=True,
                            feature_map="identity", decay="retnet").double()
    with torch.no_grad():  # gates that differ by feature and token (the initial ones are all ≈ 1)
        layer.gate_up.weight.normal_(0, 0.5)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    full = layer(x)
    first, state = layer(x[:, :13], return_state=True)
    second = layer(x[:, 13:], state=state)
    assert (torch.cat([first, second], dim=1) - full).abs().max() < FP64
    decoder = layer.decoder(state)
    assert isinstance(decoder.step, DeltaDecodeStep)
    stepped = torch.cat([decoder(x[:, t : t + 1]) for t in range(13, 20)], dim=1)
    assert (stepped - full[:, 13:]).abs().max() < FP64
    full.square().sum().backward()
    assert layer.gate_up.weight.grad is not None and layer.gate_up.weight.grad.abs().sum() > 0


def test_transition_is_the_product_and_the_state_from_zero():
    """kda_transition (the context-parallel summary): A = Π_t (I − β_t k_t k_tᵀ)diag(a_t) and B, fp64."""
    g = torch.Generator().manual_seed(2)
    kf = F.normalize(torch.randn(2, 3, 23, 5, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(2, 3, 23, 4, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(2, 3, 23, generator=g, dtype=torch.float64)
    log_gate = -torch.rand(2, 3, 23, 5, generator=g, dtype=torch.float64)
    a, b = kda.kda_transition(kf, v, beta=beta, log_gate=log_gate, chunk_size=4)
    eye = torch.eye(5, dtype=torch.float64)
    product, from_zero = eye.expand(2, 3, 5, 5), torch.zeros(2, 3, 5, 4, dtype=torch.float64)
    for t in range(23):
        k_t = kf[..., t, :, None]
        # the gate acts first: S_t = (I − β_t k_t k_tᵀ)·diag(a_t)·S_{t−1} + β_t k_t v_tᵀ
        step = (eye - beta[..., t, None, None] * k_t @ k_t.mT) * torch.exp(log_gate[..., t, None, :])
        product = step @ product
        from_zero = step @ from_zero + beta[..., t, None, None] * k_t @ v[..., t, None, :]
    assert (a - product).abs().max() < 1e-12 and (b - from_zero).abs().max() < 1e-12
    leaves = [x[:1, :1, :7].clone().requires_grad_() for x in (kf, v, beta, log_gate)]
    assert torch.autograd.gradcheck(
        lambda *x: kda.kda_transition(x[0], x[1], beta=x[2], log_gate=x[3], chunk_size=2), leaves)
    strong = log_gate[:1, :1, :20].clone()
    strong[..., :2] -= 20  # two features by sub-chunks, the others in the product
    leaves = [x[:1, :1, :20].clone().requires_grad_() for x in (kf, v, beta)] + [strong.requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda *x: kda.kda_transition(x[0], x[1], beta=x[2], log_gate=x[3], chunk_size=20), leaves)


def test_training_memory_keeps_no_state_per_token():
    """What autograd keeps for backward: O(N·(F + Dv + C)) and a state per chunk, far below N·F·Dv."""
    n, d, chunk = 512, 64, 64
    q, k, v, beta, log_gate = (x.float().requires_grad_() for x in inputs(b=1, h=1, n=n, d=d, dv=d))
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = kda_call(q, k, v, beta, log_gate, chunk_size=chunk)
    out.sum().backward()
    # q, k, v, the gate, the maps' and the normalisation's tensors, W_k, U, Q⊙e^G, K⊙e^{G_C−G}: at most 14 (N, D)
    # tensors of fp32; P and T (N, C); the N/C states entering the chunks
    bound = 14 * n * d * 4 + 2 * n * chunk * 4 + n * 4 + (n // chunk) * d * (d + 1) * 4
    assert sum(storages.values()) <= bound < n * d * d * 4 / 2


@pytest.mark.parametrize("gate,match", [
    (torch.full((2, 3, 45, 5), -0.1), "per-feature gate with 5 features"),
    (torch.full((2, 3, 45, 8), 0.1), "≤ 0"),
    (torch.full((2, 3, 44, 8), -0.1), "per-feature shape"),
])
def test_bad_gates_say_what_to_do(gate, match):
    q, k, v, beta, _ = inputs()
    with pytest.raises(LinearAttentionError, match=match):
        kda_call(q, k, v, beta, gate.double())


def test_triton_refuses_on_cpu_and_auto_runs_torch(monkeypatch):
    """The KDA kernels (tests/test_triton_kda.py) run on CUDA tensors; on CPU a forced triton says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, beta, log_gate = inputs(n=8)
    with pytest.raises(LinearAttentionError, match="device cpu: the kernels run on CUDA tensors"):
        kda_call(q.float(), k.float(), v.float(), beta.float(), log_gate.float(), backend="triton")
    want, _ = recurrence(q, k, v, beta, log_gate)
    assert (kda_call(q, k, v, beta, log_gate, backend="auto") - want).abs().max() < FP64


def test_context_parallel_takes_per_feature_gates_with_the_delta_rule_only():
    assert context_parallel_reasons(True, update="delta") == []
    assert any("per-feature" in reason for reason in context_parallel_reasons(True, update="add"))


def test_decode_step_refuses_a_gate_of_the_wrong_size():
    _, state = kda_call(*inputs(n=4), return_state=True)
    step = DeltaDecodeStep(create("identity", head_dim=8), state)
    q, k, v, beta, _ = inputs(n=1)
    with pytest.raises(LinearAttentionError, match="one per feature"):
        step(q, k, v, beta=beta[..., 0], log_decay=-torch.rand(2, 3, 5, dtype=torch.float64) * math.e)
