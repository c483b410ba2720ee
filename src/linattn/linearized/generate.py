"""``linattn generate``: text from a linearized decoder, streamed, with what it cost per token.

    linattn generate out/smollm2-lin --prompt "The river" --max-new-tokens 64 --compare-softmax --plot gen.png

MODEL is a folder written by :func:`~linattn.linearized.folder.save_linearized` (``linattn linearize``), or a
causal LM (``smollm2``, a folder, a GGUF file, a model in the local Hugging Face cache) run as shipped, or
linearized on the spot with ``--linear`` (elu+1 beside a softmax window of 64 tokens and 4 sinks: no fitted maps
ship with linattn, so this is the untrained hybrid). Decoding is greedy. After the text: the decoding rate
(tokens/s after the prompt), the prompt's time, the bytes of the cache after the last token (linear: the states;
softmax: every key and value) and the peak memory (CUDA: allocated; CPU: the process's resident memory, sampled at
each token). ``--compare-softmax`` generates with the original model too and prints both side by side, the original
with the same one-token linear layers and decoder-layer route as the linearized model
(:func:`~linattn.nn.token_linear.lean_linears`, :mod:`linattn.hf_decode`), so that the two differ in their attention
alone; ``--plot`` draws ms/token and cache bytes against position.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import hf
from ..data import check_text_file
from ..errors import LinearAttentionError
from ..evaluate.models import check_model_name, is_causal_lm, load_model, looks_causal
from ..hf_decode import install as install_decoding
from ..nn.token_linear import lean_linears
from .folder import is_linearized, load_linearized, read_index, shipped


@dataclass
class Generation:
    """One greedy generation and its measurements (``times``: seconds at each new token, from the call's start)."""

    label: str
    text: str = ""
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    times: list[float] = field(default_factory=list)
    cache_bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_kind: str = "CUDA allocated"

    @property
    def tokens_per_second(self) -> float | None:
        """New tokens after the first over the time they took (the prompt's time excluded); None with fewer than
        two new tokens (the first comes with the prompt: there is no decoding time to divide by)."""
        if len(self.times) < 2:
            return None
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    @property
    def ms_per_token(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:], strict=False)]


def cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers cache: a LinearAttentionCache's states, or a softmax cache's keys and values."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def new_cache(model: Any) -> Any:
    """An empty cache for ``model``: a LinearAttentionCache when it is linearized, else transformers' own."""
    if model.config._attn_implementation == hf.IMPLEMENTATION:
        from ..hf_cache import LinearAttentionCache

        return LinearAttentionCache()
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def generate_measured(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, label: str,
                      stream: bool = True, decode_threads: int = 0) -> Generation:
    """Greedy generation of ``max_new_tokens`` tokens after ``prompt``, streamed to stdout when ``stream``;
    ``decode_threads`` > 0: torch's threads for the tokens after the first (the prompt keeps the caller's)."""
    from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

    cache = new_cache(model)
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    if ids.shape[1] < 1:
        raise LinearAttentionError("--prompt: the prompt has no tokens; pass some text")
    run = Generation(label)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        run.peak_kind = "process RSS"
    start = time.perf_counter()

    prompt_threads = torch.get_num_threads()

    class Clock(StoppingCriteria):  # called after each new token: its time, the cache, the memory
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
            if not run.times and decode_threads > 0:  # the prompt is read: the steps from here on
                torch.set_num_threads(decode_threads)
            run.times.append(time.perf_counter() - start)
            run.cache_bytes.append(cache_bytes(cache))
            if not cuda:
                run.peak_bytes = max(run.peak_bytes, _resident_bytes())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    streamer = TextStreamer(tokenizer, skip_prompt=True) if stream else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    try:
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, streamer=streamer, attention_mask=torch.ones_like(
                                     ids), stopping_criteria=StoppingCriteriaList([Clock()]))
    finally:
        torch.set_num_threads(prompt_threads)
    if cuda:
        run.peak_bytes = torch.cuda.max_memory_allocated(device)
    run.prefill_seconds = run.times[0] if run.times else 0.0
    run.new_tokens = out.shape[1] - ids.shape[1]
    run.text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return run


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """(model, tokenizer, original or None, label): what ``args`` asks to generate with."""
    name = args.model
    if is_linearized(name):
        model, tokenizer = load_linearized(name, sparse_cache=args.sparse_cache)
        original = None
        if args.compare_softmax:
            original, _, _ = load_model(read_index(name)["base"]["model"], causal_lm=True)
        return model, tokenizer, original, "linearized"
    check_model_name(name)
    if not looks_causal(name):
        raise LinearAttentionError(
            f"model: {name!r} is not a causal LM (its config names no *ForCausalLM architecture); linattn generate "
            "needs a decoder such as smollm2, or a folder written by `linattn linearize`"
        )
    if args.compare_softmax and not args.linear:
        raise LinearAttentionError("--compare-softmax: the model runs softmax attention already; add --linear, or "
                                   "pass a folder written by `linattn linearize`")
    model, tokenizer, _ = load_model(name, causal_lm=True)
    if not is_causal_lm(model):
        raise LinearAttentionError(f"model: {name!r} loaded as {type(model).__name__}, not a *ForCausalLM")
    original = load_model(name, causal_lm=True)[0] if args.compare_softmax and args.linear else None
    if args.linear and shipped(name) is not None and not args.untrained:
        folder = shipped(name)
        assert folder is not None
        del model
        model, tokenizer = load_linearized(folder, base=name, sparse_cache=args.sparse_cache)
        return model, tokenizer, original, f"linearized (the maps shipped with linattn{_cached(args)})"
    if args.linear:
        hf.linearize(model, "elu", window=args.window, sinks=args.sinks, sparse_cache=args.sparse_cache)
        return model, tokenizer, original, f"linearized (elu, window {args.window}, sinks {args.sinks})"
    return model, tokenizer, None, "softmax"


def _cached(args: argparse.Namespace) -> str:
    return f", sparse cache {args.sparse_cache}" if args.sparse_cache else ""


def _rate(run: Generation) -> str:
    rate = run.tokens_per_second
    return "n/a (1 token)" if rate is None else f"{rate:.1f}"


def _ms_ends(run: Generation) -> str:
    """Mean ms per token over the first and over the last quarter of the new tokens (at least one each)."""
    ms = run.ms_per_token
    if len(ms) < 2:
        return "n/a (< 3 tokens)"
    part = max(1, len(ms) // 4)
    return f"{sum(ms[:part]) / part:.1f} → {sum(ms[-part:]) / part:.1f}"


def _bytes_ends(run: Generation) -> str:
    if not run.cache_bytes:
        return "0"
    first, last = run.cache_bytes[0], run.cache_bytes[-1]
    return f"{last:,}" if first == last else f"{first:,} → {last:,}"


# each row of the summary: its title, its value for a run, and what the number means (printed under the table)
_ROWS = (
    ("new tokens", lambda r: f"{r.new_tokens}", "tokens generated after the prompt (greedy)"),
    ("tokens/s (after prompt)", _rate, "decoding rate: the new tokens after the first over the time they took "
     "(the first comes with the prompt)"),
    ("ms/token, first → last quarter", _ms_ends, "mean time per new token at the start and at the end of the "
     "generation: flat when each token costs the same however long the context"),
    ("prompt ms", lambda r: f"{r.prefill_seconds * 1e3:.1f}", "time to read the prompt and make the first token"),
    ("cache bytes, first → last token", _bytes_ends, "what the model keeps between tokens (linear: fixed-size "
     "states; softmax: every key and value so far, growing with each token); one number when it never changed"),
)


def _summary(runs: list[Generation]) -> list[str]:
    width = max(24, *(len(run.label) + 2 for run in runs))
    peak = (f"peak memory MiB ({runs[0].peak_kind})", lambda r: f"{r.peak_bytes / 2**20:.1f}",
            "the most memory held so far (CPU: the process's resident memory, every loaded model's weights included, "
            "so a run's peak includes the runs above it; CUDA: allocated during the run)")
    rows = (*_ROWS, peak)
    lines = [f"{'':<34}" + "".join(f"{run.label:>{width}}" for run in runs)]
    lines += [f"{title:<34}" + "".join(f"{value(run):>{width}}" for run in runs) for title, value, _ in rows]
    lines += ["", *(f"{title.split(' (')[0].split(',')[0]}: {meaning}" for title, _, meaning in rows)]
    return lines + _break_even(runs)


def _break_even(runs: list[Generation]) -> list[str]:
    """With a run whose cache stayed one size and one whose cache grew: the context at which they hold the same."""
    fixed = [run for run in runs if len(run.cache_bytes) > 1 and run.cache_bytes[0] == run.cache_bytes[-1]]
    growing = [run for run in runs if len(run.cache_bytes) > 1 and run.cache_bytes[-1] > run.cache_bytes[0]]
    if not fixed or not growing:
        return []
    per_token = (growing[0].cache_bytes[-1] - growing[0].cache_bytes[0]) / (len(growing[0].cache_bytes) - 1)
    tokens = fixed[0].cache_bytes[-1] / per_token
    return [f"break-even: the {fixed[0].label} states hold as many bytes as the {growing[0].label} cache of "
            f"{tokens:,.0f} tokens ({per_token:,.0f} bytes per token); at longer contexts they are the smaller"]


def plot(runs: list[Generation], path: str) -> None:
    """ms/token and cache bytes against the new token's position, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise LinearAttentionError("--plot: needs matplotlib (pip install matplotlib)") from error
    fig, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        time_axis.plot(range(2, len(run.times) + 1), run.ms_per_token, label=run.label)
        memory_axis.plot(range(1, len(run.cache_bytes) + 1), [b / 2**20 for b in run.cache_bytes], label=run.label)
    time_axis.set(xlabel="new token", ylabel="ms per token", title="time per token")
    memory_axis.set(xlabel="new token", ylabel="cache MiB", title="cache after each token")
    for axis in (time_axis, memory_axis):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shown(prompt: str, tokens: int) -> str:
    """The prompt as echoed above a run: whole when short, else its two ends and its length in tokens."""
    flat = " ".join(prompt.split())
    return flat if len(flat) <= 160 else f"{flat[:70]} … {flat[-70:]} ({tokens:,} tokens)"


def cli(args: argparse.Namespace) -> int:
    """``linattn generate`` (options in :func:`linattn.cli`)."""
    if args.prompt_file is not None:
        check_text_file(args.prompt_file, "--prompt-file")
        with open(args.prompt_file, encoding="utf-8") as handle:
            args.prompt = handle.read().strip()
    if args.max_new_tokens < 1:
        raise LinearAttentionError(f"--max-new-tokens: need ≥ 1, got {args.max_new_tokens}")
    threads, decode_threads = getattr(args, "threads", 0), getattr(args, "decode_threads", 0)
    if threads < 0 or decode_threads < 0:
        raise LinearAttentionError(f"--threads/--decode-threads: need ≥ 0 (0: torch's default, or as for the "
                                   f"prompt), got {threads}/{decode_threads}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise LinearAttentionError(f"--plot: the folder of {args.plot!r} does not exist")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _generate(args, decode_threads)
    finally:
        torch.set_num_threads(before)


def _generate(args: argparse.Namespace, decode_threads: int) -> int:
    model, tokenizer, original, label = _load(args)
    if original is not None:
        lean_linears(original)  # the linearized model's linear layers and decoding route: the two differ in
        install_decoding(original)  # their attention alone
    runs = []
    for run_label, chosen in ((label, model), ("softmax (original)", original)):
        if chosen is None:
            continue
        print(f"--- {run_label}: {_shown(args.prompt, len(tokenizer(args.prompt)['input_ids']))}", flush=True)
        runs.append(generate_measured(chosen, tokenizer, args.prompt, args.max_new_tokens, run_label,
                                      decode_threads=decode_threads))
        sys.stdout.flush()
    print("\n".join(_summary(runs)))
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0
