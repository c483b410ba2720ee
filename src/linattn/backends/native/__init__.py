"""linattn's native CPU kernels: C++ that torch's extension API builds on first use (a C++ compiler and ninja are
needed; the build takes about 20 s and is kept in torch's extension cache, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``), with the torch code they replace kept as their reference and fallback.

Two extensions, one per source file: ``decode`` and ``causal``.

What ``decode`` is for: a decoding token of a small model does a few hundred thousand multiply-adds per layer, and in
torch each of its ~115 small operations (for the shipped SmolLM2 student) costs more in dispatch than in
arithmetic. Four calls replace most of them (decode.cpp): ``delta_window_token`` (the memory's decay, write and
read-out, the ring and the window's softmax; :class:`~linattn.exact.composed_step.ComposedDecodeStep` for the
delta family beside the window), ``sparse_delta_token`` (the same beside the sparse exact cache, between two of its
boundaries: :class:`~linattn.exact.sparse_composed_step.SparseComposedDecodeStep`), ``hedgehog_unit_features`` (the
Hedgehog map of one token, normalised) and ``key_gates`` (:meth:`linattn.nn.KeyGates.step_arguments`). A fifth,
``layer_token``, fuses the three a layer's token needs (the gates, the maps and either token) into one parallel
pass from the layer's raw q, k and v to its output, times the key gates' read-out weight λ (the steps'
``fused_token``, which :mod:`linattn.hf`'s attention function calls first). ``linear_token`` is a decoding token's
linear layer (a few rows times a weight matrix, the matrix's rows over the threads), and ``linear_token_blocks``
the same with the matrix held as blocks of integer codes with a scale and an offset each, where the weights are
exactly such blocks (a model read from a Q4_1 or Q8_0 GGUF file): :class:`~linattn.nn.token_linear.TokenLinear`.

What ``causal`` is for: a causal forward without gradients (inference, a prompt's prefill) spends most of its time
in the chunked forms' passes over whole tensors; causal.cpp runs the recurrence token by token with each (batch,
head) row's state in the first-level cache, block by block of features made in torch (:mod:`.forms`, the
``"native"`` backend of ``linear_attention``). Beside the sparse exact cache and the delta family it also takes
what the torch forms do one boundary or one query block at a time: a call's boundary decisions under the recall
score (``sparse_delta_decide``) and the cache's exact term (``cache_exact``); beside the window, its softmax average
over the band and the sinks (``band_average``).

Where the build cannot run (no compiler, no ninja, a platform torch cannot build for) the steps run their torch
code, with the same results up to rounding; :func:`status` says which and why. ``LINATTN_NATIVE=0`` turns the
kernels off (for a comparison, or to rule them out).
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Any

import torch

SOURCES = {name: Path(__file__).with_name(f"{name}.cpp") for name in ("decode", "causal")}
_state: dict[str, dict[str, Any]] = {}


def _arch_flags() -> tuple[str, list[str]]:
    """The instruction set to build for, from what torch found on this CPU (the name of the build says it, so a
    cache folder shared between machines never hands one a build for instructions it lacks)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic", []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512", ["-march=x86-64-v4", "-mprefer-vector-width=512"]
    if capability == "AVX2":
        return "avx2", ["-march=x86-64-v3"]
    return "generic", []


def build_digest(source: Path) -> str:
    """The build's name part: the source's bytes, and where it and torch are. ninja rebuilds when a build's
    command changes, and the command holds both paths: two checkouts (a worktree, benchmarks/ab.py's exported
    commit, a CI clone) sharing one cache folder under one name would rebuild each other's build at every first
    call (~30 s each), so each gets its own."""
    hashed = hashlib.sha256(source.read_bytes())
    hashed.update(f"\0{source.resolve()}\0{Path(torch.__file__).resolve().parent}".encode())
    return hashed.hexdigest()[:10]


def module(name: str = "decode") -> Any | None:
    """The built extension ``name`` ("decode" or "causal"), or None (:func:`status` says why); built once per
    process, on the first call."""
    found = _state.setdefault(name, {})
    if "module" in found:
        return found["module"]
    found["module"] = None
    if os.environ.get("LINATTN_NATIVE", "1") == "0":
        found["reason"] = "turned off by LINATTN_NATIVE=0"
        return None
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability

        verify_ninja_availability()
    except Exception as error:  # noqa: BLE001 - any failure to find the tools means: run the torch code
        found["reason"] = f"torch's extension builder is unavailable ({error}); pip install ninja"
        return None
    source = SOURCES[name]
    digest = build_digest(source)
    arch, flags = _arch_flags()
    # -fopenmp: at::parallel_for is inlined from torch's headers, so without it the rows would run on one thread
    parallel = ["-fopenmp"] if platform.system() == "Linux" else []
    # -fno-trapping-math: no code here reads the floating-point exception flags, and without it GCC will not compute
    # a conditional float-to-int conversion (the exp's 2^n) for every lane, so the loops with an exp in a select
    # stayed scalar (the Hedgehog activation ran 6x slower). No operation rounds differently; a loop's sum that now
    # runs in vector lanes adds in another order.
    cflags = ["-O3", "-fno-trapping-math", *parallel]
    # an older compiler may not know the instruction-set level's name: then the portable build
    for target, options in ((arch, flags), ("generic", [])) if flags else ((arch, flags),):
        try:
            found["module"] = load(f"linattn_native_{name}_{target}_{digest}", [str(source)],
                                   extra_cflags=[*cflags, *options], extra_ldflags=parallel, verbose=False)
        except Exception as error:  # noqa: BLE001 - a failed build (no compiler, no headers) falls back
            lines = str(error).strip().splitlines()
            found["reason"] = f"the build failed ({type(error).__name__}: {lines[-1] if lines else ''})"
            continue
        found["reason"] = f"built for {target}"
        return found["module"]
    return None


def status() -> str:
    """One line: whether the native kernels run here, and why not where they do not."""
    parts = []
    for name in SOURCES:
        built = module(name)
        parts.append(f"{name} {'on' if built is not None else 'off'} ({_state[name].get('reason', '')})")
    return "native kernels: " + "; ".join(parts)
