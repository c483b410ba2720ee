"""The capability table: what each form, backend, decoding step and the context-parallel path supports.

Every "can this path compute this call?" question is answered here, from what is known about a call before it runs
(a :class:`Call`), as a list of reasons why not — empty when the path covers the call. ``linear_attention``,
``decode``, the transformers cache and ``distributed`` ask; none of them decides on its own. When nothing fits,
the error lists each candidate's reasons (as xformers' dispatch does); a single reason is raised as it is.

A new computation (a form, a state kind, an update rule) enters as rows here and a runner in
:mod:`linattn._dispatch`, not as flags threaded through ``functional``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .backends import triton as triton_backend
from .errors import LinearAttentionError
from .features import is_log_space, is_signed
from .state import DeltaRuleState, LinearAttentionState, SparseCache, WindowAttentionState

BACKENDS = ("auto", "torch", "triton")
# "auto" runs non-causal attention chunked beyond this many keys: measured faster from 8192 keys on (features and
# GEMM operands stay in cache), while the global form wins up to 4096 (docs/benchmarks.md, benchmarks/run.py)
NONCAUSAL_CHUNKED_ABOVE = 4096


@dataclass(frozen=True)
class Call:
    """What a path needs to know of a ``linear_attention`` call to say whether it covers it."""

    kind: str  # "plain", "gated" (per-feature gates), "window" (the window + sinks op), "sparse" (the window op
    # with a sparse exact cache), "delta" (the delta rule) or "composed" (the window beside a decayed or gated
    # linear part, or the delta rule)
    causal: bool
    form: str  # as asked: "auto" or a name of FORMS
    num_queries: int
    num_keys: int
    chunk_size: int | None = None
    carries_state: bool = False  # an initial state is given
    normalize: bool = True
    log_space: bool = False
    # options a backend may not know (decays, gates, packing), with their values: each one given is a reason
    options: tuple[tuple[str, Any], ...] = ()
    update: str = "add"  # the state's update rule: "add" or "delta"


@dataclass(frozen=True)
class Route:
    """One computation: ``kind`` × ``form``, its default chunk length, and why it cannot run a call."""

    kind: str
    form: str
    chunk: int | None
    reasons: Callable[[Call], list[str]]

    @property
    def name(self) -> str:
        return self.form if self.kind == "plain" else f"{self.kind}.{self.form}"


def _none(_: Call) -> list[str]:
    return []


def _causal_only(call: Call) -> list[str]:
    return [] if call.causal else ["form='recurrent' is the causal token-by-token form; pass causal=True"]


def _global(call: Call) -> list[str]:
    return ["form='global' is non-causal; pass causal=False, or form='chunked'"] if call.causal else []


def _window(extra: Callable[[Call], list[str]]) -> Callable[[Call], list[str]]:
    def reasons(call: Call) -> list[str]:
        found = [] if call.normalize else ["window: the hybrid shares softmax's normaliser; use normalize=True"]
        if not call.causal and call.num_queries != call.num_keys:
            found.append(
                f"window: the non-causal band |t − j| < W pairs query t with key t, so Nq must equal Nk, got "
                f"Nq={call.num_queries}, Nk={call.num_keys}"
            )
        return found + extra(call)

    return reasons


def _delta(form_reason: str | None) -> Callable[[Call], list[str]]:
    def reasons(call: Call) -> list[str]:
        found = [] if call.causal else ["update='delta' is a causal recurrence; pass causal=True"]
        if call.normalize:
            found.append("update='delta' keeps no Σφ(k) to normalise by; pass normalize=False")
        return found + ([form_reason] if form_reason else [])

    return reasons


def _sparse(call: Call) -> list[str]:  # an additive part shares softmax's normaliser; the delta read-out is added
    found = [] if call.update == "delta" or call.normalize else ["window: the hybrid shares softmax's normaliser; "
                                                                "use normalize=True"]
    found += [] if call.causal else [
        "sparse_cache: the cache keeps pairs that have left a causal window; pass causal=True (a non-causal call "
        "sees every key in its band or linearly)"
    ]
    if call.log_space:
        found.append("sparse_cache: log-space feature maps (FAVOR+ and kin) are not covered in this version; use an "
                     "ordinary map (elu, relu, hedgehog, fitted maps)")
    return found


def _composed(call: Call) -> list[str]:
    found = [] if call.causal else [
        "window: beside a decay, a gate or the delta rule the linear part is a causal recurrence; pass causal=True"
    ]
    if call.update == "add" and not call.normalize:
        found.append("window: an additive linear part shares softmax's normaliser; use normalize=True")
    if call.log_space:
        found.append("window: log-space feature maps (FAVOR+ and kin) beside a decay, a gate or the delta rule are "
                     "not covered in this version; use an ordinary map (elu, relu, hedgehog, fitted maps)")
    return found


def _window_global(_: Call) -> list[str]:
    return ["form='global' has no window; use form='chunked' (or 'auto') with window="]


# default chunk lengths: causal 64 and non-causal 1024 (docs/benchmarks.md); per-feature gates 64, measured best of
# 16/32/64 (docs/decay.md); the window's linear part 64
ROUTES: tuple[Route, ...] = (
    Route("plain", "parallel", None, _none),
    Route("plain", "global", None, _global),
    Route("plain", "chunked", 64, _none),  # non-causal: 1024, see chunk_size()
    Route("plain", "recurrent", None, _causal_only),
    Route("gated", "parallel", None, _none),
    Route("gated", "global", None, _global),
    Route("gated", "chunked", 64, _none),
    Route("gated", "recurrent", None, _none),
    Route("window", "parallel", None, _window(_none)),
    Route("window", "global", None, _window(_window_global)),
    Route("window", "chunked", 64, _window(_none)),
    Route("window", "recurrent", None, _window(_causal_only)),
    # the window op with a sparse exact cache: the window's chunked path and a per-block correction (chunk: the
    # window's linear part); beside other linear parts their forms on a write stream (forms/window/sparse_composed)
    Route("sparse", "parallel", None, _sparse),
    Route("sparse", "global", None, _window(_window_global)),
    Route("sparse", "chunked", 64, _sparse),
    Route("sparse", "recurrent", None, _sparse),
    # the window's exact part beside a linear part of another kind (forms/window/composed.py): the linear kind's
    # forms on the stream delayed by W (chunk: the linear kind's default, 64 for each)
    Route("composed", "parallel", None, _composed),
    Route("composed", "global", None, lambda call: _window_global(call) + _composed(call)),
    Route("composed", "chunked", 64, _composed),
    Route("composed", "recurrent", None, _composed),
    # the delta rule: chunk 64 measured best of 32/64/128 at N = 16384 (docs/delta.md); "parallel" is the same
    # UT transform over the whole sequence as one chunk (quadratic in N)
    Route("delta", "parallel", None, _delta(None)),
    Route("delta", "global", None, _delta("form='global' is non-causal; the delta rule runs 'chunked' or 'recurrent'")),
    Route("delta", "chunked", 64, _delta(None)),
    Route("delta", "recurrent", None, _delta(None)),
)
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


def backend_reasons(backend: str, call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Why ``backend`` does not cover the call (before the feature map runs); [] when it does. ``torch`` runs every
    route; ``triton`` declares its own limits (:func:`linattn.backends.triton.reasons`, and for the delta rule
    :func:`~linattn.backends.triton.delta_reasons`)."""
    if backend == "torch":
        return []
    options = dict(call.options)
    if route.kind == "delta":  # per-token decays are in the delta kernels, per-feature gates not
        found = triton_backend.delta_reasons(q, form=route.form, chunk_size=call.chunk_size, dtype=dtype)
        given = {name: value for name, value in options.items() if name not in ("decay", "log_gate")}
        gate = options.get("log_gate")
        if isinstance(gate, torch.Tensor) and gate.dim() == q.dim():
            found.append("log_gate: per-feature gates (..., N, F) with update='delta' (KDA) are not in the delta "
                         "kernels, which take one log-decay per token; backend='torch' (or 'auto') runs them")
        return found + triton_backend.option_reasons(given)
    found = triton_backend.reasons(
        q, causal=call.causal, form=route.form, log_space=call.log_space, chunk_size=call.chunk_size, dtype=dtype
    )
    if route.kind != "plain":
        found.append(f"{route.kind} attention: the kernels compute plain causal linear attention and the delta rule")
    return found + triton_backend.option_reasons(options)


def choose_backend(backend: str, call: Call, route: Route, q: torch.Tensor, dtype: torch.dtype) -> str:
    """"torch" or "triton" for this call: "auto" takes triton for covered calls on CUDA tensors; a forced backend
    that does not cover the call raises, listing every reason."""
    if backend not in BACKENDS:
        raise LinearAttentionError(f"backend: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch" or (backend == "auto" and q.device.type != "cuda"):
        return "torch"
    found = backend_reasons("triton", call, route, q, dtype)
    if not found:
        return "triton"
    if backend == "triton":
        raise triton_backend.refusal(found)
    return "torch"


# ---- decoding steps --------------------------------------------------------------------------------------------

# linear_attention options a step reproduces; any other option (window=, sinks=, min_denom=, ...) is left to it
STEP_OPTIONS = frozenset({"eps", "chunk_size", "form"})
WINDOW_STEP_OPTIONS = STEP_OPTIONS | frozenset({"window", "sinks", "window_factor", "softmax_scale"})
# the sparse cache's step: the window step's options and the cache (an int or a SparseCache) the state was made with
SPARSE_STEP_OPTIONS = WINDOW_STEP_OPTIONS | frozenset({"sparse_cache"})
# the delta step: a fixed β and decay rate come as options, per-token ones with each call
DELTA_STEP_OPTIONS = STEP_OPTIONS | frozenset({"update", "normalize", "beta", "decay"})
# the window beside a decayed, gated or delta-rule linear part: the window step's and the delta step's options
# (``log_gate``: given with each token; the option only says that there is one)
COMPOSED_STEP_OPTIONS = WINDOW_STEP_OPTIONS | DELTA_STEP_OPTIONS | frozenset({"log_gate"})


def _step_common(fmap: nn.Module, kv: torch.Tensor, options: dict[str, Any], allowed: frozenset[str]) -> list[str]:
    found = []
    if kv.dtype not in (torch.float32, torch.float64):
        found.append(f"state in {kv.dtype}: the steps keep fp32 or fp64 sums")
    unknown = sorted(set(options) - allowed)
    if unknown:
        found.append(f"options {', '.join(unknown)}: not reproduced by the step")
    if not options.get("normalize", True):
        found.append("normalize=False: the steps compute normalised attention")
    if is_signed(fmap):
        found.append("a signed feature map: the steps take positive maps")
    return found


def step_reasons(step: str, fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    """Why the lean decoding step ``step`` ("plain": :class:`~linattn.decode.DecodeStep`, "window":
    :class:`~linattn.decode.WindowDecodeStep`, "sparse": :class:`~linattn.decode.SparseDecodeStep`, "delta":
    :class:`~linattn.decode.DeltaDecodeStep`) does not compute what ``linear_attention(..., **options)`` would from
    ``state``; [] when it does."""
    if step == "delta":
        return _delta_step_reasons(state, options)
    if step == "composed":
        return _composed_step_reasons(fmap, state, options)
    if step == "sparse":
        return _sparse_step_reasons(fmap, state, options)
    if step == "sparse_composed":
        return _sparse_composed_step_reasons(fmap, state, options)
    if step == "plain":
        if type(state) is not LinearAttentionState:
            return [f"state {type(state).__name__}: the step continues a LinearAttentionState"]
        return _step_common(fmap, state.kv, options, STEP_OPTIONS)
    if type(state) is not WindowAttentionState:
        return [f"state {type(state).__name__}: the window step continues a WindowAttentionState"]
    found = [] if state.linear.kv.dim() == 4 else ["state: the window step needs batch shape (B, H)"]
    if state.cache is not None:
        found.append("state: it carries a sparse cache, which the window step does not keep (linear_attention "
                     "continues it, in the definition's form)")
    found += _step_common(fmap, state.linear.kv, options, WINDOW_STEP_OPTIONS)
    if is_log_space(fmap):
        found.append("a log-space feature map: the window step keeps every sum at scale 1")
    return found


def _sparse_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    if type(state) is not WindowAttentionState or state.cache is None:
        return [f"state {type(state).__name__}: the sparse step continues a WindowAttentionState that carries a "
                "sparse cache (made with sparse_cache=)"]
    found = [] if state.linear.kv.dim() == 4 else ["state: the sparse step needs batch shape (B, H)"]
    if isinstance(state.linear, DeltaRuleState):
        found.append("state: its linear part is the delta rule (the sparse composed step continues it)")
    found += _cache_option_reasons(state, options)
    found += _step_common(fmap, state.linear.kv, options, SPARSE_STEP_OPTIONS)
    if is_log_space(fmap):
        found.append("a log-space feature map: the sparse step keeps every sum at scale 1 (and the cache takes "
                     "ordinary maps)")
    return found


def _cache_option_reasons(state: WindowAttentionState, options: dict[str, Any]) -> list[str]:
    assert state.cache is not None  # the options carry the cache the state was made with?
    option = options.get("sparse_cache")
    cache = SparseCache(option) if isinstance(option, int) and not isinstance(option, bool) else option
    if not isinstance(cache, SparseCache):
        return ["sparse_cache: the options carry no cache (an int or a SparseCache) to continue the state's with"]
    if cache.block_for(state.window) != state.cache.block or not cache.made(state.cache.sizes):
        return ["sparse_cache: not the cache the state was made with (its block or sizes differ)"]
    wrong = cache.score_mismatch(state.cache, state.num_tokens)
    return [f"sparse_cache: {wrong}"] if wrong else []


def _sparse_composed_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
    if type(state) is not WindowAttentionState or state.cache is None:  # the composed step's rules and the cache's
        return [f"state {type(state).__name__}: the sparse composed step continues a WindowAttentionState that "
                "carries a sparse cache (made with sparse_cache=)"]
    found = _cache_option_reasons(state, options)
    if not isinstance(state.linear, DeltaRuleState) and options.get("decay") is None and not options.get("log_gate"):
        found.append("no decay, gate or delta rule: the sparse step continues the additive, ungated state")
    rest = {name: value for name, value in options.items() if name != "sparse_cache"}
    return found + _composed_step_reasons(fmap, dataclasses.replace(state, cache=None), rest)


def _composed_step_reasons(fmap: nn.Module, state: Any, options: dict[str, Any]) -> list[str]:
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
    if is_log_space(fmap):
        found.append("a log-space feature map: the composed step keeps every sum at scale 1")
    return found + _fixed_option_reasons(options)


def _fixed_option_reasons(options: dict[str, Any]) -> list[str]:
    """A step's fixed β and decay options: one β in [0, 2], a decay rate as a float or one per head."""
    found = []
    beta = options.get("beta")
    if beta is not None and not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta <= 2):
        found.append("beta: the step takes one float in [0, 2] as an option (per-token β with each call)")
    decay = options.get("decay")
    if isinstance(decay, torch.Tensor) and decay.dim() > 1:
        found.append("decay: the step takes a float or one rate per head (H,)")
    return found


def _delta_step_reasons(state: Any, options: dict[str, Any]) -> list[str]:
    if type(state) is not DeltaRuleState:
        return [f"state {type(state).__name__}: the delta step continues a DeltaRuleState"]
    found = [] if state.kv.dim() == 4 else ["state: the delta step needs batch shape (B, H)"]
    if state.kv.dtype not in (torch.float32, torch.float64):
        found.append(f"state in {state.kv.dtype}: the steps keep fp32 or fp64 sums")
    unknown = sorted(set(options) - DELTA_STEP_OPTIONS)
    if unknown:
        found.append(f"options {', '.join(unknown)}: not reproduced by the step")
    if options.get("update") != "delta" or options.get("normalize"):
        found.append("the delta step computes update='delta' (normalize=False)")
    return found + _fixed_option_reasons(options)


def choose_step(fmap: nn.Module, state: Any, options: dict[str, Any]) -> str | None:
    """"plain", "window", "sparse", "delta", "composed" or "sparse_composed": the lean step that continues
    ``state``, or None (``linear_attention`` runs instead)."""
    for step in ("plain", "window", "sparse", "delta", "composed", "sparse_composed"):
        if not step_reasons(step, fmap, state, options):
            return step
    return None


def step_kernel_reasons(kv: torch.Tensor, log_space: bool, eps: float) -> list[str]:
    """Why the Triton decoding kernel does not run a :class:`~linattn.decode.DecodeStep` on this state."""
    found = []
    if not (kv.device.type == "cuda" or (kv.device.type == "cpu" and triton_backend.interpreting())):
        found.append(f"device {kv.device}: the kernel runs on CUDA tensors (on CPU under TRITON_INTERPRET=1)")
    if kv.dtype != torch.float32:
        found.append(f"state in {kv.dtype}: the kernel keeps fp32 sums")
    if log_space:
        found.append("a log-space feature map")
    if eps <= 0:
        found.append("eps ≤ 0")
    if max(kv.shape[-2:]) > triton_backend.MAX_DIM:
        found.append(f"F or Dv > {triton_backend.MAX_DIM}")
    error = triton_backend.import_error() if not found else None
    return found + ([error] if error else [])


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
