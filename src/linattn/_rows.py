"""Left-padded batches with sinks, one row at a time.

``sinks=S`` counts positions (the first S, padding included), so a left-padded batch whose rows should each keep
their own first S tokens as sinks runs row by row: the transformers attention function and the cache's prefill both
do so through these two helpers.
"""

from __future__ import annotations

from typing import Any

import torch


def left_pads(keep: torch.Tensor | None, options: dict[str, Any]) -> list[int] | None:
    """Each row's padding when ``keep`` (B, N) is left padding of some row and the options keep sinks beside a
    window, else None. ``sinks=S`` counts positions (the first S, padding included), so such a batch needs its rows
    run on their own to give each row what it gives alone: its own first S tokens as sinks."""
    if keep is None or keep.dim() != 2 or not options.get("window") or not options.get("sinks"):
        return None
    kept = keep.sum(-1)  # (B,)
    pads = keep.shape[-1] - kept
    if not bool((pads > 0).any()) or bool((kept == 0).any()):
        return None
    if not torch.equal(keep, torch.arange(keep.shape[-1], device=keep.device) >= pads.unsqueeze(-1)):
        return None  # not left padding (a hole, or right padding): positions are what the caller asked for
    return [int(p) for p in pads.tolist()]


def by_rows(pads: list[int], run: Any, *tensors: torch.Tensor) -> torch.Tensor:
    """``run`` on each row's tensors (B, H, N, ·) without its ``pads[r]`` leading positions; the outputs, zero at
    the padding, stacked back to (B, H, N, ·)."""
    outs = []
    for row, pad in enumerate(pads):
        out = run(*(x[row : row + 1, :, pad:] for x in tensors))
        outs.append(torch.nn.functional.pad(out, (0, 0, pad, 0)))
    return torch.cat(outs)
