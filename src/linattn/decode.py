"""A lean causal decode step: one new token per call against a preallocated fp32 state updated in place.

``linear_attention(..., initial_state=s, return_state=True)`` on one token costs ~0.3 ms per call at H = 8,
d = 64, almost all of it argument checking, dtype/device handling and allocation of new state tensors — per layer
and per generated token. :class:`DecodeStep` pays the checks once (when it is built from a state) and then does, per
token, the feature maps and a handful of in-place ops:

    S ← S·c + φ(k)vᵀ,   z ← z·c + φ(k),   out = φ(q)·S / (φ(q)·z + eps)

(c = exp(shift_old − shift_new) ≤ 1 for log-space maps, whose sums are kept at the running maximum log-feature
``shift``; no rescaling for ordinary maps). The arithmetic is the recurrent form's (:mod:`linattn.forms.recurrent`),
so a step agrees with ``linear_attention`` up to fp32 rounding (tests/test_decoder_generate.py).

Only the plain state (:class:`~linattn.LinearAttentionState`), ``normalize=True``, no ``min_denom`` and a positive
map qualify (:func:`supports`). On a CUDA device with triton installed, an ordinary map's step (no padding mask) is
one launch of the Triton decoding kernel on the state in place, elu + 1 made inside it (8.9 µs per layer step at
H = 32, d = 128 on an H200 in a CUDA graph: docs/benchmarks.md).

:class:`WindowDecodeStep` does the same for the sliding-window hybrid (``window=W, sinks=S``, either scale form) with
an ordinary (not log-space) map: one preallocated buffer of S sink slots and a ring of W slots holding each exact
key, its value and its feature vector φ(k) (computed once, when the key arrives — the recurrent form recomputes
φ of all W + S buffered keys every token), and the linear sums of the keys that have left the window. Per token:
the key leaving the window enters the linear sums (a sink instead becomes a separate exact key), the new key takes
its slot, and the output is the hybrid's (mass form: out = (φ(q)·S + M·A) / (φ(q)·z + M + eps), A the softmax
average over the live exact keys, M = Σ_exact φ(q)·φ(k); γ form: the γ-weighted exact sums). Anything else —
log-space maps, ``min_denom``, other options — goes through ``linear_attention`` (:func:`supports_window`).
With grouped-query attention (``kv_heads=``) the exact keys and values are held once per key/value head.
:meth:`WindowDecodeStep.stack` joins one-row steps into the step of a left-padded batch in which each row keeps its
own first S tokens as sinks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .errors import LinearAttentionError
from .feature_maps import FeatureMap
from .state import LinearAttentionState, WindowAttentionState

# linear_attention options a step reproduces; any other option (window=, sinks=, min_denom=, ...) is left to it
STEP_OPTIONS = frozenset({"eps", "chunk_size", "form"})
WINDOW_STEP_OPTIONS = STEP_OPTIONS | frozenset({"window", "sinks", "window_factor", "softmax_scale"})


class _Step:
    """What both decode steps share: the feature map of one token."""

    fmap: nn.Module
    features: Any

    def _map(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.features is not None:
            return self.features(x, is_query=is_query)
        return self.fmap(x)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: (B, Hkv, 1, ·) → (B, H, 1, ·), each key/value head serving H / Hkv query heads."""
    group = heads // x.shape[1]
    if group == 1:
        return x
    return x.unsqueeze(2).expand(x.shape[0], x.shape[1], group, 1, x.shape[-1]).reshape(x.shape[0], heads, 1, -1)


def _qualifies(fmap: nn.Module, kv: torch.Tensor, options: dict[str, Any], allowed: frozenset[str]) -> bool:
    """What both steps need: fp32/fp64 sums, only options they reproduce, normalised output, a positive map."""
    return (
        kv.dtype in (torch.float32, torch.float64)
        and set(options) <= allowed
        and options.get("normalize", True)
        and getattr(fmap, "positive", True) is not False
    )


def supports(fmap: nn.Module, state: Any, options: dict[str, Any]) -> bool:
    """Whether :class:`DecodeStep` computes what ``linear_attention(..., **options)`` would from ``state``."""
    return type(state) is LinearAttentionState and _qualifies(fmap, state.kv, options, STEP_OPTIONS)


class DecodeStep(_Step):
    """Causal linear attention one token at a time, from a state returned by ``linear_attention``.

    Args:
        fmap: the feature map the state was built with.
        state: batch shape (B, H): ``kv`` (B, H, F, Dv), ``k_sum`` (B, H, F), ``shift`` (B, H). Copied once.
        eps: the denominator's eps (as given to ``linear_attention``).
    """

    def __init__(self, fmap: nn.Module, state: LinearAttentionState, *, eps: float = 1e-6) -> None:
        if state.kv.dim() != 4:
            raise LinearAttentionError(
                f"state: a decode step needs a state of batch shape (B, H), got kv of shape {tuple(state.kv.shape)}"
            )
        self.fmap = fmap
        self.log_space = bool(getattr(fmap, "log_space", False))
        self.features = fmap.features if isinstance(fmap, FeatureMap) else None
        self.eps = float(eps)
        # contiguous copies, owned by the step and updated in place from now on
        self.kv = state.kv.detach().clone(memory_format=torch.contiguous_format)
        self.k_sum = state.k_sum.detach().clone(memory_format=torch.contiguous_format)
        self.shift = state.shift.detach().clone()
        self.num_tokens = state.num_tokens
        batch, heads, features, values = self.kv.shape
        self._flat = (batch * heads, features, values)
        self._scratch = torch.empty(batch, heads, 1, dtype=self.kv.dtype, device=self.kv.device)
        self._kernel = _step_kernel(fmap, self.kv, self.log_space, self.eps)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, 1, d), k (B, Hkv, 1, d), v (B, Hkv, 1, Dv), keep (B, 1) bool or None → out (B, H, 1, Dv).

        Output in q's dtype; the state stays in its own (fp32 or fp64).
        """
        batch, heads, features, values = self.kv.shape
        out_dtype = q.dtype
        dtype = self.kv.dtype
        if self._kernel is not None and keep is None:
            return self._fused(q, k, v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        qf = self._map(q, True)  # (B, H, 1, F)
        kf = self._map(k, False)  # (B, H, 1, F)
        if keep is not None:
            drop = ~keep.reshape(batch, 1, 1, 1)
            kf = kf.masked_fill(drop, float("-inf") if self.log_space else 0.0)
            v = v.masked_fill(drop, 0.0)
        if self.log_space:
            qf = torch.exp(qf - qf.amax(-1, keepdim=True))  # a per-query shift: cancels in the ratio
            new = torch.maximum(self.shift, kf.amax(-1).squeeze(-1))  # (B, H) running maximum
            finite = torch.where(new == float("-inf"), 0.0, new)
            carry = torch.exp(torch.where(self.shift == float("-inf"), float("-inf"), self.shift - finite))
            self.kv.mul_(carry[..., None, None])
            self.k_sum.mul_(carry[..., None])
            self.shift.copy_(new)
            kf = torch.exp(kf - finite[..., None, None])
        kf = kf.reshape(batch, heads, features)
        # S += φ(k) vᵀ and z += φ(k), in place
        self.kv.view(self._flat).addcmul_(kf.reshape(-1, features, 1), v.reshape(-1, 1, values))
        self.k_sum.add_(kf)
        self.num_tokens += 1
        qf = qf.reshape(-1, 1, features)  # (B·H, 1, F)
        num = torch.bmm(qf, self.kv.view(self._flat))  # (B·H, 1, Dv)
        den = torch.bmm(qf, self.k_sum.view(-1, features, 1), out=self._scratch.view(-1, 1, 1))
        den = den.add_(self.eps)
        if self.eps <= 0:  # no visible key and eps = 0: output 0, not 0/0 (as finalize); eps > 0 keeps den > 0
            den = torch.where(den == 0, 1.0, den)
        return (num / den).view(batch, heads, 1, values).to(out_dtype)

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step as one Triton kernel (CUDA): the state updated in place; elu + 1 made in the kernel from the raw
        projections, any other ordinary map made here in fp32 first."""
        assert self._kernel is not None
        batch, heads, features, values = self.kv.shape
        k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
        elu, out_dtype = self._kernel.elu, q.dtype
        if not elu:
            q = self._map(q.to(self.kv.dtype), True)
            k = self._map(k.to(self.kv.dtype), False)
        out = torch.empty(batch, heads, 1, values, dtype=out_dtype, device=q.device)  # the kernel rounds once
        kv, k_sum = self.kv.view(self._flat), self.k_sum.view(-1, features)
        self._kernel.launch_step(
            q.contiguous(), k.contiguous(), v.contiguous(), kv, k_sum, out, kv, k_sum,
            normalize=True, eps=self.eps, min_denom=None, elu=elu,
        )
        self.num_tokens += 1
        return out

    @property
    def batch_size(self) -> int:
        return int(self.kv.shape[0])

    def state(self) -> LinearAttentionState:
        """The state after every token stepped (shares the step's tensors: clone before stepping further)."""
        return LinearAttentionState(self.kv, self.k_sum, self.shift, self.num_tokens)

    def index_select(self, dim: int, index: torch.Tensor) -> DecodeStep:
        """A step on the selected batch rows (beam search), as the state's ``index_select``."""
        return DecodeStep(self.fmap, self.state().index_select(dim, index), eps=self.eps)


class _StepKernel:
    """The Triton decoding kernel for :class:`DecodeStep`, and whether it makes the elu + 1 features itself."""

    def __init__(self, elu: bool) -> None:
        from .backends import triton as triton_backend

        self.launch_step = triton_backend.load().launch_step
        self.elu = elu


def _step_kernel(fmap: nn.Module, kv: torch.Tensor, log_space: bool, eps: float) -> _StepKernel | None:
    """The fused kernel when it computes this step: an fp32 state on a CUDA device (or on CPU under
    TRITON_INTERPRET=1), triton importable, an ordinary map, F and Dv within the kernels' sizes, eps > 0."""
    from .backends import triton as triton_backend
    from .feature_maps.elementwise import EluFeatureMap

    on_device = kv.device.type == "cuda" or (kv.device.type == "cpu" and triton_backend.interpreting())
    if (not on_device or kv.dtype != torch.float32 or log_space or eps <= 0
            or max(kv.shape[-2:]) > triton_backend.MAX_DIM or triton_backend.import_error() is not None):
        return None
    return _StepKernel(elu=type(fmap) is EluFeatureMap)


def supports_window(fmap: nn.Module, state: Any, options: dict[str, Any]) -> bool:
    """Whether :class:`WindowDecodeStep` computes what ``linear_attention(..., **options)`` would from ``state``."""
    return (
        type(state) is WindowAttentionState
        and state.linear.kv.dim() == 4
        and _qualifies(fmap, state.linear.kv, options, WINDOW_STEP_OPTIONS)
        and not getattr(fmap, "log_space", False)
    )


def lean_step(
    fmap: nn.Module, state: Any, options: dict[str, Any], kv_heads: int
) -> DecodeStep | WindowDecodeStep | None:
    """The lean step that continues ``state`` as ``linear_attention(..., **options)`` would, or None where neither
    step reproduces the call (:func:`supports`, :func:`supports_window`); ``kv_heads`` as :class:`WindowDecodeStep`."""
    if isinstance(state, LinearAttentionState) and supports(fmap, state, options):
        return DecodeStep(fmap, state, eps=options.get("eps", 1e-6))
    if isinstance(state, WindowAttentionState) and supports_window(fmap, state, options):
        return window_step(fmap, state, options, kv_heads)
    return None


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
        linear = state.linear
        if linear.kv.dim() != 4:
            raise LinearAttentionError(
                f"state: a decode step needs a state of batch shape (B, H), got kv of shape {tuple(linear.kv.shape)}"
            )
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
        batch, heads, features, values = self._shape
        out_dtype, dtype = q.dtype, self.kv.dtype
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
        self.keys[:, slot] = k
        self.values[:, slot] = v
        self.key_features[:, slot] = kf
        self.live[:, slot] = True if kept is None else kept
        if per_row:
            self._sink_rows(t, k, v, kf)
        elif t < sinks:  # also a sink: exact by its own slot once it has left the window
            self.keys[:, t], self.values[:, t], self.key_features[:, t] = k, v, kf
            self.live[:, t] = False
        self.num_tokens = t + 1
        lin_num = torch.bmm(qf, self.kv.view(-1, features, values)).squeeze(1)  # (B·H, Dv)
        lin_den = torch.bmm(qf, self.k_sum.view(-1, features, 1)).view(-1)
        # (B·Hkv, group, d) queries against each key/value head's keys: (B·H, S + W) scores
        scores = torch.bmm(q.reshape(-1, group, q.shape[-1]), self.keys.transpose(1, 2)).view(-1, self.keys.shape[1])
        scores.mul_(self.scale)
        dead = ~self.live
        scores.masked_fill_(dead, float("-inf"))  # (B·H, S + W)
        # the row maximum; −inf (no live key) becomes the lowest finite number, so e^{−inf − top} = 0
        top = scores.amax(-1, keepdim=True).clamp_(min=-torch.finfo(dtype).max)
        probs = scores.sub_(top).exp_()
        win_num = torch.bmm(probs.view(-1, group, probs.shape[-1]), self.values).view(-1, values)
        win_den = probs.sum(-1)  # ≥ 1 (the maximum's own term) when a key is live, else 0
        if self.gamma is None:
            weights = torch.bmm(qf, self.key_features.transpose(1, 2)).squeeze(1)  # (B·H, S + W)
            mass = weights.masked_fill_(dead, 0.0).sum(-1)
            num = lin_num.addcmul_((mass / win_den.clamp_(min=1.0)).unsqueeze(-1), win_num)
            den = lin_den.add_(mass)
        else:
            num = lin_num.addcmul_(self.gamma, win_num)
            den = lin_den.addcmul_(self.gamma.view(-1), win_den)
        den = den.add_(self.eps)
        if self.eps <= 0:  # no visible key and eps = 0: output 0, not 0/0 (as finalize)
            den = torch.where(den == 0, 1.0, den)
        out = num.div_(den.unsqueeze(-1)).view(batch, heads, 1, values)
        return out if out_dtype == dtype else out.to(out_dtype)

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
