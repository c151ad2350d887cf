"""Snapshot streams whose clients stop reading mid-snapshot do not hold the others (issue 15): with
a byte budget that fits one part, two such streams block a write each, and another client's
snapshot still completes while they are open (``ByteBudget.hold_s``: a write stops counting after
0.5 s); the stalled streams are then cut by ``stalled_write_timeout_s`` and leave nothing behind.

A real server on port 0, the generated client; the stalled clients turn off HTTP/2 BDP probing so
their flow-control window stays at 64 KiB, far below the snapshot. Nothing is timed: each step
waits on the thing (the bound on the cut is what makes "before they are cut" observable).
"""

from __future__ import annotations

import grpc
import pytest

from kvservice_client.client import KVServiceError, StepBuilder
from kvservice_client.events import BlockStored
from tests.service.helpers import events_of, next_batch, pool_hashes, server_state, wait_until
from tests.service.test_snapshot_cost import read_snapshot

pytestmark = pytest.mark.timeout(120)

NUM_REQUESTS = 160
PROMPT_TOKENS = 256  # 16 blocks of 16 tokens per request: 2,560 cached blocks, about 0.5 MB of snapshot
PART_TOKENS = 2048
STALLED_WRITE_TIMEOUT_S = 8.0
NUM_STALLED = 2


async def test_streams_that_stop_reading_mid_snapshot_do_not_hold_another_snapshot_until_they_are_cut(
    start_kv_server, connect
):
    running = await start_kv_server(
        block_size=16,
        num_blocks=NUM_REQUESTS * PROMPT_TOKENS // 16 + 16,
        max_model_len=PROMPT_TOKENS,
        snapshot_part_tokens=PART_TOKENS,
        max_snapshot_bytes_in_flight=1024,  # below one part: a part goes alone, so parts take turns
        max_snapshot_bytes_stalled=1 << 20,  # room for both stalled parts (the default is 16 x the budget)
        stalled_write_timeout_s=STALLED_WRITE_TIMEOUT_S,
        max_step_ops=96,
    )
    scheduler = await connect(running)
    for first in range(0, NUM_REQUESTS, 32):  # token ids near 2^30: 5 bytes each in msgpack
        step = StepBuilder()
        for r in range(first, first + 32):
            step.get_computed_blocks(f"r{r}", [2**30 + r * PROMPT_TOKENS + t for t in range(PROMPT_TOKENS)])
            step.allocate_slots(f"r{r}", PROMPT_TOKENS).free(f"r{r}")
        assert all(result.WhichOneof("result") != "error" for result in (await scheduler.step(step)).results)
    before = server_state(running)
    log, budget = running.event_log, running.snapshots.budget
    head = log.head_seq

    stalled_clients = [await connect(running, options=[("grpc.http2.bdp_probe", 0)]) for _ in range(NUM_STALLED)]
    stalled = [client.stream_events(snapshot=True) for client in stalled_clients]
    for stream in stalled:
        first_part = await next_batch(stream)  # then stop reading
        assert (first_part.seq, first_part.snapshot, first_part.snapshot_more) == (head, True, True)
    stalled_subs = list(log._subscribers)  # no public accessor
    assert len(stalled_subs) == NUM_STALLED

    reader = await connect(running)
    parts = await read_snapshot(reader.stream_events(snapshot=True))
    # Done while both stalled streams are still open and not yet cut: their blocked writes held the
    # budget for hold_s each, not until stalled_write_timeout_s.
    assert [sub.num_write_timeouts for sub in stalled_subs] == [0] * NUM_STALLED
    assert log.num_subscribers == NUM_STALLED + 1 and running.servicer.num_stream_write_timeouts == 0
    assert budget.num_let_go >= NUM_STALLED  # each stalled stream's blocked write was let go (a slow one may be too)
    assert [b.seq for b in parts] == [head] * len(parts) and len(parts) > 10
    stored = {
        (e.group_idx, h) for b in parts for e in events_of(b) if isinstance(e, BlockStored) for h in e.block_hashes
    }
    assert stored == {(g, h) for g, hashes in enumerate(pool_hashes(running)) for h in hashes}
    assert len(stored) == NUM_REQUESTS * PROMPT_TOKENS // 16
    await reader.close()

    await wait_until(lambda: log.num_subscribers == 0, timeout=60)  # cut by their write timeout
    assert [sub.num_write_timeouts for sub in stalled_subs] == [1] * NUM_STALLED
    assert running.servicer.num_stream_write_timeouts == NUM_STALLED
    for stream in stalled:  # reading on: what was in flight, then the status
        with pytest.raises(KVServiceError) as err:
            while True:
                assert (await next_batch(stream)).seq == head
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.value.message == (
            f"stream cut: a write took over stalled_write_timeout_s {STALLED_WRITE_TIMEOUT_S:g} s (the client is not "
            f"reading); cut mid-snapshot (seq {head} of epoch {log.epoch}, not all of its parts delivered): start "
            "again from a snapshot"
        )
    assert budget.in_flight == 0
    assert server_state(running) == before
