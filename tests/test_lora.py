"""linattn.train.lora: peft LoRA adapters on the attention projections, trained by fit_end_to_end."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.distill import fit_model_feature_maps  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.train.end_to_end import fit_end_to_end  # noqa: E402
from linattn.train.lora import ADAPTER, add_lora, load_lora  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402
from test_end_to_end import texts, tiny_llama  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def parts(layer):
    """A, B of a peft LoRA layer."""
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight


def test_adapters_start_as_the_identity_and_match_a_merged_update_in_float64():
    model = tiny_llama().double()
    ids = torch.arange(1, 40)[None]
    before = logits(model, ids)
    state = torch.random.get_rng_state()
    lora = add_lora(model, rank=4, alpha=8.0, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # A is drawn from the seed, not the global state
    assert len(lora.layers) == 2 * len(TARGETS) and lora.attached
    assert all(p.requires_grad for p in model.parameters())  # peft would have frozen the model's own weights
    # every B starts at zero: the adapted model computes exactly what the model did
    assert torch.equal(logits(model, ids), before)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora.layers.values():
            up = parts(layer)[1]
            up.copy_(torch.randn(up.shape, generator=generator, dtype=torch.float64) * 0.3)
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, before, atol=1e-3)  # the updates act on the output
    flags = [p.requires_grad for p in lora.parameters()]
    with lora.disabled():
        assert torch.equal(logits(model, ids), before)
    assert [p.requires_grad for p in lora.parameters()] == flags and torch.equal(logits(model, ids), adapted)
    # reference: the same updates merged into the weights, W + (α/r)·B·A, in float64
    merged = tiny_llama().double()
    with torch.no_grad():
        for module in hf.attention_modules(merged):
            for target in TARGETS:
                down, up = parts(lora.layers[f"model.layers.{module.layer_idx}.self_attn.{target}"])
                getattr(module, target).weight += (8.0 / 4) * up @ down
    # same model in float64, the update applied in two matmuls instead of merged: rounding of float64 sums only
    torch.testing.assert_close(adapted, logits(merged, ids), rtol=1e-10, atol=1e-10)
    lora.remove()
    assert torch.equal(logits(model, ids), before)  # removed: the model as shipped, its own linears back
    assert all(type(getattr(m, t)) is torch.nn.Linear for m in hf.attention_modules(model) for t in TARGETS)
    assert not hasattr(model, "peft_config")
    lora.attach()
    assert torch.equal(logits(model, ids), adapted)  # attached again: the same adapters
    lora.remove()


def test_the_same_seed_draws_the_same_adapters():
    first = [p.clone() for p in add_lora(tiny_llama(), rank=2, seed=5).parameters()]
    again = list(add_lora(tiny_llama(), rank=2, seed=5).parameters())
    other = list(add_lora(tiny_llama(), rank=2, seed=6).parameters())
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


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
    assert any(bool(parts(layer)[1].abs().sum() > 0) for layer in lora.layers.values())
    # saved (peft's folder: a .safetensors path names the folder without the suffix) and loaded: the same outputs
    lora.save(str(tmp_path / "lora.safetensors"))
    assert {p.name for p in (tmp_path / "lora").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    ids = torch.arange(1, 60)[None]
    expected = logits(model, ids)
    lora.remove()
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())  # the weights as they were
    assert not torch.allclose(logits(model, ids), expected, atol=1e-4)
    loaded = load_lora(model, str(tmp_path / "lora"))
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=0)  # same tensors, same shapes
    loaded.remove()
    assert load_lora(model, str(tmp_path / "lora.safetensors")).attached  # the path it was saved under works too


def test_the_saved_folder_is_peft_format(tmp_path):
    """What LoRA.save writes, plain peft reads: the same weights, and PeftModel gives the same outputs."""
    from peft import PeftModel
    from peft.utils import load_peft_weights

    model = tiny_llama()
    lora = add_lora(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for index, param in enumerate(lora.parameters()):
            param.add_(0.01 * (index + 1))
    ids = torch.arange(1, 50)[None]
    expected = logits(model, ids)
    lora.remove()  # saved while detached, as the compare job does
    folder = lora.save(tmp_path / "adapters")
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4.0
    stored = load_peft_weights(folder, device="cpu")
    ours = {f"base_model.model.{name}.{part}.weight": weight
            for name, layer in lora.layers.items() for part, weight in zip(("lora_A", "lora_B"), parts(layer),
                                                                             strict=True)}
    assert stored.keys() == ours.keys() and all(torch.equal(stored[k], ours[k]) for k in ours)
    peft_model = PeftModel.from_pretrained(tiny_llama(), folder)
    torch.testing.assert_close(logits(peft_model, ids), expected, rtol=0, atol=0)


def test_bad_adapter_input_says_what_to_do(tmp_path):
    model, tokenizer = tiny_llama(), char_tokenizer()
    with pytest.raises(LinearAttentionError, match="rank"):
        add_lora(model, rank=0)
    with pytest.raises(LinearAttentionError, match="no nn.Linear named 'qkv'"):
        add_lora(model, targets=("qkv",))
    with pytest.raises(LinearAttentionError, match="not a folder holding adapter_config.json"):
        load_lora(model, str(tmp_path / "missing.safetensors"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    (tmp_path / "other" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(LinearAttentionError, match="'IA3', not LoRA"):
        load_lora(model, str(tmp_path / "other"))
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64))
    add_lora(wider, rank=2).save(str(tmp_path / "wider.safetensors"))
    deeper = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64))
    add_lora(deeper, rank=2).save(str(tmp_path / "deeper"))
    add_lora(tiny_llama(), rank=2, targets=("q_proj",)).save(str(tmp_path / "some"))
    three_layers = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    with pytest.raises(LinearAttentionError, match=r"no adapters for the attention of layer\(s\) \[2\]"):
        load_lora(three_layers, str(tmp_path / "some"))  # peft alone would adapt layers 0 and 1 and leave layer 2
    ids = torch.arange(1, 20)[None]
    before = logits(model, ids)
    for other in ("wider", "deeper"):
        with pytest.raises(LinearAttentionError, match="another model"):
            load_lora(model, str(tmp_path / other))
        assert torch.equal(logits(model, ids), before) and not hasattr(model, "peft_config")  # left as it was
    lora = add_lora(model, rank=2)
    with pytest.raises(LinearAttentionError, match="already carries LoRA adapters"):
        add_lora(model, rank=2)
    lora.remove()
    second = add_lora(model, rank=2)
    with pytest.raises(LinearAttentionError, match="other adapters attached"):
        lora.attach()
    second.remove()
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


def test_the_old_import_path_gives_the_same_functions():
    from linattn.evaluate import lora as old
    from linattn.train import lora as new

    assert old.add_lora is new.add_lora and old.load_lora is new.load_lora and old.LoRA is new.LoRA
