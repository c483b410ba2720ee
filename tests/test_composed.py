"""The window's exact part beside every linear part: decays and gates (scalar, per token, per feature), the delta
rule, the gated delta rule — each form against a token-by-token definition written here from the equations of
docs/window.md ("Composed linear parts"), sharing no helper with the library; gradients, states, continuation,
padding, GQA, the full window, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import LinearAttentionError, WindowAttentionState

FORMS = ("parallel", "chunked", "recurrent")


def elu1(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1


def definition(q, k, v, *, window, sinks, update="add", beta=None, log_gate=None, factor=None, keep=None,
               eps=1e-6):
    """Token by token, per batch row and head, in float64: at step t the linear state takes token t's decay and
    the write of key t − W (not a sink, not padding); the exact keys are the window and the sinks; the linear part
    meets them through the shared normaliser (additive) or is added to their softmax average (delta)."""
    q, k, v = q.double(), k.double(), v.double()
    *batch, n, d = q.shape
    scale = d ** -0.5
    out = torch.zeros(*batch, n, v.shape[-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(b) for b in batch)) if len(batch) > 1 else [(i,) for i in
                                                                                                 range(batch[0])]:
        index = tuple(int(i) for i in index)
        qs, ks, vs = q[index], k[index], v[index]
        fq, fk = elu1(qs), elu1(ks)
        if update == "delta":
            fq, fk = fq / fq.norm(dim=-1, keepdim=True), fk / fk.norm(dim=-1, keepdim=True)
        memory = torch.zeros(fk.shape[-1], vs.shape[-1], dtype=torch.float64)
        sums = torch.zeros(fk.shape[-1], dtype=torch.float64)
        for t in range(n):
            if log_gate is not None:
                a = torch.exp(log_gate[index][t].double())  # a scalar or one per feature
                memory = (a.unsqueeze(-1) if a.dim() else a) * memory
                sums = a * sums
            j = t - window
            if j >= sinks and (keep is None or keep[index][j]):
                if update == "delta":
                    b = float(beta[index][j])
                    memory = memory + b * torch.outer(fk[j], vs[j] - memory.T @ fk[j])
                else:
                    memory = memory + torch.outer(fk[j], vs[j])
                    sums = sums + fk[j]
            exact = [i for i in range(t + 1) if (i > t - window or i < sinks) and (keep is None or keep[index][i])]
            scores = torch.stack([scale * qs[t] @ ks[i] for i in exact]) if exact else torch.zeros(0)
            weights = torch.exp(scores - scores.max()) if exact else scores
            soft_num = weights @ vs[exact] if exact else torch.zeros(vs.shape[-1], dtype=torch.float64)
            soft_den = weights.sum()
            gamma = 1.0 if factor is None else float(factor[index[-1]] if torch.is_tensor(factor) else factor)
            if update == "delta":
                average = soft_num / soft_den if exact else soft_num
                out[index][t] = gamma * average + memory.T @ fq[t]
                continue
            num, den = memory.T @ fq[t], fq[t] @ sums
            if factor is None:
                mass = sum((fq[t] @ fk[i] for i in exact), torch.tensor(0.0, dtype=torch.float64))
                average = soft_num / soft_den if exact else soft_num
                out[index][t] = (num + mass * average) / (den + mass + eps)
            else:
                out[index][t] = (num + gamma * soft_num) / (den + gamma * soft_den + eps)
    return out


def inputs(b=2, h=2, n=29, d=6, dv=5, seed=0, heads_kv=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, heads_kv or h, n, d, generator=gen, dtype=torch.float64)
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
    if kind == "kda":  # the delta rule with a per-feature gate
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


KINDS = ("decay", "token-gate", "feature-gate", "delta", "gated-delta", "kda")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window,sinks,n", [(5, 2, 29), (4, 0, 17), (1, 1, 9), (8, 3, 1), (40, 2, 29)],
                         ids=["w5s2", "w4", "w1s1", "n1", "full-window"])
def test_forms_equal_the_definition(kind, form, window, sinks, n):
    q, k, v, gen = inputs(n=n)
    options = linear_options(kind, q, gen)
    got = linattn.linear_attention(q, k, v, causal=True, window=window, sinks=sinks, form=form, chunk_size=8,
                                   **options)
    want = definition(q, k, v, window=window, sinks=sinks, **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_a_window_over_the_whole_sequence_is_causal_softmax(kind):
    q, k, v, gen = inputs(n=23)
    options = linear_options(kind, q, gen)
    got = linattn.linear_attention(q, k, v, causal=True, window=23, **options, window_factor=1.0)
    mask = torch.ones(23, 23, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if kind in ("delta", "gated-delta", "kda"):  # the delta rule's combiner: the softmax average plus a silent memory
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    else:  # the shared normaliser with γ = 1: Σe^{s−m}v / (Σe^{s−m} + eps)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_window_factor_per_head(kind):
    q, k, v, gen = inputs(n=19)
    options = linear_options(kind, q, gen)
    factor = torch.tensor([0.5, 2.0], dtype=torch.float64)
    got = linattn.linear_attention(q, k, v, causal=True, window=4, sinks=1, window_factor=factor, **options)
    want = definition(q, k, v, window=4, sinks=1, factor=factor, **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_and_grouped_heads(kind):
    q, k, v, gen = inputs(h=4, n=21, heads_kv=2)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 21, generator=gen) > 0.3
    got = linattn.linear_attention(q, k, v, causal=True, window=5, sinks=2, key_padding_mask=keep, **options)
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    keep4 = keep[:, None, :].expand(2, 4, 21)
    want = definition(q, k4, v4.masked_fill(~keep4.unsqueeze(-1), 0), window=5, sinks=2, keep=keep4,
                      **reference_options(options, q))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_continuation_equals_one_call(kind, form):
    q, k, v, gen = inputs(n=31)
    options = linear_options(kind, q, gen)
    whole = linattn.linear_attention(q, k, v, causal=True, window=6, sinks=2, chunk_size=8, **options)
    state, pieces = None, []
    for start, end in ((0, 3), (3, 4), (4, 17), (17, 31)):
        part = {name: (value[..., start:end] if name in ("beta",) or (name == "log_gate" and value.dim() == 3)
                       else value[..., start:end, :] if name == "log_gate" else value)
                for name, value in options.items()}
        out, state = linattn.linear_attention(
            q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], causal=True, window=6, sinks=2,
            chunk_size=8, form=form, initial_state=state, return_state=True, **part,
        )
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, rtol=0, atol=1e-10)
    assert isinstance(state, WindowAttentionState) and state.num_tokens == 31
    if kind in ("delta", "gated-delta", "kda"):
        assert state.betas is not None and state.betas.shape == (2, 2, 6)


@pytest.mark.parametrize("kind", KINDS)
def test_state_bytes_do_not_grow_with_the_sequence(kind):
    sizes = []
    for n in (40, 160):
        q, k, v, gen = inputs(n=n)
        options = linear_options(kind, q, gen)
        _, state = linattn.linear_attention(q, k, v, causal=True, window=6, sinks=2, return_state=True, **options)
        tensors = [state.linear.kv, state.keys, state.values, state.keep, state.sink_keys, state.sink_values]
        if state.betas is not None:
            tensors.append(state.betas)
        sizes.append(sum(t.numel() * t.element_size() for t in tensors))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("kind", KINDS)
def test_gradients(kind):
    q, k, v, gen = inputs(b=1, h=1, n=11, d=3, dv=2)
    options = linear_options(kind, q, gen, features=3)
    tensors = [x.requires_grad_() for x in (q, k, v)]
    extra = {name: value.requires_grad_() for name, value in options.items()
             if isinstance(value, torch.Tensor)}

    def run(q, k, v, *values):
        given = dict(options, **dict(zip(extra, values, strict=True)))
        return linattn.linear_attention(q, k, v, causal=True, window=3, sinks=1, chunk_size=4, **given)

    assert torch.autograd.gradcheck(run, (*tensors, *extra.values()), atol=1e-7)


def test_fp32_within_the_float64_definition():
    q, k, v, gen = inputs(n=70)
    options = linear_options("gated-delta", q, gen)
    got = linattn.linear_attention(q.float(), k.float(), v.float(), causal=True, window=9, sinks=2,
                                   **{n: (x.float() if torch.is_tensor(x) else x) for n, x in options.items()})
    want = definition(q, k, v, window=9, sinks=2, **reference_options(options, q))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_a_state_of_the_other_update_rule_is_refused():
    q, k, v, gen = inputs(n=9)
    options = linear_options("delta", q, gen)
    _, state = linattn.linear_attention(q, k, v, causal=True, window=4, return_state=True, **options)
    with pytest.raises(LinearAttentionError, match="update='add'"):
        linattn.linear_attention(q, k, v, causal=True, window=4, initial_state=state, decay=0.9)


def test_non_causal_is_refused():
    q, k, v, gen = inputs(n=9)
    with pytest.raises(LinearAttentionError, match="causal"):
        linattn.linear_attention(q, k, v, window=4, update="delta")


@pytest.mark.parametrize("factor", [None, 0.7], ids=["no-factor", "factor"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", [2, 9], ids=["prompt-inside-the-sinks-and-window", "prompt-9"])
def test_the_decoding_step_equals_the_chunked_form(kind, prompt, factor):
    from linattn.decode import ComposedDecodeStep, lean_step

    q, k, v, gen = inputs(h=4, n=20, heads_kv=2)
    options = linear_options(kind, q, gen)
    keep = torch.rand(2, 20, generator=gen) > 0.2
    common = {"window": 5, "sinks": 3, "window_factor": factor}
    whole = linattn.linear_attention(q, k, v, causal=True, key_padding_mask=keep, **common, **options)
    head = {n: (x[..., :prompt] if n == "beta" or (n == "log_gate" and x.dim() == 3) else
                x[..., :prompt, :] if n == "log_gate" else x) for n, x in options.items()}
    _, state = linattn.linear_attention(q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], causal=True,
                                        key_padding_mask=keep[:, :prompt], return_state=True, **common, **head)
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}
    if "log_gate" in options:
        fixed["log_gate"] = "with each token"
    step = lean_step(linattn.feature_maps.create("elu", head_dim=6), state, {**common, **fixed}, kv_heads=2)
    assert isinstance(step, ComposedDecodeStep)
    outs = []
    for t in range(prompt, 20):
        beta = options["beta"][..., t] if "beta" in options else None
        gate = options.get("log_gate")
        gate = None if gate is None else gate[..., t] if gate.dim() == 3 else gate[..., t, :]
        outs.append(step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1],
                         beta=beta, log_decay=gate))
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole[..., prompt:, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("options", [{"update": "delta", "gate": "token"}, {"gate": "feature", "decay": "retnet"},
                                     {"gate": "token"}, {"update": "delta", "gate": "feature"}],
                         ids=["gated-delta", "feature-gate+retnet", "token-gate", "kda"])
def test_the_layer_decodes_with_the_composed_step(options):
    from linattn.decode import ComposedDecodeStep
    from linattn.nn import LinearAttention

    torch.manual_seed(0)
    layer = LinearAttention(16, 2, causal=True, window=4, sinks=1, **options).double()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    whole = layer(x)
    out, state = layer(x[:, :6], return_state=True)
    decoder = layer.decoder(state)
    assert isinstance(decoder.step, ComposedDecodeStep)
    outs = [out] + [decoder(x[:, t : t + 1]) for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=0, atol=1e-10)
    _, final = layer(x, return_state=True)
    torch.testing.assert_close(decoder.state().linear.kv, final.linear.kv, rtol=0, atol=1e-10)
