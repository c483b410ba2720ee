"""Low-rank adapters on a model's attention projections: the fine-tuning stage of LoLCATs (Zhang et al., 2024).

:func:`linattn.train.end_to_end.fit_end_to_end` trains the attention *maps* with the model's weights frozen. A
linearized head may still lack what its softmax did (e.g. recall of one key among hundreds beyond the window);
LoLCATs' second stage lets the attention projections adapt to the linear attention instead, through rank-r
updates W + (α/r)·B·A of each projection (A: r × in, B: out × r, B = 0 at the start so the model starts exactly as
it was). The adapters are peft's (``peft.LoraConfig``, injected with ``peft.inject_adapter_in_model``): each
targeted ``nn.Linear`` of every attention module is wrapped, in place, in a peft LoRA layer that holds the very
same linear as its base layer, so the caller's model object stays the one it holds. Here:

- :func:`add_lora`: adapters on the ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linears (by default) of every
  attention module (:func:`linattn.hf.attention_modules`); ``A`` drawn from ``seed``, ``B`` zero;
- :meth:`LoRA.remove` / :meth:`LoRA.attach`: the wrappers swapped for their base linears and back (what peft's
  ``unload`` does, keeping the adapters for later): removed, the model is exactly as shipped;
- :meth:`LoRA.disabled`: a context in which the adapters add nothing (peft's ``enable_adapters(False)``); the
  teacher of end-to-end training is the original model;
- :meth:`LoRA.save` / :func:`load_lora`: the adapters in peft's format, a folder with ``adapter_config.json`` and
  ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(model, folder)`` also loads.

This changes the model's weights in effect (by a rank-r update per projection): results with adapters are
fine-tuned results and are labelled so. Needs peft (the ``models`` extra).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import peft
import torch
from peft.tuners.lora import LoraLayer
from peft.utils import load_peft_weights
from safetensors.torch import save_file
from torch import nn

from .. import hf
from ..errors import LinearAttentionError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER = "default"  # peft's adapter name; a saved file does not record it
PREFIX = "base_model.model."  # what peft's own save puts before the model's parameter names
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def adapter_folder(path: str | os.PathLike[str]) -> str:
    """The folder :meth:`LoRA.save` writes for ``path``: ``path`` itself, or ``path`` without a ``.safetensors``
    suffix (so ``.../lora.safetensors`` names the folder ``.../lora``)."""
    path = os.fspath(path)
    return path[: -len(".safetensors")] if path.endswith(".safetensors") else path


class LoRA:
    """peft LoRA adapters injected into ``model`` per ``config`` (see :func:`add_lora`, :func:`load_lora`).

    ``layers`` maps each adapted module's name (e.g. ``model.layers.0.self_attn.q_proj``) to its peft layer,
    whose ``lora_A[ADAPTER]`` / ``lora_B[ADAPTER]`` hold A and B and ``get_base_layer()`` the model's own linear.
    Injecting leaves every parameter's ``requires_grad`` as it was (peft would freeze the model's own).
    """

    def __init__(self, model: nn.Module, config: peft.LoraConfig) -> None:
        flags = [(param, param.requires_grad) for param in model.parameters()]
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as error:  # peft: the targeted modules are not in this model (or not all adaptable)
            for name, module in list(model.named_modules()):  # undo what was injected before peft stopped
                if isinstance(module, LoraLayer):
                    parent, _, attribute = name.rpartition(".")
                    setattr(model.get_submodule(parent), attribute, module.get_base_layer())
            raise LinearAttentionError(f"model: these adapters are for another model (peft: "
                                       f"{' '.join(str(error).split())[:200]}); pass adapters saved for this "
                                       "architecture") from error
        finally:
            for param, flag in flags:
                param.requires_grad_(flag)
        self.model, self.config = model, config
        self.layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
        # (parent, attribute) of every adapted linear, to swap it for its base layer and back
        self._slots = [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in self.layers]

    @property
    def attached(self) -> bool:
        """Whether the adapters are in the model (:meth:`remove` takes them out)."""
        return all(getattr(parent, attribute) is layer
                   for (parent, attribute), layer in zip(self._slots, self.layers.values(), strict=True))

    def attach(self) -> LoRA:
        """Put the adapters back into the model (after :meth:`remove`); returns self."""
        for (parent, attribute), layer in zip(self._slots, self.layers.values(), strict=True):
            current = getattr(parent, attribute)
            if current is not layer and current is not layer.get_base_layer():
                raise LinearAttentionError(f"model: {attribute!r} of {type(parent).__name__} is no longer the linear "
                                           "these adapters were made for (other adapters attached?); remove() those "
                                           "first")
        for (parent, attribute), layer in zip(self._slots, self.layers.values(), strict=True):
            setattr(parent, attribute, layer)
        setattr(self.model, "peft_config", {ADAPTER: self.config})  # noqa: B010 - as peft's injection sets it
        return self

    def remove(self) -> None:
        """Take the adapters out: each peft layer is replaced by its base layer, the model's own linear, so the
        model computes exactly as before :func:`add_lora`. The adapters are kept (:meth:`attach`, :meth:`save`)."""
        if not self.attached:
            return
        for (parent, attribute), layer in zip(self._slots, self.layers.values(), strict=True):
            setattr(parent, attribute, layer.get_base_layer())
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config  # as peft's unload does

    def parameters(self) -> Iterator[nn.Parameter]:
        """A and B of every adapted linear (what end-to-end training updates)."""
        for layer in self.layers.values():
            yield from _weights(layer)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """A context in which the adapters add nothing (they stay in place); ``requires_grad`` is kept as it was
        (peft's switch would change it)."""
        flags = [(param, param.requires_grad) for param in self.parameters()]
        for layer in self.layers.values():
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.enable_adapters(True)
            for param, flag in flags:
                param.requires_grad_(flag)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the adapters in peft's format to the folder :func:`adapter_folder` names for ``path``
        (``.../lora.safetensors`` → ``.../lora/``): ``adapter_config.json`` and ``adapter_model.safetensors``
        (tensors ``base_model.model.{module}.lora_A.weight`` / ``lora_B.weight``). Returns the folder."""
        folder = adapter_folder(path)
        was_attached = self.attached
        self.attach()  # peft reads the adapters from the model
        try:
            state = peft.get_peft_model_state_dict(self.model, adapter_name=ADAPTER, save_embedding_layers=False)
        finally:
            if not was_attached:
                self.remove()
        os.makedirs(folder, exist_ok=True)
        self.config.save_pretrained(folder)
        save_file({PREFIX + name: tensor.detach().contiguous().cpu() for name, tensor in state.items()},
                  os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
        return folder


def _weights(layer: Any) -> tuple[nn.Parameter, nn.Parameter]:
    """A (r, in) and B (out, r) of a peft LoRA layer's adapter."""
    down, up = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    assert isinstance(down, nn.Parameter) and isinstance(up, nn.Parameter)
    return down, up


def _refuse_adapted(model: nn.Module) -> None:
    """Raise if ``model`` holds attached peft LoRA layers (one set of adapters at a time)."""
    if any(isinstance(module, LoraLayer) for module in model.modules()):
        raise LinearAttentionError("model: already carries LoRA adapters; call remove() on their LoRA before "
                                   "adding or loading others")


def add_lora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = DEFAULT_TARGETS,
             seed: int = 0) -> LoRA:
    """Rank-``rank`` adapters (scale ``alpha / rank``) on the ``targets`` linears of every attention module of
    ``model``, attached. The model's output is unchanged until they are trained (every B starts at zero); A is
    drawn from ``seed`` (rows of norm ≈ 1, N(0, 1/in)), leaving the global random state as it was. Train them with
    ``fit_end_to_end(..., adapters=lora)``."""
    if not isinstance(rank, int) or rank < 1 or not alpha > 0:
        raise LinearAttentionError(f"rank/alpha: need an int rank ≥ 1 and alpha > 0, got {rank!r}/{alpha!r}")
    _refuse_adapted(model)
    modules = hf.attention_modules(model)
    if not modules or not targets:
        raise LinearAttentionError("model: no attention modules (or no targets) to adapt; pass a transformers "
                                   "model whose attention modules carry a layer_idx")
    names = {id(module): name for name, module in model.named_modules()}
    linears: list[tuple[str, nn.Linear]] = []
    for module in modules:
        for target in targets:
            linear = getattr(module, target, None)
            if not isinstance(linear, nn.Linear):
                raise LinearAttentionError(
                    f"targets: layer {module.layer_idx} ({type(module).__name__}) has no nn.Linear named "
                    f"{target!r}; pass the names of its projections (e.g. {', '.join(DEFAULT_TARGETS)})"
                )
            linears.append((f"{names[id(module)]}.{target}", linear))
    # full module names: exactly these linears (a short name would also match other modules that end in it)
    # lora_alpha: peft annotates an int, but uses any number (scaling = lora_alpha / r)
    config = peft.LoraConfig(r=rank, lora_alpha=float(alpha), lora_dropout=0.0,  # type: ignore[arg-type]
                             target_modules=[name for name, _ in linears])
    config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    with torch.random.fork_rng(devices=[]):  # peft initialises A (then drawn again here) from the global state
        lora = LoRA(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, linear in linears:
            down = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
            _weights(lora.layers[name])[0].copy_(down)
    return lora


def load_lora(model: nn.Module, path: str | os.PathLike[str]) -> LoRA:
    """Adapters saved by :meth:`LoRA.save` (or by peft, for this architecture), attached to ``model``. ``path``:
    the folder, or the ``.safetensors`` path it was saved under (see :func:`adapter_folder`)."""
    _refuse_adapted(model)
    folder = adapter_folder(path)
    what_to_do = "pass the folder written by LoRA.save() (adapter_config.json and adapter_model.safetensors)"
    if not all(os.path.isfile(os.path.join(folder, name)) for name in (CONFIG_FILE, WEIGHTS_FILE)):
        raise LinearAttentionError(f"path: {folder!r} is not a folder holding {CONFIG_FILE} and {WEIGHTS_FILE}; "
                                   f"{what_to_do}")
    with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as handle:
        kind = json.load(handle).get("peft_type")
    if kind != "LORA":
        raise LinearAttentionError(f"path: {folder!r} holds peft adapters of type {kind!r}, not LoRA; {what_to_do}")
    config = peft.LoraConfig.from_pretrained(folder)
    config.inference_mode = False  # the adapters may be trained further (fit_end_to_end sets what it trains)
    state = {name.removeprefix(PREFIX): tensor for name, tensor in load_peft_weights(folder, device="cpu").items()}
    with torch.random.fork_rng(devices=[]):  # the weights come from the file: leave the global state as it was
        lora = LoRA(model, config)
    try:
        result: Any = peft.set_peft_model_state_dict(model, state, adapter_name=ADAPTER)  # missing/unexpected
        missing = [name for name in result.missing_keys if "lora_" in name]
        if missing or result.unexpected_keys:
            raise ValueError(f"{len(missing)} adapter tensors missing, {len(result.unexpected_keys)} unexpected, e.g. "
                             f"{(missing + list(result.unexpected_keys))[0]!r}")
        adapted = {id(parent) for parent, _ in lora._slots}
        bare = [module.layer_idx for module in hf.attention_modules(model) if id(module) not in adapted]
        if bare:  # e.g. adapters of a shallower model: peft would adapt the layers they name and leave the rest
            raise ValueError(f"no adapters for the attention of layer(s) {bare}")
    except (RuntimeError, ValueError) as error:
        lora.remove()
        detail = " ".join(str(error).split())[:200]
        raise LinearAttentionError(f"path: {folder!r} holds adapters for another model ({detail}); pass adapters "
                                   "saved for this architecture") from error
    return lora
