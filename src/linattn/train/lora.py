"""Low-rank adapters on a model's attention projections: the fine-tuning stage of LoLCATs (Zhang et al., 2024).

:func:`linattn.evaluate.end_to_end.fit_end_to_end` trains the attention *maps* with the model's weights frozen. A
linearized head may still lack what its softmax did (e.g. recall of one key among hundreds beyond the window);
LoLCATs' second stage lets the attention projections adapt to the linear attention instead, through rank-r
updates W + (α/r)·B·A of each projection (A: r × in, B: out × r, B = 0 at the start so the model starts exactly as
it was). Here:

- :func:`add_lora`: adapters on the ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linears (by default) of every
  attention module, installed as forward hooks: the model's modules and weights are not replaced, and
  :meth:`LoRA.remove` gives back the model exactly as shipped;
- :meth:`LoRA.disabled`: a context in which the adapters add nothing (the teacher of end-to-end training is the
  original model);
- :meth:`LoRA.save` / :func:`load_lora`: the adapters in a safetensors file.

This changes the model's weights in effect (by a rank-r update per projection): results with adapters are
fine-tuned results and are labelled so.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import LinearAttentionError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FORMAT = "linattn-lora"


class _Adapter(nn.Module):
    """down (r, in), up (out, r): the update (α/r)·up·down of one linear; up = 0 at the start."""

    def __init__(self, linear: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        # down: rows of norm ≈ 1 (so the rank-r code has the input's scale); up: zero, the update starts at 0
        down = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
        self.down = nn.Parameter(down.to(linear.weight.dtype))
        self.up = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=linear.weight.dtype))


class LoRA(nn.Module):
    """Adapters of rank ``rank`` (scale ``alpha / rank``) on the ``targets`` linears of every attention module of
    ``model`` (:func:`linattn.hf.attention_modules`); installed as forward hooks by :func:`add_lora`."""

    def __init__(self, model: nn.Module, *, rank: int = 8, alpha: float = 16.0,
                 targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> None:
        super().__init__()
        from .. import hf

        if not isinstance(rank, int) or rank < 1 or not alpha > 0:
            raise LinearAttentionError(f"rank/alpha: need an int rank ≥ 1 and alpha > 0, got {rank!r}/{alpha!r}")
        modules = hf.attention_modules(model)
        if not modules or not targets:
            raise LinearAttentionError("model: no attention modules (or no targets) to adapt; pass a transformers "
                                       "model whose attention modules carry a layer_idx")
        self.rank, self.alpha, self.targets = rank, float(alpha), tuple(targets)
        self.scale = self.alpha / rank
        self.enabled = True
        self.adapters = nn.ModuleDict()
        self._linears: dict[str, nn.Linear] = {}
        generator = torch.Generator().manual_seed(seed)
        for module in modules:
            for target in self.targets:
                linear = getattr(module, target, None)
                if not isinstance(linear, nn.Linear):
                    raise LinearAttentionError(
                        f"targets: layer {module.layer_idx} ({type(module).__name__}) has no nn.Linear named "
                        f"{target!r}; pass the names of its projections (e.g. {', '.join(DEFAULT_TARGETS)})"
                    )
                key = f"{module.layer_idx}_{target}"
                self.adapters[key] = _Adapter(linear, rank, generator).to(linear.weight.device)
                self._linears[key] = linear
        self._handles: list[Any] = []

    def _hook(self, key: str) -> Any:
        adapter = self.adapters[key]
        assert isinstance(adapter, _Adapter)

        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            if not self.enabled:
                return output
            x = inputs[0]
            down, up = adapter.down.to(x.dtype), adapter.up.to(x.dtype)
            return output + (x @ down.T) @ (up.T * self.scale)

        return hook

    def attach(self) -> LoRA:
        """Install the hooks (again, after :meth:`remove`); returns self."""
        if not self._handles:
            self._handles = [linear.register_forward_hook(self._hook(key)) for key, linear in self._linears.items()]
        return self

    def remove(self) -> None:
        """Take the hooks off: the model computes exactly as before :func:`add_lora`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """A context in which the adapters add nothing (the hooks stay)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def save(self, path: str) -> None:
        """Write the adapters to a safetensors file (tensors ``{layer}_{target}.down/up``, the layout as metadata)."""
        from safetensors.torch import save_file

        metadata = {"format": FORMAT, "rank": str(self.rank), "alpha": repr(self.alpha),
                    "targets": json.dumps(list(self.targets))}
        save_file({name: t.detach().contiguous().cpu() for name, t in self.adapters.state_dict().items()}, path,
                  metadata=metadata)


def add_lora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = DEFAULT_TARGETS,
             seed: int = 0) -> LoRA:
    """Adapters on ``model``'s attention projections, attached (the model's output is unchanged until they are
    trained: every ``up`` starts at zero). Train them with ``fit_end_to_end(..., adapters=lora)``."""
    return LoRA(model, rank=rank, alpha=alpha, targets=targets, seed=seed).attach()


def load_lora(model: nn.Module, path: str) -> LoRA:
    """Adapters written by :meth:`LoRA.save`, attached to ``model`` (the same architecture)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise LinearAttentionError(f"path: {path!r} is not a file; pass a file written by LoRA.save()")
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise LinearAttentionError(f"path: {path!r} is not a linattn LoRA file; pass a file written by "
                                       "LoRA.save()")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open API
    lora = LoRA(model, rank=int(metadata["rank"]), alpha=float(metadata["alpha"]),
                targets=json.loads(metadata["targets"]))
    try:
        lora.adapters.load_state_dict(tensors)
    except RuntimeError as error:
        detail = " ".join(str(error).split())[:200]
        raise LinearAttentionError(f"path: {path!r} holds adapters for another model ({detail})") from error
    return lora.attach()
