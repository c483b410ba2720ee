"""The sparse exact cache on a linearized decoder, with the equal-memory baselines beside it.

Reads a folder written by ``linattn linearize`` (its fitted maps, window W and sinks S) and scores, on the
held-out text: the original model; softmax over a window of W + λ and the sinks alone (the softmax model with
the memory of the cache); the hybrid with a window of W + λ and no cache (the same maps: what more window buys);
the hybrid as linearized (window W); and the hybrid with a cache of λ pairs per head, for each score. Each row:
perplexity, the repeated passage's perplexity, passkey retrieval (hits of ``--passkey-trials`` per filler length,
with a 95 % Wilson interval). No weights change: the cache is added to the fitted model as it is.

Rows are written to ``--out`` (JSON) as they finish; a rerun skips the rows already there (an interrupted run
loses at most the row in progress). The file records the SHA-256 of the folder's maps: a rerun on other maps (a
folder written again) is refused rather than mixed with rows measured on the earlier ones.

    .venv/bin/python benchmarks/sparse_cache_lm.py DIR [--size 128] [--scores recall attention]
        [--passkey-trials 20] [--repeat-trials 8] [--out docs/results/sparse_cache_smollm2.json] [--split-floor F]
        [--oracle-first P]

``--oracle-first P`` adds the row whose cache keeps the first P positions (``score="oracle"``, for measurement
only): the repeat probe's passage and the passkey's statement lie there, so the row bounds what a score could
reach with these maps. ``--split-floor F`` adds the row with the same mean split across heads in proportion to
their retrieval scores (:meth:`linattn.SparseCache.split`, each head at least F), scored under softmax on the
folder's sampled training texts (never on the held-out text).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from linattn import SparseCache, hf
from linattn._json import dumps
from linattn.evaluate.lm_compare import score_model
from linattn.evaluate.lm_config import ProbeOptions
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.window_softmax import use_window_softmax
from linattn.linearized.caches import folder_setting, retrieval_split
from linattn.linearized.card import wilson_interval
from linattn.linearized.folder import atomic_write, load_linearized, read_index


def rows(folder: Path, size: int, scores: list[str], split: tuple[list[Any], int, str] | None = None,
         oracle_first: int | None = None, linear_weight: float | None = None) -> list[tuple[str, dict[str, Any], Any]]:
    """(name, what it is, how to switch the model to it)."""
    maps, options, window, sinks = folder_setting(folder)
    wide = window + size

    def hybrid(**extra: Any) -> Any:
        return lambda model: hf.linearize(model, maps, **{**options, "window": window, "sinks": sinks, **extra})

    listed: list[tuple[str, dict[str, Any], Any]] = [
        ("original (softmax)", {"memory": "grows"}, lambda model: model.set_attn_implementation("sdpa")),
        (f"softmax window {wide} + {sinks} sinks", {"exact_pairs": wide + sinks},
         lambda model: use_window_softmax(model, wide, sinks)),
        (f"hybrid window {wide}, no cache", {"exact_pairs": wide + sinks}, hybrid(window=wide)),
        (f"hybrid window {window}, no cache", {"exact_pairs": window + sinks}, hybrid()),
    ]
    keep = torch.arange(1 << 16) < (oracle_first or 0)  # the first positions: a repeat's passage, a passkey's key

    def cached(beta: float | None) -> list[tuple[str, dict[str, Any], Any]]:
        """The oracle's and the split's rows, their linear part weighed β (None: as the window op weighs it)."""
        suffix, weight = ("", {}) if beta is None else (f", linear weight {beta}", {"linear_weight": beta})
        found: list[tuple[str, dict[str, Any], Any]] = []
        if oracle_first is not None:
            found.append((f"hybrid window {window} + cache {size} (oracle: the first {oracle_first} positions){suffix}",
                          {"exact_pairs": window + sinks + size, "oracle_first": oracle_first, **weight},
                          hybrid(sparse_cache=SparseCache(size, score="oracle", keep=keep, **weight))))
        if split is not None:
            caches, floor, source = split
            found.append((f"hybrid window {window} + cache {size} on average, split by retrieval score (floor "
                          f"{floor}){suffix}",
                          {"exact_pairs": window + sinks + size, "largest_per_head": max(c.largest for c in caches),
                           "scored_on": source, "sizes": [list(cache.size) for cache in caches], **weight},
                          hybrid(sparse_cache=[dataclasses.replace(cache, **weight) for cache in caches])))
        return found

    listed += cached(None)
    for score in scores:
        listed.append((f"hybrid window {window} + cache {size} ({score})", {"exact_pairs": window + sinks + size},
                       hybrid(sparse_cache=SparseCache(size, score=score))))
    if linear_weight is not None:  # the same rows with the linear part weighed β, and the equal-memory hybrid so
        # weighed (a cache of size 0 carries the weight: the window op times β)
        listed.append((f"hybrid window {wide}, no cache, linear weight {linear_weight}",
                       {"exact_pairs": wide + sinks, "linear_weight": linear_weight},
                       hybrid(window=wide, sparse_cache=SparseCache(0, linear_weight=linear_weight))))
        listed += cached(linear_weight)
    return listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--scores", nargs="+", default=["recall", "attention"])
    parser.add_argument("--passkey-trials", type=int, default=20)
    parser.add_argument("--repeat-trials", type=int, default=8)
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/sparse_cache_smollm2.json")
    parser.add_argument("--split-floor", type=int, default=None, help="also the row with the same mean split "
                        "across heads by retrieval score, each head keeping at least this many")
    parser.add_argument("--oracle-first", type=int, default=None, help="also the row whose cache keeps the first P "
                        "positions (score 'oracle', measurement only): the repeated passage and the passkey's "
                        "statement are there, so it bounds what any score could reach with these maps")
    parser.add_argument("--linear-weight", type=float, default=None, help="also the rows (split, oracle, the "
                        "equal-memory hybrid) with the linear part's sums times this weight β (SparseCache's "
                        "linear_weight)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder, out = Path(args.folder), Path(args.out)
    done: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    maps = hashlib.sha256((folder / read_index(folder)["maps"]["file"]).read_bytes()).hexdigest()
    if done.get("setting", {}).get("maps_sha256", maps) != maps:
        raise SystemExit(f"{out} holds rows measured with other maps (SHA-256 {done['setting']['maps_sha256'][:12]}…, "
                         f"{folder}'s are {maps[:12]}…); pass another --out")
    model, tokenizer = load_linearized(folder)
    heldout = read_text(None, "heldout")
    probes = ProbeOptions(passage_tokens=128, gap_tokens=512, repeat_trials=args.repeat_trials,
                          passkey_lengths=tuple(args.passkey_lengths), passkey_trials=args.passkey_trials)
    done.setdefault("setting", {"folder": os.fspath(folder), "maps_sha256": maps, "size": args.size,
                                "threads": torch.get_num_threads(),
                                "passkey_trials": args.passkey_trials, "repeat_trials": args.repeat_trials,
                                "passage_tokens": 128, "gap_tokens": 512,
                                "heldout": "the shipped corpus's held-out part"})
    results = done.setdefault("rows", {})
    split = None
    if args.split_floor is not None:
        _, _, window, sinks = folder_setting(folder)
        caches, source = retrieval_split(folder, model, tokenizer, window, sinks, args.size, args.split_floor)
        split = (caches, args.split_floor, source)
    def priority(row: tuple[str, dict[str, Any], Any]) -> int:  # what an interrupted run should have measured
        marks = ("original", "split", "linear weight", "softmax window", "cache")
        return next((rank for rank, mark in enumerate(marks) if mark in row[0]), len(marks))

    listed = rows(folder, args.size, args.scores, split, args.oracle_first, args.linear_weight)
    for name, info, switch in sorted(listed, key=priority):
        if name in results:
            print(f"{name}: done before, skipped", flush=True)
            continue
        begin = time.perf_counter()
        switch(model)
        with torch.no_grad():
            row = {**info, **score_model(model, tokenizer, heldout, probes)}
        row["seconds"] = time.perf_counter() - begin
        row["passkey_interval"] = {
            length: wilson_interval(round(rate * args.passkey_trials), args.passkey_trials)
            for length, rate in row["passkey"].items()
        }
        results[name] = row
        atomic_write(out, dumps(done, indent=2))  # strict JSON: null for a missing number
        passkey = "/".join(f"{rate:.2f}" for rate in row["passkey"].values())
        print(f"{name}: perplexity {row['perplexity']:.2f}, repeat {row['repeat_perplexity']:.2f}, passkey "
              f"{passkey} ({row['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
