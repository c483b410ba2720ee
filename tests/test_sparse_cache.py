"""The window op with a sparse exact cache: every form against the definition (``form="parallel"``) in float64,
the definition against exact softmax and against the window op, the scores, states, gradients and errors."""

from __future__ import annotations

import pytest
import torch

import linattn
from linattn import LinearAttentionError, SparseCache, linear_attention

TOL = 1e-10  # float64: the forms sum the same terms in other orders (blocks, chunks, state sums)


def _inputs(n: int = 70, heads: int = 2, d: int = 8, seed: int = 0, batch: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3))


def _run(q, k, v, cache, form, state=None, **options):
    options = {"causal": True, "window": 8, "sinks": 2, **options}
    return linear_attention(q, k, v, sparse_cache=cache, form=form, initial_state=state, return_state=True,
                            **options)


def _same_state(a: linattn.WindowAttentionState, b: linattn.WindowAttentionState) -> None:
    assert a.num_tokens == b.num_tokens
    assert torch.equal(a.cache.positions, b.cache.positions)
    for x, y in ((a.linear.kv, b.linear.kv), (a.linear.k_sum, b.linear.k_sum), (a.cache.keys, b.cache.keys),
                 (a.cache.values, b.cache.values), (a.keys, b.keys), (a.cache.queries, b.cache.queries)):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() <= TOL if x.numel() else True


SCORES = [SparseCache(size=3, score="recall", block=8), SparseCache(size=3, score="attention", block=8),
          SparseCache(size=(2, 5), score="recall", block=4),
          # per-head budgets of other widths: the chunked form decides and weighs each group of heads at its own
          SparseCache(size=(1, 6), score="attention", block=4),
          SparseCache(size=(0, 3), score="oracle", block=4, keep=(torch.arange(80) % 4 == 1).expand(2, 80)),
          # the linear part discounted: one weight, then one per head (0: that head's exact keys alone)
          SparseCache(size=3, score="recall", block=8, linear_weight=0.2),
          SparseCache(size=(2, 5), score="attention", block=4, linear_weight=(0.0, 0.6))]
IDS = ["recall", "attention", "per-head", "per-head-attention", "per-head-oracle", "discounted",
       "per-head-discounted"]


@pytest.mark.parametrize("cache", SCORES, ids=IDS)
@pytest.mark.parametrize("factor", [None, 0.7])
def test_chunked_equals_definition(cache: SparseCache, factor: float | None) -> None:
    q, k, v = _inputs()
    ref, ref_state = _run(q, k, v, cache, "parallel", window_factor=factor)
    out, state = _run(q, k, v, cache, "chunked", window_factor=factor)
    assert (out - ref).abs().max().item() <= TOL
    _same_state(state, ref_state)
    # the cache changed something: it is not the window op
    plain = linear_attention(q, k, v, causal=True, window=8, sinks=2, window_factor=factor)
    assert (out - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize("cache", SCORES, ids=IDS)
def test_pieces_and_tokens_continue_the_whole(cache: SparseCache) -> None:
    q, k, v = _inputs(n=61, seed=1)
    whole, whole_state = _run(q, k, v, cache, "chunked")
    state, outs = None, []
    for lo, hi in ((0, 13), (13, 16), (16, 40), (40, 41), (41, 61)):  # boundaries inside, at and across pieces
        part = slice(lo, hi)
        out, state = _run(q[..., part, :], k[..., part, :], v[..., part, :], cache, "chunked", state)
        outs.append(out)
    assert (torch.cat(outs, -2) - whole).abs().max().item() <= TOL
    _same_state(state, whole_state)
    tokens, token_state = _run(q, k, v, cache, "recurrent")
    assert (tokens - whole).abs().max().item() <= TOL
    _same_state(token_state, whole_state)


def test_size_zero_is_the_window_op() -> None:
    q, k, v = _inputs()
    out, _ = _run(q, k, v, SparseCache(size=0, block=8), "chunked")
    ref, _ = _run(q, k, v, SparseCache(size=0, block=8), "parallel")
    plain = linear_attention(q, k, v, causal=True, window=8, sinks=2, form="parallel")
    assert (out - plain).abs().max().item() <= TOL
    assert (ref - plain).abs().max().item() <= TOL


def test_a_cache_that_holds_nothing_is_no_cache_beside_the_gated_delta_rule() -> None:
    """What lets a layer whose split left it no pair run without a cache (hf.linearize does): its heads' outputs
    equal the composed route's, alone and beside a head that keeps pairs (heads are independent)."""
    q, k, v = _inputs(n=120)
    g = torch.Generator().manual_seed(3)
    beta = torch.rand(*q.shape[:-1], generator=g, dtype=q.dtype)
    gate = torch.nn.functional.logsigmoid(torch.randn(*q.shape[:-1], generator=g, dtype=q.dtype) + 3)
    options = {"update": "delta", "beta": beta, "log_gate": gate}
    plain = linear_attention(q, k, v, causal=True, window=8, sinks=2, **options)
    heads = q.shape[-3]
    empty = SparseCache(size=(0,) * heads, block=8)
    assert empty.holds_nothing and not SparseCache(size=0, linear_weight=0.5).holds_nothing
    assert not SparseCache(size=(0,) * (heads - 1) + (4,)).holds_nothing
    out, _ = _run(q, k, v, empty, "chunked", **options)
    assert (out - plain).abs().max().item() <= TOL
    mixed, _ = _run(q, k, v, SparseCache(size=(0,) * (heads - 1) + (16,), block=8), "chunked", **options)
    assert (mixed[:, :-1] - plain[:, :-1]).abs().max().item() <= TOL
    assert (mixed[:, -1] - plain[:, -1]).abs().max().item() > 1e-3  # the head that keeps pairs reads them


@pytest.mark.parametrize("form", ["parallel", "chunked", "recurrent"])
def test_no_linear_part_is_softmax_over_the_window_and_sinks(form: str) -> None:
    """linear_weight 0 and no cache: every query's softmax over its window and the sinks, nothing else (the
    reference built here from the scores alone); one weight per head discounts only that head."""
    q, k, v = _inputs(n=40)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    t, j = torch.arange(40).unsqueeze(-1), torch.arange(40)
    sees = (j <= t) & ((t - j < 8) | (j < 2))
    exact = torch.softmax(scores.masked_fill(~sees, float("-inf")), -1) @ v
    out, _ = _run(q, k, v, SparseCache(size=0, block=8, linear_weight=0.0), form, eps=0.0)
    assert (out - exact).abs().max().item() <= TOL
    mixed, _ = _run(q, k, v, SparseCache(size=0, block=8, linear_weight=(1.0, 0.0)), form, eps=0.0)
    plain = linear_attention(q, k, v, causal=True, window=8, sinks=2, eps=0.0)
    assert (mixed[:, 0] - plain[:, 0]).abs().max().item() <= TOL
    assert (mixed[:, 1] - exact[:, 1]).abs().max().item() <= TOL
    assert (plain[:, 1] - exact[:, 1]).abs().max().item() > 1e-3  # the linear part weighed in before


def test_keeping_every_pair_is_softmax_attention() -> None:
    """The oracle keeping every position with room for all: every key exact, so the mass form is causal softmax."""
    q, k, v = _inputs(n=48)
    cache = SparseCache(size=48, score="oracle", block=8, keep=torch.ones(48, dtype=torch.bool))
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
    softmax = torch.softmax(scores, -1) @ v
    for form in ("parallel", "chunked"):
        out, _ = _run(q, k, v, cache, form, eps=0.0)  # eps would weigh in against the mass
        assert (out - softmax).abs().max().item() <= TOL


def test_oracle_keeps_the_given_positions_newest_first() -> None:
    q, k, v = _inputs(n=64)
    keep = torch.zeros(64, dtype=torch.bool)
    keep[[3, 10, 11, 20]] = True
    _, state = _run(q, k, v, SparseCache(size=3, score="oracle", block=8, keep=keep), "chunked")
    assert state.cache.positions.tolist() == [[[10, 11, 20]] * 2]


def test_recall_keeps_what_the_state_recalls_worst() -> None:
    """Keys that repeat one direction are recalled well by the state; the one odd pair is kept."""
    n, d = 40, 4
    k = torch.zeros(1, 1, n, d, dtype=torch.float64)
    k[..., 0] = 3.0
    v = torch.ones(1, 1, n, d, dtype=torch.float64)
    k[..., 9, :] = torch.tensor([0.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    v[..., 9, :] = -5.0
    q = torch.randn(1, 1, n, d, dtype=torch.float64)
    _, state = _run(q, k, v, SparseCache(size=1, block=4), "chunked", window=4, sinks=0, feature_map="relu")
    assert state.cache.positions.tolist() == [[[9]]]


@pytest.mark.parametrize("form", ["parallel", "chunked"])
def test_padding(form: str) -> None:
    q, k, v = _inputs(n=40, seed=2)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[:, [5, 17, 18, 30]] = False
    cache = SparseCache(size=3, block=8)
    out, state = _run(q, k, v, cache, form, key_padding_mask=mask)
    ref, ref_state = _run(q, k, v, cache, "recurrent", key_padding_mask=mask)
    assert (out - ref).abs().max().item() <= TOL
    _same_state(state, ref_state)
    assert not set(state.cache.positions.flatten().tolist()) & {5, 17, 18, 30}


def test_gradients() -> None:
    q, k, v = (x[..., :24, :4].clone().requires_grad_() for x in _inputs(n=24, d=4, seed=3))
    cache = SparseCache(size=2, block=4)

    def chunked(q, k, v):
        out, state = _run(q, k, v, cache, "chunked", window=4, sinks=1, window_factor=0.5)
        return out, state.linear.kv

    def parallel(q, k, v):
        out, state = _run(q, k, v, cache, "parallel", window=4, sinks=1, window_factor=0.5)
        return out, state.linear.kv

    assert torch.autograd.gradcheck(chunked, (q, k, v))
    assert torch.autograd.gradcheck(parallel, (q, k, v))
    mass = lambda q, k, v: _run(q, k, v, cache, "chunked", window=4, sinks=1)[0]  # noqa: E731
    assert torch.autograd.gradcheck(mass, (q, k, v))


@pytest.mark.parametrize("sizes", [3, (1, 5)], ids=["uniform", "per-head"])
@pytest.mark.parametrize("factor", [None, 0.5])
def test_gradients_of_a_continuation_equal_the_definitions(factor: float | None, sizes: int | tuple[int, ...]
                                                           ) -> None:
    """A call from a state whose cache holds pairs that leave it (the held pairs' linear weights) and a call that
    starts inside a block: the chunked form's gradients (recomputed by tiles; per-head budgets in groups of their
    own width) against autograd through the definition, in float64."""
    q, k, v = _inputs(n=60, seed=5)
    cache = SparseCache(size=sizes, block=8)
    _, state = _run(q[..., :27, :], k[..., :27, :], v[..., :27, :], cache, "chunked", window_factor=factor)
    assert bool((state.cache.positions >= 0).any())
    later = [x[..., 27:, :].clone().requires_grad_() for x in (q, k, v)]
    weight = torch.randn(1, 2, 33, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = {}
    for form in ("chunked", "parallel"):
        out, after = _run(*later, cache, form, state, window_factor=factor)
        loss = (out * weight).sum() + after.linear.kv.sum()
        grads[form] = torch.autograd.grad(loss, later)
    for got, want in zip(grads["chunked"], grads["parallel"], strict=True):
        assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("score", ["recall", "attention"])
def test_memory_is_constant(score: str) -> None:
    """The state's bytes once the window and the sinks are full: the same after 40, 200 and 4,096 tokens."""
    q, k, v = _inputs(n=4096, seed=4)
    cache = SparseCache(size=5, block=8, score=score)
    size = lambda s: sum(x.numel() * x.element_size() for x in (  # noqa: E731
        s.keys, s.values, s.sink_keys, s.sink_values, s.linear.kv, s.linear.k_sum, s.cache.packed_keys,
        s.cache.packed_values, s.cache.packed_positions, s.cache.sizes, s.cache.queries))
    sizes = {n: size(_run(q[..., :n, :], k[..., :n, :], v[..., :n, :], cache, "chunked")[1]) for n in (40, 200, 4096)}
    assert len(set(sizes.values())) == 1, sizes


@pytest.mark.parametrize("form", ["chunked", "parallel"])
def test_a_split_budget_is_held_at_its_total(form: str) -> None:
    """Per-head sizes (1, 7) hold the bytes of a uniform 4, not of 7 for each head: the state packs each head's
    slots at its own size; the slot view (..., 7) gives them back, −1 beyond a head's size."""
    q, k, v = _inputs(n=70)

    def held(state: linattn.WindowAttentionState) -> int:
        assert state.cache is not None
        return sum(x.numel() * x.element_size()
                   for x in (state.cache.packed_positions, state.cache.packed_keys, state.cache.packed_values))

    split, even, wide = (_run(q, k, v, SparseCache(size=size, block=4), form)[1] for size in ((1, 7), 4, 7))
    assert held(split) == held(even) < held(wide)
    assert split.cache is not None
    positions = split.cache.positions
    assert positions.shape == (1, 2, 7) and split.cache.slots == 7
    assert positions[0, 0, 0] >= 0 and bool((positions[0, 0, 1:] == -1).all()) and bool((positions[0, 1] >= 0).all())
    again = linattn.SparseCacheState.from_slots(positions, split.cache.keys, split.cache.values, split.cache.queries,
                                                split.cache.block, split.cache.sizes)
    assert torch.equal(again.packed_keys, split.cache.packed_keys)
    assert torch.equal(again.packed_positions, split.cache.packed_positions)
    with pytest.raises(LinearAttentionError, match="same sparse_cache"):  # the same largest size, another split
        _run(q[..., :4, :], k[..., :4, :], v[..., :4, :], SparseCache(size=(7, 1), block=4), form, state=split)


def test_errors() -> None:
    q, k, v = _inputs(n=16)
    with pytest.raises(LinearAttentionError, match="pass window="):
        linear_attention(q, k, v, causal=True, sparse_cache=4)
    with pytest.raises(LinearAttentionError, match="causal=True"):
        linear_attention(q, k, v, window=8, sparse_cache=4)
    with pytest.raises(LinearAttentionError, match="block ≤ window"):
        linear_attention(q, k, v, causal=True, window=4, sparse_cache=SparseCache(4, block=8))
    with pytest.raises(LinearAttentionError, match="one per query head"):
        linear_attention(q, k, v, causal=True, window=8, sparse_cache=SparseCache((1, 2, 3)))
    with pytest.raises(LinearAttentionError, match="score"):
        SparseCache(4, score="best")
    with pytest.raises(LinearAttentionError, match="keep="):
        SparseCache(4, score="oracle")
    for weight in (-0.5, float("nan"), True, "1"):
        with pytest.raises(LinearAttentionError, match="linear_weight must be a finite number ≥ 0"):
            SparseCache(4, linear_weight=weight)
    with pytest.raises(LinearAttentionError, match="per-head linear weights .* one per query head"):
        linear_attention(q, k, v, causal=True, window=8, sparse_cache=SparseCache(4, linear_weight=(0.5, 1, 1)))
    assert SparseCache(4, linear_weight=[0.5, 1]).linear_weight == (0.5, 1.0)  # a list: a tuple (hashable)
    _, state = linear_attention(q, k, v, causal=True, window=8, sparse_cache=4, return_state=True)
    with pytest.raises(LinearAttentionError, match="same sparse_cache"):
        linear_attention(q, k, v, causal=True, window=8, initial_state=state)
    with pytest.raises(LinearAttentionError, match="same sparse_cache"):
        linear_attention(q, k, v, causal=True, window=8, initial_state=state, sparse_cache=5)


@pytest.mark.parametrize("weight", [1.0, (0.5, 0.0, 1.0, 0.2)], ids=["linear", "discounted"])
def test_transformers_cache_decodes_what_the_whole_sequence_computes(weight) -> None:
    """A tiny Llama with the cache: logits token by token through the transformers cache (the lean
    SparseDecodeStep from the prefill's state; for the last token the definition's form from the step's state())
    equal one forward pass over the whole sequence (the chunked form), and the cache's bytes do not grow."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from linattn import hf
    from linattn.decode import SparseDecodeStep
    from linattn.hf_cache import LinearAttentionCache

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval().double()
    hf.linearize(model, "elu", window=8, sinks=2, sparse_cache=SparseCache(size=3, block=4, linear_weight=weight))
    ids = torch.randint(1, 50, (1, 60))
    with torch.no_grad():
        whole = model(ids).logits
        cache = LinearAttentionCache()
        out = model(ids[:, :21], past_key_values=cache, use_cache=True)
        steps = [out.logits]
        sizes = []
        for t in range(21, 59):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            sizes.append(cache.nbytes())
        assert all(isinstance(layer.stepper, SparseDecodeStep) for layer in cache.layers)
        for layer in cache.layers:
            assert layer.current_state().cache is not None and layer.stepper is None
        steps.append(model(ids[:, 59:], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(steps, 1) - whole).abs().max().item() <= 1e-9
    assert len(set(sizes[5:])) == 1


def test_generating_with_a_split_holds_its_total() -> None:
    """A tiny Llama with one split per layer (3 pairs per head on average, the largest 6): decoded token by token
    through the transformers cache it gives the whole sequence's logits, and the cache holds the bytes of the same
    model with 3 pairs for every head."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from linattn import hf
    from linattn.hf_cache import LinearAttentionCache

    config = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    ids = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(1))

    def decoded(caches: list[SparseCache]) -> tuple[torch.Tensor, torch.Tensor, int]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval().double()
        hf.linearize(model, "elu", window=8, sinks=2, sparse_cache=caches)
        with torch.no_grad():
            whole = model(ids).logits
            cache = LinearAttentionCache()
            steps = [model(ids[:, :13], past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(13, 40)]
        return torch.cat(steps, 1), whole, cache.nbytes()

    split = [SparseCache(size=(1, 5, 3, 3), block=4), SparseCache(size=(3, 3, 0, 6), block=4)]
    steps, whole, held = decoded(split)
    assert (steps - whole).abs().max().item() <= 1e-9
    assert held == decoded([SparseCache(size=3, block=4)] * 2)[2] < decoded([SparseCache(size=6, block=4)] * 2)[2]


def test_a_layer_the_split_left_without_pairs_runs_without_a_cache() -> None:
    """hf.linearize gives a layer whose cache holds nothing no cache at all (the window op's faster route): its
    options have none, and the model's logits equal those of the same model where that layer's empty cache runs
    through the cache's own route (called directly), decoded token by token as well."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from linattn import hf
    from linattn.hf_cache import LinearAttentionCache

    config = LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    ids = torch.randint(1, 50, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().double()
    split = [SparseCache(size=(0, 0, 0, 0), block=4), SparseCache(size=(3, 3, 0, 6), block=4)]
    hf.linearize(model, "elu", window=8, sinks=2, sparse_cache=split)
    first, second = (getattr(module, hf.OPTIONS_ATTRIBUTE) for module in hf.attention_modules(model))
    assert "sparse_cache" not in first and second["sparse_cache"] == split[1]
    with torch.no_grad():
        whole = model(ids).logits
        cache = LinearAttentionCache()
        steps = [model(ids[:, :13], past_key_values=cache, use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(13, 40)]
        first["sparse_cache"] = split[0]  # the empty cache through its own route
        through_cache = model(ids).logits
    assert (torch.cat(steps, 1) - whole).abs().max().item() <= 1e-9
    assert (through_cache - whole).abs().max().item() <= 1e-9


def test_split_keeps_the_total_and_follows_the_scores() -> None:
    scores = torch.tensor([[0.0, 1.0, 3.0], [0.5, 0.0, 0.0]])
    caches = SparseCache.split(scores, 10, floor=2)
    sizes = torch.tensor([list(cache.size) for cache in caches])
    assert int(sizes.sum()) == 10 * 6
    assert int(sizes.min()) == 2
    assert sizes[0, 2] > sizes[0, 1] > sizes[1, 0] > sizes[0, 0]
    assert [list(c.size) for c in SparseCache.split(torch.zeros(2, 3), 7)] == [[7, 7, 7]] * 2


def test_split_to_the_top_heads_gives_them_what_the_floor_leaves() -> None:
    scores = torch.tensor([[0.0, 1.0, 3.0], [0.5, 0.2, 0.0]])
    sizes = [list(cache.size) for cache in SparseCache.split(scores, 10, floor=2, top=2)]
    # (10 − 2)·6 = 48 spare pairs, 24 each to the heads scoring 3.0 and 1.0; the other four keep the floor
    assert sizes == [[2, 26, 26], [2, 2, 2]]
    assert sum(map(sum, sizes)) == 10 * 6
    three = [list(cache.size) for cache in SparseCache.split(scores, 5, top=3)]  # 30 pairs: 10 each
    assert three == [[0, 10, 10], [10, 0, 0]]
    with pytest.raises(LinearAttentionError, match="top: need 1 ≤ top ≤ the 6 heads, got 7"):
        SparseCache.split(scores, 5, top=7)


@pytest.mark.parametrize("cache", SCORES, ids=IDS)
def test_selections_give_every_query_its_exact_keys(cache: SparseCache) -> None:
    """The caches ``cache_selections`` reports, written as one exact/linear mask per query (the hybrid row that
    fitting with the cache in place trains on), give the op's output: every form decides the same."""
    from linattn.exact.forms.hybrid import Hybrid
    from linattn.exact.forms.sparse import cache_selections

    q, k, v = _inputs(n=75, seed=3)
    window, sinks, n = 8, 2, q.shape[-2]
    phi = torch.nn.functional.elu

    def features(x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return phi(x) + 1

    hybrid = Hybrid(features, log_space=False, window=window, sinks=sinks, factor=None, scale=8 ** -0.5, eps=0.0,
                    min_denom=None)
    selections = cache_selections(hybrid, cache, q, k, v)  # (1, H, b, L)
    block = cache.block_for(window)
    assert selections.shape[-2] == -(-n // block)
    t, j = torch.arange(n).unsqueeze(-1), torch.arange(n)
    mine = selections[..., torch.arange(n) // block, :]  # (1, H, N, L): each query's cache
    cached = ((j.view(1, 1, 1, n, 1) == mine.unsqueeze(-2)) & (mine.unsqueeze(-2) >= 0)).any(-1) & (t - j >= window)
    visible = j <= t
    exact = visible & ((t - j < window) | (j < sinks) | cached)
    linear = visible & ~exact
    weights = features(q, True) @ features(k, False).transpose(-1, -2)
    logits = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    probs = torch.softmax(logits.masked_fill(~exact, float("-inf")), -1)
    mass = (weights * exact).sum(-1, keepdim=True)
    beta = torch.as_tensor(cache.linear_weight, dtype=q.dtype).expand(q.shape[1]).view(1, -1, 1, 1)
    lin = weights * linear * beta  # the linear part times its weight (per head)
    ref = (lin @ v + mass * (probs @ v)) / (lin.sum(-1, keepdim=True) + mass)
    out = linear_attention(q, k, v, causal=True, window=window, sinks=sinks, sparse_cache=cache, eps=0.0)
    assert bool(cached.any())  # the cache holds pairs outside the window
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("weight", [1.0, (0.5, 0.0, 2.0)], ids=["linear", "weighed"])
def test_fitting_with_the_cache_in_place_trains_the_rows_the_op_gives(weight) -> None:
    """The fit's loss with a cache is the cross-entropy of softmax against the very rows of
    ``linear_attention(..., sparse_cache=...)`` (the attention score: its choice does not read the values, so
    identity values give the rows), the linear part weighed per head as the op weighs it."""
    from linattn.exact.forms.hybrid import Hybrid
    from linattn.exact.forms.sparse import cache_selections
    from linattn.train.distill import _batch, _cached_masks, _hybrid_loss, _prepare, _window_masks, fit_feature_map

    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(3, 40, 8, generator=g) * 1.5 for _ in range(3))
    cache = SparseCache(size=(2, 3, 5), score="attention", block=4, linear_weight=weight)
    fmap = fit_feature_map(q, k, v=v, causal=True, steps=6, eval_every=3, window=5, sinks=1, sparse_cache=cache)
    item = _prepare(q, k, v, None, True)[0]
    rows = torch.arange(40)
    batch = _batch(item, rows, None, 0.0, torch.Generator())
    batch.update(_window_masks(rows, rows, 5, 1, True))
    hybrid = Hybrid(lambda x, is_query: fmap.features(x, is_query=is_query), log_space=False, window=5, sinks=1,
                    factor=None, scale=8**-0.5, eps=0.0, min_denom=None)
    with torch.no_grad():
        selections = cache_selections(hybrid, cache, item["q"], item["k"], item["v"])
        masks = _cached_masks(batch, rows, selections, 4)
        assert bool((masks["exact"] & ~batch["exact"]).any())  # pairs outside the window are exact
        batch.update(masks)
        beta = None if weight == 1.0 else torch.tensor(weight)
        loss = _hybrid_loss(fmap, batch, 0.0, None, beta)  # (H, R)
        eye = torch.eye(40).expand(3, 40, 40)
        weights = linear_attention(item["q"], item["k"], eye, feature_map=fmap, causal=True, window=5, sinks=1,
                                   sparse_cache=cache, eps=0.0)
        no_cache = linear_attention(item["q"], item["k"], eye, feature_map=fmap, causal=True, window=5, sinks=1,
                                    eps=0.0)
    cross = -torch.special.xlogy(batch["weights"], weights.clamp_min(1e-30)).sum(-1)
    if weight == 1.0:
        torch.testing.assert_close(loss, cross, rtol=2e-4, atol=2e-4)  # fp32 weights, logs of small weights
    else:  # the head weighed 0 has no linear keys' weights to match: its loss has them at 1e-30 (the fit's floor)
        torch.testing.assert_close(loss[[0, 2]], cross[[0, 2]], rtol=2e-4, atol=2e-4)
    assert (weights - no_cache).abs().max() > 1e-3


def test_fitting_with_a_cache_that_holds_everything_has_nothing_to_fit() -> None:
    """Every pair cached: the hybrid row is softmax itself whatever the map, so the loss never moves; with the
    recall score and per-layer caches through the whole-model fit."""
    from linattn.evaluate.capture import AttentionCapture
    from linattn.train.distill import fit_feature_map, fit_model_feature_maps

    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 32, 8, generator=g) for _ in range(3))
    full = fit_feature_map(q, k, v=v, causal=True, steps=6, eval_every=2, window=4, sinks=1,
                           sparse_cache=SparseCache(size=32, block=4))
    losses = [h[2] for h in full.fit_history]
    assert max(losses) - min(losses) < 1e-5
    plain = fit_feature_map(q, k, v=v, causal=True, steps=6, eval_every=2, window=4, sinks=1)
    assert plain.fit_history[0][2] > max(losses) + 1e-3  # the window alone has something to fit
    layers, heads = 2, 2
    cap = AttentionCapture("tiny-model", layers, heads, heads, 8, 8**-0.5, True, ["a"],
                           [torch.cat([q, q]).unflatten(0, (layers, heads))],
                           [torch.cat([k, k]).unflatten(0, (layers, heads))],
                           [torch.cat([v, v]).unflatten(0, (layers, heads))])
    split = [SparseCache(size=(1, 3), block=4), SparseCache(size=(32, 32), block=4)]
    fitted = fit_model_feature_maps(cap, steps=4, num_features=6, window=4, sinks=1, sparse_cache=split,
                                    progress=False)
    assert len(fitted.maps) == layers
    with pytest.raises(LinearAttentionError, match="3 sizes for 2 heads"):
        fit_model_feature_maps(cap, steps=1, window=4, sinks=1, sparse_cache=[SparseCache(size=(1, 2, 3))] * 2,
                               progress=False)
    with pytest.raises(LinearAttentionError, match="needs window"):
        fit_feature_map(q, k, v=v, causal=True, steps=1, sparse_cache=SparseCache(size=2))
    with pytest.raises(LinearAttentionError, match="needs window"):
        fit_feature_map(q, k, causal=True, steps=1, window=4, sparse_cache=SparseCache(size=2))


def _decay_probe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_cache_decay_probe.py"
    spec = importlib.util.spec_from_file_location("sparse_cache_decay_probe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cache", [SparseCache(size=5, score="oracle", block=4, keep=torch.arange(70) < 9),
                                   SparseCache(size=(2, 5, 0, 3), score="recall", block=4, linear_weight=0.3)],
                         ids=["oracle", "recall-split-weighed"])
def test_the_decay_probe_is_the_op_at_no_decay(cache: SparseCache) -> None:
    """benchmarks/sparse_cache_decay_probe.py measures the op with its linear part decayed: at γ = 1 its quadratic
    hybrid is the op (float64, 1e-10: GQA, Hedgehog per head, a cache that holds pairs), and γ < 1 changes only
    the queries with pairs in the linear part beyond the window."""
    probe = _decay_probe()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 70, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 70, 8, generator=g, dtype=torch.float64) for _ in range(2))
    fmap = linattn.feature_maps.create("hedgehog", head_dim=8, num_heads=4, init="random", seed=0).double()
    options = {"window": 6, "sinks": 2, "sparse_cache": cache}
    expected = linear_attention(q, k, v, feature_map=fmap, causal=True, **options)
    found = probe.decayed_hybrid(q, k, v, fmap, gamma=1.0, **options)
    assert (found - expected).abs().max().item() <= 1e-10
    decayed = probe.decayed_hybrid(q, k, v, fmap, gamma=0.9, **options)
    # the first query with a pair beyond the window and the sinks in its linear part is t = S + W + 1 (its key
    # S entered at S + W; decayed from the next token on)
    first = options["sinks"] + options["window"] + 1
    assert (decayed[..., :first, :] - expected[..., :first, :]).abs().max().item() <= 1e-10
    assert (decayed[..., first:, :] - expected[..., first:, :]).abs().max().item() > 1e-3
