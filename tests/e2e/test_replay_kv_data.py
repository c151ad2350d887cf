"""``replay --kv-data``: real block contents through an embedded server whose pool evicts and reuses.

The worker writes every newly computed block (content = a function of its hash and layer) and, at
every admission, reads the hit's blocks back and compares them: through the attached shared memory
(``shm``) or WriteBlocks / ReadBlocks (``grpc``). A test double that answers a hit with a wrong
block id makes the check fail, so the check can fail.
"""

from __future__ import annotations

import pytest

from kvservice.replay.runner import ModeRun, ReplayConfig, run_replay
from kvservice_client.client import AsyncKVCacheClient

pytestmark = pytest.mark.slow

# qwen-2.5-0.5b (196,608 bytes per 16-token block), 1,024 blocks: 201 MB of shared memory, and the
# first 20 requests of the trace need more, so blocks are evicted and reused (and requests preempted).
SMALL = {
    "preset": "qwen-2.5-0.5b",
    "num_blocks": 1024,
    "device": "cpu",
    "limit": 20,
    "report_modes": ("full",),
    "show_progress": False,
    "late_watcher": False,
}


async def _replay(**overrides) -> tuple[dict, ModeRun]:
    runs: list[ModeRun] = []
    report = await run_replay(ReplayConfig(**{**SMALL, **overrides}), runs=runs)
    [mode] = report.modes
    return mode.kv_data, runs[0]


@pytest.mark.parametrize("kv_data", ["shm", "grpc"])
async def test_every_hit_block_holds_its_hashs_content(kv_data):
    stats, run = await _replay(kv_data=kv_data)
    assert run.stats.num_preemptions > 0  # the pool was under pressure: blocks were evicted and reused
    assert stats["mode"] == kv_data and stats["mismatches"] == 0
    assert stats["blocks_checked"] >= 2000
    assert stats["bytes_read"] == stats["blocks_checked"] * 196_608
    assert stats["bytes_written"] == stats["blocks_written"] * 196_608 and stats["blocks_written"] > 1024
    assert stats["write_gbps"] > 0 and stats["read_gbps"] > 0


async def test_a_hit_answered_with_a_wrong_block_id_is_caught(monkeypatch):
    real_step = AsyncKVCacheClient.step
    num_corrupted = 0

    async def step_with_wrong_hit_ids(self, request, **kwargs):
        """The service's answer, except that an admission's first hit block id is off by one."""
        nonlocal num_corrupted
        response = await real_step(self, request, **kwargs)
        kinds = [op.WhichOneof("op") for op in request.ops]
        if kinds == ["get_computed_blocks", "allocate_slots"]:
            hit = response.results[1].allocate_slots.computed_block_ids
            if hit and hit[0].block_ids:
                hit[0].block_ids[0] = hit[0].block_ids[0] % 1022 + 1
                num_corrupted += 1
        return response

    monkeypatch.setattr(AsyncKVCacheClient, "step", step_with_wrong_hit_ids)
    stats, _run = await _replay(kv_data="shm")
    assert num_corrupted > 0
    assert stats["mismatches"] == num_corrupted


_COUNTS = ("blocks_written", "blocks_checked", "mismatches", "reads_before_written", "reads_never_written")


async def test_a_worker_behind_its_scheduler_reads_no_bytes_that_were_never_written():
    """``kv_data_lag``: the worker writes a step's blocks one (three) steps late, as an asynchronous
    worker can. Hits then come before their bytes: over gRPC the server refuses those reads (a read
    it served would have to be the hash's bytes, else a mismatch), and both modes check them once
    written; with three steps some requests are freed before their blocks are written: shm drops
    those writes, gRPC sends them and the server refuses every one (naming their old allocation),
    and hits on those blocks are never compared with old bytes. Both modes count the same."""
    by_mode = {}
    for kv_data in ("shm", "grpc"):
        one, _run = await _replay(kv_data=kv_data, kv_data_lag=1)
        three, _run = await _replay(kv_data=kv_data, kv_data_lag=3)
        by_mode[kv_data] = (one, three)
        assert one["mismatches"] == three["mismatches"] == 0
        assert one["reads_before_written"] > 0 and one["writes_after_free"] == 0
        assert three["writes_after_free"] > 0 and three["reads_never_written"] > 0
    for lag in (0, 1):
        shm, grpc = by_mode["shm"][lag], by_mode["grpc"][lag]
        assert {k: shm[k] for k in (*_COUNTS, "writes_after_free")} == {
            k: grpc[k] for k in (*_COUNTS, "writes_after_free")
        }
