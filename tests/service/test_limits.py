"""Limits and request lifetime on a real server: the request reaper, TakeEvents consumer expiry,
max_streams, max_step_tokens and deadlines. No test sleeps to wait: each waits on the thing (the
reaper's signal, the subscription count); the deadline tests block the server's loop on purpose
(it is the test's loop), so that a call reaches its handler after its deadline."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError, StepBuilder
from tests.service.helpers import (
    H,
    StreamReader,
    events_of,
    hashes,
    next_batch,
    observed_state,
    removed,
    stored,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
"""Bound of a wait on the server (a hang fails the test instead of blocking the suite)."""


def admit_and_register() -> pb.StepRequest:
    """One Step: A (prompt 1..8) admitted, holding 2 blocks; W (prompt 20..27) waiting."""
    return (
        StepBuilder()
        .get_computed_blocks("A", range(1, 9))
        .allocate_slots("A", 8)
        .get_computed_blocks("W", range(20, 28))
        .build()
    )


def fill_the_pool() -> pb.StepRequest:
    """One Step: X takes all 15 blocks of the default test server (evicting whatever is cached)."""
    return StepBuilder().get_computed_blocks("X", range(100, 160)).allocate_slots("X", 60).build()


async def test_idle_requests_are_freed_as_a_free_would_free_them(start_kv_server, connect, caplog):
    caplog.set_level(logging.INFO, logger="kvservice.server.reaper")
    reaping = await start_kv_server(request_idle_timeout_s=0.2)
    twin = await start_kv_server(request_idle_timeout_s=0)  # 0: off
    assert twin.reaper is None and reaping.reaper is not None and reaping.reaper.num_reaped_requests == 0
    assert twin.notes[-1] == (
        "request_idle_timeout_s off: a request whose scheduler stopped calling holds its blocks until freed"
    )
    clients = {"reaping": await connect(reaping), "twin": await connect(twin)}
    streams = {
        name: await StreamReader.open(clients[name], running)
        for name, running in (("reaping", reaping), ("twin", twin))
    }
    for client in clients.values():
        results = (await client.step(admit_and_register())).results
        assert [r.WhichOneof("result") for r in results] == [
            "get_computed_blocks",
            "allocate_slots",
            "get_computed_blocks",
        ]

    await asyncio.wait_for(reaping.reaper.wait_reaped(2), WAIT_S)
    assert list(reaping.reaper.reaped_request_ids) == ["A", "W"]  # least recently called first
    assert " A" in caplog.text and "W" in caplog.text and "request_idle_timeout_s" in caplog.text
    await clients["twin"].step(StepBuilder().free("A").free("W").build())

    usage = {name: await client.get_usage() for name, client in clients.items()}
    assert usage["reaping"] == usage["twin"]
    assert (
        usage["reaping"].num_free_blocks,
        usage["reaping"].num_cached_blocks,
        usage["reaping"].num_running_requests,
        usage["reaping"].num_waiting_requests,
    ) == (15, 2, 0, 0)
    assert reaping.engine.requests == twin.engine.requests == {}
    assert reaping.event_log.head_seq == twin.event_log.head_seq == 1  # a free announces nothing
    with pytest.raises(KVServiceError) as err:
        await clients["reaping"].allocate_slots("A", 1, new_token_ids=[9])
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "'A' is not registered" in err.value.message

    # The freed blocks sit in the same free-queue order: filling the pool evicts them in the same order.
    for client in clients.values():
        assert (await client.step(fill_the_pool())).results[1].allocate_slots.allocated
    batches = {name: await stream.batches(2) for name, stream in streams.items()}
    assert (
        [events_of(b) for b in batches["reaping"]]
        == [events_of(b) for b in batches["twin"]]
        == [
            [stored(H[:2], None, range(1, 9))],
            [removed([H[1], H[0]]), stored(hashes(range(100, 160)), None, range(100, 160))],
        ]
    )
    reaping.engine.check_invariants()


async def test_an_expired_consumer_starts_again_at_the_live_head(start_kv_server, connect):
    running = await start_kv_server(consumer_idle_timeout_s=10.0, max_consumers=1)
    now = [0.0]
    running.event_log.clock = lambda: now[0]  # expiry is applied lazily, on take: a fake clock drives it
    client = await connect(running)
    assert (await client.take_events("a")).next_seq == 1
    await client.step(admit_and_register())
    now[0] = 9.0
    with pytest.raises(KVServiceError) as err:
        await client.take_events("b")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_consumers: 1" in err.value.message
    now[0] = 10.0  # "a" has not taken for 10 s: dropped, "b" gets its slot
    b = await client.take_events("b")
    assert (list(b.batches), b.next_seq) == ([], 2)
    now[0] = 20.0
    a = await client.take_events("a")  # a new consumer again: from the live head, batch 1 is not replayed
    assert (list(a.batches), a.next_seq) == ([], 2)
    assert running.event_log._consumers == {"a": 2}


async def test_max_streams_refuses_one_more_until_one_closes(start_kv_server, connect):
    running = await start_kv_server(max_streams=2)
    client = await connect(running)
    log = running.event_log
    await client.step(admit_and_register())
    first = client.stream_events(start_seq=1)
    second = client.stream_events(start_seq=1)
    assert [(await next_batch(first)).seq, (await next_batch(second)).seq] == [1, 1]
    assert log.num_subscribers == 2
    with pytest.raises(KVServiceError) as err:
        await next_batch(client.stream_events(snapshot=True))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == "max_streams: 2 streams are open already; close one or raise max_streams"
    assert log.num_subscribers == 2

    await first.aclose()  # cancels the call; the server forgets the subscription
    await wait_until(lambda: log.num_subscribers == 1)
    third = client.stream_events(start_seq=1)
    assert (await next_batch(third)).seq == 1 and log.num_subscribers == 2
    await client.step(StepBuilder().get_computed_blocks("B", range(60, 64)).allocate_slots("B", 4).build())
    assert [(await next_batch(second)).seq, (await next_batch(third)).seq] == [2, 2]


async def test_max_step_tokens_refuses_the_whole_step(start_kv_server, connect):
    running = await start_kv_server(max_step_tokens=12)
    client = await connect(running)
    await client.step(StepBuilder().get_computed_blocks("r", range(1, 9)).allocate_slots("r", 8).build())
    before = await observed_state(running, client)
    over = StepBuilder().get_computed_blocks("new", range(50, 60)).allocate_slots("r", 3, new_token_ids=[9, 10, 11])
    with pytest.raises(KVServiceError) as err:
        await client.step(over.build())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == (
        "ops: 13 tokens (prompt_token_ids, packed_prompt_token_ids and new_token_ids over all ops), above max_step_tokens 12"
    )
    assert await observed_state(running, client) == before
    at_limit = StepBuilder().get_computed_blocks("new", range(50, 60)).allocate_slots("r", 2, new_token_ids=[9, 10])
    results = (await client.step(at_limit.build())).results
    assert results[1].allocate_slots.num_tokens == 10 and set(running.engine.requests) == {"r", "new"}


# -- deadlines ----------------------------------------------------------------------------------


def deadline_calls():
    """Mutating calls (unary, Step and TakeEvents), each of which would change the server's state."""
    return {
        "GetComputedBlocks": lambda c, t: c.get_computed_blocks("new", range(40, 48), timeout=t),
        "AllocateSlots": lambda c, t: c.allocate_slots("W", 8, timeout=t),
        "Free": lambda c, t: c.free("W", timeout=t),
        "ResetPrefixCache": lambda c, t: c.reset_prefix_cache(timeout=t),
        "Step": lambda c, t: c.step(fill_the_pool(), timeout=t),
        "TakeEvents": lambda c, t: c.take_events("watcher", timeout=t),
    }


@pytest.mark.parametrize("method", list(deadline_calls()))
async def test_a_call_past_its_deadline_changes_nothing(start_kv_server, connect, method):
    running = await start_kv_server()
    client = await connect(running)
    await client.step(admit_and_register())
    await client.take_events("watcher")
    # Batch 2 (for the watcher to take); then no block is held (ResetPrefixCache would clear), W waits.
    await client.step(
        StepBuilder().get_computed_blocks("B", range(60, 64)).allocate_slots("B", 4).free("B").free("A").build()
    )
    servicer = running.servicer
    check = servicer._deadline_passed
    reached: list[float | None] = []

    def late(context: grpc.aio.ServicerContext) -> bool:
        # The handler is reached; block the server's loop (this test's loop) until the deadline passed.
        remaining = context.time_remaining()
        reached.append(remaining)
        if remaining is not None:
            time.sleep(remaining + 0.05)
        return check(context)

    before = await observed_state(running, client)
    servicer._deadline_passed = late
    with pytest.raises(KVServiceError) as err:
        await deadline_calls()[method](client, 1.0)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(reached) == 1 and reached[0] is not None and reached[0] > 0  # the call reached its handler in time
    assert servicer.num_deadline_exceeded == 1  # ... and the handler refused it
    del servicer._deadline_passed
    assert await observed_state(running, client) == before
    running.engine.check_invariants()

    # The same call in time does change the state (so the refusal above is what kept it unchanged).
    await deadline_calls()[method](client, 10.0)
    assert await observed_state(running, client) != before


async def test_requests_of_a_scheduler_that_stopped_are_freed_by_default(start_kv_server):
    """On by default (600 s), so a crashed scheduler's requests do not hold their blocks for ever;
    the start names only a timeout that is not the default."""
    running = await start_kv_server()
    assert running.reaper is not None and running.reaper.idle_timeout_s == 600.0
    assert not any("request_idle_timeout_s" in note for note in running.notes)
