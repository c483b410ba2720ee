"""Large tensors without page faults: glibc's malloc told to keep freed memory for reuse.

PyTorch on the CPU has no caching allocator: every tensor is a ``malloc`` and every free a ``free``. On Linux with
glibc, a block above malloc's mmap threshold (128 KiB at start, raised on the fly up to 32 MiB) is mapped fresh from
the kernel and unmapped when freed, and free memory at the top of the heap goes back to the kernel past the trim
threshold. A computation that makes and frees tensors of a few MiB and more over and over (the chunked forms, their
tiles of chunks, every training step) then has each page of each such tensor faulted in and zeroed by the kernel
again. Measured on this project's 2-core machine (``benchmarks/delta.py``, docs/benchmarks.md): the chunked gated
delta rule's forward+backward at N = 16,384, 8 heads, made 185,174 page faults a call; with the memory kept almost
none, and the call ran 1.4× faster.

:func:`reuse_freed_memory` raises both thresholds (``mallopt``): blocks up to 1 GiB come from the heap, and freed
memory stays with the process for the next allocation. It is process-wide and lasts until the process ends; the
price is a resident size that stays near the process's peak instead of shrinking after it. The ``linattn`` command
calls it unless ``LINATTN_MALLOC=system``; a program that imports linattn decides for itself. The same effect without
code: ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647`` in the environment of the process.
"""

from __future__ import annotations

import ctypes
import os
import sys

from .errors import LinearAttentionError

MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap
TRIM_THRESHOLD = 2**31 - 1  # the most mallopt takes (an int): free memory at the heap's top is kept
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
ENVIRONMENT = "LINATTN_MALLOC"
CHOICES = ("keep", "system")


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse (module docstring). Returns True when it took both settings;
    False where there is no glibc malloc (macOS, Windows, musl), which is left as it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def malloc_from_environment() -> str:
    """What ``LINATTN_MALLOC`` asks of the ``linattn`` command: "keep" (the default: :func:`reuse_freed_memory`)
    or "system" (malloc as the process found it). Returns what holds after the call."""
    choice = os.environ.get(ENVIRONMENT, "keep").strip().lower() or "keep"
    if choice not in CHOICES:
        raise LinearAttentionError(f"{ENVIRONMENT}={os.environ[ENVIRONMENT]!r} is not one of {', '.join(CHOICES)}: "
                                   "'keep' lets malloc keep freed memory for reuse (faster), 'system' leaves it as is")
    if choice == "keep" and reuse_freed_memory():
        return "keep"
    return "system"
