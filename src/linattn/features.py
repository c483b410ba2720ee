"""The feature stage: resolve a feature map, apply it (checked), and keep log-space features on a safe scale.

Every path that turns q and k into features goes through here: the forms (through :mod:`linattn._dispatch`), the
Triton backend, the window op, the decoding steps and context parallelism. Nothing here knows a computation form.

Log-space maps (FAVOR+ and other exp-based maps, ``log_space = True``) return log φ(x). Their features are stored
at a log-scale: a query at its own row maximum c_t (a per-row shift, causal-safe, cancelling in the normalised
ratio), a key at a reference ref_j — the running maximum of log φ over keys ≤ j (causal) or the overall maximum
(non-causal) — so that every stored value is ≤ 1 and the true feature is stored·e^{ref}. Sums kept at one scale
move to another by :func:`scale_between`. The forms read these scales; they never compute them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import LinearAttentionError
from .feature_maps import CallableFeatureMap, FeatureMap, create

NEG_INF = float("-inf")

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


def is_log_space(fmap: nn.Module) -> bool:
    """Whether the map returns log φ (stored at a log-scale), not φ."""
    return bool(getattr(fmap, "log_space", False))


def is_signed(fmap: nn.Module) -> bool:
    """Whether the map may return negative features (its denominator can be zero or negative)."""
    return getattr(fmap, "positive", True) is False


def map_label(fmap: nn.Module) -> str:
    """The map's name for an error message: a wrapped callable's own name, else the module's class."""
    inner = getattr(fmap, "fn", None)  # a wrapped callable: name the user's function, not the wrapper
    return repr(getattr(inner, "__name__", inner)) if inner is not None else type(fmap).__name__


def map_features(
    fmap: nn.Module, x: torch.Tensor, *, is_query: bool, finite: bool = False, nonnegative: bool = False
) -> torch.Tensor:
    """The map's features of ``x`` (..., N, D) → (..., N, F), checked: any map, a user's callable or module too.

    ``finite``: raise on NaN or +inf features (``check_finite=True``; log-space maps may return −inf, log 0).
    ``nonnegative``: raise on a negative feature — for maps whose positivity is unknown (plain callables) under
    ``normalize=True``, where a negative feature can make the denominator φ(q)·Σφ(k) zero or negative.
    """
    features = fmap.features(x, is_query=is_query) if isinstance(fmap, FeatureMap) else fmap(x)
    role = "queries" if is_query else "keys"
    if not isinstance(features, torch.Tensor):
        raise LinearAttentionError(
            f"feature_map {map_label(fmap)}: returned {type(features).__name__} for the {role}; it must return a "
            f"tensor of shape (..., N, F), here {tuple(x.shape[:-1])} + (F,)"
        )
    if features.shape[:-1] != x.shape[:-1]:
        raise LinearAttentionError(
            f"feature_map {map_label(fmap)}: returned shape {tuple(features.shape)} for {role} of shape "
            f"{tuple(x.shape)}; a feature map must keep every leading dim and the token dim, returning "
            f"{tuple(x.shape[:-1])} + (F,) (map the last dim only)"
        )
    if not features.is_floating_point():
        raise LinearAttentionError(
            f"feature_map {map_label(fmap)}: returned dtype {features.dtype} for the {role}; return floating point"
        )
    features = features if features.dtype == x.dtype else features.to(x.dtype)
    if finite:
        bad = torch.isnan(features) | (features == float("inf"))
        if not is_log_space(fmap):
            bad = bad | torch.isinf(features)
        if bool(bad.any()):
            raise LinearAttentionError(
                f"feature_map {map_label(fmap)}: {int(bad.sum())} non-finite feature(s) for the {role} from finite "
                "inputs; check the map (an overflowing exp? a division by zero?)"
            )
    if nonnegative and features.numel() and bool((features < 0).any()):
        raise LinearAttentionError(
            f"feature_map {map_label(fmap)}: returned negative features for the {role} with normalize=True, so the "
            "denominator φ(q)·Σφ(k) can be zero or negative. Pass normalize=False (unnormalised linear attention), "
            "min_denom=... to clamp the denominator, or a FeatureMap subclass (positive = True) if its kernel is "
            "positive although its features are not"
        )
    return features


def check_feature_dims(query_dim: int, key_dim: int, fmap: nn.Module) -> None:
    if query_dim != key_dim:
        raise LinearAttentionError(
            f"feature_map {map_label(fmap)}: {query_dim} query features but {key_dim} key features; φ(q)·φ(k) "
            "needs the same F for both"
        )


def finite(scale: torch.Tensor) -> torch.Tensor:
    """The scale with −inf (nothing seen yet: every feature stored there is 0) read as 0."""
    return torch.where(scale == NEG_INF, 0.0, scale)


def scale_between(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(a − b): moves sums kept at log-scale ``a`` to log-scale ``b ≥ a``.

    0 where ``a`` is −inf (empty sums) or ``keep`` is False, without a NaN in the value or the gradient.
    """
    ok = a != NEG_INF
    if keep is not None:
        ok = ok & keep
    return torch.exp(torch.where(ok, a - b, NEG_INF))


def stored_at(logs: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """Log-features (..., N, F) stored at log-scales ``at`` (..., N): exp(log φ − at); ``at=None``: as they are."""
    if at is None:
        return logs
    return torch.exp(logs - finite(at).unsqueeze(-1))


def stabilise_queries(logs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query log-features at their own row maximum c: (exp(log φ(q) − c), c). The shift cancels in the ratio."""
    row_max = logs.amax(-1)  # (..., N)
    return torch.exp(logs - row_max.unsqueeze(-1)), row_max


def key_scales(logs: torch.Tensor, causal: bool, start: torch.Tensor | None = None) -> torch.Tensor:
    """ref: the running maximum of the keys' log-features (causal) or their overall maximum (non-causal, (..., 1)),
    at least ``start`` (the scale of a carried state) when given. Masked keys must be −inf already."""
    row_max = logs.amax(-1)  # (..., Nk)
    ref = torch.cummax(row_max, dim=-1).values if causal else row_max.amax(-1, keepdim=True)
    if start is not None:
        ref = torch.maximum(ref, start.unsqueeze(-1))
    return ref


def query_features(fmap: nn.Module, q: torch.Tensor, log_space: bool, **checks: bool) -> torch.Tensor:
    """φ(q), or for log-space maps φ(q) at each row's own scale; ``checks`` as :func:`map_features`."""
    qf = map_features(fmap, q, is_query=True, **checks)
    return stabilise_queries(qf)[0] if log_space else qf


UNIT_EPS = 1e-12  # as torch.nn.functional.normalize: a row of norm below it is divided by it instead
UNIT_BLOCK_ROWS = 8192  # rows of the backward's dy·y products at a time (2 MiB at 64 fp32 features)


class _UnitRows(torch.autograd.Function):
    """x/max(‖x‖, ε) over the last dimension, with the backward written out: dx = (dy − y·(dy·y))/‖x‖ (the
    projection only where ‖x‖ > ε), with dy·y = (dy·x)/‖x‖ summed by blocks of rows: one tensor the input's size
    instead of autograd's six through the norm and the division. Keeps x (not y) and the N inverse norms; under
    ``create_graph`` the same formula runs in differentiable operations, so second derivatives are exact too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        inverse = norm.clamp_min(UNIT_EPS).reciprocal_()
        ctx.save_for_backward(x, inverse, norm > UNIT_EPS)
        return x * inverse

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        x, inverse, projected = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of the gradient is wanted: the formula in differentiable operations
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            inverse = 1 / norm.clamp_min(UNIT_EPS)
            y = x * inverse
            return (dy - y * ((dy * y).sum(-1, keepdim=True) * projected)) * inverse
        along = inverse.new_empty(inverse.shape)  # dy·x
        rows, dy_rows, along_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), along.view(-1, 1)
        for begin in range(0, rows.shape[0], UNIT_BLOCK_ROWS):  # no product as large as the input
            block = slice(begin, begin + UNIT_BLOCK_ROWS)
            torch.sum(dy_rows[block] * rows[block], dim=-1, keepdim=True, out=along_rows[block])
        scale = along.mul_(inverse.square()).masked_fill_(~projected, 0).neg_()  # −(dy·y)/‖x‖
        return torch.addcmul(dy, x, scale).mul_(inverse)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x/max(‖x‖, 1e-12) over the last dimension: torch.nn.functional.normalize's values, with a leaner backward.
    Without a gradient to take, the forward's three operations alone (an autograd Function's call costs more than
    they do on one decoding token)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x * torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(UNIT_EPS).reciprocal_()
    return _UnitRows.apply(x)


def unit_features(
    fmap: nn.Module, x: torch.Tensor, *, is_query: bool, log_space: bool, keep: torch.Tensor | None = None,
    finite: bool = False, nonnegative: bool = False, normalized: bool = True,
) -> torch.Tensor:
    """φ(x)/‖φ(x)‖ per token (the delta rule's keys and queries, as DeltaNet and Gated DeltaNet normalise them).
    A log-space map's per-token scale cancels, so its features are read at each row's own maximum first; an
    all-zero φ stays 0 (it writes and reads nothing); masked tokens (``keep`` False) are 0. ``normalized=False``:
    everything but the division by the norm (for a kernel that normalises as it loads)."""
    features = map_features(fmap, x, is_query=is_query, finite=finite, nonnegative=nonnegative)
    if log_space:
        features = stabilise_queries(features)[0]
    if keep is not None:
        features = features.masked_fill(~keep.unsqueeze(-1), 0)
    return unit_rows(features) if normalized else features


def delta_inputs(
    fmap: nn.Module, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, beta: torch.Tensor, *,
    log_space: bool, finite: bool = False, nonnegative: bool = False, normalized: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta rule's feature stage: unit query and key features (:func:`unit_features`, masked keys 0), their
    widths checked, and β with masked tokens' writes set to 0 (their decay still applies)."""
    qf = unit_features(fmap, q, is_query=True, log_space=log_space, finite=finite, nonnegative=nonnegative,
                       normalized=normalized)
    kf = unit_features(fmap, k, is_query=False, log_space=log_space, keep=keep, finite=finite,
                       nonnegative=nonnegative, normalized=normalized)
    check_feature_dims(qf.shape[-1], kf.shape[-1], fmap)
    return qf, kf, beta if keep is None else beta * keep.to(beta.dtype)


def key_features(
    fmap: nn.Module,
    k: torch.Tensor,
    keep: torch.Tensor | None,
    log_space: bool,
    causal: bool,
    start: torch.Tensor | None,
    **checks: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key features with masked keys zeroed, and (log-space maps) the log-scale ref they are stored at."""
    kf = map_features(fmap, k, is_query=False, **checks)
    if log_space:
        if keep is not None:
            kf = kf.masked_fill(~keep.unsqueeze(-1), NEG_INF)
        ref = key_scales(kf, causal, start)
        return stored_at(kf, ref), ref
    if keep is not None:
        kf = kf.masked_fill(~keep.unsqueeze(-1), 0)
    return kf, None


def repeat_kv_heads(x: torch.Tensor, group: int, dim: int = -3) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``group`` consecutive query heads (dim ``dim``)."""
    return x if group == 1 else x.repeat_interleave(group, dim=dim)
