"""scripts/add_cache.py on a tiny Llama's delta-rule folder: a cache split by retrieval score, trained end to end
with the cache in place (``--end-to-end-steps``), measured, saved with the logits of the measured model, and run
again after it finished: nothing trained or measured twice."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import hf  # noqa: E402
from linattn.linearized import load_linearized  # noqa: E402
from test_linearize_job import command, tiny  # noqa: E402, F401  (tiny: a fixture)
from test_linearized import TEXT  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "add_cache.py"
OPTIONS = ["--window", "4", "--cache", "4", "--floor", "0", "--top", "2", "--end-to-end-steps", "2",
           "--end-to-end-samples", "3", "--end-to-end-tokens", "40"]


def run_script(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")


@pytest.mark.slow  # ~30 s: a tiny linearize run, then the script twice
def test_a_folder_given_a_cache_is_trained_with_it_in_place(tiny, tmp_path, monkeypatch):  # noqa: F811
    from linattn.cli import main
    from linattn.train import end_to_end

    source, out = tmp_path / "source", tmp_path / "cached"
    assert main(command(tiny, source, "--student", "gated-delta")) == 0
    trained = []
    real = end_to_end.fit_end_to_end

    def spy(model, *args, **kwargs):
        trained.append([getattr(module, hf.OPTIONS_ATTRIBUTE).get("sparse_cache")
                        for module in hf.attention_modules(model)])
        return real(model, *args, **kwargs)

    monkeypatch.setattr(end_to_end, "fit_end_to_end", spy)
    run_script(monkeypatch, str(source), str(out), *OPTIONS)
    # trained once, with the cache in place (a layer whose heads all have 0 pairs runs without one)
    assert len(trained) == 1 and any(cache is not None for cache in trained[0])
    result = json.loads((out / "results.json").read_text())
    assert result["sparse_cache_trained"] is True and result["window"] == 4
    stage = result["stages"]["cache_end_to_end"]
    assert stage["steps"] == 2 and stage["samples"] == 3 and len(stage["history"]) >= 2
    assert "trained end to end with the cache in place, 2 steps" in stage["summary"]
    assert "trained and measured in place" in (out / "README.md").read_text()
    # the saved folder is the trained one: its maps moved from the source's, its logits are the measured model's
    # (the script checks those itself and exits with 1 otherwise)
    tuned, tokenizer = load_linearized(out)
    plain, _ = load_linearized(source)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        assert not torch.equal(tuned(input_ids=ids).logits, plain(input_ids=ids).logits)
    # run again: the training read back, every measurement kept
    before = (out / ".add_cache.json").read_text()
    run_script(monkeypatch, str(source), str(out), *OPTIONS)
    assert len(trained) == 1
    assert json.loads((out / ".add_cache.json").read_text()) == json.loads(before)
    with torch.no_grad():
        again, _ = load_linearized(out)
        assert torch.equal(again(input_ids=ids).logits, tuned(input_ids=ids).logits)


@pytest.mark.slow  # ~20 s: a tiny linearize run, then the script once
def test_the_training_text_trains_beside_the_samples_when_asked(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--end-to-end-corpus-orders K: the shipped training text in K paragraph orders joins the samples (with their
    copying sequences) in the training set, the setting and the stage's record say so; --end-to-end-seed S seeds
    the steps' draws and is recorded likewise."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    source, out = tmp_path / "source", tmp_path / "corpus"
    assert main(command(tiny, source, "--student", "gated-delta")) == 0
    seen = []
    real = lm_stages.training_set

    def spy(plain, corpus, options, *rest):
        seen.append((len(plain), [len(ids) for ids in corpus], options.corpus_orders))
        return real(plain, corpus, options, *rest)

    monkeypatch.setattr(lm_stages, "training_set", spy)
    from linattn.train import end_to_end

    seeds = []
    real_fit = end_to_end.fit_end_to_end

    def spy_fit(*args, **kwargs):
        seeds.append(kwargs.get("seed"))
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(end_to_end, "fit_end_to_end", spy_fit)
    run_script(monkeypatch, str(source), str(out), *OPTIONS, "--end-to-end-corpus-orders", "2",
               "--end-to-end-seed", "3")
    assert seeds == [3]  # the steps' draws follow --end-to-end-seed
    assert len(seen) == 1 and seen[0][0] == 3 and seen[0][2] == 2
    assert len(seen[0][1]) == 2 and all(0 < n <= 40 + lm_stages.PROMPT_TOKENS for n in seen[0][1])
    progress = json.loads((out / ".add_cache.json").read_text())
    assert progress["setting"]["corpus_orders"] == 2 and progress["end_to_end"]["corpus_orders"] == 2
    assert progress["setting"]["seed"] == 3 and progress["end_to_end"]["seed"] == 3
    assert "the training text in 2 orders" in json.loads((out / "results.json").read_text())["stages"][
        "cache_end_to_end"]["summary"]
