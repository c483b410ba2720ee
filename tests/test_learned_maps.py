"""Learned feature maps (t2r, hedgehog): shapes, per-head and tied parameters, init, forms, state_dict."""

from __future__ import annotations

import io

import pytest
import torch

import linattn
from linattn import LinearAttentionError, feature_maps
from linattn.feature_maps import HedgehogFeatureMap, T2RFeatureMap

LEARNED = ["t2r", "hedgehog"]


def _phi(fmap: torch.nn.Module, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
    """The features themselves: log-space maps (hedgehog) return log φ from ``features``."""
    out = fmap.features(x, is_query=is_query)
    return out.exp() if fmap.log_space else out


def _reference(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, causal: bool, eps: float = 1e-6) -> torch.Tensor:
    """Quadratic float64 definition from features: (φq φkᵀ ∘ mask) v / row sums."""
    weights = qf @ kf.transpose(-1, -2)  # (..., N, N)
    if causal:
        weights = weights.tril()
    return (weights @ v) / (weights.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("num_features", [None, 5, 24], ids=["m=d", "m<d", "m>d"])
def test_output_dim_and_positivity(name: str, num_features: int | None) -> None:
    fmap = feature_maps.create(name, head_dim=12, num_features=num_features)
    x = torch.randn(2, 3, 7, 12) * 20
    for is_query in (True, False):
        phi = fmap.features(x, is_query=is_query)
        assert phi.shape == (2, 3, 7, fmap.output_dim(12)) and bool(torch.isfinite(phi).all())
        assert bool((_phi(fmap, x, is_query=is_query) >= 0).all())
    m = num_features or 12
    assert fmap.output_dim(12) == (2 * m if name == "hedgehog" else m)


@pytest.mark.parametrize("name", LEARNED)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_every_form_matches_float64_reference(name: str, causal: bool) -> None:
    torch.manual_seed(0)
    fmap = feature_maps.create(name, head_dim=6, num_features=9, num_heads=3, init="random", seed=3).double()
    if name == "hedgehog":
        with torch.no_grad():
            fmap.gate.normal_()  # a key gate e^{u·k} spanning several orders of magnitude
    q, k, v = (torch.randn(2, 3, 37, 6, dtype=torch.float64) for _ in range(3))
    eps = 0.0 if fmap.log_space else 1e-6  # log-space maps: eps acts in the core's shifted scale, so compare at 0
    expected = _reference(_phi(fmap, q, is_query=True), _phi(fmap, k, is_query=False), v, causal, eps)
    forms = ["parallel", "chunked", "recurrent"] if causal else ["parallel", "global", "chunked"]
    for form in forms:
        out = linattn.linear_attention(q, k, v, feature_map=fmap, causal=causal, form=form, chunk_size=8, eps=eps)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_hedgehog_identity_init_is_softmax_of_input() -> None:
    fmap = HedgehogFeatureMap(8)
    x = torch.randn(5, 8)
    expected = torch.cat([torch.softmax(x, -1), torch.softmax(-x, -1)], -1)
    torch.testing.assert_close(fmap(x), expected)
    torch.testing.assert_close(T2RFeatureMap(8).features(x, is_query=False), torch.relu(x))


def test_hedgehog_key_gate_weights_keys_and_never_overflows() -> None:
    """Â_ij ∝ φ(q_i)·φ(k_j)·e^{u·k_j}, written out here from softmax; u·k is clipped to ±30, so a gate far beyond
    fp32's exp range gives finite outputs, equal to the float64 definition with the clip."""
    torch.manual_seed(1)
    fmap = HedgehogFeatureMap(4, num_features=5, num_heads=2, tied=True, init="random", seed=2).double()
    with torch.no_grad():
        fmap.gate.normal_()
        fmap.bias.normal_()
    q, k, v = (torch.randn(2, 9, 4, dtype=torch.float64) for _ in range(3))

    def reference(values: torch.Tensor) -> torch.Tensor:
        w, b, u = fmap.weight[0], fmap.bias[0].unsqueeze(-2), fmap.gate[0].detach()  # (H, m, d), (H, 1, m), (H, d)
        phi = [torch.cat([torch.softmax(z, -1), torch.softmax(-z, -1)], -1) for z in (q @ w.mT + b, k @ w.mT + b)]
        gate = torch.exp((k @ u.unsqueeze(-1)).clamp(-30, 30)).mT  # (H, 1, N)
        scores = (phi[0] @ phi[1].mT) * gate  # (H, N, N)
        return (scores / scores.sum(-1, keepdim=True)) @ values

    eye = torch.eye(9, dtype=torch.float64).expand(2, 9, 9)  # v = I: the output is the weights themselves
    torch.testing.assert_close(linattn.linear_attention(q, k, eye, feature_map=fmap, eps=0), reference(eye),
                               rtol=1e-10, atol=1e-12)
    # queries carry no gate: it would cancel in each row's normalisation
    torch.testing.assert_close(fmap.features(q, is_query=True), fmap.activate(fmap.project(q, is_query=True)))
    with torch.no_grad():
        fmap.gate.mul_(300)  # u·k up to ±1000, clipped to ±30: e^{30} features, sums still far from overflow
    assert float((k @ fmap.gate[0].detach().unsqueeze(-1)).abs().max()) > 100
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        out = linattn.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), feature_map=fmap.to(dtype), eps=0,
                                       causal=False)
        fmap.double()
        assert out.dtype == dtype and bool(torch.isfinite(out).all())
        tolerance = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 0.05}[dtype]
        torch.testing.assert_close(out.double(), reference(v), rtol=tolerance, atol=tolerance)


def test_scaled_features_give_the_same_weights() -> None:
    """The fitting loss uses ``scaled_features`` (c·φ): normalised weights equal those from log φ."""
    for fmap in (HedgehogFeatureMap(6, num_features=7, num_heads=3, init="random", seed=4),
                 T2RFeatureMap(6, num_features=7, num_heads=3, init="random", seed=4)):
        with torch.no_grad():
            fmap.bias.fill_(1.0)  # no all-zero relu rows (0/0 on both sides)
            if isinstance(fmap, HedgehogFeatureMap):
                fmap.gate.normal_()
        fmap = fmap.double()
        q, k = torch.randn(2, 3, 11, 6, dtype=torch.float64).unbind(0)
        scaled = fmap.scaled_features(q, is_query=True) @ fmap.scaled_features(k, is_query=False).mT
        direct = _phi(fmap, q, is_query=True) @ _phi(fmap, k, is_query=False).mT
        torch.testing.assert_close(scaled / scaled.sum(-1, keepdim=True), direct / direct.sum(-1, keepdim=True),
                                   rtol=1e-12, atol=1e-14)


def test_per_head_and_tied_parameters() -> None:
    separate = HedgehogFeatureMap(4, num_heads=3, init="random", seed=1)
    tied = HedgehogFeatureMap(4, num_heads=3, tied=True, init="random", seed=1)
    assert separate.weight.shape == (2, 3, 4, 4) and tied.weight.shape == (1, 3, 4, 4)
    x = torch.randn(3, 6, 4)
    assert not torch.allclose(separate.features(x, is_query=True), separate.features(x, is_query=False))
    torch.testing.assert_close(tied.features(x, is_query=True), tied.features(x, is_query=False))
    # head h uses only its own parameters: changing head 2's weights leaves heads 0 and 1 unchanged
    before = separate.features(x, is_query=True)
    with torch.no_grad():
        separate.weight[0, 2, 0] += 1.0  # one row: shifting all rows alike cancels in the softmax
    after = separate.features(x, is_query=True)
    torch.testing.assert_close(after[:2], before[:2])
    assert not torch.allclose(after[2], before[2])


def test_head_slice_keeps_those_heads() -> None:
    fmap = T2RFeatureMap(4, num_features=6, num_heads=5, init="random", seed=2)
    x = torch.randn(5, 9, 4)
    part = fmap.head_slice(1, 3)
    torch.testing.assert_close(part.features(x[1:3], is_query=False), fmap.features(x, is_query=False)[1:3])


def test_head_select_keeps_those_heads_in_order_and_the_dtype() -> None:
    fmap = feature_maps.create("hedgehog", head_dim=4, num_features=6, num_heads=5, init="random", seed=3).double()
    with torch.no_grad():
        fmap.gate.add_(torch.randn(fmap.gate.shape, dtype=torch.float64))  # the key gate is per head too
    x = torch.randn(5, 9, 4, dtype=torch.float64)
    index = torch.tensor([4, 1])
    part = fmap.head_select(index)
    assert part.weight.dtype == torch.float64 and part.num_heads == 2
    want = fmap.features(x, is_query=False).index_select(0, index)
    # the same arithmetic per head, in a batch of another size (BLAS may pick another kernel): float64 rounding
    torch.testing.assert_close(part.features(x.index_select(0, index), is_query=False), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", LEARNED)
def test_state_dict_round_trip_and_seed(name: str) -> None:
    fmap = feature_maps.create(name, head_dim=8, num_features=16, num_heads=2, init="random", seed=7)
    with torch.no_grad():
        fmap.bias.add_(0.3)
    buffer = io.BytesIO()
    torch.save(fmap.state_dict(), buffer)
    buffer.seek(0)
    fresh = feature_maps.create(name, head_dim=8, num_features=16, num_heads=2, init="random", seed=99)
    fresh.load_state_dict(torch.load(buffer))
    q = k = v = torch.randn(1, 2, 10, 8)
    torch.testing.assert_close(linattn.linear_attention(q, k, v, feature_map=fresh),
                               linattn.linear_attention(q, k, v, feature_map=fmap))
    same = feature_maps.create(name, head_dim=8, num_features=16, num_heads=2, init="random", seed=7)
    other = feature_maps.create(name, head_dim=8, num_features=16, num_heads=2, init="random", seed=8)
    assert torch.equal(same.weight, feature_maps.create(name, head_dim=8, num_features=16, num_heads=2,
                                                        init="random", seed=7).weight)
    assert not torch.equal(same.weight, other.weight)


def test_bf16_and_large_inputs_stay_finite_and_positive() -> None:
    fmap = HedgehogFeatureMap(16, num_features=32)
    q = (torch.randn(1, 2, 50, 16) * 100).bfloat16()
    out = linattn.linear_attention(q, q, q, feature_map=fmap, causal=True)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    assert bool((fmap(q.float()) > 0).all())


def test_bad_options_and_shapes_raise() -> None:
    with pytest.raises(LinearAttentionError, match="head_dim"):
        feature_maps.create("hedgehog")
    with pytest.raises(LinearAttentionError, match="init"):
        feature_maps.create("t2r", head_dim=4, init="zeros")
    fmap = feature_maps.create("hedgehog", head_dim=4, num_heads=3)
    with pytest.raises(LinearAttentionError, match="num_heads=3"):
        fmap(torch.randn(2, 5, 4))
    with pytest.raises(LinearAttentionError, match="head_dim=4"):
        fmap(torch.randn(3, 5, 6))
