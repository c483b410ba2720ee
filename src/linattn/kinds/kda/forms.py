"""The delta rule with a per-feature gate (KDA, Kimi Delta Attention): every feature of the memory decays at its own
rate before the delta write.

    S_t = diag(a_t)·S_{t−1} + β_t·k_t·(v_t − (diag(a_t)·S_{t−1})ᵀk_t)ᵀ,   o_t = S_tᵀq_t,   a_t = e^{g_t} ∈ (0, 1]^F

k_t, q_t unit features and β_t as for the delta rule (:mod:`linattn.kinds.delta.forms`); g_t (F,) ≤ 0 the token's
log-gate per feature. A per-token decay is the case of equal g_tf.

Two forms, one definition:

- :func:`kda_recurrent`: token by token, the reference and what a decoding step computes.
- :func:`kda_chunked`: the chunkwise form. Within a chunk of C tokens entered with state S, with G_t = Σ_{i≤t} g_i
  the chunk's own cumulative log-gate per feature (fp64) and u_t = β_t(v_t − (diag(a_t)S_{t−1})ᵀk_t) what token t
  writes:

      (I + A)·U = diag(β)·V − diag(β)·(K ⊙ e^G)·S,      A_tj = β_t Σ_f k_tf k_jf e^{G_tf − G_jf}  (j < t)
      O = (Q ⊙ e^G)·S + P·U,                           P_tj = Σ_f q_tf k_jf e^{G_tf − G_jf}  (j ≤ t)
      S' = diag(e^{G_C})·S + (K ⊙ e^{G_C − G})ᵀ·U

  Every factor e^{G}, e^{G_C − G}, e^{G_C} is ≤ 1. The pair weights A and P cannot be one product of K ⊙ e^G and
  K ⊙ e^{−G} (e^{−G} overflows fp32 for strong gates), so :func:`pair_weights` splits each chunk at the midpoint M
  of its span: (X ⊙ e^{G−M})(Y ⊙ e^{M−G})ᵀ has every factor within e^{±GEMM_SPAN/2} for the features whose span
  G_1 − G_C is at most GEMM_SPAN (in every chunk of a tile). Stronger features go by sub-chunks of SUB_CHUNK tokens:
  the pairs across sub-chunks meet at a reference between them (both factors ≤ 1, one product per sub-chunk), the
  pairs within one are formed one by one (e^{(≤ 0)}). The exponents come from fp64 cumulative sums; only local
  differences are cast.

  As for the delta rule, the system is solved once per chunk (W_v = T·diag(β)V, W_k = T·diag(β)(K ⊙ e^G),
  T = (I + A)⁻¹), chunk-local work runs for tiles of chunks at once and only U = W_v − W_k·S and S' run chunk after
  chunk (:func:`linattn.kinds.delta.forms._state_sweep`, with the per-feature factor e^{G_C}).

  :class:`_KdaChunks` saves the inputs, the state entering each chunk, W_k, U, Q ⊙ e^G, K ⊙ e^{G_C − G}, P and T:
  memory O(N·(F + Dv + C) + (N/C)·F·Dv), never a state per token. Its backward is written out: the adjoint of the
  state recurrence (:func:`linattn.kinds.delta.forms.adjoint_sweep`, shared with the delta rule), then the chunk-local
  gradients tile by tile (:func:`_local_grads`), every gate factor's gradient reaching g through a reversed
  cumulative sum in fp64. :func:`chunk_backward` is that backward from the saved tensors; the Triton backend runs
  it around its adjoint kernel (kinds/kda/triton/function.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...state import DeltaRuleState
from ..delta.forms import (
    TORCH_SWEEPS,
    Sweep,
    Sweeps,
    _batch_rows,
    _by_tiles,
    _chunked,
    adjoint_sweep,
    compose_maps,
)
from ..gated.forms import GEMM_SPAN, SUB_CHUNK  # the same fp32 bound on a product's factors, and sub-chunk length


def kda_recurrent(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    log_gate: torch.Tensor,
    state: DeltaRuleState | None,
) -> tuple[torch.Tensor, DeltaRuleState]:
    """Token by token. qf, kf (..., N, F) unit features; v (..., N, Dv); beta (..., N); log_gate (..., N, F) ≤ 0."""
    kv = state.kv if state is not None else qf.new_zeros(*qf.shape[:-2], kf.shape[-1], v.shape[-1])
    gates = torch.exp(log_gate.to(torch.float64)).to(qf.dtype)  # (..., N, F)
    outs = []
    for t in range(qf.shape[-2]):
        kv = kv * gates[..., t, :, None]
        k_t = kf[..., t, :]
        recalled = (k_t.unsqueeze(-2) @ kv).squeeze(-2)  # (diag(a_t)S_{t−1})ᵀk_t, (..., Dv)
        write = beta[..., t, None] * (v[..., t, :] - recalled)
        kv = kv + k_t.unsqueeze(-1) * write.unsqueeze(-2)
        outs.append((qf[..., t, :].unsqueeze(-2) @ kv).squeeze(-2))
    seen = state.num_tokens if state is not None else 0
    return torch.stack(outs, dim=-2), DeltaRuleState(kv, seen + qf.shape[-2])


# per sub-chunk (:func:`_sub_factors`): e^{G_s − R_s}, e^{R_s − G_{<s}} (None for the first) and the factors within
SubChunks = list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]]


@dataclass
class Split:
    """How a tile's pair weights are formed (:func:`_gates`): one product with ``product`` = (e^{G−M}, e^{M−G}),
    0 at the strong features, and the features ``strong`` (indices; None: all) by sub-chunks with ``sub`` = their
    :func:`_sub_factors`; a part without features is None."""

    product: tuple[torch.Tensor, torch.Tensor] | None
    strong: torch.Tensor | None
    sub: SubChunks | None


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(-1, index)


def _gates(gc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Split]:
    """From a tile's log-gates gc (..., C, F), through G = their cumulative sums in fp64: e^G, e^{G_C − G},
    e^{G_C} (..., 1, F) (all ≤ 1) and how the pair weights split. A feature whose span G_1 − G_C is at most
    GEMM_SPAN in every chunk of the tile takes the product at the midpoint M of each chunk's span (every exponent
    within ±GEMM_SPAN/2), the others sub-chunks; the factors are formed once for both pair weights and their
    gradients, cast to ``dtype``.

    When every feature takes the product, e^G = e^{G−M}·e^M and e^{G_C−G} = e^{M−G}·e^{G_C−M} are products of
    normal numbers (≥ e^−60): one fp64 exponential per element serves all four."""
    cum = torch.cumsum(gc.to(torch.float64), dim=-2)
    total = cum[..., -1:, :]
    last = torch.exp(total).to(dtype)
    span = (cum[..., 0, :] - cum[..., -1, :]).reshape(-1, cum.shape[-1]).amax(0)  # (F,): over the tile's chunks
    strong = span > GEMM_SPAN
    if not bool(strong.any()):
        middle = (cum[..., :1, :] + total) / 2  # (..., 1, F)
        wide = torch.exp(cum - middle)
        into, out_of = wide.to(dtype), wide.reciprocal().to(dtype)
        entered, to_end = into * torch.exp(middle).to(dtype), out_of * torch.exp(total - middle).to(dtype)
        return entered, to_end, last, Split((into, out_of), None, None)
    entered, to_end = torch.exp(cum).to(dtype), torch.exp(total - cum).to(dtype)
    if bool(strong.all()):
        return entered, to_end, last, Split(None, None, _sub_factors(cum, dtype))
    index = strong.nonzero().squeeze(-1)
    exponent = (cum - (cum[..., :1, :] + total) / 2).masked_fill_(strong, 0)  # the strong features' factors: 0
    wide = torch.exp(exponent)
    into, out_of = wide.to(dtype), wide.reciprocal().to(dtype)
    product = (into.masked_fill(strong, 0), out_of.masked_fill(strong, 0))  # not in place: autograd keeps e^x
    return entered, to_end, last, Split(product, index, _sub_factors(cum.index_select(-1, index), dtype))


def _mask(size: int, strict: bool, device: torch.device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def pair_weights(x: torch.Tensor, y: torch.Tensor, split: Split, *, strict: bool) -> torch.Tensor:
    """W_tj = Σ_f x_tf y_jf e^{G_tf − G_jf} for j ≤ t (j < t when ``strict``), 0 above, per chunk: x, y
    (..., C, F), ``split`` from :func:`_gates` (G the chunk's cumulative log-gates) → (..., C, C) in x's dtype:
    the product (X ⊙ e^{G−M})(Y ⊙ e^{M−G})ᵀ over the mild features plus the sub-chunks' sum over the strong ones."""
    weights = None
    if split.product is not None:
        into, out_of = split.product
        weights = (x * into) @ (y * out_of).mT
    if split.sub is not None:
        part = _sub_chunk_weights(_take(x, split.strong), _take(y, split.strong), split.sub)
        weights = part if weights is None else weights.add_(part)
    assert weights is not None
    return weights.masked_fill_(~_mask(x.shape[-2], strict, x.device), 0)


def _pair_grads(x: torch.Tensor, y: torch.Tensor, split: Split, d_w: torch.Tensor, *,
                strict: bool, rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients of Σ d_w ⊙ diag(rows)·W (W = :func:`pair_weights`, rows (..., C) or None for 1): dx, dy,
    dG (..., C, F) in x's dtype and d rows (..., C) (None without rows). Every path has dG = x ⊙ dx − y ⊙ dy: the
    factor e^{G_t − G_j} of term (t, j) is differentiated once as t's and once as j's."""
    d_w = d_w.masked_fill(~_mask(x.shape[-2], strict, x.device), 0)
    d_x = d_y = None  # dx before the rows' scale, dy
    if split.product is not None:  # 0 at the strong features
        into, out_of = split.product
        scaled = d_w if rows is None else d_w * rows.unsqueeze(-1)
        d_x, d_y = (d_w @ (y * out_of)).mul_(into), (scaled.mT @ (x * into)).mul_(out_of)
    if split.sub is not None:
        part_x, part_y = _sub_chunk_grads(_take(x, split.strong), _take(y, split.strong), split.sub, d_w, rows)
        if d_x is None or d_y is None or split.strong is None:
            d_x, d_y = part_x, part_y
        else:
            d_x.index_add_(-1, split.strong, part_x)
            d_y.index_add_(-1, split.strong, part_y)
    assert d_x is not None and d_y is not None
    d_rows = None
    if rows is not None:  # W's row t is linear in x_t: Σ_j dW_tj W_tj = x_t · (its gradient before the scale)
        d_rows = (x * d_x).sum(-1)
        d_x = d_x * rows.unsqueeze(-1)
    return d_x, d_y, x * d_x - y * d_y, d_rows


def _sub_factors(cum: torch.Tensor, dtype: torch.dtype) -> SubChunks:
    """Per sub-chunk s of SUB_CHUNK tokens: e^{G_s − R} (..., s, F) and e^{R − G_j} for the tokens before s
    (..., start, F), R = G just before s, so G_t ≤ R ≤ G_j and both are ≤ 1; and e^{G_t − G_j} within s (..., s, s,
    F; 0 for j > t), from G re-based to the sub-chunk's first token in fp64 before the cast, so only the sub-chunk's
    own span reaches ``dtype``. Every exponent is ≤ 0: a factor below the dtype's range is a term below it too."""
    size = cum.shape[-2]
    factors: SubChunks = []
    for start in range(0, size, SUB_CHUNK):
        end = min(start + SUB_CHUNK, size)
        cum_s = cum[..., start:end, :]
        into = out_of = None
        if start > 0:
            ref = cum[..., start - 1 : start, :]  # (..., 1, F)
            into = torch.exp((cum_s - ref).to(dtype))
            out_of = torch.exp((ref - cum[..., :start, :]).to(dtype))
        inside = torch.ones(end - start, end - start, dtype=torch.bool, device=cum.device).tril().unsqueeze(-1)
        local = (cum_s - cum_s[..., :1, :]).to(dtype)
        exponent = (local.unsqueeze(-2) - local.unsqueeze(-3)).masked_fill_(~inside, float("-inf"))
        factors.append((into, out_of, torch.exp_(exponent)))
    return factors


def _sub_chunk_weights(x: torch.Tensor, y: torch.Tensor, split: SubChunks) -> torch.Tensor:
    """:func:`pair_weights` for any gates, by sub-chunks (:func:`_sub_factors`): the rows of sub-chunk s meet every
    earlier token in one product, (X_s ⊙ e^{G_s − R})(Y_{<s} ⊙ e^{R − G})ᵀ, and the tokens of s explicitly."""
    size = x.shape[-2]
    rows = []
    for index, (into, out_of, inside) in enumerate(split):
        start, end = index * SUB_CHUNK, min((index + 1) * SUB_CHUNK, size)
        pieces = []
        if into is not None and out_of is not None:
            pieces.append((x[..., start:end, :] * into) @ (y[..., :start, :] * out_of).mT)  # (..., s, start)
        pieces.append((x[..., start:end, None, :] * inside * y[..., None, start:end, :]).sum(-1))  # (..., s, s)
        if end < size:
            pieces.append(x.new_zeros(*x.shape[:-2], end - start, size - end))
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)  # (..., C, C), the diagonal blocks' upper triangles 0


def _sub_chunk_grads(x: torch.Tensor, y: torch.Tensor, split: SubChunks, d_w: torch.Tensor,
                     rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (before the rows' scale) and dy of Σ d_w ⊙ diag(rows)·W for :func:`_sub_chunk_weights` (d_w masked)."""
    d_x, d_y = torch.zeros_like(x), torch.zeros_like(y)
    for index, (into, out_of, inside) in enumerate(split):
        start, end = index * SUB_CHUNK, min((index + 1) * SUB_CHUNK, x.shape[-2])
        d_s = d_w[..., start:end, :]  # (..., s, C)
        scaled = d_s if rows is None else d_s * rows[..., start:end, None]
        if into is not None and out_of is not None:
            d_x[..., start:end, :] += (d_s[..., :start] @ (y[..., :start, :] * out_of)).mul_(into)
            d_y[..., :start, :] += (scaled[..., :start].mT @ (x[..., start:end, :] * into)).mul_(out_of)
        # with j = t the factor is 1: d_w is already 0 there when strict
        d_x[..., start:end, :] += ((d_s[..., start:end].unsqueeze(-1) * inside) * y[..., None, start:end, :]).sum(-2)
        d_y[..., start:end, :] += ((scaled[..., start:end].unsqueeze(-1) * inside)
                                   * x[..., start:end, None, :]).sum(-3)
    return d_x, d_y


def _chunk_local(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """Every chunk's local work from its inputs (..., C, ·) and log-gates gc (..., C, F): W_v (..., C, Dv), W_k
    (..., C, F), the read-out queries Q ⊙ e^G and written-out keys K ⊙ e^{G_C − G} (..., C, F), the chunk's decay
    e^{G_C} (..., F, 1), the scores P and T = (I + A)⁻¹ (..., C, C). Plain differentiable torch code."""
    entered, to_end, last, split = _gates(gc, kc.dtype)
    system = pair_weights(kc, kc, split, strict=True) * bc.unsqueeze(-1)  # A
    eye = torch.eye(kc.shape[-2], dtype=kc.dtype, device=kc.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    w_v = inverse @ (vc * bc.unsqueeze(-1))
    w_k = inverse @ (kc * entered * bc.unsqueeze(-1))
    scores = pair_weights(qc, kc, split, strict=False)  # P
    return w_v, w_k, qc * entered, kc * to_end, last.mT, scores, inverse


def _local_grads(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor, d_o: torch.Tensor,
    states: torch.Tensor, written: torch.Tensor, d_written: torch.Tensor, d_leaving: torch.Tensor,
    inverse: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The chunk-local gradients of a tile of chunks (dq, dk, dv, dβ, dg), from the adjoints the sweep gave:
    dU (``d_written``) and dS' of the state leaving each chunk (``d_leaving``).

    With U = T·R, R = diag(β)(V − (K⊙e^G)·S): dR = Tᵀ·dU and dA = −dR·Uᵀ (as for the delta rule); O = (Q⊙e^G)·S
    + P·U gives dP = dO·Uᵀ and d(Q⊙e^G) = dO·Sᵀ; S' = e^{G_C}·S + (K⊙e^{G_C−G})ᵀU gives the rest. Every factor's
    gradient reaches G = cumsum(g) as dG = (its gradient ⊙ the factored term), summed back to g in fp64."""
    entered, to_end, last, split = _gates(gc, kc.dtype)
    beta = bc.unsqueeze(-1)
    d_bq = d_o @ states.mT  # d(Q ⊙ e^G)
    d_kout = written @ d_leaving.mT  # d(K ⊙ e^{G_C − G})
    d_rv = inverse.mT @ d_written  # dR
    d_rk = (d_rv @ states.mT).neg_()  # d(K ⊙ e^G) / β
    dq, dk_p, d_cum, _ = _pair_grads(qc, kc, split, d_o @ written.mT, strict=False, rows=None)
    dk_left, dk_right, d_cum_a, d_beta = _pair_grads(kc, kc, split, (d_rv @ written.mT).neg_(), strict=True,
                                                     rows=bc)
    assert d_beta is not None
    dq = dq.addcmul_(d_bq, entered)
    dk = dk_p.add_(dk_left).add_(dk_right).addcmul_(beta * d_rk, entered).addcmul_(d_kout, to_end)
    keyed = kc * entered
    d_beta = d_beta.add_((vc * d_rv).sum(-1)).add_((keyed * d_rk).sum(-1))
    out_decay = d_kout * kc * to_end  # through e^{G_C − G}: −dG_t, +dG_C
    d_cum = d_cum.add_(d_cum_a).addcmul_(d_bq * qc, entered).addcmul_(beta * d_rk, keyed).sub_(out_decay)
    d_cum[..., -1, :] += out_decay.sum(-2) + (states * d_leaving).sum(-1) * last[..., 0, :]
    d_cum = d_cum.to(torch.float64)  # G = cumsum(g): dg_t = Σ_{s ≥ t} dG_s, summed in fp64
    d_gate = d_cum.sum(-2, keepdim=True) - torch.cumsum(d_cum, dim=-2) + d_cum
    return dq, dk, beta * d_rv, d_beta, d_gate.to(gc.dtype)


class _KdaChunks(torch.autograd.Function):
    """The chunkwise KDA on inputs whose length is a multiple of the chunk (module docstring). Saved for backward:
    the inputs, the state entering each chunk, W_k, U, Q⊙e^G, K⊙e^{G_C−G}, e^{G_C}, P and T; the backward is
    written out."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        log_gate: torch.Tensor,
        initial: torch.Tensor | None,
        size: int,
        sweeps: Sweeps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lead = q.dim() - 1  # the batch dimensions and the chunks'
        w_v, w_k, bq, k_out, last, scores, inverse = _by_tiles(_chunk_local, _chunk_inputs(q, k, v, beta, log_gate,
                                                                                            size), lead)
        state = initial if initial is not None else q.new_zeros(*q.shape[:-2], k.shape[-1], v.shape[-1])
        states = q.new_empty(*w_k.shape[:-2], k.shape[-1], v.shape[-1])  # the state entering each chunk
        final = sweeps.forward(state.reshape(-1, *state.shape[-2:]), _batch_rows(w_k, lead), _batch_rows(w_v, lead),
                               _batch_rows(k_out, lead), _batch_rows(last, lead), _batch_rows(states, lead))
        written = w_v  # U, written over W_v chunk by chunk

        def outputs(bq: torch.Tensor, scores: torch.Tensor, written: torch.Tensor, states: torch.Tensor
                    ) -> tuple[torch.Tensor]:
            return (torch.baddbmm(bq @ states, scores, written),)  # a tile: (chunks, C, ·)

        (out,) = _by_tiles(outputs, [bq, scores, written, states], lead)
        ctx.size, ctx.has_initial, ctx.sweep = size, initial is not None, sweeps.adjoint
        ctx.save_for_backward(q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores, inverse)
        return out.flatten(-3, -2), final.view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # a gradient from a sum arrives expanded: made whole once
        *grads, d_state = chunk_backward(ctx.saved_tensors, d_out.contiguous(), d_final, ctx.size, sweep=ctx.sweep)
        return (*grads, d_state if ctx.has_initial else None, None, None)


def chunk_backward(saved: tuple[torch.Tensor, ...], d_out: torch.Tensor, d_final: torch.Tensor, size: int, *,
                   sweep: Sweep = adjoint_sweep) -> tuple[torch.Tensor, ...]:
    """The written-out backward of :class:`_KdaChunks` from what its forward saved (q, k, v, β, log-gates, the
    states entering each chunk, W_k, U, Q ⊙ e^G, K ⊙ e^{G_C − G}, e^{G_C} (..., nc, F, 1), P and T; chunked
    (..., nc, C, ·) but the inputs): ``sweep`` the adjoint of the state recurrence
    (:func:`linattn.kinds.delta.forms.adjoint_sweep`, or a kernel with its signature, which may return None for dU),
    then the chunk-local gradients (:func:`_local_grads`). Returns dq, dk, dv, dβ, d log-gates and ∂L/∂(initial
    state)."""
    q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores, inverse = saved
    d_o = _chunked(d_out, size)
    p_do = scores.mT @ d_o
    d_leaving, d_written, d_state = sweep(bq, k_out, w_k, p_do, d_o, last, d_final)
    if d_written is None:  # dU = PᵀdO + K_out·dS' (PᵀdO is not needed after the sweep)
        d_written = p_do.add_(k_out @ d_leaving)
    dq, dk, dv, d_beta, d_gate = _by_tiles(
        _local_grads, [*_chunk_inputs(q, k, v, beta, log_gate, size), d_o, states, written, d_written, d_leaving,
                       inverse], q.dim() - 1)
    return (dq.flatten(-3, -2), dk.flatten(-3, -2), dv.flatten(-3, -2), d_beta.flatten(-2), d_gate.flatten(-3, -2),
            d_state)


def _chunk_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, log_gate: torch.Tensor,
                  size: int) -> list[torch.Tensor | None]:
    """(..., N, ·) → (..., N/C, C, ·); beta (..., N) → (..., N/C, C)."""
    return [_chunked(q, size), _chunked(k, size), _chunked(v, size), beta.unflatten(-1, (-1, size)),
            _chunked(log_gate, size)]


def kda_chunked(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    log_gate: torch.Tensor,
    state: DeltaRuleState | None,
    chunk_size: int,
    sweeps: Sweeps | None = None,
) -> tuple[torch.Tensor, DeltaRuleState]:
    """The chunkwise form (module docstring); tokens past a multiple of the chunk are padded with β = 0, g = 0.
    log_gate (..., N, F) ≤ 0 in any float dtype (its cumulative sums are formed in fp64). ``sweeps``: the loops
    over the chunks (:class:`linattn.kinds.delta.forms.Sweeps`; default the torch ones)."""
    n = qf.shape[-2]
    size = max(1, min(chunk_size, n))
    pad = (-n) % size
    if pad:
        qf, kf, v, log_gate = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, v, log_gate))
        beta = F.pad(beta, (0, pad))
    initial = state.kv if state is not None else None
    out, final = _KdaChunks.apply(qf, kf, v, beta, log_gate, initial, size, sweeps or TORCH_SWEEPS)
    seen = state.num_tokens if state is not None else 0
    return out[..., :n, :], DeltaRuleState(final, seen + n)


def kda_transition(
    kf: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor, log_gate: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a stretch of tokens does to any state it is entered with, S_out = A·S_in + B, as
    :func:`linattn.kinds.delta.forms.delta_transition` with per-feature gates: A (..., F, F) = Π_t (I − β_t k_t k_tᵀ)·
    diag(a_t) (the gate acts first; later tokens on the left), B (..., F, Dv) the final state from S_in = 0. Per
    chunk, from the chunked form's local solution: A_c = diag(e^{G_C}) − (K ⊙ e^{G_C−G})ᵀW_k and B_c =
    (K ⊙ e^{G_C−G})ᵀW_v, then composed pairwise. Differentiable by autograd. kf (..., N, F) unit features,
    v (..., N, Dv), beta (..., N), log_gate (..., N, F) ≤ 0."""
    n = kf.shape[-2]
    size = max(1, min(chunk_size, n))
    pad = (-n) % size
    if pad:  # β = 0, g = 0: the identity
        kf, v, log_gate = (F.pad(x, (0, 0, 0, pad)) for x in (kf, v, log_gate))
        beta = F.pad(beta, (0, pad))
    kc = _chunked(kf, size)
    w_v, w_k, _, k_out, last, _, _ = _chunk_local(kc, kc, _chunked(v, size), beta.unflatten(-1, (-1, size)),
                                                  _chunked(log_gate, size))
    decay = torch.diag_embed(last.squeeze(-1))  # (..., nc, F, F)
    return compose_maps(torch.cat([decay - k_out.mT @ w_k, k_out.mT @ w_v], dim=-1))
