"""Scalar decays as a change of log-scale: S_t = a_t·S_{t−1} + φ(k_t)v_tᵀ with a_t = e^{g_t}, g_t ≤ 0.

With G_t = Σ_{i≤t} g_i (G_0 = 0 before the first token), query t weighs key j ≤ t by φ(q_t)·φ(k_j)·e^{G_t − G_j}
and an initial state by e^{G_t}. Every causal form already weighs key j, stored at log-scale ref_j, by
e^{ref_j − ref_t} when query t reads at ref_t (log-space maps: ref = r, the running maximum). So a decay is the
change ref' = r − G (ordinary maps: ref' = −G): ref' stays non-decreasing because g ≤ 0, every factor stays
e^{(≤ 0)}, and the gradient of G flows through the forms' existing gradient of ref.

G grows without bound (γ = 0.5 over 65536 tokens: G ≈ −45000), so it is summed in fp64 and ref' is handed to the
forms in fp64; they form differences in fp64 and cast only the resulting factors (the chunked Function re-bases each
chunk to its own end first, see :class:`.causal_fn._Block`).

State convention: forms return sums stored at scale ref'_N; since ref'_N = r_N − G_N, the true decayed sums are
``kv·e^{r_N}`` — so the returned state's ``shift`` is r_N (0 for ordinary maps), exactly the meaning it has without a
decay, and a later call continues from it unchanged.
"""

from __future__ import annotations

import torch


def cumulative(log_decay: torch.Tensor) -> torch.Tensor:
    """G (..., N) in fp64 from per-token log-decays g (..., N) ≤ 0."""
    return torch.cumsum(log_decay.to(torch.float64), dim=-1)


def decayed_ref(ref: torch.Tensor | None, log_decay: torch.Tensor) -> torch.Tensor:
    """ref' = r − G in fp64 (r = 0 for ordinary maps); non-decreasing when r is and g ≤ 0."""
    total = cumulative(log_decay)
    if ref is None:
        return -total
    return ref.to(torch.float64) - total
