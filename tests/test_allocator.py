"""linattn.reuse_freed_memory: large tensors made and freed in a loop stop being faulted in anew, and the command's
knob (LINATTN_MALLOC) is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from linattn.allocator import malloc_from_environment
from linattn.errors import LinearAttentionError

# 20 tensors of 64 MiB, each filled then freed: every one is a fresh mapping under glibc's default thresholds
PROGRAM = """
import json, resource, sys, torch, linattn
took = linattn.reuse_freed_memory() if sys.argv[1] == "keep" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(16 * 2**20).fill_(1.0)
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_kept_memory_is_not_faulted_in_again():
    kept = _faults("keep")
    if not kept["took"]:
        pytest.skip("no glibc malloc here (mallopt refused the settings)")
    system = _faults("system")
    pages = 64 * 2**20 // 4096  # one tensor's pages
    # the system's malloc maps each tensor afresh: at least a page fault per page of each (20 tensors); kept, only the
    # first tensor's pages are faulted in (plus the interpreter's own few)
    assert int(system["faults"]) >= 19 * pages  # type: ignore[call-overload]
    assert int(kept["faults"]) <= 3 * pages  # type: ignore[call-overload]


def test_the_commands_knob(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LINATTN_MALLOC", "system")
    assert malloc_from_environment() == "system"
    monkeypatch.setenv("LINATTN_MALLOC", "fast")
    with pytest.raises(LinearAttentionError, match="LINATTN_MALLOC='fast' is not one of keep, system"):
        malloc_from_environment()

