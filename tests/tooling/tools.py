"""Running the pinned dev tools (ruff, mypy) of the venv the tests run in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool_path(name: str) -> str:
    """The tool beside this interpreter (the venv's), else on PATH; skips the test without it."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name) or (str(ROOT / ".venv/bin" / name) if (ROOT / ".venv/bin" / name).exists() else None)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``name args`` in the repository root."""
    return subprocess.run([tool_path(name), *args], cwd=ROOT, capture_output=True, text=True)
