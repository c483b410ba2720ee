"""Input checks for linear_attention(): every message names the argument, what was seen, and what to do.

:mod:`.calls` checks a call's tensors, options, masks and states; :mod:`.updates` the update rule, β, decays and
gates; :mod:`.window` the window op's options and state and the sparse cache. Every check is importable from here.
"""

from __future__ import annotations

from .calls import (
    check_delta_state,
    check_finite,
    check_flags,
    check_options,
    check_qkv,
    check_state,
    check_state_features,
    cu_seqlens,
    key_padding_mask,
)
from .updates import (
    UPDATES,
    check_gate_features,
    check_update,
    delta_beta,
    gate_tokens,
    log_decay,
)
from .window import (
    check_sparse_cache,
    check_window_options,
    check_window_state,
    sparse_cache,
    window_factor,
)

__all__ = [
    "UPDATES",
    "check_delta_state",
    "check_finite",
    "check_flags",
    "check_gate_features",
    "check_options",
    "check_qkv",
    "check_sparse_cache",
    "check_state",
    "check_state_features",
    "check_update",
    "check_window_options",
    "check_window_state",
    "cu_seqlens",
    "delta_beta",
    "gate_tokens",
    "key_padding_mask",
    "log_decay",
    "sparse_cache",
    "window_factor",
]
