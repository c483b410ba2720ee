"""Triton kernels for the delta rule (kinds/delta/forms.py): the chunkwise forward, the adjoint sweep of its backward,
and the token-by-token step.

Rows are flattened batch×heads, each contiguous: Q, K (R, N, F) unit features, V, O (R, N, Dv), β and the
per-token log-decay g (R, N), states (R, F, Dv) in fp32. The chunk kernels take N a multiple of the chunk C (the
host pads with β = 0, g = 0, which writes nothing and decays nothing); F and Dv are padded to powers of two by
masked loads. Every tile is computed in fp32 (operands loaded in the input dtype and widened); the products'
input_precision is a constexpr (TF32 for 16-bit inputs, TF32×3 for fp32; the interpreter computes in fp32).

Within a chunk entered with state S (G the chunk's own cumulative log-decay, summed in fp32 from 0 at its start,
so that only differences G_t − G_j ≤ 0 and G_t ≤ 0 are exponentiated):

    forward   grid (R, Dv/BV), chunk after chunk, S[:, block] in registers:
              A = (K Kᵀ ⊙ β 1ᵀ ⊙ Γ) strictly lower,  T = (I + A)⁻¹ by forward substitution (row by row),
              W_v = T·diag(β)V,  W_k = T·diag(β·e^G)K,  U = W_v − W_k·S,
              O = diag(e^G)·Q·S + (Q Kᵀ ⊙ Γ)·U,  S ← e^{G_C}·S + (K ⊙ e^{G_C − G})ᵀU
              (saving S entering each chunk, W and U for the backward when asked)
    adjoint   grid (R, Dv/BV), chunk after chunk backwards, dS[:, block] in registers:
              dU = PᵀdO + K_out·dS,  dS ← (diag(e^G)Q)ᵀdO + e^{G_C}·dS − W_kᵀ·dU
              (P = Q Kᵀ ⊙ Γ, K_out = K ⊙ e^{G_C − G}: the chunk-local products it is given; the chunk-local
              gradients around it are computed in PyTorch, kinds/delta/forms.py ``chunk_backward``)
    step      grid (R,), token by token (decoding): S ← a·S, u = β(v − Sᵀk̂), S += k̂uᵀ, o = Sᵀq̂, with q̂, k̂ the
              L2-normalised features made here; value blocks in turn, so the state may be updated in place.
The adjoint and the step also serve KDA (kinds/kda/triton/kernels.py) with PER_FEATURE set: a factor e^{G_C} (e^{g}) per
feature, scaling each row of the state (S ← diag(a)·S). Only APIs present in Triton 3.6 are used (as kernels.py). """

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_gates(G, base, t, C: tl.constexpr, HAS_DECAY: tl.constexpr):
    """Γ (C, C) (e^{G_t − G_j} for j ≤ t, else 0), e^{G_t}, e^{G_C − G_t} (C,) and e^{G_C} of one chunk."""
    lower = t[:, None] >= t[None, :]
    if HAS_DECAY:
        cum = tl.cumsum(tl.load(G + base + t), axis=0)  # G, fp32, 0 at the chunk's start
        total = tl.sum(tl.where(t == C - 1, cum, 0.0), axis=0)
        gamma = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
        return gamma, tl.exp(cum), tl.exp(total - cum), tl.exp(total)
    ones = tl.full((C,), 1.0, tl.float32)
    return tl.where(lower, 1.0, 0.0), ones, ones, 1.0


@triton.jit
def _unit_lower_inverse(a, t, C: tl.constexpr):
    """(I + A)⁻¹ of a strictly lower triangular A (C, C) in fp32: row i = e_i − Σ_{j<i} A_ij·row j."""
    inverse = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(t[:, None] == i, a, 0.0), axis=0)  # row i of A, (C,)
        combined = tl.sum(a_i[:, None] * inverse, axis=0)  # Σ_j A_ij·(row j of the inverse)
        inverse = tl.where(t[:, None] == i, inverse - combined[None, :], inverse)
    return inverse


@triton.jit
def delta_forward_kernel(
    Q, K, V, BETA, G, S0, O, SN, STATES, W, U,
    N, F, DV,
    C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, SAVE: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    t = tl.arange(0, C)
    f = tl.arange(0, BF)
    dv = vb * BV + tl.arange(0, BV)
    fm, vm = f < F, dv < DV
    fv_mask = fm[:, None] & vm[None, :]
    strict = t[:, None] > t[None, :]
    state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
    num_chunks = N // C
    for chunk in range(0, num_chunks):
        tokens = chunk * C + t
        q = tl.load(Q + row * N * F + tokens[:, None] * F + f[None, :], mask=fm[None, :], other=0.0).to(tl.float32)
        k = tl.load(K + row * N * F + tokens[:, None] * F + f[None, :], mask=fm[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + row * N * DV + tokens[:, None] * DV + dv[None, :], mask=vm[None, :], other=0.0).to(tl.float32)
        beta = tl.load(BETA + row * N + tokens)
        gamma, b, k_decay, last = _chunk_gates(G, row * N + chunk * C, t, C, HAS_DECAY)
        system = tl.where(strict, tl.dot(k, tl.trans(k), input_precision=PRECISION) * beta[:, None] * gamma, 0.0)
        inverse = _unit_lower_inverse(system, t, C)
        w_v = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)  # (C, BV)
        w_k = tl.dot(inverse, k * (beta * b)[:, None], input_precision=PRECISION)  # (C, BF)
        written = w_v - tl.dot(w_k, state, input_precision=PRECISION)  # U (C, BV)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * gamma  # P, 0 above the diagonal
        out = tl.dot(q * b[:, None], state, input_precision=PRECISION)
        out += tl.dot(scores, written, input_precision=PRECISION)
        tl.store(O + row * N * DV + tokens[:, None] * DV + dv[None, :], out.to(O.dtype.element_ty),
                 mask=vm[None, :])
        if SAVE:
            entering = STATES + (row * num_chunks + chunk) * F * DV
            tl.store(entering + f[:, None] * DV + dv[None, :], state, mask=fv_mask)
            tl.store(U + row * N * DV + tokens[:, None] * DV + dv[None, :], written, mask=vm[None, :])
            solved = W + row * N * (DV + F) + tokens[:, None] * (DV + F)  # (W_v, W_k) side by side
            tl.store(solved + dv[None, :], w_v, mask=vm[None, :])
            if vb == 0:
                tl.store(solved + DV + f[None, :], w_k, mask=fm[None, :])
        state = last * state + tl.dot(tl.trans(k * k_decay[:, None]), written, input_precision=PRECISION)
    tl.store(SN + row * F * DV + f[:, None] * DV + dv[None, :], state, mask=fv_mask)


@triton.jit
def delta_adjoint_kernel(
    BQ, KOUT, WK, PDO, DO, LAST, DSN, DLEAVING, DS0,
    N, F, DV,
    C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, HAS_DECAY: tl.constexpr, PER_FEATURE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The adjoint of the state recurrence for values [vb·BV, vb·BV + BV): BQ = diag(e^G)Q, KOUT = K ⊙ e^{G_C − G},
    WK (R, N, F), PDO = PᵀdO and DO (R, N, Dv), LAST the chunks' e^{G_C}: (R, N/C), or (R, N/C, F) with
    PER_FEATURE (KDA: one factor per row of the state), DSN ∂L/∂(final state).
    Writes the adjoint of the state leaving each chunk (R, N/C, F, Dv) and of the initial state."""
    row = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    t = tl.arange(0, C)
    f = tl.arange(0, BF)
    dv = vb * BV + tl.arange(0, BV)
    fm, vm = f < F, dv < DV
    fv_mask = fm[:, None] & vm[None, :]
    d_state = tl.load(DSN + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
    num_chunks = N // C
    for back in range(0, num_chunks):
        chunk = num_chunks - 1 - back
        tokens = chunk * C + t
        features = tokens[:, None] * F + f[None, :]
        values = tokens[:, None] * DV + dv[None, :]
        bq = tl.load(BQ + row * N * F + features, mask=fm[None, :], other=0.0)
        k_out = tl.load(KOUT + row * N * F + features, mask=fm[None, :], other=0.0)
        w_k = tl.load(WK + row * N * F + features, mask=fm[None, :], other=0.0)
        p_do = tl.load(PDO + row * N * DV + values, mask=vm[None, :], other=0.0)
        d_o = tl.load(DO + row * N * DV + values, mask=vm[None, :], other=0.0)
        tl.store(DLEAVING + (row * num_chunks + chunk) * F * DV + f[:, None] * DV + dv[None, :], d_state,
                 mask=fv_mask)
        d_written = p_do + tl.dot(k_out, d_state, input_precision=PRECISION)  # dU (C, BV)
        direct = tl.dot(tl.trans(bq), d_o, input_precision=PRECISION)
        if HAS_DECAY:
            if PER_FEATURE:
                last = tl.load(LAST + (row * num_chunks + chunk) * F + f, mask=fm, other=0.0)
                d_state = d_state * last[:, None]
            else:
                d_state = d_state * tl.load(LAST + row * num_chunks + chunk)
        d_state += direct - tl.dot(tl.trans(w_k), d_written, input_precision=PRECISION)
    tl.store(DS0 + row * F * DV + f[:, None] * DV + dv[None, :], d_state, mask=fv_mask)


@triton.jit
def delta_step_kernel(
    Q, K, V, BETA, G, S0, O, SN,
    N, F, DV,
    BF: tl.constexpr, BV: tl.constexpr, HAS_DECAY: tl.constexpr, PER_FEATURE: tl.constexpr,
):
    """Token by token, all in fp32: S ← e^{g}·S (PER_FEATURE: g (R, N, F) and S ← diag(e^{g})·S, KDA),
    u = β(v − Sᵀk̂), S ← S + k̂uᵀ, o = Sᵀq̂, with q̂ = q/max(‖q‖, 1e-12)
    and k̂ likewise (as torch.nn.functional.normalize). One program per row walks the value blocks in turn, so it
    alone reads and writes its row's state: SN may be S0 (the state updated in place)."""
    row = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BF)
    fm = f < F
    for vstart in range(0, DV, BV):
        dv = vstart + tl.arange(0, BV)
        vm = dv < DV
        fv_mask = fm[:, None] & vm[None, :]
        state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
        for step in range(0, N):
            q = tl.load(Q + (row * N + step) * F + f, mask=fm, other=0.0).to(tl.float32)
            k = tl.load(K + (row * N + step) * F + f, mask=fm, other=0.0).to(tl.float32)
            q = q / tl.maximum(tl.sqrt(tl.sum(q * q, axis=0)), 1e-12)
            k = k / tl.maximum(tl.sqrt(tl.sum(k * k, axis=0)), 1e-12)
            v = tl.load(V + (row * N + step) * DV + dv, mask=vm, other=0.0).to(tl.float32)
            if HAS_DECAY:
                if PER_FEATURE:
                    gate = tl.load(G + (row * N + step) * F + f, mask=fm, other=0.0)
                    state = state * tl.exp(gate)[:, None]
                else:
                    state = state * tl.exp(tl.load(G + row * N + step))
            recalled = tl.sum(k[:, None] * state, axis=0)  # Sᵀk̂, (BV,)
            write = tl.load(BETA + row * N + step) * (v - recalled)
            state += k[:, None] * write[None, :]
            out = tl.sum(q[:, None] * state, axis=0)
            tl.store(O + (row * N + step) * DV + dv, out.to(O.dtype.element_ty), mask=vm)
        tl.store(SN + row * F * DV + f[:, None] * DV + dv[None, :], state, mask=fv_mask)
