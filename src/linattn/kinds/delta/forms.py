"""The delta rule (DeltaNet; Gated DeltaNet with a decay): the memory writes only what it does not already predict.

    S_t = a_t·S_{t−1} + β_t·k_t·(v_t − a_t·S_{t−1}ᵀk_t)ᵀ,      o_t = S_tᵀq_t

k_t, q_t are L2-normalised features (:func:`linattn.features.unit_features`), β_t ∈ [0, 2] the write strength and
a_t = e^{g_t} ∈ (0, 1] the decay (1 without one). With ‖k_t‖ = 1 the factor (I − β_t k_t k_tᵀ) has eigenvalues 1 and
1 − β_t, so every step is a contraction of S plus a bounded write. There is no Σφ(k): the output is not normalised.

Two forms, one definition:

- :func:`delta_recurrent`: token by token, the reference and what a decoding step computes.
- :func:`delta_chunked`: the chunkwise form. Write u_t = β_t(v_t − a_t·S_{t−1}ᵀk_t) for what token t adds, so
  S_t = a_t·S_{t−1} + k_t u_tᵀ. Within a chunk of C tokens entered with state S, b_t = e^{G_t} (G the chunk's own
  cumulative log-decay, summed in fp64) and Γ_tj = e^{G_t − G_j} (j ≤ t, every factor ≤ 1):

      (I + A) U = diag(β)·V − diag(β·b)·K·S,   A_tj = β_t Γ_tj k_t·k_j  (j < t; unit lower triangular system)
      O = diag(b)·Q·S + (Q Kᵀ ⊙ Γ ⊙ [j ≤ t])·U,      S' = b_C·S + (K ⊙ Γ_Cj)ᵀ·U

  The system is solved once per chunk for both right-hand sides (the UT / WY representation: U = W_v − W_k·S with
  W_v = T·diag(β)V, W_k = T·diag(β·b)K, T = (I + A)⁻¹ by one triangular solve): W, T, P and the outputs are local
  to a chunk and computed for tiles of chunks at once; only U = W_v − W_k·S and S' = b_C·S + (K⊙Γ_C)ᵀU run chunk
  after chunk, two C×F by F×Dv-sized products each.

  :class:`_DeltaChunks` keeps the inputs, the state entering each chunk (N/C · F·Dv), W_k, U, T and the masked
  scores for backward: training memory O(N·(F + Dv + C) + (N/C)·F·Dv), never O(N·F·Dv). Its backward runs the
  adjoint of the same recurrence backwards, dU = PᵀdO + (K⊙Γ_C)·dS', dS = (bQ)ᵀdO + b_C·dS' − W_kᵀdU, then the
  chunk-local gradients written out, tile by tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ...state import DeltaRuleState


def delta_recurrent(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None,
    state: DeltaRuleState | None,
) -> tuple[torch.Tensor, DeltaRuleState]:
    """Token by token. qf, kf (..., N, F) unit features; v (..., N, Dv); beta (..., N); log_decay (..., N) fp64."""
    kv = state.kv if state is not None else qf.new_zeros(*qf.shape[:-2], kf.shape[-1], v.shape[-1])
    decay = torch.exp(log_decay).to(qf.dtype) if log_decay is not None else None
    outs = []
    for t in range(qf.shape[-2]):
        if decay is not None:
            kv = kv * decay[..., t, None, None]
        k_t = kf[..., t, :]
        recalled = (k_t.unsqueeze(-2) @ kv).squeeze(-2)  # S_{t−1}ᵀk_t after the decay, (..., Dv)
        write = beta[..., t, None] * (v[..., t, :] - recalled)
        kv = kv + k_t.unsqueeze(-1) * write.unsqueeze(-2)
        outs.append((qf[..., t, :].unsqueeze(-2) @ kv).squeeze(-2))
    seen = state.num_tokens if state is not None else 0
    return torch.stack(outs, dim=-2), DeltaRuleState(kv, seen + qf.shape[-2])


FP32_EXP_FLOOR = -87.0  # e^-87: fp32's smallest normal numbers
FOLD_SPREAD = 60.0  # a chunk's G may span this much and Γ still be folded into its products' rows (e^{±30})


class _Gates(NamedTuple):
    """A decay's per-chunk factors, from the chunks' log-decays (..., nc, C) in fp64 (every field None without one).

    Γ_tj = e^{G_t − G_j} (j ≤ t), G the chunk's own cumulative log-decay, enters every C×C product of the chunk.
    Where G spans at most ``FOLD_SPREAD`` within every chunk, Γ_tj = left_t·right_j with left = e^{G − M}, right =
    e^{M − G}, M the middle of the chunk's G: the factors are folded into the rows of the products' operands (an
    N·F pass instead of a C×C one, and no C×C exponential; each factor within e^{±30}, far inside fp32's and bf16's
    range). Otherwise (a decay that empties the memory within a chunk) Γ itself is formed (:func:`_pair_gates`)."""

    gamma: torch.Tensor | None  # Γ (..., nc, C, C), when it is not folded
    left: torch.Tensor | None  # e^{G_t − M} (..., nc, C), when it is
    right: torch.Tensor | None  # e^{M − G_j}
    b: torch.Tensor | None  # e^{G_t}
    last: torch.Tensor | None  # the chunk's total e^{G_C} (..., nc, 1, 1)
    k_decay: torch.Tensor | None  # e^{G_C − G_j}


def _gates(log_decay: torch.Tensor | None, size: int, dtype: torch.dtype) -> _Gates:
    """:class:`_Gates` from the log-decays (..., N) in fp64, N a multiple of the chunk ``size``, the factors in
    ``dtype``."""
    if log_decay is None:
        return _Gates(None, None, None, None, None, None)
    # G (..., nc, C), summed in fp64: e^G and e^{total − G} lie in (0, 1], and the pairs' factors below are cast
    # only where G spans ≤ FOLD_SPREAD (else Γ is formed from fp64 differences)
    cum = torch.cumsum(log_decay.unflatten(-1, (-1, size)), dim=-1)
    total = cum[..., -1:]
    b, last, k_decay = (torch.exp(cum).to(dtype), torch.exp(total).to(dtype).unsqueeze(-1),
                        torch.exp(total - cum).to(dtype))
    # M cancels in left_t·right_j: a constant to autograd (delta_transition differentiates through this)
    low, high = cum.detach().amin(-1, keepdim=True), cum.detach().amax(-1, keepdim=True)
    if dtype != torch.float16 and cum.numel() and float((high - low).max()) <= FOLD_SPREAD:
        middle = (low + high) / 2
        return _Gates(None, torch.exp(cum - middle).to(dtype), torch.exp(middle - cum).to(dtype), b, last, k_decay)
    return _Gates(_pair_gates(cum, dtype), None, None, b, last, k_decay)


def _pair_gates(cum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Γ (..., C, C) = e^{G_t − G_j} for j ≤ t, else 0, from G (..., C) in fp64. The difference is taken in fp64 and
    the exponential in fp32 (fp64 for an fp64 call): G_t − G_j ≤ 0 rounded to fp32 changes e^{G_t − G_j} by at most
    |d|·e^{d}·2⁻²⁴ ≤ 2.2e-8 absolute. In fp32 no pair weight is below e^-87 (≈ 1.6e-38, fp32's smallest normal
    number is 1.2e-38) but the zeros above the diagonal: a subnormal result would make the exponential and every
    product with it run on the processor's slow path, for a weight that changes nothing."""
    upper = ~_masks(cum.shape[-1], cum.device)[0]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)
    if dtype != torch.float64:
        diff = diff.to(torch.float32).clamp_(min=FP32_EXP_FLOOR)
    return diff.masked_fill_(upper, float("-inf")).exp_().to(dtype)


def _pair_products(x: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor | None, left: torch.Tensor | None,
                   right: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x·yᵀ ⊙ Γ (..., C, C) for a tile of chunks (x, y (..., C, ·)), unmasked: Γ folded into the rows of x and y,
    given, or absent (:class:`_Gates`). Into ``out`` when given."""
    if left is not None:
        return torch.matmul(_row_scaled(x, left), _row_scaled(y, right).mT, out=out)
    product = torch.matmul(x, y.mT, out=out)
    return product if gamma is None else product.mul_(gamma)


def _masks(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ones = torch.ones(size, size, dtype=torch.bool, device=device)
    return ones.tril(), ones.tril(-1)


def _scaled(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    return x if factor is None else x * factor


def _row_scaled(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """x (..., C, ·) with each row scaled by factor (..., C); None: x as it is."""
    return _scaled(x, factor.unsqueeze(-1) if factor is not None else None)


def _row_scaled_into(x: torch.Tensor, factor: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """:func:`_row_scaled` into ``out`` when a factor is given (without one, x itself: the caller made x there)."""
    return x if factor is None else torch.mul(x, factor.unsqueeze(-1), out=out)


def _add_product_(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """base += alpha·(a @ b) in place, in one batched call over any leading dimensions (shared by the three; base
    contiguous and not needed as it was). Returns base."""
    base.view(-1, *base.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), alpha=alpha)
    return base


def _chunked(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.unflatten(-2, (x.shape[-2] // size, size))


TILE_BYTES = 1 << 21  # a tile's C×C tensors: small enough to stay in cache and to be reused by the allocator


def _by_tiles(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: list[torch.Tensor | None], lead: int, *,
              into: bool = False) -> tuple[torch.Tensor, ...]:
    """``fn`` over tiles of chunks: every input (…, nc, ·) has ``lead`` dimensions up to and including the chunks',
    flattened into one; ``fn`` takes a tile of each (None stays None) and returns tensors with the tile first, which
    are gathered into (…, nc, ·) outputs allocated once. With ``into``, ``fn`` also takes ``out``: None for the
    first tile, then the outputs' slices for its tile, into which it may write its results (a result that is its
    slice is not copied: at N = 16,384 the copies of the delta rule's tiles cost tens of ms).

    Chunk-local work is independent from chunk to chunk. Done for all chunks at once, every step of it would make a
    tensor as large as the input (each streamed through memory, and freshly allocated: above glibc's 32 MiB mmap
    threshold, a fresh allocation is page-faulted anew each time); done by tiles, the intermediates stay in cache."""
    first = next(x for x in inputs if x is not None)
    shape, total = first.shape[:lead], math.prod(first.shape[:lead])
    flat = [x.reshape(total, *x.shape[lead:]) if x is not None else None for x in inputs]
    per = max(1, TILE_BYTES // (first.element_size() * first.shape[-1] * first.shape[-2]))
    outputs: list[torch.Tensor] = []
    for begin in range(0, total, per):
        tile = [x[begin : begin + per] if x is not None else None for x in flat]
        slots = tuple(out[begin : begin + per] for out in outputs)
        part = fn(*tile, out=slots or None) if into else fn(*tile)
        if not outputs:
            outputs = [y.new_empty(total, *y.shape[1:]) for y in part]
            slots = tuple(out[begin : begin + per] for out in outputs)
        for slot, y in zip(slots, part, strict=True):
            if y.data_ptr() != slot.data_ptr():
                slot.copy_(y)
    return tuple(out.view(*shape, *out.shape[1:]) for out in outputs)


def _chunk_solution(
    kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, gamma: torch.Tensor | None, left: torch.Tensor | None,
    right: torch.Tensor | None, b: torch.Tensor | None, out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Every chunk's local solution at once: W_v = T·diag(β)V (..., nc, C, Dv), W_k = T·diag(β·b)K (..., nc, C, F)
    and T = (I + A)⁻¹ (..., nc, C, C).

    T is one triangular solve against the identity, then W two products: on CPU a batched triangular solve runs at a
    fraction of a product's rate per flop, so solving for C columns and multiplying beats solving for F + Dv
    columns; and the backward's transposed solve becomes one product with Tᵀ."""
    strict = _masks(kc.shape[-2], kc.device)[1]
    system = _pair_products(kc * bc.unsqueeze(-1), kc, gamma, left, right).masked_fill_(~strict, 0)  # A
    eye = torch.eye(kc.shape[-2], dtype=kc.dtype, device=kc.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True,
                                            out=_slot(out, 2))
    w_v = torch.matmul(inverse, vc * bc.unsqueeze(-1), out=_slot(out, 0))
    w_k = torch.matmul(inverse, kc * _scaled(bc, b).unsqueeze(-1), out=_slot(out, 1))
    return w_v, w_k, inverse


def _slot(out: tuple[torch.Tensor, ...] | None, index: int) -> torch.Tensor | None:
    """A tile's output slice to write result ``index`` into (:func:`_by_tiles` with ``into``), or None."""
    return out[index] if out is not None else None


def _batch_rows(x: torch.Tensor, lead: int) -> torch.Tensor:
    """(…, nc, ·, ·) with ``lead`` dimensions up to and including the chunks' → (rows, nc, ·, ·), a view."""
    return x.reshape(-1, *x.shape[lead - 1 :])


def _state_sweep(
    state: torch.Tensor, w_k: torch.Tensor, written: torch.Tensor, k_out: torch.Tensor, last: torch.Tensor | None,
    states: torch.Tensor,
) -> torch.Tensor:
    """The forward recurrence, chunk after chunk, on (rows, nc, ·, ·) views: U_c = W_v,c − W_k,c·S written over W_v
    in place (``written`` holds W_v on entry, U on return), S ← b_C·S + K_outᵀU_c. ``states`` (rows, nc, F, Dv)
    receives the state entering each chunk; returns the final state (rows, F, Dv). The products go to fresh
    contiguous (rows, ·, ·) tensors, copied into the strided slots: an in-place product on a slot strided across
    rows runs matrix by matrix.

    Two products of C·F·Dv per chunk on the running state: no F×F transition matrix is formed per chunk (that
    would cost F²·(C + Dv) more per chunk and four tensors the size of the input)."""
    chunks = w_k.shape[1]
    for c in range(chunks):
        states[:, c] = state
        u = torch.baddbmm(written[:, c], w_k[:, c], state, alpha=-1)
        written[:, c] = u
        state = torch.baddbmm(state if last is None else state * last[:, c], k_out[:, c].mT, u)
    return state


class _DeltaChunks(torch.autograd.Function):
    """The chunkwise delta rule on inputs whose length is a multiple of the chunk.

    Saved for backward: the inputs, the state entering each chunk, W_k and the writes U (O(N·(F + Dv)) in all), and
    two C×C tensors per chunk (O(N·C)): the inverse T and the masked scores P, which the backward would otherwise
    recompute (a triangular solve and a product). The backward is written out (no autograd graph of the chunk-local
    work is kept or rebuilt)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor | None,
        initial: torch.Tensor | None,
        size: int,
        sweeps: Sweeps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qc, kc = _chunked(q, size), _chunked(k, size)
        gamma, left, right, b, last, k_decay = _gates(log_decay, size, q.dtype)
        lower, _ = _masks(size, q.device)
        lead = q.dim() - 1  # the batch dimensions and the chunks'
        w_v, w_k, inverse = _by_tiles(_chunk_solution, [kc, _chunked(v, size), beta.unflatten(-1, (-1, size)),
                                                        gamma, left, right, b], lead, into=True)
        k_out = _row_scaled(kc, k_decay)  # K ⊙ Γ_C
        state = initial if initial is not None else q.new_zeros(*q.shape[:-2], k.shape[-1], v.shape[-1])
        states = q.new_empty(*qc.shape[:-2], k.shape[-1], v.shape[-1])  # the state entering each chunk
        final = sweeps.forward(state.reshape(-1, *state.shape[-2:]), _batch_rows(w_k, lead), _batch_rows(w_v, lead),
                               _batch_rows(k_out, lead), _batch_rows(last, lead) if last is not None else None,
                               _batch_rows(states, lead))
        written = w_v  # U, written over W_v chunk by chunk (W_v is not needed after)

        def outputs(qc: torch.Tensor, kc: torch.Tensor, written: torch.Tensor, states: torch.Tensor,
                    gamma: torch.Tensor | None, left: torch.Tensor | None, right: torch.Tensor | None,
                    b: torch.Tensor | None, out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
            scores = _pair_products(qc, kc, gamma, left, right, _slot(out, 0)).masked_fill_(~lower, 0)  # P
            read = _add_product_(torch.matmul(_row_scaled(qc, b), states, out=_slot(out, 1)), scores, written)
            return scores, read

        scores, out = _by_tiles(outputs, [qc, kc, written, states, gamma, left, right, b], lead, into=True)
        ctx.size, ctx.has_initial, ctx.sweep = size, initial is not None, sweeps.adjoint
        ctx.save_for_backward(q, k, v, beta, log_decay, states, w_k, written, inverse, scores)
        return out.flatten(-3, -2), final.view(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # a gradient broadcast from a sum arrives expanded (stride 0): made whole once, not in every product
        *grads, d_initial = chunk_backward(ctx.saved_tensors, d_out.contiguous(), d_final, ctx.size,
                                           want_log=ctx.needs_input_grad[4], sweep=ctx.sweep)
        return (*grads, d_initial if ctx.has_initial else None, None, None)


Sweep = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


def adjoint_sweep(
    bq: torch.Tensor,
    k_out: torch.Tensor,
    w_k: torch.Tensor,
    p_do: torch.Tensor,
    d_o: torch.Tensor,
    last: torch.Tensor | None,
    d_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The adjoint of the state recurrence, chunk after chunk backwards, on the running adjoint dS' of the state
    leaving a chunk: dU = PᵀdO + K_out·dS', dS = (bQ)ᵀdO + b_C·dS' − W_kᵀdU. Chunked inputs (..., nc, C, ·) as
    :func:`chunk_backward` forms them; returns the adjoint of the state leaving each chunk (..., nc, F, Dv), dU
    (..., nc, C, Dv, written over ``p_do``) and the adjoint of the state entering the first chunk (..., F, Dv).
    A kernel with this signature may return None for dU (then computed from ``p_do`` and the first result)."""
    lead = bq.dim() - 2
    direct = _batch_rows(bq.mT @ d_o, lead)  # (bQ)ᵀdO for every chunk at once
    d_leaving = direct.new_empty(direct.shape)
    d_written, k_rows, w_rows = _batch_rows(p_do, lead), _batch_rows(k_out, lead), _batch_rows(w_k, lead)
    last_rows = _batch_rows(last, lead) if last is not None else None
    d_state = d_final.reshape(-1, *d_final.shape[-2:])
    for c in reversed(range(direct.shape[1])):
        d_leaving[:, c] = d_state
        d_u = torch.baddbmm(d_written[:, c], k_rows[:, c], d_state)
        d_written[:, c] = d_u
        kept = direct[:, c] + (d_state if last_rows is None else d_state * last_rows[:, c])
        d_state = torch.baddbmm(kept, w_rows[:, c].mT, d_u, alpha=-1)
    return d_leaving.view(*bq.shape[:-2], *d_leaving.shape[-2:]), p_do, d_state.view(d_final.shape)


class Sweeps(NamedTuple):
    """The two sequential sweeps of the chunked forms (the delta rule's and KDA's): ``forward`` with
    :func:`_state_sweep`'s signature, ``adjoint`` with :func:`adjoint_sweep`'s. Everything else in those forms is
    chunk-local; the sweeps are loops over the chunks, which a kernel can run faster (the native backend's,
    :mod:`linattn.backends.native.forms`, given by the dispatch)."""

    forward: Callable[..., torch.Tensor]
    adjoint: Sweep


TORCH_SWEEPS = Sweeps(_state_sweep, adjoint_sweep)


def chunk_backward(
    saved: tuple[torch.Tensor | None, ...],
    d_out: torch.Tensor,
    d_final: torch.Tensor,
    size: int,
    *,
    want_log: bool,
    sweep: Sweep,
) -> tuple[torch.Tensor | None, ...]:
    """The written-out backward of :class:`_DeltaChunks` from what its forward saved (q, k, v, beta, log_decay, the
    states entering each chunk, W_k, U, and optionally T = (I + A)⁻¹ and the masked scores P, which are
    recomputed when absent): the chunk-local gradients around ``sweep``, the sequential adjoint of the state
    (:func:`adjoint_sweep`, or a kernel with its signature). Returns dq, dk, dv, dβ, d log-decay (None unless
    ``want_log``) and ∂L/∂(initial state)."""
    q, k, v, beta, log_decay, states, w_k, written, *kept = saved
    inverse, scores = kept if kept else (None, None)
    assert q is not None and k is not None and v is not None and beta is not None
    assert states is not None and w_k is not None and written is not None
    qc, kc, vc, d_o = _chunked(q, size), _chunked(k, size), _chunked(v, size), _chunked(d_out, size)
    bc = beta.unflatten(-1, (-1, size))
    gamma, left, right, b, last, k_decay = _gates(log_decay, size, q.dtype)
    lower, strict = _masks(size, q.device)
    if scores is None:
        scores = _pair_products(qc, kc, gamma, left, right).masked_fill_(~lower, 0)
    bq = _row_scaled(qc, b)
    k_out = _row_scaled(kc, k_decay)

    p_do = scores.mT @ d_o
    d_leaving, d_written, d_state = sweep(bq, k_out, w_k, p_do, d_o, last, d_final)  # leaving each chunk; dU
    if d_written is None:
        d_written = _add_product_(p_do, k_out, d_leaving)  # dU (PᵀdO is not needed after the sweep)

    want = log_decay is not None and want_log

    def local(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, d_o: torch.Tensor,
              states: torch.Tensor, written: torch.Tensor, d_written: torch.Tensor, d_leaving: torch.Tensor,
              k_out: torch.Tensor, scores: torch.Tensor, inverse: torch.Tensor | None, gamma: torch.Tensor | None,
              left: torch.Tensor | None, right: torch.Tensor | None, b: torch.Tensor | None,
              k_decay: torch.Tensor | None, last: torch.Tensor | None, out: tuple[torch.Tensor, ...] | None = None
              ) -> tuple[torch.Tensor, ...]:
        """The chunk-local gradients of a tile of chunks, from the adjoints of their output states (dq, dk and dv
        into ``out``'s slices when given)."""
        d_scores = (d_o @ written.mT).masked_fill_(~lower, 0)  # dP
        # without a decay dq starts as d_bq and dk as d_kout (added to in place): made in their slices
        d_bq = torch.matmul(d_o, states.mT, out=_slot(out, 0) if b is None else None)
        d_kout = torch.matmul(written, d_leaving.mT, out=_slot(out, 1) if k_decay is None else None)
        system = None
        if inverse is None or want:
            system = _pair_products(kc * bc.unsqueeze(-1), kc, gamma, left, right).masked_fill_(~strict, 0)
        # W = T·R with U = W_v − W_k·S, so dW = (dU, −dU·Sᵀ) and dR = Tᵀ·dW = (Tᵀ·dU, −(Tᵀ·dU)·Sᵀ): one solve for
        # the Dv columns of dU only; and dA = −dR·Wᵀ = −(Tᵀ·dU)·(W_v − W_k·S)ᵀ = −(Tᵀ·dU)·Uᵀ
        if inverse is not None:
            d_rv = inverse.mT @ d_written
        else:
            assert system is not None
            d_rv = torch.linalg.solve_triangular(system.mT, d_written, upper=True, unitriangular=True)
        d_rk = (d_rv @ states.mT).neg_()
        d_system = (d_rv @ written.mT).neg_().masked_fill_(~strict, 0)  # dA

        rows = _scaled(bc, b)
        # A_tj = β_t·Γ_tj·k_t·k_j and P_tj = Γ_tj·q_t·k_j: dq gets (dP ⊙ Γ)·K, dk (dP ⊙ Γ)ᵀ·Q + (dA ⊙ Γ)ᵀ·(β ⊙ K), and
        # pulled = (dA ⊙ Γ)·K is the keys' row t of dA·K before β_t. d_bq and d_kout are read again below only with
        # a decay, when _row_scaled made new tensors: in place is safe
        if left is None:
            gated_scores = _scaled(d_scores, gamma)  # dP ⊙ Γ
            weighted = _scaled(d_system, gamma)  # dA ⊙ Γ
            dq = _add_product_(_row_scaled_into(d_bq, b, _slot(out, 0)), gated_scores, kc)
            pulled = weighted @ kc
            dk = _add_product_(_row_scaled_into(d_kout, k_decay, _slot(out, 1)), gated_scores.mT, qc)
            dk = _add_product_(dk, weighted.mT, kc * bc.unsqueeze(-1))
        else:  # Γ_tj = left_t·right_j: into the rows of the operands and the results
            assert right is not None and b is not None
            k_right = _row_scaled(kc, right)
            dq = torch.matmul(d_scores, k_right, out=_slot(out, 0)).mul_(left.unsqueeze(-1))
            dq.addcmul_(d_bq, b.unsqueeze(-1))
            pulled = (d_system @ k_right).mul_(left.unsqueeze(-1))
            into_k = _add_product_(d_scores.mT @ _row_scaled(qc, left), d_system.mT, kc * (bc * left).unsqueeze(-1))
            dk = _row_scaled_into(d_kout, k_decay, _slot(out, 1)).addcmul_(into_k, right.unsqueeze(-1))
        dk.addcmul_(rows.unsqueeze(-1), d_rk).addcmul_(bc.unsqueeze(-1), pulled)
        d_v = torch.mul(bc.unsqueeze(-1), d_rv, out=_slot(out, 2))
        d_rows = (kc * d_rk).sum(-1)
        d_beta = (vc * d_rv).sum(-1) + (kc * pulled).sum(-1) + _scaled(d_rows, b)

        if want:
            assert b is not None and last is not None and k_decay is not None and system is not None
            # dΓ·Γ, in place (dA and dP are not read after); each row and column sum is taken in the call's dtype,
            # as exact as its terms, and only the sums go to fp64 for G's reverse cumulative sum
            pairs = d_system.mul_(system).addcmul_(d_scores, scores)
            d_cum = pairs.sum(-1).double() - pairs.sum(-2).double()
            d_cum += ((d_rows * bc + (qc * d_bq).sum(-1)) * b).to(torch.float64)  # through b_t
            out_decay = ((kc * d_kout).sum(-1) * k_decay).to(torch.float64)  # through e^{G_C − G_j}
            d_cum -= out_decay
            d_cum[..., -1] += out_decay.sum(-1) + ((states * d_leaving).sum((-2, -1)) * last[..., 0, 0]).double()
            d_log = torch.flip(torch.cumsum(torch.flip(d_cum, [-1]), dim=-1), [-1])  # G = cumsum(g)
            return dq, dk, d_v, d_beta, d_log
        return dq, dk, d_v, d_beta

    grads = _by_tiles(local, [qc, kc, vc, bc, d_o, states, written, d_written, d_leaving, k_out, scores, inverse,
                              gamma, left, right, b, k_decay, last], q.dim() - 1, into=True)
    dq, dk, d_v, d_beta = grads[:4]
    d_log = grads[4].flatten(-2) if want else None
    return dq.flatten(-3, -2), dk.flatten(-3, -2), d_v.flatten(-3, -2), d_beta.flatten(-2), d_log, d_state


def delta_chunked(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None,
    state: DeltaRuleState | None,
    chunk_size: int,
    sweeps: Sweeps | None = None,
) -> tuple[torch.Tensor, DeltaRuleState]:
    """The chunkwise form (module docstring); tokens past a multiple of the chunk are padded with β = 0, a = 1.
    ``sweeps``: the loops over the chunks (:class:`Sweeps`; default the torch ones, :data:`TORCH_SWEEPS`)."""
    n = qf.shape[-2]
    size = max(1, min(chunk_size, n))
    pad = (-n) % size
    if pad:
        qf, kf, v = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, v))
        beta = F.pad(beta, (0, pad))
        log_decay = F.pad(log_decay, (0, pad)) if log_decay is not None else None
    initial = state.kv if state is not None else None
    out, final = _DeltaChunks.apply(qf, kf, v, beta, log_decay, initial, size, sweeps or TORCH_SWEEPS)
    seen = state.num_tokens if state is not None else 0
    return out[..., :n, :], DeltaRuleState(final, seen + n)


def delta_transition(
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a stretch of tokens does to any state it is entered with: S_out = A·S_in + B (the recurrence is affine).

    A (..., F, F) = Π_t a_t(I − β_t k_t k_tᵀ), later tokens on the left (not the chunk's system matrix of the
    module docstring), and B (..., F, Dv) = the final state from S_in = 0. Per chunk, from the same solution as
    the chunked form: A_c = b_C·I − (K⊙Γ_C)ᵀW_k, B_c = (K⊙Γ_C)ᵀW_v; the chunks' pairs then compose as
    (A₂, B₂)∘(A₁, B₁) = (A₂A₁, A₂B₁ + B₂), pairwise in ⌈log₂(N/C)⌉ batched rounds. Cost N·F·(C + F + Dv) for the
    chunks and (N/C)·F²·(F + Dv) for the products: no output and no per-chunk state of the chunked form.
    Differentiable by autograd (memory O(N·C + (N/C)·F·(F + Dv))).
    kf (..., N, F) unit features, v (..., N, Dv), beta (..., N), log_decay (..., N) fp64 or None.
    """
    n = kf.shape[-2]
    size = max(1, min(chunk_size, n))
    pad = (-n) % size
    if pad:  # β = 0, a = 1: the identity
        kf, v = F.pad(kf, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        beta = F.pad(beta, (0, pad))
        log_decay = F.pad(log_decay, (0, pad)) if log_decay is not None else None
    gamma, left, right, b, last, k_decay = _gates(log_decay, size, kf.dtype)
    kc = _chunked(kf, size)
    w_v, w_k, _ = _chunk_solution(kc, _chunked(v, size), beta.unflatten(-1, (-1, size)), gamma, left, right, b)
    k_out = _row_scaled(kc, k_decay).mT
    carry, adds = k_out @ w_k, k_out @ w_v
    eye = torch.eye(kf.shape[-1], dtype=kf.dtype, device=kf.device)
    return compose_maps(torch.cat([_scaled(eye, last) - carry, adds], dim=-1))


def compose_maps(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' affine maps [A_c | B_c] (..., nc, F, F + Dv), first chunk first, composed into the map of the
    whole stretch (A (..., F, F), B (..., F, Dv)): (A₂, B₂)∘(A₁, B₁) = (A₂A₁, A₂B₁ + B₂), pairwise in
    ⌈log₂ nc⌉ batched rounds."""
    features = maps.shape[-2]
    values = maps.shape[-1] - features
    while maps.shape[-3] > 1:  # compose neighbours (2i, 2i+1); an odd last one waits for the next round
        pairs = maps.shape[-3] // 2
        first, second = maps[..., 0 : 2 * pairs : 2, :, :], maps[..., 1 : 2 * pairs : 2, :, :]
        second_a, second_b = second.split([features, values], dim=-1)
        composed = second_a @ first + F.pad(second_b, (features, 0))  # A₂[A₁ | B₁] + [0 | B₂]
        maps = torch.cat([composed, maps[..., 2 * pairs :, :, :]], dim=-3)
    a, b_final = maps[..., 0, :, :].split([features, values], dim=-1)
    return a, b_final
