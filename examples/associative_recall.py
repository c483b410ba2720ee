"""A small decoder-only linear-attention model, trained briefly on associative recall, that generates in O(1)/token.

The task (multi-query associative recall): a sequence lists key→value pairs, then asks for keys again; after each
queried key the model must emit the value that followed it earlier::

    k3 v7 k1 v2 k9 v0 ... | k1 v2 k9 v0 ...        (loss only on the values after queried keys)

The model trains with the parallel (chunked) form over whole sequences and generates with the recurrent state,
one token at a time: both give the same logits (``python examples/associative_recall.py`` prints the gap).

Each block: x ← x + Attn(mix(LN(x))), x ← x + MLP(LN(x)), where mix(h)_t = h_t + W·h_{t−1} is a one-token shift
(linear attention has no position information of its own; the shift lets a value token see the key before it).
Decoding carries, per block, the attention state and the previous normalised hidden: O(1) memory and time in t.

Run: ``python examples/associative_recall.py [--steps 250] [--pairs 8]``
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

from linattn import LinearAttentionState
from linattn.nn import LinearAttention


@dataclass
class RecallTask:
    """Token ids: keys 0..num_keys−1, values num_keys..num_keys+num_values−1."""

    num_pairs: int = 8
    num_keys: int = 16
    num_values: int = 16

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 4 * self.num_pairs

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, 4P) and targets (B, 4P): the next token where it is a recalled value, −100 elsewhere."""
        keys = torch.rand(size, self.num_keys, generator=generator).argsort(-1)[:, : self.num_pairs]  # distinct
        values = self.num_keys + torch.randint(self.num_values, (size, self.num_pairs), generator=generator)
        order = torch.rand(size, self.num_pairs, generator=generator).argsort(-1)
        asked, answers = keys.gather(1, order), values.gather(1, order)
        tokens = torch.stack([torch.stack([keys, values], -1), torch.stack([asked, answers], -1)], 1)
        tokens = tokens.flatten(1)  # (B, 2, P, 2) → (B, 4P): pairs, then queries with answers
        targets = torch.full_like(tokens, -100)
        half = 2 * self.num_pairs
        targets[:, half:-1:2] = tokens[:, half + 1 :: 2]  # at a queried key, predict its value
        return tokens, targets


@dataclass
class BlockCache:
    """What one block carries between generated tokens: the attention state and the previous LN(x) (B, E)."""

    state: LinearAttentionState
    previous: torch.Tensor


class Block(nn.Module):
    def __init__(self, width: int, heads: int, feature_map: str) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.shift = nn.Linear(width, width, bias=False)
        self.attn = LinearAttention(width, heads, causal=True, feature_map=feature_map)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(
        self, x: torch.Tensor, cache: BlockCache | None = None, *, want_cache: bool = False
    ) -> tuple[torch.Tensor, BlockCache | None]:
        h = self.attn_norm(x)  # (B, N, E)
        first = cache.previous.unsqueeze(1) if cache is not None else torch.zeros_like(h[:, :1])
        previous = torch.cat([first, h[:, :-1]], dim=1)  # (B, N, E): h_{t−1}, the cached one for t = 0
        state = cache.state if cache is not None else None
        attended, new_state = self.attn(h + self.shift(previous), state=state, return_state=True)
        x = x + attended
        x = x + self.mlp(self.mlp_norm(x))
        return x, BlockCache(new_state, h[:, -1]) if want_cache else None


class RecallLM(nn.Module):
    """Embedding → blocks → LayerNorm → logits. ``forward`` is parallel; ``prefill`` + ``step`` generate."""

    def __init__(
        self, vocab_size: int, *, width: int = 64, heads: int = 4, layers: int = 2, feature_map: str = "elu"
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(width, heads, feature_map) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def _run(
        self, tokens: torch.Tensor, caches: list[BlockCache] | None, want_cache: bool
    ) -> tuple[torch.Tensor, list[BlockCache]]:
        x = self.embed(tokens)  # (B, N, E)
        new_caches = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, caches[i] if caches is not None else None, want_cache=want_cache)
            if cache is not None:
                new_caches.append(cache)
        return self.head(self.norm(x)), new_caches  # (B, N, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, N, V) for every position at once (training)."""
        return self._run(tokens, None, False)[0]

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[BlockCache]]:
        """Logits for a prompt (B, N) in one parallel pass, and the caches to continue from."""
        return self._run(tokens, None, True)

    def step(self, token: torch.Tensor, caches: list[BlockCache]) -> tuple[torch.Tensor, list[BlockCache]]:
        """Logits (B, V) for one new token (B,) after the cached ones: O(1) in the number already seen."""
        logits, caches = self._run(token.unsqueeze(1), caches, True)
        return logits[:, 0], caches

    def step_by_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, N, V) computed one token at a time from the very first: the decoding path, all of it."""
        logits, caches = self.prefill(tokens[:, :1])
        outs = [logits[:, 0]]
        for t in range(1, tokens.shape[1]):
            step_logits, caches = self.step(tokens[:, t], caches)
            outs.append(step_logits)
        return torch.stack(outs, dim=1)


def recall_accuracy(model: RecallLM, tokens: torch.Tensor, targets: torch.Tensor, *, step_by_step: bool) -> float:
    with torch.no_grad():
        logits = model.step_by_step(tokens) if step_by_step else model(tokens)
    asked = targets != -100
    return float((logits.argmax(-1)[asked] == targets[asked]).float().mean())


def train(
    task: RecallTask,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
    **model_options: object,
) -> tuple[RecallLM, list[float]]:
    """A briefly trained model and its training losses (one per step)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = RecallLM(task.vocab_size, **model_options)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then linear decay to 10 %
        optimizer, lambda step: min((step + 1) / warmup, 1.0 - 0.9 * max(0, step - warmup) / max(1, steps - warmup))
    )
    losses = []
    for step in range(steps):
        tokens, targets = task.batch(batch_size, generator)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1:5d}  loss {loss.item():.3f}")
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--feature-map", default="elu")
    args = parser.parse_args()
    task = RecallTask(num_pairs=args.pairs)
    start = time.perf_counter()
    model, _ = train(task, steps=args.steps, log_every=100, feature_map=args.feature_map)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s ({torch.get_num_threads()} threads)")
    model.eval()
    tokens, targets = task.batch(256, torch.Generator().manual_seed(1234))  # held out: another seed
    with torch.no_grad():
        parallel, sequential = model(tokens), model.step_by_step(tokens)
    gap = float((parallel - sequential).abs().max() / parallel.abs().max())
    print(f"recall accuracy (held out, chance {1 / task.num_values:.3f}): parallel "
          f"{recall_accuracy(model, tokens, targets, step_by_step=False):.3f}, token by token "
          f"{recall_accuracy(model, tokens, targets, step_by_step=True):.3f}")
    print(f"max |parallel − token-by-token| / max |logit| = {gap:.1e}")


if __name__ == "__main__":
    main()
