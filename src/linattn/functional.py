"""linear_attention(): convert → validate → features → ask the capability table → run the chosen route."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from . import _packed, _validate
from ._causal import run_causally
from ._dispatch import Job, native_runner, torch_runner
from .backends import select_backend
from .capabilities import Call, check_window_combination, choose_backend, choose_route
from .capabilities import chunk_size as route_chunk
from .errors import LinearAttentionError
from .feature_maps import CallableFeatureMap
from .features import (  # noqa: F401  (re-exported: the names' old home)
    FeatureMapLike,
    is_log_space,
    is_signed,
    map_features,
    repeat_kv_heads,
    resolve_feature_map,
)
from .forms import FORMS
from .kinds.additive.forms._common import scale_between
from .state import DeltaRuleState, LinearAttentionState, SparseCache, WindowAttentionState


def _to_torch(x: Any, name: str) -> tuple[torch.Tensor, bool]:
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating) and x.dtype != np.bool_:
            raise LinearAttentionError(f"{name}: NumPy dtype {x.dtype} is not floating point; use float32/float64")
        return torch.from_numpy(np.ascontiguousarray(x)), True
    return x, False


def linear_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    feature_map: FeatureMapLike = "elu",
    causal: bool = False,
    chunk_size: int | None = None,
    normalize: bool | None = None,
    eps: float = 1e-6,
    min_denom: float | None = None,
    key_padding_mask: Any = None,
    initial_state: LinearAttentionState | WindowAttentionState | DeltaRuleState | None = None,
    return_state: bool = False,
    form: str = "auto",
    check_finite: bool = False,
    decay: Any = None,
    log_gate: Any = None,
    cu_seqlens: Any = None,
    backend: str = "auto",
    window: int | None = None,
    sinks: int = 0,
    window_factor: Any = None,
    softmax_scale: float | None = None,
    update: str = "add",
    beta: Any = None,
    sparse_cache: int | SparseCache | None = None,
) -> Any:
    """Linear attention: out_t = φ(q_t)·Σ_j φ(k_j)v_jᵀ / (φ(q_t)·Σ_j φ(k_j) + eps), j ≤ t when causal.

    Shapes (like ``scaled_dot_product_attention``): q ``(..., Nq, Dk)``, k ``(..., Nk, Dk)``, v ``(..., Nk, Dv)``
    → out ``(..., Nq, Dv)``. k and v may have fewer heads than q at dim −3 (grouped-query attention). torch
    tensors (any device, autograd) or NumPy arrays (NumPy in → NumPy out).

    Args:
        feature_map: a registered name (``linattn.feature_maps.available()``), a feature-map ``nn.Module``, or a
            callable applied to q and k (NumPy callables for NumPy inputs). F may differ from Dk.
        causal: token t attends to keys ≤ t (needs Nq = Nk).
        chunk_size: chunk length of the chunked forms (default 64 causal, 1024 non-causal). Non-causal attention
            is chunked when this is given or when there are more than 4096 keys (measured faster there).
        normalize: divide by φ(q)·Σφ(k) + eps; False for signed maps (plain linear attention). Default (None):
            True for the additive update, False for the delta rule (which has no denominator).
        eps: added to the denominator (in the stabilised scale for log-space maps such as FAVOR+).
        min_denom: if given, the denominator is clamped below at this value after adding eps.
        key_padding_mask: bool ``(..., Nk)`` (or ``(B, Nk)`` for 4-D inputs), True = keep. Masked keys enter
            neither numerator nor denominator.
        initial_state: a state returned earlier with ``return_state=True``: the keys it summarises come before k.
        return_state: also return the :class:`LinearAttentionState` after all keys.
        form: ``"auto"``, or force ``"parallel"`` (quadratic definition), ``"global"`` (non-causal, two GEMMs),
            ``"chunked"``, ``"recurrent"`` (causal, token by token).
        check_finite: raise on NaN/inf inputs instead of propagating them. Without it, causal calls keep
            causality under bad values: a NaN/inf key or value at t leaves the rows before t as finite values
            would (docs/numerics.md); masked keys never reach valid rows.
        decay: causal only; a fixed rate γ ∈ (0, 1], a float or one per query head ``(H,)`` (RetNet, Lightning):
            the state is multiplied by γ before each token, so key j weighs γ^(t−j) at query t.
        log_gate: causal only; per-token log-decays g ``(..., N)`` ≤ 0 (Mamba-2 / simple GLA, e.g.
            ``F.logsigmoid(x @ w)``): the state is multiplied by e^{g_t} before token t. Shape ``(..., N, F)``
            (F the feature map's width): a per-feature gate (GLA). Composes with ``decay``. The decay applies
            at every position, masked ones included; the returned state's ``shift`` keeps its meaning (the true
            decayed sums are ``kv·e^shift``). See docs/decay.md.
        cu_seqlens: packed variable-length input: int offsets ``[0, n_1, n_1+n_2, …, N]`` of sequences laid end to
            end along the token dimension; no token attends across a boundary. ``initial_state`` then holds one
            state per sequence (a leading dimension S on every tensor) and the returned state likewise.
        backend: ``"auto"`` (Triton kernels for covered causal calls on CUDA tensors when triton is importable;
            on CPU tensors the native C++ recurrence for covered causal calls that need no gradients; else torch),
            ``"torch"``, ``"triton"`` or ``"native"`` (either raises, listing why, when a call is not covered).
        window: the sliding-window hybrid (docs/window.md): exact softmax weights e^{softmax_scale·q·k} over the
            W most recent keys (causal; non-causal: |t − j| < W) and the first ``sinks`` tokens, linear weights for
            the other keys, one normaliser. ``window_factor=None`` keeps the window's softmax shape with the mass
            φ(q)·Σ_window φ(k) (parameter-free); a float or per-head tensor γ weights e^{s − rowmax} instead.
            ``softmax_scale`` defaults to 1/√Dk; the map sees q and k unscaled. States are
            :class:`WindowAttentionState`.
        update: how the state takes a key/value pair. ``"add"`` (default): S_t = a_t·S_{t−1} + φ(k_t)v_tᵀ.
            ``"delta"``: the delta rule (DeltaNet; with ``decay``/``log_gate`` Gated DeltaNet, docs/delta.md),
            S_t = a_t·S_{t−1} + β_t·φ̂(k_t)(v_t − a_t·S_{t−1}ᵀφ̂(k_t))ᵀ and out_t = S_tᵀφ̂(q_t), with φ̂ the
            L2-normalised features: it writes only what the memory does not already predict. Causal,
            unnormalised; a per-feature ``log_gate`` makes a_t = diag(e^{g_t}) (KDA, Kimi Delta Attention); states
            are :class:`DeltaRuleState`. Masked tokens write nothing.
        sparse_cache: with ``window=`` (causal): beside the window and sinks, up to this many key/value pairs per
            head that have left the window stay exact (an int, or a :class:`SparseCache` with per-head sizes and
            the score that chooses them: LoLA's self-recall error by default); the rest are in the linear state.
            Decided every ``block`` tokens, so every form computes the same; constant memory. Beside any linear
            part (decays, gates, the delta rule): a pair enters the linear state when it leaves the exact part.
            docs/sparse_cache.md.
        beta: the delta rule's write strength β ∈ [0, 2], a float or ``(..., N)`` per token and head (e.g.
            ``torch.sigmoid(x @ w_beta)``); default 1.

    Half-precision inputs accumulate in fp32 (fp64 inputs in fp64) and return the input dtype.

    >>> import torch, linattn
    >>> q = k = v = torch.randn(2, 4, 100, 16)   # (B, H, N, D)
    >>> linattn.linear_attention(q, k, v, causal=True).shape
    torch.Size([2, 4, 100, 16])
    """
    q, q_numpy = _to_torch(q, "q")
    k, k_numpy = _to_torch(k, "k")
    v, v_numpy = _to_torch(v, "v")
    if not q_numpy == k_numpy == v_numpy:
        raise LinearAttentionError(
            "q, k, v: NumPy arrays mixed with torch tensors; pass all three as one kind (NumPy in → NumPy out)"
        )
    if normalize is None:
        normalize = update != "delta"
    _validate.check_flags(causal=causal, normalize=normalize, return_state=return_state, check_finite=check_finite)
    check_window_combination(window, cu_seqlens=cu_seqlens, backend=backend)
    cache = _validate.sparse_cache(sparse_cache, window, update, initial_state)
    if isinstance(initial_state, WindowAttentionState) and window is None:
        raise LinearAttentionError(
            f"initial_state: a WindowAttentionState (window={initial_state.window}, sinks={initial_state.sinks}) "
            "continues the sliding-window hybrid; pass the same window= and sinks= as the call that returned it"
        )
    segments = None
    if cu_seqlens is not None:
        if update == "delta" or not _packed.vectorised(q, causal, initial_state, return_state, feature_map):
            assert not isinstance(initial_state, WindowAttentionState)  # refused above, with or without window=
            packed = _packed.packed_attention(
                linear_attention, q, k, v, cu_seqlens, initial_state=initial_state, return_state=return_state,
                key_padding_mask=key_padding_mask, log_gate=log_gate, feature_map=feature_map, causal=causal,
                chunk_size=chunk_size, normalize=normalize, eps=eps, min_denom=min_denom, form=form,
                check_finite=check_finite, decay=decay, update=update, beta=beta,
            )
            if q_numpy:
                return (packed[0].detach().numpy(), packed[1]) if return_state else packed.detach().numpy()
            return packed
        segments = _packed.segment_jumps(cu_seqlens, q)  # one call: every weight across a boundary is 0
    group = _validate.check_qkv(q, k, v, causal)
    k_heads = k.shape[:-1]  # (..., Hkv, N): a per-token β or gate may be given per k/v head
    _validate.check_update(update, beta, causal, normalize, min_denom, log_gate, q)
    _validate.check_options(chunk_size, eps, min_denom, form, FORMS)
    _validate.check_window_options(window, sinks, window_factor, softmax_scale)
    if check_finite:
        _validate.check_finite(q, k, v)
    log_decay, feature_gate = _validate.log_decay(decay, log_gate, q, k.shape[:-1], causal)
    fmap = resolve_feature_map(feature_map, q.shape[-1], numpy=q_numpy, device=q.device)
    log_space = is_log_space(fmap)
    if update == "add":  # the delta rule normalises each feature vector, so any per-token scale cancels
        _check_map_normaliser(fmap, log_space, normalize, min_denom)

    kind = "gated" if feature_gate is not None else "plain"
    if update == "delta":
        kind = "delta"
    if window is not None:  # the exact part beside a linear part of another kind: composed
        kind = "window" if kind == "plain" and log_decay is None else "composed"
    if cache is not None:
        _validate.check_sparse_cache(cache, q, window or 0, initial_state, delta=update == "delta")
        kind = "sparse"
    call = Call(
        kind=kind,
        causal=causal, form=form, num_queries=q.shape[-2], num_keys=k.shape[-2], chunk_size=chunk_size,
        carries_state=initial_state is not None, normalize=normalize, log_space=log_space,
        options=(("decay", decay), ("log_gate", log_gate), ("cu_seqlens", cu_seqlens)), update=update,
    )
    route = choose_route(call)
    out_dtype = q.dtype
    chosen = choose_backend(backend, call, route, q, out_dtype)
    if chosen == "native":
        run = native_runner(route, causal, forced=backend == "native")
    else:
        run = select_backend(chosen, dtype=out_dtype, forced=backend == "triton", torch_run=torch_runner(route, causal),
                             kind=route.kind)

    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if chosen != "triton":  # the triton backend takes q, k, v in the caller's dtype (it may make elu + 1 itself)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)  # (..., Hkv, N, D) → (..., H, N, D)
    keep = None
    if key_padding_mask is not None:
        mask, _ = _to_torch(key_padding_mask, "key_padding_mask")
        keep = _validate.key_padding_mask(mask, k)
        v = v.masked_fill(~keep.unsqueeze(-1), 0)
    if window is not None and not causal and (initial_state is not None or return_state):
        raise LinearAttentionError(
            "initial_state / return_state: the non-causal hybrid has no state (every query sees every key); "
            "use causal=True for streaming and decoding"
        )
    job = Job(
        fmap, q, k, v, keep, _checked_state(initial_state, window, sinks, q, k, v, compute, log_space, update),
        causal=causal, chunk_size=route_chunk(route, call), log_space=log_space, return_state=return_state,
        normalize=normalize, eps=eps, min_denom=min_denom, log_decay=log_decay, feature_gate=feature_gate,
        segments=segments, window=window or 0, sinks=sinks,
        window_factor=_validate.window_factor(window_factor, q.shape[:-2], q.dtype, q.device),
        softmax_scale=1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
        check_finite=check_finite,
        nonnegative=normalize and min_denom is None and isinstance(fmap, CallableFeatureMap),
        beta=_validate.delta_beta(beta, q, k_heads, compute) if update == "delta" else None,
        sparse_cache=cache,
    )

    # under torch.autocast the GEMMs below would run in bf16/fp16 again: the fp32 accumulation is the point
    with torch.autocast(q.device.type, enabled=False) if _autocast_on(q.device.type) else nullcontext():
        out, final = run_causally(run, job)
    out = out.to(out_dtype)
    result: Any = out.detach().numpy() if q_numpy else out
    return (result, final) if return_state else result


def _check_map_normaliser(fmap: torch.nn.Module, log_space: bool, normalize: bool, min_denom: float | None) -> None:
    name = type(fmap).__name__
    if log_space and not normalize:
        raise LinearAttentionError(
            f"feature_map {name} works in log space with a stabilising shift that cancels only in the "
            "normalised ratio; use normalize=True"
        )
    if normalize and is_signed(fmap) and min_denom is None:
        raise LinearAttentionError(
            f"feature_map {name} is signed: its denominator φ(q)·Σφ(k) can be zero or negative. Pass "
            "normalize=False (unnormalised linear attention), or min_denom=... to clamp the denominator"
        )


def _checked_state(
    initial_state: Any, window: int | None, sinks: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    compute: torch.dtype, log_space: bool, update: str,
) -> LinearAttentionState | WindowAttentionState | DeltaRuleState | None:
    """The initial state, checked against this call; a plain state of an ordinary map with any shift folded in."""
    if initial_state is None:
        return None
    batch = q.shape[:-2]
    if window is not None:
        dims = (k.shape[-1], v.shape[-1])
        return _validate.check_window_state(initial_state, batch, dims, compute, q.device, window, sinks,
                                            delta=update == "delta")
    if update == "delta":
        return _validate.check_delta_state(initial_state, batch, v.shape[-1], compute, q.device)
    if isinstance(initial_state, DeltaRuleState):
        raise LinearAttentionError(
            "initial_state: a DeltaRuleState continues the delta rule; pass update='delta' (and the same beta/decay "
            "options) as the call that returned it"
        )
    state = _validate.check_state(initial_state, batch, v.shape[-1], compute, q.device)
    if log_space:
        return state
    carry = scale_between(state.shift, torch.zeros_like(state.shift))  # ordinary maps keep sums at scale 1
    return LinearAttentionState(
        state.kv * carry[..., None, None], state.k_sum * carry[..., None], carry * 0, state.num_tokens
    )


def _autocast_on(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False
