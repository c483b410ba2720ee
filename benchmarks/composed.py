"""What composing costs: the window beside a linear part of another kind against its two parts run alone.

For each linear part (gated additive: a per-token gate; the gated delta rule; optionally more with --kinds) at
B=1, H=8, D=64 (elu features, F = D), one round times, side by side and alternately:

- ``linear``: the linear part alone, ``linear_attention(..., causal=True, <its options>)`` (chunked);
- ``exact``: the window's exact part alone — the banded softmax over the last W keys and S sinks (the chunked form's
  exact part, :func:`linattn.exact.forms.chunked.causal_window_parts` with ``linear_part=False``), which is what the
  composed route runs beside the linear part: the mass form beside an additive part (average and mass both
  differentiated), the softmax average alone beside the delta rule. It maps q and the keys; the composed route's
  linear part reads those features instead of mapping them again;
- ``composed``: ``linear_attention(..., window=W, sinks=S, <its options>)``.

The figure is composed / (linear + exact), the median over rounds of per-round ratios (the machine is shared:
ratios, not absolute times). Forward and backward (gradients of q, k, v and the linear part's own inputs).

    .venv/bin/python benchmarks/composed.py                       # N = 16,384, 2 threads, 5 rounds
    .venv/bin/python benchmarks/composed.py --n 4096 --rounds 3 --threads 1
    .venv/bin/python benchmarks/composed.py --kinds gated gated-delta delta feature-gated --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from linattn import linear_attention
from linattn.exact import Hybrid
from linattn.exact.forms.chunked import causal_window_parts
from linattn.exact.forms.composed import softmax_average
from linattn.feature_maps import create

KINDS = ("gated", "gated-delta", "delta", "feature-gated")


def linear_options(kind: str, x: dict[str, torch.Tensor]) -> dict[str, Any]:
    if kind == "gated":
        return {"log_gate": x["gate"]}
    if kind == "feature-gated":
        return {"log_gate": x["feature_gate"]}
    options: dict[str, Any] = {"update": "delta", "beta": x["beta"]}
    if kind == "gated-delta":
        options["log_gate"] = x["gate"]
    return options


def exact_only(kind: str, x: dict[str, torch.Tensor], window: int, sinks: int) -> torch.Tensor:
    """The window's exact part alone, as the composed route computes it (it maps q and the keys, which the linear
    part then reads): beside an additive part the mass form (the softmax average A and the mass M, both read by the
    combiner), beside the delta rule the softmax average alone (a factor turns off the mass)."""
    fmap = create("elu", head_dim=x["q"].shape[-1])
    delta = kind in ("delta", "gated-delta")
    hybrid = Hybrid(lambda t, is_query: fmap(t), log_space=False, window=window, sinks=sinks,
                    factor=torch.ones(()) if delta else None, scale=x["q"].shape[-1] ** -0.5, eps=1e-6,
                    min_denom=None)
    exact = causal_window_parts(hybrid, x["q"], x["k"], x["v"], None, None, 64, linear_part=False).exact
    if delta:
        return softmax_average(exact)
    return exact[0] + exact[2].unsqueeze(-1)  # A and M: what the shared normaliser reads


def timed(fn: Callable[[], torch.Tensor], clock: Callable[[], float]) -> float:
    start = clock()
    fn().sum().backward()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=["gated", "gated-delta"], choices=KINDS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (steadier on a machine others load; counts every thread)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.n)
    base = {name: torch.randn(*shape, args.dim, generator=gen) for name in ("q", "k", "v")}
    base["gate"] = F.logsigmoid(torch.randn(*shape, generator=gen) + 4)
    base["feature_gate"] = F.logsigmoid(torch.randn(*shape, args.dim, generator=gen) + 4)
    base["beta"] = torch.rand(*shape, generator=gen)
    print(f"threads={args.threads} B=1 H={args.heads} D={args.dim} N={args.n} W={args.window} S={args.sinks} "
          f"rounds={args.rounds} clock={args.clock} (forward + backward)")
    print(f"{'linear part':>14} {'linear ms':>10} {'exact ms':>9} {'composed ms':>12} {'composed/(linear+exact)':>24}")
    for kind in args.kinds:
        def fresh() -> dict[str, torch.Tensor]:
            return {name: t.clone().requires_grad_() for name, t in base.items()}

        def linear(kind: str = kind) -> torch.Tensor:
            x = fresh()
            return linear_attention(x["q"], x["k"], x["v"], causal=True, **linear_options(kind, x))

        def exact(kind: str = kind) -> torch.Tensor:
            return exact_only(kind, fresh(), args.window, args.sinks)

        def composed(kind: str = kind) -> torch.Tensor:
            x = fresh()
            return linear_attention(x["q"], x["k"], x["v"], causal=True, window=args.window, sinks=args.sinks,
                                    **linear_options(kind, x))

        for fn in (linear, exact, composed):  # warm-up
            timed(fn, clock)
        times: dict[str, list[float]] = {"linear": [], "exact": [], "composed": []}
        ratios = []
        for _ in range(args.rounds):
            for name, fn in (("linear", linear), ("exact", exact), ("composed", composed)):
                times[name].append(timed(fn, clock))
            ratios.append(times["composed"][-1] / (times["linear"][-1] + times["exact"][-1]))
        median = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        print(f"{kind:>14} {median['linear']:>10.1f} {median['exact']:>9.1f} {median['composed']:>12.1f} "
              f"{statistics.median(ratios):>17.3f} ({min(ratios):.3f}–{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
