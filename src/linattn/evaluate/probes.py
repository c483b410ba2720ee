"""Long-range probes for causal LMs: what a softmax window cannot do and linear attention must.

Plain perplexity mostly measures local attention: a 64-token softmax window with 4 sink tokens comes within 5 % of
SmolLM2's own perplexity. These probes need keys far outside any such window, and are built from held-out text:

- **Repeated passage** (:func:`repeated_passages`): a passage of ``passage_tokens`` tokens of the text, then
  ``gap_tokens`` tokens of the text that follows it (other text, taken cyclically, never the passage itself), then
  the passage again; only the repeat is scored. A model that can look back copies it (SmolLM2: perplexity ≈ 1.3);
  one that cannot sees ordinary text (≈ 30). The gap should be ≥ 4 windows.
- **Passkey retrieval** (:func:`passkeys`): a 5-digit number stated once at the start, ``filler_tokens`` tokens of
  the text, then "What is the pass key? The pass key is"; a trial counts as retrieved when the model's greedy
  prediction is the key at every one of its tokens (scored in one forward pass, teacher-forced: the same as
  greedy generation producing the key).

Token sequences are assembled from token ids (pieces tokenized separately), so their lengths are exact.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LinearAttentionError
from ..train.end_to_end import bos_prefix as _prefix
from ..train.end_to_end import cyclic as _cyclic
from ..train.end_to_end import piece_ids as _ids
from .perplexity import score_tokens

PASSKEY_INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "The pass key is {key}. Remember it. {key} is the pass key.\n")
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class Probe:
    """One probe sequence: ``input_ids`` (N,), scored from ``score_from`` on; ``distance`` tokens lie between
    the information and the place it is needed (the gap, or the filler)."""

    kind: str
    input_ids: torch.Tensor
    score_from: int
    distance: int


def repeated_passages(
    tokenizer: Any, text: str, *, passage_tokens: int = 128, gap_tokens: int = 512, trials: int = 4
) -> list[Probe]:
    """``trials`` repeated-passage probes, passages starting at evenly spaced places of ``text``."""
    ids = _ids(tokenizer, text)
    if passage_tokens < 1 or gap_tokens < 0 or trials < 1:
        raise LinearAttentionError(
            f"passage_tokens/gap_tokens/trials: need ≥ 1, ≥ 0, ≥ 1, got {passage_tokens}/{gap_tokens}/{trials}"
        )
    if passage_tokens + gap_tokens > len(ids):
        raise LinearAttentionError(
            f"text: {len(ids)} tokens, but a passage of {passage_tokens} and a gap of {gap_tokens} other tokens need "
            f"{passage_tokens + gap_tokens}; pass a longer text or a shorter passage/gap"
        )
    prefix = _prefix(tokenizer)
    probes = []
    for trial in range(trials):
        start = trial * len(ids) // trials
        passage = _cyclic(ids, start, passage_tokens)
        gap = _cyclic(ids, start + passage_tokens, gap_tokens)  # the text after the passage: never the passage
        sequence = prefix + passage + gap + passage
        probes.append(Probe("repeat", torch.tensor(sequence), len(prefix) + passage_tokens + gap_tokens, gap_tokens))
    return probes


def passkeys(tokenizer: Any, filler_text: str, *, filler_tokens: int = 1024, trials: int = 5,
             seed: int = 0) -> list[Probe]:
    """``trials`` passkey probes with ``filler_tokens`` tokens of ``filler_text`` (cyclically) after the key."""
    filler_ids = _ids(tokenizer, filler_text)
    if not filler_ids or filler_tokens < 0 or trials < 1:
        raise LinearAttentionError(
            f"filler_text/filler_tokens/trials: need a non-empty text, ≥ 0, ≥ 1, got {len(filler_ids)} tokens/"
            f"{filler_tokens}/{trials}"
        )
    generator = random.Random(seed)
    prefix, question = _prefix(tokenizer), _ids(tokenizer, PASSKEY_QUESTION)
    probes = []
    for trial in range(trials):
        key = generator.randint(10000, 99999)
        intro = _ids(tokenizer, PASSKEY_INTRO.format(key=key))
        filler = _cyclic(filler_ids, trial * len(filler_ids) // trials, filler_tokens)
        answer = _ids(tokenizer, f" {key}")
        sequence = prefix + intro + filler + question + answer
        probes.append(Probe("passkey", torch.tensor(sequence), len(sequence) - len(answer), filler_tokens))
    return probes


def repeat_perplexity(model: Any, probes: list[Probe]) -> float:
    """exp of the mean negative log-likelihood over the scored tokens of all ``probes``."""
    total, count = 0.0, 0
    for probe in probes:
        logp = score_tokens(model, probe.input_ids[None], probe.score_from)  # (1, scored)
        total -= float(logp.sum())
        count += logp.numel()
    return math.exp(total / count)


def passkey_accuracy(model: Any, probes: list[Probe]) -> float:
    """Fraction of ``probes`` whose key is the greedy prediction at every key token."""
    device = next(model.parameters()).device
    hits = 0
    for probe in probes:
        ids = probe.input_ids[None].to(device)  # (1, N)
        needed = ids.shape[1] - probe.score_from + 1
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=needed).logits[:, -needed:-1]
        hits += bool((logits.argmax(-1) == ids[:, probe.score_from:]).all())
    return hits / len(probes)


def key_scores(model: Any, probes: list[Probe]) -> tuple[int, float]:
    """Passkey ``probes`` scored two ways: the hits (the key the greedy prediction at every key token, as
    :func:`passkey_accuracy` counts them) and the mean log-probability of the key's tokens, a finer measure than
    hits, which a small model rarely scores."""
    hits, total = 0, 0.0
    for probe in probes:
        ids = probe.input_ids[None]
        needed = ids.shape[1] - probe.score_from + 1
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=needed).logits[:, -needed:-1]
        target = ids[:, probe.score_from :]
        hits += bool((logits.argmax(-1) == target).all())
        total += float(torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).sum())
    return hits, total / len(probes)


def long_range_probes(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    passage_tokens: int = 128,
    gap_tokens: int = 512,
    repeat_trials: int = 4,
    passkey_lengths: tuple[int, ...] = (1024, 2048, 4096),
    passkey_trials: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Both probes on ``model``: ``{"repeat_perplexity", "passkey": {filler length: accuracy}, "seconds"}``."""
    start = time.perf_counter()
    repeat = repeat_perplexity(
        model, repeated_passages(tokenizer, text, passage_tokens=passage_tokens, gap_tokens=gap_tokens,
                                 trials=repeat_trials)
    )
    accuracy = {
        length: passkey_accuracy(model, passkeys(tokenizer, text, filler_tokens=length, trials=passkey_trials,
                                                 seed=seed))
        for length in passkey_lengths
    }
    return {"repeat_perplexity": repeat, "passkey": accuracy, "seconds": time.perf_counter() - start}


def repeats_by_gap(model: Any, tokenizer: Any, text: str, gaps: list[int] | tuple[int, ...], *,
                   passage_tokens: int = 128, trials: int = 4) -> dict[str, float | None]:
    """The repeated passage's perplexity ``gap`` tokens back, for each gap: ``{str(gap): perplexity}``, None where
    ``text`` is too short for a passage and that gap (the gap must not contain the passage again)."""
    out: dict[str, float | None] = {}
    length = len(_ids(tokenizer, text))
    for gap in gaps:
        if passage_tokens + gap > length:
            out[str(gap)] = None
            continue
        out[str(gap)] = repeat_perplexity(model, repeated_passages(tokenizer, text, passage_tokens=passage_tokens,
                                                                   gap_tokens=gap, trials=trials))
    return out
