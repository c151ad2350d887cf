"""The docs match the tree: the README's layout lists exactly the repository's parts, and no
docstring cites a design document outside the repository."""

from __future__ import annotations

import re

from tests.tooling.tools import ROOT

_LAYOUT = re.compile(r"^## Layout\n\n```\n(.*?)```", re.S | re.M)


def _layout_entries() -> list[str]:
    match = _LAYOUT.search((ROOT / "README.md").read_text())
    assert match, "README.md has no ## Layout block"
    return [line.split()[0] for line in match.group(1).splitlines() if line.strip()]


def _tree_entries() -> set[str]:
    """The parts a reader looks for: the proto tree, the client, each package and top-level
    module of kvservice, docs, scripts, each test tier and test-helper module."""
    entries = {"protos/kvservice/v1/", "clients/python/", "docs/", "scripts/"}
    for path in (ROOT / "kvservice").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            entries.add(f"kvservice/{path.name}/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            entries.add(f"kvservice/{path.name}")
    for path in (ROOT / "tests").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            entries.add(f"tests/{path.name}/")
        elif path.suffix == ".py" and path.name not in ("__init__.py", "conftest.py"):
            entries.add(f"tests/{path.name}")
    return entries


def test_the_readme_layout_lists_the_tree():
    entries = _layout_entries()
    assert len(entries) == len(set(entries)), entries
    assert set(entries) == _tree_entries()
    assert all((ROOT / entry).exists() for entry in entries)


def test_docstrings_cite_the_architecture_in_the_repo():
    """ "DESIGN, invariant N" and paths outside the repository are gone; what is cited exists."""
    outside = re.compile(r"\bDESIGN\b|\.\./shared/|shared/DESIGN")
    cited = re.compile(r"docs/ARCHITECTURE\.md §(\d+)(?:\.(\d+))?")
    architecture = (ROOT / "docs/ARCHITECTURE.md").read_text()
    bad: list[str] = []
    for base in ("kvservice", "clients/python/kvservice_client", "scripts", "tests"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if "_proto" in path.parts:
                continue
            text = path.read_text()
            for n, line in enumerate(text.splitlines(), 1):
                where = f"{path.relative_to(ROOT)}:{n}"
                if outside.search(line) and path.name != "test_docs.py":
                    bad.append(f"{where}: {line.strip()}")
                for section, rule in cited.findall(line):
                    heading = re.search(rf"^## §{section} (.+)$", architecture, re.M)
                    if heading is None:
                        bad.append(f"{where}: no §{section}")
                        continue
                    body = architecture[heading.end() :].split("\n## ", 1)[0]
                    if rule and not re.search(rf"^{rule}\. ", body, re.M):
                        bad.append(f"{where}: no rule {rule} in §{section}")
    for doc in ("README.md", "BENCHMARKS.md"):
        bad += [f"{doc}: {line}" for line in (ROOT / doc).read_text().splitlines() if outside.search(line)]
    assert bad == []
