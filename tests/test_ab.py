"""benchmarks/ab.py: times its calls at two commits, each side importing its own commit's code, and reports a call
the older commit lacks as n/a rather than failing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BEFORE_DELTA = "8d6dc4a"  # a commit whose linear_attention has no update= (the delta rule came later)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _run_ab(ref: str, out: Path, *calls: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab.py"), ref, "--calls", *calls, "--rounds", "2", "--warmup",
         "1", "--n", "128", "--threads", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


@pytest.mark.slow  # two worker processes import torch: ~30 s on 2 busy cores, the calls themselves < 1 s
@pytest.mark.skipif(_git("cat-file", "-e", f"{BEFORE_DELTA}^{{commit}}").returncode != 0,
                    reason=f"needs a git checkout with commit {BEFORE_DELTA}")
def test_both_sides_are_timed_and_a_call_the_old_commit_lacks_is_na(tmp_path: Path) -> None:
    record, stdout = _run_ab(BEFORE_DELTA, tmp_path / "ab.json", "causal_fwd", "delta_fwd_bwd")
    assert record["old"].startswith(f"{BEFORE_DELTA} (") and record["new"].startswith("working tree")
    both, delta = record["calls"]
    for side in ("new", "old"):
        assert len(both[side]["seconds"]) == 2 and all(t > 0 for t in both[side]["seconds"])
        assert both[side]["min"] <= both[side]["median"] <= both[side]["max"]
    assert both["ratio"] == pytest.approx(both["new"]["median"] / both["old"]["median"])
    # the delta rule is newer than the old side: timed on the new side alone, n/a on the old
    assert len(delta["new"]["seconds"]) == 2 and "old" not in delta and "ratio" not in delta
    assert "delta_fwd_bwd n/a (linear_attention has no update, beta=)" in stdout
    assert "new/old" in stdout


def test_the_workers_malloc_environment_is_the_allocators_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--malloc keep`` gives a worker of any commit, through glibc's environment, the thresholds that
    linattn.reuse_freed_memory sets in this checkout."""
    import importlib.util

    from linattn import allocator

    spec = importlib.util.spec_from_file_location("ab_script", ROOT / "benchmarks" / "ab.py")
    assert spec is not None and spec.loader is not None
    ab = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ab)  # its dataclasses look their module up there
    spec.loader.exec_module(ab)
    assert ab.malloc_environment() == {"MALLOC_MMAP_THRESHOLD_": str(allocator.MMAP_THRESHOLD),
                                       "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD)}
