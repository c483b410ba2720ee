"""The backend= dispatch, the capability check, and the Triton kernels in the interpreter (in a child process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import linattn
from linattn import LinearAttentionError
from linattn.backends import triton as triton_backend

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _qkv(n: int = 20, d: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, d, generator=generator) for _ in range(3)]


def test_torch_and_auto_agree_on_cpu() -> None:
    """On CPU tensors "auto" is the torch path: the same call, bit for bit."""
    q, k, v = _qkv()
    expected = linattn.linear_attention(q, k, v, causal=True, backend="torch")
    assert torch.equal(linattn.linear_attention(q, k, v, causal=True), expected)


def test_unknown_backend_is_refused() -> None:
    q, k, v = _qkv()
    with pytest.raises(LinearAttentionError, match="backend: unknown backend 'cuda'"):
        linattn.linear_attention(q, k, v, causal=True, backend="cuda")


def test_forced_triton_lists_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """xformers-style: each reason a call is not covered, one per line."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (x.double() for x in _qkv())
    with pytest.raises(LinearAttentionError) as caught:
        linattn.linear_attention(q, k, v, feature_map="favor+", chunk_size=32, form="parallel", backend="triton")
    message = str(caught.value)
    for reason in ("causal=False", "form='parallel'", "log-space feature map", "chunk_size=32", "torch.float64",
                   "device cpu"):
        assert reason in message, (reason, message)


def test_missing_triton_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extra, forcing the backend says how to install it."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    q, k, v = _qkv()
    with pytest.raises(LinearAttentionError, match=r"triton is not importable.*pip install 'linattn\[triton\]'"):
        linattn.linear_attention(q, k, v, causal=True, backend="triton")


def test_cpu_runs_never_import_triton() -> None:
    """A CPU-only install: importing linattn and running "auto" does not import triton."""
    code = (
        "import sys, torch, linattn\n"
        "q = torch.randn(1, 2, 30, 8)\n"
        "linattn.linear_attention(q, q, q, causal=True, backend='auto')\n"
        "linattn.linear_attention(q, q, q, causal=True, backend='torch')\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_interpreter_flag_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_backend.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_backend.interpreting()


def test_kernels_in_the_interpreter() -> None:
    """tests/triton_interpreted.py in its own pytest process with TRITON_INTERPRET=1 (kernels on CPU tensors
    against the float64 reference; see that file)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-rs",
               os.path.join(HERE, "triton_interpreted.py")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_launch_retries_without_pipelining_when_shared_memory_runs_out() -> None:
    """A GPU with less shared memory than the pipelined kernel asks for gets the unpipelined build."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from linattn.kinds.additive.triton.function import launch

    calls: list[dict[str, object]] = []

    class Kernel:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            def run(*args: object, **options: object) -> None:
                calls.append({"grid": grid, "args": args, **options})
                if "num_stages" not in options:
                    raise OutOfResources(262144, 232448, "shared memory")

            return run

    launch(Kernel(), (4, 2), 1, 2, num_warps=8)
    assert calls == [
        {"grid": (4, 2), "args": (1, 2), "num_warps": 8},
        {"grid": (4, 2), "args": (1, 2), "num_warps": 8, "num_stages": 1},
    ]


def test_options_added_later_make_a_call_uncovered() -> None:
    """An argument or option the kernels do not know (a decay, a gate, packing, a later state kind) is a reason in
    the capability table, not ignored: forced triton raises naming it, auto hands the call to torch. No kernel
    runs here (the device is faked as CUDA by the table's own inputs: a CPU tensor under TRITON_INTERPRET=1)."""
    from linattn.capabilities import Call, choose_backend, choose_route

    q, _, _ = _qkv()
    plain = Call("plain", True, "auto", 20, 20, options=(("decay", 0.9), ("log_gate", None)))
    route = choose_route(plain)
    with pytest.raises(LinearAttentionError, match=r"option decay=0.9: not in the kernels"):
        choose_backend("triton", plain, route, q, torch.float32)
    window = Call("window", True, "auto", 20, 20)
    with pytest.raises(LinearAttentionError, match=r"window attention: the kernels compute plain causal"):
        choose_backend("triton", window, choose_route(window), q, torch.float32)
    assert choose_backend("auto", plain, route, q, torch.float32) == "torch"

def _smoke_rows(script: str, tmp_path: object) -> list[list[str]]:
    """Run benchmarks/<script> --smoke (CPU tensors, the interpreter) and return its CSV rows (header dropped)."""
    pytest.importorskip("triton")
    csv_path = os.path.join(str(tmp_path), "smoke.csv")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.join(ROOT, "src"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", "--csv", csv_path]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(csv_path) as handle:
        return [line.split(",") for line in handle.read().splitlines()[1:]]


def test_gpu_benchmark_script_runs(tmp_path: object) -> None:
    """benchmarks/gpu.py --smoke: the GPU timing script's code on CPU tensors in the interpreter, every candidate,
    the delta rule's and KDA's sections and the decoding step, so that it works the first time a GPU runs it (its
    timings mean nothing here)."""
    modes = {tuple(row[1:3]) for row in _smoke_rows("gpu.py", tmp_path)}
    for candidate in ("sdpa_flash", "linattn", "linattn_kernels", "linattn_torch"):
        assert {(candidate, "fwd"), (candidate, "fwd+bwd")} <= modes, candidate
    for candidate in ("delta_triton", "delta_torch"):  # the delta rule's section
        assert {(candidate, "fwd"), (candidate, "fwd+bwd")} <= modes, candidate
    for candidate in ("kda_triton", "gated_delta_triton", "kda_torch"):  # KDA's section
        assert {(candidate, "fwd"), (candidate, "fwd+bwd")} <= modes, candidate
    for step in ("kernel_step", "DecodeStep", "DecodeStep_torch_ops"):
        assert (step, "decode") in modes, step


def test_gpu_tuning_script_runs(tmp_path: object) -> None:
    """benchmarks/gpu_tune.py --smoke: every kernel launched as the tuning sweep launches it, and the backward's
    preparation pass, in the interpreter (the timings mean nothing here)."""
    rows = _smoke_rows("gpu_tune.py", tmp_path)
    assert {row[0] for row in rows} == {"forward", "dq", "dk", "dv", "backward prep"}
    assert not [row for row in rows if row[-1]], "a variant failed"


def test_features_of_different_widths_are_refused_before_any_kernel() -> None:
    from linattn.backends import causal_attention

    q, k, v = _qkv()
    with pytest.raises(LinearAttentionError, match=r"query features \(1, 2, 20, 8\), key features \(1, 2, 20, 6\)"):
        causal_attention(q, k[..., :6], v, state=None, dtype=torch.float32, normalize=True, eps=1e-6, min_denom=None)
