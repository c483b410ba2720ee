"""A linearized decoder as a folder: written by :func:`save_linearized`, reloaded in one line by
:func:`load_linearized`.

>>> save_linearized(model, "out/smollm2-lin", base="smollm2", maps=fitted, options={"window": 64, "sinks": 4})
...                                                                                          # doctest: +SKIP
>>> model, tokenizer = load_linearized("out/smollm2-lin")                                    # doctest: +SKIP

The folder holds what :func:`linattn.hf.linearize` needs besides the base model, never the base model's weights:

    linattn.json          format, the base model (name or path as given, and a fingerprint of its weights and
                          config), the maps (a file or a registered name), the linearize options, the adapters
    maps.safetensors      fitted maps (FittedFeatureMaps.save), when the maps are fitted
    gates.safetensors     per-token β and gates from the keys (linattn.nn.KeyGates, one per layer), when there
                          are any; their settings in linattn.json
    lora/                 LoRA adapters in peft's format (LoRA.save), when there are any
    results.json          what was measured (written by ``linattn linearize``; ``{}`` otherwise)
    README.md             the card (``linattn linearize``)

``linattn.json`` is written last, by rename: a folder without it is not (yet) a linearized model. Loading takes
the base model offline from the name or path recorded (or ``base=``), recomputes the fingerprint and refuses a
different model: maps fitted for one model's heads are meaningless on another's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import hf
from .._json import dumps
from ..errors import LinearAttentionError
from ..evaluate.models import load_model
from ..feature_maps.fitted import FittedFeatureMaps, load_feature_maps

FORMAT = "linattn-linearized"
VERSION = 1
INDEX, MAPS_FILE, ADAPTERS_FOLDER, RESULTS_FILE = "linattn.json", "maps.safetensors", "lora", "results.json"
GATES_FILE = "gates.safetensors"
# config keys that say how a model was loaded or run, not what it computes
_VOLATILE_CONFIG = ("transformers_version", "dtype", "torch_dtype", "use_cache", "architectures")
# what the recorded fingerprint covers: "every tensor" (written now); folders written before record none, and their
# fingerprint hashed the bytes of four tensors (the first two and last two by name), still checked as such
EVERY_TENSOR = "every tensor"
_LEGACY_TENSORS = 4


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name in the same folder, then rename: a reader (or a run
    resumed after an interruption) sees the old file or the whole new one, never a part."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with open(partial, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def _base_parameter_name(name: str) -> str | None:
    """A state-dict name as the base model has it (peft's ``.base_layer`` removed), or None for what linearizing
    and adapters added (feature maps, LoRA A/B)."""
    if hf.MAP_ATTRIBUTE in name or hf.GATES_ATTRIBUTE in name or ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def fingerprint(model: Any, *, every_tensor: bool = True) -> str:
    """A digest of what the base model computes: its config (less load-time keys), every parameter's and buffer's
    name and shape, and the bytes of every one of them (as fp32, in name order; a tensor tied to an earlier one by
    its name). Maps, options and adapters added by linattn are left out, so the linearized model has the
    fingerprint of the model it came from. ``every_tensor=False``: the digest folders written before recorded
    (the bytes of four tensors only). SmolLM2-135M (134.5M parameters, fp32): 0.7–0.8 s on one CPU core."""
    config = getattr(model, "config", None)
    settings = config.to_dict() if config is not None else {}
    settings = {key: value for key, value in settings.items()
                if not key.startswith("_") and not key.startswith("linattn") and key not in _VOLATILE_CONFIG}
    tensors = {}
    for name, tensor in model.state_dict().items():
        base = _base_parameter_name(name)
        if base is not None:
            tensors[base] = tensor
    names = sorted(tensors)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for name in names:
        digest.update(f"{name}:{tuple(tensors[name].shape)};".encode())
    if not every_tensor:
        half = _LEGACY_TENSORS // 2
        names = names[:half] + names[-half:]
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name in names:
        tensor = tensors[name].detach()
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if every_tensor and key in seen and tensor.numel():  # tied weights (the LM head and the embedding)
            digest.update(f"{name}={seen[key]};".encode())
            continue
        seen[key] = name
        data = tensor.to("cpu", torch.float32).contiguous()
        digest.update(memoryview(data.numpy()).cast("B"))
    return digest.hexdigest()[:32]


def _maps_entry(maps: Any, directory: Path) -> dict[str, Any]:
    if isinstance(maps, FittedFeatureMaps):
        maps.save(str(directory / f".{MAPS_FILE}.partial"))
        os.replace(directory / f".{MAPS_FILE}.partial", directory / MAPS_FILE)
        return {"file": MAPS_FILE}
    if isinstance(maps, str | os.PathLike) and os.path.isfile(maps):
        return _maps_entry(load_feature_maps(os.fspath(maps)), directory)
    if isinstance(maps, str):
        return {"name": maps}
    raise LinearAttentionError(
        f"maps: a {type(maps).__name__} cannot be saved; pass the FittedFeatureMaps given to linearize (or their "
        "file), or the registered name of a map (e.g. 'elu')"
    )


def _gates_entry(gates: Any, directory: Path) -> dict[str, Any] | None:
    """Write ``gates`` (one :class:`~linattn.nn.KeyGates` per layer) as ``gates.safetensors``; their settings."""
    if gates is None:
        return None
    return {**save_gates(gates, directory / GATES_FILE), "file": GATES_FILE}


def save_gates(gates: Any, path: Path) -> dict[str, Any]:
    """Write ``gates`` (one :class:`~linattn.nn.KeyGates` per layer) to the safetensors file ``path`` (through a
    temporary name); their settings, as ``linattn.json`` records them (``file`` the path's name)."""
    from safetensors.torch import save_file

    from ..nn import KeyGates

    gates = list(gates)
    if not gates or not all(isinstance(module, KeyGates) for module in gates):
        raise LinearAttentionError("gates: a folder saves linattn.nn.KeyGates, one per layer; got "
                                   f"{[type(module).__name__ for module in gates]}")
    tensors = {f"layers.{layer}.{name}": tensor.detach().to("cpu").contiguous()
               for layer, module in enumerate(gates) for name, tensor in module.state_dict().items()}
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    save_file(tensors, str(partial))
    os.replace(partial, path)
    return {"file": path.name, "kind": "key", "config": gates[0].config(), "layers": len(gates)}


def load_gates(directory: str | os.PathLike[str], entry: dict[str, Any] | None) -> list[Any] | None:
    """The gates a folder's ``linattn.json`` names (``entry["gates"]``), or None."""
    if not entry:
        return None
    from safetensors.torch import load_file

    from ..nn import KeyGates

    if entry.get("kind") != "key" or not isinstance(entry.get("config"), dict):
        raise LinearAttentionError(f"gates: {entry!r} in {os.fspath(directory)!r} is not a KeyGates entry this "
                                   "version reads; save the folder again with this version")
    tensors = load_file(str(Path(directory) / entry["file"]))
    gates = []
    for layer in range(int(entry["layers"])):
        module = KeyGates(**entry["config"])
        prefix = f"layers.{layer}."
        module.load_state_dict({name[len(prefix):]: value for name, value in tensors.items()
                                if name.startswith(prefix)})
        gates.append(module)
    return gates


def save_linearized(model: Any, directory: str | os.PathLike[str], *, maps: Any = hf.DEFAULT_FEATURE_MAP,
                    options: dict[str, Any] | None = None, base: str | None = None, adapters: Any = None,
                    results: dict[str, Any] | None = None, gates: Any = None) -> Path:
    """Write the folder of the module docstring for ``model``, linearized by ``hf.linearize(model, maps,
    gates=gates, **options)`` (with ``adapters``, a :class:`~linattn.train.lora.LoRA`, attached or not).

    ``base``: the name or path the base model loads from offline (``"smollm2"``, a folder; default: the model's
    ``config._name_or_path``). ``options`` must be JSON values (numbers, strings, booleans). Returns the folder.
    """
    options = dict(options or {})
    try:
        options_text = json.dumps(options, sort_keys=True)
    except TypeError as error:
        raise LinearAttentionError(f"options: {error}; a saved model records its linearize options as JSON, so "
                                   "pass numbers, strings and booleans (e.g. decay=0.99, not a tensor)") from error
    base = base or str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if not base:
        raise LinearAttentionError("base: the model records no name or path; pass base='NAME' or a folder")
    if os.path.exists(base):
        base = os.path.abspath(base)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entry = {"format": FORMAT, "version": VERSION,
             "base": {"model": base, "fingerprint": fingerprint(model), "fingerprint_of": EVERY_TENSOR,
                      "class": type(model).__name__},
             "maps": _maps_entry(maps, directory), "options": json.loads(options_text), "adapters": None}
    gates_entry = _gates_entry(gates, directory)
    if gates_entry is not None:
        entry["gates"] = gates_entry
    if adapters is not None:  # through a temporary folder and a rename, as every file here
        partial = directory / f".{ADAPTERS_FOLDER}.partial-{os.getpid()}"
        adapters.save(partial)
        shutil.rmtree(directory / ADAPTERS_FOLDER, ignore_errors=True)
        os.replace(partial, directory / ADAPTERS_FOLDER)
        entry["adapters"] = ADAPTERS_FOLDER
    if results is not None or not (directory / RESULTS_FILE).exists():
        atomic_write(directory / RESULTS_FILE, dumps(results or {}, indent=2, default=str))  # strict JSON
    atomic_write(directory / INDEX, json.dumps(entry, indent=2))  # last: the folder is complete
    return directory


SHIPPED = Path(__file__).resolve().parent.parent / "data" / "linearized"


def shipped(name: str) -> Path | None:
    """The linearized folder shipped with linattn for the base model ``name`` (``smollm2``), or None."""
    folder = SHIPPED / name
    return folder if (folder / INDEX).is_file() else None


def is_linearized(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`save_linearized`."""
    return os.path.isfile(os.path.join(path, INDEX))


def read_index(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``linattn.json`` of a linearized folder, checked."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise LinearAttentionError(f"directory: {os.fspath(directory)!r} holds no {INDEX}; pass a folder written by "
                                   "save_linearized() or `linattn linearize ... --out DIR` (an interrupted run: "
                                   "run it again)")
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LinearAttentionError(f"directory: {os.fspath(path)!r} is not readable JSON ({error})") from error
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("version") != VERSION:
        seen = f"a JSON {type(entry).__name__}" if not isinstance(entry, dict) else f"format {entry.get('format')!r}"
        raise LinearAttentionError(f"directory: {os.fspath(path)!r} is not a {FORMAT} v{VERSION} index ({seen}); "
                                   "pass a folder written by save_linearized()")
    base, maps = entry.get("base"), entry.get("maps")
    problems = []
    if not isinstance(base, dict) or not isinstance(base.get("model"), str) or not isinstance(
            base.get("fingerprint"), str):
        problems.append('"base": {"model": name or path, "fingerprint": ...}')
    if not isinstance(maps, dict) or not isinstance(maps.get("file", maps.get("name")), str):
        problems.append('"maps": {"file": ...} or {"name": ...}')
    if not isinstance(entry.get("options", {}), dict):
        problems.append('"options": {...}')
    if problems:
        raise LinearAttentionError(
            f"directory: {os.fspath(path)!r} lacks or garbles {'; '.join(problems)}; write the folder again with "
            "save_linearized() (or `linattn linearize ... --out DIR`)"
        )
    return dict(entry)


def load_linearized(directory: str | os.PathLike[str], *, base: str | None = None,
                    device: str | torch.device = "cpu", sparse_cache: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer): the base model recorded in ``directory`` (or ``base``, e.g. after moving it), loaded
    offline, its fingerprint checked, linearized as saved and its adapters attached; in eval mode.
    ``sparse_cache``: add (or replace) a sparse exact cache beside the window (an int per head, a
    :class:`~linattn.SparseCache`, or one per layer)."""
    directory = Path(directory)
    entry = read_index(directory)
    name = base or entry["base"]["model"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a saved model never downloads its base
    model, tokenizer, _ = load_model(name, causal_lm=True, device=device)
    # a folder written before the fingerprint covered every tensor is checked as it was written (four tensors'
    # bytes); save it again to record the full one
    found = fingerprint(model, every_tensor=entry["base"].get("fingerprint_of") == EVERY_TENSOR)
    if found != entry["base"]["fingerprint"]:
        raise LinearAttentionError(
            f"base: {name!r} is not the model {os.fspath(directory)!r} was made from (fingerprint {found}, the folder "
            f"records {entry['base']['fingerprint']} for {entry['base']['model']!r}): its config or some weight "
            "differs; pass base= the model it was linearized from, or linearize this model anew"
        )
    maps_entry = entry["maps"]
    maps: Any = load_feature_maps(str(directory / maps_entry["file"])) if "file" in maps_entry else maps_entry["name"]
    options = dict(entry.get("options", {}))
    if sparse_cache is not None:
        options["sparse_cache"] = sparse_cache
    hf.linearize(model, maps, gates=load_gates(directory, entry.get("gates")), **options)
    if entry.get("adapters"):
        from ..train.lora import load_lora  # peft: only for a folder with adapters

        load_lora(model, directory / entry["adapters"])
    return model.eval(), tokenizer


# room a run needs beyond its estimated files
DISK_MARGIN = 64 * 2**20


def prepare_out(out: str) -> Path:
    """Make ``out`` and check that it can be written (before any model is loaded)."""
    folder = Path(out)
    try:
        (folder / "stages").mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder / "stages", prefix=".probe-"):
            pass
    except OSError as error:
        raise LinearAttentionError(f"--out: cannot write into {out!r} ({error.strerror or error}); pass a folder you "
                                   "can write to") from error
    return folder


def check_disk(folder: Path, model: Any, num_features: int | None) -> int:
    """Refuse to start when ``folder``'s disk has less room than the run's files need (an estimate: three sets of
    maps of every layer and head, a margin); returns the estimate in bytes."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    features = num_features or head_dim
    estimate = 3 * int(config.num_hidden_layers) * heads * head_dim * features * 2 * 4 + DISK_MARGIN
    free = shutil.disk_usage(folder).free
    if free < estimate:
        raise LinearAttentionError(f"--out: {free / 2**20:.0f} MiB free on the disk of {str(folder)!r}, the run needs "
                                   f"about {estimate / 2**20:.0f} MiB; free some space or pass another --out")
    return estimate
