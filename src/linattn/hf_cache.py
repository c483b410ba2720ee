"""A transformers ``Cache`` that holds linear-attention states: ``generate`` in constant memory per token.

transformers' attention modules call ``cache.update(k, v, layer_idx)`` and hand what it returns to the attention
function. Softmax caches return every key so far (memory and time per token grow with the context). This cache
returns only the keys of the current call and keeps, per layer, the state that ``linear_attention(...,
return_state=True)`` returned — opaque here: anything with ``to``, ``detach`` and ``index_select`` (the plain
:class:`~linattn.LinearAttentionState`, a state with a window ring buffer, or the delta rule's
:class:`~linattn.DeltaRuleState`). The ``"linattn"`` attention function
recognises the keys it returned (by identity: the very tensors, not copies) and runs

- the prompt (prefill) in the chunked causal form, keeping the final state;
- each later call from that state: one new token is the decode step of :mod:`linattn.decode` (a preallocated
  state updated in place) when the attention options allow it, else ``linear_attention(..., initial_state=...)``.

Padding: masked keys (left padding of a batch) enter neither sum, so a padded row's state is that of its tokens alone.

:func:`linattn.hf.linearize` makes ``generate`` create this cache (unless a cache is passed or ``use_cache=False``);
a model can also be called with ``cache=LinearAttentionCache()`` directly.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ._rows import by_rows, left_pads
from .decode import (
    ComposedDecodeStep,
    DeltaDecodeStep,
    SparseComposedDecodeStep,
    WindowDecodeStep,
    lean_step,
    supports_window,
    window_step,
)
from .errors import LinearAttentionError
from .functional import linear_attention

# the cache layer whose update() ran last, with the keys it returned: the attention function of that same layer
# runs next, and takes the state path only when handed exactly those keys
_PENDING: contextvars.ContextVar[tuple[StateLayer, torch.Tensor] | None] = contextvars.ContextVar(
    "linattn_pending_cache_layer", default=None
)


class StateLayer(CacheLayerMixin):
    """One layer's linear-attention state (``state``), the number of tokens it has seen, and a decode stepper."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.state: Any = None
        self.seen = 0
        self.stepper: Any = None  # a linattn.decode DecodeStep / WindowDecodeStep while decoding token by token
        self.owner: Any = None  # the LinearAttentionCache holding this layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pending = _PENDING.get()
        if pending is not None and pending[0].owner is self.owner and self.owner is not None:
            _PENDING.set(None)
            raise LinearAttentionError(
                "cache: a LinearAttentionCache layer's keys were not consumed by linattn's attention function; the "
                "model's attention implementation is not 'linattn' (call linattn.hf.linearize(model, ...)), and a "
                "softmax attention would see only the current keys"
            )
        self.is_initialized = True
        self.seen += key_states.shape[-2]
        _PENDING.set((self, key_states))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask covers this call's keys only: the earlier ones live in the state

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def current_state(self) -> Any:
        """The state after every token seen so far (the stepper's, if it is decoding)."""
        if self.stepper is not None:
            self.state = self.stepper.state()
            self.stepper = None
        return self.state

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (constant while generating: the test of constant memory)."""
        state = self.stepper if self.stepper is not None else self.state
        return 0 if state is None else sum(t.numel() * t.element_size() for t in _tensors(state))

    def _select(self, index: torch.Tensor) -> None:
        if self.stepper is not None:  # the step's own buffers, indexed (no round trip through a state)
            self.stepper = self.stepper.index_select(0, index)
        elif self.state is not None:
            self.state = self.state.index_select(0, index.to(_device_of(self.state)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.stepper is not None or self.state is not None:
            batch = self.stepper.batch_size if self.stepper is not None else _batch_of(self.state)
            self._select(torch.arange(batch).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise LinearAttentionError(
                "cache: a linear-attention state cannot forget tokens (crop, as assisted or speculative decoding "
                "needs); generate without an assistant model"
            )

    def offload(self) -> None:  # nothing grows with the context: nothing to move off the device
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state, self.stepper, self.seen = None, None, 0


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of an opaque state (a dataclass or a plain object's attributes), through nested dataclasses
    (a window state's linear part) and lists/tuples (the states of a row-by-row step)."""
    def walk(x: Any) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, list | tuple):
            return [t for item in x for t in walk(item)]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return [t for f in dataclasses.fields(x) for t in walk(getattr(x, f.name))]
        return []

    return walk(state) if dataclasses.is_dataclass(state) else walk(list(vars(state).values()))


def _device_of(state: Any) -> torch.device:
    return _tensors(state)[0].device


def _batch_of(state: Any) -> int:
    return int(_tensors(state)[0].shape[0])


class LinearAttentionCache(Cache):
    """A ``Cache`` of :class:`StateLayer`: one linear-attention state per layer, added as layers first run."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=StateLayer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            layer = StateLayer()
            layer.owner = self
            self.layers.append(layer)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes of every layer's state together."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, StateLayer))


def pending_layer(module: Any, key: torch.Tensor) -> StateLayer | None:
    """The cache layer whose ``update`` returned ``key`` just now, if any (consumed: asked once per call)."""
    pending = _PENDING.get()
    if pending is None or pending[1] is not key:
        return None
    _PENDING.set(None)
    return pending[0]


def install(model: Any) -> None:
    """Make ``model.generate`` create a :class:`LinearAttentionCache` where it would create a ``DynamicCache``."""
    original = getattr(type(model), "_prepare_cache_for_generation", None)
    if original is None or getattr(model, "_linattn_cache_installed", False):
        return

    def prepare(self: Any, generation_config: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        wants_default = (
            model_kwargs.get("cache") is None and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
            and self.config._attn_implementation == "linattn"
        )
        if not wants_default:
            return original(self, generation_config, model_kwargs, *args, **kwargs)
        model_kwargs["cache"] = LinearAttentionCache()
        return None

    model._prepare_cache_for_generation = prepare.__get__(model)
    model._linattn_cache_installed = True


def fused_token(layer: StateLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                gates: Any = None) -> torch.Tensor | None:
    """One decoding token (B, H, 1, ·) of a kept key through the layer's step in one C++ call: the gates, the maps,
    the token and the gates' read-out weight λ (the step's ``fused_token``) → (B, H, 1, dv), updating the state;
    None where that does not apply (no such step, padding, another shape or dtype: then :func:`attend`)."""
    fused = getattr(layer.stepper, "fused_token", None)
    if fused is None or (keep is not None and not bool(keep.all())):
        return None
    out: torch.Tensor | None = fused(q, k, v, gates)
    return out


def attend(layer: StateLayer, fmap: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keep: torch.Tensor | None, options: dict[str, Any], gates: Any = None) -> torch.Tensor:
    """Causal attention of this call's q, k, v (B, H|Hkv, N, ·) after the keys in ``layer``'s state; updates it.
    ``gates``: a module that gives per-token ``beta`` / ``log_gate`` from the keys (:class:`linattn.nn.KeyGates`)."""
    if layer.stepper is not None and q.shape[-2] == 1:
        if gates is None:
            return layer.stepper(q, k, v, keep)
        if isinstance(layer.stepper, RowSteps):
            return layer.stepper(q, k, v, keep, gates=gates)
        fast = getattr(gates, "step_arguments", None)  # KeyGates: one C++ call where it applies
        per_token = (fast(k, q.shape[1]) if fast is not None else None) or step_arguments(gates(k), q.shape[1])
        lean = (ComposedDecodeStep, DeltaDecodeStep, SparseComposedDecodeStep)
        if getattr(gates, "bounded", False) and isinstance(layer.stepper, lean):
            # β from a sigmoid and log-gates from a logsigmoid: in range by construction, not read back per token
            return layer.stepper(q, k, v, keep, validate=False, **per_token)
        return layer.stepper(q, k, v, keep, **per_token)
    if layer.stepper is None and layer.state is None:
        pads = left_pads(keep, options)
        if pads is not None:  # a left-padded prompt and sinks: each row on its own, its sinks its own first tokens
            return _prefill_rows(layer, fmap, q, k, v, pads, options, gates)
    per_token = {} if gates is None else gates(k)
    out, state = linear_attention(
        q, k, v, feature_map=fmap, causal=True, key_padding_mask=keep, initial_state=layer.current_state(),
        return_state=True, **options, **per_token,
    )
    layer.state = state
    layer.stepper = lean_step(fmap, state, options, k.shape[1])  # token by token from here on, where one applies
    return out


def step_arguments(per_token: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """One token's ``beta`` (B, Hkv, 1) and ``log_gate`` (B, Hkv, 1[, F]) as a decoding step takes them: per query
    head, (B, H) and ``log_decay`` (B, H[, F])."""
    out = {}
    for name, value in per_token.items():
        value = value.squeeze(2)  # the one token
        if value.shape[1] != heads:
            value = value.repeat_interleave(heads // value.shape[1], dim=1)
        out["log_decay" if name == "log_gate" else name] = value
    return out


def _prefill_rows(layer: StateLayer, fmap: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pads: list[int],
                  options: dict[str, Any], gates: Any = None) -> torch.Tensor:
    """The first call of a left-padded batch with sinks: each row alone, then one step for the batch."""
    states: list[Any] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        per_token = {} if gates is None else gates(k)
        out, state = linear_attention(q, k, v, feature_map=fmap, causal=True, return_state=True, **options,
                                      **per_token)
        states.append(state)
        return out

    out = by_rows(pads, run, q, k, v)
    if gates is None and all(supports_window(fmap, state, options) for state in states):
        steps = [window_step(fmap, state, options, k.shape[1]) for state in states]
        layer.stepper = WindowDecodeStep.stack(steps, pads)
    else:
        layer.stepper = RowSteps(fmap, states, options)
    return out


class RowSteps:
    """Each row of a left-padded batch decoded on its own window state (its sinks are its own first tokens):
    ``linear_attention`` per row and token — the path of maps the lean :class:`~linattn.decode.WindowDecodeStep`
    does not take (log-space maps, other options)."""

    def __init__(self, fmap: Any, states: list[Any], options: dict[str, Any]) -> None:
        self.fmap, self.states, self.options = fmap, list(states), options

    @property
    def batch_size(self) -> int:
        return len(self.states)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor | None = None, gates: Any = None) -> torch.Tensor:
        outs = []
        for row, state in enumerate(self.states):
            key = k[row : row + 1]
            out, self.states[row] = linear_attention(
                q[row : row + 1], key, v[row : row + 1], feature_map=self.fmap, causal=True,
                key_padding_mask=None if keep is None else keep[row : row + 1], initial_state=state,
                return_state=True, **self.options, **({} if gates is None else gates(key)),
            )
            outs.append(out)
        return torch.cat(outs)

    def state(self) -> Any:
        raise LinearAttentionError(
            "state: the rows of this left-padded batch keep their own first tokens as sinks, which one "
            "WindowAttentionState (sinks = the first positions) cannot hold; continue one token per call, or "
            "prefill the rows without padding"
        )

    def index_select(self, dim: int, index: torch.Tensor) -> RowSteps:
        if dim != 0:
            raise LinearAttentionError(f"dim: a decode step selects batch rows (dim 0), got {dim}")
        return RowSteps(self.fmap, [self.states[i] for i in index.tolist()], self.options)
