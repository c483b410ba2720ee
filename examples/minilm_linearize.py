"""Linearize all-MiniLM-L6-v2 and compare its sentence embeddings with the original's.

Every attention layer of the pretrained encoder is switched to linear attention (``linattn.hf.linearize``) with
(a) Hedgehog maps fitted per layer and head to the model's own softmax attention (``linattn.train``) on the
corpus's train split, (b) elu+1, (c) FAVOR+ (m = 128 random features per head). For each, the sentence embeddings
(mean pooling over non-padding tokens, L2-normalised) of the held-out split's sentences are compared with the
softmax model's by cosine similarity. Nothing is fine-tuned: only the feature maps change.

    python examples/minilm_linearize.py              # uses the shipped fitted maps (examples/data/)
    python examples/minilm_linearize.py --fit        # refits them first (65 s on 2 quiet CPU cores)
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any

import torch

from linattn import hf
from linattn.data import load_text, paragraphs

HERE = os.path.dirname(os.path.abspath(__file__))
FITTED_MAPS = os.path.join(HERE, "data", "minilm_l6_hedgehog.safetensors")
FIT_OPTIONS: dict[str, Any] = {"kind": "hedgehog", "seed": 0}  # fit_feature_map's defaults
CAPTURE_ORDERS = 4  # the train split in 4 paragraph orders
CAPTURE_TOKENS = 128  # train-split pieces of ≤ 128 tokens


def heldout_sentences(min_words: int = 4) -> list[str]:
    """The sentences of the corpus's held-out split (never seen by the fit)."""
    pieces = (re.split(r"(?<=[.!?])\s+", p) for p in paragraphs(load_text("heldout")))
    return [s for piece in pieces for s in piece if len(s.split()) >= min_words]


def fit_maps(model: Any, tokenizer: Any, name: str, path: str = FITTED_MAPS) -> Any:
    """Capture q, k on the train split and fit one Hedgehog map per layer (per-head parameters); save to ``path``."""
    from linattn.evaluate import capture_attention
    from linattn.train import fit_model_feature_maps

    capture = capture_attention(model, tokenizer, load_text("train"), max_tokens=CAPTURE_TOKENS, model_name=name,
                                orders=CAPTURE_ORDERS)
    fitted = fit_model_feature_maps(capture, **FIT_OPTIONS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fitted.save(path)
    return fitted


def compare(model: Any, tokenizer: Any, sentences: list[str], fitted: Any, *, favor_features: int = 128,
            seed: int = 0) -> dict[str, float]:
    """Mean cosine similarity with the softmax model's embeddings, per map. Leaves ``model`` back on softmax."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    exact = hf.sentence_embeddings(model, tokenizer, sentences)
    results = {}
    variants: list[tuple[str, Any, dict[str, Any]]] = [
        ("hedgehog (fitted)", fitted, {}),
        ("elu+1", "elu", {}),
        (f"favor+ (m={favor_features})", "favor+", {"num_features": favor_features, "seed": seed}),
    ]
    try:
        for label, maps, options in variants:
            hf.linearize(model, maps, **options)
            linear = hf.sentence_embeddings(model, tokenizer, sentences)
            results[label] = float((linear * exact).sum(-1).mean())
    finally:
        model.set_attn_implementation(previous)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="refit the Hedgehog maps (and overwrite the shipped file)")
    parser.add_argument("--maps", default=FITTED_MAPS, help="fitted maps file (linattn.feature_maps.fitted format)")
    args = parser.parse_args()
    from linattn.evaluate import load_model
    from linattn.feature_maps.fitted import load_feature_maps

    torch.manual_seed(0)
    model, tokenizer, name = load_model()
    if args.fit:
        start = time.perf_counter()
        fit_maps(model, tokenizer, name, args.maps)
        print(f"fitted {FIT_OPTIONS} in {time.perf_counter() - start:.0f} s → {args.maps}")
    fitted = load_feature_maps(args.maps)
    sentences = heldout_sentences()
    print(f"{name}: mean cosine similarity of sentence embeddings, linearized vs softmax, "
          f"{len(sentences)} held-out sentences")
    for label, cosine in compare(model, tokenizer, sentences, fitted).items():
        print(f"  {label:<22} {cosine:.3f}")


if __name__ == "__main__":
    main()
