"""The shipped SmolLM2 folder (maps trained without the cache) with a cache of 128 pairs per head added, scored
under the probes of ``linattn linearize``'s measure stage (passage 128, gap 512, 4 passages; passkey 1k/2k/4k,
3 trials): the row beside a folder trained with ``--sparse-cache 128``. About 3 minutes on 2 threads.

    .venv/bin/python benchmarks/sparse_cache_shipped.py [--folder DIR] [--split-floor F]

``--folder``: another linearized folder instead of the shipped one. ``--split-floor F``: the same mean split across
heads by retrieval score, each head at least F (scored under softmax on the folder's sampled training texts, or
on the shipped training text; :func:`linattn.linearized.caches.retrieval_split`, as in
``benchmarks/sparse_cache_lm.py``), about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from linattn.evaluate.lm_compare import score_model
from linattn.evaluate.lm_config import ProbeOptions
from linattn.evaluate.lm_stages import read_text
from linattn.linearized import load_linearized, shipped
from linattn.linearized.caches import folder_setting, retrieval_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--split-floor", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    begin = time.perf_counter()
    folder = Path(args.folder) if args.folder else shipped("smollm2")
    if folder is None:
        raise SystemExit("the shipped SmolLM2 folder is missing: reinstall linattn")
    cache: object = 128
    if args.split_floor is not None:
        model, tokenizer = load_linearized(folder)
        _, _, window, sinks = folder_setting(folder)
        cache, source = retrieval_split(folder, model, tokenizer, window, sinks, 128, args.split_floor)
        print(f"split by retrieval score on {source}: largest {max(c.largest for c in cache)}", flush=True)
    model, tokenizer = load_linearized(folder, sparse_cache=cache)
    probes = ProbeOptions(passage_tokens=128, gap_tokens=512, repeat_trials=4, passkey_lengths=(1024, 2048, 4096),
                          passkey_trials=3)
    row = score_model(model, tokenizer, read_text(None, "heldout"), probes)
    row["seconds"] = time.perf_counter() - begin
    print(json.dumps({key: row[key] for key in ("perplexity", "repeat_perplexity", "passkey", "seconds")},
                     default=str))


if __name__ == "__main__":
    main()
