"""The one collective of a context-parallel call: a metadata header and the slice summaries, all-gathered.

Every rank contributes a header (int64 fields, :data:`FIELDS`) and a payload (its slice's summary, flattened).
Collectives that disagree in size between ranks do not fail cleanly (gloo aborts the process, or one side reads
garbage), so the payload size must be known to agree *before* the payload travels. Two ways:

- ``validate=True``: the header goes first in its own small all-gather (``len(FIELDS)`` int64 per rank); every rank
  checks every rank's header and raises the same error when something disagrees or a rank rejected its inputs.
  Two collectives in forward.
- ``validate=False``: the header rides in front of the payload in one all-gather (one collective in forward). Empty
  slices and disagreeing options still raise on every rank; shapes that change the payload size must agree.

Backward is one reduce-scatter (sum) of the gathered payload's gradient: rank j receives Σ_r ∂L_r/∂(summary_j).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._validate import UPDATES
from ..errors import LinearAttentionError

FIELDS = (
    "q_tokens",
    "k_tokens",
    "ok",  # 1: the rank's inputs passed its local checks
    "ndim",
    "batch",  # numel of q.shape[:-2] (batch × heads)
    "heads",
    "kv_heads",
    "key_dim",
    "value_dim",
    "features",
    "dtype",
    "causal",
    "normalize",
    "eps",  # float64 bits
    "min_denom",  # float64 bits (-1.0 for None)
    "mask",
    "log_space",
    "decay",
    "feature_map",  # float64 bits of a fingerprint of the map's parameters and buffers
    "update",  # index in _validate.UPDATES (-1: unknown): the additive sums or the delta rule's affine maps
)
# fields that may differ between ranks: the slice lengths (uneven slices) and whether a rank passed a mask
_MAY_DIFFER = {"q_tokens", "k_tokens", "ok", "mask"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def float_bits(x: float) -> int:
    """The float64 bit pattern of x as an int (exact transport of a float inside an int64 header)."""
    return int(torch.tensor(x, dtype=torch.float64).view(torch.int64).item())


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def fingerprint(module: nn.Module) -> torch.Tensor:
    """A float64 checksum of a module's parameters and buffers, position-weighted so that permutations differ.

    Random feature maps drawn on each rank from an unseeded generator differ, and would silently give a wrong
    result; equal maps give bit-equal checksums (same ops on same values).
    """
    total = torch.zeros((), dtype=torch.float64)
    for name, tensor in sorted(module.state_dict().items()):
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1).to(dtype=torch.float64)
        weights = torch.sin(torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device))
        total = total + (flat * weights).sum().cpu() + len(name)
    return total


def _gather(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, op=dist.ReduceOp.SUM, group=group)


def gather_headers(header: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """All-gather the (K,) int64 headers → (world, K)."""
    out = header.new_empty(world * header.numel())
    _gather(out, header.contiguous(), group)
    return out.view(world, -1)


class GatherSummaries(torch.autograd.Function):
    """payload (P,) → (world, P) all-gathered; backward reduce-scatters the gradient back to its owner.

    With a ``header`` (K,) int64, the header and the payload travel as bytes in one collective and the gathered
    headers (world, K) come back as a second, non-differentiable output.
    """

    @staticmethod
    def forward(
        ctx: Any, payload: torch.Tensor, header: torch.Tensor | None, world: int, group: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        payload = payload.contiguous()
        if header is None:
            out = payload.new_empty(world * payload.numel())
            _gather(out, payload, group)
            headers = torch.empty(world, 0, dtype=torch.int64, device=payload.device)
            return out.view(world, -1), headers
        head_bytes = header.numel() * 8
        packed = torch.cat([header.to(payload.device).view(torch.uint8), payload.view(torch.uint8)])
        out = packed.new_empty(world * packed.numel())
        _gather(out, packed, group)
        out = out.view(world, -1)  # (world, 8K + P·itemsize) bytes
        headers = out[:, :head_bytes].contiguous().view(torch.int64)  # (world, K)
        gathered = out[:, head_bytes:].contiguous().view(payload.dtype)  # (world, P)
        ctx.mark_non_differentiable(headers)
        return gathered, headers

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_headers: torch.Tensor) -> tuple[Any, ...]:
        # every rank calls this exactly once per forward (the gathered tensor is always in the graph: see
        # combine_summaries), so the reduce-scatters pair up across ranks
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter(out, grad.reshape(-1), ctx.group)
        return out, None, None, None


# A header that fits an all-reduce (sum): each int64 field split into 11 pieces of 6 bits, sent with their squares.
# After the sum, a field agrees on every rank iff W·Σx² = (Σx)² for each of its pieces; sums stay exact in fp32
# (Σx² ≤ 63²·W < 2^24) up to W = 4096. Constant size (2·20·11 numbers), unlike a gathered table.
PIECE_BITS, PIECES = 6, 11


def header_moments(header: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(K,) int64 → (2·K·PIECES,) in ``dtype``: the 6-bit pieces of every field, then their squares."""
    shifts = torch.arange(PIECES, dtype=torch.int64) * PIECE_BITS
    pieces = (header.unsqueeze(-1) >> shifts) & ((1 << PIECE_BITS) - 1)  # (K, PIECES)
    return torch.cat([pieces.reshape(-1), pieces.square().reshape(-1)]).to(device=device, dtype=dtype)


def check_moments(moments: torch.Tensor, header: torch.Tensor, world: int, rank: int) -> int:
    """Raise on every rank when a field differs (from the summed pieces); returns the total of ``k_tokens``."""
    sums, squares = moments.detach().double().round().long().cpu().view(2, len(FIELDS), PIECES)
    where = f"context_parallel_attention (rank {rank} of {world})"
    for index, name in enumerate(FIELDS):
        if name not in _MAY_DIFFER and bool((world * squares[index] != sums[index].square()).any()):
            mine = _readable(name, int(header[index]))
            raise LinearAttentionError(
                f"{where}: {name} differs across ranks (this rank: {mine}). Every rank must pass the same batch, "
                "heads, head dims, dtype, options and feature map; only the slice length N may differ"
            )
    index = FIELDS.index("k_tokens")
    return sum(int(sums[index, i]) << (PIECE_BITS * i) for i in range(PIECES))


class ReduceSummaries(torch.autograd.Function):
    """payload (P,) → Σ over ranks (P,) by one all-reduce; backward all-reduces the gradient (the sum's gradient
    is every rank's, summed). An optional ``extra`` (non-differentiable, same dtype) is summed in the same call."""

    @staticmethod
    def forward(
        ctx: Any, payload: torch.Tensor, extra: torch.Tensor | None, group: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        parts = [payload.reshape(-1)] + ([extra] if extra is not None else [])
        buffer = torch.cat(parts)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        total, summed_extra = buffer[: payload.numel()], buffer[payload.numel() :]
        ctx.mark_non_differentiable(summed_extra)
        return total, summed_extra

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_extra: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None, None


def check_headers(
    headers: torch.Tensor, rank: int, local_error: Exception | None, *, q_shape: tuple[int, ...]
) -> None:
    """Raise the same LinearAttentionError on every rank when the gathered headers say something is wrong."""
    rows = headers.cpu().tolist()
    world = len(rows)
    table = {name: [row[i] for row in rows] for i, name in enumerate(FIELDS)}
    where = f"context_parallel_attention (rank {rank} of {world})"
    for field in ("q_tokens", "k_tokens"):
        empty = [r for r, n in enumerate(table[field]) if n == 0]
        if empty:
            raise LinearAttentionError(
                f"{where}: rank(s) {empty} have an empty slice ({field[0]} has 0 tokens; tokens per rank: "
                f"{table[field]}). Every rank needs at least one token: split the sequence so that each rank gets "
                "one or more (e.g. torch.tensor_split(x, world_size, dim=-2) with N ≥ world_size)"
            )
    failed = [r for r, ok in enumerate(table["ok"]) if ok != 1]
    if failed:
        if local_error is not None:
            raise LinearAttentionError(f"{local_error} [{where}: raised on every rank of the group]") from local_error
        raise LinearAttentionError(
            f"{where}: rank(s) {failed} rejected their inputs (their error says why); this rank's inputs (q "
            f"{q_shape}) passed the checks"
        )
    for name in FIELDS:
        if name in _MAY_DIFFER or len(set(table[name])) == 1:
            continue
        seen = [_readable(name, x) for x in table[name]]
        raise LinearAttentionError(
            f"{where}: {name} differs across ranks (per rank: {seen}). Every rank must pass the same batch, "
            "heads, head dims, dtype, options and feature map; only the slice length N may differ"
            + (
                ". For random maps, create the map with the same seed on every rank (or broadcast its state_dict)"
                if name == "feature_map"
                else ""
            )
        )
    if table["causal"][0] and any(a != b for a, b in zip(table["q_tokens"], table["k_tokens"], strict=True)):
        raise LinearAttentionError(
            f"{where}: causal=True needs as many queries as keys on every rank, got q tokens {table['q_tokens']} "
            f"and k tokens {table['k_tokens']}"
        )


def _readable(name: str, value: int) -> Any:
    if name in ("eps", "min_denom", "feature_map"):
        number = float(torch.tensor(value, dtype=torch.int64).view(torch.float64).item())
        return None if name == "min_denom" and number == -1.0 else number
    if name == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else value
    if name == "update":
        return UPDATES[value] if 0 <= value < len(UPDATES) else value
    return value


def make_header(values: dict[str, int | float | torch.Tensor]) -> torch.Tensor:
    """The (K,) int64 header from named values: ints as they are, the fingerprint tensor as float64 bits."""
    row = []
    for name in FIELDS:
        value = values[name]
        if isinstance(value, torch.Tensor):
            row.append(value.to(torch.float64).reshape(1).view(torch.int64))
        else:
            row.append(torch.tensor([int(value)], dtype=torch.int64))
    return torch.cat(row)
