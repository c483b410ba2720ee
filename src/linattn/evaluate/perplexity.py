"""Perplexity of a causal LM on a text: strided windows for texts longer than the context, tokens per second.

>>> model, tokenizer, name = load_model("smollm2")                           # doctest: +SKIP
>>> perplexity(model, tokenizer, load_text("heldout")).perplexity           # doctest: +SKIP
20.0

A token is scored once, from the log-probability the model gives it after the tokens before it in its window
(natural log; perplexity = exp of the mean negative log-likelihood over the scored tokens). The first token has no
context and is never scored. With ``max_length`` ≥ the text's length that is one forward pass; longer texts run in
windows of ``max_length`` tokens starting every ``stride`` tokens, each scoring only its tokens not scored before,
so every token is scored with at least ``max_length − stride`` tokens of context (or all tokens before it).

The model runs with whatever attention it has (softmax, or linear after :func:`linattn.hf.linearize`); only the
logits of scored positions are formed (``logits_to_keep``), since a 49k-word vocabulary makes full logits large.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LinearAttentionError


@dataclass
class Perplexity:
    """``perplexity`` = exp(``nll``), ``nll`` the mean negative log-likelihood (nats) over ``tokens`` scored
    tokens; ``seconds`` of model time, ``tokens_per_second`` = tokens forwarded / seconds."""

    perplexity: float
    nll: float
    tokens: int
    seconds: float
    tokens_per_second: float


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def keeps_logits(model: Any) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (then only the logits asked for are formed)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def score_tokens(model: Any, input_ids: torch.Tensor, score_from: int) -> torch.Tensor:
    """Log-probabilities (float64) of tokens ``input_ids[:, score_from:]``, each after all tokens before it.

    ``input_ids`` is (B, N) without padding; returns (B, N − score_from). ``score_from`` ≥ 1.
    """
    if input_ids.dim() != 2:
        raise LinearAttentionError(f"input_ids: expected (B, N), got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    if not 1 <= score_from < length:
        raise LinearAttentionError(f"score_from: need 1 ≤ score_from < {length} (the length), got {score_from}")
    input_ids = input_ids.to(_device(model))
    needed = length - score_from + 1  # logits at positions score_from − 1 … N − 1; the last one predicts nothing
    extra = {"logits_to_keep": needed} if keeps_logits(model) else {}
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False, **extra).logits  # (B, needed or N, V)
    logits = logits[:, -needed:-1].double()  # (B, N − score_from, V): predictions of tokens score_from … N − 1
    targets = input_ids[:, score_from:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def perplexity(
    model: Any,
    tokenizer: Any,
    text: str | torch.Tensor,
    *,
    max_length: int | None = None,
    stride: int | None = None,
) -> Perplexity:
    """Perplexity of causal LM ``model`` on ``text`` (a string, or token ids (N,) / (1, N)); see the module docstring.

    Args:
        max_length: window length in tokens (default: the model's ``max_position_embeddings``, at most 2048).
        stride: start of one window to the next (default ``max_length // 2``); < ``max_length``.
    """
    if isinstance(text, str):
        ids = torch.as_tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    else:
        ids = torch.as_tensor(text, dtype=torch.long)
    ids = ids.reshape(1, -1)  # (1, N)
    length = ids.shape[1]
    if length < 2:
        raise LinearAttentionError(f"text: {length} token(s); perplexity needs at least 2")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
    max_length = int(max_length or min(limit, 2048))
    stride = int(stride or max(1, max_length // 2))
    if max_length < 2 or not 1 <= stride < max_length:  # stride = max_length would leave window starts unscored
        raise LinearAttentionError(
            f"max_length/stride: need max_length ≥ 2 and 1 ≤ stride < max_length, got {max_length}/{stride}"
        )
    total, scored, forwarded, seconds = 0.0, 0, 0, 0.0
    done = 1  # tokens before this index are scored (token 0 never is)
    begin = 0
    while done < length:
        end = min(begin + max_length, length)
        if end > done:
            window = ids[:, begin:end]  # (1, ≤ max_length)
            start = time.perf_counter()
            logp = score_tokens(model, window, done - begin)
            seconds += time.perf_counter() - start
            total -= float(logp.sum())
            scored += logp.numel()
            forwarded += window.shape[1]
            done = end
        begin += stride
    nll = total / scored
    return Perplexity(math.exp(nll), nll, scored, seconds, forwarded / seconds if seconds > 0 else math.inf)
