"""An independent float64 definition of decayed linear attention: the recurrence, token by token.

    S_t = a_t S_{t−1} + φ(k_t) v_tᵀ,   z_t = a_t z_{t−1} + φ(k_t),   out_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)

with a_t = exp(g_t). Written from the formula alone; it shares no code with the library.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Phi = Callable[[torch.Tensor], torch.Tensor]


def decayed_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi: Phi,
    log_decay: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    min_denom: float | None = None,
    s0: torch.Tensor | None = None,
    z0: torch.Tensor | None = None,
    feature_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (..., N, Dv), S_N (..., F, Dv), z_N (..., F)); ``log_decay`` broadcasts to (..., N).

    ``feature_decay`` (..., N, F): per-feature log-gates (GLA), S_t = diag(exp(g_t))·S_{t−1} + …, on top."""
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query attention: repeat k/v heads
        group = q.shape[-3] // k.shape[-3]
        k = torch.repeat_interleave(k, group, dim=-3)
        v = torch.repeat_interleave(v, group, dim=-3)
    fq, fk = phi(q), phi(k)
    if keep is not None:
        fk = fk * keep.unsqueeze(-1).double()
        v = v * keep.unsqueeze(-1).double()
    g = torch.broadcast_to(log_decay.double(), q.shape[:-1])
    batch = q.shape[:-2]
    features, values = fk.shape[-1], v.shape[-1]
    s = s0.double().clone() if s0 is not None else torch.zeros(*batch, features, values, dtype=torch.float64)
    z = z0.double().clone() if z0 is not None else torch.zeros(*batch, features, dtype=torch.float64)
    outs = []
    for t in range(q.shape[-2]):
        a = torch.exp(g[..., t]).unsqueeze(-1)  # (..., 1): the same for every feature
        if feature_decay is not None:
            a = a * torch.exp(feature_decay[..., t, :].double())  # (..., F)
        s = a[..., None] * s + fk[..., t, :, None] * v[..., t, None, :]
        z = a * z + fk[..., t, :]
        num = torch.einsum("...f,...fd->...d", fq[..., t, :], s)
        if normalize:
            den = (fq[..., t, :] * z).sum(-1) + eps
            if min_denom is not None:
                den = den.clamp(min=min_denom)
            den = torch.where(den == 0, torch.ones_like(den), den)
            num = num / den.unsqueeze(-1)
        outs.append(num)
    return torch.stack(outs, dim=-2), s, z
