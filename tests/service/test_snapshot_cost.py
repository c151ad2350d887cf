"""What a snapshot costs the others (issue 15): one cut serves a burst; an oversized TakeEvents
snapshot is refused before any cut; a snapshot's events are exactly the cached set.

A real server on port 0, driven with the generated client. Nothing here is timed.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice_client.client import KVServiceError
from kvservice_client.events import BlockStored
from tests.service.helpers import events_of, next_batch, pool_hashes
from tests.service.test_metrics import scrape

pytestmark = pytest.mark.timeout(120)


def prompt(r: int, num_tokens: int) -> list[int]:
    """A prompt whose first token differs per ``r`` (distinct blocks), all ids below 128."""
    return [r + 1] + [(7 * i + r) % 100 + 1 for i in range(1, num_tokens)]


async def fill(client, num_requests: int, num_tokens: int) -> None:
    """Admit and free requests, leaving their full blocks cached."""
    for r in range(num_requests):
        await client.get_computed_blocks(f"r{r}", prompt(r, num_tokens))
        assert (await client.allocate_slots(f"r{r}", num_tokens)).allocated
        await client.free(f"r{r}")


async def read_snapshot(stream) -> list:
    """The parts of a snapshot stream, up to the last (``snapshot_more`` false)."""
    parts = [await next_batch(stream)]
    while parts[-1].snapshot_more:
        parts.append(await next_batch(stream))
    return parts


async def test_100_concurrent_snapshot_subscribers_at_one_head_cause_one_cut(start_kv_server, connect):
    running = await start_kv_server(num_blocks=200, max_model_len=256, metrics_port=0, snapshot_part_tokens=64)
    scheduler = await connect(running)
    await fill(scheduler, 4, 160)  # 160 cached blocks of 4 tokens
    head = running.event_log.head_seq
    watchers = [await connect(running) for _ in range(4)]
    streams = [w.stream_events(snapshot=True) for w in watchers for _ in range(25)]
    snapshots = await asyncio.gather(*(read_snapshot(s) for s in streams))
    assert running.snapshots.num_cuts == 1
    samples = await scrape(running.metrics_port)
    assert samples[("kvservice_snapshot_cuts_total", frozenset())] == 1.0
    first = [[b.SerializeToString() for b in parts] for parts in snapshots[:1]][0]
    assert len(first) > 1  # in parts
    for parts in snapshots:
        assert [b.seq for b in parts] == [head] * len(parts)
        assert [b.SerializeToString() for b in parts] == first  # the same bytes for all
    stored = {
        (e.group_idx, h)
        for b in snapshots[0]
        for e in events_of(b)
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    }
    assert stored == {(g, h) for g, hashes in enumerate(pool_hashes(running)) for h in hashes}
    # A take at the same head shares the cut too; the next batch makes the next ask cut again.
    taken = await watchers[0].take_events("w", snapshot=True)
    assert [b.seq for b in taken.batches] == [head] * len(first) and running.snapshots.num_cuts == 1
    await scheduler.get_computed_blocks("new", prompt(9, 8))
    await scheduler.allocate_slots("new", 8)
    again = await read_snapshot(watchers[1].stream_events(snapshot=True))
    assert again[0].seq == head + 1 and running.snapshots.num_cuts == 2


async def test_an_oversized_take_events_snapshot_is_refused_before_any_cut(start_kv_server, connect):
    # max_take_bytes = max_message_bytes - 1024 = 3072 bytes; 2,048 cached tokens are at least 4,096
    # bytes of snapshot (every token id at least once in each half).
    running = await start_kv_server(
        num_blocks=600, max_model_len=1024, max_message_bytes=4096, snapshot_part_tokens=256
    )
    scheduler = await connect(running)
    await fill(scheduler, 2, 1024)
    watcher = await connect(running)
    with pytest.raises(KVServiceError) as err:
        await watcher.take_events("w", snapshot=True)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "snapshot is at least 4096 bytes, above max_take_bytes 3072" in str(err.value)
    assert running.snapshots.num_cuts == 0
    assert running.event_log.consumer_cursor("w") is None  # the refusal registered no consumer
    # The same snapshot over StreamEvents (in parts) is fine.
    parts = await read_snapshot(watcher.stream_events(snapshot=True))
    assert running.snapshots.num_cuts == 1 and parts[-1].seq == running.event_log.head_seq


async def test_a_take_events_snapshot_above_the_bound_after_the_cut_is_refused_exactly(start_kv_server, connect):
    # 512 tokens: the bound (1,024 bytes) fits 3,072; the real snapshot (hashes are 8-10 bytes each) does not.
    running = await start_kv_server(
        num_blocks=600, max_model_len=1024, max_message_bytes=4096, snapshot_part_tokens=256
    )
    scheduler = await connect(running)
    await fill(scheduler, 1, 512)
    watcher = await connect(running)
    with pytest.raises(KVServiceError) as err:
        await watcher.take_events("w", snapshot=True)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "above max_take_bytes 3072 a TakeEvents answer carries" in str(err.value)
    assert "at least" not in str(err.value) and running.snapshots.num_cuts == 1


async def test_snapshot_streams_write_within_the_shared_bytes_in_flight_budget_and_stay_exact(start_kv_server, connect):
    running = await start_kv_server(
        num_blocks=200, max_model_len=256, snapshot_part_tokens=64, max_snapshot_bytes_in_flight=1300
    )
    scheduler = await connect(running)
    await fill(scheduler, 4, 160)  # 160 cached blocks of 4 tokens: 9 parts per snapshot
    head = running.event_log.head_seq
    watchers = [await connect(running) for _ in range(3)]
    snapshots = await asyncio.gather(*(read_snapshot(w.stream_events(snapshot=True)) for w in watchers))
    budget = running.snapshots.budget
    sizes = [len(b.SerializeToString()) for b in snapshots[0]]
    assert len(sizes) == 9 and max(sizes) < 1300  # parts fit, so the budget is what bounds them
    assert budget.peak <= 1300 and budget.in_flight == 0
    assert budget.num_bytes == 3 * sum(sizes)  # every part of every stream went through it
    assert budget.num_waits > 0  # three streams at once: some waited their turn
    expected = {(g, h) for g, hashes in enumerate(pool_hashes(running)) for h in hashes}
    for parts in snapshots:
        assert [b.seq for b in parts] == [head] * 9 and [b.snapshot_more for b in parts] == [True] * 8 + [False]
        stored = {
            (e.group_idx, h)
            for b in parts
            for e in events_of(b)
            if isinstance(e, BlockStored) and not e.reused
            for h in e.block_hashes
        }
        assert stored == expected


async def test_a_take_events_snapshot_is_made_in_steps_that_let_other_calls_in(start_kv_server, connect, monkeypatch):
    """Issue 26: a unary snapshot never holds the loop. The answer is the streams' parts (the same
    bytes, made once per payload format, shared), encoded in steps that yield to the loop, joined
    beside the loop, and written within the snapshot streams' shared byte budget. A GetUsage sent
    while the take's first encoding step has yielded is answered while the take still waits, and
    then the take's answer equals the streamed snapshot's parts, byte for byte."""
    import threading

    from kvservice.server import servicer as servicer_module
    from kvservice.server.snapshot import YIELD_EVERY_TOKENS, HalfShare

    running = await start_kv_server(num_blocks=1100, max_model_len=1024, snapshot_part_tokens=2 * YIELD_EVERY_TOKENS)
    scheduler = await connect(running)
    await fill(scheduler, 4, 1024)  # 1,024 cached blocks of 4 tokens: 8,192 token ids in the two halves
    watcher, other = await connect(running), await connect(running)
    cut = await running.snapshots.get()
    await cut.wait_done()  # cut, not encoded: the take makes the parts' bytes
    loop = asyncio.get_running_loop()
    yielded, gate = loop.create_future(), asyncio.Event()
    step = HalfShare.step

    async def gated_step(share: HalfShare) -> None:
        if not yielded.done():  # the take's first step: held here until the other call is answered
            yielded.set_result(None)
            await gate.wait()
        await step(share)

    monkeypatch.setattr(HalfShare, "step", gated_step)
    joined_on: list[threading.Thread] = []
    take_response = servicer_module.take_response

    def recording_join(parts, rest):
        joined_on.append(threading.current_thread())
        return take_response(parts, rest)

    monkeypatch.setattr(servicer_module, "take_response", recording_join)
    monkeypatch.setattr(servicer_module, "_JOIN_BESIDE_THE_LOOP_BYTES", 0)  # this answer is small
    budget_before = running.snapshots.budget.num_bytes
    take = loop.create_task(watcher.take_events("w", snapshot=True))
    done, _ = await asyncio.wait({take, yielded}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {yielded}, "the take answered without yielding to the loop once"
    usage = await other.get_usage()
    assert usage.num_cached_blocks == 1024 and not take.done()
    gate.set()
    taken = await take
    parts = await read_snapshot(watcher.stream_events(snapshot=True))
    assert [b.SerializeToString() for b in taken.batches] == [b.SerializeToString() for b in parts]
    assert len(parts) == 4 and running.snapshots.num_cuts == 1
    assert taken.next_seq == running.event_log.head_seq + 1 and taken.epoch == running.event_log.epoch
    assert joined_on and threading.main_thread() not in joined_on  # joined on a worker thread
    size = sum(len(b.SerializeToString()) for b in parts)
    assert running.snapshots.budget.num_bytes - budget_before == 2 * size  # the take's answer, then the stream's parts
    assert running.snapshots.budget.in_flight == 0
