"""Context-parallel linear attention on this machine: time and bytes communicated per call, against world size and N.

For each world size W (processes started with torch.multiprocessing, gloo over loopback, one thread each) and
total sequence length N, one causal call of ``context_parallel_attention`` on slices of N/W tokens, forward and
backward, is timed; so are its collectives alone (the all-gather of the summaries, the reduce-scatter of their
gradient), one non-causal call (elu: the all-reduce path), and, in the same run, single-process
``linear_attention`` on the whole sequence, causal and non-causal (1 thread, rank 0 while the others wait).
Rounds alternate all five and the median is reported.

Bytes are counted from the tensors handed to the collectives: the payload one rank contributes (state dtype, fp32
here) and the all-gather's output (W payloads plus W headers). A ring all-gather moves (W−1) payloads into and out
of every rank; a reduce-scatter the same in backward. For contrast, "ring KV" is what Ring Attention would send
per rank and pass (forward): its K and V slice, W−1 times, i.e. (W−1)/W · N·Hkv·(Dk+Dv) numbers.

    python benchmarks/distributed.py                              # W = 2, 4; N = 4k, 16k, 64k
    python benchmarks/distributed.py --worlds 2 --lengths 8192 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import linattn
from linattn.distributed import _exchange, context_parallel_attention

BATCH, HEADS, HEAD_DIM = 1, 8, 64


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()  # the call ends when the slowest rank ends
    return time.perf_counter() - start


def _measure(rank: int, world: int, n: int, rounds: int, gather: Any, sent: list[int]) -> dict[str, Any]:
    """One (W, N) row: the three timings (median of ``rounds``) and the bytes of one call's all-gather."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
    parts = [torch.tensor_split(x, world, dim=-2)[rank].clone().requires_grad_() for x in (q, k, v)]
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    features = HEAD_DIM  # elu: F = Dk
    payload = BATCH * HEADS * (features * HEAD_DIM + features + 1)
    gathered, grad = torch.empty(world * payload), torch.empty(payload)

    def parallel() -> None:
        context_parallel_attention(*parts, causal=True, validate=False).sum().backward()

    def single() -> None:
        if rank == 0:
            linattn.linear_attention(*full, causal=True).sum().backward()

    def parallel_noncausal() -> None:  # elu: the all-reduce path
        context_parallel_attention(*parts, causal=False, validate=False).sum().backward()

    def single_noncausal() -> None:
        if rank == 0:
            linattn.linear_attention(*full, causal=False).sum().backward()

    def collectives() -> None:
        gather(gathered, torch.zeros(payload), None)
        _exchange._reduce_scatter(grad, gathered, None)

    calls = {"parallel": parallel, "single": single, "collectives": collectives,
             "parallel_noncausal": parallel_noncausal, "single_noncausal": single_noncausal}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_timed(fn))
    sent.clear()
    parallel()
    gathered_bytes = sum(sent)
    reduced: list[int] = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    parallel_noncausal()
    dist.all_reduce = all_reduce
    return {
        "world": world, "n": n, **{f"{key}_ms": 1e3 * statistics.median(t) for key, t in times.items()},
        "payload_bytes": payload * 4, "gathered_bytes": gathered_bytes, "all_reduce_bytes": reduced,
        "ring_allgather_bytes_per_rank": (world - 1) * payload * 4,
        "ring_kv_bytes_per_rank": (world - 1) * (n // world) * BATCH * HEADS * 2 * HEAD_DIM * 4,
    }


def _worker(rank: int, world: int, directory: str, lengths: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    sent: list[int] = []
    original = _exchange._gather

    def counting(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
        sent.append(output.numel() * output.element_size())
        original(output, tensor, group)

    _exchange._gather = counting  # type: ignore[assignment]
    rows = [_measure(rank, world, n, rounds, original, sent) for n in lengths]
    if rank == 0:
        with open(os.path.join(directory, "rows.json"), "w") as handle:
            json.dump(rows, handle)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as directory:
            mp.spawn(_worker, args=(world, directory, args.lengths, args.rounds), nprocs=world, join=True)
            with open(os.path.join(directory, "rows.json")) as handle:
                rows += json.load(handle)
    print(f"causal, fp32, B·H = {BATCH * HEADS}, Dk = Dv = F = {HEAD_DIM} (elu), gloo on loopback, 1 thread per "
          f"process, {os.cpu_count()} cores; median of {args.rounds} rounds, forward + backward")
    print("| W | N | CP call ms | single-process ms | CP / single | collectives ms | payload / rank | all-gather out "
          "| ring all-gather sent / rank | Ring Attention KV sent / rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['n']} | {r['parallel_ms']:.1f} | {r['single_ms']:.1f} | "
              f"{r['parallel_ms'] / r['single_ms']:.2f} | {r['collectives_ms']:.2f} | {_kib(r['payload_bytes'])} | "
              f"{_kib(r['gathered_bytes'])} | {_kib(r['ring_allgather_bytes_per_rank'])} | "
              f"{_kib(r['ring_kv_bytes_per_rank'])} |")
    _noncausal_table(rows)


def _noncausal_table(rows: list[dict[str, Any]]) -> None:
    print("\nnon-causal (elu: one all-reduce of one state each way, no header: validate=False)")
    print("| W | N | CP call ms | single-process ms | CP / single | all-reduce buffers forward, backward |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sizes = ", ".join(_kib(b) for b in r["all_reduce_bytes"])
        print(f"| {r['world']} | {r['n']} | {r['parallel_noncausal_ms']:.1f} | {r['single_noncausal_ms']:.1f} | "
              f"{r['parallel_noncausal_ms'] / r['single_noncausal_ms']:.2f} | {sizes} |")


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


if __name__ == "__main__":
    main()
