"""The sparse cache's scores and choices against a slow reference written here from the definition alone (the
docstrings of :class:`linattn.SparseCache` and :mod:`linattn.exact.forms.sparse`), apart from the library's
``choose``/``scores_for``, which the definition, the chunked form and the decoding step all share (so agreement
between the forms says nothing about the scores themselves).

The reference walks one (batch, head) row at a time in float64 with Python loops: at each boundary t0 = b·B its
candidates are the cached pairs and the pairs leaving the window before the next boundary (positions
t0 − W … t0 − W + B − 1, neither sinks nor padding); each gets its score — recall: ‖v − Sᵀφ(k) / (zᵀφ(k))‖ against
the linear sums S, z of exactly the pairs that entered before t0 (what query t0 − 1 read; 0 recalled when
zᵀφ(k) = 0); attention: the softmax mass it receives from the queries t0 − B … t0 − 1, each query's softmax taken
over the candidates at or before it; oracle: 1 where keep — and the ``size`` best stay (ties: the newer). A cached
pair that is dropped enters the linear sums at t0; any other pair when it leaves the window (j + W).
"""

from __future__ import annotations

import pytest
import torch

from linattn import SparseCache, linear_attention

NEVER = float("inf")
TOL = 1e-10


def phi(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x) + 1


def reference_caches(q, k, v, *, window, sinks, size, score, block, keep=None, oracle=None):
    """For one row — q, k, v (N, D) float64, ``keep`` (N,) padding mask, ``oracle`` (N,) the oracle's positions —
    the cache of each query block as a sorted list of positions, one list per block."""
    n, scale = q.shape[0], q.shape[-1] ** -0.5
    keep = torch.ones(n, dtype=torch.bool) if keep is None else keep
    entry = [NEVER if j < sinks or not keep[j] else j + window for j in range(n)]
    cache: list[int] = []
    caches = [[]]
    for t0 in range(block, n, block):
        leaving = [j for j in range(max(t0 - window, 0), t0 - window + block) if j >= sinks and keep[j]]
        candidates = sorted(set(cache) | set(leaving))
        entered = [j for j in range(n) if entry[j] <= t0 - 1]
        S = sum((torch.outer(phi(k[j]), v[j]) for j in entered), torch.zeros(k.shape[-1], v.shape[-1],
                                                                                dtype=torch.float64))
        z = sum((phi(k[j]) for j in entered), torch.zeros(k.shape[-1], dtype=torch.float64))
        scores = {}
        for c in candidates:
            if score == "recall":
                den = float(phi(k[c]) @ z)
                recalled = (phi(k[c]) @ S) / den if den > 0 else torch.zeros_like(v[c])
                scores[c] = float(torch.linalg.vector_norm(v[c] - recalled))
            elif score == "attention":
                total = 0.0
                for t in range(t0 - block, t0):
                    seen = [j for j in candidates if j <= t]
                    if not seen:
                        continue
                    logits = torch.stack([q[t] @ k[j] * scale for j in seen])
                    weights = torch.softmax(logits, 0)
                    total += float(weights[seen.index(c)]) if c in seen else 0.0
                scores[c] = total
            else:
                scores[c] = 1.0 if bool(oracle[c]) else 0.0
        kept = sorted(candidates, key=lambda c: (scores[c], c), reverse=True)[:size]
        for c in cache:
            if c not in kept:
                entry[c] = t0  # dropped: enters the linear sums at the boundary
        for c in kept:
            entry[c] = NEVER
        cache = sorted(kept)
        caches.append(cache)
    return caches


def library_caches(q, k, v, cache: SparseCache, *, window, sinks, keep=None):
    """``cache_selections`` as one list of positions per block, per (batch, head) row."""
    from linattn.exact.forms.hybrid import Hybrid
    from linattn.exact.forms.sparse import cache_selections

    hybrid = Hybrid(lambda x, is_query: phi(x), log_space=False, window=window, sinks=sinks, factor=None,
                    scale=q.shape[-1] ** -0.5, eps=0.0, min_denom=None)
    selections = cache_selections(hybrid, cache, q, k, v, keep=keep)  # (B, H, blocks, L)
    return [[[p for p in block.tolist() if p >= 0] for block in row] for row in selections.flatten(0, 1)]


def inputs(n=72, heads=3, d=6, seed=0, duplicates=()):
    """Random q, k, v (1, H, N, D) in float64; each (a, b) of ``duplicates`` makes pair b a copy of pair a (the
    same key and value: the same score under every rule, so only the tie rule tells them apart)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k * 1.5, v.clone()
    for a, b in duplicates:
        k[..., b, :], v[..., b, :] = k[..., a, :], v[..., a, :]
    return q, k, v


def outputs_from(caches, q, k, v, *, window, sinks, block, keep=None):
    """The op's output with the given caches (one list per block, per head), by its definition's masks: exact
    (softmax, one normaliser with the window and sinks) the window, the sinks and the block's cached pairs at
    least W back; linear every other visible pair; the exact part carries its mass φ(q)·Σφ(k)."""
    n = q.shape[-2]
    t, j = torch.arange(n).unsqueeze(-1), torch.arange(n)
    cached = torch.zeros(q.shape[1], n, n, dtype=torch.bool)
    for h, row in enumerate(caches):
        for query in range(n):
            for p in row[query // block]:
                cached[h, query, p] = query - p >= window
    visible = (j <= t) & (torch.ones(n, dtype=torch.bool) if keep is None else keep[0])
    exact = visible & ((t - j < window) | (j < sinks) | cached)
    linear = visible & ~exact
    weights = phi(q) @ phi(k).transpose(-1, -2)
    probs = torch.softmax(((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).masked_fill(~exact, float("-inf")), -1)
    mass = (weights * exact).sum(-1, keepdim=True)
    lin = weights * linear
    return (lin @ v + mass * (probs @ v)) / (lin.sum(-1, keepdim=True) + mass)


CASES = {
    "recall": dict(size=3, score="recall", block=4),
    "attention": dict(size=3, score="attention", block=4),
    "recall, per-head sizes": dict(size=(1, 3, 6), score="recall", block=4),
    "attention, per-head sizes": dict(size=(0, 2, 5), score="attention", block=4),
    "attention, block = window": dict(size=4, score="attention", block=8),
    "oracle, per-head sizes": dict(size=(2, 0, 4), score="oracle", block=4),
}
# pairs 20 and 22 copy pairs 19 and 21 (both leave the window at one boundary), 41 copies 30 (cached for a while
# by then, for some rules): equal scores, so the newer must win
DUPLICATES = ((19, 20), (21, 22), (30, 41))


@pytest.mark.parametrize("options", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_the_caches_are_the_references(options, padded):
    window, sinks = 8, 2
    q, k, v = inputs(duplicates=DUPLICATES)
    n, heads = q.shape[-2], q.shape[1]
    keep = torch.ones(1, heads, n, dtype=torch.bool)
    if padded:
        keep[..., [5, 12, 33, 34, 50]] = False
    oracle = (torch.arange(n) % 3 == 1) | (torch.arange(n) == 20)
    extra = {"keep": oracle} if options["score"] == "oracle" else {}
    cache = SparseCache(**options, **extra)
    ours = library_caches(q, k, v, cache, window=window, sinks=sinks, keep=keep if padded else None)
    sizes = options["size"] if isinstance(options["size"], tuple) else (options["size"],) * heads
    for h in range(heads):
        want = reference_caches(q[0, h], k[0, h], v[0, h], window=window, sinks=sinks, size=sizes[h],
                                score=options["score"], block=options["block"], keep=keep[0, h], oracle=oracle)
        assert ours[h] == want, f"head {h}"
        assert max(map(len, want)) == sizes[h] or sizes[h] == 0  # every budget is used: the choice matters
    # the op's forms weigh exactly those caches (the definition, the chunked form, and token by token)
    mask = keep[:, 0] if padded else None
    ref = outputs_from([reference_caches(q[0, h], k[0, h], v[0, h], window=window, sinks=sinks, size=sizes[h],
                                         score=options["score"], block=options["block"], keep=keep[0, h],
                                         oracle=oracle) for h in range(heads)],
                       q, k, v, window=window, sinks=sinks, block=options["block"], keep=mask)
    for form in ("parallel", "chunked", "recurrent"):
        out = linear_attention(q, k, v, feature_map="elu", causal=True, window=window, sinks=sinks,
                               sparse_cache=cache, form=form, eps=0.0, key_padding_mask=mask)
        rows = torch.ones(n, dtype=torch.bool) if mask is None else mask[0]
        assert (out - ref)[..., rows, :].abs().max().item() <= TOL, form


def test_ties_go_to_the_newer_pair_under_every_score():
    """Two copies of one pair leave the window at the same boundary: with room for one, the newer stays."""
    q, k, v = inputs(n=24, heads=1, duplicates=((9, 10),))
    for score in ("recall", "attention"):
        caches = library_caches(q, k, v, SparseCache(size=1, score=score, block=4), window=8, sinks=0)[0]
        want = reference_caches(q[0, 0], k[0, 0], v[0, 0], window=8, sinks=0, size=1, score=score, block=4)
        assert caches == want
        assert 9 not in sum(caches, [])  # the copy at 10 is the newer: 9 is never the one kept
    oracle = torch.zeros(24, dtype=torch.bool)
    oracle[[2, 3]] = True
    caches = library_caches(q, k, v, SparseCache(size=1, score="oracle", block=4, keep=oracle), window=4,
                            sinks=0)[0]
    assert caches[2] == [3]  # both kept by the oracle, one slot: the newer


def test_the_recall_score_reads_the_state_before_the_boundary_and_normalises_by_z():
    """One boundary worked by hand: the recall score of each candidate is ‖v − Sᵀφ(k)/(zᵀφ(k))‖ with S, z the
    sums of the pairs that entered before t0 (not those entering at t0), and the worst recalled stay."""
    from linattn.exact.forms.boundary import recall_scores

    q, k, v = inputs(n=20, heads=1, seed=4)
    window, block = 4, 4
    caches = library_caches(q, k, v, SparseCache(size=2, score="recall", block=block), window=window, sinks=0)[0]
    # at t0 = 4 the candidates were the pairs 0 … 3 (leaving the window by 7); the two not kept entered the sums at
    # j + W ≤ 7. At t0 = 8 the candidates are the two kept and the pairs 4 … 7 (entering at 8 … 11: not yet)
    t0 = 8
    entered = [j for j in range(4) if j not in caches[1]]
    S = sum(torch.outer(phi(k[0, 0, j]), v[0, 0, j]) for j in entered)
    z = sum(phi(k[0, 0, j]) for j in entered)
    candidates = sorted(set(caches[1]) | {4, 5, 6, 7})
    by_hand = {c: float(torch.linalg.vector_norm(v[0, 0, c] - (phi(k[0, 0, c]) @ S) / (phi(k[0, 0, c]) @ z)))
               for c in candidates}
    assert caches[t0 // block] == sorted(sorted(candidates, key=lambda c: (by_hand[c], c), reverse=True)[:2])
    # the library's function agrees with the hand computation on these candidates
    kf = phi(k[0, 0, candidates])
    ours = recall_scores(kf, v[0, 0, candidates], S, z)
    assert torch.allclose(ours, torch.tensor([by_hand[c] for c in candidates], dtype=torch.float64), rtol=1e-12)
    # an empty state recalls nothing: the score is ‖v‖
    empty = recall_scores(kf, v[0, 0, candidates], torch.zeros_like(S), torch.zeros_like(z))
    assert torch.allclose(empty, torch.linalg.vector_norm(v[0, 0, candidates], dim=-1), rtol=1e-12)
