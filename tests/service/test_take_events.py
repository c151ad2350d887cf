"""TakeEvents: named consumers with their own cursors, snapshots, repositioning, group filters."""

from __future__ import annotations

import grpc
import pytest

from kvservice_client.client import KVServiceError
from kvservice_client.events import AllBlocksCleared
from tests.service.helpers import FULL_SLIDING, H, StreamReader, events_of, hashes, snapshot_presence_events, stored

pytestmark = pytest.mark.timeout(30)


async def admit(client, request_id, prompt, **kwargs):
    """Lookup + allocation of the whole prompt (one batch when it fills a block)."""
    await client.get_computed_blocks(request_id, prompt, **kwargs)
    response = await client.allocate_slots(request_id, len(prompt))
    assert response.allocated
    return response


def seqs(response) -> list[int]:
    return [b.seq for b in response.batches]


async def test_two_consumers_never_take_each_others_batches(kv_server, connect):
    scheduler, watcher_a, watcher_b, streamer = [await connect(kv_server) for _ in range(4)]
    epoch = kv_server.event_log.epoch
    stream = await StreamReader.open(streamer, kv_server)

    first = await watcher_a.take_events("a")
    assert (seqs(first), first.next_seq, first.epoch) == ([], 1, epoch)
    await admit(scheduler, "r1", range(1, 13))
    # A new consumer starts at the live head: it never sees batch 1.
    b_first = await watcher_b.take_events("b")
    assert (seqs(b_first), b_first.next_seq) == ([], 2)
    a1 = await watcher_a.take_events("a")
    assert (seqs(a1), a1.next_seq) == ([1], 2)
    assert events_of(a1.batches[0]) == [stored(H[:3], None, range(1, 13))]
    again = await watcher_a.take_events("a")
    assert (seqs(again), again.next_seq) == ([], 2)

    await admit(scheduler, "r2", range(20, 24))
    await admit(scheduler, "r3", range(30, 34))
    a2 = await watcher_a.take_events("a", max_batches=1)
    assert (seqs(a2), a2.next_seq) == ([2], 3)
    b2 = await watcher_b.take_events("b")
    assert (seqs(b2), b2.next_seq) == ([2, 3], 4)
    a3 = await watcher_a.take_events("a")
    assert (seqs(a3), a3.next_seq) == ([3], 4)
    assert (
        [events_of(b) for b in b2.batches]
        == [events_of(a2.batches[0]), events_of(a3.batches[0])]
        == [
            [stored(hashes(range(20, 24)), None, range(20, 24))],
            [stored(hashes(range(30, 34)), None, range(30, 34))],
        ]
    )
    # The same consumer name from another channel shares the cursor; a stream is never taken from.
    shared = await watcher_b.take_events("a")
    assert (seqs(shared), shared.next_seq) == ([], 4)
    streamed = await stream.batches(3)
    assert [b.seq for b in streamed] == [1, 2, 3]
    assert [events_of(b) for b in streamed] == [events_of(a1.batches[0]), *[events_of(b) for b in b2.batches]]


async def test_snapshot_take_then_live(kv_server, connect):
    scheduler, watcher = await connect(kv_server), await connect(kv_server)
    await admit(scheduler, "A", range(1, 13))
    await scheduler.free("A")
    await admit(scheduler, "E", range(300, 308), session_id="not-in-snapshots")
    head = kv_server.event_log.head_seq
    assert head == 2

    for consumer in ("new", "existing"):
        if consumer == "existing":
            await watcher.take_events(consumer)
        snap = await watcher.take_events(consumer, snapshot=True)
        assert (len(snap.batches), snap.next_seq) == (1, head + 1)
        batch = snap.batches[0]
        assert (batch.seq, batch.snapshot, batch.epoch) == (head, True, kv_server.event_log.epoch)
        assert snapshot_presence_events(batch) == [
            AllBlocksCleared(),
            stored(H[:3], None, range(1, 13)),
            stored(hashes(range(300, 308)), None, range(300, 308)),
        ]

    await admit(scheduler, "F", range(400, 404))
    for consumer in ("new", "existing"):
        live = await watcher.take_events(consumer)
        assert (seqs(live), live.next_seq, live.batches[0].snapshot) == ([3], 4, False)
        assert events_of(live.batches[0]) == [stored(hashes(range(400, 404)), None, range(400, 404))]


async def test_start_seq_repositions_a_consumer(kv_server, connect):
    scheduler, watcher = await connect(kv_server), await connect(kv_server)
    await watcher.take_events("w")
    for i in range(3):
        await admit(scheduler, f"r{i}", range(10 * i + 100, 10 * i + 104))
    everything = await watcher.take_events("w")
    assert (seqs(everything), everything.next_seq) == ([1, 2, 3], 4)

    replay = await watcher.take_events("w", start_seq=2, epoch=kv_server.event_log.epoch)
    assert (seqs(replay), replay.next_seq) == ([2, 3], 4)
    assert replay.batches == everything.batches[1:]
    from_one = await watcher.take_events("w", start_seq=1, max_batches=2)
    assert (seqs(from_one), from_one.next_seq) == ([1, 2], 3)
    rest = await watcher.take_events("w")
    assert (seqs(rest), rest.next_seq) == ([3], 4)
    # start_seq = head + 1 is the live head; a new consumer may start anywhere retained.
    at_head = await watcher.take_events("w", start_seq=4)
    assert (seqs(at_head), at_head.next_seq) == ([], 4)
    fresh = await watcher.take_events("fresh", start_seq=3)
    assert (seqs(fresh), fresh.next_seq) == ([3], 4)

    with pytest.raises(KVServiceError) as err:
        await watcher.take_events("w", start_seq=1, epoch="another-epoch")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in err.value.message
    unchanged = await watcher.take_events("w")
    assert (seqs(unchanged), unchanged.next_seq) == ([], 4)


FULL = {"group": 0, "kind": "full_attention", "window": None}
SLIDING = {"group": 1, "kind": "sliding_window", "window": 1024}


async def test_group_filter_on_take_and_stream(start_kv_server, connect):
    running = await start_kv_server(**FULL_SLIDING, num_blocks=17)
    scheduler, watcher = await connect(running), await connect(running)
    only_sliding = await StreamReader.open(watcher, running, group_idxs=[1])
    await watcher.take_events("g0", group_idxs=[0])
    await watcher.take_events("all")
    await admit(scheduler, "A", range(1, 9))
    assert (await scheduler.reset_prefix_cache()).reset is False  # A holds blocks: refused, no batch
    await scheduler.free("A")
    assert (await scheduler.reset_prefix_cache()).reset is True

    g0 = await watcher.take_events("g0", group_idxs=[0])
    everything = await watcher.take_events("all")
    [s1, s2] = await only_sliding.batches(2)
    assert seqs(g0) == seqs(everything) == [s1.seq, s2.seq] == [1, 2]
    assert [events_of(b) for b in everything.batches] == [
        [stored(H[:2], None, range(1, 9), **FULL), stored(H[:2], None, range(1, 9), **SLIDING)],
        [AllBlocksCleared()],
    ]
    # AllBlocksCleared goes to every filter.
    assert [events_of(b) for b in g0.batches] == [[stored(H[:2], None, range(1, 9), **FULL)], [AllBlocksCleared()]]
    assert [events_of(s1), events_of(s2)] == [[stored(H[:2], None, range(1, 9), **SLIDING)], [AllBlocksCleared()]]
