"""Event sinks: where the event log's batches go besides the gRPC streams (ZMQ, NATS JetStream).

One protocol, :class:`EventSink`, in the shape of vLLM's ``EventPublisher`` (publish, shutdown)
with a null object (:class:`NullEventSink`, vLLM's ``NullEventPublisher``), and one table,
:data:`SINKS`, of the kinds a server can start: :func:`start_sinks` walks it once, starting each
kind whose settings section turns it on. The data plane and the servicer never touch a sink:
batches reach them only through the event log (``EventLog.add_listener``).

**Adding a sink**: write a class with ``publish``, ``close``, ``describe``, ``counters`` and
``notes`` (any class with them is an :class:`EventSink`; no base class), give it a settings section in
``kvservice.server.settings`` (a field of ``ServerConfig`` named like the kind), and add a
:class:`SinkKind` to :data:`SINKS` with a start function. Nothing in ``app.py`` changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvservice.server.event_log import EventLog, LogEntry
    from kvservice.server.settings import NatsSettings, ServerConfig, ZmqSettings
    from kvservice.server.snapshot import SnapshotSource

__all__ = [
    "SINKS",
    "EventSink",
    "NullEventSink",
    "SinkContext",
    "SinkKind",
    "StartedSink",
    "start_sinks",
]


@runtime_checkable
class EventSink(Protocol):
    """A destination of every event-log batch.

    Its start function registers :meth:`publish` with the event log (``EventLog.add_listener``)
    before it returns, so no batch of the epoch is missed; from then on the log calls it once per
    batch, in seq order (gap-free from 1 within an epoch), on the server's event loop.

    Attributes:
        notes: lines for the start banner (warnings such as a bind off loopback).
    """

    notes: list[str]

    def publish(self, entry: LogEntry) -> None:
        """Take one sequenced batch (``entry.seq``, ``entry.msgpack`` in vLLM's layout). Must not
        block or raise: a sink that cannot keep up queues (bounded) or drops and says so."""

    async def close(self) -> None:
        """Stop: flush what the sink promises to flush, release sockets and tasks. Idempotent."""

    def describe(self) -> str:
        """One line for the start banner: where batches go."""

    def counters(self) -> Mapping[str, int]:
        """The counters it keeps, now, by name (read at each metrics scrape; the names are
        ``kvservice.server.metrics.SINK_METRICS``': ``num_published``, ``num_dropped``,
        ``num_pending``, ``num_retries``, ``num_reconnects``, ``num_replays``; a sink leaves out
        what it does not count)."""


class NullEventSink:
    """The sink that takes every batch and does nothing (a server with no sink configured)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def publish(self, entry: LogEntry) -> None:
        """Drop the batch."""

    async def close(self) -> None:
        """Nothing to close."""

    def describe(self) -> str:
        """``"no event sink"``."""
        return "no event sink"

    def counters(self) -> Mapping[str, int]:
        """None: it counts nothing."""
        return {}


@dataclass(frozen=True)
class SinkContext:
    """What a sink's start function gets besides its own settings section.

    Attributes:
        event_log: the log whose batches it publishes.
        port: the server's bound gRPC port (names NATS's default instance).
        allow_insecure_bind: the auth section's rule for a bind off loopback (ZMQ has no auth).
        snapshots: where a snapshot is cut (``kvservice.server.snapshot.SnapshotSource``): ZMQ
            answers a replay from below retention with one (None: no snapshot; such a replay
            gets the retained batches only).
    """

    event_log: EventLog
    port: int
    allow_insecure_bind: bool
    snapshots: SnapshotSource | None = None


@dataclass
class StartedSink:
    """A started sink and what the running server records of it.

    Attributes:
        sink: the sink.
        resolved: the flat settings it resolved at start (e.g. ``nats_instance``), which the
            running server's config records.
        zmq_seq_base: the ZMQ wire seq of its epoch start (``ZmqEventPublisher.seq_base``), which
            ``GetKVCacheGroupMetadata`` publishes; None for other sinks.
    """

    sink: EventSink
    resolved: dict[str, Any] = field(default_factory=dict)
    zmq_seq_base: int | None = None


@dataclass(frozen=True)
class SinkKind:
    """One kind of sink.

    Attributes:
        name: the kind, also the name of its settings section on ``ServerConfig`` ("zmq").
        enabled: whether its section turns it on.
        start: start it (raises as the sink's own start does; nothing is left open then).
    """

    name: str
    enabled: Callable[[Any], bool]
    start: Callable[[Any, SinkContext], Awaitable[StartedSink]]


async def _start_zmq(settings: ZmqSettings, ctx: SinkContext) -> StartedSink:
    from kvservice.server.zmq_publisher import ZmqEventPublisher

    assert settings.endpoint is not None
    publisher = await ZmqEventPublisher.start(
        ctx.event_log,
        endpoint=settings.endpoint,
        replay_endpoint=settings.replay_endpoint,
        topic=settings.topic or "",
        hwm=settings.hwm,
        allow_insecure_bind=ctx.allow_insecure_bind,
        snapshots=ctx.snapshots,
    )
    return StartedSink(publisher, zmq_seq_base=publisher.seq_base)


async def _start_nats(settings: NatsSettings, ctx: SinkContext) -> StartedSink:
    from kvservice.server.nats_sink import start_nats_sink

    sink = await start_nats_sink(ctx.event_log, settings, port=ctx.port)
    return StartedSink(sink, {"nats_instance": sink.config.instance})


SINKS: tuple[SinkKind, ...] = (
    SinkKind("zmq", lambda s: s.endpoint is not None, _start_zmq),
    SinkKind("nats", lambda s: s.url is not None, _start_nats),
)
"""The kinds a server can start, in start order (closed in reverse)."""


async def start_sinks(config: ServerConfig, ctx: SinkContext) -> dict[str, StartedSink]:
    """Start every kind of :data:`SINKS` whose section (``config.<kind>``: ``config.zmq``) turns it
    on; each start is handed its own section and ``ctx``.

    Returns:
        The started sinks by kind, in start order.

    Raises:
        Whatever a sink's start raises (``ValueError`` for a refused bind, ``RuntimeError`` for
        a missing optional dependency or an unreachable endpoint), after closing the sinks
        already started.
    """
    started: dict[str, StartedSink] = {}
    try:
        for kind in SINKS:
            section = getattr(
                config, kind.name
            )  # a section of ServerConfig per kind (tests/unit/test_settings_table.py)
            if kind.enabled(section):
                started[kind.name] = await kind.start(section, ctx)
    except BaseException:
        for done in reversed(started.values()):
            await done.sink.close()
        raise
    return started
