"""The documentation site's build hooks (scripts/docs_hooks.py) and docstring rewriting (scripts/griffe_docstrings.py).

The site itself is built with ``--strict`` by ``make test``; these tests pin what the two scripts do to the text,
on the real README, docs/ and linattn sources. They need the ``docs`` extra (mkdocs, griffe) and skip without it.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_script_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    pytest.importorskip("mkdocs", reason="needs the docs extra")
    return _script("docs_hooks")


@pytest.fixture(scope="module")
def rewriting() -> ModuleType:
    pytest.importorskip("griffe", reason="needs the docs extra")
    return _script("griffe_docstrings")


@pytest.fixture(scope="module")
def linattn_api(rewriting: ModuleType):
    """linattn as griffe reads it (statically, from src/), with the extension applied."""
    import griffe

    extension = rewriting.SphinxRolesAndDoctests(pages=str(ROOT / "docs" / "reference"))
    return griffe.load("linattn", search_paths=[str(ROOT / "src")], extensions=griffe.Extensions(extension))


def test_home_page_links_resolve_in_the_docs_folder(hooks: ModuleType):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    home = hooks.readme_as_home_page(readme)
    targets = [t for t in LINK.findall(home) if not t.startswith(("http://", "https://", "#", "mailto:"))]
    assert any(t.startswith("api.md") for t in targets)  # the README links docs/api.md
    missing = [t for t in targets if not (ROOT / "docs" / t.split("#")[0]).is_file()]
    assert not missing, f"README links that would not resolve on the site's home page: {missing}"
    assert "](https://" not in readme or "](https://" in home  # external links untouched


def test_pages_missing_from_the_nav_are_appended(hooks: ModuleType, tmp_path: Path):
    for page in ("index.md", "listed.md", "new.md", "experiments/listed_run.md", "experiments/new_run.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# page\n", encoding="utf-8")
    nav = [{"Home": "index.md"}, {"Guide": ["listed.md"]}, {"Experiments": [{"Run": "experiments/listed_run.md"}]}]
    config = {"nav": nav, "docs_dir": str(tmp_path), "watch": []}
    hooks.on_config(config)
    assert config["nav"][1] == {"Guide": ["listed.md", "new.md"]}
    assert config["nav"][2] == {"Experiments": [{"Run": "experiments/listed_run.md"}, "experiments/new_run.md"]}
    assert config["watch"] == [str(ROOT / "README.md")]


def test_roles_become_links_or_code(linattn_api, rewriting: ModuleType):
    decode = linattn_api["decode"].docstring.value
    assert ":class:`" not in decode and ":func:`" not in decode
    # a name relative to the module resolves to the object it names
    assert ('<autoref identifier="linattn.kinds.additive.step.DecodeStep" optional><code>DecodeStep</code></autoref>'
            in decode)
    module = linattn_api["measure"]
    collection = linattn_api.modules_collection
    text = rewriting.rewrite(module, collection, "See :func:`linattn.linear_attention` and :class:`~torch.Tensor`.")
    assert text == (
        'See <autoref identifier="linattn.linear_attention" optional><code>linattn.linear_attention</code></autoref>'
        " and <code>Tensor</code>."
    )


def test_a_reference_to_no_linattn_object_is_reported(linattn_api, rewriting: ModuleType, caplog):
    module, collection = linattn_api["measure"], linattn_api.modules_collection
    with caplog.at_level(logging.WARNING, logger="griffe"):
        text = rewriting.rewrite(module, collection, "See :func:`linattn.no_such_function`.")
    assert text == "See <code>linattn.no_such_function</code>."
    assert any("linattn.no_such_function" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="griffe"):
        rewriting.rewrite(module, collection, "See :func:`linattn.no_such_function`.", checked=False)
    assert not caplog.records


def test_doctest_lines_become_a_code_block(linattn_api):
    text = linattn_api["nn"].docstring.value
    lines = text.splitlines()
    start = lines.index("```pycon")
    assert lines[start + 1].startswith(">>> import torch")
    end = lines.index("```", start + 1)
    assert all(not line.startswith(">>>") for line in lines[end + 1 :])


def test_grouped_parameters_are_split_and_match_the_signature(linattn_api):
    function = linattn_api["train.distill.fit_feature_map"]
    sections = function.docstring.parse("google")
    names = [p.name for s in sections if s.kind.value == "parameters" for p in s.value]
    assert {"causal", "scale", "steps", "lr", "window", "sinks"} <= set(names)
    assert not [name for name in names if "," in name]
    assert set(names) <= {parameter.name for parameter in function.parameters}
