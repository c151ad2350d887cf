"""A quick run of the benchmark harness, so it cannot rot (no figure is checked: speed lives in
scripts/bench/ and BENCHMARKS.md, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_harness_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/bench/run.py"),
            "--quick",
            "--no-vllm",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "scaling.png"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    benches = {row["bench"] for row in data["rows"]}
    assert benches == {"core", "hashing", "rpc", "events", "memory", "scaling"}
    assert all(row["value"] is not None and row["value"] == row["value"] for row in data["rows"])  # no NaN
    assert "vLLM not installed: skipped" in {row["baseline"] for row in data["rows"] if row["bench"] == "core"}
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
