"""`linattn linearize`: the stages into one folder, resumed after an interruption; budgets; bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import LinearAttentionError  # noqa: E402
from linattn.linearized import budget as linearize_budget  # noqa: E402
from linattn.linearized import folder as linearized_folder  # noqa: E402
from linattn.linearized import job as linearize_job  # noqa: E402
from linattn.linearized import load_linearized  # noqa: E402
from linattn.linearized.budget import plan_steps  # noqa: E402
from linattn.linearized.card import wilson_interval  # noqa: E402
from linattn.train.end_to_end import COPY_GAP  # noqa: E402
from test_linearized import TEXT, save_tiny_llama  # noqa: E402

FAST = ["--fit-steps", "2", "--fit-max-tokens", "128", "--fit-orders", "1", "--end-to-end-steps", "3",
        "--end-to-end-samples", "4", "--end-to-end-tokens", "30", "--passkey-lengths", "40", "--passkey-trials", "2",
        "--repeat-trials", "1", "--passage-tokens", "12", "--gap-tokens", "40", "--window", "8", "--sinks", "1",
        "--quiet", "--student", "hedgehog", "--end-to-end-long-steps", "0",  # no long_gaps stage unless given
        "--sparse-cache", "0"]  # no cache unless a test gives one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-job") / "base")
    (folder / "train.txt").write_text((TEXT + "\n") * 3)
    (folder / "heldout.txt").write_text((TEXT.replace("sand", "silt") + "\n") * 3)
    return folder


def command(tiny, out, *extra):
    return ["linearize", str(tiny), str(tiny / "train.txt"), "--heldout", str(tiny / "heldout.txt"), "--out",
            str(out), *FAST, *extra]


def caches_while_training(monkeypatch):
    """The sparse_cache option of every attention layer when the end-to-end stage starts training, as a list."""
    from linattn import hf
    from linattn.evaluate import lm_stages

    seen = []
    real = lm_stages.fit_end_to_end

    def spy(model, *args, **kwargs):
        seen.extend(getattr(module, hf.OPTIONS_ATTRIBUTE).get("sparse_cache") for module in
                    hf.attention_modules(model))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    return seen


def caches_while_fitting(monkeypatch):
    """The sparse_cache the fit stage fits with (one list per fit)."""
    from linattn.evaluate import lm_stages

    seen = []
    real = lm_stages.fit_model_feature_maps

    def spy(capture, **kwargs):
        cache = kwargs.get("sparse_cache")
        seen.append(cache if isinstance(cache, list) or cache is None else [cache] * capture.num_layers)
        return real(capture, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_model_feature_maps", spy)
    return seen


def events(out):
    return [(line["stage"], line["event"]) for line in map(json.loads, (out / "stages" / "log.jsonl").open())]


def counted(monkeypatch, module, name, calls, key=None):
    """Replace ``module.name`` by a spy that counts its calls in ``calls[key or name]`` and then calls it."""
    real = getattr(module, name)
    calls.setdefault(key or name, 0)

    def spy(*args, **kwargs):
        calls[key or name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def interrupt(monkeypatch, module, name):
    monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))  # a user's Ctrl-C


def written_files(monkeypatch, out):
    """The paths under ``out`` opened for writing from Python (relative to ``out``), with their modes, as a list."""
    import builtins
    import io
    import os

    real = builtins.open
    seen = []

    def spy(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(flag in mode for flag in "wax+"):
            path = os.path.abspath(os.fspath(file))
            if path.startswith(str(out) + os.sep) and not os.path.isdir(path):  # (tempfile opens its folder)
                seen.append((os.path.relpath(path, out), mode))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return seen


@pytest.mark.slow  # ~25 s: the pipeline, interrupted in the second and in the third stage, on a tiny Llama
def test_an_interrupted_run_continues_where_it_stopped(tiny, tmp_path, monkeypatch, capsys):
    """Each rerun reuses what the stages before saved: the fit, the sampled texts (samples.json: never sampled
    twice) and the trained maps (counted by spies on sampling, fitting and training)."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    out = tmp_path / "lin"
    calls: dict[str, int] = {}
    counted(monkeypatch, lm_stages, "sample_texts", calls, "sample")
    counted(monkeypatch, linearize_job, "fit_hedgehog", calls, "fit")
    training = linearize_job.train_end_to_end
    interrupt(monkeypatch, linearize_job, "train_end_to_end")  # in the second stage, after sampling
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out))
    fit = out / "stages" / "fit.safetensors"
    assert (out / "stages" / "fit.done").is_file() and not (out / "stages" / "end_to_end.done").exists()
    assert not (out / "linattn.json").exists()  # not a linearized folder until the last stage
    assert (out / "stages" / "samples.json").is_file() and calls == {"sample": 1, "fit": 1}
    stamp = fit.stat().st_mtime_ns
    monkeypatch.setattr(linearize_job, "train_end_to_end", training)
    counted(monkeypatch, linearize_job, "train_end_to_end", calls, "train")
    interrupt(monkeypatch, linearize_job, "score_model")  # in the third stage
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out))
    assert calls == {"sample": 1, "fit": 1, "train": 1}  # the saved texts read back, the fit not run again
    assert (out / "stages" / "end_to_end.done").is_file() and not (out / "stages" / "measure.done").exists()
    monkeypatch.undo()
    calls.clear()
    counted(monkeypatch, lm_stages, "sample_texts", calls, "sample")
    counted(monkeypatch, linearize_job, "fit_hedgehog", calls, "fit")
    counted(monkeypatch, linearize_job, "train_end_to_end", calls, "train")
    counted(monkeypatch, linearize_job, "score_model", calls, "score")
    assert main(command(tiny, out)) == 0
    assert calls == {"sample": 0, "fit": 0, "train": 0, "score": 3}  # only the measure runs (three rows)
    assert fit.stat().st_mtime_ns == stamp
    assert events(out) == [("fit", "started"), ("fit", "finished"), ("end_to_end", "started"),
                           ("fit", "skipped (finished before)"), ("end_to_end", "started"),
                           ("end_to_end", "finished"), ("measure", "started"),
                           ("fit", "skipped (finished before)"), ("end_to_end", "skipped (finished before)"),
                           ("measure", "started"), ("measure", "finished")]
    result = json.loads((out / "results.json").read_text())
    names = [row["name"] for row in result["rows"]]
    assert names == ["original (softmax)", "window 8 + 1 sinks (softmax)", "linearized"]
    assert all(math.isfinite(row["perplexity"]) and row["by_position"] for row in result["rows"])
    card = (out / "README.md").read_text()
    assert "| linearized |" in card and "/2 [" in card  # passkey hits of 2 trials with their interval
    # the folder reloads as the model that was measured: the same held-out perplexity
    from linattn.evaluate import perplexity

    model, tokenizer = load_linearized(out)
    again = perplexity(model, tokenizer, (tiny / "heldout.txt").read_text())
    # the measured row ran the same weights and maps on the same text and shapes; rel 1e-6 allows for rounding
    # only (a wrong map or a missing window changes the perplexity by percents)
    assert again.perplexity == pytest.approx(result["rows"][-1]["perplexity"], rel=1e-6)
    # a fourth run finds every stage finished and does nothing but log it
    assert main(command(tiny, out)) == 0
    assert calls == {"sample": 0, "fit": 0, "train": 0, "score": 3}
    assert events(out)[-3:] == [("fit", "skipped (finished before)"), ("end_to_end", "skipped (finished before)"),
                                ("measure", "skipped (finished before)")]


@pytest.mark.slow  # ~10 s: the pipeline once on a tiny Llama
def test_every_file_a_stage_writes_goes_through_a_temporary_name(tiny, tmp_path, monkeypatch):
    """An interruption at any moment leaves each file whole or absent under its name: every file written under
    --out from Python is a temporary one (a name or a folder starting with a dot, renamed after) but the
    append-only log."""
    from linattn.cli import main

    out = tmp_path / "atomic"
    written = written_files(monkeypatch, out)
    assert main(command(tiny, out)) == 0
    names = {path for path, _ in written}
    assert {"stages/log.jsonl"} < names and any("samples.json" in path for path in names)  # the spy sees them
    direct = [(path, mode) for path, mode in written
              if path != "stages/log.jsonl" and not any(part.startswith(".") for part in path.split("/"))]
    assert direct == []
    assert all(mode == "a" for path, mode in written if path == "stages/log.jsonl")
    assert (out / "stages" / "samples.json").is_file() and not list(out.glob("**/*partial*"))
    # strict JSON: the first end-to-end step has no training loss yet (NaN in memory), written null
    results = json.loads((out / "results.json").read_text(),
                         parse_constant=lambda constant: pytest.fail(f"results.json holds {constant}"))
    assert results["stages"]["end_to_end"]["history"][0][1] is None


def test_a_rerun_with_other_options_is_refused(tiny, tmp_path, monkeypatch, capsys):
    from linattn.cli import main

    out = tmp_path / "lin"
    monkeypatch.setattr(linearize_job, "fit_hedgehog", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out))
    assert main(command(tiny, out, "--lora", "4")) == 2
    assert "holds the stages of a run with other options (lora)" in capsys.readouterr().err


def test_bad_input_is_refused_before_any_work(tiny, tmp_path, capsys):
    from transformers import BertConfig, BertModel

    from linattn.cli import main

    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path / "bert")
    assert main(["linearize", str(tmp_path / "bert"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a causal LM" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(command(tiny, blocker / "sub")) == 2  # a file where the folder should be
    assert "--out: cannot write into" in capsys.readouterr().err
    assert main(command(tiny, tmp_path / "y", "--budget", "0")) == 2
    assert "--budget: need minutes > 0" in capsys.readouterr().err


def test_a_budget_too_small_is_refused_with_the_least_that_would_do(tiny, tmp_path, monkeypatch, capsys):
    from linattn.cli import main
    from linattn.linearized import budget

    # the calibration's timings fixed (measured ones vary with the machine's load): 100 s of fixed costs and
    # (100 + 10 fitting steps of 1 s / 0.4) / 0.8 = 156 s at least, so 2 min are refused and 3 min are the least
    costs = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
             "end_to_end_step": 2.0}
    monkeypatch.setattr(budget, "calibrate", lambda *args, **kwargs: costs)
    assert main(command(tiny, tmp_path / "b", "--budget", "2", "--fit-steps", "10")) == 2
    err = capsys.readouterr().err
    assert "--budget: 2 min leave room for" in err and "pass --budget 3 or more" in err
    assert not (tmp_path / "b" / "stages" / "plan.json").exists()


@pytest.mark.parametrize("cache", [[], ["--sparse-cache", "4", "--sparse-cache-heads", "retrieval"]],
                         ids=["no-cache", "split"])
def test_the_budget_caps_the_fit_at_fit_steps_and_counts_the_training_text(tiny, tmp_path, monkeypatch, cache):
    from linattn.cli import main
    from linattn.evaluate.lm_stages import training_text_count
    from linattn.evaluate.models import load_model
    from linattn.linearized import budget

    costs = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
             "end_to_end_step": 2.0}
    monkeypatch.setattr(budget, "calibrate", lambda *args, **kwargs: costs)
    seen = []

    def plan(*args, **kwargs):
        seen.append(kwargs)
        raise KeyboardInterrupt  # what the job asked for is all this test needs

    monkeypatch.setattr(budget, "plan_steps", plan)
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, tmp_path / "b", "--budget", "10", "--fit-steps", "12", "--end-to-end-corpus-orders", "3",
                     *cache))
    _, tokenizer, _ = load_model(str(tiny), causal_lm=True)
    options = type("Options", (), {"corpus_orders": 3, "tokens": 30, "copies": True, "repeat_weight": 1.0,
                                   "copy_gap": COPY_GAP})()
    wanted = training_text_count(tokenizer, (tiny / "train.txt").read_text(), options)
    # with a split decided on the samples, the fit stage makes them (its estimate counts them)
    assert wanted >= 1 and seen == [{"end_to_end": True, "samples": 4, "most_fit": 12, "corpus": wanted,
                                     "sample_first": bool(cache), "long": False}]


def test_a_disk_without_room_for_the_run_is_refused(tiny, tmp_path, monkeypatch, capsys):
    """The estimate: three sets of maps (layers × heads × head dim × features × 2 sides × 4 bytes) and a margin."""
    import shutil
    from collections import namedtuple

    from linattn.cli import main

    config = type("Config", (), {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2})()
    estimate = linearized_folder.check_disk(tmp_path, type("Model", (), {"config": config})(), None)
    assert estimate == 3 * 2 * 4 * 16 * 16 * 2 * 4 + linearized_folder.DISK_MARGIN
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - estimate + 1, estimate - 1))
    with pytest.raises(LinearAttentionError, match="needs about 64 MiB; free some space or pass another --out"):
        linearized_folder.check_disk(tmp_path, type("Model", (), {"config": config})(), None)
    monkeypatch.setattr(linearize_job, "fit_hedgehog", None)  # never reached
    assert main(command(tiny, tmp_path / "full")) == 2
    assert "MiB free on the disk of" in capsys.readouterr().err
    assert not (tmp_path / "full" / "stages" / "plan.json").exists()


@pytest.fixture
def planned_80(monkeypatch):
    """The plans worked by hand below plan 80 % of the budget and give a long_gaps stage half of the end-to-end
    time (the shares are constants: the arithmetic is what these tests check)."""
    monkeypatch.setattr(linearize_budget, "SAFETY", 0.8)
    monkeypatch.setattr(linearize_budget, "LONG_SHARE", 0.5)


@pytest.mark.usefixtures("planned_80")
def test_plan_steps_shares_what_is_left_after_the_fixed_costs():
    costs = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
             "end_to_end_step": 2.0}
    # 80 % of 600 s, less 100 s fixed (one batch of 8 samples): 380 s, 40 % (152 s) of fitting and 60 % (228 s)
    # end to end
    plan = plan_steps(10, costs, end_to_end=True, samples=8)
    assert (plan["fit_steps"], plan["end_to_end_steps"], plan["end_to_end_samples"]) == (152, 114, 8)
    assert plan["estimates"]["fit"] == 172 and plan["estimates"]["end_to_end"] == 268
    assert plan_steps(10, costs, end_to_end=False)["fit_steps"] == 420  # no sampling, everything to the fit
    with pytest.raises(LinearAttentionError, match="pass --budget 3 or more"):  # (100 + 10 · 1 / 0.4) / 0.8 s = 2.6 min
        plan_steps(2, costs, end_to_end=True)


@pytest.mark.usefixtures("planned_80")
def test_plan_steps_samples_no_more_than_the_end_to_end_steps_use():
    costs = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
             "end_to_end_step": 20.0}
    # one batch: 380 s left, 228 s of 20 s steps = 11 steps, and 8 samples give 13 training sequences: enough
    plan = plan_steps(10, costs, end_to_end=True, samples=32)
    assert (plan["end_to_end_samples"], plan["fit_steps"], plan["end_to_end_steps"]) == (8, 152, 11)
    assert plan["estimates"]["end_to_end"] == 40 + 11 * 20
    # cheap steps: 32 samples (4 batches, 260 s left, 78 steps) still give fewer than 78 sequences, so all are made
    cheap = plan_steps(10, {**costs, "end_to_end_step": 2.0}, end_to_end=True, samples=32)
    assert (cheap["end_to_end_samples"], cheap["fit_steps"], cheap["end_to_end_steps"]) == (32, 104, 78)
    # 16 samples (2 batches, 340 s left): 29 sequences against 30 steps of 6.8 s, too few; 24: 45 against 26
    middle = plan_steps(10, {**costs, "end_to_end_step": 6.8}, end_to_end=True, samples=32)
    assert (middle["end_to_end_samples"], middle["end_to_end_steps"]) == (24, 26)
    with pytest.raises(LinearAttentionError, match="--end-to-end-samples: need more than 2"):
        plan_steps(10, costs, end_to_end=True, samples=2)


@pytest.mark.usefixtures("planned_80")
def test_plan_steps_caps_the_fit_and_counts_the_training_text():
    costs = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
             "end_to_end_step": 20.0}
    # one batch: 380 s left; the fit capped at 50 steps (50 s), the other 330 s give 16 end-to-end steps, which 8
    # samples (13 sequences) do not cover, but with the training text's 16 sequences they do
    plan = plan_steps(10, costs, end_to_end=True, samples=32, most_fit=50, corpus=16)
    assert (plan["end_to_end_samples"], plan["fit_steps"], plan["end_to_end_steps"]) == (8, 50, 16)
    assert plan["estimates"]["fit"] == 20 + 50 and plan["estimates"]["end_to_end"] == 40 + 16 * 20
    # a split decided on the samples: they are made in the fit stage, and its estimate says so
    first = plan_steps(10, costs, end_to_end=True, samples=32, most_fit=50, corpus=16, sample_first=True)
    assert first["estimates"]["fit"] == 40 + 20 + 50 and first["estimates"]["end_to_end"] == 16 * 20
    # without it, two batches (340 s left: 50 fitting steps, 14 end-to-end steps, 29 sequences)
    plan = plan_steps(10, costs, end_to_end=True, samples=32, most_fit=50)
    assert (plan["end_to_end_samples"], plan["fit_steps"], plan["end_to_end_steps"]) == (16, 50, 14)
    # a cap above 40 % of the time changes nothing; with no end-to-end stage the fit takes all of it, uncapped
    assert plan_steps(10, costs, end_to_end=True, samples=8, most_fit=500)["fit_steps"] == 152
    assert plan_steps(10, costs, end_to_end=False, most_fit=50)["fit_steps"] == 420
    with pytest.raises(LinearAttentionError, match="--fit-steps: with --budget, need at least 10"):
        plan_steps(10, costs, end_to_end=True, most_fit=9)


def test_wilson_interval_matches_its_closed_form():
    # 0 of 3: [0, z²/(n + z²)]; 3 of 3: [n/(n + z²), 1] — the interval's known endpoints at the extremes
    z2 = 1.959964**2
    low, high = wilson_interval(0, 3)
    assert low == pytest.approx(0, abs=1e-15) and high == pytest.approx(z2 / (3 + z2), rel=1e-12)
    low, high = wilson_interval(3, 3)
    assert low == pytest.approx(3 / (3 + z2), rel=1e-12) and high == 1
    low, high = wilson_interval(50, 100)  # the textbook value: [0.4038, 0.5962]
    assert (low, high) == pytest.approx((0.4038, 0.5962), abs=1e-4)


@pytest.mark.slow  # ~10 s: the pipeline once, with adapters
def test_lora_adapters_travel_with_the_folder_and_the_card_says_fine_tuned(tiny, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from linattn.cli import main
    from linattn.evaluate import perplexity

    out = tmp_path / "lora"
    written = written_files(monkeypatch, out)
    assert main(command(tiny, out, "--lora", "2")) == 0
    assert any(path.endswith("adapter_config.json") for path, _ in written)  # the spy sees the adapters' files
    assert [path for path, _ in written if path != "stages/log.jsonl"
            and not any(part.startswith(".") for part in path.split("/"))] == []  # all through temporary names
    index = json.loads((out / "linattn.json").read_text())
    assert index["adapters"] == "lora" and (out / "lora" / "adapter_model.safetensors").is_file()
    assert "**Fine-tuned:**" in (out / "README.md").read_text()
    from safetensors.torch import load_file

    saved = load_file(str(out / "lora" / "adapter_model.safetensors"))
    assert any(name.endswith("lora_B.weight") and bool(t.abs().sum() > 0) for name, t in saved.items())  # trained
    model, tokenizer = load_linearized(out)
    measured = json.loads((out / "results.json").read_text())["rows"][-1]["perplexity"]
    # with the adapters attached the reloaded model is the one measured (rounding only, as above)
    assert perplexity(model, tokenizer, (tiny / "heldout.txt").read_text()).perplexity == pytest.approx(measured,
                                                                                                         rel=1e-6)


@pytest.mark.slow  # ~10 s: the pipeline once, with a sparse cache
def test_a_sparse_cache_is_trained_and_measured_in_place_and_saved(tiny, tmp_path, monkeypatch):
    """--sparse-cache N: the end-to-end stage trains with the cache in every attention layer, the measured row and
    the reloaded folder have it (the reloaded model scores what was measured), and the softmax row beside it has
    the equal memory of W + N keys."""
    from linattn import hf
    from linattn.cli import main
    from linattn.evaluate import perplexity

    seen = caches_while_training(monkeypatch)
    fitting = caches_while_fitting(monkeypatch)
    out = tmp_path / "cached"
    assert main(command(tiny, out, "--sparse-cache", "4")) == 0
    assert seen and all(cache == 4 for cache in seen)
    assert len(fitting) == 1 and all(cache.size == 4 and cache.score == "recall" for cache in fitting[0])
    assert json.loads((out / "linattn.json").read_text())["options"] == {"sparse_cache": 4}
    results = json.loads((out / "results.json").read_text())
    assert [row["name"] for row in results["rows"]][1] == "window 12 + 1 sinks (softmax)"  # W 8 + 4
    assert results["stages"]["end_to_end"]["sparse_cache"] == 4 and results["stages"]["fit"]["sparse_cache"]
    assert "sparse exact cache of 4" in (out / "README.md").read_text()
    model, tokenizer = load_linearized(out)
    assert all(getattr(module, hf.OPTIONS_ATTRIBUTE).get("sparse_cache") == 4 for module in
               hf.attention_modules(model))
    measured = results["rows"][-1]["perplexity"]
    assert perplexity(model, tokenizer, (tiny / "heldout.txt").read_text()).perplexity == pytest.approx(measured,
                                                                                                         rel=1e-6)
    assert main(command(tiny, out)) == 2  # the same folder without the cache: other options, refused


@pytest.mark.slow  # ~10 s: the pipeline once, with a cache and the linear part discounted
def test_a_linear_weight_beside_the_cache_is_trained_measured_and_saved(tiny, tmp_path, monkeypatch):
    """--sparse-cache-linear-weight β: the end-to-end stage trains with the weighed cache in place, the folder
    saves the cache's fields and the reloaded model scores what was measured; without a cache it is refused."""
    from linattn import SparseCache, hf
    from linattn.cli import main
    from linattn.evaluate import perplexity

    seen = caches_while_training(monkeypatch)
    fitting = caches_while_fitting(monkeypatch)
    out = tmp_path / "weighed"
    assert main(command(tiny, out, "--sparse-cache", "4", "--sparse-cache-linear-weight", "0.25")) == 0
    assert seen and all(cache == SparseCache(4, linear_weight=0.25) for cache in seen)
    assert len(fitting) == 1 and all(cache.linear_weight == 0.25 for cache in fitting[0])
    options = json.loads((out / "linattn.json").read_text())["options"]
    assert options == {"sparse_cache": {"size": 4, "linear_weight": 0.25}}
    results = json.loads((out / "results.json").read_text())
    assert results["sparse_cache_linear_weight"] == 0.25
    assert "the linear part weighed 0.25 beside it" in (out / "README.md").read_text()
    model, tokenizer = load_linearized(out)
    assert all(getattr(module, hf.OPTIONS_ATTRIBUTE)["sparse_cache"].linear_weight == 0.25
               for module in hf.attention_modules(model))
    measured = results["rows"][-1]["perplexity"]
    assert perplexity(model, tokenizer, (tiny / "heldout.txt").read_text()).perplexity == pytest.approx(measured,
                                                                                                         rel=1e-6)
    assert main(command(tiny, tmp_path / "bare", "--sparse-cache-linear-weight", "0.5")) == 2  # no cache
    assert main(command(tiny, tmp_path / "negative", "--sparse-cache", "4", "--sparse-cache-linear-weight",
                        "-1")) == 2


@pytest.mark.slow  # ~15 s: the pipeline once, with the cache split across heads
def test_a_cache_split_by_retrieval_score_is_trained_saved_and_reloaded(tiny, tmp_path, monkeypatch):
    """--sparse-cache-heads retrieval: per-head sizes from the heads' retrieval scores on the sampled texts (a mean
    of N, each ≥ the floor), in place while training, saved per layer in the folder and put back on loading; a
    rerun reads them back rather than scoring again."""
    from linattn import hf
    from linattn.cli import main
    from linattn.evaluate import lm_stages
    from linattn.linearized import job as linearize_job

    seen = caches_while_training(monkeypatch)
    fitting = caches_while_fitting(monkeypatch)
    calls: dict[str, int] = {}
    counted(monkeypatch, lm_stages, "sample_texts", calls, "sample")
    out = tmp_path / "split"
    options = ("--sparse-cache", "4", "--sparse-cache-heads", "retrieval", "--sparse-cache-floor", "1",
               "--end-to-end-tokens", "120")  # samples as long as a passage, the gap and the repeat at W = 8
    assert main(command(tiny, out, *options)) == 0
    split = json.loads((out / "stages" / "cache_sizes.json").read_text())
    sizes = torch.tensor(split["sizes"])
    layers, heads = sizes.shape
    assert int(sizes.sum()) == 4 * layers * heads and int(sizes.min()) >= 1
    assert calls == {"sample": 1}  # sampled for the split in the fit stage, read back by the end-to-end stage
    scores = torch.tensor(split["scores"]).clamp(min=0).flatten()
    assert sizes.flatten()[scores.argmax()] == sizes.max()  # the head that retrieves most keeps most
    assert [cache.size for cache in seen] == [tuple(row) for row in split["sizes"]]
    assert [cache.size for cache in fitting[0]] == [tuple(row) for row in split["sizes"]]  # fitted with it too
    assert json.loads((out / "linattn.json").read_text())["options"] == {"sparse_cache": split["sizes"]}
    assert "split across heads by their retrieval score" in (out / "README.md").read_text()
    model, _ = load_linearized(out)
    assert [getattr(module, hf.OPTIONS_ATTRIBUTE)["sparse_cache"].size for module in hf.attention_modules(model)] \
        == [tuple(row) for row in split["sizes"]]
    (out / "stages" / "measure.done").unlink()  # measured again: the sizes are read back, not scored again
    monkeypatch.setattr(linearize_job, "cache_split", None)
    assert main(command(tiny, out, *options)) == 0
    assert calls == {"sample": 1}
    assert main(command(tiny, tmp_path / "other", "--sparse-cache-heads", "retrieval")) == 2  # no cache to split


@pytest.mark.slow  # ~10 s: the fit and the measure stage, with the cache split across heads
def test_a_split_cache_without_end_to_end_steps_is_fitted_measured_and_saved(tiny, tmp_path, monkeypatch):
    """--sparse-cache-heads retrieval with --end-to-end-steps 0: the texts are sampled for the split alone, the fit
    has the split in place, and the measured row and the folder have it too (also on a rerun of the measure)."""
    from linattn.cli import main

    fitting = caches_while_fitting(monkeypatch)
    out = tmp_path / "fit-only"
    options = ("--sparse-cache", "4", "--sparse-cache-heads", "retrieval", "--sparse-cache-floor", "1",
               "--end-to-end-tokens", "120", "--end-to-end-steps", "0")
    assert main(command(tiny, out, *options)) == 0
    split = json.loads((out / "stages" / "cache_sizes.json").read_text())
    assert len(fitting) == 1 and [cache.size for cache in fitting[0]] == [tuple(row) for row in split["sizes"]]
    assert not (out / "stages" / "end_to_end.done").exists()
    assert json.loads((out / "linattn.json").read_text())["options"] == {"sparse_cache": split["sizes"]}
    (out / "stages" / "measure.done").unlink()
    assert main(command(tiny, out, *options)) == 0
    assert len(fitting) == 1  # the fit was not run again
    assert json.loads((out / "linattn.json").read_text())["options"] == {"sparse_cache": split["sizes"]}


@pytest.mark.slow  # ~10 s: the fit and the measure stage, the cache given to the top heads
def test_a_cache_given_to_the_top_heads_alone_is_saved_with_the_folder(tiny, tmp_path):
    """--sparse-cache-top K: the K heads of highest retrieval score share what the floor leaves, equally; the
    others keep the floor; the folder and its card say so."""
    from linattn.cli import main

    out = tmp_path / "top"
    options = ("--sparse-cache", "4", "--sparse-cache-heads", "retrieval", "--sparse-cache-floor", "1",
               "--sparse-cache-top", "2", "--end-to-end-tokens", "120", "--end-to-end-steps", "0")
    assert main(command(tiny, out, *options)) == 0
    split = json.loads((out / "stages" / "cache_sizes.json").read_text())
    sizes, scores = torch.tensor(split["sizes"]).flatten(), torch.tensor(split["scores"]).flatten()
    spare = (4 - 1) * sizes.numel()
    assert split["top"] == 2 and int(sizes.sum()) == 4 * sizes.numel()
    ordered = sorted(sizes.tolist())
    assert ordered[-2:] == [1 + spare // 2] * 2 and ordered[:-2] == [1] * (sizes.numel() - 2)
    assert set(scores.argsort(descending=True)[:2].tolist()) == set((sizes > 1).nonzero().flatten().tolist())
    assert json.loads((out / "linattn.json").read_text())["options"] == {"sparse_cache": split["sizes"]}
    assert "shared by the 2 highest-scoring heads" in (out / "README.md").read_text()


@pytest.mark.slow  # ~10 s: the pipeline once
def test_the_training_text_trains_beside_the_samples_by_default(tiny, tmp_path, monkeypatch):
    """The end-to-end stage's training set holds the training text in --end-to-end-corpus-orders paragraph orders
    (8 by default), each cut as a sample is, and their copying sequences; 0 leaves the samples alone. A plan saved
    before the option existed meant 0: continuing it with 0 is not a run with other options."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages
    from linattn.linearized.arguments import CORPUS_ORDERS

    seen = []
    real = lm_stages.training_set

    def spy(plain, corpus, options, *rest):
        seen.append([len(ids) for ids in corpus])
        return real(plain, corpus, options, *rest)

    monkeypatch.setattr(lm_stages, "training_set", spy)
    text = tmp_path / "train.txt"  # paragraphs that differ, so that their orders differ
    text.write_text("\n\n".join(TEXT.replace("sand", word) for word in ("sand", "silt", "clay", "rock", "loam")))

    def with_text(out, *extra):
        return [str(text) if arg == str(tiny / "train.txt") else arg for arg in command(tiny, out, *extra)]

    out = tmp_path / "corpus"
    assert main(with_text(out, "--end-to-end-corpus-orders", "3")) == 0
    assert len(seen) == 1 and len(seen[0]) == 3 and all(0 < n <= 30 + lm_stages.PROMPT_TOKENS for n in seen[0])
    assert json.loads((out / "stages" / "plan.json").read_text())["options"]["end_to_end_corpus_orders"] == 3
    assert "the training text in 3 orders" in json.loads((out / "results.json").read_text())["stages"][
        "end_to_end"]["summary"]
    assert CORPUS_ORDERS == 8 and main(with_text(tmp_path / "default")) == 0 and len(seen[1]) == 8
    alone = tmp_path / "alone"
    assert main(with_text(alone, "--end-to-end-corpus-orders", "0")) == 0 and seen[2] == []
    plan = json.loads((alone / "stages" / "plan.json").read_text())  # as a plan from before the option looks
    del plan["options"]["end_to_end_corpus_orders"]
    (alone / "stages" / "plan.json").write_text(json.dumps(plan))
    assert main(with_text(alone, "--end-to-end-corpus-orders", "0")) == 0  # every stage done: nothing refused


@pytest.mark.slow  # ~10 s: the pipeline once
def test_the_copy_gap_reaches_the_training_set_and_is_planned(tiny, tmp_path, monkeypatch, capsys):
    """--end-to-end-copy-gap LOW HIGH: the end-to-end stage's options carry it, its copies are longer than a sample
    (samples joined) and trained on whole, the plan keeps it, and a rerun with another gap is refused; a plan from
    before the option existed meant 128-768, the gaps of that time, not today's default."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    seen, lengths = [], []
    real, fit = lm_stages.training_set, lm_stages.fit_end_to_end

    def spy(plain, corpus, options, *rest):
        seen.append(options.copy_gap)
        return real(plain, corpus, options, *rest)

    def fit_spy(model, tokenizer, texts, **kwargs):
        lengths.append((max(len(ids) for ids in texts), kwargs["max_tokens"]))
        return fit(model, tokenizer, texts, **kwargs)

    monkeypatch.setattr(lm_stages, "training_set", spy)
    monkeypatch.setattr(lm_stages, "fit_end_to_end", fit_spy)
    out = tmp_path / "gap"
    assert main(command(tiny, out, "--end-to-end-copy-gap", "40", "60")) == 0
    assert seen == [(40, 60)]
    longest, max_tokens = lengths[0]
    assert longest > 30 + lm_stages.PROMPT_TOKENS and max_tokens >= longest  # a joined copy, not cut
    plan_path = out / "stages" / "plan.json"
    assert json.loads(plan_path.read_text())["options"]["end_to_end_copy_gap"] == [40, 60]
    assert main(command(tiny, out, "--end-to-end-copy-gap", "40", "80")) == 2
    assert "other options (end_to_end_copy_gap)" in capsys.readouterr().err
    plan = json.loads(plan_path.read_text())
    del plan["options"]["end_to_end_copy_gap"]  # as a plan from before the option (when the gaps were 128-768) ...
    plan_path.write_text(json.dumps(plan))
    assert main(command(tiny, out)) == 2  # ... is not one of today's default gaps (128-3,072)
    assert "other options (end_to_end_copy_gap)" in capsys.readouterr().err
    assert main(command(tiny, out, "--end-to-end-copy-gap", "128", "768")) == 0  # every stage done: continued


def test_a_bad_copy_gap_is_refused_before_the_folder_is_made(tiny, tmp_path, monkeypatch, capsys):
    from linattn.cli import main

    monkeypatch.setattr(linearize_job, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "bad"
    assert main(command(tiny, out, "--end-to-end-copy-gap", "60", "40")) == 2
    assert "--end-to-end-copy-gap: need 1 ≤ LOW ≤ HIGH tokens, got 60 40" in capsys.readouterr().err
    assert not out.exists()
