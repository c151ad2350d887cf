"""StreamEvents delivery: resume from a seq, retention (OUT_OF_RANGE), epochs (FAILED_PRECONDITION), and
a stalled subscriber ended with RESOURCE_EXHAUSTED while the others go on."""

from __future__ import annotations

import re

import grpc
import pytest

from kvservice_client.client import KVServiceError
from kvservice_client.events import AllBlocksCleared
from tests.service.helpers import (
    StreamReader,
    events_of,
    hashes,
    next_batch,
    read_batches,
    snapshot_presence_events,
    stored,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


async def publish(client, i: int, num_tokens: int = 4) -> None:
    """One batch: request ``r{i}`` of ``num_tokens`` fresh tokens, allocated then freed (its blocks
    stay cached; the next publish may evict them, in the same batch as its own stores)."""
    prompt = [100_000 * (i + 1) + t for t in range(num_tokens)]
    await client.get_computed_blocks(f"r{i}", prompt)
    assert (await client.allocate_slots(f"r{i}", num_tokens)).allocated
    await client.free(f"r{i}")


def expected_store(i: int, num_tokens: int = 4):
    prompt = [100_000 * (i + 1) + t for t in range(num_tokens)]
    return stored(hashes(prompt), None, prompt)


async def stream_error(stream) -> KVServiceError:
    with pytest.raises(KVServiceError) as err:
        await next_batch(stream)
    return err.value


async def test_resume_delivers_exactly_the_missed_batches(kv_server, connect):
    scheduler, watcher = await connect(kv_server), await connect(kv_server)
    epoch = kv_server.event_log.epoch
    stream = watcher.stream_events(start_seq=1)
    await publish(scheduler, 0)
    await publish(scheduler, 1)
    seen = await read_batches(stream, 2)
    assert [b.seq for b in seen] == [1, 2]
    await stream.aclose()  # the watcher goes away after seq 2
    await wait_until(lambda: kv_server.event_log.num_subscribers == 0)

    for i in range(2, 5):
        await publish(scheduler, i)
    resumed = watcher.stream_events(start_seq=3, epoch=epoch)
    missed = await read_batches(resumed, 3)
    assert [(b.seq, b.epoch, b.snapshot) for b in missed] == [(3, epoch, False), (4, epoch, False), (5, epoch, False)]
    assert [events_of(b) for b in missed] == [[expected_store(i)] for i in range(2, 5)]
    await publish(scheduler, 5)  # then live, without a duplicate or a gap
    live = await next_batch(resumed)
    assert (live.seq, events_of(live)) == (6, [expected_store(5)])
    # Resuming at head + 1 is "live from here".
    at_head = watcher.stream_events(start_seq=7)
    await publish(scheduler, 6)
    assert (await next_batch(at_head)).seq == 7


async def test_live_start_follows_from_the_next_batch(kv_server, connect):
    scheduler, watcher = await connect(kv_server), await connect(kv_server)
    await publish(scheduler, 0)
    stream = watcher.stream_events()  # EVENT_START_LIVE
    await wait_until(lambda: kv_server.event_log.num_subscribers == 1)
    await publish(scheduler, 1)
    batch = await next_batch(stream)
    assert (batch.seq, events_of(batch)) == (2, [expected_store(1)])


async def test_start_below_retention_is_out_of_range_naming_the_oldest_seq(start_kv_server, connect):
    running = await start_kv_server(event_max_batches=3)
    scheduler, watcher = await connect(running), await connect(running)
    await watcher.take_events("slow")
    for i in range(5):
        await publish(scheduler, i)
    assert (running.event_log.oldest_seq, running.event_log.head_seq) == (3, 5)

    for start_seq in (1, 2):
        err = await stream_error(watcher.stream_events(start_seq=start_seq))
        assert err.code == grpc.StatusCode.OUT_OF_RANGE
        assert (
            f"start_seq {start_seq} is below the oldest retained batch, seq 3 of epoch {running.event_log.epoch}"
        ) in err.message
    oldest = watcher.stream_events(start_seq=3)
    assert [b.seq for b in await read_batches(oldest, 3)] == [3, 4, 5]

    with pytest.raises(KVServiceError) as take_err:
        await watcher.take_events("other", start_seq=2)
    assert take_err.value.code == grpc.StatusCode.OUT_OF_RANGE and "seq 3" in take_err.value.message
    # A consumer whose cursor (seq 1) left the log is told so, and recovers with a snapshot.
    with pytest.raises(KVServiceError) as slow_err:
        await watcher.take_events("slow")
    assert slow_err.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "consumer 'slow' is at seq 1" in slow_err.value.message and "seq 3" in slow_err.value.message
    recovered = await watcher.take_events("slow", snapshot=True)
    assert ([b.seq for b in recovered.batches], recovered.batches[0].snapshot, recovered.next_seq) == ([5], True, 6)
    assert running.engine.get_usage().num_cached_blocks == 5  # 15 blocks, 5 one-block requests: nothing evicted
    expected = [AllBlocksCleared(), *[expected_store(i) for i in range(5)]]
    assert snapshot_presence_events(recovered.batches[0]) == expected


async def test_start_seq_from_another_epoch_is_failed_precondition(kv_server, connect):
    scheduler, watcher = await connect(kv_server), await connect(kv_server)
    await publish(scheduler, 0)
    err = await stream_error(watcher.stream_events(start_seq=1, epoch="0123456789abcdef"))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'0123456789abcdef'" in err.message and kv_server.event_log.epoch in err.message
    # The current epoch, given or left empty, is accepted.
    for epoch in (kv_server.event_log.epoch, None):
        assert (await next_batch(watcher.stream_events(start_seq=1, epoch=epoch))).seq == 1


# -- a stalled subscriber ------------------------------------------------------------------------

STALL_TOKENS = 4000
MAX_STALL_BATCHES = 60
MAX_LAG = 5


async def _run_stall(start_kv_server, connect, *, num_tokens: int, stalled_options: list):
    """Open a stream that is never read (BDP probing off, so the client's HTTP/2 window stays
    small and the server's writes really block), publish batches until the server ends it for
    falling max_subscriber_lag behind while a second subscriber reads every one, then read the
    stalled stream to its end.

    The server cannot send the stalled stream's status before the batch whose write was in flight
    (HTTP/2 keeps a stream's frames in order), so the stalled stream ends only once it is read.

    Returns (the server, seqs the stalled stream yielded, its error or None if it hung, the good
    stream's batches).
    """
    running = await start_kv_server(
        num_blocks=num_tokens // 4 + 2, max_model_len=num_tokens, max_subscriber_lag=MAX_LAG
    )
    scheduler = await connect(running)
    stalled_client = await connect(running, options=[("grpc.http2.bdp_probe", 0), *stalled_options])
    stalled = stalled_client.stream_events(start_seq=1)
    good = await StreamReader.open(await connect(running), running)
    good_batches = []
    for i in range(MAX_STALL_BATCHES):
        await publish(scheduler, i, num_tokens)
        good_batches += await good.batches(1)
        # Publish until the server ends the stalled subscriber (marked ended, or already gone;
        # there is no public accessor for the former).
        log = running.event_log
        if log.num_subscribers < 2 or any(sub.ended.done() for sub in log._subscribers):
            break
    else:
        pytest.fail(f"the unread stream was never ended after {MAX_STALL_BATCHES} batches")
    assert [b.seq for b in good_batches] == list(range(1, len(good_batches) + 1))
    assert events_of(good_batches[0]) == [expected_store(0, num_tokens)]
    got: list[int] = []
    error = None
    try:
        while True:
            got.append((await next_batch(stalled, timeout=3.0)).seq)
    except KVServiceError as err:
        error = err
    except TimeoutError:
        pass
    return running, got, error, good_batches


def _named_last_seq(error: KVServiceError) -> int:
    match = re.search(r"last seq delivered (\d+)", error.message)
    assert match, error.message
    return int(match.group(1))


async def test_stalled_subscriber_is_ended_while_others_continue(start_kv_server, connect):
    running, got, error, good_batches = await _run_stall(
        start_kv_server, connect, num_tokens=STALL_TOKENS, stalled_options=[]
    )
    # The other subscriber got every batch, in order (checked in _run_stall), the first one exactly.
    # What was buffered arrives in order from seq 1, without a gap, then the stream ends.
    assert len(good_batches) > MAX_LAG
    assert 1 <= len(got) < len(good_batches) and got == list(range(1, len(got) + 1))
    assert error is not None, "the stalled stream never ended"
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"(max_subscriber_lag {MAX_LAG})" in error.message
    last = _named_last_seq(error)
    # The status names the last batch the client received: resuming after it repeats nothing.
    assert last == got[-1]
    assert f"resume from seq {last + 1}" in error.message
    await wait_until(lambda: running.event_log.num_subscribers == 1)  # only the good subscriber is left


async def test_stalled_subscriber_status_names_the_last_seq_it_received(start_kv_server, connect):
    _, got, error, _ = await _run_stall(start_kv_server, connect, num_tokens=STALL_TOKENS, stalled_options=[])
    assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _named_last_seq(error) == got[-1]


async def test_stalled_subscriber_with_a_small_window_gets_a_status(start_kv_server, connect):
    _, got, error, _ = await _run_stall(
        start_kv_server, connect, num_tokens=400, stalled_options=[("grpc.http2.lookahead_bytes", 1024)]
    )
    assert got and got == list(range(1, len(got) + 1))
    assert error is not None, f"no status after seqs {got}"
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_client_that_never_reads_is_cut_off_after_the_stall_timeout(start_kv_server, connect):
    running = await start_kv_server(
        num_blocks=STALL_TOKENS // 4 + 2,
        max_model_len=STALL_TOKENS,
        max_subscriber_lag=MAX_LAG,
        stalled_write_timeout_s=0.2,
    )
    scheduler = await connect(running)
    stalled_client = await connect(running, options=[("grpc.http2.bdp_probe", 0)])
    stalled = stalled_client.stream_events(start_seq=1)
    first = await next_batch_after_publish(scheduler, stalled)
    assert first.seq == 1
    log = running.event_log
    for i in range(1, MAX_STALL_BATCHES):
        await publish(scheduler, i, STALL_TOKENS)
        if any(sub.ended.done() for sub in log._subscribers):
            break
    # Never read again: the server ends the subscription, then cancels the blocked handler.
    await wait_until(lambda: log.num_subscribers == 0)


async def next_batch_after_publish(scheduler, stream):
    await publish(scheduler, 0, STALL_TOKENS)
    return await next_batch(stream)


async def test_a_stream_whose_next_batch_the_settling_trim_drops_ends_with_resource_exhausted(start_kv_server, connect):
    """Retention by bytes is applied when a batch settles (after the callback that appended it):
    a stream whose next batch that drops is ended as having fallen behind, naming its last seq,
    as when an append's own trim drops it (not failed with UNKNOWN by reading below the oldest
    retained seq)."""
    import dataclasses

    from kvservice.server.event_log import ENTRY_OVERHEAD_BYTES

    running = await start_kv_server(num_blocks=32)
    client = await connect(running)
    log, engine = running.event_log, running.engine
    await publish(client, 0)
    stream = client.stream_events(start_seq=1)
    assert (await next_batch(stream)).seq == 1
    await wait_until(lambda: log.num_subscribers == 1)  # caught up: waiting for seq 2

    def batch(i: int) -> None:  # one batch (BlockStored of a block), appended in this callback
        engine.get_computed_blocks(f"x{i}", [200_000 * (i + 1) + t for t in range(5)])
        assert engine.allocate_slots(f"x{i}", 5).allocated
        running.servicer.publish()

    batch(2)
    batch(3)  # settles seq 2
    log.settle()  # seq 3 too: now both sizes are known
    # The next batch fits while only its overhead is counted, and seq 2 is dropped once its bytes are.
    log.config = dataclasses.replace(
        log.config, max_bytes=log.retained_bytes - log.entries_from(1)[0].num_bytes + ENTRY_OVERHEAD_BYTES
    )
    batch(4)
    assert log.oldest_seq == 2  # the append's trim: seq 1 only (seq 4's msgpack bytes not counted yet)
    with pytest.raises(KVServiceError) as err:
        while True:
            await next_batch(stream)
    assert log.oldest_seq == 3  # the settling trim dropped seq 2
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message.endswith(
        f"last seq delivered 1 of epoch {log.epoch}: resume from seq 2 if still retained (oldest 3), else from a snapshot"
    )
