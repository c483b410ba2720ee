"""The window+sinks baseline of the causal-LM comparison: softmax over the most recent keys and the first tokens.

Local attention alone, with no linear part: what the hybrid rows' softmax window achieves by itself. It runs as a
transformers attention function (SDPA with an explicit band-and-sink mask), registered under
:data:`WINDOW_IMPLEMENTATION` by :func:`use_window_softmax`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import hf

WINDOW_IMPLEMENTATION = "linattn_window_softmax"


def window_sink_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Softmax attention restricted to keys t − W < j ≤ t and j < S (transformers' attention-function contract).

    W and S are read from the module (``linattn_window``, ``linattn_sinks``); ``attention_mask`` is the 2-D
    padding mask of :func:`linattn.hf.linattn_mask`, or None.
    """
    window, sinks = module.linattn_window, module.linattn_sinks
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    rows = torch.arange(num_keys - num_queries, num_keys, device=query.device)[:, None]  # (Nq, 1) positions
    cols = torch.arange(num_keys, device=query.device)[None, :]  # (1, Nk)
    allowed = (cols <= rows) & ((rows - cols < window) | (cols < sinks))  # (Nq, Nk)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(torch.bool)[:, None, None, -num_keys:]  # (B, 1, Nq, Nk)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None  # (B, Nq, H, dv)


def use_window_softmax(model: Any, window: int, sinks: int) -> None:
    """Switch ``model`` to :func:`window_sink_attention` with ``window`` recent keys and ``sinks`` first tokens."""
    from transformers import AttentionInterface  # transformers only when a model is switched (linattn[models])
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(WINDOW_IMPLEMENTATION, window_sink_attention)
    AttentionMaskInterface.register(WINDOW_IMPLEMENTATION, hf.linattn_mask)
    for module in hf.attention_modules(model):
        # plain ints on the module, read by window_sink_attention
        module.linattn_window, module.linattn_sinks = window, sinks  # type: ignore[assignment]
    model.set_attn_implementation(WINDOW_IMPLEMENTATION)
