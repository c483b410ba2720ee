"""Runs one chosen route: the feature stage, then the form (or the backend's kernels), on a prepared :class:`Job`.

``linear_attention`` validates, builds the job (inputs in the compute dtype, k/v heads repeated to q's, masked values
zeroed, the state checked) and asks :mod:`linattn.capabilities` which route and backend run it; :func:`run` calls
that route's runner. Every runner takes the one :class:`Job`, so the form signature is spelled out once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from . import _validate
from .backends.native import forms as native_forms
from .capabilities import Route, native_refusal
from .exact import (
    Hybrid,
    causal_window_chunked,
    noncausal_window_chunked,
    window_parallel,
    window_recurrent,
)
from .exact.forms.chunked import causal_window_parts, empty_window_state
from .exact.forms.composed import (
    add_to_average,
    composed_state,
    delayed_stream,
    softmax_average,
    with_sums,
    without_sums,
)
from .exact.forms.naive import exact_parallel, maps_features
from .exact.forms.sparse import sparse_chunked, sparse_parallel, sparse_recurrent
from .exact.forms.sparse_composed import sparse_composed
from .exact.forms.sparse_heads import HeadRows, head_rows, joined_state, joined_window, other_heads, split_heads
from .exact.forms.sparse_kept import keeps_all_or_none, pairs_kept, with_kept_pairs
from .exact.forms.sparse_stream import LinearPart
from .feature_maps.learned import HedgehogFeatureMap
from .features import (
    NEG_INF,
    check_feature_dims,
    delta_inputs,
    key_features,
    map_features,
    query_features,
    stabilise_queries,
)
from .forms import (
    causal_chunked_attention,
    global_attention,
    noncausal_chunked_attention,
    parallel_attention,
    recurrent_attention,
)
from .kinds.additive.forms._common import decayed_ref, empty_state
from .kinds.delta.forms import Sweeps, delta_chunked, delta_recurrent
from .kinds.gated.forms import gated_chunked_attention, gated_parallel_attention, gated_recurrent_attention
from .kinds.kda.forms import kda_chunked, kda_recurrent
from .state import DeltaRuleState, LinearAttentionState, SparseCache, WindowAttentionState

AnyState = LinearAttentionState | WindowAttentionState | DeltaRuleState
Result = tuple[torch.Tensor, "AnyState | None"]


@dataclass
class Job:
    """One call, prepared: q (..., Nq, Dk), k (..., Nk, Dk), v (..., Nk, Dv) in the compute dtype with k/v heads
    repeated to q's, v zero at masked keys; ``keep`` (..., Nk) or None; the state checked (plain: at scale 1 for
    ordinary maps); ``chunk_size`` resolved for the route."""

    fmap: nn.Module
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor | None
    state: AnyState | None
    causal: bool
    chunk_size: int | None
    log_space: bool
    return_state: bool
    normalize: bool = True
    eps: float = 1e-6
    min_denom: float | None = None
    log_decay: torch.Tensor | None = None  # per-token scalar log-decays (..., N), fp64 sums formed by the forms
    feature_gate: torch.Tensor | None = None  # per-feature log-gates (..., N, F)
    segments: torch.Tensor | None = None  # packed sequences: the log-scale jump of each token (_packed.py)
    window: int = 0
    sinks: int = 0
    window_factor: torch.Tensor | None = None  # broadcast to the batch dims, or None (the mass form)
    sparse_cache: SparseCache | None = None
    softmax_scale: float = 1.0
    check_finite: bool = False  # the features too, not only q, k, v
    nonnegative: bool = False  # a map of unknown positivity under normalize=True: refuse negative features
    beta: torch.Tensor | None = None  # the delta rule's write strengths (..., N), in the compute dtype
    key_scales: torch.Tensor | None = None  # k given as features stored at these log-scales (..., N) (composed)
    sweeps: Sweeps | None = None  # the chunked delta family's loops over the chunks (None: the torch ones)

    @property
    def map_name(self) -> str:
        return type(self.fmap).__name__

    def options(self) -> dict[str, Any]:
        return {"normalize": self.normalize, "eps": self.eps, "min_denom": self.min_denom}

    def checks(self) -> dict[str, bool]:
        """The feature checks of :func:`linattn.features.map_features` this call asks for."""
        return {"finite": self.check_finite, "nonnegative": self.nonnegative}


def _plain_state(job: Job) -> LinearAttentionState | None:
    assert job.state is None or isinstance(job.state, LinearAttentionState)
    return job.state


def _features(job: Job) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query and key features, the keys' log-scale ref with any decay and packing jumps applied."""
    state = _plain_state(job)
    qf = query_features(job.fmap, job.q, job.log_space, **job.checks())
    kf, ref = key_features(job.fmap, job.k, job.keep, job.log_space, job.causal,
                           state.shift if state is not None else None, **job.checks())
    check_feature_dims(qf.shape[-1], kf.shape[-1], job.fmap)
    _validate.check_state_features(state, kf.shape[-1], job.map_name)
    return qf, kf, ref if job.key_scales is None else job.key_scales


def _with_scales(job: Job, qf: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor | None:
    if job.log_decay is not None:  # a decay is a change of log-scale: ref' = r − G (kinds/additive/forms/_common.py)
        ref = decayed_ref(ref, job.log_decay)
    if job.segments is not None:  # packed sequences: a jump in log-scale at each start (_packed.py)
        ref = job.segments.expand(qf.shape[:-1]) if ref is None else ref.to(torch.float64) + job.segments
    return ref


def _decayed_state(
    job: Job, stored_at: torch.Tensor | None, final: LinearAttentionState | None
) -> LinearAttentionState | None:
    """Sums stored at ref'_N = r_N − G_N are the decayed sums at scale r_N: the returned shift is r_N."""
    if final is None or (job.log_decay is None and job.feature_gate is None):
        return final
    shift = stored_at[..., -1] if stored_at is not None else torch.zeros_like(final.shift, dtype=job.q.dtype)
    return replace(final, shift=shift.to(job.q.dtype))


def run_plain(job: Job, form: str) -> Result:
    """parallel / global / causal chunked / recurrent on the features, with decays and packing as log-scales."""
    qf, kf, stored = _features(job)
    ref = _with_scales(job, qf, stored)
    state, options = _plain_state(job), job.options()
    final: LinearAttentionState | None
    if form == "parallel":
        out, final = parallel_attention(qf, kf, job.v, causal=job.causal, ref=ref, state=state,
                                        want_state=job.return_state, **options)
    elif form == "global":
        out, final = global_attention(qf, kf, job.v, ref=ref, state=state, **options)
    elif form == "recurrent":
        out, final = recurrent_attention(qf, kf, job.v, ref=ref, state=state, **options)
    else:
        assert job.chunk_size is not None
        out, final = causal_chunked_attention(qf, kf, job.v, ref=ref, state=state, chunk_size=job.chunk_size,
                                              **options)
    return out, _decayed_state(job, stored, final)


def run_noncausal_chunked(job: Job) -> Result:
    """The bounded-memory non-causal form: the feature map runs one chunk at a time."""
    size = job.chunk_size
    assert size is not None
    # split once (a slice per chunk would cost a whole-input zero gradient per chunk in backward)
    key_chunks, query_chunks = job.k.split(size, dim=-2), job.q.split(size, dim=-2)

    def chunk_keys(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunk_keep = job.keep[..., start:end] if job.keep is not None else None
        return key_features(job.fmap, key_chunks[start // size], chunk_keep, job.log_space, False, None,
                            **job.checks())

    def chunk_queries(start: int, end: int) -> torch.Tensor:
        return query_features(job.fmap, query_chunks[start // size], job.log_space, **job.checks())

    features = map_features(job.fmap, job.k[..., :1, :], is_query=False).shape[-1]
    check_feature_dims(map_features(job.fmap, job.q[..., :1, :], is_query=True).shape[-1], features, job.fmap)
    state = _plain_state(job)
    _validate.check_state_features(state, features, job.map_name)
    if state is None:
        state = empty_state(job.q.shape[:-2], features, job.v.shape[-1], job.q)
    return noncausal_chunked_attention(
        chunk_queries, chunk_keys, job.v, num_queries=job.q.shape[-2], state=state, log_space=job.log_space,
        chunk_size=size, **job.options(),
    )


def run_gated(job: Job, form: str) -> Result:
    """Per-feature gates (GLA) in the chosen causal form; the per-token scale ref already decayed."""
    qf, kf, stored = _features(job)
    ref = _with_scales(job, qf, stored)
    gate = job.feature_gate
    assert gate is not None
    _validate.check_gate_features(gate, kf.shape[-1])
    state, options = _plain_state(job), job.options()
    final: LinearAttentionState | None
    if form == "chunked":  # the chunked form sums the gates block by block
        assert job.chunk_size is not None
        ref64 = ref.to(torch.float64) if ref is not None else None
        out, final = gated_chunked_attention(qf, kf, job.v, gate=gate, ref=ref64, state=state,
                                             chunk_size=job.chunk_size, **options)
        return out, _decayed_state(job, stored, final)
    scales = torch.cumsum(gate.to(torch.float64), dim=-2).neg_()  # −G_f (..., N, F)
    if ref is not None:
        scales = scales + ref.to(torch.float64).unsqueeze(-1)
    if form == "parallel":
        out, final = gated_parallel_attention(qf, kf, job.v, scales=scales, state=state,
                                              want_state=job.return_state, **options)
    else:
        out, final = gated_recurrent_attention(qf, kf, job.v, scales=scales, state=state,
                                               **options)
    return out, _decayed_state(job, stored, final)


def run_window(job: Job, form: str) -> Result:
    """The window + sinks op in the chosen form."""
    hybrid = _hybrid(job, job.window_factor)
    state = job.state
    assert state is None or isinstance(state, WindowAttentionState)
    if form in ("parallel", "recurrent"):  # the quadratic forms mask by value, with no branch on it
        keep = job.keep
        if keep is None:
            keep = torch.ones(job.k.shape[:-1], dtype=torch.bool, device=job.k.device)
        if form == "parallel":
            return window_parallel(hybrid, job.q, job.k, job.v, keep, state, job.causal)
        return window_recurrent(hybrid, job.q, job.k, job.v, keep, state)
    assert job.chunk_size is not None
    # the chunked forms take None for no mask: whether there is padding is then known without reading a value
    if not job.causal:
        return noncausal_window_chunked(hybrid, job.q, job.k, job.v, job.keep, job.chunk_size), None
    return causal_window_chunked(hybrid, job.q, job.k, job.v, job.keep, state, job.chunk_size)


def run_sparse(job: Job, form: str, native: bool = False) -> Result:
    """The window op with a sparse exact cache (exact/forms/sparse.py; beside a decayed, gated or delta-rule
    linear part exact/forms/sparse_composed.py); causal. Log-space maps: the scales of exact/forms/sparse_scales.py.
    ``native``: the composed route's linear part on the native kernels, for the heads that run on it (beside the
    delta family, the heads that keep no pair, and in a first call those that keep every pair:
    exact/forms/sparse_heads.py, exact/forms/sparse_kept.py); for the heads that keep pairs, beside the delta
    family, a call's boundary decisions under the recall score (the memory carried between them, the scores, the
    choice, the write stream), the delta rule over that stream and the cache's exact term, each in one C++ call."""
    state, cache = job.state, job.sparse_cache
    assert (state is None or isinstance(state, WindowAttentionState)) and cache is not None
    if job.beta is not None or job.log_decay is not None or job.feature_gate is not None:
        return _run_sparse_composed(job, form, native)
    hybrid = _hybrid(job, job.window_factor)
    if form == "chunked":
        assert job.chunk_size is not None
        return sparse_chunked(hybrid, cache, job.q, job.k, job.v, job.keep, state, job.chunk_size)
    keep = job.keep
    if keep is None:
        keep = torch.ones(job.k.shape[:-1], dtype=torch.bool, device=job.k.device)
    if form == "parallel":
        return sparse_parallel(hybrid, cache, job.q, job.k, job.v, keep, state)
    return sparse_recurrent(hybrid, cache, job.q, job.k, job.v, keep, state)


def _run_sparse_composed(job: Job, form: str, native: bool = False) -> Result:
    """The sparse cache beside a decayed, gated or delta-rule linear part: the delta family's exact part as its
    softmax sums (a factor turns off the mass), as :func:`run_composed` takes it. Chunked, beside the delta family,
    the heads that keep no pair run on the composed route (:func:`_sparse_route`)."""
    state, cache = job.state, job.sparse_cache
    assert (state is None or isinstance(state, WindowAttentionState)) and cache is not None
    route = _sparse_route(job, form)
    if route == "prefix":  # the first whole blocks on the route below, the rest continuing from their state
        cut = _kept_prefix(job)
        first, first_state = _run_sparse_composed(replace(_tokens(job, 0, cut), return_state=True), form, native)
        rest, state = _run_sparse_composed(replace(_tokens(job, cut, job.q.shape[-2]), state=first_state), form,
                                           native)
        return torch.cat([first, rest], dim=-2), state
    if route == "kept":
        full = keeps_all_or_none(cache, job.q.shape[:-2], job.q.shape[-2], job.window, job.sinks)
        assert full is not None and job.beta is not None
        out, composed = _composed_of_others(job, form, native)
        return with_kept_pairs(cache, full, out, composed, job.q, job.k, job.v, job.beta, job.window_factor,
                               job.softmax_scale)
    if route == "split":
        return _heads_apart(job, form, native)
    delta = job.beta is not None
    factor = job.window_factor if not delta or job.window_factor is not None else torch.ones((), dtype=job.q.dtype)
    # the delta family's unit rows cancel a log-space map's per-row scale: its features at each row's maximum
    hybrid = _hybrid(job, factor, row_scale=delta and job.log_space)
    features = hybrid.key_logs(job.k[..., :1, :], None).shape[-1]
    if job.feature_gate is not None:
        _validate.check_gate_features(job.feature_gate, features)
    _validate.check_state_features(state.linear if state is not None else None, features, job.map_name)
    beta = job.beta if job.beta is None or job.keep is None else job.beta * job.keep.to(job.beta.dtype)
    # native (no gradient): the boundaries' decisions and the carry between them, the delta rule over the call's
    # write stream, and (below) the cache's exact term, in C++; each falls back to torch where the kernels do not
    # take it
    part = LinearPart(job.log_decay, job.feature_gate, beta, job.eps, job.min_denom,
                      native_forms.delta_carry if native and beta is not None else None,
                      native_forms.sparse_delta_decide if native and beta is not None else None,
                      native_forms.delta_stream if native and beta is not None else None, job.sweeps)
    return sparse_composed(hybrid, cache, part, job.q, job.k, job.v, job.keep, state, form, job.chunk_size or 64,
                           native_forms.cache_exact if native else None)


def _sparse_route(job: Job, form: str) -> str | None:
    """How a chunked call of the delta family with a sparse cache runs faster than the sparse form over every head:
    "kept" (a first call without padding in which every head keeps every pair or none: exact/forms/sparse_kept.py),
    "split" (some heads keep no pair: exact/forms/sparse_heads.py), "prefix" (a longer first call without padding
    whose first whole blocks are "kept" and whose rest is "split": the two calls, the second continuing the first's
    state, are the op over the whole call), or None (the sparse form)."""
    cache = job.sparse_cache
    if form != "chunked" or job.beta is None or cache is None or job.q.dim() < 3:
        return None
    split = split_heads(cache, job.q.shape[-3]) is not None
    if job.state is None and job.keep is None:
        if keeps_all_or_none(cache, job.q.shape[:-2], job.q.shape[-2], job.window, job.sinks) is not None:
            return "kept"
        if split and job.segments is None and job.key_scales is None and _kept_prefix(job):
            return "prefix"
    return "split" if split else None


def _kept_prefix(job: Job) -> int:
    """The most whole blocks, fewer tokens than the call's, over which every head of a first call keeps every pair
    or none (a head's pairs grow with the tokens, so the longest such part is the first); 0 where none does."""
    cache = job.sparse_cache
    assert cache is not None
    block = cache.block_for(job.window)
    n = (job.q.shape[-2] - 1) // block * block
    if n < block or keeps_all_or_none(cache, job.q.shape[:-2], block, job.window, job.sinks) is None:
        return 0  # not a cache this covers (a first block keeps no pair)
    # the pairs a head keeps grow with n: the longest part is the one whose pairs fit the least positive budget
    sizes = cache.sizes_for(job.q.shape[:-2])
    positive = sizes[sizes > 0]
    if positive.numel():
        least = int(positive.min())
        while n >= block and pairs_kept(n, job.window, job.sinks, block) > least:
            n -= block
    return n if n >= block else 0


def _tokens(job: Job, start: int, stop: int) -> Job:
    """Tokens start … stop − 1 of a call without padding or packing (its per-token inputs cut alike)."""
    def cut(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        return x.narrow(dim, start, stop - start) if x is not None else None

    return replace(job, q=job.q[..., start:stop, :], k=job.k[..., start:stop, :], v=job.v[..., start:stop, :],
                   beta=cut(job.beta, -1), log_decay=cut(job.log_decay, -1), feature_gate=cut(job.feature_gate, -2))


def _heads_of(job: Job, index: torch.Tensor, native: bool, **changes: Any) -> Job:
    """The job on the heads ``index`` (h,) alone: its per-head inputs' rows, its map on those heads
    (:class:`HeadRows`), with ``changes``."""
    heads = job.q.shape[-3]
    batch = job.q.shape[:-2]
    head = len(batch) - 1  # the heads' dim among the batch dims

    def rows(x: torch.Tensor, from_end: int) -> torch.Tensor:
        return head_rows(x, x.dim() - from_end, index)

    def some(x: torch.Tensor | None, from_end: int) -> torch.Tensor | None:
        return rows(x, from_end) if x is not None else None

    factor = job.window_factor.expand(batch).index_select(head, index) if job.window_factor is not None else None
    keep = job.keep.expand(job.k.shape[:-1]).index_select(head, index) if job.keep is not None else None
    maps = native_forms.hedgehog_features if native else None
    return replace(job, fmap=HeadRows(job.fmap, index, heads, maps), q=rows(job.q, 3), k=rows(job.k, 3),
                   v=rows(job.v, 3), keep=keep, beta=some(job.beta, 2), log_decay=some(job.log_decay, 2),
                   feature_gate=some(job.feature_gate, 3), window_factor=factor, return_state=True, **changes)


def _composed_of_others(job: Job, form: str, native: bool) -> tuple[torch.Tensor, WindowAttentionState]:
    """A first call's composed (out, state) with the rows of the heads that keep every pair left for
    :func:`with_kept_pairs` to fill: where some heads keep no pair, the composed route runs those alone, and the
    others' state holds their buffers beside an empty memory (their output rows are zero); else every head."""
    cache = job.sparse_cache
    assert cache is not None
    heads = job.q.shape[-3]
    split = split_heads(cache, heads)
    if split is None:
        out, composed = run_composed(replace(job, sparse_cache=None, return_state=True), form, native)
        assert isinstance(composed, WindowAttentionState)
        return out, composed
    keeping = split[0]
    others = other_heads(keeping, heads)
    head = job.q.dim() - 3
    out, composed = run_composed(_heads_of(job, others, native, sparse_cache=None, state=None), form, native)
    assert isinstance(composed, WindowAttentionState) and isinstance(composed.linear, DeltaRuleState)
    # a first call without padding (the kept route's): the keeping heads' keys, values and write strengths alone
    assert job.keep is None and job.beta is not None
    k, v = head_rows(job.k, head, keeping), head_rows(job.v, head, keeping)
    beta = head_rows(job.beta, job.beta.dim() - 2, keeping)
    memory = composed.linear.kv
    empty = DeltaRuleState(memory.new_zeros(*k.shape[:-2], *memory.shape[-2:]), 0)
    keep = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    buffers = composed_state(empty_window_state(_hybrid(job, None), k, v, memory.shape[-2]), empty, k, v, keep, beta)
    joined = out.new_zeros(*job.q.shape[:-1], out.shape[-1]).index_copy_(head, others, out)
    return joined, joined_window(keeping, others, composed, buffers)


def _heads_apart(job: Job, form: str, native: bool) -> Result:
    """The heads that keep no pair on the composed route, the others on the sparse form; the output and the state
    take each head's rows from its own route (exact/forms/sparse_heads.py)."""
    cache, state = job.sparse_cache, job.state
    assert cache is not None and (state is None or isinstance(state, WindowAttentionState))
    heads = job.q.shape[-3]
    split = split_heads(cache, heads)
    assert split is not None
    keeping, own = split
    others = other_heads(keeping, heads)
    batch = job.q.shape[:-2]
    head = len(batch) - 1  # the heads' dim among the batch dims
    plain = replace(state, cache=None).index_select(head, others) if state is not None else None
    out, composed = run_composed(_heads_of(job, others, native, sparse_cache=None, state=plain), form, native)
    assert isinstance(composed, WindowAttentionState)
    part = _heads_of(job, keeping, native, state=state.index_select(head, keeping) if state is not None else None,
                     sparse_cache=own)
    part_out, part_state = _run_sparse_composed(part, form, native)
    assert isinstance(part_state, WindowAttentionState)
    queries = job.q[..., :0, :]  # the attention score keeps the queries since the last boundary, every head's
    if cache.score == "attention":
        carried = state.cache.queries if state is not None and state.cache is not None else queries
        queries = torch.cat([carried, job.q], dim=-2)
    joined = out.new_empty(*batch, *out.shape[-2:]).index_copy_(head, others, out).index_copy_(head, keeping, part_out)
    return joined, joined_state(cache, keeping, others, composed, part_state, queries)


def run_delta(job: Job, form: str, native: bool = False) -> Result:
    """The delta rule (kinds/delta/forms.py; per-feature gates: kinds/kda/forms.py) on unit features: masked tokens
    write nothing (β = 0), the decay applies. ``native``: the recurrence in C++ (backends/native), where the values'
    width and the absence of gradients allow; else the torch form."""
    state = job.state
    assert job.beta is not None and (state is None or isinstance(state, DeltaRuleState))
    if native and not native_job_reasons(job):
        return native_forms.delta(job)
    qf, kf, beta = delta_inputs(job.fmap, job.q, job.k, job.keep, job.beta, log_space=job.log_space,
                                finite=job.check_finite, nonnegative=job.nonnegative)
    _validate.check_state_features(state, kf.shape[-1], job.map_name)
    size = qf.shape[-2] if form == "parallel" else job.chunk_size  # parallel: one chunk, the UT transform over all
    if job.feature_gate is not None:  # per-feature gates (KDA, kinds/kda/forms.py); a decay adds to every feature's
        _validate.check_gate_features(job.feature_gate, kf.shape[-1])
        gate = job.feature_gate
        if job.log_decay is not None:
            gate = gate.to(torch.float64) + job.log_decay.unsqueeze(-1)
        if form == "recurrent":
            return kda_recurrent(qf, kf, job.v, beta=beta, log_gate=gate, state=state)
        assert size is not None
        return kda_chunked(qf, kf, job.v, beta=beta, log_gate=gate, state=state, chunk_size=size, sweeps=job.sweeps)
    if form == "recurrent":
        return delta_recurrent(qf, kf, job.v, beta=beta, log_decay=job.log_decay, state=state)
    assert size is not None
    return delta_chunked(qf, kf, job.v, beta=beta, log_decay=job.log_decay, state=state, chunk_size=size,
                         sweeps=job.sweeps)


def run_composed(job: Job, form: str, native: bool = False) -> Result:
    """The window's exact part beside a linear part of another kind (a decay or gate, the delta rule, KDA): the
    exact part alone, the linear op of that kind on the stream delayed by W, one combiner
    (:mod:`linattn.exact.forms.composed`). Causal. Log-space maps: the delta rule reads each token at its own
    scale (its normalisation cancels it); an additive part reads key rows stored at the exact part's scales."""
    if form == "recurrent" and job.q.shape[-2] > 1:  # token by token: each step sees O(W + S) exact keys
        return _token_by_token(job, native)
    state = job.state
    assert state is None or isinstance(state, WindowAttentionState)
    delta = job.beta is not None
    keep = job.keep if job.keep is not None else torch.ones(job.k.shape[:-1], dtype=torch.bool, device=job.k.device)
    # the exact part alone: with the delta rule, its softmax sums (a factor turns off the mass), which need no
    # log-scale (the delta rule's unit features cancel a log-space map's per-token scale)
    factor = job.window_factor if not delta or job.window_factor is not None else torch.ones((), dtype=job.q.dtype)
    hybrid = _hybrid(job, factor, log_space=job.log_space and not delta, native=native)
    # q and every key mapped (and checked) once, by the exact part (explicit weights: where it needs features, for
    # the mass or the log-scales): the linear part reads those features
    if form == "chunked":
        assert job.chunk_size is not None
        parts = causal_window_parts(hybrid, job.q, job.k, job.v, job.keep, state, job.chunk_size, linear_part=False,
                                    average=delta)
    else:  # explicit weights over O(W + S) keys a query
        parts = exact_parallel(hybrid, job.q, job.k, job.v, keep, state)
    rows = (parts.ring_features if state is not None else None, parts.features)
    mapped = job  # the γ form of an ordinary map, explicit weights: the linear part maps the keys it writes
    if form == "chunked" or maps_features(hybrid):
        _validate.check_state_features(state.linear if state is not None else None, parts.features.shape[-1],
                                       job.map_name)  # here, where the map is still named
        mapped = replace(job, fmap=nn.Identity(), q=parts.qf, check_finite=False, nonnegative=False)
    linear_state = state.linear if state is not None else None
    n, skip = job.q.shape[-2], job.window
    if delta and state is None and skip < n and form == "chunked":
        # a first call: the delayed stream's first W positions hold no key and the memory starts empty, so those
        # queries read 0. The delta rule then runs on views, no delayed copies: queries and decays from W on,
        # keys, values and β up to N − W (sink keys write nothing)
        kept = keep[..., : n - skip] & (torch.arange(n - skip, device=keep.device) >= job.sinks)
        assert job.beta is not None
        linear_job = replace(mapped, q=mapped.q[..., skip:, :], k=rows[1][..., : n - skip, :],
                             v=job.v[..., : n - skip, :], keep=kept, beta=job.beta[..., : n - skip],
                             log_decay=_after(job.log_decay, skip, -1), feature_gate=_after(job.feature_gate, skip, -2),
                             state=None, return_state=True, window=0, sinks=0)
        linear_out, final = run_delta(linear_job, form, native)
        assert isinstance(final, DeltaRuleState)
        out = add_to_average(softmax_average(parts.exact), linear_out, job.window_factor, start=skip)
        return out, composed_state(parts.state, final, job.k, job.v, keep, job.beta)  # its token count set there
    keys, values, kept, betas = delayed_stream(state, rows, job.v, keep, job.beta, job.window, job.sinks)
    if delta:
        linear_job = replace(mapped, k=keys, v=values, keep=kept, beta=betas, state=linear_state, return_state=True,
                             window=0, sinks=0)
        linear_out, final = run_delta(linear_job, form, native)
    else:  # the numerator and Σφ(k) in one pass: values [v | 1], unnormalised
        assert linear_state is None or isinstance(linear_state, LinearAttentionState)
        if parts.r is not None:  # log-space: row i (key i − W) stored at R_i, the scale query i reads it at
            keys = hybrid.stored(keys.masked_fill(~kept.unsqueeze(-1), NEG_INF), parts.r)
            mapped = replace(mapped, log_space=False, key_scales=parts.r)
        augmented = torch.cat([values, kept.unsqueeze(-1).to(values.dtype)], dim=-1)  # (..., N, Dv + 1)
        summed = with_sums(linear_state, job.log_space) if linear_state is not None else None
        linear_job = replace(mapped, k=keys, v=augmented, keep=kept, normalize=False, return_state=True, window=0,
                             sinks=0, state=summed)
        run = run_gated if job.feature_gate is not None else run_plain
        linear_out, final = run(linear_job, form)
        assert isinstance(final, LinearAttentionState)
        final = without_sums(final)
    assert isinstance(final, (LinearAttentionState, DeltaRuleState))
    if delta:
        out = add_to_average(softmax_average(parts.exact), linear_out, job.window_factor)
    else:  # both parts in query t's stored scale c_t + R_t for log-space maps
        out = hybrid.combine((linear_out[..., :-1], linear_out[..., -1]), parts.exact, parts.c, parts.r)
    return out, composed_state(parts.state, final, job.k, job.v, keep, job.beta)


def _hybrid(job: Job, factor: torch.Tensor | None, log_space: bool | None = None, row_scale: bool = False,
            native: bool = False) -> Hybrid:
    """The window's options; ``row_scale``: a log-space map's features read at each row's own maximum, as an
    ordinary map's (for the delta family, whose unit rows cancel each row's scale). ``native``: the Hedgehog map's
    activation and the band's softmax average in C++ where no gradient is needed (backends/native/forms.py)."""
    fmap, checks = job.fmap, job.checks()
    log_space = job.log_space if log_space is None else log_space  # False: the features as the map returns them
    hedgehog = fmap if native and type(fmap) is HedgehogFeatureMap and not any(checks.values()) else None

    def features(x: torch.Tensor, is_query: bool) -> torch.Tensor:
        made = native_forms.hedgehog_features(hedgehog, x, is_query) if hedgehog is not None else None
        mapped = made if made is not None else map_features(fmap, x, is_query=is_query, **checks)
        return stabilise_queries(mapped)[0] if row_scale else mapped

    return Hybrid(features, log_space=log_space and not row_scale, window=job.window, sinks=job.sinks,
                  factor=factor, scale=job.softmax_scale, eps=job.eps, min_denom=job.min_denom,
                  band=native_forms.band_average if native else None)


def _after(x: torch.Tensor | None, t: int, dim: int) -> torch.Tensor | None:
    """Tokens t … of a per-token tensor (its token dimension ``dim``); None stays."""
    return x.narrow(dim, t, x.shape[dim] - t) if x is not None else None


def _at(x: torch.Tensor | None, t: int, dim: int) -> torch.Tensor | None:
    """Token t of a per-token tensor (its token dimension ``dim``), kept as a length-1 dimension; None stays."""
    return x.narrow(dim, t, 1) if x is not None else None


def _token_by_token(job: Job, native: bool) -> Result:
    """:func:`run_composed` one token at a time, each continuing the state the one before left."""
    outs, state = [], job.state
    for t in range(job.q.shape[-2]):
        step = replace(job, q=job.q[..., t : t + 1, :], k=job.k[..., t : t + 1, :], v=job.v[..., t : t + 1, :],
                       keep=_at(job.keep, t, -1), state=state, log_decay=_at(job.log_decay, t, -1),
                       feature_gate=_at(job.feature_gate, t, -2), beta=_at(job.beta, t, -1))
        out, state = run_composed(step, "recurrent", native)
        outs.append(out)
    return torch.cat(outs, dim=-2), state


Runner = Callable[[Job], Result]


def torch_runner(route: Route, causal: bool) -> Runner:
    """The pure-PyTorch runner of ``route``."""
    if route.kind == "window":
        return lambda job: run_window(job, route.form)
    if route.kind == "composed":
        return lambda job: run_composed(job, route.form)
    if route.kind == "delta":
        return lambda job: run_delta(job, route.form)
    if route.kind == "sparse":
        return lambda job: run_sparse(job, route.form)
    if route.kind == "gated":
        return lambda job: run_gated(job, route.form)
    if route.form == "chunked" and not causal:
        return run_noncausal_chunked
    return lambda job: run_plain(job, route.form)


def native_job_reasons(job: Job) -> list[str]:
    """Why a job runs on the torch forms although the native backend was chosen: what is known only with the
    tensors (gradients, the values' width); [] when the kernels take it."""
    found = native_forms.grad_reasons(job.q, job.k, job.v, job.beta, job.log_decay, job.feature_gate,
                                      job.window_factor) + native_forms.value_reasons(job.v.shape[-1], job.v.dtype)
    return found + _sparse_native_reasons(job) if job.sparse_cache is not None else found


def _sparse_native_reasons(job: Job) -> list[str]:
    """Why a call with a sparse cache has no composed route for the native kernels' linear part: it has one where
    some head keeps no pair, or (a first call without padding) every head keeps every pair or none."""
    if _sparse_route(job, "chunked") is not None:
        return []
    return [f"sparse_cache: every head keeps pairs and some head's budget is not every pair of {job.q.shape[-2]} "
            "tokens in a first call without padding (or the score is the oracle, or a linear weight is not 1): the "
            "sparse form runs on the torch forms"]


def native_runner(route: Route, causal: bool, forced: bool) -> Runner:
    """The runner of ``route`` on the native CPU kernels (:mod:`linattn.backends.native`): plain attention (causal
    or not) and the delta rule whole, the window's composition with the delta rule with its linear part native (the
    exact part on the torch forms). A job the kernels do not take (gradients needed, a value width they lack) runs
    on the torch forms, or raises when the backend was asked for by name; on the torch forms the chunked delta
    family's loops over the chunks still run in C++ (:data:`linattn.backends.native.forms.SWEEPS`, which fall back
    to torch where they cannot)."""
    torch_run = torch_runner(route, causal)

    def run(job: Job) -> Result:
        found = native_job_reasons(job)
        if found and forced:
            raise native_refusal(found)
        if found:
            return torch_run(replace(job, sweeps=native_forms.SWEEPS))
        if route.kind == "plain":
            return native_forms.additive(job) if causal else native_forms.noncausal(job)
        if route.kind == "delta":
            return run_delta(job, route.form, native=True)
        if route.kind == "sparse":
            return run_sparse(job, route.form, native=True)
        return run_composed(job, route.form, native=True)

    return run
