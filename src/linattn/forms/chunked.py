"""Chunked forms: causal chunkwise-parallel, and non-causal with bounded memory.

Causal (Nq = Nk = N, chunk C, n = ⌈N/C⌉ chunks): inside a chunk the masked C×C block is computed exactly; across
chunks a running state S_c = Σ_{chunks < c} φ(K)ᵀV carries the past. Extra memory O(n·F·Dv + N·C).

Non-causal: keys are turned into features one chunk at a time and folded into S, then queries read S chunk by
chunk, so extra memory is O(C·F + F·Dv) whatever N.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..state import LinearAttentionState
from ._common import NEG_INF, finalize, scale_between, state_contribution

KeyFeatures = Callable[[int, int], tuple[torch.Tensor, "torch.Tensor | None"]]
QueryFeatures = Callable[[int, int], torch.Tensor]


def _pad_to_chunks(x: torch.Tensor, chunks: int, size: int) -> torch.Tensor:
    """(..., N, D) → (..., n, C, D), zero-padded at the end."""
    pad = chunks * size - x.shape[-2]
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], chunks, size, x.shape[-1])


def causal_chunked_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    ref: torch.Tensor | None,
    state: LinearAttentionState | None,
    chunk_size: int,
    normalize: bool,
    eps: float,
    min_denom: float | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    n_tokens = qf.shape[-2]
    size = min(chunk_size, n_tokens)
    chunks = -(-n_tokens // size)
    q = _pad_to_chunks(qf, chunks, size)  # (..., n, C, F)
    k = _pad_to_chunks(kf, chunks, size)  # (..., n, C, F)
    vc = _pad_to_chunks(v, chunks, size)  # (..., n, C, Dv)
    keep = torch.ones(size, size, dtype=torch.bool, device=qf.device).tril()

    # intra-chunk: the masked C×C block
    weights = q @ k.transpose(-1, -2)  # (..., n, C, C)
    if ref is not None:
        pad = chunks * size - n_tokens
        # padded keys are zero, so any scale serves; repeating the last keeps ref non-decreasing
        r = torch.cat([ref, ref[..., -1:].expand(*ref.shape[:-1], pad)], dim=-1) if pad else ref
        r = r.reshape(*ref.shape[:-1], chunks, size)  # (..., n, C)
        weights = weights * scale_between(r.unsqueeze(-2), r.unsqueeze(-1), keep)
        r_end = r[..., -1]  # (..., n): the scale each chunk's summary is stored at
        k = k * scale_between(r, r_end.unsqueeze(-1)).unsqueeze(-1)
    else:
        weights = weights.masked_fill(~keep, 0)
    num = weights @ vc  # (..., n, C, Dv)
    den = weights.sum(-1)  # (..., n, C)

    # inter-chunk: the state entering each chunk
    chunk_kv = k.transpose(-1, -2) @ vc  # (..., n, F, Dv)
    chunk_k_sum = k.sum(-2)  # (..., n, F)
    batch = qf.shape[:-2]
    if state is None:
        kv0 = qf.new_zeros(*batch, kf.shape[-1], v.shape[-1])
        k_sum0 = qf.new_zeros(*batch, kf.shape[-1])
        shift0 = qf.new_full(batch, NEG_INF)
        seen = 0
    else:
        kv0, k_sum0, shift0, seen = state.kv, state.k_sum, state.shift, state.num_tokens
    if ref is None:
        kv_total = kv0.unsqueeze(-3) + chunk_kv.cumsum(-3)  # (..., n, F, Dv): state after each chunk
        k_sum_total = k_sum0.unsqueeze(-2) + chunk_k_sum.cumsum(-2)
        kv_before = torch.cat([kv0.unsqueeze(-3), kv_total[..., :-1, :, :]], dim=-3)
        k_sum_before = torch.cat([k_sum0.unsqueeze(-2), k_sum_total[..., :-1, :]], dim=-2)
        final = LinearAttentionState(
            kv_total[..., -1, :, :], k_sum_total[..., -1, :], torch.zeros_like(shift0), seen + n_tokens
        )
        inter = LinearAttentionState(kv_before, k_sum_before, shift0, 0)
        inter_num, inter_den = state_contribution(q, inter, None)
    else:
        # a scan: each step moves the running sums to the next chunk's scale (all factors ≤ 1)
        kv, k_sum, shift = kv0, k_sum0, shift0
        before_kv, before_k_sum, before_shift = [], [], []
        for c in range(chunks):
            before_kv.append(kv)
            before_k_sum.append(k_sum)
            before_shift.append(shift)
            carry = scale_between(shift, r_end[..., c])
            kv = kv * carry[..., None, None] + chunk_kv[..., c, :, :]
            k_sum = k_sum * carry[..., None] + chunk_k_sum[..., c, :]
            shift = r_end[..., c]
        final = LinearAttentionState(kv, k_sum, shift, seen + n_tokens)
        inter = LinearAttentionState(
            torch.stack(before_kv, -3), torch.stack(before_k_sum, -2), torch.stack(before_shift, -1), 0
        )
        inter_num, inter_den = state_contribution(q, inter, r)
    num = (num + inter_num).reshape(*batch, chunks * size, -1)[..., :n_tokens, :]
    den = (den + inter_den).reshape(*batch, chunks * size)[..., :n_tokens]
    # normalise after dropping the padded rows, whose 0/0 would poison the gradient
    return finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom), final


def noncausal_chunked_attention(
    query_features: QueryFeatures,
    key_features: KeyFeatures,
    v: torch.Tensor,
    *,
    num_queries: int,
    state: LinearAttentionState,
    log_space: bool,
    chunk_size: int,
    normalize: bool,
    eps: float,
    min_denom: float | None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``key_features(start, end)`` gives the (masked) features of keys [start, end) and, for log-space maps,
    the log-scale (..., 1) they are stored at; ``state`` is the carried-in (or empty) state."""
    kv, k_sum, shift = state.kv, state.k_sum, state.shift
    num_keys = v.shape[-2]
    for start in range(0, num_keys, chunk_size):
        end = min(start + chunk_size, num_keys)
        kf, chunk_ref = key_features(start, end)  # (..., C, F)
        if log_space:
            assert chunk_ref is not None
            new_shift = torch.maximum(shift, chunk_ref.squeeze(-1))
            carry = scale_between(shift, new_shift)
            kv = kv * carry[..., None, None]
            k_sum = k_sum * carry[..., None]
            kf = kf * scale_between(chunk_ref, new_shift.unsqueeze(-1)).unsqueeze(-1)
            shift = new_shift
        kv = kv + kf.transpose(-1, -2) @ v[..., start:end, :]
        k_sum = k_sum + kf.sum(-2)
    outs = []
    for start in range(0, num_queries, chunk_size):
        qf = query_features(start, min(start + chunk_size, num_queries))  # (..., C, F)
        num = qf @ kv
        den = (qf @ k_sum.unsqueeze(-1)).squeeze(-1)
        outs.append(finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom))
    if not log_space:
        shift = torch.zeros_like(shift)
    return torch.cat(outs, dim=-2), LinearAttentionState(kv, k_sum, shift, state.num_tokens + num_keys)
