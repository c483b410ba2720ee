"""The benchmark suite behind docs/benchmarks.md and the README table (``make bench``).

Runs ``linattn bench`` over N = 1k…64k, causal and non-causal, forward and forward+backward, linattn's chunked and
global forms and the default call (``form="auto"``: on CPU without gradients the native kernels) with the elu map
against torch SDPA (and peers when installed), plus decoding from 1k to 64k tokens
of context; writes out/bench/{bench.csv, bench.json, decode.csv, bench.png}. Extra arguments go to ``linattn
bench`` (e.g. ``--repeats 3 --threads 1``). The chunk-size sweep is ``benchmarks/chunk_size.py``.

    .venv/bin/python benchmarks/run.py
"""

from __future__ import annotations

import sys

from linattn.cli import main

SUITE = [
    "bench",
    "--sizes", "1024", "2048", "4096", "8192", "16384", "32768", "65536",
    "--forms", "auto", "chunked", "global",
    "--maps", "elu",
    "--decode-contexts", "1024", "4096", "16384", "65536",
    "--out", "out/bench",
]

if __name__ == "__main__":
    sys.exit(main(SUITE + sys.argv[1:]))
