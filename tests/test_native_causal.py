"""The native causal forward (linattn.backends.native, causal.cpp) against float64 definitions and the torch forms:
plain linear attention (the elu map made in the kernel, other maps made in torch block by block), the delta rule
with and without decays and per-feature gates, and the delta rule beside the window.

Tolerances: float64 1e-12 against the torch forms (the same sums in another order; 1e-10 for the quadratic
definition, whose sums of N terms are ordered differently again); fp32 at most 2× the error of the torch backend
computing the same call in fp32, plus 1e-6 of the output's scale (the kernel's vectorised sums round in another
order than BLAS; never bit-identical across instruction sets or shapes).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import LinearAttentionError
from linattn.backends import native
from linattn.backends.native import forms as native_forms

pytestmark = pytest.mark.skipif(os.environ.get("LINATTN_NATIVE") == "0", reason="native kernels turned off")


@pytest.fixture(scope="module")
def kernels():
    found = native.module("causal")
    if found is None:
        pytest.skip(f"no native kernels here: {native.status()}")
    return found


def test_the_causal_kernels_build_where_a_compiler_and_ninja_are():
    """Where a compiler and ninja exist the build must succeed: else every comparison here would be a skip."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or importlib.util.find_spec("ninja") is None:
        pytest.skip("no compiler or ninja here: the torch forms run")
    assert native.module("causal") is not None, native.status()


def _inputs(n: int, dv: int, dtype: torch.dtype, heads_kv: int = 3, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, heads_kv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, heads_kv, n, dv, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _quadratic(q, k, v, keep=None):
    """The definition in float64: out_t = Σ_{j≤t} φ(q_t)·φ(k_j) v_j / Σ_{j≤t} φ(q_t)·φ(k_j), φ = elu + 1."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3).double(), v.repeat_interleave(group, -3).double()
    weights = (F.elu(q.double()) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
    weights = weights.tril()
    if keep is not None:
        weights = weights * keep[:, None, None, :].double()
    return (weights @ v) / (weights.sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 1023, 1025, 2050])
@pytest.mark.parametrize("dv", [8, 16, 64, 128])
def test_elu_float64_against_the_definition(kernels, n, dv):
    q, k, v = _inputs(n, dv, torch.float64)
    got = linattn.linear_attention(q, k, v, causal=True, backend="native")
    torch.testing.assert_close(got, _quadratic(q, k, v), rtol=0, atol=1e-10)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "hedgehog"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("heads_kv", [3, 1], ids=["mha", "gqa"])
def test_plain_float64_equals_the_torch_forms_with_state(kernels, feature_map, padded, heads_kv):
    """Every map (elu in the kernel unless padded; the others made in torch a block at a time), masks, GQA, a state
    passed in and the one returned."""
    q, k, v = _inputs(1500, 16, torch.float64, heads_kv)
    options = {"feature_map": feature_map, "causal": True, "return_state": True}
    if feature_map == "relu":
        options["min_denom"] = 1e-3  # relu features can all be zero
    if padded:
        keep = torch.ones(2, 1500, dtype=torch.bool)
        keep[0, :40] = False
        keep[1, 700:777] = False
        options["key_padding_mask"] = keep
    first = slice(0, 1100)
    reference, ref_state = linattn.linear_attention(q[..., first, :], k[..., first, :], v[..., first, :],
                                                    backend="torch", form="recurrent",
                                                    **{**options, "key_padding_mask": options.get(
                                                        "key_padding_mask", torch.ones(2, 1500, dtype=torch.bool)
                                                    )[:, first]})
    got, state = linattn.linear_attention(q[..., first, :], k[..., first, :], v[..., first, :], backend="native",
                                          **{**options, "key_padding_mask": options.get(
                                              "key_padding_mask", torch.ones(2, 1500, dtype=torch.bool))[:, first]})
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(state.kv, ref_state.kv, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(state.k_sum, ref_state.k_sum, rtol=1e-12, atol=1e-10)
    assert state.num_tokens == ref_state.num_tokens == 1100
    rest = slice(1100, 1500)
    mask = options.pop("key_padding_mask", None)
    tail = {"key_padding_mask": mask[:, rest]} if mask is not None else {}
    reference, _ = linattn.linear_attention(q[..., rest, :], k[..., rest, :], v[..., rest, :], backend="torch",
                                            initial_state=ref_state, **options, **tail)
    got, state = linattn.linear_attention(q[..., rest, :], k[..., rest, :], v[..., rest, :], backend="native",
                                          initial_state=state, **options, **tail)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    assert state.num_tokens == 1500


def _global(q, k, v, **options):
    return linattn.linear_attention(q, k, v, causal=False, backend="torch", form="global", **options)


@pytest.mark.parametrize("n", [1, 5, 63, 65, 1030])
@pytest.mark.parametrize("dv", [8, 16, 64, 128])
def test_noncausal_elu_float64_equals_the_global_form(kernels, n, dv):
    """Non-causal: the keys' sums (elu made in the kernel; strips of feature rows over blocks of 64 keys) and the
    queries' reads (tiles of tokens, the odd ones one at a time) against the torch global form."""
    q, k, v = _inputs(n, dv, torch.float64, d=16)
    got = linattn.linear_attention(q, k, v, causal=False, backend="native")
    torch.testing.assert_close(got, _global(q, k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "hedgehog"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_noncausal_float64_every_map_masks_cross_attention_and_state(kernels, feature_map, padded):
    """Maps made in torch a block at a time (features of 13 and 24: strips and tiles with remainders), masked
    keys (their keys NaN: never read), fewer queries than keys, a state passed in and the one returned,
    unnormalised and min_denom."""
    q, k, v = _inputs(1100, 32, torch.float64, heads_kv=1, d=12)
    q = q[..., :700, :]  # cross attention: 700 queries over 1,100 keys
    options: dict[str, object] = {"feature_map": feature_map, "return_state": True}
    if feature_map == "relu":
        options["min_denom"] = 1e-3
    if padded:
        keep = torch.ones(2, 1100, dtype=torch.bool)
        keep[0, :40] = False
        keep[1, 1000:] = False
        k[1, :, 1000:] = float("nan")
        options["key_padding_mask"] = keep
    fmap = linattn.features.resolve_feature_map(feature_map, 12)
    options["feature_map"] = fmap.double()
    reference, ref_state = _global(q, k, v, **options)
    got, state = linattn.linear_attention(q, k, v, causal=False, backend="native", **options)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(state.kv, ref_state.kv, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(state.k_sum, ref_state.k_sum, rtol=1e-12, atol=1e-10)
    assert state.num_tokens == ref_state.num_tokens == 1100
    options.pop("key_padding_mask", None)
    again, _ = linattn.linear_attention(q, k[..., :50, :], v[..., :50, :], causal=False, backend="native",
                                        initial_state=state, **options)
    reference, _ = _global(q, k[..., :50, :], v[..., :50, :], initial_state=ref_state, **options)
    torch.testing.assert_close(again, reference, rtol=0, atol=1e-12)
    unnormalised = linattn.linear_attention(q, k[..., :50, :], v[..., :50, :], causal=False, backend="native",
                                            normalize=False, feature_map=fmap.double())
    torch.testing.assert_close(unnormalised, _global(q, k[..., :50, :], v[..., :50, :], normalize=False,
                                                      feature_map=fmap.double()), rtol=1e-12, atol=1e-10)


def test_plain_unnormalised_and_two_dimensional_inputs(kernels):
    q, k, v = _inputs(300, 32, torch.float64)
    for options in ({"normalize": False, "feature_map": "elu"}, {"min_denom": 3.0}):
        got = linattn.linear_attention(q, k, v, causal=True, backend="native", **options)
        reference = linattn.linear_attention(q, k, v, causal=True, backend="torch", **options)
        torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-11)
    got = linattn.linear_attention(q[0, 0], k[0, 0], v[0, 0], causal=True, backend="native")  # (N, D)
    torch.testing.assert_close(got, _quadratic(q[:1, :1], k[:1, :1], v[:1, :1])[0, 0], rtol=0, atol=1e-10)


def _delta_options(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, object]:
    options: dict[str, object] = {"update": "delta", "beta": torch.rand(shape, generator=gen, dtype=torch.float64)}
    if kind == "gated":
        options["log_gate"] = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 2)
    if kind == "decay":
        options["decay"] = 0.95
    if kind == "kda":
        options["log_gate"] = F.logsigmoid(torch.randn(*shape, 8, generator=gen, dtype=torch.float64) + 2)
    if kind == "kda+decay":
        options["log_gate"] = F.logsigmoid(torch.randn(*shape, 8, generator=gen, dtype=torch.float64) + 2)
        options["decay"] = 0.97
    return options


DELTA_KINDS = ("delta", "gated", "decay", "kda", "kda+decay")


@pytest.mark.parametrize("kind", DELTA_KINDS)
@pytest.mark.parametrize("window", [None, 6], ids=["alone", "window"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_delta_family_float64_equals_the_torch_forms_with_state(kernels, kind, window, padded):
    """The delta rule's recurrence in C++ against the torch chunked and recurrent forms, alone and as the linear
    part beside the window (and its sinks), a state passed on between two calls."""
    n = 1300
    q, k, v = _inputs(n, 16, torch.float64)
    options = _delta_options(kind, (2, 3, n), torch.Generator().manual_seed(5))
    keep = torch.ones(2, n, dtype=torch.bool)
    if padded:
        keep[0, :9] = False
        keep[1, 600:640] = False
        k[1, :, 600:640] = float("nan")  # padding is never read
    if window is not None:
        options.update(window=window, sinks=2)

    def call(start: int, end: int, backend: str, state, form: str = "auto"):
        part = {name: (x[..., start:end] if name == "beta" or x.dim() == 3 else x[..., start:end, :])
                if torch.is_tensor(x) else x for name, x in options.items()}
        return linattn.linear_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :],
                                        causal=True, backend=backend, key_padding_mask=keep[:, start:end],
                                        initial_state=state, return_state=True, form=form, **part)

    reference, ref_state = call(0, 1030, "torch", None)
    got, state = call(0, 1030, "native", None)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
    if window is None:
        recurrent, _ = call(0, 1030, "torch", None, "recurrent")
        torch.testing.assert_close(got, recurrent, rtol=0, atol=1e-12)
    mine = state.linear.kv if window is not None else state.kv
    theirs = ref_state.linear.kv if window is not None else ref_state.kv
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    reference, _ = call(1030, n, "torch", ref_state)
    got, state = call(1030, n, "native", state)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call", ["elu", "hedgehog", "gated-delta", "kda-window", "noncausal-elu"])
def test_float32_error_at_most_twice_torchs(kernels, call):
    """fp32 against the float64 result: at most 2× the torch backend's own fp32 error, plus 1e-6 of the scale."""
    n = 3000
    gen = torch.Generator().manual_seed(9)
    q, k, v = _inputs(n, 64, torch.float64, d=16)
    options: dict[str, object] = {"causal": call != "noncausal-elu"}
    if call == "hedgehog":
        options["feature_map"] = "hedgehog"
    if call == "gated-delta":
        options.update(_delta_options("gated", (2, 3, n), gen))
    if call == "kda-window":
        options.update(_delta_options("kda", (2, 3, n), gen), window=32, sinks=4)
        options["log_gate"] = torch.cat([options["log_gate"]] * 2, dim=-1)  # 16 features
    fmap = linattn.features.resolve_feature_map(options.pop("feature_map", "elu"), 16)
    exact = linattn.linear_attention(q, k, v, backend="torch", feature_map=fmap.double(), **options)
    low = {name: x.float() if torch.is_tensor(x) else x for name, x in options.items()}
    q32, k32, v32 = q.float(), k.float(), v.float()
    fmap32 = fmap.float()
    theirs = (linattn.linear_attention(q32, k32, v32, backend="torch", feature_map=fmap32, **low).double()
              - exact).abs().max()
    mine = (linattn.linear_attention(q32, k32, v32, backend="native", feature_map=fmap32, **low).double()
            - exact).abs().max()
    assert mine <= 2 * theirs + 1e-6 * exact.abs().max(), (mine.item(), theirs.item())


def test_the_kernels_elu_map_within_an_ulp_or_two(kernels):
    """The kernel's elu + 1 (its own exponential) against float64, including its floor at the smallest normal
    number and NaN passed on."""
    for dtype, bound in ((torch.float32, 1.0), (torch.float64, 2.0)):
        x = torch.cat([torch.linspace(-800, 6, 40000, dtype=dtype),
                       torch.tensor([-0.0, 0.0, -87.3, -87.4, -708.3, -708.5, float("-inf"), 1e30], dtype=dtype)])
        x = x.reshape(-1, 8)
        got = kernels.elu_features(x).double()
        reference = torch.exp(x.double().clamp(max=0)).clamp(min=torch.finfo(dtype).tiny) + x.double().clamp(min=0)
        error = ((got - reference).abs() / (reference * torch.finfo(dtype).eps)).max().item()
        assert error <= bound, (dtype, error)
        nan = kernels.elu_features(torch.full((1, 8), float("nan"), dtype=dtype))
        assert torch.isnan(nan).all()


# ---- which backend runs --------------------------------------------------------------------------------------


def _spy(monkeypatch):
    calls = []
    for name in ("additive", "delta", "noncausal"):
        original = getattr(native_forms, name)

        def counted(*args, original=original, name=name):
            calls.append(name)
            return original(*args)

        monkeypatch.setattr(native_forms, name, counted)
    return calls


def test_auto_takes_the_kernels_only_without_gradients_and_for_form_auto(kernels, monkeypatch):
    calls = _spy(monkeypatch)
    q, k, v = _inputs(50, 16, torch.float32)
    linattn.linear_attention(q, k, v, causal=True)
    assert calls == ["additive"]
    linattn.linear_attention(q, k, v, causal=True, update="delta", beta=0.5)
    assert calls == ["additive", "delta"]
    linattn.linear_attention(q, k, v, causal=False)
    assert calls == ["additive", "delta", "noncausal"]
    linattn.linear_attention(q, k, v, causal=True, form="chunked")  # a form asked for by name runs as that form
    linattn.linear_attention(q, k, v, causal=False, form="global")
    linattn.linear_attention(q, k, v, causal=True, decay=0.9)  # the additive kernel has no decay
    linattn.linear_attention(q, k, v, causal=False, window=4)  # the non-causal hybrid: torch
    q.requires_grad_(True)
    out = linattn.linear_attention(q, k, v, causal=True)
    out.sum().backward()  # gradients: the torch forms ran
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        linattn.linear_attention(q, k, v, causal=True)
    assert calls == ["additive", "delta", "noncausal", "additive"]
    _, _, v6 = _inputs(50, 6, torch.float32)
    with torch.no_grad():
        linattn.linear_attention(q, k, v6, causal=True)  # a value width the kernels lack: torch, no error
    assert calls == ["additive", "delta", "noncausal", "additive"]


def test_native_by_name_refuses_what_it_does_not_cover(kernels):
    q, k, v = _inputs(20, 16, torch.float32)
    with pytest.raises(LinearAttentionError, match="causal=False with window attention"):
        linattn.linear_attention(q, k, v, causal=False, backend="native", window=4)
    with pytest.raises(LinearAttentionError, match="decay"):
        linattn.linear_attention(q, k, v, causal=True, backend="native", decay=0.9)
    with pytest.raises(LinearAttentionError, match="value dim 6"):
        linattn.linear_attention(q, k, v[..., :6], causal=True, backend="native")
    with pytest.raises(LinearAttentionError, match="gradients"):
        linattn.linear_attention(q.requires_grad_(True), k, v, causal=True, backend="native")
    with pytest.raises(LinearAttentionError, match="window attention"):
        linattn.linear_attention(q.detach(), k, v, causal=True, backend="native", window=4)


def test_turned_off_the_auto_choice_is_torch(monkeypatch):
    monkeypatch.setenv("LINATTN_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    calls = _spy(monkeypatch)
    q, k, v = _inputs(30, 16, torch.float32)
    linattn.linear_attention(q, k, v, causal=True)
    assert calls == []
    with pytest.raises(LinearAttentionError, match="LINATTN_NATIVE=0"):
        linattn.linear_attention(q, k, v, causal=True, backend="native")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("features", [8, 16, 24])
def test_hedgehog_activation_equals_the_maps_features(kernels, dtype, features):
    """The Hedgehog map in C++ (projection and activation; the window beside the delta rule, natively) against the
    map itself: float64 to 1e-12 relative (a few smallest-normal numbers at the floor aside: the kernel sums the
    projection in its own order, so z differs by a few ulps of |z| ≤ ~60 here, which e^{z − max z} turns into
    ~1e-14 relative); fp32 against the float64 map, as a share of each row's norm (what the delta rule reads, its
    rows normalised): at most 2× torch's own fp32 error plus 1e-6 (with |z| up to ~60 a few ulps of z are ~1e-5
    of e^{z − max z}, for torch's projection as for the kernel's)."""
    from linattn.feature_maps import HedgehogFeatureMap

    # 8, 16, 24 features: the fused kernel where the width is one it takes (fp64 8·2^i, fp32 16·2^i), else the
    # projection in torch; 300 tokens: tiles with a remainder, two blocks of 256 tokens per row
    fmap = HedgehogFeatureMap(head_dim=16, num_features=features, num_heads=3).to(dtype)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in fmap.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 2)
        x = torch.randn(2, 3, 300, 16, generator=gen, dtype=torch.float64).to(dtype) * 3
        for is_query in (True, False):
            reference = fmap.features(x, is_query=is_query)
            got = native_forms.hedgehog_features(fmap, x, is_query)
            assert got is not None
            if dtype == torch.float64:
                assert ((got - reference).abs() <= 1e-12 * reference + 4 * torch.finfo(dtype).tiny).all()
            else:  # below the smallest normal number the kernel's exp gives 0 where torch's keeps a subnormal,
                # which a key's weight (up to e^30) can lift to ~1e-25: hence shares of each row's norm
                exact = fmap.double().features(x.double(), is_query=is_query)
                fmap.to(dtype)
                norms = torch.linalg.vector_norm(exact, dim=-1, keepdim=True)
                mine = ((got.double() - exact).abs() / norms).max()
                theirs = ((reference.double() - exact).abs() / norms).max()
                assert mine <= 2 * theirs + 1e-6, (mine.item(), theirs.item())
    assert native_forms.hedgehog_features(fmap, x, True) is None  # gradients wanted for the map's parameters


@pytest.mark.parametrize("kind", ["gated", "kda"])
def test_hedgehog_delta_beside_the_window_float64(kernels, kind):
    """The shipped student's call: the Hedgehog map (activation in C++), the delta rule natively, the window's band."""
    from linattn.feature_maps import HedgehogFeatureMap

    n = 700
    q, k, v = _inputs(n, 16, torch.float64, heads_kv=1)
    fmap = HedgehogFeatureMap(head_dim=8, num_features=4, num_heads=3).double()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for parameter in fmap.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64))
        options = _delta_options(kind, (2, 3, n), gen)
        reference = linattn.linear_attention(q, k, v, causal=True, backend="torch", feature_map=fmap, window=24,
                                             sinks=4, **options)
        got = linattn.linear_attention(q, k, v, causal=True, feature_map=fmap, window=24, sinks=4, **options)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_feature", [False, True], ids=["token", "feature"])
def test_the_gated_delta_rule_under_strong_and_vanishing_gates(kernels, per_feature):
    """Gates that empty most of the memory in one token (log a = −25), that vanish in fp32 (log a = −200: a = 0
    there) and long stretches near 1, per token and per feature: the kernel against the torch forms in float64
    (1e-12) and in fp32 (at most twice torch's own fp32 error, plus 1e-6 of the scale)."""
    n = 900
    gen = torch.Generator().manual_seed(21)
    q, k, v = _inputs(n, 16, torch.float64)
    shape = (2, 3, n, 8) if per_feature else (2, 3, n)
    log_gate = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 6)
    pick = torch.rand(shape, generator=gen)
    log_gate = torch.where(pick < 0.01, torch.full_like(log_gate, -25.0), log_gate)
    log_gate = torch.where(pick > 0.995, torch.full_like(log_gate, -200.0), log_gate)
    beta = torch.rand(2, 3, n, generator=gen, dtype=torch.float64)
    options = dict(causal=True, update="delta", beta=beta, log_gate=log_gate)
    with torch.no_grad():
        exact = linattn.linear_attention(q, k, v, backend="torch", **options)
        got = linattn.linear_attention(q, k, v, backend="native", **options)
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)
        low = {name: x.float() if torch.is_tensor(x) else x for name, x in options.items()}
        theirs = (linattn.linear_attention(q.float(), k.float(), v.float(), backend="torch", **low).double()
                  - exact).abs().max()
        mine = (linattn.linear_attention(q.float(), k.float(), v.float(), backend="native", **low).double()
                - exact).abs().max()
    assert torch.isfinite(got).all()
    assert mine <= 2 * theirs + 1e-6 * exact.abs().max(), (mine.item(), theirs.item())


@pytest.mark.parametrize("kind", ["gated", "kda"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_delta_pass_in_column_strips_across_threads(kernels, kind, dtype):
    """Three rows on two threads: the kernel cuts each row's value columns into strips that run apart where that
    evens out the threads (the rule is independent across value columns), at Dv = 64 and 128. Against the torch
    form in float64 (1e-12) and fp32 (1e-5 of the output's scale: the same products summed in another order), and
    against the kernel on one thread, which runs whole rows (1e-12 of the scale: a column's arithmetic is the same in
    a strip and in a whole row)."""
    n = 700
    gen = torch.Generator().manual_seed(33)
    for dv in (64, 128):
        q = torch.randn(1, 3, n, 16, generator=gen, dtype=torch.float64)
        k = torch.randn(1, 3, n, 16, generator=gen, dtype=torch.float64)
        v = torch.randn(1, 3, n, dv, generator=gen, dtype=torch.float64)
        options = _delta_options(kind, (1, 3, n), gen)
        if kind == "kda":
            options["log_gate"] = torch.cat([options["log_gate"]] * 2, dim=-1)  # 16 features
        low = {name: x.to(dtype) if torch.is_tensor(x) else x for name, x in options.items()}
        threads = torch.get_num_threads()
        try:
            with torch.no_grad():
                exact = linattn.linear_attention(q, k, v, causal=True, backend="torch", **options)
                torch.set_num_threads(2)
                got = linattn.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend="native",
                                               **low)
                torch.set_num_threads(1)
                alone = linattn.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True,
                                                 backend="native", **low)
        finally:
            torch.set_num_threads(threads)
        scale = exact.abs().max().item()
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5 * scale
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=tolerance)
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-12 * scale)
