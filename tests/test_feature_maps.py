"""The feature-map catalogue: every registered map in every form, causal safety, low precision, state_dict, and
the statistics of the random maps (unbiasedness, variance orderings, error against m) against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

import linattn
from linattn import LinearAttentionError, feature_maps
from linattn.feature_maps import (
    DpfpFeatureMap,
    FavorPlusFeatureMap,
    FavorPlusPlusFeatureMap,
    RebasedFeatureMap,
    TaylorFeatureMap,
    TrigFeatureMap,
    redraw_random_features,
)
from reference import SHAPE_ULPS, ulps_of_scale

D = 8
MAPS = feature_maps.available()
F64 = torch.float64


def make(name: str, dtype: torch.dtype = F64, **options: object) -> torch.nn.Module:
    """The map with default options (trig: its bounded kernel, as the softmax one overflows by design)."""
    if name == "trig":
        options.setdefault("kernel", "gaussian")
    return feature_maps.create(name, head_dim=D, **options).to(dtype)


def normalize_for(fmap: torch.nn.Module) -> bool:
    return bool(getattr(fmap, "positive", True))


def qkv(n: int = 13, *, seed: int = 0, dtype: torch.dtype = F64, heads: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, dim, generator=g, dtype=F64).to(dtype) for dim in (D, D, 5))


def attend(fmap: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    return linattn.linear_attention(q, k, v, feature_map=fmap, normalize=normalize_for(fmap), **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).detach())


# ----------------------------------------------------------------------------------------------------------------
# every map: forms, state continuation, causal safety, dtypes, state_dict


@pytest.mark.parametrize("name", MAPS)
def test_every_form_agrees_in_float64(name: str) -> None:
    fmap = make(name)
    q, k, v = qkv()
    assert fmap.features(q, is_query=True).shape[-1] == fmap.output_dim(D)
    causal = [attend(fmap, q, k, v, causal=True, form=f, chunk_size=4) for f in ("parallel", "chunked", "recurrent")]
    full = [attend(fmap, q, k, v, form=f, chunk_size=5) for f in ("parallel", "global", "chunked")]
    for outs in (causal, full):
        assert torch.isfinite(outs[0]).all()
        for out in outs[1:]:
            assert rel_err(out, outs[0]) <= 1e-10


@pytest.mark.parametrize("name", MAPS)
def test_state_continuation(name: str) -> None:
    fmap = make(name)
    q, k, v = qkv()
    whole = attend(fmap, q, k, v, causal=True)
    first, state = attend(fmap, q[..., :7, :], k[..., :7, :], v[..., :7, :], causal=True, return_state=True)
    rest = attend(fmap, q[..., 7:, :], k[..., 7:, :], v[..., 7:, :], causal=True, initial_state=state, form="recurrent")
    assert rel_err(torch.cat([first, rest], dim=-2), whole) <= 1e-10


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", MAPS)
def test_causal_safety(name: str, dtype: torch.dtype) -> None:
    """Outputs for the first 12 tokens do not change when 6 tokens with 10× larger norms follow."""
    fmap = make(name)
    q, k, v = qkv(12, dtype=dtype)
    q2, k2, v2 = qkv(6, seed=1, dtype=dtype)
    longer = [torch.cat([a, 10 * b], dim=-2) for a, b in ((q, q2), (k, k2), (v, v2))]
    for form in ("chunked", "recurrent", "parallel"):
        short = attend(fmap, q, k, v, causal=True, form=form, chunk_size=4)
        prefix = attend(fmap, *longer, causal=True, form=form, chunk_size=4)[..., :12, :]
        # 12 against 18 tokens: other GEMM shapes, so rounding may differ (tests/reference.py, SHAPE_ULPS)
        assert ulps_of_scale(prefix, short) <= SHAPE_ULPS, form


def test_causal_safety_check_detects_a_sequence_wide_shift() -> None:
    """Control for the test above: a stabilising maximum over the whole sequence (as some peers take) fails it, by
    at least 10^6 × the tolerance the causal forms meet; ours meets that tolerance on the same inputs.

    The later key x̂ = ω_j (the longest projection) maximises log φ_j = ‖ω_j‖²/2, so it raises that maximum."""
    fmap = make("favor+")
    q, k, v = qkv(12)
    longest = fmap.projection[fmap.projection.norm(dim=-1).argmax()]
    later = (longest * D**0.25).expand(1, 2, 1, D)

    def global_shift_prefix(keys: torch.Tensor) -> torch.Tensor:
        log_k = fmap.features(keys, is_query=False)
        kf = torch.exp(log_k - log_k.amax(dim=(-2, -1), keepdim=True))[..., :12, :]
        log_q = fmap.features(q, is_query=True)
        qf = torch.exp(log_q - log_q.amax(-1, keepdim=True))
        weights = (qf @ kf.transpose(-1, -2)).tril()
        return (weights @ v) / (weights.sum(-1, keepdim=True) + 1e-6)

    shifted = global_shift_prefix(torch.cat([k, later], -2))
    assert ulps_of_scale(shifted, global_shift_prefix(k)) >= 1e6 * SHAPE_ULPS  # measured: 2·10^13 ulp
    longer = [torch.cat([x, x[..., :1, :]], -2) for x in (q, v)]
    ours = attend(fmap, longer[0], torch.cat([k, later], -2), longer[1], causal=True, form="recurrent")
    assert ulps_of_scale(ours[..., :12, :], attend(fmap, q, k, v, causal=True, form="recurrent")) <= SHAPE_ULPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MAPS)
def test_large_norms_give_finite_outputs(name: str, dtype: torch.dtype) -> None:
    fmap = make(name, torch.float32)
    q, k, v = qkv(24, dtype=F64)
    norms = torch.logspace(0, 2, 24, dtype=F64).unsqueeze(-1)  # token norms from 1 to 100
    q, k = (x / x.norm(dim=-1, keepdim=True) * norms for x in (q, k))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    for kw in ({"causal": True}, {"causal": True, "form": "recurrent"}, {}, {"chunk_size": 8}):
        out = attend(fmap, q, k, v, **kw)
        assert out.dtype == dtype and torch.isfinite(out).all(), kw


@pytest.mark.parametrize("name", MAPS)
def test_positive_maps_stay_positive_in_bf16(name: str) -> None:
    fmap = make(name, torch.float32)
    if not normalize_for(fmap):
        pytest.skip("signed map")
    g = torch.Generator().manual_seed(3)
    x = (
        torch.randn(40, D, generator=g, dtype=F64)
        * torch.tensor([0.1, 1.0, 10.0, 100.0], dtype=F64).repeat(10)[:, None]
    )

    if getattr(fmap, "log_space", False):
        # log φ: φ = exp(log φ) > 0 exactly when log φ is finite, which is the whole claim. Exponentiating here to
        # compare with fp64 would test the fp64 underflow at e^-745 instead: bf16 rounding moves a shifted log
        # feature by up to ~2.3 nats on these inputs, so one exact feature near e^-744 may turn 0 on some CPUs.
        low_log = fmap.features(x.to(torch.bfloat16), is_query=False)
        assert torch.isfinite(low_log).all()
        return

    def phi(inputs: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return module.features(inputs, is_query=False).double()

    exact_map = make(name, F64)
    exact_map.load_state_dict(fmap.state_dict())  # the same draws and parameters, in fp64
    reference = phi(x, exact_map)
    low = phi(x.to(torch.bfloat16), fmap)
    assert torch.isfinite(low).all()
    if (reference >= 0).all():  # non-negative features: stay so, and stay > 0 where the exact ones are > 0
        assert (low >= 0).all() and (low[reference > 0] > 0).all()
    small = slice(0, 20)  # signed features of a positive kernel (taylor, rebased): check the kernel itself
    kernel = low[small] @ low[small].T
    assert (kernel >= 0).all() and (kernel[(reference[small] @ reference[small].T) > 0] > 0).all()


@pytest.mark.parametrize("name", MAPS)
def test_state_dict_round_trip(name: str) -> None:
    torch.manual_seed(10)
    source = make(name)
    torch.manual_seed(11)
    target = make(name)
    q, k, v = qkv()
    if source.random:  # different draws before loading: the round trip below is what makes them agree
        assert not torch.equal(attend(source, q, k, v), attend(target, q, k, v))
    target.load_state_dict(source.state_dict())
    # bit for bit: the same shapes and the same parameters in one process take the same kernels
    assert torch.equal(attend(source, q, k, v, causal=True), attend(target, q, k, v, causal=True))


@pytest.mark.parametrize("name", [n for n in MAPS if make(n).random])
def test_seed_fixes_the_features(name: str) -> None:
    x = qkv()[0]
    first, second, other = (make(name, seed=s).features(x, is_query=False) for s in (5, 5, 6))
    assert torch.equal(first, second) and not torch.equal(first, other)
    torch.manual_seed(0)
    a = make(name).features(x, is_query=False)
    torch.manual_seed(0)
    assert torch.equal(a, make(name).features(x, is_query=False))  # unseeded maps follow torch.manual_seed


@pytest.mark.parametrize("name", MAPS)
def test_features_gradcheck(name: str) -> None:
    fmap = make(name)
    x = qkv(3)[0][0, 0].clone().requires_grad_(True)  # (3, D)
    assert torch.autograd.gradcheck(lambda t: fmap.features(t, is_query=True), (x,))


@pytest.mark.parametrize("form", ["chunked", "recurrent", "parallel"])
@pytest.mark.parametrize("name", ["favor+", "favor++"])
def test_log_space_attention_gradcheck(name: str, form: str) -> None:
    """Gradients through the core's running-max stabilisation of log-space maps, against finite differences."""
    fmap = feature_maps.create(name, head_dim=4, num_features=6, seed=0).double()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 7, 4, generator=g, dtype=F64).requires_grad_(True) for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda a, b, c: linattn.linear_attention(a, b, c, feature_map=fmap, causal=True, form=form, chunk_size=3),
        (q, k, v),
    )


# ----------------------------------------------------------------------------------------------------------------
# random maps: redraw, options, errors


def test_redraw_in_training_only() -> None:
    fmap, twin = FavorPlusFeatureMap(D, seed=1), FavorPlusFeatureMap(D, seed=1)
    before = fmap.projection.clone()
    fmap.redraw()
    twin.redraw()
    assert not torch.equal(before, fmap.projection)
    assert torch.equal(fmap.projection, twin.projection)  # a seeded map's redraws are reproducible too
    fmap.eval()
    with pytest.raises(LinearAttentionError, match="eval mode"):
        fmap.redraw()
    model = torch.nn.ModuleList([FavorPlusFeatureMap(D), TrigFeatureMap(D), FavorPlusPlusFeatureMap(D).eval()])
    frozen = model[2].projection.clone()
    assert redraw_random_features(model) == 2 and torch.equal(frozen, model[2].projection)


def test_orthogonal_projection_structure() -> None:
    omega = FavorPlusFeatureMap(D, num_features=3 * D, seed=0).projection.double()  # (24, 8): three blocks
    for block in omega.split(D):
        gram = block @ block.T
        assert torch.allclose(gram - torch.diag(torch.diagonal(gram)), torch.zeros_like(gram), atol=1e-5)
    assert not torch.allclose(omega[:D].norm(dim=-1), omega[D : 2 * D].norm(dim=-1))  # chi lengths, not √d


def test_bad_options_raise() -> None:
    with pytest.raises(LinearAttentionError, match="head_dim"):
        feature_maps.create("favor+")
    with pytest.raises(LinearAttentionError, match="num_features"):
        feature_maps.create("favor+", head_dim=D, num_features=0)
    with pytest.raises(LinearAttentionError, match="kernel"):
        TrigFeatureMap(D, kernel="laplace")
    with pytest.raises(LinearAttentionError, match="rho"):
        FavorPlusPlusFeatureMap(D, rho=-1.0)
    with pytest.raises(LinearAttentionError, match="nu"):
        DpfpFeatureMap(D, nu=2 * D)
    with pytest.raises(LinearAttentionError, match="head_dim=8"):
        FavorPlusFeatureMap(D)(torch.randn(3, 4))
    q, k, v = qkv()
    with pytest.raises(LinearAttentionError, match="normalize=True"):
        linattn.linear_attention(q, k, v, feature_map="favor+", normalize=False)
    with pytest.raises(LinearAttentionError, match="signed"):
        linattn.linear_attention(q, k, v, feature_map="trig")
    with pytest.raises(LinearAttentionError, match="overflows"):  # exp(‖x̂‖²/2) beyond fp32: an error, not inf
        linattn.linear_attention(100 * q.float(), k.float(), v.float(), feature_map="trig", normalize=False)


# ----------------------------------------------------------------------------------------------------------------
# polynomial maps: exact kernels


def test_polynomial_kernels_are_exact() -> None:
    q, k, _ = qkv(6)
    q, k = q[0, 0], k[0, 0]  # (6, D)
    s = q @ k.T / math.sqrt(D)
    taylor = TaylorFeatureMap(D)
    assert taylor.output_dim(D) == (D + 1) * (D + 2) // 2
    assert torch.allclose(taylor(q) @ taylor(k).T, 1 + s + s**2 / 2, rtol=1e-12)
    projected = TaylorFeatureMap(D, projection_dim=3, seed=0).double()
    p = projected.projection
    t = (q @ p.T) @ (k @ p.T).T / math.sqrt(D)
    assert projected(q).shape[-1] == 10 and torch.allclose(projected(q) @ projected(k).T, 1 + t + t**2 / 2)
    rebased = RebasedFeatureMap(D)
    qn, kn = (torch.nn.functional.layer_norm(x, (D,), eps=1e-5) for x in (q, k))
    assert torch.allclose(rebased(q) @ rebased(k).T, (qn @ kn.T / math.sqrt(D)) ** 2, rtol=1e-12)
    assert torch.allclose(rebased(1e3 * q), rebased(1e5 * q), rtol=1e-9)  # normalised: scale-invariant (up to eps)
    dpfp = DpfpFeatureMap(D, nu=2)
    r = torch.cat([q.clamp(min=0), (-q).clamp(min=0)], -1)
    assert torch.equal(dpfp(q)[:, 2 * D + 3], r[:, 3] * r[:, 5]) and (dpfp(-q) >= 0).all()


# ----------------------------------------------------------------------------------------------------------------
# random maps: statistics. Fixed seeds; tolerances are multiples of the estimator's standard error.


def _pairs(d: int, scale: float, count: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x, y = (torch.randn(count, d, generator=g, dtype=F64) * scale for _ in range(2))
    return x, y, torch.exp((x * y).sum(-1) / math.sqrt(d))


def _second_moment(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    """E[f(ω,x) f(ω,y))²]/K² for one FAVOR++ feature (a = 0: FAVOR+), in closed form (see the class docstring)."""
    d = x.shape[-1]
    xh, yh = x / d**0.25, y / d**0.25
    w = ((xh + yh) ** 2).sum(-1)
    log_m2 = d * math.log(1 - 4 * a) - d / 2 * math.log(1 - 8 * a) + 2 * (1 - 4 * a) * w / (1 - 8 * a)
    return torch.exp(log_m2 - (xh * xh).sum(-1) - (yh * yh).sum(-1) - 2 * (xh * yh).sum(-1))


def _estimates(make_map, x: torch.Tensor, y: torch.Tensor, seeds: int) -> torch.Tensor:
    """(seeds, pairs) kernel estimates φ(x)·φ(y), one independent draw of projections per seed."""
    rows = []
    for seed in range(seeds):
        fmap = make_map(seed)
        rows.append((fmap(x) * fmap(y)).sum(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("orthogonal", [False, True], ids=["iid", "orthogonal"])
@pytest.mark.parametrize("cls", [FavorPlusFeatureMap, FavorPlusPlusFeatureMap, TrigFeatureMap])
def test_random_features_are_unbiased(cls: type, orthogonal: bool) -> None:
    x, y, exact = _pairs(8, 0.6)
    seeds = 200
    est = _estimates(lambda s: cls(8, num_features=16, orthogonal=orthogonal, seed=s).double(), x, y, seeds)
    stderr = est.std(0) / math.sqrt(seeds)
    if cls is FavorPlusFeatureMap and not orthogonal:  # the exact standard error is known: check it too
        exact_stderr = exact * torch.sqrt((_second_moment(x, y, 0.0) - 1) / 16 / seeds)
        assert torch.allclose(stderr, exact_stderr, rtol=0.5)
    # 4.5 standard errors: a false alarm has probability < 1e-5 per pair for a normal mean
    assert ((est.mean(0) - exact).abs() <= 4.5 * stderr).all()


def test_favor_plus_plus_optimum_is_the_closed_form() -> None:
    x, y, _ = _pairs(16, 0.5)
    fmap = FavorPlusPlusFeatureMap(16, seed=0).double()
    rho = fmap.calibrate(x, y)
    xh, yh = x / 2, y / 2  # x·16^(-1/4)
    assert math.isclose(rho, float(((xh[:, None] + yh[None]) ** 2).sum(-1).mean()) / 16, rel_tol=1e-12)
    best = float(fmap.coef_a)
    # calibrate() optimises over all query/key pairs (i, j): evaluate the closed form on that (8, 8) grid
    grid = (x[:, None], y[None])
    mean_log = {a: float(_second_moment(*grid, a).log().mean()) for a in (best, best - 0.01, best + 0.01, 0.0)}
    assert mean_log[best] == min(mean_log.values()) and best < 0
    plain = FavorPlusFeatureMap(16, seed=0).double()
    zero = FavorPlusPlusFeatureMap(16, seed=0, rho=0.0).double()  # ρ = 0 gives A = 0: FAVOR+ itself
    assert torch.allclose(zero.features(x, is_query=True), plain.features(x, is_query=True), rtol=1e-12)


def test_mean_squared_kernel_error_orderings() -> None:
    """orthogonal FAVOR+ < i.i.d. FAVOR+ (closed form), and FAVOR++ < FAVOR+ on the same inputs and draws."""
    x, y, exact = _pairs(16, 0.4, count=64)  # moderate norms: the squared errors then have light tails
    seeds, m = 100, 32
    plus = _estimates(lambda s: FavorPlusFeatureMap(16, num_features=m, seed=s).double(), x, y, seeds)

    def plus_plus(seed: int) -> FavorPlusPlusFeatureMap:
        fmap = FavorPlusPlusFeatureMap(16, num_features=m, seed=seed).double()
        fmap.calibrate(x, y)
        return fmap

    better = _estimates(plus_plus, x, y, seeds)
    sq_plus = (((plus - exact) / exact) ** 2).mean(-1)  # (seeds,) relative squared error, averaged over pairs
    sq_better = (((better - exact) / exact) ** 2).mean(-1)
    iid_mse = float(((_second_moment(x, y, 0.0) - 1) / m).mean())  # exact expected value for i.i.d. features
    assert float(sq_plus.mean() + 3 * sq_plus.std() / math.sqrt(seeds)) < iid_mse
    diff = sq_plus - sq_better  # paired: same seeds draw the same projections
    assert float(diff.mean() - 3 * diff.std() / math.sqrt(seeds)) > 0


def test_attention_error_falls_as_features_grow() -> None:
    """Relative (Frobenius) error of FAVOR+ attention against exact softmax attention, mean over 6 draws.

    Inputs have N(0, 0.25) entries: the relative variance of one feature is exp(‖x̂ + ŷ‖²) − 1, which for unit
    entries at d = 8 reaches e^12 and makes any m-sweep a study of outliers."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 48, 8, generator=g, dtype=F64) * scale for scale in (0.5, 0.5, 1.0))
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    errors = []
    for m in (8, 32, 128, 512):
        runs = [
            float(
                (
                    linattn.linear_attention(q, k, v, feature_map=FavorPlusFeatureMap(8, num_features=m, seed=s))
                    - exact
                ).norm()
                / exact.norm()
            )
            for s in range(6)
        ]
        errors.append(sum(runs) / len(runs))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 3, errors  # Monte Carlo error ∝ 1/√m: 64× the features, up to 8× less error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_elu_features_and_gradient_over_several_slices(dtype: torch.dtype, layout: str) -> None:
    """elu + 1 on an input of several of the forward's 2^18-element slices and a partial one (the contiguous path
    adds max(x, 0) slice by slice; a transposed input takes the whole-tensor path), against the definition in
    float64: exp(x) for x ≤ 0, x + 1 above. Both sides are one or two roundings of the same value: 1 ulp."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2 * 2**18 // 3 + 5, 2, generator=g, dtype=F64) * 4  # 2^19 + 30 elements
    x = x if layout == "contiguous" else x.transpose(0, 1)
    leaf = x.to(dtype).requires_grad_()
    features = make("elu", dtype)(leaf)
    grad = torch.randn(x.shape, generator=g, dtype=F64)
    features.backward(grad.to(dtype))
    exact = x.to(dtype).to(F64)  # the input as the map saw it
    expected = torch.where(exact > 0, exact + 1, exact.exp())
    assert features.shape == x.shape and features.dtype == dtype
    tolerance = torch.finfo(dtype).eps
    assert torch.allclose(features.to(F64), expected, rtol=tolerance, atol=0)
    expected_grad = grad.to(dtype).to(F64) * torch.where(exact > 0, 1.0, exact.exp())  # d(elu + 1)/dx = min(φ, 1)
    assert leaf.grad is not None
    assert torch.allclose(leaf.grad.to(F64), expected_grad, rtol=2 * tolerance, atol=0)
