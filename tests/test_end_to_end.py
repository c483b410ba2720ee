"""linattn.evaluate.end_to_end: maps trained on the model's next-token distribution; texts sampled from the model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.distill import fit_model_feature_maps  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.evaluate.end_to_end import fit_end_to_end, sample_texts  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402

TEXT = ("Rivers carry sand to the sea, and the tide returns some of it to the shore every evening. "
        "Birds follow the boats home, and the harbour lights come on one by one along the quay.")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      initializer_range=0.3)  # wide weights: attention changes the logits visibly
    return LlamaForCausalLM(cfg).eval()


def texts(count: int) -> list[str]:
    return [TEXT[i * 7 :] + " " + TEXT[: i * 7] for i in range(count)]  # rotations: the same words, new places


@pytest.fixture(scope="module")
def linearized():
    model, tokenizer = tiny_llama(), char_tokenizer()
    capture = capture_attention(model, tokenizer, texts(2), max_tokens=128, model_name="tiny")
    fitted = fit_model_feature_maps(capture, steps=3, window=8, sinks=1)
    hf.linearize(model, fitted)
    return model, tokenizer, fitted


def test_fit_end_to_end_lowers_the_held_out_kl_and_touches_only_the_maps(linearized):
    model, tokenizer, fitted = linearized
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "linattn" not in name}
    before = [p.detach().clone() for fmap in fitted.maps for p in fmap.parameters()]
    flags = [p.requires_grad for p in model.parameters()]
    result = fit_end_to_end(model, tokenizer, texts(6), max_tokens=128, steps=12, lr=0.01, held_out=2, eval_every=4)
    first, best = result["history"][0][2], result["best_held_out"]
    # training lowers the divergence on sequences it never saw (a broken gradient path leaves it at `first`)
    assert best < 0.9 * first
    # the model's own weights are untouched; the maps of `fitted` are the model's, and they moved
    for name, p in model.named_parameters():
        if "linattn" not in name:
            assert torch.equal(p, weights[name]), name
    after = [p for fmap in fitted.maps for p in fmap.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(fmap is module.linattn_feature_map
               for fmap, module in zip(fitted.maps, hf.attention_modules(model), strict=True))
    assert [p.requires_grad for p in model.parameters()] == flags  # restored as they were


def test_fit_end_to_end_keeps_the_best_evaluation(linearized):
    model, tokenizer, _ = linearized
    result = fit_end_to_end(model, tokenizer, texts(5), max_tokens=128, steps=4, lr=0.05, held_out=2, eval_every=2)
    again = fit_end_to_end(model, tokenizer, texts(5), max_tokens=128, steps=0, held_out=2)
    # the parameters left in the model are those of the best held-out evaluation: evaluated again, the same KL
    # (same shapes, same kernels: equal up to the summation order of the float64 mean, hence the tolerance)
    assert again["best_held_out"] == pytest.approx(result["best_held_out"], rel=1e-6)


def test_fit_end_to_end_refuses_a_model_that_is_not_linearized_and_too_few_texts():
    model, tokenizer = tiny_llama(), char_tokenizer()
    with pytest.raises(LinearAttentionError, match="not linearized"):
        fit_end_to_end(model, tokenizer, texts(4), steps=1)
    with pytest.raises(LinearAttentionError, match="held_out"):
        fit_end_to_end(model, tokenizer, texts(2), steps=1, held_out=2)


def test_sample_texts_continues_every_prompt_reproducibly():
    model, tokenizer = tiny_llama(), char_tokenizer()
    tokenizer.eos_token = "\n"  # the char tokenizer has none; generation needs one to suppress
    prompts = ["Rivers carry", "Birds follow the boats"]
    side = tokenizer.padding_side
    first = sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=3)
    assert len(first) == 2
    for prompt, text in zip(prompts, first, strict=True):
        assert text.replace(" ", "").startswith(prompt.replace(" ", ""))  # the prompt, then its continuation
        assert len(tokenizer(text)["input_ids"]) >= len(tokenizer(prompt)["input_ids"]) + 20 - 1
    assert sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=3) == first
    assert sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=4) != first
    assert tokenizer.padding_side == side  # restored
