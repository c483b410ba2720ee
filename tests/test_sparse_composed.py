"""The sparse exact cache beside every linear part (scalar decay, per-token gate, per-feature gate, delta rule,
gated delta rule, KDA): every form against a token-by-token float64 definition written here from the equations
of docs/sparse_cache.md ("Beside a decayed, gated or delta-rule state"), sharing no helper with the library — the
boundaries, the scores, the choice, the entry times, the linear recurrence and the combiner are all redone below.
Also: cache size 0 is the composed op, a full window is causal softmax, continuation, gradients, state size,
fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import SparseCache, WindowAttentionState

NEVER = 1 << 60
FORMS = ("parallel", "chunked", "recurrent")
KINDS = ("decay", "token-gate", "feature-gate", "delta", "gated-delta", "kda")
DELTA_KINDS = ("delta", "gated-delta", "kda")


def elu1(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def definition(q, k, v, *, window, sinks, size, block, score, update="add", beta=None, log_gate=None, factor=None,
               keep=None, oracle=None, linear_weight=1.0, eps=1e-6):
    """Token by token, per (batch, head) row, float64. Before step t, if t is a boundary (t = b·B, b ≥ 1), the
    candidates (the cache and the pairs t − W … t − W + B − 1, neither sinks nor padding) are scored against the
    state as query t − 1 read it and the ``size`` best kept (ties: the newer); a cached pair dropped there enters
    at t, a pair never cached at j + W. Step t: the state decays by a_t, then the pairs entering at t write in
    ascending position (additive φ(k)vᵀ; delta β_j·k̂(v − Sᵀk̂)ᵀ). Exact: window, sinks, the block's cached pairs
    j ≤ t − W (softmax). Combined: shared normaliser (additive) or γ·average + λ·read-out (delta)."""
    q, k, v = q.double(), k.double(), v.double()
    *batch, n, d = q.shape
    scale = d ** -0.5
    out = torch.zeros(*batch, n, v.shape[-1], dtype=torch.float64)
    delta = update == "delta"
    for index in [tuple(int(i) for i in idx) for idx in torch.cartesian_prod(*(torch.arange(b) for b in batch))]:
        qs, ks, vs = q[index], k[index], v[index]
        fq, fk = elu1(qs), elu1(ks)
        lq, lk = (unit(fq), unit(fk)) if delta else (fq, fk)
        kept_token = [True] * n if keep is None else [bool(x) for x in keep[index]]
        head = index[-1]
        budget = size[head] if isinstance(size, tuple) else size
        lam = linear_weight[head] if isinstance(linear_weight, tuple) else linear_weight
        gamma = 1.0 if factor is None else float(factor[head] if torch.is_tensor(factor) else factor)
        memory = torch.zeros(fk.shape[-1], vs.shape[-1], dtype=torch.float64)
        sums = torch.zeros(fk.shape[-1], dtype=torch.float64)
        entry = [j + window if j >= sinks and kept_token[j] else NEVER for j in range(n)]
        cache: list[int] = []
        for t in range(n):
            if t and t % block == 0:
                leaving = [j for j in range(max(t - window, 0), t - window + block) if j >= sinks and kept_token[j]]
                candidates = sorted(set(cache) | set(leaving))
                scores = {}
                for c in candidates:
                    if score == "recall" and delta:
                        scores[c] = float((vs[c] - memory.T @ lk[c]).norm())
                    elif score == "recall":
                        den = float(lk[c] @ sums)
                        recalled = (memory.T @ lk[c]) / den if den > 0 else torch.zeros_like(vs[c])
                        scores[c] = float((vs[c] - recalled).norm())
                    elif score == "attention":
                        total = 0.0
                        for u in range(t - block, t):
                            seen = [j for j in candidates if j <= u]
                            if c in seen:
                                weights = torch.softmax(torch.stack([qs[u] @ ks[j] * scale for j in seen]), 0)
                                total += float(weights[seen.index(c)])
                        scores[c] = total
                    else:
                        scores[c] = 1.0 if bool(oracle[c]) else 0.0
                chosen = sorted(candidates, key=lambda c: (scores[c], c), reverse=True)[:budget]
                for c in cache:
                    if c not in chosen:
                        entry[c] = t
                for c in chosen:
                    entry[c] = NEVER
                cache = sorted(chosen)
            if log_gate is not None:
                a = torch.exp(log_gate[index][t].double())
                memory = (a.unsqueeze(-1) if a.dim() else a) * memory
                sums = a * sums
            for j in sorted(j for j in range(n) if entry[j] == t):
                if delta:
                    memory = memory + float(beta[index][j]) * torch.outer(lk[j], vs[j] - memory.T @ lk[j])
                else:
                    memory = memory + torch.outer(lk[j], vs[j])
                    sums = sums + lk[j]
            exact = [i for i in range(t + 1) if kept_token[i] and (i > t - window or i < sinks or i in cache)]
            logits = torch.stack([scale * qs[t] @ ks[i] for i in exact]) if exact else torch.zeros(0)
            weights = torch.exp(logits - logits.max()) if exact else logits
            soft_num = weights @ vs[exact] if exact else torch.zeros(vs.shape[-1], dtype=torch.float64)
            soft_den = weights.sum()
            average = soft_num / soft_den if exact else soft_num
            if delta:
                out[index][t] = gamma * average + lam * (memory.T @ lq[t])
                continue
            num, den = lam * (memory.T @ lq[t]), lam * (lq[t] @ sums)
            if factor is None:
                mass = sum((fq[t] @ fk[i] for i in exact), torch.tensor(0.0, dtype=torch.float64))
                out[index][t] = (num + mass * average) / (den + mass + eps)
            else:
                out[index][t] = (num + gamma * soft_num) / (den + gamma * soft_den + eps)
    return out


def inputs(b=2, h=2, n=29, d=6, dv=5, seed=0, heads_kv=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, heads_kv or h, n, d, generator=gen, dtype=torch.float64) * 1.5
    v = torch.randn(b, heads_kv or h, n, dv, generator=gen, dtype=torch.float64)
    return q, k, v, gen


def linear_options(kind, q, gen, features=6):
    shape = q.shape[:-1]
    if kind == "decay":
        return {"decay": 0.9}
    if kind == "token-gate":
        return {"log_gate": F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 1)}
    if kind == "feature-gate":
        return {"log_gate": F.logsigmoid(torch.randn(*shape, features, generator=gen, dtype=torch.float64) + 1)}
    beta = torch.rand(shape, generator=gen, dtype=torch.float64) * 1.5
    if kind == "delta":
        return {"update": "delta", "beta": beta}
    if kind == "kda":
        return {"update": "delta", "beta": beta,
                "log_gate": F.logsigmoid(torch.randn(*shape, features, generator=gen, dtype=torch.float64) + 1)}
    return {"update": "delta", "beta": beta,
            "log_gate": F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 1)}


def reference_options(options, q):
    gate = options.get("log_gate")
    if "decay" in options:
        gate = torch.full(q.shape[:-1], float(torch.log(torch.tensor(options["decay"], dtype=torch.float64))),
                          dtype=torch.float64)
    return {"update": options.get("update", "add"), "beta": options.get("beta"), "log_gate": gate}


def sliced(options, start, end):
    """The per-token options of tokens start … end − 1."""
    return {name: (value[..., start:end] if name == "beta" or (name == "log_gate" and value.dim() == 3)
                   else value[..., start:end, :] if name == "log_gate" else value)
            for name, value in options.items()}


ORACLE = (torch.arange(64) % 3 == 1) | (torch.arange(64) == 20)


def cache_for(score, size=3, block=4, **extra):
    return SparseCache(size=size, score=score, block=block, keep=ORACLE if score == "oracle" else None, **extra)


@pytest.mark.parametrize("score", ["recall", "attention", "oracle"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_forms_equal_the_definition(kind, form, score):
    q, k, v, gen = inputs()
    options = linear_options(kind, q, gen)
    got = linattn.linear_attention(q, k, v, causal=True, window=5, sinks=2, sparse_cache=cache_for(score),
                                   form=form, chunk_size=8, **options)
    want = definition(q, k, v, window=5, sinks=2, size=3, block=4, score=score, oracle=ORACLE,
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("kind", KINDS)
def test_per_head_sizes_factor_padding_and_grouped_heads(kind, form):
    q, k, v, gen = inputs(h=4, n=27, heads_kv=2, seed=1)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 27, generator=gen) > 0.25
    factor = torch.tensor([0.5, 2.0, 1.0, 0.7], dtype=torch.float64)
    cache = SparseCache(size=(0, 2, 3, 5), score="recall", block=3, linear_weight=(1.0, 0.5, 0.0, 2.0))
    got = linattn.linear_attention(q, k, v, causal=True, window=4, sinks=1, sparse_cache=cache, form=form,
                                   chunk_size=8, key_padding_mask=keep, window_factor=factor, **options)
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keep4 = keep[:, None, :].expand(2, 4, 27)
    want = definition(q, k4, v4.masked_fill(~keep4.unsqueeze(-1), 0), window=4, sinks=1, size=(0, 2, 3, 5),
                      block=3, score="recall", keep=keep4, factor=factor, linear_weight=(1.0, 0.5, 0.0, 2.0),
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_no_cache_is_the_composed_op(kind, form):
    q, k, v, gen = inputs(n=23)
    options = linear_options(kind, q, gen)
    got = linattn.linear_attention(q, k, v, causal=True, window=4, sinks=2, sparse_cache=SparseCache(size=0, block=4),
                                   form=form, chunk_size=8, **options)
    want = linattn.linear_attention(q, k, v, causal=True, window=4, sinks=2, form=form, chunk_size=8, **options)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_over_the_whole_sequence_is_causal_softmax(kind):
    q, k, v, gen = inputs(n=23)
    options = linear_options(kind, q, gen)
    got = linattn.linear_attention(q, k, v, causal=True, window=23, sparse_cache=SparseCache(size=4, block=8),
                                   window_factor=1.0, **options)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(23, 23, dtype=torch.bool).tril())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 if kind in DELTA_KINDS else 1e-5)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("form", ["parallel", "chunked"])
@pytest.mark.parametrize("kind", KINDS)
def test_continuation_equals_one_call(kind, form, score):
    q, k, v, gen = inputs(n=31)
    options = linear_options(kind, q, gen)
    cache = cache_for(score, size=3, block=4)
    whole = linattn.linear_attention(q, k, v, causal=True, window=6, sinks=2, sparse_cache=cache, chunk_size=8,
                                     **options)
    state, pieces = None, []
    for start, end in ((0, 3), (3, 4), (4, 17), (17, 31)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True, window=6, sinks=2,
            sparse_cache=cache, chunk_size=8, form=form, initial_state=state, return_state=True,
            **sliced(options, start, end),
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, rtol=0, atol=1e-10)
    assert isinstance(state, WindowAttentionState) and state.num_tokens == 31 and state.cache is not None
    assert (state.cache.packed_betas is not None) == (kind in DELTA_KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_state_bytes_do_not_grow_with_the_sequence(kind):
    sizes = []
    for n in (40, 200):
        q, k, v, gen = inputs(n=n)
        options = linear_options(kind, q, gen)
        _, state = linattn.linear_attention(q, k, v, causal=True, window=6, sinks=2, return_state=True,
                                            sparse_cache=SparseCache(size=4, block=4), **options)
        cache = state.cache
        tensors = [state.linear.kv, state.keys, state.values, state.keep, state.sink_keys, state.sink_values,
                   cache.packed_positions, cache.packed_keys, cache.packed_values, cache.queries]
        tensors += [x for x in (state.betas, cache.packed_betas) if x is not None]
        sizes.append(sum(t.numel() * t.element_size() for t in tensors))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("kind", KINDS)
def test_gradients(kind):
    q, k, v, gen = inputs(b=1, h=1, n=11, d=3, dv=2)
    options = linear_options(kind, q, gen, features=3)
    tensors = [x.requires_grad_() for x in (q, k, v)]
    extra = {name: value.requires_grad_() for name, value in options.items() if isinstance(value, torch.Tensor)}

    def run(q, k, v, *values):
        given = dict(options, **dict(zip(extra, values, strict=True)))
        return linattn.linear_attention(q, k, v, causal=True, window=3, sinks=1, chunk_size=4, form="chunked",
                                        sparse_cache=SparseCache(size=2, block=2), **given)

    # fast mode (random directions) keeps the per-feature gates' many inputs quick
    assert torch.autograd.gradcheck(run, (*tensors, *extra.values()), atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("sizes", [(0, 8), (0, 3)])
def test_gradients_of_heads_apart(sizes, monkeypatch):
    """Gradients through the routes that run heads apart (each head's inputs copied a head at a time): a first call
    that one head keeps whole and the other not at all (the kept route), and one whose keeping head evicts (its
    first whole blocks kept, the rest split)."""
    q, k, v, gen = inputs(b=1, h=2, n=11, d=3, dv=2)
    options = linear_options("gated-delta", q, gen, features=3)
    kept, apart = _route_calls(monkeypatch, "with_kept_pairs"), _route_calls(monkeypatch, "_heads_apart")
    tensors = [x.requires_grad_() for x in (q, k, v)]
    extra = {name: value.requires_grad_() for name, value in options.items() if isinstance(value, torch.Tensor)}

    def run(q, k, v, *values):
        given = dict(options, **dict(zip(extra, values, strict=True)))
        return linattn.linear_attention(q, k, v, causal=True, window=3, sinks=1, chunk_size=4, form="chunked",
                                        sparse_cache=SparseCache(size=sizes, block=2), **given)

    run(*tensors, *extra.values())
    assert kept == [1] and apart == ([] if sizes[1] == 8 else [1])
    assert torch.autograd.gradcheck(run, (*tensors, *extra.values()), atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("kind", ["feature-gate", "gated-delta"])
def test_fp32_within_the_float64_definition(kind):
    q, k, v, gen = inputs(n=70)
    options = linear_options(kind, q, gen)
    cache = SparseCache(size=4, block=8)
    got = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, window=9, sinks=2,
                                   sparse_cache=cache, **{n: (x.float() if torch.is_tensor(x) else x)
                                                          for n, x in options.items()})
    want = definition(q, k, v, window=9, sinks=2, size=4, block=8, score="recall", **reference_options(options, q))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_what_is_still_refused():
    q, k, v, gen = inputs(n=9)
    options = linear_options("gated-delta", q, gen)
    with pytest.raises(linattn.LinearAttentionError, match="causal"):
        linattn.linear_attention(q, k, v, window=4, sparse_cache=2, decay=0.9)
    _, state = linattn.linear_attention(q, k, v, causal=True, window=4, sparse_cache=2, decay=0.9, return_state=True)
    with pytest.raises(linattn.LinearAttentionError, match="update"):  # an additive state continued by the delta rule
        linattn.linear_attention(q, k, v, causal=True, window=4, sparse_cache=2, initial_state=state, **options)


@pytest.mark.parametrize("score", ["recall", "attention", "oracle"])
@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_decoding_step_equals_the_chunked_form(kind, factor, score):
    from linattn.decode import SparseComposedDecodeStep, lean_step

    q, k, v, gen = inputs(h=4, n=26, heads_kv=2)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 26, generator=gen) > 0.2
    cache = cache_for(score, size=(1, 3, 2, 4), block=3, linear_weight=(1.0, 0.5, 1.0, 0.0))
    common = {"window": 5, "sinks": 2, "window_factor": factor, "sparse_cache": cache}
    whole = linattn.linear_attention(q, k, v, causal=True, key_padding_mask=keep, chunk_size=8, **common, **options)
    prompt = 7
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], causal=True,
                                        key_padding_mask=keep[:, :prompt], return_state=True, **common,
                                        **sliced(options, 0, prompt))
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    step = lean_step(linattn.feature_maps.create("elu", head_dim=6), state, {**common, **fixed}, kv_heads=2)
    assert isinstance(step, SparseComposedDecodeStep)
    outs = []
    for t in range(prompt, 26):
        token = sliced(options, t, t + 1)
        gate = token.get("log_gate")
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1],
                         beta=token["beta"][..., 0] if "beta" in token else None,
                         log_decay=None if gate is None else gate[..., 0] if gate.dim() == 3 else gate[..., 0, :]))
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)
    _, final = linattn.linear_attention(q, k, v, causal=True, key_padding_mask=keep, return_state=True, **common,
                                        **options)
    got = step.state()
    torch.testing.assert_close(got.linear.kv, final.linear.kv, rtol=0, atol=1e-10)
    assert torch.equal(got.cache.packed_positions, final.cache.packed_positions)
    torch.testing.assert_close(got.cache.packed_keys, final.cache.packed_keys, rtol=0, atol=0)
    if kind in DELTA_KINDS:
        torch.testing.assert_close(got.cache.packed_betas, final.cache.packed_betas, rtol=0, atol=0)
        torch.testing.assert_close(got.betas, final.betas, rtol=0, atol=0)
    # a state the step hands back continues through linear_attention as the prefill's does
    at = 20
    again = lean_step(linattn.feature_maps.create("elu", head_dim=6), state, {**common, **fixed}, kv_heads=2)
    for t in range(prompt, at):
        token = sliced(options, t, t + 1)
        gate = token.get("log_gate")
        again(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1],
              beta=token["beta"][..., 0] if "beta" in token else None,
              log_decay=None if gate is None else gate[..., 0] if gate.dim() == 3 else gate[..., 0, :])
    rest = linattn.linear_attention(q[..., at:, :], k[..., at:, :], v[..., at:, :], causal=True, chunk_size=4,
                                    key_padding_mask=keep[:, at:], initial_state=again.state(), **common,
                                    **sliced(options, at, 26))
    torch.testing.assert_close(rest, whole[..., at:, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("kind", ["decay", "kda"])
def test_the_decoding_step_takes_a_map_per_head(kind, factor):
    """A map with its own parameters per head (Hedgehog with num_heads=H, as a linearized model's) reads each
    row's head in the step as in the op: the step equals the chunked form, the additive and the delta family."""
    from linattn.decode import lean_step
    from linattn.feature_maps import create

    q, k, v, gen = inputs(h=4, n=26, heads_kv=2)
    fmap = create("hedgehog", head_dim=6, num_heads=4).double()
    with torch.no_grad():
        for param in fmap.parameters():  # heads that differ: a step mixing them up shows
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
    options = linear_options(kind, q, gen, features=fmap.output_dim(6))
    common = {"window": 5, "sinks": 2, "window_factor": factor,
              "sparse_cache": SparseCache(size=(1, 3, 2, 4), block=3)}
    whole = linattn.linear_attention(q, k, v, feature_map=fmap, causal=True, chunk_size=8, **common, **options)
    prompt = 7
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], feature_map=fmap,
                                        causal=True, return_state=True, **common, **sliced(options, 0, prompt))
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    step = lean_step(fmap, state, {**common, **fixed}, kv_heads=2)
    outs = []
    with torch.no_grad():
        for t in range(prompt, 26):
            token = sliced(options, t, t + 1)
            outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                             beta=token["beta"][..., 0] if "beta" in token else None,
                             log_decay=token["log_gate"][..., 0, :] if "log_gate" in token else None))
        torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("options", [{"update": "delta", "gate": "token"}, {"gate": "feature", "decay": "retnet"},
                                     {"update": "delta", "gate": "feature"}],
                         ids=["gated-delta", "feature-gate+retnet", "kda"])
def test_the_layer_decodes_with_the_sparse_composed_step(options):
    from linattn.decode import SparseComposedDecodeStep
    from linattn.nn import LinearAttention

    torch.manual_seed(0)
    layer = LinearAttention(16, 2, causal=True, window=4, sinks=1, sparse_cache=SparseCache(size=2, block=2),
                            **options).double()
    x = torch.randn(2, 15, 16, dtype=torch.float64)
    whole = layer(x)
    out, state = layer(x[:, :6], return_state=True)
    decoder = layer.decoder(state)
    assert isinstance(decoder.step, SparseComposedDecodeStep)
    outs = [out] + [decoder(x[:, t : t + 1]) for t in range(6, 15)]
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["feature-gate", "kda"])
def test_continuation_with_per_head_sizes_padding_and_the_oracle(kind):
    q, k, v, gen = inputs(h=3, n=30, seed=2)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 30, generator=gen) > 0.25
    cache = SparseCache(size=(1, 4, 2), score="oracle", block=3, keep=ORACLE)
    common = {"causal": True, "window": 5, "sinks": 1, "sparse_cache": cache, "chunk_size": 4}
    whole = linattn.linear_attention(q, k, v, key_padding_mask=keep, **common, **options)
    state, pieces = None, []
    for start, end in ((0, 7), (7, 8), (8, 30)):
        out, state = linattn.linear_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :],
                                              key_padding_mask=keep[:, start:end], initial_state=state,
                                              return_state=True, **common, **sliced(options, start, end))
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, -2), whole, rtol=0, atol=1e-10)


def test_the_decoding_step_selects_beams():
    from linattn.decode import lean_step

    q, k, v, gen = inputs(b=3, n=16)
    options = linear_options("gated-delta", q, gen)
    common = {"window": 4, "sinks": 1, "sparse_cache": SparseCache(size=2, block=2)}
    _, state = linattn.linear_attention(q[..., :9, :], k[..., :9, :], v[..., :9, :], causal=True, return_state=True,
                                        **common, **sliced(options, 0, 9))
    fmap = linattn.feature_maps.create("elu", head_dim=6)
    step = lean_step(fmap, state, {**common, "update": "delta", "log_gate": "with each token"}, kv_heads=2)
    assert step is not None
    index = torch.tensor([2, 0])
    picked = step.index_select(0, index)
    fresh = lean_step(fmap, state.index_select(0, index), {**common, "update": "delta", "log_gate": "with each token"},
                      kv_heads=2)
    assert picked is not None and fresh is not None
    for t in range(9, 16):
        token = sliced(options, t, t + 1)
        args = (q[index][..., t : t + 1, :], k[index][..., t : t + 1, :], v[index][..., t : t + 1, :])
        extra = {"beta": token["beta"][index][..., 0], "log_decay": token["log_gate"][index][..., 0]}
        torch.testing.assert_close(picked(*args, **extra), fresh(*args, **extra), rtol=0, atol=0)


@pytest.mark.parametrize("gate", ["token", "feature"], ids=["gated-delta", "kda"])
def test_a_linearized_model_generates_with_the_step(gate):
    """A tiny Llama whose attention is the gated delta rule (or KDA) beside the window and the cache: generation
    through the transformers cache (the lean step from the prefill's state) equals recomputing every token."""
    pytest.importorskip("transformers")
    import linattn.hf as hf
    from linattn.decode import SparseComposedDecodeStep
    from linattn.nn import KeyGates
    from test_decoder_generate import tiny_llama
    from test_key_gates import _randomised

    gates = [_randomised(KeyGates(2, 8, gate=gate, num_features=8 if gate == "feature" else None, readout=True),
                         5 + i) for i in range(2)]
    model = hf.linearize(tiny_llama(), "elu", gates=gates, update="delta", window=16, sinks=2,
                         sparse_cache=SparseCache(size=4, block=8))
    ids = torch.randint(1, 60, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
        recomputed = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert all(isinstance(layer.stepper, SparseComposedDecodeStep) for layer in cached.past_key_values.layers)
    assert torch.equal(cached.sequences, recomputed.sequences)
    for ours, full in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(ours, full, rtol=1e-4, atol=1e-4)


def _route_calls(monkeypatch, name):
    """Counts the calls of ``linattn._dispatch.<name>``: "with_kept_pairs" (the route of exact/forms/sparse_kept.py)
    or "_heads_apart" (exact/forms/sparse_heads.py)."""
    import linattn._dispatch as dispatch

    calls = []
    taken = getattr(dispatch, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return taken(*args, **kwargs)

    monkeypatch.setattr(dispatch, name, counted)
    return calls


def _states_equal(got, want, atol):
    """Every tensor of two window states with caches: positions and counts exactly, numbers to ``atol``."""
    assert got.num_tokens == want.num_tokens
    assert torch.equal(got.cache.sizes, want.cache.sizes)
    assert torch.equal(got.cache.packed_positions, want.cache.packed_positions)
    pairs = [(got.linear.kv, want.linear.kv), (got.keys, want.keys), (got.values, want.values),
             (got.sink_keys, want.sink_keys), (got.cache.packed_keys, want.cache.packed_keys),
             (got.cache.packed_values, want.cache.packed_values), (got.cache.queries, want.cache.queries),
             (got.cache.packed_betas, want.cache.packed_betas), (got.betas, want.betas)]
    for x, y in pairs:
        torch.testing.assert_close(x, y, rtol=0, atol=atol)
    assert torch.equal(got.keep, want.keep) and torch.equal(got.sink_keep, want.sink_keep)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("factor", [None, "per-head"])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_heads_that_keep_every_pair_or_none(kind, factor, score, monkeypatch):
    """A first call in which each head's budget is 0 or holds every pair (29 tokens, window 5, 2 sinks, block 4:
    the last boundary, 28, has the candidates 2 … 26) runs the composed route and causal softmax: the
    definition's outputs, the general form's state (every field), and a continuation past the budget (head 1 then
    evicts) equal to the definition over the whole sequence."""
    q, k, v, gen = inputs(h=4, n=45, heads_kv=2, seed=2)
    options = linear_options(kind, q, gen)
    sizes = (0, 25, 0, 40)  # 25: exactly the pairs of 29 tokens
    gamma = torch.tensor([0.5, 2.0, 1.0, 0.7], dtype=torch.float64) if factor else None
    cache = SparseCache(size=sizes, score=score, block=4)
    common = {"causal": True, "window": 5, "sinks": 2, "sparse_cache": cache, "window_factor": gamma,
              "return_state": True}
    calls = _route_calls(monkeypatch, "with_kept_pairs")
    n = 29
    first = {name: (x[..., :n, :] if name == "log_gate" and x.dim() == 4 else x[..., :n]) if torch.is_tensor(x)
             else x for name, x in options.items()}
    out, state = linattn.linear_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], form="chunked",
                                          chunk_size=8, **common, **first)
    assert calls == [1]
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = definition(q, k4, v4, window=5, sinks=2, size=sizes, block=4, score=score, factor=gamma,
                      **reference_options(options, q))
    torch.testing.assert_close(out, want[..., :n, :], rtol=0, atol=1e-10)
    _, general = linattn.linear_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], form="parallel", **common,
                                          **first)
    assert calls == [1]  # the definition's form never takes it
    _states_equal(state, general, atol=1e-12)
    rest = {name: (x[..., n:, :] if name == "log_gate" and x.dim() == 4 else x[..., n:]) if torch.is_tensor(x)
            else x for name, x in options.items()}
    more, _ = linattn.linear_attention(q[..., n:, :], k[..., n:, :], v[..., n:, :], form="chunked", chunk_size=8,
                                       initial_state=state, **common, **rest)
    torch.testing.assert_close(more, want[..., n:, :], rtol=0, atol=1e-10)
    assert calls == [1]  # a continuation is the general form's


@pytest.mark.parametrize("sizes", [(0, 25, 0, 40), (25, 30, 25, 40)])
def test_the_kept_route_runs_the_composed_route_on_heads_without_pairs(sizes, monkeypatch):
    """A first call that every head keeps whole or not at all (29 tokens, window 5, 2 sinks, block 4): the composed
    route runs the heads without pairs alone (where every head keeps pairs, every head once, their rows then
    replaced), and the outputs and every field of the state are the definition's and the general form's."""
    import linattn._dispatch as dispatch

    q, k, v, gen = inputs(h=4, n=29, heads_kv=2, seed=5)
    options = linear_options("gated-delta", q, gen)
    heads = []
    composed = dispatch.run_composed

    def counted(job, *args, **kwargs):
        heads.append(job.q.shape[-3])
        return composed(job, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run_composed", counted)
    common = {"causal": True, "window": 5, "sinks": 2, "sparse_cache": SparseCache(size=sizes, block=4),
              "return_state": True}
    out, state = linattn.linear_attention(q, k, v, form="chunked", chunk_size=8, **common, **options)
    assert heads == [sum(1 for size in sizes if size == 0) or 4]
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = definition(q, k4, v4, window=5, sinks=2, size=sizes, block=4, score="recall",
                      **reference_options(options, q))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    _, general = linattn.linear_attention(q, k, v, form="parallel", **common, **options)
    _states_equal(state, general, atol=1e-12)


def test_a_head_one_pair_short_runs_the_general_form(monkeypatch):
    """Where a head's budget is one pair short of the call's (it would evict once), the general form runs, and
    the result is still the definition's. With a head that keeps none, the first 28 tokens (7 whole blocks, whose
    21 pairs the budget holds) take the kept route, the last one the general form from their state."""
    q, k, v, gen = inputs(h=2, n=29, seed=3)
    options = linear_options("gated-delta", q, gen)
    kept, apart = _route_calls(monkeypatch, "with_kept_pairs"), _route_calls(monkeypatch, "_heads_apart")
    got = linattn.linear_attention(q, k, v, causal=True, window=5, sinks=2, form="chunked", chunk_size=8,
                                   sparse_cache=SparseCache(size=(0, 24), block=4), **options)
    assert kept == [1] and apart == [1]
    want = definition(q, k, v, window=5, sinks=2, size=(0, 24), block=4, score="recall",
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    got = linattn.linear_attention(q, k, v, causal=True, window=5, sinks=2, form="chunked", chunk_size=8,
                                   sparse_cache=SparseCache(size=(23, 24), block=4), **options)
    assert kept == [1] and apart == [1]  # every head keeps pairs, one evicts: the sparse form, whole
    want = definition(q, k, v, window=5, sinks=2, size=(23, 24), block=4, score="recall",
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_a_long_first_call_keeps_its_first_blocks_whole(kind, score, monkeypatch):
    """A first call longer than the budgets hold (45 tokens, block 4, budgets (0, 13, 0, 25) of 4 heads): its
    first whole blocks over which every head keeps every pair or none (20 tokens: their last boundary, 16, has the
    13 candidates 2 … 14) run the kept route, the rest the split route from their state; outputs and every field
    of the state equal the definition's form over the whole call."""
    q, k, v, gen = inputs(h=4, n=45, heads_kv=2, seed=4)
    options = linear_options(kind, q, gen)
    sizes = (0, 13, 0, 25)
    common = {"causal": True, "window": 5, "sinks": 2, "return_state": True,
              "sparse_cache": SparseCache(size=sizes, score=score, block=4)}
    kept, apart = _route_calls(monkeypatch, "with_kept_pairs"), _route_calls(monkeypatch, "_heads_apart")
    seen = []
    import linattn._dispatch as dispatch

    real = dispatch._tokens
    monkeypatch.setattr(dispatch, "_tokens", lambda job, start, stop: seen.append((start, stop)) or real(job, start,
                                                                                                          stop))
    got, state = linattn.linear_attention(q, k, v, form="chunked", chunk_size=8, **common, **options)
    assert kept == [1] and apart == [1] and seen == [(0, 20), (20, 45)]
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = definition(q, k4, v4, window=5, sinks=2, size=sizes, block=4, score=score,
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    _, general = linattn.linear_attention(q, k, v, form="parallel", **common, **options)
    _states_equal(state, general, atol=1e-10)


def test_the_native_route_of_heads_that_keep_every_pair_or_none(monkeypatch):
    """float32, backend 'auto' (the native kernels where built) and 'torch': both within float32 rounding of the
    float64 definition; with the kernels built, 'native' takes the call, and refuses one in which every head keeps
    pairs and one would evict, saying why."""
    from linattn.backends import native as native_backend

    q, k, v, gen = inputs(h=4, n=70, d=8, dv=16, seed=4)
    options = linear_options("gated-delta", q, gen)
    sizes = (0, 0, 70, 0)
    want = definition(q, k, v, window=9, sinks=2, size=sizes, block=8, score="recall",
                      **reference_options(options, q))
    calls = _route_calls(monkeypatch, "with_kept_pairs")
    as_float = {name: x.float() for name, x in options.items() if torch.is_tensor(x)}
    backends = ["auto", "torch"] + (["native"] if native_backend.module("causal") is not None else [])
    for backend in backends:
        got = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, window=9, sinks=2,
                                       sparse_cache=SparseCache(size=sizes, block=8), backend=backend,
                                       update="delta", **as_float)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    assert len(calls) == len(backends)
    if "native" in backends:
        with pytest.raises(linattn.LinearAttentionError, match="some head's budget is not every pair of 70 tokens"):
            linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, window=9, sinks=2,
                                     sparse_cache=SparseCache(size=(3, 70, 70, 70), block=8), backend="native",
                                     update="delta", **as_float)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_heads_without_pairs_run_apart(kind, score, monkeypatch):
    """Budgets (0, 3, 0, 6): the heads without pairs on the composed route, the others on the sparse form alone;
    in three calls (the state carried, padding, grouped heads, a factor per head) the definition's outputs over the
    whole sequence, and the state of one call of the definition's form, field by field."""
    q, k, v, gen = inputs(h=4, n=40, heads_kv=2, seed=5)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 40, generator=gen) > 0.2
    gamma = torch.tensor([0.5, 2.0, 1.0, 0.7], dtype=torch.float64)
    sizes = (0, 3, 0, 6)
    common = {"causal": True, "window": 5, "sinks": 2, "window_factor": gamma, "return_state": True,
              "sparse_cache": SparseCache(size=sizes, score=score, block=4)}
    calls = _route_calls(monkeypatch, "_heads_apart")
    state, pieces = None, []
    for start, end in ((0, 13), (13, 14), (14, 40)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], form="chunked", chunk_size=8,
            key_padding_mask=keep[:, start:end], initial_state=state, **common, **sliced(options, start, end))
        pieces.append(out)
    assert calls == [1, 1, 1]
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keep4 = keep[:, None, :].expand(2, 4, 40)
    want = definition(q, k4, v4.masked_fill(~keep4.unsqueeze(-1), 0), window=5, sinks=2, size=sizes, block=4,
                      score=score, keep=keep4, factor=gamma, **reference_options(options, q))
    torch.testing.assert_close(torch.cat(pieces, dim=-2), want, rtol=0, atol=1e-10)
    _, whole = linattn.linear_attention(q, k, v, form="parallel", key_padding_mask=keep, **common, **options)
    _states_equal(state, whole, atol=1e-10)


def test_heads_apart_with_a_map_per_head(monkeypatch):
    """A Hedgehog map with its own weights per head: each head that keeps pairs is mapped at its own index, so the
    split route equals the definition's form (which maps every head at once), outputs and state."""
    q, k, v, gen = inputs(h=4, n=37, d=6, seed=6)
    options = linear_options("gated-delta", q, gen)
    fmap = linattn.feature_maps.create("hedgehog", head_dim=6, num_heads=4).double()
    with torch.no_grad():
        for param in fmap.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)
    common = {"causal": True, "window": 5, "sinks": 2, "return_state": True, "feature_map": fmap,
              "sparse_cache": SparseCache(size=(4, 0, 0, 7), block=4)}
    calls = _route_calls(monkeypatch, "_heads_apart")
    got, state = linattn.linear_attention(q, k, v, form="chunked", chunk_size=8, **common, **options)
    assert calls == [1]
    want, reference = linattn.linear_attention(q, k, v, form="parallel", **common, **options)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    _states_equal(state, reference, atol=1e-10)


def test_heads_apart_map_their_own_heads_natively_without_gradients(monkeypatch):
    """Without gradients, the heads that keep pairs are mapped in C++ by a map of their own weights alone (no
    zero rows for the others), as the torch route maps them: outputs and state agree within float64 rounding."""
    from linattn.backends import native
    from linattn.backends.native import forms as native_forms

    if native.module("causal") is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    q, k, v, gen = inputs(h=4, n=37, d=8, dv=8, seed=7)
    options = linear_options("gated-delta", q, gen, features=16)
    fmap = linattn.feature_maps.create("hedgehog", head_dim=8, num_features=8, num_heads=4).double()
    with torch.no_grad():
        for param in fmap.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)
    common = {"causal": True, "window": 5, "sinks": 2, "return_state": True, "feature_map": fmap,
              "sparse_cache": SparseCache(size=(4, 0, 0, 7), block=4), "form": "chunked", "chunk_size": 8}
    heads_seen = []
    real = native_forms.hedgehog_features

    def spy(fmap, x, is_query):
        heads_seen.append((fmap.num_heads, x.shape[-3]))
        return real(fmap, x, is_query)

    monkeypatch.setattr(native_forms, "hedgehog_features", spy)
    with torch.no_grad():
        got, state = linattn.linear_attention(q, k, v, backend="native", **common, **options)
        want, reference = linattn.linear_attention(q, k, v, backend="torch", **common, **options)
    assert (2, 2) in heads_seen  # the two heads with a budget, on a map of their own
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    _states_equal(state, reference, atol=1e-10)


@pytest.mark.parametrize("features", [6, 8], ids=["m6", "m8"])
@pytest.mark.parametrize("score", ["recall", "attention"])
def test_the_decoding_step_holds_slots_for_the_heads_with_a_budget(score, features):
    """Budgets (0, 3, 0, 5) and a Hedgehog map per head: the step keeps cache slots for heads 1 and 3 alone (the
    bytes of two rows, not four), decodes across boundaries what one chunked call computes, and hands back the
    state of that call, field by field. With m = 8 (a width the native kernels take in float64) the recall score
    maps those two rows' candidates alone, in C++ with each row's head's weights."""
    from linattn.backends import native
    from linattn.decode import SparseComposedDecodeStep, lean_step

    q, k, v, gen = inputs(h=4, n=30, heads_kv=2, seed=7)
    options = linear_options("gated-delta", q, gen)
    fmap = linattn.feature_maps.create("hedgehog", head_dim=6, num_features=features, num_heads=4).double()
    with torch.no_grad():
        for param in fmap.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)
    cache = SparseCache(size=(0, 3, 0, 5), score=score, block=3)
    common = {"window": 4, "sinks": 1, "sparse_cache": cache, "feature_map": fmap}
    whole, final = linattn.linear_attention(q, k, v, causal=True, return_state=True, **common, **options)
    prompt = 8
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], causal=True,
                                        return_state=True, **common, **sliced(options, 0, prompt))
    step_options = {n: x for n, x in common.items() if n != "feature_map"}
    step = lean_step(fmap, state, {**step_options, "update": "delta", "log_gate": "with each token"}, kv_heads=2)
    assert isinstance(step, SparseComposedDecodeStep)
    assert step.cached_keys.shape[0] == 2 * 2  # B · (heads with a budget)
    built = native.module() is not None and native.module("causal") is not None
    assert (step._held_map is not None) == (built and features == 8 and score == "recall")
    outs = []
    for t in range(prompt, 30):
        token = sliced(options, t, t + 1)
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                         beta=token["beta"][..., 0], log_decay=token["log_gate"][..., 0]))
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)
    _states_equal(step.state(), final, atol=1e-10)


class _Counted:
    """The native module with its ``sparse_delta_token`` calls counted."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, 0

    def __getattr__(self, name):
        if name == "sparse_delta_token":
            self.calls += 1
        return getattr(self.kernels, name)


@pytest.mark.parametrize("score", ["recall", "attention"])
@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_the_native_decoding_token_beside_the_cache(kind, factor, score):
    """Between two boundaries, with no padding, the delta family's step runs in one C++ call (the leaving key's
    write unless the boundary kept it, λ per head, the softmax over the ring and the cached pairs that left the
    window); across boundaries, sinks leaving and GQA it decodes what one chunked call computes (float64, 1e-10),
    as the torch step does, and hands back the same state."""
    from linattn.backends import native
    from linattn.decode import SparseComposedDecodeStep, lean_step

    if native.module() is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    q, k, v, gen = inputs(h=4, n=40, heads_kv=2, seed=11)
    options = linear_options(kind, q, gen)
    cache = cache_for(score, size=(0, 3, 2, 6), block=3, linear_weight=(1.0, 0.5, 1.0, 0.0))
    common = {"window": 5, "sinks": 2, "window_factor": factor, "sparse_cache": cache}
    whole, final = linattn.linear_attention(q, k, v, causal=True, chunk_size=8, return_state=True, **common,
                                            **options)
    prompt = 1  # the first steps are sinks (the torch code), the later ones the C++ token
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], causal=True,
                                        return_state=True, **common, **sliced(options, 0, prompt))
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    results = {}
    for on in (True, False):
        step = lean_step(linattn.feature_maps.create("elu", head_dim=6), state, {**common, **fixed}, kv_heads=2)
        assert isinstance(step, SparseComposedDecodeStep)
        step._kernels, step.native = _Counted(step._kernels), on
        outs = []
        for t in range(prompt, 40):
            token = sliced(options, t, t + 1)
            gate = token.get("log_gate")
            outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :],
                             beta=token["beta"][..., 0] if "beta" in token else None,
                             log_decay=None if gate is None else gate[..., 0] if gate.dim() == 3 else gate[..., 0, :]))
        torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)
        _states_equal(step.state(), final, atol=1e-10)
        results[on] = step
    boundaries = len([t for t in range(prompt, 40) if t % 3 == 0])
    assert results[True]._kernels.calls == 40 - max(prompt, 2) - boundaries  # every token but sinks and boundaries
    assert results[False]._kernels.calls == 0


@pytest.mark.parametrize("decide", [True, False])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_the_native_carry_between_boundaries(kind, decide, monkeypatch):
    """backend="native" beside the delta family: the heads that keep pairs make their boundary decisions in one C++
    call (the memory carried between boundaries, the recall scores, the choice and the write stream), or, where
    that call does not take them, carry the memory between boundaries in C++; either way, in three calls with
    padding and grouped heads, the definition's outputs and the state of one call of the definition's form, field
    by field."""
    from linattn.backends import native
    from linattn.backends.native import forms as native_forms

    if native.module("causal") is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    q, k, v, gen = inputs(h=4, n=40, dv=8, heads_kv=2, seed=9)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 40, generator=gen) > 0.2
    sizes = (0, 3, 0, 6)
    common = {"causal": True, "window": 5, "sinks": 2, "return_state": True,
              "sparse_cache": SparseCache(size=sizes, block=4)}
    carried, decided = [], []
    taken, deciding = native_forms.delta_carry, native_forms.sparse_delta_decide

    def counted(*args, **kwargs):
        result = taken(*args, **kwargs)
        carried.append(result is not None)
        return result

    def counted_decision(*args, **kwargs):
        result = deciding(*args, **kwargs) if decide else None
        decided.append(result is not None)
        return result

    monkeypatch.setattr(native_forms, "delta_carry", counted)
    monkeypatch.setattr(native_forms, "sparse_delta_decide", counted_decision)
    state, pieces = None, []
    for start, end in ((0, 13), (13, 14), (14, 40)):
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], form="chunked", chunk_size=8,
            backend="native", key_padding_mask=keep[:, start:end], initial_state=state, **common,
            **sliced(options, start, end))
        pieces.append(out)
    if decide:  # each call's decisions in one C++ call, the carry never needed
        assert len(decided) == 3 and all(decided) and not carried
    else:  # every boundary after the first token carried in C++
        assert len(carried) == 40 // 4 - 1 and all(carried) and len(decided) == 3
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keep4 = keep[:, None, :].expand(2, 4, 40)
    want = definition(q, k4, v4.masked_fill(~keep4.unsqueeze(-1), 0), window=5, sinks=2, size=sizes, block=4,
                      score="recall", keep=keep4, **reference_options(options, q))
    torch.testing.assert_close(torch.cat(pieces, dim=-2), want, rtol=0, atol=1e-10)
    _, whole = linattn.linear_attention(q, k, v, form="parallel", key_padding_mask=keep, **common, **options)
    _states_equal(state, whole, atol=1e-10)


def _native_calls(q, k, v, options, keep, common, cuts, decide, monkeypatch):
    """The outputs and final state of backend="native" over the calls ``cuts``, with the C++ decisions on or off."""
    from linattn.backends.native import forms as native_forms

    taken = native_forms.sparse_delta_decide
    monkeypatch.setattr(native_forms, "sparse_delta_decide", taken if decide else lambda *a, **kw: None)
    state, pieces = None, []
    for start, end in cuts:
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], form="chunked", chunk_size=16,
            backend="native", key_padding_mask=None if keep is None else keep[:, start:end], initial_state=state,
            **common, **sliced(options, start, end))
        pieces.append(out)
    monkeypatch.setattr(native_forms, "sparse_delta_decide", taken)
    return torch.cat(pieces, dim=-2), state


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_the_native_decisions_equal_the_torch_ones(kind, threads, monkeypatch):
    """The C++ decisions against the torch loop they replace, over many boundaries (300 tokens, window 16, block
    8, per-head budgets 0 … 40 so some heads evict at every boundary), with padding, a carried state and the value
    width the model uses (64): in float64 the same caches at the end (positions exactly) and the same outputs (to
    1e-12: the memory's arithmetic differs in order only). With 8 threads for the 3 heads that keep pairs, each
    boundary's scores are shared among the threads."""
    from linattn.backends import native

    if native.module("causal") is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _decisions_against_torch(kind, monkeypatch)
    finally:
        torch.set_num_threads(before)


def _decisions_against_torch(kind, monkeypatch):
    q, k, v, gen = inputs(b=1, h=4, n=300, d=8, dv=64, seed=21)
    options = linear_options(kind, q, gen, features=8)
    keep = torch.rand(1, 300, generator=gen) > 0.1
    common = {"causal": True, "window": 16, "sinks": 3, "return_state": True,
              "sparse_cache": SparseCache(size=(0, 5, 17, 40), block=8)}
    cuts = ((0, 123), (123, 124), (124, 300))
    got, got_state = _native_calls(q, k, v, options, keep, common, cuts, True, monkeypatch)
    want, want_state = _native_calls(q, k, v, options, keep, common, cuts, False, monkeypatch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    _states_equal(got_state, want_state, atol=1e-12)



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("front", [0, 3])
def test_the_native_cache_term_equals_the_torch_one(dtype, front):
    """The cache's exact term in C++ (inference) against the autograd Function it stands in for: random caches with
    empty slots, pairs still in the window for some queries of their block (p + W > t), queries with no exact pair
    and no window key (top read as 0), a call that starts inside a block, and a key width that is not a vector's.
    Float64 to 1e-12; float32 to 2e-5 absolute on sums of up to ~8: a few units in the last place of the largest
    term, the exp and the products' order differing (by CPU and BLAS); the sums are signed, so small entries can
    lose their relative digits."""
    from linattn.backends import native
    from linattn.backends.native import forms as native_forms
    from linattn.exact.forms.cache_term import CacheTerm, Geometry

    if native.module("causal") is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    gen = torch.Generator().manual_seed(5)
    rows, blocks, block, slots, xs, d, dv, window, n0 = 3, 5, 8, 37, 90, 12, 32, 6, 40 + front
    q = torch.randn(rows, blocks * block, d, generator=gen, dtype=dtype)
    keys = torch.randn(rows, xs, d, generator=gen, dtype=dtype) * 2
    values = torch.randn(rows, xs, dv, generator=gen, dtype=dtype)
    ls = torch.randn(rows, blocks * block, generator=gen, dtype=dtype) * 3
    ls[:, ::7] = float("-inf")
    first = n0 - front
    positions = torch.randint(0, first + blocks * block, (rows, blocks, slots), generator=gen)
    positions[torch.rand(rows, blocks, slots, generator=gen) < 0.3] = -1
    positions[0, 1] = -1  # a block with an empty cache
    at = torch.randint(0, xs, positions.shape, generator=gen).masked_fill(positions < 0, -1)
    geo = Geometry(n0, front, block, window, slots, d ** -0.5, False, linear=False)
    with torch.no_grad():
        want = CacheTerm.apply(q, torch.zeros(rows, blocks * block, 4, dtype=dtype), keys, values,
                               torch.zeros(rows, xs, 4, dtype=dtype), ls, at, positions, None, geo)
        got = native_forms.cache_exact(q, keys, values, ls, at, positions, first=first, block=block, window=window,
                                       scale=d ** -0.5)
    assert got is not None
    tolerance = {"rtol": 0, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 0, "atol": 2e-5}
    for name, x, y in zip(("ex_num", "ex_den", "top"), got, want[2:4] + want[5:], strict=True):
        torch.testing.assert_close(x, y, **tolerance, msg=name)
    assert bool((got[1] == 0).any()) and bool((got[1] > 0).any())  # queries with and without an exact pair


def test_the_native_decisions_break_ties_for_the_newer_pair(monkeypatch):
    """Every candidate with the same score (no write strength, so the memory stays empty, and equal values: each
    score is ‖v‖): the C++ choice keeps the newest pairs, as the torch one does and the definition says."""
    from linattn.backends import native

    if native.module("causal") is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    q, k, _, _ = inputs(b=1, h=3, n=90, d=8, dv=16, seed=4)
    v = torch.ones(1, 3, 90, 16, dtype=torch.float64)
    options = {"update": "delta", "beta": torch.zeros(1, 3, 90, dtype=torch.float64)}
    common = {"causal": True, "window": 8, "sinks": 2, "return_state": True,
              "sparse_cache": SparseCache(size=(0, 3, 6), block=4)}  # (the native route needs a head with none)
    got, got_state = _native_calls(q, k, v, options, None, common, ((0, 90),), True, monkeypatch)
    want, want_state = _native_calls(q, k, v, options, None, common, ((0, 90),), False, monkeypatch)
    _states_equal(got_state, want_state, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # at the last boundary (88) the candidates are the cache and 80 … 83: the newest pairs stay
    positions = got_state.cache.packed_positions.tolist()
    assert positions == [81, 82, 83, 78, 79, 80, 81, 82, 83]
