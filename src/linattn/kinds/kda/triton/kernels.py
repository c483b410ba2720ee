"""Triton kernels for the delta rule with a per-feature gate (KDA, kinds/kda/forms.py): the chunk-local solution and the
chunkwise forward sweep. The adjoint sweep of the backward and the decoding step are the delta rule's kernels
(delta_kernels.py) with PER_FEATURE set: they differ only in the decay factor, a vector e^{G_C} (e^{g}) scaling the
rows of the state instead of one number.

Rows are flattened batch×heads, each contiguous: Q, K (R, N, F) unit features, V (R, N, Dv), β (R, N), the log-gates
g (R, N, F) ≤ 0 in fp32, states (R, F, Dv) in fp32. N is a multiple of the chunk C = 16 (the host pads with β = 0,
g = 0: a token that writes nothing and decays nothing); F and Dv are padded by masked loads.

Within a chunk entered with state S, G_t = Σ_{i≤t} g_i the chunk's own cumulative log-gate per feature (fp32, from
0 at the chunk's start), the pair weights

    A_tj = β_t Σ_f k_tf k_jf e^{G_tf − G_jf}  (j < t),      P_tj = Σ_f q_tf k_jf e^{G_tf − G_jf}  (j ≤ t)

are not one product (e^{−G} overflows fp32 for strong gates, and a reference point between t and j differs per
pair). With C = 16 each feature block's pairwise factors e^{G_tf − G_jf} are formed in registers as a (C, C, BK)
tile, the exponent masked to ≤ 0 (−∞ above the diagonal): nothing positive is exponentiated, a factor below fp32's
range is a term below it too, and the sum over f is exact to fp32 rounding whatever the gates (C²·F exponentials
per chunk, as many as the pair weights' multiply-adds). Every other factor, e^{G}, e^{G_C − G}, e^{G_C}, has an
exponent ≤ 0 as well. G is summed in fp32 over at most 16 tokens (the torch form sums in fp64): a factor's relative
error is about |G|·2^−24, |G| the cumulative log-gate's size within the chunk (1e-6 at |G| = 16).

    local     grid (R, N/C), one chunk per program (no state: all chunks at once):
              A and P by feature blocks, T = (I + A)⁻¹ by forward substitution (row by row),
              W_v = T·diag(β)V, W_k = T·diag(β)(K ⊙ e^G), Q ⊙ e^G, K ⊙ e^{G_C − G}, e^{G_C}
    forward   grid (R, Dv/BV), chunk after chunk, S[:, block] in registers:
              U = W_v − W_k·S (written over W_v),  O = (Q ⊙ e^G)·S + P·U,  S ← diag(e^{G_C})·S + (K ⊙ e^{G_C − G})ᵀU
              (saving S entering each chunk for the backward when asked)
Every tile is computed in fp32 (operands widened on load); the products' input_precision is a constexpr (TF32 for
16-bit inputs, TF32×3 for fp32; the interpreter computes in fp32). Only APIs present in Triton 3.6 are used.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...delta.triton.kernels import _unit_lower_inverse

CHUNK = 16  # tokens per chunk: the (C, C, BK) pairwise tiles live in registers


@triton.jit
def _chunk_cumsum(G, offsets, mask):
    """G (C, BK) of a feature block: the cumulative log-gates from the chunk's start, fp32, 0 outside ``mask``."""
    return tl.cumsum(tl.load(G + offsets, mask=mask, other=0.0), axis=0)


@triton.jit
def kda_local_kernel(
    Q, K, V, BETA, G, WV, WK, BQ, KOUT, LAST, P, T,
    N, F, DV,
    C: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk's local solution. Writes W_v (R, N, Dv), W_k, Q ⊙ e^G, K ⊙ e^{G_C − G} (R, N, F), e^{G_C}
    (R, N/C, F), P and T (R, N, C: row t of the chunk's C×C matrix at token t), all fp32."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = N // C
    t = tl.arange(0, C)
    block = tl.arange(0, BK)
    tokens = chunk * C + t
    beta = tl.load(BETA + row * N + tokens)
    pairs = (t[:, None] >= t[None, :])[:, :, None]  # (C, C, 1): j ≤ t
    system = tl.zeros((C, C), dtype=tl.float32)
    scores = tl.zeros((C, C), dtype=tl.float32)
    for start in range(0, F, BK):
        f = start + block
        fm = (f < F)[None, :]
        offsets = row * N * F + tokens[:, None] * F + f[None, :]
        q = tl.load(Q + offsets, mask=fm, other=0.0).to(tl.float32)
        k = tl.load(K + offsets, mask=fm, other=0.0).to(tl.float32)
        cum = _chunk_cumsum(G, offsets, fm)
        # e^{G_t − G_j} (C, C, BK), the exponent ≤ 0 where j ≤ t, −∞ above the diagonal
        exponent = tl.minimum(cum[:, None, :] - cum[None, :, :], 0.0)
        keyed = k[None, :, :] * tl.exp(tl.where(pairs, exponent, float("-inf")))
        system += tl.sum(k[:, None, :] * keyed, axis=2)
        scores += tl.sum(q[:, None, :] * keyed, axis=2)
    system = tl.where(t[:, None] > t[None, :], system * beta[:, None], 0.0)  # A
    inverse = _unit_lower_inverse(system, t, C)  # T
    pair_offsets = row * N * C + tokens[:, None] * C + t[None, :]
    tl.store(P + pair_offsets, scores)
    tl.store(T + pair_offsets, inverse)
    last_row = t == C - 1
    for start in range(0, F, BK):
        f = start + block
        fm = (f < F)[None, :]
        offsets = row * N * F + tokens[:, None] * F + f[None, :]
        q = tl.load(Q + offsets, mask=fm, other=0.0).to(tl.float32)
        k = tl.load(K + offsets, mask=fm, other=0.0).to(tl.float32)
        cum = _chunk_cumsum(G, offsets, fm)
        total = tl.sum(tl.where(last_row[:, None], cum, 0.0), axis=0)  # G_C (BK,)
        entered = tl.exp(tl.minimum(cum, 0.0))
        w_k = tl.dot(inverse, k * entered * beta[:, None], input_precision=PRECISION)
        tl.store(WK + offsets, w_k, mask=fm)
        tl.store(BQ + offsets, q * entered, mask=fm)
        tl.store(KOUT + offsets, k * tl.exp(tl.minimum(total[None, :] - cum, 0.0)), mask=fm)
        tl.store(LAST + (row * num_chunks + chunk) * F + f, tl.exp(tl.minimum(total, 0.0)), mask=f < F)
    for start in range(0, DV, BK):
        dv = start + block
        vm = (dv < DV)[None, :]
        offsets = row * N * DV + tokens[:, None] * DV + dv[None, :]
        v = tl.load(V + offsets, mask=vm, other=0.0).to(tl.float32)
        tl.store(WV + offsets, tl.dot(inverse, v * beta[:, None], input_precision=PRECISION), mask=vm)


@triton.jit
def kda_forward_kernel(
    WK, WU, BQ, KOUT, LAST, P, S0, O, SN, STATES,
    N, F, DV,
    C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The state sweep for values [vb·BV, vb·BV + BV) from the local kernel's tensors; WU holds W_v on entry and
    U on return (each program its own columns)."""
    row = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    t = tl.arange(0, C)
    f = tl.arange(0, BF)
    dv = vb * BV + tl.arange(0, BV)
    fm, vm = f < F, dv < DV
    fv_mask = fm[:, None] & vm[None, :]
    state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
    num_chunks = N // C
    for chunk in range(0, num_chunks):
        tokens = chunk * C + t
        features = row * N * F + tokens[:, None] * F + f[None, :]
        values = row * N * DV + tokens[:, None] * DV + dv[None, :]
        w_k = tl.load(WK + features, mask=fm[None, :], other=0.0)
        bq = tl.load(BQ + features, mask=fm[None, :], other=0.0)
        k_out = tl.load(KOUT + features, mask=fm[None, :], other=0.0)
        scores = tl.load(P + row * N * C + tokens[:, None] * C + t[None, :])
        last = tl.load(LAST + (row * num_chunks + chunk) * F + f, mask=fm, other=0.0)
        if SAVE:
            tl.store(STATES + (row * num_chunks + chunk) * F * DV + f[:, None] * DV + dv[None, :], state,
                     mask=fv_mask)
        written = tl.load(WU + values, mask=vm[None, :], other=0.0) - tl.dot(w_k, state, input_precision=PRECISION)
        out = tl.dot(bq, state, input_precision=PRECISION) + tl.dot(scores, written, input_precision=PRECISION)
        tl.store(O + values, out.to(O.dtype.element_ty), mask=vm[None, :])
        if SAVE:
            tl.store(WU + values, written, mask=vm[None, :])
        state = last[:, None] * state + tl.dot(tl.trans(k_out), written, input_precision=PRECISION)
    tl.store(SN + row * F * DV + f[:, None] * DV + dv[None, :], state, mask=fv_mask)
