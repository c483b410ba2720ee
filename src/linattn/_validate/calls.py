"""Checks of a call's tensors, flags and options, its masks, states and packed offsets."""

from __future__ import annotations

import torch

from ..errors import LinearAttentionError
from ..state import DeltaRuleState, LinearAttentionState


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """Checks shapes, dtypes and devices; returns the grouped-query factor (q heads per k/v head)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise LinearAttentionError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
        if not x.is_floating_point():
            raise LinearAttentionError(
                f"{name}: dtype {x.dtype} is not floating point; cast it, e.g. {name}.float()"
            )
        if x.dim() < 2:
            raise LinearAttentionError(f"{name}: expected shape (..., N, D), got {tuple(x.shape)}")
        if x.shape[-2] == 0:
            raise LinearAttentionError(f"{name}: the sequence is empty (shape {tuple(x.shape)}); pass N ≥ 1")
        if x.shape[-1] == 0:
            raise LinearAttentionError(f"{name}: the head dimension is 0 (shape {tuple(x.shape)}); pass D ≥ 1")
        if 0 in x.shape[:-2]:
            raise LinearAttentionError(
                f"{name}: a batch or head dimension is 0 (shape {tuple(x.shape)}); there is nothing to attend: "
                "skip the call for an empty batch"
            )
        if x.device.type == "meta":
            raise LinearAttentionError(
                f"{name}: a meta tensor has no values to attend over; materialise the module first (e.g. "
                "module.to_empty(device=...) and load its weights)"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise LinearAttentionError(
            f"q, k, v: dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype"
        )
    if not q.device == k.device == v.device:
        raise LinearAttentionError(
            f"q, k, v: devices differ ({q.device}, {k.device}, {v.device}); move them to one device"
        )
    if not q.dim() == k.dim() == v.dim():
        raise LinearAttentionError(
            f"q, k, v: ranks differ (shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}); "
            "give all three the layout (..., N, D)"
        )
    if q.shape[-1] != k.shape[-1]:
        raise LinearAttentionError(
            f"q, k: last dimensions differ (q {tuple(q.shape)}, k {tuple(k.shape)}); queries and keys need "
            "the same head dimension Dk"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise LinearAttentionError(
            f"k, v: shapes {tuple(k.shape)} and {tuple(v.shape)} must agree in all but the last dimension "
            "(one value per key)"
        )
    group = 1
    if q.shape[:-2] != k.shape[:-2]:
        if q.dim() < 3 or q.shape[:-3] != k.shape[:-3] or q.shape[-3] % k.shape[-3] != 0:
            raise LinearAttentionError(
                f"q, k: leading dimensions differ (q {tuple(q.shape)}, k {tuple(k.shape)}); they must be equal, "
                "or, for grouped-query attention, differ only at dim -3 where q's head count is a multiple "
                "of k's"
            )
        group = q.shape[-3] // k.shape[-3]
    if causal and q.shape[-2] != k.shape[-2]:
        raise LinearAttentionError(
            f"causal=True needs as many queries as keys, got Nq={q.shape[-2]} and Nk={k.shape[-2]}; "
            "for decoding, pass the earlier tokens as initial_state"
        )
    return group


def check_flags(**flags: object) -> None:
    """Flags that must be True or False: a string such as "False" is truthy and would silently mean True."""
    for name, value in flags.items():
        if not isinstance(value, bool) and type(value).__name__ != "bool_":  # NumPy's bool_ is fine too
            raise LinearAttentionError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")


def check_options(
    chunk_size: int | None, eps: float, min_denom: float | None, form: str, forms: tuple[str, ...]
) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise LinearAttentionError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    if not 0 <= eps < float("inf"):
        raise LinearAttentionError(f"eps: expected a number ≥ 0 and finite, got {eps!r}")
    if min_denom is not None and not 0 < min_denom < float("inf"):
        raise LinearAttentionError(f"min_denom: expected a number > 0 (finite) or None, got {min_denom!r}")
    if form not in forms:
        raise LinearAttentionError(f"form: unknown form {form!r}; choose one of {', '.join(forms)}")


def check_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise LinearAttentionError(
                f"{name}: {bad} non-finite value(s) (NaN or inf); clean the input, or check upstream layers"
            )


def key_padding_mask(mask: object, k: torch.Tensor) -> torch.Tensor:
    """The mask broadcast to k.shape[:-1]. (B, Nk) with 4-D inputs (B, H, Nk, D) is read as (B, 1, Nk)."""
    if not isinstance(mask, torch.Tensor):
        raise LinearAttentionError(
            f"key_padding_mask: expected a bool tensor or array, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise LinearAttentionError(
            f"key_padding_mask: dtype {mask.dtype}; pass a bool mask where True keeps a key (e.g. mask.bool())"
        )
    if mask.device != k.device:
        raise LinearAttentionError(f"key_padding_mask: on {mask.device}, keys on {k.device}; move it to {k.device}")
    target = k.shape[:-1]
    if mask.dim() == 2 and k.dim() == 4 and mask.shape[0] == k.shape[0]:
        mask = mask[:, None, :]
    try:
        return torch.broadcast_to(mask, target)
    except RuntimeError:
        raise LinearAttentionError(
            f"key_padding_mask: shape {tuple(mask.shape)} does not broadcast to the keys' {tuple(target)}; "
            "expected (..., Nk) with True = keep (or (B, Nk) for (B, H, Nk, D) keys)"
        ) from None


def check_state(
    state: object, batch: torch.Size, values: int, dtype: torch.dtype, device: torch.device
) -> LinearAttentionState:
    if not isinstance(state, LinearAttentionState):
        raise LinearAttentionError(
            f"initial_state: expected a LinearAttentionState (from return_state=True), got {type(state).__name__}"
        )
    expected = (*batch, state.kv.shape[-2], values)
    if state.kv.dim() != len(expected) or tuple(state.kv.shape[:-2]) != tuple(batch) or state.kv.shape[-1] != values:
        raise LinearAttentionError(
            f"initial_state: kv has shape {tuple(state.kv.shape)}, expected (*batch, F, Dv) = "
            f"({', '.join(map(str, batch))}, F, {values}); pass the state returned for inputs of this shape"
        )
    if tuple(state.k_sum.shape) != (*batch, state.kv.shape[-2]) or tuple(state.shift.shape) != tuple(batch):
        raise LinearAttentionError(
            f"initial_state: k_sum {tuple(state.k_sum.shape)} / shift {tuple(state.shift.shape)} do not match kv "
            f"{tuple(state.kv.shape)}; the state is corrupted"
        )
    for name in ("kv", "k_sum", "shift"):
        tensor = getattr(state, name)
        if tensor.dtype != dtype:
            raise LinearAttentionError(
                f"initial_state: {name} is {tensor.dtype}, expected {dtype} (states accumulate in fp32, fp64 for "
                "fp64 inputs); convert with state.to(dtype)"
            )
        if tensor.device != device:
            raise LinearAttentionError(
                f"initial_state: {name} is on {tensor.device}, inputs on {device}; move it with state.to(device)"
            )
    return state


def check_delta_state(
    state: object, batch: torch.Size, values: int, dtype: torch.dtype, device: torch.device
) -> DeltaRuleState:
    if not isinstance(state, DeltaRuleState):
        raise LinearAttentionError(
            f"initial_state: update='delta' continues a DeltaRuleState (from return_state=True with "
            f"update='delta'), got {type(state).__name__}; the additive and the delta memories do not convert"
        )
    if state.kv.dim() != len(batch) + 2 or tuple(state.kv.shape[:-2]) != tuple(batch) or state.kv.shape[-1] != values:
        raise LinearAttentionError(
            f"initial_state: kv has shape {tuple(state.kv.shape)}, expected (*batch, F, Dv) = "
            f"({', '.join(map(str, batch))}, F, {values}); pass the state returned for inputs of this shape"
        )
    if state.kv.dtype != dtype:
        raise LinearAttentionError(
            f"initial_state: kv is {state.kv.dtype}, expected {dtype} (states accumulate in fp32, fp64 for fp64 "
            "inputs); convert with state.to(dtype)"
        )
    if state.kv.device != device:
        raise LinearAttentionError(
            f"initial_state: kv is on {state.kv.device}, inputs on {device}; move it with state.to(device)"
        )
    return state


def check_state_features(state: LinearAttentionState | DeltaRuleState | None, features: int, map_name: str) -> None:
    if state is not None and state.feature_dim != features:
        raise LinearAttentionError(
            f"initial_state: feature dimension {state.feature_dim}, but feature map {map_name} gives F={features}; "
            "pass a state made with the same feature map"
        )


def cu_seqlens(offsets: object, num_tokens: int) -> list[int]:
    """Packed-sequence offsets [0, n_1, n_1 + n_2, …, N] as a list of ints."""
    if isinstance(offsets, torch.Tensor):
        if offsets.is_floating_point() or offsets.dtype == torch.bool or offsets.dim() != 1:
            raise LinearAttentionError(
                f"cu_seqlens: expected a 1-D integer tensor of offsets, got dtype {offsets.dtype} and shape "
                f"{tuple(offsets.shape)}"
            )
        values = [int(x) for x in offsets.tolist()]
    elif isinstance(offsets, (list, tuple)) and all(isinstance(x, int) for x in offsets):
        values = list(offsets)
    else:
        raise LinearAttentionError(
            f"cu_seqlens: expected a 1-D integer tensor or a list of ints, got {type(offsets).__name__}"
        )
    if len(values) < 2 or values[0] != 0 or values[-1] != num_tokens:
        raise LinearAttentionError(
            f"cu_seqlens: offsets must start at 0 and end at the packed length {num_tokens}, got "
            f"{values[:3]}…{values[-2:]} ({len(values)} values)"
        )
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise LinearAttentionError(
            "cu_seqlens: offsets must be strictly increasing (every packed sequence has at least one token)"
        )
    return values
