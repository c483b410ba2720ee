"""benchmarks/mqar.py: the MQAR data are right by construction, and the script runs end to end and resumes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mqar", ROOT / "benchmarks" / "mqar.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mqar"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


mqar = _load()


@pytest.mark.parametrize(("seq_len", "pairs", "vocab"), [(32, 4, 64), (64, 16, 40), (48, 12, 256)],
                         ids=["small", "keys-nearly-exhausted", "query-region-exactly-full"])
def test_every_query_asks_a_key_of_its_own_sequence_and_is_labelled_with_its_value(
        seq_len: int, pairs: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs, labels = mqar.make_mqar(50, seq_len, pairs, vocab, generator)
    assert inputs.shape == labels.shape == (50, seq_len)
    half = vocab // 2
    for row, label in zip(inputs.tolist(), labels.tolist(), strict=True):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(0 < key < half for key in keys)  # distinct, from the key half
        assert all(half <= value < vocab for value in values)  # values from the other half
        answer = dict(zip(keys, values, strict=True))
        asked = [t for t, y in enumerate(label) if y != mqar.IGNORE]
        assert len(asked) == pairs and all(t >= 2 * pairs for t in asked)  # P queries, all after the pairs
        assert sorted(row[t] for t in asked) == sorted(keys)  # each key asked exactly once
        for t in asked:
            assert label[t] == answer[row[t]]  # the label is the queried key's value ...
            assert row[t + 1] == label[t]  # ... which is the next token
        rest = set(range(2 * pairs, seq_len)) - set(asked) - {t + 1 for t in asked}
        assert all(row[t] == 0 for t in rest)  # filler everywhere else


def test_too_many_pairs_for_the_sequence_or_the_vocabulary_is_refused() -> None:
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="pairs need"):
        mqar.make_mqar(2, 60, 16, 256, generator)  # query region of 28 tokens: 14 slots for 16 queries
    with pytest.raises(ValueError, match="pairs need"):
        mqar.make_mqar(2, 128, 16, 32, generator)  # 15 keys for 16 pairs


def test_state_size_counts_the_state_per_layer() -> None:
    def size(row: str, d_model: int, heads: int) -> int:
        return int(mqar.state_size(mqar.Setting(row, d_model, heads, 128, 16, 256, 1, 1, 1e-3, 0)))

    assert size("elu", 64, 1) == 64 * 64 and size("delta", 64, 4) == 4 * 16 * 16
    assert size("hedgehog", 64, 4) == 4 * 32 * 16  # F = 2m with m = head_dim
    assert size("softmax", 64, 4) == 2 * 128 * 64  # K and V at every position


def test_quick_run_writes_every_row_and_a_rerun_skips_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    path = tmp_path / "mqar.json"
    threads = torch.get_num_threads()
    try:
        mqar.main(["--quick", "--json", str(path), "--threads", "1", "--plot", str(tmp_path / "mqar.png")])
    finally:
        torch.set_num_threads(threads)
    results = json.loads(path.read_text())
    assert sorted(entry["row"] for entry in results.values()) == sorted(mqar.ROWS)
    for key, entry in results.items():
        assert key == mqar.Setting(**{name: entry[name] for name in mqar.Setting.__dataclass_fields__}).key
        assert 0.0 <= entry["accuracy"] <= 1.0
        assert entry["state_size"] > 0 and entry["train_seconds"] >= 0 and entry["train_loss"] > 0
    assert (tmp_path / "mqar.png").stat().st_size > 0
    first = capsys.readouterr().out
    assert f"{len(mqar.ROWS)} models, 0 already in" in first
    # a rerun trains nothing: every row is found in the file, which is left as it was
    before = path.read_text()
    stamp = os.stat(path).st_mtime_ns
    try:
        mqar.main(["--quick", "--json", str(path), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    rerun = capsys.readouterr().out
    assert f"{len(mqar.ROWS)} models, {len(mqar.ROWS)} already in" in rerun
    assert path.read_text() == before and os.stat(path).st_mtime_ns == stamp
    assert rerun.count("acc=") == 0 and rerun.count("| softmax |") == 1  # no training lines; the table again
    # --report trains nothing: a row missing from the file is left out of the table
    results.pop(next(key for key, entry in results.items() if entry["row"] == "softmax"))
    path.write_text(json.dumps(results))
    mqar.main(["--quick", "--json", str(path), "--threads", str(threads), "--report"])
    report = capsys.readouterr().out
    assert "| softmax |" not in report and report.count("| delta |") == 1 and "acc=" not in report
    assert json.loads(path.read_text()) == results
