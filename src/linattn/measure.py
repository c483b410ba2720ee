"""Measuring tools shared by ``linattn bench`` and ``benchmarks/``: time per call, peak memory, the machine's
GEMM peak and the useful FLOPs of an attention forward (linear: 4·N·F·Dv per batch×head; softmax: 4·N²·D
non-causal, 2·N²·D causal)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch


def useful_flops(
    kind: str, *, n: int, heads: int, batch: int, features: int, values: int, causal: bool = True
) -> int:
    """Useful FLOPs of one forward pass (see the module docstring)."""
    rows = batch * heads
    if kind == "linear":
        return 4 * n * features * values * rows
    return (2 if causal else 4) * n * n * features * rows


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(size: int = 2048, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """GFLOP/s of the best of ``repeats`` fp32 size×size matmuls: the practical GEMM peak of this run."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes of the highest point of live allocations made while ``fn()`` runs, above those before it."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def time_calls(
    fn: Callable[[], Any], repeats: int, device: torch.device, *, warmup: int = 1, max_seconds: float = math.inf
) -> list[float]:
    """Seconds per call, each timed alone (the device synchronised): ``warmup`` untimed calls, then ``repeats``
    timed ones; if one warm-up call took over ``max_seconds``, just its time."""
    for index in range(warmup):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if index == 0 and time.perf_counter() - start > max_seconds:
            return [time.perf_counter() - start]
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return samples


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (linear interpolation between order statistics)."""
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        position = fraction * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return at(0.25), at(0.5), at(0.75)
