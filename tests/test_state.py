"""The state: decoding token by token, serialisation, device/dtype moves, beam reordering."""

from __future__ import annotations

import io

import torch

import linattn
from linattn import LinearAttentionState
from reference import rel_error


def test_decoding_token_by_token_equals_one_causal_call():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    whole = linattn.linear_attention(q, k, v, causal=True)
    prompt = 25
    out, state = linattn.linear_attention(
        q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], causal=True, return_state=True
    )
    steps = [out]
    for t in range(prompt, 40):
        step, state = linattn.linear_attention(
            q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], causal=True, initial_state=state,
            return_state=True,
        )
        steps.append(step)
    assert state.num_tokens == 40
    assert rel_error(torch.cat(steps, dim=-2), whole) <= 1e-12


def test_token_by_token_recurrent_steps_equal_one_recurrent_call_bit_for_bit():
    """Where bit-identity honestly holds, it is asserted. relu features are exact (no rounding, so no kernel can
    change them), and the recurrent form does the same per-token operations, on tensors of the same shapes, whether
    the tokens come in one call or one call each: S += k⊗v (correctly rounded products and sums), then (1, F) @ (F, Dv)
    products of identical shapes. The calls differ in length (20 tokens against 1 each), the operations do not: only
    the strides of the per-token views differ (also identical at F = 64 and 128, and under the other-kernels
    settings). The chunked forms or projection maps would not qualify: there the call's length changes GEMM shapes
    (tests/reference.py, SHAPE_ULPS)."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=generator) for _ in range(3))
    whole = linattn.linear_attention(q, k, v, causal=True, feature_map="relu", form="recurrent")
    state, steps = None, []
    for t in range(20):
        step, state = linattn.linear_attention(
            q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], causal=True, feature_map="relu",
            form="recurrent", initial_state=state, return_state=True,
        )
        steps.append(step)
    assert torch.equal(torch.cat(steps, dim=-2), whole)


def test_state_is_fixed_size_and_serialisable():
    q = k = v = torch.randn(1, 2, 300, 8)
    _, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
    assert state.kv.shape == (1, 2, 8, 8) and state.k_sum.shape == (1, 2, 8) and state.shift.shape == (1, 2)
    buffer = io.BytesIO()
    torch.save(state.__dict__, buffer)
    buffer.seek(0)
    restored = LinearAttentionState(**torch.load(buffer))
    more = torch.randn(1, 2, 5, 8)
    a = linattn.linear_attention(more, more, more, causal=True, initial_state=state)
    b = linattn.linear_attention(more, more, more, causal=True, initial_state=restored)
    assert torch.equal(a, b)  # bit for bit: the restored tensors are the same values in the same shapes


def test_state_to_and_detach():
    q = torch.randn(2, 6, 4, requires_grad=True)
    _, state = linattn.linear_attention(q, q, q, causal=True, return_state=True)
    assert state.kv.requires_grad
    detached = state.detach()
    assert not detached.kv.requires_grad and not detached.k_sum.requires_grad
    doubled = state.to(dtype=torch.float64)
    assert doubled.kv.dtype == torch.float64 and doubled.num_tokens == state.num_tokens
    assert doubled.feature_dim == 4 and doubled.value_dim == 4


def test_index_select_reorders_beams():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 10, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    _, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
    order = torch.tensor([2, 0, 1])
    reordered = state.index_select(0, order)
    nxt = torch.randn(3, 1, 4, generator=generator, dtype=torch.float64)
    out = linattn.linear_attention(nxt, nxt, nxt, causal=True, initial_state=reordered)
    _, state_perm = linattn.linear_attention(q[order], k[order], v[order], causal=True, return_state=True)
    expected = linattn.linear_attention(nxt, nxt, nxt, causal=True, initial_state=state_perm)
    assert rel_error(out, expected) <= 1e-12


def test_empty_state_equals_no_state():
    q, k, v = (torch.randn(2, 9, 4, dtype=torch.float64) for _ in range(3))
    empty = LinearAttentionState.zeros((2,), 4, 4, dtype=torch.float64)
    for causal, form in [(True, "chunked"), (True, "recurrent"), (False, "global"), (False, "chunked")]:
        a = linattn.linear_attention(q, k, v, causal=causal, form=form, initial_state=empty, chunk_size=4)
        b = linattn.linear_attention(q, k, v, causal=causal, form=form, chunk_size=4)
        assert rel_error(a, b) <= 1e-14
