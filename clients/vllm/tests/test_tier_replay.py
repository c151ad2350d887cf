"""``kvservice replay --scheduler vllm-tier``: two vLLM 0.33 schedulers, each with its own
``OffloadingConnector`` on the kvservice tier, share prefix chunks through one embedded server over
the first requests of the Mooncake sample, bytes checked (kvservice_vllm.tier_replay).

The run is deterministic (the instances step in lockstep and wait for their tier after each step),
so the counts are exact (with conftest's ``VLLM_TARGET_DEVICE=cpu``; without it vLLM's GPU prefix
cache hits 16,432 and 19,520 tokens more at admission, everything else the same); the server's pool is small enough that chunks are evicted while a
request's verdict is kept, so loads fail (and are recomputed) as well as hit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvservice.cli import main

pytestmark = pytest.mark.timeout(300)

LIMIT = 200
NUM_SERVER_BLOCKS = 65536
"""256 MiB of 4,096-byte chunks: the 200 requests write 123,978 chunks, so chunks are evicted."""

EXPECTED = {
    "A": dict(
        num_requests=96,
        hit_tokens=50688,
        hit_tokens_gpu=36592,
        hit_blocks_cpu=738,
        hit_blocks_kvservice_own=0,
        hit_blocks_cross=143,
        hit_tokens_cross=2288,
        blocks_computed=64489,
        chunks_stored=62340,
        chunks_written=62340,
        store_failures=0,
        chunks_loaded=128,
        load_failures=544,
        chunks_verified=128,
        mismatches=0,
        gpu_loads_verified=881,
        gpu_load_mismatches=0,
        num_preemptions=3,
        num_steps=7683,
    ),
    "B": dict(
        num_requests=96,
        hit_tokens=48640,
        hit_tokens_gpu=47728,
        hit_blocks_cpu=57,
        hit_blocks_kvservice_own=0,
        hit_blocks_cross=0,
        hit_tokens_cross=0,
        blocks_computed=63774,
        chunks_stored=61670,
        chunks_written=61638,
        store_failures=0,
        chunks_loaded=0,
        load_failures=2016,
        chunks_verified=0,
        mismatches=0,
        gpu_loads_verified=57,
        gpu_load_mismatches=0,
        num_preemptions=4,
        num_steps=7683,
    ),
}
"""Per instance, the counts of the run (``InstanceStats``' fields): A's hits from B's chunks come
with their bytes; the chunks evicted after their lookup fail to load (and are recomputed), never
with wrong bytes."""


def _replay(out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        ["replay", "--scheduler", "vllm-tier", "--limit", str(LIMIT), "--num-blocks", str(NUM_SERVER_BLOCKS)]
        + ["--out", str(out), *extra],
    )
    return result.exit_code, result.output


def test_the_other_instance_s_chunks_are_hits_with_their_bytes(tmp_path: Path) -> None:
    code, output = _replay(tmp_path)
    assert code == 0, output
    report = json.loads((tmp_path / "tier-report.json").read_text())
    assert report["num_requests"] == 192  # 8 of the 200 are longer than max_model_len (65,520)
    assert report["num_server_blocks"] == NUM_SERVER_BLOCKS
    got = {s["name"]: {k: s[k] for k in EXPECTED[s["name"]]} for s in report["instances"]}
    assert got == EXPECTED
    assert "the other's chunks" in output
    assert f"report: {tmp_path / 'tier-report.json'}" in output


def test_options_the_mode_does_not_read_are_refused_by_name(tmp_path: Path) -> None:
    code, output = _replay(tmp_path, "--kv-data", "shm", "--instances", "2")
    assert code == 2
    assert "leave out --instances, --kv-data" in output
    assert not (tmp_path / "tier-report.json").exists()
