"""``LinearAttention``: a drop-in multi-head attention layer — projections, a feature map, one core call.

>>> import torch
>>> from linattn.nn import LinearAttention
>>> layer = LinearAttention(64, 4, causal=True)
>>> x = torch.randn(2, 100, 64)                      # (B, N, E)
>>> layer(x).shape
torch.Size([2, 100, 64])
>>> out, state = layer(x[:, :99], return_state=True)  # prefill 99 tokens ...
>>> step = layer(x[:, 99:], state=state)              # ... then one token in O(1): same as layer(x)[:, 99:]
>>> gated_delta = LinearAttention(64, 4, causal=True, update="delta", gate="token", short_conv=4,
...                               output_gate=True, feature_map="identity")   # Gated DeltaNet (docs/delta_layer.md)
>>> gated_delta(x).shape
torch.Size([2, 100, 64])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from ..capabilities import check_window_combination
from ..errors import LinearAttentionError
from ..feature_maps import FeatureMap
from ..features import FeatureMapLike, resolve_feature_map
from ..functional import linear_attention
from ..state import DeltaRuleState, LinearAttentionState, ShortConvState, SparseCache, WindowAttentionState
from .decoder import LayerDecoder
from .key_gates import KeyGates
from .parts import OutputGate, ShortConv, check_layer_update

__all__ = ["KeyGates", "LayerDecoder", "LinearAttention"]

# the data-dependent gate, as GLA: logsigmoid of a rank-16 projection, divided by a temperature of 16
GATE_RANK = 16
GATE_TEMPERATURE = 16.0
GATE_BIAS = 4.0  # logsigmoid(4)/16 ≈ −0.0011: every gate starts near 1 (a long memory), as GLA's initialisation


def _autocast(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


class LinearAttention(nn.Module):
    """Multi-head linear attention over a sequence of embeddings.

    With per-head projections q = xW_q, k = xW_k, v = xW_v (heads split from the last dimension) and feature map φ:

        out_t = W_o · concat_h [ φ(q_t)·Σ_j φ(k_j) v_jᵀ / (φ(q_t)·Σ_j φ(k_j) + eps) ],   j ≤ t when ``causal``

    Shapes: x ``(B, N, E)`` (or ``(N, E)``) → ``(B, N, E)``. Cost O(N·F·Dv) per head; a causal layer carries its
    past in a :class:`~linattn.LinearAttentionState` of size O(F·Dv) per head, so generating token t costs the same
    for every t (pass ``state=`` and one token at a time).

    Args:
        embed_dim: E, the model width (input and output).
        num_heads: H, query heads; ``head_dim`` defaults to E // H.
        num_kv_heads: key/value heads (grouped-query attention); H must be a multiple. Default H.
        head_dim: Dk = Dv per head, if not E // H.
        feature_map: a registered name, a feature-map module, or a callable (see :func:`linattn.linear_attention`).
            Created once for ``head_dim``; its parameters and random projections live in this layer's state_dict.
        causal: token t attends to tokens ≤ t (decoders); False for encoders.
        bias: biases on the four projections.
        chunk_size, normalize, eps, min_denom: passed to :func:`linattn.linear_attention`.
        decay: a fixed per-head decay of the state (causal layers): ``"retnet"`` (γ_h = 1 − 2^(−5−h)),
            ``"lightning"`` (Lightning Attention / MiniMax-01: γ_h = exp(−2^(−8(h+1)/H)·(1 − l/(L−1) + 1e-5)) for
            layer l of L, from ``layer_index`` and ``num_layers``), a float γ for every head, or None.
        gate: a data-dependent decay computed from x (causal layers): ``"token"`` one per token and head (Mamba-2 /
            simple GLA), ``"feature"`` one per token, head and feature (GLA), or None. g = logsigmoid(x W_1 W_2 + b)
            / 16 with a rank-16 W_1 W_2; W_2 starts at 0 and b at 4, so every gate starts at e^{−0.0011} ≈ 0.999.
            Composes with ``decay``. See docs/decay.md.
        output_norm: normalise each head's output (RetNet's group norm, with a learned scale and bias) before
            the output projection: what keeps unnormalised (``normalize=False``) retention in range.
        window, sinks: the sliding-window hybrid (docs/window.md): exact softmax (scale 1/√Dk) over the ``window``
            most recent keys (non-causal: the band |t − j| < window) and the first ``sinks`` tokens, linear
            attention for the rest, one normaliser; the state then also carries the window's keys and values
            (a :class:`~linattn.WindowAttentionState`, still O(1) per generated token).
        sparse_cache: with ``window`` (causal): up to this many pairs per head that have left the window stay
            exact (an int or a :class:`~linattn.SparseCache`; docs/sparse_cache.md).
        update: ``"add"`` (the sums above) or ``"delta"``: the delta rule (DeltaNet; ``gate="token"`` and/or
            ``decay``: Gated DeltaNet; ``gate="feature"``: KDA; docs/delta_layer.md), out_t = S_tᵀq̂_t with S_t =
            a_t·S_{t−1} + β_t·k̂_t(v_t − a_t·S_{t−1}ᵀk̂_t)ᵀ on L2-normalised features (the map's, then normalised: use
            ``"identity"``, with ``short_conv`` giving the SiLU, as Gated DeltaNet). Causal layers only, no
            normaliser (``normalize`` False), no window; the state is a :class:`~linattn.DeltaRuleState`.
        beta_scale: the delta rule's write strength is β = beta_scale·sigmoid(x W_β), one per token and head;
            1 (β ∈ (0, 1), DeltaNet) or 2 (β ∈ (0, 2): negative eigenvalues of I − βk̂k̂ᵀ, Grazzi et al. 2025);
            any value in (0, 2].
        short_conv: kernel size K of a short causal depthwise convolution over time on the projected q, k and v,
            followed by SiLU (Mamba, DeltaNet, Gated DeltaNet), or None. Either update rule; the state then also
            carries the last K−1 projected inputs (a :class:`~linattn.ShortConvState`).
        output_gate: o ← RMSNorm(o) ⊙ SiLU(x W_g) per head before the output projection (Gated DeltaNet). With
            ``output_norm`` too, the group norm takes the RMSNorm's place: each head is normalised once, then gated.

    The softmax scale 1/√Dk has no counterpart here: the projections are learned with the feature map in place,
    so any scale is absorbed into W_q and W_k (contrast :mod:`linattn.hf`, where pretrained weights expect it).

    Under ``torch.autocast`` the projections run in the autocast dtype while the attention core runs with autocast
    disabled, accumulating in fp32 (a bf16 running sum over thousands of tokens would lose its low bits); its
    output is cast back to the projection dtype.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        feature_map: FeatureMapLike = "elu",
        causal: bool = False,
        bias: bool = True,
        chunk_size: int | None = None,
        normalize: bool | None = None,
        eps: float = 1e-6,
        min_denom: float | None = None,
        decay: str | float | None = None,
        gate: str | None = None,
        output_norm: bool = False,
        window: int | None = None,
        sinks: int = 0,
        sparse_cache: int | SparseCache | None = None,
        update: str = "add",
        beta_scale: float = 1.0,
        short_conv: int | None = None,
        output_gate: bool = False,
        layer_index: int = 0,
        num_layers: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LinearAttentionError(f"{name}: expected a positive int, got {value!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise LinearAttentionError(
                f"num_kv_heads: got {num_kv_heads!r} with num_heads={num_heads}; expected a positive divisor of "
                "num_heads (each key/value head serves num_heads // num_kv_heads query heads)"
            )
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise LinearAttentionError(
                    f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; choose sizes that divide, "
                    "or pass head_dim= explicitly"
                )
            head_dim = embed_dim // num_heads
        elif not isinstance(head_dim, int) or head_dim <= 0:
            raise LinearAttentionError(f"head_dim: expected a positive int or None, got {head_dim!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.causal = causal
        self.update = update
        check_layer_update(update, beta_scale, short_conv, causal, normalize, min_denom, window)
        self.options: dict[str, Any] = {
            "chunk_size": chunk_size,
            "normalize": update != "delta" if normalize is None else normalize,
            "eps": eps,
            "min_denom": min_denom,
        }
        if update == "delta":
            self.options["update"] = "delta"
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.feature_map = resolve_feature_map(feature_map, head_dim)
        self._decay_options(decay, gate, output_norm, layer_index, num_layers, factory)
        self.beta_scale = float(beta_scale)
        self.beta_proj = nn.Linear(embed_dim, num_heads, **factory) if update == "delta" else None  # β per head
        channels = (num_heads + 2 * num_kv_heads) * head_dim  # q, k and v side by side
        self.short_conv = ShortConv(channels, short_conv, **factory) if short_conv is not None else None
        self.output_gate = (
            OutputGate(embed_dim, num_heads, head_dim, norm=not output_norm, **factory) if output_gate else None
        )
        if window is not None:
            check_window_combination(window)
            _validate.check_window_options(window, sinks, None, None)
            self.options.update(window=window, sinks=sinks)
            if sparse_cache is not None:
                self.options["sparse_cache"] = _validate.sparse_cache(sparse_cache, window, update, None)
                if not causal:
                    raise LinearAttentionError("sparse_cache: the cache keeps pairs that have left a causal window; "
                                               "pass causal=True")
        elif sparse_cache is not None:
            raise LinearAttentionError("sparse_cache: the cache keeps pairs that have left the window; pass window=W")
        elif sinks:
            raise LinearAttentionError(f"sinks={sinks}: sink tokens belong to the window hybrid; pass window=W too")

    def _decay_options(
        self, decay: object, gate: object, output_norm: bool, layer_index: int, num_layers: int, factory: Any
    ) -> None:
        heads = self.num_heads
        if (decay is not None or gate is not None) and not self.causal:
            raise LinearAttentionError("decay/gate: a decay needs an order of tokens; build the layer with causal=True")
        rates: torch.Tensor | None = None
        if decay == "retnet":
            rates = 1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float64))
        elif decay == "lightning":
            if not 0 <= layer_index < num_layers:
                raise LinearAttentionError(
                    f"layer_index: {layer_index} is not in [0, num_layers={num_layers}); the Lightning schedule "
                    "decays less in deeper layers"
                )
            slopes = 2.0 ** (-8.0 * (torch.arange(heads, dtype=torch.float64) + 1) / heads)  # ALiBi's slopes
            depth = 1 - layer_index / (num_layers - 1) if num_layers > 1 else 1.0
            rates = torch.exp(-slopes * (depth + 1e-5))
        elif isinstance(decay, (int, float)) and not isinstance(decay, bool):
            if not 0 < decay <= 1:
                raise LinearAttentionError(f"decay: a rate γ must lie in (0, 1], got {decay}")
            rates = torch.full((heads,), float(decay), dtype=torch.float64)
        elif decay is not None:
            raise LinearAttentionError(
                f"decay: expected 'retnet', 'lightning', a float in (0, 1] or None, got {decay!r}"
            )
        # plain floats, not a buffer: module.half() would round RetNet's 1 − 2^−12 to 1; they follow from the options
        self.decay_rates: tuple[float, ...] | None = tuple(rates.tolist()) if rates is not None else None
        self.gate_kind = gate
        self.gate_down: nn.Linear | None = None
        self.gate_up: nn.Linear | None = None
        if gate is not None:
            if gate == "token":
                width = 1
            elif gate == "feature":
                if not isinstance(self.feature_map, FeatureMap):
                    raise LinearAttentionError(
                        "gate='feature' needs the feature dimension F: pass a registered map name or a FeatureMap"
                    )
                width = self.feature_map.output_dim(self.head_dim)
            else:
                raise LinearAttentionError(f"gate: expected 'token', 'feature' or None, got {gate!r}")
            self.gate_down = nn.Linear(self.embed_dim, GATE_RANK, bias=False, **factory)
            self.gate_up = nn.Linear(GATE_RANK, heads * width, **factory)
            nn.init.zeros_(self.gate_up.weight)
            nn.init.constant_(self.gate_up.bias, GATE_BIAS)
            self.gate_width = width
        self.output_norm = (
            nn.GroupNorm(heads, heads * self.head_dim, eps=1e-5, **factory) if output_norm else None
        )

    def _rates(self, device: torch.device) -> torch.Tensor | None:
        if self.decay_rates is None:
            return None
        return torch.tensor(self.decay_rates, dtype=torch.float64, device=device)  # (H,)

    def _log_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """(B, H, N) or (B, H, N, F) log-decays from x (B, N, E)."""
        if self.gate_down is None or self.gate_up is None:
            return None
        g = F.logsigmoid(self.gate_up(self.gate_down(x))) / GATE_TEMPERATURE  # (B, N, H·width)
        g = g.unflatten(-1, (self.num_heads, self.gate_width)).transpose(1, 2)  # (B, H, N, width)
        return g.squeeze(-1) if self.gate_kind == "token" else g

    def _log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """(B, H, N) fp64 ((B, H, N, F) with per-feature gates): the fixed rates' and the gates' log-decays
        together, as ``linear_attention`` adds ``decay`` and ``log_gate``."""
        rates, gate = self._rates(x.device), self._log_gate(x)
        if gate is None:
            return None if rates is None else torch.log(rates).unsqueeze(-1).expand(x.shape[0], -1, x.shape[1])
        gate = gate.to(torch.float64)
        return gate if rates is None else torch.log(rates).view(-1, *[1] * (gate.dim() - 2)) + gate

    def _beta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The delta rule's write strengths (B, H, N) from x (B, N, E): beta_scale·sigmoid(x W_β + b)."""
        if self.beta_proj is None:
            return None
        return (torch.sigmoid(self.beta_proj(x)) * self.beta_scale).transpose(1, 2)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        # (B, N, heads·D) → (B, heads, N, D)
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        state: LinearAttentionState | WindowAttentionState | DeltaRuleState | ShortConvState | None = None,
        return_state: bool = False,
    ) -> Any:
        """Attend over ``x`` ``(B, N, E)``; returns ``(B, N, E)``, and the state after x if ``return_state``.

        Args:
            key_padding_mask: bool ``(B, N)``, **True = keep** (as in :func:`linattn.linear_attention`; note that
                ``torch.nn.MultiheadAttention`` uses the opposite convention). Padded tokens contribute to neither
                the numerator nor the normaliser; their own outputs are still computed (and meaningless).
            state: the state returned for the preceding tokens (causal layers: decoding and streaming).
            return_state: also return the state after these tokens, to continue from.
        """
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.embed_dim:
            seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(f"x: expected a tensor of shape (B, N, {self.embed_dim}) or (N, E), got {seen}")
        self._check_input(x)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if state is not None and not self.causal:
            raise LinearAttentionError(
                "state: only a causal layer continues from a state (a non-causal layer attends to the whole "
                "sequence at once); build the layer with causal=True"
            )
        attention_state, conv = self._split_state(state)
        q, k, v, conv = self._project(x, key_padding_mask, conv)
        # fp32 accumulation inside the core must not be undone by autocast re-lowering its matmuls to bf16
        # one new token (decoding): the token-by-token form has the least per-call work
        form = "recurrent" if self.causal and x.shape[1] == 1 else "auto"
        with torch.autocast(device_type=x.device.type, enabled=False):
            result = linear_attention(
                q,
                k,
                v,
                feature_map=self.feature_map,
                causal=self.causal,
                key_padding_mask=key_padding_mask,
                initial_state=attention_state,
                return_state=return_state,
                form=form,
                decay=self._rates(x.device),
                log_gate=self._log_gate(x),
                beta=self._beta(x),
                **self.options,
            )
        out, new_state = result if return_state else (result, None)
        if return_state and conv is not None:
            assert new_state is not None
            new_state = ShortConvState(new_state, conv)
        out = self._output(out, x)
        if unbatched:
            out = out.squeeze(0)
        return (out, new_state) if return_state else out

    def _check_input(self, x: torch.Tensor) -> None:
        """x in the projections' dtype and on their device (under autocast the projections cast a float32 or
        half-precision x themselves; autocast leaves float64 as it is)."""
        weight = self.q_proj.weight
        if x.device != weight.device:
            raise LinearAttentionError(
                f"x: on {x.device}, the layer's weights on {weight.device}; move one to the other (x.to(device) or "
                "layer.to(device))"
            )
        cast = _autocast(x.device.type) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        if x.dtype != weight.dtype and not cast:
            raise LinearAttentionError(
                f"x: dtype {x.dtype}, the layer's weights {weight.dtype}; cast the input (x.to({weight.dtype})) or the "
                f"layer (layer.to({x.dtype})), or run under torch.autocast"
            )

    def _split_state(self, state: Any) -> tuple[Any, torch.Tensor | None]:
        """(the attention core's state, the convolution's carried inputs) from the state passed to a call."""
        if self.short_conv is None:
            if isinstance(state, ShortConvState):
                raise LinearAttentionError(
                    "state: a ShortConvState comes from a layer with short_conv=; this layer has none, so pass its "
                    "own state (the attention's state alone)"
                )
            return state, None
        if state is None:
            return None, None
        if not isinstance(state, ShortConvState):
            raise LinearAttentionError(
                f"state: this layer convolves its projections (short_conv={self.short_conv.kernel}), so its state "
                f"also holds the last inputs of the convolution: pass the ShortConvState it returned, got "
                f"{type(state).__name__}"
            )
        return state.attention, state.conv

    def _project(
        self, x: torch.Tensor, keep: torch.Tensor | None = None, conv: torch.Tensor | None = None, step: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (B, N, E) → q (B, H, N, D), k and v (B, Hkv, N, D), through the short convolution if there is one
        (after ``conv``, the inputs before x), and the convolution's inputs to carry on (None without one).
        ``step``: one token, ``conv`` advanced in place (decoding)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.short_conv is not None:
            mixed = torch.cat([q, k, v], dim=-1)  # (B, N, (H + 2·Hkv)·D)
            if step:
                assert conv is not None
                mixed = self.short_conv.step(mixed, conv)
            else:
                mixed, conv = self.short_conv(mixed, conv, keep)
            q, k, v = mixed.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        q = self._heads(q, self.num_heads)
        return q, self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads), conv

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention's (B, H, N, D) and the layer's input x (B, N, E) → the layer's output (B, N, E)."""
        out = out.transpose(1, 2)  # (B, N, H, D)
        if self.output_norm is not None:  # per head: GroupNorm's groups are the heads
            out = self.output_norm(out.flatten(0, 1).flatten(-2)).view_as(out)
        if self.output_gate is not None:
            out = self.output_gate(out, x)
        return self.out_proj(out.flatten(-2))

    def decoder(self, state: LinearAttentionState | WindowAttentionState | DeltaRuleState | ShortConvState
                ) -> LayerDecoder:
        """A stateful decoder for generating one token at a time after ``state`` (a causal layer's state, e.g. from
        ``layer(prompt, return_state=True)``): ``decoder(x)`` with x ``(B, 1, E)`` (or ``(1, E)``) returns the
        layer's output for that token, as ``layer(x, state=..., return_state=True)`` would, and advances the
        decoder's own copy of the state in place; ``decoder.state()`` hands a state back.

        Where :mod:`linattn.decode` has a lean step for the layer's options (the delta rule, with its gates and
        decays; additive attention without decay or gate, a plain or a window state, the options it reproduces) the
        projections feed it directly: the checks are paid once, and the state (and the short convolution's last
        inputs) is preallocated and updated in place (additive, on CUDA with triton: one kernel launch per token).
        Otherwise each token goes through :meth:`forward` with the state. For inference: it runs without autograd (to
        differentiate through decoding, call :meth:`forward` with ``state=``).
        """
        return LayerDecoder(self, state)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, gate={self.gate_kind}, "
            f"decay={'per head' if self.decay_rates is not None else None}, window={self.options.get('window')}, "
            f"update={self.update}, short_conv={self.short_conv.kernel if self.short_conv is not None else None}"
        )
