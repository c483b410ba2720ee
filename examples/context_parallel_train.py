"""Context-parallel training: two processes share every sequence, each holding half of its tokens.

A small causal language model (embeddings, two blocks of linear attention + MLP, a head) learns next-token
prediction on sequences drawn from a fixed random bigram table. The model is built once with plain
``LinearAttention`` layers and once with ``ContextParallel(LinearAttention(...))`` — the one line that changes —
and wrapped in ``DistributedDataParallel`` for the gradient sum across the two ranks. Both loss curves are printed
side by side: they agree to rounding (fp32: ~1e-6; the test runs this file in fp64 and asks for 1e-10).

    python examples/context_parallel_train.py            # 2 processes on CPU (gloo), 30 steps
    python examples/context_parallel_train.py --steps 5 --dtype float64

Why the loss is scaled by the world size: each rank's backward yields the gradient of its own tokens' loss (the
cross-rank parts arrive through the context-parallel collective), so the full-sequence gradient is the *sum* over
ranks, while DDP averages; a per-rank loss of (sum over own tokens) / (all tokens) × world restores the sum.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from linattn.distributed import ContextParallel
from linattn.nn import LinearAttention

VOCAB, WIDTH, HEADS, TOKENS, BATCH, LEARNING_RATE = 16, 32, 4, 64, 4, 3e-3


class Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None = None, context_parallel: bool = False) -> None:
        super().__init__()
        blocks = []
        for _ in range(2):
            attention: nn.Module = LinearAttention(WIDTH, HEADS, causal=True)
            if context_parallel:
                attention = ContextParallel(attention, group)  # ← the one line a model author adds
            blocks.append(Block(attention))
        self.embed, self.blocks, self.head = nn.Embedding(VOCAB, WIDTH), nn.Sequential(*blocks), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))  # (B, N, VOCAB)


def batch(step: int) -> torch.Tensor:
    """(BATCH, TOKENS + 1) tokens from a fixed bigram table, the same on every rank for a given step."""
    table = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)
    g = torch.Generator().manual_seed(1000 + step)
    tokens = [torch.randint(VOCAB, (BATCH,), generator=g)]
    for _ in range(TOKENS):
        tokens.append(torch.multinomial(table[tokens[-1]], 1, generator=g).squeeze(-1))
    return torch.stack(tokens, dim=1)


def train_single(steps: int, dtype: torch.dtype = torch.float32) -> list[float]:
    """The reference: one process, whole sequences."""
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(steps):
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_context_parallel(
    rank: int,
    world: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
) -> list[float]:
    """This rank's part of context-parallel training (torch.distributed already initialised); the loss curve.

    ``groups``: (data-parallel group for DDP, context-parallel group for the attention), both of the ``world``
    ranks that share the sequences; by default the whole world and a new group of the same ranks.
    """
    # a group of its own for the attention collectives, so that they never interleave with DDP's gradient buckets
    data_group, cp_group = groups if groups is not None else (None, dist.new_group(list(range(world))))
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(cp_group, context_parallel=True).to(dtype), process_group=data_group)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(steps):
        tokens = batch(step)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # this rank's contiguous slice of every sequence: (B, N) → (B, N_r)
        inputs, targets = (torch.tensor_split(x, world, dim=1)[rank] for x in (inputs, targets))
        logits = model(inputs)
        local_sum = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        optimizer.zero_grad()
        (local_sum / (BATCH * TOKENS) * world).backward()
        optimizer.step()
        total = local_sum.detach().clone()
        dist.all_reduce(total, group=data_group)  # for the log only: the loss over whole sequences
        losses.append(total.item() / (BATCH * TOKENS))
    return losses


def _worker(rank: int, world: int, directory: str, steps: int, dtype_name: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    losses = train_context_parallel(rank, world, steps, getattr(torch, dtype_name))
    if rank == 0:
        torch.save(losses, os.path.join(directory, "losses.pt"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_worker, args=(args.world, directory, args.steps, args.dtype), nprocs=args.world, join=True)
        parallel = torch.load(os.path.join(directory, "losses.pt"))
    single = train_single(args.steps, getattr(torch, args.dtype))
    print(f"step  single-process  context-parallel ({args.world} ranks)  difference")
    for step, (a, b) in enumerate(zip(single, parallel, strict=True)):
        print(f"{step:4d}  {a:14.8f}  {b:16.8f}  {abs(a - b):10.2e}")
    print(f"max difference: {max(abs(a - b) for a, b in zip(single, parallel, strict=True)):.2e}")


if __name__ == "__main__":
    main()
