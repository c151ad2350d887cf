"""One EventSink seam: ZMQ and NATS are EventSinks, started by one loop over SINKS, held by kind,
fed every batch in seq order by the event log, closed in reverse at stop."""

from __future__ import annotations

import pytest

import kvservice.server.sinks as sinks
from kvservice.server.nats_sink import NatsJetStreamSink
from kvservice.server.settings import ServerConfig
from kvservice.server.sinks import EventSink, NullEventSink, SinkContext, SinkKind, StartedSink, start_sinks
from kvservice.server.zmq_publisher import ZmqEventPublisher


class RecordingSink:
    """An EventSink that keeps what it is given."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.notes: list[str] = [f"{name} note"]
        self.seqs: list[int] = []

    def publish(self, entry) -> None:
        self.seqs.append(entry.seq)

    async def close(self) -> None:
        self.log.append(f"close {self.name}")

    def describe(self) -> str:
        return f"{self.name} sink"

    def counters(self) -> dict[str, int]:
        return {"num_published": len(self.seqs)}


def _kind(name: str, log: list[str], *, fail: bool = False, enabled: bool = True) -> SinkKind:
    async def start(settings, ctx: SinkContext) -> StartedSink:
        log.append(f"start {name}")
        if fail:
            raise RuntimeError(f"{name} cannot start")
        sink = RecordingSink(name, log)
        ctx.event_log.add_listener(sink.publish)
        return StartedSink(sink)

    return SinkKind(name, lambda settings: enabled, start)


def test_zmq_nats_and_null_are_event_sinks():
    for cls in (ZmqEventPublisher, NatsJetStreamSink, NullEventSink, RecordingSink):
        for method in ("publish", "close", "describe", "counters"):
            assert callable(getattr(cls, method)), (cls, method)
    assert isinstance(NullEventSink(), EventSink)
    assert NullEventSink().describe() == "no event sink" and NullEventSink().notes == []
    assert NullEventSink().counters() == {}
    assert [kind.name for kind in sinks.SINKS] == ["zmq", "nats"]


async def test_one_loop_starts_the_enabled_kinds_in_order_and_feeds_them_every_batch(
    start_kv_server, connect, monkeypatch
):
    log: list[str] = []
    monkeypatch.setattr(sinks, "SINKS", (_kind("zmq", log), _kind("nats", log, enabled=False)))
    running = await start_kv_server()
    assert list(running.sinks) == ["zmq"] and log == ["start zmq"]
    assert isinstance(running.sinks["zmq"], EventSink)
    assert isinstance(running.sink("nats"), NullEventSink) and running.nats_sink is None
    assert running.sink("zmq") is running.sinks["zmq"]
    assert running.zmq_publisher is None  # the typed accessor gives the ZMQ publisher only, not another kind's sink
    assert running.notes[-2:] == ["zmq sink", "zmq note"]
    client = await connect(running)
    for request_id, first in (("r1", 0), ("r2", 100)):  # each allocation publishes one BlockStored batch
        await client.get_computed_blocks(request_id, list(range(first, first + 12)))
        await client.allocate_slots(request_id, 12)
    assert running.event_log.head_seq == 2
    assert running.sinks["zmq"].seqs == [1, 2]
    await running.stop(0)
    assert log == ["start zmq", "close zmq"]


async def test_a_sink_that_fails_to_start_closes_those_started_and_the_server(start_kv_server, monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(sinks, "SINKS", (_kind("zmq", log), _kind("nats", log, fail=True)))
    with pytest.raises(RuntimeError, match="nats cannot start"):
        await start_kv_server()
    assert log == ["start zmq", "start nats", "close zmq"]


async def test_start_sinks_with_nothing_enabled_starts_nothing():
    log: list[str] = []
    kinds = (_kind("zmq", log, enabled=False),)
    original = sinks.SINKS
    sinks.SINKS = kinds
    try:
        assert await start_sinks(ServerConfig(), SinkContext(None, 0, False)) == {}  # type: ignore[arg-type]
    finally:
        sinks.SINKS = original
    assert log == []


async def test_the_real_zmq_sink_is_started_by_the_loop_and_held_by_kind(start_kv_server):
    pytest.importorskip("zmq")
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*")
    sink = running.sinks["zmq"]
    assert isinstance(sink, ZmqEventPublisher) and isinstance(sink, EventSink)
    assert list(running.sinks) == ["zmq"] and sink.close in running.closers
    assert sink.describe() in running.notes
