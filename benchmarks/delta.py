"""What the delta rule costs on CPU: the chunked delta rule (plain, gated, and with a per-feature gate: KDA) beside
the additive path, and beside a
pure-PyTorch chunkwise delta rule written the textbook way (fla's ``naive`` references, when fla-core is installed:
the inverse built row by row, autograd through it), all in the same rounds; and training memory.

Every variant runs once per round, in turn, so a change of machine load hits all alike; the figure is the median
over rounds, the ratio is to the additive path with the same (identity) map, unnormalised — the closest additive
computation (for the gated delta rule: the additive path with the same gate) — and to the library's default
additive call (elu + 1, normalised). Memory: the peak of live
allocations during forward+backward as a multiple of the bytes of q, k, v and the output.

    .venv/bin/python benchmarks/delta.py [--n 16384] [--heads 8] [--dim 64] [--rounds 5] [--threads 2]
        [--chunk 64] [--memory] [--only "gated delta" kda] [--malloc keep|system]

With ``--malloc keep`` (the default, as the ``linattn`` command runs) glibc's malloc keeps freed memory for reuse
(:func:`linattn.reuse_freed_memory`); ``system`` leaves it as the system has it, where every large tensor is faulted
in anew.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import linattn
from linattn.measure import peak_memory

Inputs = dict[str, torch.Tensor]


def make_inputs(n: int, heads: int, dim: int) -> Inputs:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(1, heads, n, dim, generator=g), "k": torch.randn(1, heads, n, dim, generator=g),
        "v": torch.randn(1, heads, n, dim, generator=g), "beta": torch.rand(1, heads, n, generator=g),
        "log_gate": F.logsigmoid(torch.randn(1, heads, n, generator=g) + 3),
        "feature_gate": F.logsigmoid(torch.randn(1, heads, n, dim, generator=g) + 3),  # KDA's, one per feature
    } | {"strong_gate": F.logsigmoid(torch.randn(1, heads, n, dim, generator=g) + 3) - 20 * (
        torch.arange(dim) < dim // 8)}  # an eighth of the features forget at once: the chunks go by sub-chunks


def linattn_variants(chunk: int) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    def call(x: Inputs, **options: Any) -> torch.Tensor:
        return linattn.linear_attention(x["q"], x["k"], x["v"], causal=True, **options)

    return {
        "add elu": lambda x: call(x),
        "add id": lambda x: call(x, feature_map="identity", normalize=False),
        "add id gated": lambda x: call(x, feature_map="identity", normalize=False, log_gate=x["log_gate"]),
        "delta": lambda x: call(x, feature_map="identity", update="delta", beta=x["beta"], chunk_size=chunk),
        "gated delta": lambda x: call(x, feature_map="identity", update="delta", beta=x["beta"],
                                      log_gate=x["log_gate"], chunk_size=chunk),
        "kda": lambda x: call(x, feature_map="identity", update="delta", beta=x["beta"], log_gate=x["feature_gate"],
                              chunk_size=chunk),
        "kda strong": lambda x: call(x, feature_map="identity", update="delta", beta=x["beta"],
                                     log_gate=x["strong_gate"], chunk_size=chunk),
    }


def textbook_variants(chunk: int) -> dict[str, Callable[[Inputs], torch.Tensor]]:
    """fla's pure-PyTorch chunkwise references, on the same unit keys and queries (they scale q by 1/√D: the
    work is the same)."""
    try:
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
    except ImportError:
        return {}

    def plain(x: Inputs) -> torch.Tensor:
        q, k = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
        return delta_rule_chunkwise(q, k, x["v"], x["beta"], chunk_size=chunk)[0]

    def gated(x: Inputs) -> torch.Tensor:
        q, k = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
        tokens_first = [t.transpose(1, 2) for t in (q, k, x["v"], x["log_gate"], x["beta"])]
        return naive_chunk_gated_delta_rule(*tokens_first, chunk_size=chunk)[0]

    return {"textbook delta": plain, "textbook gated": gated}


def leaves(x: Inputs, training: bool) -> Inputs:
    return {name: t.clone().requires_grad_(training) for name, t in x.items()}


def run(fn: Callable[[Inputs], torch.Tensor], x: Inputs, training: bool) -> None:
    with torch.set_grad_enabled(training):
        out = fn(x)
        if training:
            out.sum().backward()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timing(n: int, heads: int, dim: int, rounds: int, chunk: int, only: list[str] | None) -> None:
    variants = linattn_variants(chunk) | textbook_variants(chunk)
    if only:
        variants = {name: variants[name] for name in only}
    x = make_inputs(n, heads, dim)
    names = list(variants)
    print(f"{'pass':<16}" + "".join(f"{name + ' ms':>20}" for name in names))
    for training in (False, True):
        times: dict[str, list[float]] = {name: [] for name in names}
        faults: dict[str, list[int]] = {name: [] for name in names}  # page faults (minor) during each call
        for _ in range(rounds + 1):  # the first round warms up
            for name in names:
                inputs = leaves(x, training)
                start, first = time.perf_counter(), _faults()
                run(variants[name], inputs, training)
                times[name].append(time.perf_counter() - start)
                faults[name].append(_faults() - first)
        ms = {name: statistics.median(times[name][1:]) * 1e3 for name in names}
        print(f"{'fwd+bwd' if training else 'forward':<16}" + "".join(f"{ms[name]:>20.1f}" for name in names))
        print(f"  {'page faults':<14}" + "".join(f"{statistics.median(faults[name][1:]):>20,.0f}" for name in names))
        for base in (name for name in ("add id", "add id gated", "add elu") if name in ms):
            print(f"  × {base:<12}" + "".join(f"{ms[name] / ms[base]:>20.2f}" for name in names))
        for name, textbook in (("delta", "textbook delta"), ("gated delta", "textbook gated")):
            if textbook in ms:
                print(f"  {name}: {ms[textbook] / ms[name]:.1f}× faster than the textbook chunkwise form")
        for name in (name for name in ("kda", "kda strong") if name in ms and "gated delta" in ms):
            spread = [a / b for a, b in zip(times[name][1:], times["gated delta"][1:], strict=True)]
            print(f"  {name} / gated delta: {ms[name] / ms['gated delta']:.2f}× (per round "
                  f"{min(spread):.2f}–{max(spread):.2f}×)")


def memory(n: int, heads: int, dim: int, chunk: int) -> None:
    x = make_inputs(n, heads, dim)
    io_bytes = 4 * x["q"].numel() * 4
    print(f"\ntraining peak memory at N={n}, forward+backward (× bytes of q, k, v, o = {io_bytes / 2**20:.0f} MiB)")
    for name, fn in linattn_variants(chunk).items():
        inputs = leaves(x, True)
        peak = peak_memory(lambda fn=fn, inputs=inputs: run(fn, inputs, True), x["q"].device)
        print(f"  {name:<12}{peak / io_bytes:>6.2f}×", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--memory", action="store_true", help="also the training peak-memory table")
    parser.add_argument("--only", nargs="+", help="time only these variants (e.g. 'gated delta' kda)")
    parser.add_argument("--malloc", choices=("keep", "system"), default="keep",
                        help="keep: malloc keeps freed memory (linattn.reuse_freed_memory); system: as it is")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    malloc = "keep" if args.malloc == "keep" and linattn.reuse_freed_memory() else "system"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, malloc {malloc}, "
          f"load {os.getloadavg()[0]:.1f}; "
          f"B=1 H={args.heads} N={args.n} D=F={args.dim} fp32, causal, chunk {args.chunk}; median of {args.rounds} "
          "alternating rounds")
    timing(args.n, args.heads, args.dim, args.rounds, args.chunk, args.only)
    if args.memory:
        memory(args.n, args.heads, args.dim, args.chunk)


if __name__ == "__main__":
    main()
