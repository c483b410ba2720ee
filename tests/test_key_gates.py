"""KeyGates: per-token β and forget gates from a linearized model's own keys (linattn.nn.key_gates), and their
place in linattn.hf (every attention call, the state cache's decoding steps)."""

from __future__ import annotations

import math

import pytest
import torch

from linattn import LinearAttentionError
from linattn.nn import KeyGates


def _rotate(key: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Each feature pair (i, i + d/2) turned by its own angle, written out (Llama's rotate-half layout)."""
    half = key.shape[-1] // 2
    x, y = key[..., :half], key[..., half:]
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.cat([x * cos - y * sin, x * sin + y * cos], dim=-1)


def _randomised(gates: KeyGates, seed: int) -> KeyGates:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in gates.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return gates


def test_the_descriptor_does_not_see_the_rotary_embedding():
    torch.manual_seed(0)
    gates = _randomised(KeyGates(3, 8, gate="feature", num_features=5).double(), 1)
    key = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    angles = torch.rand(2, 3, 7, 4, dtype=torch.float64) * 2 * math.pi  # any angle per token and pair
    plain, turned = gates(key), gates(_rotate(key, angles))
    for name in ("beta", "log_gate"):
        torch.testing.assert_close(turned[name], plain[name], rtol=1e-12, atol=1e-12)
    # and the descriptor is the pair lengths' log1p, computed here from the definition
    lengths = torch.stack([torch.hypot(key[..., i], key[..., i + 4]) for i in range(4)], dim=-1)
    # (the 1e-12 under the root, there so that a zero pair has a finite gradient, moves a length by ≤ 1e-6)
    torch.testing.assert_close(gates.descriptor(key), torch.log1p(lengths), rtol=0, atol=1e-6)


def test_initial_values_start_near_the_teacher_and_the_shapes_are_per_key_head():
    torch.manual_seed(0)
    key = torch.randn(2, 3, 5, 8) * 4
    token = KeyGates(3, 8)(key)
    assert token["beta"].shape == token["log_gate"].shape == (2, 3, 5)
    torch.testing.assert_close(token["beta"], torch.full((2, 3, 5), 1 / (1 + math.exp(3.0))))
    torch.testing.assert_close(token["log_gate"], torch.full((2, 3, 5), -math.log1p(math.exp(-7.0))))
    feature = KeyGates(3, 8, gate="feature", num_features=6, beta=False)(key)
    assert set(feature) == {"log_gate"} and feature["log_gate"].shape == (2, 3, 5, 6)
    assert set(KeyGates(3, 8, gate=None)(key)) == {"beta"}


@pytest.mark.parametrize("arguments, match", [
    ({"num_kv_heads": 0, "head_dim": 8}, "num_kv_heads"),
    ({"num_kv_heads": 2, "head_dim": 7}, "head_dim"),
    ({"num_kv_heads": 2, "head_dim": 8, "gate": "head"}, "gate"),
    ({"num_kv_heads": 2, "head_dim": 8, "gate": "feature"}, "num_features"),
    ({"num_kv_heads": 2, "head_dim": 8, "gate": None, "beta": False}, "nothing to compute"),
])
def test_bad_constructions_are_refused(arguments, match):
    with pytest.raises(LinearAttentionError, match=match):
        KeyGates(**arguments)


def test_a_key_of_another_shape_is_refused():
    with pytest.raises(LinearAttentionError, match=r"expected \(B, 2, N, 8\)"):
        KeyGates(2, 8)(torch.randn(1, 3, 4, 8))


def test_the_read_out_weight_gives_the_window_average_plus_lambda_times_the_memory():
    """λ·(composed route with γ = 1/λ) = A + λ·R, with A (the window's softmax average) and R (the memory's
    read-out) taken from two plain calls of the composed route: β = 0 writes nothing (out = A), and γ = 1 gives
    A + R. float64."""
    import linattn
    from linattn.hf import readout_options

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 40, 8, dtype=torch.float64).unbind(0)
    gates = _randomised(KeyGates(2, 8, readout=True).double(), 3)
    per_token = gates(k)
    options = {"window": 8, "sinks": 2, "update": "delta"}
    average = linattn.linear_attention(q, k, v, causal=True, **options, beta=torch.zeros(1, 2, 40,
                                       dtype=torch.float64), log_gate=per_token["log_gate"])
    both = linattn.linear_attention(q, k, v, causal=True, **options, **per_token)
    weighted, weight = readout_options(gates, 2, options)
    assert weight is not None and weight.shape == (2,)
    out = linattn.linear_attention(q, k, v, causal=True, **weighted, **per_token) * weight[:, None, None]
    lam = weight[:, None, None]
    torch.testing.assert_close(out, average + lam * (both - average), rtol=1e-10, atol=1e-12)
    assert float((both - average).detach().abs().max()) > 0.1  # the memory reads something: not vacuous
    at_start = KeyGates(2, 8, readout=True).readout_weight(4)
    torch.testing.assert_close(at_start, torch.full((4,), 1 / (1 + math.exp(4.0))))


# --- in a linearized transformers model ---------------------------------------------------------------------------

def _linearized(gate: str | None, window: int | None, seed: int = 5):
    pytest.importorskip("transformers")
    import linattn.hf as hf
    from test_decoder_generate import tiny_llama

    model = tiny_llama()
    gates = [_randomised(KeyGates(2, 8, gate=gate, num_features=8 if gate == "feature" else None,
                                  readout=window is not None), seed + i) for i in range(2)]
    options = {} if window is None else {"window": window, "sinks": 2}
    return hf.linearize(model, "elu", gates=gates, update="delta", **options)


@pytest.mark.parametrize("gate, window", [("token", 16), ("feature", 16), (None, 16), ("token", None)],
                         ids=["gated-delta+window", "kda+window", "delta+window", "gated-delta"])
def test_generation_with_gates_equals_recompute(gate, window):
    """The gates are computed from each new key in the decoding step as in the chunked call over the whole
    sequence: greedy tokens equal, logits within fp32 rounding of sums in another order."""
    from linattn.decode import ComposedDecodeStep, DeltaDecodeStep

    model = _linearized(gate, window)
    ids = torch.randint(1, 60, (1, 40), generator=torch.Generator().manual_seed(3))  # past the window of 16
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    kind = ComposedDecodeStep if window is not None else DeltaDecodeStep
    assert all(isinstance(layer.stepper, kind) for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)


def test_the_gates_change_the_model_and_train():
    """Other gate weights give other logits (the gates are used), and a loss reaches every gate parameter."""
    model = _linearized("token", 16)
    ids = torch.randint(1, 60, (1, 40), generator=torch.Generator().manual_seed(3))
    first = model(input_ids=ids).logits
    gates = model.model.layers[0].self_attn.linattn_gates
    with torch.no_grad():
        gates.beta_bias.add_(2.0)
    second = model(input_ids=ids).logits
    assert not torch.allclose(first, second, atol=1e-3)
    second.logsumexp(-1).mean().backward()
    for param in gates.parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0)


def test_linearize_checks_the_gates():
    pytest.importorskip("transformers")
    import linattn.hf as hf
    from test_decoder_generate import tiny_llama

    two = [KeyGates(2, 8), KeyGates(2, 8)]
    with pytest.raises(LinearAttentionError, match="belongs to the delta rule"):
        hf.linearize(tiny_llama(), "elu", gates=two, window=16)
    with pytest.raises(LinearAttentionError, match="one module per attention layer"):
        hf.linearize(tiny_llama(), "elu", gates=two[:1], update="delta")
    with pytest.raises(LinearAttentionError, match="drop beta="):
        hf.linearize(tiny_llama(), "elu", gates=two, update="delta", beta=0.5)
    weighed = [KeyGates(2, 8, readout=True), KeyGates(2, 8, readout=True)]
    with pytest.raises(LinearAttentionError, match="read-out weight"):
        hf.linearize(tiny_llama(), "elu", gates=weighed, update="delta")  # no window: nothing to weigh against
    with pytest.raises(LinearAttentionError, match="read-out weight"):
        hf.linearize(tiny_llama(), "elu", gates=weighed, update="delta", window=8, window_factor=2.0)
    model = hf.linearize(tiny_llama(), "elu", gates=two, update="delta")
    hf.linearize(model, "elu", update="delta", beta=0.5)  # linearized again without gates: none left
    assert not hasattr(model.model.layers[0].self_attn, hf.GATES_ATTRIBUTE)


@pytest.mark.parametrize("gate", ["token", "feature"])
def test_decoding_with_key_gates_checks_no_value_per_token_and_the_lean_path_equals_the_general_one(gate,
                                                                                                  monkeypatch):
    """KeyGates' β (a sigmoid) and log-gates (a logsigmoid) are in range by construction: the decoding steps do not
    read them back (no range check per token), and the composed step's lean path for a kept token gives the
    general path's outputs (fp32: the same sums, but the window's softmax in one call where the general path
    divides exp(s − max) by its sum; after two layers and the head the logits differ by ~2e-6: 1e-5 allowed)."""
    import linattn.exact.composed_step as composed
    import linattn.kinds.delta.step as delta
    from linattn.decode import ComposedDecodeStep

    checks = []
    for module in (composed, delta):
        real = module.check_token_options
        monkeypatch.setattr(module, "check_token_options", lambda *a, real=real: checks.append(1) or real(*a))
    lean_calls, real_lean = [], ComposedDecodeStep._delta_token
    monkeypatch.setattr(ComposedDecodeStep, "_delta_token",
                        lambda self, *a: lean_calls.append(1) or real_lean(self, *a))
    model = _linearized(gate, 16)
    ids = torch.randint(1, 60, (1, 40), generator=torch.Generator().manual_seed(4))
    runs = []
    for lean in (True, False):
        monkeypatch.setattr(ComposedDecodeStep, "lean", lean)
        with torch.no_grad():
            runs.append(model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True))
    assert not checks and len(lean_calls) == 2 * 9  # two layers, the tokens after the first (the prefill's)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for lean, general in zip(runs[0].logits, runs[1].logits, strict=True):
        torch.testing.assert_close(lean, general, rtol=1e-5, atol=1e-5)
    step = runs[0].past_key_values.layers[0].stepper
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8)
    with pytest.raises(LinearAttentionError, match="beta"):  # a direct call still checks what it is given
        step(q, k, torch.randn(1, 2, 1, 8), beta=torch.full((1, 4), 5.0))


def test_the_read_out_weight_is_kept_while_decoding_and_follows_a_change():
    """Without a gradient λ is computed once and reused (a decoding token pays nothing for it); an in-place change
    of the weight (an optimiser step, load_state_dict) is seen at once."""
    gates = KeyGates(2, 8, readout=True)
    with torch.no_grad():
        first = gates.readout_weight(4)
        assert gates.readout_weight(4) is first
        gates.readout.add_(1.0)
        changed = gates.readout_weight(4)
    torch.testing.assert_close(changed, torch.sigmoid(gates.readout.detach()).repeat_interleave(2))
    assert not torch.equal(changed, first)
    with torch.no_grad():
        assert gates.readout_weight(2) is not changed  # another head count: its own
    weight = gates.readout_weight(4)  # with a gradient: part of the graph, never a kept tensor
    assert weight.requires_grad and weight is not changed
