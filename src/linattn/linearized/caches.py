"""A sparse exact cache beside a saved folder, for measuring one the folder was not made with: what the folder
fixes (maps, options, window, sinks) and caches split across heads by retrieval score.

>>> maps, options, window, sinks = folder_setting(folder)                                    # doctest: +SKIP
>>> caches, source = retrieval_split(folder, model, tokenizer, window, sinks, size=128, floor=64)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..evaluate.capture import reordered
from ..evaluate.lm_stages import read_text
from ..feature_maps.fitted import load_feature_maps
from ..train.end_to_end import cache_split
from .folder import load_gates, read_index


def folder_setting(folder: Path) -> tuple[Any, dict[str, Any], int, int]:
    """A folder's maps (its fitted maps loaded, or a registered name), its linearize options without a cache (a
    cache is what the caller sets) and with its gates (``gates``: a delta-rule student's, loaded; so that
    ``hf.linearize(model, maps, **options)`` is the folder's model), its window and sinks."""
    entry = read_index(folder)
    options = {key: value for key, value in entry["options"].items() if key != "sparse_cache"}
    if entry.get("gates"):
        options["gates"] = load_gates(folder, entry["gates"])
    maps: Any = entry["maps"].get("name")
    if "file" in entry["maps"]:
        maps = load_feature_maps(str(folder / entry["maps"]["file"]))
    window = int(options.get("window", getattr(maps, "window", 64)))
    sinks = int(options.get("sinks", getattr(maps, "sinks", 4)))
    return maps, options, window, sinks


def retrieval_split(folder: Path, model: Any, tokenizer: Any, window: int, sinks: int, size: int,
                    floor: int, top: int | None = None) -> tuple[list[Any], str]:
    """One cache per layer, ``size`` pairs per head on average split by the heads' retrieval scores (``top``: among
    the top heads alone; :func:`linattn.train.end_to_end.cache_split`; under softmax, never on held-out text): on
    the folder's sampled training texts (``stages/samples.json``, the first 8) when it has them, else on the
    shipped training text in 8 paragraph orders. Also says which."""
    samples = folder / "stages" / "samples.json"
    if samples.is_file():
        texts = json.loads(samples.read_text(encoding="utf-8"))["texts"][:8]
        sequences = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
        caches, _ = cache_split(model, sequences, window=window, sinks=sinks, mean=size, floor=floor, top=top)
        return caches, "the folder's sampled training texts (stages/samples.json, the first 8)"
    # the shipped training text is ~1.2k tokens: its paragraphs in 8 orders
    caches = text_split(model, tokenizer, read_text(None, "train"), window, sinks, size, floor, top)
    return caches, "the shipped training text, its paragraphs in 8 orders"


def text_split(model: Any, tokenizer: Any, text: str, window: int, sinks: int, size: int, floor: int,
               top: int | None = None, orders: int = 8) -> list[Any]:
    """One cache per layer split by the heads' retrieval scores under softmax on ``text`` in ``orders`` paragraph
    orders (:func:`linattn.train.end_to_end.cache_split`)."""
    sequences = [torch.tensor(tokenizer(piece)["input_ids"]) for piece in reordered(text, orders)]
    caches, _ = cache_split(model, sequences, window=window, sinks=sinks, mean=size, floor=floor, top=top)
    return caches
