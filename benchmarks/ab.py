"""A/B timing of linattn calls at two commits: the working tree against REF, round after round, alternating.

    python benchmarks/ab.py 8d6dc4a                                  # every call, 15 rounds, 2 threads
    python benchmarks/ab.py 8d6dc4a --calls causal_fwd --rounds 40   # one call, more rounds
    python benchmarks/ab.py HEAD~1 --json out/ab.json                # also write every sample as JSON
    python benchmarks/ab.py 8d6dc4a --new 0231ac7                    # two commits, neither the working tree
    python benchmarks/ab.py 0231ac7 --threads 1 --clock cpu          # CPU time, 1 thread: steadier under load
    python benchmarks/ab.py 0231ac7 --malloc system                  # glibc's malloc as the system has it

How it measures. REF's ``src/`` is exported with ``git archive`` into a temporary folder (removed afterwards; so is
``--new``'s). Each side runs in its own long-lived subprocess, this file in worker mode with
``PYTHONPATH=<tree>/src``, so each imports its own commit's linattn (checked: the worker reports the file it
imported) and builds the same seeded inputs. After ``--warmup`` untimed runs of every call on both sides, each round
times every call once on each side, one side right after the other; the side that goes first swaps every round
(ABBA…), so a slow spell of the shared machine lands on both. Per call and side: the median, the interquartile
range and min–max of the rounds; ``new/old`` is the ratio of the medians, ``paired`` the median (and IQR) of the
per-round ratios, which cancels load that changes slowly. The load average is printed before and after. Both workers
run with malloc keeping freed memory (``--malloc keep``, as the ``linattn`` command runs: linattn/allocator.py, set
through glibc's environment variables so that a commit from before it gets it too) or as the system has it.

A call uses only API that exists at both ends of a comparison; where a side's ``linear_attention`` lacks a keyword
a call needs (``update=`` before the delta rule), that side shows ``n/a`` and the call is timed on the other side
alone. Add a call in ``CALLS`` below.

On a shared 2-core machine, 2 threads per side are fragile: while other processes hold the cores an OpenMP team
waits on a descheduled thread, and a call can take 10× its quiet time. Then compare with ``--threads 1 --clock cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TAG = "AB-WORKER "  # prefixes the worker's replies, so stray prints on its stdout are ignored
MALLOC_NAMES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc reads these at the process's start

# ---------------------------------------------------------------------------------------------- the timed calls
# Each builder gets (linattn, torch, inputs) and returns (before, step): ``before`` runs untimed ahead of every timed
# ``step``. inputs: q, k, v (B, H, N, D) fp32 from one seeded generator, g (an output gradient), beta (B, H, N).


def _forward(**options: Any) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        def step() -> None:
            with torch.no_grad():
                linattn.linear_attention(x["q"], x["k"], x["v"], causal=True, **_resolved(options, x))

        return lambda: None, step

    return build


def _training(**options: Any) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        leaves = [x[name].clone().requires_grad_() for name in ("q", "k", "v")]

        def before() -> None:
            for leaf in leaves:
                leaf.grad = None

        def step() -> None:
            out = linattn.linear_attention(*leaves, causal=True, **_resolved(options, x))
            out.backward(x["g"])

        return before, step

    return build


def _shipped_inputs(torch: Any, n: int) -> tuple[Any, ...]:
    """Seeded inputs of the shipped SmolLM2 student's attention call over n tokens: q (1, 9, n, 64), k and v
    (1, 3, n, 64), a Hedgehog map per head, β (1, 9, n) and log-gates (1, 9, n). q, k and v are laid out as
    transformers passes them: (1, n, heads, 64) in memory, the heads' dim moved (not the outer stride)."""
    from linattn.feature_maps import HedgehogFeatureMap

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, 9, 64, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, n, 3, 64, generator=g).transpose(1, 2) for _ in range(2))
    fmap = HedgehogFeatureMap(head_dim=64, num_features=64, num_heads=9)
    beta = torch.rand(1, 9, n, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, 9, n, generator=g) + 3)
    return q, k, v, fmap, beta, gate


def _student(n: int) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    """The shipped SmolLM2 student's attention call in an n-token prefill, on its own seeded inputs: B=1, 9 query and
    3 key heads, D=64, a Hedgehog map per head, the gated delta rule beside the window W=192 with 4 sinks, a
    read-out factor per head; no_grad."""
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        q, k, v, fmap, beta, gate = _shipped_inputs(torch, n)
        factor = torch.full((9,), 30.0)

        def step() -> None:
            with torch.no_grad():
                linattn.linear_attention(q, k, v, causal=True, feature_map=fmap, update="delta", beta=beta,
                                         log_gate=gate, window=192, sinks=4, window_factor=factor)

        return lambda: None, step

    return build


def _student_training(n: int) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    """A training step's attention call of the delta-rule students without a cache (their layers but the cached
    ones): the shipped student's shapes and map, the gated delta rule beside W=64 + 4 sinks, n tokens, forward and
    backward into q, k, v, the map, β and the log-gates."""
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        q, k, v, fmap, beta, gate = _shipped_inputs(torch, n)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, gate)]
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

        def before() -> None:
            for leaf in [*leaves, *fmap.parameters()]:
                leaf.grad = None

        def step() -> None:
            q, k, v, beta, gate = leaves
            out = linattn.linear_attention(q, k, v, causal=True, feature_map=fmap, update="delta", beta=beta,
                                           log_gate=gate, window=64, sinks=4)
            out.backward(grad)

        return before, step

    return build


def _model(n: int, tokens: int) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    """The shipped SmolLM2 folder in transformers (its 30 layers, 20 cached heads) on an n-token prompt of the
    shipped long held-out text: ``tokens`` = 0, the prompt read into a fresh cache, timed; else that prefill
    untimed, then ``tokens`` greedy decoding steps timed; no_grad."""
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        from linattn.linearized.folder import load_linearized, shipped
        from linattn.linearized.generate import new_cache
        from linattn.linearized.speed import prompt_ids

        model, tokenizer = load_linearized(shipped("smollm2"), base="smollm2")
        ids = prompt_ids(tokenizer, n)
        held: dict[str, Any] = {}

        def prefill() -> None:
            with torch.no_grad():
                cache = new_cache(model)
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            held["cache"], held["token"] = cache, out.logits[:, -1:].argmax(-1)

        if not tokens:
            return lambda: None, prefill

        def step() -> None:
            cache, token = held["cache"], held["token"]
            with torch.no_grad():
                for _ in range(tokens):
                    token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

        return prefill, step

    return build


# one layer of the shipped SmolLM2 folder with a cache: 5 of its 9 heads keep 1,728 pairs each (layer 21)
CACHED_SIZES = (0, 1728, 1728, 0, 0, 1728, 0, 0, 1728)
ODD_SIZES = (0, 1728, 1728, 0, 0, 0, 0, 0, 1728)  # three heads keep pairs: an odd count on two threads


def _cached(n: int, tokens: int, cached: bool = True,
            sizes: tuple[int, ...] = CACHED_SIZES) -> Callable[..., tuple[Callable[[], None], Callable[[], None]]]:
    """The shipped folder's attention with its cache, on its own seeded inputs (B=1, 9 query and 3 key heads, D=64,
    a Hedgehog map per head, the gated delta rule beside W=64 + 4 sinks, budgets ``sizes``; ``cached=False``: a
    layer without a cache): ``tokens`` = 0, an n-token prefill (no_grad); else an n-token prefill untimed, then
    ``tokens`` decoding steps timed."""
    def build(linattn: Any, torch: Any, x: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        from linattn.decode import lean_step

        total = n + tokens
        q, k, v, fmap, beta, gate = _shipped_inputs(torch, total)
        common: dict[str, Any] = {"window": 64, "sinks": 4}
        if cached:
            common["sparse_cache"] = linattn.SparseCache(size=sizes)
        steps: list[Any] = []

        def prefill(return_state: bool) -> Any:
            with torch.no_grad():
                return linattn.linear_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], causal=True,
                                                feature_map=fmap, update="delta", beta=beta[..., :n],
                                                log_gate=gate[..., :n], return_state=return_state, **common)

        if not tokens:
            return lambda: None, lambda: prefill(False)

        def before() -> None:
            state = prefill(True)[1]
            steps[:] = [lean_step(fmap, state, {**common, "update": "delta", "log_gate": "with each token"},
                                  kv_heads=3)]

        def step() -> None:
            with torch.no_grad():
                for t in range(n, total):
                    steps[0](q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                             beta=beta[..., t], log_decay=gate[..., t])

        return before, step

    return build


def _resolved(options: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
    """Options whose value names an input ("@beta") take that input."""
    return {key: x[value[1:]] if isinstance(value, str) and value.startswith("@") else value
            for key, value in options.items()}


@dataclass(frozen=True)
class Spec:
    what: str
    build: Callable[..., tuple[Callable[[], None], Callable[[], None]]]
    needs: tuple[str, ...] = ()  # keywords of linear_attention the call passes beyond causal= (checked per side)


CALLS: dict[str, Spec] = {
    "causal_fwd": Spec("causal forward, elu, form auto, no_grad (the native kernels where the tree has them)",
                       _forward(), ()),
    "causal_fwd_torch": Spec("causal forward, elu, the torch backend (chunked), no_grad", _forward(backend="torch"),
                             ()),
    "causal_fwd_bwd": Spec("causal forward + backward, elu, form auto (chunked)", _training(), ()),
    "window_fwd": Spec("window op W=64, 4 sinks, causal forward, no_grad", _forward(window=64, sinks=4),
                       ("window", "sinks")),
    "delta_fwd": Spec("delta rule, β per token, causal forward, no_grad", _forward(update="delta", beta="@beta"),
                      ("update", "beta")),
    "delta_fwd_bwd": Spec("delta rule, β per token, causal forward + backward",
                          _training(update="delta", beta="@beta"), ("update", "beta")),
    "gated_delta_fwd_bwd": Spec("gated delta rule, a decay of 0.999 per token (as the SmolLM2 students' gates), β per "
                                "token, causal forward + backward",
                                _training(update="delta", beta="@beta", decay=0.999), ("update", "beta", "decay")),
    "strong_delta_fwd_bwd": Spec("the same with a decay of 0.01 per token (the memory emptied within a chunk)",
                                 _training(update="delta", beta="@beta", decay=0.01), ("update", "beta", "decay")),
    "composed_fwd_bwd": Spec("gated delta rule beside the window W=64, 4 sinks, forward + backward",
                             _training(update="delta", beta="@beta", decay=0.01, window=64, sinks=4,
                                       normalize=False),
                             ("update", "beta", "decay", "window", "sinks")),
    "student_1536": Spec("the shipped student's attention call, a 1,536-token prefill (own shapes: 9:3 heads, "
                         "Hedgehog, gated delta beside W=192 + 4 sinks), no_grad", _student(1536),
                         ("update", "beta", "log_gate", "window", "sinks", "window_factor")),
    "student_8192": Spec("the same call, an 8,192-token prefill", _student(8192),
                         ("update", "beta", "log_gate", "window", "sinks", "window_factor")),
    "student_train_1536": Spec("a delta-rule student's attention call in training, without a cache (shipped shapes, "
                               "gated delta beside W=64 + 4 sinks), 1,536 tokens, forward + backward",
                               _student_training(1536), ("update", "beta", "log_gate", "window", "sinks")),
    "cached_prefill_8192": Spec("the shipped folder's attention with its cache (a layer of 4 cached heads of 9, "
                                "gated delta beside W=64 + 4 sinks), an 8,192-token prefill, no_grad",
                                _cached(8192, 0), ("update", "beta", "log_gate", "window", "sinks", "sparse_cache")),
    "odd_cached_prefill_8192": Spec("the same layer with three heads of 9 keeping pairs, an 8,192-token prefill, "
                                    "no_grad", _cached(8192, 0, sizes=ODD_SIZES),
                                    ("update", "beta", "log_gate", "window", "sinks", "sparse_cache")),
    "uncached_prefill_8192": Spec("a layer of the same folder without a cache (gated delta beside W=64 + 4 sinks), an "
                                  "8,192-token prefill, no_grad", _cached(8192, 0, cached=False),
                                  ("update", "beta", "log_gate", "window", "sinks")),
    "cached_prefill_1536": Spec("the same layer, a 1,536-token prefill (every pair fits the budgets: causal softmax "
                                "on the heads that keep pairs), no_grad", _cached(1536, 0),
                                ("update", "beta", "log_gate", "window", "sinks", "sparse_cache")),
    "cached_prefill_4096": Spec("the same layer, a 4,096-token prefill, no_grad", _cached(4096, 0),
                                ("update", "beta", "log_gate", "window", "sinks", "sparse_cache")),
    "cached_decode_1536": Spec("the same layer decoding 64 tokens after a 1,536-token prefill (the prefill untimed)",
                               _cached(1536, 64), ("update", "beta", "log_gate", "window", "sinks", "sparse_cache")),
    "model_prefill_1536": Spec("the shipped SmolLM2 folder reading a 1,536-token prompt into a fresh cache, through "
                               "transformers", _model(1536, 0)),
    "model_prefill_8192": Spec("the same folder reading an 8,192-token prompt into a fresh cache, through transformers",
                               _model(8192, 0)),
    "model_decode_1536": Spec("the shipped SmolLM2 folder decoding 16 tokens after a 1,536-token prompt (the prompt "
                              "untimed), through transformers", _model(1536, 16)),
    "composed_decode_1536": Spec("a layer of the same folder without a cache decoding 64 tokens after a 1,536-token "
                                 "prefill (the prefill untimed)", _cached(1536, 64, cached=False),
                                 ("update", "beta", "log_gate", "window", "sinks")),
}

# ---------------------------------------------------------------------------------------------- worker side


def _worker() -> None:
    """Serve one side: JSON requests on stdin, one JSON reply per request on stdout."""
    import inspect

    import torch

    import linattn

    state: dict[str, Any] = {}

    def reply(message: dict[str, Any]) -> None:
        sys.stdout.write(TAG + json.dumps(message) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "setup":
            torch.set_num_threads(request["threads"])
            gen = torch.Generator().manual_seed(0)
            b, h, n, d = request["shape"]
            x = {name: torch.randn(b, h, n, d, generator=gen) for name in ("q", "k", "v", "g")}
            x["beta"] = torch.sigmoid(torch.randn(b, h, n, generator=gen))
            keywords = set(inspect.signature(linattn.linear_attention).parameters)
            missing = {}
            for name in request["calls"]:
                lacking = [key for key in CALLS[name].needs if key not in keywords]
                if lacking:
                    missing[name] = f"linear_attention has no {', '.join(lacking)}="
                else:
                    state[name] = CALLS[name].build(linattn, torch, x)
            reply({"linattn": linattn.__file__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "missing": missing})
        elif request["op"] == "time":
            before, step = state[request["call"]]
            clock = time.process_time if request["clock"] == "cpu" else time.perf_counter
            seconds = []
            for _ in range(request["reps"]):
                before()
                start = clock()
                step()
                seconds.append(clock() - start)
            reply({"seconds": seconds})


# ---------------------------------------------------------------------------------------------- driver side


def malloc_environment() -> dict[str, str]:
    """What linattn.allocator.reuse_freed_memory sets (this checkout's values), as glibc's environment: so that a
    worker of any commit, one from before the function too, runs with it."""
    from linattn.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

    return dict(zip(MALLOC_NAMES, (str(MMAP_THRESHOLD), str(TRIM_THRESHOLD)), strict=True))


class Side:
    """One commit's worker process."""

    def __init__(self, label: str, src: Path, threads: int, malloc: str) -> None:
        self.label, self.src = label, src
        env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        for name in MALLOC_NAMES:
            env.pop(name, None)
        if malloc == "keep":
            env.update(malloc_environment())
        self.process = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"{self.label}: the worker exited (code {self.process.wait()}); see its error above")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _export(rev: str, into: Path) -> tuple[str, Path]:
    """``rev``'s src/ exported into ``into``; returns (a label with the short hash, the src path)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return f"{rev} ({commit[:7]})", into / "src"


def _working_tree() -> tuple[str, Path]:
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--", "src") else ""
    return f"working tree (HEAD {_git('rev-parse', '--short', 'HEAD')}{dirty})", ROOT / "src"


def _stats(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"median": values[0], "q1": values[0], "q3": values[0], "min": values[0], "max": values[0]}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def _measure(
    sides: list[Side], calls: list[str], rounds: int, warmup: int, clock: str
) -> dict[str, list[list[float]]]:
    """times[call][side index]: one sample per round, the first side swapping every round."""
    for call in calls:
        for side in sides:
            side.ask(op="time", call=call, clock=clock, reps=warmup)
    times: dict[str, list[list[float]]] = {call: [[], []] for call in calls}
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for call in calls:
            for i in order:
                times[call][i] += sides[i].ask(op="time", call=call, clock=clock, reps=1)["seconds"]
        print(f"\rround {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return times


def _table(calls: list[str], times: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    rows = []
    print(f"{'call':<15} {'new ms: median [IQR] (min–max)':>34} {'old ms: median [IQR] (min–max)':>34} "
          f"{'new/old':>8} {'paired [IQR]':>19}")
    for call in calls:
        new, old = times[call]
        row: dict[str, Any] = {"call": call, "what": CALLS[call].what}
        cells = []
        for key, samples in (("new", new), ("old", old)):
            if samples:
                row[key] = _stats([t * 1e3 for t in samples]) | {"seconds": samples}
                s = row[key]
                cells.append(f"{s['median']:.1f} [{s['q1']:.1f}–{s['q3']:.1f}] ({s['min']:.1f}–{s['max']:.1f})")
            else:
                cells.append("n/a")
        ratio, paired = "", ""
        if new and old:
            row["ratio"] = row["new"]["median"] / row["old"]["median"]
            pairs = [a / b for a, b in zip(new, old, strict=True)]
            row["paired"] = _stats(pairs)
            ratio = f"{row['ratio']:.3f}"
            p = row["paired"]
            paired = f"{p['median']:.3f} [{p['q1']:.3f}–{p['q3']:.3f}]"
        print(f"{call:<15} {cells[0]:>34} {cells[1]:>34} {ratio:>8} {paired:>19}")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", help="the old side: a commit, tag or branch")
    parser.add_argument("--new", default=None, help="the new side as a commit too (default: the working tree)")
    parser.add_argument("--calls", nargs="+", choices=sorted(CALLS), default=list(CALLS), metavar="NAME",
                        help=f"calls to time (default all): {', '.join(CALLS)}")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each call on each side first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: the worker's CPU time, all threads (steadier under load)")
    parser.add_argument("--n", type=int, default=16384, help="tokens (B=1, H=8, D=64)")
    parser.add_argument("--malloc", choices=("keep", "system"), default="keep",
                        help="keep: glibc's malloc keeps freed memory for reuse in both workers (as `linattn` runs); "
                        "system: as the system has it")
    parser.add_argument("--json", type=Path, default=None, help="also write the table and every sample here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="linattn-ab-") as tmp:
        if args.new is None:
            new_label, new_src = _working_tree()
        else:
            (Path(tmp) / "new").mkdir()
            new_label, new_src = _export(args.new, Path(tmp) / "new")
        (Path(tmp) / "old").mkdir()
        old_label, old_src = _export(args.ref, Path(tmp) / "old")
        sides = [Side(new_label, new_src, args.threads, args.malloc), Side(old_label, old_src, args.threads,
                                                                            args.malloc)]
        try:
            shape = (1, 8, args.n, 64)
            setups = [side.ask(op="setup", calls=args.calls, threads=args.threads, shape=shape) for side in sides]
            for side, setup in zip(sides, setups, strict=True):
                if not Path(setup["linattn"]).resolve().is_relative_to(side.src.resolve()):
                    raise SystemExit(f"{side.label}: imported linattn from {setup['linattn']}, not {side.src}")
                for call, why in setup["missing"].items():
                    print(f"{side.label}: {call} n/a ({why})")
            load_before = os.getloadavg()
            print(f"new = {new_label}\nold = {old_label}\ntorch {setups[0]['torch']}, {setups[0]['threads']} "
                  f"threads, B=1 H=8 N={args.n} D=64 fp32, malloc {args.malloc}, {args.rounds} rounds after "
                  f"{args.warmup} warm-up; "
                  f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
            runnable = [[c for c in args.calls if c not in setup["missing"]] for setup in setups]
            times = _measure_partial(sides, args.calls, runnable, args.rounds, args.warmup, args.clock)
        finally:
            for side in sides:
                side.close()
    load_after = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load_after)}")
    rows = _table(args.calls, times)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"new": new_label, "old": old_label, "threads": args.threads, "malloc": args.malloc, "n": args.n,
                  "rounds": args.rounds,
                  "warmup": args.warmup, "clock": args.clock, "load_before": load_before, "load_after": load_after,
                  "calls": rows}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


def _measure_partial(
    sides: list[Side], calls: list[str], runnable: list[list[str]], rounds: int, warmup: int, clock: str
) -> dict[str, list[list[float]]]:
    """As :func:`_measure`, a call that one side lacks timed on the other side alone (its column empty)."""
    both = [c for c in calls if c in runnable[0] and c in runnable[1]]
    times = _measure(sides, both, rounds, warmup, clock) if both else {}
    for i, side in enumerate(sides):
        for call in (c for c in runnable[i] if c not in both):
            side.ask(op="time", call=call, clock=clock, reps=warmup)
            samples = side.ask(op="time", call=call, clock=clock, reps=rounds)["seconds"]
            times[call] = [samples, []] if i == 0 else [[], samples]
    return {call: times.get(call, [[], []]) for call in calls}


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        main()
