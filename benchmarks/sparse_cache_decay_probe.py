"""Would a decaying linear part let the sparse cache retrieve the passkey? A measurement of a mechanism the window
op does not have, computed quadratically on a linearized SmolLM2 folder.

The hybrid with a sparse cache (``linear_attention(..., window=W, sinks=S, sparse_cache=...)``) gives every pair
in its linear state its full linear weight φ(q)·φ(k) forever, so the state's mass grows with the context and, at
1–2k filler tokens, drowns the exact pairs — the cached key included (docs/sparse_cache.md). Here the linear part's
weight of pair j at query t is instead β·γ^max(0, t − j − W)·φ(q_t)·φ(k_j): it fades by γ per token once the pair
has left the window (the state of a decaying linear attention, S_t = γ·S_{t−1} + the pair entering, has exactly
these weights). The cache's decisions are the op's own (``cache_selections``: with ``score="oracle"`` they do not
depend on the state, so they are what a decayed op would decide too); everything else is the op's mass form. With
γ = 1 and β = 1 the function is the op itself (``tests/test_sparse_cache.py`` checks it against
``linear_attention`` in float64), so each row differs from the op's in the decay alone.

Rows: passkey hits of ``--trials`` probes per filler length (greedy, every key token), with a 95 % Wilson
interval, and the mean log-probability of the key's tokens, for the hybrid with a uniform cache of ``--size``
pairs that keeps the first ``--oracle-first`` positions (the key's statement held exactly: what any score could
at best reach), for each γ of ``--gammas``. O(N²) per head and layer: 20 trials took 17 minutes at 2k filler and
5 at 1k on one thread. Rows are written to ``--out`` as they finish; a rerun skips those already there.

    .venv/bin/python benchmarks/sparse_cache_decay_probe.py [--gammas 1 0.998 0.99] [--lengths 1024 2048]
        [--trials 20] [--threads 2] [--out docs/results/sparse_cache_decay_probe_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import linattn.hf
from linattn import SparseCache
from linattn._json import dumps
from linattn.evaluate.lm_stages import read_text
from linattn.evaluate.probes import key_scores, passkeys
from linattn.exact.forms.hybrid import Hybrid
from linattn.exact.forms.sparse import cache_selections
from linattn.feature_maps import FeatureMap
from linattn.features import repeat_kv_heads
from linattn.linearized.card import wilson_interval
from linattn.linearized.folder import atomic_write, load_linearized, shipped


def decayed_hybrid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmap: Any, *, window: int, sinks: int,
                   sparse_cache: SparseCache, gamma: float, softmax_scale: float | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """The causal hybrid with a sparse cache, the mass form, its linear part's weights decayed by γ per token
    beyond the window: q (B, H, N, d), k, v (B, Hkv, N, ·) → (B, H, N, Dv). Quadratic in N; no padding."""
    heads, n = q.shape[1], q.shape[-2]
    k, v = repeat_kv_heads(k, heads // k.shape[1], dim=1), repeat_kv_heads(v, heads // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)

    def features(x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return fmap.features(x, is_query=is_query) if isinstance(fmap, FeatureMap) else fmap(x)

    hybrid = Hybrid(features, log_space=False, window=window, sinks=sinks, factor=None, scale=scale, eps=eps,
                    min_denom=None)
    block = sparse_cache.block_for(window)
    selections = cache_selections(hybrid, sparse_cache, q, k, v)  # (B, H, blocks, L): the op's own decisions
    t = torch.arange(n, device=q.device).unsqueeze(-1)
    j = torch.arange(n, device=q.device).unsqueeze(0)
    seen = j <= t
    near = seen & (t - j < window)
    sink = seen & (j < sinks)
    chosen = selections[..., t.squeeze(-1) // block, :]  # (B, H, N, L): query t's cache
    cached = torch.zeros(*q.shape[:-1], n + 1, dtype=torch.bool, device=q.device)
    cached.scatter_(-1, torch.where(chosen >= 0, chosen, n), True)  # (column n: the unused slots)
    exact = near | sink | (cached[..., :n] & (t - j >= window))
    linear = seen & ~exact
    qf, kf = features(q, True), features(k, False)
    weights = qf @ kf.transpose(-1, -2)  # φ(q)·φ(k), (B, H, N, N)
    decay = torch.pow(torch.tensor(gamma, dtype=q.dtype), (t - j - window).clamp(min=0).to(q.dtype))
    lin = weights * (linear * decay)
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~exact, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp(min=-torch.finfo(q.dtype).max)
    probs = torch.exp(scores - top)
    win_num, win_den = probs @ v, probs.sum(-1)
    mass = (weights * exact).sum(-1)
    share = mass / torch.where(win_den == 0, torch.ones_like(win_den), win_den)
    lin_num, lin_den = sparse_cache.weigh_linear((lin @ v, lin.sum(-1)))  # times β
    num = lin_num + share.unsqueeze(-1) * win_num
    den = lin_den + mass + eps
    return num / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--gammas", type=float, nargs="+", default=[1.0, 0.998, 0.99])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--oracle-first", type=int, default=128)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/sparse_cache_decay_probe_smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.folder) if args.folder else shipped("smollm2")
    if folder is None:
        raise SystemExit("the shipped SmolLM2 folder is missing: reinstall linattn")
    out = Path(args.out)
    done: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    done.setdefault("setting", {"folder": "the shipped SmolLM2 folder" if args.folder is None else args.folder,
                                "size": args.size, "oracle_first": args.oracle_first, "trials": args.trials,
                                "threads": torch.get_num_threads(), "heldout": "the shipped corpus's held-out part"})
    rows = done.setdefault("rows", {})
    keep = torch.arange(1 << 16) < args.oracle_first
    cache = SparseCache(args.size, score="oracle", keep=keep)
    model, tokenizer = load_linearized(folder, sparse_cache=cache)
    op = linattn.hf.linear_attention
    text = read_text(None, "heldout")
    for gamma in args.gammas:
        name = (f"hybrid + cache {args.size} (oracle: the first {args.oracle_first} positions), linear part "
                f"decayed {gamma:g} per token beyond the window")

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: Any, causal: bool,
                   key_padding_mask: torch.Tensor | None = None, gamma: float = gamma, **options: Any
                   ) -> torch.Tensor:
            if not causal or key_padding_mask is not None or options.get("window_factor") is not None:
                raise SystemExit("the decay probe covers causal, unpadded calls in the mass form")
            return decayed_hybrid(q, k, v, feature_map, window=options["window"], sinks=options.get("sinks", 0),
                                  sparse_cache=options["sparse_cache"], gamma=gamma,
                                  softmax_scale=options.get("softmax_scale"), eps=options.get("eps", 1e-6))

        linattn.hf.linear_attention = attend  # type: ignore[assignment]
        try:
            for length in args.lengths:
                if f"{length}" in rows.get(name, {}):
                    continue
                begin = time.perf_counter()
                probes = passkeys(tokenizer, text, filler_tokens=length, trials=args.trials, seed=0)
                hits, log_prob = key_scores(model, probes)
                rows.setdefault(name, {})[f"{length}"] = {
                    "hits": hits, "interval": wilson_interval(hits, args.trials), "mean_key_log_prob": log_prob,
                    "seconds": time.perf_counter() - begin}
                atomic_write(out, dumps(done, indent=2))  # strict JSON: null for a missing number
                print(f"{name}, filler {length}: {hits}/{args.trials}, key log-prob {log_prob:.2f}", flush=True)
        finally:
            linattn.hf.linear_attention = op


if __name__ == "__main__":
    main()
