"""`linattn linearize --student gated-delta|kda --sparse-cache N`: the delta-rule students fitted layer by layer and
trained end to end with the sparse cache in place (spied on the very calls), saved with the cache's sizes, reloaded
with the logits of the measured model, generating as they recompute, resumed after an interruption, budgeted."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import SparseCache, hf  # noqa: E402
from linattn.linearized import load_linearized  # noqa: E402
from linattn.linearized.caches import folder_setting  # noqa: E402
from test_linearize_job import command, events, tiny  # noqa: E402, F401  (tiny: a fixture)
from test_linearized import TEXT  # noqa: E402

UNIFORM = ("--sparse-cache", "4", "--sparse-cache-linear-weight", "0.5")
RETRIEVAL = ("--sparse-cache", "4", "--sparse-cache-heads", "retrieval", "--sparse-cache-floor", "1",
             "--end-to-end-tokens", "120")  # samples as long as a passage, the gap and the repeat at W = 8
PROMPT = TEXT[:48]  # past the window (8), a sink and a block (8): the cache holds pairs when decoding starts


def calibration_calls(monkeypatch):
    """([sparse_cache of each timed fit], [(sparse_cache, update) of each hf.linearize call while calibrating]),
    filled as a run calibrates its budget; the run stops (KeyboardInterrupt) once its plan is written."""
    from linattn.linearized import budget
    from linattn.linearized import job as linearize_job

    fits, linearized = [], []
    real_fit, real_linearize, real_calibrate = budget.fit_student, hf.linearize, budget.calibrate

    def spy_fit(*args, **kwargs):
        fits.append(kwargs.get("sparse_cache"))
        return real_fit(*args, **kwargs)

    def spy_linearize(model, maps, gates=None, **kwargs):
        linearized.append((kwargs.get("sparse_cache"), kwargs.get("update")))
        return real_linearize(model, maps, gates=gates, **kwargs)

    def spy_calibrate(*args, **kwargs):
        monkeypatch.setattr(hf, "linearize", spy_linearize)
        try:
            return real_calibrate(*args, **kwargs)
        finally:
            monkeypatch.setattr(hf, "linearize", real_linearize)

    monkeypatch.setattr(budget, "fit_student", spy_fit)
    monkeypatch.setattr(budget, "calibrate", spy_calibrate)
    monkeypatch.setattr(linearize_job.Job, "run", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    return fits, linearized


def size_of(cache):
    """A cache's per-head sizes as a tuple, or its one size: from a SparseCache or an option as saved (an int)."""
    if isinstance(cache, int):
        return cache
    return cache.size if isinstance(cache, SparseCache) else tuple(cache)


def calls_while_fitting(monkeypatch):
    """(update, sparse_cache, grad enabled) of every linear_attention call the layer-wise fit makes."""
    from linattn.train import student

    seen = []
    real = student.linear_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("update"), kwargs.get("sparse_cache"), torch.is_grad_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(student, "linear_attention", spy)
    return seen


def calls_while_training(monkeypatch):
    """(update, sparse_cache, β takes a gradient) of every attention call while the end-to-end stage trains (the
    held-out evaluations, without gradients, included)."""
    from linattn.evaluate import lm_stages

    seen, training = [], []
    real_call, real_fit = hf.linear_attention, lm_stages.fit_end_to_end

    def call(*args, **kwargs):
        if training:
            beta = kwargs.get("beta")
            seen.append((kwargs.get("update"), kwargs.get("sparse_cache"),
                         isinstance(beta, torch.Tensor) and beta.requires_grad))
        return real_call(*args, **kwargs)

    def fit(*args, **kwargs):
        training.append(1)
        try:
            return real_fit(*args, **kwargs)
        finally:
            training.clear()

    monkeypatch.setattr(hf, "linear_attention", call)
    monkeypatch.setattr(lm_stages, "fit_end_to_end", fit)
    return seen


def keep_measured(monkeypatch):
    """The model as the measuring stage left it (linearized as its row was measured), in a dict."""
    from linattn.linearized import job as linearize_job

    measured = {}
    real = linearize_job.Job.measure

    def measure(self, *args):
        result = real(self, *args)
        measured["model"] = self.model
        return result

    monkeypatch.setattr(linearize_job.Job, "measure", measure)
    return measured


def expected_sizes(out, heads):
    """The cache's sizes per layer the run chose: read back from the split, or N for every layer."""
    if heads == "retrieval":
        return [tuple(row) for row in json.loads((out / "stages" / "cache_sizes.json").read_text())["sizes"]]
    return [4, 4]


@pytest.mark.slow  # ~10 s each: the pipeline once, then generation from the folder
@pytest.mark.parametrize("heads", ["uniform", "retrieval"])
@pytest.mark.parametrize("name, gate", [("gated-delta", "token"), ("kda", "feature")])
def test_a_delta_student_with_a_cache_is_trained_in_place_saved_and_reloaded(tiny, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                                             name, gate, heads):
    from linattn.cli import main
    from linattn.decode import SparseComposedDecodeStep

    fitting, training = calls_while_fitting(monkeypatch), calls_while_training(monkeypatch)
    measured = keep_measured(monkeypatch)
    out = tmp_path / f"{name}-{heads}"
    assert main(command(tiny, out, "--student", name, *(UNIFORM if heads == "uniform" else RETRIEVAL))) == 0
    sizes = expected_sizes(out, heads)
    # the fit: every layer's call has the delta rule and that layer's cache, with gradients (2 steps × 2 layers)
    assert [(update, size_of(cache), grad) for update, cache, grad in fitting] == [("delta", sizes[i % 2], True)
                                                                                  for i in range(4)]
    if heads == "uniform":
        assert all(cache.linear_weight == 0.5 for _, cache, _ in fitting)
    # the end-to-end stage: every attention call (layer after layer) too, β from the gates taking gradients
    assert training and [(update, size_of(cache)) for update, cache, _ in training] == [
        ("delta", sizes[i % 2]) for i in range(len(training))]
    assert any(grad for _, _, grad in training)
    entry = json.loads((out / "linattn.json").read_text())
    saved = {"size": 4, "linear_weight": 0.5} if heads == "uniform" else [list(row) for row in sizes]
    assert entry["options"] == {"sparse_cache": saved, "update": "delta"} and entry["gates"]["config"]["gate"] == gate
    results = json.loads((out / "results.json").read_text())
    assert results["student"] == name and results["stages"]["fit"]["sparse_cache"] is True
    assert results["stages"]["end_to_end"]["sparse_cache"] == 4
    card = (out / "README.md").read_text()
    assert "sparse exact cache of 4" in card and "the window and the sparse cache in place" in card
    assert "the maps and gates trained end to end" in card
    # reloaded: the same maps, gates, cache and operations as the measured row, in one process
    model, tokenizer = load_linearized(out)
    modules = hf.attention_modules(model)
    assert [size_of(getattr(module, hf.OPTIONS_ATTRIBUTE)["sparse_cache"]) for module in modules] == sizes
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        expected = measured["model"](input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, expected)
    # the benchmarks' reading of a folder (its maps, options and gates; the cache theirs to set) is the same model
    maps, options, _, _ = folder_setting(out)
    hf.linearize(model, maps, **options, sparse_cache=entry["options"]["sparse_cache"])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)
    # generation: the lean step from the prefill's state, against every token recomputed (one call each); the two
    # sum in different orders in fp32 (the chunked form's blocks against one token's update), so the logits agree
    # to rounding: 1e-4, as the op's own test of the step through transformers
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    layers = cached.past_key_values.layers
    assert all(isinstance(layer.stepper, SparseComposedDecodeStep) for layer in layers)
    assert all(int((layer.state.cache.packed_positions >= 0).sum()) > 0 for layer in layers)  # pairs are cached
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    assert tokenizer.decode(recomputed.sequences[0, prompt.shape[1]:]) in capsys.readouterr().out


@pytest.mark.slow  # ~15 s: the pipeline interrupted in the end-to-end stage, then run again
def test_a_delta_student_with_a_split_cache_resumes_after_the_fit(tiny, tmp_path, monkeypatch):  # noqa: F811
    """Interrupted in the end-to-end stage, a rerun skips the fit, reads the split back (never scored again) and
    trains from the fit's saved maps and gates with the split cache in place."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages
    from linattn.linearized import job as linearize_job
    from linattn.linearized import students

    out = tmp_path / "resumed"
    real = lm_stages.fit_end_to_end
    monkeypatch.setattr(lm_stages, "fit_end_to_end", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out, "--student", "kda", *RETRIEVAL))
    done = json.loads((out / "stages" / "fit.done").read_text())
    assert done["sparse_cache"] is True and not (out / "stages" / "end_to_end.done").exists()
    fitted_gates = students.load_stage_gates(out / "stages", done["gates"])
    sizes = expected_sizes(out, "retrieval")
    fits, started = [], {}
    monkeypatch.setattr(students, "fit_student", lambda *a, **k: fits.append(1))
    monkeypatch.setattr(linearize_job, "cache_split", None)  # the split is read back, not scored again

    def spy(model, *args, **kwargs):
        modules = hf.attention_modules(model)
        started["bias"] = modules[0].linattn_gates.beta_bias.detach().clone()
        started["sizes"] = [size_of(getattr(module, hf.OPTIONS_ATTRIBUTE)["sparse_cache"]) for module in modules]
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    assert main(command(tiny, out, "--student", "kda", *RETRIEVAL)) == 0
    assert not fits and ("fit", "skipped (finished before)") in events(out)
    assert torch.equal(started["bias"], fitted_gates[0].beta_bias.detach())  # the fit's gates, read back
    assert started["sizes"] == sizes
    assert json.loads((out / "linattn.json").read_text())["options"]["sparse_cache"] == [list(row) for row in sizes]


def test_a_budget_times_the_delta_student_with_its_cache(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--budget with a delta student and a cache: the timed fits and the timed end-to-end step have the cache in
    place (N pairs per head), and so does the timed forward pass of the linearized row. (The run stops once the
    plan is written: a budget of minutes plans as many steps as fit, which is no test's business here.)"""
    from linattn.cli import main

    fits, linearized = calibration_calls(monkeypatch)
    out = tmp_path / "budgeted"
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out, "--student", "kda", "--sparse-cache", "4", "--budget", "30", "--fit-steps", "10"))
    assert fits == [SparseCache(size=4)] * 3  # the fits of 1 step (twice) and 9 steps
    assert linearized == [(4, "delta")]  # the end-to-end step and the linearized row's forward pass
    plan = json.loads((out / "stages" / "plan.json").read_text())
    assert plan["options"]["sparse_cache"] == 4 and plan["costs"]["measure"] > 0


def test_a_budget_times_the_end_to_end_step_at_its_sequences_mean_length(tiny, tmp_path, monkeypatch):  # noqa: F811
    """The end-to-end step is timed on a sequence as long as the mean of a sample (--end-to-end-tokens 30 and the
    prompt's room) and its copying sequence (their mean length, set to 10 here), in the teacher's two timed passes
    and the student's two forward and backward passes."""
    from linattn.cli import main
    from linattn.linearized import budget

    calibration_calls(monkeypatch)
    monkeypatch.setattr(budget, "mean_copy_length", lambda gap: 10.0)
    lengths = []
    real_forward = torch.nn.Module.__call__

    def spy(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and type(self).__name__.endswith("ForCausalLM"):
            lengths.append((ids.shape[-1], torch.is_grad_enabled()))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", spy)
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, tmp_path / "budgeted", "--student", "gated-delta", "--budget", "30", "--fit-steps", "10"))
    step = round((30 + budget.PROMPT_TOKENS + 10) / 2)
    assert [length for length, grad in lengths if grad] == [step, step]
    assert lengths.count((step, False)) == 2  # the teacher's passes


def test_a_budget_times_a_retrieval_split_with_the_split_made_on_the_training_text(tiny, tmp_path,  # noqa: F811
                                                                                monkeypatch):
    """--budget with --sparse-cache-heads retrieval: the timed fits, the end-to-end step and the linearized row have
    a split in place, the one made on the training text in 8 orders (the run's own comes later, on its samples): a
    layer's largest budget sets the training form's slots, which a uniform cache of as many pairs would not show."""
    from linattn.cli import main
    from linattn.evaluate.models import load_model
    from linattn.linearized.caches import text_split

    fits, linearized = calibration_calls(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, tmp_path / "budgeted", "--student", "gated-delta", *RETRIEVAL, "--sparse-cache-top", "2",
                     "--budget", "30", "--fit-steps", "10"))
    model, tokenizer, _ = load_model(str(tiny), causal_lm=True)
    wanted = [cache.size for cache in text_split(model, tokenizer, (tiny / "train.txt").read_text(), 8, 1, 4, 1, 2)]
    assert len(set(wanted)) > 1  # the split differs by layer: not a uniform cache in disguise
    assert len(fits) == 3 and all([cache.size for cache in fit] == wanted for fit in fits)
    assert len(linearized) == 1 and [cache.size for cache in linearized[0][0]] == wanted


def test_bad_cache_options_with_a_delta_student_are_refused(tiny, tmp_path, capsys):  # noqa: F811
    """Each refused before any stage, leaving no plan behind: the corrected run into the same folder is not taken
    for a run with other options."""
    from linattn.cli import main

    out = tmp_path / "refused"
    for extra, message in ((("--sparse-cache", "4", "--sparse-cache-floor", "1"), "--sparse-cache-floor"),
                           (("--sparse-cache-heads", "retrieval"), "--sparse-cache-heads retrieval"),
                           (("--sparse-cache", "4", "--sparse-cache-top", "2"), "--sparse-cache-top: only with"),
                           (("--sparse-cache", "4", "--sparse-cache-heads", "retrieval", "--sparse-cache-top", "0"),
                            "--sparse-cache-top: need K ≥ 1"),
                           (("--sparse-cache-linear-weight", "0.5"), "--sparse-cache-linear-weight"),
                           (("--sparse-cache", "-1"), "--sparse-cache: need pairs per head")):
        assert main(command(tiny, out, "--student", "gated-delta", *extra)) == 2
        assert message in capsys.readouterr().err
    assert not (out / "stages" / "plan.json").exists()


@pytest.mark.slow  # ~15 s: two runs of the pipeline on the tiny model
def test_a_run_continues_another_runs_student_with_other_copying_gaps(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--init-from RUN: no fit and no split; the end-to-end stage starts from RUN's trained maps and gates, with RUN's
    samples and cache sizes, trains with this run's options, and the folder is written and measured as usual."""
    from safetensors.torch import load_file

    from linattn.cli import main
    from linattn.evaluate import lm_stages
    from linattn.linearized import job as linearize_job
    from linattn.linearized import students

    first, second = tmp_path / "first", tmp_path / "second"
    assert main(command(tiny, first, "--student", "gated-delta", *RETRIEVAL)) == 0
    done = json.loads((first / "stages" / "end_to_end.done").read_text())
    trained_gates = students.load_stage_gates(first / "stages", done["gates"])
    fits, started, real = [], {}, lm_stages.fit_end_to_end
    monkeypatch.setattr(students, "fit_student", lambda *a, **k: fits.append(1))
    monkeypatch.setattr(linearize_job, "cache_split", None)  # the split is RUN's, not scored again

    def spy(model, *args, **kwargs):
        modules = hf.attention_modules(model)
        started["bias"] = modules[0].linattn_gates.beta_bias.detach().clone()
        started["sizes"] = [size_of(getattr(module, hf.OPTIONS_ATTRIBUTE)["sparse_cache"]) for module in modules]
        started["steps"] = kwargs.get("steps")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    assert main(command(tiny, second, "--student", "gated-delta", *RETRIEVAL, "--init-from", str(first),
                        "--end-to-end-copy-gap", "40", "60")) == 0
    assert not fits
    assert torch.equal(started["bias"], trained_gates[0].beta_bias.detach())  # RUN's trained gates
    assert started["sizes"] == expected_sizes(first, "retrieval")
    for name in ("samples.json", "cache_sizes.json"):
        assert (second / "stages" / name).read_bytes() == (first / "stages" / name).read_bytes()
    fit = json.loads((second / "stages" / "fit.done").read_text())
    assert fit["from"] == str(first) and fit["summary"].startswith(f"taken from the run in {first}")
    taken, trained = (load_file(str(path)) for path in (second / "stages" / "fit.safetensors",
                                                          first / "stages" / "end_to_end.safetensors"))
    assert taken.keys() == trained.keys() and all(torch.equal(taken[key], trained[key]) for key in taken)
    assert json.loads((second / "stages" / "end_to_end.done").read_text())["copy_gap"] == [40, 60]
    assert (second / "linattn.json").is_file() and json.loads((second / "results.json").read_text())["rows"]


def test_init_from_is_refused_where_it_cannot_continue(tiny, tmp_path, capsys):  # noqa: F811
    from linattn.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(command(tiny, tmp_path / "a", *RETRIEVAL, "--init-from", str(empty))) != 0
    assert "holds no finished end-to-end or long_gaps stage" in capsys.readouterr().err
    assert main(command(tiny, tmp_path / "b", *RETRIEVAL, "--init-from", str(empty), "--budget", "5")) != 0
    assert "give --end-to-end-steps instead" in capsys.readouterr().err
    stages = tmp_path / "other" / "stages"
    stages.mkdir(parents=True)
    (stages / "end_to_end.done").write_text("{}")
    (stages / "plan.json").write_text(json.dumps({"options": {"model": str(tiny), "student": "gated-delta",
                                                              "window": 16}}))
    assert main(command(tiny, tmp_path / "c", *RETRIEVAL, "--init-from", str(tmp_path / "other"))) != 0
    assert "was made with other" in capsys.readouterr().err
