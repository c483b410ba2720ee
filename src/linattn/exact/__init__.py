"""The window op (``linear_attention(..., window=W, sinks=S)``): exact softmax over a window of keys, linear
attention over the others, one normaliser.

Query t sees exact weights e^{s·q_t·k_j} for its *exact* keys — causal: the W most recent keys (t−W < j ≤ t) and
the first S tokens of the sequence (sinks); non-causal: the band |t − j| < W and the sinks — and linear weights
φ(q_t)·φ(k_j) for every other visible key. Two ways to put the parts on one scale (``factor``):

- mass-preserving (``factor=None``, parameter-free): the window keeps the softmax *shape* over its keys and
  carries the mass M_t = Σ_exact φ(q_t)·φ(k_j) that the map gives those keys, so
  out_t = (num_lin + M_t·softmax_exact(v)) / (den_lin + M_t) — the denominator is plain linear attention's, and
  an exact map (φ(q)·φ(k) = e^{s·q·k}) gives exact softmax.
- factor γ (LoLCATs): out_t = (num_lin + γ Σ_exact e^{s_tj − m_t} v_j) / (den_lin + γ Σ_exact e^{s_tj − m_t}),
  m_t the row maximum of the exact scores; γ a per-head tensor (or a float), learnable.

Scales. Log-space maps (FAVOR+) keep features at log-scales: query features at their own row maximum c_t, key j
at a running maximum R_j of log φ over all keys ≤ j (ring and sink keys of a carried state at the state's scale,
which is ≥ all of them), read by query t at R_t ≥ R_j. The linear sums and M_t are then both in query t's stored
scale (true = stored·e^{c_t+R_t}), so the mass form needs no further factor; form (a) puts the linear part
(×e^{c_t+R_t}) and the window part (×γ, already ≤ W+S) on the common scale u_t = max(c_t + R_t, 0): factors
e^{c_t+R_t−u_t} and γ·e^{−u_t}, both ≤ γ, so nothing overflows.

Causal linear part: plain causal linear attention of query t against the keys *shifted by W* (the Function in
:mod:`..causal_fn` in its unnormalised mode): position i of the shifted sequence holds key i − W (taken from the
carried window buffer while i < W, zero before the sequence start, zero for sink tokens), so a key enters the
linear state exactly when it leaves the window. The Function reads keys and values so, block by block, from the
inputs and the W rows before them (its lagged operands): no shifted copy is made, except of log-space keys, which
are stored at the scale of the query reading them. Non-causal: the same shifted pass gives the keys j ≤ t − W,
and a second one on the reversed sequence the keys j ≥ t + W — no subtraction, so no cancellation.

Exact part: banded, O(N·W). Without padding, one autograd Function (:mod:`.forms.fused`: cache-sized tiles of query
blocks, recompute in backward, O(N) memory) gives the softmax over the exact keys and, for ordinary maps, the mass;
with padding, or for the mass form with keys at their own log-scales, :class:`.forms.band.Band` gathers each
query block's keys and plain autograd differentiates (O(N·W) saved for backward).

The folder: the forms in :mod:`.forms` — :mod:`.forms.hybrid` (the options of one call and the parts every form
shares), :mod:`.forms.naive` (the quadratic reference and the token-by-token form), :mod:`.forms.chunked` (the
causal and non-causal chunked forms), :mod:`.forms.band` (the band of exact keys, gathered), :mod:`.forms.fused`
(the banded exact part as one autograd Function), :mod:`.forms.composed` (beside a linear part of any kind),
:mod:`.forms.sparse` with :mod:`.forms.boundary` and :mod:`.forms.cache_term` (the sparse cache); the decoding
steps :mod:`.window_step`, :mod:`.sparse_step` (on the window step) and :mod:`.composed_step` (on the delta rule's
step).
"""

from __future__ import annotations

from .forms.chunked import causal_window_chunked, empty_window_state, next_state, noncausal_window_chunked
from .forms.hybrid import Hybrid
from .forms.naive import window_parallel, window_recurrent

__all__ = [
    "Hybrid",
    "causal_window_chunked",
    "empty_window_state",
    "next_state",
    "noncausal_window_chunked",
    "window_parallel",
    "window_recurrent",
]
