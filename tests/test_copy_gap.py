"""The end-to-end stage's copying gaps: gaps longer than one sample (samples joined, never a sample to itself), the
held-out samples kept apart from every training sequence, and the option's checks."""

from __future__ import annotations

import pytest
import torch

from linattn.errors import LinearAttentionError
from linattn.evaluate.lm_config import HELD_OUT_SAMPLES, EndToEndOptions
from linattn.evaluate.lm_stages import training_set
from linattn.linearized.arguments import COPY_GAP_TOKENS
from linattn.linearized.budget import training_sequences_of
from linattn.train.end_to_end import COPY_GAP, COPY_PASSAGE, copying_sequences, joined_sources, mean_copy_length

LENGTH = 1000  # tokens per sample; sample k holds the ids k·LENGTH … (k + 1)·LENGTH − 1, so a token names its sample


def samples(count: int) -> list[torch.Tensor]:
    return [torch.arange(k * LENGTH, (k + 1) * LENGTH) for k in range(count)]


def options(**changes) -> EndToEndOptions:
    base = {"steps": 4, "samples": 8, "tokens": LENGTH, "texts": None, "copies": True, "corpus_orders": 0,
            "repeat_weight": 1.0, "lora_rank": 0, "lora_lr": 0.001, "retrieval_heads": 0, "retrieval_maps": None,
            "train_other_heads": False}
    return EndToEndOptions(**{**base, **changes})


def test_joined_sources_follow_each_sequence_with_the_next_and_never_with_itself():
    parts = [torch.arange(10) + 100 * k for k in range(3)]
    out = joined_sources(parts, 25)
    assert [x.tolist() for x in out] == [
        [*parts[0].tolist(), *parts[1].tolist(), *parts[2][:5].tolist()],
        [*parts[1].tolist(), *parts[2].tolist(), *parts[0][:5].tolist()],
        [*parts[2].tolist(), *parts[0].tolist(), *parts[1][:5].tolist()],
    ]
    whole = joined_sources(parts, 100)  # all three together are 30 tokens: no part recurs
    assert all(x.shape[0] == 30 and len(set(x.tolist())) == 30 for x in whole)
    assert [x.tolist() for x in joined_sources(parts, 4)] == [p[:4].tolist() for p in parts]
    with pytest.raises(LinearAttentionError, match="tokens"):
        joined_sources(parts, 0)


def test_gaps_longer_than_a_sample_copy_from_joined_training_samples_only():
    plain = samples(8)
    gap = (1500, 2600)
    data = training_set(plain, [], options(copy_gap=gap))
    held = data.held_out
    assert held == HELD_OUT_SAMPLES + 1 and data.copying == 8 - HELD_OUT_SAMPLES + 1
    held_ids = {k for k in range(8 - HELD_OUT_SAMPLES, 8)}
    training, held_out = data.sequences[:-held], data.sequences[-held:]
    assert len(training) == training_sequences_of(8)  # what --budget plans with
    copies = [x for x in training if x.shape[0] != LENGTH]
    assert len(copies) == 8 - HELD_OUT_SAMPLES
    for ids in training:  # no token of a held-out sample is trained on
        assert not {int(t) // LENGTH for t in ids} & held_ids
    for ids in [*copies, held_out[-1]]:
        n = ids.shape[0]
        passage = next(p for p in range(COPY_PASSAGE[0], COPY_PASSAGE[1] + 1)
                       if torch.equal(ids[:p], ids[n - p:]) and gap[0] <= n - 2 * p <= gap[1])
        assert passage and len(set(ids[:n - passage].tolist())) == n - passage  # the passage recurs only at the end
        assert n - 2 * passage > LENGTH  # a gap no sample alone holds
    assert {int(t) // LENGTH for t in held_out[-1]} <= held_ids  # the held-out copy: the held-out samples alone


def test_the_default_gaps_keep_each_training_copy_as_drawn_from_its_own_sample():
    plain = samples(6)
    data = training_set(plain, [], options())
    assert options().copy_gap == COPY_GAP == (128, 768)  # linattn compare's; linattn linearize draws out to 3,072
    assert COPY_GAP_TOKENS == (128, 3072)
    expected = copying_sequences(plain[:-HELD_OUT_SAMPLES], seed=0)
    copies = data.sequences[len(plain) - HELD_OUT_SAMPLES:][: len(expected)]
    assert len(expected) == len(plain) - HELD_OUT_SAMPLES
    assert all(torch.equal(a, b) for a, b in zip(copies, expected, strict=True))


def test_the_train_texts_orders_are_never_joined():
    """Orders of one text share its paragraphs: a copy made across two would find its passage inside its gap. A
    gap no order holds makes none of its copies."""
    corpus = samples(3)
    assert training_set([], corpus, options(copy_gap=(LENGTH, 2 * LENGTH))).copying == 0
    assert training_set([], corpus, options(copy_gap=(10, 20))).copying == 3


def test_mean_copy_length_follows_the_gap():
    assert mean_copy_length() == sum(COPY_PASSAGE) + sum(COPY_GAP) / 2
    assert mean_copy_length((1000, 3000)) == sum(COPY_PASSAGE) + 2000


@pytest.mark.parametrize("gap", [(0, 10), (20, 10), (-5, 5)])
def test_a_bad_copy_gap_is_refused(gap):
    with pytest.raises(LinearAttentionError, match="--end-to-end-copy-gap"):
        options(copy_gap=gap)
