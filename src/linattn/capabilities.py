"""The capability table: what each form, backend, decoding step and the context-parallel path supports.

Every "can this path compute this call?" question is answered here, from what is known about a call before it runs
(a :class:`Call`), as a list of reasons why not — empty when the path covers the call. ``linear_attention``,
``decode``, the transformers cache and ``distributed`` ask; none of them decides on its own. When nothing fits,
the error lists each candidate's reasons (as xformers' dispatch does); a single reason is raised as it is.

The rules are written in the folders of the state kinds and of the exact part (``rules.py`` in
:mod:`linattn.kinds.additive`, :mod:`linattn.kinds.gated`, :mod:`linattn.kinds.delta` and :mod:`linattn.exact`:
their routes, their decoding steps' reasons, their kernels' reasons); this module collects them into one table and
answers from it. A new computation (a form, a state kind, an update rule) enters as rows in its folder's rules, one
line in :data:`KINDS` and a runner in :mod:`linattn._dispatch`, not as flags threaded through ``functional``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .backends import native as native_backend
from .backends import triton as triton_backend
from .errors import LinearAttentionError
from .exact import rules as exact_rules
from .exact.rules import COMPOSED_STEP_OPTIONS, SPARSE_STEP_OPTIONS, WINDOW_STEP_OPTIONS
from .kinds._table import STEP_OPTIONS, Call, Route
from .kinds.additive import rules as additive_rules
from .kinds.additive.rules import step_kernel_reasons
from .kinds.delta import rules as delta_rules
from .kinds.delta.rules import DELTA_STEP_OPTIONS
from .kinds.gated import rules as gated_rules

__all__ = [
    "BACKENDS", "COMPOSED_STEP_OPTIONS", "DELTA_STEP_OPTIONS", "KINDS", "ROUTES", "SPARSE_STEP_OPTIONS",
    "STEP_OPTIONS", "WINDOW_STEP_OPTIONS", "Call", "Route", "auto_form", "backend_reasons", "check_window_combination",
    "choose_backend", "choose_route", "choose_step", "chunk_size", "context_parallel_reasons", "native_reasons",
    "native_refusal", "refuse", "step_kernel_reasons", "step_reasons",
]

BACKENDS = ("auto", "torch", "triton", "native")
# "auto" runs non-causal attention chunked beyond this many keys: measured faster from 8192 keys on (features and
# GEMM operands stay in cache), while the global form wins up to 4096 (docs/benchmarks.md, benchmarks/run.py)
NONCAUSAL_CHUNKED_ABOVE = 4096

# the folders whose rules make the table, in the order the routes are listed and the decoding steps tried
KINDS = (additive_rules, gated_rules, exact_rules, delta_rules)
ROUTES: tuple[Route, ...] = tuple(route for kind in KINDS for route in kind.ROUTES)
_STEPS = {name: reasons for kind in KINDS for name, reasons in kind.STEPS.items()}
# the kernels' reasons per route kind; a kind without kernels of its own gets the plain kernels' reasons and its kind
_TRITON = {"plain": additive_rules.triton_reasons, "delta": delta_rules.triton_reasons}
NONCAUSAL_CHUNK = 1024
SPARSE_PARALLEL_UP_TO = 16  # decoding steps and short continuations of the sparse cache run the definition


def chunk_size(route: Route, call: Call) -> int | None:
    """The chunk length ``route`` runs ``call`` with: the one asked for, else the route's default."""
    if call.chunk_size is not None:
        return call.chunk_size
    if route.kind == "plain" and route.form == "chunked" and not call.causal:
        return NONCAUSAL_CHUNK
    return route.chunk


def auto_form(call: Call) -> str:
    """The form "auto" picks (measured defaults): chunked for causal calls; non-causal calls global up to 4096 keys
    unless a chunk size is asked for; the window's one-token continuation of a state token by token."""
    if call.kind in ("window", "delta", "composed"):
        return "recurrent" if call.causal and call.num_queries == 1 and call.carries_state else "chunked"
    if call.kind == "sparse":  # a short continuation: the definition's cost is O(N·(S + W + size)) there too
        return "parallel" if call.causal and call.num_queries <= SPARSE_PARALLEL_UP_TO else "chunked"
    if call.causal or call.chunk_size is not None or call.num_keys > NONCAUSAL_CHUNKED_ABOVE:
        return "chunked"
    return "global"


def refuse(what: str, candidates: list[tuple[str, list[str]]]) -> LinearAttentionError:
    """The error when no candidate covers a call: a lone reason as it is, else every candidate's reasons."""
    if len(candidates) == 1 and len(candidates[0][1]) == 1:
        return LinearAttentionError(candidates[0][1][0])
    lines = "".join(f"\n  - {name}: {reason}" for name, found in candidates for reason in found)
    return LinearAttentionError(f"{what} covers this call:{lines}")


def choose_route(call: Call) -> Route:
    """The route that computes ``call`` (the asked form, or the "auto" choice), or an error listing the reasons."""
    form = auto_form(call) if call.form == "auto" else call.form
    route = next(r for r in ROUTES if r.kind == call.kind and r.form == form)
    found = route.reasons(call)
    if found:
        raise refuse(f"no form of kind {call.kind!r}", [(route.name, found)])
    return route


def check_window_combination(window: object, **others: object) -> None:
    """The window op does not (yet) compose with packing or the Triton backend: refuse, never ignore. Checked
    before anything else runs (packed calls would otherwise split first). Decays, gates and the delta rule compose
    (the "composed" routes)."""
    if window is None:
        return
    given = [name for name, value in others.items() if value is not None and (name != "backend" or value == "triton")]
    if given:
        raise LinearAttentionError(
            f"window: the sliding-window hybrid does not combine with {', '.join(given)} in this version; drop "
            f"window=, or drop {', '.join(given)} (the hybrid alone); packed sequences can run one call per sequence"
        )


# ---- backends -------------------------------------------------------------------------------------------------


def native_reasons(call: Call, route: Route, q: torch.Tensor, *, forced: bool = False) -> list[str]:
    """Why the native CPU kernels (linattn/backends/native/causal.cpp) do not cover the call (before the feature map
    runs); [] when they do. They run the causal recurrence of plain linear attention (an ordinary map, no decay, no
    packing) and of the delta rule (gated, per-feature gated), also as the linear part beside the window, and plain
    non-causal linear attention in two passes. With ``backend="auto"`` they take only ``form="auto"`` calls: a form
    asked for by name runs as that form. What is known only with the tensors (gradients, the value width) is checked
    when the call runs."""
    found = []
    if q.device.type != "cpu":
        found.append(f"device {q.device}: the native kernels run on CPU tensors")
    delta = call.update == "delta"
    if not call.causal and route.kind != "plain":
        found.append(f"causal=False with {route.kind} attention: the native kernels compute non-causal attention "
                     "for plain linear attention only")
    elif route.kind not in ("plain", "delta") and not (route.kind in ("composed", "sparse") and delta):
        found.append(f"{route.kind} attention: the native kernels compute plain causal linear attention and the delta "
                     "rule (alone, beside the window, or beside a sparse cache in which every head keeps every pair "
                     "or none)")
    forms = ("chunked", "recurrent") if call.causal else ("chunked", "global")
    if route.form not in forms or (call.form != "auto" and not forced):
        found.append(f"form {call.form!r}: with backend='auto' the native kernels take form='auto' calls "
                     f"(backend='native' takes {' and '.join(repr(f) for f in forms)} too)")
    if route.kind == "plain":
        if call.log_space:
            found.append("a log-space feature map: the native additive kernel keeps sums at scale 1")
        given = [name for name, value in call.options if value is not None]
        if given:
            found.append(f"{', '.join(given)}: the native additive kernel has no decay or packing (the delta rule's "
                         "kernel takes decays and gates)")
    if not found and native_backend.module("causal") is None:
        found.append(f"the native kernels are not available here ({native_backend.status()})")
    return found


def native_refusal(found: list[str]) -> LinearAttentionError:
    """The error of ``backend="native"`` asked for a call it does not cover, with every reason."""
    return LinearAttentionError("backend='native' does not cover this call: " + "; ".join(found))


def backend_reasons(backend: str, call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Why ``backend`` does not cover the call (before the feature map runs); [] when it does. ``torch`` runs every
    route; ``triton`` declares its own limits per kind (the kinds' ``triton_reasons``); ``native``:
    :func:`native_reasons`."""
    if backend == "torch":
        return []
    if backend == "native":
        return native_reasons(call, route, q, forced=True)
    return _TRITON.get(route.kind, additive_rules.triton_reasons)(call, route, q, dtype)


def choose_backend(backend: str, call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> str:
    """"torch", "triton" or "native" for this call: "auto" takes triton for covered calls on CUDA tensors and the
    native kernels for covered calls on CPU tensors; a forced backend that does not cover the call raises, listing
    every reason."""
    if backend not in BACKENDS:
        raise LinearAttentionError(f"backend: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "native" or (backend == "auto" and q.device.type == "cpu"):
        found = native_reasons(call, route, q, forced=backend == "native")
        if not found:
            return "native"
        if backend == "native":
            raise native_refusal(found)
        return "torch"
    if backend == "auto" and q.device.type != "cuda":
        return "torch"
    found = backend_reasons("triton", call, route, q, dtype)
    if not found:
        return "triton"
    if backend == "triton":
        raise triton_backend.refusal(found)
    return "torch"


# ---- decoding steps --------------------------------------------------------------------------------------------


def step_reasons(step: str, fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why the lean decoding step ``step`` ("plain": :class:`~linattn.decode.DecodeStep`, "window":
    :class:`~linattn.decode.WindowDecodeStep`, "sparse": :class:`~linattn.decode.SparseDecodeStep`, "delta":
    :class:`~linattn.decode.DeltaDecodeStep`, "composed": :class:`~linattn.decode.ComposedDecodeStep`) does not
    compute what ``linear_attention(..., **options)`` would from ``state``; [] when it does."""
    return _STEPS[step](fmap, state, options)


def choose_step(fmap: nn.Module, state: Any, options: dict[str, Any]) -> str | None:
    """"plain", "window", "sparse", "composed", "sparse_composed" or "delta": the lean step that continues
    ``state``, or None (``linear_attention`` runs instead)."""
    for step in _STEPS:
        if not step_reasons(step, fmap, state, options):
            return step
    return None


# ---- context parallelism ---------------------------------------------------------------------------------------

# ---- context parallelism ---------------------------------------------------------------------------------------


def context_parallel_reasons(per_feature_gate: bool, *, update: str = "add", causal: bool = True) -> list[str]:
    """Why a call cannot be split across ranks (each rank's slice summarised as a state); [] when it can.

    The additive update (``update="add"``) sends each slice's sums (and total log-decay); the delta rule
    (``update="delta"``) sends the affine map [A | B] a slice applies to the state entering it (linattn.distributed)."""
    found = []
    if per_feature_gate and update != "delta":  # the delta rule's [A | B] takes them (KDA): diag(a_t) in A
        found.append(
            "log_gate: per-feature gates (..., N, F) are not split across ranks yet (their summary would need a "
            "per-feature total decay); pass one log-decay per token (..., N), or run on one process"
        )
    if update == "delta" and not causal:
        found.append(
            "update='delta': the delta rule is a recurrence, so the slices run in rank order, each from the state "
            "the slices before it leave; pass causal=True"
        )
    return found
