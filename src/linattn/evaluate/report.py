"""The ``linattn compare`` reports: ``results.json`` and ``report.md`` of the encoder and the causal-LM
comparisons, and the encoder's two PNG plots (matplotlib, imported only here, and only when installed).

The shared pieces: :func:`number` (every number of a table), :func:`markdown_table` and :func:`write_results`
(the JSON and the Markdown of one folder). The comparisons hand their results in; nothing here runs a model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .._json import dumps

# Why signed maps (identity, trig) are not ranked with the others: printed above their rows on the console and in
# report.md.
SIGNED_NOTE = ("Signed maps, not ranked: φ(q)·φ(k) can be negative, so the normaliser φ(q)·Σφ(k) can vanish or "
               "change sign (clamped at 1e-6 here) and the output's scale is arbitrary, unlike softmax's weights "
               "that sum to 1; their error against softmax is not comparable with the other maps'.")


def number(x: float | None, decimals: int = 3) -> str:
    """``x`` with ``decimals`` decimals; three significant digits for the huge values of signed maps or broken
    rows (≥ 10⁴, where decimals say nothing); "—" for a value not measured (None)."""
    if x is None:
        return "—"
    return f"{x:.{decimals}f}" if abs(x) < 1e4 else f"{x:.3g}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """The lines of a Markdown table; ``align`` has one letter per column: "l" left, "r" right (numbers)."""
    rules = {"l": "---|", "r": "---:|"}
    return ["| " + " | ".join(header) + " |", "|" + "".join(rules[a] for a in align),
            *["| " + " | ".join(row) + " |" for row in rows]]


def write_results(data: dict[str, Any], lines: list[str], out_dir: str) -> list[str]:
    """``results.json`` (``data``) and ``report.md`` (``lines``) in ``out_dir``, made when missing; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w", encoding="utf-8") as handle:
        handle.write(dumps(data, indent=2, default=float))  # strict JSON: null where a number is missing
    with open(paths[1], "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return paths


def _label(row: Any) -> str:
    return row.name if row.default else f"{row.name} (m={row.num_features})"


def write_report(result: Any, out_dir: str) -> list[str]:
    """The encoder comparison's files in ``out_dir``: ``results.json`` (``result``, a
    :class:`~linattn.evaluate.compare.CompareResult`), ``report.md``, and ``error_vs_features.png`` and
    ``frontier.png`` when matplotlib is installed; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    plots = _plots(result, out_dir)
    lines = [
        f"# Feature maps against softmax attention: {result.model_name}",
        "",
        f"{result.layers} layers × {result.heads} heads, head dimension d = {result.head_dim}, "
        f"{'causal' if result.causal else 'non-causal'} attention. Learned maps fitted on {result.train_tokens} "
        f"tokens of text, captured in {result.fit_orders} paragraph orders; every map measured on "
        f"{result.heldout_tokens} held-out tokens, in float64, against exact softmax attention (mean row entropy "
        f"{result.softmax_entropy:.2f} nats).",
        "",
        "- **rel. error**: ‖Ŷ − Y‖/‖Y‖ of the attention output, mean over layers and heads (total: over all heads "
        "at once);",
        "- **KL**: mean row KL(softmax ‖ linear weights) in nats; **entropy**: mean row entropy of the linear "
        "weights;",
        f"- **µs/token**: median forward time per token at N = {result.long_n} ({result.heads} heads, random "
        f"inputs, {result.threads} threads); softmax (torch SDPA): {result.softmax_us_per_token:.2f} µs/token. "
        "One quick measurement per map: on a shared machine it is noisy; `linattn bench` times carefully.",
        "- random maps: mean over seeds at each m (each seed an independent draw per head); learned maps: "
        "fitted with the defaults of "
        "`linattn.train.distill.fit_feature_map`.",
        "",
        *_encoder_table([row for row in result.rows if not row.signed]),
    ]
    sweeps = _sweeps(result)
    if sweeps:
        lines += ["", "Random maps, error against m (sweep rows, mean over seeds):", ""]
        for name, rows in sweeps.items():
            errors = [r.rel_error for r in rows]
            falling = all(b < a for a, b in zip(errors, errors[1:]))  # noqa: B905 - lengths differ by design
            trend = "falls monotonically" if falling else "does not fall monotonically"
            lines.append(f"- `{name}`: {' → '.join(number(e) for e in errors)} for m = "
                         f"{', '.join(str(r.num_features) for r in rows)}: {trend}.")
    signed = [row for row in result.rows if row.signed]
    if signed:
        lines += ["", SIGNED_NOTE, "", *_encoder_table(signed)]
    if result.skipped:
        lines += ["", "Skipped:", ""] + [f"- `{name}`: {reason}" for name, reason in result.skipped.items()]
    lines += ["", *[f"![{name}]({name})" for name in plots], ""]
    if plots:
        lines += ["The plots leave out the signed maps and any row with an error of 2 or more.", ""]
    lines += [f"Generated by `linattn compare` in {result.seconds:.0f} s."]
    return write_results(asdict(result), lines, out_dir) + [os.path.join(out_dir, name) for name in plots]


def _encoder_table(rows: list[Any]) -> list[str]:
    return markdown_table(["map", "F", "rel. error", "rel. error (total)", "KL", "entropy", "µs/token", "note"],
                          [_table_row(row) for row in sorted(rows, key=lambda r: (r.name, r.feature_dim))],
                          align="lrrrrrrl")


def _table_row(row: Any) -> list[str]:
    """One encoder row's cells (random maps without a note: the number of seeds averaged)."""
    note = row.note or (f"mean of {row.seeds} seeds" if row.seeds > 1 else "")
    return [_label(row), str(row.feature_dim), number(row.rel_error), number(row.rel_error_total), number(row.kl),
            f"{row.entropy_linear:.2f}", f"{row.us_per_token:.2f}", note]


def write_lm_report(result: dict[str, Any], out_dir: str) -> list[str]:
    """The causal-LM comparison's ``results.json`` (``result`` as it stands: rewritten as rows finish) and
    ``report.md`` in ``out_dir``; returns their paths."""
    lengths = list(result["rows"][0]["passkey"]) if result["rows"] else []
    heldout = result.get("heldout")  # a file given with --heldout, or None: the shipped corpus's
    source = f"`{heldout}`" if heldout else "of the shipped corpus"
    lines = [
        f"# linattn compare (causal LM): {result['model']}", "",
        f"Held-out text {source}; repeated passage: {result['passage_tokens']} tokens, "
        f"{result['gap_tokens']} tokens of other text, the passage again (only the repeat scored); passkey: "
        f"a 5-digit key, filler of {', '.join(lengths)} tokens. Window rows: {result['window']} recent keys + "
        f"{result['sinks']} sink tokens. {result['threads']} threads, {result.get('seconds', 0):.0f} s in all.", "",
        *markdown_table(["row", "perplexity", "repeat perplexity", *(f"passkey {n}" for n in lengths), "rel. error",
                         "row KL", "tokens/s"],
                        [_lm_table_row(row) for row in result["rows"]], align="lrr" + "r" * len(lengths) + "rrr"),
    ]
    if "fit_seconds" in result:
        lines += ["", f"Hedgehog maps fitted in {result['fit_seconds']:.0f} s on {result['fit_tokens']} captured "
                      "train tokens (0: loaded from a file)."]
    rank = result.get("end_to_end", {}).get("lora_rank")
    if rank:
        lines += ["", f"The row marked (fine-tuned) is not the model as shipped: rank-{rank} adapters on every "
                      "attention layer's q/k/v/o projections were trained end to end with its maps frozen "
                      "(LoLCATs' second stage). Every other row uses the model's own weights."]
    return write_results(result, lines, out_dir)


def _lm_table_row(row: dict[str, Any]) -> list[str]:
    """One causal-LM row's cells: perplexities, passkey accuracies, per-head metrics ("—": not measured)."""
    return [row["name"], number(row["perplexity"], 2), number(row["repeat_perplexity"], 2),
            *(f"{v:.2f}" for v in row["passkey"].values()), number(row.get("rel_error"), 2),
            number(row.get("kl"), 2), f"{row['tokens_per_second']:.0f}"]


def _sweeps(result: Any) -> dict[str, list[Any]]:
    """Sweep rows (measured at several m) of each random positive map, by increasing m."""
    rows: dict[str, list[Any]] = {}
    for row in result.rows:
        if row.num_features is not None and not row.signed:
            rows.setdefault(row.name, []).append(row)
    return {name: sorted(found, key=lambda r: r.num_features) for name, found in rows.items() if len(found) > 1}


def _plotted(result: Any) -> list[Any]:
    """The rows the plots show: signed maps' errors are not comparable (:data:`SIGNED_NOTE`), and an error of 2 or
    more (a broken row) would flatten the rest."""
    return [r for r in result.rows if not r.signed and r.rel_error < 2.0]


def map_colours(names: Sequence[str]) -> dict[str, Any]:
    """One colour per map name, the same in every plot of a result: the names sorted, then given tab20's ten dark
    shades, its ten light ones, then tab20b's and tab20c's (the default cycle has ten, so maps shared colours)."""
    from matplotlib import colormaps

    palette = [colormaps["tab20"](i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    palette += [colormaps[name](i) for name in ("tab20b", "tab20c") for i in range(20)]
    return {name: palette[i % len(palette)] for i, name in enumerate(sorted(set(names)))}


def spread_labels(fig: Any, texts: Sequence[Any], iterations: int = 100) -> None:
    """Move overlapping annotations (offset in points) apart vertically until none overlaps: each overlapping pair
    is pushed apart by half its overlap per iteration, measured on the renderer's text boxes (adjustText does this
    more thoroughly but is not a dependency)."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    points_per_pixel = 72.0 / fig.dpi
    for _ in range(iterations):
        boxes = [Text.get_window_extent(text, renderer) for text in texts]  # the text alone, not its arrow
        shifts = [0.0] * len(texts)
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                b = boxes[j]
                if not a.overlaps(b):
                    continue
                push = (min(a.y1, b.y1) - max(a.y0, b.y0)) / 2 + 1.0
                lower, upper = (i, j) if (a.y0 + a.y1, i) <= (b.y0 + b.y1, j) else (j, i)
                shifts[lower] -= push
                shifts[upper] += push
        if not any(shifts):
            return
        for text, shift in zip(texts, shifts, strict=True):
            x, y = text.xyann
            text.xyann = (x, y + shift * points_per_pixel)


def _error_ceiling(result: Any) -> float:
    """Top of the error axis: just above the largest plotted error."""
    return 1.05 * max((r.rel_error for r in _plotted(result)), default=1.0)


def _plots(result: Any, out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: the Markdown report stands alone
        return []
    names = []
    rows_shown = _plotted(result)
    colours = map_colours([r.name for r in rows_shown])
    by_map: dict[str, list[Any]] = {}
    for row in rows_shown:
        by_map.setdefault(row.name, []).append(row)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in sorted(by_map.items()):
        rows = sorted(rows, key=lambda r: r.feature_dim)
        xs, ys = [r.feature_dim for r in rows], [r.rel_error for r in rows]
        ax.plot(xs, ys, marker="o", label=name, color=colours[name], linestyle="-" if len(rows) > 1 else "none")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, _error_ceiling(result))
    ax.set_xlabel("feature dimension F")
    ax.set_ylabel("relative output error (held-out)")
    ax.set_title(f"Error against feature dimension — {result.model_name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "error_vs_features.png"), dpi=120)
    plt.close(fig)
    names.append("error_vs_features.png")

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = sorted((r.us_per_token, r.rel_error, _label(r), r.name) for r in rows_shown)
    labels = []
    for x, y, label, name in points:
        ax.scatter(x, y, s=18, color=colours[name], zorder=3)
        labels.append(ax.annotate(label, (x, y), fontsize=7, xytext=(4, 0), textcoords="offset points",
                                  va="center", color="0.15",  # light shades of tab20 are unreadable as text
                                  bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none",
                                        "alpha": 0.7},  # legible over the frontier line and the grid
                                  arrowprops={"arrowstyle": "-", "color": colours[name], "linewidth": 0.5,
                                              "shrinkA": 0, "shrinkB": 3}))
    frontier, best = [], float("inf")
    for x, y, _, _ in points:
        if y < best:
            frontier.append((x, y))
            best = y
    if frontier:
        ax.plot(*zip(*frontier, strict=True), color="black", linewidth=1, label="frontier")
    ax.axvline(result.softmax_us_per_token, color="grey", linestyle="--", label="softmax (SDPA) time")
    ax.set_xscale("log")
    ax.set_ylim(0, _error_ceiling(result))
    ax.set_xlabel(f"µs per token at N = {result.long_n}")
    ax.set_ylabel("relative output error (held-out)")
    ax.set_title("Quality–speed frontier")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    spread_labels(fig, labels)
    fig.savefig(os.path.join(out_dir, "frontier.png"), dpi=120)
    plt.close(fig)
    names.append("frontier.png")
    return names
