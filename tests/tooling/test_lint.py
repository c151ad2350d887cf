"""Lint gate: ruff's rule set (pyproject.toml ``[tool.ruff.lint]``) over the hand-written code
(generated stubs excluded)."""

from __future__ import annotations

from tests.tooling.tools import ROOT, run_tool


def test_ruff_is_clean():
    result = run_tool("ruff", "check", "--output-format", "concise", "kvservice", "clients/python", "scripts", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_lint_covers_the_whole_tree():
    """No file of ours is excluded but the generated stubs."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'extend-exclude = ["clients/python/kvservice_client/_proto"]' in text
