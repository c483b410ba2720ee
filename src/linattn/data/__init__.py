"""A small English corpus written for linattn: varied prose in a train part and a held-out part.

Used by ``linattn compare`` to fit learned feature maps (train) and to measure every map (held-out) on real
attention. Paragraphs are separated by blank lines.

>>> from linattn.data import load_text
>>> len(load_text("train").split()) > 500
True
"""

from __future__ import annotations

from importlib import resources

from ..errors import LinearAttentionError

SPLITS = ("train", "heldout")


def load_text(split: str = "train") -> str:
    """The text of one split: ``"train"`` or ``"heldout"``."""
    if split not in SPLITS:
        raise LinearAttentionError(f"split: expected one of {SPLITS}, got {split!r}")
    return resources.files(__name__).joinpath(f"{split}.txt").read_text(encoding="utf-8")


def paragraphs(text: str) -> list[str]:
    """Non-empty paragraphs of ``text`` (blank-line separated), with inner whitespace collapsed."""
    return [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]
