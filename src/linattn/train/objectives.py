"""What fitting a learned map minimises (:func:`linattn.train.distill.fit_feature_map`): the captured sequences
prepared (scaled q, k per head; the softmax rows formed per batch, never stored whole), a batch of query rows
against a subset of keys, and the losses per head and row — the distillation cross-entropy against the softmax row,
and the same against the window hybrid's row (window and sink keys exact, a sparse cache's pairs too, the others
linear). Shapes: H heads, R query rows, K keys, d the head dimension, F the features.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import LinearAttentionError
from ..feature_maps import LearnedProjectionMap
from ..feature_maps.scaling import scale_for_map


def _as_list(x: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x)
    if not items or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in items):
        raise LinearAttentionError(f"{name}: expected a tensor (H, N, d) or a non-empty list of such tensors")
    return items


def _prepare(
    q: torch.Tensor | Sequence[torch.Tensor],
    k: torch.Tensor | Sequence[torch.Tensor],
    v: torch.Tensor | Sequence[torch.Tensor] | None,
    scale: float | None,
    causal: bool,
) -> list[dict[str, torch.Tensor]]:
    """Per sequence: scaled q, k (H, N, d) float32, softmax weights A (H, N, N), and A v when v is given."""
    qs, ks = _as_list(q, "q"), _as_list(k, "k")
    vs = _as_list(v, "v") if v is not None else [None] * len(qs)
    if not len(qs) == len(ks) == len(vs):
        raise LinearAttentionError(f"q, k, v: got {len(qs)}, {len(ks)}, {len(vs)} sequences; pass one each")
    heads, dim = qs[0].shape[0], qs[0].shape[-1]
    sequences = []
    for index, (qi, ki, vi) in enumerate(zip(qs, ks, vs, strict=True)):
        for name, tensor in (("q", qi), ("k", ki), ("v", vi)):
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                raise LinearAttentionError(
                    f"{name}: sequence {index} holds {int((~torch.isfinite(tensor)).sum())} NaN/inf values; fitting "
                    "needs finite activations (capture them in fp32 from a model whose outputs are finite)"
                )
        if qi.shape[0] != heads or qi.shape[-1] != dim or ki.shape[-1] != dim or ki.shape[1] != qi.shape[1]:
            raise LinearAttentionError(
                f"q, k: every sequence needs q (H={heads}, N, d={dim}) and k (Hkv, N, d), got {tuple(qi.shape)} "
                f"and {tuple(ki.shape)}"
            )
        if heads % ki.shape[0]:
            raise LinearAttentionError(f"k: {ki.shape[0]} heads do not divide q's {heads} heads")
        group = heads // ki.shape[0]
        qi, ki = qi.detach().float(), ki.detach().float().repeat_interleave(group, dim=0)
        mq, mk, _ = scale_for_map(qi, ki, scale)  # mq·mkᵀ/√d = scale·q·kᵀ
        # the softmax rows are formed per batch (:func:`_batch`), never stored whole: (H, N, N) per sequence is
        # 1.1 GB at 270 heads and N = 1,024, and long captures are what fits for long contexts need
        item = {"q": mq, "k": mk, "causal": torch.tensor(causal), "q_std": mq.std(dim=(-1, -2), keepdim=True),
                "k_std": mk.std(dim=(-1, -2), keepdim=True)}
        if vi is not None:
            item["v"] = vi.detach().float().repeat_interleave(group, dim=0)
        sequences.append(item)
    return sequences


def _batch(
    item: dict[str, torch.Tensor], rows: torch.Tensor, keys: torch.Tensor | None, noise: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Query rows ``rows`` against keys ``keys`` (None: all) of one sequence, as tensors for :func:`_loss`.

    The target is the softmax restricted to the chosen keys (renormalised), a valid attention distribution in
    its own right. With ``noise``, q and k get Gaussian noise of ``noise`` × their per-head std and the target is
    recomputed on the noisy inputs (maps see the scale 1/√d).
    """
    causal = bool(item["causal"])
    keys = torch.arange(item["k"].shape[1]) if keys is None else keys
    q, k = item["q"][:, rows], item["k"][:, keys]  # (H, R, d), (H, K, d)
    mask = keys.unsqueeze(0) <= rows.unsqueeze(-1) if causal else None  # (R, K): row i sees keys j ≤ i
    if noise:
        q = q + noise * item["q_std"] * torch.randn(q.shape, generator=generator)
        k = k + noise * item["k_std"] * torch.randn(k.shape, generator=generator)
    # softmax over the chosen keys (causal: j ≤ i) = the full row restricted to them and renormalised
    logits = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1)  # (H, R, K)
    batch = {"q": q, "k": k, "weights": weights}
    if mask is not None:
        batch["mask"] = mask
    if "v" in item:
        batch["v"] = item["v"][:, keys]
        batch["output"] = weights @ batch["v"]
    return batch


def _loss(fmap: LearnedProjectionMap, batch: dict[str, torch.Tensor], mse_weight: float) -> torch.Tensor:
    """Per head and row (H, R): cross-entropy −Σ_j A_ij log Â_ij = log Σ_j S_ij − Σ_j A_ij log S_ij with
    S_ij = φ(q_i)·φ(k_j), plus ``mse_weight`` · ‖Ŷ_i − Y_i‖² / mean_i ‖Y_i‖² when values are present."""
    qf = fmap.scaled_features(batch["q"], is_query=True)  # (H, R, F), up to a constant per row
    kf = fmap.scaled_features(batch["k"], is_query=False)  # (H, K, F), up to a constant per head
    # + 1e-6: a row whose features are all zero (relu maps) gets uniform weights and a finite loss, not 0/0
    scores = qf @ kf.transpose(-1, -2) + 1e-6  # (H, R, K)
    if "mask" in batch:
        scores = scores.masked_fill(~batch["mask"], 0.0)
        scores = scores.clamp_min(1e-30)  # masked scores are 0, where xlogy's gradient would be 0/0
    norm = scores.sum(-1)  # (H, R)
    loss = torch.log(norm) - torch.special.xlogy(batch["weights"], scores).sum(-1)
    if mse_weight and "v" in batch:
        exact = batch["output"]
        approx = (scores @ batch["v"]) / norm.unsqueeze(-1)  # (H, R, dv)
        scale = exact.square().sum(-1).mean(-1, keepdim=True)  # (H, 1)
        loss = loss + mse_weight * (approx - exact).square().sum(-1) / scale
    return loss


def _window_masks(rows: torch.Tensor, keys: torch.Tensor, window: int, sinks: int, causal: bool
                  ) -> dict[str, torch.Tensor]:
    """Which keys (K,) each query row (R,) of a batch scores exactly (window, sinks) and which linearly: (R, K)."""
    distance = rows.unsqueeze(-1) - keys
    visible = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    near = (distance < window) if causal else (distance.abs() < window)
    exact = visible & (near | (keys < sinks))
    return {"exact": exact, "linear": visible & ~exact}


def _cached_masks(batch: dict[str, torch.Tensor], rows: torch.Tensor, selections: torch.Tensor,
                  block: int) -> dict[str, torch.Tensor]:
    """The window masks (R, K) with each row's cached pairs (its block's row of ``selections`` (H, b, L); those
    in the linear part, i.e. visible, outside the window and not sinks) moved to the exact part: (H, R, K)."""
    keys = batch["k"].shape[1]
    mine = selections[:, rows // block]  # (H, R, L)
    held = torch.zeros(*mine.shape[:2], keys + 1, dtype=torch.bool)
    held.scatter_(-1, torch.where(mine < 0, keys, mine), True)  # slot −1 → the spare column
    cached = held[..., :-1] & batch["linear"]
    return {"exact": batch["exact"] | cached, "linear": batch["linear"] & ~cached}


def _hybrid_loss(fmap: LearnedProjectionMap, batch: dict[str, torch.Tensor], mse_weight: float,
                 log_gamma: torch.Tensor | None, linear_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per head and row (H, R): cross-entropy −Σ_j A_ij log Ĥ_ij against the full hybrid row Ĥ (window and sink
    keys exact, the others linear; see :mod:`linattn.exact`): mass-preserving form when ``log_gamma`` is
    None, else the γ form with γ = exp(log_gamma) (H,); the linear part times ``linear_weight`` (H,) when given
    (a sparse cache's ``linear_weight``)."""
    exact, linear, target = batch["exact"], batch["linear"], batch["weights"]
    logits = (batch["q"] / math.sqrt(batch["q"].shape[-1])) @ batch["k"].transpose(-1, -2)  # (H, R, K)
    exact_logits = logits.masked_fill(~exact, float("-inf"))
    if log_gamma is None:  # per-row constants of φ(q) and per-head ones of φ(k) cancel: scaled features suffice
        qf = fmap.scaled_features(batch["q"], is_query=True)
        kf = fmap.scaled_features(batch["k"], is_query=False)
    else:  # the γ form compares φ(q)·φ(k) with γ·e^{s − max}: the map's true scale matters
        qf, kf = fmap.features(batch["q"], is_query=True), fmap.features(batch["k"], is_query=False)
    scores = (qf @ kf.transpose(-1, -2) + 1e-6).clamp_min(1e-30)  # (H, R, K), as in _loss
    if linear_weight is not None:  # (kept ≥ 1e-30: a weight of 0 leaves the linear keys' log finite)
        scores = torch.where(linear, (scores * linear_weight.view(-1, 1, 1)).clamp_min(1e-30), scores)
    lin_scores = scores.masked_fill(~linear, 0.0)
    shape = torch.log_softmax(exact_logits, dim=-1).masked_fill(~exact, 0.0)  # log softmax over exact keys
    if log_gamma is None:
        mass = scores.masked_fill(~exact, 0.0).sum(-1)  # (H, R): what the map gives the exact keys
        log_exact = torch.log(mass.clamp_min(1e-30)).unsqueeze(-1) + shape
    else:
        top = exact_logits.amax(-1, keepdim=True).clamp_min(-1e30)
        log_exact = (log_gamma.view(-1, 1, 1) + exact_logits - top).masked_fill(~exact, 0.0)
        mass = (log_exact.exp() * exact).sum(-1)
    norm = lin_scores.sum(-1) + mass  # (H, R): the shared normaliser
    loss = torch.log(norm) - torch.special.xlogy(target * linear, lin_scores).sum(-1)
    loss = loss - (target * exact * log_exact).sum(-1)
    if mse_weight and "v" in batch:
        weights = lin_scores + torch.exp(log_exact) * exact
        approx = (weights @ batch["v"]) / norm.unsqueeze(-1)
        scale = batch["output"].square().sum(-1).mean(-1, keepdim=True)
        loss = loss + mse_weight * (approx - batch["output"]).square().sum(-1) / scale
    return loss
