"""The delta rule on the Triton kernels (delta_kernels.py): the autograd Function and the decoding step.

Imported only when the triton backend runs (it imports triton). Inputs as kinds/delta/forms.py's ``delta_chunked`` gets
them: unit features Q, K (..., N, F) and V (..., N, Dv) in fp32, β (..., N), per-token log-decays (..., N) or None,
the initial state (..., F, Dv) in fp32. Q, K, V are cast once to the kernel dtype (the caller's input dtype: fp32,
fp16 or bf16; the kernels widen every tile to fp32), β and the log-decays are fp32; the output comes back in the
kernel dtype, the state and every gradient in fp32.

The backward is a hybrid: the state-dependent sequential part (the adjoint of the state, chunk after chunk) is the
Triton kernel ``delta_adjoint_kernel``; the chunk-local gradients around it (independent across chunks, batched
GEMMs and one batched triangular solve) are kinds/delta/forms.py's ``chunk_backward``, the same code as the torch form's
backward, fed with the states, W and U the forward kernel saved. Both are exact (no approximation anywhere).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import triton

from ...additive.triton.function import launch
from ..forms import chunk_backward
from . import kernels as delta_kernels

CHUNKS = (16, 32, 64)  # chunk lengths the kernels take (tl.dot needs ≥ 16); 64 the default, as the torch form's
MAX_DIM = 128  # F and Dv: every tile is fp32, and 256 overflows the shared memory (tests/test_triton_compile.py)
STEP_VALUE_BLOCK = 32
STEP_WARPS = 4


def precision(dtype: torch.dtype) -> str:
    """input_precision of the kernels' products, whose operands are fp32 tiles: TF32×3 (about fp32) for fp32 inputs;
    TF32 for bf16/fp16 inputs (10 mantissa bits: at least the inputs' own, on the tensor cores)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def tiles(features: int, values: int) -> tuple[int, int, int]:
    """(BF, BV, warps) of the chunk kernels: all features, values in blocks of at most 64 (32 at F = 128); 8 warps
    (4 spill the adjoint kernel's registers at F = 128, tests/test_triton_compile.py; not timed on a GPU)."""
    size = max(16, triton.next_power_of_2(features))
    block = min(max(16, triton.next_power_of_2(values)), 64 if size <= 64 else 32)
    return size, block, 8


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., N, D) → (R, N, D) contiguous in ``dtype``."""
    return x.reshape(-1, x.shape[-2], x.shape[-1]).to(dtype).contiguous()


def _padded(x: torch.Tensor, pad: int, tokens_dim: int) -> torch.Tensor:
    """Zeros appended along the token dimension (-2 of features, -1 of β and log-decays)."""
    if not pad:
        return x
    return F.pad(x, (0, 0, 0, pad)) if tokens_dim == -2 else F.pad(x, (0, pad))


class TritonDeltaFunction(torch.autograd.Function):
    """(Q, K, V, β, g, S_0) → (out, S_N), causal, chunk ``size``, N a multiple of it (the caller pads)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor | None,
        initial: torch.Tensor,
        dtype: torch.dtype,
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, n, features, values = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
        qr, kr, vr = _rows(q, dtype), _rows(k, dtype), _rows(v, dtype)  # (R, N, F), (R, N, F), (R, N, Dv)
        rows = qr.shape[0]
        beta_r = beta.reshape(rows, n).float().contiguous()  # (R, N)
        g_r = log_decay.reshape(rows, n).float().contiguous() if log_decay is not None else beta_r
        s0 = initial.reshape(rows, features, values).float().contiguous()  # (R, F, Dv)
        save = any(ctx.needs_input_grad[:6])
        out = torch.empty(rows, n, values, dtype=dtype, device=q.device)
        final = torch.empty_like(s0)
        chunks = n // size
        states = torch.empty(rows, chunks if save else 1, features, values, device=q.device)
        solved = torch.empty(rows, n if save else 1, values + features, device=q.device)  # (W_v, W_k)
        written = torch.empty(rows, n if save else 1, values, device=q.device)  # U
        block_f, block_v, warps = tiles(features, values)
        launch(
            delta_kernels.delta_forward_kernel, (rows, triton.cdiv(values, block_v)),
            qr, kr, vr, beta_r, g_r, s0, out, final, states, solved, written, n, features, values,
            C=size, BF=block_f, BV=block_v, HAS_DECAY=log_decay is not None, SAVE=save,
            PRECISION=precision(dtype), num_warps=warps, num_stages=1,
        )
        if save:
            # the backward computes in fp32 on the operands the kernels saw (rounded to the kernel dtype)
            ctx.save_for_backward(qr.float(), kr.float(), vr.float(), beta_r,
                                  log_decay.reshape(rows, n) if log_decay is not None else None,
                                  states, solved, written)
        ctx.shapes, ctx.size, ctx.dtype = (batch, (q.dtype, k.dtype, v.dtype)), size, dtype
        return out.reshape(*batch, n, values), final.reshape(*batch, features, values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (batch, input_dtypes), size = ctx.shapes, ctx.size
        *inputs, states, solved, written = ctx.saved_tensors
        rows, n, values = inputs[2].shape
        features = inputs[0].shape[-1]
        # W_k and U as the torch form keeps them: (R, nc, C, ·)
        saved = (*inputs, states, solved.unflatten(1, (-1, size))[..., values:], written.unflatten(1, (-1, size)))
        d_out = d_out.reshape(rows, n, values).float()
        d_final = d_final.reshape(rows, features, values).float()
        dq, dk, dv, d_beta, d_log, d_initial = chunk_backward(
            saved, d_out, d_final, size, want_log=ctx.needs_input_grad[4],
            sweep=partial(adjoint_sweep, precision=precision(ctx.dtype)),
        )
        assert dq is not None and dk is not None and dv is not None and d_beta is not None and d_initial is not None
        return (
            dq.reshape(*batch, n, features).to(input_dtypes[0]),
            dk.reshape(*batch, n, features).to(input_dtypes[1]),
            dv.reshape(*batch, n, values).to(input_dtypes[2]),
            d_beta.reshape(*batch, n),
            d_log.reshape(*batch, n) if d_log is not None else None,
            d_initial.reshape(*batch, features, values),
            None, None,
        )


def adjoint_sweep(
    bq: torch.Tensor,
    k_out: torch.Tensor,
    w_k: torch.Tensor,
    p_do: torch.Tensor,
    d_o: torch.Tensor,
    last: torch.Tensor | None,
    d_final: torch.Tensor,
    *,
    precision: str = "tf32x3",
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """kinds/delta/forms.py's ``adjoint_sweep`` on the kernel: chunked (R, nc, C, ·) inputs in fp32, ``last`` (R, nc, 1,
    1) or None, or (R, nc, F, 1) per feature (KDA, kinds/kda/forms.py); the adjoint of the state leaving each chunk (R,
    nc, F, Dv), None for dU (the chunk backward forms it from the first result) and the adjoint of the initial state (R,
    F, Dv)."""
    rows, chunks, size, features = bq.shape
    values = d_o.shape[-1]
    n = chunks * size
    flat = [x.reshape(rows, n, x.shape[-1]).contiguous() for x in (bq, k_out, w_k, p_do, d_o)]
    per_feature = last is not None and last.shape[-2] > 1
    totals = last.reshape(rows, chunks, -1).contiguous() if last is not None else flat[0]
    d_leaving = torch.empty(rows, chunks, features, values, device=bq.device)
    d_initial = torch.empty(rows, features, values, device=bq.device)
    block_f, block_v, warps = tiles(features, values)
    launch(
        delta_kernels.delta_adjoint_kernel, (rows, triton.cdiv(values, block_v)),
        *flat, totals, d_final.contiguous(), d_leaving, d_initial, n, features, values,
        C=size, BF=block_f, BV=block_v, HAS_DECAY=last is not None, PER_FEATURE=per_feature, PRECISION=precision,
        num_warps=warps, num_stages=1,
    )
    return d_leaving, None, d_initial


def delta_chunked(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor, log_decay: torch.Tensor | None,
    initial: torch.Tensor, dtype: torch.dtype, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk kernels on any N: tokens past a multiple of the chunk are padded with β = 0, g = 0 (as the torch
    form pads). Returns the output (..., N, Dv) in ``dtype`` and the final state in fp32."""
    n = qf.shape[-2]
    pad = (-n) % chunk_size
    padded = [_padded(x, pad, -2) for x in (qf, kf, v)]
    gates = _padded(log_decay, pad, -1) if log_decay is not None else None
    out, final = TritonDeltaFunction.apply(*padded, _padded(beta, pad, -1), gates, initial, dtype, chunk_size)
    return out[..., :n, :], final


def delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor | None,
    kv: torch.Tensor, out: torch.Tensor, kv_out: torch.Tensor,
) -> None:
    """The token-by-token kernel on contiguous tensors with R rows: q, k (R·N·F) features (normalised in the kernel),
    v, out (R·N·Dv), β (R·N) and log-decays (R·N), or per feature (R·N·F: KDA), fp32, states (R·F·Dv) fp32.
    ``kv_out`` may be ``kv`` (in place)."""
    rows, features, values = kv.reshape(-1, kv.shape[-2], kv.shape[-1]).shape
    n = q.numel() // (rows * features)
    per_feature = log_decay is not None and log_decay.numel() != rows * n
    launch(
        delta_kernels.delta_step_kernel, (rows,),
        q, k, v, beta, log_decay if log_decay is not None else beta, kv, out, kv_out, n, features, values,
        BF=max(16, triton.next_power_of_2(features)), BV=STEP_VALUE_BLOCK, HAS_DECAY=log_decay is not None,
        PER_FEATURE=per_feature, num_warps=STEP_WARPS,
    )


def delta_recurrent(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor, log_decay: torch.Tensor | None,
    initial: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference without autograd: the step kernel over (..., N) tokens into a new state (inputs untouched).
    ``log_decay`` (..., N) per token, or (..., N, F) per feature (KDA)."""
    batch, n, values = qf.shape[:-2], qf.shape[-2], v.shape[-1]
    qr, kr, vr = _rows(qf, dtype), _rows(kf, dtype), _rows(v, dtype)
    rows = qr.shape[0]
    out = torch.empty(rows, n, values, dtype=dtype, device=qf.device)
    kv = initial.reshape(rows, kf.shape[-1], values).float().contiguous()
    kv_out = torch.empty_like(kv)
    gates = log_decay.reshape(rows, n, -1).float().contiguous() if log_decay is not None else None
    delta_step(qr, kr, vr, beta.reshape(rows, n).float().contiguous(), gates, kv, out, kv_out)
    return out.reshape(*batch, n, values), kv_out.reshape(initial.shape)


_INPUT_POINTERS = {"Q", "K", "V", "O"}  # in the kernel dtype; every other pointer is fp32 (the adjoint's: all)
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


Spec = tuple[str, Any, dict[str, str], dict[str, Any], dict[tuple[int, ...], Any], dict[str, int]]


def kernel_spec(name: str, kernel: Any, constants: dict[str, Any], typed: set[str], dtype: torch.dtype,
                aligned: bool, options: dict[str, int]) -> Spec:
    """One kernel's (name, kernel, signature, constexprs, attrs, launch options) for ``triton.compile``: N, F, DV
    are i32, the names in ``constants`` constexprs, the pointers in ``typed`` of ``dtype`` and every other fp32.
    ``aligned``: as Triton specialises a launch whose pointers and sizes are multiples of 16."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for arg in kernel.arg_names:
        if arg in ("N", "F", "DV"):
            signature[arg] = "i32"
        elif arg in constants:
            signature[arg] = "constexpr"
            constexprs[arg] = constants[arg]
        else:
            signature[arg] = "*" + (_TRITON_TYPES[dtype] if arg in typed else "fp32")
    attrs: dict[tuple[int, ...], Any] = {
        (index,): [["tt.divisibility", 16]]
        for index, kind in enumerate(signature.values()) if aligned and kind != "constexpr"
    }
    return name, kernel, signature, constexprs, attrs, options


def compile_specs(dtype: torch.dtype, features: int, values: int, chunk: int, aligned: bool) -> list[Spec]:
    """(name, kernel, signature, constexprs, attrs, launch options) of each delta kernel as the launches above
    specialise it (with a decay, saving for backward), for ``triton.compile`` (tests/test_triton_compile.py)."""
    block_f, block_v, warps = tiles(features, values)
    constants = {"C": chunk, "BF": block_f, "BV": block_v, "HAS_DECAY": True, "SAVE": True,
                 "PRECISION": precision(dtype), "PER_FEATURE": False}
    chunked = {"num_warps": warps, "num_stages": 1}
    return [
        kernel_spec("delta_forward", delta_kernels.delta_forward_kernel, constants, _INPUT_POINTERS, dtype, aligned,
                    chunked),
        kernel_spec("delta_adjoint", delta_kernels.delta_adjoint_kernel, constants, set(), dtype, aligned, chunked),
        kernel_spec("delta_step", delta_kernels.delta_step_kernel, {**constants, "BV": STEP_VALUE_BLOCK},
                    _INPUT_POINTERS, dtype, aligned, {"num_warps": STEP_WARPS}),
    ]
