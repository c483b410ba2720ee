"""`linattn linearize --student NAME`: the delta-rule students fitted, trained and measured in place, saved with
their gates, reloaded with the logits of the measured model, and resumed after an interruption (with the sparse
cache in place: test_linearize_students_cache.py)."""

from __future__ import annotations

import json

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


def test_the_default_student_is_the_gated_delta_rule_with_its_own_window():
    """The student measured best on SmolLM2 is the command's default, with its window of 192; an explicit
    --window is kept; the additive student keeps its 64."""
    import argparse

    from linattn.linearized.arguments import add_linearize_arguments
    from linattn.linearized.students import DEFAULT_STUDENT, STUDENTS

    parser = argparse.ArgumentParser()
    add_linearize_arguments(parser)
    args = parser.parse_args(["smollm2", "--out", "x"])
    assert args.student == DEFAULT_STUDENT == "gated-delta" and args.window is None
    assert STUDENTS["gated-delta"].window == STUDENTS["kda"].window == 192 and STUDENTS["hedgehog"].window == 64


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
    assert main(command(tiny, out, "--student", "gated-delta", "--budget", "30")) == 0
    assert [steps for steps, _, _ in fits[:2]] == [1, budget.FIT_PROBE_STEPS + 1]
    assert all(update == "delta" for _, update, _ in fits[:2])
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
