"""The type check: mypy (pinned in the dev extra; configuration in pyproject.toml ``[tool.mypy]``)
over ``kvservice/`` and ``clients/python/kvservice_client`` (the generated stubs through their
.pyi), zero errors, no unused ``# type: ignore`` (``warn_unused_ignores``), and every ignore left
names its error code and says why."""

from __future__ import annotations

import re

from tests.tooling.tools import ROOT, run_tool

CHECKED = [ROOT / "kvservice", ROOT / "clients/python/kvservice_client"]
_IGNORE = re.compile(r"#\s*type:\s*ignore")
_JUSTIFIED = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(, [a-z-]+)*\]  # \S.*$")


def test_mypy_finds_no_error():
    result = run_tool("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found"), result.stdout


def test_every_type_ignore_names_its_code_and_a_reason():
    unjustified = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for base in CHECKED
        for path in sorted(base.rglob("*.py"))
        if "_proto" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _IGNORE.search(line) and not _JUSTIFIED.search(line)
    ]
    assert unjustified == []


def test_the_checker_is_configured_strictly_enough():
    text = (ROOT / "pyproject.toml").read_text()
    for setting in (
        "warn_unused_ignores = true",
        "warn_return_any = true",
        "disallow_untyped_defs = true",
        'enable_error_code = ["ignore-without-code"]',
    ):
        assert setting in text, setting
