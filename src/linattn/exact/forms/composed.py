"""The window's exact part beside a linear part of any kind: the delayed stream, the exact part alone, the two
combiners and the state after a call.

A linear part is a state and its update rule — additive, scalar decay/gate, per-feature gate (GLA), delta, gated
delta, per-feature gated delta (KDA) — and the window op keeps it over the keys that have left the window. One
definition serves them all: **a key is written into the linear state when it leaves the window**. At step t the
state takes the step's own decay a_t (the gate of token t, as the linear part alone would apply it) and the write
of key t − W (with that key's value, and for the delta rule its write strength β_{t−W}):

    additive:  S_t = a_t·S_{t−1} + φ(k_{t−W}) v_{t−W}ᵀ                       (a_t scalar or diag per feature)
    delta:     S_t = a_t·S_{t−1} + β_{t−W}·k̂_{t−W}(v_{t−W} − (a_t·S_{t−1})ᵀk̂_{t−W})ᵀ

with sink tokens and padding writing nothing. So the linear part of query t is the linear op itself run on the
stream delayed by W (position i holds key i − W), read by q_t: every form of every kind serves unchanged, and a
window as long as the sequence writes nothing, leaving causal softmax over the exact keys. (For the additive update
key j then weighs e^{G_t − G_{j+W}}: its decay counts from when it enters the state.)

The combiners (docs/window.md, "Composed linear parts"):

- a normalised linear part (the additive family) shares softmax's normaliser as the plain hybrid does
  (:meth:`.hybrid.Hybrid.combine`): out = (num_lin + M·A)/(den_lin + M) (mass form) or with the factor γ;
- an unnormalised one (the delta family has no Σφ(k)) is added to the softmax average of the exact keys:
  out_t = γ·A_t + S_tᵀφ̂(q_t), A_t = Σ_exact e^{s_tj} v_j / Σ_exact e^{s_tj}, γ = ``window_factor`` (1 when None).
  The delta memory's read-out is already a value (bounded by the values it stores), not a sum of weights, so it
  needs no share of a normaliser; and a key the memory does not hold reads (nearly) 0, leaving the window's average.
"""

from __future__ import annotations

import torch

from ...state import DeltaRuleState, LinearAttentionState, WindowAttentionState
from .chunked import next_state


def delayed_stream(
    state: WindowAttentionState | None, k: tuple[torch.Tensor | None, torch.Tensor], v: torch.Tensor,
    keep: torch.Tensor, beta: torch.Tensor | None, window: int, sinks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This call's keys delayed by W: position i holds key n0 + i − W (n0 the tokens before the call) from the
    state's window buffer while i < W, none before the sequence start, and none for sink tokens (``keep`` False
    there). ``k`` = (the window buffer's rows (..., W0, ·) or None without a state, this call's (..., N, ·)): the keys
    themselves or their features, as the exact part mapped them (mapped once, read by both parts). Returns key rows
    (..., N, ·), values (..., N, Dv), keep (..., N) and the delta rule's β (..., N) likewise."""
    ring_keys, k_rows = k
    n = k_rows.shape[-2]
    n0 = state.num_tokens if state is not None else 0
    ring = state.keys.shape[-2] if state is not None else 0
    early = min(window, n)  # positions that read the buffer or the time before the sequence
    zeros = min(early, window - ring)  # key positions < 0
    taken = early - zeros
    late = n - early  # positions that read this call's keys 0 … N − W − 1

    def delayed(own: torch.Tensor, buffered: torch.Tensor | None, fill: float | bool, dim: int) -> torch.Tensor:
        """[none × zeros; buffered[:taken]; own[:late]] along ``dim`` (−2: rows of vectors, −1: one per token)."""
        shape = list(own.shape)
        shape[dim] = zeros
        parts = [own.new_full(shape, fill)]
        if buffered is not None:
            parts.append(buffered.narrow(dim, 0, taken))
        parts.append(own.narrow(dim, 0, late))
        return torch.cat(parts, dim=dim)

    keys = delayed(k_rows, ring_keys, 0.0, -2)
    values = delayed(v, state.values if state is not None else None, 0.0, -2)
    kept = delayed(keep, state.keep if state is not None else None, False, -1)
    blank = max(0, min(n, sinks + window - n0)) if sinks else 0  # positions holding a sink token
    if blank:
        kept = kept & (torch.arange(n, device=keep.device) >= blank)
    betas = None
    if beta is not None:
        buffered = state.betas if state is not None else None
        betas = delayed(beta, buffered, 0.0, -1)
    return keys, values, kept, betas


def softmax_average(exact: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """A_t = Σ e^{s−m} v / Σ e^{s−m} from the exact part's (num, den, …); 0 for a row with no exact key. den None:
    num is already the average."""
    num, den = exact[0], exact[1]
    assert num is not None
    if den is None:
        return num
    return num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


def add_to_average(average: torch.Tensor, linear_out: torch.Tensor, factor: torch.Tensor | None,
                   start: int = 0) -> torch.Tensor:
    """The unnormalised combiner: γ·A_t + S_tᵀφ̂(q_t), γ per head (..., 1) or 1, in one pass over a new tensor.
    ``start``: linear_out holds queries start … only (the ones before read an empty memory: γ·A_t alone)."""
    scale = None if factor is None else factor.unsqueeze(-1).unsqueeze(-1)
    if not start:
        return average + linear_out if scale is None else torch.addcmul(linear_out, scale, average)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (average, linear_out, scale)):
        head = average[..., :start, :] if scale is None else average[..., :start, :] * scale
        tail = average[..., start:, :] + linear_out if scale is None else torch.addcmul(
            linear_out, scale, average[..., start:, :])
        return torch.cat([head, tail], dim=-2)  # out= records no gradient
    out = torch.empty_like(average, memory_format=torch.contiguous_format)
    head, tail = out[..., :start, :], out[..., start:, :]  # each written once, in place (out= on the views)
    if scale is None:
        head.copy_(average[..., :start, :])
        torch.add(average[..., start:, :], linear_out, out=tail)
    else:
        torch.mul(average[..., :start, :], scale, out=head)
        torch.addcmul(linear_out, scale, average[..., start:, :], out=tail)
    return out


def with_sums(state: LinearAttentionState, log_space: bool) -> LinearAttentionState:
    """An additive state with Σφ(k) as one more value column: the linear op run unnormalised on values [v | 1]
    returns the numerator and the denominator in one pass. Log-space maps keep the shift (the sums' log-scale);
    ordinary maps' sums are at scale 1, as the plain hybrid reads them."""
    kv = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)  # (..., F, Dv + 1)
    return LinearAttentionState(kv, state.k_sum, state.shift if log_space else torch.zeros_like(state.shift),
                                state.num_tokens)


def without_sums(state: LinearAttentionState) -> LinearAttentionState:
    """The inverse of :func:`with_sums`: the state's last value column is Σφ(k)."""
    return LinearAttentionState(state.kv[..., :-1].contiguous(), state.kv[..., -1].contiguous(), state.shift,
                                state.num_tokens)


def composed_state(
    prev: WindowAttentionState, linear: LinearAttentionState | DeltaRuleState, k: torch.Tensor, v: torch.Tensor,
    keep: torch.Tensor, beta: torch.Tensor | None,
) -> WindowAttentionState:
    """The state after this call: the buffers as the plain window op keeps them, the linear part's state and
    (delta rule) the write strengths of the keys still in the window."""
    nxt = next_state(prev, linear, k, v, keep)
    if beta is not None:
        old = prev.betas if prev.betas is not None else beta[..., :0]
        length = nxt.keys.shape[-2]
        nxt.betas = torch.cat([old, beta], dim=-1)[..., old.shape[-1] + beta.shape[-1] - length :]
    return nxt
