"""Log-space feature maps (FAVOR+, FAVOR++ and a map of large log-features) beside the window with every linear
part: each form against a token-by-token float64 definition written here from docs/window.md ("Composed linear
parts", "How the two parts share one scale"), sharing no helper with the library; large log-features in fp32,
continuation, the decoding step, gradients and what stays refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import LinearAttentionError, WindowAttentionState
from linattn.feature_maps import FeatureMap, create

FORMS = ("parallel", "chunked", "recurrent")
KINDS = ("decay", "token-gate", "feature-gate", "delta", "gated-delta", "kda")
DELTA = ("delta", "gated-delta", "kda")


class OffsetLogMap(FeatureMap):
    """A log-space map whose log-features sit near ``offset`` (φ = e^{x·W + offset}): e^{100} overflows fp32, so
    only a form that never forms φ itself stays finite."""

    log_space = True

    def __init__(self, dim: int, features: int, offset: float) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(dim, features, generator=torch.Generator().manual_seed(7)) / 2)
        self.offset = offset

    def output_dim(self, head_dim: int) -> int:
        return int(self.weight.shape[-1])

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return x @ self.weight.to(x.dtype) + self.offset


MAPS = {
    "favor+": lambda: create("favor+", head_dim=6, num_features=9, seed=1).double(),
    "favor++": lambda: create("favor++", head_dim=6, num_features=9, seed=2).double(),
    "offset": lambda: OffsetLogMap(6, 7, 3.0).double(),
}


def definition(q, k, v, fmap, *, window, sinks, update="add", beta=None, log_gate=None, factor=None, keep=None,
               eps=1e-6):
    """Token by token, per batch row and head, in float64, from log φ. The delta rule: unit features (the row's
    scale cancels). Additive: query t at its row maximum c_t, keys at R_t, the running maximum of log φ over the kept
    keys ≤ t; the state moves to each new R by e^{R_old − R_new}, takes token t's decay, then the write of key t − W
    (not a sink, not padding); eps is added in that stored scale (mass form), or the parts meet on
    u_t = max(c_t + R_t, 0) (γ form)."""
    lq_all = fmap.features(q.double(), is_query=True).detach()
    lk_all = fmap.features(k.double(), is_query=False).detach()
    v = v.double()
    *batch, n, _ = q.shape
    scale = q.shape[-1] ** -0.5
    out = torch.zeros(*batch, n, v.shape[-1], dtype=torch.float64)
    for index in [(b, h) for b in range(batch[0]) for h in range(batch[1])]:
        qs, ks, vs, lq, lk = q[index].double(), k[index].double(), v[index], lq_all[index], lk_all[index]
        kept = [True] * n if keep is None else [bool(x) for x in keep[index]]
        memory = torch.zeros(lk.shape[-1], vs.shape[-1], dtype=torch.float64)
        sums = torch.zeros(lk.shape[-1], dtype=torch.float64)
        big_r = -math.inf
        gamma = 1.0 if factor is None else float(factor[index[-1]] if torch.is_tensor(factor) else factor)
        for t in range(n):
            if update == "add" and kept[t] and float(lk[t].max()) > big_r:
                carry = 0.0 if big_r == -math.inf else math.exp(big_r - float(lk[t].max()))
                memory, sums, big_r = memory * carry, sums * carry, float(lk[t].max())
            if log_gate is not None:
                a = torch.exp(log_gate[index][t].double())  # a scalar or one per feature
                memory = (a.unsqueeze(-1) if a.dim() else a) * memory
                sums = a * sums
            j = t - window
            if j >= sinks and kept[j]:
                if update == "delta":
                    unit = torch.exp(lk[j] - lk[j].max())
                    unit = unit / unit.norm()
                    memory = memory + float(beta[index][j]) * torch.outer(unit, vs[j] - memory.T @ unit)
                else:
                    memory = memory + torch.outer(torch.exp(lk[j] - big_r), vs[j])
                    sums = sums + torch.exp(lk[j] - big_r)
            exact = [i for i in range(t + 1) if (i > t - window or i < sinks) and kept[i]]
            scores = torch.stack([scale * qs[t] @ ks[i] for i in exact]) if exact else torch.zeros(0)
            weights = torch.exp(scores - scores.max()) if exact else scores
            soft_num = weights @ vs[exact] if exact else torch.zeros(vs.shape[-1], dtype=torch.float64)
            soft_den = weights.sum()
            average = soft_num / soft_den if exact else soft_num
            qf = torch.exp(lq[t] - lq[t].max())
            if update == "delta":
                out[index][t] = gamma * average + memory.T @ (qf / qf.norm())
                continue
            num, den = memory.T @ qf, qf @ sums
            if factor is None:
                mass = sum((qf @ torch.exp(lk[i] - big_r) for i in exact), torch.tensor(0.0, dtype=torch.float64))
                out[index][t] = (num + mass * average) / (den + mass + eps)
            else:
                both = float(lq[t].max()) + (big_r if big_r > -math.inf else 0.0)
                common = max(both, 0.0)
                lin, win = math.exp(both - common), gamma * math.exp(-common)
                out[index][t] = (lin * num + win * soft_num) / (lin * den + win * soft_den + eps)
    return out


def inputs(b=2, h=2, n=29, d=6, dv=5, seed=0, heads_kv=None, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) * spread
    k = torch.randn(b, heads_kv or h, n, d, generator=gen, dtype=torch.float64) * spread
    v = torch.randn(b, heads_kv or h, n, dv, generator=gen, dtype=torch.float64)
    return q, k, v, gen


def linear_options(kind, shape, gen, features):
    gate = F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 1)
    feature_gate = F.logsigmoid(torch.randn(*shape, features, generator=gen, dtype=torch.float64) + 1)
    beta = torch.rand(shape, generator=gen, dtype=torch.float64) * 1.5
    return {
        "plain": {},
        "decay": {"decay": 0.9},
        "token-gate": {"log_gate": gate},
        "feature-gate": {"log_gate": feature_gate},
        "delta": {"update": "delta", "beta": beta},
        "gated-delta": {"update": "delta", "beta": beta, "log_gate": gate},
        "kda": {"update": "delta", "beta": beta, "log_gate": feature_gate},
    }[kind]


def reference_options(options, shape):
    gate = options.get("log_gate")
    if "decay" in options:
        gate = torch.full(shape, math.log(options["decay"]), dtype=torch.float64)
    return {"update": options.get("update", "add"), "beta": options.get("beta"), "log_gate": gate}


def width(fmap):
    return fmap.features(torch.zeros(1, 6, dtype=torch.float64), is_query=True).shape[-1]


def sliced(options, start, end):
    def part(name, value):
        if not torch.is_tensor(value):
            return value
        return value[..., start:end] if name == "beta" or value.dim() == 3 else value[..., start:end, :]

    return {name: part(name, value) for name, value in options.items()}


@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
@pytest.mark.parametrize("map_name", ["favor+", "favor++", "offset"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window,sinks,n", [(5, 2, 29), (1, 1, 9), (40, 2, 21)], ids=["w5s2", "w1s1", "full-window"])
def test_forms_equal_the_definition(kind, map_name, factor, window, sinks, n):
    q, k, v, gen = inputs(n=n)
    fmap = MAPS[map_name]()
    options = linear_options(kind, q.shape[:-1], gen, width(fmap))
    want = definition(q, k, v, fmap, window=window, sinks=sinks, factor=factor,
                      **reference_options(options, q.shape[:-1]))
    for form in FORMS:
        got = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, window=window, sinks=sinks,
                                       window_factor=factor, form=form, chunk_size=8, **options)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=form)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_from_the_first_token_and_grouped_heads(kind):
    # the first keys masked: R is −inf until a kept key comes, and the state empty before it
    q, k, v, gen = inputs(h=4, n=21, heads_kv=2)
    fmap = MAPS["favor+"]()
    options = linear_options(kind, q.shape[:-1], gen, width(fmap))
    keep = torch.rand(2, 21, generator=gen) > 0.3
    keep[:, :3] = False
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keep4 = keep[:, None, :].expand(2, 4, 21)
    want = definition(q, k4, v4.masked_fill(~keep4.unsqueeze(-1), 0), fmap, window=5, sinks=2, keep=keep4,
                      **reference_options(options, q.shape[:-1]))
    for form in FORMS:
        got = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, window=5, sinks=2, form=form,
                                       chunk_size=8, key_padding_mask=keep, **options)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=form)


@pytest.mark.parametrize("factor", [None, 0.5], ids=["mass", "gamma"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("map_name,spread", [("favor+", 12.0), ("offset", 1.0)], ids=["favor-logs-400", "logs+100"])
def test_large_log_features_stay_finite_in_fp32(kind, map_name, spread, factor):
    # FAVOR+ on inputs ×12: log φ down to about −400 (every φ underflows fp32); the offset map at +100: log φ
    # near 100 (every φ overflows fp32). The fp32 forms against the float64 definition (stored scales).
    q, k, v, gen = inputs(n=37, spread=spread)
    fmap = MAPS[map_name]()
    if map_name == "offset":
        fmap.offset = 100.0
    logs = fmap.features(k, is_query=False)
    assert float(logs.abs().max()) > 80
    options = linear_options(kind, q.shape[:-1], gen, width(fmap))
    want = definition(q, k, v, fmap, window=6, sinks=2, factor=factor, **reference_options(options, q.shape[:-1]))
    fmap32 = fmap.float()
    single = {name: value.float() if torch.is_tensor(value) else value for name, value in options.items()}
    for form in FORMS:
        got = linattn.linear_attention(q.float(), k.float(), v.float(), feature_map=fmap32, causal=True, window=6,
                                       sinks=2, window_factor=factor, form=form, chunk_size=8, **single)
        assert bool(torch.isfinite(got).all()), form
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4, msg=form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_continuation_equals_one_call(kind, form):
    q, k, v, gen = inputs(n=31, spread=3.0)  # log-features spread widely: R rises across the pieces
    fmap = MAPS["favor+"]()
    options = linear_options(kind, q.shape[:-1], gen, width(fmap))
    common = {"feature_map": fmap, "causal": True, "window": 6, "sinks": 2, "chunk_size": 8}
    whole, final = linattn.linear_attention(q, k, v, return_state=True, **common, **options)
    state, pieces = None, []
    for start, end in ((0, 3), (3, 4), (4, 17), (17, 31)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], form=form, initial_state=state,
            return_state=True, **common, **sliced(options, start, end),
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, rtol=0, atol=1e-10)
    assert isinstance(state, WindowAttentionState) and state.num_tokens == 31
    if kind not in DELTA:  # the sums' scale: R over every key seen, at least log φ of each
        assert bool((state.linear.shift >= fmap.features(k, is_query=False).amax((-1, -2)) - 1e-12).all())
        torch.testing.assert_close(state.linear.shift, final.linear.shift, rtol=0, atol=1e-12)
    torch.testing.assert_close(state.linear.kv, final.linear.kv, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_a_plain_window_state_continues_beside_a_decay_and_back(form):
    # one convention for the sums' scale: a decay of rate 1 between two plain hybrid calls changes nothing
    q, k, v, _ = inputs(n=30, spread=2.0)
    common = {"feature_map": MAPS["favor+"](), "causal": True, "window": 5, "sinks": 2, "chunk_size": 8, "form": form}
    whole = linattn.linear_attention(q, k, v, **common)
    first, state = linattn.linear_attention(q[..., :13, :], k[..., :13, :], v[..., :13, :], return_state=True,
                                            **common)
    middle, state = linattn.linear_attention(q[..., 13:22, :], k[..., 13:22, :], v[..., 13:22, :], decay=1.0,
                                             initial_state=state, return_state=True, **common)
    last = linattn.linear_attention(q[..., 22:, :], k[..., 22:, :], v[..., 22:, :], initial_state=state, **common)
    torch.testing.assert_close(torch.cat([first, middle, last], dim=-2), whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
@pytest.mark.parametrize("kind", ("plain", *KINDS))
@pytest.mark.parametrize("prompt", [2, 9], ids=["prompt-inside-the-sinks-and-window", "prompt-9"])
def test_the_decoding_step_equals_the_chunked_form(kind, prompt, factor):
    from linattn.decode import ComposedDecodeStep, lean_step

    q, k, v, gen = inputs(h=4, n=20, heads_kv=2, spread=2.0)
    fmap = MAPS["favor+"]()
    options = linear_options(kind, q.shape[:-1], gen, width(fmap))
    keep = torch.rand(2, 20, generator=gen) > 0.2
    common = {"window": 5, "sinks": 3, "window_factor": factor}
    whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, key_padding_mask=keep, **common,
                                     **options)
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], feature_map=fmap,
                                        causal=True, key_padding_mask=keep[:, :prompt], return_state=True, **common,
                                        **sliced(options, 0, prompt))
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    step = lean_step(fmap, state, {**common, **fixed}, kv_heads=2)
    assert isinstance(step, ComposedDecodeStep)
    outs = []
    for t in range(prompt, 20):
        beta = options["beta"][..., t] if "beta" in options else None
        gate = options.get("log_gate")
        gate = None if gate is None else gate[..., t] if gate.dim() == 3 else gate[..., t, :]
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1],
                         beta=beta, log_decay=gate))
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)
    _, final = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, key_padding_mask=keep,
                                        return_state=True, **common, **options)
    stepped = step.state()
    torch.testing.assert_close(stepped.linear.kv, final.linear.kv, rtol=0, atol=1e-10)
    if kind not in DELTA:
        torch.testing.assert_close(stepped.linear.shift, final.linear.shift, rtol=0, atol=1e-12)


@pytest.mark.parametrize("factor", [None, 0.5], ids=["mass", "gamma"])
@pytest.mark.parametrize("kind", ("decay", "feature-gate", "gated-delta"))
def test_the_decoding_step_in_fp32_with_log_features_near_100(kind, factor):
    from linattn.decode import lean_step

    q, k, v, gen = inputs(n=24)
    fmap = OffsetLogMap(6, 7, 100.0)
    options = {n: x.float() if torch.is_tensor(x) else x for n, x in linear_options(kind, q.shape[:-1], gen, 7).items()}
    q, k, v = q.float(), k.float(), v.float()
    common = {"window": 4, "sinks": 1, "window_factor": factor}
    whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, **common, **options)
    _, state = linattn.linear_attention(q[..., :6, :], k[..., :6, :], v[..., :6, :], feature_map=fmap, causal=True,
                                        return_state=True, **common, **sliced(options, 0, 6))
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    step = lean_step(fmap, state, {**common, **fixed}, kv_heads=2)
    outs = []
    for t in range(6, 24):
        gate = options.get("log_gate")
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                         beta=options["beta"][..., t] if "beta" in options else None,
                         log_decay=None if gate is None else gate[..., t] if gate.dim() == 3 else gate[..., t, :]))
    got = torch.cat(outs, dim=-2)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, whole[..., 6:, :], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ("decay", "feature-gate", "kda"))
def test_gradients(kind):
    q, k, v, gen = inputs(b=1, h=1, n=11, d=6, dv=2)
    fmap = create("favor+", head_dim=6, num_features=4, seed=3).double()
    options = linear_options(kind, q.shape[:-1], gen, 4)
    tensors = [x.requires_grad_() for x in (q, k, v)]
    extra = {name: value.requires_grad_() for name, value in options.items() if torch.is_tensor(value)}

    def run(q, k, v, *values):
        given = dict(options, **dict(zip(extra, values, strict=True)))
        return linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, window=3, sinks=1, chunk_size=4,
                                        **given)

    assert torch.autograd.gradcheck(run, (*tensors, *extra.values()), atol=1e-7)


def test_what_stays_refused_says_why():
    q, k, v, gen = inputs(n=9)
    fmap = MAPS["favor+"]()
    # the additive part's log-scale cancels only in the normalised ratio
    with pytest.raises(LinearAttentionError, match="log space.*normalize=True"):
        linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, window=4, decay=0.9, normalize=False)
    # the composed routes are causal recurrences, whatever the map
    with pytest.raises(LinearAttentionError, match="causal=True"):
        linattn.linear_attention(q, k, v, feature_map=fmap, window=4, decay=0.9)
    # (the sparse cache takes log-space maps beside every linear part: tests/test_sparse_log_space.py)
