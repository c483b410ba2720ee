"""ContextParallel: run a :class:`linattn.nn.LinearAttention` layer on one slice of a sequence split across ranks.

>>> # layer = LinearAttention(256, 8, causal=True)          # before
>>> # layer = ContextParallel(LinearAttention(256, 8, causal=True), group)   # after: x is this rank's slice
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import LinearAttentionError
from ..nn import LinearAttention
from .attention import context_parallel_attention


class ContextParallel(nn.Module):
    """Wraps a ``LinearAttention`` layer: the same projections and feature map, attention across ``group``.

    ``forward(x)`` takes this rank's contiguous slice ``(B, N_r, E)`` of the sequence (slices ordered by rank)
    and returns the layer's output for those tokens, equal to the unwrapped layer on the whole sequence. The
    layer's parameters are used as they are (``self.layer``), so data-parallel wrappers (DDP, ``fully_shard``)
    go around the model as usual; its state_dict keys gain the prefix ``layer.``.

    Decays (``decay=``) and per-token gates (``gate="token"``) go across ranks (each rank computes its slice's
    gates), and so do the delta rule (``update="delta"``, β computed by each rank from its tokens) and the output
    gate, per-feature gates with the delta rule (KDA) too; the window hybrid, per-feature gates of the additive
    update and the short convolution raise here.

    ``validate``: ``"first"`` (default) exchanges the shape header in a separate small all-gather on the first
    call only, later calls use one collective; ``True``/``False`` on every call (see
    :func:`context_parallel_attention`).
    """

    def __init__(self, layer: LinearAttention, group: Any = None, *, validate: bool | str = "first") -> None:
        super().__init__()
        if not isinstance(layer, LinearAttention):
            raise LinearAttentionError(
                f"layer: expected a linattn.nn.LinearAttention, got {type(layer).__name__}; for other layers call "
                "linattn.distributed.context_parallel_attention in their forward"
            )
        if layer.options.get("window") is not None:
            raise LinearAttentionError(
                "layer: the sliding-window hybrid (window=) is not split across ranks yet (its window would need the "
                "previous rank's last keys); use a layer without window=, or run it on one process"
            )
        if layer.short_conv is not None:
            raise LinearAttentionError(
                "layer: the short convolution (short_conv=) is not split across ranks yet (each rank's first tokens "
                "would need the previous rank's last inputs); use a layer without short_conv, or run it on one process"
            )
        if layer.gate_kind not in (None, "token") and layer.update != "delta":  # the delta rule's are (KDA)
            raise LinearAttentionError(
                f"layer: gate={layer.gate_kind!r} gives per-feature gates, which are not split across ranks yet with "
                "update='add'; use gate='token' (one log-decay per token and head) or decay=, or run it on one process"
            )
        if validate not in (True, False, "first"):
            raise LinearAttentionError(f"validate: expected True, False or 'first', got {validate!r}")
        self.layer = layer
        self.group = group
        self.validate = validate
        self._calls = 0

    def forward(self, x: torch.Tensor, *, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x ``(B, N_r, E)`` → ``(B, N_r, E)``; ``key_padding_mask`` bool ``(B, N_r)``, True = keep."""
        layer = self.layer
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != layer.embed_dim:
            seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(f"x: expected this rank's slice (B, N_r, {layer.embed_dim}), got {seen}")
        validate = self._calls == 0 if self.validate == "first" else bool(self.validate)
        self._calls += 1
        q = layer._heads(layer.q_proj(x), layer.num_heads)  # (B, H, N_r, D)
        k = layer._heads(layer.k_proj(x), layer.num_kv_heads)  # (B, Hkv, N_r, D)
        v = layer._heads(layer.v_proj(x), layer.num_kv_heads)  # (B, Hkv, N_r, D)
        # as in LinearAttention: the core accumulates in fp32 whatever autocast does to the projections
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = context_parallel_attention(
                q,
                k,
                v,
                group=self.group,
                causal=layer.causal,
                feature_map=layer.feature_map,
                key_padding_mask=key_padding_mask,
                validate=validate,
                decay=layer._rates(x.device),
                log_gate=layer._log_gate(x),  # this slice's gates (and β): computed from its own tokens
                beta=layer._beta(x),
                **layer.options,
            )
        return layer._output(out, x)  # as in LinearAttention: norm and gate per head and token; (B, N_r, E)

    def extra_repr(self) -> str:
        return f"validate={self.validate!r}"
