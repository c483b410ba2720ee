"""Launch configurations, the autograd Function over the chunk kernels, and the decoding step.

Imported only when the triton backend runs (it imports triton). Inputs are feature tensors as
``CausalChunkedFunction`` gets them, Q, K (..., N, F) and V (..., N, Dv) in fp32 (fp64 is refused by the capability
check), plus the initial state (S, z) in fp32. They are cast once to the kernel dtype (the caller's input dtype:
fp32, fp16 or bf16); outputs come back in that dtype, states and the gradients of the features in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from ....errors import LinearAttentionError
from . import kernels

CHUNK = kernels.CHUNK


SIZES = (64, 128, 256)  # tile classes: F and Dv are padded together to the smallest that holds both


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and warps of the kernels for one size class; :func:`configs` lists every one shipped."""

    size: int  # BF = BVF: all features / all values, padded
    value_block: int  # BV: values per program of the forward and dV kernels
    feature_block: int  # BK: features per program of the dQ and dK kernels
    warps: int
    stages: int  # software pipeline depth of the chunk loops

    @staticmethod
    def for_size(size: int) -> Tiles:
        # State slices of at most 128×64 fp32 per program. Sizes 64 and 128: 64 values/features, 4 warps, 2 stages,
        # the fastest launch of each of the four chunk kernels on an H200 at R = 128, N = 16384, F = Dv = 128, bf16
        # (benchmarks/gpu_tune.py; docs/benchmarks.md): 1.2-1.9x faster than 8 warps. Size 256: 32 per program,
        # 8 warps, unpipelined (2 stages overflow an A100's shared memory in the dV kernel; not timed).
        if size <= 128:
            return Tiles(size, 64, 64, 4, 2)
        return Tiles(size, 32, 32, 8, 1)

    @property
    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.warps, "num_stages": self.stages}

    @staticmethod
    def for_shape(features: int, values: int) -> Tiles:
        size = max(SIZES[0], triton.next_power_of_2(max(features, values)))
        return Tiles.for_size(size)


DECODE_VALUE_BLOCK = 32  # decoding: each program walks its row's state in (size × 32) fp32 slices
DECODE_WARPS = 4
PREP_TOKENS = 32  # tokens per program of the backward's preparation kernel
PREP_WARPS = 4


def configs(dtype: torch.dtype) -> list[Tiles]:
    """Every tile configuration the backend launches for ``dtype`` (F, Dv ≤ 256; fp32: ≤ 64)."""
    return [Tiles.for_size(size) for size in SIZES if dtype != torch.float32 or size <= 64]


def precisions(dtype: torch.dtype) -> tuple[str, str]:
    """input_precision of the input products and of the state products. fp32 inputs: three TF32 products per
    product ("tf32x3", close to fp32; an IEEE fp32 dot runs on scalar FMAs and needs more shared memory than a GPU
    has at these tiles). fp16/bf16 inputs: the plain 16-bit tensor-core product, and the state (fp32, whose sums
    outgrow fp16's range) in TF32."""
    if dtype == torch.float32:
        return "tf32x3", "tf32x3"
    return "ieee", "tf32"  # "ieee" on a 16-bit dot means: the plain 16-bit tensor-core product


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """Launch; if the GPU lacks the shared memory the software pipeline asks for (its use differs between GPUs and
    Triton versions: tests/test_triton_compile.py checks sm_80/sm_90 with one version), relaunch unpipelined."""
    try:
        kernel[grid](*args, **options)
    except OutOfResources:
        kernel[grid](*args, **{**options, "num_stages": 1})


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., N, D) → (R, N, D) contiguous in ``dtype``."""
    return x.reshape(-1, x.shape[-2], x.shape[-1]).to(dtype).contiguous()


def _options(dtype: torch.dtype, normalize: bool, min_denom: float | None, elu: bool) -> dict[str, Any]:
    precision, state_precision = precisions(dtype)
    return {
        "NORMALIZE": normalize, "HAS_MIN": min_denom is not None,
        "PRECISION": precision, "STATE_PRECISION": state_precision, "ELU": elu,
    }


class TritonCausalFunction(torch.autograd.Function):
    """(Q, K, V, S_0, z_0) → (out, S_N, z_N), causal, chunk 64; backward recomputes the states.

    ``elu``: Q and K are the raw projections and the kernels make the elu + 1 features themselves (the gradients
    are then those of the raw Q and K)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv0: torch.Tensor,
        k_sum0: torch.Tensor,
        dtype: torch.dtype,
        normalize: bool,
        eps: float,
        min_denom: float | None,
        elu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n, features, values = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
        qr, kr, vr = _rows(q, dtype), _rows(k, dtype), _rows(v, dtype)  # (R, N, F), (R, N, F), (R, N, Dv)
        rows = qr.shape[0]
        kv0r = kv0.reshape(rows, features, values).float().contiguous()  # (R, F, Dv)
        z0r = k_sum0.reshape(rows, features).float().contiguous()  # (R, F)
        tiles = Tiles.for_shape(features, values)
        out = torch.empty(rows, n, values, dtype=dtype, device=q.device)
        den = torch.empty(rows, n if normalize else 1, dtype=torch.float32, device=q.device)  # den + eps
        kv_n, z_n = torch.empty_like(kv0r), torch.empty_like(z0r)
        grid = (rows, triton.cdiv(values, tiles.value_block))
        launch(
            kernels.chunk_forward_kernel, grid,
            qr, kr, vr, kv0r, z0r, out, den, kv_n, z_n, n, features, values, eps, min_denom or 0.0,
            C=CHUNK, BF=tiles.size, BV=tiles.value_block, **tiles.launch_options,
            **_options(dtype, normalize, min_denom, elu),
        )
        ctx.save_for_backward(qr, kr, vr, kv0r, z0r, out, den)
        ctx.options = (dtype, normalize, min_denom, batch, tiles, (q.dtype, k.dtype, v.dtype), kv0.dtype, elu)
        ctx.set_materialize_grads(False)
        return out.reshape(*batch, n, values), kv_n.reshape(*batch, features, values), z_n.reshape(*batch, features)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_kv: torch.Tensor | None, grad_k_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        qr, kr, vr, kv0r, z0r, out, den = ctx.saved_tensors
        dtype, normalize, min_denom, batch, tiles, input_dtypes, state_dtype, elu = ctx.options
        rows, n, features = qr.shape
        values = vr.shape[-1]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = grad_out.reshape(rows, n, values).contiguous()
        grad_den = torch.zeros(rows, 1, device=qr.device)  # (R, N) when normalising
        if normalize:
            # out = num / d: ∂L/∂num = g / d, ∂L/∂den = −(g·out) / d (0 where d does not depend on den), one pass
            grad_num = torch.empty(rows, n, values, dtype=dtype, device=qr.device)
            grad_den = torch.empty(rows, n, device=qr.device)
            kernels.backward_prep_kernel[(triton.cdiv(rows * n, PREP_TOKENS),)](
                grad_out, out, den, grad_num, grad_den, rows * n, values, min_denom or 0.0,
                BT=PREP_TOKENS, BVF=tiles.size, HAS_MIN=min_denom is not None, num_warps=PREP_WARPS,
            )
            if dtype == torch.float16 and not bool(torch.isfinite(grad_num).all()):
                # g / d over fp16's 65504: a query whose features nearly vanish (d ≈ eps). bf16 and fp32 have the
                # range; an inf here would turn every gradient of the row to NaN
                raise LinearAttentionError(
                    "backend='triton' with fp16 inputs: ∂L/∂out divided by the normaliser is beyond fp16's range "
                    "(or ∂L/∂out is not finite): some query's features nearly vanish, so its denominator is about "
                    "eps. Use bf16 inputs, or backend='torch' (fp32 throughout)"
                )
        else:
            grad_num = grad_out.to(dtype).contiguous()  # (R, N, Dv)
        grad_kv_n = (grad_kv.reshape(rows, features, values).float().contiguous() if grad_kv is not None
                     else torch.zeros_like(kv0r))
        grad_z_n = (grad_k_sum.reshape(rows, features).float().contiguous() if grad_k_sum is not None
                    else torch.zeros_like(z0r))
        # the kernels accumulate in fp32 and round once to each input's dtype when they store
        q_dtype, k_dtype, v_dtype = input_dtypes
        grad_q = torch.empty(rows, n, features, dtype=q_dtype, device=qr.device)
        grad_k = torch.empty(rows, n, features, dtype=k_dtype, device=qr.device)
        grad_v = torch.empty(rows, n, values, dtype=v_dtype, device=qr.device)
        grad_kv0, grad_z0 = torch.empty_like(kv0r), torch.empty_like(z0r)
        options = _options(dtype, normalize, min_denom, elu)
        del options["HAS_MIN"]
        feature_grid = (rows, triton.cdiv(features, tiles.feature_block))
        common = {"C": CHUNK, "BK": tiles.feature_block, "BVF": tiles.size, **tiles.launch_options, **options}
        launch(
            kernels.chunk_dq_kernel, feature_grid,
            grad_num, grad_den, qr, kr, vr, kv0r, z0r, grad_q, n, features, values, **common
        )
        launch(
            kernels.chunk_dk_kernel, feature_grid,
            grad_num, grad_den, qr, kr, vr, grad_kv_n, grad_z_n, grad_k, grad_kv0, grad_z0, n, features, values,
            **common
        )
        del options["NORMALIZE"]
        launch(
            kernels.chunk_dv_kernel, (rows, triton.cdiv(values, tiles.value_block)),
            grad_num, qr, kr, grad_kv_n, grad_v, n, features, values,
            C=CHUNK, BF=tiles.size, BV=tiles.value_block, **tiles.launch_options, **options,
        )
        return (
            grad_q.reshape(*batch, n, features),
            grad_k.reshape(*batch, n, features),
            grad_v.reshape(*batch, n, values),
            grad_kv0.reshape(*batch, features, values).to(state_dtype),
            grad_z0.reshape(*batch, features).to(state_dtype),
            None, None, None, None, None,
        )


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv0: torch.Tensor,
    k_sum0: torch.Tensor,
    dtype: torch.dtype,
    normalize: bool,
    eps: float,
    min_denom: float | None,
    elu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoding without autograd: the fused token-by-token kernel, state in fp32 (new tensors, inputs untouched).
    ``elu``: q and k are raw projections, the elu + 1 features made in the kernel."""
    batch, n, features, values = q.shape[:-2], q.shape[-2], q.shape[-1], v.shape[-1]
    qr, kr, vr = _rows(q, dtype), _rows(k, dtype), _rows(v, dtype)
    rows = qr.shape[0]
    kv0r = kv0.reshape(rows, features, values).float().contiguous()  # (R, F, Dv)
    z0r = k_sum0.reshape(rows, features).float().contiguous()  # (R, F)
    out = torch.empty(rows, n, values, dtype=dtype, device=q.device)
    kv_n, z_n = torch.empty_like(kv0r), torch.empty_like(z0r)
    launch_step(qr, kr, vr, kv0r, z0r, out, kv_n, z_n, normalize=normalize, eps=eps, min_denom=min_denom, elu=elu)
    return out.reshape(*batch, n, values), kv_n.reshape(*batch, features, values), z_n.reshape(*batch, features)


def launch_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv0: torch.Tensor, k_sum0: torch.Tensor, out: torch.Tensor,
    kv_n: torch.Tensor, k_sum_n: torch.Tensor, *, normalize: bool, eps: float, min_denom: float | None, elu: bool,
) -> None:
    """The decoding kernel on contiguous tensors with R rows: q, k (R·N·F), v, out (R·N·Dv), states (R·F·Dv),
    (R·F) in fp32. ``kv_n``/``k_sum_n`` may be ``kv0``/``k_sum0`` (updated in place: :class:`linattn.DecodeStep`).
    ``elu``: q and k are raw projections, the features elu(x) + 1 are made in the kernel."""
    rows, features = k_sum0.shape
    n, values = q.numel() // (rows * features), kv0.shape[-1]
    tiles = Tiles.for_shape(features, values)
    launch(
        kernels.recurrent_kernel, (rows,),
        q, k, v, kv0, k_sum0, out, kv_n, k_sum_n, n, features, values, eps, min_denom or 0.0,
        BF=tiles.size, BV=DECODE_VALUE_BLOCK, NORMALIZE=normalize, HAS_MIN=min_denom is not None, ELU=elu,
        num_warps=DECODE_WARPS,
    )


_KERNELS = {
    "forward": kernels.chunk_forward_kernel,
    "dq": kernels.chunk_dq_kernel,
    "dk": kernels.chunk_dk_kernel,
    "dv": kernels.chunk_dv_kernel,
    "decode": kernels.recurrent_kernel,
    "prep": kernels.backward_prep_kernel,
}
_INPUT_POINTERS = {"Q", "K", "V", "O", "DO", "G", "OUT", "GNUM"}  # in the kernel dtype; every other is fp32
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compile_specs(
    dtype: torch.dtype, tiles: Tiles, aligned: bool
) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[tuple[int, ...], Any], dict[str, int]]]:
    """(name, kernel, signature, constexprs, attrs, launch options) of each kernel as the launches above specialise
    it for ``dtype`` and ``tiles`` (normalised, with min_denom: the variant with the most code), for ``triton.compile``.
    ``aligned``: as Triton specialises a launch whose pointers and N, F, Dv are multiples of 16 (vector loads)."""
    precision, state_precision = precisions(dtype)
    values = {
        "C": CHUNK, "BF": tiles.size, "BVF": tiles.size, "BK": tiles.feature_block, "NORMALIZE": True,
        "HAS_MIN": True, "PRECISION": precision, "STATE_PRECISION": state_precision, "ELU": True,
        "BT": PREP_TOKENS,
    }
    launches = {"decode": {"num_warps": DECODE_WARPS}, "prep": {"num_warps": PREP_WARPS}}
    specs = []
    for name, kernel in _KERNELS.items():
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for arg in kernel.arg_names:
            if arg in ("N", "F", "DV", "TOKENS"):
                signature[arg] = "i32"
            elif arg in ("eps", "min_denom"):
                signature[arg] = "fp32"
            elif arg.isupper() and arg not in values and arg != "BV":
                signature[arg] = "*" + (_TRITON_TYPES[dtype] if arg in _INPUT_POINTERS else "fp32")
            else:
                signature[arg] = "constexpr"
                block = DECODE_VALUE_BLOCK if name == "decode" else tiles.value_block
                constexprs[arg] = block if arg == "BV" else values[arg]
        attrs: dict[tuple[int, ...], Any] = {
            (index,): [["tt.divisibility", 16]]
            for index, kind in enumerate(signature.values())
            if aligned and kind != "constexpr" and kind != "fp32"
        }
        specs.append((name, kernel, signature, constexprs, attrs, launches.get(name, tiles.launch_options)))
    return specs
