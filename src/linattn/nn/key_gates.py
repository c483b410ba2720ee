"""Write strengths and forget gates of a linearized model's attention, computed from the model's own keys.

A pretrained softmax model has no β projection and no gate to learn them with. :class:`KeyGates` reads them off
the keys the attention already computes, with a handful of new parameters per head (the same idea as Liger's gates
from the key projection: Lan et al. 2025, "Liger: Linearizing Large Language Models to Gated Recurrent
Structures"; the descriptor below is this project's own).

**The descriptor is invariant to the rotary embedding.** transformers hands the attention function keys after
RoPE, which rotates each pair of features (i, i + d/2) by an angle that depends on the position. The length of
each pair, r_i = ((k_i)² + (k_{i+d/2})²)^½, does not change under the rotation, so the gates see what the key *is*,
not where it sits: u = log(1 + r) ∈ R^{d/2}, per token and key head. Then, per key head h,

    β_t = sigmoid(u_t · w_β[h] + b_β[h])                      the delta rule's write strength, in (0, 1)
    g_t = logsigmoid(u_t · w_g[h] + b_g[h])                   a forget gate per token (``gate="token"``)
    g_t = logsigmoid(u_t W_g[h] + b_g[h])  ∈ R^F               or per feature of the map (``gate="feature"``, KDA)

**The read-out's weight.** Beside the window the delta family's output is γ·A + R (A the softmax average of the
exact keys, R = Sᵀφ̂(q) the memory's read-out; docs/window.md). The delta rule is an error-correcting filter: even
a small β drives R towards the stored values, so R is as large as a value from the first few hundred tokens on,
and an untrained memory adds a value's worth of noise to every output (measured on SmolLM2: held-out perplexity
45.9 against the window's 20). ``readout=True`` adds a weight λ = sigmoid(ρ) per key head (ρ starting at
``readout_bias`` = −4, λ ≈ 0.018), so that the layer computes A + λ·R and starts at the window alone. It costs the
core no new option: with γ = 1/λ the composed route gives γ·A + R, and ``linattn.hf`` multiplies that by λ
(:meth:`readout_weight`; exact, up to rounding, in every form and in the decoding step).

**Initialisation near the teacher.** The weights start at 0 and the biases at ``beta_bias`` = −3 (β ≈ 0.05) and
``gate_bias`` = 7 (a ≈ 0.9991: a horizon of about a thousand tokens); with the read-out weight near 0 the model
starts as the softmax window and sinks alone, which a model tolerates with little loss. Training moves them.

Called with keys (B, Hkv, N, d) it returns the per-token arguments of ``linear_attention``: ``{"beta": (B, Hkv, N),
"log_gate": (B, Hkv, N) or (B, Hkv, N, F)}`` (key heads: ``linear_attention`` repeats them over the query heads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import native
from ..errors import LinearAttentionError

GATE_KINDS = (None, "token", "feature")


class KeyGates(nn.Module):
    """β and a forget gate per token from the keys' rotation-invariant pair lengths (module docstring)."""

    bounded = True  # β = sigmoid(·) ∈ (0, 1), log-gate = logsigmoid(·) ≤ 0: a decoding step need not check them

    def __init__(self, num_kv_heads: int, head_dim: int, *, beta: bool = True, gate: str | None = "token",
                 num_features: int | None = None, beta_bias: float = -3.0, gate_bias: float = 7.0,
                 readout: bool = False, readout_bias: float = -4.0) -> None:
        super().__init__()
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
            raise LinearAttentionError(f"num_kv_heads: expected an int ≥ 1, got {num_kv_heads!r}")
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise LinearAttentionError(f"head_dim: expected an even int ≥ 2 (RoPE pairs), got {head_dim!r}")
        if gate not in GATE_KINDS:
            raise LinearAttentionError(f"gate: expected one of {GATE_KINDS}, got {gate!r}")
        if gate == "feature" and (not isinstance(num_features, int) or num_features < 1):
            raise LinearAttentionError(f"num_features: gate='feature' needs the map's feature count, got "
                                       f"{num_features!r}")
        if not beta and gate is None:
            raise LinearAttentionError("beta=False and gate=None: nothing to compute; pass beta=True or a gate")
        self.num_kv_heads, self.head_dim, self.gate = num_kv_heads, head_dim, gate
        self.num_features = num_features if gate == "feature" else None
        half = head_dim // 2
        self.beta_weight = nn.Parameter(torch.zeros(num_kv_heads, half)) if beta else None
        self.beta_bias = nn.Parameter(torch.full((num_kv_heads,), float(beta_bias))) if beta else None
        width = 1 if gate == "token" else (num_features or 0)
        self.gate_weight = nn.Parameter(torch.zeros(num_kv_heads, half, width)) if gate else None
        self.gate_bias = nn.Parameter(torch.full((num_kv_heads, width), float(gate_bias))) if gate else None
        self.readout = nn.Parameter(torch.full((num_kv_heads,), float(readout_bias))) if readout else None

    def config(self) -> dict[str, Any]:
        """The constructor's arguments (saved beside the weights; the biases' values are in the weights)."""
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "beta": self.beta_weight is not None,
                "gate": self.gate, "num_features": self.num_features, "readout": self.readout is not None}

    def readout_weight(self, num_heads: int) -> torch.Tensor | None:
        """λ per query head (H,) (each key head's weight repeated over its group), or None without ``readout``."""
        if self.readout is None:
            return None
        if num_heads % self.num_kv_heads:
            raise LinearAttentionError(f"num_heads: {num_heads} query heads for {self.num_kv_heads} key heads; "
                                       "expected a multiple")
        if torch.is_grad_enabled() and self.readout.requires_grad:
            return torch.sigmoid(self.readout).repeat_interleave(num_heads // self.num_kv_heads)
        # without a gradient (decoding): kept until the weight changes, so a token pays nothing for it
        key = (self.readout._version, self.readout.data_ptr(), self.readout.dtype, num_heads)
        cached = getattr(self, "_readout_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.sigmoid(self.readout).repeat_interleave(num_heads // self.num_kv_heads))
            self._readout_cache = cached
        return cached[1]

    def descriptor(self, key: torch.Tensor) -> torch.Tensor:
        """u = log(1 + r), r the lengths of the RoPE pairs (i, i + d/2): (B, Hkv, N, d/2)."""
        half = self.head_dim // 2
        first, second = key[..., :half], key[..., half:]
        pairs = torch.addcmul(first * first, second, second)
        if torch.is_grad_enabled() and key.requires_grad:
            return torch.log1p(torch.sqrt(pairs + 1e-12))
        return pairs.add_(1e-12).sqrt_().log1p_()  # in place: no gradient to keep the steps for

    def forward(self, key: torch.Tensor) -> dict[str, torch.Tensor]:
        if key.dim() != 4 or key.shape[1] != self.num_kv_heads or key.shape[-1] != self.head_dim:
            raise LinearAttentionError(
                f"key: expected (B, {self.num_kv_heads}, N, {self.head_dim}) (the attention's keys), got "
                f"{tuple(key.shape)}"
            )
        u = self.descriptor(key.to(self._dtype()))  # (B, Hkv, N, d/2)
        # β and a per-token gate as rows of one product W·uᵀ (B, Hkv, ·, N): a product with one or two output
        # columns is cheaper with the tokens along the rows' length; per-feature gates keep (N, F)
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        if self.beta_weight is not None and self.beta_bias is not None:
            weights.append(self.beta_weight.unsqueeze(-1))
            biases.append(self.beta_bias[:, None])
        token_gate = False
        if self.gate == "token" and self.gate_weight is not None and self.gate_bias is not None:
            weights.append(self.gate_weight)
            biases.append(self.gate_bias)
            token_gate = True
        out: dict[str, torch.Tensor] = {}
        if weights:
            weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=-1)  # (Hkv, d/2, 1 or 2)
            bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=-1)  # (Hkv, 1 or 2)
            logits = torch.matmul(weight.transpose(-1, -2), u.transpose(-1, -2)) + bias[..., None]  # (B, Hkv, ·, N)
            if self.beta_weight is not None:
                out["beta"] = torch.sigmoid(logits[..., 0, :])
            if token_gate:
                out["log_gate"] = F.logsigmoid(logits[..., -1, :])
        if self.gate == "feature" and self.gate_weight is not None and self.gate_bias is not None:
            out["log_gate"] = F.logsigmoid(torch.matmul(u, self.gate_weight) + self.gate_bias[:, None, :])
        return out

    def step_arguments(self, key: torch.Tensor, num_heads: int) -> dict[str, torch.Tensor] | None:
        """One decoding token's ``beta`` and ``log_decay`` per query head, (B, H) each, from its key (B, Hkv, 1, d)
        in one C++ call (:mod:`linattn.backends.native`), or None where that does not apply (a gradient to take,
        not the CPU, per-feature gates or no β, another dtype, the kernels not built): then the caller takes
        :meth:`forward`. The same values up to rounding (tests/test_native_decode.py)."""
        if torch.is_grad_enabled() or self.gate != "token" or self.beta_weight is None or key.device.type != "cpu" \
                or key.dim() != 4 or key.shape[2] != 1 or key.shape[1] != self.num_kv_heads \
                or key.shape[-1] != self.head_dim or key.dtype != self._dtype() or num_heads % self.num_kv_heads:
            return None
        kernels = native.module()
        if kernels is None:
            return None
        assert self.beta_bias is not None and self.gate_weight is not None and self.gate_bias is not None
        batch, heads_kv, _, dim = key.shape
        beta, log_gate = kernels.key_gates(key.reshape(batch, heads_kv, dim).contiguous(), self.beta_weight,
                                           self.beta_bias, self.gate_weight.reshape(heads_kv, dim // 2),
                                           self.gate_bias.reshape(heads_kv), num_heads)
        return {"beta": beta, "log_decay": log_gate}

    def _dtype(self) -> torch.dtype:
        weight = self.beta_weight if self.beta_weight is not None else self.gate_weight
        assert weight is not None
        return weight.dtype

    def extra_repr(self) -> str:
        return (f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, beta={self.beta_weight is not None}, "
                f"gate={self.gate!r}, num_features={self.num_features}, readout={self.readout is not None}")
