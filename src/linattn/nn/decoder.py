""":class:`LayerDecoder`: a :class:`~linattn.nn.LinearAttention` layer decoding one token per call on a lean step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..decode import (
    ComposedDecodeStep,
    DecodeStep,
    DeltaDecodeStep,
    SparseComposedDecodeStep,
    WindowDecodeStep,
    lean_step,
)
from ..errors import LinearAttentionError
from ..state import DeltaRuleState, LinearAttentionState, ShortConvState, WindowAttentionState

if TYPE_CHECKING:
    from . import LinearAttention

STATES = (LinearAttentionState, WindowAttentionState, DeltaRuleState)


class LayerDecoder:
    """What :meth:`LinearAttention.decoder` returns: a layer decoding one token per call from a state it owns.

    The attention state lives in a lean step of :mod:`linattn.decode` where one applies (updated in place), and
    the short convolution's last K−1 inputs in a buffer of fixed size advanced in place: memory and time per
    token do not grow with the tokens decoded."""

    def __init__(self, layer: LinearAttention, state: Any) -> None:
        if not layer.causal:
            raise LinearAttentionError("decoder: only a causal layer decodes; build the layer with causal=True")
        attention, conv = layer._split_state(state)
        if not isinstance(attention, STATES):
            raise LinearAttentionError(
                f"state: expected the state a causal call of this layer returned (return_state=True), got "
                f"{type(state).__name__}"
            )
        self.layer = layer
        # the options linear_attention would be given, without those at their defaults (a step reproduces those)
        options = {key: value for key, value in layer.options.items()
                   if value is not None and not (key == "normalize" and value is True)}
        # the delta step takes the decays and gates per token; the additive steps have none
        gated = layer.decay_rates is not None or layer.gate_kind is not None
        if gated and "window" in options:  # the composed step takes them per token: no step that ignores them
            options["log_gate"] = "with each token"
        plain = layer.update == "delta" or not gated or "window" in options
        self.step: (DecodeStep | WindowDecodeStep | DeltaDecodeStep | ComposedDecodeStep | SparseComposedDecodeStep
                    | None) = None
        if plain:
            self.step = lean_step(layer.feature_map, attention, options, layer.num_kv_heads)
        self._state = attention if self.step is None else None
        self._conv = None if conv is None else conv.detach().clone()  # owned, advanced in place

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 1, E) or (1, E) → the layer's output for this token, (B, 1, E) or (1, E)."""
        layer = self.layer
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != layer.embed_dim or (
                x.shape[-2] != 1):
            seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise LinearAttentionError(
                f"x: a decoder takes one token, (B, 1, {layer.embed_dim}) or (1, {layer.embed_dim}), got {seen}; "
                "run longer inputs through the layer itself with state="
            )
        layer._check_input(x)
        if self.step is None:
            assert self._state is not None
            state = self._state if self._conv is None else ShortConvState(self._state, self._conv)
            out, state = layer(x, state=state, return_state=True)
            if isinstance(state, ShortConvState):
                assert self._conv is not None
                self._conv.copy_(state.conv)
                state = state.attention
            self._state = state
            return out
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
        if x.shape[0] != self.step.batch_size:
            raise LinearAttentionError(
                f"x: a batch of {x.shape[0]} rows, but this decoder's state holds a batch of {self.step.batch_size}"
            )
        q, k, v, _ = layer._project(x, conv=self._conv, step=self._conv is not None)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if isinstance(self.step, DeltaDecodeStep):
                beta, log_decay = layer._beta(x), layer._log_decay(x)  # (B, H, 1)
                out = self.step(q, k, v, beta=beta, log_decay=log_decay)
            elif isinstance(self.step, ComposedDecodeStep | SparseComposedDecodeStep):  # per token, or (B, H, 1, F)
                out = self.step(q, k, v, beta=layer._beta(x), log_decay=_token_gate(layer, x))
            else:
                out = self.step(q, k, v)
            out = layer._output(out, x)
        return out.squeeze(0) if unbatched else out

    def state(self) -> Any:
        """The state after every token so far, to continue with the layer itself (new tensors: the decoder may go
        on)."""
        if self.step is None:
            assert self._state is not None
            state: Any = self._state
        else:
            state = self.step.state()
            if isinstance(state, LinearAttentionState):  # the plain step hands out its own tensors
                state = LinearAttentionState(state.kv.clone(), state.k_sum.clone(), state.shift.clone(),
                                             state.num_tokens)
            elif isinstance(state, DeltaRuleState):
                state = DeltaRuleState(state.kv.clone(), state.num_tokens)
        return state if self._conv is None else ShortConvState(state, self._conv.clone())


def _token_gate(layer: LinearAttention, x: torch.Tensor) -> torch.Tensor | None:
    """The token's log-decays as ``linear_attention`` adds them: per token (B, H, 1), or per feature (B, H, 1, F)
    with the fixed rates added."""
    if layer.gate_kind != "feature":
        return layer._log_decay(x)
    gate = layer._log_gate(x)
    assert gate is not None
    rates = layer._rates(x.device)
    gate = gate.to(torch.float64)
    return gate if rates is None else gate + torch.log(rates)[:, None, None]
