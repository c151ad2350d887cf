"""Shared test helpers, and the tiers.

Each test directory is a tier, marked by its name (select one with ``-m``):

* ``unit``: no server, no subprocess that serves; the core, the client's pure parts, the replay's
  readers and report. ``pytest tests/unit`` runs in well under a minute.
* ``tooling``: the lint, the type check and (after the format commit) the formatter.
* ``service``: a real server on port 0 (or a scripted grpc.aio servicer) driven by the client.
* ``e2e``: the CLI and the replay as a user runs them (real processes, real traces).
* ``bench``: the benchmark harness's quick run.

Tests marked ``slow`` and the ``bench`` tier are opt-in: they run with ``--run-slow`` (the
README's test command, which CI runs, passes it) and are skipped otherwise.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

# gRPC core's INFO lines (GOAWAY on server stop...) are noise in test output.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

DATA_DIR = Path(__file__).parent / "data"
VECTORS_DIR = DATA_DIR / "vectors"

TIERS = ("unit", "tooling", "service", "e2e", "bench")
OPT_IN = ("slow", "bench")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the opt-in tests (marked slow, and the bench tier)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow")
    skip = pytest.mark.skip(reason="opt-in (slow or bench): run with --run-slow")
    for item in items:
        parts = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts
        if parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        if not run_slow and any(item.get_closest_marker(name) for name in OPT_IN):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """``kvservice serve`` (run in-process by CLI tests) configures the root logger for the
    process; put its handlers and level back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
