"""The hybrid's exact part as one autograd Function: banded softmax in cache-sized tiles, recompute in backward.

Layout as :class:`.band.Band`: query i sees rows i … i + B of a key sequence (B = ``width``), rows y < ``front``
and past the last key being empty. Queries go in blocks of C; block b's band keys lie in key blocks b … b+m−1
(m = 1 + ⌈B/C⌉), so its band scores are one (C, m·C) tile with one fixed band mask. The S sink keys (the first
tokens, exact for the queries whose window has left them) are scored as a separate (C, S) tile with the sink mask,
inside the same softmax. The key sequence comes as a short ``prefix`` (the empty front rows and the carried window
keys, fewer than m·C rows) and this call's keys, and is never joined at full length: a run of blocks whose keys all
lie in this call's keys (the interior, nearly all of a long call) reads them, one batch×head row at a time, as an
overlapping strided view (tile b starts C rows after tile b−1), and only the few blocks at the two ends gather.
Sink keys are a carried prefix plus this call's first ``fresh`` keys.

Forward, per tile of blocks that fits in cache: scores, masks, row max m, p = e^{s−m}, l = Σp, A = (p V)/l, and
(ordinary maps) the mass M_t = φ(q_t)·Σ_exact φ(k), as the band's 0/1 matrix times the tile's key features.
Outputs A (R, N, Dv), lse = m + log l (R, N), m (R, N) and M (R, N) or None (R = batch×heads); saved: the inputs,
A, lse, m. Nothing of size N·C is kept, so training memory is O(N·(D + Dv + F)).

Backward recomputes each tile's scores. With P = e^{s − lse} (the normalised softmax over the exact keys):
    ∂L/∂s_ty = P_ty (dA_t·v_y − dA_t·A_t + ∂L/∂lse_t) + [s_ty = m_t] ∂L/∂m_t / #ties
(ties share ∂L/∂m as torch.amax's gradient does), then ∂L/∂q = ∂L/∂s K·scale, ∂L/∂k = ∂L/∂sᵀ q·scale,
∂L/∂v = Pᵀ dA, and for the mass ∂L/∂φ(q_t) = ∂L/∂M_t Σ_exact φ(k), ∂L/∂φ(k) = (band 0/1)ᵀ (∂L/∂M ⊙ φ(q)) (sinks:
their mask in place of the band's).

Precondition (the callers in :mod:`.chunked` check it): no padding, so every query has at least one key in its
band (its own), and m and lse are finite on every row.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...features import NEG_INF
from ...kinds.additive.forms import causal_fn
from ...kinds.additive.forms._common import rowdot
from . import flash_band
from .band import BandAverage, rows

# Score elements per tile: 2^18 fp32 = 1 MiB, so a tile's temporaries stay in cache. Measured (one thread, B·H = 8,
# N = 16384): tiles of 2^16–2^18 ran this Function's forward + backward alike, 2^19–2^20 ~15% slower, and one
# pass over all blocks at once (the earlier code: (..., b, C, 2C) temporaries of 64 MiB each) ~1.7× slower.
GROUP_ELEMENTS = 1 << 18
# Query block C of the tiles: a band of width B needs m = 1 + ⌈B/C⌉ key blocks, so C = 32 at W = 64 scores 96 keys
# per query where C = 64 scores 128. Measured (one thread, N = 16384, 8 heads, D = 64, W = 64): C = 32 ran the
# forward and backward of this Function faster than 64 and than 16 (docs/window.md, "Measured: speed").
TILE = 32


def tile_size(width: int) -> int:
    """The query block for a band of width B: TILE, or 16 for a band of width ≤ 16 (two key blocks)."""
    return 16 if width <= 16 else TILE

Pair = tuple[torch.Tensor, torch.Tensor]
Tile = tuple[int | None, int, int]  # (batch×head row, or None for all rows at once; first block; number of blocks)


def _add_rows(prefix: torch.Tensor, main: torch.Tensor, lo: int, x: torch.Tensor) -> None:
    """The inverse of :func:`rows`: adds x (R, L, D) to rows lo … lo+L−1 of [prefix; main] (rows past: dropped)."""
    p, total, hi = prefix.shape[1], prefix.shape[1] + main.shape[1], lo + x.shape[1]
    if lo < p:
        prefix[:, lo : min(hi, p)] += x[:, : min(hi, p) - lo]
    if hi > p and lo < total:
        main[:, max(lo, p) - p : min(hi, total) - p] += x[:, max(lo, p) - lo : min(hi, total) - lo]


class _Layout:
    """The geometry of one call — band, empty rows, sinks — and the tiles of queries and keys, for both passes.

    A tile is a run of query blocks of one batch×head row r whose keys all lie in this call's keys (the interior:
    its key tiles are overlapping strided views, no copy), or of all rows at once (the few blocks at the two ends,
    whose keys are gathered from the prefix, this call's keys and the empty rows past the end)."""

    def __init__(
        self, q: torch.Tensor, size: int, width: int, front: int, prefix: int, num_keys: int,
        sink_mask: torch.Tensor | None,
    ) -> None:
        self.spans = spans = 1 + -(-width // size)  # key blocks per query block: B ≤ (spans − 1)·C
        local = torch.arange(spans * size, device=q.device) - torch.arange(size, device=q.device).unsqueeze(-1)
        in_band = (local >= 0) & (local <= width)  # (C, m·C)
        self.bias = torch.zeros(in_band.shape, dtype=q.dtype, device=q.device).masked_fill_(~in_band, NEG_INF)
        self.ones = in_band.to(q.dtype)
        self.size, self.front, self.prefix, self.num_keys = size, front, prefix, num_keys
        self.sink_mask = sink_mask  # (R, N, S) or None
        self.rows, self.n = q.shape[0], q.shape[1]
        self.blocks = blocks = -(-self.n // size)
        columns = spans * size + (sink_mask.shape[-1] if sink_mask is not None else 0)
        group = max(1, GROUP_ELEMENTS // (size * columns))  # blocks per tile of one row
        inner_from = min(blocks, -(-prefix // size))  # key rows of block b: b·C … (b+m)·C − 1, prefix first
        inner_to = max(inner_from, min(blocks, num_keys // size - spans + 1))
        edge = max(1, group // self.rows)
        self.tiles: list[Tile] = []
        for lo, hi in ((0, inner_from), (inner_to, blocks)):
            self.tiles += [(None, first, min(edge, hi - first)) for first in range(lo, hi, edge)]
        for r in range(self.rows):
            self.tiles += [(r, first, min(group, inner_to - first)) for first in range(inner_from, inner_to, group)]

    def queries(self, x: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Rows of the tile's query blocks of x (R, N, ·): (G, C, ·) for one row, (R, G, C, ·) zero-padded for all."""
        r, first, count = tile
        size = self.size
        if r is not None:
            return x[r, first * size : (first + count) * size].unflatten(0, (count, size))
        part = x[:, first * size : (first + count) * size]
        missing = count * size - part.shape[1]
        if missing:
            part = torch.cat([part, part.new_zeros(part.shape[0], missing, part.shape[2])], 1)
        return part.unflatten(1, (count, size))

    def put(self, target: torch.Tensor, tile: Tile, value: torch.Tensor) -> None:
        """Writes a tile's per-query rows (…, G, C, ·) into target (R, ≥ blocks·C, ·)."""
        r, first, count = tile
        span = slice(first * self.size, (first + count) * self.size)
        if r is None:
            target[:, span] = value.flatten(1, 2)
        else:
            target[r, span] = value.flatten(0, 1)

    def keys(self, prefix: torch.Tensor, main: torch.Tensor, tile: Tile) -> torch.Tensor:
        """The tile's key-side rows: key blocks b … b+m−1 of each of its query blocks, (…, G, m·C, ·)."""
        r, first, count = tile
        size, spans = self.size, self.spans
        if r is not None:  # an overlapping view: tile b starts C rows after tile b−1 (unfold, not as_strided
            start = first * size - self.prefix  # on a storage offset, which torch.compile cannot trace)
            return main[r, start : start + (count + spans - 1) * size].unfold(0, spans * size, size).transpose(1, 2)
        joined = rows(prefix, main, first * size, (first + count + spans - 1) * size)
        joined = joined.unflatten(1, (count + spans - 1, size))  # (R, G + m − 1, C, ·)
        return torch.cat([joined[:, j : j + count] for j in range(spans)], dim=2)

    def add_keys(self, grad: Pair, tile: Tile, tiles: torch.Tensor) -> None:
        """The inverse of :meth:`keys`: adds a tile's key-side gradient (…, G, m·C, ·) into ∂L/∂(prefix, main)."""
        r, first, count = tile
        size = self.size
        for j in range(self.spans):
            part = tiles[..., j * size : (j + 1) * size, :]
            if r is None:
                _add_rows(*grad, (first + j) * size, part.flatten(1, 2))
            else:
                start = (first + j) * size - self.prefix
                grad[1][r, start : start + count * size].view(count, size, -1).add_(part)

    def scores(self, qg: torch.Tensor, kg: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Scaled queries (…, G, C, D) against their band keys (…, G, m·C, D) → masked scores (…, G, C, m·C)."""
        r, first, count = tile
        scores = torch.matmul(qg, kg.transpose(-1, -2)).add_(self.bias)
        if r is None and (first * self.size < self.front or (first + count + self.spans - 1) * self.size
                          > self.num_keys):  # the empty rows, at the two ends only
            row = (first + torch.arange(count, device=qg.device)).unsqueeze(-1) * self.size
            row = row + torch.arange(self.spans * self.size, device=qg.device)  # (G, m·C): each tile's key rows
            scores.masked_fill_(((row < self.front) | (row >= self.num_keys)).unsqueeze(-2), NEG_INF)
        return scores

    def sink_scores(self, qg: torch.Tensor, sinks: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Scaled queries (…, G, C, D) against the sink keys (R, S, D) → masked scores (…, G, C, S)."""
        assert self.sink_mask is not None
        return torch.matmul(qg, _sinks(sinks, tile).transpose(-1, -2)).masked_fill_(
            ~self.queries(self.sink_mask, tile), NEG_INF)


def _sinks(x: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The sink rows (R, S, ·) as a tile's operand: (S, ·) for one row, (R, 1, S, ·) for all."""
    return x[tile[0]] if tile[0] is not None else x.unsqueeze(1)


def _sum_tiles(target: torch.Tensor, tile: Tile, value: torch.Tensor) -> None:
    """Adds a tile's sink-side gradient (…, G, S, ·) summed over its blocks into target (R, S, ·)."""
    if tile[0] is not None:
        target[tile[0]] += value.sum(0)
    else:
        target += value.sum(1)


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
        # operands come as (..., L, ·) and are flattened here, so that backward can hand back gradients that are
        # whole tensors of the inputs' shapes (autograd sums a second gradient into such a tensor in place; into a
        # view it would allocate)
        ctx.shapes = [x.shape if x is not None else None for x in (q, k_pre, k, v_pre, v, sk_pre, sv_pre, fq, fk_pre,
                                                                   fk, fsk_pre)]
        count = q.shape[:-2].numel()
        q, k_pre, k, v_pre, v, sk_pre, sv_pre = (
            x.reshape(count, *x.shape[-2:]) for x in (q, k_pre, k, v_pre, v, sk_pre, sv_pre)
        )
        fq, fk_pre, fk, fsk_pre, sink_mask = (
            x.reshape(count, *x.shape[-2:]) if x is not None else None for x in (fq, fk_pre, fk, fsk_pre, sink_mask)
        )
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the interior tiles are strided views
        fq, fk = (x.contiguous() if x is not None else None for x in (fq, fk))
        batch, n = q.shape[0], q.shape[1]
        layout = _Layout(q, size, width, front, k_pre.shape[1], k_pre.shape[1] + k.shape[1], sink_mask)
        sk = sv = fsk = None
        if sink_mask is not None:
            sk, sv = torch.cat([sk_pre, k[:, :fresh]], 1), torch.cat([sv_pre, v[:, :fresh]], 1)  # (R, S, ·)
            if fk is not None and fsk_pre is not None:
                fsk = torch.cat([fsk_pre, fk[:, :fresh]], 1)
        padded = layout.blocks * size
        out = q.new_empty(batch, padded, v.shape[2])  # rows past n dropped below
        lse, top = q.new_empty(batch, padded, 1), q.new_empty(batch, padded, 1)
        mass = q.new_empty(batch, padded, 1) if fq is not None else None
        for tile in layout.tiles:
            qg = layout.queries(q, tile) * scale
            scores = layout.scores(qg, layout.keys(k_pre, k, tile), tile)  # (…, G, C, m·C)
            m = scores.amax(-1, keepdim=True)  # finite on every real row: its own key is in the band
            sink_scores = None
            if sk is not None:
                sink_scores = layout.sink_scores(qg, sk, tile)  # (…, G, C, S)
                m = torch.maximum(m, sink_scores.amax(-1, keepdim=True))
            p = scores.sub_(m).exp_()
            total = p.sum(-1, keepdim=True)
            a = torch.matmul(p, layout.keys(v_pre, v, tile))  # (…, G, C, Dv)
            if sink_scores is not None and sv is not None:
                sink_p = sink_scores.sub_(m).exp_()
                total += sink_p.sum(-1, keepdim=True)
                a += torch.matmul(sink_p, _sinks(sv, tile))
            layout.put(out, tile, a.div_(total))
            layout.put(lse, tile, total.log_().add_(m))
            layout.put(top, tile, m)
            if mass is not None and fq is not None and fk_pre is not None and fk is not None:
                sums = torch.matmul(layout.ones, layout.keys(fk_pre, fk, tile))  # (…, G, C, F)
                if fsk is not None and sink_mask is not None:
                    sums += torch.matmul(layout.queries(sink_mask, tile).to(q.dtype), _sinks(fsk, tile))
                layout.put(mass, tile, rowdot(layout.queries(fq, tile), sums).unsqueeze(-1))
        out, lse, top = out[:, :n], lse[:, :n, 0], top[:, :n, 0]
        ctx.save_for_backward(q, k_pre, k, v_pre, v, sk_pre, sv_pre, fq, fk_pre, fk, fsk_pre, sink_mask, out, lse, top)
        ctx.options = (scale, size, width, front, fresh)
        ctx.set_materialize_grads(False)
        return out, lse, top, mass[:, :n, 0] if mass is not None else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    @causal_fn._without_autocast  # backward may run inside an autocast region: recompute in the forward's dtypes
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, grad_top: torch.Tensor | None,
        grad_mass: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k_pre, k, v_pre, v, sk_pre, sv_pre, fq, fk_pre, fk, fsk_pre, sink_mask, out, lse, top = ctx.saved_tensors
        scale, size, width, front, fresh = ctx.options
        batch, n = q.shape[0], q.shape[1]
        layout = _Layout(q, size, width, front, k_pre.shape[1], k_pre.shape[1] + k.shape[1], sink_mask)
        with_mass = grad_mass is not None and fq is not None and fk_pre is not None and fk is not None
        sk = sv = fsk = None
        if sink_mask is not None:
            sk, sv = torch.cat([sk_pre, k[:, :fresh]], 1), torch.cat([sv_pre, v[:, :fresh]], 1)
            if with_mass and fk is not None and fsk_pre is not None:
                fsk = torch.cat([fsk_pre, fk[:, :fresh]], 1)

        shapes = ctx.shapes
        q_shape, k_shape, v_shape, fq_shape, fk_shape = (shapes[i] for i in (0, 2, 4, 7, 9))
        padded = layout.blocks * size
        whole: dict[int, torch.Tensor] = {}  # id of a flat gradient → the tensor of the input's shape it views

        def zeros(pre: torch.Tensor, main: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
            grad = main.new_zeros(shape)
            flat = grad.view(main.shape)
            whole[id(flat)] = grad
            return torch.zeros_like(pre), flat, main.new_zeros(batch, sk_pre.shape[1] + fresh, main.shape[2])

        def rows(like: torch.Tensor, shape: torch.Size) -> torch.Tensor:  # query rows, padded to whole blocks
            if padded != n:
                return like.new_empty(batch, padded, like.shape[2])
            grad = like.new_empty(shape)
            flat = grad.view(like.shape)
            whole[id(flat)] = grad
            return flat

        grad_q = rows(q, q_shape)
        grad_k, grad_v = zeros(k_pre, k, k_shape), zeros(v_pre, v, v_shape)
        grad_fq = grad_fk = None
        if with_mass and fq is not None and fk_pre is not None and fk is not None:
            assert fq_shape is not None and fk_shape is not None
            grad_fq, grad_fk = rows(fq, fq_shape), zeros(fk_pre, fk, fk_shape)
        grad_a = grad_out if grad_out is not None else torch.zeros_like(out)
        shift = -rowdot(grad_a, out)  # −dA·A (R, N): the softmax's own term
        if grad_lse is not None:
            shift = shift + grad_lse
        pad = padded - n  # padded query rows: no gradient reaches them, and lse 0 keeps their P finite
        shift, lse, top = (torch.nn.functional.pad(x, (0, pad)).unsqueeze(-1) for x in (shift, lse, top))
        grad_top = torch.nn.functional.pad(grad_top, (0, pad)).unsqueeze(-1) if grad_top is not None else None
        gm_all = grad_mass.unsqueeze(-1) if grad_mass is not None else None
        for tile in layout.tiles:
            qg = layout.queries(q, tile) * scale
            kg, vg, ga = layout.keys(k_pre, k, tile), layout.keys(v_pre, v, tile), layout.queries(grad_a, tile)
            scores = layout.scores(qg, kg, tile)
            sink_scores = layout.sink_scores(qg, sk, tile) if sk is not None else None
            row_shift, row_lse = layout.queries(shift, tile), layout.queries(lse, tile)
            ties = sink_ties = share = None
            if grad_top is not None:  # ∂L/∂m reaches the score(s) equal to the row max, shared as amax does
                row_top = layout.queries(top, tile)
                ties = scores == row_top
                count = ties.sum(-1, keepdim=True)
                if sink_scores is not None:
                    sink_ties = sink_scores == row_top
                    count += sink_ties.sum(-1, keepdim=True)
                share = layout.queries(grad_top, tile) / count.clamp(min=1)
            p = scores.sub_(row_lse).exp_()  # P, normalised (…, G, C, m·C)
            grad_s = torch.matmul(ga, vg.transpose(-1, -2)).add_(row_shift).mul_(p)
            if ties is not None and share is not None:
                grad_s += ties * share
            grad_qg = torch.matmul(grad_s, kg)
            layout.add_keys(grad_k[:2], tile, torch.matmul(grad_s.transpose(-1, -2), qg))
            layout.add_keys(grad_v[:2], tile, torch.matmul(p.transpose(-1, -2), ga))
            if sink_scores is not None and sk is not None and sv is not None:
                sink_p = sink_scores.sub_(row_lse).exp_()
                grad_ss = torch.matmul(ga, _sinks(sv, tile).transpose(-1, -2)).add_(row_shift).mul_(sink_p)
                if sink_ties is not None and share is not None:
                    grad_ss += sink_ties * share
                grad_qg += torch.matmul(grad_ss, _sinks(sk, tile))
                _sum_tiles(grad_k[2], tile, torch.matmul(grad_ss.transpose(-1, -2), qg))
                _sum_tiles(grad_v[2], tile, torch.matmul(sink_p.transpose(-1, -2), ga))
            layout.put(grad_q, tile, grad_qg.mul_(scale))
            if grad_fq is not None and grad_fk is not None and gm_all is not None and fq is not None:
                gm = layout.queries(gm_all, tile)  # (…, G, C, 1)
                weighted = gm * layout.queries(fq, tile)
                sums = torch.matmul(layout.ones, layout.keys(fk_pre, fk, tile))  # (…, G, C, F)
                layout.add_keys(grad_fk[:2], tile, torch.matmul(layout.ones.transpose(-1, -2), weighted))
                if fsk is not None and sink_mask is not None:
                    sinks = layout.queries(sink_mask, tile).to(q.dtype)  # (…, G, C, S)
                    sums += torch.matmul(sinks, _sinks(fsk, tile))
                    _sum_tiles(grad_fk[2], tile, torch.matmul(sinks.transpose(-1, -2), weighted))
                layout.put(grad_fq, tile, sums.mul_(gm))
        own = sk_pre.shape[1]

        def split(grads: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor | None, ...]:
            """(prefix, main, sinks) → ∂L/∂(prefix, this call's rows, carried sinks)."""
            if grads is None:
                return None, None, None
            pre, main, sink = grads
            if fresh:
                main[:, :fresh] += sink[:, own:]  # this call's first keys are sinks too
            return pre, main, sink[:, :own]

        def shaped(grad: torch.Tensor | None, shape: torch.Size | None) -> torch.Tensor | None:
            if grad is None or shape is None:
                return None
            if id(grad) in whole:
                return whole[id(grad)]
            return grad.reshape(shape)

        gk_pre, gk, gsk = split(grad_k)
        gv_pre, gv, gsv = split(grad_v)
        gfk_pre, gfk, gfsk = split(grad_fk)
        if sink_mask is None:
            gsk = gsv = gfsk = None
        gq, gfq = (g[:, :n] if g is not None and id(g) not in whole else g for g in (grad_q, grad_fq))  # padded rows
        grads = (gq, gk_pre, gk, gv_pre, gv, gsk, gsv, gfq, gfk_pre, gfk, gfsk)
        return (*(shaped(g, shape) for g, shape in zip(grads, shapes, strict=True)), None, None, None, None, None,
                None)


def exact_part(
    q: torch.Tensor, scale: float, shape_only: bool, keys: Pair, values: Pair,
    features: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, size: int, width: int, front: int,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None, average: bool = False,
    band: BandAverage | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """What :meth:`.window.Hybrid.exact_part` returns, from the banded Function. keys, values: (prefix (..., P, ·),
    this call's (..., N, ·)); features: (φ(q), φ(k) prefix, φ(k)) for the mass, or None; sinks: the carried sink
    keys, values, features (..., S0, ·), the mask (..., N, S) and how many of this call's first keys are sinks.

    Mass form (``shape_only``): (A, None, M, lse) — the softmax over the exact keys already normalised, and
    lse = log Σ_exact e^s. Factor form: (Σ e^{s−m} v, Σ e^{s−m}, None, m) with m the exact row max
    (differentiable: the form's definition). ``average`` (the caller reads the softmax average alone; no
    features): (A, None, None, lse), without gradients through ``band`` where given and it takes the call, else on
    CPU through torch's flash kernel (:mod:`.flash_band`).
    """
    batch, n = q.shape[:-2], q.shape[-2]

    def flat(x: torch.Tensor) -> torch.Tensor:  # to (..., L, D) with the batch dims; the Function flattens
        return x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:])

    runner = band
    if runner is None and flash_band.takes(q, keys[1], values[1], keys[0], values[0]):
        runner = flash_band.band_average
    if average and features is None and runner is not None:
        def by_row(x: torch.Tensor) -> torch.Tensor:  # (R, L, ·), R = the batch dims' product (L may be 0)
            return flat(x).reshape(math.prod(batch), *x.shape[-2:])

        joined = None
        if sinks is not None:
            count = sinks[4]
            joined = (by_row(torch.cat([sinks[0], keys[1][..., :count, :]], -2)),
                      by_row(torch.cat([sinks[1], values[1][..., :count, :]], -2)), by_row(sinks[3]))
        args = ((by_row(keys[0]), by_row(keys[1])), (by_row(values[0]), by_row(values[1])), scale, width, front,
                joined)
        found = runner(by_row(q), *args)
        if found is None and runner is band and flash_band.takes(q, keys[1], values[1], keys[0], values[0]):
            found = flash_band.band_average(by_row(q), *args)
        if found is not None:
            a, lse = found
            return a.reshape(*batch, n, a.shape[-1]), None, None, lse.reshape(*batch, n)

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
    if shape_only or average:
        return a, None, mass.reshape(*batch, n) if mass is not None else None, lse.reshape(*batch, n)
    weight = torch.exp(lse - top).reshape(*batch, n)  # Σ_exact e^{s−m}
    return weight.unsqueeze(-1) * a, weight, None, top.reshape(*batch, n)
