"""linattn.evaluate.lora: low-rank adapters on the attention projections, trained by fit_end_to_end."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.distill import fit_model_feature_maps  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.evaluate.end_to_end import fit_end_to_end  # noqa: E402
from linattn.evaluate.lora import add_lora, load_lora  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402
from test_end_to_end import texts, tiny_llama  # noqa: E402


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def test_adapters_start_as_the_identity_and_match_a_merged_update_in_float64():
    model = tiny_llama().double()
    ids = torch.arange(1, 40)[None]
    before = logits(model, ids)
    lora = add_lora(model, rank=4, alpha=8.0, seed=3)
    # every `up` starts at zero: the adapted model computes exactly what the model did
    assert torch.equal(logits(model, ids), before)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for adapter in lora.adapters.values():
            adapter.up.copy_(torch.randn(adapter.up.shape, generator=generator, dtype=torch.float64) * 0.3)
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, before, atol=1e-3)  # the updates act on the output
    with lora.disabled():
        assert torch.equal(logits(model, ids), before)
    # reference: the same updates merged into the weights, W + (α/r)·up·down, in float64
    merged = tiny_llama().double()
    with torch.no_grad():
        for module in hf.attention_modules(merged):
            for target in ("q_proj", "k_proj", "v_proj", "o_proj"):
                adapter = lora.adapters[f"{module.layer_idx}_{target}"]
                getattr(module, target).weight += (8.0 / 4) * adapter.up @ adapter.down
    # same model in float64, the update applied in two matmuls instead of merged: rounding of float64 sums only
    torch.testing.assert_close(adapted, logits(merged, ids), rtol=1e-10, atol=1e-10)
    lora.remove()
    assert torch.equal(logits(model, ids), before)  # removed: the model as shipped


def test_fit_end_to_end_trains_the_adapters_against_the_original_model(tmp_path):
    model, tokenizer = tiny_llama(), char_tokenizer()
    capture = capture_attention(model, tokenizer, texts(2), max_tokens=128, model_name="tiny")
    fitted = fit_model_feature_maps(capture, steps=3, window=8, sinks=1)
    hf.linearize(model, fitted)
    maps = [p.detach().clone() for fmap in fitted.maps for p in fmap.parameters()]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    lora = add_lora(model, rank=4)
    result = fit_end_to_end(model, tokenizer, texts(6), max_tokens=128, steps=12, lr=0.01, held_out=2, eval_every=4,
                            adapters=lora, adapter_lr=0.01, train_maps=False)
    first, best = result["history"][0][2], result["best_held_out"]
    # the adapters alone lower the held-out KL against the original model (the teacher runs with them disabled:
    # with them on, the target would move with the student and the KL would not start from the maps' value)
    assert best < 0.9 * first
    assert all(torch.equal(a, b) for a, b in zip((p for fmap in fitted.maps for p in fmap.parameters()), maps,
                                                 strict=True))  # the maps stay as they were
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())  # and the weights
    assert any(bool(adapter.up.abs().sum() > 0) for adapter in lora.adapters.values())
    # saved and loaded into a second copy of the linearized model: the same outputs
    path = str(tmp_path / "lora.safetensors")
    lora.save(path)
    ids = torch.arange(1, 60)[None]
    expected = logits(model, ids)
    lora.remove()
    assert not torch.allclose(logits(model, ids), expected, atol=1e-4)
    loaded = load_lora(model, path)
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=0)  # same tensors, same shapes
    loaded.remove()


def test_bad_adapter_input_says_what_to_do(tmp_path):
    model, tokenizer = tiny_llama(), char_tokenizer()
    with pytest.raises(LinearAttentionError, match="rank"):
        add_lora(model, rank=0)
    with pytest.raises(LinearAttentionError, match="no nn.Linear named 'qkv'"):
        add_lora(model, targets=("qkv",))
    with pytest.raises(LinearAttentionError, match="not a file"):
        load_lora(model, str(tmp_path / "missing.safetensors"))
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64))
    add_lora(wider, rank=2).save(str(tmp_path / "wider.safetensors"))
    with pytest.raises(LinearAttentionError, match="another model"):
        load_lora(model, str(tmp_path / "wider.safetensors"))
    capture = capture_attention(model, tokenizer, texts(2), max_tokens=64, model_name="tiny")
    hf.linearize(model, fit_model_feature_maps(capture, steps=1, window=8, sinks=1))
    lora = add_lora(model, rank=2)
    lora.remove()
    with pytest.raises(LinearAttentionError, match="not attached"):
        fit_end_to_end(model, tokenizer, texts(4), max_tokens=64, steps=1, adapters=lora)
    with pytest.raises(LinearAttentionError, match="heads=None"):
        fit_end_to_end(model, tokenizer, texts(4), max_tokens=64, steps=1, adapters=lora.attach(), train_maps=False,
                       heads=torch.ones(2, 4, dtype=torch.bool))
    lora.remove()
    with pytest.raises(LinearAttentionError, match="nothing left to train"):
        fit_end_to_end(model, tokenizer, texts(4), max_tokens=64, steps=1, train_maps=False)
