"""EventWatcher's recovery against a scripted fake servicer on a real grpc.aio server (127.0.0.1,
port 0): snapshot then live, resume, epoch changes, retention, gaps, falling behind, bounded retries.

Nothing here sleeps to wait: tests wait on the thing itself (a batch, a call opening or ending),
under an ``asyncio.wait_for`` deadline so a hang fails with a message instead of the suite timeout.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

import grpc
import grpc.aio
import pytest

from kvservice_client._proto.kvservice import v1
from kvservice_client.client import AsyncKVCacheClient, KVServiceError
from kvservice_client.convert import batch_to_proto
from kvservice_client.events import AllBlocksCleared, BlockStored, KVEventBatch
from kvservice_client.watcher import (
    EventWatcher,
    PrefixIndex,
    ResyncReason,
    RetryPolicy,
    WatchedBatch,
)
from tests.unit.test_watcher import removed, stored

# --- EventWatcher against a scripted fake ---------------------------------------------------------

DEADLINE_S = 10.0
FAST = RetryPolicy(max_retries=3, initial_backoff_s=0.0, max_backoff_s=0.0, jitter=0.0, connect_timeout_s=5.0)
End = Union[tuple[grpc.StatusCode, str], Literal["hold", "return"]]


@dataclass
class Call:
    """One scripted StreamEvents call: the request it must get, what it sends, how it ends."""

    expect: v1.StreamEventsRequest
    batches: list[v1.EventBatch] = field(default_factory=list)
    end: End = "hold"  # hold: stay open until cancelled (or the test ends); return: end with OK


def snap_req(**kwargs: object) -> v1.StreamEventsRequest:
    return v1.StreamEventsRequest(start=v1.EVENT_START_SNAPSHOT, **kwargs)


def seq_req(start_seq: int, epoch: str, **kwargs: object) -> v1.StreamEventsRequest:
    return v1.StreamEventsRequest(start=v1.EVENT_START_SEQ, start_seq=start_seq, epoch=epoch, **kwargs)


def live(seq: int, *events, epoch: str = "A", payload_format: str = "protobuf") -> v1.EventBatch:  # type: ignore[no-untyped-def]
    return batch_to_proto(
        KVEventBatch(ts=float(seq), events=list(events)), seq=seq, epoch=epoch, payload_format=payload_format
    )  # type: ignore[arg-type]


def snap(seq: int, *hashes: int, epoch: str = "A") -> v1.EventBatch:
    events = [AllBlocksCleared()] + ([stored(list(hashes))] if hashes else [])
    return batch_to_proto(KVEventBatch(ts=float(seq), events=events), seq=seq, epoch=epoch, snapshot=True)


class ScriptedEvents(v1.KVCacheServiceServicer):
    """Answers StreamEvents calls from a script, in order; records each request and how it ended.

    A request that differs from the script's is answered INVALID_ARGUMENT naming both (the watcher
    raises that status to the test).
    """

    def __init__(self, calls: Sequence[Call]) -> None:
        self.calls = list(calls)
        self.requests: list[v1.StreamEventsRequest] = []
        self.cancelled: list[int] = []
        self.opened: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.ended: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.release = asyncio.Event()

    async def StreamEvents(self, request, context):  # type: ignore[no-untyped-def]
        idx = len(self.requests)
        self.requests.append(request)
        self.opened[idx].set()
        try:
            if idx >= len(self.calls):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unscripted call {idx}: {request}")
            call = self.calls[idx]
            if request != call.expect:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"call {idx}: expected {call.expect} got {request}"
                )
            for batch in call.batches:
                yield batch
            if call.end == "hold":
                await self.release.wait()
            elif call.end != "return":
                await context.abort(*call.end)
        except (asyncio.CancelledError, GeneratorExit):  # cancelled while waiting, or while writing
            self.cancelled.append(idx)
            raise
        finally:
            self.ended[idx].set()


@dataclass
class Served:
    server: grpc.aio.Server
    fake: ScriptedEvents
    address: str
    port: int

    async def stop(self) -> None:
        self.fake.release.set()
        await self.server.stop(None)


async def serve(calls: Sequence[Call], port: int = 0) -> Served:
    fake = ScriptedEvents(calls)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    v1.add_KVCacheServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return Served(server, fake, f"127.0.0.1:{port}", port)


@pytest.fixture
async def servers() -> AsyncIterator[list[Served]]:
    """Servers a test starts go here and are stopped at its end."""
    started: list[Served] = []
    try:
        yield started
    finally:
        for served in started:
            await served.stop()


async def start(servers: list[Served], calls: Sequence[Call], port: int = 0) -> Served:
    served = await serve(calls, port)
    servers.append(served)
    return served


async def take(watcher: EventWatcher, n: int) -> list[WatchedBatch]:
    async def go() -> list[WatchedBatch]:
        return [await watcher.__anext__() for _ in range(n)]

    return await asyncio.wait_for(go(), DEADLINE_S)


async def until(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), DEADLINE_S)


def positions(batches: Sequence[WatchedBatch]) -> list[tuple[int, str, bool]]:
    return [(b.seq, b.epoch, b.snapshot) for b in batches]


async def test_snapshot_then_live_in_order(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers, [Call(snap_req(), [snap(3, 1, 2), live(4, stored([3], parent=2)), live(5, removed([1]))])]
    )
    index = PrefixIndex()
    async with EventWatcher(served.address, retry=FAST) as watcher:  # the watcher opens its own client
        assert watcher.last_seq is None and watcher.epoch is None
        got = await take(watcher, 3)
        for watched in got:
            index.apply_batch(watched)
        assert positions(got) == [(3, "A", True), (4, "A", False), (5, "A", False)]
        assert got[0].batch == KVEventBatch(ts=3.0, events=[AllBlocksCleared(), stored([1, 2])])
        assert got[2].batch.events == [removed([1])]
        assert index.snapshot() == {0: {2, 3}}
        assert (watcher.last_seq, watcher.epoch) == (5, "A")
        stats = watcher.stats
        assert (stats.num_batches, stats.num_events, stats.num_snapshots, stats.num_reconnects) == (3, 4, 1, 0)
        assert stats.resyncs == {} and stats.num_resyncs == 0
    await until(served.fake.ended[0])
    assert served.fake.cancelled == [0]  # closing cancelled the call
    assert served.fake.requests == [snap_req()]


@pytest.mark.parametrize("end", [(grpc.StatusCode.UNAVAILABLE, "server draining"), "return"])
async def test_a_broken_stream_resumes_from_last_seq_plus_one(servers, end) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(snap_req(), [snap(0), live(1, stored([1])), live(2, stored([2], parent=1))], end=end),
            Call(seq_req(3, "A"), [live(3, stored([3], parent=2)), live(4)]),
        ],
    )
    async with AsyncKVCacheClient(served.address) as client, EventWatcher(client, retry=FAST) as watcher:
        got = await take(watcher, 5)
        assert positions(got) == [(0, "A", True), (1, "A", False), (2, "A", False), (3, "A", False), (4, "A", False)]
        assert served.fake.requests == [snap_req(), seq_req(3, "A")]
        assert watcher.stats.num_reconnects == 1 and watcher.stats.resyncs == {}


async def test_a_dropped_connection_waits_for_the_channel_and_resumes(servers) -> None:  # type: ignore[no-untyped-def]
    first = await start(servers, [Call(snap_req(), [snap(0, 1), live(1, stored([2], parent=1))])])
    options = [
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 200),
    ]
    async with (
        AsyncKVCacheClient(first.address, options=options) as client,
        EventWatcher(client, retry=FAST) as watcher,
    ):
        assert positions(await take(watcher, 2)) == [(0, "A", True), (1, "A", False)]
        await first.stop()  # the connection goes away; the watcher cannot know where the server went
        second = await start(servers, [Call(seq_req(2, "A"), [live(2, stored([3], parent=2))])], port=first.port)
        got = await take(watcher, 1)
        assert positions(got) == [(2, "A", False)]
        assert second.fake.requests == [seq_req(2, "A")]
        assert watcher.stats.num_reconnects >= 1 and watcher.stats.resyncs == {}


async def test_an_epoch_change_resyncs_from_a_snapshot(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(
                snap_req(),
                [snap(0, 1, 2), live(1, stored([3], parent=2))],
                end=(grpc.StatusCode.UNAVAILABLE, "restart"),
            ),
            Call(seq_req(2, "A"), end=(grpc.StatusCode.FAILED_PRECONDITION, "epoch 'A' is not the current epoch 'B'")),
            Call(snap_req(), [snap(5, 7, epoch="B"), live(6, stored([8], parent=7), epoch="B")]),
        ],
    )
    index = PrefixIndex()
    async with EventWatcher(served.address, retry=FAST) as watcher:
        got = await take(watcher, 4)
        for watched in got:
            index.apply_batch(watched)
        assert positions(got) == [(0, "A", True), (1, "A", False), (5, "B", True), (6, "B", False)]
        assert index.snapshot() == {0: {7, 8}}  # nothing of epoch A survives
        assert (watcher.last_seq, watcher.epoch) == (6, "B")
        assert watcher.stats.num_reconnects == 1
        assert watcher.stats.resyncs == {ResyncReason.EPOCH_CHANGED: 1}
        assert watcher.stats.num_snapshots == 2
    assert served.fake.requests == [snap_req(), seq_req(2, "A"), snap_req()]


async def test_a_resume_below_retention_resyncs_from_a_snapshot(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(seq_req(10, "A"), end=(grpc.StatusCode.OUT_OF_RANGE, "seq 10 is below the oldest seq held (20)")),
            Call(snap_req(), [snap(25, 4)]),
        ],
    )
    async with EventWatcher(served.address, start_seq=10, epoch="A", retry=FAST) as watcher:
        assert (watcher.last_seq, watcher.epoch) == (9, "A")
        assert positions(await take(watcher, 1)) == [(25, "A", True)]
        assert watcher.stats.resyncs == {ResyncReason.OUT_OF_RANGE: 1}
        assert watcher.stats.num_reconnects == 0


async def test_resume_from_a_given_seq_follows_the_servers_epoch_when_none_is_given(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(seq_req(10, ""), [live(10, epoch="C"), live(11, epoch="C")], end=(grpc.StatusCode.UNAVAILABLE, "x")),
            Call(seq_req(12, "C"), [live(12, epoch="C")]),
        ],
    )
    async with EventWatcher(served.address, start_seq=10, retry=FAST) as watcher:
        assert positions(await take(watcher, 3)) == [(10, "C", False), (11, "C", False), (12, "C", False)]


async def test_a_seq_gap_is_never_applied_and_resyncs(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(snap_req(), [snap(0, 1), live(1, stored([2], parent=1)), live(3, stored([9]))]),
            Call(snap_req(), [snap(3, 1, 2, 5), live(4)]),
        ],
    )
    async with EventWatcher(served.address, retry=FAST) as watcher:
        got = await take(watcher, 4)
        assert positions(got) == [(0, "A", True), (1, "A", False), (3, "A", True), (4, "A", False)]
        assert all(9 not in (e.block_hashes if isinstance(e, BlockStored) else ()) for w in got for e in w.batch.events)
        assert watcher.stats.resyncs == {ResyncReason.SEQ_GAP: 1}
        await until(served.fake.ended[0])
        assert served.fake.cancelled == [0]  # the gapped call was cancelled, not left open


async def test_a_batch_from_another_epoch_resyncs(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(snap_req(), [snap(0), live(1), live(2, epoch="B")]),
            Call(snap_req(), [snap(2, epoch="B")]),
        ],
    )
    async with EventWatcher(served.address, retry=FAST) as watcher:
        assert positions(await take(watcher, 3)) == [(0, "A", True), (1, "A", False), (2, "B", True)]
        assert watcher.stats.resyncs == {ResyncReason.EPOCH_MISMATCH: 1}


async def test_falling_behind_resyncs_from_a_snapshot(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(
        servers,
        [
            Call(
                snap_req(),
                [snap(0), live(1)],
                end=(grpc.StatusCode.RESOURCE_EXHAUSTED, "subscriber fell behind at seq 1"),
            ),
            Call(snap_req(), [snap(7, 3), live(8)]),
        ],
    )
    async with EventWatcher(served.address, retry=FAST) as watcher:
        assert positions(await take(watcher, 4)) == [(0, "A", True), (1, "A", False), (7, "A", True), (8, "A", False)]
        assert watcher.stats.resyncs == {ResyncReason.FELL_BEHIND: 1}
        assert watcher.stats.num_reconnects == 0


async def test_a_snapshot_request_answered_without_one_resyncs(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(servers, [Call(snap_req(), [live(4)]), Call(snap_req(), [snap(4)])])
    async with EventWatcher(served.address, retry=FAST) as watcher:
        assert positions(await take(watcher, 1)) == [(4, "A", True)]
        assert watcher.stats.resyncs == {ResyncReason.MISSING_SNAPSHOT: 1}


async def test_an_unasked_snapshot_is_applied_as_the_new_position(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(servers, [Call(snap_req(), [snap(0), live(1), snap(9, 5), live(10)])])
    async with EventWatcher(served.address, retry=FAST) as watcher:
        got = await take(watcher, 4)
        assert positions(got) == [(0, "A", True), (1, "A", False), (9, "A", True), (10, "A", False)]
        assert watcher.stats.resyncs == {}


async def test_retries_are_bounded_and_the_last_error_is_raised(servers) -> None:  # type: ignore[no-untyped-def]
    down = (grpc.StatusCode.UNAVAILABLE, "shutting down")
    served = await start(servers, [Call(snap_req(), end=down) for _ in range(3)])
    retry = RetryPolicy(max_retries=2, initial_backoff_s=0.0, jitter=0.0)
    async with EventWatcher(served.address, retry=retry) as watcher:
        with pytest.raises(KVServiceError) as raised:
            await take(watcher, 1)
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE and raised.value.message == "shutting down"
        with pytest.raises(KVServiceError):  # and again on every later call
            await take(watcher, 1)
        assert watcher.stats.num_reconnects == 2
    assert served.fake.requests == [snap_req()] * 3


async def test_endless_gaps_are_bounded_too(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(servers, [Call(snap_req(), [live(4)]) for _ in range(2)])
    retry = RetryPolicy(max_retries=1, initial_backoff_s=0.0, jitter=0.0)
    async with EventWatcher(served.address, retry=retry) as watcher:
        with pytest.raises(KVServiceError, match="missing_snapshot") as raised:
            await take(watcher, 1)
        assert raised.value.code == grpc.StatusCode.DATA_LOSS


async def test_a_status_that_is_not_recoverable_is_raised_at_once(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(servers, [Call(snap_req(), end=(grpc.StatusCode.PERMISSION_DENIED, "read-only token"))])
    async with EventWatcher(served.address, retry=FAST) as watcher:
        with pytest.raises(KVServiceError) as raised:
            await take(watcher, 1)
        assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert watcher.stats.num_reconnects == 0 and watcher.stats.resyncs == {}
    assert served.fake.requests == [snap_req()]


async def test_close_ends_a_pending_iteration_and_cancels_the_call(servers) -> None:  # type: ignore[no-untyped-def]
    served = await start(servers, [Call(snap_req(), [snap(0)])])
    watcher = EventWatcher(served.address, retry=FAST)

    async def consume() -> list[WatchedBatch]:
        return [watched async for watched in watcher]

    consumer = asyncio.ensure_future(consume())
    await until(served.fake.opened[0])
    await watcher.close()
    got = await asyncio.wait_for(consumer, DEADLINE_S)
    assert all(w.seq == 0 for w in got)  # the snapshot, if it got through before the close
    await until(served.fake.ended[0])
    assert served.fake.cancelled == [0]
    assert watcher.closed
    with pytest.raises(StopAsyncIteration):
        await watcher.__anext__()
    with pytest.raises(RuntimeError, match="closed"):
        watcher.start()
    await watcher.close()  # idempotent


async def test_msgpack_payload_and_group_filter_are_passed_through(servers) -> None:  # type: ignore[no-untyped-def]
    events = [stored([11, 12], group=1), removed([10], group=1)]
    served = await start(
        servers,
        [
            Call(
                snap_req(group_idxs=[1], payload_format=v1.PAYLOAD_FORMAT_MSGPACK),
                [
                    batch_to_proto(
                        KVEventBatch(ts=1.0, events=[AllBlocksCleared()]),
                        seq=0,
                        epoch="A",
                        snapshot=True,
                        payload_format="msgpack",
                    ),
                    live(1, *events, payload_format="msgpack"),
                ],
                end=(grpc.StatusCode.UNAVAILABLE, "x"),
            ),
            Call(
                seq_req(2, "A", group_idxs=[1], payload_format=v1.PAYLOAD_FORMAT_MSGPACK),
                [live(2, payload_format="msgpack")],
            ),
        ],
    )
    async with EventWatcher(served.address, group_idxs=[1], payload_format="msgpack", retry=FAST) as watcher:
        got = await take(watcher, 3)
        assert positions(got) == [(0, "A", True), (1, "A", False), (2, "A", False)]
        assert got[1].batch == KVEventBatch(ts=1.0, events=events)
