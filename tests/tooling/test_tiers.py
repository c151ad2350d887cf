"""The test tiers keep their promises: CI runs the README's test command (every tier, the opt-in
ones too), a unit test starts no server, and no test file is named after who found a bug."""

from __future__ import annotations

import re

import pytest

from tests.tooling.tools import ROOT

TESTS = ROOT / "tests"
_SERVES = re.compile(
    r"grpc\.aio\.server\(|grpc\.server\(|start_server\(|start_kv_server|\bkv_server\b|kvservice\"?, \"serve"
)


def _readme_test_command() -> str:
    for line in (ROOT / "README.md").read_text().splitlines():
        if "python -m pytest" in line and line.startswith("bash scripts/setup.sh"):
            return line.split("#")[0].strip()
    raise AssertionError("README.md has no test command line")


def test_ci_runs_the_readmes_test_command():
    command = _readme_test_command()
    assert "--run-slow" in command  # the opt-in tiers too: CI runs everything
    assert command in (ROOT / ".ci/run").read_text().splitlines()


@pytest.mark.parametrize("path", sorted((TESTS / "unit").glob("*.py")), ids=lambda p: p.name)
def test_a_unit_test_starts_no_server(path):
    assert [line.strip() for line in path.read_text().splitlines() if _SERVES.search(line)] == []


def test_every_test_file_is_in_a_tier():
    tiers = {"unit", "tooling", "service", "e2e", "bench"}
    stray = [
        p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py") if p.relative_to(TESTS).parts[0] not in tiers
    ]
    assert stray == []


def test_no_test_file_is_named_after_who_found_the_bug():
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert [n for n in names if re.search(r"review|finding|tester|reported", n)] == []
