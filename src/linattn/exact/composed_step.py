"""The lean step of the window beside a linear part of another kind (a decay or gate, the delta rule): one token
against preallocated buffers, in place.

Per token t (docs/window.md, "Composed linear parts"): the linear state takes token t's decay a_t and the write of
the key leaving the window (position t − W, unless a sink or padding) — for the delta rule through
:class:`~linattn.decode.DeltaDecodeStep`, which applies the decay, writes and reads in one call — then the new key
takes the leaving key's ring slot, and the output is the window's combiner: the shared normaliser for an additive
linear part (mass or γ form), γ·A + S_tᵀφ̂(q_t) for the delta rule, A the softmax average over the live exact keys
(the ring and the sinks that have left it). Memory and time per token do not grow with the tokens seen.

Log-space maps (FAVOR+ and kin): the delta rule's unit features cancel their per-token scale. An additive part
keeps its sums at the log-scale R_t, the running maximum of log φ over every kept key seen (window and sinks
included), as the chunked form does: each token's key raises R, the sums move by e^{R_old − R_new} ≤ 1, the leaving
key is written at R and the query read at its own row maximum c_t; the combiner then meets the window on the scale
c_t + R_t (:meth:`linattn.exact.Hybrid.combine`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backends import native
from ..errors import LinearAttentionError
from ..feature_maps import HedgehogFeatureMap
from ..features import (
    NEG_INF,
    finite,
    is_log_space,
    map_features,
    scale_between,
    stabilise_queries,
    stored_at,
    unit_features,
)
from ..kinds._step import _repeat_heads, check_memory, check_step_options, check_token, check_token_options
from ..kinds.delta.step import DeltaDecodeStep
from ..state import DeltaRuleState, LinearAttentionState, WindowAttentionState


def fill_slots(step: Any, state: WindowAttentionState, first: int) -> None:
    """A step's exact slots from a window state, at once: the buffered keys (positions ``first`` on) into their
    ring slots S + p mod W, the sinks into slots 0…S−1 (live once they have left the window). ``step`` holds
    ``keys``, ``values``, ``kept``, ``betas`` and ``live`` with the slots on dim −2 (−1 for the flags), its batch
    dims as the state's or flattened into one (the sparse cache's step)."""
    buffered, sunk, device = state.keys.shape[-2], state.sink_keys.shape[-2], step.keys.device
    leading = step.keys.shape[:-2]
    if buffered:  # at most W positions, so two runs of slots: from S + first mod W to the end, then from S
        keys, values = state.keys.reshape(*leading, buffered, -1), state.values.reshape(*leading, buffered, -1)
        keep = state.keep.reshape(*leading, buffered)
        betas = state.betas.reshape(*leading, buffered) if state.betas is not None else None
        start = first % step.window
        ahead = min(buffered, step.window - start)
        for source, slot, count in ((0, step.sinks + start, ahead), (ahead, step.sinks, buffered - ahead)):
            if count:
                step.keys[..., slot : slot + count, :] = keys[..., source : source + count, :]
                step.values[..., slot : slot + count, :] = values[..., source : source + count, :]
                step.kept[..., slot : slot + count] = keep[..., source : source + count]
                if betas is not None:
                    step.betas[..., slot : slot + count] = betas[..., source : source + count]
                step.live[slot : slot + count] = True
    if sunk:
        step.keys[..., :sunk, :] = state.sink_keys.reshape(*leading, sunk, -1)
        step.values[..., :sunk, :] = state.sink_values.reshape(*leading, sunk, -1)
        step.kept[..., :sunk] = state.sink_keep.reshape(*leading, sunk)
        step.live[:sunk] = torch.arange(sunk, device=device) < first


def fused_arguments(step: Any, gates: Any, rows: int) -> tuple[Any, ...] | None:
    """The arguments a step's :meth:`fused_token` passes to :func:`linattn.backends.native` ``layer_token`` after
    q, k and v: the Hedgehog map's (queries, then keys), the gates' (``gates``: a
    :class:`~linattn.nn.KeyGates` with β and a per-token gate, its parameters read in place, its read-out weight's
    ρ where it has one; None: the step's fixed β), the fixed β per row and the fixed log-rate per row (fp64, or
    None); None where the fused call does not apply (no C++ token or Hedgehog map in C++ on this step, other gates,
    another dtype)."""
    if step._hedgehog is None:
        return None
    query, key = step._hedgehog[True], step._hedgehog[False]
    maps = (query[0], query[1], key[0], key[1], key[2], key[3], key[4])
    dtype = query[0].dtype
    if gates is None:
        gate_args: tuple[Any, ...] = (None, None, None, None, None)
    else:
        beta_w, beta_b = getattr(gates, "beta_weight", None), getattr(gates, "beta_bias", None)
        gate_w, gate_b = getattr(gates, "gate_weight", None), getattr(gates, "gate_bias", None)
        readout = getattr(gates, "readout", None)
        if getattr(gates, "gate", None) != "token" or beta_w is None or beta_b is None or gate_w is None \
                or gate_b is None or beta_w.dtype != dtype or beta_w.device != query[0].device \
                or (readout is not None and (readout.dtype != dtype or readout.shape != beta_b.shape)):
            return None
        heads_kv, half = beta_w.shape
        if 2 * half != step.keys.shape[-1]:  # gates made for another head size
            return None
        gate_args = (beta_w.detach(), beta_b.detach(), gate_w.detach().reshape(heads_kv, half),
                     gate_b.detach().reshape(heads_kv), None if readout is None else readout.detach())
    return (*maps, *gate_args, step._fixed_beta.reshape(rows), step._fused_log_rate)


def fused_takes(arguments: tuple[Any, ...] | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                shape: tuple[int, int, int, int], dtype: torch.dtype) -> bool:
    """Whether a step's fused call takes this token: :func:`fused_arguments` made, q (B, H, 1, d) for ``shape``
    (B, H, d, Dv) in the step's ``dtype``, k and v one token of key heads that divide H (and are the gates')."""
    batch, heads, dim, values = shape
    return not (arguments is None or q.shape != (batch, heads, 1, dim) or q.dtype != dtype
                or k.dim() != 4 or k.shape[0] != batch or k.shape[2] != 1 or heads % k.shape[1]
                or (arguments[7] is not None and arguments[7].shape[0] != k.shape[1])
                or v.shape[:3] != k.shape[:3] or v.shape[3] != values or k.dtype != q.dtype or v.dtype != q.dtype)


class FusedMemo:
    """What :func:`fused_call` keeps on a step: the gates it was made for, their :func:`fused_arguments` (the map's
    and the gates' parameters themselves, not copies) and the token shapes already checked. A plain object, so that
    the step's byte count (:meth:`linattn.hf_cache.StateLayer.nbytes`) does not count the model's parameters."""

    __slots__ = ("gates", "arguments", "checked")

    def __init__(self, gates: Any, arguments: tuple[Any, ...] | None) -> None:
        self.gates, self.arguments = gates, arguments
        self.checked: dict[Any, bool] = {}


def fused_call(step: Any, gates: Any, rows: int, applies: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               shape: tuple[int, int, int, int], dtype: torch.dtype) -> tuple[Any, ...] | None:
    """A step's :func:`fused_arguments` for ``gates`` (made once per gates, kept in ``step._fused``, a
    :class:`FusedMemo`; none unless ``applies``) where :func:`fused_takes` takes q, k and v (asked once per shapes
    and dtypes), else None."""
    memo = step._fused
    if memo is None or memo.gates is not gates:
        memo = step._fused = FusedMemo(gates, fused_arguments(step, gates, rows) if applies else None)
    if memo.arguments is None:
        return None
    seen = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
    takes = memo.checked.get(seen)
    if takes is None:
        takes = memo.checked[seen] = fused_takes(memo.arguments, q, k, v, shape, dtype)
    return memo.arguments if takes else None


class ComposedDecodeStep:
    """The window op with a decayed, gated or delta-rule linear part, one token at a time, from the
    :class:`~linattn.WindowAttentionState` such a call returned (batch shape (B, H)); the options as given to
    ``linear_attention`` (``eps``, ``window_factor``, ``softmax_scale``, a fixed ``beta`` and ``decay``).
    Per-token write strengths and log-decays (per token (B, H), or per feature (B, H, F)) come with each call."""

    lean = True  # a kept token of a delta-rule part takes _delta_token (False: the general path, for comparison)
    native = True  # _delta_token's arithmetic in C++ where it builds (False: the torch code, the reference)
    fuse = True  # fused_token takes a layer's token in one C++ call where it applies (False: it declines)

    def __init__(self, fmap: nn.Module, state: WindowAttentionState, options: dict[str, Any]) -> None:
        check_memory(state, WindowAttentionState, "ComposedDecodeStep")
        check_step_options(options.get("eps", 1e-6), state.window, state.sinks, options.get("window_factor"),
                           options.get("softmax_scale"))
        linear = state.linear
        self.fmap, self.options = fmap, dict(options)
        self.eps = float(options.get("eps", 1e-6))
        batch, heads, features, values = linear.kv.shape
        dtype, device = linear.kv.dtype, linear.kv.device
        dim = state.keys.shape[-1]
        self.scale = dim**-0.5 if options.get("softmax_scale") is None else float(options["softmax_scale"])
        self.window, self.sinks, self.num_tokens = state.window, state.sinks, state.num_tokens
        factor = options.get("window_factor")
        self.gamma = None if factor is None else torch.broadcast_to(
            torch.as_tensor(factor, dtype=dtype, device=device), (batch, heads)).reshape(batch, heads, 1).clone()
        self.delta: DeltaDecodeStep | None = None
        self.log_rate: torch.Tensor | None = None
        self.log_space = is_log_space(fmap)
        self.shift: torch.Tensor | None = None  # log-space additive part: the sums' log-scale R (B, H)
        self._native: Any = None  # the C++ token (linattn.backends.native) for a delta-rule part on the CPU
        self._hedgehog: dict[bool, tuple[Any, ...]] | None = None
        self._fused: FusedMemo | None = None  # what fused_call keeps
        if isinstance(linear, DeltaRuleState):
            self.delta = DeltaDecodeStep(fmap, linear, beta=options.get("beta"), decay=options.get("decay"))
            if self.native and device.type == "cpu":
                self._native = native.module()
            # the Hedgehog map's features in C++ too: this exact map (a subclass may change them), per head or
            # shared, its weights in the step's dtype; the arguments of its call for queries and keys, kept
            if self._native is not None and type(fmap) is HedgehogFeatureMap and fmap.num_heads in (None, heads) \
                    and fmap.weight.dtype == dtype and fmap.head_dim == dim:
                weight, bias, key = fmap.weight.detach(), fmap.bias.detach(), 0 if fmap.tied else 1
                common = (fmap.GATE_LIMIT, torch.finfo(dtype).tiny)
                self._hedgehog = {True: (weight[0], bias[0], None, *common),
                                  False: (weight[key], bias[key], fmap.gate.detach()[0], *common)}
            self._fixed_beta = torch.full((batch, heads), self.delta.beta, dtype=dtype, device=device)
            rate = self.delta.log_rate  # (H, 1) fp64 or None: per row for the fused call
            self._fused_log_rate = None if rate is None else rate.reshape(1, heads).expand(batch, heads).reshape(
                batch * heads).contiguous()
        else:
            self.kv = linear.kv.detach().clone(memory_format=torch.contiguous_format)
            self.k_sum = linear.k_sum.detach().clone()
            if options.get("decay") is not None:
                rate = torch.as_tensor(options["decay"], dtype=torch.float64, device=device)
                self.log_rate = torch.log(rate).expand(heads).reshape(1, heads, 1).clone()
        slots = self.sinks + self.window  # sink slots first, then the ring: position p in slot S + p mod W
        self.keys = torch.zeros(batch, heads, slots, dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, slots, values, dtype=dtype, device=device)
        self.kept = torch.zeros(batch, heads, slots, dtype=torch.bool, device=device)  # a real (unmasked) key
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)  # an exact key now
        self.betas = torch.zeros(batch, heads, slots, dtype=dtype, device=device)
        first = self.num_tokens - state.keys.shape[-2]  # the oldest buffered position
        fill_slots(self, state, first)
        if self.log_space and self.delta is None:  # R starts ≥ the state's scale and every buffered key
            self.shift = linear.shift.detach().to(dtype).clone()
            self._rescale(self._key_logs(self.keys, self.kept).amax((-1, -2)))

    def _key_logs(self, keys: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """log φ of keys (B, H, X, d) where ``keep`` (B, H, X), −inf elsewhere (a masked key's raw values, NaN or
        inf perhaps, never reach the map)."""
        zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
        logs = map_features(self.fmap, torch.where(keep.unsqueeze(-1), keys, zero), is_query=False)
        return logs.masked_fill(~keep.unsqueeze(-1), NEG_INF)

    def _rescale(self, logs_max: torch.Tensor) -> None:
        """R ← max(R, ``logs_max``) (B, H), the sums moved to the new scale by e^{R_old − R_new} ≤ 1."""
        assert self.shift is not None
        new = torch.maximum(self.shift, logs_max)
        carry = scale_between(self.shift, new)
        self.kv.mul_(carry[..., None, None])
        self.k_sum.mul_(carry[..., None])
        self.shift = new

    def _put(self, slot: int, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | bool,
             beta: torch.Tensor | float | None, live: bool = True) -> None:
        self.keys[..., slot, :], self.values[..., slot, :], self.kept[..., slot] = key, value, keep
        if beta is not None:
            self.betas[..., slot] = beta
        self.live[slot] = live

    @property
    def batch_size(self) -> int:
        return int(self.keys.shape[0])

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None, *,
                 beta: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
                 validate: bool = True) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) or None → out (B, H, 1, Dv).

        ``beta`` (B, H): this token's write strength (the delta rule; it writes when the token leaves the window);
        ``log_decay`` (B, H) or (B, H, F) ≤ 0: this token's log-decay, on top of a fixed rate. ``validate=False``:
        the caller vouches for their ranges (as :class:`~linattn.decode.DeltaDecodeStep` takes it)."""
        check_token(q, k, v, keep, self.keys, (self.keys.shape[0], self.keys.shape[1], self.values.shape[-1]))
        if validate:
            check_token_options(beta, log_decay)
        if self.lean and self.delta is not None and (keep is None or bool(keep.all())):
            return self._delta_token(q, k, v, beta, log_decay)
        batch, heads = self.keys.shape[:2]
        out_dtype, dtype = q.dtype, self.keys.dtype
        q, k, v = q.to(dtype), _repeat_heads(k.to(dtype), heads), _repeat_heads(v.to(dtype), heads)
        position = self.num_tokens
        leaving = position - self.window
        ring = self.sinks + position % self.window
        token_keep = torch.ones(batch, heads, dtype=torch.bool, device=q.device) if keep is None else (
            keep.reshape(batch, 1).expand(batch, heads))
        if self.shift is not None:  # R_t covers token t's own key (as the chunked form's running maximum)
            self._rescale(self._key_logs(k, token_keep.unsqueeze(-1)).amax((-1, -2)))
        lin = self._linear(q, leaving, ring, log_decay)
        if 0 <= leaving < self.sinks:  # a sink leaves the window: from now on a separate exact key
            self.live[leaving] = True
        if keep is not None:  # as linear_attention keeps it: a masked token's value is 0
            v = v.masked_fill(~token_keep[..., None, None], 0.0)
        strength = None
        if self.delta is not None:
            strength = (beta.reshape(batch, heads).to(dtype) if beta is not None
                        else torch.full((batch, heads), self.delta.beta, dtype=dtype, device=q.device))
        self._put(ring, k[..., 0, :], v[..., 0, :], token_keep, strength)
        if position < self.sinks:  # the token is also a sink: its slot keeps it once the ring moves on
            self._put(position, k[..., 0, :], v[..., 0, :], token_keep, None, live=False)
        self.num_tokens += 1
        allowed = self.kept & self.live  # (B, H, slots): the exact keys
        scores = (q @ self.keys.transpose(-1, -2)).squeeze(-2) * self.scale  # (B, H, slots)
        scores = scores.masked_fill(~allowed, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - torch.where(torch.isinf(top), torch.zeros_like(top), top))
        soft_num = (weights.unsqueeze(-2) @ self.values).squeeze(-2)  # (B, H, Dv)
        soft_den = weights.sum(-1, keepdim=True)
        if self.delta is not None:
            average = soft_num / torch.where(soft_den == 0, torch.ones_like(soft_den), soft_den)
            out = (average if self.gamma is None else self.gamma * average) + lin[0]
        else:
            out = self._shared(q, allowed, lin, soft_num, soft_den)
        return out.unsqueeze(-2).to(out_dtype)

    def _delta_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None,
                     log_decay: torch.Tensor | None) -> torch.Tensor:
        """:meth:`__call__` for a delta-rule linear part and a token that is kept (no padding in this call): the
        same arithmetic with the fewest operations a token needs — the leaving key's features only when it
        writes, the window's softmax in one call (the token's own key is always an exact key, so no row is
        empty), no re-checks inside the memory's step."""
        delta = self.delta
        assert delta is not None
        batch, heads = self.keys.shape[:2]
        out_dtype, dtype = q.dtype, self.keys.dtype
        position = self.num_tokens
        leaving, ring = position - self.window, self.sinks + position % self.window
        kernels = self._native if position >= self.sinks else None  # a token that is also a sink: the torch code
        if kernels is not None:
            return self._native_token(kernels, q.to(dtype), k.to(dtype), v.to(dtype), beta, log_decay,
                                      leaving, ring).to(out_dtype)
        q, k, v = q.to(dtype), _repeat_heads(k.to(dtype), heads), _repeat_heads(v.to(dtype), heads)
        qf = unit_features(delta.fmap, q, is_query=True, log_space=delta.log_space)
        kf = value = strength = None
        if leaving >= self.sinks:  # the key leaving the window writes (β = 0 where it was masked: nothing)
            kept = self.kept[..., ring]
            key = torch.where(kept[..., None], self.keys[..., ring, :], 0.0).unsqueeze(-2)
            kf = unit_features(delta.fmap, key, is_query=False, log_space=delta.log_space)
            value, strength = self.values[..., ring : ring + 1, :], (self.betas[..., ring] * kept).unsqueeze(-1)
        lin = delta.advance(qf, kf, value, strength, log_decay).view(batch, heads, 1, -1)
        if 0 <= leaving < self.sinks:  # a sink leaves the window: from now on a separate exact key
            self.live[leaving] = True
        self._put(ring, k[..., 0, :], v[..., 0, :], True, delta.beta if beta is None else beta.reshape(batch, heads))
        if position < self.sinks:  # the token is also a sink: its slot keeps it once the ring moves on
            self._put(position, k[..., 0, :], v[..., 0, :], True, None, live=False)
        self.num_tokens += 1
        scores = torch.matmul(q, self.keys.transpose(-1, -2)).mul_(self.scale)  # (B, H, 1, slots)
        scores.masked_fill_(~(self.kept & self.live).unsqueeze(-2), float("-inf"))
        average = torch.matmul(torch.softmax(scores, dim=-1), self.values)  # (B, H, 1, Dv)
        out = lin.add_(average if self.gamma is None else average.mul_(self.gamma.unsqueeze(-1)))
        return out.to(out_dtype)

    def _native_token(self, kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      beta: torch.Tensor | None, log_decay: torch.Tensor | None, leaving: int, ring: int
                      ) -> torch.Tensor:
        """:meth:`_delta_token` with its arithmetic after the feature stage in one C++ call
        (:func:`linattn.backends.native` ``delta_window_token``: the decay, the leaving key's write, the read-out,
        the new token into the ring and the window's softmax), the same values up to rounding. In the step's dtype;
        q (B, H, 1, d), k and v (B, Hkv, 1, ·)."""
        delta = self.delta
        assert delta is not None
        batch, heads = self.keys.shape[:2]
        qf = self._unit(kernels, q, is_query=True)
        kf = None
        if leaving >= self.sinks:  # the key leaving the window writes; for a masked one (kept False) the C++ never
            # reads its features, so its raw values (NaN or inf perhaps) go through the map harmlessly
            kf = self._unit(kernels, self.keys[..., ring : ring + 1, :], is_query=False)
        elif leaving >= 0:  # a sink leaves the window: from now on a separate exact key
            self.live[leaving] = True
        factors = delta.log_factors(log_decay)
        if factors is not None:
            factors = factors.expand(batch, heads, factors.shape[-1]).contiguous()
        strength = self._fixed_beta if beta is None else beta.reshape(batch, heads).to(q.dtype).contiguous()
        out = kernels.delta_window_token(
            delta.kv, qf, kf, factors, q.contiguous(), k.contiguous(), v.contiguous(), strength,
            self.keys, self.values, self.kept, self.live, self.betas, ring, self.gamma, self.scale)
        delta.num_tokens += 1
        self.num_tokens += 1
        return out

    def fused_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Any = None
                    ) -> torch.Tensor | None:
        """One kept token from a layer's q (B, H, 1, d), k and v (B, Hkv, 1, ·), its β and log-gate from the key by
        ``gates`` (:class:`~linattn.nn.KeyGates`; None: the fixed β), in one C++ call (``layer_token``: the gates,
        the Hedgehog maps and :meth:`_native_token`'s arithmetic, the same values up to rounding) → (B, H, 1, Dv),
        times the gates' read-out weight λ where they have one (``readout=True``; :meth:`__call__` leaves λ to its
        caller); None where it does not apply (the caller then takes :meth:`__call__`, which checks and explains):
        a token that is a sink, another dtype or shape, gradients on, no C++ Hedgehog path on this step."""
        if not self.fuse or torch.is_grad_enabled() or self.num_tokens < self.sinks or self._native is None:
            return None
        batch, heads, _, dim = self.keys.shape
        arguments = fused_call(self, gates, batch * heads, self.lean and self.delta is not None, q, k, v,
                               (batch, heads, dim, self.values.shape[-1]), self.keys.dtype)
        if arguments is None:
            return None
        delta = self.delta
        assert delta is not None
        position = self.num_tokens
        out = self._native.layer_token(
            delta.kv, q.contiguous(), k.contiguous(), v.contiguous(), *arguments, self.keys, self.values, self.kept,
            self.live, self.betas, self.sinks + position % self.window, position - self.window, self.sinks,
            self.gamma, self.scale, None, 0, None, None, None, None, -1, None)
        delta.num_tokens += 1
        self.num_tokens = position + 1
        return out

    def _unit(self, kernels: Any, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        """The delta rule's unit features of one token x (B, H, 1, d), contiguous: in C++ for a Hedgehog map of
        the step's dtype (its features and the normalisation in one call), else the feature stage's torch code."""
        if self._hedgehog is not None:
            return kernels.hedgehog_unit_features(x.reshape(x.shape[0], x.shape[1], x.shape[-1]).contiguous(),
                                                  *self._hedgehog[is_query])
        assert self.delta is not None
        return unit_features(self.fmap, x, is_query=is_query, log_space=self.delta.log_space).contiguous()

    def _linear(self, q: torch.Tensor, leaving: int, slot: int, log_decay: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token t's decay, the leaving key's write, the read by q: (num (B, H, Dv), den (B, H) or None)."""
        batch, heads = self.keys.shape[:2]
        writes = leaving >= self.sinks
        keep = self.kept[..., slot] if writes else torch.zeros_like(self.kept[..., slot])
        key, value = self.keys[..., slot : slot + 1, :], self.values[..., slot : slot + 1, :]
        # a masked key is zeroed, not multiplied by 0 (a NaN or inf in padding would stay NaN)
        key = torch.where(keep[..., None, None], key, torch.zeros((), dtype=key.dtype, device=key.device))
        if self.delta is not None:
            # a masked or absent key writes nothing (β = 0); the decay still applies
            out = self.delta(q, key, value, beta=self.betas[..., slot] * keep, log_decay=log_decay, validate=False)
            return out.squeeze(-2), None
        total = self.log_rate
        if log_decay is not None:
            gate = log_decay.reshape(batch, heads, -1).to(torch.float64)
            total = gate if total is None else total + gate
        if total is not None:
            factor = torch.exp(total).to(self.kv.dtype)  # (B, H, 1) or (B, H, F)
            self.kv.mul_(factor.unsqueeze(-1))
            self.k_sum.mul_(factor)
        if writes:
            kf = map_features(self.fmap, key, is_query=False)
            if self.shift is not None:  # at R ≥ log φ of every key seen: ≤ 1
                kf = stored_at(kf, self.shift.unsqueeze(-1))
            kf = kf.squeeze(-2).masked_fill(~keep.unsqueeze(-1), 0.0)  # filled: a masked log-space key may overflow
            self.kv.add_(kf.unsqueeze(-1) * value)
            self.k_sum.add_(kf)
        qf = map_features(self.fmap, q, is_query=True)
        if self.shift is not None:  # at the row's own maximum c_t
            qf = stabilise_queries(qf)[0]
        qf = qf.squeeze(-2)  # (B, H, F)
        return (qf.unsqueeze(-2) @ self.kv).squeeze(-2), (qf * self.k_sum).sum(-1)

    def _shared(self, q: torch.Tensor, allowed: torch.Tensor, lin: tuple[torch.Tensor, torch.Tensor | None],
                soft_num: torch.Tensor, soft_den: torch.Tensor) -> torch.Tensor:
        """The additive part's shared normaliser: mass form, or γ form."""
        num, den = lin
        assert den is not None
        qf = row_max = None
        if self.gamma is None or self.shift is not None:  # the mass, or log-space: the query's row maximum c_t
            qf = map_features(self.fmap, q, is_query=True)  # (B, H, 1, F)
            if self.shift is not None:  # log-space: both parts in the stored scale c_t + R_t
                qf, row_max = stabilise_queries(qf)
        if self.gamma is None:
            assert qf is not None
            if self.shift is not None:  # every exact key at R ≥ its log φ
                keys = stored_at(self._key_logs(self.keys, allowed), self.shift.unsqueeze(-1).expand(allowed.shape))
            else:
                keys = map_features(self.fmap, self.keys, is_query=False)  # (B, H, slots, F)
            mass = (qf @ keys.transpose(-1, -2)).squeeze(-2).masked_fill(~allowed, 0.0).sum(-1)
            average = soft_num / torch.where(soft_den == 0, torch.ones_like(soft_den), soft_den)
            total = den + mass + self.eps
            return (num + mass.unsqueeze(-1) * average) / torch.where(total == 0, 1.0, total).unsqueeze(-1)
        gamma = self.gamma
        if self.shift is not None and row_max is not None:  # on the common scale u = max(c + R, 0): factors ≤ 1, ≤ γ
            scale = row_max.reshape(self.shift.shape) + finite(self.shift)
            common = scale.clamp(min=0)
            lin_factor = torch.exp(scale - common)  # (B, H)
            num, den = lin_factor.unsqueeze(-1) * num, lin_factor * den
            gamma = gamma * torch.exp(-common).unsqueeze(-1)
        total = den + gamma.squeeze(-1) * soft_den.squeeze(-1) + self.eps
        return (num + gamma * soft_num) / torch.where(total == 0, 1.0, total).unsqueeze(-1)

    def state(self) -> WindowAttentionState:
        """The state after every token stepped (new tensors)."""
        length, sunk = min(self.window, self.num_tokens), min(self.sinks, self.num_tokens)
        positions = torch.arange(self.num_tokens - length, self.num_tokens)
        ring = (self.sinks + positions % self.window).to(self.keys.device)
        linear: LinearAttentionState | DeltaRuleState
        if self.delta is not None:
            memory = self.delta.state()
            linear = DeltaRuleState(memory.kv.clone(), max(0, self.num_tokens - self.window))
        else:
            shift = self.shift.clone() if self.shift is not None else torch.zeros_like(self.kv[..., 0, 0])
            linear = LinearAttentionState(self.kv.clone(), self.k_sum.clone(), shift,
                                          max(0, self.num_tokens - self.window))
        betas = self.betas.index_select(-1, ring).clone() if self.delta is not None else None
        return WindowAttentionState(
            linear, self.keys.index_select(-2, ring), self.values.index_select(-2, ring),
            self.kept.index_select(-1, ring), self.keys[..., :sunk, :].clone(), self.values[..., :sunk, :].clone(),
            self.kept[..., :sunk].clone(), self.window, self.sinks, self.num_tokens, betas=betas,
        )

    def index_select(self, dim: int, index: torch.Tensor) -> ComposedDecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``: the options (β, the
        decay, the factor) go with it, a factor given per batch row selected too."""
        if dim != 0:
            raise LinearAttentionError(f"dim: a decode step selects batch rows (dim 0), got {dim}")
        new = ComposedDecodeStep(self.fmap, self.state().index_select(dim, index), {**self.options,
                                                                                    "window_factor": None})
        new.options = dict(self.options)
        if self.gamma is not None:
            new.gamma = self.gamma.index_select(0, index.to(self.gamma.device))
        return new

