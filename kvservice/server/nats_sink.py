"""Publish the event log to a NATS JetStream stream, so watchers on any host consume it durably.

The wire (what :class:`kvservice_client.jetstream.JetStreamWatcher` reads; any NATS client can):

* **Stream** ``stream`` (created at start, or updated to these settings when it exists) captures
  ``{subject_prefix}.>``, file storage, retention by age (``max_age_s``), count (``max_msgs``)
  and size (``max_bytes``), oldest discarded first, and a ``duplicate_window_s`` dedup window.
  Several kvservice instances may share one stream; each start re-applies its own settings (give
  them all the same ones).
* **Subject** ``{subject_prefix}.{instance}``: one per server instance, so a consumer can filter
  one instance (``kvservice.events.node1-50051``) or take all (``kvservice.events.>``).
* **The epoch start**: the first message of every server epoch has ``Kvservice-Seq: 0`` and one
  ``AllBlocksCleared``, so a consumer that reads the stream in order and knows nothing of epochs
  drops a restarted server's dead blocks before its first batch (``JetStreamWatcher`` clears on
  the epoch change and skips it). Across restarts of one instance the JetStream *stream* sequence
  keeps increasing (a seq-tracking consumer uses it); ``Kvservice-Seq`` counts per epoch, as
  gRPC's seq does.
* **One message per event-log batch**, published once, in seq order. Payload: the batch's msgpack
  bytes in vLLM's layout (:attr:`LogEntry.msgpack <kvservice.server.event_log.LogEntry>`,
  ``[ts, events, data_parallel_rank]``), byte-identical to what StreamEvents (msgpack) and the
  ZMQ publisher carry.
* **Headers** (:mod:`kvservice_client.jetstream` names them): ``Kvservice-Seq`` (the batch's seq,
  gap-free from 1 within an epoch), ``Kvservice-Epoch`` (the server epoch; it changes on restart,
  and a new epoch starts with an empty cache), ``Kvservice-Instance``,
  ``Kvservice-Data-Parallel-Rank`` (only when set), ``Nats-Msg-Id: {epoch}:{seq}`` (a re-publish
  of the same batch within ``duplicate_window_s`` is dropped by the stream and acked as a
  duplicate), and on the first batch published after batches were dropped, ``Kvservice-Resync:
  {first}-{last}`` (the seqs dropped). ``Nats-Expected-Stream`` makes a publish fail rather than
  land in another stream.

One subject per instance, not per KV cache group: a router predicting a hit on a hybrid model
needs every group's blocks (its hit is the longest prefix all groups agree on), so it takes every
group anyway; per-group subjects would multiply the publishes, acks and msg ids of a batch by the
number of groups and split one atomic batch into messages a consumer could see half of. A
consumer that wants one group drops the other groups' events after decoding.

**Delivery.** The event log calls :meth:`NatsJetStreamSink.enqueue` after each batch; it only
appends to a bounded queue (``max_pending_batches``) and wakes the publishing task: the loop is
never blocked. The task publishes the oldest queued batch and waits for the stream's ack before
the next (one publish in flight keeps the stream in seq order: a retried batch can never land
after a later one). A failed publish (timeout, no stream, disconnected) is retried, the same
batch, with exponential backoff up to ``max_backoff_s``, until acked; the NATS client reconnects
by itself, a stream that vanished is created again, and a duplicate ack (the first try had been
stored) counts as acked. If the queue is full, the new batch is dropped, never silently: an ERROR
names the seqs, :attr:`NatsJetStreamSink.num_dropped` counts them, the next batch published
carries ``Kvservice-Resync``, and its seq jumps, so a watcher sees the gap either way and must
rebuild that instance's mirror from a snapshot (gRPC StreamEvents with a snapshot). A batch above
the NATS server's ``max_payload`` (1 MiB by default: raise it for long prompts) cannot ever be
published: it is dropped the same way.

Throughput: one round trip to NATS per batch (tens of microseconds on loopback; a batch is one
scheduler call's events, so a step-batched scheduler publishes one message per step).

nats-py is an optional dependency: ``pip install nats-py`` (the ``nats`` extra).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvservice.server.event_log import LogEntry
from kvservice.server.settings import NatsSettings, check_name, check_retention, check_subject_prefix, split_servers
from kvservice_client.events import AllBlocksCleared
from kvservice_client.jetstream import (
    HEADER_DATA_PARALLEL_RANK,
    HEADER_EPOCH,
    HEADER_INSTANCE,
    HEADER_RESYNC,
    HEADER_SEQ,
    NatsCredentialsRefusedError,
    connect_nats,
    msg_id,
    redact_url,
    subject_for,
)
from kvservice_client.jetstream import import_nats as client_import_nats

if TYPE_CHECKING:
    from kvservice.server.event_log import EventLog

logger = logging.getLogger(__name__)

__all__ = [
    "NatsJetStreamSink",
    "NatsSinkConfig",
    "check_name",
    "check_retention",
    "check_subject_prefix",
    "default_instance",
    "import_nats",
    "start_nats_sink",
]


def import_nats() -> Any:
    """Import nats-py for the sink: :func:`kvservice_client.jetstream.import_nats`, the error named
    after the server's setting.

    Raises:
        RuntimeError: nats-py is not installed (``nats_url needs nats-py, ...: pip install
            nats-py (kvservice's nats extra)``).
    """
    return client_import_nats("nats_url", "kvservice's nats")


def default_instance(hostname: str, port: int) -> str:
    """The default instance name, ``<hostname>-<port>``, made a single subject token (every
    character outside ``[A-Za-z0-9_-]``, dots of a FQDN included, becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{hostname}-{port}")


@dataclass(frozen=True)
class NatsSinkConfig:
    """Where and how the sink publishes: the ``nats_*`` settings (their meaning, defaults and
    bounds are :class:`~kvservice.server.settings.NatsSettings`'), the instance resolved, and the
    sink's own timings.

    Attributes:
        settings: the ``nats`` section (``url`` set).
        instance: this server's subject token (``settings.instance`` or :func:`default_instance`).
        publish_timeout_s: wait for one publish's ack, in seconds, before retrying it.
        connect_timeout_s: how long :meth:`NatsJetStreamSink.start` tries to reach NATS, in seconds.
        reconnect_wait_s: pause between the NATS client's reconnect attempts, in seconds.
        max_backoff_s: longest wait between two tries of a failing publish, in seconds.
        flush_timeout_s: how long :meth:`NatsJetStreamSink.close` waits for queued batches, in seconds.

    The settings read through: ``servers`` (the URLs of ``nats_url``), ``subject_prefix``,
    ``stream``, ``max_age_s``, ``max_msgs``, ``max_bytes``, ``duplicate_window_s``,
    ``max_pending_batches``, and ``subject``.

    Raises:
        ValueError: ``nats_url`` unset, a bad instance name, or a timing <= 0 (named).
    """

    settings: NatsSettings
    instance: str
    publish_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    reconnect_wait_s: float = 0.5
    max_backoff_s: float = 2.0
    flush_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.settings.url is None:
            raise ValueError("nats_url is not set")
        check_name("nats_instance", self.instance)
        for name in ("publish_timeout_s", "connect_timeout_s", "reconnect_wait_s", "max_backoff_s", "flush_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds; got {getattr(self, name)}")

    @classmethod
    def from_settings(cls, settings: NatsSettings, *, port: int, hostname: str | None = None) -> NatsSinkConfig:
        """The sink's config of a server bound on ``port`` (which, with ``hostname``, names the
        default instance)."""
        return cls(settings, settings.instance or default_instance(hostname or socket.gethostname(), port))

    def __getattr__(self, name: str) -> Any:
        if name in _FROM_SETTINGS:
            return getattr(self.settings, name)
        raise AttributeError(f"'NatsSinkConfig' object has no attribute {name!r}")

    @property
    def servers(self) -> tuple[str, ...]:
        """The NATS server URLs of ``nats_url``; the client reconnects among them."""
        return split_servers(self.settings.url or "")

    @property
    def subject(self) -> str:
        """This instance's subject, ``{subject_prefix}.{instance}``."""
        return subject_for(self.settings.subject_prefix, self.instance)


_FROM_SETTINGS = frozenset(
    {"subject_prefix", "stream", "max_age_s", "max_msgs", "max_bytes", "duplicate_window_s", "max_pending_batches"}
)


def _describe(error: BaseException) -> str:
    """``Type: message``, or ``Type`` when the message is empty."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def start_nats_sink(event_log: EventLog, settings: NatsSettings, *, port: int) -> NatsJetStreamSink:
    """Start the sink of a server with ``nats_url`` set (its bound ``port`` names the default
    instance).

    Raises:
        RuntimeError: as :meth:`NatsJetStreamSink.start`.
    """
    return await NatsJetStreamSink.start(event_log, NatsSinkConfig.from_settings(settings, port=port))


class NatsJetStreamSink:
    """Publishes every event-log batch to JetStream, once, in order (see the module docstring).

    Build it with :meth:`start` on the server's loop; stop it with :meth:`close`.

    Attributes:
        config: the settings.
        num_published: batches the stream acked as stored.
        num_duplicates: publishes the stream acked as duplicates (a retry of a stored batch).
        num_retries: publish attempts that failed and were retried.
        num_dropped: batches never published (queue full, too large, or still queued at close).
        last_published_seq: seq of the last batch acked (0 before any).
    """

    def __init__(self, event_log: EventLog, config: NatsSinkConfig, nats: Any) -> None:
        """Use :meth:`start`; this only assembles the parts."""
        self.config = config
        self._log = event_log
        self._nats = nats
        self._nc: Any = None
        self._js: Any = None
        self._epoch = event_log.epoch
        self._rank = event_log.data_parallel_rank
        # (entry, the seq range dropped just before it or None), oldest first.
        self._pending: collections.deque[tuple[LogEntry, tuple[int, int] | None]] = collections.deque()
        self._dropped: tuple[int, int] | None = None  # seqs dropped since the last batch queued
        self._wakeup = asyncio.Event()
        self._progress = asyncio.Event()  # set whenever the queue shrinks
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.notes: list[str] = []  # start-banner lines besides describe() (EventSink)
        self.num_published = 0
        self.num_duplicates = 0
        self.num_retries = 0
        self.num_reconnects = 0
        self.num_dropped = 0
        self.last_published_seq = 0

    @classmethod
    async def start(cls, event_log: EventLog, config: NatsSinkConfig) -> NatsJetStreamSink:
        """Connect, create (or update) the stream, register with ``event_log`` and start publishing.

        The listener is registered before connecting and every batch the log already holds is
        queued, so no batch of this epoch is missed, whenever it was appended.

        Raises:
            RuntimeError: nats-py is missing, NATS cannot be reached within ``connect_timeout_s``,
                the NATS server refused the credentials in the URL (at once, not after the
                timeout), or the stream cannot be created or updated (the message names the URL,
                its password or token redacted, or the stream).
        """
        nats = import_nats()
        sink = cls(event_log, config, nats)
        # The epoch start: seq 0, one AllBlocksCleared, published before the epoch's first batch.
        epoch_start = LogEntry(0, time.time(), [AllBlocksCleared()], event_log.epoch, event_log.data_parallel_rank)
        sink._pending.append((epoch_start, None))
        # A batch appended in this turn of the loop reaches the listeners when it settles: settle
        # it now, so it is queued once (below, with the rest the log holds), not again then.
        event_log.settle()
        event_log.add_listener(sink.publish)
        if event_log.head_seq:
            for entry in event_log.entries_from(event_log.oldest_seq):
                sink.enqueue(entry)
        try:
            await sink._connect()
            await sink._ensure_stream()
        except BaseException:
            sink._closed = True
            if sink._nc is not None:
                with contextlib.suppress(Exception):
                    await sink._nc.close()
            raise
        sink._task = asyncio.get_running_loop().create_task(sink._run(), name="nats-jetstream-sink")
        return sink

    def describe(self) -> str:
        """One line: where batches go."""
        c = self.config
        servers = redact_url(",".join(c.servers))
        return f"NATS JetStream KV events to stream {c.stream}, subject {c.subject} ({servers})"

    @property
    def num_pending(self) -> int:
        """Batches queued, not yet acked."""
        return len(self._pending)

    def counters(self) -> dict[str, int]:
        """Published (acked), dropped, pending, retries and reconnects (the EventSink's counters)."""
        return {
            "num_published": self.num_published,
            "num_dropped": self.num_dropped,
            "num_pending": self.num_pending,
            "num_retries": self.num_retries,
            "num_reconnects": self.num_reconnects,
        }

    # -- the event log's listener ----------------------------------------------------------

    def enqueue(self, entry: LogEntry) -> None:
        """Queue one batch for publishing (the event log's listener; never blocks, never raises).

        A full queue drops the batch: counted, logged at ERROR, announced on the next batch queued.
        """
        if self._closed:
            return
        if len(self._pending) >= self.config.max_pending_batches:
            self._drop(entry.seq, f"the queue is full (nats_max_pending_batches {self.config.max_pending_batches})")
            return
        if self._dropped is not None:
            logger.error(
                "NATS sink: batches seq %d-%d of epoch %s were dropped; seq %d carries %s",
                *self._dropped,
                self._epoch,
                entry.seq,
                HEADER_RESYNC,
            )
        self._pending.append((entry, self._dropped))
        self._dropped = None
        self._wakeup.set()

    publish = enqueue
    """:meth:`kvservice.server.sinks.EventSink.publish`: :meth:`enqueue`."""

    def _drop(self, seq: int, why: str) -> None:
        self.num_dropped += 1
        if self._dropped is None:
            logger.error(
                "NATS sink: dropped batch seq %d of epoch %s, %s; watchers of instance %s must resync from a snapshot",
                seq,
                self._epoch,
                why,
                self.config.instance,
            )
            self._dropped = (seq, seq)
        else:
            self._dropped = (self._dropped[0], seq)

    # -- publishing ------------------------------------------------------------------------

    def headers_for(self, entry: LogEntry, resync: tuple[int, int] | None = None) -> dict[str, str]:
        """The headers of one batch's message (see the module docstring)."""
        headers = {
            "Nats-Msg-Id": msg_id(self._epoch, entry.seq),
            HEADER_SEQ: str(entry.seq),
            HEADER_EPOCH: self._epoch,
            HEADER_INSTANCE: self.config.instance,
        }
        if self._rank is not None:
            headers[HEADER_DATA_PARALLEL_RANK] = str(self._rank)
        if resync is not None:
            headers[HEADER_RESYNC] = f"{resync[0]}-{resync[1]}"
        return headers

    async def publish_entry(self, entry: LogEntry, resync: tuple[int, int] | None = None) -> Any:
        """Publish one batch once and wait for the stream's ack (the one publish path).

        Returns:
            The ``nats.js.api.PubAck`` (``duplicate`` is True when the stream already held this
            ``Nats-Msg-Id``).

        Raises:
            nats.errors.Error: the publish failed (timeout, no stream, too large, disconnected).
        """
        return await self._js.publish(
            self.config.subject,
            entry.msgpack,
            timeout=self.config.publish_timeout_s,
            stream=self.config.stream,
            headers=self.headers_for(entry, resync),
        )

    async def _run(self) -> None:
        nats = self._nats
        backoff_s = 0.0
        failing_since: int | None = None  # seq whose publish started failing (logged once)
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            entry, resync = self._pending[0]
            try:
                ack = await self.publish_entry(entry, resync)
            except asyncio.CancelledError:
                raise
            except nats.errors.MaxPayloadError:
                self._pending.popleft()
                self._progress.set()
                self._drop_unpublishable(entry, resync)
                continue
            except Exception as e:
                self.num_retries += 1
                if failing_since is None:
                    failing_since = entry.seq
                    logger.warning(
                        "NATS sink: publishing seq %d failed (%s); retrying until acked", entry.seq, _describe(e)
                    )
                if isinstance(e, nats.js.errors.NoStreamResponseError):
                    with contextlib.suppress(Exception):
                        await self._ensure_stream()  # the stream was deleted, or NATS lost its store
                backoff_s = min(self.config.max_backoff_s, max(0.05, 2 * backoff_s))
                await asyncio.sleep(backoff_s)
                continue
            if failing_since is not None:
                logger.warning("NATS sink: publishing resumed at seq %d", entry.seq)
                failing_since = None
            backoff_s = 0.0
            self._pending.popleft()
            self._progress.set()
            if ack.duplicate:
                self.num_duplicates += 1
            else:
                self.num_published += 1
            self.last_published_seq = entry.seq

    def _drop_unpublishable(self, entry: LogEntry, resync: tuple[int, int] | None) -> None:
        """Drop the batch just taken off the queue's head (too large to ever publish): the next
        batch (queued or future) announces it, with any earlier drop it was to announce."""
        self.num_dropped += 1
        first = entry.seq if resync is None else resync[0]
        logger.error(
            "NATS sink: dropped batch seq %d of epoch %s: it is %d bytes, above the NATS server's max_payload; "
            "raise max_payload in the NATS server's config. Watchers of instance %s must resync from a snapshot",
            entry.seq,
            self._epoch,
            len(entry.msgpack),
            self.config.instance,
        )
        if self._pending:
            after, gap = self._pending[0]
            self._pending[0] = (after, (first, entry.seq if gap is None else gap[1]))
        else:
            self._dropped = (first, entry.seq if self._dropped is None else self._dropped[1])

    async def _connect(self) -> None:
        nats = self._nats
        c = self.config

        async def on_error(e: Exception) -> None:
            logger.debug("NATS sink: %s: %s", type(e).__name__, e)

        async def on_disconnected() -> None:
            if not self._closed:
                logger.warning("NATS sink: disconnected from %s; reconnecting", servers)

        async def on_reconnected() -> None:
            self.num_reconnects += 1
            logger.warning("NATS sink: reconnected to %s", redact_url(self._nc.connected_url if self._nc else None))

        servers = redact_url(",".join(c.servers))  # never log or print the password or token
        try:
            self._nc = await connect_nats(
                nats,
                list(c.servers),
                connect_timeout_s=c.connect_timeout_s,
                error_cb=on_error,
                name=f"kvservice-{c.instance}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=c.reconnect_wait_s,
                connect_timeout=min(2.0, c.connect_timeout_s),
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            )
        except NatsCredentialsRefusedError as e:
            raise RuntimeError(f"nats_url: {e}") from None
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as e:
            raise RuntimeError(
                f"nats_url: cannot reach NATS at {servers} within {c.connect_timeout_s} s ({_describe(e)})"
            ) from None
        self._js = self._nc.jetstream(timeout=c.publish_timeout_s)

    async def _ensure_stream(self) -> None:
        """Create the stream, or update it to this config when it exists with another.

        Raises:
            RuntimeError: JetStream refused (not enabled, a subject overlap, a change it forbids).
        """
        nats = self._nats
        api = nats.js.api
        c = self.config
        stream_config = api.StreamConfig(
            name=c.stream,
            subjects=[f"{c.subject_prefix}.>"],
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
            max_age=c.max_age_s,
            max_msgs=c.max_msgs or -1,
            max_bytes=c.max_bytes or -1,
            duplicate_window=c.duplicate_window_s,
        )
        try:
            try:
                await self._js.add_stream(stream_config)
            except nats.js.errors.BadRequestError as e:
                if e.err_code != 10058:  # "stream name already in use with a different configuration"
                    raise
                await self._js.update_stream(stream_config)
        except (asyncio.TimeoutError, nats.errors.Error) as e:
            raise RuntimeError(
                f"nats_stream: cannot create or update JetStream stream {c.stream!r} for subjects "
                f"{c.subject_prefix}.> ({_describe(e)}); is JetStream enabled (nats-server -js)?"
            ) from None

    # -- stop ------------------------------------------------------------------------------

    async def wait_published(self, seq: int, timeout_s: float | None = None) -> None:
        """Wait until every queued batch up to ``seq`` has left the queue (acked or dropped).

        Raises:
            asyncio.TimeoutError: not within ``timeout_s`` seconds.
        """

        async def wait() -> None:
            while self._pending and self._pending[0][0].seq <= seq:
                self._progress.clear()
                await self._progress.wait()

        await asyncio.wait_for(wait(), timeout_s)

    async def close(self) -> None:
        """Stop: publish what is queued (at most ``flush_timeout_s`` seconds), then close the
        connection. Batches still queued then are dropped and logged at ERROR. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pending and self._task is not None and not self._task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await self.wait_published(self._pending[-1][0].seq, self.config.flush_timeout_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            first, last = self._pending[0][0].seq, self._pending[-1][0].seq
            self.num_dropped += len(self._pending)
            self._pending.clear()
            logger.error(
                "NATS sink: closing with batches seq %d-%d of epoch %s unpublished (NATS unreachable for %.1f s)",
                first,
                last,
                self._epoch,
                self.config.flush_timeout_s,
            )
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
