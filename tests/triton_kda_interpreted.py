"""KDA's Triton kernels (the delta rule with a per-feature gate) in Triton's interpreter on CPU tensors, against a
float64 token-by-token recurrence written here, the torch backend's KDA form and fla's naive recurrence when
installed.

Not collected by the main run: tests/test_triton_kda.py runs this file in its own pytest process with
TRITON_INTERPRET=1 (as tests/test_triton_delta.py runs triton_delta_interpreted.py). The interpreter has no bf16:
fp32 and fp16. Sizes are tiny (40–70 tokens in chunks of 16: several chunks and a padded tail).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kda.py (sets TRITON_INTERPRET=1)"

import linattn  # noqa: E402
from linattn.backends import RECURRENT_MAX_TOKENS  # noqa: E402
from reference import rel_error  # noqa: E402

# fp32: the interpreter multiplies in fp32; measured ≤ 4.1e-7 on every output, state and gradient, strong gates
# included (the chunk's triangular inverse, the gate factors from fp32 cumulative sums over 16 tokens and ~70 state
# updates, a few ulps each): 2e-6 / 1e-5 leave a margin of ≥ 5× / 25×, the delta rule kernels' tolerances.
# fp16: the unit features and v are rounded to fp16 (2^-11 relative) for the kernels and the output once more:
# measured ≤ 4.1e-4; 2e-3 (about four fp16 roundings).
TOL = {torch.float32: 2e-6, torch.float16: 2e-3}
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def kda_reference(q, k, v, beta, log_gate, kv0):  # type: ignore[no-untyped-def]
    """S_t = diag(e^{g_t})S_{t−1} + β_t k̂_t(v_t − (diag(e^{g_t})S_{t−1})ᵀk̂_t)ᵀ, o_t = S_tᵀq̂_t, token by token in the
    inputs' dtype (identity features, L2-normalised)."""
    qf, kf = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    state = kv0
    outs = []
    for t in range(q.shape[-2]):
        state = torch.exp(log_gate[..., t, :])[..., :, None] * state
        key = kf[..., t, :]
        write = beta[..., t, None] * (v[..., t, :] - torch.einsum("...f,...fd->...d", key, state))
        state = state + key[..., :, None] * write[..., None, :]
        outs.append(torch.einsum("...f,...fd->...d", qf[..., t, :], state))
    return torch.stack(outs, dim=-2), state


def _inputs(n: int, dtype: torch.dtype, seed: int, features: int = 8, values: int = 12, strong: int = 0
            ) -> dict[str, torch.Tensor]:
    """``strong`` features gated at g ≈ −20 (one at −80: its factors underflow within a token or two)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, 2, n)
    log_gate = -torch.rand(*shape, features, generator=generator) * 0.5
    log_gate[..., :strong] -= 20.0
    if strong:
        log_gate[..., 0] -= 60.0
    return {
        "q": torch.randn(*shape, features, generator=generator).to(dtype),
        "k": torch.randn(*shape, features, generator=generator).to(dtype),
        "v": torch.randn(*shape, values, generator=generator).to(dtype),
        "beta": torch.rand(*shape, generator=generator) * 2,  # the whole range [0, 2]
        "log_gate": log_gate,
        "kv0": torch.randn(1, 2, features, values, generator=generator) * 0.5,
    }


def _call(data: dict[str, torch.Tensor], backend: str, initial: bool, **options: object
          ) -> tuple[torch.Tensor, linattn.DeltaRuleState]:
    state = linattn.DeltaRuleState(data["kv0"], 3) if initial else None
    return linattn.linear_attention(  # type: ignore[no-any-return]
        data["q"], data["k"], data["v"], causal=True, update="delta", beta=data["beta"], log_gate=data["log_gate"],
        initial_state=state, feature_map="identity", backend=backend, return_state=True, **options,
    )


CASES = [  # (N, initial state, dtype, F, Dv, strong features): N = 40 and 70 (3 and 5 chunks of 16, padded tails)
    (40, False, torch.float32, 8, 12, 0),
    (70, True, torch.float32, 8, 12, 0),
    (70, True, torch.float32, 20, 12, 0),  # F = 20: two feature blocks of the local kernel, padded to 32
    (40, True, torch.float32, 8, 72, 0),  # two value blocks of 64 per row
    (70, True, torch.float32, 20, 12, 6),  # strong gates on 6 of 20 features
    (70, True, torch.float16, 8, 12, 0),
]


@pytest.mark.parametrize(
    "n,initial,dtype,features,values,strong", CASES,
    ids=[f"N{n}-{'state' if s else 'nostate'}-{str(t)[6:]}-F{f}-Dv{v}{'-strong' if g else ''}"
         for n, s, t, f, v, g in CASES],
)
def test_chunk_kernels_match_the_recurrence(n: int, initial: bool, dtype: torch.dtype, features: int, values: int,
                                            strong: int) -> None:
    """Output, final state and ∂L/∂(q, k, v, β, log_gate, initial state) of backend='triton' against the float64
    recurrence and the torch backend's chunked KDA form in float64, with a loss on both the output and the final
    state; nothing is NaN or inf with strong gates."""
    data = _inputs(n, dtype, seed=n + 100 * initial + features + values + strong, features=features, values=values,
                   strong=strong)
    leaves = {name: x.clone().requires_grad_() for name, x in data.items()}
    out, final = _call(leaves, "triton", initial)
    assert out.dtype == dtype and final.kv.dtype == torch.float32 and final.num_tokens == n + 3 * initial
    doubles = {name: x.detach().double().requires_grad_() for name, x in data.items()}
    kv0 = doubles["kv0"] if initial else torch.zeros_like(doubles["kv0"])
    expected, expected_final = kda_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"],
                                             doubles["log_gate"], kv0)
    form, form_final = _call(doubles, "torch", initial)
    assert rel_error(out, expected) < TOL[dtype]
    assert rel_error(final.kv, expected_final) < TOL[dtype]
    assert rel_error(form, expected) < 1e-12  # the torch form, the reference beside the kernels

    generator = torch.Generator().manual_seed(1)
    d_out, d_final = torch.randn(out.shape, generator=generator), torch.randn(final.kv.shape, generator=generator)
    wanted = [name for name in leaves if initial or name != "kv0"]
    grads = torch.autograd.grad([out, final.kv], [leaves[name] for name in wanted], [d_out.to(dtype), d_final])
    upstream = [d_out.to(dtype).double(), d_final.double()]
    expected_grads = torch.autograd.grad([expected, expected_final], [doubles[name] for name in wanted], upstream,
                                         retain_graph=True)
    form_grads = torch.autograd.grad([form, form_final.kv], [doubles[name] for name in wanted], upstream)
    for name, grad, reference, torch_form in zip(wanted, grads, expected_grads, form_grads, strict=True):
        assert grad.dtype == leaves[name].dtype, name
        assert bool(torch.isfinite(grad).all()), name
        assert rel_error(grad, reference) < GRAD_TOL[dtype], (name, rel_error(grad, reference))
        assert rel_error(torch_form, reference) < 1e-10, name


def test_spiky_gates() -> None:
    """Gates near 0 with spikes of −8 on 15 % of the tokens and features: cumulative log-gates reach about −40 within
    a chunk, where the kernels' fp32 sums carry |G|·2^-24 ≈ 2.4e-6 into a factor (the torch form sums in fp64):
    measured ≤ 6.4e-7 on the output and state and ≤ 6.6e-7 on the gradients; 5e-6 for both."""
    data = _inputs(70, torch.float32, seed=3, features=16, values=16)
    spikes = torch.rand(1, 2, 70, 16, generator=torch.Generator().manual_seed(4)) < 0.15
    data["log_gate"] = data["log_gate"] * 0.05 - 8.0 * spikes
    leaves = {name: x.clone().requires_grad_() for name, x in data.items()}
    out, final = _call(leaves, "triton", True)
    doubles = {name: x.detach().double().requires_grad_() for name, x in data.items()}
    expected, expected_final = kda_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"],
                                             doubles["log_gate"], doubles["kv0"])
    assert rel_error(out, expected) < 5e-6 and rel_error(final.kv, expected_final) < 5e-6
    generator = torch.Generator().manual_seed(5)
    upstream = [torch.randn(out.shape, generator=generator), torch.randn(final.kv.shape, generator=generator)]
    grads = torch.autograd.grad([out, final.kv], list(leaves.values()), upstream)
    expected_grads = torch.autograd.grad([expected, expected_final], list(doubles.values()),
                                         [x.double() for x in upstream])
    for name, grad, reference in zip(leaves, grads, expected_grads, strict=True):
        assert rel_error(grad, reference) < 5e-6, (name, rel_error(grad, reference))


def test_against_fla_naive_recurrence() -> None:
    """fla's naive KDA recurrence (fp32, layout (B, T, H, K), no normalisation of its own: scale 1 and unit
    features given, made from the same leaves) agrees with the kernels in fp32, output, final state and every
    gradient (through autograd of its loop): 2e-5 (two fp32 computations in different orders, a few ulps per token
    over 70 tokens; measured ≤ 3.6e-7)."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    data = _inputs(70, torch.float32, seed=11, features=16, values=16, strong=2)
    mine = {name: x.clone().requires_grad_() for name, x in data.items()}
    theirs_in = {name: x.clone().requires_grad_() for name, x in data.items()}
    out, final = _call(mine, "triton", True)
    qn, kn = F.normalize(theirs_in["q"], dim=-1), F.normalize(theirs_in["k"], dim=-1)
    theirs, their_state = naive.naive_recurrent_kda(
        *(x.transpose(1, 2) for x in (qn, kn, theirs_in["v"], theirs_in["log_gate"])),
        theirs_in["beta"].transpose(1, 2), scale=1.0, initial_state=theirs_in["kv0"], output_final_state=True)
    theirs = theirs.transpose(1, 2)
    assert rel_error(out, theirs) < 2e-5
    assert rel_error(final.kv, their_state) < 2e-5
    generator = torch.Generator().manual_seed(2)
    upstream = [torch.randn(out.shape, generator=generator), torch.randn(final.kv.shape, generator=generator)]
    grads = torch.autograd.grad([out, final.kv], list(mine.values()), upstream)
    their_grads = torch.autograd.grad([theirs, their_state], list(theirs_in.values()), upstream)
    for name, grad, reference in zip(mine, grads, their_grads, strict=True):
        assert rel_error(grad, reference) < 2e-5, (name, rel_error(grad, reference))


def test_continuation_with_gradients() -> None:
    """Two chunked calls, the second continuing the first's state (split at 23 tokens, inside a chunk), equal one
    call over all 61 tokens: outputs, final state and gradients flowing back across the state."""
    data = _inputs(61, torch.float32, seed=13, strong=1)
    whole = {name: x.clone().requires_grad_() for name, x in data.items()}
    split = {name: x.clone().requires_grad_() for name, x in data.items()}
    out, final = _call(whole, "triton", True)
    first, second = ({name: x[..., part, :] if name in ("q", "k", "v", "log_gate") else x[..., part]
                      for name, x in split.items() if name != "kv0"} for part in (slice(0, 23), slice(23, 61)))
    options = {"causal": True, "update": "delta", "feature_map": "identity", "backend": "triton",
               "return_state": True}
    out_1, state = linattn.linear_attention(first["q"], first["k"], first["v"], beta=first["beta"],
                                            log_gate=first["log_gate"],
                                            initial_state=linattn.DeltaRuleState(split["kv0"], 3), **options)
    out_2, state = linattn.linear_attention(second["q"], second["k"], second["v"], beta=second["beta"],
                                            log_gate=second["log_gate"], initial_state=state, **options)
    assert state.num_tokens == 64
    pieces = torch.cat([out_1, out_2], dim=-2)
    assert rel_error(pieces, out) < TOL[torch.float32]
    assert rel_error(state.kv, final.kv) < TOL[torch.float32]
    generator = torch.Generator().manual_seed(3)
    upstream = [torch.randn(out.shape, generator=generator), torch.randn(final.kv.shape, generator=generator)]
    grads = torch.autograd.grad([out, final.kv], list(whole.values()), upstream)
    split_grads = torch.autograd.grad([pieces, state.kv], list(split.values()), upstream)
    for name, grad, reference in zip(whole, split_grads, grads, strict=True):
        assert rel_error(grad, reference) < GRAD_TOL[torch.float32], (name, rel_error(grad, reference))


def test_decay_and_padding_mask_compose() -> None:
    """A per-token decay adds to every feature's gate; a masked token writes nothing (β = 0) while its gate still
    applies; on the chunk kernels."""
    data = _inputs(40, torch.float32, seed=5)
    keep = torch.rand(1, 40, generator=torch.Generator().manual_seed(6)) > 0.3
    out = linattn.linear_attention(data["q"], data["k"], data["v"], causal=True, update="delta", beta=data["beta"],
                                   log_gate=data["log_gate"], decay=0.9, key_padding_mask=keep,
                                   feature_map="identity", backend="triton")
    doubles = {name: x.double() for name, x in data.items()}
    gate = doubles["log_gate"] + torch.log(torch.tensor(0.9, dtype=torch.float64))
    expected, _ = kda_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"] * keep[:, None, :], gate,
                                torch.zeros_like(doubles["kv0"]))
    assert rel_error(out, expected) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decoding_steps_match_the_recurrence(dtype: torch.dtype) -> None:
    """Without autograd, calls of ≤ 16 tokens take the step kernel (per-feature gates, L2 normalisation in the
    kernel): a prompt on the chunk kernels, then 1-, 1- and 5-token steps continuing the state, equal the
    recurrence over the whole sequence, with strong gates on two features."""
    data = _inputs(45, dtype, seed=7, strong=2)
    pieces, state = [], None
    with torch.no_grad():
        for start, end in ((0, 38), (38, 39), (39, 40), (40, 45)):
            piece = {name: x[..., start:end, :] if name in ("q", "k", "v", "log_gate") else x[..., start:end]
                     for name, x in data.items() if name != "kv0"}
            out, state = linattn.linear_attention(
                piece["q"], piece["k"], piece["v"], causal=True, update="delta", beta=piece["beta"],
                log_gate=piece["log_gate"], feature_map="identity", backend="triton", initial_state=state,
                return_state=True,
            )
            pieces.append(out)
    assert 5 <= RECURRENT_MAX_TOKENS < 38
    assert state is not None and state.num_tokens == 45
    doubles = {name: x.double() for name, x in data.items()}
    expected, expected_final = kda_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"],
                                             doubles["log_gate"], torch.zeros_like(doubles["kv0"]))
    assert rel_error(torch.cat(pieces, dim=-2), expected) < TOL[dtype]
    assert rel_error(state.kv, expected_final) < TOL[dtype]


def test_step_kernel_updates_the_state_in_place() -> None:
    """delta_step with per-feature gates and the output state the input state: one token against a state in place,
    from features that are not normalised (the kernel normalises them; an all-zero key writes nothing, the gate
    alone scales each row of the state)."""
    from linattn.kinds.delta.triton.function import delta_step

    data = _inputs(2, torch.float32, seed=8, features=20, values=40)  # F, Dv not powers of two; Dv > one block
    q, k, v = (data[name][..., :1, :].contiguous() for name in ("q", "k", "v"))
    k[0, 1] = 0.0  # row 1: a zero key
    beta, gate = data["beta"][..., :1].contiguous(), data["log_gate"][..., :1, :].contiguous()
    kv = data["kv0"].clone()
    storage = kv.data_ptr()
    out = torch.empty(1, 2, 1, 40)
    delta_step(q, k, v, beta, gate, kv, out, kv)
    assert kv.data_ptr() == storage
    doubles = {name: x.double() for name, x in data.items()}
    keys = doubles["k"][..., :1, :].clone()
    keys[0, 1] = 0.0
    expected, expected_kv = kda_reference(doubles["q"][..., :1, :], keys, doubles["v"][..., :1, :],
                                          doubles["beta"][..., :1], doubles["log_gate"][..., :1, :], doubles["kv0"])
    assert rel_error(out, expected) < TOL[torch.float32]
    assert rel_error(kv, expected_kv) < TOL[torch.float32]
    decayed = doubles["kv0"][0, 1] * torch.exp(doubles["log_gate"][0, 1, 0])[:, None]  # no write: the gate alone
    assert rel_error(kv[0, 1], decayed) < TOL[torch.float32]


def test_plain_2d_and_grouped_heads() -> None:
    """(N, D) inputs with (N, F) gates (one row); grouped-query heads with β and the gates given per k/v head
    (repeated to the query heads before the kernels)."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(30, 8, generator=generator) for _ in range(3))
    beta, gate = torch.rand(30, generator=generator), -torch.rand(30, 8, generator=generator)
    out, state = linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, log_gate=gate,
                                          feature_map="identity", backend="triton", return_state=True)
    expected, expected_kv = kda_reference(q.double(), k.double(), v.double(), beta.double(), gate.double(),
                                          torch.zeros(8, 8, dtype=torch.float64))
    assert state.kv.shape == (8, 8) and rel_error(out, expected) < TOL[torch.float32]
    assert rel_error(state.kv, expected_kv) < TOL[torch.float32]

    q = torch.randn(1, 4, 20, 8, generator=generator)
    k, v = (torch.randn(1, 2, 20, 8, generator=generator) for _ in range(2))
    beta, gate = torch.rand(1, 2, 20, generator=generator), -torch.rand(1, 2, 20, 8, generator=generator)
    out = linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, log_gate=gate,
                                   feature_map="identity", backend="triton")
    repeat = [x.repeat_interleave(2, dim=1).double() for x in (k, v, beta, gate)]
    expected, _ = kda_reference(q.double(), *repeat, torch.zeros(1, 4, 8, 8, dtype=torch.float64))
    assert rel_error(out, expected) < TOL[torch.float32]
