"""A lean causal decode step: one new token per call against a preallocated fp32 state updated in place.

``linear_attention(..., initial_state=s, return_state=True)`` on one token costs ~0.3 ms per call at H = 8,
d = 64, almost all of it argument checking, dtype/device handling and allocation of new state tensors — per layer
and per generated token. :class:`DecodeStep` pays the checks once (when it is built from a state) and then does, per
token, the feature maps and a handful of in-place ops:

    S ← S·c + φ(k)vᵀ,   z ← z·c + φ(k),   out = φ(q)·S / (φ(q)·z + eps)

(c = exp(shift_old − shift_new) ≤ 1 for log-space maps, whose sums are kept at the running maximum log-feature
``shift``; no rescaling for ordinary maps). The arithmetic is the recurrent form's (:mod:`linattn.forms.recurrent`),
so a step agrees with ``linear_attention`` up to fp32 rounding (tests/test_decoder_generate.py).

Only the plain state (:class:`~linattn.LinearAttentionState`), ``normalize=True``, no ``min_denom`` and a positive
map qualify (:func:`supports`); anything else — e.g. a window hybrid's state — goes through ``linear_attention``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import LinearAttentionError
from .feature_maps import FeatureMap
from .state import LinearAttentionState

# linear_attention options a step reproduces; any other option (window=, sinks=, min_denom=, ...) is left to it
STEP_OPTIONS = frozenset({"eps", "chunk_size", "form"})


def supports(fmap: nn.Module, state: Any, options: dict[str, Any]) -> bool:
    """Whether :class:`DecodeStep` computes what ``linear_attention(..., **options)`` would from ``state``."""
    return (
        type(state) is LinearAttentionState
        and state.kv.dtype in (torch.float32, torch.float64)
        and set(options) <= STEP_OPTIONS
        and options.get("normalize", True)
        and getattr(fmap, "positive", True) is not False
    )


class DecodeStep:
    """Causal linear attention one token at a time, from a state returned by ``linear_attention``.

    Args:
        fmap: the feature map the state was built with.
        state: batch shape (B, H): ``kv`` (B, H, F, Dv), ``k_sum`` (B, H, F), ``shift`` (B, H). Copied once.
        eps: the denominator's eps (as given to ``linear_attention``).
    """

    def __init__(self, fmap: nn.Module, state: LinearAttentionState, *, eps: float = 1e-6) -> None:
        if state.kv.dim() != 4:
            raise LinearAttentionError(
                f"state: a decode step needs a state of batch shape (B, H), got kv of shape {tuple(state.kv.shape)}"
            )
        self.fmap = fmap
        self.log_space = bool(getattr(fmap, "log_space", False))
        self.features = fmap.features if isinstance(fmap, FeatureMap) else None
        self.eps = float(eps)
        # contiguous copies, owned by the step and updated in place from now on
        self.kv = state.kv.detach().clone(memory_format=torch.contiguous_format)
        self.k_sum = state.k_sum.detach().clone(memory_format=torch.contiguous_format)
        self.shift = state.shift.detach().clone()
        self.num_tokens = state.num_tokens
        batch, heads, features, values = self.kv.shape
        self._flat = (batch * heads, features, values)
        self._scratch = torch.empty(batch, heads, 1, dtype=self.kv.dtype, device=self.kv.device)

    def _map(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.features is not None:
            return self.features(x, is_query=is_query)
        return self.fmap(x)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        Output in q's dtype; the state stays in its own (fp32 or fp64).
        """
        batch, heads, features, values = self.kv.shape
        out_dtype = q.dtype
        dtype = self.kv.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        group = heads // k.shape[1]
        if group > 1:  # grouped-query attention: (B, Hkv, 1, ·) → (B, H, 1, ·) without a copy
            k = k.unsqueeze(2).expand(batch, k.shape[1], group, 1, k.shape[-1]).reshape(batch, heads, 1, -1)
            v = v.unsqueeze(2).expand(batch, v.shape[1], group, 1, values).reshape(batch, heads, 1, values)
        qf = self._map(q, True)  # (B, H, 1, F)
        kf = self._map(k, False)  # (B, H, 1, F)
        if keep is not None:
            drop = ~keep.reshape(batch, 1, 1, 1)
            kf = kf.masked_fill(drop, float("-inf") if self.log_space else 0.0)
            v = v.masked_fill(drop, 0.0)
        if self.log_space:
            qf = torch.exp(qf - qf.amax(-1, keepdim=True))  # a per-query shift: cancels in the ratio
            new = torch.maximum(self.shift, kf.amax(-1).squeeze(-1))  # (B, H) running maximum
            finite = torch.where(new == float("-inf"), 0.0, new)
            carry = torch.exp(torch.where(self.shift == float("-inf"), float("-inf"), self.shift - finite))
            self.kv.mul_(carry[..., None, None])
            self.k_sum.mul_(carry[..., None])
            self.shift.copy_(new)
            kf = torch.exp(kf - finite[..., None, None])
        kf = kf.reshape(batch, heads, features)
        # S += φ(k) vᵀ and z += φ(k), in place
        self.kv.view(self._flat).baddbmm_(kf.reshape(-1, features, 1), v.reshape(-1, 1, values))
        self.k_sum.add_(kf)
        self.num_tokens += 1
        qf = qf.reshape(-1, 1, features)  # (B·H, 1, F)
        num = torch.bmm(qf, self.kv.view(self._flat))  # (B·H, 1, Dv)
        den = torch.bmm(qf, self.k_sum.view(-1, features, 1), out=self._scratch.view(-1, 1, 1))
        den = den.add_(self.eps)
        if self.eps <= 0:  # no visible key and eps = 0: output 0, not 0/0 (as finalize); eps > 0 keeps den > 0
            den = torch.where(den == 0, 1.0, den)
        return (num / den).view(batch, heads, 1, values).to(out_dtype)

    def state(self) -> LinearAttentionState:
        """The state after every token stepped (shares the step's tensors: clone before stepping further)."""
        return LinearAttentionState(self.kv, self.k_sum, self.shift, self.num_tokens)

    def index_select(self, dim: int, index: torch.Tensor) -> DecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``."""
        return DecodeStep(self.fmap, self.state().index_select(dim, index), eps=self.eps)
