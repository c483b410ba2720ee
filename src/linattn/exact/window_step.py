"""The lean step of the causal window op (see :mod:`linattn.decode`); the choice of step for a state is
:func:`linattn.decode.choose.lean_step`."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..capabilities import step_reasons
from ..errors import LinearAttentionError
from ..feature_maps import FeatureMap
from ..kinds._step import _repeat_heads, _Step, check_memory, check_step_options, check_token
from ..state import LinearAttentionState, WindowAttentionState


def supports_window(fmap: nn.Module, state: Any, options: dict[str, Any]) -> bool:
    """Whether :class:`WindowDecodeStep` computes what ``linear_attention(..., **options)`` would from ``state``."""
    return not step_reasons("window", fmap, state, options)


def window_step(
    fmap: nn.Module, state: WindowAttentionState, options: dict[str, Any], kv_heads: int
) -> WindowDecodeStep:
    """The lean window step from ``state`` with the call's ``linear_attention`` options."""
    return WindowDecodeStep(fmap, state, eps=options.get("eps", 1e-6), window_factor=options.get("window_factor"),
                            softmax_scale=options.get("softmax_scale"), kv_heads=kv_heads)


class WindowDecodeStep(_Step):
    """The causal window hybrid one token at a time, from a :class:`~linattn.WindowAttentionState` returned by
    ``linear_attention(..., window=W, sinks=S, return_state=True)`` (see the module docstring).

    Args:
        fmap: the feature map the state was built with (an ordinary map: features, not log-features).
        state: batch shape (B, H). Copied once into the step's buffers.
        eps: the denominator's eps; window_factor: None (the mass form) or γ (a float, or one value per head);
        softmax_scale: the exact part's score scale (default 1/√d), as given to ``linear_attention``.
        kv_heads: grouped-query attention: the number of key/value heads the steps will get (each serving
            H / kv_heads query heads, the state's keys repeated per group as ``linear_attention`` keeps them); the
            step then holds each exact key and value once per key/value head. Default: H (one per query head).
    """

    def __init__(
        self, fmap: nn.Module, state: WindowAttentionState, *, eps: float = 1e-6, window_factor: Any = None,
        softmax_scale: float | None = None, kv_heads: int | None = None,
    ) -> None:
        check_memory(state, WindowAttentionState, type(self).__name__)
        check_step_options(eps, state.window, state.sinks, window_factor, softmax_scale)
        linear = state.linear
        self.fmap = fmap
        self.features = fmap.features if isinstance(fmap, FeatureMap) else None
        self.eps = float(eps)
        batch, heads, features, values = linear.kv.shape
        kv_heads = heads if kv_heads is None else int(kv_heads)
        if kv_heads < 1 or heads % kv_heads:
            raise LinearAttentionError(f"kv_heads: must divide the state's {heads} heads, got {kv_heads}")
        self.kv_heads, self.group = kv_heads, heads // kv_heads
        dim = state.keys.shape[-1]
        self.scale = dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.window, self.sinks, self.num_tokens = state.window, state.sinks, state.num_tokens
        dtype, device = linear.kv.dtype, linear.kv.device
        self.gamma, self.window_factor = None, window_factor
        if window_factor is not None:
            gamma = torch.as_tensor(window_factor, dtype=dtype, device=device).detach()
            self.gamma = torch.broadcast_to(gamma, (batch, heads)).reshape(-1, 1).clone()  # (B·H, 1)
        self.kv = linear.kv.detach().clone(memory_format=torch.contiguous_format)
        self.k_sum = linear.k_sum.detach().clone(memory_format=torch.contiguous_format)
        self.shift = linear.shift.detach().clone()
        slots = self.sinks + self.window  # sink slots first, then the ring (position p in slot S + p mod W)
        # exact keys and values once per key/value head (B·Hkv rows); features and flags per query head (B·H rows)
        self.keys = torch.zeros(batch * kv_heads, slots, dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch * kv_heads, slots, values, dtype=dtype, device=device)
        self.key_features = torch.zeros(batch * heads, slots, features, dtype=dtype, device=device)
        self.live = torch.zeros(batch * heads, slots, dtype=torch.bool, device=device)  # an exact key now
        self._shape = (batch, heads, features, values)
        # rows of a left-padded batch (see stack): the padding of each (B·H,) row, None when no row is padded
        self.offsets: torch.Tensor | None = None
        self._max_offset = 0
        with torch.no_grad():
            ring = state.keys.shape[-2]
            first = self.num_tokens - ring  # position of the oldest buffered key
            if ring:
                positions = torch.arange(first, self.num_tokens, device=device)
                where = self.sinks + positions % self.window
                self._fill(where, state.keys, state.values, state.keep, live=True)
            sunk = state.sink_keys.shape[-2]
            if sunk:
                # a sink is a separate exact key once it has left the window (position < first)
                self._fill(torch.arange(sunk, device=device), state.sink_keys, state.sink_values, state.sink_keep,
                           live=torch.arange(sunk, device=device) < first)

    def _fill(self, where: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
              live: bool | torch.Tensor) -> None:
        """Writes buffered keys (B, H, L, ·) with their keep flags (B, H, L) into slots ``where`` (L,)."""
        keep = keep.reshape(-1, keep.shape[-1])
        kf = self._map(keys.to(self.keys.dtype), False)
        grouped = keys[:, :: self.group], values[:, :: self.group]  # the state repeats each key/value head
        self.keys[:, where] = grouped[0].reshape(-1, *keys.shape[-2:]).to(self.keys.dtype)
        self.values[:, where] = grouped[1].reshape(-1, *values.shape[-2:]).to(self.keys.dtype)
        self.key_features[:, where] = kf.reshape(-1, *kf.shape[-2:]).masked_fill(~keep.unsqueeze(-1), 0.0)
        self.live[:, where] = keep & live

    @torch.no_grad()
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        Inference only (no gradient flows through a step); output in q's dtype, the buffers in the state's."""
        out_dtype = q.dtype
        q, k, v, qf, kf, kept = self._inputs(q, k, v, keep)
        t, window, sinks = self.num_tokens, self.window, self.sinks
        slot = sinks + t % window
        per_row = self.offsets is not None and t - window - self._max_offset < sinks  # see stack
        if t >= window:  # key t − W leaves the window: a sink stays exact, any other key enters the linear sums
            if per_row:
                self._leave_rows(t, slot)
            elif t - window < sinks:
                self.live[:, t - window] = self.live[:, slot]
            else:
                self._enter_linear(slot, self.key_features[:, slot])
        self._write(t, slot, k, v, kf, kept)
        if per_row:
            self._sink_rows(t, k, v, kf)
        self.num_tokens = t + 1
        return self._output(q, qf, ~self.live, out_dtype)

    def _inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One token's inputs in the buffers' dtype: q (B, H, 1, d); k (B·Hkv, d) and v (B·Hkv, Dv), v zero where
        masked; the features qf (B·H, 1, F) and kf (B·H, F) (zero where masked: per query head, as per-head maps
        give them); the keep flags per query head (B·H,) or None."""
        check_token(q, k, v, keep, self.kv, (self._shape[0], self._shape[1], self._shape[3]))
        batch, heads, features, values = self._shape
        dtype = self.kv.dtype
        if q.dtype != dtype or k.dtype != dtype or v.dtype != dtype:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        kv_heads, group = self.kv_heads, self.group
        if k.shape[1] != kv_heads:
            if kv_heads != heads:
                raise LinearAttentionError(f"k: this step holds {kv_heads} key/value heads, got {k.shape[1]}")
            k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qf = self._map(q, True).reshape(-1, 1, features)  # (B·H, 1, F)
        kf = self._map(_repeat_heads(k, heads), False).reshape(-1, features)  # per query head: per-head maps
        k, v = k.reshape(-1, k.shape[-1]), v.reshape(-1, values)  # (B·Hkv, ·)
        kept = None
        if keep is not None:
            kept = keep.reshape(batch, 1).expand(batch, heads).reshape(-1)  # (B·H,)
            kf = kf.masked_fill(~kept.unsqueeze(-1), 0.0)
            v = v.masked_fill(~kept[::group].unsqueeze(-1), 0.0)
        return q, k, v, qf, kf, kept

    def _write(self, t: int, slot: int, k: torch.Tensor, v: torch.Tensor, kf: torch.Tensor,
               kept: torch.Tensor | None) -> None:
        """Key t (k, v: B·Hkv rows; kf: B·H rows) into its ring slot, and into its sink slot when t < S."""
        self.keys[:, slot] = k
        self.values[:, slot] = v
        self.key_features[:, slot] = kf
        self.live[:, slot] = True if kept is None else kept
        if t < self.sinks and self.offsets is None:  # also a sink: exact by its own slot once it has left the window
            self.keys[:, t], self.values[:, t], self.key_features[:, t] = k, v, kf
            self.live[:, t] = False

    def _output(self, q: torch.Tensor, qf: torch.Tensor, dead: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The hybrid's output (B, H, 1, Dv) of queries q (B, H, 1, d) with features qf (B·H, 1, F) from the linear
        sums and every exact slot, ``dead`` (B·H, slots) marking the slots that are not exact keys now; in
        ``out_dtype`` (default: the buffers' dtype)."""
        batch, heads, features, values = self._shape
        dtype = self.kv.dtype
        lin_num, lin_den = self._linear(qf)
        win_num, win_den, mass = self._exact(q, qf, dead)
        if mass is not None:
            num = lin_num.addcmul_((mass / win_den.clamp_(min=1.0)).unsqueeze(-1), win_num)
            den = lin_den.add_(mass)
        else:
            assert self.gamma is not None
            num = lin_num.addcmul_(self.gamma, win_num)
            den = lin_den.addcmul_(self.gamma.view(-1), win_den)
        den = den.add_(self.eps)
        if self.eps <= 0:  # no visible key and eps = 0: output 0, not 0/0 (as finalize)
            den = torch.where(den == 0, 1.0, den)
        out = num.div_(den.unsqueeze(-1)).view(batch, heads, 1, values)
        return out if out_dtype is None or out_dtype == dtype else out.to(out_dtype)

    def _linear(self, qf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear part: φ(q)·S (B·H, Dv) and φ(q)·z (B·H,), new tensors."""
        _, _, features, values = self._shape
        lin_num = torch.bmm(qf, self.kv.view(-1, features, values)).squeeze(1)
        return lin_num, torch.bmm(qf, self.k_sum.view(-1, features, 1)).view(-1)

    def _exact(self, q: torch.Tensor, qf: torch.Tensor, dead: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The exact part over the slots: Σ p·v (B·H, Dv), Σ p (B·H,) with p = e^{score − row max}, and (the mass
        form; None with γ) the mass φ(q)·Σφ(k) (B·H,) of the exact keys; ``dead`` (B·H, slots) marks the slots that
        are not exact keys now."""
        dtype = self.kv.dtype
        scores = self._scores(q)
        scores.mul_(self.scale)
        scores.masked_fill_(dead, float("-inf"))  # (B·H, slots)
        # the row maximum; −inf (no live key) becomes the lowest finite number, so e^{−inf − top} = 0
        top = scores.amax(-1, keepdim=True).clamp_(min=-torch.finfo(dtype).max)
        probs = scores.sub_(top).exp_()
        win_num = self._weighted_values(probs)
        win_den = probs.sum(-1)  # ≥ 1 (the maximum's own term) when a key is live, else 0
        if self.gamma is not None:
            return win_num, win_den, None
        return win_num, win_den, self._feature_weights(qf).masked_fill_(dead, 0.0).sum(-1)

    def _feature_weights(self, qf: torch.Tensor) -> torch.Tensor:
        """φ(q)·φ(k) of every exact slot: qf (B·H, 1, F) → (B·H, slots), a new tensor."""
        return torch.bmm(qf, self.key_features.transpose(1, 2)).squeeze(1)

    def _scores(self, q: torch.Tensor) -> torch.Tensor:
        """q·k of every exact slot, unscaled: (B·Hkv, group, d) queries against each key/value head's keys →
        (B·H, slots), a new tensor."""
        return torch.bmm(q.reshape(-1, self.group, q.shape[-1]), self.keys.transpose(1, 2)).view(-1, self.keys.shape[1])

    def _weighted_values(self, probs: torch.Tensor) -> torch.Tensor:
        """Σ_slots probs·v: probs (B·H, slots) → (B·H, Dv)."""
        return torch.bmm(probs.view(-1, self.group, probs.shape[-1]), self.values).view(-1, self.values.shape[-1])

    @property
    def batch_size(self) -> int:
        return self._shape[0]

    def _enter_linear(self, slot: int, features: torch.Tensor) -> None:
        """The key in ``slot``, with ``features`` (B·H, F) (zero where it does not enter), into the linear sums."""
        _, _, width, values = self._shape
        x = self.values[:, slot]  # (B·Hkv, Dv): one row per query head below
        x = x if self.group == 1 else x.repeat_interleave(self.group, dim=0)
        self.kv.view(-1, width, values).addcmul_(features.unsqueeze(-1), x.unsqueeze(-2))
        self.k_sum.view(-1, width).add_(features)

    def _leave_rows(self, t: int, slot: int) -> None:
        """Key t − W leaves the window when rows are padded by different amounts (see :meth:`stack`): for row r it
        is its own token t − W − pad_r, a sink when that is < S (it stays exact), else it enters the linear sums
        (padding: its zero features add nothing)."""
        assert self.offsets is not None
        local = t - self.window - self.offsets  # (B·H,)
        sink = (local >= 0) & (local < self.sinks)
        self._enter_linear(slot, self.key_features[:, slot].masked_fill(sink.unsqueeze(-1), 0.0))
        rows = sink.nonzero().squeeze(-1)
        if rows.numel():
            self.live[rows, local[rows]] = self.live[rows, slot]

    def _sink_rows(self, t: int, k: torch.Tensor, v: torch.Tensor, kf: torch.Tensor) -> None:
        """The new key (k, v: B·Hkv rows; kf: B·H rows) is also a sink of the rows whose own position t − pad_r
        is < S."""
        assert self.offsets is not None
        local = t - self.offsets
        rows = (local < self.sinks).nonzero().squeeze(-1)
        if rows.numel():
            at, grouped = local[rows], rows // self.group  # query-head row b·H + h holds key/value row b·Hkv + h // g
            self.keys[grouped, at], self.values[grouped, at] = k[grouped], v[grouped]
            self.key_features[rows, at] = kf[rows]
            self.live[rows, at] = False

    @classmethod
    def stack(cls, steps: list[WindowDecodeStep], pads: list[int]) -> WindowDecodeStep:
        """One step for a left-padded batch from one-row steps built on each row alone (its tokens without the
        padding): row r was padded by ``pads[r]`` positions, so every ``num_tokens + pads[r]`` is the batch's
        length. Each row keeps its own first S tokens as sinks — what it would have generating alone — where a
        :class:`~linattn.WindowAttentionState` of the padded batch counts sinks by position (the first S
        positions, padding for a padded row). ``state()`` is refused until every row's sinks have left its window;
        ``index_select`` works."""
        if not steps or len(steps) != len(pads) or any(step.batch_size != 1 for step in steps):
            raise LinearAttentionError("steps/pads: need one one-row WindowDecodeStep per pad count")
        if any(type(step) is not WindowDecodeStep for step in steps):  # a subclass keeps more than the ring
            raise LinearAttentionError("steps: only plain WindowDecodeSteps stack (a sparse cache's step does not)")
        first = steps[0]
        total = first.num_tokens + pads[0]
        if any(step.num_tokens + pad != total or pad < 0 for step, pad in zip(steps, pads, strict=True)):
            raise LinearAttentionError(f"pads: each row's tokens + its padding must equal the batch length; got "
                                       f"tokens {[step.num_tokens for step in steps]} and pads {pads}")
        _, heads, features, values = first._shape
        new = copy.copy(first)
        sinks, window = first.sinks, first.window

        def rows(name: str) -> torch.Tensor:
            parts = []
            for step, pad in zip(steps, pads, strict=True):
                x = getattr(step, name)
                # ring slot S + p mod W of a row's own position p is slot S + (p + pad) mod W of the batch's
                parts.append(torch.cat([x[:, :sinks], x[:, sinks:].roll(pad % window, dims=1)], dim=1))
            return torch.cat(parts)

        new.keys, new.values, new.key_features, new.live = (rows(n) for n in ("keys", "values", "key_features", "live"))
        new.kv = torch.cat([step.kv for step in steps])
        new.k_sum = torch.cat([step.k_sum for step in steps])
        new.shift = torch.cat([step.shift for step in steps])
        if first.gamma is not None:
            new.gamma = torch.cat([step.gamma for step in steps if step.gamma is not None])
        new.num_tokens, new._shape = total, (len(steps), heads, features, values)
        new.offsets = torch.tensor(pads, device=first.kv.device).repeat_interleave(heads)  # (B·H,)
        new._max_offset = max(pads)
        return new

    def state(self) -> WindowAttentionState:
        """The state after every token stepped (new tensors: the step may go on)."""
        batch, heads, features, values = self._shape
        t, window, sinks = self.num_tokens, self.window, self.sinks
        if self.offsets is not None and bool((self.offsets > 0).any()) and t - window - self._max_offset < sinks:
            # (once every row's sinks have left the window, the sink slots hold them and the state below is exact)
            raise LinearAttentionError(
                "state: this step's rows were left-padded by different amounts and keep their own first tokens as "
                "sinks, which a WindowAttentionState (sinks = the first positions) cannot hold while a row's sinks "
                "are still in its window; continue one token per call, or prefill the rows without padding"
            )
        ring = min(window, t)
        where = sinks + torch.arange(t - ring, t, device=self.keys.device) % window  # oldest first
        sunk = min(sinks, t)

        def rows(x: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
            picked = x[:, index]
            if x.shape[0] != batch * heads:  # keys/values: each key/value head repeated for its query heads
                return picked.reshape(batch, self.kv_heads, *picked.shape[1:]).repeat_interleave(self.group, dim=1)
            return picked.reshape(batch, heads, *picked.shape[1:]).clone()

        keep = self.live[:, where]  # indexing by a tensor copies
        sink_keep = self.live[:, :sunk].clone()
        # a sink still in the window is not yet live in its own slot: its keep flag is its ring slot's
        in_ring = [p for p in range(sunk) if p >= t - ring]
        if in_ring:
            sink_keep[:, in_ring] = self.live[:, [sinks + p % window for p in in_ring]]
        linear = LinearAttentionState(self.kv.clone(), self.k_sum.clone(), self.shift.clone(), max(0, t - window))
        return WindowAttentionState(
            linear, rows(self.keys, where), rows(self.values, where), keep.reshape(batch, heads, -1),
            rows(self.keys, slice(0, sunk)), rows(self.values, slice(0, sunk)),
            sink_keep.reshape(batch, heads, -1), window, sinks, t,
        )

    def index_select(self, dim: int, index: torch.Tensor) -> WindowDecodeStep:
        """A step on the selected batch rows (beam search; ``dim`` 0, the batch), its buffers indexed."""
        if dim != 0:
            raise LinearAttentionError(f"dim: a decode step selects batch rows (dim 0), got {dim}")
        _, heads, features, values = self._shape
        index = index.to(self.kv.device)
        rows = (index.unsqueeze(-1) * heads + torch.arange(heads, device=index.device)).reshape(-1)  # (B'·H,)
        grouped = (index.unsqueeze(-1) * self.kv_heads + torch.arange(self.kv_heads, device=index.device)).reshape(-1)
        new = copy.copy(self)
        new.kv, new.k_sum, new.shift = (x.index_select(0, index) for x in (self.kv, self.k_sum, self.shift))
        new.keys, new.values = self.keys.index_select(0, grouped), self.values.index_select(0, grouped)
        new.key_features, new.live = self.key_features.index_select(0, rows), self.live.index_select(0, rows)
        if self.gamma is not None:
            new.gamma = self.gamma.index_select(0, rows)
        if self.offsets is not None:
            new.offsets = self.offsets.index_select(0, rows)
        new._shape = (index.numel(), heads, features, values)
        return new
