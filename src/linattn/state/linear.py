"""The linear part's states: the additive sums and the delta rule's memory."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import torch

from ..errors import LinearAttentionError


def check_num_tokens(value: object) -> None:
    """A state's ``num_tokens``: an int ≥ 0 (a symbolic size under torch.compile passes as it is)."""
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise LinearAttentionError(
            f"num_tokens: expected an int ≥ 0 (the key positions the state has consumed), got {value!r}"
        )


@dataclass
class LinearAttentionState:
    """Running sums of the keys seen so far, for every batch/head.

    ``kv``      (..., F, Dv)  Σ_j φ(k_j) v_jᵀ
    ``k_sum``   (..., F)      Σ_j φ(k_j)
    ``shift``   (...)         log-scale of the two sums: the true sums are ``kv · exp(shift)``. Zero unless the
                              feature map works in log space (FAVOR+ and kin), where it is the running maximum
                              that keeps the stored sums in range; -inf for a state that has seen no key.
    ``num_tokens``            key positions consumed so far (padding included).

    The sums are fp32 for fp32/bf16/fp16 inputs and fp64 for fp64 inputs.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    shift: torch.Tensor
    num_tokens: int = 0

    def __post_init__(self) -> None:
        check_num_tokens(self.num_tokens)

    @property
    def feature_dim(self) -> int:
        return int(self.kv.shape[-2])

    @property
    def value_dim(self) -> int:
        return int(self.kv.shape[-1])

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LinearAttentionState:
        """Move and/or cast the three tensors; returns a new state."""
        return replace(
            self,
            kv=self.kv.to(device=device, dtype=dtype),
            k_sum=self.k_sum.to(device=device, dtype=dtype),
            shift=self.shift.to(device=device, dtype=dtype),
        )

    def detach(self) -> LinearAttentionState:
        """Cut the autograd history (for truncated back-propagation through time)."""
        return replace(self, kv=self.kv.detach(), k_sum=self.k_sum.detach(), shift=self.shift.detach())

    def index_select(self, dim: int, index: torch.Tensor) -> LinearAttentionState:
        """Select along a batch dimension (e.g. to reorder beams). ``dim`` counts over the leading dims."""
        return replace(
            self,
            kv=self.kv.index_select(dim, index),
            k_sum=self.k_sum.index_select(dim, index),
            shift=self.shift.index_select(dim, index),
        )

    @staticmethod
    def zeros(
        batch_shape: tuple[int, ...],
        feature_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> LinearAttentionState:
        """An empty state: nothing seen yet."""
        return LinearAttentionState(
            kv=torch.zeros(*batch_shape, feature_dim, value_dim, dtype=dtype, device=device),
            k_sum=torch.zeros(*batch_shape, feature_dim, dtype=dtype, device=device),
            # -inf: no key seen, so any later reference scale dominates (exp(-inf - x) = 0 scales empty sums)
            shift=torch.full(batch_shape, float("-inf"), dtype=dtype, device=device),
            num_tokens=0,
        )


@dataclass
class DeltaRuleState:
    """What the delta rule (``linear_attention(..., update="delta")``) carries between calls.

    ``kv``  (..., F, Dv)  the associative memory S: S_t = a_t·S_{t−1} + β_t·φ̂(k_t)(v_t − a_t·S_{t−1}ᵀφ̂(k_t))ᵀ,
                          φ̂ the L2-normalised key features. Stored as it is (no log-scale): every factor of the
                          update has norm ≤ 1, so S stays within Σ_t β_t·‖v_t‖.
    ``num_tokens``        key positions consumed so far (padding included).

    There is no Σφ(k): the delta rule's output S_tᵀφ̂(q_t) is not normalised. The sum is fp32 for fp32/bf16/fp16
    inputs and fp64 for fp64 inputs.
    """

    kv: torch.Tensor
    num_tokens: int = 0

    def __post_init__(self) -> None:
        check_num_tokens(self.num_tokens)

    @property
    def feature_dim(self) -> int:
        return int(self.kv.shape[-2])

    @property
    def value_dim(self) -> int:
        return int(self.kv.shape[-1])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DeltaRuleState:
        """Move and/or cast; returns a new state."""
        return replace(self, kv=self.kv.to(device=device, dtype=dtype))

    def detach(self) -> DeltaRuleState:
        """Cut the autograd history (for truncated back-propagation through time)."""
        return replace(self, kv=self.kv.detach())

    def index_select(self, dim: int, index: torch.Tensor) -> DeltaRuleState:
        """Select along a batch dimension (e.g. to reorder beams). ``dim`` counts over the leading dims."""
        return replace(self, kv=self.kv.index_select(dim, index))

    @staticmethod
    def zeros(
        batch_shape: tuple[int, ...],
        feature_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> DeltaRuleState:
        """An empty memory: nothing written yet."""
        return DeltaRuleState(torch.zeros(*batch_shape, feature_dim, value_dim, dtype=dtype, device=device), 0)
