"""Why a cache that holds the passkey does not retrieve it: the linear part's mass at long contexts.

Two measurements on a linearized SmolLM2 folder (default: the shipped one), on the passkey probes of
``linattn linearize`` (the key stated in the first ~40 tokens, then ``length`` filler tokens, then the question):

- ``--shares``: for the query that predicts the key's first token, per layer and head, the share of the attention
  that lies beyond the window and the sinks, under softmax (the original model's scores) and under the folder's
  maps (the linear part's share of the hybrid's normaliser, the mass form, with no cache), averaged over heads and
  3 probes. Softmax keeps it about constant as the filler grows; a map whose far keys each keep their mass lets it
  grow, and everything exact (the window, the sinks and a cache) is pushed aside.
- rows: passkey hits of ``--trials`` probes per filler length (greedy, every key token) with a 95 % Wilson interval,
  and the mean log-probability of the key's tokens (a finer measure than hits, which a 135M model rarely scores),
  for the original model and for the hybrid with a cache of ``--size`` pairs per head that keeps the first
  ``--oracle-first`` positions (``score="oracle"``: the key held exactly, what any score could at best reach),
  its linear part weighed ``β`` for each of ``--weights`` (:class:`linattn.SparseCache`'s ``linear_weight``);
  with ``--split-from FILE``, also the hybrid with the per-head split recorded in that results file (the ``sizes``
  of its first row that has them, from ``benchmarks/sparse_cache_lm.py``), for each score of ``--split-scores``
  and each weight of ``--split-weights``: what a real score keeps, beside the oracle's bound.

Rows are written to ``--out`` as they finish; a rerun skips those already there.

    .venv/bin/python benchmarks/sparse_cache_passkey.py [--folder DIR] [--lengths 256 512 768 1024 2048]
        [--weights 1 0.1 0.01 0] [--trials 20] [--shares] [--out docs/results/sparse_cache_passkey_smollm2.json]
        [--split-from docs/results/sparse_cache_smollm2_shipped_split.json --split-scores recall attention
         --split-weights 0.1]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from linattn import SparseCache
from linattn._json import dumps
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.probes import key_scores, passkeys
from linattn.feature_maps.fitted import load_feature_maps
from linattn.linearized.card import wilson_interval
from linattn.linearized.folder import atomic_write, load_linearized, read_index, shipped


def shares(folder: Path, length: int, window: int, sinks: int) -> dict[str, float]:
    """The far share (beyond the window and sinks) of the key-predicting query's attention, softmax and map."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, tokenizer = load_linearized(folder)
    maps = load_feature_maps(str(folder / read_index(folder)["maps"]["file"]))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recorder(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((q.detach(), k.detach()))
        return sdpa(module, q, k, v, *args, **kwargs)

    AttentionInterface.register("linattn_benchmark_recorder", recorder)
    model.set_attn_implementation("linattn_benchmark_recorder")
    softmax, mapped = [], []
    for probe in passkeys(tokenizer, read_text(None, "heldout"), filler_tokens=length, trials=3, seed=0):
        seen.clear()
        with torch.no_grad():
            model(input_ids=probe.input_ids[None], use_cache=False)
        t = probe.score_from - 1
        position = torch.arange(t + 1)
        far = (position <= t - window) & (position >= sinks)
        for layer, (q, k) in enumerate(seen):
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1)[0, :, : t + 1]  # (H, t + 1, d)
            query = q[0, :, t : t + 1]  # (H, 1, d)
            probs = torch.softmax((keys.double() @ query.double().transpose(-1, -2)).squeeze(-1)
                                  / math.sqrt(q.shape[-1]), -1)
            with torch.no_grad():
                qf = maps.maps[layer].features(query, is_query=True).double()
                kf = maps.maps[layer].features(keys, is_query=False).double()
            weights = (kf @ qf.transpose(-1, -2)).squeeze(-1)  # (H, t + 1)
            softmax.append(probs[:, far].sum(-1))
            mapped.append(weights[:, far].sum(-1) / weights.sum(-1))
    return {"softmax": float(torch.cat(softmax).mean()), "map": float(torch.cat(mapped).mean())}


def recorded_sizes(path: Path) -> list[list[int]]:
    """The per-layer, per-head sizes of the first row of a ``sparse_cache_lm.py`` results file that records them."""
    for row in json.loads(path.read_text(encoding="utf-8"))["rows"].values():
        if "sizes" in row:
            return [[int(size) for size in layer] for layer in row["sizes"]]
    raise SystemExit(f"{path}: no row records per-head sizes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 768, 1024, 2048])
    parser.add_argument("--weights", type=float, nargs="+", default=[1.0, 0.1, 0.01, 0.0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--oracle-first", type=int, default=128)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--shares", action="store_true", help="also the far shares (softmax against the map)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/sparse_cache_passkey_smollm2.json")
    parser.add_argument("--split-from", default=None, help="a results file recording a per-head split (its sizes)")
    parser.add_argument("--split-scores", nargs="+", default=["recall", "attention"], choices=["recall", "attention"])
    parser.add_argument("--split-weights", type=float, nargs="+", default=[0.1])
    parser.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                        help="the original's and the oracle's rows (--no-oracle: only the split's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.folder) if args.folder else shipped("smollm2")
    if folder is None:
        raise SystemExit("the shipped SmolLM2 folder is missing: reinstall linattn")
    maps = load_feature_maps(str(folder / read_index(folder)["maps"]["file"]))
    window, sinks = int(maps.window or 64), int(maps.sinks or 4)
    out = Path(args.out)
    done: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    done.setdefault("setting", {"folder": "the shipped SmolLM2 folder" if args.folder is None else args.folder,
                                "window": window, "sinks": sinks, "size": args.size,
                                "oracle_first": args.oracle_first, "trials": args.trials,
                                "threads": torch.get_num_threads(), "heldout": "the shipped corpus's held-out part"})
    rows = done.setdefault("rows", {})

    def save() -> None:
        atomic_write(out, dumps(done, indent=2))  # strict JSON: null for a missing number

    if args.shares:
        found = done.setdefault("far_share", {})
        for length in args.lengths:
            if str(length) not in found:
                found[str(length)] = shares(folder, length, window, sinks)
                save()
            print(f"far share, filler {length}: softmax {found[str(length)]['softmax']:.3f}, "
                  f"map {found[str(length)]['map']:.3f}", flush=True)
    keep = torch.arange(1 << 16) < args.oracle_first
    settings: list[tuple[str, Any]] = []
    if args.oracle:
        settings += [("original (softmax)", None)]
        settings += [(f"hybrid window {window} + cache {args.size} (oracle: the first {args.oracle_first} positions), "
                      f"linear weight {weight:g}", SparseCache(args.size, score="oracle", keep=keep,
                                                               linear_weight=weight))
                     for weight in args.weights]
    if args.split_from is not None:
        sizes = recorded_sizes(Path(args.split_from))
        mean = sum(map(sum, sizes)) / sum(map(len, sizes))
        settings += [(f"hybrid window {window} + cache {mean:g} on average, the recorded split ({score}), "
                      f"linear weight {weight:g}",
                      [SparseCache(tuple(layer), score=score, linear_weight=weight) for layer in sizes])
                     for score in args.split_scores for weight in args.split_weights]
    text = read_text(None, "heldout")
    for name, cache in settings:
        model = tokenizer = None
        for length in args.lengths:
            if f"{length}" in rows.get(name, {}):
                continue
            if model is None:
                model, tokenizer = load_linearized(folder, sparse_cache=cache)
                if cache is None:
                    model.set_attn_implementation("sdpa")
            begin = time.perf_counter()
            hits, log_prob = key_scores(model, passkeys(tokenizer, text, filler_tokens=length, trials=args.trials,
                                                        seed=0))
            rows.setdefault(name, {})[f"{length}"] = {
                "hits": hits, "interval": wilson_interval(hits, args.trials), "mean_key_log_prob": log_prob,
                "seconds": time.perf_counter() - begin}
            save()
            print(f"{name}, filler {length}: {hits}/{args.trials}, key log-prob {log_prob:.2f}", flush=True)


if __name__ == "__main__":
    main()
