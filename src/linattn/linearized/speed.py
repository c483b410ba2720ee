"""``linattn bench --model NAME``: a linearized causal LM against its original, side by side in one run — the
prompt's time (prefill) and the decoding rate at each context length, the peak memory of the prefill and the
cache's bytes after it.

    linattn bench --model smollm2 --contexts 512 1536 4096 8192 --out out/bench-smollm2

The linearized model is the folder shipped for NAME (``--linearized DIR``: a folder of ``linattn linearize``).
For each context N, in rounds that alternate the two models (a shared machine's load changes during a run): one
prefill of N tokens of the shipped long held-out text (repeated as needed) with a fresh cache, timed (forming the
last position's logits only, as ``generate`` does: ``logits_to_keep=1`` where the model takes it), then
``--new-tokens`` greedy decoding steps from that cache, each timed; the rounds' medians are reported, with the
ratios linearized / original (prefill: original time / linearized time, so > 1 means the linearized model is
faster; decoding: linearized tokens/s / original tokens/s). Before the rounds each model reads a 64-token prompt
untimed, so one-time work (the native kernels' build on a fresh install) is not timed. Peak memory: the highest
point of live allocations during one more prefill (the profiler's allocation events, above what existed before),
measured apart from the timed calls. Threads: ``--threads`` (default 0: torch's); one thread gives each model the
same core on a shared machine.

The linearized model's ``nn.Linear`` layers are :class:`~linattn.nn.token_linear.TokenLinear` (what
:func:`linattn.hf.linearize` installs): a decoding token's projections, MLPs and LM head run a native kernel that
streams the weights (SmolLM2's as their GGUF blocks) faster than torch's BLAS call does, and its decoder layers
run as a few native calls around the attention (:mod:`linattn.hf_decode`), so part of its decoding speed-up over
the original comes from that code, not from its attention. ``--same-linears`` adds the original with the same
layers and the same route (row ``original_lean``): the decoding ratio against it is the attention's alone (the
table's "same linears" column).

``--floor`` adds a model to every round: the original with its attention taken out (each query's output is its own
value; no cache, no mask) and the linearized model's linear layers and decoding route, so only the projections,
the MLPs, the norms and the LM head run, as fast as the linearized model runs them. No attention, linear or not,
can make the model faster than that, so original / floor is the most a linearized model can gain at each context
(the table's bound columns).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .._json import dumps
from ..data import load_text
from ..errors import LinearAttentionError
from ..evaluate.models import check_model_name, load_model
from ..evaluate.perplexity import keeps_logits
from ..hf_decode import install as install_decoding
from ..measure import peak_memory
from ..nn.token_linear import lean_linears
from .folder import atomic_write, load_linearized, shipped
from .generate import cache_bytes, new_cache

FLOOR = "floor"  # the model name of --floor's row
SAME_LINEARS = "original_lean"  # the model name of --same-linears' row
_FLOOR_IMPLEMENTATION = "linattn_floor"


@dataclass
class SpeedRow:
    """One model at one context: medians over the rounds."""

    model: str
    context: int
    prefill_ms: float
    decode_tokens_per_second: float
    peak_prefill_bytes: int | None
    cache_bytes: int
    rounds: int
    prefill_ms_all: list[float] = field(default_factory=list)
    decode_ms_per_token_all: list[float] = field(default_factory=list)


def prompt_ids(tokenizer: Any, length: int) -> torch.Tensor:
    """(1, ``length``) token ids of the shipped long held-out text, repeated as often as needed."""
    text = load_text("heldout_long")
    ids: list[int] = tokenizer(text)["input_ids"]
    if not ids:
        raise LinearAttentionError("the held-out text gave no tokens")
    repeats = -(-length // len(ids))
    return torch.tensor([(ids * repeats)[:length]])


def _last_logits(model: Any) -> dict[str, int]:
    """The prefill's logits as ``generate`` forms them: the last position's only (a 49k-word vocabulary makes all
    N positions' logits a large share of a small model's prefill, and a user's generation never forms them)."""
    return {"logits_to_keep": 1} if keeps_logits(model) else {}


def run_once(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[float], int]:
    """Seconds of the prefill, seconds of each decoding step, the cache's bytes after the prefill. The floor
    (:func:`floor_model`) runs without a cache: each step is the new token alone at its position."""
    cache = _fresh_cache(model)
    floor = cache is None
    with torch.no_grad():
        begin = time.perf_counter()
        out = model(input_ids=ids, **_cached(cache), **_last_logits(model))
        token = out.logits[:, -1:].argmax(-1)
        prefill = time.perf_counter() - begin
        held = cache_bytes(cache) if cache is not None else 0
        steps = []
        for at in range(ids.shape[-1], ids.shape[-1] + new_tokens):
            begin = time.perf_counter()
            where = {"position_ids": torch.tensor([[at]])} if floor else {}
            out = model(input_ids=token, **_cached(cache), **where)
            token = out.logits[:, -1:].argmax(-1)
            steps.append(time.perf_counter() - begin)
    return prefill, steps, held


def _fresh_cache(model: Any) -> Any:
    """A new cache for ``model``'s prefill, or None for the floor (:func:`floor_model`), which runs without one."""
    return None if model.config._attn_implementation == _FLOOR_IMPLEMENTATION else new_cache(model)


def _cached(cache: Any) -> dict[str, Any]:
    return {"cache": cache, "use_cache": True} if cache is not None else {"use_cache": False}


def _pass_through(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The floor's attention function: each query's output is its own token's value (B, Nq, H, dv)."""
    heads, queries = query.shape[1], query.shape[2]
    own = value[:, :, value.shape[2] - queries :]
    return own.repeat_interleave(heads // value.shape[1], 1).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def floor_model(name: str) -> Any:
    """The original model ``name`` with its attention taken out and the linearized model's linear layers (module
    docstring): the time of everything else."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_FLOOR_IMPLEMENTATION, _pass_through)
    AttentionMaskInterface.register(_FLOOR_IMPLEMENTATION, _no_mask)
    model, _, _ = load_model(name, causal_lm=True)
    model.set_attn_implementation(_FLOOR_IMPLEMENTATION)
    lean_linears(model)
    install_decoding(model)
    return model.eval()


def same_linears_model(name: str) -> Any:
    """The original model ``name`` with the linearized model's linear layers and decoding route (module
    docstring)."""
    model, _, _ = load_model(name, causal_lm=True)
    lean_linears(model)
    install_decoding(model)
    return model.eval()


def measure(models: dict[str, Any], tokenizer: Any, contexts: list[int], new_tokens: int, rounds: int,
            memory: bool = True, progress: bool = True) -> list[SpeedRow]:
    """Every model at every context, the models alternating within each round (see the module docstring)."""
    rows = []
    warm = prompt_ids(tokenizer, 64)
    for model in models.values():  # untimed: one-time work (the native kernels' build on a fresh install) lands here
        run_once(model, warm, 2)
    for context in contexts:
        ids = prompt_ids(tokenizer, context)
        prefills: dict[str, list[float]] = {name: [] for name in models}
        steps: dict[str, list[float]] = {name: [] for name in models}
        held: dict[str, int] = {}
        for _ in range(rounds):
            for name, model in models.items():
                prefill, step_seconds, held[name] = run_once(model, ids, new_tokens)
                prefills[name].append(prefill)
                steps[name].append(statistics.median(step_seconds) if step_seconds else float("nan"))
        for name, model in models.items():
            peak = None
            if memory:
                def prefill_call(model: Any = model, ids: torch.Tensor = ids) -> None:
                    with torch.no_grad():
                        model(input_ids=ids, **_cached(_fresh_cache(model)), **_last_logits(model))

                peak = peak_memory(prefill_call, torch.device("cpu"))
            step = statistics.median(steps[name])
            row = SpeedRow(name, context, 1e3 * statistics.median(prefills[name]), 1.0 / step if step > 0 else 0.0,
                           peak, held[name], rounds, [1e3 * s for s in prefills[name]], [1e3 * s for s in steps[name]])
            rows.append(row)
            if progress:
                print(f"{context:>6} tokens  {name:<11} prefill {row.prefill_ms:9.1f} ms   decode "
                      f"{row.decode_tokens_per_second:6.2f} tokens/s", flush=True)
    return rows


def ratios(rows: list[SpeedRow], base: str = "original", other: str = "linearized") -> list[dict[str, Any]]:
    """Per context: prefill speed-up (base ms / other ms) and decoding speed-up (other tokens/s / base tokens/s),
    with the peak memory and cache bytes of both."""
    out = []
    for context in sorted({row.context for row in rows}):
        pair = {row.model: row for row in rows if row.context == context}
        if base not in pair or other not in pair:
            continue
        a, b = pair[base], pair[other]
        out.append({
            "context": context, "prefill_ms": {base: a.prefill_ms, other: b.prefill_ms},
            "prefill_speedup": a.prefill_ms / b.prefill_ms,
            "decode_tokens_per_second": {base: a.decode_tokens_per_second, other: b.decode_tokens_per_second},
            "decode_speedup": b.decode_tokens_per_second / a.decode_tokens_per_second,
            "peak_prefill_mib": {base: _mib(a.peak_prefill_bytes), other: _mib(b.peak_prefill_bytes)},
            "cache_mib": {base: a.cache_bytes / 2**20, other: b.cache_bytes / 2**20},
        })
        if FLOOR in pair:  # the most any attention could gain: the original against the model without one
            floor = pair[FLOOR]
            out[-1]["bound"] = {"prefill_ms": floor.prefill_ms, "prefill_speedup": a.prefill_ms / floor.prefill_ms,
                                "decode_tokens_per_second": floor.decode_tokens_per_second,
                                "decode_speedup": floor.decode_tokens_per_second / a.decode_tokens_per_second}
        if SAME_LINEARS in pair:  # the attention's share: the original with the linearized model's linear layers
            lean = pair[SAME_LINEARS]
            out[-1]["same_linears"] = {"prefill_ms": lean.prefill_ms, "prefill_speedup": lean.prefill_ms / b.prefill_ms,
                                       "decode_tokens_per_second": lean.decode_tokens_per_second,
                                       "decode_speedup": b.decode_tokens_per_second / lean.decode_tokens_per_second}
    return out


def _mib(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def table(summary: list[dict[str, Any]]) -> str:
    """The ratios as a Markdown table."""
    def memory(entry: dict[str, Any]) -> str:
        values = entry["peak_prefill_mib"]
        return "—" if None in values.values() else " / ".join(f"{v:,.0f}" for v in values.values())

    extra = [(key, title) for key, title in (("same_linears", "same linears"), ("bound", "bound"))
             if any(key in entry for entry in summary)]
    lines = ["| context | prefill ms (original / linearized) | prefill speed-up | decode tokens/s (original / "
             "linearized) | decode speed-up | prefill peak MiB | cache MiB |"
             + "".join(f" {title}: prefill / decode |" for _, title in extra),
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra)]
    for entry in summary:
        prefill, decode, cache = entry["prefill_ms"], entry["decode_tokens_per_second"], entry["cache_mib"]
        lines.append(f"| {entry['context']:,} | {' / '.join(f'{v:,.0f}' for v in prefill.values())} | "
                     f"{entry['prefill_speedup']:.2f}× | {' / '.join(f'{v:.2f}' for v in decode.values())} | "
                     f"{entry['decode_speedup']:.2f}× | {memory(entry)} | "
                     f"{' / '.join(f'{v:.1f}' for v in cache.values())} |"
                     + "".join(" — |" if key not in entry else
                               f" {entry[key]['prefill_speedup']:.2f}× / {entry[key]['decode_speedup']:.2f}× |"
                               for key, _ in extra))
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path) -> bool:
    """The two speed-ups against the context length (False when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    contexts = [entry["context"] for entry in summary]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(contexts, [e["prefill_speedup"] for e in summary], "o-", label="prefill (original ms / linearized ms)")
    axis.plot(contexts, [e["decode_speedup"] for e in summary], "s-",
              label="decoding (linearized tokens/s / original)")
    bounded = [e for e in summary if "bound" in e]
    if bounded:  # --floor: the most any attention could gain
        axis.plot([e["context"] for e in bounded], [e["bound"]["prefill_speedup"] for e in bounded], "o--",
                  color="C0", alpha=0.5, label="prefill bound (original / no attention)")
        axis.plot([e["context"] for e in bounded], [e["bound"]["decode_speedup"] for e in bounded], "s--",
                  color="C1", alpha=0.5, label="decoding bound")
    same = [e for e in summary if "same_linears" in e]
    if same:  # --same-linears: the decoding speed-up of the attention alone
        axis.plot([e["context"] for e in same], [e["same_linears"]["decode_speedup"] for e in same], "s:",
                  color="C2", label="decoding, against the original with the same linear layers")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("context (tokens)")
    axis.set_ylabel("speed-up of the linearized model")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def cli(args: argparse.Namespace) -> int:
    """``linattn bench --model NAME``: load both models, measure, print and write bench_model.{json,csv,png}."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if any(n < 1 for n in args.contexts) or args.new_tokens < 1 or args.rounds < 1:
        raise LinearAttentionError(f"--contexts/--new-tokens/--rounds: need ≥ 1, got {args.contexts}, "
                                   f"{args.new_tokens}, {args.rounds}")
    check_model_name(args.model)
    folder = Path(args.linearized) if args.linearized else shipped(args.model)
    if folder is None:
        raise LinearAttentionError(f"--model {args.model}: no linearized folder ships for it; pass --linearized DIR "
                                   "(a folder written by `linattn linearize`)")
    original, tokenizer, _ = load_model(args.model, causal_lm=True)
    linearized, _ = load_linearized(folder, base=args.model)
    threads = torch.get_num_threads()
    print(f"{args.model}: original against {folder} ({threads} thread{'s' if threads != 1 else ''}, "
          f"{args.rounds} round{'s' if args.rounds != 1 else ''}, {args.new_tokens} new tokens)", flush=True)
    models = {"original": original.eval(), "linearized": linearized}
    if args.same_linears:
        models[SAME_LINEARS] = same_linears_model(args.model)
    if args.floor:
        models[FLOOR] = floor_model(args.model)
    rows = measure(models, tokenizer, sorted(args.contexts), args.new_tokens, args.rounds, memory=not args.no_memory)
    summary = ratios(rows)
    print("\n" + table(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"linattn": __version__, "torch": torch.__version__, "threads": threads, "machine": platform.machine(),
            "processor": platform.processor(), "load_average_1_5_15": list(os.getloadavg()), "model": args.model,
            "linearized": str(folder), "new_tokens": args.new_tokens, "rounds": args.rounds,
            "floor": bool(args.floor), "same_linears": bool(args.same_linears)}
    atomic_write(out / "bench_model.json", dumps({"meta": meta, "summary": summary,
                                                  "rows": [asdict(row) for row in rows]}, indent=2))
    with open(out / "bench_model.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "context", "prefill_ms", "decode_tokens_per_second", "peak_prefill_bytes",
                         "cache_bytes", "rounds"])
        for row in rows:
            writer.writerow([row.model, row.context, f"{row.prefill_ms:.3f}", f"{row.decode_tokens_per_second:.4f}",
                             row.peak_prefill_bytes if row.peak_prefill_bytes is not None else "", row.cache_bytes,
                             row.rounds])
    written = ["bench_model.json", "bench_model.csv"]
    if not args.no_plot and plot(summary, out / "bench_model.png"):
        written.append("bench_model.png")
    print(f"wrote {', '.join(str(out / name) for name in written)}")
    return 0
