"""The options of the causal-LM comparison, read once from the command line and checked there.

:class:`LMCompareConfig` is what :func:`linattn.evaluate.lm_compare.run_lm_compare` and its stages read: the
shared options of ``linattn compare`` with the causal-LM defaults filled in, and the causal-LM options grouped by
what they steer (:class:`ProbeOptions`, :class:`FitOptions`, :class:`EndToEndOptions`). Every check runs when a
config is made, so a bad combination fails before the model is loaded, not after minutes of fitting.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any

from .. import feature_maps
from ..errors import LinearAttentionError
from ..train.end_to_end import COPY_GAP, KEY_FILLER
from .arguments import DEFAULT_OUT, LM_SINKS, LM_WINDOW

# fitting sequences as long as the contexts served: maps fitted on 512-token pieces put too much weight on far keys
# past position 512 (SmolLM2 hybrid: perplexity 86.7 with 512-token fits, 53.0 with 1,024; docs/models.md)
LM_FIT_TOKENS = 1024
# hedgehog+window: maps fitted with the window in place (their file carries W and S, so linearize makes them a
# hybrid); the plain hedgehog row is fitted without it
DEFAULT_LM_MAPS = ("elu", "favor+", "hedgehog", "hedgehog+window")
HELD_OUT_SAMPLES = 2  # the end-to-end stage's last samples, held out to pick its best step
# the draw of the HELD_OUT_SAMPLES held-out key-retrieval sequences, apart from every run's training draw (0, 1, ...)
HELD_OUT_KEY_SEED = 1_000_003


@dataclass(frozen=True)
class ProbeOptions:
    """The long-range probes of every row (:func:`~linattn.evaluate.long_range_probes`)."""

    passage_tokens: int
    gap_tokens: int
    repeat_trials: int
    passkey_lengths: tuple[int, ...]
    passkey_trials: int

    def __post_init__(self) -> None:
        if self.passkey_trials < 1 or self.repeat_trials < 1:
            raise LinearAttentionError(f"--passkey-trials, --repeat-trials: need ≥ 1, got {self.passkey_trials} and "
                                       f"{self.repeat_trials}")


@dataclass(frozen=True)
class FitOptions:
    """How the hedgehog rows' maps are fitted (:func:`linattn.train.distill.fit_model_feature_maps`), loaded, saved."""

    steps: int | None  # None: the fit's default
    num_features: int | None  # None: the fit's default
    max_tokens: int  # longest captured train sequence
    orders: int  # paragraph orders of the train capture
    gamma: bool  # the window-fitted maps with LoLCATs' per-head factor γ instead of the mass-preserving window
    fitted_maps: str | None  # a maps file that replaces one of the fits
    save_maps: str | None  # a folder for every fitted and trained map file


@dataclass(frozen=True)
class EndToEndOptions:
    """The stages after the window-fitted maps: retrieval heads, then end-to-end training (maps or LoRA)."""

    steps: int  # 0: no end-to-end row
    samples: int  # texts sampled from the model; the last HELD_OUT_SAMPLES held out
    tokens: int  # tokens sampled per text
    texts: str | None  # a JSON file of the sampled texts, read or written
    copies: bool  # also train on copying sequences of the samples
    corpus_orders: int  # also train on the train text in this many paragraph orders
    repeat_weight: float  # loss weight of the positions predicting a copying sequence's repeat
    lora_rank: int  # 0: the maps are trained; else rank-R adapters with the maps frozen
    lora_lr: float
    retrieval_heads: int  # K heads retrieving most beyond the window; 0: none picked
    retrieval_maps: str | None  # a maps file whose retrieval heads' maps replace the fitted ones
    train_other_heads: bool  # train the heads other than the retrieval heads
    sparse_cache: int = 0  # pairs per head of a sparse exact cache in place while training (and measuring); 0: none
    # the cache's per-head sizes, one tuple per layer, where they differ by head (--sparse-cache-heads retrieval);
    # None: sparse_cache pairs for every head
    cache_sizes: tuple[tuple[int, ...], ...] | None = None
    cache_linear_weight: float = 1.0  # the linear part's weight β beside the cache (SparseCache.linear_weight)
    # the copying sequences' gaps G (uniform draws, tokens): longer than a sample, the samples are joined
    copy_gap: tuple[int, int] = COPY_GAP
    # key-retrieval sequences (linattn.train.end_to_end.key_sequences) made from the train text and trained on
    # beside the rest, their fillers drawn from key_filler; 0: none
    keys: int = 0
    key_filler: tuple[int, int] = KEY_FILLER
    # the draw of the key sequences trained on: a run continuing one that trained on keys takes the next, so it
    # trains on new ones (the held-out ones are drawn apart, the same in every run: HELD_OUT_KEY_SEED)
    key_seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.samples < HELD_OUT_SAMPLES + 1 or self.tokens < 1:
            raise LinearAttentionError(f"--end-to-end-steps: need ≥ 0; --end-to-end-samples: ≥ {HELD_OUT_SAMPLES + 1} "
                                       f"({HELD_OUT_SAMPLES} are held out); --end-to-end-tokens: ≥ 1")
        if self.retrieval_heads < 0 or (self.retrieval_maps and not self.retrieval_heads):
            raise LinearAttentionError("--retrieval-heads: need ≥ 0, and ≥ 1 with --retrieval-maps")
        if self.sparse_cache < 0:
            raise LinearAttentionError(f"--sparse-cache: need pairs per head ≥ 0, got {self.sparse_cache}")
        if not (0 <= self.cache_linear_weight < math.inf) or (self.cache_linear_weight != 1 and not self.sparse_cache):
            raise LinearAttentionError(f"--sparse-cache-linear-weight: need a finite weight ≥ 0, and --sparse-cache "
                                       f"N ≥ 1 beside it, got {self.cache_linear_weight}")
        low, high = self.copy_gap
        if not 1 <= low <= high:
            raise LinearAttentionError(f"--end-to-end-copy-gap: need 1 ≤ LOW ≤ HIGH tokens, got {low} {high}")
        if self.keys < 0 or not 1 <= self.key_filler[0] <= self.key_filler[1]:
            raise LinearAttentionError(f"--end-to-end-keys: need ≥ 0; --end-to-end-key-filler: 1 ≤ LOW ≤ HIGH tokens; "
                                       f"got {self.keys} and {self.key_filler[0]} {self.key_filler[1]}")
        if not 0 <= self.key_seed < HELD_OUT_KEY_SEED:
            raise LinearAttentionError(f"key_seed: need 0 ≤ seed < {HELD_OUT_KEY_SEED} (that one draws the held-out "
                                       f"key sequences), got {self.key_seed}")
        if self.corpus_orders < 0:
            raise LinearAttentionError(f"--end-to-end-corpus-orders: need ≥ 0, got {self.corpus_orders}")
        self._check_lora()
        if self.train_other_heads and not self.retrieval_heads:
            raise LinearAttentionError("--train-other-heads: needs --retrieval-heads K (the heads left as they are)")
        if not (0 < self.repeat_weight < math.inf):
            raise LinearAttentionError(f"--end-to-end-repeat-weight: need a finite weight > 0, got "
                                       f"{self.repeat_weight}")
        if self.retrieval_maps and not os.path.isfile(self.retrieval_maps):
            raise LinearAttentionError(f"--retrieval-maps: {self.retrieval_maps!r} is not a file; pass a maps file "
                                       "written by --save-maps")

    def _check_lora(self) -> None:
        if self.lora_rank < 0 or (self.lora_rank and not self.steps):
            raise LinearAttentionError("--end-to-end-lora: need a rank ≥ 0, and --end-to-end-steps ≥ 1 to train it")
        if self.lora_rank and (self.retrieval_heads and not self.retrieval_maps or self.train_other_heads):
            raise LinearAttentionError("--end-to-end-lora trains the adapters with every map frozen: it takes no "
                                       "heads to train (--retrieval-heads only with --retrieval-maps; no "
                                       "--train-other-heads)")
        if not self.lora_lr > 0:
            raise LinearAttentionError(f"--end-to-end-lora-lr: need > 0, got {self.lora_lr}")

    @property
    def cache_options(self) -> dict[str, Any]:
        """The ``hf.linearize`` options that put the sparse cache in place (none without one), as JSON values."""
        weight = {} if self.cache_linear_weight == 1 else {"linear_weight": self.cache_linear_weight}
        if self.cache_sizes is not None:  # per layer: its per-head sizes, or the cache's fields with the weight
            return {"sparse_cache": [{"size": list(sizes), **weight} if weight else list(sizes)
                                     for sizes in self.cache_sizes]}
        if not self.sparse_cache:
            return {}
        return {"sparse_cache": {"size": self.sparse_cache, **weight} if weight else self.sparse_cache}

    @property
    def after_fit(self) -> bool:
        """Whether any stage runs after the window fit (and needs the sampled training texts)."""
        return bool(self.steps or self.retrieval_heads)


@dataclass(frozen=True)
class LMCompareConfig:
    """Every option of one causal-LM comparison (see :mod:`linattn.evaluate.lm_compare` for the rows)."""

    model: str | None  # a name or path for :func:`~linattn.evaluate.load_model`
    text: str | None  # train text file (None: the shipped corpus)
    heldout: str | None  # held-out text file (None: the shipped corpus)
    out: str  # folder of results.json and report.md
    maps: tuple[str, ...]  # the linear rows, in order
    window: int  # softmax window of the window and hybrid rows
    sinks: int  # sink tokens of the window and hybrid rows
    max_tokens: int  # longest held-out sequence of the per-head metrics' capture
    metrics: bool  # per-head rel. error and KL of the linear rows
    baselines: bool  # the softmax and window+sinks rows
    quiet: bool  # no table, no progress bars
    probes: ProbeOptions
    fit: FitOptions
    end_to_end: EndToEndOptions

    def __post_init__(self) -> None:
        if self.window < 1 or self.sinks < 0:
            raise LinearAttentionError(f"--window: need ≥ 1, got {self.window}; --sinks: ≥ 0, got {self.sinks}")
        known = (*feature_maps.available(), "hedgehog+window")
        unknown = [name for name in self.maps if name not in known and not os.path.isfile(name)]
        if unknown:
            raise LinearAttentionError(f"--maps: unknown {unknown}; pass registered maps {list(known)} or maps files")
        if self.end_to_end.after_fit and "hedgehog+window" not in self.maps:
            raise LinearAttentionError("--end-to-end-steps and --retrieval-heads act on the maps of the "
                                       "hedgehog+window row: add it to --maps")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LMCompareConfig:
        """The config of ``linattn compare`` options (:mod:`linattn.evaluate.arguments`), checked.

        ``--window`` and ``--sinks`` are shared with the encoder comparison, whose defaults differ (no window, no
        sinks); the default ``--out`` gets ``-lm`` so that the two comparisons never overwrite each other's files.
        """
        probes = ProbeOptions(passage_tokens=args.passage_tokens, gap_tokens=args.gap_tokens,
                              repeat_trials=args.repeat_trials, passkey_lengths=tuple(args.passkey_lengths),
                              passkey_trials=args.passkey_trials)
        fit = FitOptions(steps=args.steps, num_features=args.num_features,
                         max_tokens=args.fit_max_tokens or LM_FIT_TOKENS, orders=args.fit_orders, gamma=args.gamma,
                         fitted_maps=args.fitted_maps, save_maps=args.save_maps)
        end_to_end = EndToEndOptions(
            steps=args.end_to_end_steps, samples=args.end_to_end_samples, tokens=args.end_to_end_tokens,
            texts=args.end_to_end_texts, copies=args.end_to_end_copies, corpus_orders=args.end_to_end_corpus_orders,
            repeat_weight=args.end_to_end_repeat_weight, lora_rank=args.end_to_end_lora,
            lora_lr=args.end_to_end_lora_lr, retrieval_heads=args.retrieval_heads, retrieval_maps=args.retrieval_maps,
            train_other_heads=args.train_other_heads,
        )
        return cls(
            model=args.model, text=args.text, heldout=args.heldout,
            out=args.out if args.out != DEFAULT_OUT else DEFAULT_OUT + "-lm", maps=tuple(args.maps or DEFAULT_LM_MAPS),
            window=LM_WINDOW if args.window is None else args.window,
            sinks=LM_SINKS if args.sinks is None else args.sinks, max_tokens=args.max_tokens,
            metrics=not args.no_metrics, baselines=not args.no_baselines, quiet=args.quiet,
            probes=probes, fit=fit, end_to_end=end_to_end,
        )
