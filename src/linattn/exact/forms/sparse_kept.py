"""A first call of the sparse cache beside the delta family in which every head keeps every pair or none.

A head whose budget holds every candidate of the call's boundaries never evicts: each pair that leaves the window
is kept (slots ascending, as :func:`.boundary.choose` orders them), so its exact part is every key ≤ t (causal
softmax) and nothing enters its memory, which stays empty: its output is γ·A_t and its state an empty memory beside
the cache of positions S … P − 1 (P = the last boundary − W + B). A head whose budget is 0 keeps nothing: the
composed op (the window and the memory, no cache), as :mod:`.sparse_composed` defines it. A split that gives a few
heads a large share and the rest none (``SparseCache.split(..., top=K)``) is both at once for any prompt shorter
than the large share: the composed op runs every head on its own route (native kernels, the flash band), then the
heads that keep everything take causal softmax in their place (:func:`with_kept_pairs`).

Only for a first call (no state: the memory starts empty), no padding (every pair a candidate), the recall or
attention score (the oracle keeps by position) and a linear weight of 1 (the composed op's read-out)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state import DeltaRuleState, SparseCache, SparseCacheState, WindowAttentionState


def pairs_kept(n: int, window: int, sinks: int, block: int) -> int:
    """How many pairs a head that never evicts holds after a first call of n tokens: the candidates of the last
    boundary t0 < n (t0 = b·B, b ≥ 1), positions S … t0 − W + B − 1; 0 with no boundary."""
    if n <= block:
        return 0
    last = ((n - 1) // block) * block
    return max(0, last - window + block - sinks)


def keeps_all_or_none(cache: SparseCache, heads: torch.Size | tuple[int, ...], n: int, window: int,
                      sinks: int) -> torch.Tensor | None:
    """(...) bool over the batch dims ``heads``: the heads that keep every pair of a first call of n tokens, where
    every other head keeps none; None where some head would evict (or the cache is not one this covers)."""
    if cache.score not in ("recall", "attention") or cache.keep is not None:
        return None
    weights = cache.linear_weight if isinstance(cache.linear_weight, tuple) else (cache.linear_weight,)
    if any(weight != 1 for weight in weights):
        return None
    sizes = cache.sizes_for(heads)
    needed = pairs_kept(n, window, sinks, cache.block_for(window))
    if bool(((sizes > 0) & (sizes < needed)).any()):
        return None
    return sizes > 0


def with_kept_pairs(cache: SparseCache, full: torch.Tensor, out: torch.Tensor, state: WindowAttentionState,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, factor: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, WindowAttentionState]:
    """The composed op's (out, state) of a first call with the heads ``full`` (...) replaced by what a head that
    keeps every pair computes: γ·softmax over every key ≤ t, an empty memory, and every pair that left the window
    (or leaves it before the next boundary) in its cache. q, k (..., N, Dk), v (..., N, Dv), beta (..., N)."""
    batch, n, full = q.shape[:-2], q.shape[-2], full.to(q.device)
    window, sinks, block = state.window, state.sinks, cache.block_for(state.window)
    rows = full.reshape(-1).nonzero().squeeze(-1)  # (R_f,) the flat batch rows that keep everything

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *x.shape[len(batch):])

    if rows.numel():
        # (1, R_f, N, ·): four dims take the CPU flash kernel (three take the quadratic math path)
        exact = F.scaled_dot_product_attention(flat(q)[rows][None], flat(k)[rows][None], flat(v)[rows][None],
                                               is_causal=True, scale=scale)[0]  # (R_f, N, Dv)
        if factor is not None:
            exact = exact * flat(factor.expand(batch).to(exact.dtype).unsqueeze(-1))[rows].unsqueeze(-1)
        out = flat(out).index_copy(0, rows, exact.to(out.dtype)).reshape(out.shape)
    linear = state.linear
    assert isinstance(linear, DeltaRuleState)
    emptied = DeltaRuleState(linear.kv.masked_fill(full.unsqueeze(-1).unsqueeze(-1), 0.0), linear.num_tokens)
    kept = min(pairs_kept(n, window, sinks, block), cache.largest)  # largest 0: no head has a budget
    sizes = cache.sizes_for(batch, q.device)
    last = ((n - 1) // block) * block
    queries = q[..., last:, :] if cache.score == "attention" else q[..., :0, :]
    return out, WindowAttentionState(emptied, state.keys, state.values, state.keep, state.sink_keys,
                                     state.sink_values, state.sink_keep, window, sinks, state.num_tokens,
                                     _packed_front(sizes, kept, sinks, flat(k), flat(v), flat(beta), queries, block),
                                     state.betas)


def _packed_front(sizes: torch.Tensor, kept: int, sinks: int, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                  queries: torch.Tensor, block: int) -> SparseCacheState:
    """The packed cache of rows that hold the pairs S … S + kept − 1 in their first slots, then empty slots to their
    budget: what :meth:`SparseCacheState.from_slots` packs from those slots, made from the rows with a budget alone
    (no (..., L, D) slot tensors). k, v (R, N, ·) and beta (R, N) by flat batch row."""
    positions, keys, values, betas = [], [], [], []
    for row, size in enumerate(sizes.reshape(-1).tolist()):
        if size == 0:
            continue
        take, empty = min(kept, size), size - min(kept, size)
        positions += [torch.arange(sinks, sinks + take, device=k.device),
                      torch.full((empty,), -1, dtype=torch.long, device=k.device)]
        keys += [k[row, sinks : sinks + take], k.new_zeros(empty, k.shape[-1])]
        values += [v[row, sinks : sinks + take], v.new_zeros(empty, v.shape[-1])]
        betas += [beta[row, sinks : sinks + take], beta.new_zeros(empty)]
    if not positions:  # no row has a budget
        return SparseCacheState(sizes, torch.zeros(0, dtype=torch.long, device=k.device), k.new_zeros(0, k.shape[-1]),
                                v.new_zeros(0, v.shape[-1]), queries, block, beta.new_zeros(0))
    return SparseCacheState(sizes, torch.cat(positions), torch.cat(keys), torch.cat(values), queries, block,
                            torch.cat(betas))
