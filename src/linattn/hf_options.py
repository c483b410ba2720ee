"""The options :func:`linattn.hf.linearize` takes, checked once before any layer is replaced: which go to every
attention call and which to a named feature map, each checked as ``linear_attention`` would check it; the gates
modules; a sparse cache as a saved folder's JSON holds it."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import _validate
from .capabilities import BACKENDS, check_window_combination
from .errors import LinearAttentionError
from .forms import FORMS
from .functional import linear_attention
from .state import SparseCache

_OWN_ARGUMENTS = frozenset({"q", "k", "v", "feature_map", "causal", "key_padding_mask", "initial_state",
                            "return_state"})


def split_options(options: dict[str, Any], fitted: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options for linear_attention, options for a named map): by what ``linear_attention`` accepts."""
    accepted = set(inspect.signature(linear_attention).parameters) - _OWN_ARGUMENTS
    attention = {name: options.pop(name) for name in list(options) if name in accepted}
    for name in ("window", "sinks"):
        carried = getattr(fitted, name, None)  # maps fitted with a window in place carry it
        if name not in attention and carried is not None:
            attention[name] = carried
    return attention, options


def check_attention_options(options: dict[str, Any]) -> None:
    """The options every attention call will get, checked as ``linear_attention`` would check them."""
    get = options.get
    _validate.check_flags(**{name: options[name] for name in ("normalize", "check_finite") if name in options})
    _validate.check_options(get("chunk_size"), get("eps", 1e-6), get("min_denom"), get("form", "auto"), FORMS)
    _validate.check_window_options(get("window"), get("sinks", 0), get("window_factor"), get("softmax_scale"))
    check_window_combination(get("window"), backend=get("backend"))
    _validate.sparse_cache(get("sparse_cache"), get("window"), get("update", "add"), None)
    if get("backend", "auto") not in BACKENDS:
        raise LinearAttentionError(f"backend: unknown backend {get('backend')!r}; choose one of {', '.join(BACKENDS)}")
    update = get("update", "add")
    if update != "add" or get("beta") is not None:  # the delta rule's own checks (causal: decoders; no log_gate)
        normalize = get("normalize", update != "delta")
        _validate.check_update(update, get("beta"), True, normalize, get("min_denom"), None, torch.empty(0))


def check_gates(gates: Sequence[nn.Module] | None, layers: int, options: dict[str, Any]) -> list[nn.Module] | None:
    """One gates module per layer, and the options they need: β only with the delta rule, neither with fixed ones."""
    if gates is None:
        return None
    if isinstance(gates, nn.Module) or not isinstance(gates, Sequence) or len(gates) != layers:
        raise LinearAttentionError(f"gates: expected one module per attention layer ({layers}), got "
                                   f"{type(gates).__name__}{'' if not isinstance(gates, Sequence) else len(gates)}")
    for layer, module in enumerate(gates):
        if not isinstance(module, nn.Module):
            raise LinearAttentionError(f"gates[{layer}]: expected an nn.Module, got {type(module).__name__}")
        gives_beta = getattr(module, "beta_weight", None) is not None
        if gives_beta and options.get("update", "add") != "delta":
            raise LinearAttentionError(f"gates[{layer}]: gives a write strength β, which belongs to the delta rule; "
                                       "pass update='delta' (or gates without β)")
        if gives_beta and options.get("beta") is not None:
            raise LinearAttentionError("beta: a fixed β beside gates that compute one per token; drop beta=")
        if getattr(module, "readout", None) is not None and (options.get("window") is None
                                                             or options.get("window_factor") is not None):
            raise LinearAttentionError(f"gates[{layer}]: a read-out weight λ weighs the memory beside the window "
                                       "(γ = 1/λ): pass window= and no window_factor=")
    return list(gates)


def cache_from_json(cache: Any) -> Any:
    """A sparse cache as a saved folder's options hold it: a list of per-head sizes, or a dict of
    :class:`~linattn.SparseCache` fields (``size`` and ``linear_weight`` lists are per head); anything else as given."""
    if isinstance(cache, list | tuple):
        return SparseCache(size=tuple(cache))
    if isinstance(cache, dict):
        fields = {"size", "score", "block", "linear_weight"}
        if not set(cache) <= fields:
            raise LinearAttentionError(f"sparse_cache: unknown fields {sorted(set(cache) - fields)} in {cache!r}; "
                                       f"a cache as JSON has {', '.join(sorted(fields))}")
        fields_given: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                                        for key, value in cache.items()}
        return SparseCache(**fields_given)
    return cache
