"""The product: a causal LM made linear, as a folder that reloads in one line.

- :mod:`~linattn.linearized.folder`: the folder's format, :func:`save_linearized` and :func:`load_linearized`
  (the base model fingerprinted, the maps, the options, the adapters), the folders shipped with linattn;
- :mod:`~linattn.linearized.job`: ``linattn linearize``, the resumable pipeline that fits, trains end to end,
  measures and writes the folder; :mod:`~linattn.linearized.budget` its step counts under ``--budget``;
- :mod:`~linattn.linearized.card`: the folder's ``README.md`` from what was measured;
- :mod:`~linattn.linearized.generate`: ``linattn generate``, text streamed with its cost per token;
- :mod:`~linattn.linearized.arguments`: the two verbs' options.

The product sits above the measuring tools (:mod:`linattn.evaluate`: capture, perplexity, probes, the causal-LM
comparison's stages), which it uses to fit and measure; they never import it. The folder's functions are
reachable from here, imported on first use: the folder loads transformers (through :mod:`linattn.hf`), which
``linattn --help`` and the arguments never need.

>>> model, tokenizer = load_linearized("out/smollm2-lin")                                    # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .folder import fingerprint, is_linearized, load_linearized, read_index, save_linearized, shipped

__all__ = ["fingerprint", "is_linearized", "load_linearized", "read_index", "save_linearized", "shipped"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".folder", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
