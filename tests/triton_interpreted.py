"""The Triton kernels run in Triton's interpreter on CPU tensors, against the float64 reference.

Not collected by the main run: tests/test_triton.py runs this file in its own pytest process with TRITON_INTERPRET=1
(the switch is read when a kernel is decorated, so it must be set before linattn's kernels are imported, and it must
not reach the other tests). The interpreter has no bf16: fp32 and fp16 here, bf16 on a GPU (tests/test_triton_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton.py (sets TRITON_INTERPRET=1)"

import linattn  # noqa: E402
from linattn import LinearAttentionError  # noqa: E402
from linattn.backends import RECURRENT_MAX_TOKENS  # noqa: E402
from reference import elu_plus_one, reference_attention, rel_error  # noqa: E402

# fp32: products are TF32×3 on a GPU and fp32 in the interpreter; the state sums over ≤ 200 tokens lose a few ulps.
# fp16: q, k, v and the features are rounded to fp16 (2^-11 relative) before the products: ~1e-3 relative error.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
GRAD_TOL = {torch.float32: 5e-5, torch.float16: 1e-2}


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _inputs(shape: tuple[int, ...], values: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=generator)
    k = torch.randn(*shape, generator=generator)
    v = torch.randn(*shape[:-1], values, generator=generator)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, upstream))


def _reference_grads(inputs: list[torch.Tensor], seed: int, out_shape: torch.Size, **options: object) -> list:
    doubles = [x.detach().double().requires_grad_() for x in inputs]
    expected = reference_attention(*doubles, causal=True, **options)  # type: ignore[arg-type]
    upstream = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed)).to(inputs[0].dtype).double()
    return [expected, *torch.autograd.grad(expected, doubles, upstream)]


CASES = [
    ((1, 2, 150, 24), 40, torch.float32),
    ((1, 2, 150, 24), 40, torch.float16),
    ((2, 1, 70, 72), 20, torch.float16),  # the 128 size class (fp32 is covered up to 64)
    ((1, 1, 1, 8), 8, torch.float32),
    ((1, 1, 1, 8), 8, torch.float16),
]


@pytest.mark.parametrize(
    "shape,values,dtype", CASES, ids=[f"N{s[-2]}-F{s[-1]}-Dv{v}-{str(d)[6:]}" for s, v, d in CASES]
)
def test_forward_and_gradients_match_reference(shape: tuple[int, ...], values: int, dtype: torch.dtype) -> None:
    """N not a multiple of 64, F ≠ Dv, two size classes (64, 128), elu features; output and ∂L/∂(q, k, v)."""
    inputs = _inputs(shape, values, dtype, seed=0)
    out = linattn.linear_attention(*inputs, causal=True, backend="triton")
    assert out.dtype == dtype
    grads = _grads(out, inputs, seed=1)
    expected, *expected_grads = _reference_grads(inputs, 1, out.shape, phi=elu_plus_one)
    assert rel_error(out, expected) < TOL[dtype]
    for name, grad, reference in zip("qkv", grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        if shape[-2] == 1 and name != "v":
            # one token: out = v·w/(w + eps) depends on q and k only through eps, the gradient is rounding noise
            assert float(grad.abs().max()) < 1e-3 * TOL[dtype] / TOL[torch.float32]
            continue
        assert rel_error(grad, reference) < GRAD_TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_initial_state_and_its_gradient(dtype: torch.dtype) -> None:
    """Two calls chained by the state equal one call over the whole sequence, output and gradients: the state's
    gradient flows from the second call's kernels (∂L/∂S_0) into the first's (∂L/∂S_final)."""
    inputs = _inputs((1, 2, 130, 16), 24, dtype, seed=2)
    split = 67
    first, state = linattn.linear_attention(
        *(x[..., :split, :] for x in inputs), causal=True, backend="triton", return_state=True
    )
    second, final = linattn.linear_attention(
        *(x[..., split:, :] for x in inputs), causal=True, backend="triton", initial_state=state, return_state=True
    )
    out = torch.cat([first, second], dim=-2)
    grads = _grads(out, inputs, seed=3)
    expected, *expected_grads = _reference_grads(inputs, 3, out.shape, phi=elu_plus_one)
    assert rel_error(out, expected) < TOL[dtype]
    for name, grad, reference in zip("qkv", grads, expected_grads, strict=True):
        assert rel_error(grad, reference) < GRAD_TOL[dtype], name
    # the same state objects as the torch forms give (fp32 sums, shift 0, tokens counted)
    _, torch_final = linattn.linear_attention(
        *(x.detach() for x in inputs), causal=True, backend="torch", return_state=True
    )
    assert final.num_tokens == torch_final.num_tokens == 130
    assert final.kv.dtype == torch_final.kv.dtype == torch.float32
    assert torch.equal(final.shift, torch_final.shift)
    assert rel_error(final.kv, torch_final.kv) < TOL[dtype]
    assert rel_error(final.k_sum, torch_final.k_sum) < TOL[dtype]


@pytest.mark.parametrize("min_denom", [None, 0.5], ids=["plain", "min_denom"])
def test_signed_features_unnormalised_and_clamped(min_denom: float | None) -> None:
    """Signed (identity) features: normalize=False, and a denominator clamped at min_denom (part of the rows are
    clamped, so the backward's "denominator is constant" branch is taken), output and gradients."""
    inputs = _inputs((1, 2, 90, 12), 20, torch.float32, seed=4)
    options = {"normalize": False} if min_denom is None else {"min_denom": min_denom}
    out = linattn.linear_attention(*inputs, feature_map="identity", causal=True, backend="triton", **options)
    grads = _grads(out, inputs, seed=5)
    expected, *expected_grads = _reference_grads(inputs, 5, out.shape, phi=identity, **options)
    assert rel_error(out, expected) < TOL[torch.float32]
    for name, grad, reference in zip("qkv", grads, expected_grads, strict=True):
        assert rel_error(grad, reference) < GRAD_TOL[torch.float32], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decoding_steps(dtype: torch.dtype) -> None:
    """The fused recurrent kernel (inference, ≤ 16 tokens): a prompt, then single tokens and a 5-token step,
    each continuing the state, equal the reference over the whole sequence."""
    q, k, v = (x.detach() for x in _inputs((2, 3, 40, 16), 32, dtype, seed=6))
    pieces, state = [], None
    with torch.no_grad():
        for start, end in ((0, 30), (30, 31), (31, 32), (32, 37), (37, 40)):
            out, state = linattn.linear_attention(
                q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True, backend="triton",
                initial_state=state, return_state=True,
            )
            pieces.append(out)
    assert 5 <= RECURRENT_MAX_TOKENS  # the 1- and 5-token steps take the decoding kernel
    assert state is not None and state.num_tokens == 40
    expected = reference_attention(q, k, v, elu_plus_one, causal=True)
    assert rel_error(torch.cat(pieces, dim=-2), expected) < TOL[dtype]


def test_padding_mask_grouped_heads_and_2d_inputs() -> None:
    """Masked keys (zeroed by the dispatch before the kernels), grouped-query heads (repeated before), and plain
    (N, D) inputs (one row, a scalar state shift)."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 80, 16, generator=generator)
    k, v = torch.randn(2, 2, 80, 16, generator=generator), torch.randn(2, 2, 80, 16, generator=generator)
    keep = torch.rand(2, 80, generator=generator) > 0.3
    out = linattn.linear_attention(q, k, v, causal=True, key_padding_mask=keep, backend="triton")
    expected = reference_attention(q, k, v, elu_plus_one, causal=True, keep=keep[:, None, :])  # (B, 1, Nk)
    assert rel_error(out, expected) < TOL[torch.float32]
    out, state = linattn.linear_attention(q[0, 0], k[0, 0], v[0, 0], causal=True, backend="triton", return_state=True)
    assert state.kv.shape == (16, 16) and state.shift.shape == ()
    assert rel_error(out, reference_attention(q[0, 0], k[0, 0], v[0, 0], elu_plus_one, causal=True)) < 2e-5


def test_forcing_triton_on_wide_features_lists_the_reason() -> None:
    """F > 256 is only known once the feature map has run: still a LinearAttentionError naming it; "auto" falls
    back to torch (here on CPU "auto" is torch anyway, so the forced path is the one to check)."""
    q = k = v = torch.randn(1, 1, 10, 300, dtype=torch.float16)
    with pytest.raises(LinearAttentionError, match=r"F=300 > 256[\s\S]*Dv=300 > 256"):
        linattn.linear_attention(q, k, v, causal=True, backend="triton")
    q = k = v = torch.randn(1, 1, 10, 72)
    with pytest.raises(LinearAttentionError, match=r"F=72 > 64 for fp32 inputs"):
        linattn.linear_attention(q, k, v, causal=True, backend="triton")


@pytest.mark.parametrize("map_name", ["elu", "hedgehog"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_step_runs_the_kernel_in_place(map_name: str, dtype: torch.dtype) -> None:
    """DecodeStep on the kernel (the state updated in place; elu + 1 made in the kernel from raw q, k; any other
    ordinary map made before it) against the same step in torch ops and against one call over the whole sequence,
    with grouped-query heads and Dv ≠ F: the kernel's fp32 sums against torch's, a few ulps per token."""
    from linattn.decode import DecodeStep
    from linattn.feature_maps import create

    generator = torch.Generator().manual_seed(12)
    fmap = create(map_name, head_dim=16)
    q = torch.randn(2, 4, 30, 16, generator=generator).to(dtype)
    k = torch.randn(2, 2, 30, 16, generator=generator).to(dtype)
    v = torch.randn(2, 2, 30, 40, generator=generator).to(dtype)
    with torch.no_grad():
        _, state = linattn.linear_attention(q[..., :20, :], k[..., :20, :], v[..., :20, :], feature_map=fmap,
                                            causal=True, backend="torch", return_state=True)
        fused, plain = DecodeStep(fmap, state), DecodeStep(fmap, state)
        assert fused._kernel is not None and fused._kernel.elu == (map_name == "elu")
        plain._kernel = None  # the same step in torch ops
        kv_storage = fused.kv.data_ptr()
        outs, expected_outs = [], []
        for t in range(20, 30):
            args = (q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :])
            outs.append(fused(*args))
            expected_outs.append(plain(*args))
        whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, backend="torch")
    out = torch.cat(outs, dim=-2)
    assert out.dtype == dtype and fused.kv.data_ptr() == kv_storage  # written in place, no new state
    assert fused.num_tokens == plain.num_tokens == 30
    tol = TOL[dtype]
    assert rel_error(out, torch.cat(expected_outs, dim=-2)) < tol
    assert rel_error(out, whole[..., 20:, :]) < tol
    assert rel_error(fused.kv, plain.kv) < 1e-6 and rel_error(fused.k_sum, plain.k_sum) < 1e-6
    # a padding mask takes the torch ops (the masked token must enter nothing)
    keep = torch.tensor([[True], [False]])
    before = fused.kv.clone()
    with torch.no_grad():
        fused(q[..., :1, :], k[..., :1, :], v[..., :1, :], keep=keep)
    assert torch.equal(fused.kv[1], before[1]) and not torch.equal(fused.kv[0], before[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_elu_made_in_the_kernels_equals_elu_made_before(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """feature_map="elu" on the triton backend hands the raw q, k to the kernels (elu + 1 made on load, dQ and dK
    taken through it on store); the same map as a subclass (not fused) makes the features first. Output and
    gradients agree: both round the features to the input dtype once, so they differ by the fp32 rounding of the
    exponential. fp32: some queries so negative that elu + 1 sits at its floor (fp32's smallest normal)."""
    from linattn import backends
    from linattn.feature_maps.elementwise import EluFeatureMap

    class Unfused(EluFeatureMap):
        pass

    flags: list[bool] = []
    original = backends.causal_attention

    def recording(*args: object, elu: bool = False, **kwargs: object) -> object:
        flags.append(elu)
        return original(*args, elu=elu, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(backends, "causal_attention", recording)
    inputs = _inputs((1, 2, 100, 16), 24, dtype, seed=14)
    if dtype == torch.float32:
        with torch.no_grad():
            inputs[0][0, 0, :5] = -100.0  # features at the floor (exp underflows)
    results = []
    for fmap in (EluFeatureMap(), Unfused()):
        out = linattn.linear_attention(*inputs, feature_map=fmap, causal=True, backend="triton")
        results.append([out, *_grads(out, inputs, seed=15)])
    assert flags == [True, False]
    for fused, unfused in zip(*results, strict=True):
        assert fused.dtype == unfused.dtype == dtype
        assert rel_error(fused, unfused) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_fp16_backward_out_of_range_is_an_error() -> None:
    """fp16: a query whose elu + 1 features underflow to 0 has denominator eps, and ∂L/∂out / eps is beyond fp16's
    range: the backward says so (and what to use) instead of handing back NaN gradients; bf16 has the range."""
    inputs = _inputs((1, 1, 70, 16), 16, torch.float16, seed=16)
    with torch.no_grad():
        inputs[0][0, 0, 3] = -100.0  # φ(q_3) = 0 in fp16: den_3 = eps
    out = linattn.linear_attention(*inputs, causal=True, backend="triton")
    assert bool(torch.isfinite(out).all())
    with pytest.raises(LinearAttentionError, match="beyond fp16's range"):
        out.backward(torch.ones_like(out))
