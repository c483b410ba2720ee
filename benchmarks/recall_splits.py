"""What limits the shipped SmolLM2 student's recall far back: its repeated-passage perplexity under other exact caches,
with the same maps and gates (no retraining).

Rows: the shipped split (20 heads × 1,728 pairs); the same 20 heads keeping every pair of the probe (3,456 ≥ its
3,328 tokens); the top 40 and 80 heads by retrieval score keeping every pair (scores under softmax on the shipped
training text in 8 paragraph orders, as the command scores a split without samples); every head keeping every pair
(exact attention: the original's numbers, a check of the cache itself). Only the first row keeps the 196 exact pairs
per head on average that the targets allow; the others measure where recall is lost, not a model to ship.

    python benchmarks/recall_splits.py [--gaps 1536 2048 2560 3072] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import linattn
from linattn.data import load_text
from linattn.evaluate.capture import reordered
from linattn.evaluate.models import load_model
from linattn.evaluate.probes import repeats_by_gap
from linattn.linearized.folder import load_linearized
from linattn.train.end_to_end import retrieval_scores, top_heads

FOLDER = Path(linattn.__file__).parent / "data" / "linearized" / "smollm2"
EVERY = 3456  # pairs per head: more than the longest probe's tokens (128 + 3,072 + 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", type=int, nargs="+", default=[1536, 2048, 2560, 3072])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    linattn.reuse_freed_memory()
    shipped = json.loads((FOLDER / "linattn.json").read_text())["options"]["sparse_cache"]
    marked = torch.tensor(shipped) > 0
    model, tokenizer, _ = load_model("smollm2", causal_lm=True)
    sequences = [torch.tensor(tokenizer(piece)["input_ids"]) for piece in reordered(load_text("train"), 8)]
    scores = retrieval_scores(model, sequences, window=64, sinks=4)
    del model
    splits = {
        "shipped: 20 heads × 1,728 pairs": shipped,
        "the same 20 heads, every pair": (marked.long() * EVERY).tolist(),
        "top 40 heads, every pair": (top_heads(scores, 40).long() * EVERY).tolist(),
        "top 80 heads, every pair": (top_heads(scores, 80).long() * EVERY).tolist(),
        "every head, every pair (exact)": [[EVERY] * len(row) for row in shipped],
    }
    same = bool((top_heads(scores, 20) == marked).all())
    print(f"the shipped split's 20 heads are {'' if same else 'not '}the top 20 by this score")
    text = load_text("heldout_long")
    rows = []
    print(f"{'exact cache':<34}" + "".join(f"{gap:>9,} back" for gap in args.gaps))
    for name, split in splits.items():
        start = time.perf_counter()
        student, tokenizer = load_linearized(FOLDER, sparse_cache=split)
        found = repeats_by_gap(student, tokenizer, text, args.gaps)
        rows.append({"split": name, "repeat_by_gap": found, "seconds": time.perf_counter() - start})
        print(f"{name:<34}" + "".join(f"{found[str(gap)]:>14.2f}" for gap in args.gaps), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"threads": args.threads, "gaps": args.gaps, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
