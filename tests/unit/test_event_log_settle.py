"""The event log settles a batch after the callback that appended it: sequenced at once, encoded,
counted and handed to the listeners on the loop's next turn (or before any read that needs it)."""

from __future__ import annotations

import asyncio

from kvservice.server.event_log import ENTRY_OVERHEAD_BYTES, EventLog, EventLogConfig
from kvservice.server.snapshot import SnapshotSource
from kvservice_client.events import BlockRemoved, BlockStored, KVEventBatch, encode_event_batch


def stored(hashes: list[int], parent: int | None, first_token: int) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(first_token, first_token + 4 * len(hashes))),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def new_log(**config: int) -> tuple[EventLog, list[int]]:
    log = EventLog(1, ["full_attention"], [None], EventLogConfig(**config))
    heard: list[int] = []
    log.add_listener(lambda entry: heard.append(entry.seq))
    return log, heard


async def next_turn() -> None:
    """Return once the callbacks the loop holds now have run (one turn of the loop)."""
    loop = asyncio.get_running_loop()
    turned = loop.create_future()
    loop.call_soon(turned.set_result, None)
    await turned


def msgpack_size(entry_events: list, ts: float) -> int:
    return len(encode_event_batch(KVEventBatch(ts, entry_events, None)))


def test_without_a_running_loop_append_settles_before_it_returns():
    log, heard = new_log()
    events = [stored([1, 2], None, 0)]
    entry = log.append(events)
    assert entry is not None and heard == [1]
    assert log.retained_bytes == entry.num_bytes == ENTRY_OVERHEAD_BYTES + msgpack_size(events, entry.ts)


async def test_on_a_running_loop_a_batch_is_sequenced_at_once_and_settles_on_the_next_turn():
    log, heard = new_log()
    events = [stored([1, 2], None, 0)]
    entry = log.append(events)
    assert entry is not None
    # Sequenced: readers of the log see it now; the listeners have not been called yet.
    assert log.head_seq == 1 and log.entries_from(1) == [entry] and heard == []
    assert entry.num_bytes == ENTRY_OVERHEAD_BYTES  # its msgpack bytes are counted when it settles
    await next_turn()
    assert heard == [1]
    assert entry.num_bytes == ENTRY_OVERHEAD_BYTES + msgpack_size(events, entry.ts) == log.retained_bytes


async def test_the_next_append_and_a_read_of_the_bytes_settle_first_in_seq_order():
    log, heard = new_log()
    first = log.append([stored([1], None, 0)])
    second = log.append([BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)])
    assert first is not None and second is not None
    assert heard == [1]  # the second append settled the first before it was sequenced
    total = first.num_bytes + ENTRY_OVERHEAD_BYTES + len(second.msgpack)
    assert log.retained_bytes == total and heard == [1, 2]  # reading the bytes settled the second
    await next_turn()
    assert heard == [1, 2]  # settling twice hands a batch over once


async def test_retention_by_bytes_is_applied_when_the_batch_settles():
    def batch(i: int) -> list:  # 100 blocks: the msgpack bytes outweigh the entry's overhead
        return [stored(list(range(100 * i, 100 * i + 100)), None, 0)]

    sizes = [ENTRY_OVERHEAD_BYTES + msgpack_size(batch(i), 0.0) for i in range(3)]
    max_bytes = sizes[0] + sizes[1] + sizes[2] // 2
    assert sizes[0] + sizes[1] + ENTRY_OVERHEAD_BYTES <= max_bytes  # an unsettled third batch fits
    log, _ = new_log(max_bytes=max_bytes)
    for i in range(3):
        log.append(batch(i), ts=0.0)
    assert log.oldest_seq == 1  # the third batch's msgpack bytes are not counted yet
    await next_turn()
    assert log.oldest_seq == 2 and log.num_retained_batches == 2 and log.retained_bytes == sizes[1] + sizes[2]


async def test_a_listener_that_fails_is_logged_and_the_others_still_hear(caplog):
    log, heard = new_log()

    def fails(entry: object) -> None:
        raise RuntimeError("boom")

    log._listeners.insert(0, fails)
    log.append([stored([1], None, 0)])
    await next_turn()
    assert heard == [1]
    assert "event log listener" in caplog.text and "failed on seq 1" in caplog.text


async def test_close_settles_the_newest_batch_first():
    log, heard = new_log()
    log.append([stored([1], None, 0)])
    log.close()
    assert heard == [1]


async def test_a_snapshot_asked_for_in_the_appending_turn_is_cut_at_the_head():
    log = EventLog(1, ["full_attention"], [None])
    source = SnapshotSource.attach(log)
    log.append([stored([1, 2], None, 0)])
    assert source.mirror.seq == 0  # not handed over yet
    assert source.min_bytes(None) == 2 * 8 and source.mirror.seq == 1  # settles the log first
    log.append([stored([3], 2, 8)])
    snap = await source.get()  # settles the log first: the cut includes the batch of this turn
    assert snap.seq == 2 and not source.pending
    await snap.wait_done()
    events = [e for i in range(len(snap.parts)) for e in snap.part_events(i)]
    # Both halves (parents first, then the records in recency order), at seq 2.
    assert [e.block_hashes for e in events[1:]] == [[1, 2, 3], [1, 2], [3]]


async def test_a_subscriber_the_settling_trim_passes_is_ended_not_left_below_the_oldest_seq():
    """Retention by bytes applied when a batch settles drops a batch a slow subscriber has not
    read yet: the subscriber is ended then (fell behind, naming its last seq), as an append's
    trim would end it, rather than left with a next seq below the oldest retained (where its
    stream's next ``entries_from`` would fail)."""

    def batch(i: int) -> list:  # 100 blocks: the msgpack bytes outweigh the entry's overhead
        return [stored(list(range(100 * i, 100 * i + 100)), None, 0)]

    sizes = [ENTRY_OVERHEAD_BYTES + msgpack_size(batch(i), 0.0) for i in range(3)]
    log, _ = new_log(max_bytes=sizes[0] + sizes[1] + sizes[2] // 2)
    sub = log.subscribe(1, 0, None)  # has read nothing yet
    for i in range(3):
        log.append(batch(i), ts=0.0)
    assert log.oldest_seq == 1 and not sub.ended.done()  # seq 1 still retained: nothing missed yet
    await next_turn()
    assert log.oldest_seq == 2 and sub.next_seq == 1
    assert sub.ended.done()
    error = sub.ended.result()(sub.last_seq)
    assert type(error).__name__ == "CapacityExceededError"
    assert str(error).endswith(
        f"last seq delivered 0 of epoch {log.epoch}: resume from seq 1 if still retained (oldest 2), else from a snapshot"
    )
