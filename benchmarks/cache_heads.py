"""How a sparse cache's pairs are spread over the heads decides how far back a delta-rule student recalls.

Reads a delta-rule student's folder (default: the folder shipped for SmolLM2, its maps and gates; a cache it has is
replaced by each split) and, for each split of the same total (``--cache`` pairs per head
on average beside a window of ``--window``), scores the repeated passage ``--gaps`` tokens back on the shipped long
held-out text (4 passages each, as the card does). The heads' retrieval scores are computed once (under softmax, on
the shipped training text in 8 paragraph orders, with :func:`linattn.train.end_to_end.cache_split`'s copying draws).

A split is ``none`` (no cache: with ``@192``, the equal memory spent on window), ``proportional:FLOOR``
(every head, in proportion to its score, at least FLOOR), ``top:K:FLOOR`` (the K highest-scoring heads share what
the floor leaves equally), ``uniform`` (every head the mean, recall score) or ``oracle`` (every head keeps the first
``--cache`` positions, where the passage lies: measurement only, the bound any score could reach), each optionally
``@W`` for another window with the same exact pairs per head (e.g. ``top:16:0@96``: window 96 and 96 cached pairs
on average beside the defaults' 64 and 128).
Rows are written to ``--out`` as they finish; a rerun skips the rows already there.

    .venv/bin/python benchmarks/cache_heads.py --splits none@192 oracle uniform proportional:32 top:10:4 \
        top:16:4 top:20:0 top:24:0 top:32:4 top:16:0@96 --out docs/results/cache_heads_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from linattn import SparseCache, hf
from linattn._json import dumps
from linattn.data import load_text
from linattn.evaluate.capture import reordered
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.probes import repeats_by_gap
from linattn.linearized.caches import folder_setting
from linattn.linearized.folder import atomic_write, load_linearized, shipped
from linattn.train.end_to_end import cache_split


def caches(split: str, scores: torch.Tensor, mean: int) -> list[SparseCache] | SparseCache | None:
    kind, *rest = split.split(":")
    if kind == "none":
        return None
    if kind == "uniform":
        return SparseCache(mean, score="recall")
    if kind == "oracle":
        return SparseCache(mean, score="oracle", keep=torch.arange(1 << 16) < mean)
    if kind == "proportional":
        return SparseCache.split(scores, mean, floor=int(rest[0]))
    if kind == "top":
        return SparseCache.split(scores, mean, floor=int(rest[1]), top=int(rest[0]))
    raise SystemExit(f"--splits: unknown split {split!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None, help="default: the folder shipped for smollm2")
    parser.add_argument("--splits", nargs="+", required=True)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--cache", type=int, default=128)
    parser.add_argument("--gaps", type=int, nargs="+", default=[512, 1536, 3072])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/results/cache_heads_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.folder) if args.folder else shipped("smollm2")
    assert folder is not None
    out = Path(args.out)
    done: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    model, tokenizer = load_linearized(folder)
    maps, options, _, sinks = folder_setting(folder)
    sequences = [torch.tensor(tokenizer(text)["input_ids"]) for text in reordered(read_text(None, "train"), 8)]
    _, scores = cache_split(model, sequences, window=args.window, sinks=sinks, mean=args.cache, floor=0)
    done.setdefault("setting", {"folder": str(folder), "window": args.window, "cache": args.cache, "sinks": sinks,
                                "gaps": args.gaps, "threads": args.threads, "scores": scores.tolist()})
    rows = done.setdefault("rows", {})
    text = load_text("heldout_long")
    for split in args.splits:
        name, _, wide = split.partition("@")
        window = int(wide) if wide else args.window
        if split in rows:
            print(f"{split}: done before, skipped", flush=True)
            continue
        chosen = caches(name, scores, args.window + args.cache - window)  # the same exact pairs per head
        begin = time.perf_counter()
        hf.linearize(model, maps, **{**options, "window": window, "sparse_cache": chosen})
        with torch.no_grad():
            repeats = repeats_by_gap(model, tokenizer, text, args.gaps)
        largest = (max(c.largest for c in chosen) if isinstance(chosen, list) else
                   chosen.largest if chosen is not None else 0)
        rows[split] = {"window": window, "cache": args.window + args.cache - window, "largest_per_head": largest,
                       "repeat_by_gap": repeats, "seconds": time.perf_counter() - begin}
        atomic_write(out, dumps(done, indent=1))
        print(f"{split}: {repeats} (largest {largest}, {rows[split]['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
