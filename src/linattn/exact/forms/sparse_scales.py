"""The sparse cache's log-scales for log-space feature maps (FAVOR+ and kin), shared by its forms.

A log-space map returns log φ. The sparse forms keep every pair j (a row of X) at its own maximum m_j = max_f log
φ(k_j)_f, as φ̃_j = e^{log φ(k_j) − m_j} (entries ≤ 1, one of them 1), and move it to a reader's scale by e^{m_j − ρ}
with ρ ≥ m_j, never the other way (no exp overflows, whatever the log-features). The scales are the window op's:

- query t reads at its stored scale c_t + R_t: c_t its own row maximum, R_t the running maximum of m over every
  kept key ≤ t (carried on in the state's ``shift``), so its linear weight of pair j is (φ̃(q_t)·φ̃_j)·e^{m_j − R_t}
  and the carried sums are moved by e^{shift − R_t};
- the sums at boundary t0, which the recall score reads, are kept at R_{t0−1} (the scale query t0 − 1 read them
  at); the score's candidates are read at their own maxima φ̃_j. LoLA's ratio Sᵀφ(k)/(zᵀφ(k)) does not depend on
  either scale, so the score is the ordinary map's, at scales every form shares;
- the state after a call holds its sums at R of its last token (its ``shift``).

A pair that enters the linear state late (it left the cache at a boundary t0 > j + W) enters at the scale the
sums have then: e^{m_j − R_{t0−1}} in the boundary sums, e^{m_j − R_t} for every query t ≥ t0 (R only grows, so
the factor is ≤ 1). The m_j are treated as constants (they cancel in φ̃_j·e^{m_j}), so gradients reach log φ(k_j)
through φ̃_j alone.
"""

from __future__ import annotations

import torch

from ...features import finite, key_scales, scale_between


def own_scale(logs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(φ̃ (..., X, F), m (..., X)): log-features (−inf at masked rows) at each row's own maximum; masked rows 0 and
    m = −inf. m carries no gradient."""
    top = logs.detach().amax(-1)  # (..., X)
    return torch.exp(logs - finite(top).unsqueeze(-1)), top


def reading(start: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[R_{n0−1}, R_{n0}, …, R_{end−1}] (..., N + 1): ``start`` (...) the scale before the call (the carried shift
    raised to the carried keys), then the running maximum over this call's rows' scales (..., N)."""
    return torch.cat([start.unsqueeze(-1), key_scales(scales.unsqueeze(-1), True, start)], -1)


def start_scale(shift: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    """R_{n0−1}: the carried shift raised to every carried row's scale (rows (..., X_i), −inf where masked)."""
    start = shift
    for rows in scales:
        if rows.shape[-1]:
            start = torch.maximum(start, rows.amax(-1))
    return start


def moved(m: torch.Tensor, to: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """e^{m_j − ρ_t} (..., T, X) for rows at m (..., X) read at ρ (..., T) ≥ m_j; 0 where m_j = −inf or not ``keep``."""
    return scale_between(m.unsqueeze(-2), to.unsqueeze(-1), keep)


def sums_at(features: torch.Tensor, m: torch.Tensor, values: torch.Tensor, to: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_j φ̃_j e^{m_j − ρ} v_jᵀ (..., F, Dv), Σ_j φ̃_j e^{m_j − ρ} (..., F)) at ρ = ``to`` (...); rows to leave out
    have φ̃ = 0 or m = −inf."""
    weighted = features * scale_between(m, to.unsqueeze(-1)).unsqueeze(-1)
    return weighted.transpose(-1, -2) @ values, weighted.sum(-2)


def carried_to(kv: torch.Tensor, k_sum: torch.Tensor, shift: torch.Tensor, to: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums kept at ``shift`` (...) moved to ``to`` (...) ≥ shift (empty sums, shift = −inf, stay 0)."""
    carry = scale_between(shift, to)
    return kv * carry[..., None, None], k_sum * carry[..., None]

