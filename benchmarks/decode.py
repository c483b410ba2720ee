"""Time per generated token against context length: linattn's state (flat) vs softmax with a KV cache (grows).

The model is ``examples/associative_recall.py``'s decoder (width, heads, layers below; untrained: timing does not
depend on the weights). For each context length T the prompt is prefilled in one parallel (chunked) pass, then
``--tokens`` tokens are generated one at a time from the carried state; each step is timed alone. The softmax
baseline runs the same projections and MLPs, with attention by ``scaled_dot_product_attention`` over a KV cache of
T entries (filled with random keys and values: only its length matters for time).

Reported per T: median ms/token and the 10–90 % spread (warm-up steps excluded), the state or cache bytes, and the
ratio of each column's 10th percentile to its value at the smallest T (1.0 = flat). The ratio uses the 10th
percentile because on a shared machine the median and the upper tail measure the neighbours' load as much as the
step; the 10th percentile is the step's own cost. Both columns are measured in the same run, interleaved by T.

    python benchmarks/decode.py                       # T = 1k, 4k, 16k, 64k, CPU, all threads
    python benchmarks/decode.py --contexts 1024 65536 --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import torch

from linattn.measure import time_calls


def example(name: str) -> ModuleType:
    """The module of ``examples/NAME.py``, loaded from its file: the model timed here is the example's own, and
    the examples are standalone scripts, not an importable package (nothing is added to the import path)."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


RecallLM = example("associative_recall").RecallLM


def linattn_decode(
    model: RecallLM, context: int, tokens: int, warmup: int, device: torch.device
) -> tuple[list[float], int]:
    """Per-token times after prefilling ``context`` tokens, and the bytes of the carried state (all layers)."""
    vocab = model.head.out_features
    prompt = torch.randint(vocab, (1, context), device=device)
    with torch.no_grad():
        logits, caches = model.prefill(prompt)
        token = logits[:, -1].argmax(-1)
        carried = {"caches": caches, "token": token}

        def step() -> None:
            logits, carried["caches"] = model.step(carried["token"], carried["caches"])
            carried["token"] = logits.argmax(-1)

        times = time_calls(step, tokens, device, warmup=warmup)
    state_bytes = sum(
        t.numel() * t.element_size()
        for c in carried["caches"]
        for t in (c.state.kv, c.state.k_sum, c.state.shift, c.previous)
    )
    return times, state_bytes


def softmax_decode(
    model: RecallLM, context: int, tokens: int, warmup: int, device: torch.device
) -> tuple[list[float], int]:
    """The same decoder with softmax attention over a KV cache of ``context`` entries (per-token times, bytes)."""
    heads, head_dim = model.blocks[0].attn.num_heads, model.blocks[0].attn.head_dim
    total = context + warmup + tokens
    caches = [(torch.randn(1, heads, total, head_dim, device=device), torch.randn(1, heads, total, head_dim,
                                                                                  device=device))
              for _ in model.blocks]
    state = {"length": context, "token": torch.zeros(1, dtype=torch.long, device=device),
             "previous": [torch.zeros(1, model.embed.embedding_dim, device=device) for _ in model.blocks]}

    def step() -> None:
        x = model.embed(state["token"]).unsqueeze(1)  # (1, 1, E)
        n = state["length"]
        for i, block in enumerate(model.blocks):
            attn = block.attn
            h = block.attn_norm(x)
            mixed = h + block.shift(state["previous"][i].unsqueeze(1))
            state["previous"][i] = h[:, -1]
            q, k, v = (proj(mixed).view(1, 1, heads, head_dim).transpose(1, 2)
                       for proj in (attn.q_proj, attn.k_proj, attn.v_proj))  # (1, H, 1, D)
            keys, values = caches[i]
            keys[:, :, n : n + 1], values[:, :, n : n + 1] = k, v
            out = torch.nn.functional.scaled_dot_product_attention(q, keys[:, :, : n + 1], values[:, :, : n + 1])
            x = x + attn.out_proj(out.transpose(1, 2).flatten(-2))
            x = x + block.mlp(block.mlp_norm(x))
        state["token"] = model.head(model.norm(x))[:, -1].argmax(-1)
        state["length"] = n + 1

    with torch.no_grad():
        times = time_calls(step, tokens, device, warmup=warmup)
    cache_bytes = sum(k[:, :, :context].numel() * k.element_size() * 2 for k, _ in caches)
    return times, cache_bytes


def summary(times: list[float]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile, in ms."""
    ms = sorted(t * 1e3 for t in times)
    return statistics.median(ms), ms[int(0.1 * (len(ms) - 1))], ms[int(0.9 * (len(ms) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description="time per generated token vs context length")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--tokens", type=int, default=64, help="timed generated tokens per context")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--feature-map", default="elu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-softmax", action="store_true", help="skip the KV-cache baseline")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = RecallLM(64, width=args.width, heads=args.heads, layers=args.layers, feature_map=args.feature_map)
    model = model.to(device).eval()
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"decode: width {args.width}, {args.heads} heads, {args.layers} layers, map {args.feature_map}, fp32, "
          f"batch 1, {where}; {args.tokens} timed tokens per context after {args.warmup} warm-up")
    print(f"{'context':>8} | {'linattn ms/token':>24} {'state':>9} {'vs first':>8} | "
          f"{'softmax+KV ms/token':>24} {'cache':>9} {'vs first':>8}")
    print(f"{'':>8} | {'median [p10–p90]':>24} {'':>9} {'(p10)':>8} | {'median [p10–p90]':>24} {'':>9} {'(p10)':>8}")
    first: dict[str, float] = {}  # 10th percentile at the first context
    for context in args.contexts:
        row = [f"{context:>8}"]
        runs = [("linattn", linattn_decode)] + ([] if args.no_softmax else [("softmax", softmax_decode)])
        for name, run in runs:
            times, size = run(model, context, args.tokens, args.warmup, device)
            median, low, high = summary(times)
            first.setdefault(name, low)
            row.append(f"{median:>8.3f} [{low:>6.3f}–{high:>6.3f}] {size / 2**20:>7.2f}MB {low / first[name]:>8.2f}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
