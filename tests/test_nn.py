"""linattn.nn.LinearAttention: against a float64 reference, decoding by state, autocast, torch.compile, errors."""

from __future__ import annotations

import pytest
import torch

from linattn import LinearAttentionError, LinearAttentionState, SparseCache, WindowAttentionState
from linattn.nn import LinearAttention
from maps_for_tests import LogExp
from reference import elu_plus_one, reference_attention, rel_error


def reference_layer(layer: LinearAttention, x: torch.Tensor, keep: torch.Tensor | None = None, phi=elu_plus_one):
    """The layer written out in float64: projections, split heads, the quadratic definition, merge, output."""
    x = x.double()

    def project(linear: torch.nn.Linear, heads: int) -> torch.Tensor:
        y = x @ linear.weight.double().T + (linear.bias.double() if linear.bias is not None else 0)
        return y.unflatten(-1, (heads, layer.head_dim)).transpose(1, 2)  # (B, heads, N, D)

    q = project(layer.q_proj, layer.num_heads)
    k = project(layer.k_proj, layer.num_kv_heads)
    v = project(layer.v_proj, layer.num_kv_heads)
    mask = keep[:, None, :] if keep is not None else None
    out = reference_attention(q, k, v, phi, causal=layer.causal, keep=mask)  # (B, H, N, D)
    out = out.transpose(1, 2).flatten(-2)
    return out @ layer.out_proj.weight.double().T + layer.out_proj.bias.double()


CASES = {
    "encoder": {"causal": False, "num_kv_heads": None},
    "decoder": {"causal": True, "num_kv_heads": None},
    "decoder-gqa": {"causal": True, "num_kv_heads": 2},
    "encoder-gqa": {"causal": False, "num_kv_heads": 1},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_layer_matches_float64_reference(case, masked):
    torch.manual_seed(0)
    layer = LinearAttention(24, 4, **CASES[case]).double()
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[1, 9:] = False  # right padding
    keep[0, :2] = False  # left padding
    mask = keep if masked else None
    out = layer(x, key_padding_mask=mask)
    assert out.shape == (2, 13, 24)
    assert rel_error(out, reference_layer(layer, x, mask)) < 1e-12


def test_padding_does_not_leak_into_kept_tokens():
    # a padded batch row gives, at its kept tokens, exactly what the unpadded sequence gives alone (encoder)
    torch.manual_seed(1)
    layer = LinearAttention(16, 2)
    x = torch.randn(1, 10, 16)
    padded = torch.cat([x, 100 * torch.randn(1, 5, 16)], dim=1)
    keep = torch.tensor([[True] * 10 + [False] * 5])
    torch.testing.assert_close(layer(padded, key_padding_mask=keep)[:, :10], layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("map_kind", ["elu", "logspace"])
def test_token_by_token_decoding_equals_one_parallel_call(map_kind):
    torch.manual_seed(2)
    fmap = "elu" if map_kind == "elu" else LogExp(8, 11)
    layer = LinearAttention(16, 2, num_kv_heads=1, causal=True, feature_map=fmap).double()
    x = torch.randn(3, 21, 16, dtype=torch.float64)
    full = layer(x)
    out, state = layer(x[:, :7], return_state=True)  # prefill, then one token at a time
    outs = [out]
    for t in range(7, 21):
        step, state = layer(x[:, t : t + 1], state=state, return_state=True)
        outs.append(step)
    assert isinstance(state, LinearAttentionState) and state.num_tokens == 21
    assert state.kv.shape == (3, 2, layer.feature_map.output_dim(8) if map_kind == "elu" else 11, 8)
    assert rel_error(torch.cat(outs, dim=1), full) < 1e-12


def test_unbatched_input():
    torch.manual_seed(3)
    layer = LinearAttention(16, 4, causal=True)
    x = torch.randn(9, 16)
    torch.testing.assert_close(layer(x), layer(x.unsqueeze(0)).squeeze(0))


def test_feature_map_parameters_live_in_state_dict():
    layer = LinearAttention(16, 2, feature_map=LogExp(8, 5))
    assert "feature_map.weight" in layer.state_dict()
    clone = LinearAttention(16, 2, feature_map=LogExp(8, 5, seed=1))
    clone.load_state_dict(layer.state_dict())
    x = torch.randn(1, 4, 16)
    torch.testing.assert_close(clone(x), layer(x))


def naive_linear_attention_layer(layer: LinearAttention, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch computing the same thing entirely in ``dtype``: the baseline of the tolerance rule."""
    params = {name: p.detach().to(dtype) for name, p in layer.named_parameters()}
    x = x.to(dtype)

    def project(name: str, heads: int) -> torch.Tensor:
        y = x @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        return y.unflatten(-1, (heads, layer.head_dim)).transpose(1, 2)

    q = elu_plus_one(project("q_proj", layer.num_heads))
    k = elu_plus_one(project("k_proj", layer.num_heads))
    v = project("v_proj", layer.num_heads)
    weights = (q @ k.transpose(-1, -2)).tril()
    out = (weights @ v) / (weights.sum(-1, keepdim=True) + 1e-6)
    return out.transpose(1, 2).flatten(-2) @ params["out_proj.weight"].T + params["out_proj.bias"]


def test_autocast_bf16_within_twice_plain_bf16_error():
    torch.manual_seed(4)
    layer = LinearAttention(64, 4, causal=True)
    x = torch.randn(2, 300, 64)
    exact = reference_layer(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().square().mean().backward()  # outside the region, as torch recommends
    assert out.dtype == torch.bfloat16
    assert layer.q_proj.weight.grad is not None and torch.isfinite(layer.q_proj.weight.grad).all()
    plain = rel_error(naive_linear_attention_layer(layer, x, torch.bfloat16), exact)
    ours = rel_error(out, exact)
    assert ours <= 2 * plain, (ours, plain)


def test_autocast_decoding_state_stays_fp32():
    torch.manual_seed(5)
    layer = LinearAttention(16, 2, causal=True)
    x = torch.randn(1, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, state = layer(x[:, :5], return_state=True)
        step = layer(x[:, 5:], state=state)
    assert state.kv.dtype == torch.float32 and step.dtype == torch.bfloat16
    assert rel_error(step, layer(x)[:, 5:]) < 2e-2


def test_torch_compile_fullgraph_forward_and_backward():
    torch.manual_seed(6)
    layer = LinearAttention(16, 2, causal=True)
    x = torch.randn(1, 9, 16)
    eager = layer(x)
    eager.square().sum().backward()
    expected_grad = layer.q_proj.weight.grad.clone()
    layer.zero_grad()
    compiled = torch.compile(layer, fullgraph=True)  # no graph break anywhere in layer + core
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.q_proj.weight.grad, expected_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embed_dim": 10, "num_heads": 3}, "not divisible"),
        ({"embed_dim": 12, "num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"embed_dim": 0, "num_heads": 1}, "embed_dim"),
        ({"embed_dim": 8, "num_heads": 2, "feature_map": "nope"}, "unknown name"),
    ],
    ids=["indivisible", "kv-heads", "zero-width", "unknown-map"],
)
def test_bad_construction_raises(kwargs, match):
    with pytest.raises(LinearAttentionError, match=match):
        LinearAttention(**kwargs)


def test_bad_calls_raise():
    encoder = LinearAttention(8, 2)
    with pytest.raises(LinearAttentionError, match=r"x: expected"):
        encoder(torch.randn(2, 3, 7))
    decoder = LinearAttention(8, 2, causal=True)
    _, state = decoder(torch.randn(1, 3, 8), return_state=True)
    with pytest.raises(LinearAttentionError, match="causal=True"):
        encoder(torch.randn(1, 3, 8), state=state)
    with pytest.raises(LinearAttentionError, match="initial_state"):
        decoder(torch.randn(2, 1, 8), state=state)  # batch 2, state for batch 1
    with pytest.raises(LinearAttentionError, match="key_padding_mask"):
        encoder(torch.randn(1, 3, 8), key_padding_mask=torch.ones(1, 3))  # not bool


# --- decays and gates ---

DECAY_CASES = {
    "retnet": {"decay": "retnet"},
    "lightning": {"decay": "lightning", "layer_index": 1, "num_layers": 4},
    "float": {"decay": 0.9},
    "token-gate": {"gate": "token"},
    "feature-gate+retnet": {"gate": "feature", "decay": "retnet"},
    "unnormalised-retention": {"decay": "retnet", "normalize": False, "feature_map": "identity", "output_norm": True},
}


def _randomise_gates(layer: LinearAttention) -> None:
    # the gate starts at a constant; give it data dependence so that the test exercises it
    if layer.gate_up is not None:
        with torch.no_grad():
            layer.gate_up.weight.normal_(std=2.0)
            layer.gate_up.bias.fill_(0.0)


@pytest.mark.parametrize("case", list(DECAY_CASES))
def test_decayed_layer_decodes_token_by_token(case):
    torch.manual_seed(3)
    layer = LinearAttention(16, 4, num_kv_heads=2, causal=True, **DECAY_CASES[case]).double()
    _randomise_gates(layer)
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    full = layer(x)
    out, state = layer(x[:, :6], return_state=True)
    outs = [out]
    for t in range(6, 19):
        step, state = layer(x[:, t : t + 1], state=state, return_state=True)
        outs.append(step)
    assert rel_error(torch.cat(outs, dim=1), full) < 1e-12


@pytest.mark.parametrize("case", ["retnet", "token-gate", "feature-gate+retnet"])
def test_decayed_layer_matches_float64_recurrence(case):
    from decay_reference import decayed_recurrence

    torch.manual_seed(4)
    layer = LinearAttention(16, 4, causal=True, **DECAY_CASES[case]).double()
    _randomise_gates(layer)
    x = torch.randn(2, 15, 16, dtype=torch.float64)

    def project(linear: torch.nn.Linear, width: int) -> torch.Tensor:  # (B, N, H·width) → (B, H, N, width)
        return (x @ linear.weight.T + linear.bias).unflatten(-1, (4, width)).transpose(1, 2)

    q, k, v = project(layer.q_proj, 4), project(layer.k_proj, 4), project(layer.v_proj, 4)
    g = torch.zeros(4, 1, dtype=torch.float64)
    if "retnet" in case:
        g = g + torch.log(1 - 2.0 ** (-5.0 - torch.arange(4, dtype=torch.float64)))[:, None]
    feature = None
    if layer.gate_down is not None:
        hidden = x @ layer.gate_down.weight.T
        width = 1 if case == "token-gate" else 4
        gate = torch.nn.functional.logsigmoid(hidden @ layer.gate_up.weight.T + layer.gate_up.bias) / 16
        gate = gate.unflatten(-1, (4, width)).transpose(1, 2)  # (B, H, N, width)
        if width == 1:
            g = g + gate.squeeze(-1)
        else:
            feature = gate
    out, _, _ = decayed_recurrence(q, k, v, elu_plus_one, g, feature_decay=feature)
    expected = out.transpose(1, 2).flatten(-2) @ layer.out_proj.weight.T + layer.out_proj.bias
    assert rel_error(layer(x), expected) < 1e-12


def test_gates_start_near_one_and_rates_follow_the_papers():
    layer = LinearAttention(32, 4, causal=True, gate="feature", decay="retnet")
    g = layer._log_gate(torch.randn(2, 7, 32))
    assert g is not None and g.shape == (2, 4, 7, 8)
    assert float(g.detach().exp().min()) > 0.998  # logsigmoid(4)/16: a long memory at initialisation
    assert layer.decay_rates == (1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8)  # RetNet, γ_h = 1 − 2^(−5−h)
    lightning = LinearAttention(32, 4, causal=True, decay="lightning", layer_index=0, num_layers=2)
    assert lightning.decay_rates is not None
    torch.testing.assert_close(
        torch.tensor(lightning.decay_rates),
        torch.exp(-(2.0 ** (-8.0 * torch.arange(1, 5) / 4)) * (1 + 1e-5)),
    )


def test_decayed_layer_bad_options_raise():
    with pytest.raises(LinearAttentionError, match="causal=True"):
        LinearAttention(16, 2, decay="retnet")
    with pytest.raises(LinearAttentionError, match="decay: expected"):
        LinearAttention(16, 2, causal=True, decay="alibi")
    with pytest.raises(LinearAttentionError, match="gate: expected"):
        LinearAttention(16, 2, causal=True, gate="head")
    with pytest.raises(LinearAttentionError, match="layer_index"):
        LinearAttention(16, 2, causal=True, decay="lightning", layer_index=3, num_layers=2)


def test_output_norm_is_a_per_head_standardisation():
    torch.manual_seed(5)
    layer = LinearAttention(16, 4, causal=True, **DECAY_CASES["unnormalised-retention"]).double()
    assert layer.output_norm is not None
    with torch.no_grad():
        layer.output_norm.weight.normal_()
        layer.output_norm.bias.normal_()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    captured = {}
    first = layer.out_proj.register_forward_hook(lambda module, args, out: captured.update(x=args[0]))
    layer(x)
    first.remove()
    layer.output_norm, norm = None, layer.output_norm
    captured_plain = {}
    hook = layer.out_proj.register_forward_hook(lambda module, args, out: captured_plain.update(x=args[0]))
    layer(x)
    hook.remove()
    heads = captured_plain["x"].unflatten(-1, (4, 4))  # (B, N, H, D): each head standardised over its D outputs
    mean = heads.mean(-1, keepdim=True)
    var = heads.var(-1, unbiased=False, keepdim=True)
    expected = ((heads - mean) / torch.sqrt(var + 1e-5)).flatten(-2) * norm.weight + norm.bias
    assert rel_error(captured["x"], expected) < 1e-12


@pytest.mark.parametrize("sinks", [0, 2])
def test_window_layer_decodes_token_by_token_as_one_call(sinks):
    """The hybrid layer: prefill then one token at a time (ring buffer + sinks + linear state) equals one call."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, causal=True, window=5, sinks=sinks).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    whole = layer(x)
    out, state = layer(x[:, :9], return_state=True)
    steps = [out]
    for t in range(9, 23):
        step, state = layer(x[:, t : t + 1], state=state, return_state=True)
        steps.append(step)
    assert isinstance(state, WindowAttentionState)
    assert rel_error(torch.cat(steps, 1), whole) <= 1e-12
    plain = LinearAttention(16, 2, causal=True).double()
    plain.load_state_dict(layer.state_dict())
    assert rel_error(plain(x), whole) > 1e-3  # the window changes what the layer computes


def test_window_layer_options_are_checked():
    # the cache beside a decayed state (tests/test_sparse_composed.py)
    assert LinearAttention(16, 2, causal=True, window=4, decay="retnet", sparse_cache=2)(torch.randn(1, 5, 16)).shape \
        == (1, 5, 16)
    with pytest.raises(LinearAttentionError, match=r"window: expected an int ≥ 1"):
        LinearAttention(16, 2, causal=True, window=0)  # refused when the layer is built, not at its first call
    with pytest.raises(LinearAttentionError, match="sink tokens belong to the window hybrid"):
        LinearAttention(16, 2, causal=True, sinks=4)
    encoder = LinearAttention(16, 2, window=3)  # non-causal: the band |t − j| < 3 exact
    assert encoder(torch.randn(1, 10, 16)).shape == (1, 10, 16)


@pytest.mark.parametrize(
    "case, lean",
    [
        ({"feature_map": "elu"}, "DecodeStep"),
        ({"feature_map": "hedgehog"}, "DecodeStep"),
        ({"feature_map": "logspace"}, "DecodeStep"),  # log-space sums rescaled per token
        ({"feature_map": "elu", "num_kv_heads": 1}, "DecodeStep"),  # GQA
        ({"feature_map": "elu", "window": 5, "sinks": 2}, "WindowDecodeStep"),
        ({"feature_map": "hedgehog", "window": 4, "num_kv_heads": 1}, "WindowDecodeStep"),
        ({"feature_map": "elu", "window": 5, "sinks": 1, "sparse_cache": SparseCache(2, block=3), "num_kv_heads": 1},
         "SparseDecodeStep"),
        ({"feature_map": "elu", "decay": "retnet"}, None),  # no lean step for decays: forward with the state
        ({"feature_map": "elu", "min_denom": 1e-3}, None),
    ],
    ids=["elu", "hedgehog", "logspace", "gqa", "window", "window-hedgehog-gqa", "sparse-gqa", "decay", "min_denom"],
)
def test_decoder_equals_one_parallel_call(case, lean):
    """layer.decoder(state): token by token after a prefill, in float64, equals the layer on the whole sequence; it
    takes the lean step where one applies, and its state continues the layer itself."""
    torch.manual_seed(4)
    options = dict(case)
    if options["feature_map"] == "logspace":
        options["feature_map"] = LogExp(8, 11)
    layer = LinearAttention(16, 2, causal=True, **options).double()
    x = torch.randn(3, 24, 16, dtype=torch.float64)
    whole = layer(x)
    out, state = layer(x[:, :9], return_state=True)
    decoder = layer.decoder(state)
    assert type(decoder.step).__name__ == lean if lean else decoder.step is None
    steps = [out] + [decoder(x[:, t : t + 1]) for t in range(9, 20)]
    assert rel_error(torch.cat(steps, 1), whole[:, :20]) <= 1e-10
    rest = layer(x[:, 20:], state=decoder.state())  # the decoder's state continues the layer
    assert rel_error(rest, whole[:, 20:]) <= 1e-10
    steps.append(decoder(x[:, 20:21]))  # and the decoder goes on after handing its state out
    assert rel_error(steps[-1], whole[:, 20:21]) <= 1e-10


def test_decoder_bad_calls_raise():
    layer = LinearAttention(16, 2, causal=True)
    _, state = layer(torch.randn(2, 5, 16), return_state=True)
    decoder = layer.decoder(state)
    with pytest.raises(LinearAttentionError, match="one token"):
        decoder(torch.randn(2, 3, 16))
    with pytest.raises(LinearAttentionError, match="batch of 2"):
        decoder(torch.randn(3, 1, 16))
    with pytest.raises(LinearAttentionError, match="only a causal layer"):
        LinearAttention(16, 2).decoder(state)
    with pytest.raises(LinearAttentionError, match="expected the state"):
        layer.decoder(torch.zeros(3))


def test_decoder_takes_an_unbatched_token():
    torch.manual_seed(5)
    layer = LinearAttention(16, 2, causal=True).double()
    x = torch.randn(6, 16, dtype=torch.float64)
    _, state = layer(x[:5], return_state=True)  # (N, E): a batch of one
    torch.testing.assert_close(layer.decoder(state)(x[5:]), layer(x)[5:], rtol=1e-10, atol=1e-12)

