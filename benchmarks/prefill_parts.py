"""Where a linearized model's prefill goes: its attention calls layer by layer, and everything else.

The shipped SmolLM2 folder (or ``--linearized DIR``) reads one prompt of N tokens, alternating in rounds between
its own attention and a pass-through attention function in the same model (each query's output is its own token's
value, as ``linattn bench --floor`` times it, with the cache's bookkeeping kept), so that both runs share every
other part: the projections, the rotary embedding, the norms, the MLP. It prints, per round, the whole prefill with
each and the attention calls' sum; then, by median over the rounds, the attention's time in layers whose heads
keep no exact pair and in each layer with a sparse cache (with how many heads keep pairs there), and a 2048² fp32
matrix product's GFLOP/s before the first round and after the last (the machine's large-product rate on the same
threads). The attention's share is what any attention kernel could still win: with a prefill P, the floor F and
an original model's prefill O, the linearized model reads the prompt O / P times as fast, and O / F bounds that
ratio.

    .venv/bin/python benchmarks/prefill_parts.py [--tokens 8192] [--rounds 3] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
import transformers.models.llama.modeling_llama as llama

import linattn.hf as hf
from linattn import hf_cache
from linattn.allocator import reuse_freed_memory
from linattn.linearized.folder import load_linearized, shipped
from linattn.linearized.generate import new_cache
from linattn.linearized.speed import prompt_ids


def pass_through(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each query's output is its own token's value (B, Nq, H, dv); the cache layer's keys are taken as consumed."""
    hf_cache.pending_layer(module, key)
    heads, queries = query.shape[1], query.shape[2]
    own = value[:, :, value.shape[2] - queries:]
    return own.repeat_interleave(heads // value.shape[1], 1).transpose(1, 2).contiguous(), None


def matmul_rate(size: int = 2048, tries: int = 5) -> float:
    """This machine's large-product rate on the current threads: GFLOP/s of a size² fp32 ``torch.mm``, best of
    ``tries``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def keeping_heads(model: Any) -> dict[int, int]:
    """Per layer, how many of its heads keep exact pairs (a sparse cache of a positive size)."""
    out = {}
    for module in hf.attention_modules(model):
        options = getattr(module, hf.OPTIONS_ATTRIBUTE, None) or {}
        cache = options.get("sparse_cache")
        sizes = getattr(cache, "size", ()) if cache is not None else ()
        sizes = sizes if isinstance(sizes, (tuple, list)) else [sizes] * module.config.num_attention_heads
        out[module.layer_idx] = sum(1 for s in sizes if s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linearized", default=None, help="a linearized folder (default: the shipped SmolLM2)")
    parser.add_argument("--out", default=None, help="write the measurements as JSON")
    args = parser.parse_args()
    reuse_freed_memory()  # as the linattn command does: large tensors without page faults
    torch.set_num_threads(args.threads)
    rates = [matmul_rate()]
    model, tokenizer = load_linearized(args.linearized or shipped("smollm2"))
    ids = prompt_ids(tokenizer, args.tokens)
    names = [name for name, fn in llama.ALL_ATTENTION_FUNCTIONS.items() if fn is hf.linattn_attention_forward]
    if not names:
        raise SystemExit("the model's attention is not linattn's: load a linearized folder")
    timed_layers: dict[int, float] = {}
    own = hf._layer_attention

    def timed(module: Any, layer: Any, *rest: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = own(module, layer, *rest)
        timed_layers[module.layer_idx] = timed_layers.get(module.layer_idx, 0.0) + time.perf_counter() - start
        return out

    def prefill(through: bool) -> float:
        for name in names:
            llama.ALL_ATTENTION_FUNCTIONS[name] = pass_through if through else hf.linattn_attention_forward
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=new_cache(model), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    hf._layer_attention = timed  # the attention function's work after the argument checks, per layer
    try:
        prefill(False)  # the kernels built and loaded, outside the timing
        keeping = keeping_heads(model)
        rounds = []
        for index in range(args.rounds):
            timed_layers.clear()
            whole = prefill(False)
            layers = dict(timed_layers)
            floor = prefill(True)
            rounds.append({"prefill_s": whole, "pass_through_s": floor, "attention_s": sum(layers.values()),
                           "layers_s": layers})
            print(f"round {index + 1}: prefill {whole:.2f} s, with a pass-through attention {floor:.2f} s, "
                  f"the attention calls {sum(layers.values()):.2f} s", flush=True)
    finally:
        hf._layer_attention = own
        for name in names:
            llama.ALL_ATTENTION_FUNCTIONS[name] = hf.linattn_attention_forward

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    rates.append(matmul_rate())
    plain = [i for i, k in keeping.items() if k == 0]
    cached = [i for i, k in keeping.items() if k > 0]
    per_layer = {i: statistics.median(r["layers_s"][i] for r in rounds) for i in keeping}
    print(f"{args.tokens} tokens, {args.threads} threads, medians of {args.rounds} rounds: prefill "
          f"{median('prefill_s'):.2f} s, pass-through {median('pass_through_s'):.2f} s, attention "
          f"{median('attention_s'):.2f} s; a 2048² matrix product {rates[0]:.0f} and {rates[1]:.0f} GFLOP/s")
    if plain:
        print(f"  {len(plain)} layers without exact pairs: {1e3 * statistics.median(per_layer[i] for i in plain):.0f} "
              f"ms a layer (median), {sum(per_layer[i] for i in plain):.2f} s together")
    for i in cached:
        print(f"  layer {i:2d} (heads keeping pairs: {keeping[i]}): {1e3 * per_layer[i]:.0f} ms")
    if args.out:
        meta = {"tokens": args.tokens, "threads": args.threads, "rounds": args.rounds, "machine": platform.machine(),
                "torch": torch.__version__, "keeping_heads": keeping,
                "matmul_gflops": rates}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rounds": rounds}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
