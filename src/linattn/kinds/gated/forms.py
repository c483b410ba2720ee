"""Per-feature gates (GLA): S_t = diag(a_t)·S_{t−1} + φ(k_t)v_tᵀ, z_t likewise, a_t = e^{g_t} ∈ (0, 1]^F.

A per-feature decay cannot be pulled out of the dot product q·k, so it is no change of one scalar log-scale: each
feature f has its own log-scale R_tf = r_t − G_tf (r: the log-space running maximum or 0; G = Σ_{i≤t} g_i, fp64),
non-decreasing in t, and query t weighs key j ≤ t by Σ_f Q_tf K_jf e^{R_jf − R_tf}. Every factor is e^{(≤ 0)}.

Three forms:
- :func:`gated_parallel_attention`: the quadratic definition with an explicit (N, N, F) tensor (reference, tiny N);
- :func:`gated_recurrent_attention`: token by token, the state rescaled per feature;
- :func:`gated_chunked_attention`: blocks of chunks under activation checkpointing. Each block forms its own R in
  fp64 from its gates and the sum of the gates before it, re-based to each chunk's end before the cast to fp32
  (only local differences reach fp32). Within a chunk the weights are one GEMM when the gate span allows, else
  sub-chunks (:func:`_intra_weights`); the states entering the chunks come from a scan, every step a factor ≤ 1.
  Training memory: the inputs, the gate's gradient, the outputs and one block's work space, O(N·(F + Dv)) +
  O(L·C·F); no (N, F) fp64 tensor.

The returned state follows :mod:`linattn.kinds.additive.forms._common` (decays as a change of log-scale): sums stored
at R_N,f = r_N − G_N,f are the decayed sums at scale r_N, so ``shift`` is r_N, its usual meaning; an initial state at
shift s_0 enters at scale s_0 in every feature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...features import finite
from ...state import LinearAttentionState
from ..additive.forms._common import NEG_INF, finalize, scale_between

# tokens per checkpointed block: the scan over its chunks is short, its work space small
GATED_BLOCK_TOKENS = 256
# the largest per-feature log-decay within one chunk that the GEMM path of _intra_weights takes (e^{±30} factors)
GEMM_SPAN = 60.0
# sub-chunk length of the path for larger spans: its explicit factors cost O(C·SUB_CHUNK·F) per chunk
SUB_CHUNK = 8


def gated_parallel_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    scales: torch.Tensor,
    state: LinearAttentionState | None,
    normalize: bool,
    eps: float,
    min_denom: float | None,
    want_state: bool,
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    n = qf.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=qf.device).tril().unsqueeze(-1)  # (Nq, Nk, 1)
    factor = scale_between(scales.unsqueeze(-3), scales.unsqueeze(-2), keep).to(qf.dtype)  # (..., Nq, Nk, F)
    weights = (qf.unsqueeze(-2) * kf.unsqueeze(-3) * factor).sum(-1)  # (..., Nq, Nk)
    num, den = weights @ v, weights.sum(-1)
    if state is not None:
        carry = scale_between(state.shift.to(scales.dtype)[..., None, None], scales).to(qf.dtype)  # (..., Nq, F)
        num = num + (qf * carry) @ state.kv
        den = den + ((qf * carry) * state.k_sum.unsqueeze(-2)).sum(-1)
    out = finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom)
    if not want_state:
        return out, None
    last = scales[..., -1, :]  # (..., F)
    keys = kf * scale_between(scales, last.unsqueeze(-2)).to(kf.dtype)
    kv, k_sum = keys.transpose(-1, -2) @ v, keys.sum(-2)
    if state is not None:
        carry_out = scale_between(state.shift.to(scales.dtype).unsqueeze(-1), last).to(kf.dtype)  # (..., F)
        kv = kv + carry_out.unsqueeze(-1) * state.kv
        k_sum = k_sum + carry_out * state.k_sum
    seen = n + (state.num_tokens if state is not None else 0)
    return out, LinearAttentionState(kv, k_sum, torch.zeros_like(kv[..., 0, 0]), seen)


def gated_recurrent_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    scales: torch.Tensor,
    state: LinearAttentionState | None,
    normalize: bool,
    eps: float,
    min_denom: float | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    batch, features = qf.shape[:-2], kf.shape[-1]
    if state is not None:
        kv, k_sum, seen = state.kv, state.k_sum, state.num_tokens
        current = state.shift.to(scales.dtype).unsqueeze(-1).expand(*batch, features)
    else:
        kv, k_sum, seen = qf.new_zeros(*batch, features, v.shape[-1]), qf.new_zeros(*batch, features), 0
        current = scales.new_full((*batch, features), NEG_INF)
    outs = []
    for t in range(qf.shape[-2]):
        carry = scale_between(current, scales[..., t, :]).to(kv.dtype)  # (..., F): a_t and the log-space rescale
        current = scales[..., t, :]
        kv = carry.unsqueeze(-1) * kv + kf[..., t, :, None] * v[..., t, None, :]
        k_sum = carry * k_sum + kf[..., t, :]
        q_t = qf[..., t, :]
        num = (q_t.unsqueeze(-2) @ kv).squeeze(-2)  # (..., Dv)
        outs.append(finalize(num, (q_t * k_sum).sum(-1), normalize=normalize, eps=eps, min_denom=min_denom))
    out = torch.stack(outs, dim=-2)
    return out, LinearAttentionState(kv, k_sum, torch.zeros_like(kv[..., 0, 0]), seen + qf.shape[-2])


def _chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(..., L, D) → (..., L/C, C, D), zero-padding L to whole chunks."""
    pad = -x.shape[-2] % size
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], -1, size, x.shape[-1])


def _intra_weights(qc: torch.Tensor, kc: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """W_tj = Σ_f Q_tf K_jf e^{L_jf − L_tf} for j ≤ t within each chunk (..., b, C, C); L = ``local`` ≤ 0, 0 at
    the chunk's end.

    When every chunk's per-feature span −L_0f is at most GEMM_SPAN, the factor splits at the span's midpoint M into
    e^{M − L_t}·e^{L_j − M}, each within e^{±GEMM_SPAN/2}: one GEMM of rescaled queries and keys, no overflow and
    no subnormal (fp32 keeps normal numbers down to e^−87). Otherwise (gates near −30) :func:`_split_weights`.
    """
    size = qc.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=qc.device).tril()  # (C_t, C_j)
    span = -local[..., 0, :]  # (..., b, F) ≥ 0; inf where the chunk starts at an empty (-inf) scale
    if bool((span <= GEMM_SPAN).all()):
        middle = local[..., :1, :] / 2  # (..., b, 1, F)
        queries = qc * torch.exp(middle - local)
        keys = kc * torch.exp(local - middle)
        return (queries @ keys.transpose(-1, -2)).masked_fill(~causal, 0)
    return _split_weights(qc, kc, local)


def _explicit_weights(qc: torch.Tensor, kc: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Causal W_tj with the c×c×F factors e^{L_jf − L_tf} formed one by one, every one e^{(≤ 0)}."""
    size = qc.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=qc.device).tril().unsqueeze(-1)  # (c_t, c_j, 1)
    factor = scale_between(local.unsqueeze(-3), local.unsqueeze(-2), causal)  # (..., c, c, F)
    return ((qc.unsqueeze(-2) * factor) * kc.unsqueeze(-3)).sum(-1)


def _split_weights(qc: torch.Tensor, kc: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Causal W_tj for any gates: sub-chunks of SUB_CHUNK tokens. Queries of sub-chunk s meet the keys of the
    earlier sub-chunks in one GEMM split at M_s = L at the first token of s: L_j ≤ M_s ≤ L_t, so both e^{M_s − L_t}
    and e^{L_j − M_s} are ≤ 1 (overflow-free; a factor small enough to lose digits makes its term smaller still).
    Within a sub-chunk the c×c×F factors are explicit."""
    size = qc.shape[-2]
    sub = min(SUB_CHUNK, size)
    rows = []
    for start in range(0, size, sub):
        end = min(start + sub, size)
        q_s, k_s, local_s = qc[..., start:end, :], kc[..., start:end, :], local[..., start:end, :]
        pieces = []
        if start > 0:
            split = local[..., start : start + 1, :]  # (..., b, 1, F): M_s
            queries = q_s * scale_between(split, local_s)
            keys = kc[..., :start, :] * scale_between(local[..., :start, :], split)
            pieces.append(queries @ keys.transpose(-1, -2))  # (..., b, c, start)
        pieces.append(_explicit_weights(q_s, k_s, local_s))  # (..., b, c, c)
        if end < size:
            pieces.append(q_s.new_zeros(*q_s.shape[:-1], size - end))
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows, dim=-2)  # (..., b, C, C)


def _block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    ref: torch.Tensor | None,
    offset: torch.Tensor,
    kv_in: torch.Tensor,
    z_in: torch.Tensor,
    scale_in: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block (L tokens): num (..., L, Dv), den (..., L), and the state (kv, z) leaving it at the block's last
    scale. The block's scales R = ref − (offset + Σ gate) are formed here in fp64 from its own gates and the gates'
    sum before it (``offset`` (..., F)), so no (N, F) fp64 tensor lives beyond one block. Plain differentiable
    torch code: checkpointed by the caller."""
    scales = -(offset.unsqueeze(-2) + torch.cumsum(gate.to(torch.float64), dim=-2))  # (..., L, F)
    if ref is not None:
        scales = scales + ref.unsqueeze(-1)
    length = q.shape[-2]
    pad = -length % size
    if pad:  # padded keys are zero; repeating the last scale keeps R non-decreasing
        scales = torch.cat([scales, scales[..., -1:, :].expand(*scales.shape[:-2], pad, scales.shape[-1])], -2)
    qc, kc, vc = _chunks(q, size), _chunks(k, size), _chunks(v, size)  # (..., b, C, F|Dv)
    r = scales.reshape(*scales.shape[:-2], -1, size, scales.shape[-1])  # (..., b, C, F) fp64
    chunks, dtype = qc.shape[-3], q.dtype
    ends = r[..., -1, :]  # (..., b, F): the scale each chunk's update is stored at
    entering = torch.cat([scale_in.unsqueeze(-2), ends[..., :-1, :]], dim=-2)  # (..., b, F)
    base = finite(ends)
    local = (r - base.unsqueeze(-2)).to(dtype)  # (..., b, C, F) ≤ 0: only local differences reach fp32
    entry = (entering - base).to(dtype).unsqueeze(-2)  # (..., b, 1, F)
    weights = _intra_weights(qc, kc, local)  # (..., b, C, C)
    keys = kc * torch.exp(local)  # (..., b, C, F) at the chunk's end scale
    values = torch.cat([vc, torch.ones_like(vc[..., :1])], dim=-1)  # (..., b, C, Dv+1): a ones column for z
    updates = keys.transpose(-1, -2) @ values  # (..., b, F, Dv+1): [Σ K vᵀ, Σ K]
    # the states entering each chunk, by a scan over the block's b chunks: every factor e^{s_c − e_c} ≤ 1, so
    # exact and overflow-free whatever the gates (b is small: the block is a few hundred tokens)
    steps = scale_between(entering, ends).to(dtype).unsqueeze(-1)  # (..., b, F, 1): chunk c's own decay
    state = torch.cat([kv_in, z_in.unsqueeze(-1)], dim=-1)  # (..., F, Dv+1)
    enter = []
    for c in range(chunks):
        enter.append(state)
        state = steps[..., c, :, :] * state + updates[..., c, :, :]
    states = torch.stack(enter, dim=-3)  # (..., b, F, Dv+1)
    reading = qc * scale_between(entry, local)  # (..., b, C, F): query t reads the entering state at R_t
    inter = reading @ states  # (..., b, C, Dv+1)
    num = weights @ vc + inter[..., :-1]  # (..., b, C, Dv)
    den = weights.sum(-1) + inter[..., -1]  # (..., b, C)
    kv_out, z_out = state[..., :-1], state[..., -1]
    num = num.reshape(*num.shape[:-3], -1, num.shape[-1])[..., :length, :]
    den = den.reshape(*den.shape[:-2], -1)[..., :length]
    return num, den, kv_out, z_out


def gated_chunked_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    gate: torch.Tensor,
    ref: torch.Tensor | None,
    state: LinearAttentionState | None,
    chunk_size: int,
    normalize: bool,
    eps: float,
    min_denom: float | None,
    block_tokens: int | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``gate`` g (..., N, F) ≤ 0 in any float dtype, ``ref`` the per-token scale r − G (..., N) fp64 or None: the
    scales are R = ref − cumsum(g), formed block by block (see the module docstring)."""
    n, batch, features = qf.shape[-2], qf.shape[:-2], kf.shape[-1]
    size = min(chunk_size, n)
    block = max(size, (block_tokens or GATED_BLOCK_TOKENS) // size * size)
    if state is not None:
        kv, k_sum, seen = state.kv, state.k_sum, state.num_tokens
        scale = state.shift.to(torch.float64).unsqueeze(-1).expand(*batch, features)
    else:
        kv, k_sum, seen = qf.new_zeros(*batch, features, v.shape[-1]), qf.new_zeros(*batch, features), 0
        scale = torch.full((*batch, features), NEG_INF, dtype=torch.float64, device=qf.device)
    offset = torch.zeros((*batch, features), dtype=torch.float64, device=qf.device)  # Σ of the earlier gates
    tensors = [qf, kf, v, gate, ref] if ref is not None else [qf, kf, v, gate]
    track = torch.is_grad_enabled() and any(x.requires_grad for x in (*tensors, kv, k_sum))
    pieces = []
    # split once: a slice per block would cost a whole-input zero gradient per block in backward, O(N²/L) work
    splits = [x.split(block, dim=-2 if x.dim() == qf.dim() else -1) for x in tensors]
    for index in range(len(splits[0])):
        q_b, k_b, v_b, g_b = (part[index] for part in splits[:4])
        r_b = splits[4][index] if ref is not None else None
        if track:  # recompute the block's C×C×F work space in backward instead of keeping it for all blocks
            result = checkpoint(_block, q_b, k_b, v_b, g_b, r_b, offset, kv, k_sum, scale, size, use_reentrant=False)
        else:
            result = _block(q_b, k_b, v_b, g_b, r_b, offset, kv, k_sum, scale, size)
        num, den, kv, k_sum = result
        offset = offset + g_b.to(torch.float64).sum(-2)
        scale = -offset if r_b is None else r_b[..., -1:] - offset  # (..., F): where the leaving state is stored
        pieces.append(finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom))
    out = torch.cat(pieces, dim=-2)
    return out, LinearAttentionState(kv, k_sum, torch.zeros_like(kv[..., 0, 0]), seen + n)
