"""Causal chunkwise linear attention as a ``torch.autograd.Function`` whose backward recomputes from the inputs.

Notation (leading dims ``...`` are batch and heads; chunk C; a block is b = L/C consecutive chunks):
    Q, K  (..., N, F)   features (for log-space maps K_j is stored at log-scale r_j, so the true key is K_j·e^{r_j},
                        and query t reads at scale r_t: r is non-decreasing, so every factor below is ≤ 1)
    V'    (..., N, Dv+1) values with a column of ones appended: one GEMM yields numerator and denominator together
    S'    (..., F, Dv+1) the running state [Σ φ(k)vᵀ, Σ φ(k)]

Per chunk c with incoming state S_c at scale s_c and chunk-end scale e_c:
    num'_c = ((Q_c K_cᵀ) ⊙ E_c) V'_c + diag(α_c) Q_c S_c          E_tj = e^{r_j − r_t}[j ≤ t],  α_t = e^{s_c − r_t}
    S_{c+1} = e^{s_c − e_c} S_c + (diag(γ_c) K_c)ᵀ V'_c            γ_j = e^{r_j − e_c}
(ordinary maps: r ≡ 0, so E is the causal mask and α = γ = 1.) Within a block the states entering each chunk are a
batched prefix sum (a (b+1)×b matrix of decays for log-space maps), so the Python loop runs over blocks only.

Memory: forward saves the inputs, the output, the normaliser (..., N) and one state per block; backward rebuilds
each block's C×C weights and per-chunk states from them. Training memory is O(N·(F + Dv)) + O((N/L)·F·Dv) plus
one block's O(L·(C + F + Dv)) work space, never O(N·F·Dv).

Gradient of the log-scales: the output depends on (Q, K, r) only through Q_t e^{−r_t} and K_j e^{r_j}, so
∂L/∂r_t = Σ_f K_tf ∂L/∂K_tf − Σ_f Q_tf ∂L/∂Q_tf (minus Σ S'_final ⊙ ∂L/∂S'_final at the last token, whose scale
the final state is stored at); an initial state stored at scale s_0 gets ∂L/∂s_0 = Σ S'_0 ⊙ ∂L/∂S'_0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._common import scale_between

# Elements of Q, K and V per block (over all batch and head rows): about 4 MiB of fp32, so a block's operands stay
# in cache. Measured on a 2-core CPU at B·H=8, F=Dv=64 (1024 tokens per block): 512–1024 tokens ran 1.2–1.7×
# faster than 4096–16384 (docs/benchmarks.md, benchmarks/chunk_size.py).
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


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """(..., L, Dv) → (..., L, Dv+1): the ones column turns the denominator into one more numerator column."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _denominator(den: torch.Tensor, min_denom: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The divisor of ``finalize`` from den + eps: clamped at ``min_denom``, and 1 where it is exactly 0 (no
    visible key, eps = 0: the numerator is 0 too). Also where it does not depend on den (clamped or replaced)."""
    constant = den == 0
    if min_denom is not None:
        constant = constant | (den < min_denom)
        den = den.clamp(min=min_denom)
        constant = constant | (den == 0)
    return torch.where(den == 0, torch.ones_like(den), den), constant


class _Block:
    """One block's chunked operands and the states entering its chunks, shared by forward and backward."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        r: torch.Tensor | None,
        state_in: torch.Tensor,
        scale_in: torch.Tensor | None,
        size: int,
    ) -> None:
        self.length = q.shape[-2]
        self.q = _chunks(q, size)  # (..., b, C, F)
        self.k = _chunks(k, size)  # (..., b, C, F)
        self.v = _chunks(_with_ones(v), size)  # (..., b, C, Dv+1)
        chunks = self.q.shape[-3]
        self.keep = keep = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        weights = self.q @ self.k.transpose(-1, -2)  # (..., b, C, C)
        earlier = torch.ones(chunks, chunks, dtype=torch.bool, device=q.device).tril(-1)  # chunk c' < c
        self.scaled = r is not None
        if r is None:
            self.weights = weights.masked_fill_(~keep, 0)
            self.keys = self.k
            # update c' reaches every later chunk of the block, unscaled: a GEMM with a 0/1 matrix is the
            # exclusive prefix sum (much faster on CPU than cumsum over a middle dimension)
            self.decay = earlier.to(q.dtype)  # (b, b)
            self.scale_out = None
        else:
            pad = -r.shape[-1] % size
            if pad:  # padded keys are zero: repeating the last scale keeps r non-decreasing
                r = torch.cat([r, r[..., -1:].expand(*r.shape[:-1], pad)], dim=-1)
            r = r.reshape(*r.shape[:-1], chunks, size)  # (..., b, C)
            ends = r[..., -1]  # (..., b): the scale each chunk's update is stored at
            assert scale_in is not None
            scales = torch.cat([scale_in.unsqueeze(-1), ends[..., :-1]], dim=-1)  # (..., b): scale entering chunk c
            self.scale_out = ends[..., -1]
            self.masked_decay = scale_between(r.unsqueeze(-2), r.unsqueeze(-1), keep)  # E (..., b, C, C)
            self.weights = weights * self.masked_decay
            self.key_decay = scale_between(r, ends.unsqueeze(-1)).unsqueeze(-1)  # γ (..., b, C, 1)
            self.keys = self.k * self.key_decay
            self.query_decay = scale_between(scales.unsqueeze(-1), r).unsqueeze(-1)  # α (..., b, C, 1)
            # update c' (at scale e_c') reaches chunk c > c' at scale s_c, and the block's output at e_{b−1}
            self.decay = scale_between(ends.unsqueeze(-2), scales.unsqueeze(-1), earlier)  # (..., b, b)
            self.out_decay = scale_between(ends, self.scale_out.unsqueeze(-1))  # (..., b)
            self.carry = scale_between(scale_in.unsqueeze(-1), scales)  # (..., b): S_in moved to each s_c
            self.out_carry = scale_between(scale_in, self.scale_out)  # (...)
        updates = (self.keys.transpose(-1, -2) @ self.v).flatten(-2)  # (..., b, F·(Dv+1))
        state_flat = state_in.flatten(-2)  # (..., F·(Dv+1))
        entering = self.decay @ updates  # (..., b, F·(Dv+1))
        if self.scaled:
            entering += self.carry.unsqueeze(-1) * state_flat.unsqueeze(-2)
            state_out = (self.out_decay.unsqueeze(-2) @ updates).squeeze(-2) + self.out_carry.unsqueeze(-1) * state_flat
        else:
            entering += state_flat.unsqueeze(-2)
            state_out = updates.sum(-2) + state_flat
        self.entering = entering.unflatten(-1, state_in.shape[-2:])  # (..., b, F, Dv+1)
        self.state_out = state_out.unflatten(-1, state_in.shape[-2:])  # (..., F, Dv+1)

    def numerator(self) -> torch.Tensor:
        """num' (..., L, Dv+1) for the block's queries: intra-chunk block plus the carried state."""
        inter = self.q @ self.entering  # (..., b, C, Dv+1)
        if self.scaled:
            inter *= self.query_decay
        num = inter.flatten(0, -3).baddbmm_(self.weights.flatten(0, -3), self.v.flatten(0, -3))
        return num.reshape(*self.q.shape[:-3], -1, num.shape[-1])[..., : self.length, :]

    def backward(
        self, grad_num: torch.Tensor, grad_out_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Given ∂L/∂num' (..., L, Dv+1) and ∂L/∂S'_out, return ∂L/∂(Q, K, V') of the block and ∂L/∂S'_in."""
        size = self.q.shape[-2]
        grad = _chunks(grad_num, size)  # (..., b, C, Dv+1)
        grad_weights = grad @ self.v.transpose(-1, -2)  # (..., b, C, C)
        if self.scaled:
            grad_weights = grad_weights * self.masked_decay
            grad_inter = grad * self.query_decay
        else:
            grad_weights = grad_weights.masked_fill_(~self.keep, 0)
            grad_inter = grad
        grad_q = grad_weights @ self.k + grad_inter @ self.entering.transpose(-1, -2)
        grad_states = (self.q.transpose(-1, -2) @ grad_inter).flatten(-2)  # (..., b, F·(Dv+1)): ∂L/∂S_c
        grad_flat = grad_out_state.flatten(-2)  # (..., F·(Dv+1))
        grad_updates = self.decay.transpose(-1, -2) @ grad_states  # (..., b, F·(Dv+1))
        if self.scaled:
            grad_updates += self.out_decay.unsqueeze(-1) * grad_flat.unsqueeze(-2)
            grad_state_in = (self.carry.unsqueeze(-2) @ grad_states).squeeze(-2)
            grad_state_in += self.out_carry.unsqueeze(-1) * grad_flat
        else:
            grad_updates += grad_flat.unsqueeze(-2)
            grad_state_in = grad_states.sum(-2) + grad_flat
        grad_updates = grad_updates.unflatten(-1, grad_out_state.shape[-2:])  # (..., b, F, Dv+1)
        grad_state_in = grad_state_in.unflatten(-1, grad_out_state.shape[-2:])
        grad_keys = self.v @ grad_updates.transpose(-1, -2)  # (..., b, C, F)
        if self.scaled:
            grad_keys *= self.key_decay
        grad_k = torch.baddbmm(grad_keys.flatten(0, -3), grad_weights.transpose(-1, -2).flatten(0, -3),
                               self.q.flatten(0, -3))
        grad_v = self.weights.transpose(-1, -2) @ grad + self.keys @ grad_updates  # (..., b, C, Dv+1)
        batch = self.q.shape[:-3]

        def tokens(x: torch.Tensor) -> torch.Tensor:  # (..., b, C, D) → (..., L, D)
            return x.reshape(*batch, -1, x.shape[-1])[..., : self.length, :]

        return tokens(grad_q), tokens(grad_k), tokens(grad_v), grad_state_in


class CausalChunkedFunction(torch.autograd.Function):
    """(Q, K, V, r, S'_0, s_0) → (out, kv_final, k_sum_final); see the module docstring. Once differentiable."""

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values = v.shape[-1]
        out = q.new_empty(*q.shape[:-1], values)  # (..., N, Dv)
        denom = q.new_empty(q.shape[:-1]) if normalize else None  # (..., N): den + eps, before any clamp
        state, scale = state0, scale0
        starts = list(range(0, q.shape[-2], block))
        block_states, block_scales = [], []
        for start in starts:
            end = start + block
            block_states.append(state)
            block_scales.append(scale)
            r = ref[..., start:end] if ref is not None else None
            part = _Block(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], r, state, scale, size)
            num = part.numerator()  # (..., L, Dv+1)
            state = part.state_out
            scale = part.scale_out
            del part
            if normalize:
                assert denom is not None
                den = num[..., values] + eps
                denom[..., start:end] = den
                den, _ = _denominator(den, min_denom)
                torch.div(num[..., :values], den.unsqueeze(-1), out=out[..., start:end, :])
            else:
                out[..., start:end, :] = num[..., :values]
        scales = torch.stack(block_scales, -1) if ref is not None else None  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, ref, state0, scale0, out, denom, torch.stack(block_states, -3), scales, state)
        ctx.options = (size, block, normalize, min_denom, starts)
        ctx.set_materialize_grads(False)
        return out, state[..., :values].contiguous(), state[..., values].contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor | None, grad_kv: torch.Tensor | None, grad_k_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ref, state0, scale0, out, denom, block_states, block_scales, final = ctx.saved_tensors
        size, block, normalize, min_denom, starts = ctx.options
        values = v.shape[-1]
        grad_state = torch.zeros_like(final)  # ∂L/∂S' leaving the current block, walking backwards
        if grad_kv is not None:
            grad_state[..., :values] = grad_kv
        if grad_k_sum is not None:
            grad_state[..., values] = grad_k_sum
        grad_final = grad_state.clone() if ref is not None else None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for index in reversed(range(len(starts))):
            start = starts[index]
            end = start + block
            grad_num = grad_out.new_zeros(*grad_out[..., start:end, :].shape[:-1], values + 1)  # (..., L, Dv+1)
            if normalize:
                # out = num / d: ∂L/∂num = g / d, ∂L/∂den = −(g·out) / d (0 where the clamp to min_denom bit)
                den, constant = _denominator(denom[..., start:end], min_denom)
                torch.div(grad_out[..., start:end, :], den.unsqueeze(-1), out=grad_num[..., :values])
                grad_den = (grad_num[..., :values] * out[..., start:end, :]).sum(-1).neg_()
                grad_num[..., values] = grad_den.masked_fill_(constant, 0)
            else:
                grad_num[..., :values] = grad_out[..., start:end, :]
            r = ref[..., start:end] if ref is not None else None
            scale = block_scales[..., index] if block_scales is not None else None
            part = _Block(
                q[..., start:end, :], k[..., start:end, :], v[..., start:end, :], r,
                block_states[..., index, :, :], scale, size,
            )
            gq, gk, gv, grad_state = part.backward(grad_num, grad_state)
            del part
            grad_q[..., start:end, :] = gq
            grad_k[..., start:end, :] = gk
            grad_v[..., start:end, :] = gv[..., :values]
        grad_ref = grad_scale0 = None
        if ref is not None and ctx.needs_input_grad[3]:
            assert grad_final is not None
            grad_ref = (k * grad_k).sum(-1) - (q * grad_q).sum(-1)  # (..., N)
            grad_ref[..., -1] -= (final * grad_final).sum((-2, -1))
        if scale0 is not None and ctx.needs_input_grad[5]:
            grad_scale0 = (state0 * grad_state).sum((-2, -1))
        return grad_q, grad_k, grad_v, grad_ref, grad_state, grad_scale0, None, None, None, None, None
