"""A small English corpus written for linattn: varied prose in a train part and a held-out part.

Used by ``linattn compare`` to fit learned feature maps (train) and to measure every map (held-out) on real
attention. Paragraphs are separated by blank lines.

>>> from linattn.data import load_text
>>> len(load_text("train").split()) > 500
True
"""

from __future__ import annotations

import os
from importlib import resources

from ..errors import LinearAttentionError

SPLITS = ("train", "heldout", "heldout_long")


def load_text(split: str = "train") -> str:
    """The text of one split: ``"train"``, ``"heldout"``, or ``"heldout_long"`` (about 5,000 tokens of other
    prose, for probes that need a passage thousands of tokens back)."""
    if split not in SPLITS:
        raise LinearAttentionError(f"split: expected one of {SPLITS}, got {split!r}")
    return resources.files(__name__).joinpath(f"{split}.txt").read_text(encoding="utf-8")


def check_text_file(path: str | None, name: str) -> None:
    """A text file given on the command line exists, is a file, and reads as UTF-8 (None: the shipped corpus)."""
    if path is None:
        return
    if not os.path.exists(path):
        raise LinearAttentionError(f"{name}: no such file {path!r}; pass the path of a UTF-8 text file")
    if not os.path.isfile(path):
        raise LinearAttentionError(f"{name}: {path!r} is not a file; pass the path of a UTF-8 text file")
    try:
        with open(path, encoding="utf-8") as handle:
            handle.read()
    except UnicodeDecodeError as error:
        raise LinearAttentionError(
            f"{name}: {path!r} is not UTF-8 text (byte {error.start}: {error.reason}); pass a plain text file"
        ) from None


def paragraphs(text: str) -> list[str]:
    """Non-empty paragraphs of ``text`` (blank-line separated), with inner whitespace collapsed."""
    return [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]
