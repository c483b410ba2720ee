"""The lean step of the delta rule (see :mod:`linattn.decode`): one token against a preallocated memory, in place.

    S ← a·S,   u = β·(v − Sᵀk̂),   S ← S + k̂·uᵀ,   o = Sᵀq̂

k̂, q̂ are the L2-normalised features (:func:`linattn.features.unit_features`, as in every delta form), a = e^g the
token's decay (a fixed rate per head from the options, times a gate given with the call: per head, Gated DeltaNet,
or per feature, KDA, where a·S scales each row of S by its own factor) and β the write strength (a float from the
options, or per token and head with the call). The arithmetic is the token-by-token form's
(:func:`linattn.kinds.delta.forms.delta_recurrent`, :func:`linattn.kinds.kda.forms.kda_recurrent`) in the same
order, so a step agrees with ``linear_attention(..., update="delta", initial_state=...)`` up to rounding; the
memory S (B, H, F, Dv) is copied once and then updated in place: memory and time per token do not grow with the
tokens seen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import LinearAttentionError
from ...features import is_log_space, unit_features
from ...state import DeltaRuleState
from .._step import _repeat_heads, check_memory, check_token, check_token_options


class DeltaDecodeStep:
    """The delta rule one token at a time, from a :class:`~linattn.DeltaRuleState` (batch shape (B, H)).

    Args:
        fmap: the feature map the state was built with.
        state: ``kv`` (B, H, F, Dv); copied once.
        beta: the write strength every token gets unless the call passes its own (default 1), in [0, 2].
        decay: a fixed decay rate γ ∈ (0, 1], a float or one per head (H,), as ``linear_attention``'s ``decay=``.
    """

    def __init__(self, fmap: nn.Module, state: DeltaRuleState, *, beta: float | None = None,
                 decay: Any = None) -> None:
        check_memory(state, DeltaRuleState, "DeltaDecodeStep")
        self.fmap = fmap
        self.log_space = is_log_space(fmap)
        self.kv = state.kv.detach().clone(memory_format=torch.contiguous_format)  # owned, updated in place
        self.num_tokens = state.num_tokens
        batch, heads, features, values = self.kv.shape
        self._flat = (batch * heads, features, values)
        self.beta = 1.0 if beta is None else float(beta)
        if not 0 <= self.beta <= 2:
            raise LinearAttentionError(f"beta: the write strength must lie in [0, 2], got {beta}")
        self.decay = decay
        self.log_rate: torch.Tensor | None = None  # (H, 1) fp64: log γ per head
        if decay is not None:
            rate = torch.as_tensor(decay, dtype=torch.float64, device=self.kv.device)
            if rate.dim() > 1 or not bool(((rate > 0) & (rate <= 1)).all()):
                raise LinearAttentionError(f"decay: expected a rate in (0, 1], a float or one per head, got {decay}")
            self.log_rate = torch.log(rate).expand(heads).reshape(heads, 1).clone()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None, *,
                 beta: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
                 validate: bool = True) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        ``beta`` (B, H): this token's write strengths (instead of the fixed one); ``log_decay`` ≤ 0: this token's
        log-gate on top of the fixed rate, one per head (B, H) or one per feature (B, H, F) (KDA; (B, H, 1, F) is
        taken too). Output in q's dtype; the memory stays in its own (fp32/fp64). ``validate=False``: the caller
        vouches for β ∈ [0, 2] and log-decays ≤ 0 (e.g. a sigmoid and a logsigmoid computed for this token), so
        their values are not read back (a comparison, a reduction and a synchronisation per call).
        """
        check_token(q, k, v, keep, self.kv, (self.kv.shape[0], self.kv.shape[1], self.kv.shape[-1]))
        if validate:
            check_token_options(beta, log_decay)
        batch, heads, features, values = self.kv.shape
        out_dtype, dtype = q.dtype, self.kv.dtype
        q, k, v = q.to(dtype), _repeat_heads(k.to(dtype), heads), _repeat_heads(v.to(dtype), heads)
        mask = None if keep is None else keep.reshape(batch, 1, 1)
        if mask is not None:  # zeroed, not multiplied by β = 0: a NaN or inf in padding would stay NaN
            k, v = (x.masked_fill(~mask.unsqueeze(-1), 0.0) for x in (k, v))
        qf = unit_features(self.fmap, q, is_query=True, log_space=self.log_space)  # (B, H, 1, F)
        kf = unit_features(self.fmap, k, is_query=False, log_space=self.log_space, keep=mask)
        strength = torch.full((batch, heads, 1), self.beta, dtype=dtype, device=q.device) if beta is None else (
            beta.reshape(batch, heads, 1).to(dtype))
        if mask is not None:  # a masked token writes nothing; its decay still applies
            strength = strength * mask.to(dtype)
        return self.advance(qf, kf, v, strength, log_decay).view(batch, heads, 1, values).to(out_dtype)

    def advance(self, qf: torch.Tensor, kf: torch.Tensor | None, v: torch.Tensor | None,
                strength: torch.Tensor | None, log_decay: torch.Tensor | None) -> torch.Tensor:
        """The memory's arithmetic for one token, in place, from its unit features (B, H, 1, F) (``kf`` None: no
        write), v (B, H, 1, Dv) and ``strength`` (B, H, 1) in the memory's dtype: the decay, the write, the read
        Sᵀq̂ (B·H, 1, Dv). Nothing is checked: :meth:`__call__` and the composed step check before they call it."""
        batch, heads, features, values = self.kv.shape
        total = self.log_factors(log_decay)
        memory = self.kv.view(self._flat)
        if total is not None:  # diag(a)·S: one factor per row of S, the same for every row without per-feature gates
            factor = torch.exp(total).to(memory.dtype)
            memory.mul_(factor.expand(batch, heads, factor.shape[-1]).reshape(-1, factor.shape[-1], 1))
        if kf is not None and v is not None and strength is not None:
            kf = kf.reshape(-1, 1, features)  # (B·H, 1, F)
            recalled = torch.bmm(kf, memory)  # Sᵀk̂ after the decay, (B·H, 1, Dv)
            write = strength.reshape(-1, 1, 1) * (v.reshape(-1, 1, values) - recalled)
            memory.addcmul_(kf.transpose(1, 2), write)  # S += k̂ uᵀ
        self.num_tokens += 1
        return torch.bmm(qf.reshape(-1, 1, features), memory)  # (B·H, 1, Dv)

    def log_factors(self, log_decay: torch.Tensor | None) -> torch.Tensor | None:
        """log a of this token, fp64: the fixed rate's (H, 1) and the call's gate ((B, H, 1) per head or (B, H, F)
        per feature) added; None when neither decays."""
        total = self.log_rate  # (H, 1)
        if log_decay is not None:
            gate = self._gate(log_decay)
            total = gate if total is None else total + gate  # (B, H, 1) or (B, H, F)
        return total

    def _gate(self, log_decay: torch.Tensor) -> torch.Tensor:
        """A token's log-gates as (B, H, 1) per head or (B, H, F) per feature, fp64."""
        batch, heads, features, _ = self.kv.shape
        if log_decay.numel() == batch * heads:
            return log_decay.reshape(batch, heads, 1).to(torch.float64)
        if log_decay.numel() != batch * heads * features:
            raise LinearAttentionError(
                f"log_decay: shape {tuple(log_decay.shape)}; expected one log-decay per head (B, H) = ({batch}, "
                f"{heads}) or one per feature (B, H, F) = ({batch}, {heads}, {features})"
            )
        return log_decay.reshape(batch, heads, features).to(torch.float64)

    @property
    def batch_size(self) -> int:
        return int(self.kv.shape[0])

    def state(self) -> DeltaRuleState:
        """The state after every token stepped (shares the step's memory: clone before stepping further)."""
        return DeltaRuleState(self.kv, self.num_tokens)

    def index_select(self, dim: int, index: torch.Tensor) -> DeltaDecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``."""
        return DeltaDecodeStep(self.fmap, self.state().index_select(dim, index), beta=self.beta, decay=self.decay)
