"""Checks of the window op's options, its state and the sparse cache."""

from __future__ import annotations

import torch

from ..errors import LinearAttentionError
from ..state import DeltaRuleState, SparseCache, WindowAttentionState
from .calls import check_delta_state, check_state


def check_window_options(window: object, sinks: object, factor: object, softmax_scale: object) -> None:
    """The window op's options (``window=``, ``sinks=``, ``window_factor=``, ``softmax_scale=``); which forms and
    options it runs with is the capability table's question."""
    if window is None:
        if sinks or factor is not None or softmax_scale is not None:
            raise LinearAttentionError(
                "sinks, window_factor and softmax_scale belong to the sliding-window hybrid; pass window=W as well"
            )
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise LinearAttentionError(f"window: expected an int ≥ 1 (keys scored exactly), got {window!r}")
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise LinearAttentionError(f"sinks: expected an int ≥ 0 (first tokens kept exact), got {sinks!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, int | float) and 0 < softmax_scale < float("inf")):
        raise LinearAttentionError(f"softmax_scale: expected a positive finite number or None, got {softmax_scale!r}")
    if isinstance(factor, torch.Tensor):
        message = (f"window_factor: expected finite values ≥ 0 (dtype {factor.dtype}, shape {tuple(factor.shape)}); "
                   "parametrise a learned factor e.g. as exp(log_gamma)")
        if not factor.is_floating_point():
            raise LinearAttentionError(message)
        valid = (torch.isfinite(factor) & (factor >= 0)).all()
        if torch.compiler.is_compiling():  # a branch on the values would break the graph: checked when it runs
            torch._assert_async(valid, message)
        elif not bool(valid):
            raise LinearAttentionError(message)
    elif factor is not None and not (isinstance(factor, int | float) and 0 <= factor < float("inf")):
        raise LinearAttentionError(f"window_factor: expected None, a number ≥ 0 or a tensor, got {factor!r}")


def check_window_state(
    state: object, batch: torch.Size, dims: tuple[int, int], dtype: torch.dtype, device: torch.device,
    window: int, sinks: int, *, delta: bool = False,
) -> WindowAttentionState:
    """A state passed back to the hybrid: its type, window/sinks, buffer sizes, shapes, dtype and device; with
    ``delta`` (the delta rule's linear part) its memory and the buffered write strengths."""
    if not isinstance(state, WindowAttentionState):
        raise LinearAttentionError(
            f"initial_state: with window= expected a WindowAttentionState (from return_state=True with the same "
            f"window), got {type(state).__name__}"
        )
    if (state.window, state.sinks) != (window, sinks):
        raise LinearAttentionError(
            f"initial_state: made with window={state.window}, sinks={state.sinks}, but this call has "
            f"window={window}, sinks={sinks}; pass the same values"
        )
    buffered, sunk = min(window, state.num_tokens), min(sinks, state.num_tokens)
    expected = {
        "keys": (*batch, buffered, dims[0]), "values": (*batch, buffered, dims[1]), "keep": (*batch, buffered),
        "sink_keys": (*batch, sunk, dims[0]), "sink_values": (*batch, sunk, dims[1]), "sink_keep": (*batch, sunk),
    }
    for name, shape in expected.items():
        tensor = getattr(state, name)
        if tuple(tensor.shape) != shape:
            raise LinearAttentionError(
                f"initial_state: {name} has shape {tuple(tensor.shape)}, expected {shape} after "
                f"{state.num_tokens} tokens; pass the state returned for inputs of this shape"
            )
        wanted = torch.bool if name.endswith("keep") else dtype
        if tensor.dtype != wanted or tensor.device != device:
            raise LinearAttentionError(
                f"initial_state: {name} is {tensor.dtype} on {tensor.device}, expected {wanted} on {device}; "
                "convert with state.to(device, dtype)"
            )
    if delta != isinstance(state.linear, DeltaRuleState):
        held, asked = ("an additive state", "update='delta'") if delta else ("the delta rule's memory", "update='add'")
        raise LinearAttentionError(
            f"initial_state: its linear part is {held}, but this call has {asked}; pass the same update= (and "
            "gates) as the call that returned it"
        )
    if delta:
        check_delta_state(state.linear, batch, dims[1], dtype, device)
        betas = state.betas
        if betas is None or tuple(betas.shape) != (*batch, buffered) or betas.dtype != dtype:
            seen = None if betas is None else (tuple(betas.shape), betas.dtype)
            raise LinearAttentionError(
                f"initial_state: betas (the buffered keys' write strengths) are {seen}, expected shape "
                f"{(*batch, buffered)} in {dtype}; pass the state returned with update='delta'"
            )
    else:
        check_state(state.linear, batch, dims[1], dtype, device)
    return state


def window_factor(factor: object, batch: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """window_factor= as a tensor broadcast to the batch/head dims (a per-head (H,) over (B, H)), or None."""
    if factor is None:
        return None
    gamma = torch.as_tensor(factor, dtype=dtype, device=device)
    try:
        return torch.broadcast_to(gamma, batch)
    except RuntimeError:
        raise LinearAttentionError(
            f"window_factor: shape {tuple(gamma.shape)} does not broadcast to the batch/head dims "
            f"{tuple(batch)}; pass a float or one value per head, e.g. shape (H,)"
        ) from None


def sparse_cache(option: object, window: int | None, update: str, state: object) -> SparseCache | None:
    """``sparse_cache=``: None, an int (the size per head) or a :class:`SparseCache`; it needs ``window=``."""
    if option is None:
        if isinstance(state, WindowAttentionState) and state.cache is not None:
            raise LinearAttentionError(
                "initial_state: it carries a sparse cache; pass the same sparse_cache= as the call that returned it"
            )
        return None
    if window is None:
        raise LinearAttentionError(
            "sparse_cache: the cache keeps pairs that have left the window; pass window= (and sinks=) with it"
        )
    if isinstance(option, SparseCache):
        return option
    if isinstance(option, bool) or not isinstance(option, int):
        raise LinearAttentionError(
            f"sparse_cache: expected an int (pairs per head) or a linattn.SparseCache, got {type(option).__name__}"
        )
    return SparseCache(size=option)


def check_sparse_cache(cache: SparseCache, q: torch.Tensor, window: int, state: object, *,
                       delta: bool = False) -> None:
    """The cache against the call: its block fits in the window, per-head sizes match the heads, a carried state
    was made with the same block and slots (and, beside the delta rule, keeps its cached pairs' β)."""
    block = cache.block_for(window)
    if block > window:
        raise LinearAttentionError(
            f"sparse_cache: block={block} is longer than the window ({window}); the pairs leaving before the next "
            "decision must still be in the window when it is made. Pass block ≤ window"
        )
    wrong = cache.heads_mismatch(q.shape[-3] if q.dim() >= 3 else 1)
    if wrong is not None:
        raise LinearAttentionError(f"sparse_cache: {wrong} (the inputs' dim −3)")
    if cache.keep is not None:
        _check_oracle(cache.keep, q, state)
    if isinstance(state, WindowAttentionState):
        if state.cache is None and state.num_tokens:
            raise LinearAttentionError(
                "initial_state: made without sparse_cache=; continue it without one, or start a new sequence"
            )
        held = state.cache
        if held is not None and (held.block != block or not cache.made(held.sizes)):
            raise LinearAttentionError(
                f"initial_state: its cache was made with block={held.block} and other per-head sizes (largest "
                f"{held.slots}); this call has block={block} and sizes {cache.size!r}: pass the same sparse_cache"
            )
        wrong = cache.score_mismatch(held, state.num_tokens) if held is not None else None
        if wrong is not None:
            raise LinearAttentionError(f"initial_state: {wrong}")
        if held is not None and delta and held.packed_betas is None:
            raise LinearAttentionError(
                "initial_state: its cache keeps no write strengths (made beside an additive state), but this call "
                "has update='delta'; pass the same update= as the call that returned it"
            )


def _check_oracle(keep: torch.Tensor, q: torch.Tensor, state: object) -> None:
    """The oracle's ``keep`` (..., P): bool, broadcast against the batch and head dims, over every position reached."""
    if keep.dtype != torch.bool or keep.dim() < 1:
        raise LinearAttentionError(
            f"sparse_cache: keep must be a bool tensor (..., P) over positions, got {keep.dtype} of shape "
            f"{tuple(keep.shape)}"
        )
    batch = q.shape[:-2]
    try:
        fits = torch.broadcast_shapes(keep.shape[:-1], batch) == batch
    except RuntimeError:
        fits = False
    if not fits:
        raise LinearAttentionError(
            f"sparse_cache: keep has shape {tuple(keep.shape)}; its leading dims must broadcast to the batch and "
            f"head dims {tuple(batch)} (e.g. (P,) for every row, or (H, P) with H = {batch[-1] if batch else 1})"
        )
    reached = (state.num_tokens if isinstance(state, WindowAttentionState) else 0) + q.shape[-2]
    if keep.shape[-1] < reached:
        raise LinearAttentionError(
            f"sparse_cache: keep covers positions 0 … {keep.shape[-1] - 1}, but this call reaches position "
            f"{reached - 1}; pass keep over every position (False where no pair should stay)"
        )
