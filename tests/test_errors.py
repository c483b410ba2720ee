"""Every bad input raises LinearAttentionError (a ValueError) whose message names the argument and what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import linattn
from linattn import LinearAttentionError, LinearAttentionState


def qkv(*shape, dtype=torch.float32):
    return tuple(torch.randn(*shape, dtype=dtype) for _ in range(3))


def test_error_class_is_a_value_error():
    assert issubclass(LinearAttentionError, ValueError)


BAD_CALLS = {
    "q-not-tensor": (lambda: linattn.linear_attention([1.0], *qkv(4, 3)[1:]), r"q: expected a torch.Tensor"),
    "int-dtype": (
        lambda: linattn.linear_attention(torch.ones(4, 3, dtype=torch.int64), *qkv(4, 3)[1:]),
        r"q: dtype torch.int64 is not floating point; cast",
    ),
    "1-d": (lambda: linattn.linear_attention(*qkv(5)), r"q: expected shape \(\.\.\., N, D\)"),
    "empty": (lambda: linattn.linear_attention(*qkv(0, 3)), r"q: the sequence is empty"),
    "dtype-mismatch": (
        lambda: linattn.linear_attention(torch.randn(4, 3), torch.randn(4, 3).double(), torch.randn(4, 3)),
        r"q, k, v: dtypes differ .*cast them",
    ),
    "rank-mismatch": (
        lambda: linattn.linear_attention(torch.randn(2, 4, 3), torch.randn(4, 3), torch.randn(4, 3)),
        r"q, k, v: ranks differ",
    ),
    "head-dim-mismatch": (
        lambda: linattn.linear_attention(torch.randn(4, 3), torch.randn(4, 5), torch.randn(4, 3)),
        r"q, k: last dimensions differ",
    ),
    "kv-length-mismatch": (
        lambda: linattn.linear_attention(torch.randn(4, 3), torch.randn(4, 3), torch.randn(6, 3)),
        r"k, v: shapes .* must agree",
    ),
    "batch-mismatch": (
        lambda: linattn.linear_attention(torch.randn(2, 4, 3), torch.randn(3, 4, 3), torch.randn(3, 4, 3)),
        r"q, k: leading dimensions differ .*grouped-query",
    ),
    "gqa-not-multiple": (
        lambda: linattn.linear_attention(torch.randn(1, 5, 4, 3), torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3)),
        r"multiple of k's",
    ),
    "causal-lengths": (
        lambda: linattn.linear_attention(torch.randn(4, 3), torch.randn(6, 3), torch.randn(6, 3), causal=True),
        r"causal=True needs as many queries as keys.*initial_state",
    ),
    "chunk-zero": (lambda: linattn.linear_attention(*qkv(4, 3), chunk_size=0), r"chunk_size: expected a positive int"),
    "chunk-negative": (lambda: linattn.linear_attention(*qkv(4, 3), chunk_size=-8), r"chunk_size"),
    "chunk-float": (lambda: linattn.linear_attention(*qkv(4, 3), chunk_size=2.5), r"chunk_size"),
    "eps-negative": (lambda: linattn.linear_attention(*qkv(4, 3), eps=-1.0), r"eps: expected a number ≥ 0"),
    "min-denom-zero": (lambda: linattn.linear_attention(*qkv(4, 3), min_denom=0.0), r"min_denom"),
    "unknown-form": (lambda: linattn.linear_attention(*qkv(4, 3), form="fast"), r"form: unknown form 'fast'; choose"),
    "recurrent-noncausal": (lambda: linattn.linear_attention(*qkv(4, 3), form="recurrent"), r"pass causal=True"),
    "global-causal": (lambda: linattn.linear_attention(*qkv(4, 3), causal=True, form="global"), r"non-causal"),
    "unknown-map": (
        lambda: linattn.linear_attention(*qkv(4, 3), feature_map="softmaxx"),
        r"unknown name 'softmaxx'; known maps are .*elu.*identity.*relu",
    ),
    "map-wrong-type": (lambda: linattn.linear_attention(*qkv(4, 3), feature_map=3), r"feature_map: expected"),
    "callable-returns-junk": (
        lambda: linattn.linear_attention(*qkv(4, 3), feature_map=lambda x: "x"),
        r"feature_map '<lambda>': returned str; it must return a tensor",
    ),
    "signed-map-normalized": (
        lambda: linattn.linear_attention(*qkv(4, 3), feature_map="identity"),
        r"is signed.*normalize=False.*min_denom",
    ),
    "mask-shape": (
        lambda: linattn.linear_attention(*qkv(2, 4, 3), key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
        r"key_padding_mask: shape \(2, 5\) does not broadcast",
    ),
    "mask-dtype": (
        lambda: linattn.linear_attention(*qkv(2, 4, 3), key_padding_mask=torch.ones(2, 4)),
        r"key_padding_mask: dtype torch.float32; pass a bool mask",
    ),
    "mask-type": (
        lambda: linattn.linear_attention(*qkv(2, 4, 3), key_padding_mask=[True] * 4),
        r"key_padding_mask: expected a bool tensor",
    ),
    "nonfinite-checked": (
        lambda: linattn.linear_attention(torch.full((4, 3), float("nan")), *qkv(4, 3)[1:], check_finite=True),
        r"q: 12 non-finite value\(s\)",
    ),
    "numpy-int": (
        lambda: linattn.linear_attention(np.ones((4, 3), dtype=np.int32), *qkv(4, 3)[1:]),
        r"q: NumPy dtype int32 is not floating point",
    ),
    "numpy-mixed-with-torch": (
        lambda: linattn.linear_attention(np.ones((4, 3), dtype=np.float32), *qkv(4, 3)[1:]),
        r"q, k, v: NumPy arrays mixed with torch tensors",
    ),
    "causal-string": (
        lambda: linattn.linear_attention(*qkv(4, 3), causal="False"),  # a non-empty string is truthy
        r"causal: expected True or False, got 'False' \(str\)",
    ),
    "normalize-int": (lambda: linattn.linear_attention(*qkv(4, 3), normalize=0), r"normalize: expected True or False"),
    "signed-callable-normalized": (
        lambda: linattn.linear_attention(*qkv(2, 8, 3), feature_map=lambda x: x),
        r"feature_map '<lambda>': returned negative features .*normalize=False.*min_denom",
    ),
    "nonfinite-features-checked": (
        lambda: linattn.linear_attention(*qkv(4, 3), feature_map=lambda x: 1 / (x - x), check_finite=True),
        r"feature_map '<lambda>': 12 non-finite feature\(s\) for the queries",
    ),
    "head-dim-zero": (lambda: linattn.linear_attention(*qkv(2, 4, 0)), r"q: the head dimension is 0"),
    "value-dim-zero": (
        lambda: linattn.linear_attention(torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 0)),
        r"v: the head dimension is 0",
    ),
    "batch-zero-causal": (
        lambda: linattn.linear_attention(*qkv(0, 2, 4, 3), causal=True), r"q: a batch or head dimension is 0"
    ),
    "heads-zero": (lambda: linattn.linear_attention(*qkv(1, 0, 4, 3)), r"q: a batch or head dimension is 0"),
    "meta-tensors": (
        lambda: linattn.linear_attention(*(torch.empty(2, 4, 3, device="meta") for _ in range(3)), causal=True),
        r"q: a meta tensor has no values",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_actionable_error(case):
    call, pattern = BAD_CALLS[case]
    with pytest.raises(LinearAttentionError, match=pattern):
        call()


def _state(batch=(2,), features=3, values=3, dtype=torch.float32):
    return LinearAttentionState.zeros(batch, features, values, dtype=dtype)


BAD_STATES = {
    "not-a-state": ({"kv": 1}, r"initial_state: expected a LinearAttentionState"),
    "batch-shape": (_state(batch=(3,)), r"initial_state: kv has shape \(3, 3, 3\), expected"),
    "value-dim": (_state(values=5), r"initial_state: kv has shape .*expected \(\*batch, F, Dv\) = \(2, F, 3\)"),
    "feature-dim": (_state(features=7), r"initial_state: feature dimension 7, but feature map .* gives F=3"),
    "dtype": (_state(dtype=torch.float64), r"initial_state: kv is torch.float64, expected torch.float32.*state.to"),
    "corrupted": (
        LinearAttentionState(torch.zeros(2, 3, 3), torch.zeros(2, 4), torch.zeros(2)),
        r"the state is corrupted",
    ),
}


@pytest.mark.parametrize("form", ["parallel", "global", "chunked", "recurrent"])
@pytest.mark.parametrize("case", list(BAD_STATES))
def test_bad_state_raises_actionable_error(case, form):
    state, pattern = BAD_STATES[case]
    causal = form in ("chunked", "recurrent")
    with pytest.raises(LinearAttentionError, match=pattern):
        linattn.linear_attention(*qkv(2, 4, 3), causal=causal, form=form, initial_state=state)


def test_noncausal_chunked_checks_state_features_too():
    with pytest.raises(LinearAttentionError, match=r"feature dimension 7"):
        linattn.linear_attention(*qkv(2, 4, 3), form="chunked", chunk_size=2, initial_state=_state(features=7))


def test_registry_errors():
    from linattn import feature_maps

    with pytest.raises(LinearAttentionError, match=r"exists already; pass overwrite=True"):
        feature_maps.register("elu", feature_maps.EluFeatureMap)
    with pytest.raises(LinearAttentionError, match=r"bad options"):
        feature_maps.create("elu", head_dim=4, nonsense=1)
    with pytest.raises(LinearAttentionError, match=r"non-empty string"):
        feature_maps.register("", feature_maps.EluFeatureMap)


def _wrong_rows(x):
    return x[..., :-1, :]  # drops a token


def _flattened(x):
    return x.reshape(-1, x.shape[-1])  # loses the head dim


def _not_a_tensor(x):
    return x.tolist()


def _integer_features(x):
    return (x > 0).long()


class _MismatchedMap(linattn.feature_maps.FeatureMap):
    """A map that treats queries and keys differently, and gets their widths wrong."""

    def features(self, x, *, is_query):
        return torch.cat([x, x], -1) if is_query else x


@pytest.mark.parametrize(
    ("fmap", "pattern"),
    [
        (_wrong_rows, r"feature_map '_wrong_rows': returned shape \(1, 2, (6|0), 4\) for (queries|keys) of shape "
                      r"\(1, 2, (7|1), 4\).*map the last dim only"),
        (_flattened, r"feature_map '_flattened': returned shape \((14|2), 4\)"),
        (_not_a_tensor, r"feature_map '_not_a_tensor': returned list"),
        (_integer_features, r"feature_map '_integer_features': returned dtype torch.int64"),
    ],
    ids=["rows", "flattened", "list", "int"],
)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"chunk_size": 3}, {"causal": True, "form": "recurrent"}],
                         ids=["global", "causal", "noncausal-chunked", "recurrent"])
def test_a_bad_callable_feature_map_is_named_in_the_error(fmap, pattern, kw):
    q, k, v = qkv(1, 2, 7, 4)
    with pytest.raises(LinearAttentionError, match=pattern):
        linattn.linear_attention(q, k, v, feature_map=fmap, **kw)


def test_a_feature_map_with_different_query_and_key_widths_is_refused():
    q, k, v = torch.randn(1, 7, 4), torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    for kw in ({}, {"chunk_size": 4}):
        with pytest.raises(LinearAttentionError, match=r"8 query features but 4 key features"):
            linattn.linear_attention(q, k, v, feature_map=_MismatchedMap(), **kw)
