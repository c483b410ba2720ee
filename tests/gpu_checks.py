"""Checks of the Triton backend on a CUDA device, against the float64 reference and the torch backend.

Plain functions with a small runner, so that the GPU image (python3, torch, triton; maybe no pytest) runs them as
``PYTHONPATH=src:tests python3 tests/gpu_checks.py``; tests/test_triton_gpu.py runs the same under pytest (skipped
without CUDA). Tolerances: bf16 rounds the features and values to 8 bits (2^-9 relative) before the products,
fp16 to 11 bits, fp32 multiplies in TF32×3 (about fp32).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

import torch

import linattn
from linattn.backends import RECURRENT_MAX_TOKENS
from linattn.capabilities import Call, choose_backend, choose_route
from reference import elu_plus_one, reference_attention, rel_error

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3, torch.float32: 3e-5}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(shape: tuple[int, ...], values: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*shape, generator=generator, device="cuda")
    k = torch.randn(*shape, generator=generator, device="cuda")
    v = torch.randn(*shape[:-1], values, generator=generator, device="cuda")
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _check(inputs: list[torch.Tensor], dtype: torch.dtype, label: str) -> None:
    out = linattn.linear_attention(*inputs, causal=True, backend="triton")
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, upstream)
    doubles = [x.detach().double().requires_grad_() for x in inputs]
    expected = reference_attention(*doubles, elu_plus_one, causal=True)
    expected_grads = torch.autograd.grad(expected, doubles, upstream.double())
    assert out.dtype == dtype
    error = rel_error(out, expected)
    assert error < TOL[dtype], f"{label}: output rel. error {error:.2e}"
    for name, grad, reference in zip("qkv", grads, expected_grads, strict=True):
        if out.shape[-2] == 1 and name != "v":
            continue  # one token: out = v·w/(w + eps), the gradient of q and k is O(eps), rounding noise
        error = rel_error(grad, reference)
        assert error < GRAD_TOL[dtype], f"{label}: ∂L/∂{name} rel. error {error:.2e}"


# (dtype, N, F, Dv): every size class (64, 128, 256), N = 1, unaligned N and F/Dv (65, 700, 40, 96) and aligned
# ones (1024, 128) — Triton compiles one specialisation per dtype, class and alignment, so the list stays short
CASES = [
    (torch.bfloat16, 1, 16, 40),
    (torch.bfloat16, 65, 16, 40),
    (torch.bfloat16, 65, 128, 128),
    (torch.bfloat16, 1024, 128, 128),
    (torch.bfloat16, 700, 256, 96),
    (torch.float16, 700, 128, 128),
    (torch.float16, 65, 256, 96),
    (torch.float32, 65, 16, 40),
    (torch.float32, 1024, 64, 64),
]


def check_shapes_and_dtypes() -> None:
    """N around and beyond the chunk, F ≠ Dv, every size class, three dtypes (fp32 is covered up to 64)."""
    for dtype, n, features, values in CASES:
        _check(_inputs((2, 3, n, features), values, dtype, seed=n), dtype, f"{dtype} N={n} F={features} Dv={values}")


def check_initial_state_and_decoding() -> None:
    """A prompt through the chunk kernels, then decoding steps through the fused kernel, against the reference."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (x.detach() for x in _inputs((1, 4, 300, 64), 64, dtype, seed=9))
        pieces, state = [], None
        with torch.no_grad():
            for start, end in ((0, 250), (250, 251), (251, 252), (252, 260), (260, 300)):
                out, state = linattn.linear_attention(
                    q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True,
                    backend="triton", initial_state=state, return_state=True,
                )
                pieces.append(out)
        assert 8 <= RECURRENT_MAX_TOKENS
        expected = reference_attention(q, k, v, elu_plus_one, causal=True)
        error = rel_error(torch.cat(pieces, dim=-2), expected)
        assert error < TOL[dtype], f"{dtype}: chained rel. error {error:.2e}"


def check_long_sequence_against_torch() -> None:
    """16k tokens at the benchmark's head size: the triton and torch backends agree (bf16 inputs; the torch
    backend computes in fp32, so the difference is the kernels' bf16 operands)."""
    q, k, v = (x.detach() for x in _inputs((1, 4, 16384, 128), 128, torch.bfloat16, seed=11))
    fast = linattn.linear_attention(q, k, v, causal=True, backend="triton")
    slow = linattn.linear_attention(q, k, v, causal=True, backend="torch")
    error = rel_error(fast, slow)
    assert error < TOL[torch.bfloat16], f"16k tokens: rel. difference {error:.2e}"


def check_auto_picks_triton() -> None:
    q = torch.randn(1, 2, 10, 16, device="cuda")
    call = Call("plain", True, "auto", 10, 10)
    assert choose_backend("auto", call, choose_route(call), q, torch.bfloat16) == "triton", (
        "auto did not pick triton for a covered CUDA call"
    )
    out = linattn.linear_attention(q, q, q, causal=True, feature_map="favor+")  # log-space: auto falls back
    assert out.shape == q.shape and bool(torch.isfinite(out).all())


def check_decode_step_fused_and_graphed() -> None:
    """DecodeStep on the fused kernel (state in place, elu made in the kernel) against the same step in torch ops,
    bf16 inputs, grouped heads; then the fused step captured in a CUDA graph and replayed gives the same outputs
    and state as eager steps."""
    from linattn.decode import DecodeStep
    from linattn.feature_maps import create

    generator = torch.Generator(device="cuda").manual_seed(13)
    fmap = create("elu", head_dim=64)
    q = torch.randn(2, 8, 40, 64, generator=generator, device="cuda").bfloat16()
    k = torch.randn(2, 4, 40, 64, generator=generator, device="cuda").bfloat16()
    v = torch.randn(2, 4, 40, 96, generator=generator, device="cuda").bfloat16()
    with torch.no_grad():
        _, state = linattn.linear_attention(q[..., :30, :], k[..., :30, :], v[..., :30, :], causal=True,
                                            return_state=True)
        fused, plain, graphed = DecodeStep(fmap, state), DecodeStep(fmap, state), DecodeStep(fmap, state)
        assert fused._kernel is not None and fused._kernel.elu
        plain._kernel = None
        tokens = [(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :]) for t in range(30, 40)]
        outs = [fused(*x) for x in tokens]
        expected = [plain(*x) for x in tokens]
        error = rel_error(torch.cat(outs, -2), torch.cat(expected, -2))
        assert error < TOL[torch.bfloat16], f"fused step: rel. error {error:.2e}"
        assert rel_error(fused.kv, plain.kv) < 1e-5, "fused step: state"
        # graph: static inputs copied in before each replay
        static = [x.clone() for x in tokens[0]]
        replayed = [graphed(*static)]  # the first token eagerly (the kernel is compiled: capture needs that)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # recorded, not run
            captured = graphed(*static)
        for x in tokens[1:]:
            for target, source in zip(static, x, strict=True):
                target.copy_(source)
            graph.replay()
            replayed.append(captured.clone())
        graphed.num_tokens = fused.num_tokens  # the graph does not run the Python counter
        error = rel_error(torch.cat(replayed, -2), torch.cat(outs, -2))
        assert error < 1e-6, f"graph replay: rel. difference {error:.2e}"
        assert rel_error(graphed.kv, fused.kv) < 1e-6, "graph replay: state"


def _delta(inputs: list[torch.Tensor], backend: str, **options: object) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, beta, gate, kv0 = inputs
    out, state = linattn.linear_attention(
        q, k, v, causal=True, update="delta", beta=beta, log_gate=gate, feature_map="identity", backend=backend,
        initial_state=linattn.DeltaRuleState(kv0, 0), return_state=True, **options,  # type: ignore[arg-type]
    )
    return out, state.kv


def check_delta_rule() -> None:
    """The delta rule (with a gate and an initial state) on the kernels against the token-by-token torch form in
    float64: output, final state and every gradient; N around the chunk (64), F = Dv = 64 and 128."""
    for dtype, n, dim in ((torch.bfloat16, 200, 64), (torch.float16, 130, 128), (torch.float32, 65, 32)):
        generator = torch.Generator(device="cuda").manual_seed(n)
        inputs = _inputs((2, 3, n, dim), dim, dtype, seed=n)
        inputs += [torch.rand(2, 3, n, generator=generator, device="cuda").mul(2).requires_grad_(),
                   torch.rand(2, 3, n, generator=generator, device="cuda").mul(-0.3).requires_grad_(),
                   torch.randn(2, 3, dim, dim, generator=generator, device="cuda").mul(0.3).requires_grad_()]
        out, final = _delta(inputs, "triton")
        upstream = [torch.randn_like(out), torch.randn_like(final)]
        grads = torch.autograd.grad([out, final], inputs, upstream)
        doubles = [x.detach().double().requires_grad_() for x in inputs]
        expected, expected_final = _delta(doubles, "torch", form="recurrent")
        expected_grads = torch.autograd.grad([expected, expected_final], doubles, [x.double() for x in upstream])
        for name, value, reference in (("output", out, expected), ("state", final, expected_final)):
            error = rel_error(value, reference)
            assert error < TOL[dtype], f"delta {dtype} N={n}: {name} rel. error {error:.2e}"
        for name, grad, reference in zip(("q", "k", "v", "beta", "log_gate", "kv0"), grads, expected_grads,
                                         strict=True):
            error = rel_error(grad, reference)
            assert error < GRAD_TOL[dtype], f"delta {dtype} N={n}: ∂L/∂{name} rel. error {error:.2e}"


def check_delta_decoding() -> None:
    """A prompt through the delta chunk kernels, then 1- and 8-token calls through the step kernel (bf16), against
    the token-by-token torch form in float64; and "auto" picks triton for the delta rule on CUDA."""
    call = Call("delta", True, "auto", 10, 10, normalize=False)
    q0 = torch.randn(1, 2, 10, 16, device="cuda")
    assert choose_backend("auto", call, choose_route(call), q0, torch.bfloat16) == "triton"
    generator = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (x.detach() for x in _inputs((1, 4, 300, 64), 64, torch.bfloat16, seed=21))
    beta = torch.rand(1, 4, 300, generator=generator, device="cuda")
    pieces, state = [], None
    with torch.no_grad():
        for start, end in ((0, 250), (250, 251), (251, 252), (252, 260), (260, 300)):
            out, state = linattn.linear_attention(
                q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True, update="delta",
                beta=beta[..., start:end], decay=0.99, backend="triton", initial_state=state, return_state=True,
            )
            pieces.append(out)
        expected = linattn.linear_attention(q.double(), k.double(), v.double(), causal=True, update="delta",
                                            beta=beta.double(), decay=0.99, backend="torch", form="recurrent")
    error = rel_error(torch.cat(pieces, dim=-2), expected)
    assert error < TOL[torch.bfloat16], f"delta decoding: chained rel. error {error:.2e}"


def _kda_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, strong: int) -> list[torch.Tensor]:
    """q, k, v (B, H, N, D) in ``dtype``; β (B, H, N), per-feature log-gates (B, H, N, D) with ``strong`` features
    at g ≈ −20, the initial state (B, H, D, D), fp32."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = _inputs(shape, shape[-1], dtype, seed=seed)
    gate = torch.rand(*shape, generator=generator, device="cuda").mul(-0.3)
    gate[..., :strong] -= 20.0
    inputs += [torch.rand(shape[:-1], generator=generator, device="cuda").mul(2).requires_grad_(),
               gate.requires_grad_(),
               torch.randn(*shape[:-2], shape[-1], shape[-1], generator=generator, device="cuda").mul(0.3)
               .requires_grad_()]
    return inputs


def check_kda_rule() -> None:
    """KDA (the delta rule with per-feature gates, 4 of them strong) on its kernels against the token-by-token
    torch form in float64: output, final state and every gradient, nothing NaN or inf; N around the chunk (16),
    F = Dv = 64 and 128; and "auto" picks triton for KDA on CUDA."""
    call = Call("delta", True, "auto", 10, 10, normalize=False, options=(("log_gate", torch.zeros(1, 2, 10, 16)),))
    q0 = torch.randn(1, 2, 10, 16, device="cuda")
    assert choose_backend("auto", call, choose_route(call), q0, torch.bfloat16) == "triton"
    for dtype, n, dim in ((torch.bfloat16, 200, 64), (torch.float32, 70, 128)):
        inputs = _kda_inputs((2, 3, n, dim), dtype, seed=n, strong=4)
        out, final = _delta(inputs, "triton")
        upstream = [torch.randn_like(out), torch.randn_like(final)]
        grads = torch.autograd.grad([out, final], inputs, upstream)
        doubles = [x.detach().double().requires_grad_() for x in inputs]
        expected, expected_final = _delta(doubles, "torch", form="recurrent")
        expected_grads = torch.autograd.grad([expected, expected_final], doubles, [x.double() for x in upstream])
        for name, value, reference in (("output", out, expected), ("state", final, expected_final)):
            error = rel_error(value, reference)
            assert error < TOL[dtype], f"kda {dtype} N={n}: {name} rel. error {error:.2e}"
        for name, grad, reference in zip(("q", "k", "v", "beta", "log_gate", "kv0"), grads, expected_grads,
                                         strict=True):
            assert bool(torch.isfinite(grad).all()), f"kda {dtype} N={n}: ∂L/∂{name} not finite"
            error = rel_error(grad, reference)
            assert error < GRAD_TOL[dtype], f"kda {dtype} N={n}: ∂L/∂{name} rel. error {error:.2e}"


def check_kda_long_and_decoding() -> None:
    """KDA at 4096 tokens (bf16, strong gates on 4 features): the triton and torch backends agree, nothing NaN or
    inf; then a prompt through the chunk kernels and 1- and 8-token calls through the step kernel against the
    token-by-token torch form in float64."""
    q, k, v, beta, gate, _ = (x.detach() for x in _kda_inputs((1, 4, 4096, 64), torch.bfloat16, seed=31, strong=4))
    options = {"causal": True, "update": "delta", "feature_map": "identity"}
    with torch.no_grad():
        fast = linattn.linear_attention(q, k, v, beta=beta, log_gate=gate, backend="triton", **options)
        slow = linattn.linear_attention(q, k, v, beta=beta, log_gate=gate, backend="torch", **options)
        assert bool(torch.isfinite(fast).all()), "kda 4096 tokens: output not finite"
        error = rel_error(fast, slow)
        assert error < TOL[torch.bfloat16], f"kda 4096 tokens: rel. difference {error:.2e}"
        pieces, state = [], None
        for start, end in ((0, 250), (250, 251), (251, 252), (252, 260), (260, 300)):
            out, state = linattn.linear_attention(
                q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], beta=beta[..., start:end],
                log_gate=gate[..., start:end, :], backend="triton", initial_state=state, return_state=True, **options,
            )
            pieces.append(out)
        expected = linattn.linear_attention(
            q[..., :300, :].double(), k[..., :300, :].double(), v[..., :300, :].double(),
            beta=beta[..., :300].double(), log_gate=gate[..., :300, :].double(), backend="torch", form="recurrent",
            **options)
    error = rel_error(torch.cat(pieces, dim=-2), expected)
    assert error < TOL[torch.bfloat16], f"kda decoding: chained rel. error {error:.2e}"


CHECKS: list[Callable[[], None]] = [
    check_auto_picks_triton,
    check_shapes_and_dtypes,
    check_initial_state_and_decoding,
    check_long_sequence_against_torch,
    check_decode_step_fused_and_graphed,
    check_delta_rule,
    check_delta_decoding,
    check_kda_rule,
    check_kda_long_and_decoding,
]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 1
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        try:
            check()
            print(f"PASS {check.__name__} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:  # report every check, then fail
            failed += 1
            print(f"FAIL {check.__name__}\n{traceback.format_exc()}", flush=True)
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
