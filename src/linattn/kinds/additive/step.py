"""The lean step of plain causal linear attention (see :mod:`linattn.decode`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...backends import triton as triton_backend
from ...capabilities import step_kernel_reasons, step_reasons
from ...feature_maps import FeatureMap
from ...feature_maps.elementwise import EluFeatureMap
from ...features import is_log_space, scale_between, stabilise_queries, stored_at
from ...state import LinearAttentionState
from .._step import _repeat_heads, _Step, check_memory, check_step_options, check_token


def supports(fmap: nn.Module, state: Any, options: dict[str, Any]) -> bool:
    """Whether :class:`DecodeStep` computes what ``linear_attention(..., **options)`` would from ``state``
    (:func:`linattn.capabilities.step_reasons` says why not)."""
    return not step_reasons("plain", fmap, state, options)


class DecodeStep(_Step):
    """Causal linear attention one token at a time, from a state returned by ``linear_attention``.

    Args:
        fmap: the feature map the state was built with.
        state: batch shape (B, H): ``kv`` (B, H, F, Dv), ``k_sum`` (B, H, F), ``shift`` (B, H). Copied once.
        eps: the denominator's eps (as given to ``linear_attention``).
    """

    def __init__(self, fmap: nn.Module, state: LinearAttentionState, *, eps: float = 1e-6) -> None:
        check_memory(state, LinearAttentionState, "DecodeStep")
        check_step_options(eps)
        self.fmap = fmap
        self.log_space = is_log_space(fmap)
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
        self._kernel = _step_kernel(fmap, self.kv, self.log_space, self.eps)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        Output in q's dtype; the state stays in its own (fp32 or fp64).
        """
        check_token(q, k, v, keep, self.kv, (self.kv.shape[0], self.kv.shape[1], self.kv.shape[-1]))
        batch, heads, features, values = self.kv.shape
        out_dtype = q.dtype
        dtype = self.kv.dtype
        if self._kernel is not None and keep is None:
            return self._fused(q, k, v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qf = self._map(q, True)  # (B, H, 1, F)
        kf = self._map(k, False)  # (B, H, 1, F)
        if keep is not None:
            drop = ~keep.reshape(batch, 1, 1, 1)
            kf = kf.masked_fill(drop, float("-inf") if self.log_space else 0.0)
            v = v.masked_fill(drop, 0.0)
        if self.log_space:
            qf = stabilise_queries(qf)[0]  # a per-query shift: cancels in the ratio
            new = torch.maximum(self.shift, kf.amax(-1).squeeze(-1))  # (B, H) running maximum
            carry = scale_between(self.shift, new)
            self.kv.mul_(carry[..., None, None])
            self.k_sum.mul_(carry[..., None])
            self.shift.copy_(new)
            kf = stored_at(kf, new.unsqueeze(-1))
        kf = kf.reshape(batch, heads, features)
        # S += φ(k) vᵀ and z += φ(k), in place
        self.kv.view(self._flat).addcmul_(kf.reshape(-1, features, 1), v.reshape(-1, 1, values))
        self.k_sum.add_(kf)
        self.num_tokens += 1
        qf = qf.reshape(-1, 1, features)  # (B·H, 1, F)
        num = torch.bmm(qf, self.kv.view(self._flat))  # (B·H, 1, Dv)
        den = torch.bmm(qf, self.k_sum.view(-1, features, 1), out=self._scratch.view(-1, 1, 1))
        den = den.add_(self.eps)
        if self.eps <= 0:  # no visible key and eps = 0: output 0, not 0/0 (as finalize); eps > 0 keeps den > 0
            den = torch.where(den == 0, 1.0, den)
        return (num / den).view(batch, heads, 1, values).to(out_dtype)

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step as one Triton kernel (CUDA): the state updated in place; elu + 1 made in the kernel from the raw
        projections, any other ordinary map made here in fp32 first."""
        assert self._kernel is not None
        batch, heads, features, values = self.kv.shape
        k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        elu, out_dtype = self._kernel.elu, q.dtype
        if not elu:
            q = self._map(q.to(self.kv.dtype), True)
            k = self._map(k.to(self.kv.dtype), False)
        out = torch.empty(batch, heads, 1, values, dtype=out_dtype, device=q.device)  # the kernel rounds once
        kv, k_sum = self.kv.view(self._flat), self.k_sum.view(-1, features)
        self._kernel.launch_step(
            q.contiguous(), k.contiguous(), v.contiguous(), kv, k_sum, out, kv, k_sum,
            normalize=True, eps=self.eps, min_denom=None, elu=elu,
        )
        self.num_tokens += 1
        return out

    @property
    def batch_size(self) -> int:
        return int(self.kv.shape[0])

    def state(self) -> LinearAttentionState:
        """The state after every token stepped (shares the step's tensors: clone before stepping further)."""
        return LinearAttentionState(self.kv, self.k_sum, self.shift, self.num_tokens)

    def index_select(self, dim: int, index: torch.Tensor) -> DecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``."""
        return DecodeStep(self.fmap, self.state().index_select(dim, index), eps=self.eps)


class _StepKernel:
    """The Triton decoding kernel for :class:`DecodeStep`, and whether it makes the elu + 1 features itself."""

    def __init__(self, elu: bool) -> None:
        self.launch_step = triton_backend.load().launch_step
        self.elu = elu


def _step_kernel(fmap: nn.Module, kv: torch.Tensor, log_space: bool, eps: float) -> _StepKernel | None:
    """The fused kernel when it computes this step (:func:`linattn.capabilities.step_kernel_reasons`): an fp32
    state on a CUDA device (or on CPU under TRITON_INTERPRET=1), triton importable, an ordinary map, F and Dv
    within the kernels' sizes, eps > 0."""
    if step_kernel_reasons(kv, log_space, eps):
        return None
    return _StepKernel(elu=type(fmap) is EluFeatureMap)
