"""KDA (the delta rule with a per-feature gate, kinds/kda/forms.py) on the Triton kernels (kernels.py): the autograd
Function and the chunked entry point; the decoding step is kinds/delta/triton/function.py's ``delta_recurrent`` given
the per-feature gates (its kernel scales each row of the state by its own factor).

Imported only when the triton backend runs (it imports triton). Inputs as kinds/kda/forms.py's ``kda_chunked`` gets
them: unit features Q, K (..., N, F) and V (..., N, Dv) in fp32, β (..., N), log-gates (..., N, F) ≤ 0, the initial
state (..., F, Dv) in fp32. Q, K, V are cast once to the kernel dtype (the caller's input dtype: fp32, fp16 or bf16; the
kernels widen every tile to fp32); β and the gates are fp32; the output comes back in the kernel dtype, the state and
every gradient in fp32 (cast to each input's dtype).

Forward: the local kernel (one program per chunk: pair weights, T = (I + A)⁻¹, W, the gate factors), then the sweep
kernel (one program per row and value block, chunk after chunk). Backward, as the delta rule's: the adjoint of the
state recurrence on the delta rule's adjoint kernel (per-feature e^{G_C}), the chunk-local gradients around it in
PyTorch, kinds/kda/forms.py's ``chunk_backward`` (the torch form's own backward) fed with what the kernels saved.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import triton

from ...additive.triton.function import launch
from ...delta.triton import kernels as delta_kernels
from ...delta.triton.function import (
    STEP_VALUE_BLOCK,
    STEP_WARPS,
    Spec,
    _padded,
    _rows,
    adjoint_sweep,
    kernel_spec,
    precision,
    tiles,
)
from ..forms import chunk_backward
from . import kernels as kda_kernels

CHUNK = kda_kernels.CHUNK
LOCAL_BLOCK = 16  # features (and values) per step of the local kernel: its (C, C, BK) tiles, 4096 fp32 elements
LOCAL_WARPS = 4


def sweep_tiles(rows: int, features: int, values: int) -> tuple[int, int, int]:
    """(BF, BV, warps) of the forward sweep: the delta rule's tiles (kinds/delta/triton/function.py ``tiles``), with the
    value block halved (down to 16) while the grid has fewer than 128 programs. Each program is one chain of small
    products through N/16 chunks, bound by latency, so programs (an H100 or H200 has 132 SMs) matter more than their
    tile size; at B·H = 32, Dv = 64 this gives 16 values per program (not timed on a GPU)."""
    block_f, block_v, warps = tiles(features, values)
    while block_v > 16 and rows * triton.cdiv(values, block_v) < 128:
        block_v //= 2
    return block_f, block_v, warps


class TritonKdaFunction(torch.autograd.Function):
    """(Q, K, V, β, g, S_0) → (out, S_N), causal, chunks of 16, N a multiple of 16 (the caller pads)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        log_gate: torch.Tensor,
        initial: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, n, features, values = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
        qr, kr, vr = _rows(q, dtype), _rows(k, dtype), _rows(v, dtype)  # (R, N, F), (R, N, F), (R, N, Dv)
        rows, chunks = qr.shape[0], n // CHUNK
        beta_r = beta.reshape(rows, n).float().contiguous()  # (R, N)
        gate_r = _rows(log_gate, torch.float32)  # (R, N, F)
        s0 = initial.reshape(rows, features, values).float().contiguous()  # (R, F, Dv)
        save = any(ctx.needs_input_grad[:6])
        device = q.device  # every buffer below fp32 (the default dtype is not assumed)
        written = torch.empty(rows, n, values, device=device, dtype=torch.float32)  # W_v, then U
        w_k, bq, k_out = (torch.empty(rows, n, features, device=device, dtype=torch.float32) for _ in range(3))
        last = torch.empty(rows, chunks, features, device=device, dtype=torch.float32)  # e^{G_C}
        scores, inverse = (torch.empty(rows, n, CHUNK, device=device, dtype=torch.float32) for _ in range(2))  # P, T
        launch(
            kda_kernels.kda_local_kernel, (rows, chunks),
            qr, kr, vr, beta_r, gate_r, written, w_k, bq, k_out, last, scores, inverse, n, features, values,
            C=CHUNK, BK=LOCAL_BLOCK, PRECISION=precision(dtype), num_warps=LOCAL_WARPS, num_stages=1,
        )
        out = torch.empty(rows, n, values, dtype=dtype, device=q.device)
        final = torch.empty_like(s0)
        states = torch.empty(rows, chunks if save else 1, features, values, device=device, dtype=torch.float32)
        block_f, block_v, warps = sweep_tiles(rows, features, values)
        launch(
            kda_kernels.kda_forward_kernel, (rows, triton.cdiv(values, block_v)),
            w_k, written, bq, k_out, last, scores, s0, out, final, states, n, features, values,
            C=CHUNK, BF=block_f, BV=block_v, SAVE=save, PRECISION=precision(dtype), num_warps=warps, num_stages=1,
        )
        if save:
            # the backward computes in fp32 on the operands the kernels saw (rounded to the kernel dtype)
            chunked = [x.unflatten(1, (chunks, CHUNK)) for x in (w_k, written, bq, k_out)]
            ctx.save_for_backward(qr.float(), kr.float(), vr.float(), beta_r, gate_r, states, *chunked,
                                  last.unsqueeze(-1), *(x.unflatten(1, (chunks, CHUNK)) for x in (scores, inverse)))
        ctx.shapes, ctx.dtype = (batch, (q.dtype, k.dtype, v.dtype, log_gate.dtype)), dtype
        return out.reshape(*batch, n, values), final.reshape(*batch, features, values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        batch, input_dtypes = ctx.shapes
        saved = ctx.saved_tensors
        rows, n, values = saved[2].shape
        features = saved[0].shape[-1]
        d_out = d_out.reshape(rows, n, values).float()
        d_final = d_final.reshape(rows, features, values).float()
        dq, dk, dv, d_beta, d_gate, d_initial = chunk_backward(
            saved, d_out, d_final, CHUNK, sweep=partial(adjoint_sweep, precision=precision(ctx.dtype)),
        )
        return (
            dq.reshape(*batch, n, features).to(input_dtypes[0]),
            dk.reshape(*batch, n, features).to(input_dtypes[1]),
            dv.reshape(*batch, n, values).to(input_dtypes[2]),
            d_beta.reshape(*batch, n),
            d_gate.reshape(*batch, n, features).to(input_dtypes[3]),
            d_initial.reshape(*batch, features, values),
            None,
        )


def kda_chunked(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor, log_gate: torch.Tensor,
    initial: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk kernels on any N: tokens past a multiple of 16 are padded with β = 0, g = 0 (as the torch form
    pads). Returns the output (..., N, Dv) in ``dtype`` and the final state in fp32."""
    n = qf.shape[-2]
    pad = (-n) % CHUNK
    padded = [_padded(x, pad, -2) for x in (qf, kf, v, log_gate)]
    out, final = TritonKdaFunction.apply(*padded[:3], _padded(beta, pad, -1), padded[3], initial, dtype)
    return out[..., :n, :], final


def compile_specs(dtype: torch.dtype, features: int, values: int, aligned: bool, rows: int = 32) -> list[Spec]:
    """(name, kernel, signature, constexprs, attrs, launch options) of each kernel a KDA call on ``rows`` rows
    launches, as the launches above and kinds/delta/triton/function.py's specialise them (saving for backward,
    per-feature gates), for ``triton.compile`` (tests/test_triton_compile.py)."""
    block_f, block_v, warps = sweep_tiles(rows, features, values)
    constants = {"C": CHUNK, "BF": block_f, "BV": block_v, "BK": LOCAL_BLOCK, "HAS_DECAY": True, "SAVE": True,
                 "PRECISION": precision(dtype), "PER_FEATURE": True}
    typed = {"Q", "K", "V", "O"}  # in the kernel dtype; every other pointer is fp32
    sweep = {"num_warps": warps, "num_stages": 1}
    _, adjoint_block, _ = tiles(features, values)
    return [
        kernel_spec("kda_local", kda_kernels.kda_local_kernel, constants, typed, dtype, aligned,
                    {"num_warps": LOCAL_WARPS, "num_stages": 1}),
        kernel_spec("kda_forward", kda_kernels.kda_forward_kernel, constants, typed, dtype, aligned, sweep),
        kernel_spec("kda_adjoint", delta_kernels.delta_adjoint_kernel, {**constants, "BV": adjoint_block}, set(),
                    dtype, aligned, sweep),
        kernel_spec("kda_step", delta_kernels.delta_step_kernel, {**constants, "BV": STEP_VALUE_BLOCK}, typed, dtype,
                    aligned, {"num_warps": STEP_WARPS}),
    ]
