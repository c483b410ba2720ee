"""The shipped SmolLM2 folder (maps trained without the cache) with a cache of 128 pairs per head added, scored
under the probes of ``linattn linearize``'s measure stage (passage 128, gap 512, 4 passages; passkey 1k/2k/4k,
3 trials): the row beside a folder trained with ``--sparse-cache 128``. About 3 minutes on 2 threads.

    .venv/bin/python benchmarks/sparse_cache_shipped.py
"""

from __future__ import annotations

import json
import time

import torch

from linattn.evaluate.linearized import load_linearized, shipped
from linattn.evaluate.lm_compare import score_model
from linattn.evaluate.lm_config import ProbeOptions
from linattn.evaluate.lm_stages import read_text


def main() -> None:
    torch.set_num_threads(2)
    begin = time.perf_counter()
    folder = shipped("smollm2")
    if folder is None:
        raise SystemExit("the shipped SmolLM2 folder is missing: reinstall linattn")
    model, tokenizer = load_linearized(folder, sparse_cache=128)
    probes = ProbeOptions(passage_tokens=128, gap_tokens=512, repeat_trials=4, passkey_lengths=(1024, 2048, 4096),
                          passkey_trials=3)
    row = score_model(model, tokenizer, read_text(None, "heldout"), probes)
    row["seconds"] = time.perf_counter() - begin
    print(json.dumps({key: row[key] for key in ("perplexity", "repeat_perplexity", "passkey", "seconds")},
                     default=str))


if __name__ == "__main__":
    main()
