"""Multi-query associative recall (MQAR): accuracy against recurrent state size, on CPU in minutes.

The task (Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language Models"): a sequence
opens with P key/value pairs ``k1 v1 k2 v2 …``; later, each key appears once more, at a random place in the rest
of the sequence (filler token 0 elsewhere), and the model must output that key's value at the key's position.
Keys are drawn without repetition from the first half of the vocabulary, values from the second half. Accuracy
is the fraction of queries answered exactly (argmax), on held-out sequences drawn with a different seed.

Every model is the same two-block stack — embedding, then per block x += mixer(conv(norm(x))) and
x += MLP(norm(x)), then a norm and the output head tied to the embedding — with no positional embedding; only the
mixer differs. The short causal convolution (width 4; Zoology's and DeltaNet's models have one too) lets a token
see its predecessors, so one attention layer can pair a key with the value after it; every row, softmax included,
has it. It mixes all channels rather than each alone (as theirs, which act on q, k and v after the projections,
do): here it sits before the mixer, whose projections are inside ``LinearAttention``.

Rows: ``softmax`` (torch's scaled_dot_product_attention, causal, with QK-norm: unit q and k times a learned
temperature, which left a plateau of several hundred steps fewer than the plain 1/√D scale here), ``elu``
(additive, normalised), ``hedgehog`` (the learned Hedgehog map, additive), ``retnet`` (additive, elu, RetNet's fixed
per-head decays), ``delta`` (the delta rule, ``update="delta"``: identity features, L2-normalised, β =
sigmoid(W_β x)) and ``gated-delta`` (the same with ``gate="token"``, a per-token decay). Every linear row is a
``linattn.nn.LinearAttention`` layer with its defaults otherwise (no ``short_conv`` or ``output_gate``: the block's
convolution serves every row alike). State size per layer: H·F·Dv for the linear rows, the K and V cache at the
sequence length (2·N·E) for softmax.

The window rows put exact softmax over the last ``WINDOW`` = 8 keys — shorter than the distance from a pair to its
query — alone (``window``: the QK-normed softmax row with a band mask) or beside a linear part, the window op
composed with it (``window-elu``, ``window-delta``, ``window-gated-delta``: the layer with ``window=8``); their
state adds the window's keys and values (2·W·E).

The defaults — N = 64, 8 pairs, a vocabulary of 256, d_model 64 with 1 or 4 heads, 800 steps of 32 sequences —
are smaller than Zoology's (N up to 512, vocabulary 8192) so that a model trains on two CPU threads in minutes;
every size is an option. Results go to a JSON file, one entry per (row, setting), written after each model: an
interrupted run loses only the model in training, and a rerun skips what is there (a changed option is a new
entry).

    python benchmarks/mqar.py --plot docs/results/mqar.png   # the sweep of docs/recall.md
    python benchmarks/mqar.py --quick --json /tmp/q.json      # a tiny setting (the test's), seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from linattn._json import dumps
from linattn.nn import LinearAttention

ROWS = ("softmax", "elu", "hedgehog", "retnet", "delta", "gated-delta", "window", "window-elu", "window-delta",
        "window-gated-delta")
# the window rows: exact softmax over the last WINDOW keys (shorter than the distance from a pair to its query),
# alone ("window") and beside a linear part (the window op composed with it, docs/window.md)
WINDOW = 8
IGNORE = -100  # the label of every position that is not a query
QK_SCALE = 10.0  # the softmax temperature at initialisation: cosine 1 against 0 weighs e^10 ≈ 2·10^4 times more


@dataclass(frozen=True)
class Setting:
    """One trained model: the row (the mixer), its size and the task it is trained on."""

    row: str
    d_model: int
    num_heads: int
    seq_len: int
    num_pairs: int
    vocab: int
    steps: int
    batch: int
    lr: float
    seed: int

    @property
    def key(self) -> str:
        return "|".join(f"{name}={value}" for name, value in asdict(self).items())


def make_mqar(num_seqs: int, seq_len: int, num_pairs: int, vocab: int, generator: torch.Generator) -> tuple[
        torch.Tensor, torch.Tensor]:
    """``num_seqs`` MQAR sequences: inputs (B, N) and labels (B, N), the value at each query position, else −100.

    Positions 0 … 2P−1 hold the pairs; the rest is split into slots of two tokens, P of which (chosen at random)
    hold a query key followed by its value, so that next-token prediction at the key is the answer.
    """
    half = vocab // 2
    slots = (seq_len - 2 * num_pairs) // 2
    if num_pairs > half - 1 or slots < num_pairs:
        raise ValueError(f"MQAR: {num_pairs} pairs need vocab > {2 * num_pairs + 1} and seq_len ≥ {4 * num_pairs}, "
                         f"got vocab={vocab}, seq_len={seq_len}")
    # distinct keys per sequence: the first P of a random permutation of 1 … half−1
    keys = torch.rand(num_seqs, half - 1, generator=generator).argsort(dim=-1)[:, :num_pairs] + 1  # (B, P)
    values = torch.randint(half, vocab, (num_seqs, num_pairs), generator=generator)  # (B, P)
    inputs = torch.zeros(num_seqs, seq_len, dtype=torch.long)
    inputs[:, 0:2 * num_pairs:2], inputs[:, 1:2 * num_pairs:2] = keys, values
    labels = torch.full_like(inputs, IGNORE)
    order = torch.rand(num_seqs, num_pairs, generator=generator).argsort(dim=-1)  # which pair each query asks
    chosen = torch.rand(num_seqs, slots, generator=generator).argsort(dim=-1)[:, :num_pairs]  # which slots
    where = 2 * num_pairs + 2 * chosen  # (B, P) positions of the query keys
    rows = torch.arange(num_seqs).unsqueeze(-1)
    inputs[rows, where] = keys.gather(1, order)
    inputs[rows, where + 1] = values.gather(1, order)
    labels[rows, where] = values.gather(1, order)
    return inputs, labels


class Softmax(nn.Module):
    """The reference mixer: causal softmax attention (SDPA), no positional encoding (the convolution orders)."""

    def __init__(self, d_model: int, num_heads: int, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        # QK-norm: unit q and k times a learned temperature per head
        self.log_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(QK_SCALE)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)  # each (B, H, N, D)
        q, k = F.normalize(q, dim=-1) * self.log_scale.exp(), F.normalize(k, dim=-1)
        if self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        else:  # the last `window` keys only: t − W < j ≤ t
            distance = torch.arange(x.shape[1]).unsqueeze(-1) - torch.arange(x.shape[1])
            band = (distance >= 0) & (distance < self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=1.0)
        return self.out(out.transpose(1, 2).flatten(-2))


def make_mixer(row: str, d_model: int, num_heads: int) -> nn.Module:
    if row == "softmax":
        return Softmax(d_model, num_heads)
    if row == "hedgehog":
        return LinearAttention(d_model, num_heads, causal=True, feature_map=row)
    if row == "retnet":
        return LinearAttention(d_model, num_heads, causal=True, feature_map="elu", decay="retnet")
    if row == "window":
        return Softmax(d_model, num_heads, window=WINDOW)
    window = WINDOW if row.startswith("window-") else None
    linear = row.removeprefix("window-")
    if linear == "elu":
        return LinearAttention(d_model, num_heads, causal=True, feature_map="elu", window=window)
    if linear in ("delta", "gated-delta"):  # the block's convolution in place of the layer's short_conv
        return LinearAttention(d_model, num_heads, causal=True, feature_map="identity", update="delta",
                               gate="token" if linear == "gated-delta" else None, window=window)
    raise ValueError(f"unknown row {row!r}; expected one of {ROWS}")


def state_size(setting: Setting) -> int:
    """Numbers of the recurrent state per layer: H·F·Dv, or the softmax K/V cache at the sequence length."""
    head_dim = setting.d_model // setting.num_heads
    if setting.row in ("softmax", "window"):
        return 2 * (WINDOW if setting.row == "window" else setting.seq_len) * setting.d_model
    features = 2 * head_dim if setting.row == "hedgehog" else head_dim  # Hedgehog: [softmax(z), softmax(−z)]
    window = 2 * WINDOW * setting.d_model if setting.row.startswith("window-") else 0  # the window's K and V
    return setting.num_heads * features * head_dim + window


class Block(nn.Module):
    def __init__(self, row: str, d_model: int, num_heads: int, conv: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        # causal: padded on both sides by conv − 1, the right end cut off
        self.conv = nn.Conv1d(d_model, d_model, conv, padding=conv - 1)
        self.mixer = make_mixer(row, d_model, num_heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x).transpose(1, 2)  # (B, E, N)
        h = self.conv(h)[..., : x.shape[1]].transpose(1, 2)  # (B, N, E)
        x = x + self.mixer(h)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, setting: Setting, layers: int = 2, conv: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(setting.vocab, setting.d_model)
        self.blocks = nn.ModuleList(Block(setting.row, setting.d_model, setting.num_heads, conv) for _ in range(layers))
        self.norm = nn.LayerNorm(setting.d_model)
        self.head = nn.Linear(setting.d_model, setting.vocab)
        self.head.weight = self.embed.weight  # tied: answering is copying a value token seen earlier

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the predictions at the query positions only (the head's cost is paid there alone)."""
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        asked = labels != IGNORE
        logits = self.head(self.norm(x[asked]))  # (queries, V)
        return F.cross_entropy(logits, labels[asked]), logits.argmax(-1) == labels[asked]


def train(setting: Setting, progress: Any = None) -> dict[str, Any]:
    torch.manual_seed(setting.seed)
    model = Model(setting)
    data = torch.Generator().manual_seed(setting.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.lr, weight_decay=0.1)
    warmup, cooldown = max(1, setting.steps // 20), max(1, setting.steps // 5)

    def lr_at(step: int) -> float:  # linear warm-up, constant, linear decay to 0 over the last fifth
        return min(1.0, (step + 1) / warmup, (setting.steps - step) / cooldown)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(setting.steps):
        inputs, labels = make_mqar(setting.batch, setting.seq_len, setting.num_pairs, setting.vocab, data)
        loss, _ = model(inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress.update(1)
    seconds = time.perf_counter() - start
    return {**asdict(setting), "state_size": state_size(setting), "train_loss": loss.item(),
            "accuracy": evaluate(model, setting), "train_seconds": round(seconds, 1)}


@torch.no_grad()
def evaluate(model: Model, setting: Setting, num_seqs: int = 512) -> float:
    """Exact-match accuracy over the queries of ``num_seqs`` held-out sequences (a seed training never uses)."""
    model.eval()
    held_out = torch.Generator().manual_seed(10_000 + setting.seed)
    correct = total = 0
    for start in range(0, num_seqs, 128):
        inputs, labels = make_mqar(min(128, num_seqs - start), setting.seq_len, setting.num_pairs, setting.vocab,
                                   held_out)
        _, hits = model(inputs, labels)
        correct, total = correct + int(hits.sum()), total + hits.numel()
    return correct / total


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(dumps(results, indent=1, sort_keys=True) + "\n")  # strict JSON
    os.replace(partial, path)  # atomic: an interrupt never leaves half a file


def table(entries: list[dict[str, Any]]) -> str:
    """A markdown table: one line per model, sorted by row and state size."""
    lines = ["| row | d_model | heads | state / layer | accuracy | final loss | steps | train s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in sorted(entries, key=lambda e: (ROWS.index(e["row"]), e["state_size"])):
        lines.append(f"| {e['row']} | {e['d_model']} | {e['num_heads']} | {e['state_size']:,} | {e['accuracy']:.3f} "
                     f"| {e['train_loss']:.3f} | {e['steps']} | {e['train_seconds']:.0f} |")
    return "\n".join(lines)


def plot(entries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    labels = []
    for row in ROWS:
        points = sorted((e["state_size"], e["accuracy"]) for e in entries if e["row"] == row)
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        (line,) = axes.plot(xs, ys, marker="o", label=row)
        labels.append(axes.text(xs[-1], ys[-1], f" {row}", color=line.get_color(), fontsize=8))
    try:
        from adjustText import adjust_text

        adjust_text(labels, ax=axes)
    except ImportError:  # labels stay where they were put; the legend names every line anyway
        pass
    first = entries[0]
    axes.set(xscale="log", xlabel="state size per layer (numbers; softmax: K/V cache at N)", ylabel="accuracy",
             ylim=(-0.02, 1.02), title=f"MQAR: N={first['seq_len']}, {first['num_pairs']} pairs, "
                                       f"vocab {first['vocab']}, 2 layers")
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--d-model", type=int, nargs="+", default=[64])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("docs/results/mqar.json"))
    parser.add_argument("--plot", type=Path, default=None, help="write the accuracy/state-size plot here")
    parser.add_argument("--quick", action="store_true", help="a tiny setting for tests: seconds, not minutes")
    parser.add_argument("--report", action="store_true", help="table and plot of what the JSON holds; train nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_model, args.heads, args.seq_len, args.pairs, args.vocab, args.steps, args.batch = (
            [16], [1], 32, 4, 64, 3, 8)
    torch.set_num_threads(args.threads)
    settings = [Setting(row, d, h, args.seq_len, args.pairs, args.vocab, args.steps, args.batch, args.lr, args.seed)
                for d in args.d_model for h in args.heads for row in args.rows]
    results = load(args.json)
    todo = [] if args.report else [s for s in settings if s.key not in results]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(settings)} models, "
          f"{sum(s.key in results for s in settings)} already in {args.json}")
    bar = _bar(len(todo) * args.steps)
    for setting in todo:
        if bar is not None:
            bar.set_description(f"{setting.row} d={setting.d_model} h={setting.num_heads}")
        results[setting.key] = train(setting, bar)
        save(args.json, results)
        entry = results[setting.key]
        print(f"{setting.row:>12} d={setting.d_model:<4} h={setting.num_heads} state={entry['state_size']:>8,} "
              f"acc={entry['accuracy']:.3f} loss={entry['train_loss']:.3f} {entry['train_seconds']:.0f}s",
              flush=True)
    if bar is not None:
        bar.close()
    entries = [results[s.key] for s in settings if s.key in results]
    print(table(entries))
    if args.plot is not None:
        plot(entries, args.plot)


def _bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience
        return None
    return tqdm(total=total, unit="step", leave=False, disable=None)


if __name__ == "__main__":
    main()
