"""How well a feature map imitates softmax attention: output error, row KL, row entropies (float64).

For one head with queries q (N, d), keys k (N, d), values v (N, dv) and scale s (default 1/√d):

- exact weights  A = softmax(s·q kᵀ) (rows; causal: keys j ≤ i), output Y = A v;
- linear weights Â_ij = φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j'), output Ŷ = Â v, computed by
  :func:`linattn.linear_attention` itself (so the map is measured as it is used);
- ``rel_error`` = ‖Ŷ − Y‖_F / ‖Y‖_F per head, ``kl`` = mean over rows of KL(A_i ‖ Â_i) = Σ_j A_ij log(A_ij/Â_ij),
  ``entropy`` / ``entropy_linear`` = mean row entropies −Σ_j A_ij log A_ij of A and of Â.

Feature maps are written for the standard scale 1/√d (FAVOR+ divides x by d^¼, learned maps are fitted that way),
so for another scale q and k are both multiplied by c = (s·√d)^½ before the map: then c²/√d = s.
A signed map can give weights ≤ 0, where KL is undefined: weights are floored at 1e-12 (and rows renormalised)
before KL and entropies, which also keeps a map with exact zeros (relu, t2r) finite. The floor is reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import LinearAttentionError
from ..feature_maps.scaling import scale_for_map
from ..features import FeatureMapLike, is_signed, resolve_feature_map
from ..functional import linear_attention

WEIGHT_FLOOR = 1e-12


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception as error:  # noqa: BLE001 - any conversion failure is a bad input
            raise LinearAttentionError(f"{name}: expected a tensor or array of shape (..., N, d), got "
                                       f"{type(x).__name__}") from error
    if not x.is_floating_point() or x.dim() < 2:
        raise LinearAttentionError(f"{name}: expected a floating tensor of shape (..., N, d), got dtype {x.dtype} "
                                   f"shape {tuple(x.shape)}")
    return x


def softmax_weights(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """A = softmax(scale·q kᵀ) over keys (causal: j ≤ i); (..., Nq, d), (..., Nk, d) → (..., Nq, Nk)."""
    logits = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


def linear_weights(
    q: torch.Tensor, k: torch.Tensor, fmap: nn.Module, causal: bool, *, signed: bool = False,
    window: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Â (..., Nq, Nk) through :func:`linear_attention` with v = I_Nk: each output row is one row of weights.
    ``window``: the hybrid's options (``window``, ``sinks``, ``window_factor``) — then Â is the hybrid row."""
    eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device).expand(*k.shape[:-1], k.shape[-2])
    options: dict[str, Any] = {"min_denom": 1e-6} if signed else {}
    if window:
        options.update(window)
        if isinstance(options.get("window_factor"), torch.Tensor):
            options["window_factor"] = options["window_factor"].to(q.dtype)
    return linear_attention(q, k, eye, feature_map=fmap, causal=causal, **options)


def _row_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Mean over rows of −Σ_j w_ij log w_ij; zero weights contribute 0. (..., N, N) → (...)."""
    return -torch.special.xlogy(weights, weights).sum(-1).mean(-1)


@dataclass
class SoftmaxReference:
    """Exact softmax attention of one (q, k, v), float64, computed once and shared by every map measured on it.

    ``weights`` A (..., N, Nk), ``output`` Y = A v (..., N, dv), ``entropy`` (...): mean row entropy of A.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool
    weights: torch.Tensor
    output: torch.Tensor
    entropy: torch.Tensor


def softmax_reference(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None
                      ) -> SoftmaxReference:
    """Validate q, k, v (float64, grouped-query heads repeated) and compute exact attention."""
    q = _as_tensor(q, "q").detach().to(torch.float64)
    k = _as_tensor(k, "k").detach().to(torch.float64)
    v = _as_tensor(v, "v").detach().to(torch.float64)
    if q.dim() != k.dim() or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise LinearAttentionError(
            f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not fit (..., N, d), "
            "(..., Nk, d), (..., Nk, dv)"
        )
    if causal and q.shape[-2] != k.shape[-2]:
        raise LinearAttentionError(f"causal=True needs Nq = Nk, got {q.shape[-2]} and {k.shape[-2]}")
    if q.shape[:-2] != k.shape[:-2]:  # grouped-query attention: (..., Hkv, N, d) → (..., H, N, d)
        if q.dim() < 3 or q.shape[:-3] != k.shape[:-3] or q.shape[-3] % k.shape[-3]:
            raise LinearAttentionError(f"q, k: head counts {tuple(q.shape)} and {tuple(k.shape)} are incompatible")
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = scale_for_map(q, k, scale)[2]
    weights = softmax_weights(q, k, s, causal)  # (..., N, Nk)
    return SoftmaxReference(q, k, v, s, causal, weights, weights @ v, _row_entropy(weights))


def attention_metrics(
    q: Any,
    k: Any,
    v: Any,
    feature_map: FeatureMapLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    reference: SoftmaxReference | None = None,
    window: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compare linear attention with ``feature_map`` to exact softmax attention, in float64.

    Args:
        q: ``(..., N, d)`` queries, e.g. ``(H, N, d)`` for the heads of one layer. k, v: ``(..., Nk, d)``,
            ``(..., Nk, dv)``; k and v may have fewer heads at dim −3 (grouped-query attention).
        feature_map: a registered name, a feature-map module or a callable, as for :func:`linear_attention`.
        causal: compare causal attention (token i sees keys ≤ i).
        scale: softmax scale (default 1/√d); see the module docstring for how maps see it.
        reference: :func:`softmax_reference` of the same q, k, v, to reuse when measuring several maps
            (q, k, v, causal and scale are then taken from it).
        window: measure the sliding-window hybrid: ``{"window": W, "sinks": S, "window_factor": γ}`` as for
            :func:`linear_attention` (the window's softmax scale is the map's, so it equals ``scale``).

    Returns:
        A dict with floats ``rel_error`` (mean over heads of ‖Ŷ−Y‖/‖Y‖), ``rel_error_total`` (‖Ŷ−Y‖/‖Y‖ over all
        heads at once), ``kl``, ``entropy`` (softmax), ``entropy_linear``, ``feature_dim``, ``weight_floor``; and
        ``per_head``: a dict of float64 tensors shaped like the leading dims ``(...)`` with ``rel_error``,
        ``kl``, ``entropy``, ``entropy_linear``.

    >>> import torch
    >>> q, k, v = torch.randn(3, 2, 50, 16).unbind(0)
    >>> m = attention_metrics(q, k, v, "elu")
    >>> sorted(m["per_head"]), m["per_head"]["kl"].shape
    (['entropy', 'entropy_linear', 'kl', 'rel_error'], torch.Size([2]))
    """
    ref = reference if reference is not None else softmax_reference(q, k, v, causal=causal, scale=scale)
    fmap = resolve_feature_map(feature_map, ref.q.shape[-1])
    signed = is_signed(fmap)
    mq, mk = (x * math.sqrt(ref.scale * math.sqrt(ref.q.shape[-1])) for x in (ref.q, ref.k))
    with torch.no_grad():
        approx = linear_weights(mq, mk, fmap, ref.causal, signed=signed, window=window)  # (..., N, Nk)
        y_hat = approx @ ref.v
        err = (y_hat - ref.output).flatten(-2).norm(dim=-1) / ref.output.flatten(-2).norm(dim=-1).clamp_min(1e-300)
        total = float((y_hat - ref.output).norm() / ref.output.norm().clamp_min(1e-300))
        floored = approx.clamp_min_(WEIGHT_FLOOR)  # approx is not needed unfloored any more
        if ref.causal:
            floored = floored.tril_()  # future keys keep weight exactly zero, they are not floored
        floored /= floored.sum(-1, keepdim=True)
        entropy_linear = _row_entropy(floored)
        # KL(A‖Â) = −H(A) − Σ_j A_ij log Â_ij
        cross = torch.special.xlogy(ref.weights, floored).sum(-1).mean(-1)
        kl = -ref.entropy - cross
    per_head = {"rel_error": err, "kl": kl, "entropy": ref.entropy, "entropy_linear": entropy_linear}
    if not all(bool(torch.isfinite(values).all()) for values in per_head.values()):
        raise LinearAttentionError(
            f"feature_map {type(fmap).__name__}: linear attention weights are not finite on these inputs"
        )
    result: dict[str, Any] = {name: float(values.mean()) for name, values in per_head.items()}
    features = map_output_dim(fmap, ref.q.shape[-1])
    result.update(rel_error_total=total, feature_dim=features, weight_floor=WEIGHT_FLOOR, per_head=per_head)
    return result


def map_output_dim(fmap: nn.Module, head_dim: int) -> int:
    """Feature dimension F of a map: its ``output_dim`` when it has one, else measured on one input."""
    output_dim = getattr(fmap, "output_dim", None)
    if callable(output_dim):
        return int(output_dim(head_dim))
    with torch.no_grad():
        return int(fmap(torch.zeros(1, head_dim)).shape[-1])


def _layer_window(window: dict[str, Any] | None, layer: int, layers: int) -> dict[str, Any] | None:
    """The hybrid options of the ``layer``-th map: a per-layer list of factors is indexed by layer."""
    if not window or not isinstance(window.get("window_factor"), list | tuple):
        return window
    factors = window["window_factor"]
    if len(factors) != layers:
        raise LinearAttentionError(f"window_factor: {len(factors)} per-layer factors for {layers} maps")
    return {**window, "window_factor": factors[layer]}


def capture_references(capture: Any) -> list[SoftmaxReference]:
    """Exact attention of every sequence of a capture, all layers' heads stacked: weights ``(L·H, N, N)``."""
    return [softmax_reference(q, k, v, causal=capture.causal, scale=capture.scaling)
            for q, k, v in zip(*capture.all_heads(), strict=True)]


def _heads(ref: SoftmaxReference, start: int, stop: int) -> SoftmaxReference:
    return SoftmaxReference(ref.q[start:stop], ref.k[start:stop], ref.v[start:stop], ref.scale, ref.causal,
                            ref.weights[start:stop], ref.output[start:stop], ref.entropy[start:stop])


def capture_metrics(
    capture: Any,
    feature_map: FeatureMapLike | Sequence[nn.Module],
    *,
    references: list[SoftmaxReference] | None = None,
    window: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`attention_metrics` over every layer, head and sequence of an :class:`AttentionCapture`.

    ``feature_map`` is one map for all heads — a name, a module (a per-head module must have ``num_heads = L·H``,
    heads ordered as in ``capture.all_heads()``) or a callable — or a sequence of L per-layer modules.
    ``references``: :func:`capture_references` of the capture, to reuse across maps. Sequences are weighted by
    their token counts; the scalars are means over all L·H heads, and ``per_head`` holds ``(L, H)`` tensors.
    ``window``: the hybrid's options (see :func:`attention_metrics`); its ``window_factor`` may be one tensor
    for all L·H heads or a list of L per-layer (H,) tensors.
    """
    per_layer = isinstance(feature_map, Sequence) and not isinstance(feature_map, str)
    maps: list[Any] = list(feature_map) if per_layer else [feature_map]  # type: ignore[arg-type]
    if per_layer and len(maps) != capture.num_layers:
        raise LinearAttentionError(f"feature_map: got {len(maps)} per-layer maps for {capture.num_layers} layers")
    refs = references if references is not None else capture_references(capture)
    heads = capture.num_heads if per_layer else capture.num_layers * capture.num_heads
    sums: dict[str, torch.Tensor] = {}
    error_sq = norm_sq = 0.0
    features = 0
    for ref in refs:
        n = ref.q.shape[-2]
        parts = [attention_metrics(None, None, None, fmap, reference=_heads(ref, i * heads, (i + 1) * heads),
                                   window=_layer_window(window, i, len(maps)))
                 for i, fmap in enumerate(maps)]
        features = parts[0]["feature_dim"]
        for name in parts[0]["per_head"]:
            values = torch.cat([part["per_head"][name] for part in parts])  # (L·H,)
            sums[name] = sums.get(name, torch.zeros_like(values)) + values * n
        # ‖Ŷ−Y‖² summed over heads = Σ_h rel_error_h² ‖Y_h‖²
        y_sq = ref.output.square().sum((-1, -2))
        rel = torch.cat([part["per_head"]["rel_error"] for part in parts])
        error_sq += float((rel.square() * y_sq).sum())
        norm_sq += float(y_sq.sum())
    tokens = sum(ref.q.shape[-2] for ref in refs)
    shape = (capture.num_layers, capture.num_heads)
    per_head = {name: (value / tokens).reshape(shape) for name, value in sums.items()}
    result: dict[str, Any] = {name: float(values.mean()) for name, values in per_head.items()}
    result.update(rel_error_total=math.sqrt(error_sq / norm_sq), feature_dim=features, weight_floor=WEIGHT_FLOOR,
                  per_head=per_head, num_tokens=tokens)
    return result
