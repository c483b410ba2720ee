"""Triton kernels for causal linear attention on precomputed features (ordinary, non-log-space maps).

Rows are flattened batch×heads, each contiguous: Q, K (R, N, F), V, O (R, N, Dv), state S (R, F, Dv) and z (R, F)
in fp32. Chunk C = 64 tokens; F and Dv are padded to powers of two (BF, BV ≥ 16) by masked loads, tails of N too.
Each program walks its row's chunks in order, holding its slice of the state in fp32 registers:

    forward   grid (R, Dv/BV):  o_c = ((Q_c K_cᵀ) ⊙ M) V_c + Q_c S_c,  den_c = ((Q_c K_cᵀ) ⊙ M) 1 + Q_c z_c,
                                S_{c+1} = S_c + K_cᵀ V_c,  z_{c+1} = z_c + K_cᵀ 1          (M: causal mask, j ≤ t)
    dQ        grid (R, F/BK):   walks forward, rebuilding S_c (no state is stored between forward and backward)
    dK        grid (R, F/BK):   walks backward with dS_c = Σ_{later chunks} Q_tᵀ dO_t (+ ∂L/∂S_final)
    dV        grid (R, Dv/BV):  walks backward likewise
    decode    grid (R,):        token by token, S ← S + k vᵀ, o = q·S / (q·z + eps), value blocks in turn
                                (in place allowed)
    prep      grid (R·N/BT,):   ∂L/∂num and ∂L/∂den from ∂L/∂out, the divisor and the output (backward)

The normaliser enters the backward as an extra value column of ones: ∂L/∂den_t (GD) plays the role of dO_t for it.
dO given to the backward kernels is ∂L/∂num = ∂L/∂o / divisor, formed by the caller with GD.
ELU (a constexpr of every kernel): Q and K hold the raw projections and the kernels make the elu + 1 features as they
load them, and take dQ, dK through elu + 1 when they store them (no feature tensor is ever written).
Products take the input dtype (bf16/fp16: tensor cores; fp32: IEEE unless TF32 is asked for) and accumulate in fp32.
Only APIs present in Triton 3.6 are used (the GPU image has 3.6; the development machines 3.9).
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _divisor(den, eps, min_denom, HAS_MIN: tl.constexpr):
    """den + eps, clamped at min_denom, 1 where exactly 0 (as forms/_common.finalize)."""
    d = den + eps
    if HAS_MIN:
        d = tl.maximum(d, min_denom)
    return tl.where(d == 0.0, 1.0, d)


@triton.jit
def _elu_plus_one(x):
    """elu(x) + 1 in fp32 as EluFeatureMap computes it: exp(min(x, 0)) + max(x, 0), the exponential floored at fp32's
    smallest normal."""
    xf = x.to(tl.float32)
    return tl.maximum(tl.exp(tl.minimum(xf, 0.0)), 1.1754943508222875e-38) + tl.maximum(xf, 0.0)


@triton.jit
def _elu_features(x, mask):
    """elu(x) + 1 of a tile of raw projections, 0 outside ``mask``, rounded once to x's dtype."""
    return tl.where(mask, _elu_plus_one(x), 0.0).to(x.dtype)


@triton.jit
def _elu_slope(x):
    """d(elu(x) + 1)/dx = min(elu(x) + 1, 1), in fp32 (EluFeatureMap's backward)."""
    return tl.minimum(_elu_plus_one(x), 1.0)


@triton.jit
def _state_dot(a, b, STATE_PRECISION: tl.constexpr):
    """A product with a running state or its gradient: fp32 operands (the sums outgrow fp16's range), TF32 tensor
    cores unless IEEE is asked for."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=STATE_PRECISION)


@triton.jit
def chunk_forward_kernel(
    Q, K, V, S0, Z0, O, D, SN, ZN,
    N, F, DV, eps, min_denom,
    C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_MIN: tl.constexpr, PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr,
    ELU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    t = tl.arange(0, C)
    f = tl.arange(0, BF)
    dv = vb * BV + tl.arange(0, BV)
    fm, vm = f < F, dv < DV
    causal = t[:, None] >= t[None, :]
    q_base, v_base = Q + row * N * F, V + row * N * DV
    k_base = K + row * N * F
    # the state slice S[:, dv] and z, in fp32
    state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fm[:, None] & vm[None, :], other=0.0)
    k_sum = tl.load(Z0 + row * F + f, mask=fm, other=0.0)
    for start in range(0, N, C):
        tm = start + t < N
        qk_mask = tm[:, None] & fm[None, :]
        q = tl.load(q_base + (start + t)[:, None] * F + f[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_base + (start + t)[:, None] * F + f[None, :], mask=qk_mask, other=0.0)
        if ELU:
            q, k = _elu_features(q, qk_mask), _elu_features(k, qk_mask)
        v = tl.load(v_base + (start + t)[:, None] * DV + dv[None, :], mask=tm[:, None] & vm[None, :], other=0.0)
        w = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (C, C) fp32
        w = tl.where(causal, w, 0.0)
        num = tl.dot(w.to(q.dtype), v, input_precision=PRECISION)
        num += _state_dot(q, state, STATE_PRECISION)
        if NORMALIZE:
            den = tl.sum(w, axis=1) + tl.sum(q.to(tl.float32) * k_sum[None, :], axis=1)  # (C,)
            num = num / _divisor(den, eps, min_denom, HAS_MIN)[:, None]
            if vb == 0:
                tl.store(D + row * N + start + t, den + eps, mask=tm)
        tl.store(O + row * N * DV + (start + t)[:, None] * DV + dv[None, :], num.to(O.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)
        k_sum += tl.sum(k.to(tl.float32), axis=0)
    tl.store(SN + row * F * DV + f[:, None] * DV + dv[None, :], state, mask=fm[:, None] & vm[None, :])
    if vb == 0:
        tl.store(ZN + row * F + f, k_sum, mask=fm)


@triton.jit
def chunk_dq_kernel(
    DO, GD, Q, K, V, S0, Z0, DQ,
    N, F, DV,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr, ELU: tl.constexpr,
):
    """dQ_c = ((dO_c V_cᵀ + GD_c 1ᵀ) ⊙ M) K_c + dO_c S_cᵀ + GD_c z_cᵀ, for features [fb·BK, fb·BK + BK).
    ELU: K holds raw keys (features made on load) and dQ is taken through elu + 1 of the raw Q."""
    row = tl.program_id(0).to(tl.int64)
    fb = tl.program_id(1)
    t = tl.arange(0, C)
    f = fb * BK + tl.arange(0, BK)
    dv = tl.arange(0, BVF)
    fm, vm = f < F, dv < DV
    causal = t[:, None] >= t[None, :]
    state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fm[:, None] & vm[None, :], other=0.0)
    k_sum = tl.load(Z0 + row * F + f, mask=fm, other=0.0)
    for start in range(0, N, C):
        tm = start + t < N
        tf_mask = tm[:, None] & fm[None, :]
        k = tl.load(K + row * N * F + (start + t)[:, None] * F + f[None, :], mask=tf_mask, other=0.0)
        if ELU:
            k = _elu_features(k, tf_mask)
        tv_mask = tm[:, None] & vm[None, :]
        v = tl.load(V + row * N * DV + (start + t)[:, None] * DV + dv[None, :], mask=tv_mask, other=0.0)
        do = tl.load(DO + row * N * DV + (start + t)[:, None] * DV + dv[None, :], mask=tv_mask, other=0.0)
        dw = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (C, C)
        if NORMALIZE:
            gd = tl.load(GD + row * N + start + t, mask=tm, other=0.0)
            dw += gd[:, None]
        dw = tl.where(causal, dw, 0.0)
        dq = tl.dot(dw.to(k.dtype), k, input_precision=PRECISION)
        dq += _state_dot(do, tl.trans(state), STATE_PRECISION)
        if NORMALIZE:
            dq += gd[:, None] * k_sum[None, :]
        if ELU:
            dq *= _elu_slope(tl.load(Q + row * N * F + (start + t)[:, None] * F + f[None, :], mask=tf_mask, other=0.0))
        tl.store(DQ + row * N * F + (start + t)[:, None] * F + f[None, :], dq.to(DQ.dtype.element_ty),
                 mask=tf_mask)
        state += tl.dot(tl.trans(k), v, input_precision=PRECISION)
        k_sum += tl.sum(k.to(tl.float32), axis=0)


@triton.jit
def chunk_dk_kernel(
    DO, GD, Q, K, V, DSN, DZN, DK, DS0, DZ0,
    N, F, DV,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr, ELU: tl.constexpr,
):
    """dK_c = ((dO_c V_cᵀ + GD_c 1ᵀ) ⊙ M)ᵀ Q_c + V_c dS_cᵀ + 1 dz_cᵀ, walking backward; writes ∂L/∂(S_0, z_0).
    ELU: Q holds raw queries (features made on load) and dK is taken through elu + 1 of the raw K."""
    row = tl.program_id(0).to(tl.int64)
    fb = tl.program_id(1)
    t = tl.arange(0, C)
    f = fb * BK + tl.arange(0, BK)
    dv = tl.arange(0, BVF)
    fm, vm = f < F, dv < DV
    causal = t[:, None] >= t[None, :]
    fv_mask = fm[:, None] & vm[None, :]
    d_state = tl.load(DSN + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
    d_sum = tl.load(DZN + row * F + f, mask=fm, other=0.0)
    num_chunks = tl.cdiv(N, C)
    for back in range(0, num_chunks):
        start = (num_chunks - 1 - back) * C
        tm = start + t < N
        tf_mask = tm[:, None] & fm[None, :]
        q = tl.load(Q + row * N * F + (start + t)[:, None] * F + f[None, :], mask=tf_mask, other=0.0)
        if ELU:
            q = _elu_features(q, tf_mask)
        tv_mask = tm[:, None] & vm[None, :]
        v = tl.load(V + row * N * DV + (start + t)[:, None] * DV + dv[None, :], mask=tv_mask, other=0.0)
        do = tl.load(DO + row * N * DV + (start + t)[:, None] * DV + dv[None, :], mask=tv_mask, other=0.0)
        dw = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (C, C): rows t (queries), columns j (keys)
        if NORMALIZE:
            gd = tl.load(GD + row * N + start + t, mask=tm, other=0.0)
            dw += gd[:, None]
        dw = tl.where(causal, dw, 0.0)
        dk = tl.dot(tl.trans(dw.to(q.dtype)), q, input_precision=PRECISION)
        dk += _state_dot(v, tl.trans(d_state), STATE_PRECISION)
        if NORMALIZE:
            dk += d_sum[None, :]  # every key of the chunk reaches z_{c+1}
        if ELU:
            dk *= _elu_slope(tl.load(K + row * N * F + (start + t)[:, None] * F + f[None, :], mask=tf_mask, other=0.0))
        tl.store(DK + row * N * F + (start + t)[:, None] * F + f[None, :], dk.to(DK.dtype.element_ty),
                 mask=tf_mask)
        d_state += tl.dot(tl.trans(q), do, input_precision=PRECISION)
        if NORMALIZE:
            d_sum += tl.sum(q.to(tl.float32) * gd[:, None], axis=0)
    tl.store(DS0 + row * F * DV + f[:, None] * DV + dv[None, :], d_state, mask=fv_mask)
    tl.store(DZ0 + row * F + f, d_sum, mask=fm)


@triton.jit
def chunk_dv_kernel(
    DO, Q, K, DSN, DV_OUT,
    N, F, DV,
    C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr,
    ELU: tl.constexpr,
):
    """dV_c = ((Q_c K_cᵀ) ⊙ M)ᵀ dO_c + K_c dS_c, walking backward, for values [vb·BV, vb·BV + BV).
    ELU: Q and K hold raw projections (features made on load)."""
    row = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    t = tl.arange(0, C)
    f = tl.arange(0, BF)
    dv = vb * BV + tl.arange(0, BV)
    fm, vm = f < F, dv < DV
    causal = t[:, None] >= t[None, :]
    d_state = tl.load(DSN + row * F * DV + f[:, None] * DV + dv[None, :], mask=fm[:, None] & vm[None, :], other=0.0)
    num_chunks = tl.cdiv(N, C)
    for back in range(0, num_chunks):
        start = (num_chunks - 1 - back) * C
        tm = start + t < N
        qk_mask = tm[:, None] & fm[None, :]
        q = tl.load(Q + row * N * F + (start + t)[:, None] * F + f[None, :], mask=qk_mask, other=0.0)
        k = tl.load(K + row * N * F + (start + t)[:, None] * F + f[None, :], mask=qk_mask, other=0.0)
        if ELU:
            q, k = _elu_features(q, qk_mask), _elu_features(k, qk_mask)
        do = tl.load(DO + row * N * DV + (start + t)[:, None] * DV + dv[None, :], mask=tm[:, None] & vm[None, :],
                     other=0.0)
        w = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        w = tl.where(causal, w, 0.0)
        dval = tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=PRECISION)
        dval += _state_dot(k, d_state, STATE_PRECISION)
        tl.store(DV_OUT + row * N * DV + (start + t)[:, None] * DV + dv[None, :], dval.to(DV_OUT.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        d_state += tl.dot(tl.trans(q), do, input_precision=PRECISION)


@triton.jit
def backward_prep_kernel(
    G, OUT, DEN, GNUM, GDEN,
    TOKENS, DV, min_denom,
    BT: tl.constexpr, BVF: tl.constexpr, HAS_MIN: tl.constexpr,
):
    """The backward's input from ∂L/∂out, in one pass over tokens [pid·BT, pid·BT + BT) of all rows (R·N of them):
    ∂L/∂num = g / d and ∂L/∂den = −(∂L/∂num)·out, 0 where d does not depend on den (den = 0 or below min_denom),
    with d the forward's divisor (DEN holds den + eps)."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    dv = tl.arange(0, BVF)
    tm = tok < TOKENS
    mask = tm[:, None] & (dv < DV)[None, :]
    den = tl.load(DEN + tok, mask=tm, other=1.0)
    constant = den == 0.0
    if HAS_MIN:
        constant = constant | (den < min_denom)
        den = tl.maximum(den, min_denom)
    div = tl.where(den == 0.0, 1.0, den)
    g = tl.load(G + tok[:, None] * DV + dv[None, :], mask=mask, other=0.0).to(tl.float32) / div[:, None]
    out = tl.load(OUT + tok[:, None] * DV + dv[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(GNUM + tok[:, None] * DV + dv[None, :], g.to(GNUM.dtype.element_ty), mask=mask)
    tl.store(GDEN + tok, tl.where(constant, 0.0, -tl.sum(g * out, axis=1)), mask=tm)


@triton.jit
def recurrent_kernel(
    Q, K, V, S0, Z0, O, SN, ZN,
    N, F, DV, eps, min_denom,
    BF: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr, HAS_MIN: tl.constexpr, ELU: tl.constexpr,
):
    """Decoding: S ← S + k_t v_tᵀ, z ← z + k_t, o_t = q_t·S / (q_t·z + eps), token by token, all in fp32.

    One program per row walks the value blocks in turn (each block: its state slice through all N tokens), so it
    alone reads and writes the row's S and z: SN may be S0 and ZN may be Z0 (the state updated in place).
    ELU: Q and K hold raw projections and the features are elu(x) + 1, applied here."""
    row = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BF)
    fm = f < F
    z0 = tl.load(Z0 + row * F + f, mask=fm, other=0.0)
    k_sum = z0
    for vstart in range(0, DV, BV):
        dv = vstart + tl.arange(0, BV)
        vm = dv < DV
        fv_mask = fm[:, None] & vm[None, :]
        state = tl.load(S0 + row * F * DV + f[:, None] * DV + dv[None, :], mask=fv_mask, other=0.0)
        k_sum = z0
        for step in range(0, N):
            q = tl.load(Q + (row * N + step) * F + f, mask=fm, other=0.0).to(tl.float32)
            k = tl.load(K + (row * N + step) * F + f, mask=fm, other=0.0).to(tl.float32)
            if ELU:
                q, k = _elu_features(q, fm), _elu_features(k, fm)
            v = tl.load(V + (row * N + step) * DV + dv, mask=vm, other=0.0).to(tl.float32)
            state += k[:, None] * v[None, :]
            k_sum += k
            num = tl.sum(q[:, None] * state, axis=0)  # (BV,)
            if NORMALIZE:
                num = num / _divisor(tl.sum(q * k_sum, axis=0), eps, min_denom, HAS_MIN)
            tl.store(O + (row * N + step) * DV + dv, num.to(O.dtype.element_ty), mask=vm)
        tl.store(SN + row * F * DV + f[:, None] * DV + dv[None, :], state, mask=fv_mask)
    tl.store(ZN + row * F + f, k_sum, mask=fm)
