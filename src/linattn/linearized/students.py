"""The students of ``linattn linearize --student NAME``: what replaces each softmax attention layer.

Every student keeps the softmax window and sinks (exact over the last W keys and the first S tokens) and puts a
linear part beside them for the keys that have left the window:

- ``hedgehog``: Hedgehog maps, the additive state (LoLCATs' hybrid). Its far keys' mass grows with the context.
- ``gated-delta``: a gated delta-rule memory (Gated DeltaNet's update) on Hedgehog features, with β and a forget
  gate per token computed from the model's own keys and a read-out weight (:class:`~linattn.nn.KeyGates`): the
  memory overwrites what a key already recalls and forgets at a learned rate, so it does not grow with the context.
- ``kda``: the same with a forget gate per feature (Kimi Delta Attention).

The additive student is fitted on attention weights (:mod:`linattn.train.distill`); the delta-rule students on
each layer's output with the student in place (:mod:`linattn.train.student`); all are then trained end to end.
With ``--sparse-cache`` every student has the cache in place in both stages and in the measured row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import LinearAttentionError
from ..evaluate.capture import capture_attention
from ..evaluate.defaults import LM_WINDOW
from ..evaluate.lm_config import LMCompareConfig
from ..feature_maps import create
from ..feature_maps.fitted import FittedFeatureMaps
from ..feature_maps.learned import LearnedProjectionMap
from ..nn import KeyGates
from ..train.student import fit_student
from .arguments import DEFAULT_STUDENT_NAME, DELTA_CACHE_PER_WINDOW, DELTA_CACHE_TOP, DELTA_WINDOW, STUDENT_NAMES
from .folder import load_gates, save_gates

STUDENT_LR = 0.01  # Adam's step in the layer-wise fit of the delta-rule students


@dataclass(frozen=True)
class Student:
    name: str
    gate: str | None  # KeyGates' gate ("token", "feature"), None without a gate
    delta: bool  # the delta rule's memory (with KeyGates), else the additive state
    window: int  # the softmax window when --window is not given
    summary: str
    cache: bool = False  # a sparse cache when --sparse-cache is not given (resolve_exact_part)


STUDENTS = {student.name: student for student in (
    Student("hedgehog", None, False, LM_WINDOW, "Hedgehog maps, the additive state beside the softmax window"),
    Student("gated-delta", "token", True, DELTA_WINDOW, "a gated delta-rule memory beside the softmax window: "
            "Hedgehog features, β and a forget gate per token from the keys, a read-out weight", cache=True),
    Student("kda", "feature", True, DELTA_WINDOW, "a delta-rule memory with a forget gate per feature (KDA) beside "
            "the softmax window: Hedgehog features, β and the gates from the keys, a read-out weight", cache=True),
)}
DEFAULT_STUDENT = DEFAULT_STUDENT_NAME
assert tuple(STUDENTS) == STUDENT_NAMES  # the command line's choices (kept apart so that --help imports no torch)


def student(name: str) -> Student:
    if name not in STUDENTS:
        raise LinearAttentionError(f"--student: unknown student {name!r}; choose one of {', '.join(STUDENTS)}")
    return STUDENTS[name]


def resolve_exact_part(args: Any, chosen: Student) -> bool:
    """Fill in the exact part the options leave open (on ``args``, in place) with the student's own: its window;
    for the delta-rule students a cache of :data:`DELTA_CACHE_PER_WINDOW` windows per head on average, split by
    retrieval score with no floor among the :data:`DELTA_CACHE_TOP` highest-scoring heads (the shipped SmolLM2's
    layout), for the additive student none. A ``--sparse-cache N`` given keeps the uniform spread unless
    ``--sparse-cache-heads`` says otherwise. Returns whether the top heads' count is the default (which then
    covers every head of a model with fewer)."""
    if args.window is None:
        args.window = chosen.window
    own = args.sparse_cache is None and chosen.cache
    if args.sparse_cache is None:
        args.sparse_cache = DELTA_CACHE_PER_WINDOW * args.window if own else 0
    if args.sparse_cache_heads is None:
        args.sparse_cache_heads = "retrieval" if own else "uniform"
    default_top = own and args.sparse_cache_heads == "retrieval" and args.sparse_cache_top is None
    if own and args.sparse_cache_heads == "retrieval":
        args.sparse_cache_floor = 0 if args.sparse_cache_floor is None else args.sparse_cache_floor
        args.sparse_cache_top = DELTA_CACHE_TOP if args.sparse_cache_top is None else args.sparse_cache_top
    return default_top


def attention_options(chosen: Student) -> dict[str, Any]:
    """The ``linear_attention`` options the student adds to the window's (JSON values: saved with the folder)."""
    return {"update": "delta"} if chosen.delta else {}


def new_student(model: Any, model_name: str, chosen: Student, num_features: int | None, window: int,
                sinks: int) -> tuple[FittedFeatureMaps, list[KeyGates]]:
    """A delta-rule student at its initialisation: Hedgehog maps (identity start) and gates, one per layer."""
    config = model.config
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers = int(config.num_hidden_layers)
    options = {"num_features": num_features or head_dim, "tied": False}
    fitted = FittedFeatureMaps(model_name, "hedgehog", layers, heads, head_dim, dict(options))
    fitted.maps = [cast(LearnedProjectionMap, create("hedgehog", head_dim=head_dim, num_heads=heads, **options))
                   for _ in range(layers)]
    fitted.window, fitted.sinks = window, sinks
    features = int(fitted.maps[0].output_dim(head_dim))  # the gate per feature: one per map feature (2m)
    gates = [KeyGates(kv_heads, head_dim, gate=chosen.gate, num_features=features, readout=True)
             for _ in range(layers)]
    return fitted, gates


def fit_delta_student(model: Any, tokenizer: Any, model_name: str, train: str, config: LMCompareConfig,
                      chosen: Student, sparse_cache: Any = None
                      ) -> tuple[FittedFeatureMaps, list[KeyGates], dict[str, Any]]:
    """The fit stage of a delta-rule student: captured under softmax, fitted layer by layer with the student in
    place (:func:`linattn.train.student.fit_student`), with ``sparse_cache`` (one
    :class:`~linattn.SparseCache` for every layer, or one per layer) in place too when given. Returns the maps,
    the gates and what it took."""
    fit = config.fit
    model.set_attn_implementation("sdpa")
    capture = capture_attention(model, tokenizer, train, max_tokens=fit.max_tokens, model_name=model_name,
                                orders=fit.orders)
    fitted, gates = new_student(model, model_name, chosen, fit.num_features, config.window, config.sinks)
    options = {"window": config.window, "sinks": config.sinks, **attention_options(chosen)}
    info = fit_student(capture, fitted.maps, gates, options, steps=fit.steps or 0, lr=STUDENT_LR,
                       progress=not config.quiet, sparse_cache=sparse_cache)
    history = info["history"]
    return fitted, gates, {"captured_tokens": capture.num_tokens, "student_seconds": info["seconds"],
                           "first_loss": history[0][1] if history else None,
                           "last_loss": history[-1][1] if history else None}


def save_stage_gates(gates: list[KeyGates] | None, folder: Path, stage: str) -> dict[str, Any] | None:
    """A stage's gates as ``stages/STAGE_gates.safetensors``; the entry to record in its marker (or None)."""
    return None if gates is None else save_gates(gates, folder / f"{stage}_gates.safetensors")


def load_stage_gates(folder: Path, entry: dict[str, Any] | None) -> list[Any] | None:
    return load_gates(folder, entry)
