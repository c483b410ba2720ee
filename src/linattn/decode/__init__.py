"""A lean causal decode step: one new token per call against a preallocated fp32 state updated in place.

``linear_attention(..., initial_state=s, return_state=True)`` on one token costs ~0.3 ms per call at H = 8,
d = 64, almost all of it argument checking, dtype/device handling and allocation of new state tensors — per layer
and per generated token. :class:`DecodeStep` pays the checks once (when it is built from a state) and then does, per
token, the feature maps and a handful of in-place ops:

    S ← S·c + φ(k)vᵀ,   z ← z·c + φ(k),   out = φ(q)·S / (φ(q)·z + eps)

(c = exp(shift_old − shift_new) ≤ 1 for log-space maps, whose sums are kept at the running maximum log-feature
``shift``; no rescaling for ordinary maps). The arithmetic is the recurrent form's
(:mod:`linattn.kinds.additive.forms.recurrent`), so a step agrees with ``linear_attention`` up to fp32 rounding
(tests/test_decoder_generate.py).

Only the plain state (:class:`~linattn.LinearAttentionState`), ``normalize=True``, no ``min_denom`` and a positive
map qualify (:func:`supports`). On a CUDA device with triton installed, an ordinary map's step (no padding mask) is
one launch of the Triton decoding kernel on the state in place, elu + 1 made inside it (8.9 µs per layer step at
H = 32, d = 128 on an H200 in a CUDA graph: docs/benchmarks.md).

:class:`WindowDecodeStep` does the same for the sliding-window hybrid (``window=W, sinks=S``, either scale form) with
an ordinary (not log-space) map: one preallocated buffer of S sink slots and a ring of W slots holding each exact
key, its value and its feature vector φ(k) (computed once, when the key arrives — the recurrent form recomputes
φ of all W + S buffered keys every token), and the linear sums of the keys that have left the window. Per token:
the key leaving the window enters the linear sums (a sink instead becomes a separate exact key), the new key takes
its slot, and the output is the hybrid's (mass form: out = (φ(q)·S + M·A) / (φ(q)·z + M + eps), A the softmax
average over the live exact keys, M = Σ_exact φ(q)·φ(k); γ form: the γ-weighted exact sums). Anything else —
log-space maps, ``min_denom``, other options — goes through ``linear_attention`` (:func:`supports_window`).
With grouped-query attention (``kv_heads=``) the exact keys and values are held once per key/value head.
:meth:`WindowDecodeStep.stack` joins one-row steps into the step of a left-padded batch in which each row keeps its
own first S tokens as sinks.

:class:`SparseDecodeStep` is the window step for the window op with a sparse exact cache (``sparse_cache=``): λ more
exact slots per query head hold the cached pairs, and every B tokens a boundary scores and chooses them with the
functions that define the op (:mod:`linattn.exact.forms.sparse`); between boundaries a token costs the window
step's ops on S + W + λ slots and two small ones more (:mod:`linattn.exact.sparse_step`).

:class:`DeltaDecodeStep` continues a :class:`~linattn.DeltaRuleState` (``update="delta"``, DeltaNet and Gated
DeltaNet): S ← a·S, u = β(v − Sᵀk̂), S += k̂uᵀ, o = Sᵀq̂ on the preallocated memory, a fixed β and decay from the
options or per-token ones with each call (:mod:`linattn.kinds.delta.step`).

:class:`ComposedDecodeStep` continues the window beside a decayed, gated or delta-rule linear part: the leaving
key is written with the token's decay (the delta rule through a :class:`DeltaDecodeStep`), the new key takes its
ring slot, and the window's combiner gives the output (:mod:`linattn.exact.composed_step`).

:class:`SparseComposedDecodeStep` continues the sparse cache beside such a linear part: at a boundary the cache is
chosen against the decayed sums or the delta memory, and the step's decay precedes the writes of the pairs leaving
the exact part at that step (the dropped cached pairs, then the key leaving the window;
:mod:`linattn.exact.sparse_composed_step`).

Both also take a layer's whole token in one C++ call on the CPU (``fused_token``: the key gates' β and log-gate, the
Hedgehog maps, the token and the gates' read-out weight λ, from the layer's raw q, k and v;
:mod:`linattn.backends.native`), which :mod:`linattn.hf`'s attention function tries first, before it builds the
call's options; where it declines, the step's own call runs.
"""

from __future__ import annotations

from ..capabilities import (
    COMPOSED_STEP_OPTIONS,
    DELTA_STEP_OPTIONS,
    SPARSE_STEP_OPTIONS,
    STEP_OPTIONS,
    WINDOW_STEP_OPTIONS,
)
from ..exact.composed_step import ComposedDecodeStep
from ..exact.sparse_composed_step import SparseComposedDecodeStep
from ..exact.sparse_step import SparseDecodeStep, sparse_step
from ..exact.window_step import WindowDecodeStep, supports_window, window_step
from ..kinds.additive.step import DecodeStep, supports
from ..kinds.delta.step import DeltaDecodeStep
from .choose import lean_step

__all__ = [
    "COMPOSED_STEP_OPTIONS", "DELTA_STEP_OPTIONS", "SPARSE_STEP_OPTIONS", "STEP_OPTIONS", "WINDOW_STEP_OPTIONS",
    "ComposedDecodeStep", "DecodeStep", "DeltaDecodeStep", "SparseComposedDecodeStep", "SparseDecodeStep",
    "WindowDecodeStep", "lean_step",
    "sparse_step", "supports", "supports_window", "window_step",
]
