"""`linattn linearize --student NAME`: the delta-rule students fitted, trained and measured in place, saved with
their gates, reloaded with the logits of the measured model, and resumed after an interruption (with the sparse
cache in place: test_linearize_students_cache.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import hf  # noqa: E402
from linattn.linearized import load_linearized  # noqa: E402
from test_linearize_job import command, events, tiny  # noqa: E402, F401  (tiny: a fixture)
from test_linearized import TEXT  # noqa: E402


def gates_while_training(monkeypatch):
    """(gate kind, update) of every attention layer when the end-to-end stage starts training."""
    from linattn.evaluate import lm_stages

    seen = []
    real = lm_stages.fit_end_to_end

    def spy(model, *args, **kwargs):
        seen.extend((getattr(module, hf.GATES_ATTRIBUTE).gate, getattr(module, hf.OPTIONS_ATTRIBUTE)["update"])
                    for module in hf.attention_modules(model))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    return seen


@pytest.mark.parametrize("name, gate", [("gated-delta", "token"), ("kda", "feature")])
def test_a_delta_student_is_trained_in_place_saved_and_reloaded(tiny, tmp_path, monkeypatch, name, gate):  # noqa: F811
    from linattn.cli import main
    from linattn.linearized import job as linearize_job

    seen = gates_while_training(monkeypatch)
    out = tmp_path / name
    measured = {}
    real_measure = linearize_job.Job.measure

    def keep_model(self, *args):
        result = real_measure(self, *args)
        measured["model"] = self.model  # linearized as the measured row was
        return result

    monkeypatch.setattr(linearize_job.Job, "measure", keep_model)
    assert main(command(tiny, out, "--student", name)) == 0
    assert seen and all(item == (gate, "delta") for item in seen)
    entry = json.loads((out / "linattn.json").read_text())
    assert entry["options"]["update"] == "delta" and entry["gates"]["config"]["gate"] == gate
    results = json.loads((out / "results.json").read_text())
    assert results["student"] == name and results["stages"]["fit"]["gates"]["file"] == "fit_gates.safetensors"
    reloaded, tokenizer = load_linearized(out)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        ours, theirs = reloaded(input_ids=ids).logits, measured["model"](input_ids=ids).logits
    assert torch.equal(ours, theirs)  # the same weights, maps, gates and operations in one process


def test_a_delta_student_resumes_after_the_fit(tiny, tmp_path, monkeypatch):  # noqa: F811
    """Interrupted in the end-to-end stage, a rerun skips the fit and trains from the fit's saved maps and gates."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages
    from linattn.linearized import students

    out = tmp_path / "resumed"
    real = lm_stages.fit_end_to_end

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm_stages, "fit_end_to_end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out, "--student", "gated-delta"))
    fitted_gates = students.load_stage_gates(out / "stages", json.loads((out / "stages" / "fit.done").read_text())
                                             ["gates"])
    monkeypatch.setattr(lm_stages, "fit_end_to_end", real)
    fits = []
    monkeypatch.setattr(students, "fit_student", lambda *a, **k: fits.append(1))
    started = {}

    def spy(model, *args, **kwargs):
        started["bias"] = hf.attention_modules(model)[0].linattn_gates.beta_bias.detach().clone()
        return real(model, *args, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    assert main(command(tiny, out, "--student", "gated-delta")) == 0
    assert not fits and ("fit", "skipped (finished before)") in events(out)
    assert torch.equal(started["bias"], fitted_gates[0].beta_bias.detach())  # the fit's gates, read back


def test_an_unknown_student_is_refused(tiny, tmp_path):  # noqa: F811
    from linattn.cli import main

    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(command(tiny, tmp_path / "b", "--student", "rwkv"))


def test_the_default_student_is_the_gated_delta_rule_with_its_own_window_and_cache():
    """The student measured best on SmolLM2 is the command's default, with the shipped folder's exact part: a window
    of 64 and a cache of 2·64 pairs per head on average split by retrieval score among the 20 top heads, no floor;
    what is given is kept (a --sparse-cache N given keeps the uniform spread); the additive student has no cache."""
    import argparse

    from linattn.linearized.arguments import add_linearize_arguments
    from linattn.linearized.students import DEFAULT_STUDENT, STUDENTS, resolve_exact_part

    parser = argparse.ArgumentParser()
    add_linearize_arguments(parser)

    def resolved(*extra):
        args = parser.parse_args(["smollm2", "--out", "x", *extra])
        default_top = resolve_exact_part(args, STUDENTS[args.student])
        return (args.window, args.sparse_cache, args.sparse_cache_heads, args.sparse_cache_floor,
                args.sparse_cache_top, default_top)

    args = parser.parse_args(["smollm2", "--out", "x"])
    assert args.student == DEFAULT_STUDENT == "gated-delta" and args.window is None and args.sparse_cache is None
    assert resolved() == (64, 128, "retrieval", 0, 20, True)
    assert resolved("--student", "kda") == (64, 128, "retrieval", 0, 20, True)
    assert resolved("--window", "192") == (192, 384, "retrieval", 0, 20, True)
    assert resolved("--sparse-cache-top", "5") == (64, 128, "retrieval", 0, 5, False)
    assert resolved("--sparse-cache-floor", "8") == (64, 128, "retrieval", 8, 20, True)
    assert resolved("--sparse-cache-heads", "uniform") == (64, 128, "uniform", None, None, False)
    assert resolved("--sparse-cache", "0") == (64, 0, "uniform", None, None, False)
    assert resolved("--sparse-cache", "32") == (64, 32, "uniform", None, None, False)
    assert resolved("--student", "hedgehog") == (64, 0, "uniform", None, None, False)
    assert resolved("--student", "hedgehog", "--sparse-cache", "32") == (64, 32, "uniform", None, None, False)


@pytest.mark.slow  # ~20 s: the pipeline once with the default exact part
def test_the_default_exact_part_is_split_trained_measured_beside_both_baselines_and_saved(tiny, tmp_path):  # noqa: F811
    """With no window or cache given, a delta-rule student gets its own: the cache of 2·W per head on average given
    to the top 20 heads, here every head of the tiny model (8), no floor. The measured rows are the original, the
    softmax window of W + 2W keys, the same student with those pairs in its window instead, and the linearized
    model (last); the card explains the third; the folder saves the split."""
    from linattn.cli import main
    from test_linearize_job import FAST

    out = tmp_path / "default"
    full = command(tiny, out)
    at = full.index("--sparse-cache")
    base = full[:at] + full[at + 2:]  # FAST's "no cache" dropped
    assert full[at + 1] == "0" and "--sparse-cache" not in base and "--window" in base  # W = 8 as FAST says
    assert main([*base, "--student", "gated-delta", "--end-to-end-tokens", "120"]) == 0
    plan = json.loads((out / "stages" / "plan.json").read_text())["options"]
    assert (plan["sparse_cache"], plan["sparse_cache_heads"], plan["sparse_cache_floor"],
            plan["sparse_cache_top"]) == (16, "retrieval", 0, 20)
    split = json.loads((out / "stages" / "cache_sizes.json").read_text())
    sizes = torch.tensor(split["sizes"])
    assert split["top"] == sizes.numel() == 8 and int(sizes.sum()) == 16 * 8  # every head: the model has 8
    results = json.loads((out / "results.json").read_text())
    names = [row["name"] for row in results["rows"]]
    assert names == ["original (softmax)", "window 24 + 1 sinks (softmax)",
                     "the same student, window 24 + 1 sinks, no cache", "linearized"]
    wider, linear = results["rows"][2], results["rows"][3]
    assert math.isfinite(wider["perplexity"]) and wider["perplexity"] != linear["perplexity"]
    assert "cache's pairs in its window instead" in (out / "README.md").read_text()
    assert json.loads((out / "linattn.json").read_text())["options"]["sparse_cache"] == split["sizes"]
    model, tokenizer = load_linearized(out)  # the measured (last) row's model is the folder's
    with torch.no_grad():
        ids = torch.tensor([tokenizer(TEXT)["input_ids"][:60]])
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert FAST[-2:] == ["--sparse-cache", "0"]


def test_a_budget_times_the_delta_students_own_fit_and_training_step(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--budget with a delta student calibrates that student: its layer-wise fit (1 and 9 steps) and an end-to-end
    step with its gates taking gradients; the planned run then finishes with the gates saved."""
    from linattn.cli import main
    from linattn.linearized import budget

    fits, trained = [], []
    real_fit = budget.fit_student

    def spy_fit(capture, maps, gates, options, *, steps, **kwargs):
        fits.append((steps, options.get("update"), len(gates)))
        return real_fit(capture, maps, gates, options, steps=steps, **kwargs)

    reached, real_calibrate, real_linearize = [], budget.calibrate, hf.linearize

    def spy_linearize(model, maps, gates=None, **kwargs):  # hooks on the gates: does a backward reach them?
        for module in gates or []:
            for param in module.parameters():
                param.register_hook(lambda grad: reached.append(grad.abs().sum().item()))
        return real_linearize(model, maps, gates=gates, **kwargs)

    def spy_calibrate(*args, **kwargs):
        monkeypatch.setattr(hf, "linearize", spy_linearize)
        try:
            costs = real_calibrate(*args, **kwargs)
        finally:
            monkeypatch.setattr(hf, "linearize", real_linearize)
        trained.append(list(reached))
        return costs

    monkeypatch.setattr(budget, "fit_student", spy_fit)
    monkeypatch.setattr(budget, "calibrate", spy_calibrate)
    out = tmp_path / "budgeted"
    assert main(command(tiny, out, "--student", "gated-delta", "--budget", "30", "--fit-steps", "10")) == 0
    # the 1-step fit twice (a first call can pay one-time set-up), then the longer one
    assert [steps for steps, _, _ in fits[:3]] == [1, 1, budget.FIT_PROBE_STEPS + 1]
    assert all(update == "delta" for _, update, _ in fits[:3])
    assert trained and trained[0] and max(trained[0]) > 0  # the timed backward reached the gates
    plan = json.loads((out / "stages" / "plan.json").read_text())
    assert plan["fit_steps"] >= budget.MIN_FIT_STEPS and plan["options"]["student"] == "gated-delta"
    assert json.loads((out / "linattn.json").read_text())["gates"]["config"]["gate"] == "token"


def test_the_budget_counts_the_repeats_at_every_gap():
    """The measuring stage reads each --repeat-gaps probe too: its tokens enter the estimate (a run of the default
    student measured its stage in 56 min against an estimate of 42 made without them)."""
    from linattn.evaluate.lm_config import ProbeOptions
    from linattn.linearized.budget import _probe_tokens

    probes = ProbeOptions(passage_tokens=128, gap_tokens=512, repeat_trials=4, passkey_lengths=(1024,),
                          passkey_trials=2)
    config = type("Config", (), {"probes": probes})()
    plain = _probe_tokens(config, 1000)
    assert plain == 1000 + 4 * (256 + 512) + 2 * (1024 + 64)
    assert _probe_tokens(config, 1000, (1536, 3072)) == plain + 4 * (256 + 1536) + 4 * (256 + 3072)
