"""The delta rule with a per-feature gate (KDA, Kimi Delta Attention): every feature of the memory decays at its own
rate before the delta write.

    S_t = diag(a_t)·S_{t−1} + β_t·k_t·(v_t − (diag(a_t)·S_{t−1})ᵀk_t)ᵀ,   o_t = S_tᵀq_t,   a_t = e^{g_t} ∈ (0, 1]^F

k_t, q_t unit features and β_t as for the delta rule (:mod:`.delta`); g_t (F,) ≤ 0 the token's log-gate per
feature. A per-token decay is the case of equal g_tf.

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
  of its span: (X ⊙ e^{G−M})(Y ⊙ e^{M−G})ᵀ has every factor within e^{±GEMM_SPAN/2} when the chunk's span −G_C is
  at most GEMM_SPAN; a stronger chunk is split into sub-chunks, the pairs across sub-chunks meeting at a reference
  between them (both factors ≤ 1) and the pairs within one formed one by one (e^{(≤ 0)}). The exponents are formed
  in fp64 from fp64 cumulative sums; only the factors are cast.

  As for the delta rule, the system is solved once per chunk (W_v = T·diag(β)V, W_k = T·diag(β)(K ⊙ e^G),
  T = (I + A)⁻¹), chunk-local work runs for tiles of chunks at once and only U = W_v − W_k·S and S' run chunk after
  chunk (:func:`linattn.forms.delta._state_sweep`, with the per-feature factor e^{G_C}).

  :class:`_KdaChunks` saves the inputs, the state entering each chunk, W_k, U, P and the gate factors: memory
  O(N·(F + Dv + C) + (N/C)·F·Dv). Its backward runs the adjoint of the state recurrence written out
  (:func:`linattn.forms.delta.adjoint_sweep`), then differentiates each tile's chunk-local work (recomputed from
  the inputs) by autograd, given the adjoints of what that work produced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..state import DeltaRuleState
from .delta import _batch_rows, _by_tiles, _chunked, _state_sweep, adjoint_sweep, compose_maps

# the largest per-feature log-gate span of a chunk whose pair weights are one product (factors within e^{±30})
GEMM_SPAN = 60.0
# sub-chunk length for stronger gates: the pairs within a sub-chunk cost O(C·SUB_CHUNK·F) per chunk
SUB_CHUNK = 16


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


def _gemm_ok(cum: torch.Tensor) -> bool:
    """Whether every chunk's per-feature span G_1 − G_C (cum (..., C, F) fp64) is at most GEMM_SPAN."""
    return cum.shape[-2] == 1 or bool((cum[..., 0, :] - cum[..., -1, :] <= GEMM_SPAN).all())


Split = tuple[torch.Tensor, torch.Tensor] | None


def _gates(gc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          Split]:
    """From a chunk's log-gates gc (..., C, F): G (fp64 cumulative sums), e^G, e^{G_C − G}, e^{G_C} (..., 1, F)
    (all ≤ 1) and, when :func:`_gemm_ok`, the split factors (e^{G−M}, e^{M−G}) at the midpoint M of each chunk's
    span (every exponent within ±GEMM_SPAN/2), else None; the factors cast to ``dtype``.

    With the split, e^G = e^{G−M}·e^M and e^{G_C−G} = e^{M−G}·e^{G_C−M} are products of normal numbers (≥ e^−60):
    one fp64 exponential per element serves all four."""
    cum = torch.cumsum(gc.to(torch.float64), dim=-2)
    total = cum[..., -1:, :]
    last = torch.exp(total).to(dtype)
    if not _gemm_ok(cum):
        return cum, torch.exp(cum).to(dtype), torch.exp(total - cum).to(dtype), last, None
    middle = (cum[..., :1, :] + total) / 2  # (..., 1, F)
    wide = torch.exp(cum - middle)
    into, out_of = wide.to(dtype), wide.reciprocal().to(dtype)
    return cum, into * torch.exp(middle).to(dtype), out_of * torch.exp(total - middle).to(dtype), last, (into, out_of)


def _mask(size: int, strict: bool, device: torch.device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def pair_weights(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, split: Split, *, strict: bool) -> torch.Tensor:
    """W_tj = Σ_f x_tf y_jf e^{G_tf − G_jf} for j ≤ t (j < t when ``strict``), 0 above, per chunk: x, y
    (..., C, F), cum G (..., C, F) fp64 and non-increasing in t, ``split`` from :func:`_gates` → (..., C, C) in x's
    dtype. With the split one product (X ⊙ e^{G−M})(Y ⊙ e^{M−G})ᵀ, else by sub-chunks. Differentiable."""
    keep = _mask(x.shape[-2], strict, x.device)
    if split is None:
        return _sub_chunk_weights(x, y, cum, keep)
    return ((x * split[0]) @ (y * split[1]).mT).masked_fill_(~keep, 0)


def _pair_grads(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, split: Split, d_w: torch.Tensor, *,
                strict: bool, rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients of Σ d_w ⊙ diag(rows)·W (W = :func:`pair_weights`, rows (..., C) or None for 1): dx, dy,
    dG (..., C, F) in x's dtype and d rows (..., C) (None without rows). Written out for the product path; the
    sub-chunk path (strong gates) by autograd through its recomputation."""
    keep = _mask(x.shape[-2], strict, x.device)
    if split is None:
        leaves = [t.detach().requires_grad_() for t in (x, y, cum)]
        scale = rows.detach().requires_grad_() if rows is not None else None
        with torch.enable_grad():
            w = _sub_chunk_weights(leaves[0], leaves[1], leaves[2], keep)
            if scale is not None:
                w = w * scale.unsqueeze(-1)
            grads = torch.autograd.grad(w, [*leaves, *([scale] if scale is not None else [])], d_w)
        return grads[0], grads[1], grads[2].to(x.dtype), grads[3] if rows is not None else None
    into, out_of = split
    left, right = x * into, y * out_of
    d_w = d_w.masked_fill(~keep, 0)
    pulled = d_w @ right  # the gradient of X ⊙ e^{G−M}, before the rows' scale
    d_rows = None
    if rows is not None:
        d_rows = (left * pulled).sum(-1)
        d_w, pulled = d_w * rows.unsqueeze(-1), pulled * rows.unsqueeze(-1)
    pushed = d_w.mT @ left  # the gradient of Y ⊙ e^{M−G}
    d_cum = pulled * left - pushed * right  # e^{G−M} and e^{M−G}: ∂/∂G_t = ± the factored term
    return pulled.mul_(into), pushed.mul_(out_of), d_cum, d_rows


def _sub_chunk_weights(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`pair_weights` for any gates, by sub-chunks of SUB_CHUNK tokens. Rows of sub-chunk s meet every earlier
    token in one product split at R = G just before s: G_t ≤ R ≤ G_j, so both e^{G_t − R} and e^{R − G_j} are ≤ 1
    (a factor small enough to underflow makes its term smaller still). Within s the s×s×F factors are explicit."""
    size, dtype = x.shape[-2], x.dtype
    rows = []
    for start in range(0, size, SUB_CHUNK):
        end = min(start + SUB_CHUNK, size)
        cum_s = cum[..., start:end, :]
        pieces = []
        if start > 0:
            ref = cum[..., start - 1 : start, :]  # (..., 1, F)
            left = x[..., start:end, :] * torch.exp(cum_s - ref).to(dtype)
            right = y[..., :start, :] * torch.exp(ref - cum[..., :start, :]).to(dtype)
            pieces.append(left @ right.mT)  # (..., s, start)
        inside = keep[start:end, start:end].unsqueeze(-1)  # (s_t, s_j, 1)
        exponent = (cum_s.unsqueeze(-2) - cum_s.unsqueeze(-3)).masked_fill(~inside, float("-inf"))  # G_t − G_j
        factor = torch.exp(exponent).to(dtype)  # (..., s, s, F)
        pieces.append((x[..., start:end, None, :] * factor * y[..., None, start:end, :]).sum(-1))
        if end < size:
            pieces.append(x.new_zeros(*x.shape[:-2], end - start, size - end))
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)  # (..., C, C)


def _chunk_local(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """Every chunk's local work from its inputs (..., C, ·) and log-gates gc (..., C, F): W_v (..., C, Dv), W_k
    (..., C, F), the read-out queries Q ⊙ e^G and written-out keys K ⊙ e^{G_C − G} (..., C, F), the chunk's decay
    e^{G_C} (..., F, 1), the scores P and T = (I + A)⁻¹ (..., C, C). Plain differentiable torch code."""
    cum, entered, to_end, last, split = _gates(gc, kc.dtype)
    system = pair_weights(kc, kc, cum, split, strict=True) * bc.unsqueeze(-1)  # A
    eye = torch.eye(kc.shape[-2], dtype=kc.dtype, device=kc.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    w_v = inverse @ (vc * bc.unsqueeze(-1))
    w_k = inverse @ (kc * entered * bc.unsqueeze(-1))
    scores = pair_weights(qc, kc, cum, split, strict=False)  # P
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
    cum, entered, to_end, last, split = _gates(gc, kc.dtype)
    beta = bc.unsqueeze(-1)
    d_bq = d_o @ states.mT  # d(Q ⊙ e^G)
    d_kout = written @ d_leaving.mT  # d(K ⊙ e^{G_C − G})
    d_rv = inverse.mT @ d_written  # dR
    d_rk = (d_rv @ states.mT).neg_()  # d(K ⊙ e^G) / β
    dq, dk_p, d_cum, _ = _pair_grads(qc, kc, cum, split, d_o @ written.mT, strict=False, rows=None)
    dk_left, dk_right, d_cum_a, d_beta = _pair_grads(kc, kc, cum, split, (d_rv @ written.mT).neg_(), strict=True,
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lead = q.dim() - 1  # the batch dimensions and the chunks'
        w_v, w_k, bq, k_out, last, scores, inverse = _by_tiles(_chunk_local, _chunk_inputs(q, k, v, beta, log_gate,
                                                                                            size), lead)
        state = initial if initial is not None else q.new_zeros(*q.shape[:-2], k.shape[-1], v.shape[-1])
        states = q.new_empty(*w_k.shape[:-2], k.shape[-1], v.shape[-1])  # the state entering each chunk
        final = _state_sweep(state.reshape(-1, *state.shape[-2:]), _batch_rows(w_k, lead), _batch_rows(w_v, lead),
                             _batch_rows(k_out, lead), _batch_rows(last, lead), _batch_rows(states, lead))
        written = w_v  # U, written over W_v chunk by chunk

        def outputs(bq: torch.Tensor, scores: torch.Tensor, written: torch.Tensor, states: torch.Tensor
                    ) -> tuple[torch.Tensor]:
            return (torch.baddbmm(bq @ states, scores, written),)  # a tile: (chunks, C, ·)

        (out,) = _by_tiles(outputs, [bq, scores, written, states], lead)
        ctx.size, ctx.has_initial = size, initial is not None
        ctx.save_for_backward(q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores, inverse)
        return out.flatten(-3, -2), final.view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores, inverse = ctx.saved_tensors
        size = ctx.size
        d_o = _chunked(d_out.contiguous(), size)  # a gradient from a sum arrives expanded: made whole once
        d_leaving, d_written, d_state = adjoint_sweep(bq, k_out, w_k, scores.mT @ d_o, d_o, last, d_final)
        assert d_written is not None
        dq, dk, dv, d_beta, d_gate = _by_tiles(
            _local_grads, [*_chunk_inputs(q, k, v, beta, log_gate, size), d_o, states, written, d_written, d_leaving,
                           inverse], q.dim() - 1)
        return (dq.flatten(-3, -2), dk.flatten(-3, -2), dv.flatten(-3, -2), d_beta.flatten(-2),
                d_gate.flatten(-3, -2), d_state if ctx.has_initial else None, None)


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
) -> tuple[torch.Tensor, DeltaRuleState]:
    """The chunkwise form (module docstring); tokens past a multiple of the chunk are padded with β = 0, g = 0.
    log_gate (..., N, F) ≤ 0 in any float dtype (its cumulative sums are formed in fp64)."""
    n = qf.shape[-2]
    size = max(1, min(chunk_size, n))
    pad = (-n) % size
    if pad:
        qf, kf, v, log_gate = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, v, log_gate))
        beta = F.pad(beta, (0, pad))
    initial = state.kv if state is not None else None
    out, final = _KdaChunks.apply(qf, kf, v, beta, log_gate, initial, size)
    seen = state.num_tokens if state is not None else 0
    return out[..., :n, :], DeltaRuleState(final, seen + n)


def kda_transition(
    kf: torch.Tensor, v: torch.Tensor, *, beta: torch.Tensor, log_gate: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a stretch of tokens does to any state it is entered with, S_out = A·S_in + B, as
    :func:`linattn.forms.delta.delta_transition` with per-feature gates: A (..., F, F) = Π_t (I − β_t k_t k_tᵀ)·
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
