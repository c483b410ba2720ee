"""The delta rule with a per-feature gate (KDA, Kimi Delta Attention): every feature of the memory decays at its own
rate before the delta write.

    S_t = diag(a_t)·S_{t−1} + β_t·k_t·(v_t − (diag(a_t)·S_{t−1})ᵀk_t)ᵀ,      o_t = S_tᵀq_t,      a_t = e^{g_t} ∈ (0, 1]^F

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
from .delta import _batch_rows, _by_tiles, _chunked, _state_sweep, adjoint_sweep

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


def pair_weights(x: torch.Tensor, y: torch.Tensor, cum: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """W_tj = Σ_f x_tf y_jf e^{G_tf − G_jf} for j ≤ t (j < t when ``strict``), 0 above, per chunk: x, y
    (..., C, F), cum G (..., C, F) fp64 and non-increasing in t → (..., C, C) in x's dtype. Differentiable."""
    size = x.shape[-2]
    keep = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    span = cum[..., 0, :] - cum[..., -1, :]  # (..., F) ≥ 0: the largest exponent difference within a chunk
    if size == 1 or bool((span <= GEMM_SPAN).all()):
        middle = (cum[..., :1, :] + cum[..., -1:, :]) / 2  # (..., 1, F): every G − M within ±span/2
        left = x * torch.exp(cum - middle).to(x.dtype)
        right = y * torch.exp(middle - cum).to(y.dtype)
        return (left @ right.mT).masked_fill(~keep, 0)
    return _sub_chunk_weights(x, y, cum, keep)


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
    e^{G_C} (..., F, 1) and the scores P (..., C, C). Plain differentiable torch code."""
    dtype = kc.dtype
    cum = torch.cumsum(gc.to(torch.float64), dim=-2)  # G (..., C, F): only differences ≤ 0 are exponentiated
    total = cum[..., -1:, :]  # G_C (..., 1, F)
    entered = torch.exp(cum).to(dtype)  # e^{G_t}: how much of the entering state token t sees
    system = pair_weights(kc, kc, cum, strict=True) * bc.unsqueeze(-1)  # A
    eye = torch.eye(kc.shape[-2], dtype=dtype, device=kc.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    w_v = inverse @ (vc * bc.unsqueeze(-1))
    w_k = inverse @ (kc * entered * bc.unsqueeze(-1))
    k_out = kc * torch.exp(total - cum).to(dtype)
    last = torch.exp(total).to(dtype).mT  # (..., F, 1)
    scores = pair_weights(qc, kc, cum, strict=False)  # P
    return w_v, w_k, qc * entered, k_out, last, scores


class _KdaChunks(torch.autograd.Function):
    """The chunkwise KDA on inputs whose length is a multiple of the chunk (module docstring)."""

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
        chunked = [_chunked(q, size), _chunked(k, size), _chunked(v, size), beta.unflatten(-1, (-1, size)),
                   _chunked(log_gate, size)]
        w_v, w_k, bq, k_out, last, scores = _by_tiles(_chunk_local, list(chunked), lead)
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
        ctx.save_for_backward(q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores)
        return out.flatten(-3, -2), final.view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, beta, log_gate, states, w_k, written, bq, k_out, last, scores = ctx.saved_tensors
        size = ctx.size
        d_o = _chunked(d_out.contiguous(), size)
        d_leaving, d_written, d_state = adjoint_sweep(bq, k_out, w_k, scores.mT @ d_o, d_o, last, d_final)
        assert d_written is not None

        def local(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor,
                  d_o: torch.Tensor, states: torch.Tensor, written: torch.Tensor, d_written: torch.Tensor,
                  d_leaving: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """The chunk-local gradients of a tile, by autograd through its recomputed local work, given the
            adjoints of that work's results: U = W_v − W_k·S, O = (Q⊙e^G)·S + P·U, S' = e^{G_C}·S + K_outᵀU."""
            leaves = [x.detach().requires_grad_() for x in (qc, kc, vc, bc, gc)]
            with torch.enable_grad():
                results = _chunk_local(*leaves)
            adjoints = (d_written, -(d_written @ states.mT), d_o @ states.mT, written @ d_leaving.mT,
                        (states * d_leaving).sum(-1, keepdim=True), (d_o @ written.mT))
            return torch.autograd.grad(results, leaves, adjoints)

        chunked = [_chunked(q, size), _chunked(k, size), _chunked(v, size), beta.unflatten(-1, (-1, size)),
                   _chunked(log_gate, size)]
        dq, dk, dv, d_beta, d_gate = _by_tiles(local, [*chunked, d_o, states, written, d_written, d_leaving],
                                               q.dim() - 1)
        return (dq.flatten(-3, -2), dk.flatten(-3, -2), dv.flatten(-3, -2), d_beta.flatten(-2),
                d_gate.flatten(-3, -2), d_state if ctx.has_initial else None, None)


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
