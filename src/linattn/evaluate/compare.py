"""``linattn compare``: every registered feature map measured against softmax attention on a real model.

1. Capture q, k, v of every layer and head of the model on the train text and on the held-out text.
2. For each map in ``feature_maps.available()``: learned maps are fitted on the train capture
   (:func:`linattn.train.distill.fit_feature_map`, one parameter set per layer and head); random maps are measured at
   several feature counts m (the mean over ``seeds`` draws); every other map is created with
   ``create(name, head_dim=d)``. All are measured on the held-out capture (:func:`capture_metrics`).
3. Time per token of a forward pass at a long N (random inputs, the model's head count and head dimension).
4. Print the table as rows finish (signed maps apart, after it: :data:`~linattn.evaluate.report.SIGNED_NOTE`);
   write ``report.md``, ``results.json`` and PNG plots to the output folder.
"""

from __future__ import annotations

import os
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import feature_maps
from ..data import load_text, paragraphs
from ..errors import LinearAttentionError
from ..feature_maps import FeatureMap
from ..feature_maps.fitted import FittedFeatureMaps
from ..features import is_signed
from ..functional import linear_attention
from ..train.distill import fit_feature_map
from .capture import AttentionCapture, capture_attention, load_model
from .metrics import capture_metrics, capture_references
from .report import SIGNED_NOTE, number, write_report

SWEEP_FEATURES = (16, 64, 256)


@dataclass
class Row:
    """One measured configuration: a map at one feature dimension (random maps: mean over seeds)."""

    name: str
    feature_dim: int
    rel_error: float
    rel_error_total: float
    kl: float
    entropy_linear: float
    us_per_token: float
    num_features: int | None = None
    default: bool = True
    note: str = ""
    seeds: int = 1
    window: int | None = None
    sinks: int = 0
    signed: bool = False  # φ(q)·φ(k) can be negative: its error is not comparable (report.SIGNED_NOTE)


@dataclass
class CompareResult:
    """What the encoder comparison measured: the model's shape, the texts' sizes, the softmax reference and the
    rows (written as results.json by :func:`~linattn.evaluate.report.write_report`)."""

    model_name: str
    layers: int
    heads: int
    head_dim: int
    causal: bool
    train_tokens: int
    heldout_tokens: int
    softmax_entropy: float
    softmax_us_per_token: float
    long_n: int
    threads: int
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    fit_orders: int = 1


class _Uniform(FeatureMap):
    """φ(x) = 1: every key gets the same weight — plain averaging, the "no attention" baseline."""

    def output_dim(self, head_dim: int) -> int:
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)


def time_per_token(fmap: Any, heads: int, head_dim: int, n: int, causal: bool, repeats: int = 5,
                   options: dict[str, Any] | None = None) -> float:
    """Median µs per token of a forward pass (B=1, H heads, N=n), one warm-up excluded; map None = softmax SDPA."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, heads, n, head_dim, generator=generator).unbind(0)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            if fmap is None:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                linear_attention(q, k, v, feature_map=fmap, causal=causal, **_signed_options(fmap), **(options or {}))
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / n * 1e6


def _signed_options(fmap: Any) -> dict[str, Any]:
    return {"min_denom": 1e-6} if is_signed(fmap) else {}


def _split_text(text: str) -> tuple[str, str]:
    """First half of the paragraphs for fitting, second half held out."""
    parts = paragraphs(text)
    if len(parts) < 2:
        raise LinearAttentionError("text: need at least two paragraphs (blank-line separated) to split into "
                                   "train and held-out parts; or pass --heldout")
    half = len(parts) // 2
    return "\n\n".join(parts[:half]), "\n\n".join(parts[half:])


def run_compare(
    *,
    model: str | None = None,
    text: str | None = None,
    heldout: str | None = None,
    out_dir: str = "out/compare",
    maps: list[str] | None = None,
    sweep: tuple[int, ...] = SWEEP_FEATURES,
    seeds: int = 2,
    fit_options: dict[str, Any] | None = None,
    long_n: int = 4096,
    progress: bool = True,
    max_tokens: int = 384,
    fit_max_tokens: int | None = None,
    fit_orders: int = 4,
    save_maps: str | None = None,
    window: int | None = None,
    sinks: int = 0,
) -> CompareResult:
    """Measure every registered map (or ``maps``) and write the report; see the module docstring.

    ``text``/``heldout`` are file paths; with ``text`` alone its paragraphs are split in half; with neither, the
    shipped corpus (:mod:`linattn.data`) is used. Held-out text is measured in pieces of ≤ ``max_tokens`` tokens;
    train text is captured in pieces of ≤ ``fit_max_tokens`` (None: the model's limit), in ``fit_orders``
    paragraph orders (:func:`~linattn.evaluate.capture_attention`'s ``orders``). ``save_maps``: a folder
    where each learned kind's fitted maps are written (``{kind}.safetensors``, loadable with
    :func:`linattn.feature_maps.fitted.load_feature_maps`). ``window``, ``sinks``: also measure the sliding-window
    hybrid (:func:`_hybrid_rows`): the window alone, elu and each learned map (as fitted above) with the window,
    and each learned map fitted with the window in place, in both scale forms.
    """
    began = time.perf_counter()
    say = print if progress else (lambda *args, **kwargs: None)
    if text is None:
        train_text, heldout_text = load_text("train"), load_text("heldout")
    else:
        with open(text, encoding="utf-8") as handle:
            train_text = handle.read()
        if heldout is None:
            train_text, heldout_text = _split_text(train_text)
        else:
            with open(heldout, encoding="utf-8") as handle:
                heldout_text = handle.read()
    names = maps if maps is not None else feature_maps.available()
    unknown = [name for name in names if name not in feature_maps.available()]
    if unknown:
        raise LinearAttentionError(f"maps: unknown {unknown}; known maps are {feature_maps.available()}")

    say("loading the model and capturing q, k, v ...", flush=True)
    net, tokenizer, model_name = load_model(model)
    # train text in sequences as long as the model takes, each query then seeing more keys, and in several
    # paragraph orders: maps fitted that way generalise better (docs/evaluation.md)
    train = capture_attention(net, tokenizer, train_text, max_tokens=fit_max_tokens, model_name=model_name,
                              orders=fit_orders)
    test = capture_attention(net, tokenizer, heldout_text, max_tokens=max_tokens, model_name=model_name)
    del net
    references = capture_references(test)
    heads, dim = test.num_heads, test.head_dim
    result = CompareResult(
        model_name=model_name, layers=test.num_layers, heads=heads, head_dim=dim, causal=test.causal,
        train_tokens=train.text_tokens, heldout_tokens=test.num_tokens, fit_orders=max(train.orders, default=0) + 1,
        softmax_entropy=float(references[0].entropy.mean()) if len(references) == 1 else float(
            sum(r.entropy.mean() * r.q.shape[-2] for r in references) / test.num_tokens),
        softmax_us_per_token=time_per_token(None, heads, dim, long_n, test.causal), long_n=long_n,
        threads=torch.get_num_threads(),
    )
    say(f"{model_name}: {test.num_layers} layers × {heads} heads, d={dim}, {'causal' if test.causal else 'non-causal'}"
        f"; fit on {train.text_tokens} tokens ({result.fit_orders} paragraph orders), measured on {test.num_tokens} "
        f"held-out tokens; {result.threads} threads", flush=True)
    say(f"{'map':<22}{'F':>6}{'rel.err':>9}{'KL':>8}{'entropy':>9}{'µs/token':>10}   (softmax: entropy "
        f"{result.softmax_entropy:.2f}, {result.softmax_us_per_token:.2f} µs/token at N={long_n})", flush=True)
    for line in ("F: features per key (a head's state is F × d numbers)",
                 "rel.err: ‖linear output − softmax output‖ / ‖softmax output‖, mean over heads (0: exact)",
                 "KL: from softmax's attention weights to the map's, mean over rows (0: the same weights)",
                 "entropy: of the map's attention weights, mean over rows (softmax's is above)",
                 f"µs/token: median time of one attention forward (all heads, random inputs, N={long_n}) per token"):
        say(f"  {line}", flush=True)

    def measure(name: str, fmap: Any, timing_map: Any, *, num_features: int | None = None, default: bool = True,
                note: str = "", seeds_used: int = 1, metrics: dict[str, Any] | None = None,
                hybrid: dict[str, Any] | None = None) -> None:
        if metrics is None:
            metrics = capture_metrics(test, fmap, references=references, window=hybrid)
        timing_options = None
        if hybrid:  # a per-head factor of another head count would not broadcast on the timing inputs
            timing_options = {**hybrid, "window_factor": 1.0 if hybrid.get("window_factor") is not None else None}
        row = Row(name, metrics["feature_dim"], metrics["rel_error"], metrics["rel_error_total"], metrics["kl"],
                  metrics["entropy_linear"],
                  time_per_token(timing_map, heads, dim, long_n, test.causal, options=timing_options),
                  num_features, default, note, seeds_used, (hybrid or {}).get("window"), (hybrid or {}).get("sinks", 0),
                  signed=is_signed(fmap))
        result.rows.append(row)
        if not row.signed:  # signed rows are printed apart at the end, with the reason
            say(_console_row(row), flush=True)

    measure("uniform (no attention)", _Uniform(), _Uniform())
    learned: dict[str, Any] = {}  # fitted maps by kind, for the hybrid rows
    for name in names:
        try:
            probe = feature_maps.create(name, head_dim=dim)
            if getattr(probe, "learned", False):
                options = {"progress": progress, **(fit_options or {})}
                qs, ks, vs = train.all_heads()  # (L·H, N, d) per sequence: one fit for every layer and head
                fitted = fit_feature_map(qs, ks, kind=name, v=vs, causal=train.causal, scale=train.scaling,
                                         **options)
                steps = fitted.fit_history[-1][0]  # type: ignore[index]
                timing = feature_maps.create(name, head_dim=dim, num_heads=heads,
                                             num_features=fitted.num_features)  # same cost, per-head parameters
                measure(name, fitted, timing, note=f"fitted, {steps} steps")
                learned[name] = (fitted, timing, options)
                if save_maps:
                    layers = [fitted.head_slice(i * heads, (i + 1) * heads) for i in range(train.num_layers)]
                    options_saved = {"num_features": fitted.num_features, "tied": fitted.tied}
                    os.makedirs(save_maps, exist_ok=True)
                    FittedFeatureMaps(model_name, name, train.num_layers, heads, dim, options_saved, layers).save(
                        os.path.join(save_maps, f"{name}.safetensors"))
            elif getattr(probe, "random", False):
                _sweep_random(name, probe, dim, sweep, seeds, test, references, measure)
            else:
                measure(name, probe, probe)
        except (LinearAttentionError, RuntimeError, TypeError, ValueError) as error:
            result.skipped[name] = str(error)
            say(f"{name:<22}skipped: {error}", flush=True)
    if window is not None:
        qs, ks, vs = train.all_heads()
        _hybrid_rows(measure, learned, dim, window, sinks,
                     lambda kind, **extra: fit_feature_map(qs, ks, kind=kind, v=vs, causal=train.causal,
                                                           scale=train.scaling, window=window, sinks=sinks, **extra))
    signed = [row for row in result.rows if row.signed]
    if signed:
        say("\n" + textwrap.fill(SIGNED_NOTE, 118), flush=True)
        for row in signed:
            say(_console_row(row), flush=True)
    result.seconds = time.perf_counter() - began
    written = write_report(result, out_dir)
    say(f"done in {result.seconds:.0f} s; wrote {', '.join(written)}", flush=True)
    return result


def _console_row(row: Row) -> str:
    label = row.name if row.default else f"{row.name} (m={row.num_features})"
    return (f"{label:<22}{row.feature_dim:>6}{number(row.rel_error):>9}{number(row.kl):>8}"
            f"{row.entropy_linear:>9.2f}{row.us_per_token:>10.2f}")


class _Zero(FeatureMap):
    """φ(x) = 0: no linear part at all — with ``window_factor=1`` the hybrid is the softmax window alone."""

    def output_dim(self, head_dim: int) -> int:
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)


def _hybrid_rows(measure: Any, learned: dict[str, Any], dim: int, window: int, sinks: int, fit: Any) -> None:
    """The sliding-window hybrid's rows: the window alone (no linear part), elu + window, each learned map fitted
    without the window then used with it, and fitted with it in place — mass-preserving and γ forms."""
    mass = {"window": window, "sinks": sinks, "window_factor": None}
    label = f"W={window}" + (f", S={sinks}" if sinks else "")
    measure(f"window alone ({label})", _Zero(), _Zero(), hybrid={**mass, "window_factor": 1.0},
            note="softmax over the window and sinks only")
    elu = feature_maps.create("elu", head_dim=dim)
    measure(f"elu + window ({label})", elu, elu, hybrid=mass, note="mass-preserving")
    for name, (fitted, timing, options) in learned.items():
        measure(f"{name} + window ({label})", fitted, timing, hybrid=mass,
                note="map fitted without the window; mass-preserving")
        for form, extra in (("mass-preserving", {}), ("γ per head", {"window_factor": True})):
            refit = fit(name, **options, **extra)
            steps = refit.fit_history[-1][0]
            hybrid = {**mass, "window_factor": refit.window_factor}
            measure(f"{name} fitted with window ({label})", refit, timing, hybrid=hybrid,
                    note=f"{form}, {steps} steps")


class PerHead(FeatureMap):
    """One map per head along dim −3 (e.g. an independent random draw per head): (..., H, N, d) → (..., H, N, F).

    The flags ``positive`` and ``log_space`` are those of the wrapped maps (all of one kind).
    """

    def __init__(self, maps: list[FeatureMap]) -> None:
        super().__init__()
        self.maps = torch.nn.ModuleList(maps)
        self.positive = bool(getattr(maps[0], "positive", True))  # type: ignore[misc]
        self.log_space = bool(getattr(maps[0], "log_space", False))  # type: ignore[misc]

    def output_dim(self, head_dim: int) -> int:
        return int(self.maps[0].output_dim(head_dim))  # type: ignore[operator]

    def features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        if x.dim() < 3 or x.shape[-3] != len(self.maps):
            raise LinearAttentionError(f"PerHead: {len(self.maps)} maps for input of shape {tuple(x.shape)}")
        return torch.stack([fmap.features(x[..., h, :, :], is_query=is_query)  # type: ignore[operator]
                            for h, fmap in enumerate(self.maps)], dim=-3)


def _sweep_random(name: str, probe: Any, dim: int, sweep: tuple[int, ...], seeds: int, test: AttentionCapture,
                  references: list[Any], measure: Any) -> None:
    """Measure a random map at its default size and at each m in ``sweep``: the mean of ``seeds`` runs, each with
    an independent draw per layer and head (so the mean reflects the map, not one draw's luck)."""
    default_m = getattr(probe, "num_features", None)
    sizes = sorted({*sweep, *([default_m] if isinstance(default_m, int) else [])})
    heads = test.num_layers * test.num_heads
    for m in sizes:
        try:
            runs = [PerHead([feature_maps.create(name, head_dim=dim, num_features=m, seed=1000 * s + h)
                             for h in range(heads)]) for s in range(seeds)]
        except LinearAttentionError:
            if m != default_m:
                continue  # this map has no num_features/seed options: measured at its default only
            raise
        results = [capture_metrics(test, fmap, references=references) for fmap in runs]
        mean = {key: sum(r[key] for r in results) / len(results)
                for key in ("rel_error", "rel_error_total", "kl", "entropy_linear")}
        mean["feature_dim"] = results[0]["feature_dim"]
        timing = runs[0].maps[0]  # the cost of one draw: every head's draw costs the same
        measure(name, runs[0], timing, num_features=m, default=m == default_m, seeds_used=seeds, metrics=mean)
    if default_m is None:
        measure(name, probe, probe)


def cli(args: Any) -> int:
    """``linattn compare`` with the options of :func:`linattn.evaluate.arguments.add_compare_arguments`."""
    fit_options: dict[str, Any] = {}
    if args.steps is not None:
        fit_options["steps"] = args.steps
    if args.num_features is not None:
        fit_options["num_features"] = args.num_features
    run_compare(model=args.model, text=args.text, heldout=args.heldout, out_dir=args.out, maps=args.maps,
                sweep=tuple(args.sweep), seeds=args.seeds, fit_options=fit_options, long_n=args.long_n,
                progress=not args.quiet, max_tokens=args.max_tokens, fit_max_tokens=args.fit_max_tokens,
                fit_orders=args.fit_orders, save_maps=args.save_maps, window=args.window, sinks=args.sinks or 0)
    return 0
