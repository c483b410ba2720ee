"""Generation in constant memory: LinearAttentionCache, the lean decode step, linearize's options."""

from __future__ import annotations

import pytest
import torch

from maps_for_tests import LogExp
from reference import reference_attention, rel_error

pytest.importorskip("transformers")

import linattn.hf as hf  # noqa: E402
from linattn import LinearAttentionError, linear_attention  # noqa: E402
from linattn.decode import DecodeStep, WindowDecodeStep, supports  # noqa: E402
from linattn.feature_maps import create  # noqa: E402
from linattn.hf_cache import LinearAttentionCache  # noqa: E402


def tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # a wide initialisation, so that greedy tokens vary from step to step and a wrong state shows
    cfg = LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048,
                      initializer_range=0.3, eos_token_id=None, bos_token_id=None)  # no early stop
    return LlamaForCausalLM(cfg).eval()


MAPS = {
    "elu": lambda: "elu",
    "favor+": lambda: "favor+",  # log-space: the running-maximum shift is carried by the step
    "hedgehog": lambda: [create("hedgehog", head_dim=8, num_heads=4, init="random", seed=i) for i in range(2)],
}


@pytest.mark.parametrize("name", sorted(MAPS))
def test_generation_with_the_state_cache_equals_full_recompute(name):
    model = tiny_llama()
    hf.linearize(model, MAPS[name](), **({"num_features": 16, "seed": 1} if name == "favor+" else {}))
    ids = torch.randint(1, 60, (1, 70), generator=torch.Generator().manual_seed(3))  # > one 64-token chunk
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert isinstance(cached.past_key_values, LinearAttentionCache)
    assert all(layer.stepper is not None for layer in cached.past_key_values.layers)  # the lean step ran
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert len(set(cached.sequences[0, 70:].tolist())) > 3  # the tokens vary: a broken state would show
    # chunked prefill + per-token steps against one chunked pass over everything: fp32 sums in another order
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)


def test_cache_size_is_constant_over_1000_generated_tokens():
    model = hf.linearize(tiny_llama(), "elu")
    ids = torch.randint(1, 60, (1, 8), generator=torch.Generator().manual_seed(4))
    sizes = []
    for new in (1, 1000):
        cache = LinearAttentionCache()
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        assert out.shape[1] == 8 + new
        assert cache.get_seq_length() == 8 + new - 1  # the last token is sampled, never fed back
        sizes.append(cache.nbytes())
    # per layer: S (H·F·Dv) + z (H·F) + shift (H) + a (H) scratch, fp32: 4·(4·8·8 + 4·8 + 4 + 4) = 1184 bytes
    assert sizes[0] == sizes[1] == 2 * 4 * (4 * 8 * 8 + 4 * 8 + 4 + 4)


PADDED = {
    "favor+": ("favor+", {"num_features": 16, "seed": 2}),
    # the window hybrid with sinks: each row's sinks are its own first tokens (the lean step, stacked per row)
    "elu+window+sinks": ("elu", {"window": 4, "sinks": 2}),
    # a log-space map with the window: no lean step, each row on its own state (RowSteps)
    "favor+window+sinks": ("favor+", {"num_features": 16, "seed": 2, "window": 3, "sinks": 3}),
    # the delta rule: padded keys write nothing (the lean delta step with a mask)
    "elu+delta": ("elu", {"update": "delta", "beta": 0.8, "decay": 0.97}),
    # the window and sinks beside the gated delta rule: each row's sinks are its own first tokens
    "elu+window+sinks+delta": ("elu", {"update": "delta", "beta": 0.8, "decay": 0.97, "window": 4, "sinks": 2}),
}


@pytest.mark.parametrize("name", sorted(PADDED))
def test_left_padded_batch_equals_each_row_alone(name):
    fmap, options = PADDED[name]
    model = hf.linearize(tiny_llama(), fmap, **options)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 60, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    lengths = [9, 5, 2]
    for row, length in enumerate(lengths):
        ids[row, : 9 - length] = 0
        mask[row, : 9 - length] = 0  # left padding
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for row, length in enumerate(lengths):
            alone = model.generate(ids[row : row + 1, 9 - length :], max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)
            assert torch.equal(batch[row, 9:], alone[0, length:])
        # one forward pass without a cache, positions counted from each row's first token as generate does: each
        # row's logits are its own, padding or not (other batch shapes in the projections and MLP: fp32 rounding)
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        for row, length in enumerate(lengths):
            torch.testing.assert_close(logits[row, 9 - length :], model(ids[row : row + 1, 9 - length :]).logits[0],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [
    {}, {"update": "delta"}, {"update": "delta", "beta": 0.5, "decay": 0.9}, {"window": 4, "sinks": 1},
    {"window": 4, "sinks": 1, "sparse_cache": 2}, {"window": 4, "sinks": 1, "decay": 0.9},
    {"window": 4, "sinks": 1, "update": "delta", "beta": 0.5, "decay": 0.9},
], ids=["add", "delta", "delta-beta-decay", "window", "sparse-cache", "window-decay", "window-delta"])
def test_beam_search_reorders_the_states(options):
    """Every kind of lean step under beam search (the steps' index_select), with options other than the defaults:
    the tokens of recomputing every prefix."""
    model = hf.linearize(tiny_llama(), "elu", **options)
    ids = torch.randint(1, 60, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
        recomputed = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0,
                                    use_cache=False)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("fmap", [LogExp(8, 12, seed=0), create("elu")], ids=["log-space", "elu"])
def test_decode_step_follows_the_float64_reference(fmap):
    """Prefill in linear_attention, then steps (GQA, one padded key) against the quadratic float64 definition."""
    torch.manual_seed(0)
    batch, heads, kv_heads, n, d = 2, 4, 2, 12, 8
    q = torch.randn(batch, heads, n, d)
    k, v = torch.randn(batch, kv_heads, n, d), torch.randn(batch, kv_heads, n, d)
    keep = torch.ones(batch, n, dtype=torch.bool)
    keep[1, 8] = False  # a masked key among the stepped ones
    _, state = linear_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], feature_map=fmap, causal=True,
                                key_padding_mask=keep[:, :5], return_state=True, eps=0.0)
    assert supports(fmap, state, {})
    step = DecodeStep(fmap, state, eps=0.0)  # eps = 0: log-space maps add eps at their own scale, the reference not
    outs = [step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1])
            for t in range(5, n)]
    group = heads // kv_heads
    phi = fmap.reference if hasattr(fmap, "reference") else (lambda x: torch.nn.functional.elu(x) + 1)
    expected = reference_attention(q.double(), k.repeat_interleave(group, 1).double(),
                                   v.repeat_interleave(group, 1).double(), phi, causal=True,
                                   keep=keep[:, None, :], eps=0.0)[..., 5:, :]
    # fp32 sums updated in place against a float64 quadratic definition: a few fp32 ulps of the outputs
    assert rel_error(torch.cat(outs, dim=-2), expected) < 1e-5
    assert step.state().num_tokens == n


def test_states_the_step_cannot_reproduce_go_through_linear_attention():
    q, k, v = torch.randn(3, 1, 2, 4, 8, generator=torch.Generator().manual_seed(7)).unbind(0)
    _, state = linear_attention(q, k, v, causal=True, return_state=True)
    assert supports(create("elu"), state, {"eps": 1e-3})
    assert not supports(create("elu"), state, {"min_denom": 1e-3})
    assert not supports(create("elu"), state, {"window": 4})
    assert not supports(create("elu"), object(), {})


def test_linearize_keeps_attention_options_and_passes_them_on():
    model = hf.linearize(tiny_llama(), "elu", eps=0.5, chunk_size=16)
    modules = hf.attention_modules(model)
    assert all(m.linattn_options == {"eps": 0.5, "chunk_size": 16} for m in modules)
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8,
                                                                                                      generator=g)
    with torch.no_grad():
        out, _ = hf.linattn_attention_forward(modules[0], q, k, v, None, scaling=8**-0.5, is_causal=True)
    expected = linear_attention(q, k, v, causal=True, eps=0.5)
    torch.testing.assert_close(out.transpose(1, 2), expected)
    assert rel_error(out.transpose(1, 2), linear_attention(q, k, v, causal=True)) > 1e-3  # eps made a difference


def test_the_state_cache_refuses_a_softmax_model():
    model = tiny_llama()  # attention: sdpa, which would see only the current keys
    with pytest.raises(LinearAttentionError, match="not 'linattn'"), torch.no_grad():
        model(input_ids=torch.arange(1, 6)[None], cache=LinearAttentionCache(), use_cache=True)


@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
def test_hybrid_generation_with_the_state_cache_equals_full_recompute(factor):
    """The window hybrid through linearize: ring buffer + sinks + linear state in the cache, per-token steps equal
    a full recompute with the same hybrid attention, and the cache stays the same size as tokens are generated."""
    model = tiny_llama()
    hf.linearize(model, "elu", window=8, sinks=2, window_factor=factor)
    ids = torch.randint(1, 60, (1, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert isinstance(cached.past_key_values, LinearAttentionCache)
    assert all(isinstance(layer.stepper, WindowDecodeStep) for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):  # fp32 sums in another order
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)
    sizes = []
    with torch.no_grad():
        out = model.generate(ids[:, :20], max_new_tokens=1, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        cache = out.past_key_values
        for _ in range(40):
            step = model(input_ids=out.sequences[:, -1:], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            sizes.append(cache.nbytes())  # the steppers' buffers while decoding
    assert sizes[0] > 0 and len(set(sizes)) == 1  # ring buffer of 8 keys and values, 2 sinks, fixed linear state


def _tensors(state):
    import dataclasses

    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif dataclasses.is_dataclass(value):
            yield from _tensors(value)


@pytest.mark.parametrize("given", ["object", "saved file"])
def test_fitted_window_options_reach_every_layer(given, tmp_path):
    """Maps fitted with the window in place bring W, S and γ to linearize — also from the file save() wrote."""
    from linattn.distill import FittedFeatureMaps

    maps = [create("hedgehog", head_dim=8, num_heads=4, init="random", seed=i) for i in range(2)]
    gammas = [torch.full((4,), 0.5 + i) for i in range(2)]
    fitted = FittedFeatureMaps("tiny", "hedgehog", 2, 4, 8, maps=maps, window=8, sinks=2, window_factors=gammas)
    if given == "saved file":
        fitted.save(str(tmp_path / "maps.safetensors"))
    model = hf.linearize(tiny_llama(), fitted if given == "object" else tmp_path / "maps.safetensors")
    options = [module.linattn_options for module in hf.attention_modules(model)]
    assert [o["window"] for o in options] == [8, 8] and [o["sinks"] for o in options] == [2, 2]
    assert all(torch.equal(o["window_factor"], g) for o, g in zip(options, gammas, strict=True))


@pytest.mark.parametrize("options", [{"update": "delta", "beta": 0.8, "decay": 0.97}, {"decay": 0.95}],
                         ids=["gated-delta", "decayed-additive"])
def test_window_beside_a_decayed_or_delta_state_generates_as_full_recompute(options):
    """linearize with window + sinks beside the delta rule or a decayed additive state: generate steps on the
    composed lean step and gives the tokens and logits of recomputing every prefix."""
    model = hf.linearize(tiny_llama(), "elu", window=6, sinks=2, **options)
    ids = torch.randint(1, 60, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert all(type(layer.stepper).__name__ == "ComposedDecodeStep" for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)
