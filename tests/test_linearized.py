"""A linearized decoder as a folder: save_linearized, load_linearized, and the `linattn generate` command."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.linearized.folder import INDEX, fingerprint, load_linearized, save_linearized  # noqa: E402
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


@pytest.mark.parametrize("gate", ["token", "feature"])
def test_gates_round_trip_through_the_folder(tiny_base, tmp_path, gate):
    """A gated delta-rule (or KDA) student beside a window: the gates' weights and settings are saved, and the
    reloaded model gives the same logits, bit for bit (same weights, same operations, one process)."""
    from linattn.evaluate import load_model
    from linattn.nn import KeyGates

    model, tokenizer, _ = load_model(str(tiny_base), causal_lm=True)
    before = fingerprint(model)
    generator = torch.Generator().manual_seed(2)
    gates = [KeyGates(2, 16, gate=gate, num_features=16 if gate == "feature" else None) for _ in range(2)]
    with torch.no_grad():
        for module in gates:
            for param in module.parameters():
                param.add_(torch.randn(param.shape, generator=generator))
    options = {"update": "delta", "window": 8, "sinks": 2}
    hf.linearize(model, "elu", gates=gates, **options)
    assert fingerprint(model) == before  # the gates are not the base model
    save_linearized(model, tmp_path / "gated", maps="elu", options=options, base=str(tiny_base), gates=gates)
    entry = json.loads((tmp_path / "gated" / INDEX).read_text())
    assert entry["gates"]["config"]["gate"] == gate and entry["gates"]["layers"] == 2
    reloaded, _ = load_linearized(tmp_path / "gated")
    assert torch.equal(logits(reloaded, tokenizer), logits(model, tokenizer))
    hf.linearize(reloaded, "elu", **options)  # the same model without its gates computes something else
    assert not torch.allclose(logits(reloaded, tokenizer), logits(model, tokenizer), atol=1e-4)


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


def test_generate_streams_from_a_folder_beside_the_original(fitted_dir, tmp_path, capsys):
    from linattn.cli import main

    pytest.importorskip("matplotlib")
    folder, model, tokenizer = fitted_dir
    plot = tmp_path / "gen.png"
    code = main(["generate", str(folder), "--prompt", "Rivers carry", "--max-new-tokens", "12", "--compare-softmax",
                 "--plot", str(plot)])
    assert code == 0
    out = capsys.readouterr().out
    assert "--- linearized: Rivers carry" in out and "--- softmax (original): Rivers carry" in out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines() if "  " in line}
    assert lines["new tokens"][-2:] == ["12", "12"]
    # the linear cache is its states (the window's ring buffer included): a fixed size; the softmax cache holds
    # the keys and values of prompt + 11 fed-back tokens: 2 layers · 2 kv heads · 16 dims · 23 tokens · 2 · 4 bytes
    # (after the first new token: the prompt's 12 tokens)
    assert lines["cache bytes, first → last token"][-3:] == [f"{2 * 2 * 16 * 12 * 2 * 4:,}", "→",
                                                             f"{2 * 2 * 16 * (12 + 11) * 2 * 4:,}"]
    assert plot.stat().st_size > 0
    # what was streamed is greedy generation from the in-memory linearized model
    ids = tokenizer("Rivers carry", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert tokenizer.decode(expected[0, ids.shape[1]:]) in out


def test_the_linear_cache_stays_flat_while_the_softmax_cache_grows(fitted_dir):
    from linattn.evaluate import load_model
    from linattn.linearized.generate import generate_measured

    folder, model, tokenizer = fitted_dir
    linear = generate_measured(model, tokenizer, "Rivers", 20, "linear", stream=False)
    base, _, _ = load_model(json.loads((folder / INDEX).read_text())["base"]["model"], causal_lm=True)
    original = generate_measured(base, tokenizer, "Rivers", 20, "softmax", stream=False)
    assert linear.new_tokens == original.new_tokens == 20 and len(linear.times) == 20
    assert len(set(linear.cache_bytes[1:])) == 1  # from the first decoded token on: the states, a fixed size
    per_token = 2 * 2 * 16 * 2 * 4  # layers · kv heads · head dim · (k, v) · fp32 bytes
    assert ([b - a for a, b in zip(original.cache_bytes[:-1], original.cache_bytes[1:], strict=True)]
            == [per_token] * 19)
    assert linear.tokens_per_second > 0 and linear.peak_bytes > 0


def test_generate_refuses_what_it_cannot_run(tiny_base, capsys):
    from linattn.cli import main

    assert main(["generate", str(tiny_base), "--prompt", "x", "--compare-softmax"]) == 2
    assert "--compare-softmax: the model runs softmax attention already" in capsys.readouterr().err
    assert main(["generate", str(tiny_base), "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens: need ≥ 1" in capsys.readouterr().err


def test_generate_refuses_a_model_that_is_not_a_causal_lm(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    from linattn.cli import main

    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path / "bert")
    assert main(["generate", str(tmp_path / "bert"), "--prompt", "x"]) == 2
    assert "is not a causal LM" in capsys.readouterr().err


def test_generate_with_linear_on_a_plain_model_prints_its_numbers(tiny_base, capsys):
    from linattn.cli import main

    assert main(["generate", str(tiny_base), "--prompt", "The tide", "--max-new-tokens", "5", "--linear",
                 "--window", "4", "--sinks", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- linearized (elu, window 4, sinks 1): The tide" in out and "tokens/s" in out


def test_generate_says_what_each_number_means_and_prints_no_nan(tiny_base, tmp_path, capsys):
    """One new token has no decoding rate: the summary says so (not "nan"); every row of the summary has a line
    saying what it means; beside softmax (a prompt read from a file), the linear cache stays one size while
    softmax's grows, and the break-even context is the states' bytes over softmax's bytes per token."""
    import re

    from linattn.cli import main

    assert main(["generate", str(tiny_base), "--prompt", "The tide", "--max-new-tokens", "1", "--linear"]) == 0
    out = capsys.readouterr().out
    assert "n/a (1 token)" in out and "n/a (< 3 tokens)" in out and not re.search(r"\bnan\b", out, re.I)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The tide returns some of it to the shore. " * 8)
    assert main(["generate", str(tiny_base), "--prompt-file", str(prompt), "--max-new-tokens", "9", "--linear",
                 "--window", "4", "--sinks", "1", "--compare-softmax"]) == 0
    out = capsys.readouterr().out
    table, legend = out.split("new tokens  ")[-1].split("\n\n")
    for title in ("new tokens", "tokens/s", "ms/token", "prompt ms", "cache bytes", "peak memory MiB"):
        assert f"\n{title}: " in "\n" + legend  # one line says what it means
    cache = next(line for line in table.splitlines() if line.startswith("cache bytes"))
    linear, softmax = re.findall(r"[\d,]+(?: → [\d,]+)?", cache.split("token")[-1])
    assert "→" not in linear and "→" in softmax  # the states stay one size, the softmax cache grows
    assert " … " in out and "(335 tokens)" in out.splitlines()[0]  # a long prompt: its ends and length (characters)
    states = int(linear.replace(",", ""))
    per_token = 2 * 2 * 16 * 2 * 4  # 2 layers · 2 kv heads · 16 dims · key and value · 4 bytes
    assert f"cache of {states / per_token:,.0f} tokens ({per_token:,} bytes per token)" in out


def test_generate_reads_the_prompt_and_decodes_with_their_own_thread_counts(fitted_dir, monkeypatch, capsys):
    """--threads for the prompt, --decode-threads (default 1) for the tokens after it; the caller's count is back
    afterwards, and a negative count is refused."""
    from linattn.cli import main
    from linattn.linearized import generate as generate_module

    folder, _, _ = fitted_dir
    seen, real_load = [], generate_module._load

    def load(args):
        model, *rest = real_load(args)
        forward = model.forward

        def counted(*a, **k):
            seen.append(torch.get_num_threads())
            return forward(*a, **k)

        model.forward = counted
        return (model, *rest)

    monkeypatch.setattr(generate_module, "_load", load)
    before = torch.get_num_threads()
    assert main(["generate", str(folder), "--prompt", "Rivers carry", "--max-new-tokens", "4", "--threads", "2"]) == 0
    assert seen == [2, 1, 1, 1] and torch.get_num_threads() == before
    seen.clear()
    assert main(["generate", str(folder), "--prompt", "Rivers", "--max-new-tokens", "3", "--threads", "2",
                 "--decode-threads", "0"]) == 0
    assert seen == [2, 2, 2] and torch.get_num_threads() == before
    assert main(["generate", str(folder), "--prompt", "x", "--decode-threads", "-1"]) == 2
    assert "--threads/--decode-threads: need ≥ 0" in capsys.readouterr().err
