"""Perplexity of SmolLM2 on the held-out text by token position, softmax / window / hybrids from saved maps.

A map fitted on rows of at most N keys can put too much weight on the far keys of longer rows; scoring the held-out
text (1,140 tokens, one pass) by position shows where a hybrid loses against the window alone. Also the repeated-
passage perplexity (4 passages of 128 tokens after 512, the ``long_range_probes`` default).

    python benchmarks/lm_positions.py out/smollm2-maps/hedgehog_window.safetensors ...   # 1 thread
"""

from __future__ import annotations

import argparse
import time

import torch

from linattn import hf
from linattn.data import load_text
from linattn.evaluate.lm_compare import LM_SINKS, LM_WINDOW, use_window_softmax
from linattn.evaluate.models import load_model
from linattn.evaluate.perplexity import score_tokens
from linattn.evaluate.probes import repeat_perplexity, repeated_passages
from linattn.feature_maps.fitted import load_feature_maps

EDGES = (1, 128, 256, 512, 768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("maps", nargs="*", help="maps files written by FittedFeatureMaps.save (hybrids: with W, S)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model("smollm2", causal_lm=True)
    text = load_text("heldout")
    ids = torch.tensor(tokenizer(text)["input_ids"])[None]  # (1, N)
    probes = repeated_passages(tokenizer, text)
    edges = [*EDGES, ids.shape[1]]
    buckets = [f"{a}–{b - 1}" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    print(f"{ids.shape[1]} held-out tokens; perplexity of the tokens at positions " + ", ".join(buckets))
    print(f"{'row':>36} {'all':>7} " + " ".join(f"{b:>9}" for b in buckets) + f" {'repeat':>7}")

    def row(label: str) -> None:
        start = time.perf_counter()
        nll = -score_tokens(model, ids, 1)[0]  # (N − 1,): token t at index t − 1
        parts = [float(nll[a - 1 : b - 1].mean().exp()) for a, b in zip(edges[:-1], edges[1:], strict=True)]
        repeat = repeat_perplexity(model, probes)
        print(f"{label[-36:]:>36} {float(nll.mean().exp()):7.2f} " + " ".join(f"{p:9.2f}" for p in parts)
              + f" {repeat:7.2f}  ({time.perf_counter() - start:.0f} s)", flush=True)

    row("softmax")
    use_window_softmax(model, LM_WINDOW, LM_SINKS)
    row(f"window{LM_WINDOW}+sinks{LM_SINKS}")
    for path in args.maps:
        hf.linearize(model, load_feature_maps(path))
        row(path)


if __name__ == "__main__":
    main()
