"""``linattn linearize``'s measuring stage keeps its rows as it goes: a rerun after an interruption measures only
the rows not yet measured, and a run continuing another (--init-from) takes that run's rows of the original and
the softmax window where every input they depend on is the same; the student's rows are always measured."""

import json

import pytest

pytest.importorskip("transformers")

from linattn.linearized import job as linearize_job  # noqa: E402
from test_linearize_job import FAST, tiny  # noqa: E402,F401

BASELINES = ("original (softmax)", "window 8 + 1 sinks (softmax)")


def command(model, out, *extra):
    return ["linearize", str(model), str(model / "train.txt"), "--heldout", str(model / "heldout.txt"), "--out",
            str(out), *FAST, *extra]


def scored_rows(monkeypatch):
    """The names of the rows whose probes run, in order (a spy on the measuring stage's probe call)."""
    names: list[str] = []
    real = linearize_job.score_model

    def spy(model, *args, **kwargs):
        names.append(len(names))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(linearize_job, "score_model", spy)
    return names


def rows_of(out):
    return json.loads((out / "results.json").read_text())["rows"]


@pytest.mark.slow  # ~20 s: a tiny Llama's pipeline, interrupted in the measuring stage and rerun
def test_a_rerun_measures_only_the_rows_not_measured(tiny, tmp_path, monkeypatch):  # noqa: F811
    from linattn.cli import main

    out = tmp_path / "lin"
    real = linearize_job.score_model
    calls = []

    def second_interrupted(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a user's Ctrl-C during the second row
        return real(model, *args, **kwargs)

    monkeypatch.setattr(linearize_job, "score_model", second_interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(command(tiny, out))
    kept = json.loads((out / "stages" / linearize_job.MEASURED_ROWS).read_text())
    assert [row["name"] for row in kept] == ["original (softmax)"]
    monkeypatch.setattr(linearize_job, "score_model", real)
    scored = scored_rows(monkeypatch)
    assert main(command(tiny, out)) == 0
    rows = rows_of(out)
    assert [row["name"] for row in rows] == [*BASELINES, "linearized"]
    assert len(scored) == 2  # the window and the linearized model; the original's row was kept
    assert rows[0] == kept[0]
    assert json.loads((out / "results.json").read_text())["rows_taken"] == {}


@pytest.mark.slow  # ~30 s: two short runs on a tiny Llama, the second continuing the first, then a third
def test_a_continued_run_takes_the_baselines_of_its_source(tiny, tmp_path, monkeypatch):  # noqa: F811
    from linattn.cli import main

    source, more, other = tmp_path / "source", tmp_path / "more", tmp_path / "other"
    assert main(command(tiny, source)) == 0
    scored = scored_rows(monkeypatch)
    assert main(command(tiny, more, "--init-from", str(source), "--end-to-end-steps", "2")) == 0
    assert len(scored) == 1  # the linearized row alone
    first, second = rows_of(source), rows_of(more)
    assert second[:2] == first[:2]  # taken as they are
    assert second[2]["perplexity"] != first[2]["perplexity"]  # the student trained on: measured again
    result = json.loads((more / "results.json").read_text())
    assert result["rows_taken"] == {name: str(source.resolve()) for name in BASELINES}
    card = (more / "README.md").read_text()
    assert f"Taken as measured by another run on the same inputs (the base model, texts and probes): " \
           f"original (softmax), from {source.resolve()}" in card
    # other probes: nothing is taken
    scored.clear()
    assert main(command(tiny, other, "--init-from", str(source), "--end-to-end-steps", "2",
                        "--passkey-trials", "3")) == 0
    assert len(scored) == 3
    assert json.loads((other / "results.json").read_text())["rows_taken"] == {}


def test_rows_from_before_rows_carried_their_inputs_are_never_taken(tmp_path):
    source = tmp_path / "source"
    (source / "stages").mkdir(parents=True)
    row = {"name": "original (softmax)", "perplexity": 1.0}
    (source / "results.json").write_text(json.dumps({"rows": [row]}))
    assert linearize_job._measured_rows(tmp_path / "new", source, ["original (softmax)"]) == {}
    (source / "results.json").write_text(json.dumps({"rows": [{**row, "inputs": "x"},
                                                             {"name": "linearized", "inputs": "y"}]}))
    taken = linearize_job._measured_rows(tmp_path / "new", source, ["original (softmax)"])
    assert list(taken) == [("original (softmax)", "x")]  # the student's row never crosses runs
    (source / "results.json").write_text("{not json")
    assert linearize_job._measured_rows(tmp_path / "new", source, ["original (softmax)"]) == {}
