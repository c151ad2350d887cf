"""The data-plane benchmark runs end to end (a smoke run: figures are not checked, they live in
BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "data_plane_bench.py"


def test_the_bench_prints_its_four_rows():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--gib", "0.02", "--rounds", "1", "--view-blocks", "50"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["baseline"] for r in rows] == [
        "bare gRPC client stream of bytes",
        "bare gRPC server stream of bytes",
        "bare gRPC server, same transfers",
        "torch copy into a local tensor",
    ]
    assert all(r["value"] > 0 and r["baseline_value"] > 0 for r in rows if "RssAnon" not in r["figure"])
