"""The training stages of the causal-LM comparison: the hedgehog fit, the sampled training texts, the retrieval
heads and the end-to-end stage (maps or LoRA adapters trained against the model's own softmax attention).

Each stage reads its options from :class:`~linattn.evaluate.lm_config.LMCompareConfig` and returns what it made;
:mod:`linattn.evaluate.lm_compare` puts the results in rows.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import hf
from ..data import load_text, paragraphs
from ..errors import LinearAttentionError
from ..feature_maps.fitted import FittedFeatureMaps
from ..train.distill import fit_model_feature_maps
from ..train.end_to_end import (
    COPY_PASSAGE,
    KEY_SHARE,
    copying_sequences,
    copying_weights,
    fit_end_to_end,
    joined_sources,
    key_sequences,
    retrieval_scores,
    sample_texts,
    top_heads,
)
from ..train.lora import add_lora
from .capture import capture_attention, reordered
from .lm_config import HELD_OUT_KEY_SEED, HELD_OUT_SAMPLES, EndToEndOptions, LMCompareConfig
from .models import cache_folder

PROMPT_WORDS = 20  # each sampled text starts from the first words of a train paragraph
PROMPT_TOKENS = 64  # room for the prompt beside the sampled tokens when a text is cut to token ids
RETRIEVAL_SEQUENCES = 8  # training samples scored by retrieval_scores (two forward passes each with weights)


def read_text(path: str | None, part: str) -> str:
    """The text of file ``path``, or the shipped corpus's ``part`` ("train", "heldout") when None."""
    if path is None:
        return load_text(part)
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def fit_hedgehog(model: Any, tokenizer: Any, name: str, train: str, config: LMCompareConfig,
                 *, with_window: bool, sparse_cache: Any = None) -> tuple[FittedFeatureMaps, int]:
    """Hedgehog maps, one set per layer, fitted on the capture of ``train`` under the model's softmax attention;
    ``with_window``: fitted with the softmax window and sinks in place (the hybrid's maps), with LoLCATs' per-head
    factor γ under ``--gamma``; ``sparse_cache`` (a :class:`~linattn.SparseCache`, or one per layer): with a sparse
    exact cache in place too. Returns the maps and the number of captured tokens."""
    fit = config.fit
    model.set_attn_implementation("sdpa")
    capture = capture_attention(model, tokenizer, train, max_tokens=fit.max_tokens, model_name=name,
                                orders=fit.orders)
    options: dict[str, Any] = {"progress": not config.quiet}
    if fit.steps is not None:
        options["steps"] = fit.steps
    if fit.num_features is not None:
        options["num_features"] = fit.num_features
    if with_window:
        options.update(window=config.window, sinks=config.sinks, window_factor=fit.gamma)
        if sparse_cache is not None:
            options["sparse_cache"] = sparse_cache
    return fit_model_feature_maps(capture, kind="hedgehog", **options), capture.num_tokens


def sampled_texts(model: Any, tokenizer: Any, prompts: list[str], tokens: int, path: str | None) -> list[str]:
    """The end-to-end stage's texts: ``tokens`` tokens sampled (seed 0) after each prompt, or read from ``path``
    (``--end-to-end-texts``) when that file was written for the same model, prompts and length; sampling takes
    minutes, so a run writes the file when it is missing."""
    name = str(getattr(model.config, "_name_or_path", ""))
    if os.path.dirname(os.path.abspath(name)) == os.path.abspath(cache_folder()):  # a GGUF conversion: its folder
        name = os.path.basename(name)  # is named by the file's bytes, the same in every install; the path is not
    settings = {"model": name, "prompts": prompts, "tokens": tokens, "seed": 0}
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            saved = json.load(handle)
        if {key: saved.get(key) for key in settings} != settings:
            raise LinearAttentionError(
                f"--end-to-end-texts: {path} holds texts sampled for another model, other prompts or another "
                "length; pass another path (it is written when missing) or remove it"
            )
        return list(saved["texts"])
    texts = sample_texts(model, tokenizer, prompts, tokens=tokens, seed=0)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({**settings, "texts": texts}, handle, ensure_ascii=False)
    return texts


def token_ids(tokenizer: Any, texts: list[str], tokens: int) -> list[torch.Tensor]:
    """Each text as token ids (N,), cut where the end-to-end stage cuts them (``tokens`` and a prompt's room)."""
    return [torch.as_tensor(tokenizer(text)["input_ids"][: tokens + PROMPT_TOKENS]) for text in texts]


def training_sequences(model: Any, tokenizer: Any, train: str,
                       options: EndToEndOptions) -> tuple[list[torch.Tensor], float]:
    """The end-to-end stage's texts as token ids (N,) each, sampled from the model itself under softmax attention,
    prompted by the train text's paragraphs (or read from ``--end-to-end-texts``); and the seconds that took."""
    starts = [" ".join(paragraph.split()[:PROMPT_WORDS]) for paragraph in paragraphs(train)]
    prompts = [starts[i % len(starts)] for i in range(options.samples)]
    model.set_attn_implementation("sdpa")
    begin = time.perf_counter()
    texts = sampled_texts(model, tokenizer, prompts, options.tokens, options.texts)
    return token_ids(tokenizer, texts, options.tokens), time.perf_counter() - begin


def retrieval_heads(model: Any, plain: list[torch.Tensor], config: LMCompareConfig) -> torch.Tensor:
    """(layers, heads) bool: the ``--retrieval-heads`` heads of highest :func:`~.end_to_end.retrieval_scores` on
    the first training samples (never the held-out ones), under the model's softmax attention."""
    model.set_attn_implementation("sdpa")
    scored = plain[: min(RETRIEVAL_SEQUENCES, len(plain) - HELD_OUT_SAMPLES)]
    scores = retrieval_scores(model, scored, window=config.window, sinks=config.sinks)
    return top_heads(scores, config.end_to_end.retrieval_heads)


@dataclass
class TrainingSet:
    """The end-to-end stage's sequences, held-out ones last, with their position weights (None: all 1)."""

    sequences: list[torch.Tensor]
    weights: list[Any] | None
    held_out: int  # the last this many sequences are held out
    copying: int  # copying sequences among them (of the samples and of the train text)
    corpus: int  # orders of the train text among them
    keys: int = 0  # key-retrieval sequences among them


def _with_copies(texts: list[torch.Tensor], options: EndToEndOptions, seed: int,
                 join: bool) -> list[tuple[torch.Tensor, Any]]:
    """Each copying sequence of ``texts`` with its position weights (the repeat weighted), its gap drawn from
    ``options.copy_gap``; with ``join``, each text followed by the next ones where a gap needs more than one."""
    if not texts or not options.copies:
        return []
    gap = options.copy_gap
    sources = joined_sources(texts, COPY_PASSAGE[1] + gap[1]) if join else texts
    return list(zip(copying_sequences(sources, gap=gap, seed=seed),
                    copying_weights(sources, options.repeat_weight, gap=gap, seed=seed), strict=True))


def training_set(plain: list[torch.Tensor], corpus: list[torch.Tensor], options: EndToEndOptions,
                 keys: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> TrainingSet:
    """The samples ``plain``, their copying sequences, the train text's orders ``corpus`` and theirs, and the
    key-retrieval sequences ``keys`` (sequences and their position weights: :func:`key_set`), in training order.
    The last HELD_OUT_SAMPLES samples, one copying sequence made from them alone and the last HELD_OUT_SAMPLES key
    sequences are held out; the training copies come from the other samples alone (samples are joined for gaps
    longer than one, the train text's orders never: they share its paragraphs)."""
    held = HELD_OUT_SAMPLES
    training, held_out = (plain[:-held], plain[-held:]) if plain else ([], [])
    samples, copies = [(x, None) for x in training], _with_copies(training, options, 0, join=True)
    held_copies = _with_copies(held_out, options, 2, join=True)[-1:]
    corpus_copies = _with_copies(corpus, options, 1, join=False)
    pairs = list(zip(*keys, strict=True)) if keys is not None else []
    key_train, key_held = pairs[:-held], pairs[-held:]
    ordered = (samples + copies + [(x, None) for x in corpus] + corpus_copies + key_train
               + [(x, None) for x in held_out] + held_copies + key_held)
    weights = None if options.repeat_weight == 1 and not pairs else [marks for _, marks in ordered]
    return TrainingSet([ids for ids, _ in ordered], weights, len(held_out) + len(held_copies) + len(key_held),
                       len(copies) + len(held_copies) + len(corpus_copies), len(corpus), len(pairs))


def key_set(tokenizer: Any, train: str,
            options: EndToEndOptions) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """With ``options.keys``: that many key-retrieval sequences of the train text (draw ``options.key_seed``) and
    HELD_OUT_SAMPLES more to hold out (drawn apart, HELD_OUT_KEY_SEED: never among any run's training ones), with
    their position weights (:func:`~linattn.train.end_to_end.key_sequences`); None without."""
    if not options.keys:
        return None
    trained = key_sequences(tokenizer, train, count=options.keys, filler=options.key_filler, share=KEY_SHARE,
                            seed=options.key_seed)
    held = key_sequences(tokenizer, train, count=HELD_OUT_SAMPLES, filler=options.key_filler, share=KEY_SHARE,
                         seed=HELD_OUT_KEY_SEED)
    return trained[0] + held[0], trained[1] + held[1]


def corpus_sequences(tokenizer: Any, train: str, options: EndToEndOptions) -> list[torch.Tensor]:
    """With ``--end-to-end-corpus-orders K``: the training text itself in K paragraph orders, as token ids of
    ``--end-to-end-tokens`` each, trained on beside the samples (none without it)."""
    if not options.corpus_orders:
        return []
    return token_ids(tokenizer, reordered(train, options.corpus_orders, seed=0), options.tokens)


def training_text_count(tokenizer: Any, train: str, options: EndToEndOptions) -> int:
    """End-to-end training sequences that come from the training text (its orders and their copying sequences):
    what the stage trains on beyond its samples, with no sampling."""
    data = training_set([], corpus_sequences(tokenizer, train, options), options)
    return len(data.sequences)


def train_end_to_end(model: Any, tokenizer: Any, fitted: FittedFeatureMaps, config: LMCompareConfig, train: str,
                     plain: list[torch.Tensor], heads: torch.Tensor | None, *, gates: list[Any] | None = None,
                     student_options: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """A copy of ``fitted`` trained end to end (:mod:`.end_to_end`) on the sampled sequences ``plain`` (and their
    copying sequences, and the train text with ``--end-to-end-corpus-orders``); only the ``heads`` marked, when
    given (the others with ``--train-other-heads``). ``fitted`` stays as it was. With ``--end-to-end-lora R`` the
    maps stay as they are and rank-R adapters are trained instead (detached from the model on return). Returns the
    copy, the adapters (or None) and what it took. ``gates`` (a student's, :class:`linattn.nn.KeyGates` per layer)
    are trained in place beside the maps, with the student's ``linear_attention`` options (``update="delta"``)."""
    options = config.end_to_end
    data = training_set(plain, corpus_sequences(tokenizer, train, options), options,
                        key_set(tokenizer, train, options))
    if heads is not None and options.train_other_heads:
        heads = ~heads
    tuned = copy.deepcopy(fitted)
    # with --sparse-cache, trained with the cache in place; a student's gates and update rule likewise
    hf.linearize(model, tuned, gates=gates, **options.cache_options, **(student_options or {}))
    adapters = add_lora(model, rank=options.lora_rank) if options.lora_rank else None
    if adapters is not None:
        heads = None  # every map stays as it is (the retrieval heads' maps may come from --retrieval-maps)
    try:
        longest = max([options.tokens + PROMPT_TOKENS, *(ids.shape[-1] for ids in data.sequences)])
        info = fit_end_to_end(model, tokenizer, data.sequences, max_tokens=longest,
                              steps=options.steps, held_out=data.held_out, progress=not config.quiet, heads=heads,
                              weights=data.weights, adapters=adapters, adapter_lr=options.lora_lr,
                              train_maps=adapters is None)
    finally:
        if adapters is not None:
            adapters.remove()  # attached again for its own row only
    model.set_attn_implementation("sdpa")
    return tuned, adapters, {"samples": len(plain), "copying_sequences": data.copying,
                             "corpus_sequences": data.corpus, "key_sequences": data.keys,
                             **({"key_draw": options.key_seed} if data.keys else {}),
                             "tokens": options.tokens, "steps": options.steps,
                             "heads": None if heads is None else int(heads.sum()),
                             "repeat_weight": options.repeat_weight, "copy_gap": list(options.copy_gap),
                             "lora_rank": options.lora_rank,
                             "sparse_cache": options.sparse_cache,
                             "best_held_out_kl": info["best_held_out"], "history": info["history"]}
