"""The delta rule's and KDA's sections of the GPU timing (benchmarks/gpu.py imports them; run that script).

Each section times its candidates in alternating rounds with the ``time_calls`` it is given (gpu.py's), on
``device`` ("cuda"; "cpu" under --smoke), and fills the ratio column against its reference candidate.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

import linattn

Call = Callable[[], Any]
TimeCalls = Callable[[dict[tuple[str, str], Call], int, int], list[dict[str, Any]]]


def _fla_delta(device: str) -> Callable[..., Any] | None:
    if device != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except Exception:
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        # (B, N, H, ·) layout, made outside the timing; L2-normalised q and k in its kernel, as linattn's
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=True)[0]

    return run


def _update_calls(runs: dict[str, Callable[..., torch.Tensor]], inputs: list[torch.Tensor], grad: torch.Tensor
                  ) -> dict[tuple[str, str], Call]:
    """The forward and forward+backward calls of each delta-rule candidate on ``inputs`` (B, H, N, ·); fla's
    candidates (names starting "fla") get them token-major (B, N, H, ·), made outside the timing."""
    calls: dict[tuple[str, str], Call] = {}
    for name, fn in runs.items():
        token_major = name.startswith("fla")  # (B, N, H, ·)
        base = [x.transpose(1, 2).contiguous() for x in inputs] if token_major else inputs
        upstream = grad.transpose(1, 2).contiguous() if token_major else grad
        leaves = [x.detach().requires_grad_() for x in base]

        def forward(fn: Callable[..., torch.Tensor] = fn, base: list[torch.Tensor] = base) -> None:
            with torch.no_grad():
                fn(*base)

        def training(fn: Callable[..., torch.Tensor] = fn, leaves: list[torch.Tensor] = leaves,
                     upstream: torch.Tensor = upstream) -> None:
            fn(*leaves).backward(upstream)
            for leaf in leaves:
                leaf.grad = None

        calls[(name, "fwd")], calls[(name, "fwd+bwd")] = forward, training
    return calls


def _ratios(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    """The ratio column: ``reference``'s ms over each row's, mode by mode."""
    ms = {r["mode"]: r["ms"] for r in rows if r["candidate"] == reference}
    for row in rows:
        row["flash/this"] = ms.get(row["mode"], float("nan")) / row["ms"]
    return rows


def _difference(label: str, fast: torch.Tensor, slow: torch.Tensor) -> None:
    fast, slow = fast.float(), slow.float()
    print(f"  {label}: triton vs torch rel. difference {((fast - slow).norm() / slow.norm()).item():.2e}")


def time_delta(n: int, args: argparse.Namespace, *, device: str, time_calls: TimeCalls) -> list[dict[str, Any]]:
    """The delta rule with a per-token gate (Gated DeltaNet: identity features, L2-normalised; β = σ(·),
    g = logsigmoid(·)), B=4, H=8, D=64 by default: the triton backend against the torch chunked form (both chunk
    64, end to end through linear_attention) and fla's chunk_gated_delta_rule when importable."""
    shape = (args.batch, args.delta_heads, n, args.delta_dim)
    inputs = [torch.randn(shape, device=device, dtype=args.dtype) for _ in range(3)]
    inputs += [torch.rand(shape[:-1], device=device) * 0.9 + 0.05, -torch.rand(shape[:-1], device=device) * 0.1]
    grad = torch.randn(shape, device=device, dtype=args.dtype)
    runs: dict[str, Callable[..., torch.Tensor]] = {
        f"delta_{backend}": lambda q, k, v, beta, g, backend=backend: linattn.linear_attention(
            q, k, v, causal=True, update="delta", beta=beta, log_gate=g, feature_map="identity", backend=backend)
        for backend in ("triton", "torch")
    }
    fla = _fla_delta(device)
    if fla is not None:
        runs["fla_gated_delta"] = fla
    calls = _update_calls(runs, inputs, grad)
    with torch.no_grad():  # the timed calls compute the same
        _difference(f"delta N={n}", runs["delta_triton"](*inputs), runs["delta_torch"](*inputs))
    return _ratios(time_calls(calls, n, args.rounds), "delta_torch")  # the column holds torch-form/this


def _fla_kda(device: str) -> Callable[..., Any] | None:
    if device != "cuda":
        return None
    try:
        from fla.ops.kda import chunk_kda  # type: ignore[import-not-found]
    except Exception:
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
            _: torch.Tensor) -> torch.Tensor:
        # (B, N, H, ·) layout, made outside the timing; L2-normalised q and k in its kernel, as linattn's
        return chunk_kda(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=True)[0]

    return run


def time_kda(n: int, args: argparse.Namespace, *, device: str, time_calls: TimeCalls) -> list[dict[str, Any]]:
    """KDA (the delta rule with a per-feature gate, g (B, H, N, D) ≤ 0) on its Triton kernels against the gated
    delta rule's kernels on the same q, k, v, β with one gate per token, side by side in the same rounds, at the
    delta rule's shape (B=4, H=8, D=64 by default), end to end through linear_attention; also KDA's torch chunked
    form and fla's chunk_kda when importable. The ratio column reads gated-delta-triton/this."""
    shape = (args.batch, args.delta_heads, n, args.delta_dim)
    inputs = [torch.randn(shape, device=device, dtype=args.dtype) for _ in range(3)]
    inputs += [torch.rand(shape[:-1], device=device) * 0.9 + 0.05, -torch.rand(shape, device=device) * 0.1,
               -torch.rand(shape[:-1], device=device) * 0.1]  # β, per-feature gates, per-token gates
    grad = torch.randn(shape, device=device, dtype=args.dtype)

    def kda(backend: str) -> Callable[..., torch.Tensor]:
        return lambda q, k, v, beta, g, _: linattn.linear_attention(
            q, k, v, causal=True, update="delta", beta=beta, log_gate=g, feature_map="identity", backend=backend)

    runs: dict[str, Callable[..., torch.Tensor]] = {
        "kda_triton": kda("triton"),
        "gated_delta_triton": lambda q, k, v, beta, _, g: linattn.linear_attention(
            q, k, v, causal=True, update="delta", beta=beta, log_gate=g, feature_map="identity", backend="triton"),
        "kda_torch": kda("torch"),
    }
    fla = _fla_kda(device)
    if fla is not None:
        runs["fla_kda"] = fla
    calls = _update_calls(runs, inputs, grad)
    with torch.no_grad():  # the timed calls compute the same
        _difference(f"kda N={n}", runs["kda_triton"](*inputs), runs["kda_torch"](*inputs))
    return _ratios(time_calls(calls, n, args.rounds), "gated_delta_triton")
