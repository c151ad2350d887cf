"""The sequenced, bounded KV event log: batches, retention, stream cursors and named consumers.

Each mutating call's events become one batch with the next sequence number (gap-free from 1 within
an epoch; the epoch is a random instance id that changes on restart). The log keeps a bounded
window of recent batches (``max_batches`` and ``max_bytes``), from which ``StreamEvents(start_seq)``
replays and ``TakeEvents`` consumers read. A batch is held as its msgpack bytes (vLLM's layout)
plus whatever wire encodings the servicer cached on it (:meth:`EventLog.cache_encoding`, made once
per payload format and group filter, the same bytes for every subscriber); its Python events are
kept only while it is the newest batch and decoded from the msgpack bytes when asked for later.
``max_bytes`` and :attr:`EventLog.retained_bytes` count all of that: msgpack bytes, encodings and
a fixed per-batch overhead (:data:`ENTRY_OVERHEAD_BYTES`).

Nothing here knows protobuf or the cached set: the servicer edge (``kvservice.server.encoding``)
turns entries into ``EventBatch`` messages, and snapshots come from ``kvservice.server.snapshot``
(fed by a listener of this log).

Subscribers are cursors into the window, not queues. A subscriber more than
``max_subscriber_lag`` batches behind the head (or whose next batch left the window) is ended with
RESOURCE_EXHAUSTED naming its last delivered seq; never a silent gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvservice.core.errors import (
    CapacityExceededError,
    EpochMismatchError,
    InvalidArgumentError,
    SeqOutOfRangeError,
    ShuttingDownError,
)
from kvservice.server.settings import EventsSettings
from kvservice_client.events import AllBlocksCleared, KVEvent, KVEventBatch, decode_event_batch, encode_event_batch

logger = logging.getLogger(__name__)

__all__ = [
    "ENCODING_OVERHEAD_BYTES",
    "ENTRY_OVERHEAD_BYTES",
    "EventLog",
    "EventLogConfig",
    "LogEntry",
    "Subscriber",
    "filter_events",
]

ENTRY_OVERHEAD_BYTES = 400
"""Bytes a retained batch costs beyond its msgpack bytes and encodings (the entry object, its
encodings table, the bytes objects' headers, its slot in the window), as measured with tracemalloc
(tests/unit/test_event_log_memory.py)."""

ENCODING_OVERHEAD_BYTES = 200
"""Bytes a cached encoding costs beyond its length (its key, its slot in the entry's table)."""

MAX_EPOCH_BYTES = 256
"""Longest epoch a request may name, in UTF-8 bytes (an epoch is 32 hex digits)."""


EventLogConfig = EventsSettings
"""The event log's bounds: the ``events`` settings section
(:class:`kvservice.server.settings.EventsSettings`, which documents and checks each)."""


class LogEntry:
    """One batch of the log.

    Attributes:
        seq, ts: its seq and wall-clock time (seconds).
        epoch, data_parallel_rank: copied onto every encoding of it.
        msgpack: the batch in vLLM's msgpack layout (``[ts, events, data_parallel_rank]``), encoded
            on first read (the log reads it when it settles the batch: :meth:`EventLog.settle`).
        encodings: wire encodings cached by the servicer edge, by (payload format, group filter);
            add through :meth:`EventLog.cache_encoding` so the log counts them.
        num_bytes: what the log counts for it (msgpack once settled, encodings,
            ``ENTRY_OVERHEAD_BYTES``).
    """

    __slots__ = ("seq", "ts", "_msgpack", "encodings", "epoch", "data_parallel_rank", "num_bytes", "_events")

    def __init__(self, seq: int, ts: float, events: list[KVEvent], epoch: str, rank: int | None) -> None:
        self.seq = seq
        self.ts = ts
        self.epoch = epoch
        self.data_parallel_rank = rank
        self._events: list[KVEvent] | None = events
        self._msgpack: bytes | None = None
        self.encodings: dict[tuple[int, tuple[int, ...] | None], bytes] = {}
        self.num_bytes = ENTRY_OVERHEAD_BYTES

    @property
    def msgpack(self) -> bytes:
        """The batch in vLLM's msgpack layout (encoded once, on first read)."""
        data = self._msgpack
        if data is None:
            assert self._events is not None  # events are released only after the bytes exist
            data = self._msgpack = encode_event_batch(KVEventBatch(self.ts, self._events, self.data_parallel_rank))
        return data

    @property
    def events(self) -> list[KVEvent]:
        """The batch's events (the originals while it is the newest batch, else decoded from
        :attr:`msgpack`: equal values, new objects)."""
        if self._events is not None:
            return self._events
        return decode_event_batch(self.msgpack).events

    def _release_events(self) -> None:
        self.msgpack  # noqa: B018  # the bytes first: they replace the events
        self._events = None


def filter_events(events: list[KVEvent], group_idxs: tuple[int, ...] | None) -> list[KVEvent]:
    """The events of the groups in ``group_idxs`` (None: all), AllBlocksCleared always."""
    if group_idxs is None:
        return events
    return [e for e in events if isinstance(e, AllBlocksCleared) or e.group_idx in group_idxs]


@dataclass(eq=False)
class Subscriber:
    """A stream subscriber's cursor.

    Attributes:
        next_seq: the next seq to deliver.
        payload_format, group_idxs: what it asked for.
        ended: resolved when the subscription must end (it fell behind, or shutdown), with a
            function that builds the error from the last seq delivered by then.
    """

    next_seq: int
    payload_format: int
    group_idxs: tuple[int, ...] | None
    handler: asyncio.Task | None = None
    stalled_write_timeout_s: float = 30.0
    num_write_timeouts: int = 0
    abandoned: bool = False
    ended: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def last_seq(self) -> int:
        """The last seq delivered (0 when none)."""
        return self.next_seq - 1

    def end(self, make_error: Callable[[int], Exception]) -> None:
        """Mark the subscription ended; ``make_error(last_seq)`` is raised to its handler.

        A handler that is not back within ``stalled_write_timeout_s`` (blocked in a write to a
        client that stopped reading) is cancelled: the call ends with this status then.
        """
        if self.ended.done():
            return
        self.ended.set_result(make_error)
        if self.handler is not None:
            asyncio.get_running_loop().call_later(self.stalled_write_timeout_s, self._abandon)

    def _abandon(self) -> None:
        if self.handler is not None and not self.handler.done():
            self.abandoned = True
            logger.warning("cancelled a stream whose client stopped reading (next seq %d)", self.next_seq)
            self.handler.cancel()

    def write_timed_out(self) -> None:
        """One write took longer than ``stalled_write_timeout_s``: cancel the handler, which ends
        the call with DEADLINE_EXCEEDED naming the bound and the last seq delivered."""
        self.num_write_timeouts += 1
        if self.handler is not None and not self.handler.done():
            logger.warning(
                "cancelled a stream: a write took over %g s (client not reading, or its connection is dead); "
                "next seq %d",
                self.stalled_write_timeout_s,
                self.next_seq,
            )
            self.handler.cancel()

    def raise_if_ended(self) -> None:
        """Raise the ending error, naming the last seq delivered, if the subscription was ended.

        Raises:
            CapacityExceededError | ShuttingDownError: the subscription was ended.
        """
        if self.ended.done() and not self.ended.cancelled():
            raise self.ended.result()(self.last_seq)


class EventLog:
    """Sequenced batches, retention, stream subscribers and named consumers.

    Args:
        num_groups: KV cache groups (for filters).
        group_kinds: per group, the kind string (for a snapshot source attached to the log).
        group_windows: per group, the sliding window (likewise).
        config: bounds.
        data_parallel_rank: copied onto every batch.
        epoch: this instance's epoch (default: a fresh random id).
        clock: seconds of a monotonic clock, for consumer expiry (default ``time.monotonic``).
    """

    def __init__(
        self,
        num_groups: int,
        group_kinds: Sequence[str | None],
        group_windows: Sequence[int | None],
        config: EventLogConfig | None = None,
        *,
        data_parallel_rank: int | None = None,
        epoch: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.num_groups = num_groups
        self.group_kinds = tuple(group_kinds)
        self.group_windows = tuple(group_windows)
        self.config = config or EventLogConfig()
        self.data_parallel_rank = data_parallel_rank
        self.epoch = epoch or uuid.uuid4().hex
        self.head_seq = 0
        self._entries: list[LogEntry] = []
        self._start = 0  # index of the oldest retained entry in _entries
        self._bytes = 0  # sum of num_bytes of the retained entries
        self._subscribers: set[Subscriber] = set()
        self._consumers: dict[str, int] = {}
        # consumer -> clock() at its last take, least recent first (for consumer_idle_timeout_s).
        self._consumer_last_take: OrderedDict[str, float] = OrderedDict()
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._closed = False
        self.num_events = 0
        self._listeners: list[Callable[[LogEntry], None]] = []
        self._unsettled: LogEntry | None = None  # the newest batch, until settle() counts its bytes

    # -- writing ----------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[LogEntry], None]) -> None:
        """Call ``listener(entry)`` for every batch when it settles (:meth:`settle`), in seq order,
        on the loop that appends (publishers, metrics and the snapshot source hang here). It must
        not block; an exception it raises is logged and the listener stays registered."""
        self._listeners.append(listener)

    def append(self, events: list[KVEvent], ts: float | None = None) -> LogEntry | None:
        """Append one call's events as the next batch; no batch for no events.

        The batch is sequenced at once (:attr:`head_seq` and :meth:`entries_from` include it),
        subscribers that fell too far behind are ended and the rest woken. The rest of its cost
        waits for :meth:`settle`: on a running loop right after the current callback (so the
        unary RPC that appended answers first), or at the next append or read of what settling
        makes, whichever comes first; with no running loop, before this returns. The previous
        batch's Python events are released (it keeps its bytes).
        """
        if not events:
            return None
        self.settle()
        self.head_seq += 1
        entry = LogEntry(self.head_seq, time.time() if ts is None else ts, events, self.epoch, self.data_parallel_rank)
        if self._start < len(self._entries):
            self._entries[-1]._release_events()
        self._entries.append(entry)
        self._bytes += entry.num_bytes
        self.num_events += len(events)
        self._trim()
        self._check_subscribers()
        if self._waiter is not None:
            self._waiter.set_result(None)
            self._waiter = None
        self._unsettled = entry
        try:
            asyncio.get_running_loop().call_soon(self.settle)
        except RuntimeError:  # no running loop (the log used outside the server): settle now
            self.settle()
        return entry

    def settle(self) -> None:
        """Settle the newest batch if it has not settled yet: encode it (:attr:`LogEntry.msgpack`),
        count those bytes against ``max_bytes``, trim retention (ending subscribers whose next
        batch it dropped, as :meth:`append` does), then call the listeners with it.
        :attr:`retained_bytes`, :meth:`close` and the snapshot source (before it reads its mirror)
        call it first."""
        entry = self._unsettled
        if entry is None:
            return
        self._unsettled = None
        size = len(entry.msgpack)
        entry.num_bytes += size
        oldest = self.oldest_seq
        if entry.seq >= oldest:
            self._bytes += size
        self._trim()
        if self.oldest_seq != oldest:  # a subscriber the trim passed falls behind now, as at an append
            self._check_subscribers()
        for listener in self._listeners:
            try:
                listener(entry)
            except Exception:
                logger.exception("event log listener %r failed on seq %d", listener, entry.seq)

    def _trim(self) -> None:
        cfg = self.config
        entries = self._entries
        while len(entries) - self._start > 1 and (
            len(entries) - self._start > cfg.max_batches or self._bytes > cfg.max_bytes
        ):
            self._bytes -= entries[self._start].num_bytes
            entries[self._start] = None  # type: ignore[call-overload]  # the list is typed by its retained part; a slot before _start holds None (its entry let go) until that prefix is deleted below
            self._start += 1
        if self._start > 1024 and self._start * 2 > len(entries):
            del entries[: self._start]
            self._start = 0

    def cache_encoding(self, entry: LogEntry, key: tuple[int, tuple[int, ...] | None], data: bytes) -> bytes:
        """Keep a wire encoding of ``entry`` under ``key`` and count its bytes against ``max_bytes``
        (while the entry is retained; retention is applied at the next append). Returns ``data``."""
        entry.encodings[key] = data
        if entry.seq >= self.oldest_seq:
            size = len(data) + ENCODING_OVERHEAD_BYTES
            entry.num_bytes += size
            self._bytes += size
        return data

    def _check_subscribers(self) -> None:
        oldest = self.oldest_seq
        max_lag = self.config.max_subscriber_lag
        for sub in self._subscribers:
            if not sub.ended.done() and (self.head_seq - sub.last_seq > max_lag or sub.next_seq < oldest):
                sub.end(self._fell_behind)

    def _fell_behind(self, last_seq: int) -> CapacityExceededError:
        return CapacityExceededError(
            f"subscriber fell behind the head (seq {self.head_seq}) by more than the limit "
            f"(max_subscriber_lag {self.config.max_subscriber_lag}); last seq delivered {last_seq} of epoch "
            f"{self.epoch}: resume from "
            f"seq {last_seq + 1} if still retained (oldest {self.oldest_seq}), else from a snapshot"
        )

    def _shutting_down(self, last_seq: int) -> ShuttingDownError:
        return ShuttingDownError(f"server shutting down; last seq delivered {last_seq} of epoch {self.epoch}")

    # -- reading ----------------------------------------------------------------------------

    @property
    def oldest_seq(self) -> int:
        """The oldest retained seq (head + 1 when the log is empty)."""
        if self._start < len(self._entries):
            return self._entries[self._start].seq
        return self.head_seq + 1

    def entries_from(self, seq: int, max_entries: int | None = None) -> list[LogEntry]:
        """Retained entries with seq >= ``seq`` (at most ``max_entries``)."""
        oldest = self.oldest_seq
        if seq > self.head_seq:
            return []
        assert seq >= oldest, f"seq {seq} below the oldest retained {oldest}"
        lo = self._start + (seq - oldest)
        hi = len(self._entries) if max_entries is None else min(len(self._entries), lo + max_entries)
        return self._entries[lo:hi]

    # -- validation -------------------------------------------------------------------------

    def check_filter(self, group_idxs: Sequence[int]) -> tuple[int, ...] | None:
        """Validate a group filter; None means all groups.

        Raises:
            InvalidArgumentError: an index outside 0..num_groups-1 (field ``group_idxs``).
        """
        if not group_idxs:
            return None
        for g in group_idxs:
            if not 0 <= g < self.num_groups:
                raise InvalidArgumentError("group_idxs", f"{g} outside 0..{self.num_groups - 1}")
        return tuple(sorted(set(group_idxs)))

    @staticmethod
    def check_epoch_length(epoch: str) -> None:
        """Validate the length of an epoch a request names (an error message quotes it, so an
        over-long one would make a status too large for gRPC's metadata limits).

        Raises:
            InvalidArgumentError: longer than :data:`MAX_EPOCH_BYTES` (field ``epoch``).
        """
        if len(epoch.encode()) > MAX_EPOCH_BYTES:
            raise InvalidArgumentError("epoch", f"longer than {MAX_EPOCH_BYTES} bytes")

    def check_start_seq(self, start_seq: int, epoch: str) -> None:
        """Validate a resume position.

        Raises:
            EpochMismatchError: ``epoch`` is set and is not this log's epoch.
            InvalidArgumentError: ``epoch`` longer than MAX_EPOCH_BYTES, ``start_seq`` < 1 or > head + 1.
            SeqOutOfRangeError: ``start_seq`` below the oldest retained batch.
        """
        self.check_epoch_length(epoch)
        if epoch and epoch != self.epoch:
            raise EpochMismatchError(
                f"epoch {epoch!r} is not this server's epoch {self.epoch!r} (the server restarted): "
                "resync from a snapshot"
            )
        if start_seq < 1:
            raise InvalidArgumentError("start_seq", f"{start_seq} must be >= 1")
        if start_seq > self.head_seq + 1:
            raise InvalidArgumentError("start_seq", f"{start_seq} is beyond the head seq {self.head_seq} + 1")
        oldest = self.oldest_seq
        if start_seq < oldest:
            raise SeqOutOfRangeError(
                f"start_seq {start_seq} is below the oldest retained batch, seq {oldest} of epoch {self.epoch}: "
                "resync from a snapshot",
                oldest,
            )

    # -- stream subscribers -----------------------------------------------------------------

    def subscribe(
        self,
        next_seq: int,
        payload_format: int,
        group_idxs: tuple[int, ...] | None,
        *,
        handler: asyncio.Task | None = None,
    ) -> Subscriber:
        """Register a stream subscriber whose next batch is ``next_seq``.

        Args:
            handler: the task serving the stream (cancelled if it stays blocked once ended).

        Raises:
            ShuttingDownError: the log is closed.
            CapacityExceededError: ``max_streams`` subscriptions are open.
        """
        self.check_can_subscribe()
        sub = Subscriber(next_seq, payload_format, group_idxs, handler, self.config.stalled_write_timeout_s)
        self._subscribers.add(sub)
        return sub

    def check_can_subscribe(self) -> None:
        """Raise if a new subscription would be refused (checked before a snapshot is cut).

        Raises:
            ShuttingDownError: the log is closed.
            CapacityExceededError: ``max_streams`` subscriptions are open (RESOURCE_EXHAUSTED).
        """
        if self._closed:
            raise ShuttingDownError("server shutting down")
        if len(self._subscribers) >= self.config.max_streams:
            raise CapacityExceededError(
                f"max_streams: {self.config.max_streams} streams are open already; close one or raise max_streams"
            )

    def unsubscribe(self, sub: Subscriber) -> None:
        """Forget a subscriber."""
        self._subscribers.discard(sub)
        if not sub.ended.done():
            sub.ended.cancel()
        if self._closed and not self._subscribers and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def wait_drained(self, timeout: float) -> bool:
        """After :meth:`close`, wait until every subscriber has gone (their streams ended with
        their status), at most ``timeout`` seconds; True when all went."""
        if not self._subscribers:
            return True
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._drained), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def num_subscribers(self) -> int:
        """Open stream subscriptions."""
        return len(self._subscribers)

    def subscriber_lags(self) -> list[int]:
        """Per open stream subscription, batches it is behind the head (head seq - last seq delivered)."""
        head = self.head_seq
        return [head - sub.last_seq for sub in self._subscribers]

    @property
    def num_consumers(self) -> int:
        """Named TakeEvents consumers tracked (expired ones dropped first)."""
        self._expire_consumers()
        return len(self._consumers)

    @property
    def num_retained_batches(self) -> int:
        """Batches held for replay."""
        return len(self._entries) - self._start

    @property
    def retained_bytes(self) -> int:
        """Bytes the retained batches hold: msgpack bytes, cached encodings and
        ``ENTRY_OVERHEAD_BYTES`` each (what ``max_bytes`` bounds)."""
        self.settle()
        return self._bytes

    async def wait_for(self, sub: Subscriber) -> None:
        """Return once a batch with seq >= ``sub.next_seq`` exists.

        Raises:
            CapacityExceededError: the subscriber fell too far behind.
            ShuttingDownError: the log was closed.
        """
        while sub.next_seq > self.head_seq:
            sub.raise_if_ended()
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.wait({self._waiter, sub.ended}, return_when=asyncio.FIRST_COMPLETED)
        sub.raise_if_ended()

    def close(self) -> None:
        """Settle the newest batch, then end every subscriber with ShuttingDownError naming its
        last seq."""
        self.settle()
        self._closed = True
        for sub in self._subscribers:
            sub.end(self._shutting_down)

    # -- named consumers --------------------------------------------------------------------

    def check_consumer(self, consumer: str) -> None:
        """Validate a consumer name and that it may take (checked before any snapshot is cut).
        Consumers idle for ``consumer_idle_timeout_s`` are dropped first.

        Raises:
            InvalidArgumentError: empty or over-long (256 bytes) consumer name (field ``consumer``).
            CapacityExceededError: it is new and ``max_consumers`` consumers exist already.
        """
        if not consumer:
            raise InvalidArgumentError("consumer", "must not be empty")
        if len(consumer.encode()) > 256:
            raise InvalidArgumentError("consumer", "longer than 256 bytes")
        self._expire_consumers()
        if consumer not in self._consumers and len(self._consumers) >= self.config.max_consumers:
            raise CapacityExceededError(f"max_consumers: {self.config.max_consumers} consumers exist already")

    def take(
        self,
        consumer: str,
        *,
        max_batches: int,
        start_seq: int,
        epoch: str,
        snapshot_seq: int | None = None,
        size_of: Callable[[LogEntry], int] = lambda entry: len(entry.msgpack),
        max_bytes: int | None = None,
    ) -> tuple[list[LogEntry], int]:
        """Pull the batches after a named consumer's cursor and advance it.

        A new consumer starts at the live head (or after a snapshot at ``snapshot_seq``, or at
        ``start_seq``). An answer carries at most ``max_bytes`` (default ``max_take_bytes``) of
        batches as ``size_of`` measures them (the rest come with the next take). Consumers that
        have not taken for ``consumer_idle_timeout_s`` are dropped first, so a take by an expired
        name starts like a new consumer's.

        Args:
            max_batches: most batches (0 or above ``max_take_batches``: ``max_take_batches``).
            snapshot_seq: the watermark of a snapshot sent with this answer (its bytes already
                taken off ``max_bytes``); the cursor continues from it.

        Returns:
            (entries, the consumer's next seq).

        Raises:
            InvalidArgumentError: empty or over-long consumer name, bad start_seq.
            EpochMismatchError: start_seq from another epoch.
            SeqOutOfRangeError: the cursor (or start_seq, or snapshot_seq + 1) is below the
                retained log; take with ``snapshot`` to restart.
            CapacityExceededError: ``max_consumers`` consumers exist already, or the next batch
                alone is above ``max_bytes`` (the cursor does not move).
        """
        self.check_consumer(consumer)
        limit = self.config.max_take_batches
        if max_batches == 0 or max_batches > limit:
            max_batches = limit
        if start_seq:
            self.check_start_seq(start_seq, epoch)
        max_bytes = self.config.max_take_bytes if max_bytes is None else max_bytes
        if snapshot_seq is not None:
            cursor = snapshot_seq + 1
            if cursor < self.oldest_seq:
                raise SeqOutOfRangeError(
                    f"the snapshot's watermark seq {snapshot_seq} was trimmed from the retained log while it was "
                    f"cut (oldest {self.oldest_seq}): take with snapshot=true again",
                    self.oldest_seq,
                )
        elif start_seq:
            cursor = start_seq
        else:
            cursor = self._consumers.get(consumer, self.head_seq + 1)
            if cursor < self.oldest_seq:
                raise SeqOutOfRangeError(
                    f"consumer {consumer!r} is at seq {cursor}, below the oldest retained batch, seq "
                    f"{self.oldest_seq}: take with snapshot=true",
                    self.oldest_seq,
                )
        taken: list[LogEntry] = []
        size = 0
        for entry in self.entries_from(cursor, max_batches):
            batch_size = size_of(entry)
            if size + batch_size > max_bytes:
                if not taken and snapshot_seq is None:
                    raise CapacityExceededError(
                        f"batch seq {entry.seq} is {batch_size} bytes, above max_take_bytes {max_bytes} a "
                        f"TakeEvents answer carries; consumer {consumer!r} stays at seq {cursor}: read it "
                        "with StreamEvents"
                    )
                break
            taken.append(entry)
            size += batch_size
        cursor += len(taken)
        self._consumers[consumer] = cursor
        self._consumer_last_take[consumer] = self.clock()
        self._consumer_last_take.move_to_end(consumer)
        return taken, cursor

    def consumer_cursor(self, consumer: str) -> int | None:
        """A named consumer's next seq (None for an unknown or expired name)."""
        self._expire_consumers()
        return self._consumers.get(consumer)

    def _expire_consumers(self) -> None:
        """Drop the consumers that have not taken for ``consumer_idle_timeout_s`` seconds or more."""
        last_take = self._consumer_last_take
        if not last_take:
            return
        expire_before = self.clock() - self.config.consumer_idle_timeout_s
        while last_take:
            consumer, taken = next(iter(last_take.items()))
            if taken > expire_before:
                break
            del last_take[consumer]
            del self._consumers[consumer]

    def restore_consumer(self, consumer: str, cursor: int | None, if_at: int) -> None:
        """Put a consumer's cursor back (its answer never reached it), unless it moved since."""
        if self._consumers.get(consumer) == if_at:
            if cursor is None:
                del self._consumers[consumer]
                self._consumer_last_take.pop(consumer, None)
            else:
                self._consumers[consumer] = cursor
