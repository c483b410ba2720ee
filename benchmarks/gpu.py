"""GPU timing: linattn's Triton kernels against torch SDPA (flash backend), causal, forward and forward+backward.

At B=4, H=32, D=128, bf16 (the Lightning Attention-2 setting) for N = 2k … 64k, every candidate is timed in the
same run, in alternating rounds (one call of each candidate per round, CUDA events, median over rounds after a
warm-up call), so that clocks and neighbours affect all alike. Candidates:

    sdpa_flash       F.scaled_dot_product_attention(is_causal=True) restricted to the flash backend
    linattn          linattn.linear_attention(causal=True, feature_map="elu", backend="triton"), end to end
                     (the fp32 casts and feature map of the functional API included)
    linattn_kernels  the Triton autograd Function alone, on bf16 elu+1 features made beforehand
    linattn_torch    the pure-PyTorch chunked form (backend="torch"), up to --torch-max tokens
    fla_chunk        fla's chunk_linear_attn on the same features, when the fla package is importable

The delta rule (Gated DeltaNet, --delta-lengths, default N = 8192 at B=4, H=8, D=64, bf16): the Triton backend
against the torch chunked form, end to end, forward and forward+backward (and fla's chunk_gated_delta_rule when
importable); the ratio column then reads torch/this. KDA (per-feature gates, --kda-lengths, the same shape): its
Triton kernels beside the gated delta rule's on the same inputs (one gate per token), and KDA's torch form (and
fla's chunk_kda when importable); the ratio column reads gated_delta/this.

Also the decoding step (B=1, H=32, D=128: one token against the carried state) through linear_attention, through
the fused kernel alone, and through DecodeStep (fused kernel, state in place; and in torch ops), eager and as the
steps of 32 layers captured in one CUDA graph. Prints a table, writes CSV (--csv). No network, no install: run from
the repo with ``PYTHONPATH=src python3 benchmarks/gpu.py`` (scripts/gpu_check.sh does, with the CUDA checks first).

``--smoke`` runs the same code on CPU tensors at toy sizes under TRITON_INTERPRET=1 (SDPA's default backend,
wall-clock timing): tests/test_triton.py uses it so that the script works when a GPU is there for it.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import gpu_delta  # the delta rule's and KDA's sections (benchmarks/gpu_delta.py, beside this script)
import torch
import torch.nn.functional as F

import linattn
from linattn.backends import causal_attention
from linattn.decode import DecodeStep

Call = Callable[[], Any]


DEVICE = "cuda"


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type != "cuda":  # --smoke: no flash kernel on CPU
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _features(x: torch.Tensor) -> torch.Tensor:
    return (F.elu(x.float()) + 1).to(x.dtype)


def _fla() -> Callable[..., Any] | None:
    if DEVICE != "cuda":  # --smoke: fla's kernels have no interpreter path (its CPU fallback finds no driver)
        return None
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # type: ignore[import-not-found]
    except Exception:  # not carried, or it does not import with this torch/triton
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # fla takes (B, N, H, D), given to it in that layout (made outside the timing), and normalises by the
        # running key sum itself
        out = chunk_linear_attn(q, k, v, scale=1.0, normalize=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def candidates(n: int, args: argparse.Namespace) -> dict[str, Callable[..., torch.Tensor]]:
    found: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa_flash": _flash,
        "linattn": lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, feature_map="elu", backend="triton"),
        "linattn_kernels": lambda q, k, v: causal_attention(
            q, k, v, state=None, dtype=q.dtype, normalize=True, eps=1e-6, min_denom=None
        )[0],
    }
    if n <= args.torch_max:
        found["linattn_torch"] = lambda q, k, v: linattn.linear_attention(
            q, k, v, causal=True, feature_map="elu", backend="torch"
        )
    fla = _fla()
    if fla is not None:
        found["fla_chunk"] = fla
    return found


FEATURE_INPUTS = ("linattn_kernels", "fla_chunk")  # these take elu+1 features, made once outside the timing
TOKEN_MAJOR = ("fla_chunk",)  # this one takes (B, N, H, D)


def agreement(
    runs: dict[str, Callable[..., torch.Tensor]], feats: list[torch.Tensor], token_major: list[torch.Tensor]
) -> str:
    """Relative difference of the outputs of the feature-taking candidates (same features, same normaliser; the
    token-major ones get ``token_major``, the same features in (B, N, H, D)): the timed calls compute the same."""
    with torch.no_grad():
        ours = runs["linattn_kernels"](*feats).float()
        notes = []
        for name in TOKEN_MAJOR:
            if name in runs:
                theirs = runs[name](*token_major).transpose(1, 2).float()
                difference = ((ours - theirs).norm() / ours.norm()).item()
                notes.append(f"{name} vs linattn_kernels: rel. difference {difference:.2e}")
    return "; ".join(notes)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(call: Call) -> float:
    """Milliseconds of one call: CUDA events on the GPU, the wall clock in --smoke."""
    if DEVICE != "cuda":
        began = time.perf_counter()
        call()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _time_calls(calls: dict[tuple[str, str], Call], n: int, rounds: int) -> list[dict[str, Any]]:
    """Median ms, spread and peak memory of each (candidate, mode) call: a warm-up call each (compiles the kernels,
    measures the peak), then ``rounds`` alternating rounds. A call that fails is a row with its error as the note."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    peak: dict[tuple[str, str], int] = {}
    failed: dict[tuple[str, str], str] = {}
    for key, call in calls.items():  # warm-up (compiles the kernels) and peak memory
        try:
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            call()
            _sync()
            peak[key] = torch.cuda.max_memory_allocated() - before if DEVICE == "cuda" else 0
        except Exception as error:  # e.g. out of memory: reported in the table, the others go on
            failed[key] = f"{type(error).__name__}: {str(error)[:80]}"
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    for _ in range(rounds):
        for key, call in calls.items():
            if key not in failed:
                times[key].append(_timed(call))
    rows = []
    for (name, mode), samples in times.items():
        row: dict[str, Any] = {"N": n, "candidate": name, "mode": mode}
        if (name, mode) in failed:
            row.update(ms=float("nan"), spread="", peak_GiB=float("nan"), note=failed[(name, mode)])
        else:
            quarters = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else samples * 3
            row.update(ms=statistics.median(samples), spread=f"{quarters[0]:.3f}-{quarters[2]:.3f}",
                       peak_GiB=peak[(name, mode)] / 2**30, note="")
        rows.append(row)
    return rows


def time_length(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median forward and forward+backward ms of every candidate at N = n, alternating rounds."""
    shape = (args.batch, args.heads, n, args.dim)
    raw = [torch.randn(shape, device=DEVICE, dtype=args.dtype) for _ in range(3)]
    feats = [_features(raw[0]), _features(raw[1]), raw[2]]
    grad = torch.randn(shape, device=DEVICE, dtype=args.dtype)
    runs = candidates(n, args)
    calls: dict[tuple[str, str], Call] = {}
    token_major = [x.transpose(1, 2).contiguous() for x in feats] if any(n in runs for n in TOKEN_MAJOR) else []
    grad_token_major = grad.transpose(1, 2).contiguous() if token_major else grad
    for name, fn in runs.items():
        base = feats if name in FEATURE_INPUTS else raw
        base = token_major if name in TOKEN_MAJOR else base
        leaves = [x.detach().requires_grad_() for x in base]

        def forward(fn: Callable[..., torch.Tensor] = fn, base: list[torch.Tensor] = base) -> None:
            with torch.no_grad():
                fn(*base)

        def training(
            fn: Callable[..., torch.Tensor] = fn, leaves: list[torch.Tensor] = leaves,
            upstream: torch.Tensor = grad_token_major if name in TOKEN_MAJOR else grad,
        ) -> None:
            fn(*leaves).backward(upstream)
            for leaf in leaves:
                leaf.grad = None

        calls[(name, "fwd")] = forward
        calls[(name, "fwd+bwd")] = training
    rows = _time_calls(calls, n, args.rounds)
    if n == args.lengths[0]:
        try:
            note = agreement(runs, feats, token_major)
        except Exception as error:  # a candidate that fails is reported in the table; this is only a check
            note = f"agreement not checked: {type(error).__name__}: {str(error)[:120]}"
        if note:
            print(f"  {note}", flush=True)
    flash = {r["mode"]: r["ms"] for r in rows if r["candidate"] == "sdpa_flash"}
    for row in rows:
        row["flash/this"] = flash.get(row["mode"], float("nan")) / row["ms"] if row["ms"] == row["ms"] else float("nan")
    return rows


LAYERS = 32  # decoding steps of as many layers captured in one CUDA graph (a model's step is one graph)


def time_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    """µs per decoding step (one token, B=1, H=32, D=128, 4k tokens already in the state), wall clock over
    --steps calls (what a decoder waits for, launch overhead included). Eager rows: one layer's step per call.
    Graph rows: the steps of LAYERS layers (each its own DecodeStep and state) captured in one CUDA graph and
    replayed; µs per layer step = replay time / LAYERS (the GPU's time, the Python launch cost gone)."""
    shape = (1, args.heads, 1, args.dim)
    prompt = [torch.randn(1, args.heads, args.prompt, args.dim, device=DEVICE, dtype=args.dtype) for _ in range(3)]
    step = [torch.randn(shape, device=DEVICE, dtype=args.dtype) for _ in range(3)]
    rows = []
    with torch.no_grad():
        _, state = linattn.linear_attention(*prompt, causal=True, backend="triton", return_state=True)
        _sync()
        host = linattn.backends.triton.load()
        fmap = linattn.feature_maps.create("elu", head_dim=args.dim)
        feats = [_features(step[0]).float(), _features(step[1]).float(), step[2].float()]

        def steps(fused: bool, count: int) -> list[DecodeStep]:
            made = [DecodeStep(fmap, state) for _ in range(count)]
            if not fused:
                for made_step in made:
                    made_step._kernel = None  # the same step in torch ops
            return made

        fused_step, torch_step = steps(True, 1)[0], steps(False, 1)[0]
        calls: dict[str, tuple[Call, int]] = {
            "linattn_step": (lambda: linattn.linear_attention(
                *step, causal=True, backend="triton", initial_state=state, return_state=True
            ), 1),
            "linattn_torch_step": (lambda: linattn.linear_attention(
                *step, causal=True, backend="torch", initial_state=state, return_state=True
            ), 1),
            "kernel_step": (lambda: host.recurrent_step(
                *feats, state.kv, state.k_sum, args.dtype, True, 1e-6, None
            ), 1),
            "DecodeStep": (lambda: fused_step(*step), 1),
            "DecodeStep_torch_ops": (lambda: torch_step(*step), 1),
        }
        kept: list[Any] = []
        if DEVICE == "cuda":
            for name, fused in (("DecodeStep_graph", True), ("DecodeStep_torch_ops_graph", False)):
                layers = steps(fused, LAYERS)
                for layer in layers:  # warm-up: the kernel is compiled and loaded before the capture
                    layer(*step)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for layer in layers:
                        layer(*step)
                torch.cuda.synchronize()
                print(f"  captured {name}", flush=True)
                kept.append((graph, layers))  # the graph writes the layers' states: they must outlive it
                calls[name] = (graph.replay, LAYERS)
        for name, (call, per_call) in calls.items():
            call()
            _sync()  # a failure is reported at the candidate that caused it
            print(f"  warm {name}", flush=True)
            for _ in range(args.steps // 10):
                call()
            _sync()
            samples = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.steps):
                    call()
                _sync()
                samples.append((time.perf_counter() - start) / (args.steps * per_call) * 1e6)
            rows.append({"N": 1, "candidate": name, "mode": "decode", "ms": statistics.median(samples) / 1e3,
                         "spread": f"{min(samples):.1f}-{max(samples):.1f} us", "peak_GiB": 0.0, "note": "",
                         "flash/this": float("nan")})
    return rows


def _lengths(rows: list[dict[str, Any]], lengths: list[int], timer: Callable[..., list[dict[str, Any]]], ratio: str,
             args: argparse.Namespace) -> None:
    """Time each length with ``timer``, print its rows (``ratio``/this: the column's reference), keep them."""
    for n in lengths:
        started = time.perf_counter()
        found = timer(n, args)
        rows += found
        for row in found:
            print(f"N={row['N']:>6} {row['candidate']:>16} {row['mode']:>8} {row['ms']:10.3f} ms  "
                  f"[{row['spread']}]  {ratio}/this {row['flash/this']:6.2f}  peak {row['peak_GiB']:6.2f} GiB "
                  f"{row['note']}", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if ratio != "flash":  # the delta rule's and KDA's sections come last: their rows are saved as they come
            _write(args.csv, rows)


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768, 65536],
                        help="N of the attention table (none: skip it)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--torch-max", type=int, default=16384, help="longest N for the pure-PyTorch column")
    parser.add_argument("--prompt", type=int, default=4096, help="tokens in the state before the decoding steps")
    parser.add_argument("--steps", type=int, default=100, help="decoding steps per timed round")
    parser.add_argument("--csv", default="gpu_benchmark.csv")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes, under TRITON_INTERPRET=1")
    parser.add_argument("--decode-only", action="store_true", help="only the decoding step")
    parser.add_argument("--delta-lengths", type=int, nargs="*", default=[8192], help="the delta rule's N (none: skip)")
    parser.add_argument("--delta-heads", type=int, default=8)
    parser.add_argument("--delta-dim", type=int, default=64)
    parser.add_argument("--kda-lengths", type=int, nargs="*", default=[8192],
                        help="KDA's N, at the delta rule's heads and dim (none: skip)")
    args = parser.parse_args(argv)
    args.dtype = torch.bfloat16
    global DEVICE
    if args.smoke:
        DEVICE, args.dtype = "cpu", torch.float16  # the interpreter has no bf16
        args.lengths, args.batch, args.heads, args.dim, args.rounds = [80], 1, 2, 16, 2
        args.prompt, args.steps, args.torch_max = 70, 2, 80
        args.delta_lengths, args.kda_lengths, args.delta_heads, args.delta_dim = [80], [80], 2, 16
    elif not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    import triton

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke, interpreter)"
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}  B={args.batch} H={args.heads} "
          f"D={args.dim} {str(args.dtype)[6:]} causal, median of {args.rounds} alternating rounds")
    rows = []
    _lengths(rows, [] if args.decode_only else args.lengths, time_length, "flash", args)
    for row in time_decode(args):
        rows.append(row)
        print(f"decode {row['candidate']:>20} {row['ms'] * 1e3:8.1f} us per step [{row['spread']}]", flush=True)
    _write(args.csv, rows)  # before the delta rule's section, whose first launches compile (and fla autotunes)
    for timer, lengths, ratio in ((gpu_delta.time_delta, args.delta_lengths, "torch"),
                                  (gpu_delta.time_kda, args.kda_lengths, "gated_delta")):
        timed = partial(timer, device=DEVICE, time_calls=_time_calls)
        _lengths(rows, [] if args.decode_only else lengths, timed, ratio, args)
    broken = [f"{row['candidate']} {row['mode']}: {row['note']}" for row in rows if row["note"]]
    if broken:
        print("failed:\n  " + "\n  ".join(broken))
    return 1 if broken and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
