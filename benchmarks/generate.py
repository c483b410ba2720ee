"""Generation with linattn's state cache: the per-layer decode step, and time/memory per token inside ``generate``.

Part ``step`` (no model): one attention layer's step for one new token, from a state after ``--context`` tokens,
timed three ways in alternating rounds (median of the rounds' medians):

- ``linear_attention``: ``linear_attention(q, k, v, causal=True, initial_state=s, return_state=True)`` — what the
  cache did before the lean step (validation, dtype handling, new state tensors per call);
- ``DecodeStep``: :class:`linattn.decode.DecodeStep` (validated once, state preallocated and updated in place);
- ``hf attention``: the whole ``"linattn"`` attention function as ``generate`` calls it with a
  ``LinearAttentionCache`` (mask handling, scale, GQA, the step, the transpose).

Part ``layer``: one ``linattn.nn.LinearAttention`` layer (E = H·d, projections included) decoding one token after
``--context``: ``layer(x, state=s, return_state=True)`` against ``layer.decoder(s)(x)``, in alternating rounds.

Part ``generate``: a linearized causal LM (default: SmolLM2-135M, elu+1 maps; ``--maps FILE`` for fitted ones)
generates ``--new`` tokens greedily after a ``--prompt``-token prompt. Every generated token's wall time is
recorded (a stopping criterion called once per token), wall and this process's CPU time (on a shared machine
the wall time also measures the neighbours' load, which changes during a long run; with one thread the CPU time is
the step's own cost), and so are the time spent in the attention layers' steps,
the cache's bytes and the process's resident memory. Reported: median ms/token over the first and the last 512
tokens and their ratio (flat = 1.0), wall and CPU, ms per layer step inside ``generate``, state bytes and RSS at
start and end.

    python benchmarks/generate.py --part step                  # ~10 s
    python benchmarks/generate.py --part step --window 64      # the window hybrid's step (4 sinks)
    python benchmarks/generate.py --part layer                 # nn.LinearAttention: layer(x, state=) vs decoder(x)
    python benchmarks/generate.py --part generate              # SmolLM2, 4,096 tokens after 512: minutes on CPU

Threads: ``--threads`` (default 1: the per-token work is small; more threads mostly add synchronisation).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

from linattn import linear_attention
from linattn.decode import DecodeStep, WindowDecodeStep, supports_window
from linattn.feature_maps import create


def _median_ms(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _step_times(heads: int, kv_heads: int, name: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Median ms of one step by linear_attention, by DecodeStep and through the hf attention function."""
    import linattn.hf as hf
    from linattn.hf_cache import LinearAttentionCache

    per_head = {"num_heads": heads} if name == "hedgehog" else {}  # a fitted map is per head
    fmap = create(name, head_dim=args.dim, **per_head)
    q = torch.randn(1, heads, 1, args.dim)
    k, v = torch.randn(1, kv_heads, 1, args.dim), torch.randn(1, kv_heads, 1, args.dim)
    context = (torch.randn(1, kv_heads, args.context, args.dim),) * 2
    options = {"window": args.window, "sinks": args.sinks} if args.window else {}
    _, state = linear_attention(torch.randn(1, heads, args.context, args.dim), *context, feature_map=fmap,
                                causal=True, return_state=True, **options)
    if args.window and not supports_window(fmap, state, options):  # log-space maps: linear_attention's path
        return math.nan, math.nan, math.nan
    step = WindowDecodeStep(fmap, state, kv_heads=kv_heads) if args.window else DecodeStep(fmap, state)
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0  # type: ignore[assignment]
    module.linattn_feature_map = fmap
    module.linattn_options = options
    cache = LinearAttentionCache()
    cache.update(*context, 0)  # the prefill goes through the function once
    hf.linattn_attention_forward(module, torch.randn(1, heads, args.context, args.dim), *context, None)

    def old() -> None:
        linear_attention(q, k, v, feature_map=fmap, causal=True, initial_state=state, return_state=True, **options)

    def new() -> None:
        step(q, k, v)

    def whole() -> None:
        key, value = cache.update(k, v, 0)
        hf.linattn_attention_forward(module, q, key, value, None, scaling=args.dim**-0.5)

    rounds: dict[str, list[float]] = {"old": [], "new": [], "whole": []}
    with torch.no_grad():
        for _ in range(args.rounds):
            for label, fn in (("old", old), ("new", new), ("whole", whole)):
                rounds[label].append(_median_ms(fn, args.calls))
    o, n, w = (statistics.median(rounds[label]) for label in ("old", "new", "whole"))
    return o, n, w


def step_part(args: argparse.Namespace) -> None:
    hybrid = f", window {args.window} + {args.sinks} sinks (WindowDecodeStep)" if args.window else ""
    print(f"one layer's decode step, B=1, d={args.dim}, fp32, {torch.get_num_threads()} thread(s), median of "
          f"{args.rounds} alternating rounds of {args.calls} calls (ms){hybrid}")
    print(f"{'H/Hkv':>7} {'map':>8} {'linear_attention':>17} {'DecodeStep':>11} {'hf attention':>13} {'speed-up':>9}")
    for heads, kv_heads in ((8, 8), (9, 3)):
        for name in args.step_maps:
            o, n, w = _step_times(heads, kv_heads, name, args)
            print(f"{heads:>3}/{kv_heads:<3} {name:>8} {o:>17.3f} {n:>11.3f} {w:>13.3f} {o / n:>8.1f}x")


def layer_part(args: argparse.Namespace) -> None:
    """``linattn.nn.LinearAttention`` decoding one token: the layer with a state against its ``decoder(state)``."""
    from linattn.nn import LinearAttention

    hybrid = f", window {args.window} + {args.sinks} sinks" if args.window else ""
    if args.delta:
        hybrid += ", Gated DeltaNet layer (update='delta', gate='token', short_conv=4, output_gate=True)"
    print(f"nn.LinearAttention, one token after {args.context}, B=1, d={args.dim}, fp32, "
          f"{torch.get_num_threads()} thread(s), median of {args.rounds} alternating rounds of {args.calls} calls "
          f"(ms, projections included){hybrid}")
    print(f"{'H/Hkv':>7} {'map':>8} {'layer(x, state=)':>17} {'decoder(x)':>11} {'speed-up':>9}")
    options: dict[str, Any] = {"window": args.window, "sinks": args.sinks} if args.window else {}
    if args.delta:
        options.update(update="delta", gate="token", short_conv=4, output_gate=True)
    for heads, kv_heads in ((8, 8), (9, 3)):
        for name in args.step_maps:
            layer = LinearAttention(heads * args.dim, heads, num_kv_heads=kv_heads, feature_map=name, causal=True,
                                    **options)
            x = torch.randn(1, 1, heads * args.dim)
            with torch.no_grad():
                _, state = layer(torch.randn(1, args.context, heads * args.dim), return_state=True)
                decoder = layer.decoder(state)

                def old(layer: Any = layer, x: torch.Tensor = x, state: Any = state) -> None:
                    layer(x, state=state, return_state=True)

                rounds: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(args.rounds):
                    rounds["old"].append(_median_ms(old, args.calls))
                    rounds["new"].append(_median_ms(lambda d=decoder, x=x: d(x), args.calls))
            o, n = (statistics.median(rounds[label]) for label in ("old", "new"))
            print(f"{heads:>3}/{kv_heads:<3} {name:>8} {o:>17.3f} {n:>11.3f} {o / n:>8.1f}x")


def generate_part(args: argparse.Namespace) -> None:
    from transformers import StoppingCriteria, StoppingCriteriaList

    import linattn.hf as hf
    import linattn.hf_cache as hf_cache
    from linattn.data import load_text
    from linattn.evaluate import load_model

    model, tokenizer, name = load_model(args.model)
    hf.linearize(model, args.maps or "elu")
    text = load_text("heldout") + "\n\n" + load_text("train")
    ids = torch.tensor(tokenizer(text)["input_ids"][: args.prompt])[None]  # (1, prompt)
    if ids.shape[1] < args.prompt:
        ids = ids.repeat(1, args.prompt // ids.shape[1] + 1)[:, : args.prompt]

    step_times: list[float] = []
    original = hf_cache.attend

    def timed_attend(layer: Any, *rest: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = original(layer, *rest)
        if rest[1].shape[-2] == 1:  # one query: a decode step (the prefill is not counted)
            step_times.append(time.perf_counter() - start)
        return out

    token_times: list[float] = []
    cpu_times: list[float] = []
    state_bytes: list[int] = []
    rss: list[int] = []
    cache = hf_cache.LinearAttentionCache()

    class Clock(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
            token_times.append(time.perf_counter())
            cpu_times.append(time.process_time())
            state_bytes.append(cache.nbytes())
            rss.append(_rss())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)  # type: ignore[return-value]

    hf_cache.attend = timed_attend  # type: ignore[assignment]
    try:
        with torch.no_grad():
            model.generate(ids, cache=cache, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id, stopping_criteria=StoppingCriteriaList([Clock()]))
    finally:
        hf_cache.attend = original  # type: ignore[assignment]
    per_token = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]  # s between tokens
    per_token_cpu = [b - a for a, b in zip(cpu_times, cpu_times[1:], strict=False)]
    window = min(512, len(per_token) // 2)
    first, last = statistics.median(per_token[:window]) * 1e3, statistics.median(per_token[-window:]) * 1e3
    first_cpu = statistics.median(per_token_cpu[:window]) * 1e3
    last_cpu = statistics.median(per_token_cpu[-window:]) * 1e3
    layers = len(cache.layers)
    print(f"{name}, linearized ({args.maps or 'elu'}), {layers} layers, prompt {ids.shape[1]}, {args.new} new "
          f"tokens, {torch.get_num_threads()} thread(s)")
    print(f"wall ms/token: first {window}: {first:.2f}, last {window}: {last:.2f}, ratio last/first {last / first:.3f}")
    print(f"CPU ms/token (this process): first {window}: {first_cpu:.2f}, last {window}: {last_cpu:.2f}, ratio "
          f"{last_cpu / first_cpu:.3f}")
    print(f"attention step inside generate: {statistics.median(step_times) * 1e3:.3f} ms per layer "
          f"(median of {len(step_times)}), {statistics.median(step_times) * 1e3 * layers:.2f} ms of each token")
    print(f"state bytes: after token 1 {state_bytes[0]:,}, after token {len(state_bytes)} {state_bytes[-1]:,}")
    print(f"resident memory (MiB): after token 1 {rss[0] / 2**20:.1f}, after token {len(rss)} {rss[-1] / 2**20:.1f}")


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["step", "layer", "generate", "both"], default="both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="tokens in the state before the timed step")
    parser.add_argument("--step-maps", nargs="+", default=["elu", "favor+", "hedgehog"])
    parser.add_argument("--window", type=int, default=0, help="step the window hybrid with this window (0: none)")
    parser.add_argument("--sinks", type=int, default=4, help="sinks of the window hybrid (with --window)")
    parser.add_argument("--delta", action="store_true",
                        help="layer part: Gated DeltaNet layers (update='delta', gate='token', short_conv=4, "
                        "output_gate=True)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--maps", default=None, help="fitted maps file (FittedFeatureMaps.save()); default elu")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=4096)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.part in ("step", "both"):
        step_part(args)
    if args.part == "layer":
        layer_part(args)
    if args.part in ("generate", "both"):
        generate_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
