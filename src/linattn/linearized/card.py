"""The card of a linearized folder: ``README.md`` written from its ``results.json``, and a plot of perplexity by
token position (when matplotlib is installed).

The table has one row per measured model (the original, the softmax window of equal memory, with a cache the same
student with the cache's pairs in its window instead, the linearized model): held-out perplexity, the repeated
passage's perplexity and passkey retrieval per filler length as hits of trials with a 95 % Wilson score interval
(Wilson, 1927, "Probable inference, the law of succession, and statistical inference"): with a handful of trials
an accuracy alone says little.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..evaluate.perplexity import score_tokens
from ..evaluate.report import markdown_table, number

POSITION_BINS = 8
WIDER_ROW = "the same student"  # the row of the student with the cache's pairs in its window instead
Z95 = 1.959964  # the standard normal's 97.5 % quantile


def wilson_interval(hits: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``hits / trials`` (two-sided, 95 % by default)."""
    if trials < 1:
        return 0.0, 1.0
    p = hits / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def perplexity_by_position(model: Any, tokenizer: Any, text: str, max_tokens: int,
                           bins: int = POSITION_BINS) -> list[list[float]]:
    """[first position, last position, perplexity] of ``bins`` equal spans of the first ``max_tokens`` tokens of
    ``text`` read as one sequence (:func:`~linattn.evaluate.perplexity.score_tokens`): how a model fares as the
    context grows."""
    ids = torch.as_tensor(tokenizer(text)["input_ids"][:max_tokens]).reshape(1, -1)  # (1, N)
    logp = score_tokens(model, ids, 1)[0]  # (N − 1,): token t + 1 given tokens ≤ t
    edges = torch.linspace(0, logp.numel(), bins + 1).round().long().tolist()
    return [[a + 1, b, math.exp(-float(logp[a:b].mean()))] for a, b in zip(edges, edges[1:], strict=False) if b > a]


def _passkey_cell(accuracy: float, trials: int) -> str:
    hits = round(accuracy * trials)
    low, high = wilson_interval(hits, trials)
    return f"{hits}/{trials} [{low:.2f}, {high:.2f}]"


def _plot(result: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the card stands without its plot
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in result["rows"]:
        spans = row.get("by_position")
        if spans:
            ax.plot([(a + b) / 2 for a, b, _ in spans], [p for _, _, p in spans], marker="o", label=row["name"])
    ax.set(xlabel="token position", ylabel="perplexity", yscale="log", title="Held-out perplexity by position")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial-{os.getpid()}.png")
    fig.savefig(partial, dpi=120)  # through a temporary name, as every file of the folder
    plt.close(fig)
    os.replace(partial, path)
    return True


def card_lines(result: dict[str, Any], plotted: bool) -> list[str]:
    """The Markdown of the card."""
    trials = result["passkey_trials"]
    lengths = list(result["rows"][0]["passkey"]) if result["rows"] else []
    stages = result.get("stages", {})
    cache = int(result.get("sparse_cache") or 0)
    top = result.get("sparse_cache_top")
    shared = f" (what the floor leaves shared by the {top} highest-scoring heads)" if top else ""
    per_head = (f" on average, split across heads by their retrieval score{shared},"
                if result.get("sparse_cache_heads") == "retrieval" else ",")
    weight = float(result.get("sparse_cache_linear_weight", 1.0))
    weighed = f" (the linear part weighed {weight:g} beside it)" if cache and weight != 1 else ""
    how = ("trained and measured in place" if result.get("sparse_cache_trained", True) else
           "measured in place, added after training (the student was trained without it)")
    kept = (f" and a sparse exact cache of {cache} older key/value pairs per head{per_head} {how}{weighed}"
            if cache else "")
    part = result.get("student_summary") or "Hedgehog maps, the additive state beside the softmax window"
    gaps = list(result["rows"][0].get("repeat_by_gap") or {}) if result["rows"] else []
    lines = [
        f"# {result['model']}, linearized", "",
        f"Every attention layer of `{result['model']}` is linear attention: {part} (recent tokens: "
        f"{result['window']}, sink tokens: {result['sinks']}){kept}; its memory per layer stays the same at any "
        "context length.",
        "", "Load it (offline: the base model is loaded from the name or path recorded in `linattn.json`):", "",
        "    model, tokenizer = linattn.linearized.load_linearized(\"THIS_FOLDER\")",
        "    linattn generate THIS_FOLDER --prompt \"...\" --compare-softmax", "",
        "## Measured", "",
        f"Held-out text: {result['heldout_source']}. Repeated passage: {result['passage_tokens']} tokens, then "
        f"{result['gap_tokens']} other tokens, then the passage again (only the repeat scored; passages: "
        f"{result['repeat_trials']}). Passkey: hits of {trials} trials per filler length, with the 95 % "
        "Wilson interval. The window row is softmax over the same window" + (" widened by the cache's pairs"
                                                                             if cache else "")
        + " and sinks without a linear part: the softmax model of equal memory."
        + (" The row of the same student has its maps and gates with the cache's pairs in its window instead of "
           "the cache (not trained at that window): the linear model of equal memory."
           if any(row["name"].startswith(WIDER_ROW) for row in result["rows"]) else "")
        + (f" Repeated passage N back: the same probe with a gap of N tokens, on {result.get('probe_source')} "
           "(— where the text is too short for that gap)." if gaps else ""), "",
        *markdown_table(["model", "perplexity", "repeated passage", *(f"repeat {n} back" for n in gaps),
                         *(f"passkey {n}" for n in lengths)],
                        [[row["name"], number(row["perplexity"], 2), number(row["repeat_perplexity"], 2),
                          *(number((row.get("repeat_by_gap") or {}).get(n), 2) for n in gaps),
                          *(_passkey_cell(v, trials) for v in row["passkey"].values())] for row in result["rows"]],
                        align="lrr" + "r" * (len(gaps) + len(lengths))),
        "",
    ]
    if result.get("fine_tuned"):
        lines += ["**Fine-tuned:** LoRA adapters of the attention projections were trained with the maps (see below): "
                  "the linearized row is not the base model's own weights.", ""]
    if plotted:
        lines += ["![perplexity by position](perplexity_by_position.png)", ""]
    if stages:
        lines += ["## How it was made", ""]
        lines += [f"- {name}: {info.get('summary', '')} ({info.get('seconds', 0):.0f} s)" for name, info in
                  stages.items()]
        lines += [""]
    taken = result.get("rows_taken") or {}
    if taken:
        lines += ["Taken as measured by another run on the same inputs (the base model, texts and probes): "
                  + "; ".join(f"{name}, from {where}" for name, where in taken.items()) + ".", ""]
    threads = int(result["threads"])
    lines += [f"{threads} thread{'s' if threads != 1 else ''}. The numbers are in `results.json`."]
    return lines


def write_card(result: dict[str, Any], directory: str) -> str:
    """Write ``README.md`` (and ``perplexity_by_position.png`` when possible) into ``directory``; returns the
    card's path."""
    from .folder import atomic_write

    plotted = _plot(result, os.path.join(directory, "perplexity_by_position.png"))
    path = os.path.join(directory, "README.md")
    atomic_write(path, "\n".join(card_lines(result, plotted)) + "\n")
    return path
