"""A linearized decoder as a folder: save_linearized, load_linearized, and the `linattn generate` command."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.evaluate.linearized import INDEX, fingerprint, load_linearized, save_linearized  # noqa: E402
from linattn.train.distill import fit_model_feature_maps  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402

TEXT = ("Rivers carry sand to the sea. The tide returns some of it to the shore. Birds follow the boats home in "
        "the evening, and the harbour lights come on one by one.\n")


def save_tiny_llama(folder, seed: int = 0):
    """A tiny random Llama (2 layers, hidden 64, vocab 100) and a character tokenizer, saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                      initializer_range=0.3)  # wide weights: attention changes the logits visibly
    LlamaForCausalLM(cfg).save_pretrained(folder)
    char_tokenizer(eos="\n").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture(scope="module")
def fitted_dir(tiny_base, tmp_path_factory):
    """A folder of the tiny Llama with hedgehog maps fitted with a window (3 steps), and the in-memory model."""
    from linattn.evaluate import load_model

    model, tokenizer, _ = load_model(str(tiny_base), causal_lm=True)
    capture = capture_attention(model, tokenizer, [TEXT, TEXT[40:] + TEXT[:40]], max_tokens=128, model_name="tiny")
    fitted = fit_model_feature_maps(capture, steps=3, window=8, sinks=2, progress=False)
    options = {"eps": 1e-5}
    hf.linearize(model, fitted, **options)
    folder = tmp_path_factory.mktemp("lin") / "tiny-lin"
    save_linearized(model, folder, maps=fitted, options=options, base=str(tiny_base))
    return folder, model, tokenizer


def logits(model, tokenizer, text=TEXT):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_reloaded_folder_computes_what_the_linearized_model_did(fitted_dir):
    folder, model, tokenizer = fitted_dir
    entry = json.loads((folder / INDEX).read_text())
    assert entry["maps"] == {"file": "maps.safetensors"} and entry["options"] == {"eps": 1e-5}
    reloaded, reloaded_tokenizer = load_linearized(folder)
    assert reloaded.config._attn_implementation == "linattn"
    assert reloaded_tokenizer(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    window = hf.attention_modules(reloaded)[0].linattn_options
    assert window["window"] == 8 and window["sinks"] == 2  # carried by the maps file
    # the same weights, maps and options through the same kernels on the same shapes, in one process: the same
    # floating-point operations, so the logits are equal bit for bit
    assert torch.equal(logits(reloaded, tokenizer), logits(model, tokenizer))
    # and not trivially: the model's softmax attention gives other logits
    reloaded.set_attn_implementation("sdpa")
    assert not torch.allclose(logits(reloaded, tokenizer), logits(model, tokenizer), atol=1e-3)


def test_a_named_map_with_delta_options_round_trips(tiny_base, tmp_path):
    from linattn.evaluate import load_model

    model, tokenizer, _ = load_model(str(tiny_base), causal_lm=True)
    options = {"update": "delta", "beta": 0.5}
    hf.linearize(model, "elu", **options)
    save_linearized(model, tmp_path / "delta", maps="elu", options=options, base=str(tiny_base))
    reloaded, _ = load_linearized(tmp_path / "delta")
    assert hf.attention_modules(reloaded)[1].linattn_options["update"] == "delta"
    assert torch.equal(logits(reloaded, tokenizer), logits(model, tokenizer))  # elu has no parameters: same ops


def test_the_fingerprint_ignores_linearizing_but_not_the_weights(tiny_base):
    from linattn.evaluate import load_model

    model, _, _ = load_model(str(tiny_base), causal_lm=True)
    before = fingerprint(model)
    hf.linearize(model, "hedgehog", num_heads=4)
    assert fingerprint(model) == before  # the maps are not the base model
    with torch.no_grad():
        dict(model.named_parameters())["model.embed_tokens.weight"][0, 0] += 1e-3
    assert fingerprint(model) != before


def test_a_folder_for_another_base_model_is_refused(fitted_dir, tmp_path):
    folder, _, _ = fitted_dir
    other = save_tiny_llama(tmp_path / "other", seed=1)  # same architecture, other weights
    with pytest.raises(LinearAttentionError, match="is not the model .* was made from"):
        load_linearized(folder, base=str(other))


def test_bad_folders_and_options_are_explained(tiny_base, tmp_path):
    from linattn.evaluate import load_model

    with pytest.raises(LinearAttentionError, match="holds no linattn.json"):
        load_linearized(tmp_path)
    (tmp_path / INDEX).write_text('{"format": "something else"}')
    with pytest.raises(LinearAttentionError, match="not a linattn-linearized"):
        load_linearized(tmp_path)
    model, _, _ = load_model(str(tiny_base), causal_lm=True)
    with pytest.raises(LinearAttentionError, match="options: .*JSON"):
        save_linearized(model, tmp_path / "x", options={"decay": torch.tensor(0.9)}, base=str(tiny_base))
    with pytest.raises(LinearAttentionError, match="maps: a Linear cannot be saved"):
        save_linearized(model, tmp_path / "x", maps=torch.nn.Linear(2, 2), base=str(tiny_base))
