"""The old import path of the linearized folder (save, load, fingerprint): the product lives in
:mod:`linattn.linearized` now (:mod:`linattn.linearized.folder`), apart from the measuring tools; this module keeps
``linattn.evaluate.linearized`` working."""

from __future__ import annotations

from ..linearized.folder import (
    ADAPTERS_FOLDER,
    FORMAT,
    INDEX,
    MAPS_FILE,
    RESULTS_FILE,
    SHIPPED,
    VERSION,
    atomic_write,
    fingerprint,
    is_linearized,
    load_linearized,
    read_index,
    save_linearized,
    shipped,
)

__all__ = [
    "ADAPTERS_FOLDER",
    "FORMAT",
    "INDEX",
    "MAPS_FILE",
    "RESULTS_FILE",
    "SHIPPED",
    "VERSION",
    "atomic_write",
    "fingerprint",
    "is_linearized",
    "load_linearized",
    "read_index",
    "save_linearized",
    "shipped",
]
