"""The band's softmax average for inference on CPU, through torch's flash-attention kernel.

The layout is :class:`.fused.BandSoftmax`'s: query i sees rows i … i + B of the key sequence [prefix; keys] (rows
below ``front`` and past the last key empty), plus sink keys under a (N, S) mask. Where no gradient is needed and
only the average A_t = Σ_exact e^{s_tj} v_j / Σ_exact e^{s_tj} is wanted (the window beside the delta rule), the
band goes to ``aten::_scaled_dot_product_flash_attention_for_cpu`` in blocks of C queries: block b's keys are rows
b·C … b·C + C + B − 1, an overlapping strided view of the key sequence (no copy), scored with one (C, C + B) band
mask shared by every block that has no empty row (blocks at the two ends get their own). The kernel returns each
row's log-sum-exp, so the sinks (a few keys, scored here with one batched product) join the average afterwards:

    A = (A_band·e^{lse − m} + Σ_sinks e^{s − m} v) / (e^{lse − m} + Σ_sinks e^{s − m}),  m = max(lse, max_sinks s)

The kernel scores C + B keys a query where the band holds B + 1, and is still faster than the tiled Function on
this project's shapes (docs/benchmarks.md, "The window's exact part in prefill"). Gradients, other devices and a
torch without the kernel take the Function.
"""

from __future__ import annotations

import functools

import torch

from ...features import NEG_INF
from .band import rows

# Queries per block: each block scores C + B keys for B + 1 in the band, so small blocks waste little; the kernel's
# own tiles want C ≥ 32. Measured (N = 1,536 and 8,192, 9 heads, D = 64, B = 191, two threads): C = 32 ran faster
# than 16 and 64.
BLOCK = 32

_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether :func:`band_average` serves these operands: CPU, fp32 or fp64, values as wide as the keys (the
    kernel's rule), no gradient needed."""
    tensors = (q, k, v, *more)
    if _KERNEL is None or v.shape[-1] != k.shape[-1]:
        return False
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not needs_grad and all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
                                  for t in tensors)


@functools.lru_cache(maxsize=16)
def _mask(lo: int, hi: int, size: int, width: int, front: int, end: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """The additive band mask of query blocks lo … hi−1, (hi−lo, C, C + B): 0 where query c of block b sees key row
    b·C + y (c ≤ y ≤ c + B, front ≤ b·C + y < end), −inf elsewhere. Kept: every layer of a model asks for the same."""
    c = torch.arange(size, device=device).unsqueeze(-1)
    y = torch.arange(size + width, device=device)
    row = (torch.arange(lo, hi, device=device) * size).view(-1, 1, 1) + y
    sees = (y >= c) & (y <= c + width) & (row >= front) & (row < end)
    return torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill_(~sees, NEG_INF)


def band_average(
    q: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor], values: tuple[torch.Tensor, torch.Tensor],
    scale: float, width: int, front: int,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (R, N, Dv), lse (R, N)) over the band and the sinks. q (R, N, D); keys, values: (prefix (R, P, ·), this
    call's (R, N, ·)); sinks: (keys (R, S, D), values (R, S, Dv), mask (R, N, S) bool) or None. Every query must see
    at least one key of its band (its own, in the causal layout)."""
    n = q.shape[1]
    size, prefix = BLOCK, keys[0].shape[1]
    blocks = -(-n // size)
    span = size + width  # key rows a block scores
    end = prefix + n  # rows from here on are empty
    # inner blocks read this call's keys alone: overlapping views of them, one shared mask; the blocks at the two
    # ends gather their rows (the prefix, the empty rows past the end) and get their own masks
    inner_lo = min(blocks, -(-prefix // size))
    inner_hi = max(inner_lo, min(blocks, (end - span) // size + 1))
    with_sinks = sinks is not None and sinks[0].shape[1] > 0
    kernel = _KERNEL
    assert kernel is not None  # takes() said so
    outs, lses = [], []
    for lo, hi in ((0, inner_lo), (inner_lo, inner_hi), (inner_hi, blocks)):
        if hi <= lo:
            continue
        kb, vb = (rows(pre, main, lo * size, (hi - 1) * size + span).unfold(1, span, size).transpose(-1, -2)
                  for pre, main in (keys, values))  # (R, hi − lo, C + B, ·)
        queries = q[:, lo * size : hi * size]
        if queries.shape[1] < (hi - lo) * size:  # the last block, partly past the end
            queries = torch.nn.functional.pad(queries, (0, 0, 0, (hi - lo) * size - queries.shape[1]))
        inner = lo == inner_lo and hi == inner_hi
        mask = _mask(0, 1, size, width, 0, span, q.dtype, q.device) if inner else \
            _mask(lo, hi, size, width, front, end, q.dtype, q.device)
        out, lse = kernel(queries.unflatten(1, (hi - lo, size)), kb, vb, 0.0, False, attn_mask=mask.unsqueeze(0),
                           scale=scale)[:2]
        outs.append(out.flatten(1, 2))
        lses.append(lse.flatten(1, 2))
    a = (outs[0] if len(outs) == 1 else torch.cat(outs, 1))[:, :n]
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses, 1))[:, :n]
    if not with_sinks:
        return a, lse
    assert sinks is not None
    sink_keys, sink_values, sink_mask = sinks
    fill = torch.zeros(sink_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~sink_mask, NEG_INF)
    scores = torch.baddbmm(fill, q, sink_keys.transpose(-1, -2), alpha=scale)  # (R, N, S)
    top = torch.maximum(scores.amax(-1), lse)
    sink_w = scores.sub_(top.unsqueeze(-1)).exp_()  # 0 where masked
    band_w = (lse - top).exp_()
    inverse = (sink_w.sum(-1) + band_w).reciprocal_()
    # a is this call's own tensor (the kernel's output, or the join of its groups): merged in place
    a = a.mul_((band_w * inverse).unsqueeze(-1)).baddbmm_(sink_w.mul_(inverse.unsqueeze(-1)), sink_values)
    return a, top - inverse.log()
