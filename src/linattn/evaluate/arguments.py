"""Command-line options of ``linattn compare`` (kept apart from the jobs so that ``--help`` imports none of them).

:func:`add_compare_arguments` adds the options of every comparison, :func:`add_lm_arguments` those of causal LMs
(:mod:`linattn.evaluate.lm_compare`); both parsers share one ``argparse`` namespace, read by
:func:`linattn.evaluate.compare.cli` or :meth:`linattn.evaluate.lm_config.LMCompareConfig.from_args`.
"""

from __future__ import annotations

import argparse
from typing import Any

from .defaults import LM_SINKS, LM_WINDOW

DEFAULT_OUT = "out/compare"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every ``linattn compare`` run: model, texts, maps, fitting, output (``--help`` shows them in
    two groups: every model, and the encoders' own)."""
    every = parser.add_argument_group("every model (encoders and causal LMs)")
    encoders = parser.add_argument_group("encoders only (attention metrics against softmax, per head)")
    every.add_argument("model", nargs="?", default=None,
                        help="transformers model name or folder (default: the shipped MiniLM-L6, offline)")
    every.add_argument("text", nargs="?", default=None,
                        help="text file; its paragraphs are split in half into train and held-out parts "
                             "(default: the shipped corpus)")
    every.add_argument("--heldout", default=None, help="held-out text file (then TEXT is all train)")
    every.add_argument("--maps", nargs="+", default=None, help="registered maps to measure (default: all)")
    encoders.add_argument("--sweep", type=int, nargs="+", default=[16, 64, 256],
                        help="feature counts m for random maps")
    encoders.add_argument("--seeds", type=int, default=2,
                        help="runs of each random map (each an independent draw per head), averaged")
    every.add_argument("--steps", type=int, default=None, help="fitting steps for learned maps")
    every.add_argument("--num-features", type=int, default=None, help="m of learned maps (default: the fit's)")
    encoders.add_argument("--long-n", type=int, default=4096, help="sequence length of the timing (causal LMs: unused)")
    every.add_argument("--max-tokens", type=int, default=384,
                        help="longest held-out sequence (paragraphs are grouped up to it)")
    every.add_argument("--fit-max-tokens", type=int, default=None,
                        help="longest train sequence for fitting (default: the model's limit)")
    every.add_argument("--fit-orders", type=int, default=4,
                        help="capture the train text in this many paragraph orders for fitting (1: as given)")
    every.add_argument("--save-maps", default=None,
                        help="also write the fitted maps of each learned kind to this folder (safetensors)")
    every.add_argument("--window", type=int, default=None,
                        help="also measure the sliding-window hybrid with this window W (docs/window.md; causal "
                             f"LMs: default {LM_WINDOW})")
    every.add_argument("--sinks", type=int, default=None,
                        help=f"sink tokens kept exact in the hybrid rows (default 0; causal LMs: {LM_SINKS})")
    every.add_argument("--out", default=DEFAULT_OUT, help="folder for report.md, results.json and plots")
    every.add_argument("--quiet", action="store_true", help="no table or progress bars")


def add_lm_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The causal-LM options of ``linattn compare`` (options another part already defines are shared); given an
    argument group (``linattn compare --help`` shows them under one heading), the help drops its "causal LMs: "."""
    grouped = isinstance(parser, argparse._ArgumentGroup)

    def add(flag: str, **options: Any) -> None:
        if flag not in parser._option_string_actions:
            if grouped and "help" in options:
                options["help"] = options["help"].removeprefix("causal LMs: ")
            parser.add_argument(flag, **options)

    add("--lm", action="store_true", help="treat MODEL as a causal LM (detected for smollm2, GGUF, *ForCausalLM)")
    add("--window", type=int, default=None, help=f"causal LMs: softmax window of the window rows ({LM_WINDOW})")
    add("--sinks", type=int, default=None, help=f"causal LMs: sink tokens kept exact in the window rows ({LM_SINKS})")
    add("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="causal LMs: filler tokens")
    add("--passkey-trials", type=int, default=3, help="causal LMs: passkey trials per filler length")
    add("--repeat-trials", type=int, default=4, help="causal LMs: repeated passages")
    add("--passage-tokens", type=int, default=128, help="causal LMs: tokens of the repeated passage")
    add("--gap-tokens", type=int, default=512, help="causal LMs: tokens between the passage and its repeat")
    add("--fitted-maps", default=None,
        help="causal LMs: hedgehog maps saved earlier (skip the fit): maps fitted with the window serve the "
             "hedgehog+window rows, others the hedgehog row")
    add("--no-metrics", action="store_true", help="causal LMs: skip the per-head rel. error / KL")
    add("--no-baselines", action="store_true", help="causal LMs: skip the softmax and window+sinks rows")
    add("--end-to-end-steps", type=int, default=0,
        help="causal LMs: also train the window-fitted maps end to end for this many steps (0: no such row)")
    add("--end-to-end-samples", type=int, default=32,
        help="causal LMs: texts sampled from the model for the end-to-end stage (the last 2 held out)")
    add("--end-to-end-tokens", type=int, default=1024, help="causal LMs: tokens sampled per text")
    add("--end-to-end-texts", default=None,
        help="causal LMs: a JSON file of the end-to-end stage's sampled texts: read when it was written for the same "
             "model, prompts and --end-to-end-tokens, else sampled and written there (sampling is minutes)")
    add("--end-to-end-copies", action=argparse.BooleanOptionalAction, default=True,
        help="causal LMs: also train on copying sequences built from the samples (a passage, other text, the "
             "passage again)")
    add("--end-to-end-corpus-orders", type=int, default=0,
        help="causal LMs: also train the end-to-end stage on the training text itself, in this many paragraph "
             "orders (and their copying sequences); 0: the samples alone")
    add("--end-to-end-repeat-weight", type=float, default=1.0,
        help="causal LMs: the loss weight of the positions that predict a copying sequence's repeat (others 1)")
    add("--retrieval-heads", type=int, default=0,
        help="causal LMs: the K heads that retrieve most beyond the window (retrieval_scores on the sampled texts): "
             "with --retrieval-maps they take that file's maps; the end-to-end stage then trains only them")
    add("--retrieval-maps", default=None,
        help="causal LMs: a maps file (same layout as the hedgehog+window maps) whose retrieval heads' maps replace "
             "those of the fitted/--fitted-maps maps, e.g. maps trained on copying sequences")
    add("--train-other-heads", action="store_true",
        help="causal LMs: the end-to-end stage trains the heads other than the --retrieval-heads (those stay as "
             "they are)")
    add("--end-to-end-lora", type=int, default=0, metavar="R",
        help="causal LMs: the end-to-end stage trains rank-R adapters of every attention layer's q/k/v/o "
             "projections instead of the maps (LoLCATs' fine-tuning stage: the model's weights change in effect, "
             "and the row says so); 0: no adapters")
    add("--end-to-end-lora-lr", type=float, default=0.0005, help="causal LMs: the adapters' Adam learning rate")
    add("--gamma", action="store_true",
        help="causal LMs: fit hedgehog+window with LoLCATs' per-head factor γ instead of the mass-preserving window")


def __getattr__(name: str) -> Any:
    """The options of ``linattn generate`` and ``linattn linearize`` moved with the product
    (:mod:`linattn.linearized.arguments`); their old names here still resolve, imported on first use (that module
    reads this one's window and sinks defaults, so it cannot be imported while this one loads)."""
    if name in ("add_generate_arguments", "add_linearize_arguments"):
        from ..linearized import arguments

        return getattr(arguments, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
