"""Property tests: random shapes, chunk sizes, masks and options; every form equals the float64 definition."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from reference import elu_plus_one, reference_attention, rel_error


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(1, 40),
    dk=st.integers(1, 9),
    dv=st.integers(1, 9),
    chunk=st.integers(1, 48),
    causal=st.booleans(),
    use_mask=st.booleans(),
    eps=st.sampled_from([0.0, 1e-6, 1e-2]),
    seed=st.integers(0, 2**16),
)
def test_all_forms_equal_definition(batch, n, dk, dv, chunk, causal, use_mask, eps, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, n, dk, generator=generator, dtype=torch.float64)
    k = torch.randn(*batch, n, dk, generator=generator, dtype=torch.float64)
    v = torch.randn(*batch, n, dv, generator=generator, dtype=torch.float64)
    keep = torch.rand(*batch, n, generator=generator) > 0.25 if use_mask else None
    expected = reference_attention(q, k, v, elu_plus_one, causal=causal, keep=keep, eps=eps)
    forms = ["parallel", "chunked", "recurrent"] if causal else ["parallel", "global", "chunked"]
    for form in forms:
        out = linattn.linear_attention(
            q, k, v, causal=causal, form=form, chunk_size=chunk, key_padding_mask=keep, eps=eps
        )
        assert out.shape == expected.shape
        assert torch.isfinite(out).all()
        assert rel_error(out, expected) <= 1e-10 or float((out - expected).abs().max()) <= 1e-12


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 50), cut=st.integers(1, 49), chunk=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_state_split_anywhere(n, cut, chunk, seed):
    cut = min(cut, n - 1)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, 3, generator=generator, dtype=torch.float64) for _ in range(3))
    first, state = linattn.linear_attention(
        q[:, :cut], k[:, :cut], v[:, :cut], causal=True, chunk_size=chunk, return_state=True
    )
    second = linattn.linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], causal=True, chunk_size=chunk,
                                      initial_state=state)
    whole = reference_attention(q, k, v, elu_plus_one, causal=True)
    assert rel_error(torch.cat([first, second], dim=1), whole) <= 1e-10
