"""Fitted feature maps of a whole model, and their file: what :mod:`linattn.train.distill` and
:mod:`linattn.train.end_to_end` produce and :func:`linattn.hf.linearize` installs.

A :class:`FittedFeatureMaps` holds one learned map per layer (parameters per head), the layout they were fitted
for and, for the sliding-window hybrid, the window, sinks and γ factors. :meth:`FittedFeatureMaps.save` writes a
safetensors file (tensors ``layers.{i}.{name}``, layout as metadata); :func:`load_feature_maps` reads it back.
The file is a feature-map artifact, so it is read here, without the fitting code; safetensors (the ``models``
extra) is imported only when a file is written or read.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LinearAttentionError
from .learned import LearnedProjectionMap
from .registry import create

# 2: hedgehog maps hold a key gate; version-1 files load with the gate at 0 (the same map). 3: maps fitted for the
# sliding-window hybrid record window, sinks (metadata) and γ (tensors ``layers.{i}.window_factor``); older files
# load as fitted without a window
FORMAT_VERSION = 3


def check_head_mask(heads: Any, layers: int, width: int | None) -> None:
    """Raise unless ``heads`` is a (layers, width) bool tensor marking heads per layer."""
    if not isinstance(heads, torch.Tensor) or heads.dtype != torch.bool or heads.shape != (layers, width):
        raise LinearAttentionError(
            f"heads: need a bool tensor of shape ({layers}, {width}) (layers, heads), got "
            f"{heads.dtype if isinstance(heads, torch.Tensor) else type(heads).__name__} "
            f"{tuple(heads.shape) if isinstance(heads, torch.Tensor) else ''}"
        )


@dataclass
class FittedFeatureMaps:
    """Fitted maps for a whole model: ``maps[layer]`` is a per-head map (``num_heads`` = the model's heads)."""

    model_name: str
    kind: str
    num_layers: int
    num_heads: int
    head_dim: int
    options: dict[str, Any] = field(default_factory=dict)
    maps: list[LearnedProjectionMap] = field(default_factory=list)
    window: int | None = None
    sinks: int = 0
    window_factors: list[torch.Tensor] | None = None  # per layer (H,): the γ form; None: mass-preserving

    def window_options(self, layer: int) -> dict[str, Any]:
        """The keyword arguments of :func:`linattn.linear_attention` for ``layer``'s hybrid (empty without a
        window): ``window``, ``sinks`` and ``window_factor`` (a (H,) tensor, or None for the mass form)."""
        if self.window is None:
            return {}
        factor = self.window_factors[layer] if self.window_factors is not None else None
        return {"window": self.window, "sinks": self.sinks, "window_factor": factor}

    def with_heads(self, other: FittedFeatureMaps, heads: torch.Tensor) -> FittedFeatureMaps:
        """A copy of these maps in which the heads marked in ``heads`` take ``other``'s parameters (and γ factors).

        ``heads``: a (num_layers, num_heads) bool tensor. Both sets must have the same kind, layout, options and
        window. The use: maps trained for two goals (local text, copying) combined per head, e.g. the retrieval
        heads of :func:`linattn.train.end_to_end.retrieval_scores` from the copy-trained set.
        """
        layout = ("kind", "num_layers", "num_heads", "head_dim", "options", "window", "sinks")
        differ = [name for name in layout if getattr(self, name) != getattr(other, name)]
        if differ or (self.window_factors is None) != (other.window_factors is None):
            raise LinearAttentionError(
                f"other: maps of another layout ({', '.join(differ) or 'γ form'} differ); combine maps fitted for "
                "the same model with the same options"
            )
        check_head_mask(heads, self.num_layers, self.num_heads)
        out = copy.deepcopy(self)
        with torch.no_grad():
            for layer, (mine, theirs) in enumerate(zip(out.maps, other.maps, strict=True)):
                chosen = heads[layer].nonzero().flatten()
                for (name, param), source in zip(mine.named_parameters(), theirs.parameters(), strict=True):
                    if param.dim() < 2 or param.shape[1] != self.num_heads:
                        raise LinearAttentionError(f"{self.kind}: parameter {name!r} has no head axis (dim 1 of "
                                                   f"size {self.num_heads}); its maps cannot be combined per head")
                    param[:, chosen] = source[:, chosen].to(param)
                if out.window_factors is not None and other.window_factors is not None:
                    out.window_factors[layer][chosen] = other.window_factors[layer][chosen].to(
                        out.window_factors[layer])
        return out

    def save(self, path: str) -> None:
        """Write a safetensors file: tensors ``layers.{i}.{name}``, the layout and options as metadata."""
        from safetensors.torch import save_file

        tensors = {f"layers.{i}.{name}": tensor.detach().contiguous().cpu()
                   for i, fmap in enumerate(self.maps) for name, tensor in fmap.state_dict().items()}
        for i, factor in enumerate(self.window_factors or []):
            tensors[f"layers.{i}.window_factor"] = factor.detach().contiguous().cpu()
        metadata = {
            "format": "linattn-feature-maps", "version": str(FORMAT_VERSION), "model_name": self.model_name,
            "kind": self.kind, "num_layers": str(self.num_layers), "num_heads": str(self.num_heads),
            "head_dim": str(self.head_dim), "options": json.dumps(self.options),
            "window": json.dumps({"window": self.window, "sinks": self.sinks}),
        }
        save_file(tensors, path, metadata=metadata)


def load_feature_maps(path: str) -> FittedFeatureMaps:
    """Read maps written by :meth:`FittedFeatureMaps.save`."""
    from safetensors import safe_open

    what_to_do = ("pass a file written by FittedFeatureMaps.save() (e.g. `linattn compare ... --save-maps DIR`), or "
                  "fit the maps again with fit_model_feature_maps()")
    if not os.path.isfile(path):
        raise LinearAttentionError(f"path: {path!r} is not a file; {what_to_do}")
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != "linattn-feature-maps":
                raise LinearAttentionError(
                    f"path: {path!r} is a safetensors file but not a linattn feature-map file (no linattn format "
                    f"metadata); {what_to_do}"
                )
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open API
        fitted = FittedFeatureMaps(
            model_name=metadata["model_name"], kind=metadata["kind"], num_layers=int(metadata["num_layers"]),
            num_heads=int(metadata["num_heads"]), head_dim=int(metadata["head_dim"]),
            options=json.loads(metadata["options"]),
        )
        hybrid = json.loads(metadata.get("window", '{"window": null, "sinks": 0}'))  # absent before version 3
        fitted.window, fitted.sinks = hybrid["window"], hybrid["sinks"]
        factors = [tensors.pop(f"layers.{i}.window_factor", None) for i in range(fitted.num_layers)]
        if all(factor is not None for factor in factors):
            fitted.window_factors = factors
        for layer in range(fitted.num_layers):
            fmap = create(fitted.kind, head_dim=fitted.head_dim, num_heads=fitted.num_heads, **fitted.options)
            prefix = f"layers.{layer}."
            state = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
            if metadata.get("version") == "1" and "gate" in fmap.state_dict():
                state["gate"] = fmap.state_dict()["gate"]  # zero: written before hedgehog had a key gate
            fmap.load_state_dict(state)
            fitted.maps.append(fmap.eval())  # type: ignore[arg-type]
    except LinearAttentionError:
        raise
    except Exception as error:  # the file format library's own errors, missing keys, tensors of the wrong shape
        raise LinearAttentionError(
            f"path: {path!r} is not a readable linattn feature-map file (empty, truncated or damaged: "
            f"{type(error).__name__}: {' '.join(str(error).split())}); {what_to_do}"
        ) from error
    return fitted
