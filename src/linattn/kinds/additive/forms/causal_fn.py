"""Causal chunkwise linear attention as a ``torch.autograd.Function`` whose backward recomputes from the inputs.

Notation (leading dims ``...`` are batch and heads; chunk C; a block is b = L/C consecutive chunks):
    Q, K  (..., N, F)   features (for log-space maps K_j is stored at log-scale r_j, so the true key is K_j·e^{r_j},
                        and query t reads at scale r_t: r is non-decreasing, so every factor below is ≤ 1)
    V     (..., N, Dv)  values
    S, z  (..., F, Dv), (..., F)  the running state Σ φ(k)vᵀ and Σ φ(k); S' = [S, z] (..., F, Dv+1) at the interface

Per chunk c with incoming state (S_c, z_c) at scale s_c and chunk-end scale e_c, W_c = (Q_c K_cᵀ) ⊙ E_c:
    num_c = W_c V_c + diag(α_c) Q_c S_c,   den_c = W_c 1 + diag(α_c) Q_c z_c
    S_{c+1} = e^{s_c − e_c} S_c + (diag(γ_c) K_c)ᵀ V_c,   z_{c+1} = e^{s_c − e_c} z_c + (diag(γ_c) K_c)ᵀ 1
with E_tj = e^{r_j − r_t}[j ≤ t], α_t = e^{s_c − r_t}, γ_j = e^{r_j − e_c} (ordinary maps: r ≡ 0, so E is the causal
mask and α = γ = 1). Within a block the states entering each chunk are one GEMM with a b×b matrix of 0/1 (or decay)
weights, so the Python loop runs over blocks only. Numerator and denominator take separate GEMMs: a (Dv+1)-wide
operand (a ones column on V) ran ~1.8× slower per FLOP than a 64-wide one on the CPU we measured.

Memory: forward saves the inputs, the output, the normaliser (..., N) and one state per block; backward rebuilds
each block's C×C weights and per-chunk states from them. Training memory is O(N·(F + Dv)) + O((N/L)·F·Dv) plus
one block's O(L·(C + F + Dv)) work space, never O(N·F·Dv).

Gradient of the log-scales: the output depends on (Q, K, r) only through Q_t e^{−r_t} and K_j e^{r_j}, so
∂L/∂r_t = Σ_f K_tf ∂L/∂K_tf − Σ_f Q_tf ∂L/∂Q_tf (minus Σ S'_final ⊙ ∂L/∂S'_final at the last token, whose scale
the final state is stored at); an initial state stored at scale s_0 gets ∂L/∂s_0 = Σ S'_0 ⊙ ∂L/∂S'_0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F

from ....features import finite
from ._common import rowdot, scale_between

# Elements of Q, K and V per block (over all batch and head rows): about 4 MiB of fp32, so a block's operands stay
# in cache. Measured on a 2-core CPU at B·H=8, F=Dv=64, N=16384 (this gives 1024 tokens per block): blocks of
# 512–1024 tokens ran the forward 1.2–1.6× faster than 4096–16384 (docs/benchmarks.md, "Chunk size and block size").
BLOCK_ELEMENTS = 1 << 20


def block_tokens(rows: int, features: int, values: int, chunk: int) -> int:
    """Tokens per block for ``rows`` batch×head rows: BLOCK_ELEMENTS / (rows·(F+Dv)), whole chunks, ≥ 1 chunk."""
    tokens = BLOCK_ELEMENTS // max(1, rows * (features + values))
    return max(chunk, tokens // chunk * chunk)


def _chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(..., L, D) → (..., L/C, C, D) contiguous, zero-padding L up to a multiple of C."""
    pad = -x.shape[-2] % size
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], -1, size, x.shape[-1]).contiguous()


def _denominator(den: torch.Tensor, min_denom: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The divisor of ``finalize`` from den + eps: clamped at ``min_denom``, and 1 where it is exactly 0 (no
    visible key, eps = 0: the numerator is 0 too). Also where it does not depend on den (clamped or replaced)."""
    constant = den == 0
    if min_denom is not None:
        constant = constant | (den < min_denom)
        den = den.clamp(min=min_denom)
        constant = constant | (den == 0)
    return torch.where(den == 0, torch.ones_like(den), den), constant


def _lagged(x: torch.Tensor, head: torch.Tensor | None, start: int, end: int, blank: int) -> torch.Tensor:
    """Rows [start, end) of a key or value operand as the Function reads it: x (..., N, ·) itself, or, given
    ``head`` (..., E, ·), x read E rows late — [head; x[:N−E]] — with its first ``blank`` rows zero. The hybrid's
    linear part reads its keys so (a key enters the state when it leaves the window) without a shifted copy."""
    if head is None:
        return x[..., start:end, :]
    early, end = head.shape[-2], min(end, x.shape[-2])
    if start >= early and blank <= start:
        return x[..., start - early : end - early, :]  # a view: every block past the first E rows
    tail = x[..., max(0, start - early) : max(0, end - early), :]
    part = torch.cat([head[..., start : min(end, early), :], tail], -2)
    if blank > start:
        part[..., : blank - start, :] = 0.0
    return part


def _put_lagged(
    grad_x: torch.Tensor, grad_head: torch.Tensor | None, part: torch.Tensor, start: int, blank: int
) -> None:
    """The inverse of :func:`_lagged`: writes a block's gradient rows [start, start + L) into ∂L/∂(x, head)."""
    if grad_head is None:
        grad_x[..., start : start + part.shape[-2], :] = part
        return
    early, end = grad_head.shape[-2], start + part.shape[-2]
    if blank > start:
        part[..., : blank - start, :] = 0.0  # blank rows read zeros, not x
    if start < early:
        grad_head[..., start : min(end, early), :] = part[..., : min(end, early) - start, :]
    if end > early:
        grad_x[..., max(start, early) - early : end - early, :] = part[..., max(start, early) - start :, :]


class _Block:
    """One block's chunked operands and the states entering its chunks, shared by forward and backward."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        r: torch.Tensor | None,
        state_in: tuple[torch.Tensor, torch.Tensor],
        scale_in: torch.Tensor | None,
        size: int,
    ) -> None:
        self.length = q.shape[-2]
        self.q = _chunks(q, size)  # (..., b, C, F)
        self.k = _chunks(k, size)  # (..., b, C, F)
        self.v = _chunks(v, size)  # (..., b, C, Dv)
        chunks = self.q.shape[-3]
        self.keep = keep = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        weights = self.q @ self.k.transpose(-1, -2)  # (..., b, C, C)
        earlier = torch.ones(chunks, chunks, dtype=torch.bool, device=q.device).tril(-1)  # chunk c' < c
        self.scaled = r is not None
        if r is None:
            self.weights = weights.masked_fill_(~keep, 0)
            self.keys = self.k
            # update c' reaches every later chunk of the block, unscaled: a GEMM with a 0/1 matrix is the
            # exclusive prefix sum (faster on CPU than cumsum over a middle dimension)
            self.decay = earlier.to(q.dtype)  # (b, b)
            self.scale_out = None
        else:
            # Scales can be large (a decay adds |log γ| per token: 0.69·65536 ≈ 45000 for γ = 0.5) while only their
            # local differences matter; fp32 keeps ~6e-5 of absolute precision at 640. So everything crossing
            # chunks is formed in fp64 (b-sized), and each chunk's C-sized factors come from scales re-based to the
            # chunk's end in fp64 before the cast: only differences of at most a chunk's worth of decay reach fp32.
            r = r.to(torch.float64)
            pad = -r.shape[-1] % size
            if pad:  # padded keys are zero: repeating the last scale keeps r non-decreasing
                r = torch.cat([r, r[..., -1:].expand(*r.shape[:-1], pad)], dim=-1)
            r = r.reshape(*r.shape[:-1], chunks, size)  # (..., b, C)
            ends = r[..., -1]  # (..., b): the scale each chunk's update is stored at
            assert scale_in is not None
            scale_in = scale_in.to(torch.float64)
            scales = torch.cat([scale_in.unsqueeze(-1), ends[..., :-1]], dim=-1)  # (..., b): scale entering chunk c
            self.scale_out = ends[..., -1]  # fp64, carried to the next block
            base = finite(ends)  # (..., b); -inf only while every key so far is masked
            local = (r - base.unsqueeze(-1)).to(q.dtype)  # (..., b, C), ≤ 0
            # E and α from scales re-based to the chunk's entering scale s_c, not to its end: the end depends on
            # the chunk's later keys (a log-space map's running maximum), and a row before t must not change by a
            # bit when key t does (the repair of bad values rests on it, _dispatch.py); s_c comes from before the
            # chunk. Still within a chunk's worth of s_c, so fp32 keeps the differences as precisely.
            entering = scales.unsqueeze(-1)  # (..., b, 1): s_c
            causal_local = (r - finite(entering)).to(q.dtype)  # (..., b, C), ≥ 0
            self.masked_decay = scale_between(causal_local.unsqueeze(-2), causal_local.unsqueeze(-1), keep)  # E
            self.weights = weights * self.masked_decay
            self.key_decay = torch.exp(local).unsqueeze(-1)  # γ (..., b, C, 1)
            self.keys = self.k * self.key_decay
            self.query_decay = scale_between((entering - finite(entering)).to(q.dtype), causal_local)  # α (..., b, C)
            # update c' (at scale e_c') reaches chunk c > c' at scale s_c, and the block's output at e_{b−1}
            dtype = q.dtype
            self.decay = scale_between(ends.unsqueeze(-2), scales.unsqueeze(-1), earlier).to(dtype)  # (..., b, b)
            self.out_decay = scale_between(ends, self.scale_out.unsqueeze(-1)).to(dtype)  # (..., b)
            self.carry = scale_between(scale_in.unsqueeze(-1), scales).to(dtype)  # (..., b): S_in moved to each s_c
            self.out_carry = scale_between(scale_in, self.scale_out).to(dtype)  # (...)
        kv_in, z_in = state_in
        kv_enter, kv_out = self._propagate(self.keys.transpose(-1, -2) @ self.v, kv_in)  # updates (..., b, F, Dv)
        z_enter, z_out = self._propagate(self.keys.sum(-2).unsqueeze(-1), z_in.unsqueeze(-1))  # (..., b, F, 1)
        self.kv_enter, self.z_enter = kv_enter, z_enter.squeeze(-1)  # (..., b, F, Dv), (..., b, F)
        self.state_out = (kv_out, z_out.squeeze(-1))

    def _propagate(self, updates: torch.Tensor, state_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-chunk updates (..., b, F, D) and the block's input state (..., F, D) → the states entering each
        chunk (..., b, F, D) and leaving the block (..., F, D)."""
        flat = updates.flatten(-2)  # (..., b, F·D)
        state_flat = state_in.flatten(-2)  # (..., F·D)
        entering = self.decay @ flat
        if self.scaled:
            entering += self.carry.unsqueeze(-1) * state_flat.unsqueeze(-2)
            out = (self.out_decay.unsqueeze(-2) @ flat).squeeze(-2) + self.out_carry.unsqueeze(-1) * state_flat
        else:
            entering += state_flat.unsqueeze(-2)
            out = flat.sum(-2) + state_flat
        return entering.unflatten(-1, updates.shape[-2:]), out.unflatten(-1, updates.shape[-2:])

    def _propagate_back(self, grad_entering: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The transpose of :meth:`_propagate`: ∂L/∂(entering states, output state) → ∂L/∂(updates, input state)."""
        flat = grad_entering.flatten(-2)  # (..., b, F·D)
        out_flat = grad_out.flatten(-2)  # (..., F·D)
        grad_updates = self.decay.transpose(-1, -2) @ flat
        if self.scaled:
            grad_updates += self.out_decay.unsqueeze(-1) * out_flat.unsqueeze(-2)
            grad_in = (self.carry.unsqueeze(-2) @ flat).squeeze(-2) + self.out_carry.unsqueeze(-1) * out_flat
        else:
            grad_updates += out_flat.unsqueeze(-2)
            grad_in = flat.sum(-2) + out_flat
        return grad_updates.unflatten(-1, grad_out.shape[-2:]), grad_in.unflatten(-1, grad_out.shape[-2:])

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(..., b, C, D) → (..., L, D), dropping the padded rows; (..., b, C) → (..., L)."""
        batch = self.q.shape[:-3]
        if x.dim() == self.q.dim() - 1:
            return x.reshape(*batch, -1)[..., : self.length]
        return x.reshape(*batch, -1, x.shape[-1])[..., : self.length, :]

    def forward(self, normalize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """num (..., L, Dv) and, when ``normalize``, den (..., L): intra-chunk block plus the carried state."""
        inter = self.q @ self.kv_enter  # (..., b, C, Dv)
        if self.scaled:
            inter *= self.query_decay.unsqueeze(-1)
        num = inter.flatten(0, -3).baddbmm_(self.weights.flatten(0, -3), self.v.flatten(0, -3))
        den = None
        if normalize:
            inter_den = (self.q @ self.z_enter.unsqueeze(-1)).squeeze(-1)  # (..., b, C)
            if self.scaled:
                inter_den *= self.query_decay
            den = self._tokens(self.weights.sum(-1) + inter_den)
        return self._tokens(num.reshape(self.q.shape[:-1] + num.shape[-1:])), den

    def backward(
        self, grad_num: torch.Tensor, grad_den: torch.Tensor | None, grad_out: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """∂L/∂num (..., L, Dv), ∂L/∂den (..., L) and ∂L/∂(S, z) leaving the block → ∂L/∂(Q, K, V) of the block
        and ∂L/∂(S, z) entering it."""
        size = self.q.shape[-2]
        grad = _chunks(grad_num, size)  # (..., b, C, Dv)
        grad_weights = grad @ self.v.transpose(-1, -2)  # (..., b, C, C)
        grad_d = _chunks(grad_den.unsqueeze(-1), size) if grad_den is not None else None  # (..., b, C, 1)
        if grad_d is not None:
            grad_weights += grad_d  # den_t = Σ_j W_tj
        grad_inter, grad_inter_d = grad, grad_d
        if self.scaled:
            grad_weights *= self.masked_decay
            grad_inter = grad * self.query_decay.unsqueeze(-1)
            grad_inter_d = grad_d * self.query_decay.unsqueeze(-1) if grad_d is not None else None
        else:
            grad_weights.masked_fill_(~self.keep, 0)
        grad_q = (grad_weights @ self.k).flatten(0, -3)
        grad_q = grad_q.baddbmm_(grad_inter.flatten(0, -3), self.kv_enter.transpose(-1, -2).flatten(0, -3))
        grad_q = grad_q.reshape(self.q.shape)
        grad_kv_enter = self.q.transpose(-1, -2) @ grad_inter  # (..., b, F, Dv): ∂L/∂S_c from chunk c's queries
        grad_z_enter = torch.zeros_like(self.z_enter).unsqueeze(-1)  # (..., b, F, 1)
        if grad_inter_d is not None:  # the rank-one term ∂L/∂den ⊗ z, accumulated in place
            grad_q.flatten(0, -3).baddbmm_(grad_inter_d.flatten(0, -3), self.z_enter.unsqueeze(-2).flatten(0, -3))
            grad_z_enter = self.q.transpose(-1, -2) @ grad_inter_d
        grad_kv_updates, grad_kv_in = self._propagate_back(grad_kv_enter, grad_out[0])
        grad_z_updates, grad_z_in = self._propagate_back(grad_z_enter, grad_out[1].unsqueeze(-1))
        grad_keys = (self.v @ grad_kv_updates.transpose(-1, -2)).add_(grad_z_updates.transpose(-1, -2))  # (.., b, C, F)
        if self.scaled:
            grad_keys *= self.key_decay
        grad_k = grad_keys.flatten(0, -3).baddbmm_(
            grad_weights.transpose(-1, -2).flatten(0, -3), self.q.flatten(0, -3)
        ).reshape(self.k.shape)
        grad_v = (self.keys @ grad_kv_updates).flatten(0, -3)  # (b·..., C, Dv)
        grad_v = grad_v.baddbmm_(self.weights.transpose(-1, -2).flatten(0, -3), grad.flatten(0, -3)).reshape(grad.shape)
        grad_in = (grad_kv_in, grad_z_in.squeeze(-1))
        return self._tokens(grad_q), self._tokens(grad_k), self._tokens(grad_v), grad_in


_Backward = TypeVar("_Backward", bound=Callable[..., Any])


def _without_autocast(backward: _Backward) -> _Backward:
    """backward() may be called inside a torch.autocast region: recompute in the forward's dtypes regardless."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: torch.Tensor | None) -> Any:
        device = next((g.device.type for g in grads if g is not None), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return cast(_Backward, wrapper)


class CausalChunkedFunction(torch.autograd.Function):
    """(Q, K, V, r, S'_0, s_0) → (out, kv_final, k_sum_final); see the module docstring. Once differentiable.

    With ``unnormalised=True`` (needs ``normalize=True``) the outputs are (num, kv_final, k_sum_final, den): the
    numerator (..., N, Dv) and denominator (..., N) before any eps or division, each query at its own scale r_t,
    so that a caller can add its own terms to both before dividing (the sliding-window hybrid does).

    Lagged keys and values: given ``k_head`` (..., E, F) (ordinary maps only) the keys read are [k_head; K[:N−E]]
    with the first ``blank`` rows zero, and given ``v_head`` the values likewise — K and V as given are read E rows
    late, block by block, with no shifted copy (the hybrid's linear part); their last E rows get zero gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ref: torch.Tensor | None,
        state0: torch.Tensor,
        scale0: torch.Tensor | None,
        size: int,
        block: int,
        normalize: bool,
        eps: float,
        min_denom: float | None,
        unnormalised: bool = False,
        k_head: torch.Tensor | None = None,
        v_head: torch.Tensor | None = None,
        blank: int = 0,
    ) -> tuple[torch.Tensor, ...]:
        if k_head is not None and ref is not None:
            raise ValueError("CausalChunkedFunction: lagged keys (k_head) are for maps without log-scales")
        values = v.shape[-1]
        out = q.new_empty(*q.shape[:-1], values)  # (..., N, Dv)
        denom = q.new_empty(q.shape[:-1]) if normalize else None  # (..., N): den + eps, before any clamp
        state = (state0[..., :values], state0[..., values])
        scale = scale0
        starts = list(range(0, q.shape[-2], block))
        block_kv, block_z, block_scales = [], [], []
        for start in starts:
            end = start + block
            block_kv.append(state[0])
            block_z.append(state[1])
            block_scales.append(scale)
            r = ref[..., start:end] if ref is not None else None
            kb, vb = _lagged(k, k_head, start, end, blank), _lagged(v, v_head, start, end, 0)
            part = _Block(q[..., start:end, :], kb, vb, r, state, scale, size)
            num, den = part.forward(normalize)
            state, scale = part.state_out, part.scale_out
            del part
            if unnormalised:
                assert den is not None and denom is not None
                denom[..., start:end] = den
                out[..., start:end, :] = num
            elif den is not None:
                assert denom is not None
                den += eps
                denom[..., start:end] = den
                divisor, _ = _denominator(den, min_denom)
                torch.div(num, divisor.unsqueeze(-1), out=out[..., start:end, :])
            else:
                out[..., start:end, :] = num
        scales = torch.stack(block_scales, -1) if ref is not None else None  # type: ignore[arg-type]
        final = torch.cat([state[0], state[1].unsqueeze(-1)], dim=-1)  # (..., F, Dv+1)
        # unnormalised: num and den are outputs whose gradients pass straight through, so backward needs neither
        saved_out, saved_denom = (None, None) if unnormalised else (out, denom)
        ctx.save_for_backward(
            q, k, v, ref, state0, scale0, saved_out, saved_denom, torch.stack(block_kv, -3), torch.stack(block_z, -2),
            scales, final, k_head, v_head,
        )
        ctx.options = (size, block, normalize, min_denom, starts, unnormalised, blank)
        ctx.set_materialize_grads(False)
        if unnormalised:
            assert denom is not None
            return out, state[0], state[1], denom
        return out, state[0], state[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_without_autocast
    def backward(
        ctx: Any,
        grad_out: torch.Tensor | None,
        grad_kv: torch.Tensor | None,
        grad_k_sum: torch.Tensor | None,
        grad_denom: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ref, state0, scale0, out, denom, block_kv, block_z, block_scales, final, k_head, v_head = (
            ctx.saved_tensors
        )
        size, block, normalize, min_denom, starts, unnormalised, blank = ctx.options
        if unnormalised and grad_denom is None:
            grad_denom = q.new_zeros(q.shape[:-1])
        values = v.shape[-1]
        # ∂L/∂(S, z) leaving the current block, walking backwards
        grad_state = (
            grad_kv if grad_kv is not None else torch.zeros_like(final[..., :values]),
            grad_k_sum if grad_k_sum is not None else torch.zeros_like(final[..., values]),
        )
        grad_final = torch.cat([grad_state[0], grad_state[1].unsqueeze(-1)], dim=-1)
        if grad_out is None:
            grad_out = q.new_zeros(*q.shape[:-1], values)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grad_k_head, grad_v_head = (torch.empty_like(x) if x is not None else None for x in (k_head, v_head))
        for grad_x, head in ((grad_k, k_head), (grad_v, v_head)):
            if head is not None:  # x's last E rows are never read
                grad_x[..., grad_x.shape[-2] - head.shape[-2] :, :] = 0.0
        for index in reversed(range(len(starts))):
            start = starts[index]
            end = start + block
            grad_num, grad_den = grad_out[..., start:end, :], None
            if unnormalised:  # num and den are outputs themselves: their gradients pass straight through
                assert grad_denom is not None
                grad_den = grad_denom[..., start:end]
            elif normalize:
                # out = num / d: ∂L/∂num = g / d, ∂L/∂den = −(g·out) / d (0 where d does not depend on den)
                divisor, constant = _denominator(denom[..., start:end], min_denom)
                grad_num = grad_num / divisor.unsqueeze(-1)
                grad_den = rowdot(grad_num, out[..., start:end, :]).neg_().masked_fill_(constant, 0)
            r = ref[..., start:end] if ref is not None else None
            scale = block_scales[..., index] if block_scales is not None else None
            part = _Block(
                q[..., start:end, :], _lagged(k, k_head, start, end, blank), _lagged(v, v_head, start, end, 0), r,
                (block_kv[..., index, :, :], block_z[..., index, :]), scale, size,
            )
            gq, gk, gv, grad_state = part.backward(grad_num, grad_den, grad_state)
            del part
            grad_q[..., start:end, :] = gq
            _put_lagged(grad_k, grad_k_head, gk, start, blank)
            _put_lagged(grad_v, grad_v_head, gv, start, 0)
        grad_state0 = torch.cat([grad_state[0], grad_state[1].unsqueeze(-1)], dim=-1)  # (..., F, Dv+1)
        grad_ref = grad_scale0 = None
        if ref is not None and ctx.needs_input_grad[3]:
            grad_ref = rowdot(k, grad_k) - rowdot(q, grad_q)  # (..., N)
            grad_ref[..., -1] -= (final * grad_final).sum((-2, -1))
        if scale0 is not None and ctx.needs_input_grad[5]:
            grad_scale0 = (state0 * grad_state0).sum((-2, -1))
        return (grad_q, grad_k, grad_v, grad_ref, grad_state0, grad_scale0, None, None, None, None, None, None,
                grad_k_head, grad_v_head, None)
