"""Memory within what the settings say (issue 15): the waiting-token bound; the event log's byte
count includes the encodings it caches.

A real server on port 0, the generated client; exact values.
"""

from __future__ import annotations

import grpc
import pytest

from kvservice.server.event_log import ENCODING_OVERHEAD_BYTES, ENTRY_OVERHEAD_BYTES
from kvservice_client.client import KVServiceError, StepBuilder
from tests.service.helpers import next_batch, observed_state

pytestmark = pytest.mark.timeout(60)


def prompt(r: int, n: int) -> list[int]:
    return [1000 * (r + 1) + t for t in range(n)]


async def test_waiting_requests_are_bounded_by_max_waiting_tokens(start_kv_server, connect):
    running = await start_kv_server(max_waiting_tokens=100)
    client = await connect(running)
    await client.get_computed_blocks("a", prompt(0, 40))
    await client.get_computed_blocks("b", prompt(1, 40))
    assert running.engine.num_waiting_tokens == 80
    before = await observed_state(running, client)
    with pytest.raises(KVServiceError) as err:
        await client.get_computed_blocks("c", prompt(2, 40))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err.value).endswith(
        "max_waiting_tokens: waiting requests hold 80 prompt tokens; 40 more would be above 100: admit "
        "(AllocateSlots) or free waiting requests first"
    )
    assert await observed_state(running, client) == before  # the refusal changed nothing
    # In a Step the op answers its own status; the rest go on.
    results = (await client.step(StepBuilder().get_computed_blocks("c", prompt(2, 40)).get_usage())).results
    assert results[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert results[1].get_usage.num_waiting_requests == 2
    # Admitting a request takes its tokens off the bound; so does freeing a waiting one.
    assert (await client.allocate_slots("a", 40)).allocated
    assert running.engine.num_waiting_tokens == 40
    await client.get_computed_blocks("c", prompt(2, 40))
    assert running.engine.num_waiting_tokens == 80
    await client.free("b")
    await client.free("a")  # running: its tokens were off the bound already
    assert running.engine.num_waiting_tokens == 40 and running.engine.num_freed_tokens == 80
    running.engine.check_invariants()


async def test_the_default_bound_is_on(start_kv_server):
    running = await start_kv_server()
    assert running.config.limits.max_waiting_tokens == 8 * 1024 * 1024
    assert running.engine.limits.max_waiting_tokens == 8 * 1024 * 1024
    assert (await start_kv_server(max_waiting_tokens=0)).engine.limits.max_waiting_tokens is None


async def test_retained_bytes_count_the_encodings_the_log_caches(start_kv_server, connect):
    running = await start_kv_server()
    client = await connect(running)
    stream = client.stream_events(start_seq=1)  # protobuf: one encoding cached per batch
    await client.get_computed_blocks("a", prompt(0, 8))
    assert (await client.allocate_slots("a", 8)).allocated
    batch = await next_batch(stream)
    log = running.event_log
    (entry,) = log.entries_from(1)
    assert list(entry.encodings.values()) == [batch.SerializeToString()]
    assert log.retained_bytes == (
        len(entry.msgpack) + len(batch.SerializeToString()) + ENCODING_OVERHEAD_BYTES + ENTRY_OVERHEAD_BYTES
    )


async def test_the_heap_is_trimmed_once_enough_tokens_were_freed():
    from kvservice.server import heap

    freed = [0]
    trimmer = heap.HeapTrimmer(lambda: freed[0], trim_every_tokens=100, min_interval_s=0.0)
    freed[0] = 99
    trimmer.maybe_trim()
    assert trimmer.task is None and trimmer.num_trims == 0
    freed[0] = 100
    trimmer.maybe_trim()
    if heap._MALLOC_TRIM is None:  # no malloc_trim in this libc: nothing to do
        assert trimmer.task is None and trimmer.num_trims == 0
        return
    task = trimmer.task
    assert task is not None
    trimmer.maybe_trim()  # one at a time: the running task is the one
    assert trimmer.task is task
    await task
    assert trimmer.num_trims == 1 and trimmer.task is None
    trimmer.maybe_trim()  # nothing freed since
    assert trimmer.task is None and trimmer.num_trims == 1


async def test_a_trim_sooner_than_the_interval_is_deferred_not_dropped():
    """Frees right after a trim are trimmed once the interval has passed, with no call after them;
    frees made while a trim waits join that trim."""
    from kvservice.server import heap

    if heap._MALLOC_TRIM is None:
        pytest.skip("no malloc_trim in this libc")
    freed = [100]
    trimmer = heap.HeapTrimmer(lambda: freed[0], trim_every_tokens=100, min_interval_s=0.2)
    assert trimmer._trimmed_at == 100  # what was freed before it existed is not counted
    freed[0] = 200
    trimmer.maybe_trim()
    assert trimmer.task is not None
    await trimmer.task
    assert trimmer.num_trims == 1
    first = trimmer._started_at
    freed[0] = 300  # enough again, within the interval: deferred
    trimmer.maybe_trim()
    task = trimmer.task
    assert task is not None and trimmer.num_trims == 1
    freed[0] = 450  # more freed while it waits: the same trim covers it
    trimmer.maybe_trim()
    assert trimmer.task is task
    await task
    assert trimmer.num_trims == 2 and trimmer._trimmed_at == 450
    assert trimmer._started_at is not None and first is not None
    assert trimmer._started_at - first >= 0.2


async def test_closing_the_trimmer_cancels_a_deferred_trim():
    from kvservice.server import heap

    if heap._MALLOC_TRIM is None:
        pytest.skip("no malloc_trim in this libc")
    freed = [0]
    trimmer = heap.HeapTrimmer(lambda: freed[0], trim_every_tokens=1, min_interval_s=3600.0)
    freed[0] = 1
    trimmer.maybe_trim()
    assert trimmer.task is not None
    await trimmer.task
    freed[0] = 2
    trimmer.maybe_trim()  # waits an hour
    assert trimmer.task is not None
    await trimmer.close()
    assert trimmer.task is None and trimmer.num_trims == 1


def test_the_trimmer_refuses_bad_bounds():
    from kvservice.server import heap

    with pytest.raises(ValueError, match="trim_every_tokens must be >= 1; got 0"):
        heap.HeapTrimmer(lambda: 0, trim_every_tokens=0)
    with pytest.raises(ValueError, match="min_interval_s must be >= 0; got -1"):
        heap.HeapTrimmer(lambda: 0, min_interval_s=-1)
