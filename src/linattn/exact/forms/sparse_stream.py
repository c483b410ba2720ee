"""The sparse cache beside a linear part of any kind: the pairs of a call, their entry times, the boundary
decisions and the write stream the linear op runs on (see :mod:`.sparse_composed` for the definition).

A call's pairs are the rows X = [the carried cache's slots, the sinks not in the window buffer, the window buffer,
this call's tokens]. Every row j has an entry time e_j (the step at which its pair is written into the linear
state, :data:`~.boundary.NEVER` if not in this call), fixed for the steps before a boundary once it is decided.
The write stream of steps lo … hi − 1 is, step after step, the slots

    [the pairs leaving the cache at step t (a boundary), ascending by position] + [key t − W]

each slot a row of X written (features, value, β) when its entry time is t, else nothing; the step's decay a_t
sits on its first slot (every other slot decays by 1), and query t reads at the slot of key t − W, the last of its
step. So the linear op run on the stream from the carried state is the definition's linear part, in any of the op's
own forms (recurrent, chunked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...features import scale_between, unit_rows
from ...kinds.additive.forms.chunked import causal_chunked_attention
from ...kinds.additive.forms.recurrent import recurrent_attention
from ...kinds.delta.forms import Sweeps, delta_chunked, delta_recurrent
from ...kinds.gated.forms import gated_chunked_attention, gated_recurrent_attention
from ...kinds.kda.forms import kda_chunked, kda_recurrent
from ...state import DeltaRuleState, LinearAttentionState
from .boundary import NEVER, gather_rows, in_cache, slot_of, sorted_table
from .composed import with_sums, without_sums

Linear = LinearAttentionState | DeltaRuleState


@dataclass
class LinearPart:
    """The linear part beside the cache: the update rule and this call's per-token decays and write strengths.

    ``log_decay`` (..., N) fp64 one log-decay per token (a fixed rate and/or a per-token gate) or None;
    ``feature_gate`` (..., N, F) per-feature log-gates or None; ``beta`` (..., N) the delta rule's write strengths
    (masked tokens 0) or None for the additive update. ``carry``: None, or a faster way (the native kernels, given
    by the caller) to the delta rule's state after a stream that nothing reads, the boundaries' carry:
    ``carry(kf (..., M, F) unit rows, values (..., M, Dv), beta (..., M), log_gates (..., M, 1 | F) fp64 or None,
    state)`` → the state after the M slots, or None where it does not take them. ``decide``: None, or a faster way
    (the native kernels) to a call's boundary decisions beside the delta rule under the recall score
    (:func:`linattn.backends.native.forms.sparse_delta_decide`'s arguments and results, None where it does not
    take them). ``read``: None, or a faster way (the native kernels) to the delta rule over a stream that is read:
    ``read(qf, kf, values, beta, log_gates, state)`` → (the read-outs, the state), or None where it does not take
    them. ``sweeps``: the chunked forms' loops over the chunks (:class:`linattn.kinds.delta.forms.Sweeps`; None:
    the torch ones)."""

    log_decay: torch.Tensor | None
    feature_gate: torch.Tensor | None
    beta: torch.Tensor | None
    eps: float
    min_denom: float | None
    carry: Callable[..., DeltaRuleState | None] | None = None
    decide: Callable[..., tuple[torch.Tensor, ...] | None] | None = None
    read: Callable[..., tuple[torch.Tensor, DeltaRuleState] | None] | None = None
    sweeps: Sweeps | None = None

    @property
    def delta(self) -> bool:
        return self.beta is not None

    def features(self, phi: torch.Tensor) -> torch.Tensor:
        """The linear part's feature rows from φ: the delta rule's unit rows φ̂, the additive update's φ."""
        return unit_rows(phi) if self.delta else phi

    def gate(self) -> torch.Tensor | None:
        """Per-feature log-gates with the per-token log-decay folded in (..., N, F) fp64, or None."""
        if self.feature_gate is None:
            return None
        gate = self.feature_gate.to(torch.float64)
        return gate if self.log_decay is None else gate + self.log_decay.unsqueeze(-1)


@dataclass
class Pairs:
    """The rows X of a call (module docstring): positions (..., X) (−1: none), whether each is a valid pair, raw keys
    and values, φ(k) and the linear part's feature rows (0 where not valid), the delta rule's β (or None); ``base``: the
    row of the window buffer's first position ``ring_start``; the first ``slots`` rows are the carried cache."""

    pos: torch.Tensor
    valid: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    phi: torch.Tensor  # φ(k) (0 where not valid): the exact part's mass
    lin: torch.Tensor
    beta: torch.Tensor | None
    slots: int
    base: int
    ring_start: int
    carried: torch.Tensor  # (..., L) the carried cache's positions (−1: empty)
    # log-space maps beside the additive state (sparse_scales.py): φ and the feature rows are at each row's own
    # maximum ``scale`` (..., X); ``reading`` (..., N + 1) is R_{n0−1} … R_{end−1}, the scale of each step's sums
    scale: torch.Tensor | None = None
    reading: torch.Tensor | None = None

    def row_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The row of each position (..., K) or (..., b, K) (−1 for none): a slot for a carried pair older than the
        buffer."""
        shape = positions.shape
        positions = positions.reshape(*self.carried.shape[:-1], -1)
        row = self.base + positions - self.ring_start
        older = positions < self.ring_start
        if self.slots and bool(older.any()):  # a carried pair's slot, by binary search among the cache's positions
            slot, found = slot_of(positions, sorted_table(self.carried))
            row = torch.where(older, torch.where(found, slot, -1), row)
        elif not self.slots:
            row = row.masked_fill(older, -1)
        return torch.where(positions < 0, -1, row).view(shape)


def first_entries(pairs: Pairs, window: int, sinks: int) -> torch.Tensor:
    """Each row's entry time before any decision of the call: j + W for a pair not cached (not a sink, not
    padding), NEVER for the cached ones and the rest."""
    enters = pairs.valid & (pairs.pos >= sinks) & ~in_cache(pairs.pos, pairs.carried)
    return torch.where(enters, pairs.pos + window, NEVER)


@dataclass
class Stream:
    """A write stream (module docstring): the row of X each slot writes (..., M) (−1: nothing), the call token
    whose decay applies at each slot (M,), the call token read at each slot (M,) (−1: none) and the call token of
    each slot's step (M,)."""

    rows: torch.Tensor
    gate_at: torch.Tensor
    read: torch.Tensor
    step: torch.Tensor

    @staticmethod
    def join(pieces: list[Stream]) -> Stream:
        return Stream(torch.cat([p.rows for p in pieces], -1), torch.cat([p.gate_at for p in pieces]),
                      torch.cat([p.read for p in pieces]), torch.cat([p.step for p in pieces]))


def stream_piece(pairs: Pairs, entry: torch.Tensor, lo: int, hi: int, n0: int, window: int,
                 boundary: bool) -> Stream:
    """The slots of steps lo … hi − 1 (``boundary``: lo is a boundary, so the pairs leaving the cache there come
    first), from the entry times ``entry`` (..., X), final for these steps."""
    device, batch = pairs.pos.device, pairs.pos.shape[:-1]
    steps = torch.arange(lo, hi, device=device)
    key_rows = pairs.row_of((steps - window).expand(*batch, hi - lo))  # (..., T)
    writes = (key_rows >= 0) & (entry.gather(-1, key_rows.clamp(min=0)) == steps)
    key_rows = torch.where(writes, key_rows, -1)
    extra = key_rows[..., :0]
    if boundary:
        leaving = pairs.valid & (entry == lo) & (pairs.pos < lo - window)  # (..., X): dropped from the cache at lo
        count = int(leaving.sum(-1).max()) if leaving.numel() else 0
        if count:  # the leaving rows in ascending order, −1 after them: each row to its rank (O(X), no sort)
            rank = torch.where(leaving, leaving.cumsum(-1) - 1, count)  # the others to a spare last column
            index = torch.arange(leaving.shape[-1], device=device).expand_as(rank)
            extra = rank.new_full((*batch, count + 1), -1).scatter_(-1, rank, index)[..., :count]
    count = extra.shape[-1]
    tokens = steps - n0
    key_gate, extra_gate = tokens.clone(), tokens.new_full((count,), -1)
    if count:  # the step's decay on its first slot
        extra_gate[0], key_gate[0] = tokens[0], -1
    gate_at = torch.cat([extra_gate, key_gate])
    read = torch.cat([tokens.new_full((count,), -1), tokens])
    step = torch.cat([tokens[:1].expand(count), tokens])
    return Stream(torch.cat([extra, key_rows], -1), gate_at, read, step)


def _at(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x's entries at ``index`` (M,) along ``dim`` (−1 per token, −2 rows), 0 where the index is −1."""
    picked = x.index_select(dim, index.clamp(min=0))
    shape = [1] * picked.dim()
    shape[dim] = -1
    return picked * (index >= 0).view(shape).to(picked.dtype)


def _summed(part: LinearPart, kf: torch.Tensor, values: torch.Tensor, stream: Stream,
            state: Linear, slot_scales: torch.Tensor | None) -> LinearAttentionState:
    """The additive sums after the stream's slots i = 1 … M: S_M = e^{G_M}·S_0 + Σ_i e^{G_M − G_i}·φ_i v_iᵀ (and z
    alike), G the cumulative log-decay over the slots (per feature with a per-feature gate). Log-space maps: φ_i
    stored at the slot's scale ρ_i (``slot_scales`` (..., M)), the sums at ρ_M."""
    assert isinstance(state, LinearAttentionState)
    if slot_scales is not None:  # at ρ_M: the carried sums moved there, each row moved from ρ_i
        end = slot_scales[..., -1]
        carried = scale_between(state.shift, end)
        kf = kf * torch.exp(slot_scales - end.unsqueeze(-1)).unsqueeze(-1)
        state = LinearAttentionState(state.kv * carried[..., None, None], state.k_sum * carried[..., None], end,
                                     state.num_tokens)
    gate = part.gate()
    if gate is not None:
        logs = _at(gate, stream.gate_at, -2)  # (..., M, F)
    elif part.log_decay is not None:
        logs = _at(part.log_decay, stream.gate_at, -1).unsqueeze(-1)  # (..., M, 1)
    else:
        logs = kf.new_zeros(*kf.shape[:-1], 1, dtype=torch.float64)
    total = torch.cumsum(logs.to(torch.float64), dim=-2)
    carry = torch.exp(total[..., -1, :]).to(kf.dtype)  # (..., F) or (..., 1)
    weights = kf * torch.exp(total[..., -1:, :] - total).to(kf.dtype)
    kv = state.kv * carry.unsqueeze(-1) + weights.transpose(-1, -2) @ values
    return LinearAttentionState(kv, state.k_sum * carry + weights.sum(-2), state.shift, state.num_tokens)


def run_stream(part: LinearPart, pairs: Pairs, stream: Stream, qf: torch.Tensor | None, state: Linear,
               chunk_size: int | None) -> tuple[torch.Tensor | None, Linear]:
    """The linear op on ``stream`` from ``state`` (its recurrent form, or chunked with ``chunk_size``): the
    read-outs at the stream's reading slots (..., T, Dv) — with Σφ(k)'s read as a last column for the additive
    update — or None without queries ``qf`` (..., N, F), and the state after the stream."""
    if not stream.rows.shape[-1]:  # no step: nothing written or read
        width = pairs.values.shape[-1] + (0 if part.delta else 1)
        return (pairs.values.new_zeros(*pairs.values.shape[:-2], 0, width) if qf is not None else None), state
    written = (stream.rows >= 0).unsqueeze(-1)
    kf = gather_rows(pairs.lin, stream.rows) * written
    values = gather_rows(pairs.values, stream.rows) * written
    slot_scales = None  # log-space maps: each slot's row stored at its step's scale ρ = R_step (≥ the row's m)
    if pairs.scale is not None and pairs.reading is not None and not part.delta:
        slot_scales = pairs.reading.index_select(-1, stream.step + 1)  # (..., M)
        row_scales = pairs.scale.gather(-1, stream.rows.clamp(min=0))
        kf = kf * scale_between(row_scales, slot_scales, written.squeeze(-1)).unsqueeze(-1)
    if qf is None and not part.delta:  # the additive sums after the stream, in one product
        return None, _summed(part, kf, values, stream, state, slot_scales)
    queries = _at(qf, stream.read, -2) if qf is not None else kf.new_zeros(*kf.shape[:-1], pairs.lin.shape[-1])
    decay = _at(part.log_decay, stream.gate_at, -1) if part.log_decay is not None else None
    gate = part.gate()
    gate = _at(gate, stream.gate_at, -2) if gate is not None else None
    out: torch.Tensor
    if part.delta:
        assert pairs.beta is not None and isinstance(state, DeltaRuleState)
        beta = pairs.beta.gather(-1, stream.rows.clamp(min=0)) * written.squeeze(-1)
        logs = gate if gate is not None else decay.unsqueeze(-1) if decay is not None else None
        if qf is None and part.carry is not None:  # the state alone: decays and writes, nothing read
            carried = part.carry(kf, values, beta, logs, state)
            if carried is not None:
                return None, carried
        if qf is not None and part.read is not None:
            found = part.read(queries, kf, values, beta, logs, state)
            if found is not None:
                return found[0].index_select(-2, (stream.read >= 0).nonzero().squeeze(-1)), found[1]
        if gate is not None:
            if chunk_size is None:
                out, final = kda_recurrent(queries, kf, values, beta=beta, log_gate=gate, state=state)
            else:
                out, final = kda_chunked(queries, kf, values, beta=beta, log_gate=gate, state=state,
                                         chunk_size=chunk_size, sweeps=part.sweeps)
        elif chunk_size is None:
            out, final = delta_recurrent(queries, kf, values, beta=beta, log_decay=decay, state=state)
        else:
            out, final = delta_chunked(queries, kf, values, beta=beta, log_decay=decay, state=state,
                                       chunk_size=chunk_size, sweeps=part.sweeps)
        linear: Linear = final
    else:
        assert isinstance(state, LinearAttentionState)
        augmented = torch.cat([values, written.to(values.dtype)], -1)  # (..., M, Dv + 1): num and Σφ(k) at once
        summed_state, eps, floor = with_sums(state, slot_scales is not None), part.eps, part.min_denom
        rho = slot_scales.to(torch.float64) if slot_scales is not None else None  # log-space: the slots' scales
        if gate is not None:
            if chunk_size is None:
                scales = torch.cumsum(gate, dim=-2).neg_()
                if rho is not None:
                    scales = scales + rho.unsqueeze(-1)
                out, summed = gated_recurrent_attention(queries, kf, augmented, scales=scales, state=summed_state,
                                                        normalize=False, eps=eps, min_denom=floor)
            else:
                out, summed = gated_chunked_attention(queries, kf, augmented, gate=gate, ref=rho, state=summed_state,
                                                      chunk_size=chunk_size, normalize=False, eps=eps,
                                                      min_denom=floor)
        else:
            ref = torch.cumsum(decay, dim=-1).neg_() if decay is not None else None
            if rho is not None:  # ref' = ρ − G: the decayed sums at each slot's scale
                ref = rho if ref is None else rho + ref
            if chunk_size is None:
                out, summed = recurrent_attention(queries, kf, augmented, ref=ref, state=summed_state,
                                                  normalize=False, eps=eps, min_denom=floor)
            else:
                out, summed = causal_chunked_attention(queries, kf, augmented, ref=ref, state=summed_state,
                                                       chunk_size=chunk_size, normalize=False, eps=eps,
                                                       min_denom=floor)
        linear = without_sums(summed)
        if slot_scales is not None:  # sums stored at ρ_M − G_M are the decayed sums at ρ_M (the state's shift)
            linear = LinearAttentionState(linear.kv, linear.k_sum, slot_scales[..., -1].to(linear.kv.dtype),
                                          linear.num_tokens)
    if qf is None:
        return None, linear
    reading = (stream.read >= 0).nonzero().squeeze(-1)
    return out.index_select(-2, reading), linear
