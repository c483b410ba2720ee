"""The layer-wise fit of a linearized student whose linear part is not the additive state: each attention layer's
output, computed as the linearized model will compute it (the softmax window and sinks, the linear part beside
them with its per-token β and gates from :class:`~linattn.nn.KeyGates`), trained to the output of the model's own
softmax attention on captured sequences.

The Hedgehog fit (:mod:`linattn.train.distill`) matches attention *weights*, which the additive state has and the
delta rule does not (its read-out is a value, not a sum of weights). Here the loss is on the layer's output: per
head, the mean squared error over the positions past the window, divided by the teacher output's mean square there
(so that every head and layer counts alike), averaged. The layers are independent (each sees its captured q, k, v),
so one step runs every layer on one captured sequence and updates all maps and gates together.

With a sparse exact cache (``sparse_cache=``, one for every layer or one per layer) the student's output is the
call the linearized model makes, ``linear_attention(..., update="delta", sparse_cache=...)``: the cache's
decisions (which pairs stay exact, made by the op under the maps and gates of the current step, without a
gradient: the choice is discrete) and the delta-rule memory the other pairs enter as they leave the exact part
(with gradients), so the memory is trained for the pairs it will hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._progress import progress_bar
from ..errors import LinearAttentionError
from ..functional import linear_attention
from ..hf import readout_options
from ..state import SparseCache


def teacher_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax attention (1, H, N, dv) of q (1, H, N, d) over k, v (1, Hkv, N, ·): the fit's target."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                            enable_gqa=k.shape[1] != q.shape[1])


def student_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: nn.Module, gates: nn.Module | None,
                    scaling: float, options: dict[str, Any]) -> torch.Tensor:
    """The linearized layer's attention output (1, H, N, dv), as :func:`linattn.hf.linattn_attention_forward`
    computes it (q and k scaled by c = (s·√d)^½, the per-token arguments from the keys)."""
    c = math.sqrt(scaling * math.sqrt(q.shape[-1]))
    if c != 1.0:
        q, k = q * c, k * c
    per_token = {} if gates is None else gates(k)
    options, weight = readout_options(gates, q.shape[1], options)
    out = linear_attention(q, k, v, feature_map=fmap, causal=True, **options, **per_token)
    return out if weight is None else out * weight.to(out.dtype)[:, None, None]


def layer_caches(sparse_cache: Any, layers: int) -> list[Any]:
    """``sparse_cache`` as one entry per layer: None, one cache for every layer (a :class:`~linattn.SparseCache`
    or what ``linear_attention`` takes for it, e.g. an int), or a sequence of one per layer."""
    if sparse_cache is None or isinstance(sparse_cache, SparseCache | int):
        return [sparse_cache] * layers
    caches = list(sparse_cache)
    if len(caches) != layers:
        raise LinearAttentionError(f"sparse_cache: one cache for every layer or one per layer ({layers}), got "
                                   f"{len(caches)}")
    return caches


def fit_student(capture: Any, maps: Sequence[nn.Module], gates: Sequence[nn.Module | None], options: dict[str, Any],
                *, steps: int = 100, lr: float = 0.01, gate_lr: float = 0.05, progress: bool = False,
                sparse_cache: Any = None) -> dict[str, Any]:
    """Train ``maps`` and ``gates`` (one per layer, in place) so that every layer's linearized output, with the
    ``linear_attention`` ``options`` (``window``, ``sinks``, ``update``, ...), matches its softmax output on the
    sequences of ``capture`` (an :class:`~linattn.evaluate.AttentionCapture`). ``steps`` Adam steps, one captured
    sequence longer than the window each (in turn), the maps at ``lr`` and the gates at ``gate_lr`` (their biases
    must travel several units from a start near the teacher). Returns ``{"history": [(step, loss)], "seconds":
    s}``; the parameters after the last step are kept (the end-to-end stage that follows has a held-out set to
    choose by). ``sparse_cache``: a sparse exact cache in place (one for every layer, or one per layer: per-head
    sizes differ by layer), passed to each layer's call as the linearized model passes it."""
    layers, window = capture.num_layers, int(options.get("window") or 0)
    if len(maps) != layers or len(gates) != layers:
        raise LinearAttentionError(f"maps/gates: one per layer ({layers}), got {len(maps)}/{len(gates)}")
    if sparse_cache is not None and ("sparse_cache" in options or not window):
        raise LinearAttentionError("sparse_cache: the cache sits beside the window; pass it once (not in options "
                                   "too), with options' window=W")
    per_layer = [options if cache is None else {**options, "sparse_cache": cache}
                 for cache in layer_caches(sparse_cache, layers)]
    if not capture.queries or steps < 0:
        raise LinearAttentionError(f"capture/steps: need a captured sequence and steps ≥ 0, got "
                                   f"{len(capture.queries)}/{steps}")
    usable = [index for index, q in enumerate(capture.queries) if q.shape[-2] > window]  # the loss lies past W
    if not usable:
        raise LinearAttentionError(f"capture: every sequence ({max(q.shape[-2] for q in capture.queries)} tokens at "
                                   f"most) lies within the window ({window}); capture longer pieces (the fit trains "
                                   "what lies beyond it)")
    map_params = [p for module in maps for p in module.parameters()]
    gate_params = [p for module in gates if module is not None for p in module.parameters()]
    params = map_params + gate_params
    if not params:
        raise LinearAttentionError("maps/gates: nothing to train (a named map without parameters and no gates)")
    optimizer = torch.optim.Adam([group for group in ({"params": map_params, "lr": lr},
                                                      {"params": gate_params, "lr": gate_lr}) if group["params"]])
    targets: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def target(sequence: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (sequence, layer) not in targets:
            q, k, v = (t[sequence][layer][None] for t in (capture.queries, capture.keys, capture.values))
            with torch.no_grad():
                out = teacher_outputs(q, k, v, capture.scaling)[..., window:, :]
            targets[sequence, layer] = out, out.square().mean(dim=(-1, -2)).clamp_min(1e-12)  # (1, H)
        return targets[sequence, layer]

    history: list[tuple[int, float]] = []
    sequences = len(usable)
    start = time.perf_counter()
    bar = progress_bar(total=steps, desc="student fit", enabled=progress)
    for step in range(steps):
        sequence = usable[step % sequences]
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for layer in range(layers):
            q, k, v = (t[sequence][layer][None] for t in (capture.queries, capture.keys, capture.values))
            out = student_outputs(q, k, v, maps[layer], gates[layer], capture.scaling,
                                  per_layer[layer])[..., window:, :]
            wanted, scale = target(sequence, layer)
            loss = ((out - wanted).square().mean(dim=(-1, -2)) / scale).mean() / layers
            if not torch.isfinite(loss):
                raise LinearAttentionError(f"fitting: the student loss of layer {layer} became non-finite at step "
                                           f"{step} (sequence {sequence}); lower lr or gate_lr")
            loss.backward()  # layer by layer: one layer's graph alive at a time
            total += float(loss.detach())
        if not math.isfinite(total):
            raise LinearAttentionError(f"fitting: the student loss became non-finite at step {step}; lower lr")
        optimizer.step()
        history.append((step, total))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{total:.4f}")
    if bar is not None:
        bar.close()
    return {"history": history, "seconds": time.perf_counter() - start}
