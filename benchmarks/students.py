"""Linearized folders side by side on the probes of ``linattn linearize``'s measured rows, with the equal-memory
baselines: which student recalls.

For each folder (written by ``linattn linearize``, any ``--student``), and for the original model and softmax over
each folder's window and sinks alone: held-out perplexity, the repeated passage (``--gap`` tokens back, on the
held-out text) and passkey retrieval (hits of ``--passkey-trials`` per filler length), as the measure stage scores
them (:func:`linattn.evaluate.lm_compare.score_model`), and the repeated passage ``--gaps`` tokens back on the long
held-out text (:func:`linattn.evaluate.probes.repeats_by_gap`).

Rows are written to ``--out`` (strict JSON) as they finish; a rerun skips the rows already there.

    .venv/bin/python benchmarks/students.py src/linattn/data/linearized/smollm2 out/gdn [--passkey-trials 20]
        [--repeat-trials 4] [--gaps 512 1536 3072] [--out docs/results/students_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from linattn._json import dumps
from linattn.data import load_text
from linattn.evaluate.lm_compare import score_model
from linattn.evaluate.lm_config import ProbeOptions
from linattn.evaluate.probes import repeats_by_gap
from linattn.evaluate.window_softmax import use_window_softmax
from linattn.linearized import load_linearized
from linattn.linearized.folder import read_index


def _row(name: str, model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    begin = time.perf_counter()
    probes = ProbeOptions(passage_tokens=128, gap_tokens=args.gap, repeat_trials=args.repeat_trials,
                          passkey_lengths=tuple(args.passkey_lengths), passkey_trials=args.passkey_trials)
    with torch.no_grad():
        row = {"name": name, **score_model(model, tokenizer, load_text("heldout"), probes),
               "repeat_by_gap": repeats_by_gap(model, tokenizer, load_text("heldout_long"), args.gaps,
                                               passage_tokens=128, trials=args.repeat_trials)}
    row["seconds"] = time.perf_counter() - begin
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("folders", nargs="+", help="folders written by linattn linearize (one base model)")
    parser.add_argument("--passkey-trials", type=int, default=20)
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeat-trials", type=int, default=4)
    parser.add_argument("--gap", type=int, default=512, help="the held-out text's repeated passage")
    parser.add_argument("--gaps", type=int, nargs="+", default=[512, 1536, 3072])
    parser.add_argument("--no-baselines", action="store_true", help="the folders' rows only")
    parser.add_argument("--out", default="students.json")
    args = parser.parse_args()
    done: dict[str, Any] = {}
    if os.path.isfile(args.out):
        done = {row["name"]: row for row in json.load(open(args.out, encoding="utf-8"))["rows"]}
    rows = list(done.values())

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        with open(args.out + ".partial", "w", encoding="utf-8") as handle:
            handle.write(dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        os.replace(args.out + ".partial", args.out)
        repeats = " ".join(f"{gap}:{value:.2f}" if value is not None else f"{gap}:—"
                           for gap, value in row["repeat_by_gap"].items())
        print(f"{row['name']:42s} ppl {row['perplexity']:7.2f}  repeat {row['repeat_perplexity']:7.2f}  "
              f"long {repeats}  passkey {row['passkey']}  {row['seconds']:.0f} s", flush=True)

    windows = []
    for folder in args.folders:
        entry = read_index(folder)
        gates = entry.get("gates") or {}
        kind = {None: "delta", "token": "gated delta", "feature": "KDA"}[gates["config"]["gate"]] if gates else (
            "additive")
        name = f"{os.path.basename(os.path.normpath(folder))} ({kind})"
        model, tokenizer = load_linearized(folder)
        options = next(module.linattn_options for module in model.modules() if hasattr(module, "linattn_options"))
        windows.append((options.get("window"), options.get("sinks", 0)))
        if name not in done:
            record(_row(name, model, tokenizer, args))
    if args.no_baselines:
        return
    model.set_attn_implementation("sdpa")
    if "original (softmax)" not in done:
        record(_row("original (softmax)", model, tokenizer, args))
    for window, sinks in sorted(set(windows)):
        label = f"window {window} + {sinks} sinks (softmax)"
        if label not in done:
            use_window_softmax(model, window, sinks)
            record(_row(label, model, tokenizer, args))


if __name__ == "__main__":
    main()
