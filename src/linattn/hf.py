"""Hugging Face transformers integration: linear attention as the attention implementation ``"linattn"``.

Importing this module registers ``"linattn"`` with transformers' ``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (a mask function that hands over the 2-D padding mask instead of an N×N one), so any
model that dispatches through them switches by the library's own switch:

>>> import linattn.hf                                                   # doctest: +SKIP
>>> model = AutoModel.from_pretrained(path, attn_implementation="linattn")   # doctest: +SKIP
>>> model.set_attn_implementation("linattn")                           # or on a loaded model   # doctest: +SKIP
>>> linattn.hf.linearize(model, fitted)          # per-layer fitted maps (linattn.train), and switch  # doctest: +SKIP

What the model's attention becomes, per layer and head (q, k: (B, H, N, d) after the model's own projections,
rotary embeddings included; s: the model's softmax scale):

    out_t = φ(c·q_t)·Σ_j φ(c·k_j) v_jᵀ / (φ(c·q_t)·Σ_j φ(c·k_j) + eps),   c = (s·√d)^½, j over kept keys (≤ t if causal)

**Scale.** Feature maps see q and k, not q·kᵀ, so the scale cannot be applied to the product. Maps here are built
for the standard scale s = 1/√d (FAVOR+ divides by d^¼ itself; :mod:`linattn.train.distill` fits maps at the scale the
model uses, expressed the same way), so q and k are each multiplied by c, which is 1 for s = 1/√d: the map then
sees the model's raw q and k. This is the convention of :mod:`linattn.evaluate`.

**Masks.** Padding is honoured: masked keys enter neither numerator nor normaliser. Encoders (``is_causal`` False
on the attention module, e.g. BERT/MiniLM) attend non-causally, decoders causally. Masks other than padding
(sliding windows, packed sequences, block overlays, position biases, soft-capping) have no linear-attention
counterpart here and raise :class:`~linattn.LinearAttentionError` rather than being ignored.

**Generation.** :func:`linearize` makes ``model.generate`` use :class:`linattn.hf_cache.LinearAttentionCache`: per
layer the linear-attention state instead of every key and value, so memory and time per token stay flat at any
context (the prompt runs in the chunked form, each new token in the lean step of :mod:`linattn.decode`). With
transformers' own KV cache (``DynamicCache``) a query sees all cached keys and linattn recomputes the sums over
them, O(t) per token: as correct, not faster.

**Options.** ``linearize(model, maps, window=64, sinks=4, eps=...)``: keyword options that ``linear_attention``
accepts are kept on each attention module (``linattn_options``) and passed to every call, the cached ones included.
``update="delta"`` (with a fixed ``beta=`` and ``decay=``) gives every layer the delta rule (docs/delta_layer.md),
decoded by :class:`~linattn.decode.DeltaDecodeStep` in the cache.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._rows import by_rows, left_pads  # noqa: F401  (re-exported: the names' old home)
from .errors import LinearAttentionError
from .feature_maps import create
from .feature_maps.fitted import load_feature_maps
from .functional import linear_attention
from .hf_decode import install as install_decoding
from .hf_options import cache_from_json, check_attention_options, check_gates, split_options
from .nn.token_linear import lean_linears

IMPLEMENTATION = "linattn"
DEFAULT_FEATURE_MAP = "elu"
MAP_ATTRIBUTE = "linattn_feature_map"
OPTIONS_ATTRIBUTE = "linattn_options"
GATES_ATTRIBUTE = "linattn_gates"
# linear_attention arguments that linattn.hf sets itself, per call


def _feature_map_of(module: nn.Module, head_dim: int) -> nn.Module:
    """The map installed by :func:`linearize`, else one made once from ``config.linattn_feature_map`` (or elu+1).

    Made once and kept on the module: a random map (FAVOR+) must not be redrawn at every call.
    """
    fmap = getattr(module, MAP_ATTRIBUTE, None)
    if fmap is None:
        config = getattr(module, "config", None)
        name = getattr(config, "linattn_feature_map", None) or DEFAULT_FEATURE_MAP
        fmap = create(name, head_dim=head_dim)
        setattr(module, MAP_ATTRIBUTE, fmap)
    return fmap


def _keep_from_dense_mask(mask: torch.Tensor, num_queries: int, causal: bool) -> torch.Tensor:
    """A 4-D mask (B, 1|H, Nq, Nk), bool or additive, as a key padding mask (B, Nk) — if it is one.

    Accepted: padding alone (every query row the same), or padding combined with the causal pattern aligned to the
    last key. Anything else (sliding windows, documents packed together) cannot be expressed and raises.
    """
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # additive: 0 or min
    keep = allowed.any(dim=-2).any(dim=1)  # (B, Nk): kept by some query in some head
    num_keys = keep.shape[-1]
    padding_only = keep[:, None, None, :].expand(allowed.shape)
    if bool((allowed == padding_only).all()):
        return keep
    if causal:
        offset = num_keys - num_queries  # queries are the last Nq positions
        tril = torch.ones(num_queries, num_keys, dtype=torch.bool, device=mask.device).tril(offset)
        if bool((allowed == (padding_only & tril)).all()):
            return keep
    raise LinearAttentionError(
        f"attention_mask: a {tuple(mask.shape)} mask that is neither key padding nor key padding with the causal "
        "pattern; linear attention can only drop whole keys. Pass a 2-D padding mask (B, N) instead"
    )


def linattn_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q (B, H, Nq, d), k/v (B, Hkv, Nk, ·) → ((B, Nq, H, dv), None).

    ``attention_mask`` is the (B, Nk) bool mask from :func:`linattn_mask` (True = keep), or a 4-D mask a caller
    built (see :func:`_keep_from_dense_mask`), or None.
    """
    for option in ("sliding_window", "softcap", "position_bias"):
        if kwargs.get(option) is not None:
            raise LinearAttentionError(
                f"{type(module).__name__}: {option}={kwargs[option]!r} has no counterpart in linear attention; use "
                "a model without it, or another attn_implementation for this model"
            )
    if dropout:
        raise LinearAttentionError(
            f"dropout: attention dropout {dropout} drops softmax weights, which linear attention never forms; set "
            "the model's attention dropout to 0 (e.g. config.attention_probs_dropout_prob = 0) or call model.eval()"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    layer = _cache_layer(module, key) if causal else None  # set when a LinearAttentionCache returned these keys
    num_queries, num_keys, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    if causal and num_queries > num_keys:
        raise LinearAttentionError(f"query: {num_queries} causal queries but only {num_keys} keys")

    keep = None
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            keep = _keep_from_dense_mask(attention_mask, num_queries, causal)
        elif attention_mask.dim() == 2:
            keep = attention_mask.to(torch.bool)[:, -num_keys:]
        else:
            raise LinearAttentionError(
                f"attention_mask: expected (B, Nk) or (B, 1, Nq, Nk), got {tuple(attention_mask.shape)}"
            )

    query, key = _scaled(query, key, scaling)
    if layer is not None:
        return _layer_attention(module, layer, query, key, value, keep), None
    gates = getattr(module, GATES_ATTRIBUTE, None)  # per-token β / log-gates from the keys (linattn.nn.KeyGates)
    fmap, options = _feature_map_of(module, head_dim), getattr(module, OPTIONS_ATTRIBUTE, None) or {}
    options, weight = readout_options(gates, query.shape[1], options)
    if causal and num_queries < num_keys:
        # the queries are the last positions (a KV cache): causal attention over all keys with placeholder
        # queries in front; their outputs are discarded, and query t still sees keys ≤ its own position only
        filler = query[..., :1, :].expand(*query.shape[:-2], num_keys - num_queries, head_dim)
        query = torch.cat([filler, query], dim=-2)  # (B, H, Nk, d)
    def per_token(k: torch.Tensor) -> dict[str, Any]:
        return {} if gates is None else gates(k)

    pads = left_pads(keep, options)
    if pads is not None:  # a left-padded batch with sinks: each row on its own, its sinks its own first tokens
        out = by_rows(pads, lambda q, k, v: linear_attention(q, k, v, feature_map=fmap, causal=causal, **options,
                                                             **per_token(k)), query, key, value)
    else:
        out = linear_attention(query, key, value, feature_map=fmap, causal=causal, key_padding_mask=keep, **options,
                               **per_token(key))
    return _heads_last(out[..., -num_queries:, :], weight), None


def _scaled(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k times c, for the feature maps, built for 1/√d: c²/√d = ``scaling`` (module docstring)."""
    head_dim = query.shape[-1]
    s = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    c = math.sqrt(s * math.sqrt(head_dim))
    return (query * c, key * c) if c != 1.0 else (query, key)


def _layer_attention(module: nn.Module, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     keep: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of q (B, H, Nq, d) (scaled), k and v after the keys in the LinearAttentionCache layer
    ``layer``, updating its state → (B, Nq, H, dv): a decoding token of a kept key in one C++ call where the
    step has one, else the step or the chunked form."""
    gates = getattr(module, GATES_ATTRIBUTE, None)  # per-token β / log-gates from the keys (linattn.nn.KeyGates)
    if query.shape[-2] == 1:
        out = _hf_cache().fused_token(layer, query, key, value, keep, gates)  # λ included: one C++ call
        if out is not None:
            return out.transpose(1, 2)  # (B, 1, H, dv): the size-1 dim moved, contiguous as it is
    fmap, options = _feature_map_of(module, query.shape[-1]), getattr(module, OPTIONS_ATTRIBUTE, None) or {}
    options, weight = readout_options(gates, query.shape[1], options)
    out = _hf_cache().attend(layer, fmap, query, key, value, keep, options, gates)
    return _heads_last(out, weight)


def _heads_last(out: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """(B, H, Nq, dv) → (B, Nq, H, dv) contiguous, as transformers takes it, times the read-out weight λ (H,)
    where there is one: the copy and the product in one pass."""
    moved = out.transpose(1, 2)
    if weight is None:
        return moved.contiguous()
    if torch.is_grad_enabled() and (out.requires_grad or weight.requires_grad):  # out= records no gradient
        return (moved * weight.to(out.dtype)[:, None]).contiguous()
    return torch.mul(moved, weight.to(out.dtype)[:, None], out=torch.empty(moved.shape, dtype=out.dtype,
                                                                          device=out.device))


def readout_options(gates: Any, heads: int, options: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The options of a call with ``gates`` that weigh the memory's read-out by λ (:class:`linattn.nn.KeyGates`
    with ``readout=True``): γ = 1/λ, so that the composed route's γ·A + R times λ is A + λ·R; and λ (H,) to
    multiply the output by. Without such gates, the options as given and None."""
    weigh = getattr(gates, "readout_weight", None)
    weight = None if weigh is None else weigh(heads)
    if weight is None:
        return options, None
    return {**options, "window_factor": 1.0 / weight}, weight


_HF_CACHE: Any = None  # linattn.hf_cache once imported; False: transformers without cache_utils


def _hf_cache() -> Any:
    """:mod:`linattn.hf_cache`, imported at the first call (it needs transformers' cache_utils), or False."""
    global _HF_CACHE
    if _HF_CACHE is None:
        try:
            from . import hf_cache
        except ImportError:  # transformers without cache_utils: never a LinearAttentionCache
            _HF_CACHE = False
        else:
            _HF_CACHE = hf_cache
    return _HF_CACHE


def _cache_layer(module: nn.Module, key: torch.Tensor) -> Any:
    cache = _hf_cache()
    return cache.pending_layer(module, key) if cache else None


def linattn_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-function contract, for ``"linattn"``: the 2-D padding mask (B, kv_length), or None.

    Linear attention needs no N×N mask: causality is the ``causal`` flag and padding drops whole keys. Only the
    plain causal and bidirectional patterns are accepted; the others (sliding windows, packing) raise.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function is not None and mask_function not in (causal_mask_function, bidirectional_mask_function):
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise LinearAttentionError(
            f"attention mask: the model asks for the mask pattern {name!r} (a sliding window, packed sequences or "
            "an overlay), which linear attention cannot express; only padding with causal or full attention is "
            "supported"
        )
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:].to(torch.bool)


def register() -> None:
    """Register ``"linattn"`` with transformers' attention and mask interfaces (done on import; idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise LinearAttentionError(
            "linattn.hf needs transformers ≥ 5 (pip install 'linattn[models]')"
        ) from error
    AttentionInterface.register(IMPLEMENTATION, linattn_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, linattn_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules in layer order: modules named ``*Attention`` with an int ``layer_idx``.

    (In transformers 5 these are the modules that call the attention interface: ``BertSelfAttention``,
    ``LlamaAttention``, ...; cross-attention modules of encoder-decoders are included in module order.)
    """
    found = [
        m for m in model.modules()
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    return sorted(found, key=lambda m: m.layer_idx)  # type: ignore[arg-type, return-value]


FeatureMaps = str | nn.Module | Sequence[nn.Module] | Any


def linearize(model: nn.Module, feature_maps: FeatureMaps = DEFAULT_FEATURE_MAP, *,
              gates: Sequence[nn.Module] | None = None, **options: Any) -> nn.Module:
    """Install feature maps in every attention layer of a transformers ``model`` and switch it to ``"linattn"``.

    Args:
        model: a loaded transformers model whose attention dispatches through ``AttentionInterface``.
        feature_maps: one of
            - fitted maps from :mod:`linattn.train.distill` (a ``FittedFeatureMaps``, its ``.maps`` one per layer), or
              the path of a file written by its ``save()``,
            - a sequence of map modules, one per attention layer (per-head maps with the model's head count),
            - a registered name (``"elu"``, ``"favor+"``, ...): one new map per layer, built with ``options``
              (e.g. ``num_features=``, ``seed=``; a random map with ``seed=`` gets ``seed + layer``),
            - one module, shared by every layer.
        gates: one module per attention layer that computes per-token ``beta`` (the delta rule's write strength)
            and ``log_gate`` from the layer's keys (B, Hkv, N, d), e.g. :class:`linattn.nn.KeyGates`; kept as the
            submodule ``linattn_gates`` and called at every attention call, decoding included. None removes any.
        options: keyword options of ``linear_attention`` (``window=``, ``sinks=``, ``eps=``, ``chunk_size=``, ...
            whatever it accepts) are kept for every attention call; the others go to a named map.

    Returns the same model, modified in place: each attention module holds its map as the submodule
    ``linattn_feature_map`` (so ``model.to(...)`` moves it and it appears in ``state_dict``) and its options as
    ``linattn_options``. Switch back with ``model.set_attn_implementation("sdpa")``; the maps stay attached, unused.
    A model with ``generate`` then generates with a :class:`~linattn.hf_cache.LinearAttentionCache`, and its
    ``nn.Linear`` layers become :class:`~linattn.nn.token_linear.TokenLinear` (the same layers; a decoding token's
    product runs a native kernel that streams the weights faster than torch's one-row BLAS call).
    """
    register()
    if isinstance(feature_maps, str | os.PathLike) and os.path.isfile(feature_maps):
        feature_maps = load_feature_maps(os.fspath(feature_maps))  # before the options: a file carries its window
    attention_options, options = split_options(dict(options), feature_maps)
    modules = attention_modules(model)
    if not modules:
        raise LinearAttentionError(
            f"model: no attention module (a '*Attention' module with a layer_idx) found in {type(model).__name__}"
        )
    per_layer_caches = attention_options.get("sparse_cache")
    if isinstance(per_layer_caches, dict):  # one cache for all, as JSON (a saved folder's options)
        attention_options["sparse_cache"] = cache_from_json(per_layer_caches)
    if isinstance(per_layer_caches, list | tuple):  # one cache per layer (per-head budgets chosen per layer)
        if len(per_layer_caches) != len(modules):
            raise LinearAttentionError(f"sparse_cache: {len(per_layer_caches)} caches for {len(modules)} attention "
                                       "layers; pass one per layer, or one for all")
        # a layer's cache as JSON (a saved folder's options): a list of per-head ints is a per-head budget
        per_layer_caches = [cache_from_json(cache) for cache in per_layer_caches]
        for cache in per_layer_caches:
            check_attention_options({**attention_options, "sparse_cache": cache})
    else:
        per_layer_caches = None
        check_attention_options(attention_options)  # at the call, not at the model's first forward
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if config is not None and heads else None
    )
    maps: list[nn.Module]
    if isinstance(feature_maps, str):
        if head_dim is None:
            raise LinearAttentionError("model: config has no head_dim / hidden_size and num_attention_heads")
        maps = []
        for layer in range(len(modules)):
            layer_options = dict(options)
            if "seed" in layer_options and layer_options["seed"] is not None:
                layer_options["seed"] = int(layer_options["seed"]) + layer  # independent draws per layer
            maps.append(create(feature_maps, head_dim=head_dim, **layer_options))
    elif isinstance(feature_maps, nn.Module):
        maps = [feature_maps] * len(modules)
    else:
        maps = list(getattr(feature_maps, "maps", feature_maps))
    if len(maps) != len(modules):
        raise LinearAttentionError(
            f"feature_maps: {len(maps)} maps for {len(modules)} attention layers; pass one per layer "
            "(fitted on this model) or a single map/name"
        )
    layer_gates = check_gates(gates, len(modules), attention_options)
    for layer, (module, fmap) in enumerate(zip(modules, maps, strict=True)):
        if hasattr(module, GATES_ATTRIBUTE):
            delattr(module, GATES_ATTRIBUTE)
        if layer_gates is not None:
            setattr(module, GATES_ATTRIBUTE, layer_gates[layer])
        if not isinstance(fmap, nn.Module):
            raise LinearAttentionError(f"feature_maps[{layer}]: expected an nn.Module, got {type(fmap).__name__}")
        map_heads = getattr(fmap, "num_heads", None)
        if map_heads is not None and heads is not None and map_heads not in (1, heads):
            raise LinearAttentionError(
                f"feature_maps[{layer}]: a per-head map for {map_heads} heads, but the model has {heads} heads"
            )
        map_dim = getattr(fmap, "head_dim", None)
        if map_dim is not None and head_dim is not None and map_dim != head_dim:
            raise LinearAttentionError(
                f"feature_maps[{layer}]: built for head_dim={map_dim}, the model's heads have {head_dim}"
            )
        setattr(module, MAP_ATTRIBUTE, fmap)
        layer_options = dict(attention_options)
        fitted_options = getattr(feature_maps, "window_options", None)  # maps fitted with the window in place
        if fitted_options is not None and layer_options.get("window") is not None:
            factor = fitted_options(layer).get("window_factor")  # the γ form's per-head factor of this layer
            if factor is not None and "window_factor" not in layer_options:
                layer_options["window_factor"] = factor  # (H,): broadcasts over the (B, H) batch dims
        if per_layer_caches is not None:
            layer_options["sparse_cache"] = per_layer_caches[layer]
            if per_layer_caches[layer].holds_nothing:  # a layer the split left no pair: the same result without a
                del layer_options["sparse_cache"]  # cache, on the window op's own (faster) route
        setattr(module, OPTIONS_ATTRIBUTE, layer_options)
    if hasattr(model, "generate"):
        from .hf_cache import install

        install(model)
        lean_linears(model)  # a decoding token's projections, MLPs and head in the native kernel
        install_decoding(model)  # a token's decoder layers in native calls
    set_implementation = getattr(model, "set_attn_implementation", None)
    if set_implementation is None:
        raise LinearAttentionError(f"model: {type(model).__name__} has no set_attn_implementation (transformers ≥ 5)")
    set_implementation(IMPLEMENTATION)
    return model


def sentence_embeddings(model: nn.Module, tokenizer: Any, sentences: Sequence[str], *, batch_size: int = 32,
                        max_length: int = 256) -> torch.Tensor:
    """Sentence embeddings (S, E): mean of the last hidden states over non-padding tokens, L2-normalised.

    The pooling of sentence-transformers models such as all-MiniLM-L6-v2 (their ``1_Pooling`` config). Batches are
    padded, so this also exercises the padding mask.
    """
    outputs = []
    device = next(model.parameters()).device
    for start in range(0, len(sentences), batch_size):
        encoded = tokenizer(list(sentences[start : start + batch_size]), padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt").to(device)
        with torch.no_grad():
            hidden = model(**encoded).last_hidden_state  # (B, N, E)
        weights = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, N, 1)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        outputs.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return torch.cat(outputs)


try:  # registration on import, when transformers is there; linearize() registers (or explains) otherwise
    register()
except LinearAttentionError:
    pass
