"""``linattn linearize MODEL [TEXT] --out DIR``: the measured recipe as one resumable pipeline that produces a
linearized folder (:mod:`linattn.linearized.folder`).

Stages, each reusing the comparison's own (:mod:`~linattn.evaluate.lm_stages`):

1. ``fit``: the student fitted with the softmax window and sinks (and ``--sparse-cache``'s cache) in place, on
   pieces as long as the contexts served (``--fit-max-tokens``, 1,024 by default): Hedgehog maps on attention
   weights, or a delta-rule student's maps and gates layer by layer on each layer's output;
2. ``end_to_end``: text sampled from the model itself (and copying sequences built from it), then the maps (and a
   delta-rule student's gates; or, with ``--lora R``, rank-R adapters) trained on the KL to the original's
   next-token distribution, with the same exact part in place;
3. ``long_gaps``: with ``--end-to-end-long-steps``, the same training continued on the samples' copying
   sequences alone, with the longer gaps of ``--end-to-end-long-gap``;
4. ``measure``: the original, the softmax window of equal memory and the linearized model scored (perplexity,
   repeated passage, passkey; perplexity by position), then the folder and its card written.

Each stage writes its checkpoint under ``DIR/stages/`` through a temporary name and a rename, then a marker
``NAME.done``; a run started again with the same options skips every stage with a marker and never reads a file
without one. ``DIR/stages/log.jsonl`` records each stage's start, finish or skip. The options of the first run are
kept (``stages/plan.json``, with the step counts ``--budget`` chose): a rerun with other options is refused rather
than mixing stages made two ways.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from .. import hf
from .._progress import progress_bar
from ..data import check_text_file
from ..errors import LinearAttentionError
from ..evaluate.lm_compare import score_model
from ..evaluate.lm_config import (
    HELD_OUT_SAMPLES,
    LM_FIT_TOKENS,
    EndToEndOptions,
    FitOptions,
    LMCompareConfig,
    ProbeOptions,
)
from ..evaluate.lm_stages import (
    RETRIEVAL_SEQUENCES,
    fit_hedgehog,
    read_text,
    train_end_to_end,
    training_sequences,
    training_text_count,
)
from ..evaluate.models import check_model_name, load_model, looks_causal
from ..evaluate.probes import repeats_by_gap
from ..evaluate.window_softmax import use_window_softmax
from ..feature_maps.fitted import FittedFeatureMaps, load_feature_maps
from ..state import SparseCache
from ..train.end_to_end import COPY_GAP, cache_split
from .arguments import KEY_FILLER_TOKENS, LONG_GAP_STEPS, LONG_GAP_TOKENS
from .card import WIDER_ROW, perplexity_by_position, write_card
from .folder import atomic_write, check_disk, fingerprint, prepare_out, save_linearized
from .students import (
    attention_options,
    fit_delta_student,
    load_stage_gates,
    resolve_exact_part,
    save_stage_gates,
    student,
)

STAGES = ("fit", "end_to_end", "long_gaps", "measure")
PROBE_TEXT, PROBE_SOURCE = "heldout_long", "the shipped long held-out text"  # the repeated passage at --repeat-gaps
# what --out must have free, beyond the checkpoints' estimate: the card, the plot, the samples, a margin
# options that change what a stage makes (a rerun must pass the same); --quiet and --budget's own value do not
_PLANNED = ("model", "text", "heldout", "student", "window", "sinks", "fit_steps", "num_features", "fit_max_tokens",
            "fit_orders", "end_to_end_steps", "end_to_end_samples", "end_to_end_tokens", "end_to_end_corpus_orders",
            "end_to_end_copy_gap", "end_to_end_long_steps", "end_to_end_long_gap", "end_to_end_keys",
            "end_to_end_key_filler", "lora", "sparse_cache",
            "sparse_cache_heads", "sparse_cache_floor", "sparse_cache_top", "sparse_cache_linear_weight", "budget",
            "init_from")
# what --init-from's run must share with this one (its student and exact part, the text its samples came from)
_SHARED = ("model", "text", "student", "window", "sinks", "num_features", "end_to_end_samples", "end_to_end_tokens",
           "sparse_cache", "sparse_cache_heads", "sparse_cache_floor", "sparse_cache_top",
           "sparse_cache_linear_weight")
# what a plan saved before an option existed meant
_EARLIER_DEFAULTS = {"end_to_end_corpus_orders": 0, "end_to_end_copy_gap": list(COPY_GAP), "sparse_cache": 0,
                     "sparse_cache_heads": "uniform",
                     "sparse_cache_floor": None,
                     "sparse_cache_top": None,
                     "sparse_cache_linear_weight": 1.0, "student": "hedgehog", "init_from": None,
                     "end_to_end_long_steps": None, "end_to_end_long_gap": list(LONG_GAP_TOKENS),
                     "end_to_end_keys": 0, "end_to_end_key_filler": list(KEY_FILLER_TOKENS)}


class Stages:
    """The markers, checkpoints and log of one output folder's stages."""

    def __init__(self, folder: Path, quiet: bool) -> None:
        self.folder, self.quiet = folder / "stages", quiet
        self.folder.mkdir(parents=True, exist_ok=True)

    def done(self, name: str) -> dict[str, Any] | None:
        """The finished stage's record, or None (not finished: whatever files it left are not read)."""
        marker = self.folder / f"{name}.done"
        return json.loads(marker.read_text(encoding="utf-8")) if marker.is_file() else None

    def log(self, name: str, event: str, **extra: Any) -> None:
        with open(self.folder / "log.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"stage": name, "event": event, "time": time.time(), **extra}) + "\n")
        if not self.quiet:
            detail = ", ".join(f"{key} {value}" for key, value in extra.items())
            print(f"stage {name}: {event}" + (f" ({detail})" if detail else ""), flush=True)

    def finish(self, name: str, info: dict[str, Any]) -> None:
        atomic_write(self.folder / f"{name}.done", json.dumps(info, indent=2, default=str))
        self.log(name, "finished", seconds=round(info.get("seconds", 0.0), 1))

    def save_maps(self, fitted: FittedFeatureMaps, name: str) -> Path:
        path = self.folder / f"{name}.safetensors"
        partial = self.folder / f".{name}.safetensors.partial-{os.getpid()}"
        fitted.save(str(partial))
        os.replace(partial, path)
        return path


def _long_steps(args: argparse.Namespace) -> int:
    """--end-to-end-long-steps as given, else its default: none with --lora (the adapters are not trained on)."""
    given = getattr(args, "end_to_end_long_steps", None)
    if given is not None:
        if given < 0:
            raise LinearAttentionError(f"--end-to-end-long-steps: need ≥ 0, got {given}")
        if given and args.lora:
            raise LinearAttentionError("--end-to-end-long-steps with --lora: the long_gaps stage trains the maps and "
                                       "gates, not adapters; pass --end-to-end-long-steps 0")
        return int(given)
    return 0 if args.lora else LONG_GAP_STEPS


def _long_options(options: EndToEndOptions, args: argparse.Namespace, plan: dict[str, Any]) -> EndToEndOptions | None:
    """The long_gaps stage's end-to-end options: ``plan``'s step count (None or 0: no such stage), the copying
    gaps of --end-to-end-long-gap, the samples alone, and the --end-to-end-keys key-retrieval sequences (of
    ``plan``'s draw: :func:`_key_seed`)."""
    steps = plan.get("end_to_end_long_steps", 0)
    gap = tuple(getattr(args, "end_to_end_long_gap", LONG_GAP_TOKENS))
    keys = int(getattr(args, "end_to_end_keys", 0) or 0)
    try:
        long = replace(options, steps=max(int(steps or 0), 0), copy_gap=gap, corpus_orders=0, lora_rank=0,
                       keys=keys, key_filler=tuple(getattr(args, "end_to_end_key_filler", KEY_FILLER_TOKENS)),
                       key_seed=int(plan.get("key_seed", 0)))
    except LinearAttentionError as error:
        raise LinearAttentionError(str(error).replace("--end-to-end-copy-gap", "--end-to-end-long-gap")) from error
    if keys and not long.steps:
        raise LinearAttentionError("--end-to-end-keys: the key-retrieval sequences are trained on in the long_gaps "
                                   "stage, which this run does not have; give --end-to-end-long-steps N ≥ 1 (and no "
                                   "--lora), or --end-to-end-keys 0")
    return long if long.steps else None


def _config(args: argparse.Namespace, plan: dict[str, Any], samples_file: str) -> LMCompareConfig:
    """The pipeline's settings: the options given, with the step counts and the number of samples of ``plan``."""
    fit_steps, end_to_end_steps = plan["fit_steps"], plan["end_to_end_steps"]
    samples = plan.get("end_to_end_samples", args.end_to_end_samples)  # a plan written before it was planned
    probes = ProbeOptions(passage_tokens=args.passage_tokens, gap_tokens=args.gap_tokens,
                          repeat_trials=args.repeat_trials, passkey_lengths=tuple(args.passkey_lengths),
                          passkey_trials=args.passkey_trials)
    fit = FitOptions(steps=fit_steps, num_features=args.num_features, max_tokens=args.fit_max_tokens or LM_FIT_TOKENS,
                     orders=args.fit_orders, gamma=False, fitted_maps=None, save_maps=None)
    end_to_end = EndToEndOptions(
        steps=end_to_end_steps, samples=samples, tokens=args.end_to_end_tokens, texts=samples_file,
        copies=True, corpus_orders=args.end_to_end_corpus_orders, repeat_weight=1.0,
        lora_rank=args.lora if end_to_end_steps else 0, lora_lr=0.0005, retrieval_heads=0, retrieval_maps=None,
        train_other_heads=False,
        sparse_cache=args.sparse_cache, cache_linear_weight=args.sparse_cache_linear_weight,
        copy_gap=tuple(args.end_to_end_copy_gap))
    _long_options(end_to_end, args, plan)  # checked with the rest
    return LMCompareConfig(model=args.model, text=args.text, heldout=args.heldout, out=args.out,
                           maps=("hedgehog+window",), window=args.window, sinks=args.sinks, max_tokens=0,
                           metrics=False, baselines=True, quiet=args.quiet, probes=probes, fit=fit,
                           end_to_end=end_to_end)


class Job:
    """One ``linattn linearize`` run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        check_model_name(args.model)
        if not looks_causal(args.model):
            raise LinearAttentionError(f"model: {args.model!r} is not a causal LM (its config names no *ForCausalLM "
                                       "architecture); linattn linearize makes decoders linear, such as smollm2")
        check_text_file(args.text, "text")
        check_text_file(args.heldout, "--heldout")
        check_text_file(getattr(args, "probe_text", None), "--probe-text")
        if args.budget is not None and not args.budget > 0:
            raise LinearAttentionError(f"--budget: need minutes > 0, got {args.budget}")
        args.init_from = getattr(args, "init_from", None)
        if args.init_from is not None and args.budget is not None:
            raise LinearAttentionError("--init-from with --budget: the budget plans a fit that --init-from skips; give "
                                       "--end-to-end-steps instead")
        self.student = student(getattr(args, "student", "hedgehog"))
        # the student's own window and cache where the options leave them open (what is given is kept; all of it
        # is saved in the plan)
        self.default_top = resolve_exact_part(args, self.student)
        _check_cache_heads(args)
        # every option checked before the output folder is made and the model loaded
        _config(args, {"fit_steps": args.fit_steps, "end_to_end_steps": args.end_to_end_steps,
                       "end_to_end_long_steps": _long_steps(args)}, "")
        self.source = _source_run(args) if args.init_from is not None else None
        self.gates: list[Any] | None = None  # a delta-rule student's KeyGates, one per layer
        self.args, self.folder = args, prepare_out(args.out)
        self.stages = Stages(self.folder, args.quiet)
        saved = self._saved_plan()  # a rerun with other options fails here, before the model loads
        self.model, self.tokenizer, self.name = load_model(args.model, causal_lm=True)
        check_disk(self.folder, self.model, args.num_features)
        self.train, self.heldout = read_text(args.text, "train"), read_text(args.heldout, "heldout")
        self.probe_text = read_text(getattr(args, "probe_text", None), PROBE_TEXT)
        self.plan = saved if saved is not None else self._new_plan()
        self.config = _config(args, self.plan, str(self.folder / "stages" / "samples.json"))
        self.long = _long_options(self.config.end_to_end, args, self.plan)

    def _options(self) -> dict[str, Any]:
        return {name: getattr(self.args, name) for name in _PLANNED}

    def _saved_plan(self) -> dict[str, Any] | None:
        """The plan of an earlier run into this folder (``stages/plan.json``), refused if made with other options."""
        path = self.folder / "stages" / "plan.json"
        if not path.is_file():
            return None
        saved = json.loads(path.read_text(encoding="utf-8"))
        options = self._options()
        earlier = {**_EARLIER_DEFAULTS, **saved["options"]}
        if earlier != options:
            differ = sorted(name for name in options if earlier.get(name) != options[name])
            raise LinearAttentionError(
                f"--out: {self.args.out!r} holds the stages of a run with other options ({', '.join(differ)}); "
                "run again with the same options to continue it, or pass another --out"
            )
        return dict(saved)

    def _new_plan(self) -> dict[str, Any]:
        """The step counts (chosen by --budget, or given), kept in ``stages/plan.json`` for reruns."""
        plan: dict[str, Any] = {"fit_steps": self.args.fit_steps, "end_to_end_steps": self.args.end_to_end_steps,
                                "end_to_end_long_steps": _long_steps(self.args),
                                "end_to_end_samples": self.args.end_to_end_samples, "estimates": {}}
        if self.args.budget is not None:
            from .budget import calibrate, plan_steps

            config = _config(self.args, plan, "")
            long = _long_options(config.end_to_end, self.args, plan)
            costs = calibrate(self.model, self.tokenizer, self.name, self.train, self.heldout, config, self.student,
                              tuple(getattr(self.args, "repeat_gaps", None) or ()), split=self._calibration_split(),
                              long_gap=None if long is None else long.copy_gap)
            plan = plan_steps(self.args.budget, costs, end_to_end=self.args.end_to_end_steps > 0,
                              samples=self.args.end_to_end_samples, most_fit=self.args.fit_steps,
                              corpus=training_text_count(self.tokenizer, self.train, config.end_to_end),
                              sample_first=self._retrieval_split, long=long is not None)
        plan["key_seed"] = _key_seed(self.source)
        plan["options"] = self._options()
        _config(self.args, plan, "")  # options refused there leave no plan behind (a corrected rerun is not "other")
        atomic_write(self.folder / "stages" / "plan.json", json.dumps(plan, indent=2))
        return plan

    @property
    def _retrieval_split(self) -> bool:
        """Whether the run splits its cache by retrieval score (--sparse-cache with --sparse-cache-heads retrieval)."""
        return bool(self.args.sparse_cache) and self.args.sparse_cache_heads == "retrieval"

    def _top(self) -> int | None:
        """--sparse-cache-top, the students' default count held to the model's heads."""
        top = self.args.sparse_cache_top
        if top is not None and self.default_top:  # every head of a model with fewer
            config = self.model.config
            top = min(top, int(config.num_hidden_layers) * int(config.num_attention_heads))
        return top

    def _calibration_split(self) -> list[Any] | None:
        """With --sparse-cache-heads retrieval: the split --budget times the stages with, made on the training text
        (the run's own is decided later on its samples; its layers' largest budgets, which set the training form's
        slots, are what a uniform cache would miss). None otherwise, or where the text is too short to score."""
        args = self.args
        if not self._retrieval_split:
            return None
        from .caches import text_split

        try:
            caches = text_split(self.model, self.tokenizer, self.train, args.window, args.sinks, args.sparse_cache,
                                _cache_floor(args), self._top())
        except LinearAttentionError:
            return None  # the uniform cache of as many pairs instead
        weight = args.sparse_cache_linear_weight
        return [SparseCache(size=cache.size, linear_weight=weight) for cache in caches]

    def run(self) -> dict[str, Any]:
        bar = progress_bar(len(STAGES), "linearize", enabled=not self.args.quiet)
        try:
            fitted = self.fit()
            _update(bar)
            tuned, adapters = self.end_to_end(fitted)
            _update(bar)
            tuned = self.long_gaps(tuned)
            _update(bar)
            return self.measure(tuned, adapters)
        finally:
            if bar is not None:
                bar.close()

    def _starting(self, name: str) -> None:
        estimate = self.plan["estimates"].get(name)
        self.stages.log(name, "started", **({"estimate_s": round(estimate)} if estimate is not None else {}))

    def fit(self) -> FittedFeatureMaps:
        if (done := self.stages.done("fit")) is not None:
            self.stages.log("fit", "skipped (finished before)")
            self.gates = load_stage_gates(self.stages.folder, done.get("gates"))
            return load_feature_maps(str(self.stages.folder / "fit.safetensors"))
        if self.source is not None:
            return self._take_source(self.source)
        self._starting("fit")
        begin = time.perf_counter()
        caches = self._fit_caches()
        cache = " and the sparse cache" if caches is not None else ""
        if self.student.delta:
            fitted, self.gates, info = fit_delta_student(self.model, self.tokenizer, self.name, self.train,
                                                         self.config, self.student, sparse_cache=caches)
            self.stages.save_maps(fitted, "fit")
            entry = save_stage_gates(self.gates, self.stages.folder, "fit")
            self.stages.finish("fit", {"seconds": time.perf_counter() - begin, "steps": self.config.fit.steps,
                                       **info, "sparse_cache": caches is not None, "gates": entry,
                                       "summary": f"{self.student.summary}: fitted layer by layer to the softmax "
                                       f"outputs with the window{cache} in place, {self.config.fit.steps} steps on "
                                       f"{info['captured_tokens']} captured tokens"})
            return fitted
        fitted, tokens = fit_hedgehog(self.model, self.tokenizer, self.name, self.train, self.config, with_window=True,
                                      sparse_cache=caches)
        self.stages.save_maps(fitted, "fit")
        self.stages.finish("fit", {"seconds": time.perf_counter() - begin, "steps": self.config.fit.steps,
                                   "captured_tokens": tokens, "sparse_cache": caches is not None,
                                   "summary": f"Hedgehog maps fitted with the window{cache} in place, "
                                              f"{self.config.fit.steps} steps on {tokens} captured tokens"})
        return fitted

    def _take_source(self, source: Path) -> FittedFeatureMaps:
        """--init-from: the source run's trained maps and gates (after its long_gaps stage, when it had one) as this
        run's starting point (the fit stage's checkpoint), with its samples and its cache split; a copy each, then
        the marker."""
        stages = source / "stages"
        last = "long_gaps" if (stages / "long_gaps.done").is_file() else "end_to_end"
        done = json.loads((stages / f"{last}.done").read_text("utf-8"))
        for name in ("samples.json", "cache_sizes.json"):
            if (stages / name).is_file():
                atomic_write(self.stages.folder / name, (stages / name).read_bytes())
        fitted = load_feature_maps(str(stages / f"{last}.safetensors"))
        self.stages.save_maps(fitted, "fit")
        entry = None
        if done.get("gates") is not None:
            self.gates = load_stage_gates(stages, done["gates"])
            entry = save_stage_gates(self.gates, self.stages.folder, "fit")
        self.stages.finish("fit", {"seconds": 0.0, "from": str(source), "gates": entry,
                                   "summary": f"taken from the run in {source}: {done.get('summary', '')}"})
        return fitted

    def _fit_caches(self) -> SparseCache | list[SparseCache] | None:
        """With --sparse-cache: the caches the fit has in place, one per layer (a split is decided first, on the
        end-to-end stage's training samples, which are then sampled here rather than in that stage)."""
        if not self.args.sparse_cache:
            return None
        self._ensure_split()
        sizes = self.config.end_to_end.cache_sizes
        weight = self.args.sparse_cache_linear_weight
        if sizes is None:
            return SparseCache(size=self.args.sparse_cache, linear_weight=weight)
        return [SparseCache(size=row, linear_weight=weight) for row in sizes]

    def end_to_end(self, fitted: FittedFeatureMaps) -> tuple[FittedFeatureMaps, Any]:
        options = self.config.end_to_end
        if not options.steps:
            self._ensure_split()  # the measured row has the split the fit had
            return fitted, None
        return self._trained("end_to_end", fitted, options)

    def long_gaps(self, tuned: FittedFeatureMaps) -> FittedFeatureMaps:
        """With --end-to-end-long-steps: ``tuned`` trained on, on the samples' copies at --end-to-end-long-gap."""
        if self.long is None:
            return tuned
        return self._trained("long_gaps", tuned, self.long)[0]

    def _trained(self, name: str, fitted: FittedFeatureMaps, options: EndToEndOptions
                 ) -> tuple[FittedFeatureMaps, Any]:
        """The stage ``name`` (end_to_end or long_gaps): ``fitted`` and the gates trained end to end with
        ``options``, or read back when the stage finished before; and the LoRA adapters, if trained."""
        adapters_folder = self.stages.folder / "lora"
        if (done := self.stages.done(name)) is not None:
            self.stages.log(name, "skipped (finished before)")
            self.gates = load_stage_gates(self.stages.folder, done.get("gates"))
            self._split_cache(None)
            tuned = load_feature_maps(str(self.stages.folder / f"{name}.safetensors"))
            return tuned, self._adapters(adapters_folder) if options.lora_rank else None
        self._starting(name)
        begin = time.perf_counter()
        plain = self._samples()
        self._split_cache(plain)
        config = replace(self.config, end_to_end=replace(options, cache_sizes=self.config.end_to_end.cache_sizes))
        tuned, adapters, info = train_end_to_end(self.model, self.tokenizer, fitted, config, self.train, plain,
                                                 None, gates=self.gates,
                                                 student_options=attention_options(self.student))
        if adapters is not None:
            partial = self.stages.folder / f".lora.partial-{os.getpid()}"
            adapters.save(partial)
            shutil.rmtree(adapters_folder, ignore_errors=True)
            os.replace(partial, adapters_folder)
        self.stages.save_maps(tuned, name)
        info["gates"] = save_stage_gates(self.gates, self.stages.folder, name)
        what = (f"LoRA r={options.lora_rank} adapters (fine-tuned)" if adapters is not None
                else "the maps and gates" if self.gates is not None else "the maps")
        then = "then " if name == "long_gaps" else ""
        self.stages.finish(name, {
            "seconds": time.perf_counter() - begin, **info,
            "summary": f"{then}{what} trained end to end, {options.steps} steps on {len(plain)} samples of "
                       f"{options.tokens} tokens"
                       + (f" and the training text in {options.corpus_orders} orders" if options.corpus_orders else "")
                       + f" and their copying sequences (gaps of {options.copy_gap[0]:,}–{options.copy_gap[1]:,} "
                       "tokens"
                       + (f"), and {options.keys} key-retrieval sequences of the training text (fillers of "
                          f"{options.key_filler[0]:,}–{options.key_filler[1]:,} tokens" if options.keys else "")
                       + f"; best held-out KL {info['best_held_out_kl']:.3f})"})
        return tuned, adapters

    def _ensure_split(self) -> None:
        """With --sparse-cache-heads retrieval: the split read back, or decided on the sampled training texts."""
        if self.args.sparse_cache_heads != "retrieval":
            return
        if (self.stages.folder / "cache_sizes.json").is_file():
            self._split_cache(None)
            return
        self._split_cache(self._samples())

    def _samples(self) -> list[torch.Tensor]:
        """The sampled training texts: read from ``stages/samples.json`` when a run wrote it whole, else sampled
        into a temporary name that is then renamed (an interrupted run leaves no part of it under the name)."""
        options = self.config.end_to_end
        path = Path(str(options.texts))
        _drop_unreadable(path)
        if path.is_file():
            return training_sequences(self.model, self.tokenizer, self.train, options)[0]
        partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
        plain, _ = training_sequences(self.model, self.tokenizer, self.train, replace(options, texts=str(partial)))
        os.replace(partial, path)
        return plain

    def _split_cache(self, plain: list[torch.Tensor] | None) -> None:
        """With --sparse-cache-heads retrieval: the per-head sizes, scored once on the first training samples
        under softmax and kept in ``stages/cache_sizes.json`` (read back on a rerun), put into the config."""
        args = self.args
        if args.sparse_cache_heads != "retrieval":
            return
        path = self.stages.folder / "cache_sizes.json"
        if path.is_file():
            sizes = json.loads(path.read_text(encoding="utf-8"))["sizes"]
        else:
            if plain is None:
                raise LinearAttentionError(f"--out: {args.out!r} has a finished end-to-end stage but no "
                                           "stages/cache_sizes.json; pass another --out to run it again")
            floor = _cache_floor(args)
            scored = plain[: max(1, min(RETRIEVAL_SEQUENCES, len(plain) - HELD_OUT_SAMPLES))]
            top = self._top()
            try:
                caches, scores = cache_split(self.model, scored, window=args.window, sinks=args.sinks,
                                             mean=args.sparse_cache, floor=floor, top=top)
            except LinearAttentionError as error:
                raise LinearAttentionError(f"--sparse-cache-heads retrieval: {error} (--end-to-end-tokens ≥ "
                                           f"{15 * args.window} lets every sample serve)") from error
            sizes = [list(cache.size) for cache in caches]  # type: ignore[arg-type]  # split gives tuples
            atomic_write(path, json.dumps({"mean": args.sparse_cache, "floor": floor, "top": top,
                                           "sizes": sizes,
                                           "scores": scores.tolist()}))
            self.stages.log("end_to_end", "cache split by retrieval score",
                            largest=max(max(row) for row in sizes), floor=floor)
        cache_sizes = tuple(tuple(int(x) for x in row) for row in sizes)
        self.config = replace(self.config, end_to_end=replace(self.config.end_to_end, cache_sizes=cache_sizes))

    def _adapters(self, folder: Path) -> Any:
        from ..train.lora import load_lora

        lora = load_lora(self.model, folder)
        lora.remove()  # attached for the linearized row only
        return lora

    def measure(self, tuned: FittedFeatureMaps, adapters: Any) -> dict[str, Any]:
        if self.stages.done("measure") is not None:
            self.stages.log("measure", "skipped (finished before)")
            return dict(json.loads((self.folder / "results.json").read_text(encoding="utf-8")))
        self._starting("measure")
        begin = time.perf_counter()
        args, model = self.args, self.model
        rows = []
        positions = min(2048, getattr(model.config, "max_position_embeddings", None) or 2048)
        cache = {**self.config.end_to_end.cache_options, **attention_options(self.student)}
        wide = args.window + args.sparse_cache  # the softmax window of equal memory: W + λ keys
        label = f"window {wide} + {args.sinks} sinks (softmax)"
        switches: list[tuple[str, Any]] = [("original (softmax)", lambda: model.set_attn_implementation("sdpa")),
                                           (label, lambda: use_window_softmax(model, wide, args.sinks))]
        if args.sparse_cache:  # the same student with the cache's pairs in its window instead (equal memory)
            switches.append((f"{WIDER_ROW}, window {wide} + {args.sinks} sinks, no cache",
                             lambda: hf.linearize(model, tuned, gates=self.gates, window=wide,
                                                  **attention_options(self.student))))
        switches.append(("linearized", lambda: hf.linearize(model, tuned, gates=self.gates, **cache)))
        # rows measured before an interruption of this stage, and --init-from's rows of the original and the
        # softmax window, where every input they depend on is the same: taken as they are
        digest = _RowInputs(model, self.heldout, self.probe_text, self.config.probes,
                            getattr(args, "repeat_gaps", []), positions)
        student = _student_digest(tuned, self.gates, adapters)
        taken = _measured_rows(self.folder, self.source, baselines=[name for name, _ in switches[:2]])
        here = str(self.folder.resolve())
        linearized_now = False
        for name, switch in switches:
            of_student = name == "linearized" or name.startswith(WIDER_ROW)
            inputs = digest(name, student if of_student else "")
            if (row := taken.get((name, inputs))) is not None:
                rows.append(row)
                if not args.quiet:
                    print(f"{name}: taken from {row.get('measured_in', 'this run')} (the same inputs)", flush=True)
                continue
            switch()
            if adapters is not None and of_student:
                adapters.attach()
            linearized_now = name == "linearized"
            row = {"name": name, **score_model(model, self.tokenizer, self.heldout, self.config.probes),
                   "by_position": perplexity_by_position(model, self.tokenizer, self.heldout, positions),
                   "repeat_by_gap": repeats_by_gap(model, self.tokenizer, self.probe_text,
                                                   getattr(args, "repeat_gaps", []),
                                                   passage_tokens=self.config.probes.passage_tokens,
                                                   trials=self.config.probes.repeat_trials),
                   "inputs": inputs, "measured_in": here}  # its tokens/s: of this run
            rows.append(row)
            atomic_write(self.folder / "stages" / MEASURED_ROWS, json.dumps(rows))
            if not args.quiet:
                print(f"{name}: perplexity {row['perplexity']:.2f}, repeated passage {row['repeat_perplexity']:.2f}",
                      flush=True)
        if not linearized_now:  # its row was taken: the model is saved as it measured
            switches[-1][1]()
            if adapters is not None:
                adapters.attach()
        stages = {name: info for name in STAGES[:-1] if (info := self.stages.done(name)) is not None}
        probes = self.config.probes
        result = {"model": self.name, "base": args.model, "student": self.student.name,
                  "student_summary": self.student.summary, "window": args.window,
                  "probe_source": f"`{args.probe_text}`" if getattr(args, "probe_text", None) else PROBE_SOURCE,
                  "sinks": args.sinks,
                  "sparse_cache": args.sparse_cache, "sparse_cache_heads": args.sparse_cache_heads,
                  "sparse_cache_top": getattr(args, "sparse_cache_top", None),
                  "sparse_cache_linear_weight": args.sparse_cache_linear_weight,
                  "heldout_source": f"`{args.heldout}`" if args.heldout else "the shipped corpus's held-out text",
                  "passage_tokens": probes.passage_tokens, "gap_tokens": probes.gap_tokens,
                  "repeat_trials": probes.repeat_trials, "passkey_trials": probes.passkey_trials,
                  "threads": torch.get_num_threads(), "rows": rows, "stages": stages,
                  "rows_taken": {row["name"]: row["measured_in"] for row in rows
                                 if row.get("measured_in") != here},
                  "fine_tuned": adapters is not None}
        save_linearized(model, self.folder, maps=tuned, options=cache, base=args.model, adapters=adapters,
                        results=result, gates=self.gates)
        write_card(result, str(self.folder))
        self.stages.finish("measure", {"seconds": time.perf_counter() - begin})
        return result


def _source_run(args: argparse.Namespace) -> Path:
    """--init-from's run folder, checked: a finished end-to-end or long_gaps stage (a run that continued another
    with --end-to-end-steps 0 has the second alone), made with this run's student and exact part."""
    source = Path(args.init_from)
    stages, plan = source / "stages", source / "stages" / "plan.json"
    trained = any((stages / f"{name}.done").is_file() for name in ("end_to_end", "long_gaps"))
    if not (trained and plan.is_file()):
        raise LinearAttentionError(f"--init-from: {args.init_from!r} holds no finished end-to-end or long_gaps stage "
                                   "(stages/end_to_end.done, stages/long_gaps.done); pass the --out of a linearize "
                                   "run that trained end to end")
    if source.resolve() == Path(args.out).resolve():
        raise LinearAttentionError("--init-from: the run's own --out; pass another folder to --out")
    earlier = {**_EARLIER_DEFAULTS, **json.loads(plan.read_text("utf-8"))["options"]}
    differ = sorted(name for name in _SHARED if earlier.get(name) != getattr(args, name))
    if differ:
        raise LinearAttentionError(f"--init-from: {args.init_from!r} was made with other {', '.join(differ)}; give "
                                   "this run the same (its student, exact part and samples are taken as they are)")
    return source


# the measuring stage's rows so far (stages/): a rerun after an interruption measures only the others
MEASURED_ROWS = "measure_rows.json"


class _RowInputs:
    """A digest of what a measured row depends on: its name (the window row's names its window and sinks), the
    base model's fingerprint, the held-out and probe texts, the probes' options, the repeats' gaps, the positions
    scored, and for the student's rows a digest of the student (:func:`_student_digest`)."""

    def __init__(self, model: Any, heldout: str, probe_text: str, probes: Any, gaps: Any, positions: int) -> None:
        self.common = json.dumps([fingerprint(model), heldout, probe_text, asdict(probes), list(gaps or []),
                                  positions], default=str)

    def __call__(self, name: str, student: str) -> str:
        return hashlib.sha256(json.dumps([name, student, self.common]).encode()).hexdigest()


def _student_digest(tuned: FittedFeatureMaps, gates: list[Any] | None, adapters: Any) -> str:
    """A digest of every tensor of the student: its maps, its gates and its adapters."""
    digest = hashlib.sha256()
    tensors = [tensor for module in [*tuned.maps, *(gates or [])] for _, tensor in sorted(module.state_dict().items())]
    tensors += [*(tuned.window_factors or []), *(adapters.parameters() if adapters is not None else [])]
    for tensor in tensors:
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().to(torch.float64).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _measured_rows(folder: Path, source: Path | None, baselines: list[str]) -> dict[tuple[str, str], Any]:
    """(name, inputs) → row: this run's rows measured so far, and the ``baselines`` rows of --init-from's run
    (its results, or its rows so far); a row from before rows carried their inputs is never taken."""
    taken: dict[tuple[str, str], Any] = {}

    def read(path: Path) -> list[Any]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        rows = data.get("rows", []) if isinstance(data, dict) else data
        return [row for row in rows if isinstance(row, dict) and isinstance(row.get("inputs"), str)]

    if source is not None:
        for path in (source / "stages" / MEASURED_ROWS, source / "results.json"):
            for row in read(path):
                if row.get("name") in baselines:
                    taken[(row["name"], row["inputs"])] = row
    for row in read(folder / "stages" / MEASURED_ROWS):
        taken[(row["name"], row["inputs"])] = row
    return taken


def _key_seed(source: Path | None) -> int:
    """The draw of this run's key-retrieval sequences: 0, or with --init-from the one after the source's where the
    source trained on keys (a plan from before the draw was kept drew 0), so that a continued run learns from new
    sequences, not the same ones again."""
    if source is None:
        return 0
    plan = json.loads((source / "stages" / "plan.json").read_text("utf-8"))
    return int(plan.get("key_seed", 0)) + (1 if plan["options"].get("end_to_end_keys") else 0)


def _cache_floor(args: argparse.Namespace) -> int:
    return args.sparse_cache // 2 if args.sparse_cache_floor is None else int(args.sparse_cache_floor)


def _check_cache_heads(args: argparse.Namespace) -> None:
    if args.sparse_cache_heads == "uniform":
        for option in ("floor", "top"):
            if getattr(args, f"sparse_cache_{option}", None) is not None:
                raise LinearAttentionError(f"--sparse-cache-{option}: only with --sparse-cache-heads retrieval")
        return
    if args.sparse_cache < 1:
        raise LinearAttentionError("--sparse-cache-heads retrieval: needs --sparse-cache N ≥ 1 (the mean per head)")
    if not 0 <= _cache_floor(args) <= args.sparse_cache:
        raise LinearAttentionError(f"--sparse-cache-floor: need 0 ≤ floor ≤ --sparse-cache ({args.sparse_cache}), "
                                   f"got {args.sparse_cache_floor}")
    top = getattr(args, "sparse_cache_top", None)
    if top is not None and top < 1:
        raise LinearAttentionError(f"--sparse-cache-top: need K ≥ 1 heads, got {top}")


def _update(bar: Any) -> None:
    if bar is not None:
        bar.update(1)


def _drop_unreadable(path: Path) -> None:
    """Remove a samples file that an interrupted run left half-written (it is made again)."""
    if path.is_file():
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            path.unlink()


def cli(args: argparse.Namespace) -> int:
    """``linattn linearize`` (options: :func:`linattn.linearized.arguments.add_linearize_arguments`)."""
    result = Job(args).run()
    if not args.quiet:
        print(f"wrote {args.out} (linattn.json, maps.safetensors, results.json, README.md): "
              f"{result['rows'][-1]['name']} perplexity {result['rows'][-1]['perplexity']:.2f}")
    return 0
