"""The options of one window call and the pieces every window form shares: features, the exact part, the
combination of the linear and exact parts on one scale (see the package docstring for the definition)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...features import NEG_INF, finite, scale_between, stabilise_queries, stored_at
from ...kinds.additive.forms import causal_fn
from ...kinds.additive.forms._common import finalize, rowdot
from .band import Band, BandAverage, Sinks, band_sums

Features = Callable[[torch.Tensor, bool], torch.Tensor]  # (x, is_query) → φ(x), or log φ(x) for log-space maps


class Hybrid:
    """The options of one hybrid call and the pieces every form shares."""

    def __init__(
        self, features: Features, *, log_space: bool, window: int, sinks: int, factor: torch.Tensor | None,
        scale: float, eps: float, min_denom: float | None, band: BandAverage | None = None,
    ) -> None:
        """``band``: a faster way to the band's softmax average where nothing needs its gradient (the native
        kernels), tried before :mod:`.flash_band`."""
        self.features, self.log_space, self.band = features, log_space, band
        self.window, self.sinks, self.factor, self.scale = window, sinks, factor, scale
        self.eps, self.min_denom = eps, min_denom

    def query_features(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Query features and (log-space maps) the row maximum c they are stored at."""
        qf = self.features(q, True)
        if not self.log_space:
            return qf, None
        return stabilise_queries(qf)

    def key_logs(self, k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """φ(k) (ordinary maps; 0 at masked keys) or log φ(k) (log-space; −inf at masked keys)."""
        kf = self.features(k, False)
        if keep is not None:
            kf = kf.masked_fill(~keep.unsqueeze(-1), NEG_INF if self.log_space else 0.0)
        return kf

    def stored(self, logs: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
        """Key features stored at log-scale ``at`` (..., N) (log-space maps); ordinary maps as they are."""
        return stored_at(logs, at)  # −inf only where every key so far is masked: features 0

    def combine(
        self, lin: tuple[torch.Tensor, torch.Tensor], exact: tuple[Any, ...],
        c: torch.Tensor | None, r: torch.Tensor | None,
    ) -> torch.Tensor:
        """The output from the linear (num, den) and the exact part's (num, den, mass[, log-scale]), per the module
        docstring."""
        lin_num, lin_den = lin
        win_num, win_den, mass = exact[:3]
        if self.factor is None and win_den is None:  # the window part already normalised (fused)
            assert mass is not None
            return MassCombine.apply(lin_num, lin_den, win_num, mass, self.eps, self.min_denom)
        if self.factor is None:
            assert mass is not None and win_den is not None
            share = mass / torch.where(win_den == 0, torch.ones_like(win_den), win_den)  # (..., N)
            num = lin_num + share.unsqueeze(-1) * win_num
            den = lin_den + mass
        else:
            assert win_den is not None
            gamma = self.factor.unsqueeze(-1)  # per head: (..., 1) against rows (..., N)
            if c is not None and r is not None:
                scale = c + finite(r)  # linear part's true scale: stored·e^{c+R}
                common = scale.clamp(min=0)
                lin_factor, win_factor = torch.exp(scale - common), gamma * torch.exp(-common)
                num = lin_factor.unsqueeze(-1) * lin_num + win_factor.unsqueeze(-1) * win_num
                den = lin_factor * lin_den + win_factor * win_den
            else:
                num = lin_num + gamma.unsqueeze(-1) * win_num
                den = lin_den + gamma * win_den
        return finalize(num, den, normalize=True, eps=self.eps, min_denom=self.min_denom)

    def exact_part(
        self, q: torch.Tensor, qf: torch.Tensor, r: torch.Tensor | None, band: Band, sink: Sinks | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Σ e^{s_tj − m_t} v_j, Σ e^{s_tj − m_t} over the exact keys, (mass form) M_t = Σ φ(q_t)·φ(k_j), and the
        row max m_t (−inf for a row with no exact key, whose sums are 0)."""
        n = q.shape[-2]
        size, blocks = band.size, band.blocks
        pad = blocks * size - n
        queries = q * self.scale
        qb = torch.nn.functional.pad(queries, (0, 0, 0, pad)).unflatten(-2, (blocks, size))  # (..., b, C, D)
        # (..., b, C, 2C), −inf outside the band: filled, not added (a NaN in a padded key stays out of the row)
        scores = (qb @ band.keys.transpose(-1, -2)).masked_fill_(~band.mask, NEG_INF)
        # the mass form keeps only the softmax *shape* of the exact keys, so the shift cancels exactly: it needs
        # no gradient, and the scores can be turned into probabilities in place (one pass, no copy)
        shape_only = self.factor is None
        row_max = (scores.detach() if shape_only else scores).amax(-1)  # (..., b, C)
        sink_scores = None
        if sink is not None:
            sink_scores = (queries @ sink.keys.transpose(-1, -2)).masked_fill(~sink.mask, NEG_INF)  # (..., N, S)
            sink_max = (sink_scores.detach() if shape_only else sink_scores).amax(-1)
            sink_max = torch.nn.functional.pad(sink_max, (0, pad), value=NEG_INF).unflatten(-1, (blocks, size))
            row_max = torch.maximum(row_max, sink_max)
        raw_max = row_max.flatten(-2)[..., :n]
        row_max = finite(row_max).unsqueeze(-1)  # no exact keys: weights all 0
        probs = scores.sub_(row_max).exp_() if shape_only else torch.exp(scores - row_max)  # 0 outside the band
        win_num = (probs @ band.values).flatten(-3, -2)[..., :n, :]  # (..., N, Dv)
        win_den = probs.sum(-1).flatten(-2)[..., :n]
        if sink is not None and sink_scores is not None:
            sink_probs = torch.exp(sink_scores - row_max.flatten(-3, -2)[..., :n, :])  # (..., N, S)
            win_num = win_num + sink_probs @ sink.values
            win_den = win_den + sink_probs.sum(-1)
        if self.factor is not None:
            return win_num, win_den, None, raw_max
        assert band.features is not None
        if r is None:  # every key at one scale: M_t = φ(q_t)·(sliding sum of φ(k) over the band), O(N·F)
            mass = (qf * band_sums(band.features, band.width + 1, n)).sum(-1)
        else:  # keys at their own log-scales: the band's φ(q)·φ(k) weights, moved to each query's scale
            keys = band.gather(band.features)  # (..., b, m·C, F)
            qfb = torch.nn.functional.pad(qf, (0, 0, 0, pad)).unflatten(-2, (blocks, size))  # (..., b, C, F)
            weights = qfb @ keys.transpose(-1, -2)  # (..., b, C, m·C)
            assert band.scales is not None
            rb = torch.nn.functional.pad(r, (0, pad), value=0.0).unflatten(-1, (blocks, size)).unsqueeze(-1)
            weights = weights * scale_between(band.gather_scales().unsqueeze(-2), rb, band.mask)
            mass = weights.sum(-1).flatten(-2)[..., :n]
        if sink is not None and sink.features is not None:
            sink_weights = qf @ sink.features.transpose(-1, -2)  # (..., N, S)
            if r is not None:
                assert sink.scales is not None
                sink_weights = sink_weights * scale_between(sink.scales.unsqueeze(-2), r.unsqueeze(-1), sink.mask)
            else:
                sink_weights = sink_weights.masked_fill(~sink.mask, 0.0)
            mass = mass + sink_weights.sum(-1)
        return win_num, win_den, mass, raw_max


class MassCombine(torch.autograd.Function):
    """out = (num_lin + M·A) / d, d = den_lin + M + eps (clamped and guarded as
    :func:`linattn.kinds.additive.forms._common.finalize`): the mass form's output from the linear part's (num, den),
    the window's softmax average A and its mass M, in one pass forward and without keeping the numerator (autograd
    would keep num_lin + M·A for the division)."""

    @staticmethod
    def forward(
        ctx: Any, lin_num: torch.Tensor, lin_den: torch.Tensor, a: torch.Tensor, mass: torch.Tensor, eps: float,
        min_denom: float | None,
    ) -> torch.Tensor:
        divisor, constant = causal_fn._denominator(lin_den + mass + eps, min_denom)  # (..., N)
        out = torch.addcmul(lin_num, mass.unsqueeze(-1), a).div_(divisor.unsqueeze(-1))  # (..., N, Dv)
        ctx.save_for_backward(a, mass, divisor, constant, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @causal_fn._without_autocast  # backward may run inside an autocast region: recompute in the forward's dtypes
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, mass, divisor, constant, out = ctx.saved_tensors
        scaled = grad / divisor.unsqueeze(-1)  # ∂L/∂num
        grad_den = rowdot(scaled, out).neg_().masked_fill_(constant, 0.0)  # 0 where d is constant
        grad_a = scaled * mass.unsqueeze(-1) if ctx.needs_input_grad[2] else None
        grad_mass = rowdot(scaled, a).add_(grad_den)
        return scaled, grad_den, grad_a, grad_mass, None, None
