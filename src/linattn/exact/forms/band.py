"""The exact part's keys as a band: each query block against two key blocks (:mod:`linattn.exact`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# the window's band average in inference (q, keys, values, scale, width, front, sinks) → (A, lse), or None where it
# does not take the call: :func:`.flash_band.band_average`'s arguments and results
BandAverage = Callable[..., "tuple[torch.Tensor, torch.Tensor] | None"]

MIN_BAND_BLOCK = 16  # the band's query blocks: B rounded up to a multiple of this


def rows_like(like: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """(..., rows, D) filled with ``value``, like ``like`` (..., N, D) in all else."""
    return like.new_full((*like.shape[:-2], rows, like.shape[-1]), value)


def band_size(width: int) -> int:
    """The query block C of a band of width B: B rounded up to a multiple of MIN_BAND_BLOCK (so B ≤ C)."""
    return -(-max(width, MIN_BAND_BLOCK) // MIN_BAND_BLOCK) * MIN_BAND_BLOCK


def band_sums(rows: torch.Tensor, length: int, n: int) -> torch.Tensor:
    """Σ_{y=i}^{i+length−1} rows_y for i < n, (..., Ny, F) → (..., n, F), without subtracting prefix sums (which
    would cancel): in blocks of ``length``, a window is a suffix of its first block plus a prefix of the next."""
    total = -(-max(rows.shape[-2], n + length - 1) // length) * length
    blocks = torch.nn.functional.pad(rows, (0, 0, 0, total - rows.shape[-2])).unflatten(-2, (-1, length))
    prefix = blocks.cumsum(-2).flatten(-3, -2)  # (..., total, F): from the block start to y
    suffix = blocks.flip(-2).cumsum(-2).flip(-2).flatten(-3, -2)  # from y to the block end
    starts = (torch.arange(n, device=rows.device) % length == 0).unsqueeze(-1)  # window = one whole block
    return suffix[..., :n, :] + prefix[..., length - 1 : length - 1 + n, :].masked_fill(starts, 0.0)


class Band:
    """Keys for the banded exact part: query i sees row y of a key sequence for i ≤ y ≤ i + B (rows y < ``front``
    and past the end are empty; ``keep`` (..., Ny) marks padding, None when there is none).

    Queries go in blocks of C (B rounded up to a multiple of 16); block b's keys lie in key blocks b and b+1, so
    each query block is scored against 2C keys (O(N·C) work and memory) with one band mask. This is the general
    path (padding; the mass form with keys at their own log-scales), differentiated by autograd, which keeps the
    O(N·C) tiles; without padding :mod:`.fused` does the same in O(N) memory.
    """

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], keep: torch.Tensor | None, front: int,
        features: torch.Tensor | None, scales: torch.Tensor | None, width: int, num_queries: int,
    ) -> None:
        """``keys``, ``values``: the key sequence's rows in pieces (joined once, with the padding)."""
        self.width = width
        self.size = size = band_size(width)
        self.blocks = blocks = -(-num_queries // size)
        rows = sum(piece.shape[-2] for piece in keys)
        self.pad = (blocks + 1) * size - rows
        assert self.pad >= 0
        self.keys, self.values = self.gather(keys), self.gather(values)
        self.features, self._scales = features, scales
        device = self.keys.device
        local = torch.arange(2 * size, device=device) - torch.arange(size, device=device).unsqueeze(-1)
        in_band = (local >= 0) & (local <= width)  # (C, 2C)
        row = torch.arange(blocks, device=device).unsqueeze(-1) * size + torch.arange(2 * size, device=device)
        self.mask = in_band & ((row >= front) & (row < rows)).unsqueeze(-2)  # (b, C, 2C)
        if keep is not None:
            kept = self.gather(keep.unsqueeze(-1).to(torch.uint8)).squeeze(-1).bool()  # (..., b, 2C)
            self.mask = self.mask & kept.unsqueeze(-2)  # (..., b, C, 2C)

    def gather(self, x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """(..., Ny, D) (or its pieces) → (..., b, 2C, D): key blocks b and b+1 side by side."""
        pieces = list(x) if isinstance(x, list) else [x]
        pieces.append(rows_like(pieces[0], self.pad, 0.0))
        joined = torch.cat([piece for piece in pieces if piece.shape[-2]], dim=-2)
        split = joined.unflatten(-2, (self.blocks + 1, self.size))  # (..., b+1, C, D)
        return torch.cat([split[..., :-1, :, :], split[..., 1:, :, :]], dim=-2)

    def gather_scales(self) -> torch.Tensor:
        assert self._scales is not None
        return self.gather(self._scales.unsqueeze(-1)).squeeze(-1)  # (..., b, 2C)

    @property
    def scales(self) -> torch.Tensor | None:
        return self._scales


class Sinks:
    """The sink keys (..., S, ·) and which query sees each one as a sink (outside its window): mask (..., N, S)."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, features: torch.Tensor | None,
        scales: torch.Tensor | None,
    ) -> None:
        self.keys, self.values, self.mask, self.features, self.scales = keys, values, mask, features, scales


class ShiftRows(torch.autograd.Function):
    """[head; x[..., :N−E, :]] with rows ``blank`` (indices, or None) set to ``fill``: head (..., E, D) are the rows
    before x's first (E ≤ N). The hybrid's linear part reads log-space keys shifted so (stored at each reader's
    scale; other keys and values it reads lagged, without a copy); this makes the shifted copy in one pass and its
    gradient in one (autograd's slice of x would first zero a buffer of x's size)."""

    @staticmethod
    def forward(
        ctx: Any, head: torch.Tensor, x: torch.Tensor, blank: torch.Tensor | None, fill: float
    ) -> torch.Tensor:
        early, n = head.shape[-2], x.shape[-2]
        out = torch.cat([head, x[..., : n - early, :]], dim=-2)  # (..., N, D)
        if blank is not None:
            out.index_fill_(-2, blank, fill)
        ctx.save_for_backward(blank)
        ctx.early = early
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (blank,) = ctx.saved_tensors
        early, n = ctx.early, grad.shape[-2]
        if blank is not None:  # few rows (the sinks): zero them in a copy of the small head and in place below
            grad = grad.index_fill(-2, blank[blank < early], 0.0) if bool((blank < early).any()) else grad
        grad_head = grad[..., :early, :] if ctx.needs_input_grad[0] else None
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty_like(grad)
            grad_x[..., : n - early, :] = grad[..., early:, :]
            grad_x[..., n - early :, :] = 0.0
            if blank is not None and bool((blank >= early).any()):
                grad_x.index_fill_(-2, blank[blank >= early] - early, 0.0)
        return grad_head, grad_x, None, None


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
