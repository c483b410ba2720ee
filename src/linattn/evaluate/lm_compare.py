"""``linattn compare`` for causal LMs: perplexity and long-range recall of each way to replace softmax attention.

Rows (each on the same held-out text of the shipped corpus, or ``--heldout``):

- ``softmax``: the model as it is (SDPA);
- ``window+sinks``: softmax over the ``--window`` most recent keys and the first ``--sinks`` tokens only (SDPA with
  an explicit band-and-sink mask; no linear part): what local attention alone achieves;
- ``elu``, ``favor+``: linear attention with a fixed map (:func:`linattn.hf.linearize`);
- ``hedgehog``: maps fitted on the train text (:func:`linattn.distill.fit_model_feature_maps`), or loaded with
  ``--fitted-maps FILE``;
- hybrids (``hedgehog+window``, ``elu+window``: the maps above beside the softmax window; ``hedgehog fitted with
  window``: maps fitted with the window in place, :func:`linattn.distill.fit_feature_map` ``window=``);
- with ``--retrieval-heads K --retrieval-maps FILE``: the K heads that retrieve most beyond the window
  (:func:`~linattn.evaluate.end_to_end.retrieval_scores`) take FILE's maps, the others keep the hybrid's; an
  end-to-end stage (``--end-to-end-steps``) then trains only those K heads.

Columns: held-out perplexity (:func:`~linattn.evaluate.perplexity`), the repeated-passage perplexity and passkey
accuracy at each filler length (:mod:`~linattn.evaluate.probes`), and for linear rows the per-head output error and
row KL against softmax on the held-out capture (:func:`~linattn.evaluate.capture_metrics`).

    linattn compare smollm2                    # docs/models.md: the command, its run time, the measured table
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import time
from typing import Any

import torch

from ..data import load_text
from ..distill import load_feature_maps
from ..errors import LinearAttentionError
from .models import _gguf_in, _is_causal_lm, cache_folder, load_model

WINDOW_IMPLEMENTATION = "linattn_window_softmax"
DEFAULT_OUT = "out/compare"


def window_sink_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Softmax attention restricted to keys t − W < j ≤ t and j < S (transformers' attention-function contract).

    W and S are read from the module (``linattn_window``, ``linattn_sinks``); ``attention_mask`` is the 2-D
    padding mask of :func:`linattn.hf.linattn_mask`, or None.
    """
    window, sinks = module.linattn_window, module.linattn_sinks
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    rows = torch.arange(num_keys - num_queries, num_keys, device=query.device)[:, None]  # (Nq, 1) positions
    cols = torch.arange(num_keys, device=query.device)[None, :]  # (1, Nk)
    allowed = (cols <= rows) & ((rows - cols < window) | (cols < sinks))  # (Nq, Nk)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(torch.bool)[:, None, None, -num_keys:]  # (B, 1, Nq, Nk)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None  # (B, Nq, H, dv)


def use_window_softmax(model: Any, window: int, sinks: int) -> None:
    """Switch ``model`` to :func:`window_sink_attention` with ``window`` recent keys and ``sinks`` first tokens."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .. import hf

    AttentionInterface.register(WINDOW_IMPLEMENTATION, window_sink_attention)
    AttentionMaskInterface.register(WINDOW_IMPLEMENTATION, hf.linattn_mask)
    for module in hf.attention_modules(model):
        # plain ints on the module, read by window_sink_attention
        module.linattn_window, module.linattn_sinks = window, sinks  # type: ignore[assignment]
    model.set_attn_implementation(WINDOW_IMPLEMENTATION)


def looks_causal(name: str | None) -> bool:
    """Whether ``linattn compare MODEL`` should take the causal-LM path (without loading the model)."""
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


def _train_text(args: Any) -> str:
    return load_text("train") if args.text is None else open(args.text, encoding="utf-8").read()


def _fit(model: Any, tokenizer: Any, name: str, args: Any, window: int | None) -> Any:
    from ..distill import fit_feature_map, fit_model_feature_maps
    from .capture import capture_attention

    train = _train_text(args)
    capture = capture_attention(model, tokenizer, train, max_tokens=args.fit_max_tokens or LM_FIT_TOKENS,
                                model_name=name, orders=args.fit_orders)
    options: dict[str, Any] = {"progress": not args.quiet}
    if args.steps is not None:
        options["steps"] = args.steps
    if args.num_features is not None:
        options["num_features"] = args.num_features
    accepted = inspect.signature(fit_feature_map).parameters
    if window is not None and "window" in accepted:  # fitted with the window in place (the hybrid's fitting)
        options["window"] = window
        if "sinks" in accepted:
            options["sinks"] = args.sinks
        if getattr(args, "gamma", False):  # LoLCATs' per-head factor on the window, fitted with the maps
            options["window_factor"] = True
    return fit_model_feature_maps(capture, kind="hedgehog", **options), capture.num_tokens


def _sampled(model: Any, tokenizer: Any, prompts: list[str], args: Any, sample_texts: Any) -> list[str]:
    """The end-to-end stage's texts: sampled (seed 0), or read from ``--end-to-end-texts`` when that file was
    written for the same model, prompts and length (a run writes it when it is missing)."""
    name = str(getattr(model.config, "_name_or_path", ""))
    if os.path.dirname(os.path.abspath(name)) == os.path.abspath(cache_folder()):  # a GGUF conversion: its folder
        name = os.path.basename(name)  # is named by the file's bytes, the same in every install; the path is not
    settings = {"model": name, "prompts": prompts,
                "tokens": args.end_to_end_tokens, "seed": 0}
    path = getattr(args, "end_to_end_texts", None)
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if {key: saved.get(key) for key in settings} != settings:
            raise LinearAttentionError(
                f"--end-to-end-texts: {path} holds texts sampled for another model, other prompts or another "
                "length; pass another path (it is written when missing) or remove it"
            )
        return list(saved["texts"])
    texts = sample_texts(model, tokenizer, prompts, tokens=args.end_to_end_tokens, seed=0)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**settings, "texts": texts}, f, ensure_ascii=False)
    return texts


def _training_sequences(model: Any, tokenizer: Any, args: Any) -> tuple[list[torch.Tensor], float]:
    """The end-to-end stage's texts as token ids (N,) each, sampled from the model itself prompted by the train
    text's paragraphs (or read from ``--end-to-end-texts``), and the seconds sampling took."""
    from ..data import paragraphs
    from .end_to_end import sample_texts

    train = _train_text(args)
    starts = [" ".join(paragraph.split()[:20]) for paragraph in paragraphs(train)]
    prompts = [starts[i % len(starts)] for i in range(args.end_to_end_samples)]
    model.set_attn_implementation("sdpa")
    begin = time.perf_counter()
    texts = _sampled(model, tokenizer, prompts, args, sample_texts)
    return _token_ids(tokenizer, texts, args), time.perf_counter() - begin


def _token_ids(tokenizer: Any, texts: list[str], args: Any) -> list[torch.Tensor]:
    """Each text as token ids (N,), cut where the end-to-end stage cuts them (its tokens, a prompt's 64 more)."""
    return [torch.as_tensor(tokenizer(text)["input_ids"][: args.end_to_end_tokens + 64]) for text in texts]


RETRIEVAL_SEQUENCES = 8  # training samples scored by retrieval_scores (two forward passes each with weights)


def _retrieval_heads(model: Any, plain: list[torch.Tensor], args: Any) -> torch.Tensor:
    """(layers, heads) bool: the ``--retrieval-heads`` heads of highest :func:`~.end_to_end.retrieval_scores` on
    the first training samples (never the held-out ones)."""
    from .end_to_end import retrieval_scores, top_heads

    model.set_attn_implementation("sdpa")
    scores = retrieval_scores(model, plain[: min(RETRIEVAL_SEQUENCES, len(plain) - 2)], window=args.window,
                              sinks=args.sinks)
    return top_heads(scores, args.retrieval_heads)


def _end_to_end(model: Any, tokenizer: Any, fitted: Any, args: Any, plain: list[torch.Tensor],
                heads: torch.Tensor | None) -> tuple[Any, Any, dict[str, Any]]:
    """A copy of ``fitted`` trained end to end (:mod:`.end_to_end`) on the sampled sequences ``plain`` (and their
    copying sequences); only the ``heads`` marked, when given. ``fitted`` stays as it was. With
    ``--end-to-end-lora R`` the maps stay as they are and rank-R adapters are trained instead (detached from the
    model on return). Returns the copy, the adapters (or None) and what it took."""
    from .. import hf
    from .end_to_end import copying_sequences, copying_weights, fit_end_to_end
    from .lora import add_lora

    held = 2  # the last two samples, and the copying sequence of the last but one, are held out
    repeat = args.end_to_end_repeat_weight

    def with_copies(texts: list[torch.Tensor], seed: int) -> list[tuple[torch.Tensor, Any]]:
        """Each copying sequence of ``texts`` with its position weights (the repeat weighted)."""
        if not texts or not args.end_to_end_copies:
            return []
        return list(zip(copying_sequences(texts, seed=seed), copying_weights(texts, repeat, seed=seed), strict=True))

    corpus: list[torch.Tensor] = []
    if args.end_to_end_corpus_orders:  # the training text itself, in paragraph orders, beside the samples
        from .capture import reordered

        corpus = _token_ids(tokenizer, reordered(_train_text(args), args.end_to_end_corpus_orders, seed=0), args)
    samples, copies, corpus_copies = [(x, None) for x in plain], with_copies(plain, 0), with_copies(corpus, 1)
    ordered = (samples[:-held] + copies[:-1] + [(x, None) for x in corpus] + corpus_copies + samples[-held:]
               + copies[-1:])
    sequences = [ids for ids, _ in ordered]
    weights = None if repeat == 1 else [marks for _, marks in ordered]
    if heads is not None and args.train_other_heads:
        heads = ~heads
    tuned = copy.deepcopy(fitted)
    hf.linearize(model, tuned)
    adapters = add_lora(model, rank=args.end_to_end_lora) if args.end_to_end_lora else None
    if adapters is not None:
        heads = None  # every map stays as it is (the retrieval heads' maps may come from --retrieval-maps)
    try:
        info = fit_end_to_end(model, tokenizer, sequences, max_tokens=args.end_to_end_tokens + 64,
                              steps=args.end_to_end_steps, held_out=held + len(copies[-1:]), progress=not args.quiet,
                              heads=heads, weights=weights, adapters=adapters,
                              adapter_lr=args.end_to_end_lora_lr, train_maps=adapters is None)
    finally:
        if adapters is not None:
            adapters.remove()  # attached again for its own row only
    model.set_attn_implementation("sdpa")
    return tuned, adapters, {"samples": len(plain), "copying_sequences": len(copies) + len(corpus_copies),
                   "corpus_sequences": len(corpus), "tokens": args.end_to_end_tokens,
                   "steps": args.end_to_end_steps, "heads": None if heads is None else int(heads.sum()),
                   "repeat_weight": args.end_to_end_repeat_weight, "lora_rank": args.end_to_end_lora,
                   "best_held_out_kl": info["best_held_out"], "history": info["history"]}


def _row(model: Any, tokenizer: Any, heldout: str, args: Any) -> dict[str, Any]:
    from .perplexity import perplexity
    from .probes import long_range_probes

    plain = perplexity(model, tokenizer, heldout)
    probes = long_range_probes(
        model, tokenizer, heldout, passage_tokens=args.passage_tokens, gap_tokens=args.gap_tokens,
        repeat_trials=args.repeat_trials, passkey_lengths=tuple(args.passkey_lengths),
        passkey_trials=args.passkey_trials,
    )
    return {"perplexity": plain.perplexity, "tokens_per_second": plain.tokens_per_second,
            "heldout_tokens": plain.tokens, "repeat_perplexity": probes["repeat_perplexity"],
            "passkey": {str(k): v for k, v in probes["passkey"].items()}, "probe_seconds": probes["seconds"]}


def run_lm_compare(args: Any) -> dict[str, Any]:
    """The causal-LM comparison; writes ``report.md`` and ``results.json`` to ``args.out`` as rows finish."""
    from .. import hf
    from .capture import capture_attention
    from .metrics import capture_metrics, capture_references

    start = time.perf_counter()
    model, tokenizer, name = load_model(args.model, causal_lm=True)
    heldout = load_text("heldout") if args.heldout is None else open(args.heldout, encoding="utf-8").read()
    # hedgehog+window: maps fitted with the window in place (their file carries W and S, so linearize makes them a
    # hybrid); plain hedgehog rows are fitted without it
    wanted = args.maps or ["elu", "favor+", "hedgehog", "hedgehog+window"]
    result: dict[str, Any] = {
        "model": name, "layers": model.config.num_hidden_layers, "window": args.window, "sinks": args.sinks,
        "passage_tokens": args.passage_tokens, "gap_tokens": args.gap_tokens, "threads": torch.get_num_threads(),
        "rows": [],
    }
    out = args.out if args.out != DEFAULT_OUT else DEFAULT_OUT + "-lm"
    os.makedirs(out, exist_ok=True)

    def record(row_name: str, row: dict[str, Any], seconds: float, **extra: Any) -> None:
        row.update(name=row_name, seconds=seconds, **extra)
        result["rows"].append(row)
        result["seconds"] = time.perf_counter() - start
        write(result, out)
        if not args.quiet:
            print(format_row(row), flush=True)

    if not args.quiet:
        print(f"{name}: held-out perplexity, repeated passage ({args.passage_tokens} tokens after "
              f"{args.gap_tokens}) and passkey accuracy; {torch.get_num_threads()} threads")
        print(header())
    metrics_capture = references = None
    if not args.no_metrics:
        metrics_capture = capture_attention(model, tokenizer, heldout, max_tokens=args.max_tokens, model_name=name)
        references = capture_references(metrics_capture)
    if not args.no_baselines:
        begin = time.perf_counter()
        record("softmax", _row(model, tokenizer, heldout, args), time.perf_counter() - begin)
        begin = time.perf_counter()
        use_window_softmax(model, args.window, args.sinks)
        record(f"window{args.window}+sinks{args.sinks}", _row(model, tokenizer, heldout, args),
               time.perf_counter() - begin)

    fitted = None
    configurations: list[tuple[str, Any, dict[str, Any]]] = []
    adapted: dict[str, Any] = {}  # row label → the LoRA adapters of that row (attached for it alone)
    saved = load_feature_maps(args.fitted_maps) if args.fitted_maps else None  # read once for every map row
    for map_name in wanted:
        if map_name in ("hedgehog", "hedgehog+window"):
            with_window = map_name == "hedgehog+window"
            begin = time.perf_counter()
            if saved is not None and (saved.window is not None) == with_window:  # a file fitted with the window
                fitted, fit_tokens = saved, 0  # serves the window row, one fitted without it the plain row
            else:
                model.set_attn_implementation("sdpa")
                fitted, fit_tokens = _fit(model, tokenizer, name, args, args.window if with_window else None)
                if args.save_maps:
                    os.makedirs(args.save_maps, exist_ok=True)
                    fitted.save(os.path.join(args.save_maps, f"{map_name.replace('+', '_')}.safetensors"))
            key = "fit_window_seconds" if with_window else "fit_seconds"
            result[key], result["fit_tokens"] = time.perf_counter() - begin, fit_tokens
            label = "hedgehog fitted with window" + (" (γ)" if args.gamma else "") if with_window else "hedgehog"
            configurations.append((label, fitted, {}))
            heads = None
            if with_window and (args.end_to_end_steps or args.retrieval_heads):
                plain, result["sample_seconds"] = _training_sequences(model, tokenizer, args)
            if with_window and args.retrieval_heads:
                begin = time.perf_counter()
                heads = _retrieval_heads(model, plain, args)
                result["retrieval_heads"] = {"heads": heads.nonzero().tolist(), "seconds": time.perf_counter() - begin}
                if args.retrieval_maps:  # the retrieval heads' maps from another run (e.g. trained on copying)
                    fitted = fitted.with_heads(load_feature_maps(args.retrieval_maps), heads)
                    label += f", {args.retrieval_heads} retrieval heads from {os.path.basename(args.retrieval_maps)}"
                    configurations.append((label, fitted, {}))
            if with_window and args.end_to_end_steps:
                begin = time.perf_counter()
                tuned, adapters, info = _end_to_end(model, tokenizer, fitted, args, plain, heads)
                result["end_to_end"] = {**info, "seconds": time.perf_counter() - begin}
                stage = ", end to end"
                if adapters is not None:  # the maps as they were, the projections adapted
                    stage += f": LoRA r={args.end_to_end_lora} (fine-tuned)"
                if heads is not None and args.train_other_heads:
                    stage += ", other heads"
                elif heads is not None and not args.retrieval_maps:  # else the label names them already
                    stage += f", {args.retrieval_heads} retrieval heads"
                if args.end_to_end_corpus_orders:
                    stage += f", with {args.end_to_end_corpus_orders} orders of the training text"
                if args.end_to_end_repeat_weight != 1:
                    stage += f", repeat weight {args.end_to_end_repeat_weight:g}"
                if adapters is not None:
                    adapted[label + stage] = adapters
                configurations.append((label + stage, tuned, {}))
                if args.save_maps:
                    os.makedirs(args.save_maps, exist_ok=True)  # also when the fit was loaded (--fitted-maps)
                    if adapters is not None:
                        adapters.save(os.path.join(args.save_maps, "lora.safetensors"))
                    else:
                        tuned.save(os.path.join(args.save_maps, "hedgehog_window_end_to_end.safetensors"))
        else:
            configurations.append((map_name, map_name, {"seed": 0} if map_name == "favor+" else {}))
    hybrid_options = {"window": args.window, "sinks": args.sinks}
    configurations += [(f"{label}+window", maps, {**options, **hybrid_options})
                       for label, maps, options in list(configurations) if label in ("hedgehog", "elu")]
    for label, maps, options in configurations:
        begin = time.perf_counter()
        hf.linearize(model, maps, **options)
        adapters = adapted.get(label)
        if adapters is not None:
            adapters.attach()
        extra: dict[str, Any] = {}
        if metrics_capture is not None and "window" not in options and not getattr(maps, "window", None):
            per_layer: list[Any] = [m.linattn_feature_map for m in hf.attention_modules(model)]
            metrics = capture_metrics(metrics_capture, per_layer, references=references)
            extra = {"rel_error": metrics["rel_error"], "kl": metrics["kl"]}
        try:
            row = _row(model, tokenizer, heldout, args)
        finally:
            if adapters is not None:
                adapters.remove()
        record(label, row, time.perf_counter() - begin, **extra)
    model.set_attn_implementation("sdpa")
    return result


def header() -> str:
    return (f"{'row':>22} {'ppl':>9} {'repeat ppl':>11} {'passkey 1k/2k/4k':>18} {'rel.err':>8} {'KL':>7} "
            f"{'tok/s':>7} {'s':>6}")


def _num(x: Any) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}" if abs(x) < 1e4 else f"{x:.3g}"


def format_row(row: dict[str, Any]) -> str:
    passkey = "/".join(f"{v:.2f}" for v in row["passkey"].values())
    return (f"{row['name']:>22} {_num(row['perplexity']):>9} {_num(row['repeat_perplexity']):>11} {passkey:>18} "
            f"{_num(row.get('rel_error')):>8} {_num(row.get('kl')):>7} {row['tokens_per_second']:>7.0f} "
            f"{row['seconds']:>6.0f}")


LM_WINDOW, LM_SINKS = 64, 4  # the window rows' defaults: StreamingLLM's 4 sinks, a 64-token window (LoLCATs)
# fitting sequences as long as the contexts served: maps fitted on 512-token pieces put too much weight on far keys
# past position 512 (SmolLM2 hybrid: perplexity 86.7 with 512-token fits, 53.0 with 1,024; docs/models.md)
LM_FIT_TOKENS = 1024


def write(result: dict[str, Any], out: str) -> None:
    """results.json and report.md in ``out``."""
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=float)
    lengths = list(result["rows"][0]["passkey"]) if result["rows"] else []
    lines = [
        f"# linattn compare (causal LM): {result['model']}", "",
        f"Held-out text of the shipped corpus; repeated passage: {result['passage_tokens']} tokens, "
        f"{result['gap_tokens']} tokens of other text, the passage again (only the repeat scored); passkey: "
        f"a 5-digit key, filler of {', '.join(lengths)} tokens. Window rows: {result['window']} recent keys + "
        f"{result['sinks']} sink tokens. {result['threads']} threads, {result.get('seconds', 0):.0f} s in all.", "",
        "| row | perplexity | repeat perplexity | " + " | ".join(f"passkey {n}" for n in lengths)
        + " | rel. error | row KL | tokens/s |",
        "|---|---:|---:|" + "---:|" * len(lengths) + "---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['name']} | {_num(row['perplexity'])} | {_num(row['repeat_perplexity'])} | "
                     + " | ".join(f"{v:.2f}" for v in row["passkey"].values())
                     + f" | {_num(row.get('rel_error'))} | {_num(row.get('kl'))} | {row['tokens_per_second']:.0f} |")
    if "fit_seconds" in result:
        lines += ["", f"Hedgehog maps fitted in {result['fit_seconds']:.0f} s on {result['fit_tokens']} captured "
                      "train tokens (0: loaded from a file)."]
    rank = result.get("end_to_end", {}).get("lora_rank")
    if rank:
        lines += ["", f"The row marked (fine-tuned) is not the model as shipped: rank-{rank} adapters on every "
                      "attention layer's q/k/v/o projections were trained end to end with its maps frozen "
                      "(LoLCATs' second stage). Every other row uses the model's own weights."]
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def add_lm_arguments(parser: Any) -> None:
    """The causal-LM options of ``linattn compare`` (options another part already defines are shared)."""
    def add(flag: str, **options: Any) -> None:
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, **options)

    add("--lm", action="store_true", help="treat MODEL as a causal LM (detected for smollm2, GGUF, *ForCausalLM)")
    add("--window", type=int, default=None, help=f"causal LMs: softmax window of the window rows ({LM_WINDOW})")
    add("--sinks", type=int, default=None, help=f"causal LMs: sink tokens kept exact in the window rows ({LM_SINKS})")
    add("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="causal LMs: filler tokens")
    add("--passkey-trials", type=int, default=3, help="causal LMs: passkey trials per filler length")
    add("--repeat-trials", type=int, default=4, help="causal LMs: repeated passages")
    add("--passage-tokens", type=int, default=128, help="causal LMs: tokens of the repeated passage")
    add("--gap-tokens", type=int, default=512, help="causal LMs: tokens between the passage and its repeat")
    add("--fitted-maps", default=None,
        help="causal LMs: hedgehog maps saved earlier (skip the fit): maps fitted with the window serve the "
             "hedgehog+window rows, others the hedgehog row")
    add("--no-metrics", action="store_true", help="causal LMs: skip the per-head rel. error / KL")
    add("--no-baselines", action="store_true", help="causal LMs: skip the softmax and window+sinks rows")
    add("--end-to-end-steps", type=int, default=0,
        help="causal LMs: also train the window-fitted maps end to end for this many steps (0: no such row)")
    add("--end-to-end-samples", type=int, default=32,
        help="causal LMs: texts sampled from the model for the end-to-end stage (the last 2 held out)")
    add("--end-to-end-tokens", type=int, default=1024, help="causal LMs: tokens sampled per text")
    add("--end-to-end-texts", default=None,
        help="causal LMs: a JSON file of the end-to-end stage's sampled texts: read when it was written for the same "
             "model, prompts and --end-to-end-tokens, else sampled and written there (sampling is minutes)")
    add("--end-to-end-copies", action=argparse.BooleanOptionalAction, default=True,
        help="causal LMs: also train on copying sequences built from the samples (a passage, other text, the "
             "passage again)")
    add("--end-to-end-corpus-orders", type=int, default=0,
        help="causal LMs: also train the end-to-end stage on the training text itself, in this many paragraph "
             "orders (and their copying sequences); 0: the samples alone")
    add("--end-to-end-repeat-weight", type=float, default=1.0,
        help="causal LMs: the loss weight of the positions that predict a copying sequence's repeat (others 1)")
    add("--retrieval-heads", type=int, default=0,
        help="causal LMs: the K heads that retrieve most beyond the window (retrieval_scores on the sampled texts): "
             "with --retrieval-maps they take that file's maps; the end-to-end stage then trains only them")
    add("--retrieval-maps", default=None,
        help="causal LMs: a maps file (same layout as the hedgehog+window maps) whose retrieval heads' maps replace "
             "those of the fitted/--fitted-maps maps, e.g. maps trained on copying sequences")
    add("--train-other-heads", action="store_true",
        help="causal LMs: the end-to-end stage trains the heads other than the --retrieval-heads (those stay as "
             "they are)")
    add("--end-to-end-lora", type=int, default=0, metavar="R",
        help="causal LMs: the end-to-end stage trains rank-R adapters of every attention layer's q/k/v/o "
             "projections instead of the maps (LoLCATs' fine-tuning stage: the model's weights change in effect, "
             "and the row says so); 0: no adapters")
    add("--end-to-end-lora-lr", type=float, default=0.0005, help="causal LMs: the adapters' Adam learning rate")
    add("--gamma", action="store_true",
        help="causal LMs: fit hedgehog+window with LoLCATs' per-head factor γ instead of the mass-preserving window")


def cli(args: Any) -> int:
    # --window/--sinks are shared with the encoder comparison, whose defaults differ (no window, no sinks)
    args.window = LM_WINDOW if args.window is None else args.window
    args.sinks = LM_SINKS if args.sinks is None else args.sinks
    if args.passkey_trials < 1 or args.repeat_trials < 1 or args.window < 1 or args.sinks < 0:
        raise LinearAttentionError("--passkey-trials, --repeat-trials, --window: need ≥ 1; --sinks: ≥ 0")
    if args.end_to_end_steps < 0 or args.end_to_end_samples < 3 or args.end_to_end_tokens < 1:
        raise LinearAttentionError("--end-to-end-steps: need ≥ 0; --end-to-end-samples: ≥ 3 (2 are held out); "
                                   "--end-to-end-tokens: ≥ 1")
    if args.retrieval_heads < 0 or (args.retrieval_maps and not args.retrieval_heads):
        raise LinearAttentionError("--retrieval-heads: need ≥ 0, and ≥ 1 with --retrieval-maps")
    if args.end_to_end_corpus_orders < 0:
        raise LinearAttentionError("--end-to-end-corpus-orders: need ≥ 0")
    if args.end_to_end_lora < 0 or (args.end_to_end_lora and not args.end_to_end_steps):
        raise LinearAttentionError("--end-to-end-lora: need a rank ≥ 0, and --end-to-end-steps ≥ 1 to train it")
    if args.end_to_end_lora and (args.retrieval_heads and not args.retrieval_maps or args.train_other_heads):
        raise LinearAttentionError("--end-to-end-lora trains the adapters with every map frozen: it takes no heads "
                                   "to train (--retrieval-heads only with --retrieval-maps; no --train-other-heads)")
    if not args.end_to_end_lora_lr > 0:
        raise LinearAttentionError(f"--end-to-end-lora-lr: need > 0, got {args.end_to_end_lora_lr}")
    if args.train_other_heads and not args.retrieval_heads:
        raise LinearAttentionError("--train-other-heads: needs --retrieval-heads K (the heads left as they are)")
    if not (args.end_to_end_repeat_weight > 0 and args.end_to_end_repeat_weight < float("inf")):
        raise LinearAttentionError(f"--end-to-end-repeat-weight: need a finite weight > 0, got "
                                   f"{args.end_to_end_repeat_weight}")
    if args.retrieval_maps and not os.path.isfile(args.retrieval_maps):
        raise LinearAttentionError(f"--retrieval-maps: {args.retrieval_maps!r} is not a file; pass a maps file "
                                   "written by --save-maps")
    if (args.end_to_end_steps or args.retrieval_heads) and "hedgehog+window" not in (args.maps or ["hedgehog+window"]):
        raise LinearAttentionError("--end-to-end-steps and --retrieval-heads act on the maps of the hedgehog+window "
                                   "row: add it to --maps")
    result = run_lm_compare(args)
    out = args.out if args.out != DEFAULT_OUT else DEFAULT_OUT + "-lm"
    if not args.quiet:
        print(f"wrote {out}/report.md and results.json ({result['seconds']:.0f} s)")
    return 0
