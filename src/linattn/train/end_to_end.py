"""Fitting a causal LM's maps end to end: its next-token distribution, not each head's rows, is the target.

:func:`linattn.train.distill.fit_model_feature_maps` fits every head on its own softmax rows. On a decoder that is not
enough: the errors of 270 heads compound through 30 layers, and a map fitted on rows of at most N keys puts too much
weight on the far keys of longer rows (SmolLM2 with the hybrid window, maps fitted on 512-token pieces: perplexity
about twice the original's on the tokens past position 512 alone, docs/models.md). Two remedies, both here:

- :func:`sample_texts`: long training text *from the model itself* (sampled continuations of short prompts), so
  the fits see rows as long as the contexts they will serve, without any text beyond the shipped corpus;
- :func:`copying_sequences`: a passage, other text, the passage again — the model copies the repeat, and the
  hybrid's linear part must learn to, since the first copy has left the window; :func:`copying_weights` weights
  the positions that predict the repeat in the loss;
- :func:`key_sequences`: a number stated once, other text, a question the number answers: the memory must carry it
  past the window (the passkey probe's task, in other words);
- :func:`retrieval_scores`: which heads retrieve beyond the window (reach far on a repeat, not on plain text),
  so that maps trained for copying can serve those heads and maps trained on plain text the others
  (:meth:`~linattn.feature_maps.fitted.FittedFeatureMaps.with_heads`, and ``heads=`` of :func:`fit_end_to_end`);
- :func:`fit_end_to_end`: the same map parameters (every layer's, and the γ form's per-head factors) trained on
  KL(p_softmax ‖ p_linear) of the next token, averaged over every position of the training sequences, with the
  model's own weights frozen. The teacher is the same model with its own attention, computed once per sequence and
  kept as its top 256 tokens plus one bucket for the rest (:func:`coarse_kl`).
  Early stopping on held-out sequences keeps the best parameters.

LoLCATs' second stage fine-tunes the model's weights (LoRA) on next-token loss; this stage trains only the
attention maps by default, so the model's weights stay exactly those shipped. ``adapters=`` (a
:class:`~linattn.train.lora.LoRA`) trains low-rank updates of the attention projections as well or instead
(``train_maps=False``): a fine-tuned model, to be reported as one.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import hf
from ..errors import LinearAttentionError
from ..feature_maps.fitted import check_head_mask
from ..state import SparseCache

if TYPE_CHECKING:
    from .lora import LoRA


def sample_texts(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, tokens: int = 1024, batch_size: int = 8, seed: int = 0,
    temperature: float = 1.0, top_p: float = 0.95, repetition_penalty: float = 1.1,
) -> list[str]:
    """One sampled continuation of exactly ``tokens`` new tokens per prompt (end-of-text suppressed), prompt
    included, from ``model`` as it is (run it before linearizing). Seeded: the same seed gives the same texts.

    The keys and values go in a cache allocated once for the whole length (transformers' static cache): the
    default cache grows by a copy of every layer's keys and values at every token, which on SmolLM2 (2 threads, 8
    prompts) made a step at 1,400 tokens cost 176 ms against 80 ms in the static cache."""
    if tokens < 1 or batch_size < 1 or not prompts:
        raise LinearAttentionError(f"prompts/tokens/batch_size: need ≥ 1 prompt, tokens ≥ 1, batch_size ≥ 1, got "
                                   f"{len(prompts)}/{tokens}/{batch_size}")
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"  # generation continues from the last position of every row
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    texts: list[str] = []
    try:
        for begin in range(0, len(prompts), batch_size):
            batch = tokenizer(list(prompts[begin : begin + batch_size]), return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                                     temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty,
                                     pad_token_id=tokenizer.pad_token_id, cache_implementation="static")
            width, kept = batch["input_ids"].shape[1], batch["attention_mask"].sum(-1).tolist()  # (B,)
            # left padding dropped by position (a pad token need not be a special token)
            texts += [tokenizer.decode(row[width - n :], skip_special_tokens=True)
                      for row, n in zip(out, kept, strict=True)]
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    return texts


COPY_PASSAGE, COPY_GAP = (32, 192), (128, 768)  # copying sequences' passage P and gap G: uniform draws


def mean_copy_length(gap: tuple[int, int] = COPY_GAP) -> float:
    """The expected length 2P + G of a copying sequence drawn from :data:`COPY_PASSAGE` and ``gap``."""
    return float(sum(COPY_PASSAGE) + sum(gap) / 2)


def joined_sources(sequences: Sequence[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """Each token sequence (N,) followed by the ones after it in ``sequences`` (wrapping round to the first) until
    it is ``tokens`` long, then cut there: sources for copying sequences whose gap is longer than one sequence.

    A sequence is never joined to itself (its passage would recur inside the gap, and the copy be a short one), so
    a source stays shorter than ``tokens`` when all of ``sequences`` together are; :func:`copying_sequences` then
    skips it for a draw it cannot hold. Join only sequences that do not share text: orders of one text do."""
    if tokens < 1:
        raise LinearAttentionError(f"tokens: need ≥ 1, got {tokens}")
    out = []
    for index in range(len(sequences)):
        parts, length = [], 0
        for step in range(len(sequences)):
            if length >= tokens:
                break
            part = sequences[(index + step) % len(sequences)].reshape(-1)
            parts.append(part)
            length += part.shape[0]
        out.append(torch.cat(parts)[:tokens])
    return out


def _copy_plans(sequences: Sequence[torch.Tensor], passage: tuple[int, int], gap: tuple[int, int],
                seed: int) -> list[tuple[int, int, int]]:
    """(index, P, G) of each sequence long enough for its drawn passage P and gap G (seeded draws, one per
    sequence, whether it is long enough or not)."""
    generator = random.Random(seed)
    plans = []
    for index, ids in enumerate(sequences):
        length, span = generator.randint(*passage), generator.randint(*gap)
        if length + span <= ids.shape[-1]:
            plans.append((index, length, span))
    return plans


def copying_sequences(
    sequences: Sequence[torch.Tensor], *, passage: tuple[int, int] = COPY_PASSAGE, gap: tuple[int, int] = COPY_GAP,
    seed: int = 0,
) -> list[torch.Tensor]:
    """From each token sequence (N,) long enough: its first P tokens, the G tokens after them, then the first P
    again (P, G drawn uniformly from the ranges, seeded). The softmax model copies the repeat; trained on such
    sequences, the linear part learns to retrieve what has left the window (a window alone cannot)."""
    return [_copy(sequences[i], length, span) for i, length, span in _copy_plans(sequences, passage, gap, seed)]


def copying_weights(
    sequences: Sequence[torch.Tensor], repeat_weight: float, *, passage: tuple[int, int] = COPY_PASSAGE,
    gap: tuple[int, int] = COPY_GAP, seed: int = 0,
) -> list[torch.Tensor]:
    """Position weights for :func:`fit_end_to_end`'s ``weights``, one (N,) float32 tensor per sequence of
    :func:`copying_sequences` with the same arguments (same order): ``repeat_weight`` at the positions that predict
    a token of the repeat (position t predicts token t + 1), 1 elsewhere.

    The repeat is a small share of a copying sequence's positions (P of 2P + G); weighting it more steers training
    towards recall beyond the window, at some cost on plain text (docs/models.md measures the trade-off).
    """
    if not (math.isfinite(repeat_weight) and repeat_weight > 0):
        raise LinearAttentionError(f"repeat_weight: need a finite weight > 0, got {repeat_weight}")
    out = []
    for _, length, span in _copy_plans(sequences, passage, gap, seed):
        weights = torch.ones(2 * length + span)
        weights[length + span - 1 : -1] = repeat_weight  # logits at P + G − 1 … predict the repeat's P tokens
        out.append(weights)
    return out


def _copy(ids: torch.Tensor, length: int, span: int) -> torch.Tensor:
    """ids[:P], ids[P : P + G], ids[:P] (P = length, G = span)."""
    return torch.cat([ids[:length], ids[length : length + span], ids[:length]])


# Key-retrieval sequences' phrasings: (statement with {key}, question the key answers). None of them is the
# passkey probe's own wording (linattn.evaluate.probes.PASSKEY_INTRO / PASSKEY_QUESTION), which stays held out:
# tests/test_key_sequences.py checks it.
KEY_PHRASINGS = (
    ("Somewhere in the notes below is a code. Keep it in mind. The code is {key}. Again: {key} is the code.\n",
     "\nWhat was the code? The code is"),
    ("Remember this number for later: {key}. The number to remember is {key}.\n",
     "\nWhich number were you asked to remember? The number to remember is"),
    ("The secret is a number, {key}. Do not forget the secret: {key}.\n",
     "\nNow tell me the secret. The secret is"),
    ("Your locker combination is {key}. Write it down: {key}.\n",
     "\nWhat is your locker combination? It is"),
    ("Important: the access number is {key}. Once more, the access number is {key}.\n",
     "\nPlease repeat the access number. The access number is"),
    ("Note the reference {key} before reading on. Reference: {key}.\n",
     "\nWhich reference did the note give? The reference was"),
)
KEY_FILLER = (256, 3072)  # filler tokens between the statement and the question: uniform draws
# the share of a key sequence's loss on the positions that predict the number: on SmolLM2's shipped student, 60 steps
# at 0.5 (fillers 256-2,048) moved the held-out passkey's key log-probability at 2k from -6.88 to -2.55
KEY_SHARE = 0.5


def piece_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids with no special tokens: a piece of a sequence assembled from pieces."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_prefix(tokenizer: Any) -> list[int]:
    """The begin-of-sequence token, if the tokenizer puts one in front of a text."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []


def cyclic(ids: list[int], start: int, count: int) -> list[int]:
    """``count`` of ``ids`` from ``start`` on, wrapping round to the first."""
    return [ids[(start + i) % len(ids)] for i in range(count)]


def key_sequences(
    tokenizer: Any, text: str, *, count: int, filler: tuple[int, int] = KEY_FILLER, share: float = KEY_SHARE,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``count`` key-retrieval sequences (N,) and their position weights (N,): a number of 4–6 digits stated in
    one of :data:`KEY_PHRASINGS` (in turn), a run of ``text``'s tokens from a random place (cyclically, F drawn
    uniformly from ``filler``), the phrasing's question, then the number. The positions that predict the number
    carry ``share`` of the sequence's weight (each other position 1): a handful of positions among a thousand
    would otherwise teach nothing. Seeded; the pieces are tokenized apart, so the lengths are exact.

    Trained on, the memory must carry a number from one place to a question thousands of tokens on, past the
    window: what the passkey probe asks, in other words and on other text."""
    low, high = filler
    if count < 1 or not 1 <= low <= high or not 0 < share < 1:
        raise LinearAttentionError(f"count/filler/share: need ≥ 1, 1 ≤ LOW ≤ HIGH, 0 < share < 1; got {count}/"
                                   f"{filler}/{share}")

    def ids(piece: str) -> list[int]:
        return piece_ids(tokenizer, piece)

    source = ids(text)
    if not source:
        raise LinearAttentionError("text: no tokens to fill key-retrieval sequences with; pass a non-empty text")
    prefix = bos_prefix(tokenizer)
    generator = random.Random(seed)
    sequences, weights = [], []
    for index in range(count):
        statement, question = KEY_PHRASINGS[index % len(KEY_PHRASINGS)]
        digits = generator.randint(4, 6)
        key = generator.randint(10 ** (digits - 1), 10**digits - 1)
        length, start = generator.randint(low, high), generator.randrange(len(source))
        answer = ids(f" {key}")
        tokens = prefix + ids(statement.format(key=key)) + cyclic(source, start, length) + ids(question) + answer
        n, a = len(tokens), len(answer)
        weight = torch.ones(n)
        weight[n - a - 1 : n - 1] = share * (n - a) / ((1 - share) * a)  # position t predicts token t + 1
        sequences.append(torch.tensor(tokens))
        weights.append(weight)
    return sequences, weights


def retrieval_scores(
    model: Any, sequences: Sequence[torch.Tensor], *, window: int, sinks: int = 0,
    passage: tuple[int, int] = (32, 192), gap: tuple[int, int] = (128, 768), seed: int = 0,
) -> torch.Tensor:
    """How much each head of ``model`` (with its own attention) retrieves beyond a window: (layers, heads).

    For each token sequence (N,) long enough, its copying sequence (:func:`copying_sequences`, same draws) and the
    sequence itself cut to the same length are run; a head's score is the attention mass its queries in the repeat
    put on keys outside the window (older than ``window`` and not among the first ``sinks``), minus the mass the
    same positions put there in the plain text, averaged over the sequences. Heads that reach far only when there
    is something to copy score high; heads that spread over the far past on any text score about 0. A hybrid's
    linear part serves the two kinds differently: sharp recall on the first, a smooth summary on the second.
    Returned in float64.
    """
    if window < 1 or sinks < 0:
        raise LinearAttentionError(f"window/sinks: need ≥ 1 and ≥ 0, got {window}/{sinks}")
    plans = _copy_plans(sequences, passage, gap, seed)
    if not plans:
        raise LinearAttentionError(f"sequences: none is long enough for a passage and gap drawn from {passage} and "
                                   f"{gap} tokens; pass longer sequences or smaller ranges")
    modules = hf.attention_modules(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns attention weights
    device = next(model.parameters()).device

    def far_mass(ids: torch.Tensor, first: int) -> torch.Tensor:  # (layers, heads): mean over queries ≥ first
        with torch.no_grad():
            weights = model(input_ids=ids[None].to(device), output_attentions=True, use_cache=False).attentions
        n = ids.shape[0]
        rows, cols = torch.arange(first, n, device=device)[:, None], torch.arange(n, device=device)[None]
        far = ((cols <= rows - window) & (cols >= sinks)).to(weights[0].dtype)  # (queries, keys)
        return torch.stack([(w[0, :, first:] * far).sum(-1).mean(-1) for w in weights]).double().cpu()

    try:
        total = torch.zeros(len(modules), model.config.num_attention_heads, dtype=torch.float64)
        for index, length, span in plans:
            copied, first = _copy(sequences[index], length, span), length + span
            total += far_mass(copied, first) - far_mass(sequences[index][: copied.shape[0]], first)
    finally:
        model.set_attn_implementation(previous)
    return total / len(plans)


def cache_split(model: Any, sequences: Sequence[torch.Tensor], *, window: int, sinks: int, mean: int,
                floor: int, top: int | None = None) -> tuple[list[SparseCache], torch.Tensor]:
    """A sparse cache per layer with ``mean`` pairs per head on average, split across heads in proportion to their
    :func:`retrieval_scores` on ``sequences`` (each head at least ``floor``; with ``top``, equally among the top
    heads alone: :meth:`~linattn.SparseCache.split`), and the scores. The copying draws scale with the window:
    passages of W/2 … 3W tokens repeated after 2W … 12W others (for W = 64, retrieval_scores' defaults); sequences
    of 15·W tokens always serve."""
    scores = retrieval_scores(model, sequences, window=window, sinks=sinks,
                              passage=(max(1, window // 2), 3 * window), gap=(2 * window, 12 * window))
    return SparseCache.split(scores, mean, floor=floor, top=top), scores


def top_heads(scores: torch.Tensor, count: int) -> torch.Tensor:
    """(layers, heads) bool: the ``count`` heads of highest ``scores`` (layers, heads), e.g. of
    :func:`retrieval_scores`; all heads when ``count`` exceeds their number."""
    marked = torch.zeros(scores.numel(), dtype=torch.bool)
    marked[scores.flatten().argsort(descending=True)[:count]] = True
    return marked.reshape(scores.shape)


TOP_TOKENS = 256  # the teacher's distribution kept per position: its top tokens and the rest as one bucket


def _log_probs(model: Any, ids: torch.Tensor, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)  # (1, N, V)


def _with_rest(top: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the top tokens (..., k) → (..., k + 1), the last entry log(1 − their total mass)."""
    total = torch.logsumexp(top, dim=-1, keepdim=True)
    rest = torch.log(-torch.expm1(total.clamp(max=-1e-7)))  # log(1 − e^total), total < 0
    return torch.cat([top, rest], dim=-1)


def _coarse_teacher(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (..., k) of the top tokens, log-probabilities (..., k + 1) with the rest bucket)."""
    top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return top.indices, _with_rest(top.values)


def coarse_kl(teacher: tuple[torch.Tensor, torch.Tensor], student: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position between the two distributions coarsened to the teacher's top tokens and one bucket
    for all others; ``student`` holds full log-probabilities (..., V). ≤ the full KL (coarsening never increases
    a divergence), equal to it up to the rest bucket's share."""
    indices, p = teacher
    q = _with_rest(student.gather(-1, indices))
    return (p.exp() * (p - q)).sum(-1)


def _head_masks(modules: list[Any], heads: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, 0/1 mask broadcast over it) for every trainable map parameter and γ factor of a layer whose
    heads are not all trained; [] when ``heads`` is None."""
    if heads is None:
        return []
    width = getattr(getattr(modules[0], hf.MAP_ATTRIBUTE), "num_heads", None) if modules else None
    check_head_mask(heads, len(modules), width)
    masks = []
    for module, row in zip(modules, heads, strict=True):
        factor = getattr(module, hf.OPTIONS_ATTRIBUTE, {}).get("window_factor")
        tensors = [*getattr(module, hf.MAP_ATTRIBUTE).parameters(),
                   *([factor] if isinstance(factor, torch.Tensor) else [])]
        for tensor in tensors:
            axis = 0 if tensor is factor else 1  # map parameters (P, H, ...), γ (H,)
            if tensor.dim() <= axis or tensor.shape[axis] != row.numel():
                raise LinearAttentionError(f"heads: a map parameter of shape {tuple(tensor.shape)} has no head axis; "
                                           "train every head (heads=None)")
            shape = [1] * tensor.dim()
            shape[axis] = row.numel()
            masks.append((tensor, row.to(tensor.dtype).reshape(shape)))
    return masks


def _position_weights(weights: Sequence[torch.Tensor | None] | None, ids: list[torch.Tensor],
                      max_tokens: int) -> list[torch.Tensor | None]:
    """``weights`` checked against the token sequences ``ids`` (each (1, n), already truncated to ``max_tokens``)
    and truncated likewise; all None when ``weights`` is None."""
    if weights is None:
        return [None] * len(ids)
    if len(weights) != len(ids):
        raise LinearAttentionError(f"weights: need one entry (None or a (N,) tensor) per text, got {len(weights)} "
                                   f"for {len(ids)} texts")
    out: list[torch.Tensor | None] = []
    for index, (entry, tokens) in enumerate(zip(weights, ids, strict=True)):
        if entry is None:
            out.append(None)
            continue
        entry = torch.as_tensor(entry, dtype=torch.float64)
        n = tokens.shape[-1]
        if entry.dim() != 1 or entry.shape[0] < n or (entry.shape[0] > n and n < max_tokens):
            raise LinearAttentionError(f"weights[{index}]: shape {tuple(entry.shape)}; need one weight per token of "
                                       "its text, (N,)")
        entry = entry[:n]
        if not bool(torch.isfinite(entry).all()) or bool((entry < 0).any()) or float(entry.sum()) <= 0:
            raise LinearAttentionError(f"weights[{index}]: need finite weights ≥ 0 with a positive sum")
        out.append(entry)
    return out


def fit_end_to_end(
    model: Any, tokenizer: Any, texts: Sequence[str | torch.Tensor], *, max_tokens: int = 1024, steps: int = 40,
    lr: float = 0.003, held_out: int = 2, eval_every: int = 5, seed: int = 0, progress: bool = False,
    heads: torch.Tensor | None = None, weights: Sequence[torch.Tensor | None] | None = None,
    adapters: LoRA | None = None, adapter_lr: float = 0.0005, train_maps: bool = True, gate_lr: float = 0.02,
) -> dict[str, Any]:
    """Train the maps of a model linearized by :func:`linattn.hf.linearize` (with learned maps) end to end.

    Args:
        model: a causal LM after ``hf.linearize(model, fitted)``; its own weights are frozen here, its maps trained
            in place (each attention module's ``linattn_feature_map``, its ``linattn_gates`` when it has any, and
            a ``window_factor`` tensor in its options: the γ form). texts: training sequences (strings, or token
            ids (N,)), each truncated to ``max_tokens`` tokens; the last ``held_out`` of them are held out for
            early stopping (every ``eval_every`` steps).
        steps, lr: Adam steps (one sequence each) and learning rate.
        heads: None (train every head's map), or a (layers, heads) bool tensor: only the marked heads' map
            parameters (and γ factors) are trained, the others stay exactly as they were.
        weights: None (every position counts 1), or one entry per text: None, or a (N,) tensor of non-negative
            position weights (N the text's tokens; position t predicts token t + 1), truncated with the text. A
            sequence's KL is then the weighted mean over its positions, in training and in the held-out
            evaluation alike; e.g. :func:`copying_weights`.
        adapters: None, or a :class:`~linattn.train.lora.LoRA` attached to ``model``
            (:func:`~linattn.train.lora.add_lora`): its low-rank updates of the attention projections are
            trained too, at ``adapter_lr`` (the teacher is the model with them disabled). This fine-tunes the
            model in effect (LoLCATs' second stage); without adapters the model's weights stay as shipped.
        train_maps: False keeps every map (and γ) as it is, e.g. to train the adapters alone.
        gate_lr: the learning rate of the gates (``linattn_gates``), whose biases start near the teacher and must
            travel several units.

    Returns ``{"history": [(step, train KL, held-out KL)], "best_held_out": KL, "seconds": s}``; the model keeps
    the parameters of the best held-out evaluation. ``linearize`` installs the very map modules (and γ tensors) of
    the ``FittedFeatureMaps`` it was given, so that object holds the trained maps too: ``fitted.save(path)``.
    """
    ids = [(torch.as_tensor(tokenizer(text)["input_ids"]) if isinstance(text, str) else torch.as_tensor(text))
           .reshape(-1)[:max_tokens][None] for text in texts]  # each (1, N)
    if held_out < 1 or len(ids) <= held_out or steps < 0 or eval_every < 1:
        raise LinearAttentionError(f"texts/held_out/steps/eval_every: need more than held_out ≥ 1 texts, steps ≥ 0, "
                                   f"eval_every ≥ 1; got {len(ids)}/{held_out}/{steps}/{eval_every}")
    scales = _position_weights(weights, ids, max_tokens)
    modules = hf.attention_modules(model)
    maps = [getattr(module, hf.MAP_ATTRIBUTE, None) for module in modules]
    if any(fmap is None for fmap in maps) or model.config._attn_implementation != hf.IMPLEMENTATION:
        raise LinearAttentionError("model: not linearized; call linattn.hf.linearize(model, fitted_maps) first")
    params = [param for fmap in maps if fmap is not None for param in fmap.parameters()]
    gated = [param for module in modules for param in getattr(module, hf.GATES_ATTRIBUTE, nn.Identity()).parameters()]
    if gated and heads is not None:
        raise LinearAttentionError("heads: the model's gates (linattn_gates) are per key head, not per head; train "
                                   "every head (heads=None)")
    params += gated
    for module in modules:
        factor = getattr(module, hf.OPTIONS_ATTRIBUTE, {}).get("window_factor")
        if isinstance(factor, torch.Tensor):
            params.append(factor)
    if adapters is not None and not getattr(adapters, "attached", False):
        raise LinearAttentionError("adapters: not attached to the model; pass the LoRA of add_lora(model) (or call "
                                   "its attach())")
    if not train_maps:
        if heads is not None:
            raise LinearAttentionError("heads: marks the heads whose maps are trained; with train_maps=False no map "
                                       "is, so pass heads=None")
        params = []
    elif not params:
        raise LinearAttentionError("model: its maps have no parameters to train (use maps from fit_model_feature_maps)")
    extra = [] if adapters is None else list(adapters.parameters())
    if not params and not extra:
        raise LinearAttentionError("train_maps=False: nothing left to train; pass adapters (add_lora(model))")
    masks = _head_masks(modules, heads) if params else []
    frozen = [(param, param.requires_grad) for param in model.parameters()]
    for param, _ in frozen:
        param.requires_grad_(False)
    for param in params + extra:
        param.requires_grad_(True)

    def original() -> Any:  # the teacher: the model as shipped (a context manager is used once)
        return contextlib.nullcontext() if adapters is None else adapters.disabled()
    # the teacher's distributions, cached coarsened: (N, V) floats per sequence would be 0.2 GB at N = 1,024 and
    # a 49k vocabulary, (N, 2k + 1) are 2 MB
    teacher: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def target(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in teacher:  # the model with its own attention
            model.set_attn_implementation("sdpa")
            try:
                with original():
                    teacher[index] = _coarse_teacher(_log_probs(model, ids[index], False), TOP_TOKENS)
            finally:
                model.set_attn_implementation(hf.IMPLEMENTATION)
        return teacher[index]

    def divergence(index: int, grad: bool) -> torch.Tensor:
        per_position = coarse_kl(target(index), _log_probs(model, ids[index], grad))[0]  # (N,)
        scale = scales[index]
        if scale is None:
            return per_position.mean()
        scale = scale.to(per_position)
        return (per_position * scale).sum() / scale.sum()

    train, held = list(range(len(ids) - held_out)), list(range(len(ids) - held_out, len(ids)))
    gate_ids = {id(p) for p in gated}
    plain = [p for p in params if id(p) not in gate_ids]
    groups = [group for group in ({"params": plain, "lr": lr},
                                  {"params": [p for p in params if id(p) in gate_ids], "lr": gate_lr})
              if group["params"]]
    optimiser = torch.optim.Adam(groups + ([{"params": extra, "lr": adapter_lr}] if extra else []))
    params = params + extra  # kept at their best evaluation alike
    order = random.Random(seed)
    best, best_loss = [p.detach().clone() for p in params], math.inf
    history: list[tuple[int, float, float]] = []
    start, train_loss = time.perf_counter(), math.nan
    was_training = model.training
    model.eval()
    try:
        for step in range(steps + 1):
            if step % eval_every == 0 or step == steps:
                loss = sum(float(divergence(i, False)) for i in held) / len(held)
                if not math.isfinite(loss):
                    raise LinearAttentionError(f"fit_end_to_end: the held-out KL became {loss} at step {step}; lower "
                                               "lr (e.g. lr=0.001)")
                if loss < best_loss:
                    best_loss, best = loss, [p.detach().clone() for p in params]
                history.append((step, train_loss, loss))
                if progress:
                    print(f"end to end: step {step}/{steps}, held-out KL {loss:.4f} (best {best_loss:.4f}), "
                          f"{time.perf_counter() - start:.0f} s", flush=True)
            if step == steps:
                break
            loss_t = divergence(order.choice(train), True)
            optimiser.zero_grad()
            loss_t.backward()
            for param, mask in masks:  # Adam moves an entry whose gradient was always 0 by exactly 0
                if param.grad is not None:
                    param.grad.mul_(mask)
            optimiser.step()
            train_loss = float(loss_t.detach())
    finally:
        with torch.no_grad():
            for param, saved in zip(params, best, strict=True):
                param.copy_(saved)
                param.requires_grad_(False)
        for param, flag in frozen:
            param.requires_grad_(flag)
        model.train(was_training)
    return {"history": history, "best_held_out": best_loss, "seconds": time.perf_counter() - start}
