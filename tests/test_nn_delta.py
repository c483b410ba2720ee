"""linattn.nn.LinearAttention(update="delta", short_conv=, output_gate=): the Gated DeltaNet layer against a
float64 recurrence written out here, decoding (forward with state=, the decoder, the transformers cache) against one
call, constant state size, gradients, and the errors for options that do not combine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn import DeltaRuleState, LinearAttentionError, ShortConvState, linear_attention
from linattn.decode import DeltaDecodeStep, lean_step
from linattn.feature_maps import create
from linattn.nn import LinearAttention
from reference import elu_plus_one, rel_error

# float64 throughout: a sequence of ~20–70 tokens through projections, a convolution and the recurrence rounds at
# ~1e-15 relative; 1e-12 leaves three orders of magnitude and still fails on any wrong term (errors of O(1e-2))
TOL = 1e-12


def _randomise(layer: LinearAttention) -> None:
    """Data-dependent gates and β away from their constant start, so the tests exercise them."""
    with torch.no_grad():
        if layer.gate_up is not None:
            layer.gate_up.weight.normal_(std=2.0)
            layer.gate_up.bias.fill_(0.0)
        if layer.beta_proj is not None:
            layer.beta_proj.weight.normal_(std=1.0)
        if layer.output_gate is not None and layer.output_gate.weight is not None:
            layer.output_gate.weight.uniform_(0.5, 1.5)


def _linear(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ linear.weight.double().T + (linear.bias.double() if linear.bias is not None else 0)


def reference_layer(layer: LinearAttention, x: torch.Tensor, keep: torch.Tensor | None = None,
                    phi=lambda z: z) -> torch.Tensor:
    """The layer written out in float64: projections; the convolution as a sum over its taps; the delta recurrence
    token by token on explicit (D, D) memories; the output norm and gate; the output projection."""
    x = x.double()
    batch, n, _ = x.shape
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = _linear(layer.q_proj, x), _linear(layer.k_proj, x), _linear(layer.v_proj, x)
    if layer.short_conv is not None:
        mixed = torch.cat([q, k, v], -1)
        if keep is not None:
            mixed = mixed * keep[..., None]
        weight = layer.short_conv.weight.double()  # (C, K)
        size = weight.shape[1]
        conv = torch.zeros_like(mixed)
        for t in range(n):
            for i in range(size):
                s = t - size + 1 + i
                if s >= 0:
                    conv[:, t] += weight[:, i] * mixed[:, s]
        q, k, v = F.silu(conv).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)

    def split(y: torch.Tensor, h: int) -> torch.Tensor:
        return y.unflatten(-1, (h, dim)).transpose(1, 2).repeat_interleave(heads // h, dim=1)  # (B, H, N, D)

    q, k, v = split(q, heads), split(k, kv_heads), split(v, kv_heads)
    unit_q, unit_k = F.normalize(phi(q), dim=-1), F.normalize(phi(k), dim=-1)
    beta = layer.beta_scale * torch.sigmoid(_linear(layer.beta_proj, x)).transpose(1, 2)  # (B, H, N)
    log_a = torch.zeros(batch, heads, n, dtype=torch.float64)
    if layer.decay_rates is not None:
        log_a += torch.log(torch.tensor(layer.decay_rates, dtype=torch.float64))[:, None]
    if layer.gate_down is not None:
        gate = F.logsigmoid(_linear(layer.gate_up, _linear(layer.gate_down, x))) / 16  # (B, N, H)
        log_a += gate.transpose(1, 2)
    memory = torch.zeros(batch, heads, unit_k.shape[-1], dim, dtype=torch.float64)
    outs = []
    for t in range(n):
        memory = memory * log_a[..., t, None, None].exp()
        key = unit_k[..., t, :]
        write = beta[..., t, None] * (v[..., t, :] - torch.einsum("bhf,bhfd->bhd", key, memory))
        if keep is not None:
            write = write * keep[:, None, t, None]
        memory = memory + key[..., :, None] * write[..., None, :]
        outs.append(torch.einsum("bhf,bhfd->bhd", unit_q[..., t, :], memory))
    out = torch.stack(outs, dim=1)  # (B, N, H, D)
    if layer.output_norm is not None:
        norm = layer.output_norm
        out = F.group_norm(out.flatten(-2).flatten(0, 1), heads, norm.weight.double(), norm.bias.double(),
                           norm.eps).view_as(out)
    if layer.output_gate is not None:
        if layer.output_gate.weight is not None:
            out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.output_gate.weight.double()
        out = out * F.silu(_linear(layer.output_gate.proj, x)).unflatten(-1, (heads, dim))
    return _linear(layer.out_proj, out.flatten(-2))


CASES = {
    "deltanet": {},
    "deltanet-elu-gqa": {"feature_map": "elu", "num_kv_heads": 2},
    "gated-deltanet": {"gate": "token", "short_conv": 4, "output_gate": True},
    "gated-deltanet-retnet-beta2": {"gate": "token", "decay": "retnet", "beta_scale": 2.0, "short_conv": 2},
    "conv1-norm+gate": {"short_conv": 1, "output_gate": True, "output_norm": True, "decay": 0.9},
}


def _layer(case: str, seed: int = 0) -> LinearAttention:
    torch.manual_seed(seed)
    options = {"feature_map": "identity", **CASES[case]}
    layer = LinearAttention(16, 4, causal=True, update="delta", **options).double()
    _randomise(layer)
    return layer


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_delta_layer_matches_float64_recurrence(case, masked):
    layer = _layer(case)
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    keep = torch.ones(2, 21, dtype=torch.bool)
    keep[0, :3] = False  # left padding
    keep[1, 15:] = False  # right padding
    mask = keep if masked else None
    phi = elu_plus_one if CASES[case].get("feature_map") == "elu" else (lambda z: z)
    out = layer(x, key_padding_mask=mask)
    assert rel_error(out, reference_layer(layer, x, mask, phi)) < TOL


def test_delta_layer_is_the_functional_delta_rule_on_its_projections():
    """Without the parts around it, the layer is linear_attention(update="delta") on its q, k, v, β and gates."""
    layer = _layer("gated-deltanet-retnet-beta2")
    layer.short_conv = None
    x = torch.randn(2, 70, 16, dtype=torch.float64)  # > one 64-token chunk
    q, k, v, _ = layer._project(x)
    core = linear_attention(q, k, v, causal=True, update="delta", beta=layer._beta(x), feature_map="identity",
                            decay=layer._rates(x.device), log_gate=layer._log_gate(x))
    assert rel_error(layer(x), layer._output(core, x)) < TOL


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_token_by_token_equals_one_call(case):
    layer = _layer(case, seed=1)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    full = layer(x)
    prompt, state = layer(x[:, :7], return_state=True)
    assert isinstance(state, ShortConvState if layer.short_conv is not None else DeltaRuleState)
    decoder = layer.decoder(state)
    assert isinstance(decoder.step, DeltaDecodeStep)  # the lean step, gates and β given per token
    by_state, by_decoder = [prompt], [prompt]
    for t in range(7, 30):
        token = x[:, t : t + 1]
        out, state = layer(token, state=state, return_state=True)
        by_state.append(out)
        by_decoder.append(decoder(token))
    assert rel_error(torch.cat(by_state, 1), full) < TOL
    assert rel_error(torch.cat(by_decoder, 1), full) < TOL
    # the decoder's state continues the layer as the layer's own state does
    rest = torch.randn(2, 5, 16, dtype=torch.float64)
    assert rel_error(layer(rest, state=decoder.state()), layer(rest, state=state)) < TOL


def test_short_conv_with_the_additive_update_decodes_and_keeps_padding_out():
    torch.manual_seed(2)
    layer = LinearAttention(16, 4, causal=True, short_conv=3, output_gate=True).double()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    full = layer(x)
    prompt, state = layer(x[:, :4], return_state=True)
    decoder = layer.decoder(state)
    steps = [decoder(x[:, t : t + 1]) for t in range(4, 12)]
    assert rel_error(torch.cat([prompt, *steps], 1), full) < TOL
    # left padding: masked inputs enter no neighbour's convolution, so the row equals its tokens alone
    padded = torch.cat([100 * torch.randn(1, 3, 16, dtype=torch.float64), x], 1)
    keep = torch.tensor([[False] * 3 + [True] * 12])
    assert rel_error(layer(padded, key_padding_mask=keep)[:, 3:], full) < TOL
    assert not torch.equal(layer(padded)[:, 3:], full)  # without the mask the padding would reach them


def _nbytes(state) -> int:
    parts = [state.attention.kv, state.conv] if isinstance(state, ShortConvState) else [state.kv]
    return sum(t.numel() * t.element_size() for t in parts)


def test_decoder_state_is_the_same_size_after_1_and_1000_tokens():
    torch.manual_seed(3)
    layer = LinearAttention(16, 4, causal=True, update="delta", gate="token", short_conv=4, output_gate=True,
                            feature_map="identity")
    _, state = layer(torch.randn(1, 5, 16), return_state=True)
    decoder = layer.decoder(state)
    memory, conv = decoder.step.kv.data_ptr(), decoder._conv.data_ptr()
    sizes = {}
    for t in range(1, 1001):
        decoder(torch.randn(1, 1, 16))
        if t in (1, 1000):
            sizes[t] = _nbytes(decoder.state())
    # the memory (H·F·Dv) and the convolution's last K−1 inputs ((K−1)·(H + 2·Hkv)·D), fp32: updated in place
    assert sizes[1] == sizes[1000] == 4 * (4 * 4 * 4) + 4 * 3 * 3 * 16
    assert decoder.step.kv.data_ptr() == memory and decoder._conv.data_ptr() == conv
    assert decoder.state().num_tokens == 1005
    assert bool(torch.isfinite(decoder.state().attention.kv).all())


def test_gradients_reach_the_beta_projection():
    torch.manual_seed(4)
    layer = LinearAttention(8, 2, causal=True, update="delta", gate="token", short_conv=2, output_gate=True,
                            beta_scale=2.0, feature_map="identity").double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    layer(x).square().sum().backward()
    assert layer.beta_proj.weight.grad is not None and float(layer.beta_proj.weight.grad.abs().sum()) > 0
    weight = layer.beta_proj.weight.detach().clone().requires_grad_()

    def through_beta(w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, {"beta_proj.weight": w}, (x,))

    assert torch.autograd.gradcheck(through_beta, (weight,))


def test_delta_step_follows_linear_attention_with_fixed_options():
    """The step alone (as the transformers cache runs it): a fixed β and per-head decay from the options, GQA, a
    masked token; against linear_attention on the whole sequence."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 4, 12, 8).double(), torch.randn(2, 2, 12, 8).double(), torch.randn(2, 2, 12, 8).double()
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9] = False
    options = {"update": "delta", "beta": 0.7, "decay": torch.tensor([0.9, 0.95, 0.99, 1.0], dtype=torch.float64)}
    fmap = create("elu")
    full = linear_attention(q, k, v, causal=True, feature_map=fmap, key_padding_mask=keep, **options)
    prompt, state = linear_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], causal=True, feature_map=fmap,
                                     key_padding_mask=keep[:, :5], return_state=True, **options)
    step = lean_step(fmap, state, options, kv_heads=2)
    assert isinstance(step, DeltaDecodeStep)
    outs = [prompt] + [step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1])
                       for t in range(5, 12)]
    assert rel_error(torch.cat(outs, -2), full) < TOL
    assert lean_step(fmap, state, {**options, "log_gate": torch.zeros(2, 4, 1)}, 2) is None  # not reproduced


BAD = [
    ({"update": "delta"}, "causal=True"),  # built non-causal below
    ({"update": "delta", "causal": True, "beta_scale": 0.0}, r"beta_scale: expected a float in \(0, 2\]"),
    ({"update": "delta", "causal": True, "beta_scale": 2.5}, r"\(0, 2\]"),
    ({"update": "delta", "causal": True, "beta_scale": True}, r"\(0, 2\]"),
    ({"causal": True, "beta_scale": 2.0}, "pass update='delta'"),
    ({"causal": True, "short_conv": 0}, "short_conv: expected a kernel size ≥ 1"),
    ({"causal": True, "short_conv": 2.5}, "kernel size"),
    ({"update": "delta", "causal": True, "normalize": True}, "no Σφ\\(k\\) to normalise"),
    ({"update": "delta", "causal": True, "min_denom": 1e-3}, "min_denom"),
    ({"update": "delta", "causal": True, "gate": "channel"}, "gate: expected 'token', 'feature' or None"),
    ({"update": "mystery", "causal": True}, "update: expected 'add' or 'delta'"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(LinearAttentionError, match=match):
        LinearAttention(16, 4, **kwargs)


def test_states_of_the_wrong_kind_raise():
    conv_layer = LinearAttention(16, 4, causal=True, update="delta", short_conv=3)
    plain_layer = LinearAttention(16, 4, causal=True, update="delta")
    x = torch.randn(1, 5, 16)
    _, conv_state = conv_layer(x, return_state=True)
    _, plain_state = plain_layer(x, return_state=True)
    with pytest.raises(LinearAttentionError, match="pass the ShortConvState"):
        conv_layer(x, state=plain_state)
    with pytest.raises(LinearAttentionError, match="this layer has none"):
        plain_layer(x, state=conv_state)
    with pytest.raises(LinearAttentionError, match="pass the ShortConvState"):
        conv_layer.decoder(plain_state)
    additive = LinearAttention(16, 4, causal=True)
    _, additive_state = additive(x, return_state=True)
    with pytest.raises(LinearAttentionError, match="DeltaRuleState"):
        plain_layer(x, state=additive_state)


def test_context_parallel_refuses_the_short_convolution():
    from linattn.distributed import ContextParallel

    ContextParallel(LinearAttention(16, 4, causal=True, update="delta"))  # the delta rule splits across ranks
    with pytest.raises(LinearAttentionError, match="not split across ranks"):
        ContextParallel(LinearAttention(16, 4, causal=True, update="delta", short_conv=4))


def _tiny_linearized_llama(**options):
    pytest.importorskip("transformers")
    import linattn.hf as hf
    from test_decoder_generate import tiny_llama

    return hf.linearize(tiny_llama(), "elu", update="delta", **options)


def test_linearized_delta_model_generates_with_the_state_cache_as_full_recompute():
    """linearize passes update="delta" (with a fixed β and per-head decay) to every layer; generate decodes on the
    lean delta step and gives the tokens and logits of recomputing every prefix without a cache."""
    from linattn.hf_cache import LinearAttentionCache

    model = _tiny_linearized_llama(beta=0.8, decay=0.97)
    ids = torch.randint(1, 60, (1, 70), generator=torch.Generator().manual_seed(3))  # > one 64-token chunk
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert isinstance(cached.past_key_values, LinearAttentionCache)
    assert all(isinstance(layer.stepper, DeltaDecodeStep) for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert len(set(cached.sequences[0, 70:].tolist())) > 3  # the tokens vary: a broken state would show
    # chunked prefill + fp32 steps against one chunked pass over every prefix: fp32 sums in another order
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)


def test_linearized_delta_model_cache_is_the_same_size_after_1_and_1000_tokens():
    from linattn.hf_cache import LinearAttentionCache

    model = _tiny_linearized_llama()
    ids = torch.randint(1, 60, (1, 8), generator=torch.Generator().manual_seed(4))
    sizes = []
    for new in (1, 1000):
        cache = LinearAttentionCache()
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        assert out.shape[1] == 8 + new
        sizes.append(cache.nbytes())
    # per layer the delta memory alone, H·F·Dv fp32 (no Σφ(k), no shift): 2 layers · 4 · (4·8·8) bytes
    assert sizes[0] == sizes[1] == 2 * 4 * (4 * 8 * 8)


def test_linearize_checks_the_delta_options_when_called():
    with pytest.raises(LinearAttentionError, match="no denominator"):
        _tiny_linearized_llama(normalize=True)
    with pytest.raises(LinearAttentionError, match="pass update='delta'"):
        pytest.importorskip("transformers")
        import linattn.hf as hf
        from test_decoder_generate import tiny_llama

        hf.linearize(tiny_llama(), "elu", beta=0.5)
