"""The hybrid's exact part as one autograd Function: banded softmax in cache-sized groups, recompute in backward.

Layout as :class:`.window_band.Band`: query i sees rows i … i + B of a key sequence (B = ``width``), rows y < ``front``
and past the last key being empty. Queries go in blocks of C (B ≤ C); block b's band keys are key blocks b and b+1,
and the S sink keys (the first tokens, exact for the queries whose window has left them) follow them, so a block's
scores are one (C, 2C + S) tile: a fixed band mask on the first 2C columns, the sink mask on the last S. The key
sequence is given as a short ``prefix`` (< C rows: the empty front rows and the carried window keys) and this call's
keys, and is never joined at full length; sink keys are a carried prefix plus this call's first ``fresh`` keys.

Forward, per group of blocks that fits in cache: scores, masks, row max m, p = e^{s−m}, l = Σp, A = (p V)/l, and
(ordinary maps) the mass M_t = φ(q_t)·Σ_exact φ(k), as the tile's 0/1 matrix times the group's key features.
Outputs A (R, N, Dv), lse = m + log l (R, N), m (R, N) and M (R, N) or None (R = batch×heads); saved: the inputs,
A, lse, m. Nothing of size N·C is kept, so training memory is O(N·(D + Dv + F)).

Backward recomputes each group's scores. With P = e^{s − lse} (the normalised softmax over the exact keys):
    ∂L/∂s_ty = P_ty (dA_t·v_y − dA_t·A_t + ∂L/∂lse_t) + [s_ty = m_t] ∂L/∂m_t / #ties
(ties share ∂L/∂m as torch.amax's gradient does), then ∂L/∂q = ∂L/∂s K·scale, ∂L/∂k = ∂L/∂sᵀ q·scale,
∂L/∂v = Pᵀ dA, and for the mass ∂L/∂φ(q_t) = ∂L/∂M_t Σ_exact φ(k), ∂L/∂φ(k) = (tile 0/1)ᵀ (∂L/∂M ⊙ φ(q)).

Precondition (the callers in :mod:`.window` check it): no padding, so every query has at least one key in its
band (its own), and m and lse are finite on every row.
"""

from __future__ import annotations

from typing import Any

import torch

from . import causal_fn
from ._common import NEG_INF

# Score elements per group over all batch×head rows: 2^18 fp32 = 1 MiB, so a group's tiles stay in cache.
# Measured (one thread, B·H = 8, C = 64, N = 16384): the grouped forward ran ~1.7× faster than one pass over all
# blocks at once, whose (..., b, C, 2C) temporaries are each 64 MiB.
GROUP_ELEMENTS = 1 << 18
# Query block C of the tiles: a band of width B needs m = 1 + ⌈B/C⌉ key blocks, so C = 32 at W = 64 scores 96 keys
# per query where C = 64 scores 128. Measured (one thread, N = 16384, 8 heads, D = 64, W = 64): C = 32 ran the
# forward and backward of this Function faster than 64 and than 16 (docs/window.md, "Measured: speed").
TILE = 32


def tile_size(width: int) -> int:
    """The query block for a band of width B: TILE, or 16 for a band of width ≤ 16 (two key blocks)."""
    return 16 if width <= 16 else TILE

Pair = tuple[torch.Tensor, torch.Tensor]


def rows(prefix: torch.Tensor, main: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows lo … hi−1 of [prefix; main; zeros] (R, ·, D) → (R, hi−lo, D); a copy of hi−lo rows at most."""
    p, total = prefix.shape[1], prefix.shape[1] + main.shape[1]
    pieces = []
    if lo < p:
        pieces.append(prefix[:, lo : min(hi, p)])
    if hi > p and lo < total:
        pieces.append(main[:, max(lo, p) - p : min(hi, total) - p])
    if hi > max(lo, total):
        pieces.append(main.new_zeros(main.shape[0], hi - max(lo, total), main.shape[2]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


def _blocks(x: torch.Tensor, first: int, count: int, size: int) -> torch.Tensor:
    """Rows of query blocks first … first+count−1 of x (R, N, ·), zero past the end: (R, count, C, ·)."""
    part = x[:, first * size : (first + count) * size]
    missing = count * size - part.shape[1]
    if missing:
        part = torch.cat([part, part.new_zeros(part.shape[0], missing, part.shape[2])], 1)
    return part.unflatten(1, (count, size))


class _Layout:
    """The geometry of one call — band, empty rows, sinks — and each group's tiles, shared by forward and backward."""

    def __init__(
        self, q: torch.Tensor, size: int, width: int, front: int, num_keys: int, sink_mask: torch.Tensor | None,
        scale: float,
    ) -> None:
        self.spans = spans = 1 + -(-width // size)  # key blocks per query block: B ≤ (spans − 1)·C
        local = torch.arange(spans * size, device=q.device) - torch.arange(size, device=q.device).unsqueeze(-1)
        in_band = (local >= 0) & (local <= width)  # (C, m·C)
        self.bias = torch.zeros(in_band.shape, dtype=q.dtype, device=q.device).masked_fill_(~in_band, NEG_INF)
        self.ones = in_band.to(q.dtype)
        self.size, self.front, self.num_keys, self.scale = size, front, num_keys, scale
        self.sink_mask = sink_mask  # (R, N, S) or None
        self.n = q.shape[1]
        self.blocks = -(-self.n // size)
        columns = spans * size + (sink_mask.shape[-1] if sink_mask is not None else 0)
        self.group = max(1, GROUP_ELEMENTS // (q.shape[0] * size * columns))

    def keys(self, prefix: torch.Tensor, main: torch.Tensor, sinks: torch.Tensor | None, first: int, count: int
             ) -> torch.Tensor:
        """The tile's keys for blocks first …: key blocks b … b+m−1, then the sinks: (R, count, m·C + S, ·)."""
        size, spans = self.size, self.spans
        joined = rows(prefix, main, first * size, (first + count + spans - 1) * size)
        joined = joined.unflatten(1, (count + spans - 1, size))  # (R, G + m − 1, C, ·)
        pieces = [joined[:, j : j + count] for j in range(spans)]
        if sinks is not None:
            pieces.append(sinks.unsqueeze(1).expand(-1, count, -1, -1))
        return torch.cat(pieces, dim=2)

    def sink_blocks(self, first: int, count: int) -> torch.Tensor:
        assert self.sink_mask is not None
        return _blocks(self.sink_mask, first, count, self.size)  # (R, G, C, S), False on padded rows

    def scores(self, qg: torch.Tensor, kg: torch.Tensor, first: int) -> torch.Tensor:
        """Scaled queries (R, G, C, D) against their tile's keys (R, G, m·C + S, D) → masked scores."""
        count, columns = qg.shape[1], self.spans * self.size
        scores = torch.matmul(qg, kg.transpose(-1, -2))  # (R, G, C, m·C + S)
        band = scores[..., :columns]
        band.add_(self.bias)
        if first * self.size < self.front or (first + count + self.spans - 1) * self.size > self.num_keys:
            # empty rows lie only at the two ends
            row = (first + torch.arange(count, device=qg.device)).unsqueeze(-1) * self.size
            row = row + torch.arange(columns, device=qg.device)  # (G, m·C): each tile's key rows
            band.masked_fill_(((row < self.front) | (row >= self.num_keys)).unsqueeze(-2), NEG_INF)
        if self.sink_mask is not None:
            scores[..., columns:].masked_fill_(~self.sink_blocks(first, count), NEG_INF)
        return scores

    def mass_weights(self, first: int, count: int) -> torch.Tensor:
        """The tile's 0/1 matrix of exact keys (the scores' mask), (C, m·C) or (R, G, C, m·C + S)."""
        if self.sink_mask is None:
            return self.ones
        sinks = self.sink_blocks(first, count).to(self.ones.dtype)
        return torch.cat([self.ones.expand(*sinks.shape[:-1], -1), sinks], dim=-1)


def _scatter(
    target: torch.Tensor, sink_grad: torch.Tensor | None, tiles: torch.Tensor, first: int, size: int, spans: int
) -> None:
    """Adds a tile's key-side gradient (R, G, m·C + S, D) into target (R, rows, D) (viewed as blocks of C) and the
    sinks' share into sink_grad (R, S, D)."""
    blocks = target.unflatten(1, (-1, size))
    count = tiles.shape[1]
    for j in range(spans):
        blocks[:, first + j : first + j + count] += tiles[:, :, j * size : (j + 1) * size]
    if sink_grad is not None:
        sink_grad += tiles[:, :, spans * size :].sum(1)


class BandSoftmax(torch.autograd.Function):
    """(q, keys, values, sink keys/values, φ(q), φ(k), φ(sink keys), sink mask) → (A, lse, m, M); see the module
    docstring. Operands are (R, ·, ·); keys etc. come as (prefix, this call's), sinks as the carried ones plus
    ``fresh`` of this call's first keys; the feature operands may be None (no mass), sink_mask None (no sinks)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v_pre: torch.Tensor, v: torch.Tensor,
        sk_pre: torch.Tensor, sv_pre: torch.Tensor, fq: torch.Tensor | None, fk_pre: torch.Tensor | None,
        fk: torch.Tensor | None, fsk_pre: torch.Tensor | None, sink_mask: torch.Tensor | None, scale: float,
        size: int, width: int, front: int, fresh: int,
    ) -> tuple[torch.Tensor | None, ...]:
        batch, n = q.shape[0], q.shape[1]
        layout = _Layout(q, size, width, front, k_pre.shape[1] + k.shape[1], sink_mask, scale)
        sinks = sink_mask is not None
        sk = torch.cat([sk_pre, k[:, :fresh]], 1) if sinks else None  # (R, S, ·)
        sv = torch.cat([sv_pre, v[:, :fresh]], 1) if sinks else None
        fsk = torch.cat([fsk_pre, fk[:, :fresh]], 1) if sinks and fk is not None and fsk_pre is not None else None
        rows_out = layout.blocks * size
        out = q.new_empty(batch, rows_out, v.shape[2])  # rows past n dropped below
        lse, top = q.new_empty(batch, rows_out), q.new_empty(batch, rows_out)
        mass = q.new_empty(batch, rows_out) if fq is not None else None
        for first in range(0, layout.blocks, layout.group):
            count = min(layout.group, layout.blocks - first)
            span = slice(first * size, (first + count) * size)
            scores = layout.scores(_blocks(q, first, count, size) * scale, layout.keys(k_pre, k, sk, first, count),
                                   first)
            m = scores.amax(-1, keepdim=True)  # (R, G, C, 1): finite, every row has its own key
            p = scores.sub_(m).exp_()
            total = p.sum(-1, keepdim=True)
            a = torch.matmul(p, layout.keys(v_pre, v, sv, first, count)).div_(total)  # (R, G, C, Dv)
            out[:, span] = a.flatten(1, 2)
            lse[:, span] = (m + total.log()).flatten(1)
            top[:, span] = m.flatten(1)
            if mass is not None and fq is not None and fk_pre is not None and fk is not None:
                sums = torch.matmul(layout.mass_weights(first, count), layout.keys(fk_pre, fk, fsk, first, count))
                mass[:, span] = (_blocks(fq, first, count, size) * sums).sum(-1).flatten(1)  # sums (R, G, C, F)
        out, lse, top = out[:, :n], lse[:, :n], top[:, :n]
        ctx.save_for_backward(q, k_pre, k, v_pre, v, sk_pre, sv_pre, fq, fk_pre, fk, fsk_pre, sink_mask, out, lse, top)
        ctx.options = (scale, size, width, front, fresh)
        ctx.set_materialize_grads(False)
        return out, lse, top, mass[:, :n] if mass is not None else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, grad_top: torch.Tensor | None,
        grad_mass: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k_pre, k, v_pre, v, sk_pre, sv_pre, fq, fk_pre, fk, fsk_pre, sink_mask, out, lse, top = ctx.saved_tensors
        scale, size, width, front, fresh = ctx.options
        batch, n = q.shape[0], q.shape[1]
        layout = _Layout(q, size, width, front, k_pre.shape[1] + k.shape[1], sink_mask, scale)
        sinks = sink_mask is not None
        sk = torch.cat([sk_pre, k[:, :fresh]], 1) if sinks else None
        sv = torch.cat([sv_pre, v[:, :fresh]], 1) if sinks else None
        with_mass = grad_mass is not None and fq is not None and fk_pre is not None and fk is not None
        fsk = torch.cat([fsk_pre, fk[:, :fresh]], 1) if with_mass and sinks and fk is not None else None
        key_rows = (layout.blocks + layout.spans - 1) * size  # every gathered row: the scatter views whole blocks

        def grads(like: torch.Tensor) -> Pair:  # zeroed gradients of the band's rows and of the sinks
            return q.new_zeros(batch, key_rows, like.shape[2]), q.new_zeros(batch, sk_pre.shape[1] + fresh,
                                                                             like.shape[2])

        grad_q = q.new_empty(batch, layout.blocks * size, q.shape[2])
        grad_k, grad_v = grads(k), grads(v)
        grad_fq = grad_fk = None
        if with_mass and fq is not None and fk is not None:
            grad_fq, grad_fk = q.new_empty(batch, layout.blocks * size, fq.shape[2]), grads(fk)
        grad_a = grad_out if grad_out is not None else torch.zeros_like(out)
        shift = -(grad_a * out).sum(-1)  # −dA·A (R, N): the softmax's own term
        if grad_lse is not None:
            shift = shift + grad_lse
        pad = layout.blocks * size - n
        shift, lse, top = (torch.nn.functional.pad(x, (0, pad)).unsqueeze(-1) for x in (shift, lse, top))
        grad_top = torch.nn.functional.pad(grad_top, (0, pad)).unsqueeze(-1) if grad_top is not None else None
        for first in range(0, layout.blocks, layout.group):
            count = min(layout.group, layout.blocks - first)
            span = slice(first * size, (first + count) * size)
            qg = _blocks(q, first, count, size) * scale
            kg = layout.keys(k_pre, k, sk, first, count)
            vg = layout.keys(v_pre, v, sv, first, count)
            ga = _blocks(grad_a, first, count, size)  # (R, G, C, Dv); zero on padded rows, so their grads are 0
            scores = layout.scores(qg, kg, first)
            grad_s = torch.matmul(ga, vg.transpose(-1, -2)).add_(_blocks(shift, first, count, size))
            if grad_top is not None:  # ∂L/∂m reaches the score(s) equal to the row max
                ties = scores == _blocks(top, first, count, size)
                share = _blocks(grad_top, first, count, size) / ties.sum(-1, keepdim=True).clamp(min=1)
            p = scores.sub_(_blocks(lse, first, count, size)).exp_()  # P (R, G, C, 2C + S)
            grad_s.mul_(p)
            if grad_top is not None:
                grad_s += ties * share
            grad_q[:, span] = torch.matmul(grad_s, kg).mul_(scale).flatten(1, 2)
            _scatter(*grad_k, torch.matmul(grad_s.transpose(-1, -2), qg), first, size, layout.spans)
            _scatter(*grad_v, torch.matmul(p.transpose(-1, -2), ga), first, size, layout.spans)
            if grad_fq is not None and grad_fk is not None and grad_mass is not None and fq is not None:
                gm = _blocks(grad_mass.unsqueeze(-1), first, count, size)  # (R, G, C, 1)
                weights = layout.mass_weights(first, count)
                sums = torch.matmul(weights, layout.keys(fk_pre, fk, fsk, first, count))  # (R, G, C, F)
                grad_fq[:, span] = (gm * sums).flatten(1, 2)
                _scatter(*grad_fk, torch.matmul(weights.transpose(-1, -2), gm * _blocks(fq, first, count, size)),
                         first, size, layout.spans)
        pre, own = k_pre.shape[1], sk_pre.shape[1]

        def split(pair: Pair | None) -> tuple[torch.Tensor | None, ...]:
            """(band rows, sinks) → ∂L/∂(prefix, this call's rows, carried sinks)."""
            if pair is None:
                return None, None, None
            band, sink = pair
            main = band[:, pre : pre + k.shape[1]]
            if fresh:
                main[:, :fresh] += sink[:, own:]  # this call's first keys are sinks too
            return band[:, :pre], main, sink[:, :own]

        gk_pre, gk, gsk = split(grad_k)
        gv_pre, gv, gsv = split(grad_v)
        gfk_pre, gfk, gfsk = split(grad_fk)
        gfq = grad_fq[:, :n] if grad_fq is not None else None
        return (grad_q[:, :n], gk_pre, gk, gv_pre, gv, gsk if sinks else None, gsv if sinks else None, gfq, gfk_pre,
                gfk, gfsk if sinks else None, None, None, None, None, None, None)


def exact_part(
    q: torch.Tensor, scale: float, shape_only: bool, keys: Pair, values: Pair,
    features: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, size: int, width: int, front: int,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What :meth:`.window.Hybrid.exact_part` returns, from the banded Function. keys, values: (prefix (..., P, ·),
    this call's (..., N, ·)); features: (φ(q), φ(k) prefix, φ(k)) for the mass, or None; sinks: the carried sink
    keys, values, features (..., S0, ·), the mask (..., N, S) and how many of this call's first keys are sinks.

    Mass form (``shape_only``): (A, None, M) — the softmax over the exact keys already normalised. Factor form:
    (Σ e^{s−m} v, Σ e^{s−m}, None) with m the exact row max (differentiable: the form's definition).
    """
    batch, n = q.shape[:-2], q.shape[-2]
    count = batch.numel()

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.expand(*batch, *x.shape[-2:]).reshape(count, *x.shape[-2:])  # (..., L, D) → (R, L, D)

    fq = fk_pre = fk = fsk_pre = mask = None
    fresh = 0
    sk_pre, sv_pre = keys[0][..., :0, :], values[0][..., :0, :]
    if features is not None:
        fq, fk_pre, fk = (flat(x) for x in features)
    if sinks is not None:
        sk_pre, sv_pre, fsk, mask, fresh = sinks
        mask = flat(mask)
        if features is not None and fsk is not None:
            fsk_pre = flat(fsk)
    a, lse, top, mass = BandSoftmax.apply(
        flat(q), flat(keys[0]), flat(keys[1]), flat(values[0]), flat(values[1]), flat(sk_pre), flat(sv_pre), fq,
        fk_pre, fk, fsk_pre, mask, scale, size, width, front, fresh,
    )
    a = a.reshape(*batch, n, a.shape[-1])
    if shape_only:
        return a, None, mass.reshape(*batch, n) if mass is not None else None
    weight = torch.exp(lse - top).reshape(*batch, n)  # Σ_exact e^{s−m}
    return weight.unsqueeze(-1) * a, weight, None


class MassCombine(torch.autograd.Function):
    """out = (num_lin + M·A) / d, d = den_lin + M + eps (clamped and guarded as :func:`._common.finalize`): the mass
    form's output from the linear part's (num, den), the window's softmax average A and its mass M, in one pass
    forward and without keeping the numerator (autograd would keep num_lin + M·A for the division)."""

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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, mass, divisor, constant, out = ctx.saved_tensors
        scaled = grad / divisor.unsqueeze(-1)  # ∂L/∂num
        grad_den = torch.linalg.vecdot(scaled, out).neg_().masked_fill_(constant, 0.0)  # 0 where d is constant
        grad_a = scaled * mass.unsqueeze(-1) if ctx.needs_input_grad[2] else None
        grad_mass = torch.linalg.vecdot(scaled, a).add_(grad_den)
        return scaled, grad_den, grad_a, grad_mass, None, None
