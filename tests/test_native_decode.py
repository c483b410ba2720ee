"""The native decoding core (linattn.backends.native, C++ built on first use) against the torch code it replaces
and against the chunked form: the window beside a delta-rule memory (delta, gated delta, KDA), one kept token at a
time. float64 agreement to 1e-12 (the same arithmetic, summed in another order); fp32 within 2e-6 of the output's
scale (vectorised sums in another order than torch's kernels: a few units in the last place of each sum, never
bit-identical across instruction sets)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.backends import native
from linattn.exact.composed_step import ComposedDecodeStep
from linattn.feature_maps import HedgehogFeatureMap

KINDS = ("delta", "gated-delta", "kda", "delta-decay")


def _options(kind: str, shape: tuple[int, ...], features: int, gen: torch.Generator, dtype: torch.dtype
             ) -> dict[str, object]:
    beta = torch.rand(shape, generator=gen, dtype=dtype) * 1.5
    if kind == "delta":
        return {"update": "delta", "beta": beta}
    if kind == "delta-decay":
        return {"update": "delta", "beta": beta, "decay": 0.9}
    if kind == "gated-delta":
        return {"update": "delta", "beta": beta,
                "log_gate": F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype) + 1)}
    return {"update": "delta", "beta": beta,
            "log_gate": F.logsigmoid(torch.randn(*shape, features, generator=gen, dtype=dtype) + 1)}


def _decode(kind: str, use_native: bool, dtype: torch.dtype, prompt: int, factor: float | None,
            heads_kv: int, fixed_beta: bool = False, poison: bool = False,
            map_class: type = HedgehogFeatureMap):
    """(stepped outputs, the chunked form's outputs for the same tokens, the step)."""
    gen = torch.Generator().manual_seed(3)
    b, h, n, d, dv, window, sinks = 2, 4, 24, 8, 6, 5, 2
    fmap = map_class(head_dim=d, num_features=4, num_heads=h).to(dtype)
    with torch.no_grad():
        for parameter in fmap.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 0.5)
    # drawn in float64 and rounded, so that every dtype sees the same inputs
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(b, heads_kv, n, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, heads_kv, n, dv, generator=gen, dtype=torch.float64).to(dtype)
    options = {name: x.to(dtype) if torch.is_tensor(x) else x
               for name, x in _options(kind, (b, h, n), 8, gen, torch.float64).items()}
    if fixed_beta:
        options["beta"] = 0.8
    keep = torch.ones(b, n, dtype=torch.bool)
    for row, position in ((0, 1), (1, prompt - 2)):  # masked keys in the prompt: they sit in the ring, write nothing
        if 0 <= position < prompt:
            keep[row, position] = False
            if poison:  # padding with NaN and inf in it: never read, not even by the map when it leaves the window
                k[row, :, position] = float("nan")
                v[row, :, position, 0] = float("inf")
    common = {"window": window, "sinks": sinks, "window_factor": factor}
    whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, key_padding_mask=keep, **common,
                                     **options)
    head = {name: (x[..., :prompt] if torch.is_tensor(x) and x.shape == (b, h, n) else
                   x[..., :prompt, :] if torch.is_tensor(x) else x) for name, x in options.items()}
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], feature_map=fmap,
                                        causal=True, key_padding_mask=keep[:, :prompt], return_state=True, **common,
                                        **head)
    fixed = {name: x for name, x in options.items() if not torch.is_tensor(x)}
    original = ComposedDecodeStep.native
    ComposedDecodeStep.native = use_native
    try:
        step = ComposedDecodeStep(fmap, state, {**common, **fixed})
    finally:
        ComposedDecodeStep.native = original
    outs = []
    for t in range(prompt, n):
        beta = options["beta"][..., t] if torch.is_tensor(options["beta"]) else None
        gate = options.get("log_gate")
        gate = None if gate is None else gate[..., t] if gate.dim() == 3 else gate[..., t, :]
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], beta=beta,
                         log_decay=gate))
    return torch.cat(outs, dim=-2), whole[..., prompt:, :], step


@pytest.fixture(scope="module")
def kernels():
    found = native.module()
    if found is None:
        pytest.skip(native.status())
    return found


def test_the_kernels_build_where_a_compiler_and_ninja_are():
    """Where this machine has a C++ compiler and ninja, the build must succeed: a broken build would otherwise turn
    every comparison below into a skip."""
    import importlib.util

    if os.environ.get("LINATTN_NATIVE") == "0" or shutil.which(os.environ.get("CXX", "c++")) is None \
            or importlib.util.find_spec("ninja") is None:
        pytest.skip("no compiler or ninja here, or turned off: the torch code runs")
    assert native.module() is not None, native.status()
    assert "off" not in native.status(), native.status()


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("prompt", [1, 9], ids=["prompt-inside-the-sinks", "prompt-9"])
@pytest.mark.parametrize("kind", KINDS)
def test_native_equals_torch_and_the_chunked_form_float64(kernels, kind, prompt, factor, heads_kv):
    got, whole, step = _decode(kind, True, torch.float64, prompt, factor, heads_kv)
    reference, _, torch_step = _decode(kind, False, torch.float64, prompt, factor, heads_kv)
    assert step._native is kernels and torch_step._native is None
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)
    # the state it leaves: the memory, the ring, its flags and strengths
    mine, theirs = step.state(), torch_step.state()
    torch.testing.assert_close(mine.linear.kv, theirs.linear.kv, rtol=0, atol=1e-12)
    for name in ("keys", "values", "keep", "sink_keys", "sink_values", "sink_keep", "betas"):
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), rtol=0, atol=0)
    assert (mine.num_tokens, mine.linear.num_tokens) == (theirs.num_tokens, theirs.linear.num_tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_native_fixed_beta(kernels, kind):
    got, whole, _ = _decode(kind, True, torch.float64, 9, None, 2, fixed_beta=True)
    reference, _, _ = _decode(kind, False, torch.float64, 9, None, 2, fixed_beta=True)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_native_float32(kernels, kind):
    got, _, _ = _decode(kind, True, torch.float32, 9, 0.7, 2)
    reference, _, _ = _decode(kind, False, torch.float32, 9, 0.7, 2)
    exact, _, _ = _decode(kind, False, torch.float64, 9, 0.7, 2)  # fp32's inputs: rounding differs by ~1e-7
    scale = float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= 2e-6 * scale
    assert float((got - reference).abs().max()) <= 2e-6 * scale


def test_the_build_name_differs_by_checkout_not_by_call(tmp_path):
    """Two copies of one source (two checkouts) get two build names, so neither rebuilds the other's; one source
    keeps its name."""
    source = native.SOURCES["decode"]
    copy = tmp_path / source.name
    copy.write_bytes(source.read_bytes())
    assert native.build_digest(source) == native.build_digest(source)
    before = native.build_digest(copy)
    assert before != native.build_digest(source)
    copy.write_bytes(source.read_bytes() + b"\n")  # and an edited source, at the same path, another
    assert native.build_digest(copy) != before


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LINATTN_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.module() is None
    assert native.status() == ("native kernels: decode off (turned off by LINATTN_NATIVE=0); "
                              "causal off (turned off by LINATTN_NATIVE=0)")
    _, _, step = _decode("gated-delta", True, torch.float64, 9, None, 2)
    assert step._native is None  # the torch code runs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_key_gates_step_arguments_equal_the_layer(kernels, dtype):
    """β and the per-head log-gate of one token in C++ (KeyGates.step_arguments) against the layer's forward,
    repeated over each key head's group as the decoding step takes them."""
    from linattn.hf_cache import step_arguments
    from linattn.nn import KeyGates

    gen = torch.Generator().manual_seed(5)
    gates = KeyGates(2, 8).to(dtype)
    with torch.no_grad():
        for parameter in gates.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 2)
        key = (torch.randn(3, 2, 1, 8, generator=gen, dtype=torch.float64) * 3).to(dtype)
        got = gates.step_arguments(key, 6)
        expected = step_arguments(gates(key), 6)
    assert got is not None and set(got) == set(expected) == {"beta", "log_decay"}
    tolerance = 1e-14 if dtype == torch.float64 else 2e-6
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=tolerance, atol=tolerance)
    assert gates.step_arguments(key, 6) is None  # a gradient to take (outside no_grad): the layer's forward
    assert KeyGates(2, 8, gate="feature", num_features=4).to(dtype).step_arguments(key, 6) is None


@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "shared"])
def test_the_hedgehog_map_in_cpp_equals_the_feature_stage(kernels, shared):
    from linattn.features import unit_features

    gen = torch.Generator().manual_seed(7)
    fmap = HedgehogFeatureMap(head_dim=8, num_features=5, num_heads=None if shared else 3).double()
    with torch.no_grad():
        for parameter in fmap.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(2, 3, 1, 8, generator=gen, dtype=torch.float64) * 4
    for is_query, index in ((True, 0), (False, 1)):
        got = kernels.hedgehog_unit_features(x.reshape(2, 3, 8).contiguous(), fmap.weight[index].detach(),
                                             fmap.bias[index].detach(), None if is_query else fmap.gate[0].detach(),
                                             fmap.GATE_LIMIT, torch.finfo(torch.float64).tiny)
        with torch.no_grad():
            expected = unit_features(fmap, x, is_query=is_query, log_space=False)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


class _OwnMap(HedgehogFeatureMap):
    """The same map under another class: the step's C++ call for Hedgehog does not take it (a subclass may change
    the features), so the torch feature stage runs beside the C++ memory-and-window call."""


@pytest.mark.parametrize("map_class", [HedgehogFeatureMap, _OwnMap], ids=["map-in-cpp", "map-in-torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_masked_keys_with_nan_leave_the_window_unread(kernels, kind, map_class):
    got, whole, step = _decode(kind, True, torch.float64, 9, 0.7, 2, poison=True, map_class=map_class)
    reference, _, _ = _decode(kind, False, torch.float64, 9, 0.7, 2, poison=True, map_class=map_class)
    assert step._native is kernels and (step._hedgehog is None) == (map_class is _OwnMap)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-10)
