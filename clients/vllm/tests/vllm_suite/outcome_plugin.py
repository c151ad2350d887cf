"""pytest plugin: write each test's outcome (passed, failed, skipped, error) to the JSON file named
by ``KVSERVICE_VLLM_OUTCOMES`` (``scripts/vllm_tests.py`` compares two runs by them)."""

from __future__ import annotations

import json
import os

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.when == "setup" and report.outcome != "passed":
        _outcomes[report.nodeid] = "skipped" if report.skipped else "error"
    elif report.when == "call":
        _outcomes[report.nodeid] = report.outcome
    elif report.when == "teardown" and report.failed and _outcomes.get(report.nodeid) == "passed":
        _outcomes[report.nodeid] = "error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KVSERVICE_VLLM_OUTCOMES")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)
