"""Two sets of SmolLM2 hybrid maps combined per head: the retrieval heads take maps B, the others maps A.

End-to-end training on plain text (maps A) and on copying sequences (maps B) pull the same features two ways:
A is better on plain text, B on the repeated passage (docs/models.md, "Staged"). Here the heads are ranked by
:func:`linattn.train.end_to_end.retrieval_scores` on the first 8 training samples (the texts of
``--texts``, written by ``linattn compare ... --end-to-end-texts``; never the held-out text), and the top k take
B's maps (:meth:`linattn.feature_maps.fitted.FittedFeatureMaps.with_heads`). Each row: held-out perplexity and
repeated-passage
perplexity (the ``linattn compare`` probes: 4 passages of 128 tokens after 512), and the same two measures on
training-side sequences (the 2 samples and the copying sequence the end-to-end stage held out), which is what a
choice of k may look at.

``--exact K...``: a diagnostic, not a linear model: maps A everywhere but the top K heads, which attend with exact
causal softmax over all keys. How much of the repeat the retrieval heads carry, and so how much better maps for
those heads alone could buy.

``--scale K S...``: a second diagnostic: maps A (the first file) with the top K heads' projections W, b multiplied
by S, untrained. S < 1 flattens those heads' features, which moves attention mass from the window to the many
keys beyond it: it tells whether those heads' far mass or the sharpness of their recall is what is short.

    python benchmarks/retrieval_heads.py A.safetensors B.safetensors --texts out/e2e-texts-1536.json \\
        --k 0 10 20 40 70 270 --exact 20 70 --baselines        # ~30 s a row, 2 threads
    python benchmarks/retrieval_heads.py A.safetensors A.safetensors --texts out/e2e-texts-1536.json \\
        --k 0 --scale 20 0.5 0.75 1.5
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from typing import Any

import torch

from linattn import hf
from linattn.data import load_text
from linattn.evaluate.lm_compare import LM_SINKS, LM_WINDOW, RETRIEVAL_SEQUENCES, use_window_softmax
from linattn.evaluate.models import load_model
from linattn.evaluate.perplexity import score_tokens
from linattn.evaluate.probes import Probe, repeat_perplexity, repeated_passages
from linattn.feature_maps.fitted import load_feature_maps
from linattn.train.end_to_end import _copy_plans, copying_sequences, retrieval_scores, top_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="maps for the other heads (e.g. trained end to end on samples alone)")
    parser.add_argument("b", help="maps for the retrieval heads (e.g. trained with copying sequences)")
    parser.add_argument("--texts", required=True, help="the end-to-end texts file (--end-to-end-texts)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 10, 20, 40, 70, 270])
    parser.add_argument("--exact", type=int, nargs="*", default=[],
                        help="diagnostic rows: maps A, the top K heads with exact causal softmax")
    parser.add_argument("--scale", type=float, nargs="*", default=[],
                        help="diagnostic rows: K S1 S2 ...: maps A with the top K heads' W, b multiplied by S")
    parser.add_argument("--baselines", action="store_true", help="also the softmax and window+sinks rows")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model("smollm2", causal_lm=True)
    with open(args.texts, encoding="utf-8") as f:
        saved = json.load(f)
    limit = saved["tokens"] + 64  # as the end-to-end stage cuts them
    plain = [torch.as_tensor(tokenizer(text)["input_ids"][:limit]) for text in saved["texts"]]
    heldout = load_text("heldout")
    ids = torch.tensor(tokenizer(heldout)["input_ids"])[None]
    probes = repeated_passages(tokenizer, heldout)
    # the end-to-end stage's held-out sequences: its last two samples and the last copying sequence
    index, length, _ = _copy_plans(plain, (32, 192), (128, 768), 0)[-1]
    last_copy = copying_sequences(plain, seed=0)[-1]
    train_side = [x[None] for x in plain[-2:]]
    train_probe = [Probe("repeat", last_copy, last_copy.shape[0] - length, 0)]
    print(f"{ids.shape[1]} held-out tokens; training side: samples {len(plain) - 1}, {len(plain)}, copying "
          f"sequence of sample {index + 1}")
    print(f"{'row':>26} {'held-out ppl':>12} {'repeat':>7} {'train-side ppl':>14} {'repeat':>7}")

    def row(label: str) -> None:
        begin = time.perf_counter()
        ppl = float((-score_tokens(model, ids, 1)[0]).mean().exp())
        repeat = repeat_perplexity(model, probes)
        side = math.exp(sum(float(-score_tokens(model, x, 1)[0].mean()) for x in train_side) / len(train_side))
        side_repeat = repeat_perplexity(model, train_probe)
        print(f"{label:>26} {ppl:12.2f} {repeat:7.2f} {side:14.2f} {side_repeat:7.2f}  "
              f"({time.perf_counter() - begin:.0f} s)", flush=True)

    begin = time.perf_counter()
    scores = retrieval_scores(model, plain[:RETRIEVAL_SEQUENCES], window=LM_WINDOW, sinks=LM_SINKS)
    order = scores.flatten().argsort(descending=True)
    heads = scores.shape[1]
    top = ", ".join(f"{int(i) // heads}.{int(i) % heads} ({float(scores.flatten()[i]):.2f})" for i in order[:10])
    print(f"retrieval scores ({time.perf_counter() - begin:.0f} s); the top 10, layer.head (score): {top}")
    if args.baselines:
        row("softmax")
        use_window_softmax(model, LM_WINDOW, LM_SINKS)
        row(f"window{LM_WINDOW}+sinks{LM_SINKS}")
    a, b = load_feature_maps(args.a), load_feature_maps(args.b)
    for k in args.k:
        hf.linearize(model, a.with_heads(b, top_heads(scores, k)))
        row(f"top {k} heads from B")
    if args.scale:
        if len(args.scale) < 2 or args.scale[0] != int(args.scale[0]) or args.scale[0] < 1:
            parser.error("--scale: K S1 [S2 ...], K a head count ≥ 1")
        count = int(args.scale[0])
        for factor in args.scale[1:]:
            hf.linearize(model, scaled(a, top_heads(scores, count), factor))
            row(f"A, top {count} heads W,b x{factor:g}")
    if args.exact:
        exact_rows(model, a, order, heads, args.exact, row)


def scaled(maps: Any, marked: torch.Tensor, factor: float) -> Any:
    """A copy of ``maps`` whose marked heads ((layers, heads) bool) have their projection W, b times ``factor``."""
    out = copy.deepcopy(maps)
    with torch.no_grad():
        for fmap, row in zip(out.maps, marked, strict=True):
            fmap.weight[:, row] *= factor
            fmap.bias[:, row] *= factor
    return out


def exact_rows(model: Any, maps: Any, order: torch.Tensor, heads: int, counts: list[int], row: Any) -> None:
    """Rows with ``maps`` in every head but the top ``count`` of ``order``, which get exact causal softmax."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    exact: dict[int, list[int]] = {}

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                  **options: Any) -> tuple[torch.Tensor, None]:
        out, _ = hf.linattn_attention_forward(module, query, key, value, mask, **options)
        chosen = exact.get(module.layer_idx)
        if chosen:  # (B, N, H, d): the chosen heads' outputs replaced by softmax over every earlier key
            softmax = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=options.get("scaling"), enable_gqa=True).transpose(1, 2)
            out = out.clone()
            out[:, :, chosen] = softmax[:, :, chosen]
        return out, None

    hf.linearize(model, maps)
    AttentionInterface.register("linattn_exact_heads", attention)
    AttentionMaskInterface.register("linattn_exact_heads", hf.linattn_mask)  # the 2-D padding mask, as "linattn"
    model.set_attn_implementation("linattn_exact_heads")
    for count in counts:
        exact.clear()
        for index in order[:count].tolist():
            exact.setdefault(index // heads, []).append(index % heads)
        row(f"A, top {count} heads exact")


if __name__ == "__main__":
    main()
