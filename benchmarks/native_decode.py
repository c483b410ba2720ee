"""Decoding the shipped linearized SmolLM2 with and without linattn's native kernels, beside the original, in one run.

    python benchmarks/native_decode.py                          # contexts 1536 and 8192, 1 and 2 threads, 3 rounds
    python benchmarks/native_decode.py --contexts 1536 --threads 1 --rounds 5

For each thread count and context, in rounds that alternate the four (original, linearized with the torch code,
linearized with the native kernels called one by one, and with a layer's token fused into one call): a prefill of N
tokens of the shipped long held-out text, then ``--steps`` greedy decoding steps, each timed; the round's median ms
per token; the medians over rounds and the ratios printed at the end (tokens/s against the original: above 1,
faster). The native kernels are turned off for the torch rows by hiding the built module (every step made while it
is hidden runs the torch code, and the key gates' one-call path declines), and the fused call for the "native" row
by the steps' ``fuse`` switch, so every row runs in this process with the same weights and inputs. Also printed: the
largest difference between the linearized rows' logits over the decoded tokens (fp32 rounding, not a tolerance).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from linattn.backends import native
from linattn.evaluate.models import load_model
from linattn.exact.composed_step import ComposedDecodeStep
from linattn.exact.sparse_composed_step import SparseComposedDecodeStep
from linattn.linearized.folder import load_linearized, shipped
from linattn.linearized.generate import new_cache
from linattn.linearized.speed import prompt_ids


def decode(model: Any, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """The median ms of ``steps`` greedy decoding steps after a prefill of ``ids``, and their logits."""
    cache = new_cache(model)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        token, times, logits = out.logits[:, -1:].argmax(-1), [], []
        for _ in range(steps):
            begin = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - begin)
            logits.append(out.logits[:, -1])
    return 1e3 * statistics.median(times), torch.cat(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1536, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    built = native.module()
    if built is None:
        raise SystemExit(native.status())
    folder = shipped("smollm2")
    assert folder is not None, "the shipped SmolLM2 folder is missing"
    linearized, tokenizer = load_linearized(folder)
    original = load_model("smollm2")[0]
    print(native.status(), flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for context in args.contexts:
            ids = prompt_ids(tokenizer, context)
            times: dict[str, list[float]] = {"original": [], "torch": [], "native": [], "fused": []}
            gap = 0.0
            for _ in range(args.rounds):
                times["original"].append(decode(original, ids, args.steps)[0])
                native._state["decode"]["module"] = None  # hidden: the steps made now run the torch code
                ms, reference = decode(linearized, ids, args.steps)
                times["torch"].append(ms)
                native._state["decode"]["module"] = built
                for row, fuse in (("native", False), ("fused", True)):
                    ComposedDecodeStep.fuse = SparseComposedDecodeStep.fuse = fuse
                    ms, logits = decode(linearized, ids, args.steps)
                    times[row].append(ms)
                    gap = max(gap, float((logits - reference).abs().max()))
                print(f"  {threads} thread(s) {context:>6} tokens: " + ", ".join(
                    f"{name} {values[-1]:.1f}" for name, values in times.items()) + " ms/token", flush=True)
            med = {name: statistics.median(values) for name, values in times.items()}
            print(f"{threads} thread(s), {context} tokens, median ms/token: original {med['original']:.1f}, "
                  f"linearized torch {med['torch']:.1f}, native {med['native']:.1f}, fused {med['fused']:.1f}; "
                  f"tokens/s against the original: torch {med['original'] / med['torch']:.2f}×, native "
                  f"{med['original'] / med['native']:.2f}×, fused {med['original'] / med['fused']:.2f}×; "
                  f"native against torch {med['torch'] / med['native']:.2f}×, fused against native "
                  f"{med['native'] / med['fused']:.2f}×; logits differ by ≤ {gap:.1e}", flush=True)


if __name__ == "__main__":
    main()
