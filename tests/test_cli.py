from __future__ import annotations

import subprocess
import sys

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
