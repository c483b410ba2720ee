"""``linattn compare`` for causal LMs: the window+sinks softmax row, and the whole job on a tiny saved Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError  # noqa: E402
from linattn.evaluate.models import looks_causal  # noqa: E402
from linattn.evaluate.window_softmax import window_sink_attention  # noqa: E402


class Holder(torch.nn.Module):
    linattn_window = 3
    linattn_sinks = 2


def band_and_sinks_reference(q, k, v, window, sinks, keep, scale):
    """Row by row in float64: softmax over keys j ≤ t with t − j < window or j < sinks, kept by ``keep``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n = q.shape[-2]
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for b in range(q.shape[0]):
        for t in range(n):
            js = [j for j in range(t + 1) if (t - j < window or j < sinks) and bool(keep[b, j])]
            if not js:
                continue
            scores = torch.einsum("hd,hjd->hj", q[b, :, t], k[b, :, js]) * scale  # (H, |js|)
            out[b, :, t] = torch.einsum("hj,hjd->hd", torch.softmax(scores, -1), v[b, :, js])
    return out


def test_window_and_sinks_softmax_follows_the_float64_definition():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :2] = False  # left padding: the first real token of row 1 is at position 2
    out, _ = window_sink_attention(Holder(), q, k, v, keep, scaling=0.3)
    expected = band_and_sinks_reference(q, k, v, 3, 2, keep, 0.3)
    # fp32 SDPA against float64 row loops; padded rows of batch 1 (all keys masked there) are not compared
    torch.testing.assert_close(out.transpose(1, 2)[0].double(), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.transpose(1, 2)[1, :, 2:].double(), expected[1, :, 2:], rtol=1e-5, atol=1e-5)


def char_tokenizer(eos: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token=eos)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      initializer_range=0.3)  # wide weights: attention changes the logits visibly
    LlamaForCausalLM(cfg).save_pretrained(folder)
    char_tokenizer(eos="\n").save_pretrained(folder)  # an end-of-text token: sampling needs one
    text = ("Rivers carry sand to the sea. The tide returns some of it to the shore.\n\n"
            "Birds follow the boats home in the evening, and the harbour lights come on one by one.\n\n")
    (folder / "train.txt").write_text(text * 2)
    (folder / "heldout.txt").write_text(text.replace("sand", "silt") * 2)
    return folder


def test_compare_on_a_tiny_causal_lm_writes_every_row(tiny_folder, tmp_path):
    from linattn.cli import main

    assert looks_causal(str(tiny_folder)) and not looks_causal(None)
    out = tmp_path / "out"
    code = main(["compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
                 str(tiny_folder / "heldout.txt"), "--window", "1000", "--sinks", "0", "--passkey-lengths", "40",
                 "--passkey-trials", "1", "--repeat-trials", "2", "--passage-tokens", "12", "--gap-tokens", "60",
                 "--steps", "2", "--fit-max-tokens", "128", "--fit-orders", "1", "--max-tokens", "128", "--out",
                 str(out), "--quiet"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows)[:5] == ["softmax", "window1000+sinks0", "elu", "favor+", "hedgehog"]
    assert all(math.isfinite(row["perplexity"]) and math.isfinite(row["repeat_perplexity"]) for row in rows.values())
    # a window longer than the text is plain causal softmax: the same numbers up to SDPA's kernels
    assert rows["window1000+sinks0"]["perplexity"] == pytest.approx(rows["softmax"]["perplexity"], rel=1e-4)
    assert rows["elu"]["perplexity"] != pytest.approx(rows["softmax"]["perplexity"], rel=1e-2)
    assert "kl" in rows["elu"] and "kl" not in rows["softmax"]
    report = (out / "report.md").read_text()
    assert "| hedgehog |" in report
    assert f"Held-out text `{tiny_folder / 'heldout.txt'}`;" in report and "shipped corpus" not in report
    # maps fitted with the window in place make a hybrid; a window longer than the text leaves no key to the linear
    # part, and the mass-preserving window is then softmax itself (the eps of the shared normaliser aside)
    for hybrid in ("hedgehog fitted with window", "hedgehog+window", "elu+window"):
        assert rows[hybrid]["perplexity"] == pytest.approx(rows["softmax"]["perplexity"], rel=1e-3), hybrid


def test_compare_trains_the_window_maps_end_to_end_on_sampled_text(tiny_folder, tmp_path, capsys):
    from linattn.cli import main

    out = tmp_path / "out"
    code = main(["compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
                 str(tiny_folder / "heldout.txt"), "--window", "8", "--sinks", "1", "--passkey-lengths", "40",
                 "--passkey-trials", "1", "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40",
                 "--steps", "2", "--fit-max-tokens", "128", "--fit-orders", "1", "--no-metrics", "--no-baselines",
                 "--maps", "hedgehog+window", "--end-to-end-steps", "3", "--end-to-end-samples", "4",
                 "--end-to-end-tokens", "30", "--save-maps", str(tmp_path / "maps"), "--out", str(out), "--quiet"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}
    fitted, tuned = rows["hedgehog fitted with window"], rows["hedgehog fitted with window, end to end"]
    assert math.isfinite(tuned["perplexity"])
    info = result["end_to_end"]
    assert info["samples"] == 4 and info["steps"] == 3 and len(info["history"]) == 2  # evaluated at 0 and 3
    # the end-to-end row has maps of its own: the window-fitted row kept the maps it was fitted with, so the two
    # differ unless training never moved them (then the best held-out KL is the first one)
    moved = info["best_held_out_kl"] < info["history"][0][2]
    assert (tuned["perplexity"] != fitted["perplexity"]) == moved
    # the saved window-fitted maps, passed back, serve the window row without fitting: the same perplexity
    again = tmp_path / "again"
    code = main(["compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
                 str(tiny_folder / "heldout.txt"), "--window", "8", "--sinks", "1", "--passkey-lengths", "40",
                 "--passkey-trials", "1", "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40",
                 "--no-metrics", "--no-baselines", "--maps", "hedgehog+window", "--fitted-maps",
                 str(tmp_path / "maps" / "hedgehog_window.safetensors"), "--end-to-end-steps", "1",
                 "--end-to-end-samples", "3", "--end-to-end-tokens", "20", "--save-maps", str(tmp_path / "new"),
                 "--out", str(again)])
    assert code == 0
    # without --quiet a line announces each row as it starts: the rows take minutes and print nothing till done
    printed = capsys.readouterr().out
    assert "measuring hedgehog fitted with window ...\n" in printed
    assert "measuring hedgehog fitted with window, end to end ... (the rows so far took" in printed
    result = json.loads((again / "results.json").read_text())
    assert result["fit_tokens"] == 0  # loaded, not fitted
    assert result["rows"][0]["perplexity"] == pytest.approx(fitted["perplexity"], rel=1e-6)
    assert (tmp_path / "new" / "hedgehog_window_end_to_end.safetensors").is_file()  # a folder the fit never made


def test_compare_gives_the_retrieval_heads_other_maps_and_trains_only_them(tiny_folder, tmp_path):
    from linattn.cli import main
    from linattn.distill import load_feature_maps

    common = ["compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
              str(tiny_folder / "heldout.txt"), "--window", "8", "--sinks", "1", "--passkey-lengths", "40",
              "--passkey-trials", "1", "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40",
              "--no-metrics", "--no-baselines", "--maps", "hedgehog+window", "--end-to-end-samples", "4",
              "--end-to-end-tokens", "900", "--end-to-end-texts", str(tmp_path / "texts.json"), "--quiet"]
    assert main([*common, "--steps", "2", "--fit-max-tokens", "128", "--fit-orders", "1", "--end-to-end-steps", "2",
                 "--save-maps", str(tmp_path / "a"), "--out", str(tmp_path / "first")]) == 0
    base = str(tmp_path / "a" / "hedgehog_window.safetensors")
    other = str(tmp_path / "a" / "hedgehog_window_end_to_end.safetensors")
    assert main([*common, "--fitted-maps", base, "--retrieval-maps", other, "--retrieval-heads", "3",
                 "--end-to-end-steps", "2", "--save-maps", str(tmp_path / "b"), "--out", str(tmp_path / "second")]) == 0
    result = json.loads((tmp_path / "second" / "results.json").read_text())
    names = [row["name"] for row in result["rows"]]
    assert names == ["hedgehog fitted with window",
                     "hedgehog fitted with window, 3 retrieval heads from hedgehog_window_end_to_end.safetensors",
                     "hedgehog fitted with window, 3 retrieval heads from hedgehog_window_end_to_end.safetensors, "
                     "end to end"]
    marked = result["retrieval_heads"]["heads"]
    assert len(marked) == 3 and result["end_to_end"]["heads"] == 3
    before, source = load_feature_maps(base), load_feature_maps(other)
    after = load_feature_maps(str(tmp_path / "b" / "hedgehog_window_end_to_end.safetensors"))
    for layer in range(2):
        for head in range(4):
            if [layer, head] not in marked:  # neither replaced nor trained
                assert torch.equal(after.maps[layer].weight[:, head], before.maps[layer].weight[:, head])
    # the mixed row's maps: the marked heads are the other file's, so that row differs from the first
    moved = any(not torch.equal(source.maps[l].weight[:, h], before.maps[l].weight[:, h]) for l, h in marked)
    assert (result["rows"][1]["perplexity"] != result["rows"][0]["perplexity"]) == moved
    with pytest.raises(LinearAttentionError, match="retrieval-heads"):
        main(["--debug", *common, "--fitted-maps", base, "--retrieval-maps", other, "--out", str(tmp_path / "third")])
    # the other way round: the retrieval heads stay, the other heads are trained, the repeat weighted
    assert main([*common, "--fitted-maps", base, "--retrieval-heads", "3", "--train-other-heads",
                 "--end-to-end-repeat-weight", "4", "--end-to-end-steps", "2", "--save-maps", str(tmp_path / "c"),
                 "--out", str(tmp_path / "fourth")]) == 0
    result = json.loads((tmp_path / "fourth" / "results.json").read_text())
    samples_copies = result["end_to_end"]["copying_sequences"]
    assert [row["name"] for row in result["rows"]] == [
        "hedgehog fitted with window", "hedgehog fitted with window, end to end, other heads, repeat weight 4"]
    assert result["end_to_end"]["heads"] == 8 - 3 and result["end_to_end"]["repeat_weight"] == 4
    after = load_feature_maps(str(tmp_path / "c" / "hedgehog_window_end_to_end.safetensors"))
    for layer, head in result["retrieval_heads"]["heads"]:
        assert torch.equal(after.maps[layer].weight[:, head], before.maps[layer].weight[:, head])
    # the retrieval heads alone trained, on their own maps, with the training text beside the samples: the row
    # says which heads and which text
    longer = tmp_path / "longer.txt"  # long enough for copying sequences of its own
    longer.write_text((tiny_folder / "train.txt").read_text() * 4)
    assert main([*common[:2], str(longer), *common[3:], "--fitted-maps", base, "--retrieval-heads", "2",
                 "--end-to-end-steps", "1", "--end-to-end-corpus-orders", "2", "--end-to-end-repeat-weight", "3",
                 "--out", str(tmp_path / "sixth")]) == 0
    result = json.loads((tmp_path / "sixth" / "results.json").read_text())
    assert result["rows"][-1]["name"] == ("hedgehog fitted with window, end to end, 2 retrieval heads, with 2 orders "
                                          "of the training text, repeat weight 3")
    info = result["end_to_end"]
    assert info["heads"] == 2 and info["corpus_sequences"] == 2
    assert info["copying_sequences"] > samples_copies  # the text's own copies too, each with its weights
    with pytest.raises(LinearAttentionError, match="train-other-heads"):
        main(["--debug", *common, "--fitted-maps", base, "--train-other-heads", "--out", str(tmp_path / "fifth")])


def test_end_to_end_texts_are_written_once_and_read_back(tiny_folder, tmp_path):
    from linattn.cli import main

    texts = tmp_path / "texts.json"

    def run(out: str, tokens: str = "20") -> dict:
        code = main(["--debug", "compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
                     str(tiny_folder / "heldout.txt"), "--window", "8", "--sinks", "1", "--passkey-lengths", "40",
                     "--passkey-trials", "1", "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40",
                     "--steps", "1", "--fit-max-tokens", "128", "--fit-orders", "1", "--no-metrics", "--no-baselines",
                     "--maps", "hedgehog+window", "--end-to-end-steps", "2", "--end-to-end-samples", "3",
                     "--end-to-end-tokens", tokens, "--end-to-end-texts", str(texts), "--out", str(tmp_path / out),
                     "--quiet"])
        assert code == 0
        return json.loads((tmp_path / out / "results.json").read_text())

    first = run("first")
    saved = json.loads(texts.read_text())
    assert len(saved["texts"]) == 3 and saved["tokens"] == 20
    # edited texts are what the second run trains on: its end-to-end row differs from the first run's
    texts.write_text(json.dumps({**saved, "texts": [t[::-1] for t in saved["texts"]]}))
    second = run("second")
    rows = [{row["name"]: row for row in r["rows"]}["hedgehog fitted with window, end to end"] for r in (first, second)]
    assert rows[0]["perplexity"] != rows[1]["perplexity"]
    texts.write_text(json.dumps(saved))
    third = {row["name"]: row["perplexity"] for row in run("third")["rows"]}  # the same texts: the same rows
    assert third == pytest.approx({row["name"]: row["perplexity"] for row in first["rows"]}, rel=1e-6)
    with pytest.raises(LinearAttentionError, match="another model, other prompts or another length"):
        run("fourth", tokens="21")


def test_end_to_end_texts_of_a_converted_model_are_found_from_any_install(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from linattn.evaluate import lm_stages

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    saved = tmp_path / "texts.json"
    settings = {"model": "m-0123456789ab", "prompts": ["a"], "tokens": 5, "seed": 0}
    saved.write_text(json.dumps({**settings, "texts": ["abcde"]}))

    def never(*_: object, **__: object) -> list[str]:
        raise AssertionError("sampled again")

    monkeypatch.setattr(lm_stages, "sample_texts", never)
    # a GGUF conversion is named by the file's bytes (the same folder name in every install): the name is the key
    converted = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(tmp_path / "cache" / "m-0123456789ab")))
    assert lm_stages.sampled_texts(converted, None, ["a"], 5, str(saved)) == ["abcde"]
    # any other folder is known by its path
    other = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(tmp_path / "m-0123456789ab")))
    with pytest.raises(LinearAttentionError, match="another model"):
        lm_stages.sampled_texts(other, None, ["a"], 5, str(saved))


def test_compare_trains_lora_adapters_with_the_maps_frozen_and_only_for_their_row(tiny_folder, tmp_path):
    from linattn.cli import main

    common = ["compare", str(tiny_folder), str(tiny_folder / "train.txt"), "--heldout",
              str(tiny_folder / "heldout.txt"), "--window", "8", "--sinks", "1", "--passkey-lengths", "40",
              "--passkey-trials", "1", "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40",
              "--no-metrics", "--no-baselines", "--end-to-end-samples", "4", "--end-to-end-tokens", "60",
              "--end-to-end-texts", str(tmp_path / "texts.json"), "--quiet"]
    assert main([*common, "--maps", "hedgehog+window", "--steps", "2", "--fit-max-tokens", "128", "--fit-orders",
                 "1", "--save-maps", str(tmp_path / "a"), "--out", str(tmp_path / "first")]) == 0
    base = str(tmp_path / "a" / "hedgehog_window.safetensors")
    # elu after the adapted row: it must see the model as shipped (the adapters are attached for their row alone)
    assert main([*common, "--maps", "hedgehog+window", "elu", "--fitted-maps", base, "--out", str(tmp_path / "plain")
                 ]) == 0
    assert main([*common, "--maps", "hedgehog+window", "elu", "--fitted-maps", base, "--end-to-end-lora", "2",
                 "--end-to-end-lora-lr", "0.01", "--end-to-end-steps", "3", "--save-maps", str(tmp_path / "b"),
                 "--out", str(tmp_path / "lora")]) == 0
    plain = {row["name"]: row for row in json.loads((tmp_path / "plain" / "results.json").read_text())["rows"]}
    result = json.loads((tmp_path / "lora" / "results.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}
    adapted = "hedgehog fitted with window, end to end: LoRA r=2 (fine-tuned)"
    assert list(rows) == ["hedgehog fitted with window", adapted, "elu", "elu+window"]
    for name in ("hedgehog fitted with window", "elu", "elu+window"):  # same model, same maps: the same numbers
        assert rows[name]["perplexity"] == pytest.approx(plain[name]["perplexity"], rel=1e-6), name
    info = result["end_to_end"]
    assert info["lora_rank"] == 2 and info["heads"] is None
    assert "rank-2 adapters" in (tmp_path / "lora" / "report.md").read_text()  # the report says what was changed
    assert "adapters" not in (tmp_path / "plain" / "report.md").read_text()
    moved = info["best_held_out_kl"] < info["history"][0][2]
    assert (rows[adapted]["perplexity"] != rows["hedgehog fitted with window"]["perplexity"]) == moved
    assert (tmp_path / "b" / "lora" / "adapter_model.safetensors").is_file()  # the adapters; the maps were not trained
    assert not (tmp_path / "b" / "hedgehog_window_end_to_end.safetensors").exists()
    for bad in (["--end-to-end-lora", "2"], ["--end-to-end-lora", "-1", "--end-to-end-steps", "1"],
                ["--end-to-end-lora", "2", "--end-to-end-steps", "1", "--retrieval-heads", "2"],
                ["--end-to-end-lora", "2", "--end-to-end-steps", "1", "--end-to-end-lora-lr", "0"]):
        with pytest.raises(LinearAttentionError, match="lora"):
            main(["--debug", *common, "--maps", "hedgehog+window", "--fitted-maps", base, *bad, "--out",
                  str(tmp_path / "bad")])


def test_lm_options_are_checked_before_the_model_loads(tmp_path):
    from linattn.cli import main

    folder = tmp_path / "not-a-model"  # passes the name check (a local folder); only loading it would fail
    folder.mkdir()
    common = ["compare", str(folder), "--lm", "--out", str(tmp_path / "out")]
    for bad, match in ((["--maps", "elu", "nonesuch"], "unknown"), (["--window", "0"], "--window"),
                       (["--end-to-end-steps", "2", "--maps", "elu"], "hedgehog\\+window")):
        with pytest.raises(LinearAttentionError, match=match):
            main(["--debug", *common, *bad])
    assert not (tmp_path / "out").exists()


def test_lm_report_names_the_held_out_text(tmp_path):
    from linattn.evaluate.report import write_lm_report

    result = {"model": "tiny", "passage_tokens": 12, "gap_tokens": 40, "window": 8, "sinks": 1, "threads": 2,
              "rows": [], "heldout": "texts/mine.txt"}
    write_lm_report(result, str(tmp_path))
    assert "Held-out text `texts/mine.txt`;" in (tmp_path / "report.md").read_text()
    write_lm_report({**result, "heldout": None}, str(tmp_path))
    assert "Held-out text of the shipped corpus;" in (tmp_path / "report.md").read_text()
