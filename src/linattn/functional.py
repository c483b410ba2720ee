"""linear_attention(): validate inputs, apply the feature map, pick the form, call it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from . import _packed, _validate
from .errors import LinearAttentionError
from .feature_maps import CallableFeatureMap, FeatureMap, create
from .forms import (
    FORMS,
    causal_chunked_attention,
    global_attention,
    noncausal_chunked_attention,
    parallel_attention,
    recurrent_attention,
)
from .forms._common import NEG_INF, empty_state, scale_between
from .forms.decay import decayed_ref
from .forms.gated import gated_chunked_attention, gated_parallel_attention, gated_recurrent_attention
from .forms.hybrid import run_window
from .state import LinearAttentionState, WindowAttentionState

DEFAULT_CAUSAL_CHUNK = 64
DEFAULT_NONCAUSAL_CHUNK = 1024
DEFAULT_GATED_CHUNK = 64  # per-feature gates: measured best of 16/32/64 (docs/decay.md)
# "auto" runs non-causal attention chunked beyond this many keys: measured faster from 8192 keys on (features and
# GEMM operands stay in cache), while the global form wins up to 4096 (docs/benchmarks.md, benchmarks/run.py)
NONCAUSAL_CHUNKED_ABOVE = 4096

FeatureMapLike = str | nn.Module | Callable[..., Any]


# maps created from a name, kept so that a random map drawn once serves every later call with that name
_NAMED_MAPS: dict[tuple[str, int, str], nn.Module] = {}


def resolve_feature_map(
    feature_map: FeatureMapLike, head_dim: int, *, numpy: bool = False, device: torch.device | None = None
) -> nn.Module:
    """A feature-map module from a registered name, a module, or a callable.

    A name creates the map with default options once per (name, head_dim, device) and reuses it: random maps keep
    their projections across calls (drawn from torch's generator at first use). Pass a module for other options.
    """
    if isinstance(feature_map, str):
        key = (feature_map, head_dim, str(device))
        if key not in _NAMED_MAPS:
            _NAMED_MAPS[key] = create(feature_map, head_dim=head_dim).to(device)
        return _NAMED_MAPS[key]
    if isinstance(feature_map, nn.Module):
        return feature_map
    if callable(feature_map):
        return CallableFeatureMap(feature_map, numpy=numpy)
    raise LinearAttentionError(
        f"feature_map: expected a registered name, an nn.Module or a callable, got {type(feature_map).__name__}"
    )


def map_features(fmap: nn.Module, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
    """The map's features of ``x`` (..., N, D) → (..., N, F), checked: any map, a user's callable or module too."""
    features = fmap.features(x, is_query=is_query) if isinstance(fmap, FeatureMap) else fmap(x)
    role = "queries" if is_query else "keys"
    if not isinstance(features, torch.Tensor):
        raise LinearAttentionError(
            f"feature_map {_map_label(fmap)}: returned {type(features).__name__} for the {role}; it must return a "
            f"tensor of shape (..., N, F), here {tuple(x.shape[:-1])} + (F,)"
        )
    if features.shape[:-1] != x.shape[:-1]:
        raise LinearAttentionError(
            f"feature_map {_map_label(fmap)}: returned shape {tuple(features.shape)} for {role} of shape "
            f"{tuple(x.shape)}; a feature map must keep every leading dim and the token dim, returning "
            f"{tuple(x.shape[:-1])} + (F,) (map the last dim only)"
        )
    if not features.is_floating_point():
        raise LinearAttentionError(
            f"feature_map {_map_label(fmap)}: returned dtype {features.dtype} for the {role}; return floating point"
        )
    return features if features.dtype == x.dtype else features.to(x.dtype)


def _map_label(fmap: nn.Module) -> str:
    inner = getattr(fmap, "fn", None)  # a wrapped callable: name the user's function, not the wrapper
    return repr(getattr(inner, "__name__", inner)) if inner is not None else type(fmap).__name__


def _check_feature_dims(query_dim: int, key_dim: int, fmap: nn.Module) -> None:
    if query_dim != key_dim:
        raise LinearAttentionError(
            f"feature_map {_map_label(fmap)}: {query_dim} query features but {key_dim} key features; φ(q)·φ(k) "
            "needs the same F for both"
        )


def _stabilise_queries(log_features: torch.Tensor) -> torch.Tensor:
    # a per-row shift is causal-safe and cancels in the normalised ratio
    return torch.exp(log_features - log_features.amax(-1, keepdim=True))


def _stabilise_keys(
    log_features: torch.Tensor, keep: torch.Tensor | None, causal: bool, start: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(log φ(k_j) − ref_j) and ref: the running maximum (causal) or the overall maximum (non-causal)."""
    if keep is not None:
        log_features = log_features.masked_fill(~keep.unsqueeze(-1), NEG_INF)
    row_max = log_features.amax(-1)  # (..., Nk)
    if causal:
        ref = torch.cummax(row_max, dim=-1).values
    else:
        ref = row_max.amax(-1, keepdim=True)  # (..., 1)
    if start is not None:
        ref = torch.maximum(ref, start.unsqueeze(-1))
    finite_ref = torch.where(ref == NEG_INF, 0.0, ref)  # only masked keys see -inf: their features are 0 anyway
    return torch.exp(log_features - finite_ref.unsqueeze(-1)), ref


def _query_features(fmap: nn.Module, q: torch.Tensor, log_space: bool) -> torch.Tensor:
    qf = map_features(fmap, q, is_query=True)
    return _stabilise_queries(qf) if log_space else qf


def _key_features(
    fmap: nn.Module,
    k: torch.Tensor,
    keep: torch.Tensor | None,
    log_space: bool,
    causal: bool,
    start: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key features with masked keys zeroed, and (log-space maps) the log-scale they are stored at."""
    kf = map_features(fmap, k, is_query=False)
    if log_space:
        return _stabilise_keys(kf, keep, causal, start)
    if keep is not None:
        kf = kf.masked_fill(~keep.unsqueeze(-1), 0)
    return kf, None


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
    normalize: bool = True,
    eps: float = 1e-6,
    min_denom: float | None = None,
    key_padding_mask: Any = None,
    initial_state: LinearAttentionState | WindowAttentionState | None = None,
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
        normalize: divide by φ(q)·Σφ(k) + eps; False for signed maps (plain linear attention).
        eps: added to the denominator (in the stabilised scale for log-space maps such as FAVOR+).
        min_denom: if given, the denominator is clamped below at this value after adding eps.
        key_padding_mask: bool ``(..., Nk)`` (or ``(B, Nk)`` for 4-D inputs), True = keep. Masked keys enter
            neither numerator nor denominator.
        initial_state: a state returned earlier with ``return_state=True``: the keys it summarises come before k.
        return_state: also return the :class:`LinearAttentionState` after all keys.
        form: ``"auto"``, or force ``"parallel"`` (quadratic definition), ``"global"`` (non-causal, two GEMMs),
            ``"chunked"``, ``"recurrent"`` (causal, token by token).
        check_finite: raise on NaN/inf inputs instead of propagating them.
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
        backend: ``"auto"`` (Triton kernels for covered causal calls on CUDA tensors when triton is importable,
            else torch), ``"torch"``, or ``"triton"`` (raises, listing why, when a call is not covered).
        window: the sliding-window hybrid (docs/window.md): exact softmax weights e^{softmax_scale·q·k} over the
            W most recent keys (causal; non-causal: |t − j| < W) and the first ``sinks`` tokens, linear weights for
            the other keys, one normaliser. ``window_factor=None`` keeps the window's softmax shape with the mass
            φ(q)·Σ_window φ(k) (parameter-free); a float or per-head tensor γ weights e^{s − rowmax} instead.
            ``softmax_scale`` defaults to 1/√Dk; the map sees q and k unscaled. States are
            :class:`WindowAttentionState`.

    Half-precision inputs accumulate in fp32 (fp64 inputs in fp64) and return the input dtype.

    >>> import torch, linattn
    >>> q = k = v = torch.randn(2, 4, 100, 16)   # (B, H, N, D)
    >>> linattn.linear_attention(q, k, v, causal=True).shape
    torch.Size([2, 4, 100, 16])
    """
    q, q_numpy = _to_torch(q, "q")
    k, _ = _to_torch(k, "k")
    v, _ = _to_torch(v, "v")
    _validate.check_window_combination(window, decay=decay, log_gate=log_gate, cu_seqlens=cu_seqlens, backend=backend)
    if isinstance(initial_state, WindowAttentionState) and window is None:
        raise LinearAttentionError(
            f"initial_state: a WindowAttentionState (window={initial_state.window}, sinks={initial_state.sinks}) "
            "continues the sliding-window hybrid; pass the same window= and sinks= as the call that returned it"
        )
    segments = None
    if cu_seqlens is not None and _packed.vectorised(q, causal, initial_state, return_state, feature_map):
        segments = _packed.segment_jumps(cu_seqlens, q)  # one call: every weight across a boundary is 0
    elif cu_seqlens is not None:
        assert not isinstance(initial_state, WindowAttentionState)  # refused above, with or without window=
        packed = _packed.packed_attention(
            linear_attention, q, k, v, cu_seqlens, initial_state=initial_state, return_state=return_state,
            key_padding_mask=key_padding_mask, log_gate=log_gate, feature_map=feature_map, causal=causal,
            chunk_size=chunk_size, normalize=normalize, eps=eps, min_denom=min_denom, form=form,
            check_finite=check_finite, decay=decay,
        )
        if q_numpy:
            return (packed[0].detach().numpy(), packed[1]) if return_state else packed.detach().numpy()
        return packed
    group = _validate.check_qkv(q, k, v, causal)
    _validate.check_options(chunk_size, eps, min_denom, form, FORMS)
    _validate.check_window_options(
        window, sinks, window_factor, softmax_scale, normalize, form, causal, q.shape[-2], k.shape[-2]
    )
    if check_finite:
        _validate.check_finite(q, k, v)
    log_decay, feature_gate = _validate.log_decay(decay, log_gate, q, k.shape[:-1], causal)
    fmap = resolve_feature_map(feature_map, q.shape[-1], numpy=q_numpy, device=q.device)
    map_name = type(fmap).__name__
    log_space = bool(getattr(fmap, "log_space", False))
    if log_space and not normalize:
        raise LinearAttentionError(
            f"feature_map {map_name} works in log space with a stabilising shift that cancels only in the "
            "normalised ratio; use normalize=True"
        )
    if normalize and getattr(fmap, "positive", True) is False and min_denom is None:
        raise LinearAttentionError(
            f"feature_map {map_name} is signed: its denominator φ(q)·Σφ(k) can be zero or negative. Pass "
            "normalize=False (unnormalised linear attention), or min_denom=... to clamp the denominator"
        )

    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    run = _run_form
    if window is None:  # (the hybrid resolves its own forms: forms/hybrid.py)
        if form == "auto":
            long_keys = k.shape[-2] > NONCAUSAL_CHUNKED_ABOVE
            form = "chunked" if causal or chunk_size is not None or long_keys else "global"
        if form == "recurrent" and not causal:
            raise LinearAttentionError("form='recurrent' is the causal token-by-token form; pass causal=True")
        if form == "global" and causal:
            raise LinearAttentionError("form='global' is non-causal; pass causal=False, or form='chunked'")
        if backend != "torch":  # imported here: the triton backend is optional
            from .backends import select_backend

            run = select_backend(
                backend, q, causal=causal, form=form, log_space=log_space, chunk_size=chunk_size, dtype=out_dtype,
                torch_run=_run_form,
            )
    if run is _run_form:  # the triton backend takes q, k, v in the caller's dtype (it may make elu + 1 itself)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    if group > 1:  # (..., Hkv, N, D) → (..., H, N, D)
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    batch = q.shape[:-2]

    keep = None
    if key_padding_mask is not None:
        mask, _ = _to_torch(key_padding_mask, "key_padding_mask")
        keep = _validate.key_padding_mask(mask, k)
        v = v.masked_fill(~keep.unsqueeze(-1), 0)
    if window is not None:  # the sliding-window hybrid: forms/hybrid.py
        out, hybrid_state = run_window(
            lambda x, is_query: map_features(fmap, x, is_query=is_query), q, k, v, keep, initial_state,
            causal=causal, window=window, sinks=sinks, factor=window_factor, softmax_scale=softmax_scale, form=form,
            chunk_size=chunk_size, eps=eps, min_denom=min_denom, log_space=log_space, return_state=return_state,
        )
        hybrid_out: Any = out.to(out_dtype).detach().numpy() if q_numpy else out.to(out_dtype)
        return (hybrid_out, hybrid_state) if return_state else hybrid_out
    state = None
    if initial_state is not None:
        state = _validate.check_state(initial_state, batch, v.shape[-1], compute, q.device)
        if not log_space:  # ordinary maps keep sums at scale 1: fold any shift in
            carry = scale_between(state.shift, torch.zeros_like(state.shift))
            state = LinearAttentionState(
                state.kv * carry[..., None, None], state.k_sum * carry[..., None], carry * 0, state.num_tokens
            )

    options: dict[str, Any] = {"normalize": normalize, "eps": eps, "min_denom": min_denom}

    # under torch.autocast the GEMMs below would run in bf16/fp16 again: the fp32 accumulation is the point
    guard = torch.autocast(q.device.type, enabled=False) if _autocast_on(q.device.type) else nullcontext()
    with guard:
        out, final = run(
            fmap, q, k, v, keep=keep, state=state, form=form, causal=causal, chunk_size=chunk_size,
            log_space=log_space, map_name=map_name, return_state=return_state, options=options,
            log_decay=log_decay, feature_gate=feature_gate, segments=segments,
        )

    out = out.to(out_dtype)
    result: Any = out.detach().numpy() if q_numpy else out
    if return_state:
        return result, final
    return result


def _autocast_on(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


def _run_form(
    fmap: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None,
    state: LinearAttentionState | None,
    form: str,
    causal: bool,
    chunk_size: int | None,
    log_space: bool,
    map_name: str,
    return_state: bool,
    options: dict[str, Any],
    log_decay: torch.Tensor | None = None,
    feature_gate: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Feature maps, stabilisation and the chosen form, on inputs already in the compute dtype."""
    final: LinearAttentionState | None
    if form == "chunked" and not causal:
        size = chunk_size or DEFAULT_NONCAUSAL_CHUNK
        out, final = _noncausal_chunked(fmap, q, k, v, keep, state, log_space, size, map_name, options)
    else:
        qf = _query_features(fmap, q, log_space)
        kf, ref = _key_features(fmap, k, keep, log_space, causal, state.shift if state is not None else None)
        _check_feature_dims(qf.shape[-1], kf.shape[-1], fmap)
        _validate.check_state_features(state, kf.shape[-1], map_name)
        stored_at = ref
        if log_decay is not None:  # a decay is a change of log-scale: ref' = r − G (forms/decay.py)
            ref = decayed_ref(ref, log_decay)
        if segments is not None:  # packed sequences: a jump in log-scale at each start (_packed.py)
            ref = segments.expand(qf.shape[:-1]) if ref is None else ref.to(torch.float64) + segments
        if feature_gate is not None:  # per-feature scales R = ref' − G_f: their own forms (forms/gated.py)
            out, final = _gated_form(qf, kf, v, ref, feature_gate, state, form, chunk_size, return_state, options)
        elif form == "parallel":
            out, final = parallel_attention(
                qf, kf, v, causal=causal, ref=ref, state=state, want_state=return_state, **options
            )
        elif form == "global":
            out, final = global_attention(qf, kf, v, ref=ref, state=state, **options)
        elif form == "recurrent":
            out, final = recurrent_attention(qf, kf, v, ref=ref, state=state, **options)
        else:
            size = chunk_size or DEFAULT_CAUSAL_CHUNK
            out, final = causal_chunked_attention(qf, kf, v, ref=ref, state=state, chunk_size=size, **options)
        if (log_decay is not None or feature_gate is not None) and final is not None:
            # sums stored at ref'_N = r_N − G_N are the decayed sums at scale r_N: the usual meaning of shift
            shift = stored_at[..., -1] if stored_at is not None else torch.zeros_like(final.shift, dtype=q.dtype)
            final = replace(final, shift=shift.to(q.dtype))
    return out, final


def _gated_form(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    ref: torch.Tensor | None,
    feature_gate: torch.Tensor,
    state: LinearAttentionState | None,
    form: str,
    chunk_size: int | None,
    return_state: bool,
    options: dict[str, Any],
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Per-feature gates (GLA) in the chosen causal form; ``ref`` is the per-token scale already decayed."""
    if feature_gate.shape[-1] != kf.shape[-1]:
        raise LinearAttentionError(
            f"log_gate: per-feature gate with {feature_gate.shape[-1]} features, but the feature map gives "
            f"F={kf.shape[-1]}; pass (..., N, F) with F the feature dimension"
        )
    if form not in ("parallel", "recurrent"):  # the chunked form sums the gates block by block
        size = chunk_size or DEFAULT_GATED_CHUNK
        ref64 = ref.to(torch.float64) if ref is not None else None
        return gated_chunked_attention(qf, kf, v, gate=feature_gate, ref=ref64, state=state, chunk_size=size, **options)
    scales = torch.cumsum(feature_gate.to(torch.float64), dim=-2).neg_()  # −G_f (..., N, F)
    if ref is not None:
        scales = scales + ref.to(torch.float64).unsqueeze(-1)
    if form == "parallel":
        return gated_parallel_attention(qf, kf, v, scales=scales, state=state, want_state=return_state, **options)
    return gated_recurrent_attention(qf, kf, v, scales=scales, state=state, **options)


def _noncausal_chunked(
    fmap: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    state: LinearAttentionState | None,
    log_space: bool,
    size: int,
    map_name: str,
    options: dict[str, Any],
) -> tuple[torch.Tensor, LinearAttentionState]:
    """The bounded-memory non-causal form: the feature map runs one chunk at a time."""

    # split once (a slice per chunk would cost a whole-input zero gradient per chunk in backward)
    key_chunks, query_chunks = k.split(size, dim=-2), q.split(size, dim=-2)

    def key_features(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunk_keep = keep[..., start:end] if keep is not None else None
        return _key_features(fmap, key_chunks[start // size], chunk_keep, log_space, False, None)

    def query_features(start: int, end: int) -> torch.Tensor:
        return _query_features(fmap, query_chunks[start // size], log_space)

    features = map_features(fmap, k[..., :1, :], is_query=False).shape[-1]
    _check_feature_dims(map_features(fmap, q[..., :1, :], is_query=True).shape[-1], features, fmap)
    _validate.check_state_features(state, features, map_name)
    if state is None:
        state = empty_state(q.shape[:-2], features, v.shape[-1], q)
    return noncausal_chunked_attention(
        query_features,
        key_features,
        v,
        num_queries=q.shape[-2],
        state=state,
        log_space=log_space,
        chunk_size=size,
        **options,
    )
