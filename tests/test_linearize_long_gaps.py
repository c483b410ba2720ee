"""``linattn linearize``'s long_gaps stage: the end-to-end training continued on the samples' copying sequences
alone, at --end-to-end-long-gap, checkpointed and resumed as the other stages; and --budget's share of it."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from linattn.errors import LinearAttentionError  # noqa: E402
from linattn.feature_maps.fitted import load_feature_maps  # noqa: E402
from linattn.linearized import job as linearize_job  # noqa: E402
from linattn.linearized.budget import LONG_SHARE, MAX_STEPS, plan_steps  # noqa: E402
from test_linearize_job import FAST, counted, events, planned_80, tiny  # noqa: E402,F401

# FAST without its "--end-to-end-long-steps 0"; samples long enough for copies with the passage (up to 192
# tokens) and a gap of 30-40 tokens (two training samples joined)
AT = FAST.index("--end-to-end-long-steps")
BASE = [*FAST[:AT], *FAST[AT + 2:], "--end-to-end-tokens", "120"]
LONG = ["--end-to-end-long-steps", "2", "--end-to-end-long-gap", "30", "40"]
COSTS = {"calibration": 10.0, "fit_fixed": 20.0, "measure": 30.0, "sampling_batch": 40.0, "fit_step": 1.0,
         "end_to_end_step": 2.0, "long_step": 4.0}


def command(model, out, *extra):
    return ["linearize", str(model), str(model / "train.txt"), "--heldout", str(model / "heldout.txt"), "--out",
            str(out), *BASE, *extra]


def flat(maps):
    return torch.cat([param.detach().reshape(-1) for module in maps.maps for param in module.parameters()])


@pytest.mark.slow  # ~20 s: the pipeline with both training stages on a tiny Llama, then rerun
def test_the_long_gaps_stage_trains_on_from_the_end_to_end_stage(tiny, tmp_path, monkeypatch):  # noqa: F811
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    out = tmp_path / "lin"
    seen = []
    real = linearize_job.train_end_to_end

    def spy(model, tokenizer, fitted, config, *args, **kwargs):
        seen.append((flat(fitted).clone(), config.end_to_end))
        return real(model, tokenizer, fitted, config, *args, **kwargs)

    monkeypatch.setattr(linearize_job, "train_end_to_end", spy)
    copies = []
    real_copies = lm_stages.copying_sequences

    def spy_copies(sources, **kwargs):
        made = real_copies(sources, **kwargs)
        copies.append((kwargs["gap"], made))
        return made

    monkeypatch.setattr(lm_stages, "copying_sequences", spy_copies)
    assert main(command(tiny, out, *LONG)) == 0
    stages = out / "stages"
    assert [options.steps for _, options in seen] == [3, 2]
    first, long = seen[0][1], seen[1][1]
    assert first.copy_gap == (128, 3072) and long.copy_gap == (30, 40)
    assert first.corpus_orders == 8 and long.corpus_orders == 0  # the samples alone
    # the long gaps start where the end-to-end stage ended, and what is measured and saved is where they ended
    assert torch.equal(seen[1][0], flat(load_feature_maps(str(stages / "end_to_end.safetensors"))))
    final = flat(load_feature_maps(str(stages / "long_gaps.safetensors")))
    assert not torch.equal(final, seen[1][0])
    assert torch.equal(flat(load_feature_maps(str(out / "maps.safetensors"))), final)
    # the long stage's copying sequences were made with its gaps
    assert (30, 40) in [gap for gap, made in copies if made]
    result = json.loads((out / "results.json").read_text())
    assert list(result["stages"]) == ["fit", "end_to_end", "long_gaps"]
    assert result["stages"]["long_gaps"]["copy_gap"] == [30, 40]
    assert result["stages"]["long_gaps"]["corpus_sequences"] == 0
    assert result["stages"]["long_gaps"]["summary"].startswith("then the maps trained end to end, 2 steps")
    assert "- long_gaps: then the maps" in (out / "README.md").read_text()
    plan = json.loads((stages / "plan.json").read_text())
    assert plan["end_to_end_long_steps"] == 2 and plan["options"]["end_to_end_long_gap"] == [30, 40]
    # a rerun finds both training stages finished
    calls: dict[str, int] = {}
    counted(monkeypatch, linearize_job, "train_end_to_end", calls, "train")
    (stages / "measure.done").unlink()
    assert main(command(tiny, out, *LONG)) == 0
    assert calls == {"train": 0}
    assert ("long_gaps", "skipped (finished before)") in events(out)
    assert torch.equal(flat(load_feature_maps(str(out / "maps.safetensors"))), final)


@pytest.mark.slow  # ~15 s: two short runs on a tiny Llama
def test_init_from_takes_the_source_after_its_long_gaps(tiny, tmp_path):  # noqa: F811
    from linattn.cli import main

    source, out = tmp_path / "source", tmp_path / "more"
    assert main(command(tiny, source, *LONG)) == 0
    assert main(command(tiny, out, "--init-from", str(source), "--end-to-end-steps", "0", *LONG)) == 0
    taken = flat(load_feature_maps(str(out / "stages" / "fit.safetensors")))
    assert torch.equal(taken, flat(load_feature_maps(str(source / "stages" / "long_gaps.safetensors"))))
    assert not (out / "stages" / "end_to_end.done").exists() and (out / "stages" / "long_gaps.done").is_file()
    # a run that continued another has a long_gaps stage alone: it can be continued in turn
    again = tmp_path / "again"
    assert main(command(tiny, again, "--init-from", str(out), "--end-to-end-steps", "0", *LONG)) == 0
    taken = flat(load_feature_maps(str(again / "stages" / "fit.safetensors")))
    assert torch.equal(taken, flat(load_feature_maps(str(out / "stages" / "long_gaps.safetensors"))))


@pytest.mark.slow  # ~20 s: the pipeline with both training stages on a tiny Llama, then a rerun refused
def test_key_sequences_join_the_long_gaps_stage_alone(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--end-to-end-keys N: N key-retrieval sequences of the training text (and 2 held out) join the long_gaps
    stage's training set with their weighted positions; the end-to-end stage has none. The plan keeps the option."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    seen = []
    real = lm_stages.fit_end_to_end

    def spy(model, tokenizer, texts, **kwargs):
        seen.append((list(texts), kwargs["weights"], kwargs["held_out"]))
        return real(model, tokenizer, texts, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    out = tmp_path / "keys"
    keys = ["--end-to-end-keys", "3", "--end-to-end-key-filler", "20", "40"]
    assert main(command(tiny, out, *LONG, *keys)) == 0
    (first, first_weights, first_held), (long, weights, held) = seen
    # the long stage: its samples and copies, then 3 key sequences, then the held-out ones (2 of them keys)
    assert len(long) == len(weights)
    marked = [w for w in weights if w is not None and float(w.max()) > 1]
    assert len(marked) == 5  # 3 trained on, 2 held out
    assert sum(1 for w in weights[-held:] if w is not None and float(w.max()) > 1) == 2  # held out: 2 keys ...
    assert held - 2 >= first_held and all(float(weights[-i].max()) > 1 for i in (1, 2))  # ... and the samples
    for ids, weight in zip(long, weights, strict=True):
        if weight is not None and float(weight.max()) > 1:
            assert ids.shape == weight.shape and 20 <= int((weight == 1).sum()) - 1
    # the first stage trains on no key sequence
    assert first_weights is None or not any(w is not None and float(w.max()) > 1 for w in first_weights)
    result = json.loads((out / "results.json").read_text())
    assert result["stages"]["long_gaps"]["key_sequences"] == 5
    assert result["stages"]["end_to_end"]["key_sequences"] == 0
    assert "and 3 key-retrieval sequences of the training text (fillers of 20–40 tokens" in result["stages"][
        "long_gaps"]["summary"]
    options = json.loads((out / "stages" / "plan.json").read_text())["options"]
    assert options["end_to_end_keys"] == 3 and options["end_to_end_key_filler"] == [20, 40]
    assert main(command(tiny, out, *LONG, "--end-to-end-keys", "4", "--end-to-end-key-filler", "20", "40")) == 2
    assert "other options (end_to_end_keys)" in capsys.readouterr().err


@pytest.mark.slow  # ~25 s: a run with key sequences on a tiny Llama, then one continuing it
def test_a_continued_run_trains_on_new_key_sequences_and_holds_out_the_same(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--init-from a run that trained on keys: the next draw of training keys (none of the source's again), the
    same held-out keys in both runs, and none of them ever trained on."""
    from linattn.cli import main
    from linattn.evaluate import lm_stages

    seen = []
    real = lm_stages.fit_end_to_end

    def spy(model, tokenizer, texts, **kwargs):
        weights, held = kwargs["weights"] or [None] * len(texts), kwargs["held_out"]
        keyed = [tuple(ids.tolist()) for ids, w in zip(texts, weights, strict=True)
                 if w is not None and float(w.max()) > 1]
        held_keys = [tuple(ids.tolist()) for ids, w in zip(texts[-held:], weights[-held:], strict=True)
                     if w is not None and float(w.max()) > 1]
        seen.append((set(keyed) - set(held_keys), set(held_keys)))
        return real(model, tokenizer, texts, **kwargs)

    monkeypatch.setattr(lm_stages, "fit_end_to_end", spy)
    keys = ["--end-to-end-keys", "3", "--end-to-end-key-filler", "20", "40"]
    source, more = tmp_path / "source", tmp_path / "more"
    assert main(command(tiny, source, *LONG, *keys)) == 0
    assert main(command(tiny, more, "--init-from", str(source), "--end-to-end-steps", "0", *LONG, *keys)) == 0
    (first_trained, first_held), (second_trained, second_held) = [entry for entry in seen if entry[0]]
    assert len(first_trained) == len(second_trained) == 3 and len(first_held) == 2
    assert not first_trained & second_trained  # new keys
    assert first_held == second_held and not (first_held & (first_trained | second_trained))
    draws = [json.loads((out / "results.json").read_text())["stages"]["long_gaps"]["key_draw"]
             for out in (source, more)]
    assert draws == [0, 1]
    assert json.loads((more / "stages" / "plan.json").read_text())["key_seed"] == 1


@pytest.mark.parametrize(("extra", "message"), [
    (["--end-to-end-keys", "3", "--end-to-end-long-steps", "0"],
     "--end-to-end-keys: the key-retrieval sequences are trained on in the long_gaps"),
    (["--end-to-end-keys", "-1", *LONG], "--end-to-end-keys: need ≥ 0"),
    (["--end-to-end-keys", "2", "--end-to-end-key-filler", "9", "5", *LONG], "1 ≤ LOW ≤ HIGH tokens; got 2 and 9 5"),
    (["--end-to-end-long-steps", "2", "--lora", "2"], "--end-to-end-long-steps with --lora"),
    (["--end-to-end-long-steps", "-1"], "--end-to-end-long-steps: need ≥ 0"),
    (["--end-to-end-long-gap", "60", "40"], "--end-to-end-long-gap: need 1 ≤ LOW ≤ HIGH"),
])
def test_long_gap_options_out_of_range_are_refused_before_anything_runs(tiny, tmp_path, capsys, extra, message):  # noqa: F811
    from linattn.cli import main

    assert main(command(tiny, tmp_path / "x", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_lora_alone_has_no_long_gaps_stage_by_default():
    args = type("Args", (), {"end_to_end_long_steps": None, "lora": 2})()
    assert linearize_job._long_steps(args) == 0
    args.lora = 0
    assert linearize_job._long_steps(args) == linearize_job.LONG_GAP_STEPS


def test_a_plan_saved_before_the_stage_existed_continues_without_it(tiny, tmp_path):  # noqa: F811
    """A run whose plan has neither long option nor count (made before the stage existed) is continued as it was
    planned: the rerun with the default options is not refused and trains no long gaps."""
    from linattn.cli import main

    out = tmp_path / "old"
    assert main(command(tiny, out, "--end-to-end-long-steps", "0")) == 0
    path = out / "stages" / "plan.json"
    plan = json.loads(path.read_text())
    del plan["end_to_end_long_steps"], plan["options"]["end_to_end_long_steps"]
    del plan["options"]["end_to_end_long_gap"]
    path.write_text(json.dumps(plan))
    (out / "stages" / "measure.done").unlink()
    assert main(command(tiny, out)) == 0  # the default long steps: the plan's none
    assert not (out / "stages" / "long_gaps.done").exists()


@pytest.mark.usefixtures("planned_80")
def test_plan_steps_gives_half_the_end_to_end_time_to_the_long_gaps():
    # 32 samples (4 batches, 160 s): 480 - 220 = 260 s left, 104 fitting steps, 156 s of training: 78 s of 2 s steps
    # (39) and 78 s of 4 s long steps (19); 24 samples would leave 45 end-to-end steps and 44 sequences, too few
    plan = plan_steps(10, COSTS, end_to_end=True, samples=32, long=True)
    assert (plan["end_to_end_samples"], plan["fit_steps"], plan["end_to_end_steps"],
            plan["end_to_end_long_steps"]) == (32, 104, 39, 19)
    assert plan["estimates"]["long_gaps"] == 19 * 4 and plan["estimates"]["end_to_end"] == 160 + 39 * 2
    # the training text's 16 sequences make 24 samples (44 + 16 sequences) enough: 120, 45 and 22 steps
    plan = plan_steps(10, COSTS, end_to_end=True, samples=32, long=True, corpus=16)
    assert (plan["end_to_end_samples"], plan["fit_steps"], plan["end_to_end_steps"],
            plan["end_to_end_long_steps"]) == (24, 120, 45, 22)
    # the long steps train on the samples alone: 8 samples (12 sequences) and 100 of the text cover 57 end-to-end
    # steps but not 28 long ones; 16 samples (28 sequences) cover their 25
    plan = plan_steps(10, COSTS, end_to_end=True, samples=32, long=True, corpus=100)
    assert (plan["end_to_end_samples"], plan["end_to_end_steps"], plan["end_to_end_long_steps"]) == (16, 51, 25)
    # without the stage: no long steps, the end-to-end stage has all of the training time
    plain = plan_steps(10, COSTS, end_to_end=True, samples=32)
    assert plain["end_to_end_long_steps"] == 0 and plain["end_to_end_steps"] == 78 and "long_gaps" not in \
        plain["estimates"]


@pytest.mark.usefixtures("planned_80")
def test_a_budget_too_small_for_the_long_gaps_names_them():
    with pytest.raises(LinearAttentionError, match="long_gaps steps .* --end-to-end-long-steps 0"):
        plan_steps(3, COSTS, end_to_end=True, samples=8, long=True)


@pytest.mark.slow  # ~10 s: the budget's calibration on a tiny Llama
def test_the_budget_times_a_long_gaps_step_and_plans_its_steps(tiny, tmp_path, monkeypatch):  # noqa: F811
    from linattn.cli import main

    monkeypatch.setattr(linearize_job.Job, "run", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "budget"
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out, "--budget", "0.1", "--fit-steps", "10", "--end-to-end-long-gap", "30", "40"))
    plan = json.loads((out / "stages" / "plan.json").read_text())
    costs = plan["costs"]
    assert costs["long_step"] > 0 and costs["end_to_end_step"] > 0
    assert plan["end_to_end_long_steps"] >= 5 and plan["estimates"]["long_gaps"] == pytest.approx(
        plan["end_to_end_long_steps"] * costs["long_step"])
    # LONG_SHARE of the training time to the long steps, the rest to the first stage, at each stage's own step (a
    # budget of seconds: no stage at MAX_STEPS)
    assert max(plan["end_to_end_steps"], plan["end_to_end_long_steps"]) < MAX_STEPS
    first = plan["end_to_end_steps"] * costs["end_to_end_step"]
    assert first * LONG_SHARE / (1 - LONG_SHARE) == pytest.approx(plan["estimates"]["long_gaps"], rel=0.2)
    # --end-to-end-long-steps 0 still skips the stage under a budget
    none = tmp_path / "none"
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, none, "--budget", "5", "--fit-steps", "10", "--end-to-end-long-steps", "0"))
    plan = json.loads((none / "stages" / "plan.json").read_text())
    assert plan["end_to_end_long_steps"] == 0 and "long_step" not in plan["costs"]
