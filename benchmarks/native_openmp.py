"""The native decoding kernels built without and with ``-fopenmp``, side by side in one process.

``at::parallel_for`` is inlined from torch's headers: an extension compiled without ``-fopenmp`` runs its rows on one
thread whatever torch's thread count. linattn builds its kernels with it; this script builds decode.cpp both ways
under other names (the first as linattn built it before, with ``-fopenmp-simd``) and decodes the shipped SmolLM2
student with each, rounds alternating (the first in each round swapping), at two threads:

    python benchmarks/native_openmp.py                 # contexts 1536 and 8192, 3 rounds of 24 tokens
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Any

import torch
from torch.utils.cpp_extension import load

from linattn.backends import native
from linattn.linearized.folder import load_linearized, shipped
from linattn.linearized.generate import new_cache
from linattn.linearized.speed import prompt_ids


def decode(model: Any, ids: torch.Tensor, steps: int) -> float:
    """The median ms of ``steps`` greedy decoding steps after a prefill of ``ids``."""
    cache = new_cache(model)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        token, times = out.logits[:, -1:].argmax(-1), []
        for _ in range(steps):
            begin = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - begin)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1536, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    source = native.SOURCES["decode"]
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:10]
    arch = native._arch_flags()[1]
    builds = {
        "without -fopenmp": load(f"ab_decode_serial_{digest}", [str(source)],
                                 extra_cflags=["-O3", "-fopenmp-simd", *arch]),
        "with -fopenmp": load(f"ab_decode_openmp_{digest}", [str(source)], extra_cflags=["-O3", "-fopenmp", *arch],
                              extra_ldflags=["-fopenmp"]),
    }
    torch.set_num_threads(args.threads)
    folder = shipped("smollm2")
    assert folder is not None, "the shipped SmolLM2 folder is missing"
    model, tokenizer = load_linearized(folder)
    for context in args.contexts:
        ids = prompt_ids(tokenizer, context)
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_ in range(args.rounds):
            order = list(builds) if round_ % 2 == 0 else list(reversed(builds))
            for name in order:
                native._state.setdefault("decode", {})["module"] = builds[name]  # the steps made now use it
                times[name].append(decode(model, ids, args.steps))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"{args.threads} threads, {context} tokens, ms per token: " + "; ".join(
            f"{name} {[round(v, 1) for v in times[name]]} median {medians[name]:.1f}" for name in builds)
            + f"; speed-up {medians['without -fopenmp'] / medians['with -fopenmp']:.2f}×", flush=True)


if __name__ == "__main__":
    main()
