"""Fit learned feature maps (``hedgehog``, ``t2r``) to imitate softmax attention, and save/load them per model.

For each head, with softmax weights A = softmax(s·q kᵀ) (s = 1/√d by default) and the map's weights
Â_ij = φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j'), the loss is the mean row cross-entropy −Σ_j A_ij log Â_ij (Hedgehog's
attention distillation; it equals KL(A‖Â) up to a constant), plus optionally ``mse_weight`` times the relative
output error ‖Â v − A v‖² / ‖A v‖² (as in LoLCATs) when values are given. Every head has its own parameters and
its own loss, so one optimiser fits all heads at once exactly as if each were fitted alone.

Generalising from a few hundred tokens: the defaults (tied query/key projection, m = 2d, identity × 2
initialisation, Gaussian jitter of q and k, random key subsets, 4 sequences per step, 600 steps) were chosen on
MiniLM-L6 attention, measured on held-out text (docs/evaluation.md gives the figures); pass many sequences, e.g.
the text captured in several paragraph orders (``capture_attention(..., orders=4)``), and each step samples 4
of them. A seeded fraction ``holdout`` of the query rows of every sequence is kept out of the loss; each head
keeps the parameters of its best held-out loss (per-head early stopping, on a fixed subset of ``eval_rows``
held-out rows), and fitting stops once no head has improved for ``patience`` evaluations.
``anchor`` adds λ‖W − W₀‖² (a pull towards the initialisation); it did not help on MiniLM and is off.

:func:`fit_model_feature_maps` returns a :class:`~linattn.feature_maps.fitted.FittedFeatureMaps` (one map per
layer, saved and read by :func:`~linattn.feature_maps.fitted.load_feature_maps`); both are re-exported here.
The sequences' preparation, the batches and the losses are :mod:`linattn.train.objectives`; this module holds the
fitting loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._progress import progress_bar
from ..errors import LinearAttentionError
from ..exact.forms.boundary import cache_selections
from ..exact.forms.hybrid import Hybrid
from ..feature_maps import LearnedProjectionMap, create
from ..feature_maps.fitted import FORMAT_VERSION, FittedFeatureMaps, check_head_mask, load_feature_maps
from ..state import SparseCache
from .objectives import _batch, _cached_masks, _hybrid_loss, _loss, _prepare, _window_masks

__all__ = [
    "FORMAT_VERSION",
    "FittedFeatureMaps",
    "check_head_mask",
    "fit_feature_map",
    "fit_model_feature_maps",
    "load_feature_maps",
]


def fit_feature_map(
    q: torch.Tensor | Sequence[torch.Tensor],
    k: torch.Tensor | Sequence[torch.Tensor],
    *,
    kind: str = "hedgehog",
    seed: int = 0,
    v: torch.Tensor | Sequence[torch.Tensor] | None = None,
    causal: bool = False,
    scale: float | None = None,
    num_features: int | None = None,
    tied: bool = True,
    init_scale: float = 2.0,
    steps: int = 600,
    lr: float = 0.02,
    batch_rows: int = 128,
    batch_keys: int | None = 128,
    batch_sequences: int | None = 4,
    holdout: float = 0.2,
    holdout_by: str = "rows",
    eval_every: int = 10,
    eval_rows: int | None = 768,
    patience: int = 6,
    anchor: float = 0.0,
    mse_weight: float = 0.0,
    noise: float = 0.2,
    progress: bool = False,
    window: int | None = None,
    sinks: int = 0,
    window_factor: bool = False,
    sparse_cache: SparseCache | None = None,
    **map_options: Any,
) -> LearnedProjectionMap:
    """Fit a learned map, one set of parameters per head, to imitate softmax attention on q, k.

    Args:
        q: ``(H, N, d)`` queries, or a list of such for several sequences of different lengths (attention is
            taken within each sequence). k: ``(Hkv, N, d)`` likewise (Hkv dividing H: grouped-query attention).
        kind: a registered learned map (``"hedgehog"``, ``"t2r"``) built with ``num_heads=H``.
        seed: the map's initialisation, the held-out rows and the row batches; the same seed gives the same map.
        v: values ``(Hkv, N, dv)`` (or a list), needed only for ``mse_weight > 0``.
        causal, scale: the attention to imitate (scale default 1/√d, as in
            :func:`linattn.evaluate.attention_metrics`).
        num_features: the map's m (default 2d: hedgehog F = 4d, t2r F = 2d). tied: one projection for queries
            and keys (default; halves the parameters, which generalises better from little text).
        init_scale, map_options: passed to the map (``init_scale`` multiplies the identity initialisation:
            sharper softmax features from the start; e.g. ``init="random"``).
        steps, lr: Adam steps and learning rate. batch_rows, batch_keys: query rows and keys (None: all) sampled
            per sequence in each step; the target is softmax over the sampled keys, renormalised.
            batch_sequences: sequences sampled per step (None: all), so that many sequences (e.g. a text captured
            in several paragraph orders) cost no more per step.
        holdout, holdout_by, eval_every, patience: early stopping on held-out query rows (``"rows"``) or whole
            held-out sequences (``"sequences"``); see the module docstring; patience counts evaluations.
            eval_rows: evaluate on a fixed seeded subset of at most about this many held-out rows (None: all).
        anchor: weight of the pull λ‖W − W₀‖² towards the initialisation. mse_weight: weight of the output loss.
        noise: Gaussian jitter on q and k (× their per-head std) in each step, the target recomputed on the
            jittered inputs: it makes the map match exp(q·k/√d) around the training tokens, not only at them.
        progress: show a tqdm progress bar with the held-out loss (on a terminal only: :func:`progress_bar`).
        window, sinks: fit for the sliding-window hybrid (``linear_attention(..., window=W, sinks=S)``): the loss
            is on the full hybrid row (window and sink keys exact, the rest through the map, one normaliser), so
            the map spends its capacity on the keys outside the window. Every key of each sampled row is used.
            window_factor: fit the γ form too (a per-head factor, ``fmap.window_factor``); default the
            parameter-free mass-preserving form. The map remembers ``window``, ``sinks``, ``window_factor``.
        sparse_cache: with ``window``, fit with a sparse exact cache in place (a
            :class:`~linattn.SparseCache`; a per-head ``size`` counts the H heads of q): each row's exact keys are
            also the pairs of its block's cache, decided as ``linear_attention(..., sparse_cache=...)`` decides them
            on each whole sequence (so ``v`` is needed) under the map as it is at each evaluation.

    Returns:
        The fitted map (``num_heads=H``) in eval mode, holding for each head its parameters at the evaluation of
        its best held-out loss; ``fit_history`` on it lists (step, mean train loss, mean held-out loss).

    >>> import torch
    >>> q, k = torch.randn(2, 4, 64, 16).unbind(0)
    >>> fmap = fit_feature_map(q, k, steps=5)
    >>> fmap(q).shape   # hedgehog with m = 2d features per sign: F = 4d
    torch.Size([4, 64, 64])
    """
    if not 0.0 <= holdout < 1.0:
        raise LinearAttentionError(f"holdout: a fraction in [0, 1), got {holdout!r}")
    if steps < 0 or patience < 1 or eval_every < 1 or batch_rows < 1:
        raise LinearAttentionError(f"steps must be ≥ 0 and patience, eval_every, batch_rows ≥ 1, got steps={steps},"
                                   f" patience={patience}, eval_every={eval_every}, batch_rows={batch_rows}")
    if mse_weight and v is None:
        raise LinearAttentionError("mse_weight > 0 needs the values: pass v=...")
    if window is not None and (not isinstance(window, int) or window < 1 or sinks < 0):
        raise LinearAttentionError(f"window, sinks: expected an int ≥ 1 and an int ≥ 0, got {window!r}, {sinks!r}")
    if window is not None:
        batch_keys = None  # the hybrid row needs every key: the linear part's mass depends on all of them
    if sparse_cache is not None and (window is None or v is None or not causal):
        raise LinearAttentionError("sparse_cache: fitting with the cache in place needs window=..., causal=True and "
                                   "the values v=... (the recall score reads them)")
    sequences = _prepare(q, k, v, scale, causal)
    heads, dim = sequences[0]["q"].shape[0], sequences[0]["q"].shape[-1]
    if not isinstance(create(kind, head_dim=dim), LearnedProjectionMap):
        raise LinearAttentionError(f"kind: {kind!r} is not a learned projection map; use 'hedgehog' or 't2r'")
    num_features = 2 * dim if num_features is None else num_features
    fmap = create(kind, head_dim=dim, num_heads=heads, num_features=num_features, tied=tied, seed=seed,
                  init_scale=init_scale, **map_options)
    assert isinstance(fmap, LearnedProjectionMap)
    generator = torch.Generator().manual_seed(seed)
    if holdout_by == "sequences" and len(sequences) >= 2:
        # whole sequences (a seeded choice, about `holdout` of the tokens, at least one) are held out: early
        # stopping then watches text the map was not fitted on, which is what generalisation to new text needs
        shuffled = torch.randperm(len(sequences), generator=generator).tolist()
        budget = holdout * sum(item["q"].shape[1] for item in sequences)
        held_out: list[int] = []
        for index in shuffled[:-1]:
            if not held_out or sum(sequences[i]["q"].shape[1] for i in held_out) < budget:
                held_out.append(index)
        for index, item in enumerate(sequences):
            rows = torch.arange(item["q"].shape[1])
            item["held"], item["train"] = (rows, rows[:0]) if index in held_out else (rows[:0], rows)
    elif holdout_by in ("rows", "sequences"):
        for item in sequences:  # a seeded random subset of each sequence's query rows is held out
            order = torch.randperm(item["q"].shape[1], generator=generator)
            cut = int(round(holdout * len(order)))
            item["held"], item["train"] = order[:cut].sort().values, order[cut:].sort().values
    else:
        raise LinearAttentionError(f"holdout_by: 'rows' or 'sequences', got {holdout_by!r}")
    training = [item for item in sequences if len(item["train"])]
    if not training:
        raise LinearAttentionError("q: no query rows left to train on after the holdout; pass more tokens")
    if eval_rows is not None:  # a fixed seeded subset of the held-out rows, spread evenly over the sequences
        share = max(1, eval_rows // max(1, sum(bool(len(item["held"])) for item in sequences)))
        for item in sequences:
            if len(item["held"]) > share:
                keep = torch.randperm(len(item["held"]), generator=generator)[:share]
                item["held"] = item["held"][keep.sort().values]
    held_rows = sum(len(item["held"]) for item in sequences)

    log_gamma = torch.zeros(1, heads, requires_grad=True) if window is not None and window_factor else None
    beta = None  # the cache's linear weight per head, as the op weighs the linear part
    if sparse_cache is not None and sparse_cache.linear_weight != 1:
        beta = torch.as_tensor(sparse_cache.linear_weight, dtype=torch.float32).expand(heads)

    def loss_of(batch: dict[str, torch.Tensor], rows: torch.Tensor, item: dict[str, torch.Tensor]) -> torch.Tensor:
        if window is None:
            return _loss(fmap, batch, mse_weight)
        batch.update(_window_masks(rows, torch.arange(batch["k"].shape[1]), window, sinks, causal))
        if sparse_cache is not None:
            batch.update(_cached_masks(batch, rows, item["cache"], sparse_cache.block_for(window)))
        return _hybrid_loss(fmap, batch, mse_weight, log_gamma[0] if log_gamma is not None else None, beta)

    def decide() -> None:
        """Each sequence's caches under the map as it is now (the recall score reads the map's state)."""
        if sparse_cache is None:
            return
        hybrid = Hybrid(lambda x, is_query: fmap.features(x, is_query=is_query), log_space=False, window=window or 0,
                        sinks=sinks, factor=None, scale=1.0 / math.sqrt(dim), eps=0.0, min_denom=None)
        with torch.no_grad():
            for item in sequences:
                item["cache"] = cache_selections(hybrid, sparse_cache, item["q"], item["k"], item["v"])

    initial = fmap.weight.detach().clone()
    # each (P, H, ...): the head is dim 1, so heads are kept independently
    params = list(fmap.parameters()) + ([log_gamma] if log_gamma is not None else [])
    best = [p.detach().clone() for p in params]
    best_loss = torch.full((heads,), math.inf)
    optimiser = torch.optim.Adam(params, lr=lr)
    history: list[tuple[int, float, float]] = []
    bar = progress_bar(steps, f"fitting {kind} ({heads} heads)", progress)
    stale = 0
    train_loss = torch.zeros(heads)
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            decide()
            with torch.no_grad():
                watched = torch.zeros(heads)
                for item in sequences:
                    rows = item["held"] if held_rows else item["train"]
                    watched += loss_of(_batch(item, rows, None, 0.0, generator), rows, item).sum(-1)
            improved = watched < best_loss
            stale = 0 if bool(improved.any()) else stale + 1
            best_loss = torch.where(improved, watched, best_loss)
            with torch.no_grad():  # per-head early stopping: keep each head's best parameters
                for saved, param in zip(best, params, strict=True):
                    saved[:, improved] = param.detach()[:, improved]
            _check_finite_loss(watched, step, "held-out")
            watched_mean = float(watched.mean()) / max(held_rows, 1)
            history.append((step, float(train_loss.mean()), watched_mean))
            if bar is not None:
                bar.set_postfix(held_out=f"{watched_mean:.4f}")
            if stale >= patience:
                break
        if step == steps:
            break
        total = torch.zeros(())
        train_loss = torch.zeros(heads)
        chosen = training
        if batch_sequences and batch_sequences < len(training):
            chosen = [training[i] for i in torch.randperm(len(training), generator=generator)[:batch_sequences]]
        for item in chosen:
            pick = torch.randperm(len(item["train"]), generator=generator)[:batch_rows]
            n = item["k"].shape[1]
            keys = None
            if batch_keys and not causal and n > batch_keys:
                keys = torch.randperm(n, generator=generator)[:batch_keys].sort().values
            batch = _batch(item, item["train"][pick], keys, noise, generator)
            losses = loss_of(batch, item["train"][pick], item).mean(-1)  # (H,)
            total = total + losses.sum() / len(chosen)
            train_loss += losses.detach() / len(chosen)
        if anchor:
            total = total + anchor * (fmap.weight - initial).square().sum()
        _check_finite_loss(train_loss, step, "training")
        optimiser.zero_grad()
        total.backward()
        optimiser.step()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    with torch.no_grad():
        for saved, param in zip(best, params, strict=True):
            param.copy_(saved)
    fmap.fit_history = history  # type: ignore[assignment]
    fmap.window, fmap.sinks = window, sinks  # type: ignore[assignment]
    fmap.window_factor = log_gamma[0].detach().exp() if log_gamma is not None else None  # type: ignore[assignment]
    return fmap.eval()


def _check_finite_loss(per_head: torch.Tensor, step: int, kind: str) -> None:
    """Stop, rather than return a map whose history is NaN, once a head's loss is no longer finite."""
    bad = (~torch.isfinite(per_head)).nonzero().flatten().tolist()
    if bad:
        raise LinearAttentionError(
            f"fitting: the {kind} loss of head(s) {bad} became non-finite at step {step}; lower lr (e.g. lr=0.005) "
            "or init_scale, or check the activations for extreme values"
        )


def fit_model_feature_maps(
    capture: Any, *, kind: str = "hedgehog", seed: int = 0, **fit_options: Any
) -> FittedFeatureMaps:
    """Fit one map per layer (parameters per head) on an :class:`~linattn.evaluate.AttentionCapture`.

    All layers are fitted in one optimisation (heads are independent, see :func:`fit_feature_map`), then split
    per layer. ``fit_options`` go to :func:`fit_feature_map` (``num_features``, ``tied``, ``steps``, ``window``,
    ``sinks``, ``window_factor``, ``sparse_cache``, ...); a window fit is recorded
    (:meth:`FittedFeatureMaps.window_options`). ``sparse_cache``: one :class:`~linattn.SparseCache` for every layer
    or one per layer (per-head sizes count one layer's heads).
    A progress bar over the fit's steps (all layers' heads at once) is shown on a terminal unless
    ``progress=False``: a model's fit takes minutes to tens of minutes.
    """
    qs, ks, vs = capture.all_heads()  # lists of (L·H, N, d)
    fit_options.setdefault("progress", True)
    if fit_options.get("mse_weight") or fit_options.get("sparse_cache") is not None:
        fit_options["v"] = vs
    if fit_options.get("sparse_cache") is not None:
        fit_options["sparse_cache"] = _stacked_cache(fit_options["sparse_cache"], capture.num_layers,
                                                     capture.num_heads)
    stacked = fit_feature_map(qs, ks, kind=kind, seed=seed, causal=capture.causal, scale=capture.scaling,
                              **fit_options)
    heads = capture.num_heads
    options = {"num_features": stacked.num_features, "tied": stacked.tied}
    fitted = FittedFeatureMaps(capture.model_name, kind, capture.num_layers, heads, capture.head_dim, options)
    fitted.maps = [stacked.head_slice(i * heads, (i + 1) * heads).eval() for i in range(capture.num_layers)]
    fitted.window, fitted.sinks = getattr(stacked, "window", None), getattr(stacked, "sinks", 0)
    gamma = getattr(stacked, "window_factor", None)  # (L·H,) for the γ form
    if gamma is not None:
        fitted.window_factors = [gamma[i * heads : (i + 1) * heads].clone() for i in range(capture.num_layers)]
    return fitted


def _stacked_cache(cache: SparseCache | Sequence[SparseCache], layers: int, heads: int) -> SparseCache:
    """One cache over the stacked L·H heads from one cache for every layer or one per layer."""
    caches = [cache] * layers if isinstance(cache, SparseCache) else list(cache)
    if len(caches) != layers or not all(isinstance(c, SparseCache) for c in caches):
        raise LinearAttentionError(f"sparse_cache: one SparseCache or one per layer ({layers}), got {cache!r}")
    sizes: list[int] = []
    for layer, item in enumerate(caches):
        size = item.size.tolist() if isinstance(item.size, torch.Tensor) else item.size
        row = [size] * heads if isinstance(size, int) else list(size)
        if len(row) != heads:
            raise LinearAttentionError(f"sparse_cache: layer {layer} gives {len(row)} sizes for {heads} heads")
        sizes.extend(int(x) for x in row)
    first = caches[0]
    if any((c.score, c.block) != (first.score, first.block) or c.keep is not None for c in caches):
        raise LinearAttentionError("sparse_cache: fitting takes caches of one score and block, not the oracle")
    weights: list[float] = []
    for item in caches:
        weight = item.linear_weight
        weights.extend([float(weight)] * heads if isinstance(weight, int | float) else weight)
    if len(weights) != len(sizes):
        raise LinearAttentionError(f"sparse_cache: one linear weight per head ({heads}) or one per layer, got "
                                   f"{[c.linear_weight for c in caches]!r}")
    return SparseCache(size=tuple(sizes), score=first.score, block=first.block, linear_weight=tuple(weights))
