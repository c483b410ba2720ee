"""``linattn compare`` for causal LMs: perplexity and long-range recall of each way to replace softmax attention.

Rows (each on the same held-out text of the shipped corpus, or ``--heldout``):

- ``softmax``: the model as it is (SDPA);
- ``window+sinks``: softmax over the ``--window`` most recent keys and the first ``--sinks`` tokens only (SDPA with
  an explicit band-and-sink mask; no linear part): what local attention alone achieves;
- ``elu``, ``favor+``: linear attention with a fixed map (:func:`linattn.hf.linearize`);
- ``hedgehog``: maps fitted on the train text (:func:`linattn.train.distill.fit_model_feature_maps`), or loaded with
  ``--fitted-maps FILE``;
- hybrids (``hedgehog+window``, ``elu+window``: the maps above beside the softmax window; ``hedgehog fitted with
  window``: maps fitted with the window in place, :func:`linattn.train.distill.fit_feature_map` ``window=``);
- with ``--retrieval-heads K --retrieval-maps FILE``: the K heads that retrieve most beyond the window
  (:func:`~linattn.train.end_to_end.retrieval_scores`) take FILE's maps, the others keep the hybrid's; an
  end-to-end stage (``--end-to-end-steps``) then trains only those K heads.

Columns: held-out perplexity (:func:`~linattn.evaluate.perplexity`), the repeated-passage perplexity and passkey
accuracy at each filler length (:mod:`~linattn.evaluate.probes`), and for linear rows the per-head output error and
row KL against softmax on the held-out capture (:func:`~linattn.evaluate.capture_metrics`).

    linattn compare smollm2                    # docs/models.md: the command, its run time, the measured table

Here the run's steps, in order (:func:`run_lm_compare`); the options are read and checked in
:mod:`~linattn.evaluate.lm_config`, the fit and the training stages are in :mod:`~linattn.evaluate.lm_stages`,
the window+sinks attention in :mod:`~linattn.evaluate.window_softmax`, the files written by
:mod:`~linattn.evaluate.report`.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .. import hf
from ..feature_maps.fitted import FittedFeatureMaps, load_feature_maps
from .arguments import add_lm_arguments  # noqa: F401  (re-exported: the names' old home)
from .capture import capture_attention
from .lm_config import EndToEndOptions, LMCompareConfig, ProbeOptions
from .lm_stages import fit_hedgehog, read_text, retrieval_heads, train_end_to_end, training_sequences
from .metrics import capture_metrics, capture_references
from .models import (
    load_model,
    looks_causal,  # noqa: F401  (re-exported)
)
from .perplexity import perplexity
from .probes import long_range_probes
from .report import number, write_lm_report
from .window_softmax import use_window_softmax, window_sink_attention  # noqa: F401  (re-exported)


@dataclass
class MapRow:
    """One linear row: its label, its maps (a registered name, a maps file or fitted maps), the options of
    :func:`linattn.hf.linearize`, and the LoRA adapters attached for this row alone (or None)."""

    label: str
    maps: Any
    options: dict[str, Any] = field(default_factory=dict)
    adapters: Any = None


def run_lm_compare(config: LMCompareConfig) -> dict[str, Any]:
    """The causal-LM comparison of the module docstring; writes ``report.md`` and ``results.json`` to
    ``config.out`` as rows finish, and returns the results."""
    comparison = _Comparison(config)
    comparison.announce()
    comparison.capture_references()  # under softmax, before any row changes the model's attention
    if config.baselines:
        comparison.measure_baselines()
    rows = comparison.map_rows()  # every fit and training stage runs here, before the first linear row
    for row in rows + hybrid_rows(rows, config):
        comparison.measure(row)
    comparison.model.set_attn_implementation("sdpa")
    return comparison.result


def hybrid_rows(rows: list[MapRow], config: LMCompareConfig) -> list[MapRow]:
    """The ``+window`` rows: the hedgehog maps fitted without the window, and elu, beside the softmax window."""
    window = {"window": config.window, "sinks": config.sinks}
    return [MapRow(f"{row.label}+window", row.maps, {**row.options, **window})
            for row in rows if row.label in ("hedgehog", "elu")]


def end_to_end_label(options: EndToEndOptions, heads: torch.Tensor | None, adapted: bool) -> str:
    """What the end-to-end row's label adds to the label of the maps it started from: what was trained, on what."""
    stage = ", end to end"
    if adapted:  # the maps as they were, the projections adapted
        stage += f": LoRA r={options.lora_rank} (fine-tuned)"
    if heads is not None and options.train_other_heads:
        stage += ", other heads"
    elif heads is not None and not options.retrieval_maps:  # else the label names them already
        stage += f", {options.retrieval_heads} retrieval heads"
    if options.corpus_orders:
        stage += f", with {options.corpus_orders} orders of the training text"
    if options.repeat_weight != 1:
        stage += f", repeat weight {options.repeat_weight:g}"
    return stage


class _Comparison:
    """One run: the model and its held-out text, the results so far, and the steps that add rows to them."""

    def __init__(self, config: LMCompareConfig) -> None:
        """Load the model and the held-out text; the results start with what every row shares."""
        self.config = config
        self.start = time.perf_counter()
        self.model, self.tokenizer, self.name = load_model(config.model, causal_lm=True)
        self.heldout = read_text(config.heldout, "heldout")
        probes = config.probes
        self.result: dict[str, Any] = {
            "model": self.name, "layers": self.model.config.num_hidden_layers, "window": config.window,
            "sinks": config.sinks, "passage_tokens": probes.passage_tokens, "gap_tokens": probes.gap_tokens,
            "heldout": config.heldout, "threads": torch.get_num_threads(), "rows": [],
        }
        self.metrics_capture: Any = None
        self.references: Any = None

    @cached_property
    def train(self) -> str:
        """The train text, read when a stage first needs it."""
        return read_text(self.config.text, "train")

    def announce(self) -> None:
        """The table's title and header on the console (unless ``--quiet``)."""
        if self.config.quiet:
            return
        probes = self.config.probes
        print(f"{self.name}: held-out perplexity, repeated passage ({probes.passage_tokens} tokens after "
              f"{probes.gap_tokens}) and passkey accuracy; {torch.get_num_threads()} threads")
        print(_console_header())

    def capture_references(self) -> None:
        """The held-out capture and its softmax references, for the linear rows' per-head metrics."""
        if not self.config.metrics:
            return
        self.metrics_capture = capture_attention(self.model, self.tokenizer, self.heldout,
                                                 max_tokens=self.config.max_tokens, model_name=self.name)
        self.references = capture_references(self.metrics_capture)

    def starting(self, label: str) -> None:
        """One console line as a row starts (unless ``--quiet``): a row takes minutes on a CPU, and nothing else
        is printed until its line of the table."""
        if self.config.quiet:
            return
        done = [row["seconds"] for row in self.result["rows"]]
        pace = f" (the rows so far took {sum(done) / len(done):.0f} s each)" if done else ""
        print(f"measuring {label} ...{pace}", flush=True)

    def record(self, label: str, row: dict[str, Any], seconds: float, **extra: Any) -> None:
        """Add a finished row; rewrite the report files and print the row."""
        row.update(name=label, seconds=seconds, **extra)
        self.result["rows"].append(row)
        self.result["seconds"] = time.perf_counter() - self.start
        write_lm_report(self.result, self.config.out)
        if not self.config.quiet:
            print(_console_row(row), flush=True)

    def score(self) -> dict[str, Any]:
        """The model as it is now, on the held-out text: perplexity and the long-range probes."""
        return score_model(self.model, self.tokenizer, self.heldout, self.config.probes)

    def measure_baselines(self) -> None:
        """The softmax row (the model as it is) and the window+sinks row (softmax over the window alone)."""
        self.starting("softmax")
        begin = time.perf_counter()
        self.record("softmax", self.score(), time.perf_counter() - begin)
        label = f"window{self.config.window}+sinks{self.config.sinks}"
        self.starting(label)
        begin = time.perf_counter()
        use_window_softmax(self.model, self.config.window, self.config.sinks)
        self.record(label, self.score(), time.perf_counter() - begin)

    def map_rows(self) -> list[MapRow]:
        """The linear rows of ``--maps`` in order, their maps fitted, loaded or trained (the hybrids come later)."""
        fit = self.config.fit
        saved = load_feature_maps(fit.fitted_maps) if fit.fitted_maps else None  # read once for both hedgehog rows
        rows: list[MapRow] = []
        for map_name in self.config.maps:
            if map_name == "hedgehog":
                rows.append(MapRow("hedgehog", self.hedgehog_maps(saved, with_window=False)))
            elif map_name == "hedgehog+window":
                rows += self.window_rows(self.hedgehog_maps(saved, with_window=True))
            else:
                rows.append(MapRow(map_name, map_name, {"seed": 0} if map_name == "favor+" else {}))
        return rows

    def hedgehog_maps(self, saved: FittedFeatureMaps | None, *, with_window: bool) -> FittedFeatureMaps:
        """The maps of a hedgehog row: ``saved`` (``--fitted-maps``) when fitted the same way (with the window or
        without it), else fitted here; the seconds and the captured tokens go in the results."""
        begin = time.perf_counter()
        if saved is not None and (saved.window is not None) == with_window:
            fitted, tokens = saved, 0
        else:
            fitted, tokens = fit_hedgehog(self.model, self.tokenizer, self.name, self.train, self.config,
                                          with_window=with_window)
            self.save(fitted, "hedgehog_window.safetensors" if with_window else "hedgehog.safetensors")
        key = "fit_window_seconds" if with_window else "fit_seconds"
        self.result[key], self.result["fit_tokens"] = time.perf_counter() - begin, tokens
        return fitted

    def window_rows(self, fitted: FittedFeatureMaps) -> list[MapRow]:
        """The window-fitted maps' row, then the rows of the stages after it: the retrieval heads with another
        file's maps (``--retrieval-maps``) and the end-to-end stage (``--end-to-end-steps``)."""
        options = self.config.end_to_end
        label = "hedgehog fitted with window" + (" (γ)" if self.config.fit.gamma else "")
        rows = [MapRow(label, fitted)]
        if not options.after_fit:
            return rows
        plain, self.result["sample_seconds"] = training_sequences(self.model, self.tokenizer, self.train, options)
        heads = None
        if options.retrieval_heads:
            heads = self.retrieval_heads(plain)
            if options.retrieval_maps:  # the retrieval heads' maps from another run (e.g. trained on copying)
                fitted = fitted.with_heads(load_feature_maps(options.retrieval_maps), heads)
                label += f", {options.retrieval_heads} retrieval heads from {os.path.basename(options.retrieval_maps)}"
                rows.append(MapRow(label, fitted))
        if options.steps:
            rows.append(self.end_to_end_row(fitted, label, plain, heads))
        return rows

    def retrieval_heads(self, plain: list[torch.Tensor]) -> torch.Tensor:
        """(layers, heads) bool: the heads that retrieve most beyond the window; they and the seconds go in the
        results."""
        begin = time.perf_counter()
        heads = retrieval_heads(self.model, plain, self.config)
        self.result["retrieval_heads"] = {"heads": heads.nonzero().tolist(), "seconds": time.perf_counter() - begin}
        return heads

    def end_to_end_row(self, fitted: FittedFeatureMaps, label: str, plain: list[torch.Tensor],
                       heads: torch.Tensor | None) -> MapRow:
        """The row of ``fitted`` trained end to end (its maps, or LoRA adapters); what it took goes in the results,
        what was trained in ``--save-maps``."""
        begin = time.perf_counter()
        tuned, adapters, info = train_end_to_end(self.model, self.tokenizer, fitted, self.config, self.train, plain,
                                                 heads)
        self.result["end_to_end"] = {**info, "seconds": time.perf_counter() - begin}
        if adapters is not None:
            self.save(adapters, "lora")
        else:
            self.save(tuned, "hedgehog_window_end_to_end.safetensors")
        return MapRow(label + end_to_end_label(self.config.end_to_end, heads, adapters is not None), tuned,
                      adapters=adapters)

    def save(self, trained: Any, file: str) -> None:
        """Write fitted maps or adapters to ``--save-maps`` (made when missing, also when the fit was loaded)."""
        folder = self.config.fit.save_maps
        if folder:
            os.makedirs(folder, exist_ok=True)
            trained.save(os.path.join(folder, file))

    def measure(self, row: MapRow) -> None:
        """Linearize the model with the row's maps (its adapters attached for it alone) and record its scores."""
        self.starting(row.label)
        begin = time.perf_counter()
        hf.linearize(self.model, row.maps, **row.options)
        if row.adapters is not None:
            row.adapters.attach()
        try:
            extra = self.head_metrics(row)
            scores = self.score()
        finally:
            if row.adapters is not None:
                row.adapters.remove()
        self.record(row.label, scores, time.perf_counter() - begin, **extra)

    def head_metrics(self, row: MapRow) -> dict[str, Any]:
        """Per-head output error and row KL of the linear part against softmax; none for hybrid rows (their
        softmax window is not part of the map) or without ``--metrics``."""
        if self.metrics_capture is None or "window" in row.options or getattr(row.maps, "window", None):
            return {}
        per_layer: list[Any] = [module.linattn_feature_map for module in hf.attention_modules(self.model)]
        metrics = capture_metrics(self.metrics_capture, per_layer, references=self.references)
        return {"rel_error": metrics["rel_error"], "kl": metrics["kl"]}


def score_model(model: Any, tokenizer: Any, heldout: str, probes: ProbeOptions) -> dict[str, Any]:
    """A row's scores: held-out perplexity and the long-range probes of ``probes``, on ``model`` as it is now."""
    plain = perplexity(model, tokenizer, heldout)
    found = long_range_probes(
        model, tokenizer, heldout, passage_tokens=probes.passage_tokens, gap_tokens=probes.gap_tokens,
        repeat_trials=probes.repeat_trials, passkey_lengths=probes.passkey_lengths,
        passkey_trials=probes.passkey_trials,
    )
    return {"perplexity": plain.perplexity, "tokens_per_second": plain.tokens_per_second,
            "heldout_tokens": plain.tokens, "repeat_perplexity": found["repeat_perplexity"],
            "passkey": {str(k): v for k, v in found["passkey"].items()}, "probe_seconds": found["seconds"]}


def _console_header() -> str:
    return (f"{'row':>22} {'ppl':>9} {'repeat ppl':>11} {'passkey 1k/2k/4k':>18} {'rel.err':>8} {'KL':>7} "
            f"{'tok/s':>7} {'s':>6}")


def _console_row(row: dict[str, Any]) -> str:
    passkey = "/".join(f"{v:.2f}" for v in row["passkey"].values())
    return (f"{row['name']:>22} {number(row['perplexity'], 2):>9} {number(row['repeat_perplexity'], 2):>11} "
            f"{passkey:>18} {number(row.get('rel_error'), 2):>8} {number(row.get('kl'), 2):>7} "
            f"{row['tokens_per_second']:>7.0f} {row['seconds']:>6.0f}")


def cli(args: argparse.Namespace) -> int:
    """``linattn compare`` on a causal LM, with the options of :mod:`linattn.evaluate.arguments`."""
    config = LMCompareConfig.from_args(args)
    result = run_lm_compare(config)
    if not config.quiet:
        print(f"wrote {config.out}/report.md and results.json ({result['seconds']:.0f} s)")
    return 0
