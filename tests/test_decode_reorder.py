"""Beam search reorders the decoding steps' batch rows (``index_select``, as transformers' ``reorder_cache`` and
``batch_select_indices`` call it): for every kind of step, with options other than the defaults (β = 0.5, a decay
of 0.9, per-token gates and write strengths, a window with sinks and a factor, a sparse cache with per-head sizes,
grouped-query heads), the reordered step must be the step made from the reordered inputs — the same state, and
the same outputs from then on, which are linear_attention's on the reordered sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import linattn
from linattn import SparseCache, linear_attention
from linattn.decode import (
    ComposedDecodeStep,
    DecodeStep,
    DeltaDecodeStep,
    SparseDecodeStep,
    WindowDecodeStep,
    lean_step,
)

B, H, HKV, D, N, PROMPT, REORDER = 3, 4, 2, 6, 21, 7, 13
INDEX = torch.tensor([2, 0, 0])  # a beam dropped, another duplicated: rows 2, 0, 0
TOL = 1e-10

# name: (map, the options of the call, per-token inputs: "beta" (B, H, N), "gate" (B, H, N) or "feature-gate"
# (B, H, N, F), the step's class)
CASES = {
    "plain, log-space map, eps": ("favor+", {"eps": 1e-3}, (), DecodeStep),
    "window with sinks and a factor": ("elu", {"window": 4, "sinks": 1, "window_factor": 0.7}, (), WindowDecodeStep),
    "sparse cache, attention score, per-head sizes, weighed": (
        "elu", {"window": 4, "sinks": 1, "sparse_cache": SparseCache(size=(1, 3, 0, 2), score="attention", block=2,
                                                                    linear_weight=0.5)}, (), SparseDecodeStep),
    "sparse cache, recall score": ("elu", {"window": 4, "sinks": 2, "sparse_cache": SparseCache(size=2, block=4)},
                                   (), SparseDecodeStep),
    "delta, beta 0.5, decay 0.9": ("elu", {"update": "delta", "beta": 0.5, "decay": 0.9}, (), DeltaDecodeStep),
    "delta, per-head decays, per-token beta and gates": (
        "elu", {"update": "delta", "decay": torch.tensor([0.9, 0.95, 0.99, 1.0], dtype=torch.float64)},
        ("beta", "gate"), DeltaDecodeStep),
    "delta, per-feature gates (KDA)": ("identity", {"update": "delta", "beta": 0.5}, ("feature-gate",),
                                       DeltaDecodeStep),
    "window beside a decay 0.9": ("elu", {"window": 4, "sinks": 1, "decay": 0.9}, (), ComposedDecodeStep),
    "window beside a decay, log-space map, a factor": (
        "favor+", {"window": 4, "sinks": 1, "decay": 0.9, "window_factor": 0.7}, (), ComposedDecodeStep),
    "window beside a gated delta rule, beta 0.5, a factor": (
        "elu", {"window": 4, "sinks": 1, "update": "delta", "beta": 0.5, "window_factor": 0.7}, ("gate",),
        ComposedDecodeStep),
    "window beside per-token beta and per-feature gates": (
        "elu", {"window": 5, "sinks": 2, "update": "delta", "decay": 0.9}, ("beta", "feature-gate"),
        ComposedDecodeStep),
}


def inputs(extras, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 9] = keep[2, 16] = False  # a padded token before and after the reorder
    per_token = {}
    if "beta" in extras:
        per_token["beta"] = 0.2 + 1.5 * torch.rand(B, H, N, generator=g, dtype=torch.float64)
    if "gate" in extras:
        per_token["log_gate"] = -0.3 * torch.rand(B, H, N, generator=g, dtype=torch.float64)
    if "feature-gate" in extras:
        per_token["log_gate"] = -0.3 * torch.rand(B, H, N, D, generator=g, dtype=torch.float64)
    return q, k, v, keep, per_token


def token(per_token, t):
    """The step's keyword arguments for token t."""
    out = {}
    if "beta" in per_token:
        out["beta"] = per_token["beta"][..., t]
    if "log_gate" in per_token:
        gate = per_token["log_gate"]
        out["log_decay"] = gate[..., t] if gate.dim() == 3 else gate[..., t, :]
    return out


def head(per_token, stop, index=None):
    """The per-token inputs of the tokens before ``stop`` (of the rows ``index``)."""
    out = {}
    for name, x in per_token.items():
        x = x if index is None else x.index_select(0, index)
        out[name] = x[..., :stop] if name == "beta" or x.dim() == 3 else x[..., :stop, :]
    return out


def fields(state, prefix="state"):
    """Every tensor and number of a state (a dataclass, nested), by name."""
    if dataclasses.is_dataclass(state):
        for field in dataclasses.fields(state):
            yield from fields(getattr(state, field.name), f"{prefix}.{field.name}")
    else:
        yield prefix, state


def assert_same_state(a, b):
    left, right = dict(fields(a)), dict(fields(b))
    assert left.keys() == right.keys()
    for name, x in left.items():
        y = right[name]
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape, name
            if x.dtype == torch.bool or not x.is_floating_point():
                assert torch.equal(x, y), name
            elif x.numel():
                assert (x - y).abs().max().item() <= TOL, name
        else:
            assert x == y, name


def make_step(fmap, q, k, v, keep, per_token, options, stop):
    """The step after linear_attention on the tokens before ``stop`` (as a cache prefills the prompt)."""
    _, state = linear_attention(q[..., :stop, :], k[..., :stop, :], v[..., :stop, :], feature_map=fmap, causal=True,
                                key_padding_mask=keep[:, :stop], return_state=True, **options,
                                **head(per_token, stop))
    fixed = dict(options)
    if "log_gate" in per_token:
        fixed["log_gate"] = "with each token"
    step = lean_step(fmap, state, fixed, kv_heads=HKV)
    if step is None and options.get("update") == "delta" and "window" not in options:  # gates come with each call
        step = DeltaDecodeStep(fmap, state, beta=options.get("beta"), decay=options.get("decay"))
    return step


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_a_reordered_step_is_the_step_of_the_reordered_inputs(case):
    name, options, extras, kind = case
    torch.manual_seed(0)  # favor+ draws its features
    fmap = linattn.feature_maps.create(name, head_dim=D)
    q, k, v, keep, per_token = inputs(extras)
    step = make_step(fmap, q, k, v, keep, per_token, options, PROMPT)
    assert type(step) is kind  # the lean step of the kind named, not a fallback
    for t in range(PROMPT, REORDER):
        step(q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :], keep[:, t : t + 1],
             **token(per_token, t))
    reordered = step.index_select(0, INDEX)
    assert type(reordered) is kind and reordered.batch_size == len(INDEX)
    # the inputs of the beams, reordered from the start
    q2, k2, v2, keep2 = (x.index_select(0, INDEX) for x in (q, k, v, keep))
    per_token2 = {n: x.index_select(0, INDEX) for n, x in per_token.items()}
    fresh = make_step(fmap, q2, k2, v2, keep2, per_token2, options, PROMPT)
    for t in range(PROMPT, REORDER):
        fresh(q2[..., t : t + 1, :], k2[..., t : t + 1, :], v2[..., t : t + 1, :], keep2[:, t : t + 1],
              **token(per_token2, t))
    assert_same_state(reordered.state(), fresh.state())
    whole = linear_attention(q2, k2, v2, feature_map=fmap, causal=True, key_padding_mask=keep2, **options,
                             **head(per_token2, N))
    outs = [reordered(q2[..., t : t + 1, :], k2[..., t : t + 1, :], v2[..., t : t + 1, :], keep2[:, t : t + 1],
                      **token(per_token2, t)) for t in range(REORDER, N)]
    assert (torch.cat(outs, -2) - whole[..., REORDER:, :]).abs().max().item() <= TOL
    # the options mattered: the same rows stepped with the defaults give other outputs
    if options.get("beta") is not None or options.get("decay") is not None:
        plain = {n: x for n, x in options.items() if n not in ("beta", "decay")}
        other = linear_attention(q2, k2, v2, feature_map=fmap, causal=True, key_padding_mask=keep2, **plain,
                                 **head(per_token2, N))
        assert (other - whole)[..., REORDER:, :].abs().max().item() > 1e-3


def test_a_reordered_step_keeps_reordering():
    """Two reorders in a row (beams dropped twice) and a repeat (transformers' batch_repeat_interleave)."""
    fmap = linattn.feature_maps.create("elu", head_dim=D)
    options = {"update": "delta", "beta": 0.5, "decay": 0.9}
    q, k, v, keep, per_token = inputs(())
    step = make_step(fmap, q, k, v, keep, per_token, options, PROMPT)
    twice = step.index_select(0, torch.tensor([1, 2, 0])).index_select(0, torch.tensor([2, 2, 1]))
    once = step.index_select(0, torch.tensor([0, 0, 2]))  # the same rows in one go
    assert_same_state(twice.state(), once.state())
    wide = step.index_select(0, torch.arange(B).repeat_interleave(2))
    assert wide.batch_size == 2 * B
    assert torch.equal(wide.state().kv[::2], step.state().kv) and torch.equal(wide.state().kv[1::2], step.state().kv)
