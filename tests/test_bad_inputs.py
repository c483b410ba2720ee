"""Bad inputs beyond linear_attention's own arguments get a LinearAttentionError that names the argument and the
fix: the decoding steps' per-token β and gates, the sparse cache (its oracle, its size, its score across calls, its
split), states, a linearized folder's index and fingerprint, and the layer's input dtype; and a few nearby bad
values of linear_attention itself (NaN or inf options, negative sizes, empty inputs, masks and states of the wrong
kind)."""

from __future__ import annotations

import json

import pytest
import torch

import linattn
from linattn import LinearAttentionError, SparseCache, linear_attention
from linattn.capabilities import step_reasons
from linattn.decode import ComposedDecodeStep, DeltaDecodeStep, SparseDecodeStep
from linattn.feature_maps import create
from linattn.state import DeltaRuleState, LinearAttentionState, WindowAttentionState


def _qkv(n: int = 20, heads: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, 8, generator=generator) for _ in range(3))  # type: ignore[return-value]


def _token(q, k, v, t=0):
    return q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :]


# ---- the decoding steps' per-token β and log-decays --------------------------------------------------------------

BAD_TOKEN_OPTIONS = {
    "beta-5": ({"beta": torch.full((1, 4), 5.0)}, r"beta: .*\[0, 2\]"),
    "beta-negative": ({"beta": torch.full((1, 4), -0.1)}, r"beta: .*\[0, 2\]"),
    "beta-nan": ({"beta": torch.full((1, 4), float("nan"))}, r"beta: .*NaN"),
    "beta-int": ({"beta": torch.ones(1, 4, dtype=torch.long)}, r"beta: expected a floating tensor"),
    "log-decay-positive": ({"log_decay": torch.full((1, 4), 0.5)}, r"log_decay: .*≤ 0"),
    "log-decay-nan": ({"log_decay": torch.full((1, 4), float("nan"))}, r"log_decay: .*≤ 0"),
    "log-decay-minus-inf": ({"log_decay": torch.full((1, 4), float("-inf"))}, r"log_decay: .*finite"),
    "log-decay-per-feature-positive": ({"log_decay": torch.full((1, 4, 8), 0.1)}, r"log_decay: .*≤ 0"),
}


@pytest.mark.parametrize("given,pattern", BAD_TOKEN_OPTIONS.values(), ids=BAD_TOKEN_OPTIONS.keys())
def test_the_delta_step_refuses_a_bad_per_token_beta_or_decay(given, pattern):
    q, k, v = _qkv()
    _, state = linear_attention(q, k, v, causal=True, update="delta", return_state=True)
    step = DeltaDecodeStep(create("elu"), state)
    with pytest.raises(LinearAttentionError, match=pattern):
        step(*_token(q, k, v), **given)
    assert torch.equal(step.state().kv, state.kv) and step.num_tokens == state.num_tokens  # nothing written
    out = step(*_token(q, k, v), beta=torch.full((1, 4), 0.5), log_decay=torch.full((1, 4), -0.1))  # good ones run
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("given,pattern", BAD_TOKEN_OPTIONS.values(), ids=BAD_TOKEN_OPTIONS.keys())
def test_the_composed_step_refuses_a_bad_per_token_beta_or_decay(given, pattern):
    q, k, v = _qkv()
    options = {"window": 4, "update": "delta"}
    _, state = linear_attention(q, k, v, causal=True, return_state=True, **options)
    step = ComposedDecodeStep(create("elu"), state, options)
    with pytest.raises(LinearAttentionError, match=pattern):
        step(*_token(q, k, v), **given)


# ---- the sparse cache ---------------------------------------------------------------------------------------------


def test_an_oracle_keep_shorter_than_the_positions_reached_is_refused():
    q, k, v = _qkv()
    short = SparseCache(2, score="oracle", block=4, keep=torch.ones(10, dtype=torch.bool))
    with pytest.raises(LinearAttentionError, match=r"keep covers positions 0 … 9, but this call reaches position 19"):
        linear_attention(q, k, v, causal=True, window=4, sparse_cache=short)
    # a continuation counts the positions before it
    _, state = linear_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], causal=True, window=4, return_state=True,
                                sparse_cache=short)
    with pytest.raises(LinearAttentionError, match=r"reaches position 11"):
        linear_attention(q[..., 8:12, :], k[..., 8:12, :], v[..., 8:12, :], causal=True, window=4,
                         sparse_cache=short, initial_state=state)
    exact = SparseCache(2, score="oracle", block=4, keep=torch.ones(20, dtype=torch.bool))
    assert linear_attention(q, k, v, causal=True, window=4, sparse_cache=exact).shape == q.shape


@pytest.mark.parametrize("shape", [(3, 20), (2, 4, 20), (0,)], ids=["3-rows-for-4-heads", "2-batch-rows", "0-d"])
def test_an_oracle_keep_of_the_wrong_shape_is_refused(shape):
    q, k, v = _qkv()
    keep = torch.ones(shape, dtype=torch.bool) if shape != (0,) else torch.tensor(True)
    with pytest.raises(LinearAttentionError, match=r"sparse_cache: keep"):
        linear_attention(q, k, v, causal=True, window=4, sparse_cache=SparseCache(2, score="oracle", keep=keep))
    per_head = SparseCache(2, score="oracle", block=4, keep=torch.ones(4, 20, dtype=torch.bool))  # (H, P) fits
    assert linear_attention(q, k, v, causal=True, window=4, sparse_cache=per_head).shape == q.shape


@pytest.mark.parametrize("made,continued", [("recall", "attention"), ("attention", "recall")])
def test_a_cache_state_continued_with_another_score_is_refused(made, continued):
    q, k, v = _qkv()
    prefix = (q[..., :10, :], k[..., :10, :], v[..., :10, :])
    _, state = linear_attention(*prefix, causal=True, window=4, sparse_cache=SparseCache(2, block=4, score=made),
                                return_state=True)
    other = SparseCache(2, block=4, score=continued)
    with pytest.raises(LinearAttentionError, match=rf"initial_state: the state's cache was made with score='{made}"):
        linear_attention(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], causal=True, window=4, sparse_cache=other,
                         initial_state=state)
    with pytest.raises(LinearAttentionError, match=r"cache: the state's cache was made with"):
        SparseDecodeStep(create("elu"), state, other)
    assert any("score" in reason for reason in step_reasons(
        "sparse", create("elu"), state, {"window": 4, "sparse_cache": other}))
    same = SparseCache(2, block=4, score=made)  # the same cache goes on
    out = linear_attention(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], causal=True, window=4, sparse_cache=same,
                           initial_state=state)
    assert bool(torch.isfinite(out).all())


def test_an_absurd_cache_size_is_refused_before_anything_is_allocated():
    with pytest.raises(LinearAttentionError, match=r"size 1000000000 pairs per head is more than SparseCache.MAX_SIZE"):
        SparseCache(10**9)
    with pytest.raises(LinearAttentionError, match=r"MAX_SIZE"):
        SparseCache((4, SparseCache.MAX_SIZE + 1))
    assert SparseCache(SparseCache.MAX_SIZE).largest == SparseCache.MAX_SIZE  # the bound itself is a size


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_split_with_non_finite_scores_is_refused(bad):
    scores = torch.tensor([[1.0, 2.0], [bad, 0.5]])
    with pytest.raises(LinearAttentionError, match=r"scores: 1 NaN or inf"):
        SparseCache.split(scores, 4)
    caches = SparseCache.split(torch.tensor([[1.0, 3.0], [0.0, 0.0]]), 4)  # finite scores split as before
    assert [cache.size for cache in caches] == [(4, 12), (0, 0)]


# ---- states ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [-5, 1.5, True, "3"], ids=["negative", "float", "bool", "str"])
def test_a_state_with_a_bad_token_count_is_refused(count):
    with pytest.raises(LinearAttentionError, match=r"num_tokens: expected an int ≥ 0"):
        DeltaRuleState(torch.zeros(1, 4, 8, 8), num_tokens=count)
    with pytest.raises(LinearAttentionError, match=r"num_tokens: expected an int ≥ 0"):
        LinearAttentionState(torch.zeros(1, 8, 8), torch.zeros(1, 8), torch.zeros(1), count)
    q, k, v = _qkv()
    _, window_state = linear_attention(q, k, v, causal=True, window=4, return_state=True)
    with pytest.raises(LinearAttentionError, match=r"num_tokens: expected an int ≥ 0"):
        WindowAttentionState(**{**vars(window_state), "num_tokens": count})
    assert DeltaRuleState(torch.zeros(1, 4, 8, 8), num_tokens=0).num_tokens == 0


# ---- linear_attention's nearby bad values: each a clear error ------------------------------------------------------


def _call(**options):
    q, k, v = _qkv()
    return lambda: linear_attention(q, k, v, causal=True, **options)


NEARBY = {
    "beta-nan": (_call(update="delta", beta=float("nan")), r"beta: .*NaN"),
    "beta-inf-tensor": (_call(update="delta", beta=torch.full((1, 4, 20), float("inf"))), r"beta: .*\[0, 2\]"),
    "log-gate-nan": (_call(log_gate=torch.full((1, 4, 20), float("nan"))), r"log_gate: .*NaN"),
    "log-gate-per-feature-inf": (_call(log_gate=torch.full((1, 4, 20, 8), float("inf"))), r"log_gate: .*> 0"),
    "decay-nan": (_call(decay=float("nan")), r"decay: rates must lie in \(0, 1\]"),
    "eps-inf": (_call(eps=float("inf")), r"eps: expected a number ≥ 0 and finite"),
    "min-denom-inf": (_call(min_denom=float("inf")), r"min_denom: expected a number > 0 \(finite\)"),
    "window-negative": (_call(window=-2), r"window: expected an int ≥ 1"),
    "sinks-negative": (_call(window=4, sinks=-1), r"sinks: expected an int ≥ 0"),
    "window-factor-nan": (_call(window=4, window_factor=float("nan")), r"window_factor"),
    "softmax-scale-nan": (_call(window=4, softmax_scale=float("nan")), r"softmax_scale"),
    "mask-float": (_call(key_padding_mask=torch.ones(1, 20)), r"key_padding_mask: dtype torch.float32"),
    "mask-int": (_call(key_padding_mask=torch.ones(1, 20, dtype=torch.long)), r"key_padding_mask: dtype torch.int64"),
    "empty": (lambda: linear_attention(*(torch.randn(1, 4, 0, 8) for _ in range(3)), causal=True),
              r"the sequence is empty"),
}


@pytest.mark.parametrize("call,pattern", NEARBY.values(), ids=NEARBY.keys())
def test_nearby_bad_values_are_refused(call, pattern):
    with pytest.raises(LinearAttentionError, match=pattern):
        call()


@pytest.mark.parametrize("kind", ["plain", "delta", "window"])
def test_a_state_of_another_dtype_is_refused(kind):
    q, k, v = _qkv()
    options = {"delta": {"update": "delta"}, "window": {"window": 4}}.get(kind, {})
    _, state = linear_attention(q, k, v, causal=True, return_state=True, **options)
    with pytest.raises(LinearAttentionError, match=r"initial_state: .*float64.*expected torch.float32|"
                                                   r"initial_state: .*expected torch.float32"):
        linear_attention(q, k, v, causal=True, initial_state=state.to(dtype=torch.float64), **options)


# ---- the layer's input dtype --------------------------------------------------------------------------------------


def test_the_layer_names_a_dtype_mismatch_and_the_fix():
    torch.manual_seed(0)
    layer = linattn.nn.LinearAttention(32, 4, causal=True)
    x = torch.randn(1, 5, 32)
    with pytest.raises(LinearAttentionError, match=r"x: dtype torch.float64, the layer's weights torch.float32; cast"):
        layer(x.double())
    with pytest.raises(LinearAttentionError, match=r"x: dtype torch.int64"):
        layer(torch.ones(1, 5, 32, dtype=torch.long))
    assert layer.double()(x.double()).dtype == torch.float64  # the fix it names
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the projections cast a float32 or half input themselves
        assert layer(x.bfloat16()).shape == (1, 5, 32)
        with pytest.raises(LinearAttentionError, match=r"x: dtype torch.float64"):  # autocast leaves float64 be
            layer(x.double())


# ---- a linearized folder's index and fingerprint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from linattn import hf
    from linattn.evaluate import load_model
    from linattn.linearized.folder import save_linearized
    from test_linearized import save_tiny_llama

    base = save_tiny_llama(tmp_path_factory.mktemp("tiny-base"))
    model, _, _ = load_model(str(base), causal_lm=True)
    hf.linearize(model, "elu")
    folder = tmp_path_factory.mktemp("lin") / "tiny-lin"
    save_linearized(model, folder, maps="elu", base=str(base))
    return folder, base


@pytest.mark.parametrize("index,pattern", [
    ("[1, 2]", r"is not a linattn-linearized v1 index \(a JSON list\)"),
    ("no base", r'lacks or garbles "base"'),
    ("base without fingerprint", r'lacks or garbles "base"'),
    ("no maps", r'lacks or garbles "maps"'),
    ("options a list", r'lacks or garbles "options"'),
])
def test_a_garbled_index_is_explained(tiny_folder, tmp_path, index, pattern):
    from linattn.linearized.folder import INDEX, load_linearized

    folder, _ = tiny_folder
    entry = json.loads((folder / INDEX).read_text())
    if index == "no base":
        del entry["base"]
    elif index == "base without fingerprint":
        del entry["base"]["fingerprint"]
    elif index == "no maps":
        del entry["maps"]
    elif index == "options a list":
        entry["options"] = []
    (tmp_path / INDEX).write_text(index if index.startswith("[") else json.dumps(entry))
    with pytest.raises(LinearAttentionError, match=pattern):
        load_linearized(tmp_path)


def test_one_scaled_projection_changes_the_fingerprint_and_is_refused(tiny_folder, tmp_path):
    import shutil

    from transformers import LlamaForCausalLM

    from linattn.linearized.folder import fingerprint, load_linearized

    folder, base = tiny_folder
    model = LlamaForCausalLM.from_pretrained(base)
    before = fingerprint(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1.5)  # not among the first or last tensors by name
    assert fingerprint(model) != before
    assert fingerprint(model, every_tensor=False) == fingerprint(LlamaForCausalLM.from_pretrained(base),
                                                                 every_tensor=False)  # what the old digest missed
    shutil.copytree(base, tmp_path / "scaled")  # the tokenizer too
    model.save_pretrained(tmp_path / "scaled")
    with pytest.raises(LinearAttentionError, match=r"base: .* is not the model .* some weight differs"):
        load_linearized(folder, base=str(tmp_path / "scaled"))


def test_a_folder_with_the_old_fingerprint_still_loads_and_is_checked(tiny_folder, tmp_path):
    import shutil

    from transformers import LlamaForCausalLM

    from linattn.linearized.folder import INDEX, fingerprint, load_linearized

    folder, base = tiny_folder
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    entry = json.loads((old / INDEX).read_text())
    del entry["base"]["fingerprint_of"]
    entry["base"]["fingerprint"] = fingerprint(LlamaForCausalLM.from_pretrained(base), every_tensor=False)
    (old / INDEX).write_text(json.dumps(entry))
    model, _ = load_linearized(old)
    assert model.config._attn_implementation == "linattn"
    entry["base"]["fingerprint"] = "0" * 32
    (old / INDEX).write_text(json.dumps(entry))
    with pytest.raises(LinearAttentionError, match=r"is not the model"):
        load_linearized(old)


# ---- the decoding steps' states and tokens ------------------------------------------------------------------------


def _steps():
    """(name, a step's constructor from a state, the options that make the state)."""
    from linattn.decode import DecodeStep, WindowDecodeStep

    return [
        ("plain", lambda s: DecodeStep(create("elu"), s), {}),
        ("window", lambda s: WindowDecodeStep(create("elu"), s), {"window": 4}),
        ("delta", lambda s: DeltaDecodeStep(create("elu"), s), {"update": "delta"}),
        ("composed", lambda s: ComposedDecodeStep(create("elu"), s, {"window": 4, "decay": 0.9}),
         {"window": 4, "decay": 0.9}),
    ]


@pytest.mark.parametrize("index", range(4), ids=["plain", "window", "delta", "composed"])
def test_a_step_refuses_a_half_precision_state_and_tokens_of_another_kind(index):
    _, make, options = _steps()[index]
    q, k, v = _qkv()
    _, state = linear_attention(q, k, v, causal=True, return_state=True, **options)
    with pytest.raises(LinearAttentionError, match=r"state: kv in torch.float16; the steps keep fp32 or fp64"):
        make(state.to(dtype=torch.float16))
    step = make(state)
    token = _token(q, k, v)
    with pytest.raises(LinearAttentionError, match=r"keep: expected a bool tensor"):
        step(*token, torch.ones(1, 1))
    with pytest.raises(LinearAttentionError, match=r"q: on meta, the step's state on cpu"):
        step(token[0].to("meta"), *token[1:])
    with pytest.raises(LinearAttentionError, match=r"k: expected a floating tensor"):
        step(token[0], token[1].long(), token[2])
    assert bool(torch.isfinite(step(*token, torch.ones(1, 1, dtype=torch.bool))).all())  # the step goes on


def test_the_layer_decoder_names_a_dtype_mismatch_too():
    torch.manual_seed(0)
    layer = linattn.nn.LinearAttention(32, 4, causal=True)
    _, state = layer(torch.randn(1, 3, 32), return_state=True)
    decoder = linattn.nn.LayerDecoder(layer, state)
    with pytest.raises(LinearAttentionError, match=r"x: dtype torch.float64, the layer's weights torch.float32"):
        decoder(torch.randn(1, 1, 32, dtype=torch.float64))
    assert decoder(torch.randn(1, 1, 32)).shape == (1, 1, 32)


def test_a_step_refuses_a_state_of_another_kind_tokens_of_another_shape_and_bad_options():
    from linattn.decode import DecodeStep, WindowDecodeStep

    q, k, v = _qkv()
    _, plain = linear_attention(q, k, v, causal=True, return_state=True)
    _, window = linear_attention(q, k, v, causal=True, window=4, return_state=True)
    elu = create("elu")
    for make, state, kind in ((lambda s: DecodeStep(elu, s), window, "LinearAttentionState"),
                              (lambda s: DeltaDecodeStep(elu, s), plain, "DeltaRuleState"),
                              (lambda s: WindowDecodeStep(elu, s), plain, "WindowAttentionState"),
                              (lambda s: ComposedDecodeStep(elu, s, {"window": 4, "decay": 0.9}), plain,
                               "WindowAttentionState")):
        with pytest.raises(LinearAttentionError, match=rf"state: \w+ continues a {kind}, got"):
            make(state)
    step = DecodeStep(elu, plain)
    with pytest.raises(LinearAttentionError, match=r"q: expected one token, \(B, H, 1, d\) = \(1, 4, 1, d\)"):
        step(q[..., :2, :], k[..., :2, :], v[..., :2, :])
    with pytest.raises(LinearAttentionError, match=r"k, v: expected one token each"):
        step(q[..., :1, :], k[:, :3, :1, :], v[:, :3, :1, :])
    with pytest.raises(LinearAttentionError, match=r"keep: expected a bool tensor \(B, 1\)"):
        step(*_token(q, k, v), torch.ones(2, 1, dtype=torch.bool))
    for bad in ({"eps": float("nan")}, {"eps": -1.0}):
        with pytest.raises(LinearAttentionError, match=r"eps: expected a number ≥ 0 and finite"):
            DecodeStep(elu, plain, **bad)
    for bad, pattern in (({"window_factor": float("nan")}, r"window_factor"),
                         ({"window_factor": -1.0}, r"window_factor"),
                         ({"softmax_scale": float("nan")}, r"softmax_scale"), ({"eps": float("inf")}, r"eps")):
        with pytest.raises(LinearAttentionError, match=pattern):
            WindowDecodeStep(elu, window, **bad)
        with pytest.raises(LinearAttentionError, match=pattern):
            ComposedDecodeStep(elu, window, {"window": 4, "decay": 0.9, **bad})
