"""A decoding token of a Llama-architecture model in a few native calls: :func:`install`.

transformers' forward of one new token runs, in each decoder layer, some twenty small torch operations and a dozen
Python calls around the attention (two RMSNorms, the rotary embedding, the seven projections, the MLP's product,
two residuals); at a 135M model's sizes each costs more in dispatch than in arithmetic. After :func:`install`
(which :func:`linattn.hf.linearize` does), a call of the model with one token a row runs each layer as two native
calls (``DecoderLayers`` in decode.cpp: before the attention the input norm, q, k, v and the rotary embedding;
after it the output projection, the residual, the post-attention norm, the MLP and its residual) around the
layer's attention, which stays what transformers' own forward calls: the cache's ``update``, then the attention
function registered for the model's implementation (``"linattn"``'s decoding step, or a softmax model's SDPA over
its cache), with the mask transformers makes for the call; the final norm and the LM head are a third call. The
arithmetic is transformers'; the sums run in another order (the linear layers are
:class:`~linattn.nn.token_linear.TokenLinear`'s kernels, GGUF blocks included), so the logits agree to rounding,
not bit for bit.

The route is the model's, not the attention's: ``linattn bench --same-linears`` and ``linattn generate
--compare-softmax`` give the original softmax model the same route (and the same linear layers), so that what
differs between the two is their attention.

Every other call is transformers' forward, unchanged: a prompt, gradients on, training mode, a forward hook or
pre-hook on any module, another architecture than transformers' own Llama classes, weights that are not CPU fp32
or fp64 matrices, arguments beyond the ones ``generate`` passes for a token, or ``model.linattn_lean_decoding =
False`` (the switch for a comparison).
"""

from __future__ import annotations

import functools
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .backends import native
from .nn.token_linear import MAX_TOKENS, TokenLinear

SWITCH = "linattn_lean_decoding"  # model attribute: False turns the route off (transformers' forward every call)
_ARGUMENTS = frozenset({"input_ids", "cache", "past_key_values", "attention_mask", "use_cache", "return_dict",
                        "position_ids", "logits_to_keep"})
_DTYPES = (torch.float32, torch.float64)
_CAPTURING = "output_capturing_hook"  # transformers' hooks for output_hidden_states / output_attentions

@dataclass
class _Plan:
    """What a token needs of a model, checked once: the native layers, the modules whose weights they hold (with
    the weights, to notice one replaced), every module's hook dictionaries, the attention modules, the embedding
    and the rotary embedding."""

    layers: Any  # decode.cpp's DecoderLayers
    held: list[tuple[dict[str, Any], torch.Tensor]]  # (a module's parameters, its weight)
    hooks: list[dict[Any, Any]]
    attention: list[nn.Module]
    embedding: torch.Tensor
    rotary: nn.Module
    eager: Any  # transformers' eager attention function, the default its forward falls back to

    def valid(self) -> bool:
        """Whether every weight is the tensor the plan holds (the parameters' own dictionaries, read without
        nn.Module's attribute lookup, ~1 µs each), unchanged."""
        return all(parameters.get("weight") is weight for parameters, weight in self.held) and self.layers.current()


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan | None] = weakref.WeakKeyDictionary()


def install(model: Any) -> None:
    """Route ``model``'s one-token calls through the native decoder layers (module docstring); idempotent."""
    if getattr(model, "_linattn_decode_installed", False):
        return

    @functools.wraps(type(model).forward)  # its signature: generate passes the arguments forward names
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and getattr(self, SWITCH, True):
            out = _token(self, kwargs)
            if out is not None:
                return out
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    model._linattn_decode_installed = True


def _token(model: Any, kwargs: dict[str, Any]) -> Any:
    """The model's output for one token a row through the native layers, or None where the route does not apply.
    The steps of transformers' LlamaModel and LlamaForCausalLM forward, with each layer's norms, projections,
    rotary embedding and MLP in ``DecoderLayers``."""
    ids = kwargs.get("input_ids")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    use_cache = kwargs.get("use_cache")
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] > MAX_TOKENS
            or kwargs.keys() - _ARGUMENTS or model.training or torch.is_grad_enabled()
            or kwargs.get("return_dict") is False or kwargs.get("logits_to_keep", 0) not in (0, 1)
            or (cache is None and use_cache is not False) or (cache is not None and use_cache is False)):
        return None  # without a cache transformers makes one unless told not to: that call is its own
    plan = _plan(model)
    if plan is None or _hooked(plan) or any(m.training for m in plan.attention):
        return None
    from transformers.cache_utils import Cache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if cache is not None and not isinstance(cache, Cache):
        return None
    x = torch.embedding(plan.embedding, ids)
    position = kwargs.get("position_ids")
    if position is None:
        seen = cache.get_seq_length() if cache is not None else 0
        position = torch.full((1, 1), seen, dtype=torch.long, device=x.device)
    mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=kwargs.get("attention_mask"),
                              cache=cache, position_ids=position)
    cos, sin = plan.rotary(x, position)
    if cos.dtype != x.dtype:
        return None
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, plan.eager)
    layers = plan.layers
    for i, module in enumerate(plan.attention):
        q, k, v = layers.pre(i, x, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, i)
        out, _ = attention(module, q, k, v, mask, dropout=0.0, scaling=module.scaling)
        x = layers.post(i, x, out)
    return CausalLMOutputWithPast(logits=layers.head(x), cache=cache)


def _hooked(plan: _Plan) -> bool:
    """Whether a forward hook or pre-hook is on any module of the model, or on every module. transformers' own
    output-capturing hooks (installed for good at a call with ``output_hidden_states`` or ``output_attentions``)
    do not count: outside such a call, which never takes the route, they do nothing."""
    from torch.nn.modules import module as modules

    for hooks in plan.hooks:
        if hooks and any(getattr(hook, "__name__", "") != _CAPTURING for hook in hooks.values()):
            return True
    return bool(modules._global_forward_hooks) or bool(modules._global_forward_pre_hooks)


def _plan(model: Any) -> _Plan | None:
    """The model's plan (made at the first call and again once a weight changed), or None where the route does not
    apply to this model."""
    if model not in _PLANS or (_PLANS[model] is not None and not _PLANS[model].valid()):  # type: ignore[union-attr]
        _PLANS[model] = _make_plan(model)
    return _PLANS[model]


def _make_plan(model: Any) -> _Plan | None:
    kernels = native.module()
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:
        return None
    inner: Any = getattr(model, "model", None)
    if (kernels is None or type(model) is not llama.LlamaForCausalLM or type(inner) is not llama.LlamaModel
            or getattr(model.config, "hidden_act", None) != "silu" or type(inner.norm) is not llama.LlamaRMSNorm
            or type(inner.embed_tokens) is not nn.Embedding):
        return None
    decoders: list[Any] = list(inner.layers[: model.config.num_hidden_layers])
    linears: list[Any] = []
    norms: list[Any] = []
    for decoder in decoders:
        attention, mlp = decoder.self_attn, decoder.mlp
        if (type(decoder) is not llama.LlamaDecoderLayer or type(attention) is not llama.LlamaAttention
                or type(mlp) is not llama.LlamaMLP or type(decoder.input_layernorm) is not llama.LlamaRMSNorm
                or type(decoder.post_attention_layernorm) is not llama.LlamaRMSNorm):
            return None
        linears += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                    mlp.up_proj, mlp.down_proj]
        norms += [decoder.input_layernorm, decoder.post_attention_layernorm]
    linears.append(model.lm_head)
    norms.append(inner.norm)
    epsilons = {norm.variance_epsilon for norm in norms}
    dtype = inner.embed_tokens.weight.dtype
    weights = [m.weight for m in (*linears, *norms, inner.embed_tokens)]
    if (len(epsilons) != 1 or dtype not in _DTYPES
            or any(type(m) not in (nn.Linear, TokenLinear) for m in linears)
            or any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous() for w in weights)
            or any(m.bias is not None and (m.bias.dtype != dtype or not m.bias.is_contiguous()) for m in linears)):
        return None
    head_dim = decoders[0].self_attn.head_dim if decoders else 1
    specs = [_spec(m) for m in linears]
    layers = kernels.DecoderLayers(specs, [norm.weight.detach() for norm in norms], float(epsilons.pop()), head_dim)
    held = [(m._parameters, m.weight) for m in (*linears, *norms, inner.embed_tokens)]
    hooks = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
    return _Plan(layers, held, hooks, [d.self_attn for d in decoders], inner.embed_tokens.weight.detach(),
                 inner.rotary_emb, llama.eager_attention_forward)


def _spec(module: Any) -> tuple[Any, ...]:
    """A linear layer as decode.cpp takes it: (weight, bias, codes, scales, offsets, two codes a byte), the codes
    where the layer holds current ones (:class:`~linattn.nn.token_linear.BlockWeights`)."""
    weight = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach()
    blocks = getattr(module, "blocks", None)
    if blocks is not None and blocks.current(module.weight):
        return weight, bias, blocks.codes, blocks.scales, blocks.mins, blocks.nibbles
    return weight, bias, None, None, None, False
