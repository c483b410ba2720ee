"""How many heads must hold the whole context exactly before a linearized folder finds the passkey.

The shipped SmolLM2 student keeps the original's weights (no adapters): it differs from the original only in what
each head keeps exactly (the window, the sinks and, for its 20 cached heads, up to 1,728 pairs) and what it leaves to
the gated delta memory. This script gives more heads a cache larger than the probe (so that head is exact over the
whole context, and its memory receives nothing) and measures the passkey at each step:

1. The heads ranked by how much softmax attention (the original model's) the positions that predict the key put on
   the key's digits, averaged over ``--rank-trials`` passkey probes built from the shipped *training* text (seed
   ``--rank-seed``), never the held-out text the probes below use.
2. For each count K of ``--counts``: the folder with its own cached heads and the top K of that ranking given
   ``--exact`` pairs each (the rest as the folder has them), scored on ``--trials`` passkey probes of the shipped
   held-out text per filler length (``linattn linearize``'s probes, seed 0; ``--seed`` draws others): hits (the key
   greedy at every key token) with a 95 % Wilson interval, and the mean log-probability of the key's tokens
   (finer than hits, which a 135M model rarely scores). Also the original model, the folder as it is, and the
   folder with its memory's read-out weight λ set to 0 (its key gates' ``readout``: the window, the sinks and the
   cache alone).

Rows are written to ``--out`` as they finish; a rerun skips those already there.

    .venv/bin/python benchmarks/passkey_heads.py [--counts 20 60 120 200 270] [--lengths 1024] [--trials 20]
        [--out docs/results/passkey_heads_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from linattn import hf
from linattn._json import dumps
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.models import load_model
from linattn.evaluate.probes import PASSKEY_QUESTION, key_scores, passkeys
from linattn.linearized.card import wilson_interval
from linattn.linearized.folder import atomic_write, load_linearized, read_index, shipped


def key_attention(model: Any, tokenizer: Any, filler: int, trials: int, seed: int) -> torch.Tensor:
    """(layers, heads): the softmax attention mass of the key-predicting positions on the key's digits, averaged
    over those positions and ``trials`` passkey probes of the shipped training text."""
    model.set_attn_implementation("eager")  # the attention weights themselves
    digits = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()}
    total: torch.Tensor | None = None
    probes = passkeys(tokenizer, read_text(None, "train"), filler_tokens=filler, trials=trials, seed=seed)
    question = len(tokenizer(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"])
    for probe in probes:
        ids = probe.input_ids
        # the key's digits in the intro (before the filler), and the rows that predict the key's tokens
        intro_end = probe.score_from - question - probe.distance
        keys = [i for i in range(intro_end) if int(ids[i]) in digits]
        if not keys:
            raise SystemExit("no digit tokens in the intro: this tokenizer writes numbers otherwise")
        rows = list(range(probe.score_from - 1, ids.shape[0] - 1))
        with torch.no_grad():
            attentions = model(input_ids=ids[None], output_attentions=True, use_cache=False).attentions
        mass = torch.stack([a[0][:, rows][:, :, keys].sum(-1).mean(-1) for a in attentions]).double()
        total = mass if total is None else total + mass
    assert total is not None
    return total / len(probes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None, help="a linearized folder (default: the shipped SmolLM2 one)")
    parser.add_argument("--counts", type=int, nargs="*", default=[20, 60, 120, 200, 270],
                        help="top-K counts made exact (none: the original, the folder and λ = 0 alone)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--exact", type=int, default=8192, help="pairs per head for a head made exact")
    parser.add_argument("--rank-filler", type=int, default=1024)
    parser.add_argument("--rank-trials", type=int, default=8)
    parser.add_argument("--rank-seed", type=int, default=11)
    parser.add_argument("--seed", type=int, default=0,
                        help="the held-out probes' draw (0: linattn linearize's own; another: new probes)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/passkey_heads_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.folder) if args.folder else shipped("smollm2")
    if folder is None:
        raise SystemExit("the shipped SmolLM2 folder is missing: reinstall linattn")
    entry = read_index(folder)
    out = Path(args.out)
    done: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    heldout = f"the shipped corpus's held-out part (probes, seed {args.seed})"
    done.setdefault("setting", {"folder": "the shipped SmolLM2 folder" if args.folder is None else args.folder,
                                "trials": args.trials, "exact": args.exact, "rank_filler": args.rank_filler,
                                "rank_trials": args.rank_trials, "rank_seed": args.rank_seed,
                                "threads": torch.get_num_threads(),
                                "heldout": heldout,
                                "ranking": "the shipped corpus's training part"})
    if done["setting"]["heldout"] != heldout:
        raise SystemExit(f"--out {out} holds probes of another --seed ({done['setting']['heldout']}): pass another "
                         "--out")
    rows = done.setdefault("rows", {})

    def save() -> None:
        atomic_write(out, dumps(done, indent=2))

    original, tokenizer, _ = load_model(entry["base"]["model"], causal_lm=True)
    if "ranking" not in done:
        start = time.perf_counter()
        done["ranking"] = key_attention(original, tokenizer, args.rank_filler, args.rank_trials,
                                        args.rank_seed).tolist()
        done["ranking_seconds"] = time.perf_counter() - start
        save()
    mass = torch.tensor(done["ranking"])
    layers, heads = mass.shape
    order = [(int(i) // heads, int(i) % heads) for i in mass.flatten().argsort(descending=True)]
    own = entry["options"].get("sparse_cache") or [[0] * heads for _ in range(layers)]
    own = [list(layer["size"] if isinstance(layer, dict) else layer) for layer in own]
    held = {(layer, head) for layer in range(layers) for head in range(heads) if own[layer][head]}
    original.set_attn_implementation("sdpa")
    text = read_text(None, "heldout")

    def measure(label: str, model: Any, extra: dict[str, Any]) -> None:
        row = rows.setdefault(label, {**extra, "lengths": {}})
        for length in args.lengths:
            if str(length) in row["lengths"]:
                continue
            start = time.perf_counter()
            hits, logp = key_scores(model, passkeys(tokenizer, text, filler_tokens=length, trials=args.trials,
                                                    seed=args.seed))
            low, high = wilson_interval(hits, args.trials)
            row["lengths"][str(length)] = {"hits": hits, "trials": args.trials, "wilson_95": [low, high],
                                           "key_log_prob": logp, "seconds": time.perf_counter() - start}
            save()
        found = ", ".join(f"{n}: {r['hits']}/{r['trials']} (log p {r['key_log_prob']:.2f})"
                          for n, r in row["lengths"].items())
        print(f"{label}: {found}", flush=True)

    measure("original (softmax)", original, {})
    del original
    model, _ = load_linearized(folder)
    measure(f"the folder ({len(held)} cached heads)", model, {"exact_heads": len(held)})
    silenced = 0
    with torch.no_grad():
        for module in hf.attention_modules(model):
            gates = getattr(module, hf.GATES_ATTRIBUTE, None)
            if getattr(gates, "readout", None) is not None:
                gates.readout.fill_(-60.0)  # λ = sigmoid(−60): the memory's read-out off, the exact part alone
                silenced += 1
    if silenced:
        measure("the folder, its memory's read-out off (λ = 0)", model, {"exact_heads": len(held)})
    for count in args.counts:
        exact = held | set(order[:count])
        sizes = [[args.exact if (layer, head) in exact else own[layer][head] for head in range(heads)]
                 for layer in range(layers)]
        model, _ = load_linearized(folder, sparse_cache=sizes)
        measure(f"the folder's cached heads and the top {count} exact ({len(exact)} heads)", model,
                {"exact_heads": len(exact), "top": count,
                 "pairs_per_head": sum(map(sum, sizes)) / (layers * heads)})


if __name__ == "__main__":
    main()
