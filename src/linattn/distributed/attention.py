"""context_parallel_attention(): one sequence split across the ranks of a process group, exact, with gradients.

Rank r holds the contiguous slice r of the sequence. Everything it needs from the tokens before it is one
fixed-size summary per slice, so a call is:

1. summary of the own slice: S_r = Σ φ(k_j) v_jᵀ, z_r = Σ φ(k_j) at log-scale m_r (log-space maps: the slice's
   maximal log-feature; ordinary maps: 0), from :func:`linattn.linear_attention` with ``return_state=True``;
2. one all-gather of the summaries (world × B·H·(F·Dv + F + 1) numbers, whatever N is);
3. combine: causal — the slices before r (:func:`combine_prefix`); non-causal — every other slice
   (:func:`combine_others`); log-scales are merged exactly (max, then e^{m_j − M} ≤ 1 factors);
4. the own slice through :func:`linattn.linear_attention` with the combined state as ``initial_state``. Its
   stabilising reference is then max(running max of the slice, M), exactly the single-process one.

Backward runs through the same autograd graph; the only collective is a reduce-scatter of the gathered summaries'
gradient, which delivers to rank j the sum of what every later (causal) or other (non-causal) rank's initial
state sent back to its summary.

Non-causal attention with an ordinary map (sums at scale 1, nothing to align) needs only the total: one
all-reduce of the summaries replaces steps 2–3 (backward: one all-reduce of the gradient), and the queries read
the whole sequence's state.

The delta rule (``update="delta"``) keeps the same steps with another summary: the affine map [A | B] of the slice
(S_out = A·S_in + B), folded in rank order in step 3 (:mod:`linattn.kinds.delta.distributed`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _validate
from ..capabilities import context_parallel_reasons
from ..errors import LinearAttentionError
from ..features import NEG_INF, FeatureMapLike, is_log_space, repeat_kv_heads, resolve_feature_map, scale_between
from ..forms import FORMS
from ..functional import linear_attention
from ..kinds.kda import distributed as _delta
from ..state import DeltaRuleState, LinearAttentionState
from . import _exchange


def _after(g: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ_{i > j} g_i along ``dim`` for every j (0 for the last): a suffix sum, never a difference of two long
    cumulative sums."""
    suffix = g.flip(dim).cumsum(dim).flip(dim)  # Σ_{i ≥ j} g_i
    return torch.cat([suffix.narrow(dim, 1, g.shape[dim] - 1), torch.zeros_like(suffix.narrow(dim, 0, 1))], dim=dim)


def _weighted_sum(
    kv: torch.Tensor, k_sum: torch.Tensor, log_weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_j e^{lw_j} (S_j, z_j) kept at log-scale M = max_j lw_j, or at ``scale`` (≥ every lw_j) when given; -inf
    log-weights drop out (empty: M = -inf)."""
    # M rounded to the state dtype before the weights are formed against it, so that the sums are exact at the
    # scale the state records (with decays, M is no longer one of the fp32 shifts; at |M| ≈ 640 an fp32 ulp of M
    # would otherwise be a 3e-5 relative error of the sums)
    top = (log_weight.amax(0) if scale is None else scale.to(torch.float64)).to(kv.dtype).to(torch.float64)  # (...)
    weight = scale_between(log_weight, top.unsqueeze(0)).to(kv.dtype)  # (W, ...), every factor ≤ 1 (+ 1 ulp)
    # multiply-and-sum over all W slices, zero weights included: the gathered tensor stays in this rank's graph,
    # so every rank runs the backward collective
    combined_kv = (weight[..., None, None] * kv).sum(0)  # (..., F, Dv)
    combined_k_sum = (weight[..., None] * k_sum).sum(0)  # (..., F)
    return combined_kv, combined_k_sum, top.to(kv.dtype)


def combine_prefix(
    kv: torch.Tensor,
    k_sum: torch.Tensor,
    shift: torch.Tensor,
    rank: int,
    *,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state before slice ``rank``: slices 0..rank-1 combined in order.

    ``kv`` (W, ..., F, Dv), ``k_sum`` (W, ..., F), ``shift`` (W, ...): each slice's sums at log-scale shift
    (true sums = kv·e^shift, -inf for a slice with no visible key). ``log_decay`` (W, ...) ≤ 0: a slice's total
    log-decay Σ g_t over its tokens (scalar decays), so that slice j reaches slice ``rank`` scaled by
    e^{Σ_{j<i<rank} g_i}. Returns (kv, k_sum, shift) of the combined state, shift = max_j of the scales (with
    decays: of the undecayed ones, the scale of ``linear_attention``'s own state after those tokens).
    """
    world = kv.shape[0]
    before = torch.arange(world, device=kv.device) < rank  # (W,)
    index_shape = (world,) + (1,) * (shift.dim() - 1)
    log_weight = shift.to(torch.float64)
    if log_decay is not None:
        # decay from the end of slice j to the start of slice `rank`: the sum of g_i over j < i < rank, formed in
        # fp64 as a suffix sum of the slices in between (never a difference of two long cumulative sums)
        inside = torch.where(before.view(index_shape), log_decay.to(torch.float64), 0.0)
        log_weight = log_weight + _after(inside, 0)  # Σ_{j < i < rank} g_i
    log_weight = torch.where(before.view(index_shape), log_weight, NEG_INF)
    scale = None
    if log_decay is not None:
        # at the largest undecayed scale, max_j shift_j, as linear_attention's state after the same tokens: it
        # reads (and adds eps) at the scale a state carries, so the same scale gives the same outputs
        scale = torch.where(before.view(index_shape), shift.to(torch.float64), NEG_INF).amax(0)
    return _weighted_sum(kv, k_sum, log_weight, scale)


def combine_others(
    kv: torch.Tensor, k_sum: torch.Tensor, shift: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summary of every slice but ``rank`` (non-causal attention: what the other ranks' keys contribute)."""
    world = kv.shape[0]
    others = torch.arange(world, device=kv.device) != rank
    log_weight = torch.where(others.view((world,) + (1,) * (shift.dim() - 1)), shift.to(torch.float64), NEG_INF)
    return _weighted_sum(kv, k_sum, log_weight)


def _rank_and_world(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise LinearAttentionError(
            "group: torch.distributed is not initialised; call torch.distributed.init_process_group(...) on every "
            "rank first (backend 'gloo' on CPU, 'nccl' on GPU)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise LinearAttentionError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the given group; call "
            "context_parallel_attention only on the group's ranks"
        )
    return rank, dist.get_world_size(group)


def _slice_summary(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: Any, mask: Any, options: dict[str, Any],
    log_decay: torch.Tensor | None = None,
) -> LinearAttentionState:
    """The own slice's sums (q-head layout, as linear_attention's initial_state wants them).

    One query token stands in for q: it fixes the head layout (grouped-query attention) and the dtype checks, and
    its output (1×F×Dv work) is discarded. Non-causal, so the sums sit at the slice's maximal log-scale.

    With a decay (``log_decay`` g, (..., H, N) fp64) key j reaches the end of the slice weighted by
    w_j = e^{Σ_{j<i<N} g_i} (the last key 1, so no weight underflows them all): the values carry w_j and one more
    column holds w_j itself, so that the non-causal sums are Σ φ(k_j)(w_j v_j)ᵀ and, in that column, Σ w_j φ(k_j).
    The weights are per query head, so grouped key/value heads are repeated first.
    """
    if log_decay is None:
        _, state = linear_attention(
            q[..., :1, :], k, v, causal=False, feature_map=fmap, key_padding_mask=mask, return_state=True, **options
        )
        return state
    weight = _after(log_decay, -1).exp().to(v.dtype)  # in fp64, then the values' dtype
    if k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)
    weight = weight.unsqueeze(-1)  # (..., H, N, 1)
    weighted = torch.cat([v * weight, weight.expand(*v.shape[:-1], 1)], dim=-1)  # (..., H, N, Dv + 1)
    _, state = linear_attention(
        q[..., :1, :], k, weighted, causal=False, feature_map=fmap, key_padding_mask=mask, return_state=True,
        **options,
    )
    return LinearAttentionState(state.kv[..., :-1], state.kv[..., -1], state.shift, state.num_tokens)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    causal: bool = False,
    feature_map: FeatureMapLike = "elu",
    key_padding_mask: torch.Tensor | None = None,
    normalize: bool | None = None,
    eps: float = 1e-6,
    min_denom: float | None = None,
    chunk_size: int | None = None,
    decay: Any = None,
    log_gate: torch.Tensor | None = None,
    update: str = "add",
    beta: Any = None,
    validate: bool = True,
) -> torch.Tensor:
    """Linear attention over a sequence split across the ranks of ``group``: this rank's slice of the output.

    Rank r passes its contiguous slice of the sequence: q ``(..., N_r, Dk)``, k ``(..., N_r, Dk)``, v
    ``(..., N_r, Dv)`` (k/v may have fewer heads, as in :func:`linattn.linear_attention`), and ``key_padding_mask``
    ``(..., N_r)`` for those keys. Slices may be uneven (each N_r ≥ 1) and are ordered by rank. The result is
    ``(..., N_r, Dv)``, equal — to rounding — to rows of ``linear_attention`` on the concatenated sequence; so are
    the gradients of q, k, v and of the feature map's parameters summed over ranks (each rank's backward delivers
    its share; sum them as data-parallel training does).

    Communication per call: forward one all-gather of world × B·H·(F·Dv + F + 1) numbers in the state dtype (fp32
    for fp16/bf16/fp32 inputs, fp64 for fp64), independent of N; backward one reduce-scatter of the same size.
    Non-causal with an ordinary (not log-space) map: one all-reduce of B·H·(F·Dv + F + 1) numbers each way.
    ``validate=True`` (default) adds a small all-gather of 20 int64 per rank before it, so that ranks whose shapes
    disagree raise a clear error everywhere instead of corrupting the collective; ``validate=False`` folds the
    header into the one all-gather (empty slices and disagreeing options still raise on every rank; shapes and the
    ``update`` rule, which change the state size, must then agree — gloo aborts the process otherwise).

    ``decay`` (γ, a float or one per query head) and ``log_gate`` (this rank's slice of the per-token log-decays,
    (..., N_r)), causal only, as in :func:`linattn.linear_attention`: each slice's summary is then its decayed sums
    plus its total log-decay (B·H more numbers), and slice j reaches rank r scaled by the decays of the slices in
    between (:func:`combine_prefix`). Per-feature gates (``log_gate`` (..., N_r, F)) of the additive update are not
    split yet and raise; with the delta rule (KDA) they are.

    ``update="delta"`` with ``beta`` (a float, or this rank's slice (..., N_r) per token and head), causal, as in
    :func:`linattn.linear_attention` (``decay``/``log_gate`` per token: Gated DeltaNet): the summary of a slice is
    the affine map it applies to the state, S_out = A·S_in + B, A (F×F) and B (F×Dv), so the all-gather and the
    reduce-scatter carry world × B·H·F·(F + Dv) numbers; rank r folds the maps of slices 0..r−1 in order and runs
    its slice from that state (linattn.kinds.delta.distributed). ``normalize`` defaults to True for ``update="add"``
    and False for the delta rule, which refuses True.

    Every rank of the group must make the same calls in the same order, and every rank must run backward through
    every call whose output needs a gradient (as with DDP). Random feature maps must be equal on every rank (seed
    them, or pass one module): the header carries a checksum of the map and a mismatch raises.

    >>> # on each of 2 ranks, after torch.distributed.init_process_group("gloo", ...):
    >>> # x = torch.randn(1, 4, 1000, 32); part = torch.tensor_split(x, 2, dim=-2)[rank]
    >>> # out = context_parallel_attention(part, part, part, causal=True)   # (1, 4, N_rank, 32)
    """
    rank, world = _rank_and_world(group)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(f"{name}: expected a torch.Tensor of shape (..., N, D), got {seen}")
    if normalize is None:
        normalize = update != "delta"
    options: dict[str, Any] = {"normalize": normalize, "eps": eps, "min_denom": min_denom}
    fmap: Any = None
    state: LinearAttentionState | None = None
    transition: torch.Tensor | None = None  # the delta rule's summary [A | B] (..., F, F + Dv)
    total_decay: torch.Tensor | None = None
    error: LinearAttentionError | None = None
    # local checks run before any collective and are reported in the header: a rank that raised alone would leave
    # the others waiting in the collective
    try:
        fmap = resolve_feature_map(feature_map, q.shape[-1], device=q.device)
        if q.shape[-2] > 0 and k.shape[-2] > 0:
            _validate.check_options(chunk_size, eps, min_denom, "auto", FORMS)
            log_decay, per_feature = _validate.log_decay(decay, log_gate, q, k.shape[:-1], causal)
            refused = context_parallel_reasons(per_feature is not None, update=update, causal=causal)
            if refused:
                raise LinearAttentionError(refused[0])
            _validate.check_update(update, beta, causal, normalize, min_denom, log_gate, q)
            if update == "delta":
                transition = _delta.slice_transition(q, k, v, fmap, key_padding_mask, beta, log_decay, chunk_size,
                                                      per_feature)
            else:
                state = _slice_summary(q, k, v, fmap, key_padding_mask, options, log_decay)
            if log_decay is not None and state is not None:
                total_decay = log_decay.sum(-1).to(state.shift.dtype)  # (..., H): the slice's Σ g
    except LinearAttentionError as raised:
        error = raised
    batch = q.shape[:-2].numel()
    ready = state is not None or transition is not None
    features = state.feature_dim if state is not None else transition.shape[-2] if transition is not None else -1
    header = _exchange.make_header(
        {
            "q_tokens": q.shape[-2],
            "k_tokens": k.shape[-2],
            "ok": int(ready),
            "ndim": q.dim(),
            "batch": batch,
            "heads": q.shape[-3] if q.dim() > 2 else 0,
            "kv_heads": k.shape[-3] if k.dim() > 2 else 0,
            "key_dim": q.shape[-1],
            "value_dim": v.shape[-1],
            "features": features,
            "dtype": _exchange.dtype_code(q.dtype),
            "causal": int(causal),
            "normalize": int(normalize),
            "eps": _exchange.float_bits(eps),
            "min_denom": _exchange.float_bits(-1.0 if min_denom is None else min_denom),
            "mask": int(key_padding_mask is not None),
            "log_space": int(is_log_space(fmap)),
            "decay": int(decay is not None or log_gate is not None),
            "feature_map": _exchange.fingerprint(fmap) if fmap is not None else 0,
            "update": _validate.UPDATES.index(update) if update in _validate.UPDATES else -1,
        }
    )
    if validate:
        table = _exchange.gather_headers(header.to(q.device), world, group)
        _exchange.check_headers(table, rank, error, q_shape=tuple(q.shape))
    elif not ready:
        # no header exchange first: this rank cannot build a payload of the agreed size, so it can only raise
        # here (the other ranks then fail in, or time out of, the collective)
        raise error or LinearAttentionError(
            f"context_parallel_attention (rank {rank}): empty slice (q {tuple(q.shape)}, k {tuple(k.shape)}); "
            "every rank needs at least one token"
        )
    if transition is not None:  # the delta rule: [A | B] (..., F, F + Dv) flattened
        payload = transition.reshape(-1)
    else:
        assert state is not None
        # (..., F, Dv) + (..., F) + (...) flattened into one (P,) payload
        parts = [state.kv.reshape(-1), state.k_sum.reshape(-1), state.shift.reshape(-1)]
        if total_decay is not None:  # (...) after the shifts: the slice's total log-decay
            parts.append(total_decay.reshape(-1))
        payload = torch.cat(parts)
        if not causal and not is_log_space(fmap):
            total_tokens = int(table[:, _exchange.FIELDS.index("k_tokens")].sum()) if validate else None
            return _noncausal_all_reduce(q, k, v, payload, state, header, total_tokens, rank, world, group, fmap,
                                         chunk_size, options)
    gathered, headers_inline = _exchange.GatherSummaries.apply(
        payload, None if validate else header, world, group
    )
    if not validate:
        table = headers_inline
        _exchange.check_headers(table, rank, error, q_shape=tuple(q.shape))
    tokens = table[:, _exchange.FIELDS.index("k_tokens")].cpu()
    if transition is not None:  # the slices before this one, folded in order: S ← A_j·S + B_j
        prefix = _delta.prefix_state(gathered.reshape(world, *transition.shape), rank, transition.shape[-2])
        delta_out: torch.Tensor = linear_attention(
            q, k, v, causal=True, feature_map=fmap, key_padding_mask=key_padding_mask, chunk_size=chunk_size,
            initial_state=DeltaRuleState(prefix, int(tokens[:rank].sum())), decay=decay, log_gate=log_gate,
            update="delta", beta=beta, **options,
        )
        return delta_out
    assert state is not None
    rows = state.kv.shape[:-2]  # (...) batch × heads
    size_kv, size_k = state.kv.numel(), state.k_sum.numel()
    kv = gathered[:, :size_kv].reshape(world, *state.kv.shape)  # (W, ..., F, Dv)
    k_sum = gathered[:, size_kv : size_kv + size_k].reshape(world, *state.k_sum.shape)  # (W, ..., F)
    size_rows = state.shift.numel()
    shift = gathered[:, size_kv + size_k : size_kv + size_k + size_rows].reshape(world, *rows)  # (W, ...)
    log_decays = None
    if total_decay is not None:
        log_decays = gathered[:, size_kv + size_k + size_rows :].reshape(world, *rows)  # (W, ...)
    if causal:
        combined = combine_prefix(kv, k_sum, shift, rank, log_decay=log_decays)
        prefix_tokens = int(tokens[:rank].sum())
    else:
        combined = combine_others(kv, k_sum, shift, rank)
        prefix_tokens = int(tokens.sum()) - k.shape[-2]
    initial = LinearAttentionState(*combined, num_tokens=prefix_tokens)
    out: torch.Tensor = linear_attention(
        q,
        k,
        v,
        causal=causal,
        feature_map=fmap,
        key_padding_mask=key_padding_mask,
        initial_state=initial,
        chunk_size=chunk_size,
        decay=decay,
        log_gate=log_gate,
        **options,
    )
    return out


def _noncausal_all_reduce(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    payload: torch.Tensor,
    state: LinearAttentionState,
    header: torch.Tensor,
    total_tokens: int | None,
    rank: int,
    world: int,
    group: Any,
    fmap: Any,
    chunk_size: int | None,
    options: dict[str, Any],
) -> torch.Tensor:
    """Non-causal attention with an ordinary map (sums at scale 1): one all-reduce of the summaries gives the
    whole sequence's state, 2·(W−1)/W·P numbers per rank in a ring instead of the all-gather's (W−1)·P. The
    queries then read that state through one key that is masked out (it adds nothing)."""
    extra = None if total_tokens is not None else _exchange.header_moments(header, payload.dtype, payload.device)
    total, moments = _exchange.ReduceSummaries.apply(payload, extra, group)
    if total_tokens is None:
        total_tokens = _exchange.check_moments(moments, header, world, rank)
    size_kv, size_k = state.kv.numel(), state.k_sum.numel()
    whole = LinearAttentionState(
        total[:size_kv].reshape(state.kv.shape),  # (..., F, Dv)
        total[size_kv : size_kv + size_k].reshape(state.k_sum.shape),  # (..., F)
        torch.zeros_like(state.shift),
        num_tokens=total_tokens,
    )
    masked = torch.zeros(1, dtype=torch.bool, device=k.device)  # broadcasts to (..., 1): the one key is masked
    out: torch.Tensor = linear_attention(
        q, k[..., :1, :], v[..., :1, :], causal=False, feature_map=fmap, key_padding_mask=masked,
        initial_state=whole, chunk_size=chunk_size, **options,
    )
    return out
