"""linattn.hf: the "linattn" attention implementation in transformers models, masks, scale, linearize, generation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from maps_for_tests import LogExp
from reference import elu_plus_one, reference_attention, rel_error

transformers = pytest.importorskip("transformers")

import linattn.hf as hf  # noqa: E402
from linattn import LinearAttentionError  # noqa: E402
from linattn.feature_maps import create  # noqa: E402


class FakeAttention(nn.Module):
    """What the attention function reads from a transformers attention module: is_causal (and a map, if any)."""

    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def test_registered_with_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["linattn"] is hf.linattn_attention_forward
    assert AttentionMaskInterface._global_mapping["linattn"] is hf.linattn_mask


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("scaling", [None, 0.5], ids=["scale-default", "scale-0.5"])
def test_attention_function_matches_reference_with_padding_and_gqa(causal, scaling):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 8, dtype=torch.float64), torch.randn(2, 2, 9, 8, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, 6:] = False
    out, weights = hf.linattn_attention_forward(FakeAttention(causal), q, k, v, keep, scaling=scaling)
    assert weights is None and out.shape == (2, 9, 4, 8)  # (B, N, H, d), as transformers expects
    c = math.sqrt((scaling or 8**-0.5) * math.sqrt(8))  # the documented scale convention
    expected = reference_attention(c * q, c * k, v, elu_plus_one, causal=causal, keep=keep[:, None, :])
    assert rel_error(out.transpose(1, 2), expected) < 1e-12


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_dense_4d_masks_read_as_key_padding(kind, causal):
    torch.manual_seed(1)
    q = k = v = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    keep = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    allowed = keep[:, None, None, :].expand(2, 1, 6, 6)
    if causal:
        allowed = allowed & torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = allowed if kind == "bool" else additive
    out, _ = hf.linattn_attention_forward(FakeAttention(causal), q, k, v, mask)
    expected, _ = hf.linattn_attention_forward(FakeAttention(causal), q, k, v, keep)
    torch.testing.assert_close(out, expected)


def test_dense_mask_that_is_not_padding_raises():
    q = k = v = torch.randn(1, 1, 5, 4)
    window = torch.ones(5, 5, dtype=torch.bool).tril().triu(-1)[None, None]  # a sliding window of 2
    with pytest.raises(LinearAttentionError, match="neither key padding"):
        hf.linattn_attention_forward(FakeAttention(True), q, k, v, window)


def test_unsupported_options_raise():
    q = k = v = torch.randn(1, 1, 5, 4)
    with pytest.raises(LinearAttentionError, match="dropout"):
        hf.linattn_attention_forward(FakeAttention(False), q, k, v, None, dropout=0.1)
    with pytest.raises(LinearAttentionError, match="sliding_window"):
        hf.linattn_attention_forward(FakeAttention(True), q, k, v, None, sliding_window=2)


def test_cached_queries_see_their_own_prefix_only():
    # a KV cache hands the last Nq queries and all Nk keys: rows must equal those of the full causal call
    torch.manual_seed(2)
    q = k = v = torch.randn(1, 2, 7, 4, dtype=torch.float64)
    full, _ = hf.linattn_attention_forward(FakeAttention(True), q, k, v, None)
    last, _ = hf.linattn_attention_forward(FakeAttention(True), q[..., 4:, :], k, v, None)
    torch.testing.assert_close(last, full[:, 4:])


def tiny_bert(**config):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, **config)
    return BertModel(cfg, add_pooling_layer=False).eval()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_encoder_padded_batch_equals_sequences_run_alone():
    model = tiny_bert()
    model.set_attn_implementation("linattn")
    ids = torch.randint(1, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = model(input_ids=ids[1:, :6]).last_hidden_state
        first = model(input_ids=ids[:1]).last_hidden_state
    torch.testing.assert_close(batch[1:, :6], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch[:1], first, rtol=1e-5, atol=1e-5)
    # non-causal: changing the last token changes the first token's output
    changed = ids[:1].clone()
    changed[0, -1] = (changed[0, -1] + 1) % 50
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=changed).last_hidden_state[:, 0], first[:, 0])


def test_attn_implementation_switch_at_load_time(tmp_path):
    from transformers import BertModel

    tiny_bert().save_pretrained(tmp_path)
    model = BertModel.from_pretrained(tmp_path, attn_implementation="linattn").eval()
    assert model.config._attn_implementation == "linattn"
    ids = torch.randint(1, 50, (1, 6))
    with torch.no_grad():
        linear = model(input_ids=ids).last_hidden_state
        model.set_attn_implementation("sdpa")
        softmax = model(input_ids=ids).last_hidden_state
    assert not torch.allclose(linear, softmax)  # the switch took effect


def test_decoder_is_causal_and_generation_with_cache_matches_without():
    model = tiny_llama()
    model.set_attn_implementation("linattn")
    ids = torch.randint(1, 50, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 50
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        # the future never leaks: bit for bit, as both calls have the same shapes (same kernels), and every earlier
        # position's inputs are the same
        assert torch.equal(model(input_ids=changed).logits[:, :-1], logits[:, :-1])
        cached = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        uncached = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)


def test_decoder_left_padding_respected():
    model = tiny_llama()
    model.set_attn_implementation("linattn")
    ids = torch.randint(1, 50, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 6])
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        batch = model(input_ids=padded, attention_mask=mask, position_ids=torch.arange(-3, 6).clamp(min=0)[None])
    torch.testing.assert_close(batch.logits[:, 3:], alone, rtol=1e-5, atol=1e-5)


def test_linearize_installs_per_layer_maps_and_switches():
    model = tiny_bert()
    maps = [LogExp(8, 16, seed=i) for i in range(2)]
    assert hf.linearize(model, maps) is model
    assert model.config._attn_implementation == "linattn"
    modules = hf.attention_modules(model)
    assert [m.linattn_feature_map for m in modules] == maps
    assert any(key.endswith("linattn_feature_map.weight") for key in model.state_dict())
    # the installed map is the one used: layer 0's output follows the reference with that map
    hidden = torch.randn(1, 5, 32)
    attn = modules[0]
    with torch.no_grad():
        q, k, v = (proj(hidden).view(1, 5, 4, 8).transpose(1, 2) for proj in (attn.query, attn.key, attn.value))
        out, _ = hf.linattn_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
    expected = reference_attention(q, k, v, maps[0].reference)
    assert rel_error(out.transpose(1, 2), expected) < 1e-6


def test_linearize_by_name_gives_independent_seeded_maps():
    model = tiny_bert()
    hf.linearize(model, "favor+", num_features=16, seed=3)
    first, second = (m.linattn_feature_map for m in hf.attention_modules(model))
    assert not torch.equal(first.projection, second.projection)
    again = create("favor+", head_dim=8, num_features=16, seed=3)
    assert torch.equal(first.projection, again.projection)


def test_linearize_rejects_mismatched_maps():
    model = tiny_bert()
    with pytest.raises(LinearAttentionError, match="2 attention layers"):
        hf.linearize(model, [LogExp(8, 4)] * 3)
    with pytest.raises(LinearAttentionError, match="12 heads"):
        hf.linearize(model, [create("hedgehog", head_dim=8, num_heads=12)] * 2)
    with pytest.raises(LinearAttentionError, match="head_dim=16"):
        hf.linearize(model, [create("hedgehog", head_dim=16, num_heads=4)] * 2)
    with pytest.raises(LinearAttentionError, match="no attention module"):
        hf.linearize(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"window": -1}, r"window: expected an int ≥ 1"),
        ({"window": 8, "sinks": -2}, r"sinks: expected an int ≥ 0"),
        ({"eps": -1.0}, r"eps: expected a number ≥ 0"),
        ({"chunk_size": 0}, r"chunk_size: expected a positive int"),
        ({"form": "fast"}, r"form: unknown form 'fast'"),
        ({"window": 8, "backend": "triton"}, r"does not combine with backend"),
        ({"backend": "cuda"}, r"backend: unknown backend 'cuda'"),
        ({"normalize": "yes"}, r"normalize: expected True or False"),
    ],
)
def test_linearize_checks_every_option_at_the_call(options, pattern):
    """A bad option fails when linearize is called, not at the model's first forward."""
    model = tiny_bert()
    with pytest.raises(LinearAttentionError, match=pattern):
        hf.linearize(model, "elu", **options)


def test_linearize_from_a_saved_fitted_maps_file(tmp_path):
    from linattn.distill import FittedFeatureMaps

    maps = [create("hedgehog", head_dim=8, num_heads=4, init="random", seed=i) for i in range(2)]
    options = {"num_features": 8, "tied": False}
    FittedFeatureMaps("tiny-bert", "hedgehog", 2, 4, 8, options, maps).save(str(tmp_path / "maps.safetensors"))
    model = hf.linearize(tiny_bert(), tmp_path / "maps.safetensors")
    for module, fmap in zip(hf.attention_modules(model), maps, strict=True):
        assert torch.equal(module.linattn_feature_map.weight, fmap.weight)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(1, 50, (1, 5))).last_hidden_state).all()


def test_batched_left_padded_generation_equals_each_sequence_alone():
    model = tiny_llama()
    model.set_attn_implementation("linattn")
    torch.manual_seed(5)
    ids = torch.randint(1, 50, (2, 6))
    ids[1, :2] = 0
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # the second prompt is 4 tokens, left-padded
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        alone = model.generate(ids[1:, 2:], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(batch[1:, 2:], alone)
