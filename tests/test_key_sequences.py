"""linattn.train.end_to_end.key_sequences: a number stated once, filler, a question it answers; the probe's own
wording held out."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError  # noqa: E402
from linattn.evaluate.probes import PASSKEY_INTRO, PASSKEY_QUESTION  # noqa: E402
from linattn.train.end_to_end import KEY_PHRASINGS, key_sequences  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402


def text_of(tokenizer, ids: torch.Tensor) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids.tolist()))  # one character a token


TEXT = "Rivers carry sand to the sea, and the tide returns some of it to the shore every evening. "


def test_a_sequence_is_statement_filler_question_number_with_its_share_of_the_weight():
    tokenizer = char_tokenizer()
    sequences, weights = key_sequences(tokenizer, TEXT, count=8, filler=(30, 50), share=0.4, seed=3)
    assert len(sequences) == len(weights) == 8
    for index, (ids, weight) in enumerate(zip(sequences, weights, strict=True)):
        text = text_of(tokenizer, ids)
        statement, question = KEY_PHRASINGS[index % len(KEY_PHRASINGS)]
        before, after = statement.split("{key}")[0], question
        assert text.startswith(before)
        key = re.match(r"\d+", text[len(before):]).group(0)
        assert key.isdigit() and 4 <= len(key) <= 6
        assert text.endswith(after + " " + key)  # the question, then the number stated at the start
        filler = len(text) - len(statement.format(key=key)) - len(question) - len(key) - 1  # one token a character
        assert 30 <= filler <= 50
        # the positions predicting the number (the last len(" key") tokens) carry `share` of the weight
        answer = len(key) + 1
        assert weight.shape == ids.shape
        marked = weight[-answer - 1 : -1]
        assert torch.all(marked == marked[0]) and float(marked[0]) > 1
        assert float(marked.sum() / weight.sum()) == pytest.approx(0.4, rel=1e-6)
        assert torch.all(weight[: -answer - 1] == 1) and float(weight[-1]) == 1


def test_the_probe_wording_is_never_trained_on():
    # the held-out passkey probe asks with its own words; training sequences use others, so a student that finds
    # the probe's key has learned to retrieve, not the probe's template
    tokenizer = char_tokenizer()
    probe_statement = PASSKEY_INTRO.split("{key}")[0]
    for statement, question in KEY_PHRASINGS:
        assert question.strip() != PASSKEY_QUESTION.strip()
        assert PASSKEY_QUESTION.strip() not in question and probe_statement.strip() not in statement
    sequences, _ = key_sequences(tokenizer, TEXT, count=12, filler=(10, 20))
    for ids in sequences:
        text = text_of(tokenizer, ids)
        assert "pass key" not in text


def test_seeded_and_checked():
    tokenizer = char_tokenizer()
    one, _ = key_sequences(tokenizer, TEXT, count=4, filler=(10, 40), seed=1)
    two, _ = key_sequences(tokenizer, TEXT, count=4, filler=(10, 40), seed=1)
    three, _ = key_sequences(tokenizer, TEXT, count=4, filler=(10, 40), seed=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert any(a.shape != c.shape or not torch.equal(a, c) for a, c in zip(one, three, strict=True))
    for bad in ({"count": 0}, {"count": 2, "filler": (0, 5)}, {"count": 2, "filler": (9, 5)},
                {"count": 2, "share": 1.0}, {"count": 2, "share": 0.0}):
        with pytest.raises(LinearAttentionError):
            key_sequences(tokenizer, TEXT, **bad)
    with pytest.raises(LinearAttentionError, match="non-empty text"):
        key_sequences(tokenizer, "", count=2)
