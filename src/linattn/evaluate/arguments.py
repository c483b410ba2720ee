"""Command-line options of ``linattn compare`` (kept apart from compare.py so that ``--help`` imports nothing)."""

from __future__ import annotations

import argparse


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="transformers model name or folder (default: the shipped MiniLM-L6, offline)")
    parser.add_argument("text", nargs="?", default=None,
                        help="text file; its paragraphs are split in half into train and held-out parts "
                             "(default: the shipped corpus)")
    parser.add_argument("--heldout", default=None, help="held-out text file (then TEXT is all train)")
    parser.add_argument("--maps", nargs="+", default=None, help="registered maps to measure (default: all)")
    parser.add_argument("--sweep", type=int, nargs="+", default=[16, 64, 256],
                        help="feature counts m for random maps")
    parser.add_argument("--seeds", type=int, default=2,
                        help="runs of each random map (each an independent draw per head), averaged")
    parser.add_argument("--steps", type=int, default=None, help="fitting steps for learned maps")
    parser.add_argument("--num-features", type=int, default=None, help="m of learned maps (default: the fit's)")
    parser.add_argument("--long-n", type=int, default=4096, help="sequence length of the timing")
    parser.add_argument("--max-tokens", type=int, default=384,
                        help="longest held-out sequence (paragraphs are grouped up to it)")
    parser.add_argument("--fit-max-tokens", type=int, default=None,
                        help="longest train sequence for fitting (default: the model's limit)")
    parser.add_argument("--fit-orders", type=int, default=4,
                        help="capture the train text in this many paragraph orders for fitting (1: as given)")
    parser.add_argument("--save-maps", default=None,
                        help="also write the fitted maps of each learned kind to this folder (safetensors)")
    parser.add_argument("--window", type=int, default=None,
                        help="also measure the sliding-window hybrid with this window W (docs/window.md; causal "
                             "LMs: default 64)")
    parser.add_argument("--sinks", type=int, default=None,
                        help="sink tokens kept exact in the hybrid rows (default 0; causal LMs: 4)")
    parser.add_argument("--out", default="out/compare", help="folder for report.md, results.json and plots")
    parser.add_argument("--quiet", action="store_true", help="no table or progress bars")
