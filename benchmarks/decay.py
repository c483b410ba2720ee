"""What decays and gates cost: causal chunked attention with a fixed decay, a per-token gate and a per-feature gate
(GLA), each beside the undecayed path in the same rounds; training memory; and packed sequences.

Every variant runs once per round, in turn, so a change of machine load hits all alike; the figure is the median
over rounds, the ratio is to the undecayed path of the same rounds. Memory: the peak of live allocations during
forward+backward as a multiple of the bytes of q, k, v and the output.

    .venv/bin/python benchmarks/decay.py [--n 1024 4096 16384 65536] [--heads 8] [--dim 64] [--rounds 5]
        [--threads 0] [--memory-n 65536] [--packed 256x64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import linattn
from linattn.measure import peak_memory

VARIANTS = ("none", "decay", "gate", "gla")


def make_options(variant: str, heads: int, n: int, dim: int) -> dict[str, Any]:
    if variant == "decay":  # RetNet's per-head rates
        return {"decay": 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float32))}
    if variant == "gate":
        return {"log_gate": F.logsigmoid(torch.randn(1, heads, n) + 3)}
    if variant == "gla":
        return {"log_gate": F.logsigmoid(torch.randn(1, heads, n, dim) + 3) / 16}
    return {}


def leaves(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any], training: bool
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Fresh inputs; in training the decay rates and gates require grad too, as a model's would."""
    qkv = [t.clone().requires_grad_(training) for t in (q, k, v)]
    return qkv, {name: x.clone().requires_grad_(training) for name, x in options.items()}


def run(qkv: list[torch.Tensor], options: dict[str, Any], training: bool) -> None:
    with torch.set_grad_enabled(training):
        out = linattn.linear_attention(*qkv, causal=True, **options)
        if training:
            out.sum().backward()


def timing_table(sizes: list[int], heads: int, dim: int, rounds: int) -> None:
    print(f"{'N':>7} {'pass':<8}" + "".join(f"{v + ' ms':>11}" for v in VARIANTS) + "".join(
        f"{v + ' ×':>9}" for v in VARIANTS[1:]))
    for n in sizes:
        q, k, v = torch.randn(3, 1, heads, n, dim).unbind(0)
        options = {variant: make_options(variant, heads, n, dim) for variant in VARIANTS}
        for training in (False, True):
            times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for _ in range(rounds + 1):  # the first round warms up
                for variant in VARIANTS:
                    inputs = leaves(q, k, v, options[variant], training)
                    start = time.perf_counter()
                    run(*inputs, training)
                    times[variant].append(time.perf_counter() - start)
            ms = {variant: statistics.median(times[variant][1:]) * 1e3 for variant in VARIANTS}
            row = "".join(f"{ms[variant]:>11.1f}" for variant in VARIANTS)
            ratios = "".join(f"{ms[variant] / ms['none']:>9.2f}" for variant in VARIANTS[1:])
            print(f"{n:>7} {'fwd+bwd' if training else 'forward':<8}{row}{ratios}", flush=True)


def memory_table(n: int, heads: int, dim: int) -> None:
    q, k, v = torch.randn(3, 1, heads, n, dim).unbind(0)
    io_bytes = 4 * q.numel() * 4  # q, k, v and the output, fp32
    print(f"\ntraining peak memory at N={n}, forward+backward, inputs made beforehand "
          f"(×bytes of q, k, v, o = {io_bytes / 2**20:.0f} MiB; the gate's own gradient included)")
    for variant in VARIANTS:
        inputs = leaves(q, k, v, make_options(variant, heads, n, dim), True)
        peak = peak_memory(lambda inputs=inputs: run(*inputs, True), q.device)
        print(f"  {variant:<6}{peak / io_bytes:>6.2f}×", flush=True)


def packed_table(count: int, length: int, heads: int, dim: int, rounds: int) -> None:
    n = count * length
    q, k, v = torch.randn(3, heads, n, dim).unbind(0)
    offsets = list(range(0, n + 1, length))
    batched = [t.reshape(heads, count, length, dim).transpose(0, 1) for t in (q, k, v)]  # (S, H, L, D)
    calls: dict[str, Callable[[], Any]] = {
        "packed": lambda: linattn.linear_attention(q, k, v, causal=True, cu_seqlens=offsets),
        # return_state=True takes the per-sequence path (one core call per sequence)
        "packed, loop": lambda: linattn.linear_attention(q, k, v, causal=True, cu_seqlens=offsets, return_state=True),
        "padded batch": lambda: linattn.linear_attention(*batched, causal=True),
        "one sequence": lambda: linattn.linear_attention(q, k, v, causal=True),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["padded batch"][1:])
    print(f"\npacked: {count} sequences of {length} tokens, H={heads} D={dim}, causal forward (ms, × padded batch); "
          "'one sequence': the same tokens with no boundaries")
    for name in calls:
        ms = statistics.median(times[name][1:])
        print(f"  {name:<14}{ms * 1e3:>9.1f}{ms / base:>7.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--memory-n", type=int, default=65536, help="0 skips the memory table")
    parser.add_argument("--packed", default="256x64", help="COUNTxLENGTH; empty skips the packed table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          f"B=1 H={args.heads} d=F={args.dim} (elu) fp32, causal chunked; median of {args.rounds} alternating rounds")
    timing_table(args.n, args.heads, args.dim, args.rounds)
    if args.memory_n:
        memory_table(args.memory_n, args.heads, args.dim)
    if args.packed:
        count, length = (int(x) for x in args.packed.split("x"))
        packed_table(count, length, args.heads, args.dim, args.rounds)


if __name__ == "__main__":
    main()
