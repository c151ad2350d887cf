"""The docs match the tree: the README's layout lists exactly the repository's parts, and no
docstring cites a design document outside the repository."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.tooling.tools import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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


# --- the README's first screen, its links and its install lines -------------------------------

DOC_PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(text: str) -> list[str]:
    return re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", text), re.M)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_readme_opens_with_what_it_is_when_to_run_it_and_a_quickstart():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250
    assert lines[2:6] == [
        "```bash",
        next(line for line in lines if line.startswith("bash scripts/setup.sh && .venv/bin/kvservice replay")),
        next(line for line in lines if line.startswith("bash scripts/setup.sh && .venv/bin/python -m pytest")),
        "```",
    ]
    sections = re.findall(r"^## (.+)$", _FENCE.sub("", text), re.M)
    assert sections[:3] == ["When a team runs it", "Quickstart (five minutes)", "Install"]
    when = text.split("## When a team runs it", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\* \*\*(.+?)\*\*", when, re.M) == [
        "With vLLM",
        "With a KV-aware router",
        "As a shared prefix tier",
    ]


def test_every_docs_page_is_one_link_from_the_readme():
    linked = {target.split("#")[0] for target in _LINK.findall(_FENCE.sub("", (ROOT / "README.md").read_text()))}
    assert [page for page in DOC_PAGES if page not in linked] == []


@pytest.mark.parametrize("doc", ["README.md", *DOC_PAGES])
def test_every_relative_link_resolves_to_a_file_and_heading(doc):
    source = ROOT / doc
    bad = []
    for target in _LINK.findall(_FENCE.sub("", source.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in {_slug(h) for h in _headings(file.read_text())}:
            bad.append(f"{target}: no such heading in {file.relative_to(ROOT)}")
    assert bad == []


def _pip_install_lines() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every ``pip install`` written in the README and docs/."""
    found = []
    for doc in ["README.md", *DOC_PAGES]:
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            for command in re.findall(r"pip install ([^`#\n]+)", line):
                found.append((f"{doc}:{n}", shlex.split(command.split(" from ")[0].split(" (")[0])))
    return found


def _extras(directory: str) -> set[str]:
    return set(tomllib.loads((ROOT / directory / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_install_lines_name_a_checkout_path_and_extras_that_exist():
    """The packages are not on an index: ``pip install 'kvservice[otel]'`` fails outside the
    checkout, so every line installs from a path (``.`` or ``./clients/python``)."""
    packages = {".": _extras("."), "./clients/python": _extras("clients/python")}
    lines = _pip_install_lines()
    assert len(lines) >= 5
    bad = []
    for where, args in lines:
        for arg in args:
            path, _, extras = arg.partition("[")
            if path not in packages:
                bad.append(f"{where}: {arg} is not a path in the checkout")
            elif extras and not set(extras.rstrip("]").split(",")) <= packages[path]:
                bad.append(f"{where}: {arg} names an extra {path}/pyproject.toml does not have")
    assert bad == []


@pytest.mark.slow
def test_install_lines_resolve_as_written():
    """pip itself resolves each line (dry run, no index: the dev venv holds every dependency)."""
    for where, args in sorted({(w, tuple(a)) for w, a in _pip_install_lines()}, key=lambda item: item[1]):
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "-q", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and "does not provide the extra" not in result.stderr, (where, result.stderr)
