"""The sliding-window hybrid (window=, sinks=) against an independent float64 definition with explicit N×N weights."""

from __future__ import annotations

import math

import pytest
import torch

from linattn import LinearAttentionError, WindowAttentionState, linear_attention
from linattn.feature_maps import create


def hybrid_reference(q, k, v, phi_q, phi_k, *, window, sinks, causal, keep=None, factor=None, eps=1e-6):
    """out_t = Σ_j w_tj v_j / (Σ_j w_tj + eps) with, over visible keys j (not masked; causal: j ≤ t):
    exact keys (causal: t − W < j ≤ t; non-causal: |t − j| < W; and j < S) get either
    M_t·softmax_exact(s_tj) with M_t = Σ_exact φ(q_t)·φ(k_j) (factor None) or γ·e^{s_tj − max_exact s_t};
    every other visible key gets φ(q_t)·φ(k_j). s = q·k/√d."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    n = q.shape[-2]
    t, j = torch.arange(n).unsqueeze(-1), torch.arange(n)
    visible = (j <= t) if causal else torch.ones(n, n, dtype=torch.bool)
    near = ((t - j) < window) if causal else ((t - j).abs() < window)
    if keep is not None:
        visible = visible & keep.unsqueeze(-2)
    exact = visible & (near | (j < sinks))
    linear = visible & ~exact
    kernel = phi_q(q) @ phi_k(k).transpose(-1, -2)  # true φ(q)·φ(k), (..., N, N)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    zero = torch.zeros((), dtype=torch.float64)
    if factor is None:
        soft = torch.where(exact, scores.exp(), zero)
        mass = torch.where(exact, kernel, zero).sum(-1, keepdim=True)
        window_weights = mass * soft / soft.sum(-1, keepdim=True).clamp_min(1e-300)
    else:
        top = scores.masked_fill(~exact, -math.inf).amax(-1, keepdim=True)
        gamma = torch.as_tensor(factor, dtype=torch.float64).reshape(*torch.as_tensor(factor).shape, 1, 1)
        window_weights = gamma * torch.where(exact, (scores - top).exp(), zero)
    weights = torch.where(linear, kernel, zero) + window_weights
    return (weights @ v) / (weights.sum(-1, keepdim=True) + eps)


def elu1(x):
    return torch.nn.functional.elu(x) + 1


def inputs(*shape, heads_kv=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    *batch, n, d = shape
    q = torch.randn(*shape, generator=gen, dtype=dtype)
    kv_batch = list(batch)
    if heads_kv is not None:
        kv_batch[-1] = heads_kv
    k = torch.randn(*kv_batch, n, d, generator=gen, dtype=dtype)
    v = torch.randn(*kv_batch, n, d + 3, generator=gen, dtype=dtype)  # Dv ≠ Dk
    return q, k, v


def favor_map(d):
    torch.manual_seed(3)
    fmap = create("favor+", head_dim=d).double()

    def phi(x, is_query):  # log-space map: true features exp(log φ), small inputs so nothing overflows
        return fmap.features(x, is_query=is_query).exp()

    return fmap, (lambda x: phi(x, True)), (lambda x: phi(x, False))


CASES = [  # (N, W, S, chunk)
    pytest.param(37, 5, 0, 8, id="W5-noSinks"),
    pytest.param(37, 5, 4, 8, id="W5-sinks4"),
    pytest.param(33, 1, 0, 4, id="W1"),
    pytest.param(33, 1, 4, 4, id="W1-sinks4"),
    pytest.param(20, 64, 4, 8, id="W>=N"),
    pytest.param(40, 16, 2, 16, id="W=chunk"),
    pytest.param(1, 3, 2, 8, id="N1"),
]


@pytest.mark.parametrize("factor", [None, 0.6], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize(("n", "window", "sinks", "chunk"), CASES)
def test_forms_match_reference(n, window, sinks, chunk, causal, factor):
    q, k, v = inputs(2, 3, n, 8)
    expected = hybrid_reference(q, k, v, elu1, elu1, window=window, sinks=sinks, causal=causal, factor=factor)
    forms = ["parallel", "chunked"] + (["recurrent"] if causal else [])
    for form in forms:
        out = linear_attention(q, k, v, feature_map="elu", causal=causal, window=window, sinks=sinks,
                               window_factor=factor, form=form, chunk_size=chunk)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=form)


@pytest.mark.parametrize("factor", [None, "per-head"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_padding_gqa_and_per_head_factor(causal, factor):
    q, k, v = inputs(2, 4, 30, 8, heads_kv=2, seed=1)
    gen = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 30, generator=gen) > 0.3  # padding both inside and outside the window
    keep[:, 0] = True
    gamma = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64) if factor else None
    expected = hybrid_reference(q, k, v, elu1, elu1, window=6, sinks=3, causal=causal, keep=keep[:, None, :],
                                factor=gamma)
    for form in ["parallel", "chunked"] + (["recurrent"] if causal else []):
        out = linear_attention(q, k, v, causal=causal, window=6, sinks=3, window_factor=gamma, form=form,
                               chunk_size=8, key_padding_mask=keep)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=form)


@pytest.mark.parametrize("factor", [None, 1.5], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_log_space_map(causal, factor):
    q, k, v = inputs(2, 2, 45, 8, seed=2)
    fmap, phi_q, phi_k = favor_map(8)
    # eps=0: eps is added in the stabilised scale, which the reference (true scale) does not have
    expected = hybrid_reference(q, k, v, phi_q, phi_k, window=7, sinks=2, causal=causal, factor=factor, eps=0.0)
    for form in ["parallel", "chunked"] + (["recurrent"] if causal else []):
        out = linear_attention(q, k, v, feature_map=fmap, causal=causal, window=7, sinks=2, window_factor=factor,
                               form=form, chunk_size=8, eps=0.0)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=form)


def test_log_space_large_logits_stay_finite():
    # log φ up to ~±400: exp would overflow fp64 without the shared per-row scale
    q, k, v = inputs(1, 2, 40, 8, seed=3)
    fmap, _, _ = favor_map(8)
    q, k = q * 12, k * 12
    for factor in (None, 0.5):
        outs = [linear_attention(q, k, v, feature_map=fmap, causal=True, window=5, sinks=2, window_factor=factor,
                                 form=form, chunk_size=8) for form in ("parallel", "chunked", "recurrent")]
        assert all(bool(torch.isfinite(o).all()) for o in outs)
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("factor", [None, 0.3], ids=["mass", "gamma"])
def test_window_covering_everything_is_softmax(factor):
    # every key exact: both scale choices reduce to softmax(q·k/√d), whatever the map
    q, k, v = inputs(1, 2, 30, 4, seed=4)
    scores = (q @ k.transpose(-1, -2)) / 2.0
    scores = scores.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), -math.inf)
    for form in ("chunked", "parallel", "recurrent"):
        out = linear_attention(q, k, v, causal=True, window=30, window_factor=factor, form=form, chunk_size=8,
                               eps=0.0)  # eps would be the only difference
        torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", ["chunked", "parallel", "recurrent"])
@pytest.mark.parametrize("fmap_name", ["elu", "favor+"])
def test_continuation_across_calls(form, fmap_name):
    q, k, v = inputs(2, 2, 41, 8, seed=6)
    fmap = favor_map(8)[0] if fmap_name == "favor+" else "elu"
    gen = torch.Generator().manual_seed(7)
    keep = torch.rand(2, 2, 41, generator=gen) > 0.2
    options = {"feature_map": fmap, "causal": True, "window": 6, "sinks": 4, "chunk_size": 4}
    full = linear_attention(q, k, v, key_padding_mask=keep, **options)
    pieces, state = [], None
    for start, end in [(0, 2), (2, 3), (3, 15), (15, 16), (16, 41)]:  # calls shorter than S and than W
        out, state = linear_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], form=form,
                                      key_padding_mask=keep[..., start:end], initial_state=state,
                                      return_state=True, **options)
        pieces.append(out)
    assert isinstance(state, WindowAttentionState) and state.num_tokens == 41
    assert state.keys.shape[-2] == 6 and state.sink_keys.shape[-2] == 4  # O(W + S) buffers
    # different call shapes round differently (BLAS): equal to a few ulp, not bit for bit
    torch.testing.assert_close(torch.cat(pieces, -2), full, rtol=1e-10, atol=1e-10)


def test_token_by_token_with_chunked_calls_and_state_methods():
    q, k, v = inputs(2, 2, 25, 8, seed=8)
    options = {"causal": True, "window": 4, "sinks": 2}
    full = linear_attention(q, k, v, **options)
    state, outs = None, []
    for t in range(25):
        form = "chunked" if t % 2 else "recurrent"
        out, state = linear_attention(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], form=form,
                                      initial_state=state, return_state=True, **options)
        outs.append(out)
        if t == 10:  # beams reordered and back, moved and detached: the same state
            state = state.index_select(0, torch.tensor([1, 0])).index_select(0, torch.tensor([1, 0]))
            state = state.to("cpu").detach()
    torch.testing.assert_close(torch.cat(outs, -2), full, rtol=1e-10, atol=1e-10)


def test_float32_within_tolerance():
    q, k, v = inputs(2, 2, 200, 16, seed=9)
    expected = hybrid_reference(q, k, v, elu1, elu1, window=24, sinks=4, causal=True)
    for form in ("chunked", "parallel"):
        out = linear_attention(q.float(), k.float(), v.float(), causal=True, window=24, sinks=4, form=form)
        assert out.dtype == torch.float32
        error = (out.double() - expected).norm() / expected.norm()
        assert error < 1e-5, (form, float(error))
    half = linear_attention(q.half(), k.half(), v.half(), causal=True, window=24, sinks=4)
    assert half.dtype == torch.float16  # accumulated in fp32, returned in the input dtype
    assert float((half.double() - expected).norm() / expected.norm()) < 5e-3


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("factor", [None, "tensor"])
def test_gradcheck(causal, factor):
    q, k, v = inputs(1, 2, 11, 4, seed=10)
    fmap, _, _ = favor_map(4)
    gamma = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True) if factor else None
    leaves = [x.requires_grad_() for x in (q, k, v)] + ([gamma] if gamma is not None else [])

    def run(*args):
        g = args[3] if len(args) > 3 else None
        return linear_attention(args[0], args[1], args[2], feature_map=fmap, causal=causal, window=3, sinks=2,
                                window_factor=g, form="chunked", chunk_size=4)

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7)


def test_gradients_match_reference_through_state():
    q, k, v = inputs(1, 2, 30, 8, seed=11)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = hybrid_reference(*leaves, elu1, elu1, window=5, sinks=2, causal=True)
    expected.square().sum().backward()
    reference_grads = [x.grad for x in leaves]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    first, state = linear_attention(*(x[..., :13, :] for x in leaves), causal=True, window=5, sinks=2,
                                    return_state=True, chunk_size=4)
    second = linear_attention(*(x[..., 13:, :] for x in leaves), causal=True, window=5, sinks=2, chunk_size=4,
                              initial_state=state)
    torch.cat([first, second], -2).square().sum().backward()
    for got, want in zip((x.grad for x in leaves), reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_bad_options_raise():
    q, k, v = inputs(1, 2, 10, 4)
    with pytest.raises(LinearAttentionError, match="window"):
        linear_attention(q, k, v, window=0)
    with pytest.raises(LinearAttentionError, match="sinks"):
        linear_attention(q, k, v, window=3, sinks=-1)
    with pytest.raises(LinearAttentionError, match="window="):
        linear_attention(q, k, v, sinks=2)
    with pytest.raises(LinearAttentionError, match="window_factor"):
        linear_attention(q, k, v, window=3, window_factor=-1.0)
    with pytest.raises(LinearAttentionError, match="window_factor"):
        linear_attention(q, k, v, window=3, window_factor=torch.ones(3, dtype=torch.float64))
    with pytest.raises(LinearAttentionError, match="normalize"):
        linear_attention(q, k, v, window=3, normalize=False)
    with pytest.raises(LinearAttentionError, match="state"):
        linear_attention(q, k, v, window=3, return_state=True)  # non-causal: no state
    _, state = linear_attention(q, k, v, causal=True, window=3, sinks=1, return_state=True)
    with pytest.raises(LinearAttentionError, match="window=3"):
        linear_attention(q, k, v, causal=True, window=4, sinks=1, initial_state=state)
    with pytest.raises(LinearAttentionError, match="WindowAttentionState"):
        linear_attention(q, k, v, causal=True, window=3, sinks=1, initial_state=state.linear)
    with pytest.raises(LinearAttentionError, match="float32"):
        linear_attention(q.float(), k.float(), v.float(), causal=True, window=3, sinks=1, initial_state=state)


@pytest.mark.parametrize("gamma", [False, True], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fit_with_window_loss_is_the_hybrid_row(causal, gamma, tmp_path):
    # the fitting loss must be the cross-entropy of softmax against the very rows linear_attention(window=) gives
    from linattn.distill import FittedFeatureMaps, _batch, _hybrid_loss, _prepare, _window_masks, load_feature_maps
    from linattn.evaluate.metrics import softmax_weights

    q, k, _ = inputs(3, 24, 8, dtype=torch.float32, seed=12)
    fmap = linattn_fit(q, k, causal=causal, gamma=gamma)
    assert fmap.window == 5 and fmap.sinks == 2 and (fmap.window_factor is not None) == gamma
    item = _prepare(q, k, None, None, causal)[0]
    rows = torch.arange(24)
    batch = _batch(item, rows, None, 0.0, torch.Generator())
    batch.update(_window_masks(rows, rows, 5, 2, causal))
    log_gamma = fmap.window_factor.log() if gamma else None
    with torch.no_grad():
        loss = _hybrid_loss(fmap, batch, 0.0, log_gamma)  # (H, R)
        eye = torch.eye(24).expand(3, 24, 24)
        rows_hybrid = linear_attention(item["q"], item["k"], eye, feature_map=fmap, causal=causal, window=5, sinks=2,
                                       window_factor=fmap.window_factor, eps=0.0)
    target = softmax_weights(q, k, 8**-0.5, causal)  # the softmax rows, formed here independently of _batch
    cross = -torch.special.xlogy(target, rows_hybrid).sum(-1)
    torch.testing.assert_close(loss, cross, rtol=2e-4, atol=2e-4)  # fp32 weights, logs of small weights
    # saved and loaded, the window options travel with the maps (format version 3)
    factors = [fmap.window_factor] if gamma else None
    saved = FittedFeatureMaps("test", "hedgehog", 1, 3, 8, {"num_features": fmap.num_features, "tied": fmap.tied},
                              [fmap], window=5, sinks=2, window_factors=factors)
    saved.save(str(tmp_path / "maps.safetensors"))
    loaded = load_feature_maps(str(tmp_path / "maps.safetensors"))
    options = loaded.window_options(0)
    assert options["window"] == 5 and options["sinks"] == 2
    if gamma:
        torch.testing.assert_close(options["window_factor"], fmap.window_factor)
    else:
        assert options["window_factor"] is None


def linattn_fit(q, k, *, causal, gamma):
    from linattn.distill import fit_feature_map

    return fit_feature_map(q, k, causal=causal, steps=20, eval_every=5, window=5, sinks=2, window_factor=gamma)


def test_fitting_with_the_window_lowers_the_hybrid_loss():
    # the fit must improve the hybrid row over the initial map (held-out loss history goes down)
    from linattn.distill import fit_feature_map

    q, k, _ = inputs(2, 48, 8, dtype=torch.float32, seed=13)
    fmap = fit_feature_map(q * 2, k * 2, causal=True, steps=60, eval_every=10, window=4, sinks=1, noise=0.0)
    history = fmap.fit_history
    assert min(h[2] for h in history[1:]) < history[0][2] - 1e-3


def test_metrics_measure_the_hybrid_rows():
    # a window covering every key makes the hybrid exact softmax: the metrics must then report ~0 error and KL,
    # and a narrow window must differ (the options reach linear_attention)
    from linattn.evaluate.metrics import attention_metrics

    q, k, v = inputs(3, 20, 8, seed=14)
    full = attention_metrics(q, k, v, "elu", window={"window": 20, "sinks": 0, "window_factor": None})
    assert full["rel_error"] < 1e-5 and abs(full["kl"]) < 1e-5  # eps = 1e-6 in the denominator, nothing else
    narrow = attention_metrics(q, k, v, "elu", window={"window": 2, "sinks": 0, "window_factor": None})
    plain = attention_metrics(q, k, v, "elu")
    assert narrow["rel_error"] > 1e-3 and narrow["rel_error"] != plain["rel_error"]


@pytest.mark.parametrize(
    "other",
    [{"cu_seqlens": [0, 5, 12]}, {"backend": "triton"}],
    ids=["cu_seqlens", "triton"],
)
def test_window_refuses_what_it_does_not_combine_with(other):
    q = k = v = torch.randn(1, 2, 12, 4)
    with pytest.raises(LinearAttentionError, match=r"window: the sliding-window hybrid does not combine with"):
        linear_attention(q, k, v, causal=True, window=4, **other)


def test_a_window_state_without_window_is_refused():
    q = k = v = torch.randn(1, 2, 12, 4)
    _, state = linear_attention(q, k, v, causal=True, window=4, sinks=1, return_state=True)
    with pytest.raises(LinearAttentionError, match=r"initial_state: a WindowAttentionState \(window=4, sinks=1\)"):
        linear_attention(q, k, v, causal=True, initial_state=state)


def test_fit_model_feature_maps_carries_window_and_per_layer_gamma(tmp_path):
    from types import SimpleNamespace

    from linattn.distill import fit_model_feature_maps, load_feature_maps

    q, k, v = inputs(4, 16, 8, dtype=torch.float32, seed=15)  # 2 layers × 2 heads, stacked as all_heads() gives
    capture = SimpleNamespace(all_heads=lambda: ([q], [k], [v]), causal=True, scaling=None, num_heads=2,
                              num_layers=2, model_name="tiny", head_dim=8)
    fitted = fit_model_feature_maps(capture, steps=3, eval_every=1, window=4, sinks=1, window_factor=True)
    assert fitted.window == 4 and fitted.sinks == 1 and len(fitted.window_factors) == 2
    fitted.save(str(tmp_path / "maps.safetensors"))
    loaded = load_feature_maps(str(tmp_path / "maps.safetensors"))
    for layer in range(2):
        options = loaded.window_options(layer)
        assert options["window"] == 4 and options["sinks"] == 1 and options["window_factor"].shape == (2,)
        torch.testing.assert_close(options["window_factor"], fitted.window_factors[layer])
        # the layer's map and γ in a hybrid call: heads 2·layer … 2·layer+1 of the stack
        out = linear_attention(q[2 * layer : 2 * layer + 2], k[2 * layer : 2 * layer + 2], v[2 * layer : 2 * layer + 2],
                               feature_map=loaded.maps[layer], causal=True, **options)
        assert out.shape == (2, 16, 11) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("factor", [None, "per-head"], ids=["mass", "gamma"])
@pytest.mark.parametrize("map_name", ["elu", "hedgehog"])
@pytest.mark.parametrize("window,sinks,prefill", [(4, 2, 1), (4, 2, 9), (1, 0, 5), (3, 5, 2), (6, 1, 6)])
def test_window_decode_step_follows_the_float64_reference(window, sinks, prefill, map_name, factor):
    """The lean hybrid step (linattn.decode.WindowDecodeStep): prefill by linear_attention, then token by token,
    with GQA, a left-padded row and a masked stepped key, against the quadratic float64 definition; its state
    equals linear_attention's after the same tokens, and a step on reordered batch rows (beam search) goes on."""
    from linattn.decode import WindowDecodeStep, supports_window

    batch, heads, kv_heads, n, d = 2, 4, 2, 16, 8
    q, k, v = inputs(batch, heads, n, d, heads_kv=kv_heads, seed=prefill)
    keep = torch.ones(batch, n, dtype=torch.bool)
    keep[1, :2] = False  # left padding
    keep[0, prefill + 2] = False  # a masked key among the stepped ones
    gamma = torch.tensor([0.5, 1.0, 2.0, 0.7], dtype=torch.float64) if factor else None
    if map_name == "elu":
        fmap = create("elu")
        phi_q = phi_k = elu1
    else:
        fmap = create("hedgehog", head_dim=d, num_heads=heads, init="random", seed=0).double()
        phi_q, phi_k = (lambda x: fmap.features(x, is_query=True)), (lambda x: fmap.features(x, is_query=False))
    options = {"window": window, "sinks": sinks, "window_factor": gamma}
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], feature_map=fmap,
                                causal=True, key_padding_mask=keep[:, :prefill], return_state=True, **options)
    assert supports_window(fmap, state, options)
    step = WindowDecodeStep(fmap, state, window_factor=gamma, kv_heads=kv_heads)  # keys/values once per kv head
    outs = [step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1])
            for t in range(prefill, n)]
    with torch.no_grad():
        expected = hybrid_reference(q, k, v, phi_q, phi_k, window=window, sinks=sinks, causal=True,
                                    keep=keep[:, None, :], factor=gamma)
    # float64 in-place sums against the float64 quadratic definition: rounding only
    torch.testing.assert_close(torch.cat(outs, dim=-2), expected[..., prefill:, :], rtol=1e-10, atol=1e-10)
    _, full = linear_attention(q, k, v, feature_map=fmap, causal=True, key_padding_mask=keep, return_state=True,
                               **options)
    ours = step.state()
    assert ours.num_tokens == full.num_tokens == n and ours.linear.num_tokens == full.linear.num_tokens
    for name in ("keys", "values", "keep", "sink_keys", "sink_values", "sink_keep"):
        assert torch.equal(getattr(ours, name), getattr(full, name)), name
    torch.testing.assert_close(ours.linear.kv, full.linear.kv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.linear.k_sum, full.linear.k_sum, rtol=1e-10, atol=1e-10)
    # beam search: the rows swapped, one more token each, against linear_attention from the swapped state
    swap = torch.tensor([1, 0])
    more = [x.index_select(0, swap) for x in inputs(batch, heads, 1, d, heads_kv=kv_heads, seed=99)]
    stepped = step.index_select(0, swap)(*more)
    again = linear_attention(*more, feature_map=fmap, causal=True, initial_state=full.index_select(0, swap),
                             **options)
    torch.testing.assert_close(stepped, again, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("factor", [None, "per-head"], ids=["mass", "gamma"])
@pytest.mark.parametrize("window,sinks", [(4, 2), (3, 5), (6, 1)])
def test_stacked_step_gives_each_left_padded_row_its_own_sinks(window, sinks, factor):
    """WindowDecodeStep.stack: rows prefilled alone (without their padding), stepped as one left-padded batch, give
    each row the float64 reference of the row alone — its own first S tokens as sinks — through the steps where
    a row's leaving key or new key is one of its sinks; state() is refused while a row's sinks are in its window
    and exact after; index_select (beam search) keeps each row's own sinks."""
    from linattn.decode import WindowDecodeStep

    heads, kv_heads, n, d = 4, 2, 24, 8
    pads = [0, 3, 1]
    q, k, v = inputs(len(pads), heads, n, d, heads_kv=kv_heads, seed=7)
    gamma = torch.tensor([0.5, 1.0, 2.0, 0.7], dtype=torch.float64) if factor else None
    options = {"window": window, "sinks": sinks, "window_factor": gamma}
    prefill = 4  # the batch's prompt length: rows of 4, 1 and 3 tokens
    steps = []
    for row, pad in enumerate(pads):
        _, state = linear_attention(q[row : row + 1, :, pad:prefill], k[row : row + 1, :, pad:prefill],
                                    v[row : row + 1, :, pad:prefill], feature_map=create("elu"), causal=True,
                                    return_state=True, **options)
        steps.append(WindowDecodeStep(create("elu"), state, window_factor=gamma))
    step = WindowDecodeStep.stack(steps, pads)
    outs = []
    for t in range(prefill, n):
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :]))
        if t + 1 - window - max(pads) < sinks:
            with pytest.raises(LinearAttentionError, match="left-padded"):
                step.state()
    got = torch.cat(outs, dim=-2)
    for row, pad in enumerate(pads):
        with torch.no_grad():
            alone = hybrid_reference(*(x[row : row + 1, :, pad:] for x in (q, k, v)), elu1, elu1, window=window,
                                     sinks=sinks, causal=True, factor=gamma)
        torch.testing.assert_close(got[row : row + 1], alone[..., prefill - pad :, :], rtol=1e-10, atol=1e-10)
    # past the sink phase the position-counted state is exact: one more token from it, against the step's
    more = inputs(len(pads), heads, 1, d, heads_kv=kv_heads, seed=98)
    state = step.state()
    picked = torch.tensor([2, 1, 1])
    stepped = step.index_select(0, picked)(*(x.index_select(0, picked) for x in more))
    again = linear_attention(*(x.index_select(0, picked) for x in more), feature_map=create("elu"), causal=True,
                             initial_state=state.index_select(0, picked), **options)
    torch.testing.assert_close(stepped, again, rtol=1e-10, atol=1e-10)
    with pytest.raises(LinearAttentionError, match="pads"):
        WindowDecodeStep.stack(steps, [0, 0, 0])
    with pytest.raises(LinearAttentionError, match="kv_heads"):
        WindowDecodeStep(create("elu"), state, kv_heads=3)


def test_window_decode_step_refuses_what_it_cannot_reproduce():
    from linattn.decode import supports_window

    q, k, v = inputs(1, 2, 6, 8)
    _, state = linear_attention(q, k, v, causal=True, window=4, sinks=1, return_state=True)
    _, plain = linear_attention(q, k, v, causal=True, return_state=True)
    assert supports_window(create("elu"), state, {"window": 4, "sinks": 1, "eps": 1e-3})
    assert not supports_window(create("elu"), state, {"window": 4, "min_denom": 1e-3})
    assert not supports_window(favor_map(8)[0], state, {"window": 4})  # log-space: linear_attention's path
    assert not supports_window(create("elu"), plain, {})


def window_definition(q, k, v, phi, *, window, sinks, causal, factor, scale, eps=1e-6, min_denom=None):
    """(out, divisor) of the hybrid written from its definition with the two options hybrid_reference leaves at their
    defaults: exact keys weigh M_t·e^{s·q_t·k_j}/Σ_exact e^{s·q_t·k_j'} (factor None, M_t the exact keys' kernel
    mass) or γ·e^{s·q_t·k_j − max}, s = ``scale``, the map seeing q and k unscaled; every other visible key weighs
    φ(q_t)·φ(k_j); divisor = max(Σ_j w_tj + eps, min_denom)."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[-2]
    t, j = torch.arange(n).unsqueeze(-1), torch.arange(n)
    visible = (j <= t) if causal else torch.ones(n, n, dtype=torch.bool)
    near = ((t - j) < window) if causal else ((t - j).abs() < window)
    exact = visible & (near | (j < sinks))
    kernel = phi(q) @ phi(k).transpose(-1, -2)
    scores = scale * (q @ k.transpose(-1, -2))
    soft = torch.where(exact, (scores - scores.masked_fill(~exact, -math.inf).amax(-1, keepdim=True)).exp(), 0.0)
    if factor is None:
        mass = torch.where(exact, kernel, 0.0).sum(-1, keepdim=True)
        window_weights = mass * soft / soft.sum(-1, keepdim=True)
    else:
        window_weights = factor * soft
    weights = torch.where(visible & ~exact, kernel, 0.0) + window_weights
    divisor = weights.sum(-1, keepdim=True) + eps
    if min_denom is not None:
        divisor = divisor.clamp(min=min_denom)
    return (weights @ v) / divisor, divisor.squeeze(-1)


def window_forms(causal):
    return ["parallel", "chunked"] + (["recurrent"] if causal else [])


@pytest.mark.parametrize("factor", [None, 0.6], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_softmax_scale_follows_its_definition(causal, factor):
    """softmax_scale=s weighs the exact keys by e^{s·q·k} (the map still sees q, k unscaled), in every form and in
    the decode step, against the float64 definition within 1e-10 (float64 rounding of sums of a few dozen terms, as
    in test_forms_match_reference). Left out it is 1/√d: the same call as passing 1/√d, bit for bit (the same float
    in the same shapes). Negative control: the output with s = 0.9 differs from the definition at 1/√d = 0.354 by
    ≥ 1e-3 relative (measured 9e-3 to 0.5), 10⁷× the tolerance: a form that ignored the option would fail."""
    q, k, v = inputs(2, 3, 37, 8, seed=11)
    options = {"window": 5, "sinks": 2, "window_factor": factor, "causal": causal}
    defined = {"window": 5, "sinks": 2, "factor": factor, "causal": causal}
    expected, _ = window_definition(q, k, v, elu1, scale=0.9, **defined)
    default, _ = window_definition(q, k, v, elu1, scale=1 / math.sqrt(8), **defined)
    for form in window_forms(causal):
        out = linear_attention(q, k, v, softmax_scale=0.9, form=form, chunk_size=8, **options)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=form)
        assert float((out - default).norm() / default.norm()) >= 1e-3, form  # a wrong scale is seen
        plain = linear_attention(q, k, v, form=form, chunk_size=8, **options)
        assert torch.equal(plain, linear_attention(q, k, v, softmax_scale=1 / math.sqrt(8), form=form, chunk_size=8,
                                                   **options))
        torch.testing.assert_close(plain, default, rtol=1e-10, atol=1e-10, msg=form)
    if causal:  # the decode step takes the option too
        from linattn.decode import WindowDecodeStep

        prefill = 20
        _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], softmax_scale=0.9,
                                    return_state=True, **options)
        step = WindowDecodeStep(create("elu"), state, window_factor=factor, softmax_scale=0.9)
        outs = [step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :]) for t in range(prefill, 37)]
        torch.testing.assert_close(torch.cat(outs, -2), expected[..., prefill:, :], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("factor", [None, 0.6], ids=["mass", "gamma"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_min_denom_clamps_the_hybrid_denominator_after_eps(causal, factor):
    """min_denom=m divides by max(Σ_j w_tj + eps, m), in every form, against the float64 definition within 1e-10,
    gradients included (where the clamp holds, the divisor is a constant): float64 rounding of sums of a few dozen
    terms, as in test_forms_match_reference. m lies halfway between the two middle rows' Σ w + eps, so the clamp
    acts on half the rows and no row sits at the clamp's kink (there the gradient is either side's, and a form
    rounding to the other side would disagree by 1e-2); eps is a quarter of the median Σ w (not the default 1e-6),
    so the order of clamp and eps shows. Negative controls: dividing by Σ w + eps unclamped, or clamping before
    adding eps (max(Σ w, m) + eps), each differs from the output by ≥ 1e-2 relative (measured ≥ 0.1)."""
    q, k, v = inputs(2, 3, 37, 8, seed=12)
    q = q * 2  # a wider spread of denominators between rows
    defined = {"window": 5, "sinks": 2, "factor": factor, "causal": causal, "scale": 1 / math.sqrt(8)}
    _, sums = window_definition(q, k, v, elu1, eps=0.0, **defined)
    eps = float(sums.median()) / 4
    defined["eps"] = eps
    unclamped, divisor = window_definition(q, k, v, elu1, **defined)
    ranked = divisor.flatten().sort().values
    middle = ranked.numel() // 2
    # halfway between two rows' divisors: no row sits at the clamp's kink, where the gradient is either side's
    min_denom = float(ranked[middle - 1] + ranked[middle]) / 2
    assert float(ranked[middle] - ranked[middle - 1]) > 1e-9 * min_denom
    assert 0.3 <= float((divisor < min_denom).double().mean()) <= 0.7  # the clamp acts on about half the rows
    expected, _ = window_definition(q, k, v, elu1, min_denom=min_denom, **defined)
    clamp_first = (unclamped * divisor.unsqueeze(-1)) / ((divisor - eps).clamp(min=min_denom) + eps).unsqueeze(-1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected_grads = torch.autograd.grad(
        (window_definition(*leaves, elu1, min_denom=min_denom, **defined)[0] * v.flip(-1)).sum(), leaves
    )
    for form in window_forms(causal):
        out = linear_attention(*leaves, window=5, sinks=2, window_factor=factor, causal=causal, eps=eps,
                               min_denom=min_denom, form=form, chunk_size=8)
        torch.testing.assert_close(out.detach(), expected, rtol=1e-10, atol=1e-10, msg=form)
        for wrong in (unclamped, clamp_first):
            assert float((out.detach() - wrong).norm() / wrong.norm()) >= 1e-2, form
        grads = torch.autograd.grad((out * v.flip(-1)).sum(), leaves)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=form)
