"""The step counts of ``linattn linearize --budget MINUTES``: a few steps of each stage timed, then the counts
that fit.

The fit's cost is measured as one capture, then fits of 1 and 9 steps on it (the difference is eight steps; the
student's own fit: Hedgehog maps on attention weights, or a delta-rule student layer by layer with its gates), an
end-to-end step as one softmax forward pass and one forward and backward pass of the student (its maps and gates
alone taking gradients, as in training; the faster of two passes) on a sequence as long as the mean of the stage's
(a sample and its copying sequence, 2P + G tokens long: 672 on average with the default gaps; the long_gaps
stage's key-retrieval sequences, ``--end-to-end-keys``, are not counted: with the default fillers they are
shorter than its mean, so its steps cost at most what is planned), and the measuring
stage from one forward pass over 256 tokens of the original and one of the linearized model (every row reads about
the same number of tokens; the softmax window's row is counted as the original's, and with a cache the row of the
same student with a wider window instead as the linearized model's). With ``--sparse-cache`` the fit, the
end-to-end step and the linearized forward pass run with the cache in place, so its decisions and its exact term
are counted: N pairs for every head, or with ``--sparse-cache-heads retrieval`` a split made on the training text
(the run's own split, decided later on its samples, gives its heads other budgets; a layer's largest budget sets
the training form's slots, so a split costs more than a uniform cache of as many pairs).

Sampling is timed as 8 tokens generated for one batch of short prompts into a cache as long as a whole sample
(:func:`~linattn.train.end_to_end.sample_texts` allocates it once, and every step attends over all of it, so a
step costs the same at any position).

What remains of 88 % of the budget (a shared machine's load changes during a run) after the fixed costs goes 40 % to
fitting steps, but no more than ``--fit-steps`` of them, and the rest to end-to-end steps: the end-to-end stage is
where a student learns to recall, and on SmolLM2 a fit of 1,332 steps left its held-out KL still falling fast
after 22 end-to-end steps, where the shipped folder had 48 fitting and 180 end-to-end steps. Without an end-to-end
stage, everything goes to the fit. With a long_gaps stage (``--end-to-end-long-steps``), 60 % of the end-to-end
time goes to it, at its own step's cost. The number of samples is the least (in whole batches, up to
``--end-to-end-samples``) that gives the end-to-end steps one training sequence each, counting the training text's
own sequences (``--end-to-end-corpus-orders``) among them (and the long_gaps steps one each of the samples' own):
a sample the steps never reach costs its sampling and
buys nothing, and its time goes to steps instead. A budget that leaves fewer than :data:`MIN_FIT_STEPS` /
:data:`MIN_END_TO_END_STEPS` is refused, naming the least that would do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import hf
from ..errors import LinearAttentionError
from ..evaluate.capture import capture_attention
from ..evaluate.lm_config import HELD_OUT_SAMPLES, LMCompareConfig
from ..evaluate.lm_stages import PROMPT_TOKENS
from ..state import SparseCache
from ..train.distill import fit_model_feature_maps
from ..train.end_to_end import mean_copy_length
from ..train.student import fit_student
from .students import STUDENT_LR, STUDENTS, Student, attention_options, new_student

MIN_FIT_STEPS, MIN_END_TO_END_STEPS = 10, 5
MAX_STEPS = 2000  # a large budget on a small model: beyond this, more steps are not what is missing
FIT_SHARE = 0.4
# fit_end_to_end scores 2 held-out sequences every 5 steps (~30 % more forward passes), but the step timed here
# (the faster of two passes on one sequence of the mean length) already costs more than a training step does: on
# SmolLM2 (--budget 90, 2 threads) calibration timed 15.6 s, and the 69 steps took 14.75 s each with their scoring
EVAL_OVERHEAD = 1.0
SAMPLING_BATCH = 8  # sample_texts' batch
SAMPLING_PROMPT = 16  # tokens of the short prompts sampling is timed after
FIT_PROBE_STEPS = 8  # fitting steps timed (beyond a first one)
# the share of the budget planned: the machine's load varies while the run goes on; on SmolLM2 (--budget 90,
# 2 threads, alone) the whole run took 1.04x its plan, and at 0.8 a sixth of the budget went unused
SAFETY = 0.88
# the long_gaps stage's share of the end-to-end time: the passage 3,072 tokens back follows its steps (29 long
# steps after 49 end-to-end ones read it at 7.68, 40 after 69 at 5.79: docs/linearize.md)
LONG_SHARE = 0.6


def _timed(action: Any, repeats: int = 1) -> tuple[float, Any]:
    """The shortest of ``repeats`` runs of ``action`` (the first run of a path pays its one-time set-up)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        begin = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - begin)
    return best, result


def _probe_tokens(config: LMCompareConfig, heldout_tokens: int, repeat_gaps: tuple[int, ...] = ()) -> int:
    """Tokens one measured row reads: the held-out text, the repeated passages (at the probe's gap and at each of
    ``repeat_gaps``), the passkeys."""
    probes = config.probes
    repeats = probes.repeat_trials * sum(2 * probes.passage_tokens + gap for gap in (probes.gap_tokens,
                                                                                    *repeat_gaps))
    keys = probes.passkey_trials * sum(length + 64 for length in probes.passkey_lengths)
    return heldout_tokens + repeats + keys


def calibration_cache(config: LMCompareConfig, split: list[Any] | None = None) -> Any:
    """The sparse cache the stages are timed with: ``split`` when given (one cache per layer: a split across heads
    like the one the run decides later on its samples, whose layers' largest budgets set the training form's
    slots), else ``--sparse-cache`` N pairs for every head, with its linear weight; None without one."""
    options = config.end_to_end
    if not options.sparse_cache:
        return None
    if split is not None:
        return split
    return SparseCache(size=options.sparse_cache, linear_weight=options.cache_linear_weight)


def _fitter(model: Any, name: str, capture: Any, config: LMCompareConfig, chosen: Student, cache: Any
            ) -> Callable[[int], tuple[Any, list[Any] | None]]:
    """``steps ↦ (maps, gates)``: the fit stage of ``chosen`` on ``capture`` (new parameters at every call), with
    the sparse cache ``cache`` (or None) in place."""
    fit = config.fit
    if not chosen.delta:
        options: dict[str, Any] = {"progress": False, "window": config.window, "sinks": config.sinks}
        if fit.num_features is not None:
            options["num_features"] = fit.num_features
        if cache is not None:
            options["sparse_cache"] = cache
        return lambda steps: (fit_model_feature_maps(capture, kind="hedgehog", steps=steps, **options), None)
    layer_options = {"window": config.window, "sinks": config.sinks, **attention_options(chosen)}

    def delta(steps: int) -> tuple[Any, list[Any] | None]:
        maps, gates = new_student(model, name, chosen, fit.num_features, config.window, config.sinks)
        fit_student(capture, maps.maps, gates, layer_options, steps=steps, lr=STUDENT_LR, sparse_cache=cache)
        return maps, gates

    return delta


def calibrate(model: Any, tokenizer: Any, name: str, train: str, heldout: str,
              config: LMCompareConfig, chosen: Student | None = None, repeat_gaps: tuple[int, ...] = (),
              split: list[Any] | None = None, long_gap: tuple[int, int] | None = None) -> dict[str, float]:
    """Seconds: ``fit_fixed`` (capture), ``fit_step``, ``end_to_end_step``, ``sampling_batch`` (one batch of
    :data:`SAMPLING_BATCH` samples), ``measure`` (the rows), and ``calibration`` (what measuring these took);
    with ``long_gap`` (the long_gaps stage's copying gaps), ``long_step`` too: a step of that stage, timed as the
    end-to-end step is at the mean length of its sequences (a sample, a copy with the longer gap);
    for the student ``chosen`` (default: the Hedgehog hybrid): its own fit and its own end-to-end step; with the
    cache ``split`` (one per layer) in place when given, else ``--sparse-cache``'s uniform one
    (:func:`calibration_cache`)."""
    begin = time.perf_counter()
    chosen = chosen or STUDENTS["hedgehog"]
    cache = calibration_cache(config, split)
    fit = config.fit
    model.set_attn_implementation("sdpa")
    capture_seconds, capture = _timed(lambda: capture_attention(model, tokenizer, train, max_tokens=fit.max_tokens,
                                                                model_name=name, orders=fit.orders))
    fitter = _fitter(model, name, capture, config, chosen, cache)
    # on one capture, so that the difference is the steps alone (a capture's own time varies more than a step);
    # the shorter fit twice, the faster kept: a first call can pay one-time set-up, and on SmolLM2 (2026-12-06) one
    # 1-step fit took longer than the 9-step fit after it, which left the fitting step's estimate at nothing
    short, _ = _timed(lambda: fitter(1), repeats=2)
    long, (maps, gates) = _timed(lambda: fitter(1 + FIT_PROBE_STEPS))
    fit_step = max((long - short) / FIT_PROBE_STEPS, 1e-4)
    limit = getattr(model.config, "max_position_embeddings", None) or 4096
    length = min(config.end_to_end.tokens + PROMPT_TOKENS, limit)
    # a step's sequence is a sample (or the training text) or its copying sequence, as many of each: timed at
    # their mean length (a step's cost grows with its tokens; a copy can be longer than a sample)
    step = round((length + min(mean_copy_length(config.end_to_end.copy_gap), limit)) / 2)
    step = step if config.end_to_end.copies else length
    lengths = {"end_to_end_step": step}
    if long_gap is not None:
        lengths["long_step"] = round((length + min(mean_copy_length(long_gap), limit)) / 2)
    ids = torch.randint(0, int(model.config.vocab_size), (1, max(length, *lengths.values())))
    model.set_attn_implementation("sdpa")
    teacher = {}
    with torch.no_grad():
        for key, tokens in lengths.items():
            teacher[key], _ = _timed(lambda tokens=tokens: model(input_ids=ids[:, :tokens]), repeats=2)
    placed = config.end_to_end.cache_options if split is None else {"sparse_cache": split}
    hf.linearize(model, maps, gates=gates, **placed, **attention_options(chosen))
    flags = [(param, param.requires_grad) for param in model.parameters()]
    for param, _ in flags:  # as in fit_end_to_end: the model's own weights frozen, gradients for the maps only
        param.requires_grad_(False)
    for module in [*maps.maps, *(gates or [])]:  # and the gates
        module.requires_grad_(True)
    steps = {}
    try:  # twice: a first backward pass pays one-time set-up (SmolLM2, 1,552 tokens: 13.3 s, then 11.4 s)
        for key, tokens in lengths.items():
            student, _ = _timed(lambda tokens=tokens: model(input_ids=ids[:, :tokens]).logits.float().logsumexp(-1)
                                .mean().backward(), repeats=2)
            steps[key] = (teacher[key] + student) * EVAL_OVERHEAD
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)
        model.zero_grad(set_to_none=True)
    with torch.no_grad():  # the linearized row as it is measured (with the cache, when there is one)
        linear, _ = _timed(lambda: model(input_ids=ids[:, :256]), repeats=2)
    model.set_attn_implementation("sdpa")
    batch = min(SAMPLING_BATCH, config.end_to_end.samples)
    prompt = torch.randint(0, int(model.config.vocab_size), (batch, SAMPLING_PROMPT))
    with torch.no_grad():  # as sample_texts generates: a static cache, here as long as a whole sample's
        eight, _ = _timed(lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                                 min_new_tokens=8, do_sample=False, pad_token_id=0,
                                                 cache_implementation="static",
                                                 max_cache_len=SAMPLING_PROMPT + config.end_to_end.tokens))
    with torch.no_grad():
        forward, _ = _timed(lambda: model(input_ids=ids[:, :256]), repeats=2)
    heldout_tokens = len(tokenizer(heldout)["input_ids"])
    # the original and the softmax window (timed as the original), the linearized model, and with a cache the same
    # student with the cache's pairs in its window instead (timed as the linearized model)
    rows = 2 * forward + (2 if config.end_to_end.sparse_cache else 1) * linear
    measure = rows / min(256, length) * _probe_tokens(config, heldout_tokens, repeat_gaps)
    return {"fit_fixed": capture_seconds + max(short - fit_step, 0.0), "fit_step": fit_step, **steps,
            "sampling_batch": eight / 8 * config.end_to_end.tokens, "measure": measure,
            "calibration": time.perf_counter() - begin}


def training_sequences_of(samples: int, corpus: int = 0) -> int:
    """End-to-end training sequences from ``samples`` samples: the samples and their copying sequences, less the
    held-out ones (:func:`~.lm_stages.training_set`), and ``corpus`` sequences of the training text (its orders
    and their copying sequences)."""
    return 2 * (samples - HELD_OUT_SAMPLES) + corpus


def _sample_counts(most: int) -> list[int]:
    """Sample counts worth planning, fewest first: whole batches, up to ``most``."""
    counts = [min(batch * SAMPLING_BATCH, most) for batch in range(1, math.ceil(most / SAMPLING_BATCH) + 1)]
    return [count for count in counts if count > HELD_OUT_SAMPLES]


def _steps(budget_minutes: float, costs: dict[str, float], end_to_end: bool, samples: int, most_fit: int,
           long: bool = False) -> tuple[float, float, int, int, int]:
    """The fixed seconds, the sampling's share of them, and the fitting, end-to-end and long_gaps steps that fit,
    with ``samples`` samples and at most ``most_fit`` fitting steps when an end-to-end stage follows; with
    ``long``, the long_gaps stage gets :data:`LONG_SHARE` of the end-to-end time."""
    sampling = costs["sampling_batch"] * math.ceil(samples / SAMPLING_BATCH) if end_to_end else 0.0
    fixed = costs["calibration"] + costs["fit_fixed"] + costs["measure"] + sampling
    left = budget_minutes * 60 * SAFETY - fixed
    if left <= 0:
        return fixed, sampling, 0, 0, 0
    if not end_to_end:
        return fixed, sampling, min(int(left / costs["fit_step"]), MAX_STEPS), 0, 0
    fit_steps = min(int(left * FIT_SHARE / costs["fit_step"]), most_fit, MAX_STEPS)
    training = left - fit_steps * costs["fit_step"]
    share = LONG_SHARE if long else 0.0
    e2e_steps = min(int(training * (1 - share) / costs["end_to_end_step"]), MAX_STEPS)
    long_steps = min(int(training * share / costs["long_step"]), MAX_STEPS) if long else 0
    return fixed, sampling, fit_steps, e2e_steps, long_steps


def plan_steps(budget_minutes: float, costs: dict[str, float], end_to_end: bool, samples: int = 32, *,
               most_fit: int = MAX_STEPS, corpus: int = 0, sample_first: bool = False, long: bool = False
               ) -> dict[str, Any]:
    """Fit and end-to-end step counts and the number of samples (at most ``samples``) that fit ``budget_minutes``
    given ``costs`` (:func:`calibrate`), and the estimated seconds of each stage; refuses a budget too small for
    the least useful run. With an end-to-end stage, the fit gets 40 % of the training time but at most
    ``most_fit`` steps (``--fit-steps``), and the end-to-end stage the rest; ``corpus`` training sequences come
    from the training text (no sampling needed for them). ``sample_first``: the sampling is counted in the fit's
    estimate (it runs there when a split across heads is decided on the samples before the fit). ``long``: a
    long_gaps stage follows the end-to-end stage, with :data:`LONG_SHARE` of its time (``costs["long_step"]``), on
    the samples' copies alone."""
    counts = _sample_counts(samples) if end_to_end else [0]
    if not counts:
        raise LinearAttentionError(f"--end-to-end-samples: need more than {HELD_OUT_SAMPLES}, got {samples}")
    if most_fit < MIN_FIT_STEPS:
        raise LinearAttentionError(f"--fit-steps: with --budget, need at least {MIN_FIT_STEPS}, got {most_fit}")
    long = long and end_to_end
    plans = [(count, _steps(budget_minutes, costs, end_to_end, count, most_fit, long)) for count in counts]
    # the fewest samples that give every end-to-end step its own sequence (the long_gaps stage's, of the samples
    # alone), else as many as allowed
    chosen, (fixed, sampling, fit_steps, e2e_steps, long_steps) = next(
        (plan for plan in plans if training_sequences_of(plan[0], corpus) >= plan[1][3]
         and training_sequences_of(plan[0]) >= plan[1][4]), plans[-1])
    share = FIT_SHARE if end_to_end else 1.0
    if (fit_steps < MIN_FIT_STEPS or (end_to_end and e2e_steps < MIN_END_TO_END_STEPS)
            or (long and long_steps < MIN_END_TO_END_STEPS)):
        least = fixed + MIN_FIT_STEPS * costs["fit_step"] / share
        if end_to_end:
            part = 1 - LONG_SHARE if long else 1.0
            least = max(least, fixed + MIN_END_TO_END_STEPS * costs["end_to_end_step"] / (1 - share) / part)
        if long:
            least = max(least, fixed + MIN_END_TO_END_STEPS * costs["long_step"] / (1 - share) / LONG_SHARE)
        longs = (f", {max(long_steps, 0)} long_gaps steps ({costs['long_step']:.2f} s each)" if long else "")
        raise LinearAttentionError(
            f"--budget: {budget_minutes:g} min leave room for {max(fit_steps, 0)} fitting and {max(e2e_steps, 0)} "
            f"end-to-end steps{longs} here (fixed costs {fixed / 60:.1f} min: capture, sampling, measuring; a fitting "
            f"step {costs['fit_step']:.2f} s, an end-to-end step {costs['end_to_end_step']:.2f} s); at least "
            f"{MIN_FIT_STEPS} and {MIN_END_TO_END_STEPS} of each are needed: pass --budget "
            f"{math.ceil(least / SAFETY / 60)} or more"
            + ("" if not long else ", or --end-to-end-long-steps 0 to skip the long_gaps stage")
            + ("" if not end_to_end else ", or --end-to-end-steps 0 to skip the end-to-end stage")
        )
    # with a split decided on the samples (--sparse-cache-heads retrieval), the fit stage samples them first
    first = sampling if sample_first else 0.0
    estimates = {"fit": first + costs["fit_fixed"] + fit_steps * costs["fit_step"],
                 "end_to_end": (sampling - first + e2e_steps * costs["end_to_end_step"]) if end_to_end else 0.0,
                 **({"long_gaps": long_steps * costs["long_step"]} if long else {}),
                 "measure": costs["measure"]}
    return {"fit_steps": fit_steps, "end_to_end_steps": e2e_steps, "end_to_end_long_steps": long_steps,
            "end_to_end_samples": chosen, "estimates": estimates, "costs": costs}
