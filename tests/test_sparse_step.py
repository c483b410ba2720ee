"""The lean decoding step of the sparse exact cache (linattn.decode.SparseDecodeStep) against the definition
(``linear_attention(..., sparse_cache=..., form="parallel")`` one token at a time from the same state) in float64:
outputs, the state it hands back, beam-search row selection, the capability table's choice, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from linattn import LinearAttentionError, SparseCache, linear_attention
from linattn.capabilities import choose_step, step_reasons
from linattn.decode import SparseDecodeStep, WindowDecodeStep, lean_step
from linattn.feature_maps import create

TOL = 1e-10  # float64: the step sums the same terms as the definition in another order (in-place state sums)
WINDOW, SINKS, BLOCK = 6, 2, 4


def _inputs(n: int, heads: int = 4, kv_heads: int = 4, d: int = 8, batch: int = 2,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _options(cache: SparseCache, factor: float | None = None) -> dict:
    return {"causal": True, "window": WINDOW, "sinks": SINKS, "sparse_cache": cache, "window_factor": factor}


def _token(x: torch.Tensor, t: int) -> torch.Tensor:
    return x[..., t : t + 1, :]


def _definition(fmap, q, k, v, keep, state, options, start: int, end: int):
    """The definition one token at a time from ``state``: outputs (B, H, end − start, Dv) and the final state."""
    outs = []
    for t in range(start, end):
        mask = None if keep is None else keep[:, t : t + 1]
        out, state = linear_attention(_token(q, t), _token(k, t), _token(v, t), feature_map=fmap, form="parallel",
                                      key_padding_mask=mask, initial_state=state, return_state=True, **options)
        outs.append(out)
    return torch.cat(outs, -2), state


def _same_state(a, b) -> None:
    assert a.num_tokens == b.num_tokens and a.linear.num_tokens == b.linear.num_tokens
    assert torch.equal(a.cache.positions, b.cache.positions)
    assert a.cache.block == b.cache.block
    for name in ("keys", "values", "keep", "sink_keys", "sink_values", "sink_keep"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for x, y in ((a.linear.kv, b.linear.kv), (a.linear.k_sum, b.linear.k_sum), (a.cache.keys, b.cache.keys),
                 (a.cache.values, b.cache.values), (a.cache.queries, b.cache.queries)):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() <= TOL if x.numel() else True


ORACLE_KEEP = torch.arange(64) % 3 == 1
# per head: every third, every other, every fifth and every fourth position (each head's boundaries decide on its own)
ORACLE_PER_HEAD = torch.stack([torch.arange(64) % m == 1 for m in (3, 2, 5, 4)])
CACHES = {
    "recall": SparseCache(size=3, score="recall", block=BLOCK),
    "attention": SparseCache(size=3, score="attention", block=BLOCK),
    "oracle": SparseCache(size=3, score="oracle", block=BLOCK, keep=ORACLE_KEEP),
    "per-head": SparseCache(size=(1, 4, 0, 2), score="recall", block=BLOCK),
    "per-head-attention": SparseCache(size=(2, 3, 1, 4), score="attention", block=BLOCK),
    "per-head-oracle": SparseCache(size=(1, 4, 0, 2), score="oracle", block=BLOCK, keep=ORACLE_PER_HEAD),
    "discounted": SparseCache(size=3, score="recall", block=BLOCK, linear_weight=0.3),
    "per-head-discounted": SparseCache(size=(1, 4, 0, 2), score="recall", block=BLOCK,
                                       linear_weight=(0.5, 0.0, 1.0, 0.1)),
}


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("factor", [None, 0.7], ids=["mass", "gamma"])
@pytest.mark.parametrize("name", list(CACHES))
def test_step_follows_the_definition(name: str, factor: float | None, kv_heads: int) -> None:
    """Prefill 3 tokens (the ring not yet full), step 37 more (boundaries at 4, 8, …, 36: nine; at 4 the sinks
    are among the leaving pairs and not candidates), a padded token among them and a left-padded row: every output
    within 1e-10 of the definition; the step's state is the definition's; and the cache holds pairs (it is not the
    window op)."""
    cache, n, prefill = CACHES[name], 40, 3
    q, k, v = _inputs(n, kv_heads=kv_heads)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, :2] = False  # left padding
    keep[0, 14] = False  # a padded token among the stepped ones: never a candidate
    fmap = create("elu")
    options = _options(cache, factor)
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], feature_map=fmap,
                                key_padding_mask=keep[:, :prefill], return_state=True, **options)
    step = SparseDecodeStep(fmap, state, cache, window_factor=factor, kv_heads=kv_heads)
    outs = torch.cat([step(_token(q, t), _token(k, t), _token(v, t), keep[:, t : t + 1]) for t in range(prefill, n)],
                     -2)
    expected, final = _definition(fmap, q, k, v, keep, state, options, prefill, n)
    assert (outs - expected).abs().max().item() <= TOL
    _same_state(step.state(), final)
    assert (final.cache.positions >= 0).any() and 14 not in final.cache.positions[0].tolist()
    plain = linear_attention(q, k, v, feature_map=fmap, causal=True, window=WINDOW, sinks=SINKS, window_factor=factor,
                             key_padding_mask=keep)
    assert (outs - plain[..., prefill:, :]).abs().max().item() > 1e-3


def test_per_head_map_and_a_prefill_inside_a_block() -> None:
    """Hedgehog (one map per head) from a state whose last boundary kept pairs still in the window (prefill 13:
    the boundary at 12 kept pairs 6 … 9): the kept pairs stay exact when they leave."""
    cache, n, prefill = CACHES["attention"], 34, 13
    q, k, v = _inputs(n, kv_heads=2, seed=1)
    fmap = create("hedgehog", head_dim=8, num_heads=4, init="random", seed=0).double()
    options = _options(cache)
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], feature_map=fmap,
                                return_state=True, **options)
    assert (state.cache.positions >= prefill - WINDOW).any()  # a kept pair not yet out of the window
    step = SparseDecodeStep(fmap, state, cache, kv_heads=2)
    outs = torch.cat([step(_token(q, t), _token(k, t), _token(v, t)) for t in range(prefill, n)], -2)
    expected, final = _definition(fmap, q, k, v, None, state, options, prefill, n)
    assert (outs - expected).abs().max().item() <= TOL
    _same_state(step.state(), final)


@pytest.mark.parametrize("name", ["recall", "attention"])
def test_state_midway_continues_exactly(name: str) -> None:
    """state() after some tokens (inside a block), continued by linear_attention and by a new step built from it,
    gives what the first step gives going on."""
    cache, n, prefill, mid = CACHES[name], 36, 5, 19
    q, k, v = _inputs(n, seed=2)
    fmap = create("elu")
    options = _options(cache)
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], feature_map=fmap,
                                return_state=True, **options)
    step = SparseDecodeStep(fmap, state, cache)
    for t in range(prefill, mid):
        step(_token(q, t), _token(k, t), _token(v, t))
    middle = step.state()
    again = SparseDecodeStep(fmap, middle, cache)
    going_on = torch.cat([step(_token(q, t), _token(k, t), _token(v, t)) for t in range(mid, n)], -2)
    restarted = torch.cat([again(_token(q, t), _token(k, t), _token(v, t)) for t in range(mid, n)], -2)
    continued, _ = _definition(fmap, q, k, v, None, middle, options, mid, n)
    assert (restarted - going_on).abs().max().item() <= TOL
    assert (continued - going_on).abs().max().item() <= TOL
    whole = linear_attention(q, k, v, feature_map=fmap, **options)  # the chunked form over the whole sequence
    assert (going_on - whole[..., mid:, :]).abs().max().item() <= TOL


def test_index_select_goes_on_with_the_selected_rows() -> None:
    """Beam search: rows reordered and repeated (3 rows from 2), stepped over two boundaries, against the definition
    from the state's rows selected alike."""
    cache, n, prefill = CACHES["per-head-attention"], 30, 11
    q, k, v = _inputs(n, kv_heads=2, seed=3)
    fmap = create("elu")
    options = _options(cache, 0.5)
    _, state = linear_attention(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], feature_map=fmap,
                                return_state=True, **options)
    step = SparseDecodeStep(fmap, state, cache, window_factor=0.5, kv_heads=2)
    for t in range(prefill, 17):
        step(_token(q, t), _token(k, t), _token(v, t))
    picked = torch.tensor([1, 0, 1])
    selected = step.index_select(0, picked)
    assert selected.batch_size == 3
    q3, k3, v3 = (x.index_select(0, picked) for x in _inputs(n, kv_heads=2, seed=4))
    outs = torch.cat([selected(_token(q3, t), _token(k3, t), _token(v3, t)) for t in range(17, n)], -2)
    expected, final = _definition(fmap, q3, k3, v3, None, step.state().index_select(0, picked), options, 17, n)
    assert (outs - expected).abs().max().item() <= TOL
    _same_state(selected.state(), final)


def test_the_step_holds_a_split_budget_at_its_total() -> None:
    """Sizes (1, 4, 0, 3) per head: the step's buffers hold the bytes of a uniform 2 (the same total), fewer than a
    uniform 4 (the largest) — after a prefill and across boundaries."""
    q, k, v = _inputs(30)
    fmap = create("elu")

    def held(size: int | tuple[int, ...]) -> int:
        cache = SparseCache(size=size, score="recall", block=BLOCK)
        _, state = linear_attention(q[..., :9, :], k[..., :9, :], v[..., :9, :], feature_map=fmap, return_state=True,
                                    **_options(cache))
        step = SparseDecodeStep(fmap, state, cache)
        for t in range(9, 30):
            step(_token(q, t), _token(k, t), _token(v, t))
        return sum(x.numel() * x.element_size() for x in vars(step).values() if isinstance(x, torch.Tensor))

    assert held((1, 4, 0, 3)) == held(2) < held(4)


def test_the_capability_table_and_lean_step_choose_it() -> None:
    q, k, v = _inputs(12)
    fmap = create("elu")
    for option in (3, SparseCache(3)):
        options = {"window": WINDOW, "sinks": SINKS, "sparse_cache": option, "eps": 1e-6}
        _, state = linear_attention(q, k, v, feature_map=fmap, causal=True, return_state=True, **options)
        assert choose_step(fmap, state, options) == "sparse"
        assert isinstance(lean_step(fmap, state, options, 4), SparseDecodeStep)
        assert any("sparse cache" in reason for reason in step_reasons("window", fmap, state, options))
    assert step_reasons("sparse", fmap, state, {**options, "min_denom": 1e-3})  # an option it does not reproduce
    assert step_reasons("sparse", fmap, state, {**options, "sparse_cache": SparseCache(5)})  # not the state's cache
    assert step_reasons("sparse", fmap, state, {k: x for k, x in options.items() if k != "sparse_cache"})
    _, plain = linear_attention(q, k, v, feature_map=fmap, causal=True, window=WINDOW, return_state=True)
    assert step_reasons("sparse", fmap, plain, {"window": WINDOW})  # no cache: the window step's
    assert choose_step(fmap, plain, {"window": WINDOW}) == "window"
    flat, _ = (x.flatten(0, 1) for x in (q, k))
    _, unbatched = linear_attention(flat, flat, flat, feature_map=fmap, causal=True, return_state=True, **options)
    assert any("(B, H)" in reason for reason in step_reasons("sparse", fmap, unbatched, options))


def test_refusals() -> None:
    q, k, v = _inputs(12)
    cache = SparseCache(3, block=BLOCK)
    _, state = linear_attention(q, k, v, causal=True, window=WINDOW, sinks=SINKS, sparse_cache=cache,
                                return_state=True)
    favor = create("favor+", head_dim=8).double()
    with pytest.raises(LinearAttentionError, match="log-space"):
        SparseDecodeStep(favor, state, cache)
    assert any("log-space" in reason for reason in step_reasons("sparse", favor, state, {"window": WINDOW,
                                                                                        "sparse_cache": cache}))
    step = SparseDecodeStep(create("elu"), state, cache)
    with pytest.raises(LinearAttentionError, match="sparse cache"):
        SparseDecodeStep.stack([step.index_select(0, torch.tensor([0]))] * 2, [0, 1])
    with pytest.raises(LinearAttentionError, match="sparse cache"):
        WindowDecodeStep.stack([step.index_select(0, torch.tensor([0]))] * 2, [0, 1])
    with pytest.raises(LinearAttentionError, match="same sparse_cache"):
        SparseDecodeStep(create("elu"), state, SparseCache(4, block=BLOCK))
    _, plain = linear_attention(q, k, v, causal=True, window=WINDOW, sinks=SINKS, return_state=True)
    with pytest.raises(LinearAttentionError, match="without sparse_cache"):
        SparseDecodeStep(create("elu"), plain, cache)
