"""The lean step of the sparse exact cache beside a decayed, gated or delta-rule linear part
(``linear_attention(..., window=W, sinks=S, sparse_cache=..., decay=/log_gate=/update="delta")``), one token per
call: :class:`SparseComposedDecodeStep`.

The definition is :mod:`linattn.exact.forms.sparse_composed`'s: a pair enters the linear state when it leaves the
exact part. Per token t, on buffers of B·H rows preallocated once:

- at a boundary (t = b·B, b ≥ 1) the candidates — the cache and the ring's pairs t − W … t − W + B − 1 — are scored
  against the linear state as query t − 1 read it (``"recall"``: LoLA's error beside additive sums, the memory's
  ‖v − Sᵀk̂‖ beside the delta rule), the stored queries (``"attention"``) or the oracle, and chosen by the
  functions that define the op (:mod:`linattn.exact.forms.boundary`); the cached pairs not chosen are held to be
  written at this step, and each leaving ring pair is marked to stay or not;
- the linear state takes the token's decay, then the writes of step t in ascending position: the pairs dropped at
  the boundary, then key t − W unless the boundary kept it (sinks and padding never write);
- the new key takes its ring slot and the output is the composed op's combiner over the exact keys (ring, sinks,
  the cached pairs that have left the window) and the linear read-out.

The cache is held per query-head row with a budget, at the largest size (rows of a smaller budget leave their last
slots empty; rows without one hold no slot, and their output skips the cache).
Log-space maps (FAVOR+ and kin): the delta family reads unit rows; beside the additive state (with or without a
decay or gate; this is also the additive sparse cache's step for such maps) the sums are kept at R, the running
maximum of the keys' log φ — each token's key raises it before the step's writes, which are stored at it — and the
combiner meets the exact part on query t's c_t + R_t (docs/sparse_cache.md, "Log-space maps").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..backends import native
from ..backends.native import forms as native_forms
from ..errors import LinearAttentionError
from ..feature_maps import HedgehogFeatureMap
from ..features import NEG_INF, finite, is_log_space, map_features, scale_between, stabilise_queries, unit_rows
from ..kinds._step import _repeat_heads, check_memory, check_step_options, check_token, check_token_options
from ..state import DeltaRuleState, LinearAttentionState, SparseCache, SparseCacheState, WindowAttentionState
from .composed_step import FusedMemo, fill_slots, fused_call
from .forms.boundary import attention_scores, choose, oracle_scores, recall_scores

# a write into the linear state: keys (R, d), values (R, Dv), strength (R,), and the keys' features (R, F) or None
Write = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class SparseComposedDecodeStep:
    """The sparse cache beside a decayed, gated or delta-rule linear part one token at a time, from the
    :class:`~linattn.WindowAttentionState` (batch shape (B, H), with its ``cache``) such a call returned; ``cache``
    the :class:`~linattn.SparseCache` it was made with; the options as given to ``linear_attention`` (``eps``,
    ``window_factor``, ``softmax_scale``, a fixed ``beta`` and ``decay``). Per-token write strengths and log-decays
    (per token (B, H), or per feature (B, H, F)) come with each call, as :class:`~linattn.decode.ComposedDecodeStep`
    takes them."""

    # C++ where it builds (False: the torch code): one token's Hedgehog unit features (read when the step is made)
    # and, between boundaries, the delta family's whole token (read at each call)
    native = True
    fuse = True  # fused_token takes a layer's token in one C++ call where it applies (False: it declines)

    def __init__(self, fmap: nn.Module, state: WindowAttentionState, cache: SparseCache,
                 options: dict[str, Any]) -> None:
        check_memory(state, WindowAttentionState, "SparseComposedDecodeStep")
        check_step_options(options.get("eps", 1e-6), state.window, state.sinks, options.get("window_factor"),
                           options.get("softmax_scale"))
        held = state.cache
        if held is None:
            raise LinearAttentionError("state: made without sparse_cache=; continue it with ComposedDecodeStep")
        self.fmap, self.options, self.cache = fmap, dict(options), cache
        self.delta = isinstance(state.linear, DeltaRuleState)
        self.log_space = is_log_space(fmap)
        batch, heads, features, values = state.linear.kv.shape
        rows, dtype, device = batch * heads, state.linear.kv.dtype, state.linear.kv.device
        dim = state.keys.shape[-1]
        self.shape, self.eps = (batch, heads, features, values), float(options.get("eps", 1e-6))
        self.scale = dim**-0.5 if options.get("softmax_scale") is None else float(options["softmax_scale"])
        self.window, self.sinks, self.num_tokens = state.window, state.sinks, state.num_tokens
        self.block, self.slots = cache.block_for(state.window), cache.largest
        if held.block != self.block or not cache.made(held.sizes):
            raise LinearAttentionError("cache: not the cache the state was made with (its block or sizes differ)")

        def per_row(value: Any) -> torch.Tensor | None:
            if value is None:
                return None
            return torch.broadcast_to(torch.as_tensor(value, dtype=dtype, device=device), (batch, heads)).reshape(
                rows).clone()

        # the delta rule's unit features of one token in C++ for this exact Hedgehog map (per head or shared) in the
        # step's dtype, as ComposedDecodeStep computes them; the arguments for queries and keys, kept
        self._kernels: Any = native.module() if self.delta and self.native and device.type == "cpu" else None
        self._hedgehog: dict[bool, tuple[Any, ...]] | None = None
        if self._kernels is not None and type(fmap) is HedgehogFeatureMap \
                and fmap.num_heads in (None, heads) and fmap.weight.dtype == dtype and fmap.head_dim == dim:
            weight, bias, key = fmap.weight.detach(), fmap.bias.detach(), 0 if fmap.tied else 1
            common = (fmap.GATE_LIMIT, torch.finfo(dtype).tiny)
            self._hedgehog = {True: (weight[0], bias[0], None, *common),
                              False: (weight[key], bias[key], fmap.gate.detach()[0], *common)}
        self.gamma = per_row(options.get("window_factor"))
        self.linear_weight = None if cache.linear_weight == 1 else per_row(cache.linear_weight)
        self.beta = 1.0 if options.get("beta") is None else float(options["beta"])
        self.log_rate = None
        if options.get("decay") is not None:
            rate = torch.as_tensor(options["decay"], dtype=torch.float64, device=device)
            self.log_rate = torch.log(rate).expand(heads).repeat(batch).reshape(rows, 1)
        self.kv = state.linear.kv.detach().reshape(rows, features, values).clone()
        self.k_sum = None if self.delta else state.linear.k_sum.detach().reshape(rows, features).clone()
        # log-space maps beside the additive state: the sums' log-scale R (the running maximum of the keys' log φ,
        # docs/sparse_cache.md); the delta family's unit rows need none
        self.shift = None
        if self.log_space and not self.delta:
            assert isinstance(state.linear, LinearAttentionState)
            self.shift = state.linear.shift.detach().to(device, dtype).reshape(rows).clone()
        self.sizes = cache.sizes_for((batch, heads), device).reshape(rows)
        # the exact keys: S sink slots, then the ring (position p in slot S + p mod W)
        slots = self.sinks + self.window
        self.keys = torch.zeros(rows, slots, dim, dtype=dtype, device=device)
        self.values = torch.zeros(rows, slots, values, dtype=dtype, device=device)
        self.kept = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        self.betas = torch.zeros(rows, slots, dtype=dtype, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        fill_slots(self, state, self.num_tokens - state.keys.shape[-2])
        # the cache: (R_c, λ) slots of the R_c rows with a budget (a split that leaves most heads no pair holds the
        # others' slots alone), positions ascending, −1 where empty
        budget = self.sizes > 0
        self.holding = None if bool(budget.all()) else budget.nonzero().squeeze(-1)  # None: every row
        # each row's index among the rows with a budget, −1 for the others (the C++ token reads it)
        self._cache_rows = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self._cache_rows[budget] = torch.arange(int(budget.sum()), device=device)
        self._fixed_beta = torch.full((rows,), self.beta, dtype=dtype, device=device)
        self._fused_log_rate = None if self.log_rate is None else self.log_rate.reshape(rows).contiguous()
        self._fused: FusedMemo | None = None  # what fused_call keeps
        # the rows with a budget unpacked straight from the packed cache (rows without one hold no packed slot)
        held_sizes = self._held(self.sizes)
        self.positions = SparseCacheState.unpack(held.packed_positions.to(device), held_sizes, self.slots, -1)
        self.cached_keys = SparseCacheState.unpack(held.packed_keys.to(device, dtype), held_sizes, self.slots, 0.0)
        self.cached_values = SparseCacheState.unpack(held.packed_values.to(device, dtype), held_sizes, self.slots,
                                                     0.0)
        betas = held.packed_betas
        self.cached_betas = (SparseCacheState.unpack(betas.to(device, dtype), held_sizes, self.slots, 0.0)
                             if betas is not None else torch.zeros(len(held_sizes), self.slots, dtype=dtype,
                                                                   device=device))
        # the recall score's unit features of the rows with a budget alone, in C++ with each row's own head's
        # weights (a Hedgehog map beside the delta family); else the map over every row (:meth:`_held_features`)
        self._held_map: tuple[Any, ...] | None = None
        causal = native.module("causal") if self._kernels is not None and cache.score == "recall" else None
        if causal is not None and type(fmap) is HedgehogFeatureMap and fmap.num_heads in (None, heads) \
                and fmap.head_dim == dim and dtype in (torch.float32, torch.float64) \
                and not native_forms.value_reasons(fmap.num_features, dtype):
            index = 0 if fmap.tied else 1
            held_rows = torch.arange(rows, device=device) if self.holding is None else self.holding
            head = held_rows % heads if fmap.num_heads else torch.zeros_like(held_rows)
            weight = fmap.weight.detach()[index].to(dtype).index_select(0, head)  # (R_c, m, d)
            self._held_map = (causal, weight.transpose(-1, -2).contiguous(),
                              fmap.bias.detach()[index].to(dtype).index_select(0, head).contiguous(),
                              fmap.gate.detach()[0].to(dtype).index_select(0, head).contiguous(),
                              fmap.GATE_LIMIT, torch.finfo(dtype).tiny)
        self.oracle = None  # the oracle's marks for the rows with a budget
        if cache.keep is not None:
            self.oracle = dataclasses.replace(cache, size=self._rows(self.sizes).cpu(), keep=self._rows(
                cache.keep.to(device).expand(batch, heads, cache.keep.shape[-1]).reshape(rows, -1)))
        # per ring slot of a position p: whether the last boundary kept the pair (it stays exact when it leaves)
        self.stays = torch.zeros(rows, self.window, dtype=torch.bool, device=device)
        if self.num_tokens and self.slots:  # the cached positions still in the ring (every position is < N)
            every = self._every(self.positions, -1)
            row, slot = (every >= max(0, self.num_tokens - self.window)).nonzero(as_tuple=True)
            self.stays[row, every[row, slot] % self.window] = True
        self.queries = None
        if cache.score == "attention":
            self.queries = torch.zeros(rows, self.block, dim, dtype=dtype, device=device)
            since = held.queries.shape[-2]
            if since:
                at = torch.arange(self.num_tokens - since, self.num_tokens, device=device) % self.block
                self.queries[:, at] = held.queries.detach().to(device, dtype).reshape(rows, since, dim)

    def _held(self, x: torch.Tensor) -> torch.Tensor:
        """The rows with a budget of x (B·H, ·) (a new tensor)."""
        return x.clone() if self.holding is None else x.index_select(0, self.holding)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows with a budget of x (B·H, ·) (x itself when every row has one)."""
        return x if self.holding is None else x.index_select(0, self.holding)

    def _every(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Cache rows x (R_c, ·) as (B·H, ·), ``fill`` in the rows without a budget."""
        if self.holding is None:
            return x
        return x.new_full((self.kv.shape[0], *x.shape[1:]), fill).index_copy_(0, self.holding, x)

    def _put(self, slot: int, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | bool,
             beta: torch.Tensor | float | None, live: bool = True) -> None:
        rows = self.keys.shape[0]
        self.keys[:, slot], self.values[:, slot] = key.reshape(rows, -1), value.reshape(rows, -1)
        self.kept[:, slot] = keep.reshape(rows) if isinstance(keep, torch.Tensor) else keep
        if beta is not None:
            self.betas[:, slot] = beta.reshape(rows) if isinstance(beta, torch.Tensor) else beta
        self.live[slot] = live

    def _map(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """φ of rows x (B·H, [N,] d) → (B·H, [N,] F), each row's head on the axis a per-head map (``num_heads``)
        reads it from: the map sees (B, H, N, d), as in the op."""
        batch, heads = self.shape[:2]
        phi = map_features(self.fmap, x.reshape(batch, heads, -1, x.shape[-1]), is_query=is_query)  # (B, H, N, F)
        return phi.reshape(*x.shape[:-1], phi.shape[-1])

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """The linear part's features of rows x (B·H, [N,] d): the delta rule's unit φ̂, the additive update's φ (a
        log-space map's at each row's own maximum)."""
        if self._hedgehog is not None and x.dim() == 2:  # one token per row
            batch, heads = self.shape[:2]
            one = x.reshape(batch, heads, x.shape[-1]).contiguous()
            return self._kernels.hedgehog_unit_features(one, *self._hedgehog[is_query]).reshape(x.shape[0], -1)
        phi = self._map(x, is_query)
        if self.log_space:
            phi = stabilise_queries(phi)[0]
        return unit_rows(phi) if self.delta else phi

    def _held_features(self, keys: torch.Tensor) -> torch.Tensor:
        """The recall score's features of keys (R_c, N, d) of the rows with a budget: the delta rule's unit φ̂ in
        C++ for those rows alone (the Hedgehog kernel of the native forward, each row with its head's weights and
        key weight e^{clamp(u·k)}), or :meth:`_features` of every row (the map sees (B, H, ·, d))."""
        if self._held_map is None:
            return self._rows(self._features(self._every(keys, 0.0), False))
        causal, weight_t, bias, gate, limit, floor = self._held_map
        return unit_rows(causal.hedgehog_map(keys.contiguous(), weight_t, bias, gate, limit, floor))

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """Key rows x (R, ·, d) as the additive sums hold them: φ, or (log-space maps) e^{log φ − R} (≤ 1 for every
        key seen; clamped for empty slots)."""
        phi = self._map(x, False)
        if self.shift is None:
            return phi
        scale = finite(self.shift).view(-1, *([1] * (phi.dim() - 1)))
        return torch.exp((phi - scale).clamp(max=0.0))

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None, *,
                 beta: torch.Tensor | None = None, log_decay: torch.Tensor | None = None,
                 validate: bool = True) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) or None → out (B, H, 1, Dv); ``beta``
        (B, H) and ``log_decay`` (B, H) or (B, H, F) as :class:`~linattn.decode.ComposedDecodeStep` takes them."""
        batch, heads, features, values = self.shape
        rows = batch * heads
        check_token(q, k, v, keep, self.kv, (batch, heads, values))
        if validate:
            check_token_options(beta, log_decay)
        out_dtype, dtype = q.dtype, self.kv.dtype
        t = self.num_tokens
        boundary = t and t % self.block == 0 and self.slots
        if self.native and self._kernels is not None and t >= self.sinks and not boundary \
                and (keep is None or bool(keep.all())):  # between two boundaries, no padding, not a sink
            return self._native_token(q.to(dtype), k.to(dtype), v.to(dtype), beta, log_decay).to(out_dtype)
        q = q.to(dtype).reshape(rows, -1)
        k = _repeat_heads(k.to(dtype), heads).reshape(rows, -1)
        v = _repeat_heads(v.to(dtype), heads).reshape(rows, -1)
        token_keep = torch.ones(rows, dtype=torch.bool, device=q.device) if keep is None else (
            keep.reshape(batch, 1).expand(batch, heads).reshape(rows))
        v = v.masked_fill(~token_keep.unsqueeze(-1), 0.0)
        window = self.window
        writes: list[Write] = []
        if boundary:
            writes += self._decide(t)
        slot = self.sinks + t % window
        leaving = t - window
        if leaving >= self.sinks:  # key t − W enters the state unless the boundary kept it or it was padding
            stays = self.stays[:, t % window]
            writes.append((self.keys[:, slot].clone(), self.values[:, slot].clone(),
                           (self.kept[:, slot] & ~stays).to(dtype) * (self.betas[:, slot] if self.delta else 1.0),
                           None))
        if self.shift is not None:  # R takes key t (a kept one) before the step's writes
            top = self._map(k, False).amax(-1).masked_fill(~token_keep, NEG_INF)
            self._rescale(torch.maximum(self.shift, top))
        self._advance(writes, log_decay)
        if 0 <= leaving < self.sinks:  # a sink leaves the window: from now on a separate exact key
            self.live[leaving] = True
        strength = (torch.full((rows,), self.beta, dtype=dtype, device=q.device) if beta is None
                    else beta.reshape(rows).to(dtype)) * token_keep  # as the op keeps it: padding's β is 0
        self._put(slot, k, v, token_keep, strength)
        if t < self.sinks:
            self._put(t, k, v, token_keep, None, live=False)
        if self.queries is not None:
            self.queries[:, t % self.block] = q
        self.num_tokens = t + 1
        return self._output(q).view(batch, heads, 1, values).to(out_dtype)

    def _native_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None,
                      log_decay: torch.Tensor | None) -> torch.Tensor:
        """:meth:`__call__` for a delta-rule part between two boundaries, every token kept: after the feature
        stage, one C++ call (:func:`linattn.backends.native` ``sparse_delta_token``: the decay, the leaving key's
        write unless the last boundary kept it, the read-out times λ, the new token into the ring and the softmax
        over the ring and the cached pairs that have left the window), the same values up to rounding. In the
        step's dtype: q (B, H, 1, d), k and v (B, Hkv, 1, ·) → (B, H, 1, Dv)."""
        batch, heads, features, values = self.shape
        rows, t = batch * heads, self.num_tokens
        slot, leaving = self.sinks + t % self.window, t - self.window
        q = q.reshape(rows, -1).contiguous()
        kf = None
        if leaving >= self.sinks:  # a masked key (kept False) writes nothing: the C++ never reads its features
            kf = self._features(self.keys[:, slot], False).contiguous()
        elif leaving >= 0:  # a sink leaves the window: from now on a separate exact key
            self.live[leaving] = True
        qf = self._features(q, True).contiguous()
        factors = self.log_rate
        if log_decay is not None:
            gate = log_decay.reshape(rows, -1).to(torch.float64)
            factors = gate if factors is None else factors + gate
        strength = self._fixed_beta if beta is None else beta.reshape(rows).to(q.dtype).contiguous()
        out = self._kernels.sparse_delta_token(
            self.kv.view(batch, heads, features, values), qf, kf, None if factors is None else factors.contiguous(),
            q, k.contiguous(), v.contiguous(), strength, self.keys, self.values, self.kept, self.live, self.betas,
            slot, self.gamma, self.scale, self.stays[:, t % self.window].contiguous(), self._cache_rows,
            self.positions, self.cached_keys, self.cached_values, leaving, self.linear_weight)
        if self.queries is not None:
            self.queries[:, t % self.block] = q
        self.num_tokens = t + 1
        return out

    def fused_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: Any = None
                    ) -> torch.Tensor | None:
        """One kept token between two boundaries from a layer's q (B, H, 1, d), k and v (B, Hkv, 1, ·), its β and
        log-gate from the key by ``gates`` (:class:`~linattn.nn.KeyGates`; None: the fixed β), in one C++ call
        (``layer_token``: the gates, the Hedgehog maps and :meth:`_native_token`'s arithmetic, the same values up
        to rounding) → (B, H, 1, Dv), times the gates' read-out weight λ where they have one (``readout=True``;
        :meth:`__call__` leaves λ to its caller); None where it does not apply (the caller then takes
        :meth:`__call__`): a boundary, a token that is a sink, another dtype or shape, gradients on, no C++
        Hedgehog path here."""
        t = self.num_tokens
        if not self.fuse or torch.is_grad_enabled() or not self.native or self._kernels is None or t < self.sinks \
                or (t % self.block == 0 and self.slots):
            return None
        batch, heads, _, values = self.shape
        arguments = fused_call(self, gates, self.kv.shape[0], bool(self.delta), q, k, v,
                               (batch, heads, self.keys.shape[-1], values), self.kv.dtype)
        if arguments is None:
            return None
        q = q.contiguous()
        out = self._kernels.layer_token(
            self.kv, q, k.contiguous(), v.contiguous(), *arguments, self.keys, self.values, self.kept, self.live,
            self.betas, self.sinks + t % self.window, t - self.window, self.sinks, self.gamma, self.scale,
            self.stays, t % self.window, self._cache_rows, self.positions, self.cached_keys, self.cached_values,
            t - self.window, self.linear_weight)
        if self.queries is not None:
            self.queries[:, t % self.block] = q.reshape(batch * heads, -1)
        self.num_tokens = t + 1
        return out

    def _rescale(self, shift: torch.Tensor) -> None:
        """The additive sums moved to the log-scale ``shift`` (R,) ≥ the current one."""
        assert self.shift is not None and self.k_sum is not None
        carry = scale_between(self.shift, shift)
        self.kv.mul_(carry[:, None, None])
        self.k_sum.mul_(carry[:, None])
        self.shift = shift

    def _advance(self, writes: list[Write], log_decay: torch.Tensor | None) -> None:
        """The linear state's step: the token's decay, then each write (keys (R, d), values (R, Dv), strength (R,):
        the delta rule's β, or 1/0 for the additive update; the delta rule's unit features (R, F) of the keys, or
        None: mapped here) in order."""
        rows = self.kv.shape[0]
        total = self.log_rate
        if log_decay is not None:
            gate = log_decay.reshape(rows, -1).to(torch.float64)
            total = gate if total is None else total + gate
        if total is not None:
            factor = torch.exp(total).to(self.kv.dtype)  # (R, 1) or (R, F)
            self.kv.mul_(factor.unsqueeze(-1))
            if self.k_sum is not None:
                self.k_sum.mul_(factor)
        for key, value, strength, known in writes:
            kf = known if known is not None else self._features(key, False) if self.delta else self._stored(key)
            kf = torch.where(strength.unsqueeze(-1) != 0, kf, 0.0)  # (R, F)
            if self.delta:
                recalled = torch.bmm(kf.unsqueeze(1), self.kv).squeeze(1)  # Sᵀk̂ (R, Dv)
                self.kv.add_(kf.unsqueeze(-1) * (strength.unsqueeze(-1) * (value - recalled)).unsqueeze(1))
            else:
                assert self.k_sum is not None
                kf = kf * strength.unsqueeze(-1)
                self.kv.add_(kf.unsqueeze(-1) * value.unsqueeze(1))
                self.k_sum.add_(kf)

    def _decide(self, t0: int) -> list[Write]:
        """The boundary t0: choose the cache, mark the leaving ring pairs that stay, and return the writes of the
        cached pairs not kept (ascending position; strength 0 where a row drops fewer). Only the rows with a budget
        decide (the others keep no pair: every ring pair of theirs enters the state when it leaves), their
        candidates mapped alone where the map allows it (:meth:`_held_features`)."""
        window, block, slots, device = self.window, self.block, self.slots, self.kv.device
        leaving = torch.arange(t0 - window, t0 - window + block, device=device)
        at = self.sinks + leaving % window
        ring_valid = self._rows((leaving >= max(self.sinks, 0)) & self.live[at] & self.kept[:, at])  # (R_c, B)
        positions = torch.cat([self.positions, leaving.expand(ring_valid.shape[0], -1)], 1)  # (R_c, C)
        valid = torch.cat([self.positions >= 0, ring_valid], 1)
        positions = positions.masked_fill(~valid, -1)
        keys = torch.cat([self.cached_keys, self._rows(self.keys[:, at])], 1)
        vals = torch.cat([self.cached_values, self._rows(self.values[:, at])], 1)
        betas = torch.cat([self.cached_betas, self._rows(self.betas[:, at])], 1)
        features = None
        if self.cache.score == "recall":
            features = self._held_features(keys)
            kf = features * valid.unsqueeze(-1)
            if self.delta:
                scores = torch.linalg.vector_norm(vals - torch.bmm(kf, self._rows(self.kv)), dim=-1)
            else:
                assert self.k_sum is not None
                scores = recall_scores(kf, vals, self._rows(self.kv), self._rows(self.k_sum))
        elif self.cache.score == "attention":
            assert self.queries is not None
            scores = attention_scores(self._rows(self.queries), torch.arange(t0 - block, t0, device=device), keys,
                                      positions, valid, self.scale)
        else:
            assert self.oracle is not None
            scores = oracle_scores(self.oracle, positions)
        chosen, index, kept = choose(scores, positions, valid, self._rows(self.sizes), slots)
        dropped = valid[:, :slots] & ~kept[:, :slots]  # (R_c, λ), ascending as the cache's slots
        count = int(dropped.sum(-1).max()) if dropped.numel() else 0
        order = torch.argsort((~dropped).to(torch.int8), dim=1, stable=True)[:, :count]  # the dropped first
        mask = dropped.gather(1, order)
        writes: list[Write] = []
        every = torch.arange(order.shape[0], device=device)
        for column in range(count):
            pick = order[:, column]
            strength = mask[:, column].to(self.kv.dtype) * (self.cached_betas[every, pick] if self.delta else 1.0)
            picked = None if features is None or not self.delta else self._every(features[every, pick], 0.0)
            writes.append((self._every(self.cached_keys[every, pick], 0.0),
                           self._every(self.cached_values[every, pick], 0.0), self._every(strength, 0.0), picked))
        filled = (index >= 0).unsqueeze(-1)
        pick = index.clamp(min=0)

        def take(x: torch.Tensor) -> torch.Tensor:
            return x.gather(1, pick.unsqueeze(-1).expand(-1, -1, x.shape[-1])) * filled

        self.cached_keys, self.cached_values = take(keys), take(vals)
        self.cached_betas = betas.gather(1, pick) * filled.squeeze(-1)
        self.positions = chosen
        self.stays[:, leaving % window] = self._every(kept[:, slots:], False)
        return writes

    def _scores(self, keys: torch.Tensor, q: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """Softmax logits of q (R, d) against keys (R, L, d), −inf where not ``exact`` (R, L)."""
        return torch.bmm(keys, q.unsqueeze(-1)).squeeze(-1).mul_(self.scale).masked_fill_(~exact, float("-inf"))

    def _output(self, q: torch.Tensor) -> torch.Tensor:
        """The combiner over the exact keys (ring, sinks, cached pairs j ≤ t − W) and the linear read-out (R, Dv):
        the ring's and the cache's sums apart on one shift per row, the cache's over the rows with a budget."""
        t = self.num_tokens - 1
        ring = self.kept & self.live
        scores = self._scores(self.keys, q, ring)  # (R, S + W)
        top = scores.amax(-1, keepdim=True)
        rows = self.holding
        cached = None
        if self.slots:
            keys, values, positions = self.cached_keys, self.cached_values, self.positions  # (R_c, λ, ·)
            at = q if rows is None else q.index_select(0, rows)
            cached = self._scores(keys, at, (positions >= 0) & (positions <= t - self.window))
            cached_top = cached.amax(-1, keepdim=True)
            top = torch.maximum(top, cached_top) if rows is None else top.index_copy(
                0, rows, torch.maximum(top.index_select(0, rows), cached_top))
        shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        weights = torch.exp(scores - shift)
        soft_num = torch.bmm(weights.unsqueeze(1), self.values).squeeze(1)  # (R, Dv)
        soft_den = weights.sum(-1, keepdim=True)
        if cached is not None:
            weights = torch.exp(cached - (shift if rows is None else shift.index_select(0, rows)))
            num = torch.bmm(weights.unsqueeze(1), values).squeeze(1)  # (R_c, Dv)
            den = weights.sum(-1, keepdim=True)
            soft_num = soft_num + num if rows is None else soft_num.index_add(0, rows, num)
            soft_den = soft_den + den if rows is None else soft_den.index_add(0, rows, den)
        average = soft_num / torch.where(soft_den == 0, torch.ones_like(soft_den), soft_den)
        qf = self._features(q, True)  # (R, F)
        lam = self.linear_weight.unsqueeze(-1) if self.linear_weight is not None else None
        num = torch.bmm(qf.unsqueeze(1), self.kv).squeeze(1)
        if lam is not None:
            num = num * lam
        if self.delta:
            return (average if self.gamma is None else self.gamma.unsqueeze(-1) * average) + num
        assert self.k_sum is not None
        den = (qf * self.k_sum).sum(-1, keepdim=True)
        if lam is not None:
            den = den * lam
        if self.gamma is None:  # log-space maps: every sum at query t's stored scale c_t + R_t
            every = self._every(self.positions, -1)
            keys = torch.cat([self.keys, self._every(self.cached_keys, 0.0)], 1)  # the map sees (B, H, ·, d)
            exact = torch.cat([ring, (every >= 0) & (every <= t - self.window)], 1)
            phi_keys = self._stored(keys)  # (R, slots, F)
            mass = torch.bmm(phi_keys, qf.unsqueeze(-1)).squeeze(-1).masked_fill(~exact, 0.0).sum(-1, keepdim=True)
            total = den + mass + self.eps
            return (num + mass * average) / torch.where(total == 0, 1.0, total)
        gamma = self.gamma.unsqueeze(-1)
        if self.shift is not None:  # the two parts meet on u = max(c_t + R_t, 0), as the op's combiner
            both = self._map(q, True).amax(-1, keepdim=True) + finite(self.shift).unsqueeze(-1)
            common = both.clamp(min=0)
            num, den, gamma = num * torch.exp(both - common), den * torch.exp(both - common), gamma * torch.exp(-common)
        total = den + gamma * soft_den + self.eps
        return (num + gamma * soft_num) / torch.where(total == 0, 1.0, total)

    def state(self) -> WindowAttentionState:
        """The state after every token stepped, its cache included (new tensors)."""
        batch, heads, features, values = self.shape
        length, sunk = min(self.window, self.num_tokens), min(self.sinks, self.num_tokens)
        ring = (self.sinks + torch.arange(self.num_tokens - length, self.num_tokens) % self.window).to(self.kv.device)

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch, heads, *x.shape[1:]).clone()

        seen = max(0, self.num_tokens - self.window)
        linear: LinearAttentionState | DeltaRuleState
        if self.delta:
            linear = DeltaRuleState(rows(self.kv), seen)
        else:
            assert self.k_sum is not None
            shift = self.shift.view(batch, heads).clone() if self.shift is not None else self.kv.new_zeros(batch, heads)
            linear = LinearAttentionState(rows(self.kv), rows(self.k_sum), shift, seen)
        t, dim = self.num_tokens, self.keys.shape[-1]
        held = (t - 1) % self.block + 1 if t else 0
        queries = (rows(self.queries[:, :held]) if self.queries is not None
                   else self.keys.new_zeros(batch, heads, 0, dim))
        sizes = self.sizes.view(batch, heads)
        every = {name: self._every(getattr(self, name), -1 if name == "positions" else 0.0)
                 for name in ("positions", "cached_keys", "cached_values", "cached_betas")}
        cache = SparseCacheState.from_slots(rows(every["positions"]), rows(every["cached_keys"]),
                                            rows(every["cached_values"]), queries, self.block, sizes,
                                            rows(every["cached_betas"]) if self.delta else None)
        return WindowAttentionState(
            linear, rows(self.keys.index_select(1, ring)), rows(self.values.index_select(1, ring)),
            rows(self.kept.index_select(1, ring)), rows(self.keys[:, :sunk]), rows(self.values[:, :sunk]),
            rows(self.kept[:, :sunk]), self.window, self.sinks, self.num_tokens,
            betas=rows(self.betas.index_select(1, ring)) if self.delta else None, cache=cache,
        )

    def index_select(self, dim: int, index: torch.Tensor) -> SparseComposedDecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``."""
        if dim != 0:
            raise LinearAttentionError(f"dim: a decode step selects batch rows (dim 0), got {dim}")
        return SparseComposedDecodeStep(self.fmap, self.state().index_select(dim, index), self.cache, self.options)
