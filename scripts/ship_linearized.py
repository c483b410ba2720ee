"""Copy a folder written by ``linattn linearize`` into the package (``src/linattn/data/linearized/NAME``), with its
maps stored in fp16 (they load into the maps' own fp32 parameters), so that ``linattn generate NAME --linear`` runs
them from a fresh clone. Prints the shipped size and how far the fp16 maps move the logits on a held-out piece.

    .venv/bin/python scripts/ship_linearized.py DIR NAME
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from linattn.evaluate.lm_stages import read_text
from linattn.linearized.folder import SHIPPED, load_linearized

KEPT = ("linattn.json", "results.json", "README.md", "perplexity_by_position.png")


def main() -> None:
    source, name = Path(sys.argv[1]), sys.argv[2]
    target = SHIPPED / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    index = json.loads((source / "linattn.json").read_text(encoding="utf-8"))
    for file in (*KEPT, *([index["gates"]["file"]] if index.get("gates") else [])):  # a delta student's gates
        shutil.copy2(source / file, target / file)
    maps = index["maps"]["file"]
    with safe_open(str(source / maps), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open API
    half = {key: t.half() if t.is_floating_point() else t for key, t in tensors.items()}
    save_file(half, str(target / maps), metadata=metadata)
    size = sum(path.stat().st_size for path in target.iterdir())
    print(f"shipped {target}: {size / 2**20:.2f} MiB ({', '.join(sorted(p.name for p in target.iterdir()))})")
    full, tokenizer = load_linearized(source)
    shipped, _ = load_linearized(target, base=index["base"]["model"])
    ids = tokenizer(read_text(None, "heldout"), return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        a, b = full(ids).logits, shipped(ids).logits
    nll = [torch.nn.functional.cross_entropy(x[0, :-1], ids[0, 1:]).item() for x in (a, b)]
    print(f"fp16 maps against fp32 on 512 held-out tokens: max |Δ logit| {(a - b).abs().max().item():.2e}, "
          f"mean NLL {nll[0]:.5f} → {nll[1]:.5f}")


if __name__ == "__main__":
    main()
