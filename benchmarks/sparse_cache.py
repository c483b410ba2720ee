"""What the sparse exact cache costs on CPU: the window op (W = 64, 4 sinks) with and without a cache of λ pairs
per head (and the same total split unevenly across heads), causal forward and forward+backward at N tokens,
alternating in the same rounds; the decoding step (one token from a state after ``--context`` tokens) of the
window op (its lean step) and with the cache (the definition's form from the state, and its lean step
SparseDecodeStep, also with the split); and training memory.

Every variant runs once per round, in turn, so a change of machine load hits all alike; the figure is the median
over rounds. Memory: the peak of live allocations during forward+backward as a multiple of the bytes of q, k, v
and the output.

    .venv/bin/python benchmarks/sparse_cache.py [--n 16384] [--heads 8] [--dim 64] [--size 128] [--rounds 3]
        [--threads 2] [--context 4096] [--memory] [--decoding-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import linattn
from linattn import SparseCache
from linattn.decode import SparseDecodeStep, WindowDecodeStep
from linattn.feature_maps import create
from linattn.measure import peak_memory

WINDOW, SINKS = 64, 4


def make_inputs(n: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, n, dim, generator=g) for _ in range(3))


def uneven(size: int, heads: int) -> SparseCache:
    """The same total as ``size`` per head, split unevenly: a quarter of it for all but one head, the rest there."""
    low = size // 4
    return SparseCache(tuple([low] * (heads - 1) + [size * heads - low * (heads - 1)]))


def variants(size: int, heads: int) -> dict[str, Callable[..., Any]]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
        return linattn.linear_attention(q, k, v, causal=True, window=WINDOW, sinks=SINKS, **options)

    split = uneven(size, heads)
    return {
        "window": call,
        # the equal-memory baseline: the cache's pairs spent on more window (W + λ exact keys, no cache)
        f"window {WINDOW + size}": lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, window=WINDOW + size,
                                                                          sinks=SINKS),
        f"cache {size} recall": lambda q, k, v: call(q, k, v, sparse_cache=SparseCache(size)),
        f"cache {size} attention": lambda q, k, v: call(q, k, v, sparse_cache=SparseCache(size, score="attention")),
        f"split {size // 4}…{split.largest} recall": lambda q, k, v: call(q, k, v, sparse_cache=split),
    }


def run(fn: Callable[..., Any], x: tuple[torch.Tensor, ...], training: bool) -> None:
    inputs = [t.clone().requires_grad_(training) for t in x]
    with torch.set_grad_enabled(training):
        out = fn(*inputs)
        if training:
            out.sum().backward()


def timing(n: int, heads: int, dim: int, size: int, rounds: int) -> None:
    x = make_inputs(n, heads, dim)
    calls = variants(size, heads)
    names = list(calls)
    print(f"{'pass':<8}" + "".join(f"{name + ' ms':>26}" for name in names))
    for training in (False, True):
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(rounds + 1):  # the first round warms up
            for name in names:
                start = time.perf_counter()
                run(calls[name], x, training)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(times[name][1:]) * 1e3 for name in names}
        print(f"{'fwd+bwd' if training else 'forward':<8}" + "".join(f"{ms[name]:>26.1f}" for name in names))
        print("  × window" + "".join(f"{ms[name] / ms['window']:>26.2f}" for name in names))


def decoding(heads: int, dim: int, size: int, context: int, rounds: int) -> None:
    q, k, v = make_inputs(context + 64, heads, dim)
    fmap = create("elu", head_dim=dim)
    head = slice(0, context)
    _, plain_state = linattn.linear_attention(q[..., head, :], k[..., head, :], v[..., head, :], causal=True,
                                              window=WINDOW, sinks=SINKS, feature_map=fmap, return_state=True)
    cache = SparseCache(size)
    _, cache_state = linattn.linear_attention(q[..., head, :], k[..., head, :], v[..., head, :], causal=True,
                                              window=WINDOW, sinks=SINKS, feature_map=fmap, sparse_cache=cache,
                                              return_state=True)
    split = uneven(size, heads)
    low = size // 4
    _, split_state = linattn.linear_attention(q[..., head, :], k[..., head, :], v[..., head, :], causal=True,
                                              window=WINDOW, sinks=SINKS, feature_map=fmap, sparse_cache=split,
                                              return_state=True)
    lean, per_call, spread = f"cache {size} step", f"cache {size} per call", f"split {low}…{split.largest} step"
    times: dict[str, list[float]] = {"window step": [], lean: [], spread: [], per_call: []}
    with torch.no_grad():
        for _ in range(rounds + 1):  # the first round warms up
            step, sparse = WindowDecodeStep(fmap, plain_state), SparseDecodeStep(fmap, cache_state, cache)
            split_step = SparseDecodeStep(fmap, split_state, split)
            state = cache_state
            for t in range(context, context + 64):  # one boundary (block 64) among the 64 tokens of a round
                token = slice(t, t + 1)
                x = q[..., token, :], k[..., token, :], v[..., token, :]
                start = time.perf_counter()
                step(*x)
                times["window step"].append(time.perf_counter() - start)
                start = time.perf_counter()
                sparse(*x)
                times[lean].append(time.perf_counter() - start)
                start = time.perf_counter()
                split_step(*x)
                times[spread].append(time.perf_counter() - start)
                start = time.perf_counter()
                _, state = linattn.linear_attention(*x, causal=True, window=WINDOW, sinks=SINKS, feature_map=fmap,
                                                    sparse_cache=cache, initial_state=state, return_state=True)
                times[per_call].append(time.perf_counter() - start)
    median = {name: statistics.median(values[64:]) * 1e3 for name, values in times.items()}
    mean = {name: statistics.fmean(values[64:]) * 1e3 for name, values in times.items()}
    print(f"\ndecoding one token after {context} (B=1, H={heads}; {rounds}×64 steps, a boundary every 64 of them: "
          f"the median is a token between boundaries, the mean includes the boundary; load {os.getloadavg()[0]:.1f})")
    for name in times:
        print(f"  {name:<22}median {median[name]:>8.3f} ms   × window step {median[name] / median['window step']:5.2f}"
              f"   mean {mean[name]:>8.3f} ms   × window step {mean[name] / mean['window step']:5.2f}")


def memory(n: int, heads: int, dim: int, size: int) -> None:
    x = make_inputs(n, heads, dim)
    io_bytes = 4 * x[0].numel() * 4
    print(f"\ntraining peak memory at N={n}, forward+backward (× bytes of q, k, v, o = {io_bytes / 2**20:.0f} MiB)")
    for name, fn in variants(size, heads).items():
        peak = peak_memory(lambda fn=fn: run(fn, x, True), x[0].device)
        print(f"  {name:<24}{peak / io_bytes:>6.2f}×", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--memory", action="store_true", help="also the training peak-memory table")
    parser.add_argument("--decoding-only", action="store_true", help="only the decoding table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; B=1 "
          f"H={args.heads} N={args.n} D={args.dim} fp32, causal, window {WINDOW} + {SINKS} sinks, elu; median of "
          f"{args.rounds} alternating rounds")
    if not args.decoding_only:
        timing(args.n, args.heads, args.dim, args.size, args.rounds)
    decoding(args.heads, args.dim, args.size, args.context, args.rounds)
    if args.memory:
        memory(args.n, args.heads, args.dim, args.size)


if __name__ == "__main__":
    main()
