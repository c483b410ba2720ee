"""Every tile configuration of the Triton kernels compiles for real GPUs (sm_80, sm_90) on this CPU machine.

triton.compile with an explicit GPUTarget runs the whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin via the
bundled ptxas) without a device, so a kernel that cannot be built for an A100/H100 fails here. By default the
bf16 kernels of every size class (every tile configuration) are compiled for both targets as launches with
pointers and sizes that are multiples of 16 specialise them (vector loads), and the 128 class also without;
LINATTN_COMPILE_ALL=1 adds fp16 and fp32 (other MMA instructions; fp32 is the slowest to build), a few minutes.
The delta rule's three kernels are built likewise (bf16, F = Dv = 64 and 128; about 20 s from a cold cache), and
the four a KDA call launches (its local and sweep kernels, the delta rule's adjoint and step with per-feature gates).
Triton caches what it compiled (~/.triton/cache): a second run costs seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

# fusion stays on (the default of the Triton versions we target); setting it silences 3.9's notice of a change
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from linattn.kinds.additive.triton import function  # noqa: E402

ARCHES = (80, 90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory a block may use (A100, H100)
FULL = os.environ.get("LINATTN_COMPILE_ALL") == "1"
CASES = [
    (dtype, tiles.size, aligned)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for tiles in reversed(function.configs(dtype))
    for aligned in (True, False)
    if FULL or (dtype == torch.bfloat16 and (aligned or tiles.size == 128))
]


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) read from the cubin by the bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([tool, "-res-usage", handle.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    assert match is not None, text
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: f"sm{a}")
@pytest.mark.parametrize(
    "dtype,size,aligned", CASES, ids=[f"{str(d)[6:]}-{s}-{'aligned' if a else 'any'}" for d, s, a in CASES]
)
def test_kernels_compile(arch: int, dtype: torch.dtype, size: int, aligned: bool) -> None:
    tiles = function.Tiles.for_size(size)
    assert tiles in function.configs(dtype)
    report = []
    for name, kernel, signature, constexprs, attrs, options in function.compile_specs(dtype, tiles, aligned):
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options,
        )
        assert compiled.asm["cubin"], f"{name}: no cubin"
        shared = compiled.metadata.shared
        registers, stack = _resources(compiled.asm["cubin"])
        report.append(f"{name}: {registers} regs, {stack} B stack, {shared} B shared, {options}")
        assert shared <= SHARED_LIMIT[arch], f"{name}: {shared} B of shared memory > {SHARED_LIMIT[arch]}"
        assert registers <= 255
        if arch == 90 and dtype != torch.float32 and name not in ("decode", "prep"):
            # the 16-bit chunk products must map to Hopper's warpgroup MMA, not to scalar FMAs
            assert "wgmma" in compiled.asm["ptx"], f"{name}: no wgmma in the sm_90 PTX"
    print(f"\nsm_{arch} {dtype} size {size} {'aligned' if aligned else 'any'}:\n  " + "\n  ".join(report))


# the delta rule's kernels (kinds/delta/triton/function.py): F = Dv at each size class the backend covers (≤ 128), chunk
# 64 (the default; 16 and 32 use smaller tiles); by default bf16, both alignments at 128; LINATTN_COMPILE_ALL=1 adds
# fp16, fp32
DELTA_CASES = [
    (dtype, size, aligned)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for size in (128, 64)
    for aligned in (True, False)
    if FULL or (dtype == torch.bfloat16 and (aligned or size == 128))
]


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: f"sm{a}")
@pytest.mark.parametrize(
    "dtype,size,aligned", DELTA_CASES,
    ids=[f"{str(d)[6:]}-{s}-{'aligned' if a else 'any'}" for d, s, a in DELTA_CASES],
)
def test_delta_kernels_compile(arch: int, dtype: torch.dtype, size: int, aligned: bool) -> None:
    from linattn.backends.triton import DELTA_MAX_DIM
    from linattn.kinds.delta.triton import function as delta_function

    assert size <= DELTA_MAX_DIM
    report = []
    for name, kernel, signature, constexprs, attrs, options in delta_function.compile_specs(
        dtype, size, size, 64, aligned
    ):
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options,
        )
        assert compiled.asm["cubin"], f"{name}: no cubin"
        shared = compiled.metadata.shared
        registers, stack = _resources(compiled.asm["cubin"])
        report.append(f"{name}: {registers} regs, {stack} B stack, {shared} B shared, {options}")
        assert shared <= SHARED_LIMIT[arch], f"{name}: {shared} B of shared memory > {SHARED_LIMIT[arch]}"
        assert registers <= 255
        if arch == 90 and name != "delta_step":
            # the chunk products (fp32 tiles, TF32 or TF32×3) must map to Hopper's warpgroup MMA
            assert "wgmma" in compiled.asm["ptx"], f"{name}: no wgmma in the sm_90 PTX"
    print(f"\ndelta sm_{arch} {dtype} F = Dv = {size} {'aligned' if aligned else 'any'}:\n  " + "\n  ".join(report))


# KDA's kernels (kinds/kda/triton/function.py: the local and sweep kernels, and the delta rule's adjoint and step
# kernels with per-feature gates): F = Dv = 64 and 128, chunks of 16, bf16 by default (LINATTN_COMPILE_ALL=1 adds fp16,
# fp32). Chunks of 16 make M = 16 products: mma.sync, not Hopper's warpgroup MMA (which needs M ≥ 64), so none is asked
# for.
KDA_CASES = [
    (dtype, size, aligned)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for size in (128, 64)
    for aligned in (True, False)
    if FULL or (dtype == torch.bfloat16 and (aligned or size == 128))
]


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: f"sm{a}")
@pytest.mark.parametrize(
    "dtype,size,aligned", KDA_CASES,
    ids=[f"{str(d)[6:]}-{s}-{'aligned' if a else 'any'}" for d, s, a in KDA_CASES],
)
def test_kda_kernels_compile(arch: int, dtype: torch.dtype, size: int, aligned: bool) -> None:
    from linattn.backends.triton import DELTA_MAX_DIM
    from linattn.kinds.kda.triton import function as kda_function

    assert size <= DELTA_MAX_DIM
    report = []
    for name, kernel, signature, constexprs, attrs, options in kda_function.compile_specs(dtype, size, size, aligned):
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options,
        )
        assert compiled.asm["cubin"], f"{name}: no cubin"
        shared = compiled.metadata.shared
        registers, stack = _resources(compiled.asm["cubin"])
        report.append(f"{name}: {registers} regs, {stack} B stack, {shared} B shared, {options}")
        assert shared <= SHARED_LIMIT[arch], f"{name}: {shared} B of shared memory > {SHARED_LIMIT[arch]}"
        assert registers <= 255
    print(f"\nkda sm_{arch} {dtype} F = Dv = {size} {'aligned' if aligned else 'any'}:\n  " + "\n  ".join(report))
