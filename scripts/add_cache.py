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

With ``--end-to-end-steps S`` the maps and gates are then trained end to end with the cache in place (the
linearize command's end-to-end stage: KL to the softmax model on ``--end-to-end-samples`` texts of
``--end-to-end-tokens`` tokens sampled from the model, seed 0, and their copying sequences, the last ones held out for
early stopping; with ``--end-to-end-corpus-orders K`` also the shipped training text in K paragraph orders and their
copying sequences), before they are measured. The trained folder is kept in OUT/.tuned, the samples in
OUT/.samples.json.

The measurement (perplexity, the repeated passage at the card's gaps, passkey at the card's lengths and trials,
perplexity by position) is written to OUT/.add_cache.json piece by piece: an interrupted run, started again with the
same options, measures only what is missing (and trains again only if it stopped while training).

    .venv/bin/python scripts/add_cache.py SOURCE OUT --window 64 --cache 128 --floor 0 --top 20 [--threads 1]
                                          [--end-to-end-steps 48 --end-to-end-samples 16 --end-to-end-tokens 1024]
                                          [--end-to-end-corpus-orders K] [--end-to-end-seed S]
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
from linattn.evaluate.lm_config import EndToEndOptions
from linattn.evaluate.lm_stages import PROMPT_TOKENS, corpus_sequences, read_text, training_sequences, training_set
from linattn.evaluate.perplexity import perplexity
from linattn.evaluate.probes import passkey_accuracy, passkeys, repeat_perplexity, repeated_passages, repeats_by_gap
from linattn.linearized.caches import folder_setting, retrieval_split
from linattn.linearized.card import perplexity_by_position, write_card
from linattn.linearized.folder import atomic_write, load_linearized, read_index, save_linearized
from linattn.train.end_to_end import fit_end_to_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--cache", type=int, required=True, help="pairs per head on average")
    parser.add_argument("--floor", type=int, default=0)
    parser.add_argument("--top", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--end-to-end-steps", type=int, default=0, help="train with the cache in place first")
    parser.add_argument("--end-to-end-samples", type=int, default=16)
    parser.add_argument("--end-to-end-tokens", type=int, default=1024)
    parser.add_argument("--end-to-end-corpus-orders", type=int, default=0, help="the shipped training text in this "
                        "many paragraph orders (and their copying sequences) beside the samples")
    parser.add_argument("--end-to-end-seed", type=int, default=0, help="the seed of the steps' random draws of "
                        "training sequences (another seed: a rerun that shows how far the draws move the result)")
    args = parser.parse_args()
    if args.end_to_end_steps < 0 or args.end_to_end_corpus_orders < 0:
        raise SystemExit(f"--end-to-end-steps, --end-to-end-corpus-orders: need ≥ 0, got {args.end_to_end_steps}, "
                         f"{args.end_to_end_corpus_orders}")
    torch.set_num_threads(args.threads)
    source, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress_path = out / ".add_cache.json"
    setting = {"source": str(source), "window": args.window, "cache": args.cache, "floor": args.floor,
               "top": args.top, **({"end_to_end": [args.end_to_end_steps, args.end_to_end_samples,
                                                   args.end_to_end_tokens]} if args.end_to_end_steps else {}),
               **({"corpus_orders": args.end_to_end_corpus_orders} if args.end_to_end_corpus_orders else {}),
               **({"seed": args.end_to_end_seed} if args.end_to_end_seed else {})}
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
    trained: dict[str, Any] | None = None
    if args.end_to_end_steps:
        model, maps, gates, trained = tuned(model, tokenizer, maps, gates, saved, index, out, args, progress)
        atomic_write(progress_path, dumps(progress, indent=1))
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
              "sparse_cache_floor": args.floor, "sparse_cache_top": args.top,
              "sparse_cache_trained": trained is not None,
              "sparse_cache_scored_on": scored_on, "threads": args.threads, "rows": [*kept, row],
              "stages": {**earlier.get("stages", {}), "cache": {
                  "summary": f"window {args.window}, a cache of {args.cache} pairs per head on average split by the "
                             f"heads' retrieval scores on {scored_on} (floor {args.floor}"
                             + (f", the rest to the top {args.top} heads" if args.top else "")
                             + "), added after training"
                             + (f", then trained with it in place for {args.end_to_end_steps} end-to-end steps"
                                if trained is not None else "")
                             + " and measured (scripts/add_cache.py)",
                  "seconds": sum(progress["seconds"].values())},
              **({"cache_end_to_end": {**trained, "summary": (
                  f"the maps and gates trained end to end with the cache in place, {trained['steps']} steps on "
                  f"{trained['samples']} samples of {trained['tokens']} tokens"
                  + (f" and the training text in {trained['corpus_orders']} orders" if trained.get("corpus_orders")
                     else "")
                  + " and their copying sequences (best "
                  f"held-out KL {trained['best_held_out_kl']:.3f})")}} if trained is not None else {})}}
    save_linearized(model, out, maps=maps, options=saved, base=index["base"]["model"], results=result, gates=gates)
    write_card(result, str(out))
    reloaded, _ = load_linearized(out)
    ids = tokenizer(heldout, return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, model(ids).logits)
    print(f"wrote {out}: reloaded logits {'equal' if same else 'DIFFER'} to the measured model's on 512 tokens")
    if not same:
        raise SystemExit(1)


def tuned(model: Any, tokenizer: Any, maps: Any, gates: Any, saved: dict[str, Any], index: dict[str, Any],
          out: Path, args: argparse.Namespace, progress: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The model's maps and gates trained end to end with the cache in place (or read back from OUT/.tuned when an
    earlier run finished training): the model, maps, gates and what training took."""
    folder = out / ".tuned"
    if "end_to_end" in progress and (folder / "linattn.json").is_file():
        model, _ = load_linearized(folder)
        maps, setting, _, _ = folder_setting(folder)
        print(f"end to end: read back from {folder}", flush=True)
        return model, maps, setting.get("gates"), progress["end_to_end"]
    options = EndToEndOptions(steps=args.end_to_end_steps, samples=args.end_to_end_samples,
                              tokens=args.end_to_end_tokens, texts=str(out / ".samples.json"), copies=True,
                              corpus_orders=args.end_to_end_corpus_orders, repeat_weight=1.0, lora_rank=0,
                              lora_lr=0.0005, retrieval_heads=0,
                              retrieval_maps=None, train_other_heads=False, sparse_cache=args.cache)
    begin = time.perf_counter()
    train = read_text(None, "train")
    plain, sampling = training_sequences(model, tokenizer, train, options)  # under softmax
    model.set_attn_implementation(hf.IMPLEMENTATION)
    corpus = corpus_sequences(tokenizer, train, options)
    data = training_set(plain, corpus, options)
    info = fit_end_to_end(model, tokenizer, data.sequences, max_tokens=options.tokens + PROMPT_TOKENS,
                          steps=options.steps, held_out=data.held_out, progress=True, weights=data.weights,
                          seed=args.end_to_end_seed)
    save_linearized(model, folder, maps=maps, options=saved, base=index["base"]["model"], gates=gates)
    progress["end_to_end"] = {"steps": options.steps, "samples": len(plain), "copying_sequences": data.copying,
                              "corpus_orders": len(corpus), "seed": args.end_to_end_seed,
                              "tokens": options.tokens, "sampling_seconds": sampling,
                              "seconds": time.perf_counter() - begin, "best_held_out_kl": info["best_held_out"],
                              "history": info["history"]}
    return model, maps, gates, progress["end_to_end"]


if __name__ == "__main__":
    main()
