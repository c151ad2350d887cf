"""Shared test helpers."""

from __future__ import annotations

import os
from pathlib import Path

# gRPC core's INFO lines (GOAWAY on server stop...) are noise in test output.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

DATA_DIR = Path(__file__).parent / "data"
VECTORS_DIR = DATA_DIR / "vectors"
