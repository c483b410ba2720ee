"""MkDocs hooks for the documentation site (mkdocs.yml names this file under ``hooks``).

- The home page is README.md, made into ``index.md`` at build time: the README's links point at ``docs/…`` paths
  (they work on the repository's page), which become paths relative to the site's root here. Generating the page
  instead of keeping a copy in docs/ keeps one source, and keeps tests/test_docs.py from running the README's
  examples twice.
- A page added to docs/ (or docs/experiments/) that the nav does not list yet is appended to the nav's "Guide"
  (or "Experiments") section, so that a new page is published, and checked by ``--strict``, before someone places
  it; mkdocs.yml's nav is where it belongs for good.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# a Markdown link target that starts with docs/: ](docs/api.md) or ](docs/benchmarks.md#anchor)
DOCS_LINK = re.compile(r"\]\(docs/")
# where a page found in a folder goes when the nav does not list it: folder (relative to docs/) → nav section
SECTIONS = {"": "Guide", "experiments": "Experiments"}


def readme_as_home_page(text: str) -> str:
    """The README with its links to ``docs/…`` made relative to the docs folder, the site's root."""
    return DOCS_LINK.sub("](", text)


def _listed(nav: Any) -> set[str]:
    """Every page path the nav lists, at any depth."""
    found: set[str] = set()
    if isinstance(nav, str):
        found.add(nav)
    elif isinstance(nav, list):
        for item in nav:
            found |= _listed(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            found |= _listed(value)
    return found


def _section(nav: list[Any], title: str) -> list[Any]:
    for item in nav:
        if isinstance(item, dict) and title in item and isinstance(item[title], list):
            return item[title]
    section: list[Any] = []
    nav.append({title: section})
    return section


def on_config(config: Any) -> Any:
    config["watch"].append(str(README))  # `mkdocs serve` rebuilds when the README changes
    nav = config["nav"]
    if not nav:
        return config
    listed = _listed(nav)
    docs = Path(config["docs_dir"])
    for folder, title in SECTIONS.items():
        for path in sorted((docs / folder).glob("*.md")):
            page = path.relative_to(docs).as_posix()
            if page != "index.md" and page not in listed:
                _section(nav, title).append(page)
    return config


def on_files(files: Files, config: Any) -> Files:
    home = File.generated(config, "index.md", content=readme_as_home_page(README.read_text(encoding="utf-8")))
    files.append(home)
    return files
