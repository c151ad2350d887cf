"""Shared test helpers."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

# gRPC core's INFO lines (GOAWAY on server stop...) are noise in test output.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

DATA_DIR = Path(__file__).parent / "data"
VECTORS_DIR = DATA_DIR / "vectors"


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """``kvservice serve`` (run in-process by CLI tests) configures the root logger for the
    process; put its handlers and level back after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
