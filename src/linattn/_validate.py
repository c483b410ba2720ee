"""Input checks for linear_attention(): every message names the argument, what was seen, and what to do."""

from __future__ import annotations

import torch

from .errors import LinearAttentionError
from .state import DeltaRuleState, LinearAttentionState, SparseCache, WindowAttentionState


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
    if not eps >= 0:
        raise LinearAttentionError(f"eps: expected a number ≥ 0, got {eps!r}")
    if min_denom is not None and not min_denom > 0:
        raise LinearAttentionError(f"min_denom: expected a number > 0 or None, got {min_denom!r}")
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


UPDATES = ("add", "delta")


def check_update(update: object, beta: object, causal: bool, normalize: bool, min_denom: object,
                 log_gate: object, q: torch.Tensor) -> None:
    """The state-update rule and what it composes with (the delta rule: causal and unnormalised; any gate)."""
    if update not in UPDATES:
        raise LinearAttentionError(f"update: unknown update rule {update!r}; choose one of {', '.join(UPDATES)}")
    if update == "add":
        if beta is not None:
            raise LinearAttentionError("beta: the write strength belongs to the delta rule; pass update='delta'")
        return
    if not causal:
        raise LinearAttentionError(
            "update='delta': the delta rule is a recurrence (each write corrects what the memory predicts from the "
            "keys before it), so it needs an order; pass causal=True"
        )
    if normalize or min_denom is not None:
        raise LinearAttentionError(
            "update='delta': the delta memory keeps no Σφ(k), so there is no denominator to normalise by; its output "
            "S_tᵀφ̂(q_t) is already bounded by the values it recalls. Pass normalize=False (the default for this "
            "update) and no min_denom (docs/delta.md)"
        )


def delta_beta(beta: object, q: torch.Tensor, kv_batch: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """β (..., N) in [0, 2] broadcast to q's (..., N) in ``dtype`` (1 when None); given per k/v head, repeated to
    the query heads (GQA)."""
    target = q.shape[:-1]
    if beta is None:
        return torch.ones(target, dtype=dtype, device=q.device)
    if isinstance(beta, (int, float)) and not isinstance(beta, bool):
        beta = torch.tensor(float(beta), dtype=dtype, device=q.device)
    if not isinstance(beta, torch.Tensor) or not beta.is_floating_point():
        raise LinearAttentionError(
            f"beta: expected a float or a floating tensor of shape (..., N), got {type(beta).__name__}"
        )
    if beta.device != q.device:
        raise LinearAttentionError(f"beta: on {beta.device}, q on {q.device}; move it to {q.device}")
    if beta.dim() >= 2 and tuple(beta.shape) == tuple(kv_batch) and tuple(kv_batch) != tuple(target):
        beta = beta.repeat_interleave(target[-2] // kv_batch[-2], dim=-2)  # (..., Hkv, N) → (..., H, N)
    try:
        beta = torch.broadcast_to(beta, target)
    except RuntimeError:
        raise LinearAttentionError(
            f"beta: shape {tuple(beta.shape)} does not broadcast to q's (..., N) = {tuple(target)}; pass one write "
            "strength per token and head"
        ) from None
    if not bool(((beta >= 0) & (beta <= 2)).all()):
        raise LinearAttentionError(
            f"beta: values from {float(beta.min())} to {float(beta.max())} (or NaN); the write strength must lie in "
            "[0, 2] (e.g. torch.sigmoid(x @ w)): with unit keys, I − β·kkᵀ is then a contraction"
        )
    return beta.to(dtype)


def check_state_features(state: LinearAttentionState | DeltaRuleState | None, features: int, map_name: str) -> None:
    if state is not None and state.feature_dim != features:
        raise LinearAttentionError(
            f"initial_state: feature dimension {state.feature_dim}, but feature map {map_name} gives F={features}; "
            "pass a state made with the same feature map"
        )


def log_decay(
    decay: object, log_gate: object, q: torch.Tensor, kv_batch: torch.Size, causal: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(g, g_f): the per-token log-decay (*q.shape[:-1]) in fp64 from ``decay`` γ (float or (H,)) and a per-token
    ``log_gate`` (..., N), summed when both are given; and a per-feature ``log_gate`` (..., N, F) in its own dtype
    (F checked against the feature map later). None for what is not given."""
    if decay is None and log_gate is None:
        return None, None
    if not causal:
        raise LinearAttentionError(
            "decay/log_gate: a decay weighs keys by their distance back from the query, which needs an order; "
            "pass causal=True (non-causal attention has no decayed form)"
        )
    batch = q.shape[:-1]  # (..., N)
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    if decay is not None:
        if isinstance(decay, (int, float)) and not isinstance(decay, bool):
            decay = torch.tensor(float(decay), dtype=torch.float64, device=q.device)
        if not isinstance(decay, torch.Tensor) or not decay.is_floating_point():
            raise LinearAttentionError(
                f"decay: expected a float or a floating tensor of shape (H,), got {type(decay).__name__}"
            )
        if decay.dim() > 1 or (decay.dim() == 1 and (q.dim() < 3 or decay.shape[0] not in (1, q.shape[-3]))):
            heads = q.shape[-3] if q.dim() >= 3 else "none"
            raise LinearAttentionError(
                f"decay: shape {tuple(decay.shape)}; expected a scalar or one rate per query head (H,) with "
                f"H = q.shape[-3] = {heads}"
            )
        if not bool(((decay > 0) & (decay <= 1)).all()):
            raise LinearAttentionError(
                f"decay: rates must lie in (0, 1], got values from {float(decay.min())} to {float(decay.max())}; "
                "γ multiplies the state once per token (RetNet: γ_h = 1 − 2^(−5−h))"
            )
        per_head = torch.log(decay.to(device=q.device, dtype=torch.float64))
        total = per_head.unsqueeze(-1) if per_head.dim() == 1 else per_head  # (H, 1) broadcasts over (..., H, N)
    per_feature = None
    if isinstance(log_gate, torch.Tensor) and log_gate.dim() == q.dim():
        per_feature = gate_tokens(log_gate, q, kv_batch, per_feature=True)
        if decay is None:
            return None, per_feature
    elif log_gate is not None:
        total = total + gate_tokens(log_gate, q, kv_batch)
    return torch.broadcast_to(total, batch), per_feature


def gate_tokens(log_gate: object, q: torch.Tensor, kv_batch: torch.Size, per_feature: bool = False) -> torch.Tensor:
    """A log-gate ≤ 0 as fp64: per token (..., N) broadcast to q's (..., N), or per feature (..., N, F) to
    (..., N, F); a gate given per k/v head is repeated to the query heads (GQA)."""
    if not isinstance(log_gate, torch.Tensor) or not log_gate.is_floating_point():
        raise LinearAttentionError(
            f"log_gate: expected a floating tensor of shape (..., N), got {type(log_gate).__name__}"
        )
    if log_gate.device != q.device:
        raise LinearAttentionError(f"log_gate: on {log_gate.device}, q on {q.device}; move it to {q.device}")
    # per-token gates are small (..., N): fp64 at once; per-feature gates stay in their dtype (the chunked form
    # sums them in fp64 block by block, so no (N, F) fp64 copy is made)
    gate = log_gate if per_feature else log_gate.to(torch.float64)
    target = q.shape[:-1]
    if per_feature:  # the token dimension is -2, features last
        target = torch.Size((*target, log_gate.shape[-1]))
        kv_batch = torch.Size((*kv_batch, log_gate.shape[-1]))
    at = -3 if per_feature else -2  # the head dimension of the gate
    if gate.dim() >= -at and tuple(gate.shape) == tuple(kv_batch) and tuple(kv_batch) != tuple(target):
        gate = gate.repeat_interleave(target[at] // kv_batch[at], dim=at)  # (..., Hkv, N[, F]) → (..., H, N[, F])
    if per_feature and gate.shape[-2] != target[-2]:
        raise LinearAttentionError(
            f"log_gate: per-feature shape {tuple(log_gate.shape)}; expected (..., N, F) with N = {target[-2]}"
        )
    if not per_feature and gate.shape[-1] != target[-1]:
        raise LinearAttentionError(
            f"log_gate: last dimension {gate.shape[-1]}, expected one log-decay per token, N = {target[-1]}"
        )
    try:
        gate = torch.broadcast_to(gate, target)
    except RuntimeError:
        raise LinearAttentionError(
            f"log_gate: shape {tuple(log_gate.shape)} does not broadcast to q's (..., N) = {tuple(target)}"
        ) from None
    if not bool((gate <= 0).all()):
        bad = int((~(gate <= 0)).sum())
        raise LinearAttentionError(
            f"log_gate: {bad} value(s) are > 0 or NaN; a log-decay must be ≤ 0 (e.g. F.logsigmoid(x)), since the "
            "state may only shrink"
        )
    if not bool(torch.isfinite(gate).all()):
        raise LinearAttentionError(
            "log_gate: -inf (a decay to exactly 0) is not supported; pass a finite value (e^-100 is 0 in fp32 "
            "already), or cu_seqlens to start new sequences"
        )
    return gate


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
    window: int, sinks: int,
) -> WindowAttentionState:
    """A state passed back to the hybrid: its type, window/sinks, buffer sizes, shapes, dtype and device."""
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
    check_state(state.linear, batch, dims[1], dtype, device)
    return state


def check_gate_features(gate: torch.Tensor, features: int) -> None:
    """A per-feature gate (..., N, F) must have the feature map's F."""
    if gate.shape[-1] != features:
        raise LinearAttentionError(
            f"log_gate: per-feature gate with {gate.shape[-1]} features, but the feature map gives "
            f"F={features}; pass (..., N, F) with F the feature dimension"
        )


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
    if update != "add":
        raise LinearAttentionError("sparse_cache: the cache sits beside the additive state; drop update= with it")
    if isinstance(option, SparseCache):
        return option
    if isinstance(option, bool) or not isinstance(option, int):
        raise LinearAttentionError(
            f"sparse_cache: expected an int (pairs per head) or a linattn.SparseCache, got {type(option).__name__}"
        )
    return SparseCache(size=option)


def check_sparse_cache(cache: SparseCache, q: torch.Tensor, window: int, state: object) -> None:
    """The cache against the call: its block fits in the window, per-head sizes match the heads, a carried state
    was made with the same block and slots."""
    block = cache.block_for(window)
    if block > window:
        raise LinearAttentionError(
            f"sparse_cache: block={block} is longer than the window ({window}); the pairs leaving before the next "
            "decision must still be in the window when it is made. Pass block ≤ window"
        )
    wrong = cache.heads_mismatch(q.shape[-3] if q.dim() >= 3 else 1)
    if wrong is not None:
        raise LinearAttentionError(f"sparse_cache: {wrong} (the inputs' dim −3)")
    if cache.keep is not None and cache.keep.dtype != torch.bool:
        raise LinearAttentionError(f"sparse_cache: keep must be a bool tensor over positions, got {cache.keep.dtype}")
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
