"""The exact part's capability rules: the window + sinks op ("window"), with the sparse cache ("sparse"), and beside
a linear part of another kind ("composed"): their routes and their decoding steps' reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..features import is_log_space, is_signed
from ..kinds._table import STEP_OPTIONS, Call, Route, fixed_option_reasons, step_common
from ..kinds.additive.rules import causal_only, none
from ..kinds.delta.rules import DELTA_STEP_OPTIONS
from ..state import DeltaRuleState, SparseCache, WindowAttentionState

WINDOW_STEP_OPTIONS = STEP_OPTIONS | frozenset({"window", "sinks", "window_factor", "softmax_scale"})
# the sparse cache's step: the window step's options and the cache (an int or a SparseCache) the state was made with
SPARSE_STEP_OPTIONS = WINDOW_STEP_OPTIONS | frozenset({"sparse_cache"})
# the window beside a decayed, gated or delta-rule linear part: the window step's and the delta step's options
# (``log_gate``: given with each token; the option only says that there is one)
COMPOSED_STEP_OPTIONS = WINDOW_STEP_OPTIONS | DELTA_STEP_OPTIONS | frozenset({"log_gate"})


def window_reasons(extra: Callable[[Call], list[str]]) -> Callable[[Call], list[str]]:
    def reasons(call: Call) -> list[str]:
        found = [] if call.normalize else ["window: the hybrid shares softmax's normaliser; use normalize=True"]
        if not call.causal and call.num_queries != call.num_keys:
            found.append(
                f"window: the non-causal band |t − j| < W pairs query t with key t, so Nq must equal Nk, got "
                f"Nq={call.num_queries}, Nk={call.num_keys}"
            )
        return found + extra(call)

    return reasons



def sparse_reasons(call: Call) -> list[str]:
    """The sparse cache's routes: an additive linear part shares softmax's normaliser; the delta family's read-out
    is added to the softmax average."""
    found = [] if call.update == "delta" or call.normalize else ["window: the hybrid shares softmax's normaliser; "
                                                                "use normalize=True"]
    found += [] if call.causal else [
        "sparse_cache: the cache keeps pairs that have left a causal window; pass causal=True (a non-causal call "
        "sees every key in its band or linearly)"
    ]
    return found


def composed_reasons(call: Call) -> list[str]:
    found = [] if call.causal else [
        "window: beside a decay, a gate or the delta rule the linear part is a causal recurrence; pass causal=True"
    ]
    if call.update == "add" and not call.normalize:
        found.append("window: an additive linear part shares softmax's normaliser; use normalize=True")
    return found



def no_global(_: Call) -> list[str]:
    return ["form='global' has no window; use form='chunked' (or 'auto') with window="]



ROUTES: tuple[Route, ...] = (
    Route("window", "parallel", None, window_reasons(none)),
    Route("window", "global", None, window_reasons(no_global)),
    Route("window", "chunked", 64, window_reasons(none)),
    Route("window", "recurrent", None, window_reasons(causal_only)),
    # the window op with a sparse exact cache: the window's chunked path and a per-block correction (chunk: the
    # window's linear part); beside other linear parts their forms on a write stream (exact/forms/sparse_composed.py)
    Route("sparse", "parallel", None, sparse_reasons),
    Route("sparse", "global", None, window_reasons(no_global)),
    Route("sparse", "chunked", 64, sparse_reasons),
    Route("sparse", "recurrent", None, sparse_reasons),
    # the window's exact part beside a linear part of another kind (exact/forms/composed.py): the linear kind's
    # forms on the stream delayed by W (chunk: the linear kind's default, 64 for each)
    Route("composed", "parallel", None, composed_reasons),
    Route("composed", "global", None, lambda call: no_global(call) + composed_reasons(call)),
    Route("composed", "chunked", 64, composed_reasons),
    Route("composed", "recurrent", None, composed_reasons),
)


def window_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why :class:`~linattn.decode.WindowDecodeStep` does not continue ``state``; [] when it does."""
    if type(state) is not WindowAttentionState:
        return [f"state {type(state).__name__}: the window step continues a WindowAttentionState"]
    found = [] if state.linear.kv.dim() == 4 else ["state: the window step needs batch shape (B, H)"]
    if state.cache is not None:
        found.append("state: it carries a sparse cache, which the window step does not keep (linear_attention "
                     "continues it, in the definition's form)")
    found += step_common(fmap, state.linear.kv, options, WINDOW_STEP_OPTIONS)
    if is_log_space(fmap):
        found.append("a log-space feature map: the window step keeps every sum at scale 1")
    return found



def sparse_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    if type(state) is not WindowAttentionState or state.cache is None:
        return [f"state {type(state).__name__}: the sparse step continues a WindowAttentionState that carries a "
                "sparse cache (made with sparse_cache=)"]
    found = [] if state.linear.kv.dim() == 4 else ["state: the sparse step needs batch shape (B, H)"]
    if isinstance(state.linear, DeltaRuleState):
        found.append("state: its linear part is the delta rule (the sparse composed step continues it)")
    found += _cache_option_reasons(state, options)
    found += step_common(fmap, state.linear.kv, options, SPARSE_STEP_OPTIONS)
    if is_log_space(fmap):
        found.append("a log-space feature map: the sparse step, on the window step, keeps every sum at scale 1 "
                     "(the sparse composed step continues it)")
    return found



def _cache_option_reasons(state: WindowAttentionState, options: dict[str, Any]) -> list[str]:
    """Whether the options carry the cache the state was made with."""
    assert state.cache is not None
    option = options.get("sparse_cache")
    cache = SparseCache(option) if isinstance(option, int) and not isinstance(option, bool) else option
    if not isinstance(cache, SparseCache):
        return ["sparse_cache: the options carry no cache (an int or a SparseCache) to continue the state's with"]
    if cache.block_for(state.window) != state.cache.block or not cache.made(state.cache.sizes):
        return ["sparse_cache: not the cache the state was made with (its block or sizes differ)"]
    wrong = cache.score_mismatch(state.cache, state.num_tokens)
    return [f"sparse_cache: {wrong}"] if wrong else []


def sparse_composed_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why :class:`~linattn.decode.SparseComposedDecodeStep` does not continue ``state``: the composed step's rules
    and the cache's; [] when it does."""
    if type(state) is not WindowAttentionState or state.cache is None:
        return [f"state {type(state).__name__}: the sparse composed step continues a WindowAttentionState that "
                "carries a sparse cache (made with sparse_cache=)"]
    found = _cache_option_reasons(state, options)
    decayed = options.get("decay") is not None or bool(options.get("log_gate"))
    if not isinstance(state.linear, DeltaRuleState) and not decayed and not is_log_space(fmap):
        found.append("no decay, gate or delta rule: the sparse step continues the additive, ungated state")
    rest = {name: value for name, value in options.items() if name != "sparse_cache"}
    return found + composed_step_reasons(fmap, dataclasses.replace(state, cache=None), rest)


def composed_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    if type(state) is not WindowAttentionState or state.cache is not None:
        return [f"state {type(state).__name__}: the composed step continues a WindowAttentionState without a "
                "sparse cache"]
    delta = isinstance(state.linear, DeltaRuleState)
    found = [] if state.linear.kv.dim() == 4 else ["state: the composed step needs batch shape (B, H)"]
    if state.linear.kv.dtype not in (torch.float32, torch.float64):
        found.append(f"state in {state.linear.kv.dtype}: the steps keep fp32 or fp64 sums")
    unknown = sorted(set(options) - COMPOSED_STEP_OPTIONS)
    if unknown:
        found.append(f"options {', '.join(unknown)}: not reproduced by the step")
    if delta != (options.get("update") == "delta"):
        found.append("update: the state's linear part and the options' update rule differ")
    if not delta and (not options.get("normalize", True) or is_signed(fmap)):
        found.append("an additive linear part: the step computes normalised attention with a positive map")
    return found + fixed_option_reasons(options)



STEPS: dict[str, Callable[[nn.Module, Any, dict[str, Any]], list[str]]] = {
    "window": window_step_reasons, "sparse": sparse_step_reasons, "composed": composed_step_reasons,
    "sparse_composed": sparse_composed_step_reasons,
}
