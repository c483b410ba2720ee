"""`linattn bench --model NAME --linearized DIR`: a linearized model against its original, side by side — every
context measured for both, the ratios computed from the rows, the files written, bad input refused."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from linattn import LinearAttentionError  # noqa: E402
from linattn.linearized import speed  # noqa: E402
from test_linearized import fitted_dir, tiny_base  # noqa: E402, F401  (fixtures)


def test_the_bench_times_both_models_at_every_context_and_writes_the_ratios(fitted_dir, tmp_path):  # noqa: F811
    from linattn.cli import main

    folder, _, _ = fitted_dir
    base = json.loads((folder / "linattn.json").read_text())["base"]["model"]
    out = tmp_path / "bench"
    assert main(["bench", "--model", base, "--linearized", str(folder), "--contexts", "40", "12", "--new-tokens",
                 "3", "--rounds", "2", "--out", str(out), "--no-plot"]) == 0
    result = json.loads((out / "bench_model.json").read_text())
    rows = result["rows"]
    assert sorted((row["model"], row["context"]) for row in rows) == [
        ("linearized", 12), ("linearized", 40), ("original", 12), ("original", 40)]
    assert all(len(row["prefill_ms_all"]) == 2 and row["prefill_ms"] > 0 and row["decode_tokens_per_second"] > 0
               and row["peak_prefill_bytes"] > 0 for row in rows)
    by = {(row["model"], row["context"]): row for row in rows}
    for entry in result["summary"]:  # each ratio is the rows' own
        n = entry["context"]
        assert entry["prefill_speedup"] == pytest.approx(by["original", n]["prefill_ms"] / by["linearized", n]
                                                         ["prefill_ms"])
        assert entry["decode_speedup"] == pytest.approx(by["linearized", n]["decode_tokens_per_second"]
                                                        / by["original", n]["decode_tokens_per_second"])
    # the softmax cache grows with the context, the linear state does not
    assert by["original", 40]["cache_bytes"] > by["original", 12]["cache_bytes"]
    assert by["linearized", 40]["cache_bytes"] == by["linearized", 12]["cache_bytes"]
    assert (out / "bench_model.csv").read_text().count("\n") == 5


def test_prompts_repeat_the_long_text_to_any_length(fitted_dir):  # noqa: F811
    _, _, tokenizer = fitted_dir
    ids = speed.prompt_ids(tokenizer, 30_000)  # the text is shorter: repeated
    assert ids.shape == (1, 30_000) and ids[0, :5].tolist() == speed.prompt_ids(tokenizer, 5)[0].tolist()


def test_bad_bench_arguments_are_refused(fitted_dir, tmp_path, capsys):  # noqa: F811
    from linattn.cli import main

    folder, _, _ = fitted_dir
    base = json.loads((folder / "linattn.json").read_text())["base"]["model"]
    assert main(["bench", "--model", base, "--contexts", "0", "--out", str(tmp_path)]) == 2
    assert "--contexts/--new-tokens/--rounds: need ≥ 1" in capsys.readouterr().err
    assert main(["bench", "--model", base, "--out", str(tmp_path)]) == 2  # no folder ships for a local model
    assert "no linearized folder ships for it; pass --linearized DIR" in capsys.readouterr().err
    with pytest.raises(LinearAttentionError):
        speed.prompt_ids(type("T", (), {"__call__": lambda self, text: {"input_ids": []}})(), 4)


def test_the_floor_is_the_original_without_attention_and_bounds_the_ratios(fitted_dir, tmp_path):  # noqa: F811
    """--floor: a third row per context, the original whose attention returns each query's own value (so a token's
    output does not depend on the others: the last position of a prompt equals that token alone at its position,
    which is how the floor decodes without a cache), and bound columns computed from the rows."""
    import torch

    from linattn.cli import main
    from linattn.evaluate import load_model

    folder, _, tokenizer = fitted_dir
    base = json.loads((folder / "linattn.json").read_text())["base"]["model"]
    floor = speed.floor_model(base)
    ids = speed.prompt_ids(tokenizer, 20)
    with torch.no_grad():
        whole = floor(input_ids=ids, use_cache=False).logits[0, -1]
        alone = floor(input_ids=ids[:, -1:], position_ids=torch.tensor([[19]]), use_cache=False).logits[0, -1]
        original = load_model(base, causal_lm=True)[0](input_ids=ids).logits[0, -1]
    torch.testing.assert_close(alone, whole, rtol=1e-5, atol=1e-5)  # one token's rows, two matmul shapes
    assert not torch.allclose(original, whole, atol=1e-2)  # the attention is really taken out
    out = tmp_path / "bench"
    assert main(["bench", "--model", base, "--linearized", str(folder), "--contexts", "24", "--new-tokens", "3",
                 "--rounds", "1", "--out", str(out), "--no-plot", "--no-memory", "--floor"]) == 0
    result = json.loads((out / "bench_model.json").read_text())
    by = {row["model"]: row for row in result["rows"]}
    assert set(by) == {"original", "linearized", "floor"} and by["floor"]["cache_bytes"] == 0
    bound = result["summary"][0]["bound"]
    assert bound["prefill_speedup"] == pytest.approx(by["original"]["prefill_ms"] / by["floor"]["prefill_ms"])
    assert bound["decode_speedup"] == pytest.approx(by["floor"]["decode_tokens_per_second"]
                                                    / by["original"]["decode_tokens_per_second"])


def test_same_linears_times_the_original_with_the_linearized_models_linear_layers(fitted_dir, tmp_path):  # noqa: F811
    """--same-linears: a row of the original whose nn.Linear layers are the linearized model's TokenLinear (the
    same logits as the original up to rounding), and the attention's own ratios computed from it; the linearized
    model and the floor run the same layers, the original does not."""
    import torch

    from linattn.cli import main
    from linattn.evaluate import load_model
    from linattn.linearized.folder import load_linearized
    from linattn.nn.token_linear import TokenLinear

    folder, _, tokenizer = fitted_dir
    base = json.loads((folder / "linattn.json").read_text())["base"]["model"]
    lean, original = speed.same_linears_model(base), load_model(base, causal_lm=True)[0]

    def kinds(model: torch.nn.Module) -> set[type]:
        return {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    assert kinds(lean) == {TokenLinear} and kinds(speed.floor_model(base)) == {TokenLinear}
    assert kinds(load_linearized(folder, base=base)[0]) == {TokenLinear} and kinds(original) == {torch.nn.Linear}
    ids = speed.prompt_ids(tokenizer, 9)
    with torch.no_grad():  # a decoding-sized call (one token after the prompt, no cache: a 1-row product)
        for model in (lean, original):
            model.config.use_cache = False
        step = [model(input_ids=ids[:, -1:], position_ids=torch.tensor([[8]])).logits for model in (lean, original)]
    torch.testing.assert_close(step[0], step[1], rtol=1e-5, atol=1e-5)  # the order of the sums alone differs
    out = tmp_path / "bench"
    assert main(["bench", "--model", base, "--linearized", str(folder), "--contexts", "24", "--new-tokens", "3",
                 "--rounds", "1", "--out", str(out), "--no-plot", "--no-memory", "--same-linears"]) == 0
    result = json.loads((out / "bench_model.json").read_text())
    by = {row["model"]: row for row in result["rows"]}
    assert set(by) == {"original", "linearized", speed.SAME_LINEARS} and result["meta"]["same_linears"]
    same = result["summary"][0]["same_linears"]
    assert same["decode_speedup"] == pytest.approx(by["linearized"]["decode_tokens_per_second"]
                                                   / by[speed.SAME_LINEARS]["decode_tokens_per_second"])
    assert same["prefill_speedup"] == pytest.approx(by[speed.SAME_LINEARS]["prefill_ms"]
                                                    / by["linearized"]["prefill_ms"])
    assert "same linears: prefill / decode" in speed.table(result["summary"])
