"""The Triton backend: chunked causal linear attention and a fused decoding step on CUDA tensors.

Importing this package does not import triton; :func:`load` does, on first use. What it covers (v1): causal
attention with ordinary (non-log-space) feature maps, fp32/fp16/bf16 inputs, F and Dv up to 256, any N, chunk 64,
an optional initial state, the normaliser (eps, min_denom) or none. :func:`reasons` says why a case is not covered.
The delta rule (kinds/delta/triton/function.py): causal, any feature map (made and normalised before the kernels),
per-token decays, F and Dv up to 128, chunks of 16, 32 or 64; :func:`delta_reasons` and :func:`delta_shape_reasons`.
KDA, the delta rule with per-feature gates (kinds/kda/triton/): the same, in chunks of 16 (a per-token decay given too
is added to every feature's gate); :func:`delta_reasons` with ``per_feature_gate=True``. """

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from ...errors import LinearAttentionError

MAX_DIM = 256
# fp32 operands take twice the shared memory: TF32×3 tiles of 128 overflow an H100's 227 KiB (measured by
# tests/test_triton_compile.py), so fp32 is covered up to the 64 size class
MAX_DIM_FP32 = 64
CHUNK = 64
DELTA_CHUNKS = (16, 32, 64)  # tl.dot needs tiles of ≥ 16 tokens; 64 the default, as the torch form's
# every tile of the delta kernels is fp32: F = 256 overflows an H100's shared memory (tests/test_triton_compile.py)
DELTA_MAX_DIM = 128
KDA_CHUNK = 16  # the KDA kernels form each chunk's (C, C, feature block) pairwise gate factors in registers
_TRUE = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """TRITON_INTERPRET is on: the kernels run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def import_error() -> str | None:
    """None when triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:  # the extra is not installed
        return f"triton is not importable ({error}); install the extra: pip install 'linattn[triton]'"
    return None


def load() -> ModuleType:
    """The kernels' host module (imports triton)."""
    from ...kinds.additive.triton import function

    return function


def load_delta() -> ModuleType:
    """The delta rule's host module (imports triton)."""
    from ...kinds.delta.triton import function as delta_function

    return delta_function


def load_kda() -> ModuleType:
    """KDA's host module (imports triton)."""
    from ...kinds.kda.triton import function as kda_function

    return kda_function


def reasons(
    q: torch.Tensor,
    *,
    causal: bool,
    form: str,
    log_space: bool,
    chunk_size: int | None,
    dtype: torch.dtype,
    check_import: bool = True,
) -> list[str]:
    """Why the kernels do not cover this call, from what is known before the feature map runs; [] when covered."""
    found = []
    if not causal:
        found.append("causal=False: the kernels compute causal attention (non-causal is two GEMMs in torch)")
    if form not in ("chunked", "recurrent"):
        found.append(f"form={form!r}: the kernels compute the chunked and recurrent forms")
    if log_space:
        found.append("log-space feature map: v1 kernels take ordinary maps (no log-scale ref)")
    if chunk_size not in (None, CHUNK):
        found.append(f"chunk_size={chunk_size}: the kernels use chunks of {CHUNK}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        found.append(f"dtype {dtype}: the kernels take fp32, fp16 and bf16")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        found.append(f"device {q.device}: the kernels run on CUDA tensors (on CPU only under TRITON_INTERPRET=1)")
    if check_import:
        error = import_error()
        if error is not None:
            found.append(error)
    return found


def shape_reasons(features: int, values: int, dtype: torch.dtype) -> list[str]:
    """Why the kernels do not cover the feature and value sizes (known once the feature map has run)."""
    found = []
    limit, what = (MAX_DIM_FP32, " for fp32 inputs (use bf16/fp16)") if dtype == torch.float32 else (MAX_DIM, "")
    if features > limit:
        found.append(f"feature dimension F={features} > {limit}{what}")
    if values > limit:
        found.append(f"value dimension Dv={values} > {limit}{what}")
    return found


def delta_reasons(q: torch.Tensor, *, form: str, chunk_size: int | None, dtype: torch.dtype,
                  per_feature_gate: bool = False) -> list[str]:
    """Why the delta kernels do not cover this call of the delta rule (causal, unnormalised: the route's own
    reasons); [] when covered. Any feature map: the features are made and L2-normalised before the kernels.
    ``per_feature_gate``: KDA (log-gates (..., N, F)), on its own kernels, which take chunks of 16 only."""
    found = reasons(q, causal=True, form=form, log_space=False, chunk_size=None, dtype=dtype)
    if per_feature_gate and chunk_size not in (None, KDA_CHUNK):
        found.append(f"chunk_size={chunk_size}: the KDA kernels (per-feature gates) use chunks of {KDA_CHUNK}")
    elif not per_feature_gate and chunk_size not in (None, *DELTA_CHUNKS):
        found.append(f"chunk_size={chunk_size}: the delta kernels use chunks of {', '.join(map(str, DELTA_CHUNKS))}")
    return found


def delta_shape_reasons(features: int, values: int) -> list[str]:
    """Why the delta kernels do not cover the feature and value sizes (known once the feature map has run)."""
    return [f"{name}={size} > {DELTA_MAX_DIM} (the delta kernels keep every tile in fp32)"
            for name, size in (("feature dimension F", features), ("value dimension Dv", values))
            if size > DELTA_MAX_DIM]


def option_reasons(options: dict[str, Any]) -> list[str]:
    """Options the kernels do not know (decays, gates, packing, ...): each a reason, never ignored."""
    given = {name: value for name, value in options.items() if value is not None}
    return [f"option {name}={_short(value)}: not in the kernels" for name, value in given.items()]


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}" if value.dim() else repr(value.item())
    return repr(value)


def refusal(found: list[str]) -> LinearAttentionError:
    """The error of a forced ``backend='triton'`` that does not cover a call: every reason, one per line."""
    listed = "".join(f"\n  - {reason}" for reason in found)
    return LinearAttentionError(f"backend='triton' does not cover this call:{listed}\nuse backend='torch' or 'auto'")
