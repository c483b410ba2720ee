"""The sparse cache's per-block term of the chunked form, as one autograd Function that recomputes its tiles.

Query block b (B queries at flat positions b·B … b·B + B − 1 of the padded call) meets the U rows of X that its
cache names, ``rows`` (..., b, U) (−1: none), at positions ``positions`` (..., b, U). The first ``slots`` of
them are the block's cache; the rest (when present) are the pairs the carried state held cached, added to the
linear part once dropped (``outside`` (..., b, slots): the held pair is not in the block's cache). For query t
and row j at position p:

- exact when j < slots, p ≥ 0 and p + W ≤ t: the score s = scale·q·k enters the exact part, and its linear
  weight w = φ(q)·φ(k) leaves the linear part if the shifted linear part counted it (p + W ≥ n0) and joins the
  exact part's mass;
- a held pair outside the block's cache: its linear weight joins the linear part.

The exact scores are taken against one shift per query, top = max(m_window, max_j s) (the window's own row max
m_window, −inf read as 0), so that the window's sums join the cache's as Σ e^{s − top}. Outputs per query: the
linear part's (num, den) additions, the exact part's Σ e^{s − top}·v and Σ e^{s − top}, the mass Σ_exact w, and
top. Only O(N) rows are kept for backward (and the indices): every (B, U) tile of scores and weights is
recomputed, the way the window's exact part is. In the mass form (``shape_only``) top is a shift that cancels
and takes no gradient; in the γ form it is part of the definition and its gradient reaches the maximum's score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...features import NEG_INF, finite
from ...kinds.additive.forms import causal_fn

TILE_ELEMENTS = 1 << 18  # elements of one (rows, blocks, B, U) tile: small enough to stay in cache


@dataclass(frozen=True)
class Geometry:
    """Where the blocks are: the call starts at n0, the first block at n0 − front; B tokens per block."""

    n0: int
    front: int
    block: int
    window: int
    slots: int
    scale: float
    shape_only: bool
    linear: bool = True  # whether the linear part's additions and the mass are wanted (else zeros, not computed)


def _tile_blocks(rows: int, block: int, width: int) -> int:
    return max(1, TILE_ELEMENTS // max(1, rows * block * width))


class _Tile:
    """One tile's gathered rows and masks: blocks g0 … g1 − 1 of every batch row."""

    def __init__(self, geo: Geometry, q: torch.Tensor, qf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 features: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, outside: torch.Tensor | None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None, g0: int, g1: int) -> None:
        b0, b1 = g0 * geo.block, g1 * geo.block
        count = g1 - g0
        r = q.shape[0]
        self.q = q[:, b0:b1].view(r, count, geo.block, -1)
        self.qf = qf[:, b0:b1].view(r, count, geo.block, -1)
        index = rows[:, g0:g1]  # (R, G, U)
        self.valid = index >= 0
        self.flat = (index.clamp(min=0) + (torch.arange(r, device=q.device) * keys.shape[1]).view(r, 1, 1)).flatten()
        shape = (*index.shape, -1)
        slots = geo.slots
        self.slot_flat = self.flat.view(index.shape)[..., :slots]  # the block's cache (the keys scored exactly)
        self.keys = keys.flatten(0, 1).index_select(0, self.slot_flat.flatten()).view(*index.shape[:-1], slots, -1)
        self.values = values.flatten(0, 1).index_select(0, self.flat).view(shape)
        self.features = features.flatten(0, 1).index_select(0, self.flat).view(shape) if geo.linear else None
        pos = positions[:, g0:g1, :slots].unsqueeze(-2)  # (R, G, 1, L)
        query_pos = (geo.n0 - geo.front + torch.arange(b0, b1, device=q.device)).view(1, count, geo.block, 1)
        self.exact = (pos >= 0) & (pos + geo.window <= query_pos)  # (R, G, B, L)
        self.coef = self.exact.new_zeros(()).to(q.dtype)  # unread without the linear additions
        if geo.linear:
            counted = self.exact & (pos + geo.window >= geo.n0)  # the shifted linear part counted it
            coef = -counted.to(q.dtype)
            if outside is not None:  # the held pairs: +1 where dropped from the block's cache
                held = outside[:, g0:g1].unsqueeze(-2).to(q.dtype).expand(r, count, geo.block, slots)
                coef = torch.cat([coef, held], -1)
            self.coef = coef
        self.gain: torch.Tensor | None = None  # log-space maps: e^{m_j − R_t} (R, G, B, U), ≤ 1
        if scales is not None:
            row_scale = scales[0].flatten().index_select(0, self.flat).view(index.shape).masked_fill(~self.valid,
                                                                                                     NEG_INF)
            query_scale = scales[1][:, b0:b1].view(r, count, geo.block, 1)
            apart = torch.where(row_scale.unsqueeze(-2) == NEG_INF, NEG_INF, row_scale.unsqueeze(-2) - query_scale)
            self.gain = torch.exp(apart.clamp(max=0.0))

    def weights(self) -> torch.Tensor:
        assert self.features is not None
        weights = self.qf @ self.features.transpose(-1, -2)  # (R, G, B, U)
        return weights if self.gain is None else weights.mul_(self.gain)

    def scores(self, geo: Geometry) -> torch.Tensor:
        scores = (self.q @ self.keys.transpose(-1, -2)).mul_(geo.scale)
        return scores.masked_fill_(~self.exact, NEG_INF)


class CacheTerm(torch.autograd.Function):
    """(lin_num, lin_den, ex_num, ex_den, mass, top) of the per-block cache term (see the module docstring).

    q (R, P, D) and qf (R, P, F) padded to P = blocks·B; keys, values, features (R, X, ·) the rows X; ls (R, P)
    the window's row max (−inf: none); rows, positions (R, blocks, U) int64; outside (R, blocks, slots) bool or
    None; log-space maps: ``scales`` = (each row's own maximum m (R, X), each query's R_t (R, P), +inf at padding)
    as constants, the features at m, so that a linear weight is (φ̃(q_t)·φ̃_j)·e^{m_j − R_t} at the query's stored
    scale (the caller restores the gradient through R_t). Outputs (R, P, ·)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, qf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                features: torch.Tensor, ls: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                outside: torch.Tensor | None, geo: Geometry,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        r, p, dv = q.shape[0], q.shape[1], values.shape[-1]
        blocks, width = rows.shape[1], rows.shape[-1]
        make = q.new_empty if geo.linear else q.new_zeros
        lin_num, ex_num = make(r, p, dv), q.new_empty(r, p, dv)
        lin_den, mass = make(r, p), make(r, p)
        ex_den, top = q.new_empty(r, p), q.new_empty(r, p)
        best = torch.full((r, p), -1, dtype=torch.long, device=q.device)  # γ form: the maximum's row, or −1
        window_won = torch.zeros(r, p, dtype=torch.bool, device=q.device)  # γ form: the window's max is top
        step = _tile_blocks(r, geo.block, width)
        for g0 in range(0, blocks, step):
            g1 = min(blocks, g0 + step)
            tile = _Tile(geo, q, qf, keys, values, features, rows, positions, outside, scales, g0, g1)
            at = slice(g0 * geo.block, g1 * geo.block)
            s = tile.scores(geo)
            local, arg = s.amax(-1), None
            if not geo.shape_only:
                local, arg = s.max(-1)
            window_max = ls[:, at].view(local.shape)
            shift = finite(torch.maximum(window_max, local))
            probs = s.sub_(shift.unsqueeze(-1)).exp_()  # 0 where not exact
            padded = torch.nn.functional.pad(probs, (0, width - geo.slots))
            if geo.linear:
                w = tile.weights()
                moved = w * tile.coef
                sums = torch.cat([moved, padded], -2) @ tile.values
                lin_num[:, at] = sums[:, :, : geo.block].reshape(r, -1, dv)
                ex_num[:, at] = sums[:, :, geo.block :].reshape(r, -1, dv)
                lin_den[:, at] = moved.sum(-1).view(r, -1)
                mass[:, at] = (w[..., : geo.slots] * tile.exact).sum(-1).view(r, -1)
            else:
                ex_num[:, at] = (padded @ tile.values).reshape(r, -1, dv)
            ex_den[:, at] = probs.sum(-1).view(r, -1)
            top[:, at] = shift.view(r, -1)
            if arg is not None:  # γ form: which score, if any, is the row's maximum
                slot_rows = tile.slot_flat.unsqueeze(-2).expand(*arg.shape, geo.slots)
                won = (local >= window_max) & (local > NEG_INF)
                best[:, at] = torch.where(won, slot_rows.gather(-1, arg.unsqueeze(-1)).squeeze(-1), -1).view(r, -1)
                window_won[:, at] = (~won & (window_max > NEG_INF)).view(r, -1)
        ctx.geo, ctx.scales = geo, scales  # (constants: no gradient)
        ctx.save_for_backward(q, qf, keys, values, features, rows, positions, outside, top, best, window_won)
        if geo.shape_only:
            ctx.mark_non_differentiable(top)
        return lin_num, lin_den, ex_num, ex_den, mass, top

    @staticmethod
    @torch.autograd.function.once_differentiable
    @causal_fn._without_autocast
    def backward(ctx: Any, g_ln: torch.Tensor | None, g_ld: torch.Tensor | None, g_en: torch.Tensor | None,
                 g_ed: torch.Tensor | None, g_m: torch.Tensor | None, g_top: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        q, qf, keys, values, features, rows, positions, outside, top, best, window_won = ctx.saved_tensors
        geo: Geometry = ctx.geo
        scales = ctx.scales
        r, p, dv = q.shape[0], q.shape[1], values.shape[-1]
        blocks, width = rows.shape[1], rows.shape[-1]

        def grad(x: torch.Tensor | None, *shape: int) -> torch.Tensor:
            return x if x is not None else q.new_zeros(*shape)

        g_ln, g_en = grad(g_ln, r, p, dv), grad(g_en, r, p, dv)
        g_ld, g_ed, g_m = grad(g_ld, r, p), grad(g_ed, r, p), grad(g_m, r, p)
        d_q, d_qf = torch.zeros_like(q), torch.zeros_like(qf)
        spare = 1  # a row for the indices −1
        d_keys = q.new_zeros(r * keys.shape[1] + spare, keys.shape[-1])
        d_values = q.new_zeros(r * values.shape[1] + spare, dv)
        d_features = q.new_zeros(r * features.shape[1] + spare, features.shape[-1])
        d_top = q.new_zeros(r, p)  # ∂L/∂top with the scores held: −Σ_j ∂L/∂s_j, plus the output's own
        step = _tile_blocks(r, geo.block, width)
        for g0 in range(0, blocks, step):
            g1 = min(blocks, g0 + step)
            count = g1 - g0
            tile = _Tile(geo, q, qf, keys, values, features, rows, positions, outside, scales, g0, g1)
            at = slice(g0 * geo.block, g1 * geo.block)
            shape = (r, count, geo.block)
            probs = tile.scores(geo).sub_(top[:, at].view(*shape, 1)).exp_()
            target = torch.where(tile.valid.flatten(), tile.flat, d_keys.shape[0] - 1)
            if geo.linear:  # the linear additions and the mass: through the weights w = φ(q)·φ(k)
                w = tile.weights()
                moved = w * tile.coef
                upstream = torch.stack([g_ln[:, at].view(*shape, dv), g_en[:, at].view(*shape, dv)], 2)
                d_pair = upstream.flatten(2, 3) @ tile.values.transpose(-1, -2)  # (R, G, 2B, U)
                d_moved = d_pair[:, :, : geo.block].add_(g_ld[:, at].view(*shape, 1))
                d_probs = d_pair[:, :, geo.block :, : geo.slots].add_(g_ed[:, at].view(*shape, 1))
                d_w = d_moved.mul_(tile.coef)
                d_w[..., : geo.slots] += g_m[:, at].view(*shape, 1) * tile.exact
                if tile.gain is not None:
                    d_w.mul_(tile.gain)
                d_v = moved.transpose(-1, -2) @ upstream[:, :, 0]
                assert tile.features is not None
                d_qf[:, at] = (d_w @ tile.features).view(r, -1, qf.shape[-1])
                d_features.index_add_(0, target, (d_w.transpose(-1, -2) @ tile.qf).flatten(0, 2))
                exact_upstream = upstream[:, :, 1]
            else:  # the exact sums alone
                exact_upstream = g_en[:, at].view(*shape, dv)
                d_probs = (exact_upstream @ tile.values.transpose(-1, -2))[..., : geo.slots]
                d_probs.add_(g_ed[:, at].view(*shape, 1))
                d_v = q.new_zeros(r, count, width, dv)
            d_s = d_probs.mul_(probs)  # 0 where not exact
            d_top[:, at] = -d_s.sum(-1).view(r, -1)
            d_v[..., : geo.slots, :] += probs.transpose(-1, -2) @ exact_upstream
            d_q[:, at] = (d_s @ tile.keys).mul_(geo.scale).view(r, -1, q.shape[-1])
            d_k = (d_s.transpose(-1, -2) @ tile.q).mul_(geo.scale)
            d_values.index_add_(0, target, d_v.flatten(0, 2))
            d_keys.index_add_(0, target.view(r, count, width)[..., : geo.slots].flatten(), d_k.flatten(0, 2))
        d_ls = None
        if not geo.shape_only:  # top = max(window max, cache max): its gradient goes to whichever is larger
            total = d_top + g_top if g_top is not None else d_top
            cache_won = best >= 0
            row = best.clamp(min=0).flatten()
            picked = (total * cache_won).flatten().unsqueeze(-1) * geo.scale
            d_q.flatten(0, 1).add_(picked * keys.flatten(0, 1).index_select(0, row))
            d_keys.index_add_(0, torch.where(cache_won.flatten(), row, d_keys.shape[0] - 1),
                              picked * q.flatten(0, 1))
            d_ls = total * window_won
        return (d_q, d_qf, d_keys[:-1].view_as(keys), d_values[:-1].view_as(values),
                d_features[:-1].view_as(features), d_ls, None, None, None, None, None)
