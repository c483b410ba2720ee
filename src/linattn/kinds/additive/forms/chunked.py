"""Chunked forms: causal chunkwise-parallel, and non-causal with bounded memory.

Causal (Nq = Nk = N, chunk C): inside a chunk the masked C×C block is computed exactly; across chunks a running
state S_c = Σ_{chunks < c} φ(K)ᵀV carries the past. The work runs in :mod:`.causal_fn`, a custom autograd Function
that processes a few thousand tokens at a time and recomputes in backward: training memory O(N·(F+Dv)).

Non-causal: keys are turned into features one chunk at a time and folded into S, then queries read S chunk by
chunk, so extra memory is O(C·F + F·Dv) whatever N.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ....state import LinearAttentionState
from . import causal_fn
from ._common import NEG_INF, finalize, scale_between

KeyFeatures = Callable[[int, int], tuple[torch.Tensor, "torch.Tensor | None"]]
QueryFeatures = Callable[[int, int], torch.Tensor]


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
    block_tokens: int | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal chunkwise-parallel attention through :class:`CausalChunkedFunction` (backward recomputes).

    ``block_tokens`` (default :func:`causal_fn.block_tokens`; rounded to whole chunks) bounds the work space.
    """
    n_tokens = qf.shape[-2]
    size = min(chunk_size, n_tokens)
    batch = qf.shape[:-2]
    if block_tokens is None:
        block_tokens = causal_fn.block_tokens(batch.numel(), kf.shape[-1], v.shape[-1], size)
    block = max(size, block_tokens // size * size)
    if state is None:
        merged = qf.new_zeros(*batch, kf.shape[-1], v.shape[-1] + 1)  # (..., F, Dv+1): [kv, k_sum]
        shift0 = qf.new_full(batch, NEG_INF)
        seen = 0
    else:
        merged = torch.cat([state.kv, state.k_sum.unsqueeze(-1)], dim=-1)
        shift0, seen = state.shift, state.num_tokens
    scale0 = shift0 if ref is not None else None
    out, kv, k_sum = causal_fn.CausalChunkedFunction.apply(
        qf, kf, v, ref, merged, scale0, size, block, normalize, eps, min_denom
    )
    shift = ref[..., -1] if ref is not None else torch.zeros_like(shift0)
    return out, LinearAttentionState(kv, k_sum, shift, seen + n_tokens)


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
    # split, not sliced one by one: a slice's backward writes into a zero tensor of the whole input, O(N²/C) work
    value_chunks = v.split(chunk_size, dim=-2)
    for index, start in enumerate(range(0, num_keys, chunk_size)):
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
        kv = kv + kf.transpose(-1, -2) @ value_chunks[index]
        k_sum = k_sum + kf.sum(-2)
    # Inference writes each chunk into one output buffer, so the output is never held twice. With autograd the
    # pieces are concatenated once instead: slice writes would pass the whole output's gradient through every
    # slice in backward, O(N²/C) work.
    track = torch.is_grad_enabled() and (v.requires_grad or kv.requires_grad)
    out = None if track else v.new_empty(*v.shape[:-2], num_queries, v.shape[-1])
    pieces = []
    for start in range(0, num_queries, chunk_size):
        end = min(start + chunk_size, num_queries)
        qf = query_features(start, end)  # (..., C, F)
        num = qf @ kv
        den = (qf @ k_sum.unsqueeze(-1)).squeeze(-1)
        piece = finalize(num, den, normalize=normalize, eps=eps, min_denom=min_denom)
        if out is None:
            pieces.append(piece)
        else:
            out[..., start:end, :] = piece
    if out is None:
        out = torch.cat(pieces, dim=-2)
    if not log_space:
        shift = torch.zeros_like(shift)
    return out, LinearAttentionState(kv, k_sum, shift, state.num_tokens + num_keys)
