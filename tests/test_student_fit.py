"""The layer-wise fit of a student with a gated delta-rule (or KDA) memory beside the window (linattn.train.student)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LinearAttentionError, SparseCache, hf  # noqa: E402
from linattn.evaluate.capture import capture_attention  # noqa: E402
from linattn.feature_maps import create  # noqa: E402
from linattn.nn import KeyGates  # noqa: E402
from linattn.train.student import fit_student, student_outputs, teacher_outputs  # noqa: E402
from test_decoder_compare import char_tokenizer  # noqa: E402

TEXT = ("Rivers carry sand to the sea. The tide returns some of it to the shore. Birds follow the boats home in "
        "the evening, and the harbour lights come on one by one. ") * 2


@pytest.fixture(scope="module")
def captured():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                                         initializer_range=0.3)).eval()
    return model, capture_attention(model, char_tokenizer(eos="\n"), [TEXT, TEXT[50:] + TEXT[:50]], max_tokens=200,
                                    model_name="tiny")


def _student(gate):
    torch.manual_seed(1)
    maps = [create("hedgehog", head_dim=8, num_heads=4) for _ in range(2)]
    gates = [KeyGates(2, 8, gate=gate, num_features=16 if gate == "feature" else None, readout=True)
             for _ in range(2)]
    return maps, gates


@pytest.mark.parametrize("gate", ["token", "feature"])
def test_the_fit_brings_every_layer_closer_to_its_softmax_output(captured, gate):
    model, capture = captured
    maps, gates = _student(gate)
    options = {"window": 16, "sinks": 2, "update": "delta"}

    def error() -> float:
        total = 0.0
        with torch.no_grad():
            for layer in range(2):
                q, k, v = (t[0][layer][None] for t in (capture.queries, capture.keys, capture.values))
                wanted = teacher_outputs(q, k, v, capture.scaling)
                total += float((student_outputs(q, k, v, maps[layer], gates[layer], capture.scaling, options)
                                - wanted)[..., 16:, :].square().mean())
        return total

    before = [p.detach().clone() for module in [*maps, *gates] for p in module.parameters()]
    first = error()
    info = fit_student(capture, maps, gates, options, steps=30, lr=0.02)
    assert len(info["history"]) == 30
    assert error() < 0.99 * first  # (a random tiny model: the memory has little to add; the gain is small)
    after = [p for module in [*maps, *gates] for p in module.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # every parameter trained


@pytest.mark.parametrize("cache", [None, SparseCache(size=(1, 3, 5, 2), block=8)], ids=["window", "sparse-cache"])
def test_the_students_layer_output_is_the_linearized_models(captured, cache):
    """student_outputs computes what the linearized model's attention computes (the fit trains the real thing),
    with the sparse cache beside the window too."""
    model, capture = captured
    maps, gates = _student("token")
    options = {"window": 16, "sinks": 2, "update": "delta", **({} if cache is None else {"sparse_cache": cache})}
    hf.linearize(model, maps, gates=gates, **options)
    seen = {}

    def spy(module, args, kwargs, output):
        seen["out"] = output[0]

    attention = hf.attention_modules(model)[0]
    handle = attention.register_forward_hook(spy, with_kwargs=True)
    try:
        ids = torch.tensor([char_tokenizer(eos="\n")(TEXT)["input_ids"][:200]])
        with torch.no_grad():
            model(input_ids=ids)
            recaptured = capture_attention(model, char_tokenizer(eos="\n"), [TEXT], max_tokens=200, model_name="t")
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    q, k, v = (t[0][0][None] for t in (recaptured.queries, recaptured.keys, recaptured.values))
    with torch.no_grad():
        ours = student_outputs(q, k, v, maps[0], gates[0], recaptured.scaling, options)
        hf.linearize(model, maps, gates=gates, **options)
        model(input_ids=ids)
    # the layer's attention output (before o_proj) equals the student's output, as (B, N, H·dv)
    torch.testing.assert_close(seen["out"], attention.o_proj(ours.transpose(1, 2).reshape(1, ids.shape[1], -1)),
                               rtol=1e-5, atol=1e-5)


def test_sequences_within_the_window_are_left_out_of_the_fit(captured):
    """A captured piece no longer than the window has no position past it to train on (its loss would be the mean
    of nothing, NaN): the fit uses the longer pieces only."""
    model, _ = captured
    capture = capture_attention(model, char_tokenizer(eos="\n"), [TEXT, TEXT[:40]], max_tokens=200,
                                model_name="tiny")
    assert min(q.shape[-2] for q in capture.queries) <= 60 < max(q.shape[-2] for q in capture.queries)
    maps, gates = _student("token")
    info = fit_student(capture, maps, gates, {"window": 60, "sinks": 2, "update": "delta"}, steps=4)
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in info["history"])


def test_the_fit_gives_each_layer_its_own_cache(captured, monkeypatch):
    """sparse_cache= one per layer: every layer's call of the fit has its layer's cache (per-head sizes), with
    gradients on (the memory beside the cache is what is trained), and every map and gate moves."""
    from linattn.train import student

    _, capture = captured
    maps, gates = _student("feature")
    caches = [SparseCache(size=(1, 3, 5, 2), block=8), SparseCache(size=4, block=8, linear_weight=0.5)]
    seen = []
    real = student.linear_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("sparse_cache"), kwargs.get("update"), torch.is_grad_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(student, "linear_attention", spy)
    before = [p.detach().clone() for module in [*maps, *gates] for p in module.parameters()]
    info = fit_student(capture, maps, gates, {"window": 16, "sinks": 2, "update": "delta"}, steps=3, lr=0.02,
                       sparse_cache=caches)
    assert seen == [(caches[i % 2], "delta", True) for i in range(6)]  # 3 steps × 2 layers, in layer order
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in info["history"])
    after = [p for module in [*maps, *gates] for p in module.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    seen.clear()
    fit_student(capture, maps, gates, {"window": 16, "update": "delta"}, steps=1, sparse_cache=caches[0])
    assert [cache for cache, _, _ in seen] == [caches[0]] * 2  # one cache for every layer


def test_bad_fits_are_refused(captured):
    _, capture = captured
    maps, gates = _student("token")
    with pytest.raises(LinearAttentionError, match="one per layer"):
        fit_student(capture, maps[:1], gates, {"window": 16, "update": "delta"})
    with pytest.raises(LinearAttentionError, match="within the window"):
        fit_student(capture, maps, gates, {"window": 500, "update": "delta"})
    with pytest.raises(LinearAttentionError, match="nothing to train"):
        fit_student(capture, [create("elu")] * 2, [None, None], {"window": 16, "update": "delta", "beta": 0.5})
    cache = SparseCache(size=2, block=8)
    with pytest.raises(LinearAttentionError, match="one per layer"):
        fit_student(capture, maps, gates, {"window": 16, "update": "delta"}, sparse_cache=[cache])
    with pytest.raises(LinearAttentionError, match="beside the window"):
        fit_student(capture, maps, gates, {"update": "delta"}, sparse_cache=cache)
    with pytest.raises(LinearAttentionError, match="pass it once"):
        fit_student(capture, maps, gates, {"window": 16, "update": "delta", "sparse_cache": cache}, sparse_cache=cache)
