"""linattn.train.end_to_end (imported through its old path, linattn.evaluate.end_to_end): maps trained on the
model's next-token distribution; texts sampled from the model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError, hf  # noqa: E402
from linattn.distill import fit_model_feature_maps  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.evaluate.end_to_end import (  # noqa: E402
    TOP_TOKENS,
    _coarse_teacher,
    _log_probs,
    coarse_kl,
    copying_sequences,
    copying_weights,
    fit_end_to_end,
    retrieval_scores,
    sample_texts,
)
from test_decoder_compare import char_tokenizer  # noqa: E402

TEXT = ("Rivers carry sand to the sea, and the tide returns some of it to the shore every evening. "
        "Birds follow the boats home, and the harbour lights come on one by one along the quay.")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                      initializer_range=0.3)  # wide weights: attention changes the logits visibly
    return LlamaForCausalLM(cfg).eval()


def texts(count: int) -> list[str]:
    return [TEXT[i * 7 :] + " " + TEXT[: i * 7] for i in range(count)]  # rotations: the same words, new places


@pytest.fixture(scope="module")
def linearized():
    model, tokenizer = tiny_llama(), char_tokenizer()
    capture = capture_attention(model, tokenizer, texts(2), max_tokens=128, model_name="tiny")
    fitted = fit_model_feature_maps(capture, steps=3, window=8, sinks=1)
    hf.linearize(model, fitted)
    return model, tokenizer, fitted


def test_fit_end_to_end_lowers_the_held_out_kl_and_touches_only_the_maps(linearized):
    model, tokenizer, fitted = linearized
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "linattn" not in name}
    before = [p.detach().clone() for fmap in fitted.maps for p in fmap.parameters()]
    flags = [p.requires_grad for p in model.parameters()]
    result = fit_end_to_end(model, tokenizer, texts(6), max_tokens=128, steps=12, lr=0.01, held_out=2, eval_every=4)
    first, best = result["history"][0][2], result["best_held_out"]
    # training lowers the divergence on sequences it never saw (a broken gradient path leaves it at `first`)
    assert best < 0.9 * first
    # the model's own weights are untouched; the maps of `fitted` are the model's, and they moved
    for name, p in model.named_parameters():
        if "linattn" not in name:
            assert torch.equal(p, weights[name]), name
    after = [p for fmap in fitted.maps for p in fmap.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(fmap is module.linattn_feature_map
               for fmap, module in zip(fitted.maps, hf.attention_modules(model), strict=True))
    assert [p.requires_grad for p in model.parameters()] == flags  # restored as they were


def test_fit_end_to_end_keeps_the_best_evaluation(linearized):
    model, tokenizer, _ = linearized
    result = fit_end_to_end(model, tokenizer, texts(5), max_tokens=128, steps=4, lr=0.05, held_out=2, eval_every=2)
    again = fit_end_to_end(model, tokenizer, texts(5), max_tokens=128, steps=0, held_out=2)
    # the parameters left in the model are those of the best held-out evaluation: evaluated again, the same KL
    # (same shapes, same kernels: equal up to the summation order of the float64 mean, hence the tolerance)
    assert again["best_held_out"] == pytest.approx(result["best_held_out"], rel=1e-6)


def test_fit_end_to_end_weights_the_kl_of_each_position(linearized):
    model, tokenizer, _ = linearized
    data = texts(3)
    tokens = torch.as_tensor(tokenizer(data[-1])["input_ids"])
    assert tokens.shape[0] > 128  # the weights are truncated with the text
    ids = tokens[:128][None]
    model.set_attn_implementation("sdpa")
    teacher = _coarse_teacher(_log_probs(model, ids, False), TOP_TOKENS)
    model.set_attn_implementation(hf.IMPLEMENTATION)
    per_position = coarse_kl(teacher, _log_probs(model, ids, False))[0].double()  # (128,)
    weights = torch.zeros(tokens.shape[0])
    weights[10:40], weights[70], weights[127:] = 2.0, 5.0, 100.0  # past position 127: cut off with the text
    weighted = fit_end_to_end(model, tokenizer, data, max_tokens=128, steps=0, held_out=1,
                              weights=[None, None, weights])
    plain = fit_end_to_end(model, tokenizer, data, max_tokens=128, steps=0, held_out=1)
    # the held-out KL is the weighted mean over positions, by hand in float64 from the same per-position values
    # (the library sums 128 float32 terms: a relative error of order 1e-6, hence rel=1e-5)
    kept = weights[:128].double()
    assert weighted["best_held_out"] == pytest.approx(float((per_position * kept).sum() / kept.sum()), rel=1e-5)
    assert plain["best_held_out"] == pytest.approx(float(per_position.mean()), rel=1e-5)
    assert abs(weighted["best_held_out"] - plain["best_held_out"]) > 1e-4  # the weights changed the measure
    for bad, match in (([None, weights], "one entry"), ([None, None, weights[:50]], r"weights\[2\]: shape"),
                       ([None, None, -weights], r"weights\[2\]: need finite"),
                       ([None, None, torch.zeros_like(weights)], "positive sum")):
        with pytest.raises(LinearAttentionError, match=match):
            fit_end_to_end(model, tokenizer, data, max_tokens=128, steps=0, held_out=1, weights=bad)


def test_fit_end_to_end_trains_only_the_marked_heads():
    model, tokenizer = tiny_llama(), char_tokenizer()
    capture = capture_attention(model, tokenizer, texts(2), max_tokens=128, model_name="tiny")
    fitted = fit_model_feature_maps(capture, steps=3, window=8, sinks=1, window_factor=True)  # γ form: γ too
    hf.linearize(model, fitted)
    marked = torch.tensor([[True, False, False, True], [False, False, True, False]])
    tensors = [[*fmap.parameters(), factor] for fmap, factor in zip(fitted.maps, fitted.window_factors or [],
                                                                      strict=True)]
    before = [[t.detach().clone() for t in layer] for layer in tensors]
    fit_end_to_end(model, tokenizer, texts(4), max_tokens=128, steps=3, lr=0.05, held_out=1, eval_every=100,
                   heads=marked)
    for layer, (now, then) in enumerate(zip(tensors, before, strict=True)):
        for tensor, old in zip(now, then, strict=True):
            axis = 0 if tensor.dim() == 1 else 1  # γ (H,), map parameters (P, H, ...)
            for head in range(4):
                same = torch.equal(tensor.select(axis, head), old.select(axis, head))
                assert same != bool(marked[layer, head]), (layer, head, tuple(tensor.shape))
    with pytest.raises(LinearAttentionError, match="heads"):
        fit_end_to_end(model, tokenizer, texts(4), max_tokens=128, steps=1, held_out=1, heads=marked.T)


def test_retrieval_scores_against_attention_weights_by_hand():
    model = tiny_llama().double()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 100, (60,), generator=gen) for _ in range(2)] + [torch.arange(5)]  # last: too short
    window, sinks = 6, 2
    scores = retrieval_scores(model, sequences, window=window, sinks=sinks, passage=(5, 10), gap=(12, 20), seed=3)
    assert scores.shape == (2, 4)
    assert model.config._attn_implementation != "eager"  # restored
    copies = copying_sequences(sequences, passage=(5, 10), gap=(12, 20), seed=3)
    assert len(copies) == 2
    model.set_attn_implementation("eager")
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for ids, made in zip(sequences[:2], copies, strict=True):
        length = next(p for p in range(5, 11) if torch.equal(made[-p:], made[:p]) and torch.equal(
            made[:-p], ids[: made.shape[0] - p]) and 12 <= made.shape[0] - 2 * p <= 20)
        for sign, run in ((1, made), (-1, ids[: made.shape[0]])):
            with torch.no_grad():
                weights = model(input_ids=run[None], output_attentions=True).attentions  # per layer (1, H, N, N)
            first = made.shape[0] - length
            for layer, w in enumerate(weights):
                for t in range(first, made.shape[0]):
                    far = [j for j in range(t + 1) if j <= t - window and j >= sinks]
                    expected[layer] += sign * w[0, :, t, far].sum(-1) / length / len(copies)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=1e-12)  # float64 masses, summed in another order
    with pytest.raises(LinearAttentionError, match="long enough"):
        retrieval_scores(model, sequences[-1:], window=window, passage=(5, 10), gap=(12, 20))


def test_fit_end_to_end_refuses_a_model_that_is_not_linearized_and_too_few_texts():
    model, tokenizer = tiny_llama(), char_tokenizer()
    with pytest.raises(LinearAttentionError, match="not linearized"):
        fit_end_to_end(model, tokenizer, texts(4), steps=1)
    with pytest.raises(LinearAttentionError, match="held_out"):
        fit_end_to_end(model, tokenizer, texts(2), steps=1, held_out=2)


def test_sample_texts_continues_every_prompt_reproducibly():
    model, tokenizer = tiny_llama(), char_tokenizer()
    tokenizer.eos_token = "\n"  # the char tokenizer has none; generation needs one to suppress
    prompts = ["Rivers carry", "Birds follow the boats"]
    side = tokenizer.padding_side
    first = sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=3)
    assert len(first) == 2
    for prompt, text in zip(prompts, first, strict=True):
        assert text.replace(" ", "").startswith(prompt.replace(" ", ""))  # the prompt, then its continuation
        assert len(tokenizer(text)["input_ids"]) >= len(tokenizer(prompt)["input_ids"]) + 20 - 1
    assert sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=3) == first
    assert sample_texts(model, tokenizer, prompts, tokens=20, batch_size=2, seed=4) != first
    assert tokenizer.padding_side == side  # restored


def test_copying_sequences_repeat_the_passage_after_the_gap():
    sequences = [torch.arange(100) + 1000 * i for i in range(3)] + [torch.arange(10)]  # the last one is too short
    out = copying_sequences(sequences, passage=(5, 20), gap=(30, 60), seed=1)
    assert len(out) == 3  # 10 tokens cannot hold a passage of ≥ 5, a gap of ≥ 30 and the repeat
    for ids, made in zip(sequences[:3], out, strict=True):
        length = next(p for p in range(5, 21) if torch.equal(made[-p:], ids[:p]) and made.shape[0] - 2 * p >= 30
                      and torch.equal(made[:-p], ids[: made.shape[0] - p]))
        assert 30 <= made.shape[0] - 2 * length <= 60
    assert all(torch.equal(a, b) for a, b in zip(out, copying_sequences(sequences, passage=(5, 20), gap=(30, 60),
                                                                         seed=1), strict=True))


def test_copying_weights_mark_the_positions_that_predict_the_repeat():
    sequences = [torch.arange(100) + 1000 * i for i in range(3)] + [torch.arange(10)]
    copies = copying_sequences(sequences, passage=(5, 20), gap=(30, 60), seed=1)
    weights = copying_weights(sequences, 4.0, passage=(5, 20), gap=(30, 60), seed=1)
    assert len(weights) == len(copies) == 3
    for made, marks in zip(copies, weights, strict=True):
        start = int((made[1:] < made[:-1]).nonzero()[0]) + 1  # increasing tokens: the repeat starts at the drop
        expected = torch.ones(made.shape[0])
        expected[start - 1 : -1] = 4.0  # position t predicts token t + 1: from the one before the repeat
        assert torch.equal(marks, expected)
    with pytest.raises(LinearAttentionError, match="repeat_weight"):
        copying_weights(sequences, 0.0)


def test_coarse_kl_against_the_full_kl_in_float64():
    gen = torch.Generator().manual_seed(0)
    p = torch.log_softmax(3 * torch.randn(5, 40, generator=gen, dtype=torch.float64), -1)
    q = torch.log_softmax(3 * torch.randn(5, 40, generator=gen, dtype=torch.float64), -1)
    full = (p.exp() * (p - q)).sum(-1)  # (5,)
    # every token kept: the rest bucket is empty (its mass clamped to ~1e-7) and the KL is the full one
    torch.testing.assert_close(coarse_kl(_coarse_teacher(p, 40), q), full, rtol=0, atol=1e-5)
    # fewer tokens: the divergence of coarsened distributions, never above the full one, and by hand for k = 3
    coarse = coarse_kl(_coarse_teacher(p, 3), q)
    assert bool((coarse <= full + 1e-12).all()) and bool((coarse < full).any())
    top = p.topk(3, -1).indices
    pk, qk = p.exp().gather(-1, top), q.exp().gather(-1, top)
    pr, qr = 1 - pk.sum(-1), 1 - qk.sum(-1)
    by_hand = (pk * (pk.log() - qk.log())).sum(-1) + pr * (pr.log() - qr.log())
    torch.testing.assert_close(coarse, by_hand, rtol=1e-10, atol=1e-12)
