"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
VECTORS_DIR = DATA_DIR / "vectors"
