"""linattn.evaluate for causal LMs: perplexity against a per-token float64 recomputation, the long-range probes."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from linattn import LinearAttentionError  # noqa: E402
from linattn.evaluate.perplexity import perplexity, score_tokens  # noqa: E402
from linattn.evaluate.probes import (  # noqa: E402
    passkey_accuracy,
    passkeys,
    repeat_perplexity,
    repeated_passages,
    repeats_by_gap,
)


def tiny_llama(vocab: int = 60, positions: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=positions)
    return LlamaForCausalLM(cfg).eval()


class CharTokenizer:
    """One token per character (printable ASCII: ids 1…95, newline: 0), no special tokens: lengths are easy to
    check by hand."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - 31 if 32 <= ord(c) < 127 else 0 for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 31) if i else "\n" for i in ids)


def nll_by_hand(model, ids: torch.Tensor, t: int, begin: int) -> float:
    """−log p(ids[t] | ids[begin:t]) from the model's logits, the softmax written out in float64."""
    with torch.no_grad():
        logits = model(input_ids=ids[None, begin:t]).logits[0, -1].double()  # (V,) prediction of token t
    return float(torch.logsumexp(logits, 0) - logits[ids[t]])


def test_perplexity_equals_the_per_token_computation_in_one_window():
    model = tiny_llama()
    ids = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(1))
    result = perplexity(model, None, ids)
    expected = sum(nll_by_hand(model, ids, t, 0) for t in range(1, 40)) / 39
    assert result.tokens == 39
    # one forward pass against 39 prefix passes: same numbers up to fp32 rounding of differently shaped GEMMs
    assert result.nll == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert result.tokens_per_second > 0


def test_strided_perplexity_scores_each_token_once_with_its_window_context():
    model = tiny_llama()
    ids = torch.randint(0, 60, (50,), generator=torch.Generator().manual_seed(2))
    length, stride = 16, 6
    result = perplexity(model, None, ids, max_length=length, stride=stride)
    # token t is scored in the first window [b, b + length) (b a multiple of stride) that reaches past it
    expected = []
    for t in range(1, 50):
        begin = next(b for b in range(0, 50, stride) if b + length > t)
        assert t - begin >= length - stride or begin == 0  # the documented minimum context
        expected.append(nll_by_hand(model, ids, t, begin))
    assert result.tokens == 49
    assert result.nll == pytest.approx(sum(expected) / 49, rel=1e-5)
    # a different window gives another number: the test can tell windows apart
    assert result.nll != pytest.approx(perplexity(model, None, ids).nll, rel=1e-5)


def test_perplexity_from_a_string_and_bad_arguments():
    model = tiny_llama(vocab=100)
    text = "a small text of plain characters"
    assert perplexity(model, CharTokenizer(), text).tokens == len(text) - 1
    with pytest.raises(LinearAttentionError, match="stride"):
        perplexity(model, CharTokenizer(), text, max_length=8, stride=8)
    with pytest.raises(LinearAttentionError, match="at least 2"):
        perplexity(model, CharTokenizer(), "a")
    with pytest.raises(LinearAttentionError, match="score_from"):
        score_tokens(model, torch.ones(1, 5, dtype=torch.long), 0)


TEXT = "".join(chr(65 + (i * 7) % 26) for i in range(300))  # 300 characters, no long exact repeats nearby


def test_repeated_passage_probe_is_passage_gap_passage():
    probes = repeated_passages(CharTokenizer(), TEXT, passage_tokens=20, gap_tokens=100, trials=3)
    ids = CharTokenizer()(TEXT)["input_ids"]
    assert len(probes) == 3
    for trial, probe in enumerate(probes):
        seq = probe.input_ids.tolist()
        start = trial * 300 // 3
        assert len(seq) == 140 and probe.score_from == 120 and probe.distance == 100
        assert seq[:20] == seq[120:] == ids[start : start + 20]
        assert seq[20:120] == [ids[(start + 20 + i) % 300] for i in range(100)]  # the text after the passage
    with pytest.raises(LinearAttentionError, match="longer text"):
        repeated_passages(CharTokenizer(), TEXT, passage_tokens=100, gap_tokens=250)


def test_passkey_probe_states_the_key_once_then_filler_then_question():
    tok = CharTokenizer()
    probes = passkeys(tok, TEXT, filler_tokens=500, trials=2, seed=3)
    for probe in probes:
        text = tok.decode(probe.input_ids.tolist())
        answer = text[probe.score_from :]
        key = answer.strip()
        assert len(key) == 5 and key.isdigit() and answer == f" {key}"
        intro_end = text.index("pass key.\n") + len("pass key.\n")
        assert text[:intro_end].count(key) == 2  # stated in the intro ("is K. Remember it. K is the pass key")
        question = text.index("\nWhat is the pass key?")
        assert question - intro_end == 500 == probe.distance  # exactly the filler between them
        assert key not in text[intro_end:question]
    assert probes[0].input_ids.tolist() != probes[1].input_ids.tolist()


class Copier(nn.Module):
    """An ideal induction head: predicts the token that followed the earlier place whose preceding tokens match
    the current ones longest (up to 12; uniform when no earlier token matches). It reaches back any distance, as
    a model with full recall would; ``memory=False`` never finds anything."""

    def __init__(self, vocab: int, memory: bool) -> None:
        super().__init__()
        self.vocab, self.memory = vocab, memory
        self.weight = nn.Parameter(torch.zeros(1))  # a parameter, for the device look-up

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        for t in range(len(ids) - (logits_to_keep or len(ids)), len(ids)):
            best, where = 0, None
            for j in range(t if self.memory else 0):
                match = 0
                while match < 12 and match <= j and ids[j - match] == ids[t - match]:
                    match += 1
                if match >= best and match > 0:
                    best, where = match, j
            if where is not None:
                logits[0, t, ids[where + 1]] = 20.0
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_probe_scores_separate_recall_from_no_recall():
    tok = CharTokenizer()
    letters = random.Random(0).choices("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", k=400)
    text = "".join(letters)  # random: no long repeats inside the text itself, so any recall is of the probe
    repeat = repeated_passages(tok, text, passage_tokens=30, gap_tokens=120, trials=2)
    keys = passkeys(tok, text, filler_tokens=200, trials=3)
    recall, amnesia = Copier(100, memory=True), Copier(100, memory=False)
    assert passkey_accuracy(recall, keys) == 1.0
    assert passkey_accuracy(amnesia, keys) == 0.0
    assert repeat_perplexity(amnesia, repeat) == pytest.approx(100.0)  # uniform over 100 tokens
    # the repeat's first token follows gap text and cannot be copied: one miss in 30 tokens keeps it above 1
    assert repeat_perplexity(recall, repeat) < 4.0


def test_repeats_by_gap_scores_each_gap_and_marks_the_ones_the_text_cannot_hold():
    tok = CharTokenizer()
    text = "".join(random.Random(1).choices("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", k=300))
    recall = Copier(100, memory=True)
    found = repeats_by_gap(recall, tok, text, [50, 200, 280], passage_tokens=30, trials=2)
    assert list(found) == ["50", "200", "280"]
    assert found["280"] is None  # 30 + 280 > 300 characters: the gap would hold the passage again
    assert found["50"] == repeat_perplexity(recall, repeated_passages(tok, text, passage_tokens=30, gap_tokens=50,
                                                                      trials=2))
    assert found["200"] is not None and found["200"] < 4.0


def test_the_long_held_out_text_holds_a_passage_3072_tokens_back():
    from linattn.data import load_text

    long = load_text("heldout_long")
    assert len(long.split()) > 3500 and long not in load_text("heldout")
