"""The replay's ``--kv-data`` worker (``kvservice.replay.kv_data``) when a hit comes before its
block's bytes are written: vLLM registers a block's hash at allocation, so a request admitted in the
same step as the one computing its prefix hits blocks the worker writes only at the step's flush.

The server here (qwen-2.5-0.5b at block size 4, 16 blocks) first holds an old tenant's bytes in
blocks 1..3, so a read that returned them would be a mismatch.
"""

from __future__ import annotations

import pytest

from kvservice.replay.kv_data import KVDataWorker
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.data import awrite_blocks
from kvservice_client.torch_view import aattach

PROMPT = list(range(1, 13))  # 3 full blocks of 4 tokens
CPU = {"device": "cpu"}


async def _admit(client: AsyncKVCacheClient, request_id: str, prompt: list[int]):
    await client.get_computed_blocks(request_id, prompt)
    response = await client.allocate_slots(request_id, len(prompt))
    assert response.allocated
    return response


async def _old_tenant(client: AsyncKVCacheClient, block_bytes: int) -> None:
    old = await _admit(client, "old", [7000 + i for i in range(12)])
    await awrite_blocks(client, "old", [(0, b, bytes([b]) * block_bytes) for b in (1, 2, 3)], allocation=old)
    await client.free("old")
    await _admit(client, "filler", [8000 + i for i in range(60)])  # the whole pool: 1..3 lose their hashes
    await client.free("filler")


@pytest.mark.parametrize("mode", ["grpc", "shm"])
async def test_a_hit_before_its_blocks_are_written_is_counted_and_checked_after_the_writes(
    start_kv_server, connect, mode
):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    metadata = await client.get_kv_cache_group_metadata()
    await _old_tenant(client, metadata.groups[0].bytes_per_block)
    view = await aattach(client) if mode == "shm" else None
    worker = KVDataWorker(mode, client, metadata, view=view)
    a = await _admit(client, "a", PROMPT)  # computes 1, 2, 3 (their hashes registered now)
    assert [list(g.block_ids) for g in a.new_block_ids] == [[1, 2, 3]]
    worker.admitted("a", PROMPT, a)
    b = await _admit(client, "b", PROMPT[:8] + [90, 91, 92, 93])  # the same step: hits 1, 2 before a's bytes
    assert [list(g.block_ids) for g in b.computed_block_ids] == [[1, 2]]
    worker.admitted("b", PROMPT[:8] + [90, 91, 92, 93], b)
    written = [1, 2, 3, *b.new_block_ids[0].block_ids]
    state = running.servicer.data_plane.byte_state
    assert [state[x] for x in written] == [0, 0, 0, 0]  # nothing written yet
    await worker.flush()
    stats = worker.stats.to_dict()
    assert {k: stats[k] for k in ("blocks_written", "blocks_checked", "mismatches", "reads_before_written")} == {
        "blocks_written": 4,
        "blocks_checked": 2,
        "mismatches": 0,
        "reads_before_written": 2,
    }
    assert stats["reads_never_written"] == 0
    # grpc wrote through WriteBlocks, shm through the memory and then marked them: final either way.
    assert [state[x] for x in written] == [2, 2, 2, 2]
    # A later admission hitting all three reads them as written: checked, matched.
    c = await _admit(client, "c", PROMPT + [5])
    worker.admitted("c", PROMPT + [5], c)
    await worker.flush()
    assert (worker.stats.blocks_checked, worker.stats.mismatches, worker.stats.reads_before_written) == (5, 0, 2)
