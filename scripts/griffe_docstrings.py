"""A griffe extension (mkdocs.yml loads it for mkdocstrings): linattn's docstrings as the site renders them.

The docstrings are written for ``help()`` and for reading in the source: Google-style sections, Sphinx roles for
cross-references (:func:`linattn.linear_attention`) and doctest lines (``>>>``) in the running text. Rendered as
Markdown unchanged, a role shows its markup and a doctest line becomes a quotation. Before the docstrings are
parsed, this extension rewrites, in the text mkdocstrings renders (the source files are not touched):

- a role whose target is a linattn object → a link to that object's reference entry where one is rendered, its
  name as code otherwise (private modules have no page); a target that names no linattn object at all (a typo, a
  renamed function) in a docstring that the reference renders is reported as a warning, so ``mkdocs build
  --strict`` fails on it;
- a role naming anything else (torch, transformers) → the name as code;
- each run of doctest lines → a fenced ``pycon`` code block;
- a Google-style parameter entry that documents several parameters at once (``eps, min_denom: ...``) → one entry
  per parameter, each with the shared description, so that griffe can match every name against the signature.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(func|class|mod|meth|attr|data|obj|exc):`(~?)([^`\n]+)`")
FENCE = re.compile(r"^\s*```")
SECTION = re.compile(r"^(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
# a parameter entry naming several parameters: "    name, other, third: description"
GROUPED = re.compile(r"^(?P<indent>\s+)(?P<names>\*{0,2}\w+(?:,\s*\*{0,2}\w+)+):(?P<rest>.*)$")

# the objects each reference page renders: "::: linattn.decode" lines
DIRECTIVE = re.compile(r"^:::\s*(\S+)", re.MULTILINE)


def _exists(collection: Any, path: str) -> bool:
    try:
        collection.get_member(path)
    except Exception:  # missing, or an alias to a module griffe did not load
        return False
    return True


def _resolve(obj: griffe.Object, collection: Any, target: str) -> str | None:
    """The full path of a role's target as seen from ``obj`` (relative names as Python would see them), or None."""
    target = target.lstrip(".")
    head, _, rest = target.partition(".")
    candidates = [target]
    try:
        resolved = obj.resolve(head)
    except Exception:  # NameResolutionError: not a name in scope
        resolved = None
    if resolved:
        candidates.insert(0, f"{resolved}.{rest}" if rest else resolved)
    for candidate in candidates:
        if _exists(collection, candidate):
            return candidate
    return None


def _roles(obj: griffe.Object, collection: Any, line: str, where: str | None) -> str:
    def replace(match: re.Match[str]) -> str:
        short, target = match[2] == "~", match[3].strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        code = f"<code>{shown}</code>"
        path = _resolve(obj, collection, target)
        if path is None:
            if where is not None and (target == "linattn" or target.startswith("linattn.")):
                griffe.logger.warning(f"{where}: the reference {match[0]} names no linattn object")
            return code
        if not (path == "linattn" or path.startswith("linattn.")):
            return code
        return f'<autoref identifier="{path}" optional>{code}</autoref>'

    return ROLE.sub(replace, line)


def rewrite(obj: griffe.Object, collection: Any, text: str, *, checked: bool = True) -> str:
    """The docstring ``text`` of ``obj`` with roles, doctest runs and grouped parameters rewritten (module doc);
    ``checked``: report roles whose linattn target does not exist."""
    where = f"{obj.relative_filepath}:{obj.docstring.lineno if obj.docstring else 0}" if checked else None
    lines = text.splitlines()
    out: list[str] = []
    in_fence = in_params = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        if in_fence:
            out.append(line)
            i += 1
            continue
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        if SECTION.match(line):
            in_params = True
        elif line and not line[0].isspace():
            in_params = False
        grouped = GROUPED.match(line) if in_params else None
        if grouped:
            indent = grouped["indent"]
            entry = [f"{grouped['rest']}"]  # the description: this line's rest and its more-indented continuation
            i += 1
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
                entry.append(lines[i])
                i += 1
            for name in grouped["names"].split(","):
                out.append(f"{indent}{name.strip()}:{_roles(obj, collection, entry[0], where)}")
                out.extend(_roles(obj, collection, more, where) for more in entry[1:])
            continue
        out.append(_roles(obj, collection, line, where))
        i += 1
    return "\n".join(out)


def _target(obj: Any) -> Any:
    try:
        return obj.final_target if obj.is_alias else obj
    except Exception:  # an alias to an object outside the loaded package (torch, transformers)
        return None


def rendered(collection: Any, roots: list[str]) -> set[str]:
    """Paths of the objects whose docstrings the reference may render: each root and its public members, at any
    depth, aliases followed to the object they name (an over-approximation: checking more never hides a fault)."""
    found: set[str] = set()

    def visit(obj: Any) -> None:
        obj = _target(obj)
        if obj is None or obj.path in found or not obj.path.startswith("linattn"):
            return
        found.add(obj.path)
        for name, member in obj.members.items():
            if not name.startswith("_") and (not obj.is_module or _public(obj, name)):
                visit(member)

    for root in roots:
        if _exists(collection, root):
            visit(collection.get_member(root))
    return found


def _public(module: Any, name: str) -> bool:
    exports = module.exports
    return name in exports if exports is not None else not module.members[name].is_alias


class SphinxRolesAndDoctests(griffe.Extension):
    """Rewrites every docstring of a package once the whole package is loaded (names resolve across modules).

    Args:
        pages: the folder of the reference pages (relative to the working directory, the repository root): the
            objects their ``::: name`` lines render, and those objects' members, are the docstrings whose
            references are checked. Other docstrings (private modules) are rewritten without the check.
    """

    def __init__(self, pages: str = "docs/reference") -> None:
        super().__init__()
        texts = [page.read_text(encoding="utf-8") for page in Path(pages).glob("**/*.md")]
        self.roots = sorted({name for text in texts for name in DIRECTIVE.findall(text)})

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        collection = loader.modules_collection
        checked = rendered(collection, self.roots)
        seen: set[str] = set()

        def visit(obj: griffe.Object) -> None:
            if obj.path in seen:
                return
            seen.add(obj.path)
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, collection, obj.docstring.value, checked=obj.path in checked)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)  # type: ignore[arg-type]

        visit(pkg)
