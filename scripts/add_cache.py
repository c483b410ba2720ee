"""Give a delta-rule student's folder (written by ``linattn linearize``) a sparse exact cache it was not trained with,
measure it as the folder's card measures, and write the result as a new folder whose card shows it beside the
source's rows.

The cache's total is ``--cache`` pairs per head on average with the window narrowed to ``--window``; it is split
across heads by their retrieval score (:func:`linattn.train.end_to_end.retrieval_scores`, under softmax, on the
shipped training text in 8 paragraph orders: never on the held-out text), each head keeping ``--floor`` and, with
``--top K``, the K highest-scoring heads sharing the rest equally. With ``--window`` + ``--cache`` equal to the
source's window the exact pairs per head are the source's, so the source's softmax-window row is the equal-memory
softmax baseline and its linearized row the equal-memory "more window instead of a cache" baseline; both are kept in
the new card.

The measurement (perplexity, the repeated passage at the card's gaps, passkey at the card's lengths and trials,
perplexity by position) is written to OUT/.add_cache.json piece by piece: an interrupted run, started again with the
same options, measures only what is missing.

    .venv/bin/python scripts/add_cache.py SOURCE OUT --window 64 --cache 128 --floor 0 --top 20 [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from linattn import hf
from linattn._json import dumps
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.perplexity import perplexity
from linattn.evaluate.probes import passkey_accuracy, passkeys, repeat_perplexity, repeated_passages, repeats_by_gap
from linattn.linearized.caches import folder_setting, retrieval_split
from linattn.linearized.card import perplexity_by_position, write_card
from linattn.linearized.folder import atomic_write, load_linearized, read_index, save_linearized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--cache", type=int, required=True, help="pairs per head on average")
    parser.add_argument("--floor", type=int, default=0)
    parser.add_argument("--top", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress_path = out / ".add_cache.json"
    setting = {"source": str(source), "window": args.window, "cache": args.cache, "floor": args.floor,
               "top": args.top}
    progress: dict[str, Any] = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    if progress.get("setting", setting) != setting:
        raise SystemExit(f"{out} holds a measurement made with {progress['setting']}; pass the same options or "
                         "another OUT")
    progress["setting"] = setting
    index = read_index(source)
    earlier = json.loads((source / "results.json").read_text(encoding="utf-8"))
    maps, options, _, sinks = folder_setting(source)
    gates = options.pop("gates", None)
    model, tokenizer = load_linearized(source)
    caches, scored_on = retrieval_split(source, model, tokenizer, args.window, sinks, args.cache, args.floor,
                                        args.top)
    sizes = [list(cache.size) for cache in caches]
    saved = {**{key: value for key, value in index["options"].items() if key != "sparse_cache"},
             "window": args.window, "sparse_cache": sizes}
    hf.linearize(model, maps, gates=gates, **{**options, "window": args.window, "sparse_cache": caches})
    heldout, probe_text = read_text(None, "heldout"), read_text(None, "heldout_long")
    lengths = tuple(int(n) for n in earlier["rows"][0]["passkey"])
    gaps = [int(n) for n in earlier["rows"][0].get("repeat_by_gap") or {}]

    def piece(name: str, measure: Any) -> Any:
        if name not in progress:
            begin = time.perf_counter()
            with torch.no_grad():
                progress[name] = measure()
            progress.setdefault("seconds", {})[name] = time.perf_counter() - begin
            atomic_write(progress_path, dumps(progress, indent=1))
            print(f"{name}: {progress[name]} ({progress['seconds'][name]:.0f} s)", flush=True)
        return progress[name]

    plain = piece("perplexity", lambda: dataclasses.asdict(perplexity(model, tokenizer, heldout)))
    by_gap = piece("repeat_by_gap", lambda: repeats_by_gap(model, tokenizer, probe_text, gaps,
                                                         passage_tokens=earlier["passage_tokens"],
                                                         trials=earlier["repeat_trials"]))
    repeat = piece("repeat_perplexity", lambda: repeat_perplexity(model, repeated_passages(
        tokenizer, heldout, passage_tokens=earlier["passage_tokens"], gap_tokens=earlier["gap_tokens"],
        trials=earlier["repeat_trials"])))
    passkey = {str(n): piece(f"passkey {n}", lambda n=n: passkey_accuracy(model, passkeys(
        tokenizer, heldout, filler_tokens=n, trials=earlier["passkey_trials"]))) for n in lengths}
    positions = piece("by_position", lambda: perplexity_by_position(model, tokenizer, heldout, 2048))
    row = {"name": "linearized", "perplexity": plain["perplexity"], "tokens_per_second": plain["tokens_per_second"],
           "heldout_tokens": plain["tokens"], "repeat_perplexity": repeat, "passkey": passkey,
           "by_position": positions,
           "repeat_by_gap": by_gap}
    equal = args.window + args.cache == earlier["window"]
    kept = []
    for old in earlier["rows"]:
        if old["name"] == "linearized":
            if not equal:
                continue
            old = {**old, "name": f"the same student, window {earlier['window']}, no cache (equal memory)"}
        elif old["name"] != "original (softmax)" and not equal:
            continue
        kept.append(old)
    result = {**earlier, "window": args.window, "sparse_cache": args.cache, "sparse_cache_heads": "retrieval",
              "sparse_cache_floor": args.floor, "sparse_cache_top": args.top, "sparse_cache_trained": False,
              "sparse_cache_scored_on": scored_on, "threads": args.threads, "rows": [*kept, row],
              "stages": {**earlier.get("stages", {}), "cache": {
                  "summary": f"window {args.window}, a cache of {args.cache} pairs per head on average split by the "
                             f"heads' retrieval scores on {scored_on} (floor {args.floor}"
                             + (f", the rest to the top {args.top} heads" if args.top else "")
                             + "), added after training and measured (scripts/add_cache.py)",
                  "seconds": sum(progress["seconds"].values())}}}
    save_linearized(model, out, maps=maps, options=saved, base=index["base"]["model"], results=result, gates=gates)
    write_card(result, str(out))
    reloaded, _ = load_linearized(out)
    ids = tokenizer(heldout, return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, model(ids).logits)
    print(f"wrote {out}: reloaded logits {'equal' if same else 'DIFFER'} to the measured model's on 512 tokens")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
