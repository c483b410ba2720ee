"""``linattn bench``: time, memory and useful FLOPs of linear attention against softmax attention, side by side.

For each N, each implementation runs its forward (under ``no_grad``) and its forward+backward (``out.backward(g)``
with g preallocated) ``repeats`` times after one warm-up; we report the median and the interquartile range.

Useful FLOPs per forward (the work the method needs, not what a kernel happens to do):
    linear attention  4·N·F·Dv per batch×head (φ(K)ᵀV and φ(Q)S, two multiply-adds per element)
    softmax attention 4·N²·D non-causal, 2·N²·D causal (QKᵀ and PV, half of them masked when causal)
forward+backward counts 3× the forward. The ratio to a large square matmul timed in the same run (the machine's
practical GEMM peak) says how much of the hardware the method uses. Peak memory is the largest live allocation
above what existed before the call (CPU: the profiler's allocation events; CUDA: the caching allocator's peak),
also given as a multiple of the bytes of q, k, v and out together.

Peers are used only when installed (never dependencies): fla's pure-PyTorch chunked reference, performer-pytorch.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import __version__, feature_maps
from ._json import dumps
from .functional import linear_attention
from .measure import matmul_peak, peak_memory, quartiles, time_calls, useful_flops

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BenchConfig:
    sizes: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    batch: int = 1
    heads: int = 8
    dim: int = 64
    forms: list[str] = field(default_factory=lambda: ["chunked", "global"])
    maps: list[str] = field(default_factory=lambda: ["elu"])
    causal: list[bool] = field(default_factory=lambda: [True, False])
    backward: bool = True
    sdpa: bool = True
    peers: bool = True
    memory: bool = True
    repeats: int = 5
    max_seconds: float = 30.0  # an implementation stops at the first N where one run takes longer
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536])
    decode_steps: int = 32
    dtype: str = "float32"
    device: str = "cpu"
    peak_size: int = 2048  # side of the square matmul that measures the GEMM peak
    # causal decays timed beside the plain path: "decay" (RetNet rates), "gate" (per token), "gla" (per feature)
    decays: list[str] = field(default_factory=list)
    out: Path = Path("out/bench")


@dataclass
class Result:
    impl: str
    causal: bool
    pass_name: str  # "forward" or "forward+backward"
    n: int
    median_s: float
    q1_s: float
    q3_s: float
    samples: int
    tokens_per_s: float
    gflops: float  # useful GFLOP/s
    peak_fraction: float  # of the best matmul rate measured in the run
    peak_bytes: int  # -1 when not measured
    io_ratio: float  # peak_bytes / bytes of (q, k, v, out)
    matmul_peak_gflops: float  # measured just before this implementation's sweep (the run's best sets %peak)
    speedup_vs_sdpa: float | None = None


@dataclass
class DecodeResult:
    impl: str
    context: int
    step_s: float  # median seconds per generated token
    q1_s: float
    q3_s: float


@dataclass
class _Impl:
    name: str
    fn: Attention
    kind: str  # "linear" or "sdpa": which FLOP count applies
    features: int
    needs: Callable[[int], bool] = lambda n: True  # sizes the implementation accepts


def _peers(config: BenchConfig, causal: bool) -> list[_Impl]:
    """Peers that happen to be installed, each run its own way (fla: no feature map; performer: FAVOR+)."""
    found: list[_Impl] = []
    if importlib.util.find_spec("fla") is not None and causal:
        try:
            from fla.ops.linear_attn.naive import naive_chunk_linear_attn

            def fla_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                # fla-core 0.6 lays inputs out tokens first, (B, N, H, D)
                out = naive_chunk_linear_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), normalize=True)
                return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

            found.append(_Impl("fla naive_chunk", fla_reference, "linear", config.dim, lambda n: n % 64 == 0))
        except Exception as error:  # a peer's API drift must not break our benchmark
            print(f"fla found but not usable: {error!r}")
    if importlib.util.find_spec("performer_pytorch") is not None:
        try:
            from performer_pytorch import FastAttention

            features = 256
            performer = FastAttention(dim_heads=config.dim, nb_features=features, causal=causal).to(config.device)
            found.append(_Impl("performer-pytorch", performer, "linear", features))
        except Exception as error:
            print(f"performer-pytorch found but not usable: {error!r}")
    return found


def _impls(config: BenchConfig, causal: bool) -> list[_Impl]:
    impls = []
    for map_name in config.maps:
        fmap = feature_maps.create(map_name, head_dim=config.dim).to(config.device)
        features = int(fmap.output_dim(config.dim))
        for form in config.forms:
            if (causal and form == "global") or (not causal and form == "recurrent"):
                continue

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: str = form, fmap: Any = fmap) -> Any:
                return linear_attention(q, k, v, feature_map=fmap, causal=causal, form=form)

            impls.append(_Impl(f"linattn {form} {map_name}", run, "linear", features))
            for decay in config.decays if causal else []:
                label = f"linattn {form} {map_name} +{decay}"
                impls.append(_Impl(label, _decayed(decay, form, fmap), "linear", features))
    if config.sdpa:

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        impls.append(_Impl("sdpa", sdpa, "sdpa", config.dim))
    if config.peers:
        impls.extend(_peers(config, causal))
    return impls


def _decayed(decay: str, form: str, fmap: Any) -> Attention:
    """Causal attention with a decay; gates come from the queries (cheap, and differentiable like a model's)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        options: dict[str, Any] = {}
        if decay == "decay":
            options["decay"] = 1 - 2.0 ** (-5.0 - torch.arange(q.shape[-3], device=q.device))
        elif decay == "gate":
            options["log_gate"] = F.logsigmoid(q[..., 0] + 3)  # (..., N)
        elif decay == "gla":
            options["log_gate"] = F.logsigmoid(q + 3) / 16  # (..., N, D): needs F = D (elu, relu, ...)
        else:
            raise ValueError(f"--decays: unknown {decay!r}; choose from decay, gate, gla")
        return linear_attention(q, k, v, feature_map=fmap, causal=True, form=form, **options)

    return run


def run(config: BenchConfig) -> tuple[list[Result], list[DecodeResult]]:
    """Every implementation over ``config.sizes`` (causal and non-causal), then the decoding benchmark."""
    device = torch.device(config.device)
    dtype = getattr(torch, config.dtype)
    results: list[Result] = []
    for causal in config.causal:
        stopped: set[tuple[str, str]] = set()
        for impl in _impls(config, causal):
            peak = matmul_peak(config.peak_size, device=device)
            for n in config.sizes:
                if not impl.needs(n):
                    continue
                generator = torch.Generator(device=device).manual_seed(n)
                shape = (config.batch, config.heads, n, config.dim)
                q, k, v = (torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(3))
                grad = torch.randn(shape, generator=generator, device=device, dtype=dtype)
                io_bytes = 4 * q.numel() * q.element_size()
                flops = useful_flops(
                    impl.kind, n=n, heads=config.heads, batch=config.batch, features=impl.features,
                    values=config.dim, causal=causal,
                )
                passes: list[tuple[str, Callable[[], Any], int]] = []

                def forward(impl: _Impl = impl, q: Any = q, k: Any = k, v: Any = v) -> None:
                    with torch.no_grad():
                        impl.fn(q, k, v)

                passes.append(("forward", forward, flops))
                if config.backward:
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

                    def training(impl: _Impl = impl, leaves: list[Any] = leaves, grad: Any = grad) -> None:
                        for leaf in leaves:
                            leaf.grad = None
                        impl.fn(*leaves).backward(grad)

                    passes.append(("forward+backward", training, 3 * flops))
                for pass_name, fn, pass_flops in passes:
                    if (impl.name, pass_name) in stopped:
                        continue
                    samples = time_calls(fn, config.repeats, device, max_seconds=config.max_seconds)
                    if len(samples) == 1:
                        stopped.add((impl.name, pass_name))  # larger N would take longer still
                    q1, median, q3 = quartiles(samples)
                    # a run past max_seconds is not repeated for its memory either
                    peak_bytes = peak_memory(fn, device) if config.memory and len(samples) > 1 else -1
                    gflops = pass_flops / median / 1e9
                    results.append(Result(
                        impl.name, causal, pass_name, n, median, q1, q3, len(samples),
                        config.batch * n / median, gflops, gflops / peak, peak_bytes,
                        peak_bytes / io_bytes if peak_bytes >= 0 else float("nan"), peak,
                    ))
                    print(_row(results[-1]), flush=True)
    _speedups(results)
    best = max((r.matmul_peak_gflops for r in results), default=0.0)
    for r in results:  # against the best GEMM rate seen in the run: the load drags each measurement differently
        r.peak_fraction = r.gflops / best
    decode = decode_benchmark(config) if config.decode_contexts else []
    return results, decode


def _speedups(results: list[Result]) -> None:
    sdpa = {(r.causal, r.pass_name, r.n): r.median_s for r in results if r.impl == "sdpa"}
    for r in results:
        base = sdpa.get((r.causal, r.pass_name, r.n))
        r.speedup_vs_sdpa = base / r.median_s if base is not None else None


def decode_benchmark(config: BenchConfig) -> list[DecodeResult]:
    """Seconds per generated token after a context of L tokens: the recurrent step (state F×Dv, whatever L)
    against softmax attention reading an L-token KV cache (cache append not counted)."""
    device = torch.device(config.device)
    dtype = getattr(torch, config.dtype)
    fmap = feature_maps.create(config.maps[0], head_dim=config.dim).to(device)
    rows: list[DecodeResult] = []
    for context in config.decode_contexts:
        generator = torch.Generator(device=device).manual_seed(context)
        shape = (config.batch, config.heads, context, config.dim)
        k, v = (torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in range(2))
        q = torch.randn(config.batch, config.heads, 1, config.dim, generator=generator, device=device, dtype=dtype)
        with torch.no_grad():
            # the state after the context (non-causal global form: same sums, cheapest way to get them)
            _, state = linear_attention(k, k, v, feature_map=fmap, form="global", return_state=True)

            def step(q: torch.Tensor = q, state: Any = state) -> None:
                linear_attention(q, q, q, feature_map=fmap, causal=True, form="recurrent", initial_state=state,
                                 return_state=True)

            def cache_step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                F.scaled_dot_product_attention(q, k, v)

            for name, fn in (("linattn recurrent step", step), ("sdpa kv-cache step", cache_step)):
                q1, median, q3 = quartiles(time_calls(fn, config.decode_steps, device, max_seconds=config.max_seconds))
                rows.append(DecodeResult(name, context, median, q1, q3))
                print(f"decode {name:>24} L={context:>6}: {median * 1e3:8.3f} ms/token "
                      f"(IQR {q1 * 1e3:.3f}–{q3 * 1e3:.3f})", flush=True)
    return rows


def metadata(config: BenchConfig) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "linattn": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_1_5_15": list(load),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
    }


_HEADER = (f"{'impl':<24} {'causal':>6} {'pass':>16} {'N':>6} {'median ms':>10} {'IQR ms':>15} {'tok/s':>9} "
           f"{'GFLOP/s':>8} {'%peak':>6} {'peak MiB':>9} {'×qkvo':>6} {'×sdpa':>6}")


def _row(r: Result) -> str:
    speed = f"{r.speedup_vs_sdpa:6.1f}" if r.speedup_vs_sdpa is not None else f"{'':>6}"
    memory = f"{r.peak_bytes / 2**20:9.1f} {r.io_ratio:6.2f}" if r.peak_bytes >= 0 else f"{'':>9} {'':>6}"
    return (f"{r.impl:<24} {r.causal!s:>6} {r.pass_name:>16} {r.n:>6} {r.median_s * 1e3:10.1f} "
            f"{r.q1_s * 1e3:7.1f}–{r.q3_s * 1e3:<7.1f} {r.tokens_per_s:9.3g} {r.gflops:8.1f} "
            f"{100 * r.peak_fraction:5.1f}% {memory} {speed}")


def table(results: list[Result]) -> str:
    return "\n".join([_HEADER, *(_row(r) for r in results)])


def write(results: list[Result], decode: list[DecodeResult], config: BenchConfig, *, plot: bool = True) -> list[Path]:
    """bench.csv, bench.json (with versions, threads and load), decode.csv and bench.png into ``config.out``."""
    folder = Path(config.out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in results]
    paths = [folder / "bench.csv", folder / "decode.csv", folder / "bench.json"]
    for path, records, kind in ((paths[0], rows, Result), (paths[1], [dataclasses.asdict(d) for d in decode],
                                                          DecodeResult)):
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=[f.name for f in dataclasses.fields(kind)])
            writer.writeheader()
            writer.writerows(records)
    meta = metadata(config)
    payload = {"meta": meta, "results": rows, "decode": [dataclasses.asdict(d) for d in decode]}
    paths[2].write_text(dumps(payload, indent=1))  # strict JSON: null for a missing number
    if plot:
        paths.append(_plot(results, decode, folder / "bench.png", meta))
    return paths


def _plot(results: list[Result], decode: list[DecodeResult], path: Path, meta: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(17, 5))
    series: dict[tuple[str, bool, str], list[Result]] = {}
    for r in results:
        series.setdefault((r.impl, r.causal, r.pass_name), []).append(r)
    for (impl, causal, pass_name), points in series.items():
        label = f"{impl} {'causal' if causal else 'non-causal'} {pass_name}"
        style = "-" if pass_name == "forward" else "--"
        marker = "o" if causal else "s"
        ns = [p.n for p in points]
        axes[0].plot(ns, [p.median_s for p in points], style, marker=marker, label=label)
        measured = [p for p in points if p.peak_bytes >= 0]
        if pass_name == "forward+backward" and measured:
            axes[1].plot([p.n for p in measured], [p.peak_bytes / 2**20 for p in measured], style, marker=marker,
                         label=label)
    for name in sorted({d.impl for d in decode}):
        steps = [d for d in decode if d.impl == name]
        axes[2].plot([d.context for d in steps], [d.step_s * 1e3 for d in steps], marker="o", label=name)
    titles = ("time (s) against N", "peak extra memory, forward+backward (MiB)", "decoding: ms per token")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("context length" if "decoding" in title else "N (tokens)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=6)
    figure.suptitle(f"linattn {meta['linattn']}, torch {meta['torch']}, {meta['threads']} threads, "
                    f"load {meta['load_average_1_5_15'][0]:.1f}; B={meta['config']['batch']}, "
                    f"H={meta['config']['heads']}, D={meta['config']['dim']}, {meta['config']['dtype']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def cli(args: Any) -> int:
    """``linattn bench``: run, print the table, write CSV/JSON/PNG (arguments in :mod:`linattn.cli`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    causal = {"both": [True, False], "causal": [True], "noncausal": [False]}[args.causal]
    config = BenchConfig(
        sizes=args.sizes, batch=args.batch, heads=args.heads, dim=args.dim, forms=args.forms, maps=args.maps,
        causal=causal, backward=not args.no_backward, sdpa=not args.no_sdpa, peers=not args.no_peers,
        memory=not args.no_memory, repeats=args.repeats, max_seconds=args.max_seconds,
        decode_contexts=[] if args.no_decode else args.decode_contexts, dtype=args.dtype, device=args.device,
        out=Path(args.out), decays=getattr(args, "decays", []),
    )
    meta = metadata(config)
    print(f"linattn {meta['linattn']}, torch {meta['torch']}, {meta['threads']} threads, "
          f"load average {meta['load_average_1_5_15'][0]:.2f}, device {config.device}")
    print(_HEADER, flush=True)
    results, decode = run(config)
    print("\n" + table(results))
    for path in write(results, decode, config, plot=not args.no_plot):
        print(f"wrote {path}")
    return 0
