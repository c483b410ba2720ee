"""Per-layer, per-head q, k, v from a Hugging Face transformers model on given text.

The capture goes through transformers' attention interface: for the duration of the capture the model's attention
implementation is swapped for a recorder that stores the tensors the model hands to its attention function (after
the head reshape, after rotary embeddings in decoders, before grouped-query repetition) and then calls the model's
own implementation, so the forward pass is unchanged. Any model that dispatches through
``ALL_ATTENTION_FUNCTIONS`` (BERT-likes, Llama-likes, most of transformers 5) works, encoder or decoder.

>>> model, tokenizer, name = load_model()                    # doctest: +SKIP
>>> cap = capture_attention(model, tokenizer, load_text("heldout"), model_name=name)  # doctest: +SKIP
>>> cap.queries[0].shape                                       # (L, H, N, d) for sequence 0  # doctest: +SKIP
torch.Size([6, 12, 413, 32])
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data import paragraphs
from ..errors import LinearAttentionError
from .models import default_model_path, load_model  # noqa: F401  (re-exported: compare.py, user code)

CAPTURE_IMPLEMENTATION = "linattn_capture"


def split_sequences(text: str, tokenizer: Any, max_tokens: int) -> list[str]:
    """Group the paragraphs of ``text`` greedily into pieces of at most ``max_tokens`` tokens (special included).

    A single paragraph longer than that becomes its own piece and is truncated when captured.
    """
    pieces: list[str] = []
    current = ""
    for paragraph in paragraphs(text):
        candidate = f"{current} {paragraph}".strip()
        # verbose=False: a candidate longer than the model's limit is expected here (it is what ends a piece),
        # and transformers would warn that running it through the model would fail
        if current and len(tokenizer(candidate, verbose=False)["input_ids"]) > max_tokens:
            pieces.append(current)
            candidate = paragraph
        current = candidate
    if current:
        pieces.append(current)
    return pieces


def reordered(text: str, orders: int, seed: int = 0) -> list[str]:
    """``text`` followed by up to ``orders − 1`` seeded shuffles of its paragraphs, each order at most once."""
    parts = paragraphs(text)
    generator = random.Random(seed)
    seen, texts = {tuple(parts)}, [text]
    for _ in range(8 * orders):  # a few paragraphs have few distinct orders: stop trying after a while
        if len(texts) >= orders:
            break
        order = generator.sample(parts, len(parts))
        if tuple(order) not in seen:
            seen.add(tuple(order))
            texts.append("\n\n".join(order))
    return texts


@dataclass
class AttentionCapture:
    """q, k, v of every attention layer for each captured sequence.

    ``queries[s]`` is ``(L, H, N_s, d)``, ``keys[s]`` and ``values[s]`` are ``(L, Hkv, N_s, d)`` and
    ``(L, Hkv, N_s, dv)`` (float32, CPU) for sequence s; ``scaling`` is the softmax scale the model uses;
    ``causal`` whether its attention is causal.
    """

    model_name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    causal: bool
    texts: list[str] = field(default_factory=list)
    queries: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    orders: list[int] = field(default_factory=list)  # the paragraph order of each sequence (0: as given; [] all 0)

    @property
    def num_tokens(self) -> int:
        return sum(q.shape[-2] for q in self.queries)

    @property
    def text_tokens(self) -> int:
        """Tokens of the text as given: those of the sequences captured in the first paragraph order."""
        orders = self.orders or [0] * len(self.queries)
        return sum(q.shape[-2] for q, order in zip(self.queries, orders, strict=True) if order == 0)

    def layer(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Lists over sequences of q ``(H, N, d)``, k, v ``(Hkv, N, ·)`` of layer ``index``."""
        if not -self.num_layers <= index < self.num_layers:
            raise LinearAttentionError(f"layer: index {index} out of range for {self.num_layers} layers")
        return ([q[index] for q in self.queries], [k[index] for k in self.keys], [v[index] for v in self.values])

    def all_heads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's heads stacked: lists over sequences of q ``(L·H, N, d)``, k and v ``(L·H, N, ·)``.

        k and v are repeated to H heads (grouped-query attention), so head i of the stack is layer i // H,
        head i % H.
        """
        group = self.num_heads // self.num_kv_heads
        qs = [q.flatten(0, 1) for q in self.queries]  # (L, H, N, d) → (L·H, N, d)
        ks = [k.repeat_interleave(group, dim=1).flatten(0, 1) for k in self.keys]
        vs = [v.repeat_interleave(group, dim=1).flatten(0, 1) for v in self.values]
        return qs, ks, vs


class _Recorder:
    """The attention function installed during a capture: stores (q, k, v, scaling, causal), then delegates."""

    active: _Recorder | None = None

    def __init__(self, delegate: Any) -> None:
        self.delegate = delegate
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool]] = []

    @staticmethod
    def dispatch(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
        recorder = _Recorder.active
        if recorder is None:
            raise LinearAttentionError("the linattn capture attention ran outside capture_attention()")
        scaling = kwargs.get("scaling")
        scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        # (1, H, N, d) per call: batch 1, one sequence
        recorder.calls.append((query[0].detach().float().cpu(), key[0].detach().float().cpu(),
                               value[0].detach().float().cpu(), scaling, causal))
        return recorder.delegate(module, query, key, value, *args, **kwargs)


def capture_attention(
    model: Any,
    tokenizer: Any,
    texts: str | Sequence[str],
    *,
    max_tokens: int | None = 512,
    model_name: str | None = None,
    orders: int = 1,
    seed: int = 0,
) -> AttentionCapture:
    """Run ``model`` on ``texts`` and capture q, k, v of every attention layer.

    Args:
        texts: one string (split at paragraphs into pieces of ≤ ``max_tokens`` tokens) or a list of strings
            (one sequence each, truncated to ``max_tokens``). Each sequence runs alone (batch 1, no padding).
        max_tokens: longest sequence; capped at the model's ``max_position_embeddings`` when it has one.
        model_name: recorded in the capture (default: the model config's name or path).
        orders: for a string, capture it in this many paragraph orders: as given, then seeded shuffles (``seed``;
            repeated orders are skipped). The same text then shows every token at other positions and after
            other context, more activations to fit learned maps on without more text (docs/evaluation.md).
    """
    if orders < 1:
        raise LinearAttentionError(f"orders: need at least 1, got {orders!r}")
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if max_tokens is None or (limit is not None and max_tokens > limit):
        max_tokens = limit or 512
    if isinstance(texts, str):
        split = [(index, piece) for index, text in enumerate(reordered(texts, orders, seed))
                 for piece in split_sequences(text, tokenizer, max_tokens)]
        order_of, pieces = [index for index, _ in split], [piece for _, piece in split]
    else:
        pieces = list(texts)
        order_of = [0] * len(pieces)
    if not pieces or not all(isinstance(p, str) and p.strip() for p in pieces):
        raise LinearAttentionError("texts: need at least one non-empty string")

    previous = config._attn_implementation
    delegate = ALL_ATTENTION_FUNCTIONS.get(previous) or ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _Recorder.dispatch)
    recorder = _Recorder(delegate)
    capture: AttentionCapture | None = None
    device = next(model.parameters()).device
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    _Recorder.active = recorder
    try:
        for piece, order in zip(pieces, order_of, strict=True):
            recorder.calls.clear()
            encoded = tokenizer(piece, return_tensors="pt", truncation=True, max_length=max_tokens)
            with torch.no_grad():
                model(**{name: tensor.to(device) for name, tensor in encoded.items()})
            if not recorder.calls:
                raise LinearAttentionError(
                    f"model {type(model).__name__}: no attention call went through transformers' attention "
                    "interface, so nothing could be captured"
                )
            q0, k0, v0, scaling, causal = recorder.calls[0]
            if capture is None:
                capture = AttentionCapture(
                    model_name=model_name or str(getattr(config, "_name_or_path", type(model).__name__)),
                    num_layers=len(recorder.calls), num_heads=q0.shape[0], num_kv_heads=k0.shape[0],
                    head_dim=q0.shape[-1], scaling=scaling, causal=causal,
                )
            capture.texts.append(piece)
            capture.orders.append(order)
            capture.queries.append(torch.stack([call[0] for call in recorder.calls]))  # (L, H, N, d)
            capture.keys.append(torch.stack([call[1] for call in recorder.calls]))
            capture.values.append(torch.stack([call[2] for call in recorder.calls]))
    finally:
        _Recorder.active = None
        model.set_attn_implementation(previous)
    assert capture is not None
    return capture
