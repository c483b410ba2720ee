"""GPU: each Triton kernel of the backend alone, under every launch configuration worth trying (values or features
per program, warps, pipeline stages), and the backward's preparation pass, at one benchmark shape.

What the shipped configuration (``function.Tiles``) is chosen from. Kernel time by ``triton.testing.do_bench``
(median ms); registers, spills and shared memory from the compiled kernel. One line per variant, CSV with --csv.
Run from the repo on a GPU machine: ``PYTHONPATH=src python3 benchmarks/gpu_tune.py`` (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="batch × heads (B=4, H=32)")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128, help="F = Dv")
    parser.add_argument("--budget", type=float, default=100.0, help="seconds; variants beyond it are skipped")
    parser.add_argument("--csv", default="gpu_tune.csv")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes, under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    device = "cuda"
    if args.smoke:
        device, args.rows, args.length, args.dim = "cpu", 1, 80, 16
    elif not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    import triton

    def do_bench(call: Any, warmup: int, rep: int) -> float:
        if device == "cuda":
            from triton.testing import do_bench as bench

            return float(bench(call, warmup=warmup, rep=rep))
        began = time.perf_counter()
        call()
        return (time.perf_counter() - began) * 1e3

    from linattn.kinds.additive.triton import function, kernels

    began = time.perf_counter()
    rows, n, dim = args.rows, args.length, args.dim
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter has no bf16
    gen = torch.Generator(device=device).manual_seed(0)
    q = (torch.nn.functional.elu(torch.randn(rows, n, dim, device=device, generator=gen)) + 1).to(dtype)
    k = (torch.nn.functional.elu(torch.randn(rows, n, dim, device=device, generator=gen)) + 1).to(dtype)
    v = torch.randn(rows, n, dim, device=device, generator=gen).to(dtype)
    s0 = torch.zeros(rows, dim, dim, device=device)
    z0 = torch.zeros(rows, dim, device=device)
    out, den = torch.empty_like(v), torch.empty(rows, n, device=device)
    sn, zn = torch.empty_like(s0), torch.empty_like(z0)
    dnum = torch.randn(rows, n, dim, device=device, generator=gen).to(dtype)
    gd = torch.randn(rows, n, device=device, generator=gen)
    dq, dk, dvo = (torch.empty(rows, n, dim, device=device) for _ in range(3))
    ds0, dz0 = torch.empty_like(s0), torch.empty_like(z0)
    precision, state_precision = function.precisions(dtype)
    size = max(64, triton.next_power_of_2(dim))
    flops = {  # useful FLOPs per kernel (2 per multiply-add), for TFLOP/s
        "forward": 2 * rows * n * (64 * dim + 64 * dim + 2 * dim * dim),
        "dq": 2 * rows * n * (64 * dim + 64 * dim + dim * dim * 2),
        "dk": 2 * rows * n * (64 * dim + 64 * dim + dim * dim * 2),
        "dv": 2 * rows * n * (64 * dim + 64 * dim + dim * dim * 2),
    }
    results: list[dict[str, Any]] = []
    shipped = function.Tiles.for_shape(dim, dim)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke, interpreter)"
    print(f"{name} triton {triton.__version__}: R={rows} N={n} F=Dv={dim} bf16; "
          f"shipped: BV={shipped.value_block} BK={shipped.feature_block} warps={shipped.warps}", flush=True)

    def launcher(name: str, block: int, warps: int, stages: int) -> Any:
        common = {"num_warps": warps, "num_stages": stages}
        if name == "forward":
            grid = (rows, triton.cdiv(dim, block))
            return lambda: kernels.chunk_forward_kernel[grid](
                q, k, v, s0, z0, out, den, sn, zn, n, dim, dim, 1e-6, 0.0, C=64, BF=size, BV=block,
                NORMALIZE=True, HAS_MIN=False, PRECISION=precision, STATE_PRECISION=state_precision, ELU=False,
                **common)
        if name == "dv":
            grid = (rows, triton.cdiv(dim, block))
            return lambda: kernels.chunk_dv_kernel[grid](
                dnum, q, k, s0, dvo, n, dim, dim, C=64, BF=size, BV=block, PRECISION=precision,
                STATE_PRECISION=state_precision, ELU=False, **common)
        grid = (rows, triton.cdiv(dim, block))
        options = {"C": 64, "BK": block, "BVF": size, "NORMALIZE": True, "PRECISION": precision,
                   "STATE_PRECISION": state_precision, "ELU": False, **common}
        if name == "dq":
            return lambda: kernels.chunk_dq_kernel[grid](dnum, gd, q, k, v, s0, z0, dq, n, dim, dim, **options)
        return lambda: kernels.chunk_dk_kernel[grid](
            dnum, gd, q, k, v, s0, z0, dk, ds0, dz0, n, dim, dim, **options)

    blocks = [b for b in (32, 64, 128) if b <= size] if device == "cuda" else [16]
    # the kernel innermost: every kernel gets the same variants before the budget runs out
    for block, warps, stages, name in itertools.product(blocks, (4, 8), (1, 2), ("forward", "dq", "dk", "dv")):
        row: dict[str, Any] = {"kernel": name, "block": block, "warps": warps, "stages": stages}
        if time.perf_counter() - began > args.budget:
            row["note"] = "skipped: over the budget"
            results.append(row)
            continue
        try:
            call = launcher(name, block, warps, stages)
            compiled = call()
            if device == "cuda":
                torch.cuda.synchronize()
            row.update(regs=getattr(compiled, "n_regs", ""), spills=getattr(compiled, "n_spills", ""),
                       shared=getattr(getattr(compiled, "metadata", None), "shared", ""))
            ms = do_bench(call, warmup=5, rep=30)
            row.update(ms=ms, tflops=flops[name] / ms / 1e9)
        except Exception as error:  # out of resources, compile failure: reported, the others go on
            row["note"] = f"{type(error).__name__}: {str(error)[:100]}"
        results.append(row)
        mark = " (shipped)" if (block == (shipped.value_block if name in ("forward", "dv") else shipped.feature_block)
                                and warps == shipped.warps) else ""
        print(f"{name:>8} block {block:>3} warps {warps} stages {stages}: "
              + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s  regs {row['regs']} spills {row['spills']} "
               f"shared {row['shared']}" if "ms" in row else row["note"]) + mark,
              flush=True)

    # the backward's preparation pass (∂L/∂num, ∂L/∂den from ∂L/∂out): one kernel over R·N tokens
    g = torch.randn(rows, n, dim, device=device, generator=gen).to(dtype)
    den_full = torch.rand(rows, n, device=device, generator=gen) + 1
    gden = torch.empty(rows, n, device=device)

    def prep() -> None:
        kernels.backward_prep_kernel[(triton.cdiv(rows * n, function.PREP_TOKENS),)](
            g, out, den_full, dnum, gden, rows * n, dim, 0.0, BT=function.PREP_TOKENS, BVF=size, HAS_MIN=False,
            num_warps=function.PREP_WARPS)

    ms = do_bench(prep, warmup=5, rep=30)
    results.append({"kernel": "backward prep", "ms": ms})
    print(f"backward prep (dO/d, dden): {ms:.3f} ms", flush=True)
    with open(args.csv, "w", newline="") as handle:
        fields = ["kernel", "block", "warps", "stages", "ms", "tflops", "regs", "spills", "shared", "note"]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(results)
    print(f"wrote {args.csv} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
