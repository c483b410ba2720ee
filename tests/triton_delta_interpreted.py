"""The delta rule's Triton kernels in Triton's interpreter on CPU tensors, against a float64 token-by-token recurrence.

Not collected by the main run: tests/test_triton_delta.py runs this file in its own pytest process with
TRITON_INTERPRET=1 (as tests/test_triton.py runs triton_interpreted.py). The interpreter has no bf16: fp32 and fp16.
Sizes are tiny (40–70 tokens, chunks of 16: several chunks and a padded tail) because the interpreter is slow.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_delta.py (sets TRITON_INTERPRET=1)"

import linattn  # noqa: E402
from linattn.backends import RECURRENT_MAX_TOKENS  # noqa: E402
from reference import rel_error  # noqa: E402

# fp32: the interpreter multiplies in fp32; measured ≤ 3e-7 on outputs and states, ≤ 8e-7 on gradients (the
# chunk's triangular inverse and ~70 state updates, a few ulps each): 2e-6 / 1e-5 leave a margin of ≥ 10×.
# fp16: the unit features and v are rounded to fp16 (2^-11 relative) for the kernels and the output once more:
# measured ≤ 4e-4 on outputs and gradients; 2e-3 (about four fp16 roundings).
TOL = {torch.float32: 2e-6, torch.float16: 2e-3}
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
MAPS = {"identity": lambda x: x, "elu": lambda x: F.elu(x) + 1}


def delta_reference(q, k, v, beta, log_decay, kv0, phi):  # type: ignore[no-untyped-def]
    """S_t = a_t·S_{t−1} + β_t·k̂_t(v_t − a_t·S_{t−1}ᵀk̂_t)ᵀ, o_t = S_tᵀq̂_t, token by token in the inputs' dtype."""
    qf, kf = F.normalize(phi(q), dim=-1), F.normalize(phi(k), dim=-1)
    state = kv0
    outs = []
    for t in range(q.shape[-2]):
        if log_decay is not None:
            state = state * torch.exp(log_decay[..., t])[..., None, None]
        key = kf[..., t, :]
        write = beta[..., t, None] * (v[..., t, :] - torch.einsum("...f,...fd->...d", key, state))
        state = state + key[..., :, None] * write[..., None, :]
        outs.append(torch.einsum("...f,...fd->...d", qf[..., t, :], state))
    return torch.stack(outs, dim=-2), state


def _inputs(n: int, dtype: torch.dtype, seed: int, features: int = 8, values: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, 2, n)
    return {
        "q": torch.randn(*shape, features, generator=generator).to(dtype),
        "k": torch.randn(*shape, features, generator=generator).to(dtype),
        "v": torch.randn(*shape, values, generator=generator).to(dtype),
        "beta": torch.rand(*shape, generator=generator) * 2,  # the whole range [0, 2]
        "log_gate": -torch.rand(*shape, generator=generator) * 0.5,
        "kv0": torch.randn(1, 2, features, values, generator=generator) * 0.5,
    }


CASES = [  # (N, decay, initial state, map, dtype, Dv): N = 40 and 70 with chunks of 16 (3 and 5 chunks, padded tails)
    (40, False, False, "identity", torch.float32, 12),
    (70, True, False, "identity", torch.float32, 12),
    (40, False, True, "elu", torch.float32, 12),
    (70, True, True, "elu", torch.float32, 12),
    (70, True, True, "identity", torch.float16, 12),
    (40, True, True, "identity", torch.float32, 72),  # two value blocks of 64 per row
]


@pytest.mark.parametrize(
    "n,decay,initial,map_name,dtype,values", CASES,
    ids=[f"N{n}-{'decay' if d else 'nodecay'}-{'state' if s else 'nostate'}-{m}-{str(t)[6:]}-Dv{v}"
         for n, d, s, m, t, v in CASES],
)
def test_chunk_kernels_match_the_recurrence(n: int, decay: bool, initial: bool, map_name: str,
                                            dtype: torch.dtype, values: int) -> None:
    """Output, final state and ∂L/∂(q, k, v, β, log_gate, initial state) of backend='triton' (chunk 16) against
    the float64 recurrence, with a loss on both the output and the final state."""
    data = _inputs(n, dtype, seed=n + 10 * decay + 100 * initial, values=values)
    leaves = {name: x.clone().requires_grad_() for name, x in data.items()}
    state = linattn.DeltaRuleState(leaves["kv0"], 3) if initial else None
    out, final = linattn.linear_attention(
        leaves["q"], leaves["k"], leaves["v"], causal=True, update="delta", beta=leaves["beta"],
        log_gate=leaves["log_gate"] if decay else None, initial_state=state, feature_map=map_name,
        chunk_size=16, backend="triton", return_state=True,
    )
    assert out.dtype == dtype and final.kv.dtype == torch.float32 and final.num_tokens == n + 3 * initial
    doubles = {name: x.detach().double().requires_grad_() for name, x in data.items()}
    kv0 = doubles["kv0"] if initial else torch.zeros_like(doubles["kv0"])
    expected, expected_final = delta_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"],
                                               doubles["log_gate"] if decay else None, kv0, MAPS[map_name])
    assert rel_error(out, expected) < TOL[dtype]
    assert rel_error(final.kv, expected_final) < TOL[dtype]

    generator = torch.Generator().manual_seed(1)
    d_out, d_final = torch.randn(out.shape, generator=generator), torch.randn(final.kv.shape, generator=generator)
    wanted = [name for name in leaves if (decay or name != "log_gate") and (initial or name != "kv0")]
    grads = torch.autograd.grad([out, final.kv], [leaves[name] for name in wanted], [d_out.to(dtype), d_final])
    expected_grads = torch.autograd.grad([expected, expected_final], [doubles[name] for name in wanted],
                                         [d_out.to(dtype).double(), d_final.double()])
    for name, grad, reference in zip(wanted, grads, expected_grads, strict=True):
        assert grad.dtype == leaves[name].dtype, name
        assert rel_error(grad, reference) < GRAD_TOL[dtype], (name, rel_error(grad, reference))


def test_padding_mask_writes_nothing() -> None:
    """A masked token writes nothing (β = 0) while the decay still applies, on the chunk kernels."""
    data = _inputs(40, torch.float32, seed=5)
    keep = torch.rand(1, 40, generator=torch.Generator().manual_seed(6)) > 0.3
    out = linattn.linear_attention(data["q"], data["k"], data["v"], causal=True, update="delta", beta=data["beta"],
                                   log_gate=data["log_gate"], key_padding_mask=keep, feature_map="identity",
                                   chunk_size=16, backend="triton")
    doubles = {name: x.double() for name, x in data.items()}
    beta = doubles["beta"] * keep[:, None, :]
    expected, _ = delta_reference(doubles["q"], doubles["k"], doubles["v"], beta, doubles["log_gate"],
                                  torch.zeros_like(doubles["kv0"]), MAPS["identity"])
    assert rel_error(out, expected) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decoding_steps_match_the_recurrence(dtype: torch.dtype) -> None:
    """Without autograd, calls of ≤ 16 tokens take the step kernel (L2 normalisation in the kernel): a prompt
    on the chunk kernels, then 1-, 1- and 5-token steps continuing the state, equal the recurrence over the whole
    sequence, with a decay."""
    data = _inputs(45, dtype, seed=7)
    pieces, state = [], None
    with torch.no_grad():
        for start, end in ((0, 38), (38, 39), (39, 40), (40, 45)):
            out, state = linattn.linear_attention(
                data["q"][..., start:end, :], data["k"][..., start:end, :], data["v"][..., start:end, :],
                causal=True, update="delta", beta=data["beta"][..., start:end],
                log_gate=data["log_gate"][..., start:end], feature_map="elu", chunk_size=16, backend="triton",
                initial_state=state, return_state=True,
            )
            pieces.append(out)
    assert 5 <= RECURRENT_MAX_TOKENS < 38
    assert state is not None and state.num_tokens == 45
    doubles = {name: x.double() for name, x in data.items()}
    expected, expected_final = delta_reference(doubles["q"], doubles["k"], doubles["v"], doubles["beta"],
                                               doubles["log_gate"], torch.zeros_like(doubles["kv0"]), MAPS["elu"])
    assert rel_error(torch.cat(pieces, dim=-2), expected) < TOL[dtype]
    assert rel_error(state.kv, expected_final) < TOL[dtype]


def test_step_kernel_updates_the_state_in_place() -> None:
    """delta_step with the output state the input state: one token against a DeltaRuleState in place, from
    features that are not normalised (the kernel normalises them; an all-zero key writes nothing)."""
    from linattn.kinds.delta.triton.function import delta_step

    data = _inputs(2, torch.float32, seed=8, features=20, values=40)  # F, Dv not powers of two; Dv > one block
    q, k, v = (data[name][..., :1, :].contiguous() for name in ("q", "k", "v"))
    k[0, 1] = 0.0  # row 1: a zero key
    beta, gate = data["beta"][..., :1].contiguous(), data["log_gate"][..., :1].contiguous()
    kv = data["kv0"].clone()
    storage = kv.data_ptr()
    out = torch.empty(1, 2, 1, 40)
    delta_step(q, k, v, beta, gate, kv, out, kv)
    assert kv.data_ptr() == storage
    doubles = {name: x.double() for name, x in data.items()}
    keys = doubles["k"][..., :1, :].clone()
    keys[0, 1] = 0.0
    expected, expected_kv = delta_reference(doubles["q"][..., :1, :], keys, doubles["v"][..., :1, :],
                                            doubles["beta"][..., :1], doubles["log_gate"][..., :1], doubles["kv0"],
                                            MAPS["identity"])
    assert rel_error(out, expected) < TOL[torch.float32]
    assert rel_error(kv, expected_kv) < TOL[torch.float32]
    decayed = doubles["kv0"][0, 1] * torch.exp(doubles["log_gate"][0, 1, 0])  # no write: the decay alone
    assert rel_error(kv[0, 1], decayed) < TOL[torch.float32]


def test_plain_2d_grouped_heads_and_one_token() -> None:
    """(N, D) inputs (one row); grouped-query heads with β given per k/v head (repeated to the query heads before
    the kernels); one token with a gradient (the chunk kernels on a chunk of 16, 15 tokens of padding)."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(30, 8, generator=generator) for _ in range(3))
    beta = torch.rand(30, generator=generator)
    out, state = linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, feature_map="identity",
                                          backend="triton", return_state=True)
    expected, expected_kv = delta_reference(q.double(), k.double(), v.double(), beta.double(), None,
                                            torch.zeros(8, 8, dtype=torch.float64), MAPS["identity"])
    assert state.kv.shape == (8, 8) and rel_error(out, expected) < TOL[torch.float32]
    assert rel_error(state.kv, expected_kv) < TOL[torch.float32]

    q = torch.randn(1, 4, 20, 8, generator=generator)
    k, v = (torch.randn(1, 2, 20, 8, generator=generator) for _ in range(2))
    beta = torch.rand(1, 2, 20, generator=generator)  # per k/v head
    out = linattn.linear_attention(q, k, v, causal=True, update="delta", beta=beta, feature_map="identity",
                                   chunk_size=16, backend="triton")
    repeat = [x.repeat_interleave(2, dim=1).double() for x in (k, v, beta)]
    expected, _ = delta_reference(q.double(), repeat[0], repeat[1], repeat[2], None,
                                  torch.zeros(1, 4, 8, 8, dtype=torch.float64), MAPS["identity"])
    assert rel_error(out, expected) < TOL[torch.float32]

    leaves = [x[..., :1, :].clone().requires_grad_() for x in (q, q.flip(-1), q * 0.5 + 1)]
    out = linattn.linear_attention(*leaves, causal=True, update="delta", feature_map="identity", backend="triton")
    grads = torch.autograd.grad(out.sum(), leaves)
    doubles = [x.detach().double().requires_grad_() for x in leaves]
    expected, _ = delta_reference(*doubles, torch.ones(1, 4, 1, dtype=torch.float64), None,
                                  torch.zeros(1, 4, 8, 8, dtype=torch.float64), MAPS["identity"])
    for grad, reference in zip(grads, torch.autograd.grad(expected.sum(), doubles), strict=True):
        assert rel_error(grad, reference) < GRAD_TOL[torch.float32]
