"""pytest plugin: write each test's outcome (passed, failed, skipped, error) to the file named by
``KVSERVICE_VLLM_OUTCOMES`` (``scripts/vllm_tests.py`` compares two runs by them).

One JSON object a line, ``{"nodeid": ..., "outcome": ...}``, appended and flushed as each phase
reports (a later line for the same test replaces an earlier one): a run killed part way (the
script's time bound) still leaves what it did. A test that starts is written ``started`` first,
so the one a killed run was in reads ``started``.
"""

from __future__ import annotations

import json
import os
from typing import IO

_outcomes: dict[str, str] = {}
_file: IO[str] | None = None


def _write(nodeid: str, outcome: str) -> None:
    global _file
    _outcomes[nodeid] = outcome
    path = os.environ.get("KVSERVICE_VLLM_OUTCOMES")
    if not path:
        return
    if _file is None:
        _file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for the session
    _file.write(json.dumps({"nodeid": nodeid, "outcome": outcome}) + "\n")
    _file.flush()


def pytest_runtest_logstart(nodeid, location):
    _write(nodeid, "started")


def pytest_runtest_logreport(report):
    if report.when == "setup" and report.outcome != "passed":
        _write(report.nodeid, "skipped" if report.skipped else "error")
    elif report.when == "call":
        _write(report.nodeid, report.outcome)
    elif report.when == "teardown" and report.failed and _outcomes.get(report.nodeid) == "passed":
        _write(report.nodeid, "error")


def pytest_sessionfinish(session, exitstatus):
    if _file is not None:
        _file.close()
