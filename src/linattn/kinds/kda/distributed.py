"""KDA across ranks: the delta rule's slice maps (:mod:`linattn.kinds.delta.distributed`) with the per-feature
transition Π_t (I − β_t k̂_t k̂_tᵀ)·diag(a_t) of :func:`linattn.kinds.kda.forms.kda_transition`; the fold of the
gathered maps is the delta rule's (:func:`~linattn.kinds.delta.distributed.prefix_state`)."""

from __future__ import annotations

from typing import Any

import torch

from ..delta.distributed import prefix_state
from ..delta.distributed import slice_transition as delta_slice_transition
from .forms import kda_transition

__all__ = ["prefix_state", "slice_transition"]


def slice_transition(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: Any, mask: torch.Tensor | None, beta: Any,
    log_decay: torch.Tensor | None, chunk_size: int | None, feature_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """[A | B] of this rank's slice for the delta family: per-token decays by the delta rule's transition,
    per-feature gates (``feature_gate`` (..., H, N, F)) by KDA's."""
    return delta_slice_transition(q, k, v, fmap, mask, beta, log_decay, chunk_size, feature_gate,
                                  per_feature=kda_transition)
