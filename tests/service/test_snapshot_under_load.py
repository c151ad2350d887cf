"""Snapshots cut while Steps keep storing and evicting are exact: a watcher that starts from a
snapshot taken mid-workload (its parts produced over several turns of the loop while batches
are held back) and applies every later batch holds exactly the server's cached set once it
reaches the head, over StreamEvents and TakeEvents."""

from __future__ import annotations

import asyncio

import pytest

from tests.service.helpers import Mirror, next_batch, pool_hashes
from tests.service.test_snapshot_consistency import Workload

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", [3, 4])
async def test_snapshots_taken_during_a_workload_are_exact(start_kv_server, connect, seed):
    running = await start_kv_server(preset="qwen-2.5-0.5b", num_blocks=24, snapshot_part_tokens=8)
    num_groups = running.engine.manager.num_groups
    scheduler = await connect(running)
    workload = Workload(scheduler, running, seed)
    await workload.run(40)  # something cached before the first snapshot
    moved = asyncio.Event()  # set by every batch appended
    running.event_log.add_listener(lambda entry: moved.set())
    task = asyncio.create_task(workload.run(400))
    watchers = []
    seqs = []
    for k in range(6):
        client = await connect(running)
        stream = client.stream_events(snapshot=True)
        mirror = Mirror(num_groups)
        batch = await next_batch(stream)
        assert batch.snapshot
        mirror.apply(batch)
        while batch.snapshot_more:
            batch = await next_batch(stream)
            mirror.apply(batch)
        watchers.append((stream, mirror))
        taken = await client.take_events(f"taker{k}", snapshot=True)
        take_mirror = Mirror(num_groups)
        for b in taken.batches:
            take_mirror.apply(b)
        watchers.append((None, take_mirror))
        seqs.append(running.event_log.head_seq)
        # let the workload go on between snapshots: wait until it has moved the head (a loaded
        # machine can run the next snapshot before the workload's next event)
        if running.event_log.head_seq == seqs[-1]:
            moved.clear()
            waiter = asyncio.ensure_future(moved.wait())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
    assert not task.done() and len(set(seqs)) == len(seqs)  # every snapshot at another head, mid-workload
    await task
    head = running.event_log.head_seq
    expected = pool_hashes(running)
    assert running.snapshots.mirror.cached_hashes() == expected
    for k, (stream, mirror) in enumerate(watchers):
        if stream is None:
            name = f"taker{k // 2}"
            while mirror.last_seq != head:
                for b in (await scheduler.take_events(name)).batches:
                    mirror.apply(b)
        else:
            while mirror.last_seq != head:
                mirror.apply(await next_batch(stream))
        assert mirror.groups == expected, k
    running.engine.check_invariants()
