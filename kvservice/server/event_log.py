"""The sequenced, bounded KV event log and its fan-out to subscribers and named consumers.

Each mutating call's events become one batch with the next sequence number (gap-free from 1 within
an epoch; the epoch is a random instance id that changes on restart). A batch is encoded once per
payload format (and group filter) and the same bytes go to every subscriber. The log keeps:

* a bounded window of recent batches (``max_batches`` and ``max_bytes``, of msgpack size), from
  which ``StreamEvents(start_seq)`` replays and ``TakeEvents`` consumers read;
* a mirror of the cached set built only from the batches (hash -> block info per group), from which
  a snapshot is cut: AllBlocksCleared, then BlockStored for every cached block, parents first, with
  the watermark seq, so a subscriber that starts from a snapshot and then follows live batches from
  watermark + 1 misses nothing and sees nothing twice.

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
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.convert import batch_to_proto
from kvservice_client.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    encode_event_batch,
)

logger = logging.getLogger(__name__)

__all__ = ["EventLog", "EventLogConfig", "LogEntry", "Subscriber"]

_FORMATS = (pb.PAYLOAD_FORMAT_UNSPECIFIED, pb.PAYLOAD_FORMAT_PROTOBUF, pb.PAYLOAD_FORMAT_MSGPACK)

MAX_EPOCH_BYTES = 256
"""Longest epoch a request may name, in UTF-8 bytes (an epoch is 32 hex digits)."""


EventLogConfig = EventsSettings
"""The event log's bounds: the ``events`` settings section
(:class:`kvservice.server.settings.EventsSettings`, which documents and checks each)."""


class LogEntry:
    """One batch of the log: its seq, time, events and encodings (made once, on first use)."""

    __slots__ = ("seq", "ts", "events", "msgpack", "_encoded", "_epoch", "_rank")

    def __init__(self, seq: int, ts: float, events: list[KVCacheEvent], epoch: str, rank: int | None) -> None:
        self.seq = seq
        self.ts = ts
        self.events = events
        self._epoch = epoch
        self._rank = rank
        self.msgpack = encode_event_batch(KVEventBatch(ts, events, rank))  # type: ignore[arg-type]  # list[KVCacheEvent] holds only the KVEvent union's members (list is invariant)
        self._encoded: dict[tuple[int, tuple[int, ...] | None], bytes] = {}

    def encoded(self, payload_format: int, group_idxs: tuple[int, ...] | None) -> bytes:
        """The serialized ``EventBatch`` for a payload format and group filter (cached)."""
        key = (payload_format, group_idxs)
        data = self._encoded.get(key)
        if data is None:
            data = self.to_proto(payload_format, group_idxs).SerializeToString()
            self._encoded[key] = data
        return data

    def to_proto(self, payload_format: int, group_idxs: tuple[int, ...] | None) -> pb.EventBatch:
        """The ``EventBatch`` message for a payload format and group filter."""
        events = _filter_events(self.events, group_idxs)
        if payload_format == pb.PAYLOAD_FORMAT_MSGPACK and group_idxs is None:
            msg = pb.EventBatch(seq=self.seq, epoch=self._epoch, ts=self.ts, msgpack=self.msgpack)
            if self._rank is not None:
                msg.data_parallel_rank = self._rank
            return msg
        batch = KVEventBatch(self.ts, events, self._rank)  # type: ignore[arg-type]  # list[KVCacheEvent] holds only the KVEvent union's members (list is invariant)
        return batch_to_proto(batch, seq=self.seq, epoch=self._epoch, payload_format=payload_format)


def _filter_events(events: list[KVCacheEvent], group_idxs: tuple[int, ...] | None) -> list[KVCacheEvent]:
    if group_idxs is None:
        return events
    return [e for e in events if type(e) is AllBlocksCleared or e.group_idx in group_idxs]  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base


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
    ended: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def last_seq(self) -> int:
        """The last seq delivered (0 when none)."""
        return self.next_seq - 1

    def end(self, make_error: Callable[[int], Exception]) -> None:
        """Mark the subscription ended; ``make_error(last_seq)`` is raised to its handler.

        A handler that is not back within ``stalled_write_timeout_s`` (blocked in a write to a
        client that stopped reading) is cancelled: the call ends without a status.
        """
        if self.ended.done():
            return
        self.ended.set_result(make_error)
        if self.handler is not None:
            asyncio.get_running_loop().call_later(self.stalled_write_timeout_s, self._abandon)

    def _abandon(self) -> None:
        if self.handler is not None and not self.handler.done():
            logger.warning("cancelled a stream whose client stopped reading (next seq %d)", self.next_seq)
            self.handler.cancel()

    def raise_if_ended(self) -> None:
        """Raise the ending error, naming the last seq delivered, if the subscription was ended.

        Raises:
            CapacityExceededError | ShuttingDownError: the subscription was ended.
        """
        if self.ended.done() and not self.ended.cancelled():
            raise self.ended.result()(self.last_seq)


class _CachedBlock:
    """A cached hash in the mirror: the BlockStored that announced it and its position there."""

    __slots__ = ("parent", "event", "index")

    def __init__(self, parent: object, event: BlockStored, index: int) -> None:
        self.parent = parent
        self.event = event
        self.index = index

    def token_ids(self) -> list[int]:
        bs = self.event.block_size
        return self.event.token_ids[self.index * bs : (self.index + 1) * bs]

    def extra_keys(self) -> object:
        extra = self.event.extra_keys
        return extra[self.index] if extra is not None else None


class EventLog:
    """Sequenced batches, retention, the cached-set mirror, subscribers and consumers.

    Args:
        num_groups: KV cache groups (for filters and the mirror).
        group_kinds: per group, the kind string put on snapshot events.
        group_windows: per group, the sliding window put on snapshot events.
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
        self._bytes = 0
        # (group_idx, hash) -> its block, least recently announced first. Within one BlockStored
        # the first block counts as the most recent (hashes are applied last to first), as the
        # server's free queue evicts a request's deepest block first; reuse reports refresh.
        self._mirror: OrderedDict[tuple[int, object], _CachedBlock] = OrderedDict()
        self._subscribers: set[Subscriber] = set()
        self._consumers: dict[str, int] = {}
        # consumer -> clock() at its last take, least recent first (for consumer_idle_timeout_s).
        self._consumer_last_take: OrderedDict[str, float] = OrderedDict()
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._closed = False
        self.num_events = 0
        self._listeners: list[Callable[[LogEntry], None]] = []

    # -- writing ----------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[LogEntry], None]) -> None:
        """Call ``listener(entry)`` after every appended batch, in seq order, on the loop that
        appends (publishers and metrics hang here). It must not block; an exception it raises is
        logged and the listener stays registered."""
        self._listeners.append(listener)

    def append(self, events: list[KVCacheEvent], ts: float | None = None) -> LogEntry | None:
        """Append one call's events as the next batch; no batch for no events.

        Applies the events to the mirror, trims retention, ends subscribers that fell too far
        behind and wakes the rest.
        """
        if not events:
            return None
        self.head_seq += 1
        entry = LogEntry(self.head_seq, time.time() if ts is None else ts, events, self.epoch, self.data_parallel_rank)
        self._entries.append(entry)
        self._bytes += len(entry.msgpack)
        self.num_events += len(events)
        self._apply_to_mirror(events)
        self._trim()
        self._check_subscribers()
        if self._waiter is not None:
            self._waiter.set_result(None)
            self._waiter = None
        for listener in self._listeners:
            try:
                listener(entry)
            except Exception:
                logger.exception("event log listener %r failed on seq %d", listener, entry.seq)
        return entry

    def _trim(self) -> None:
        cfg = self.config
        entries = self._entries
        while len(entries) - self._start > 1 and (
            len(entries) - self._start > cfg.max_batches or self._bytes > cfg.max_bytes
        ):
            self._bytes -= len(entries[self._start].msgpack)
            entries[self._start] = None  # type: ignore[call-overload]  # a retired slot is None until the ring reuses it
            self._start += 1
        if self._start > 1024 and self._start * 2 > len(entries):
            del entries[: self._start]
            self._start = 0

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

    def _apply_to_mirror(self, events: list[KVCacheEvent]) -> None:
        mirror = self._mirror
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                g = event.group_idx  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                hashes = event.block_hashes  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                if event.reused:  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                    for h in reversed(hashes):
                        if (g, h) in mirror:
                            mirror.move_to_end((g, h))
                    continue
                for i in range(len(hashes) - 1, -1, -1):
                    parent = hashes[i - 1] if i else event.parent_block_hash  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                    key = (g, hashes[i])
                    mirror[key] = _CachedBlock(parent, event, i)  # type: ignore[arg-type]  # event is a BlockStored here (dispatched by type above)
                    mirror.move_to_end(key)
            elif kind is BlockRemoved:
                g = event.group_idx  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                for h in event.block_hashes:  # type: ignore[attr-defined]  # dispatch on type(event) is X, which mypy does not narrow from the KVCacheEvent base
                    mirror.pop((g, h), None)
            elif kind is AllBlocksCleared:
                mirror.clear()

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

    def cached_hashes(self) -> list[set]:
        """Per group, the hashes the mirror holds (what a watcher applying every batch holds)."""
        groups: list[set] = [set() for _ in range(self.num_groups)]
        for g, h in self._mirror:
            groups[g].add(h)
        return groups

    def snapshot_events(self, group_idxs: tuple[int, ...] | None = None) -> list[KVCacheEvent]:
        """AllBlocksCleared; BlockStored for every cached block, parents before children; then the
        same blocks re-announced in the server's recency order (``reused``).

        The first part gives the cached set (a consumer building a tree meets every parent before
        its children). The second part, like a reuse report, changes no presence; a consumer that
        bounds its index by recency of announcement (an LRU) ends up ordered as one that watched
        from the start would be. Consecutive blocks of one chain share one BlockStored.
        """
        mirror = self._mirror
        keys = [k for k in mirror if group_idxs is None or k[0] in group_idxs]
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        # Part 1: parents first. Walk each block's ancestors up to an emitted (or absent) one.
        emitted: set = set()
        runs: list[list[tuple[int, object]]] = []
        for key in keys:
            if key in emitted:
                continue
            chain = [key]
            parent = mirror[key].parent
            while parent is not None and (key[0], parent) in mirror and (key[0], parent) not in emitted:
                chain.append((key[0], parent))
                parent = mirror[(key[0], parent)].parent
            chain.reverse()
            emitted.update(chain)
            if runs and self._continues(runs[-1][-1], chain[0]):
                runs[-1].extend(chain)
            else:
                runs.append(chain)
        events.extend(self._stored(run, reused=False) for run in runs)
        # Part 2: recency order, least recent first; a run is a chain listed child first.
        runs = []
        for key in keys:
            if runs and self._continues(key, runs[-1][-1]):
                runs[-1].append(key)
            else:
                runs.append([key])
        events.extend(self._stored(run[::-1], reused=True) for run in runs)
        return events

    def _continues(self, prev: tuple[int, object], key: tuple[int, object]) -> bool:
        """Whether ``key``'s block directly extends ``prev``'s in one BlockStored."""
        if prev[0] != key[0]:
            return False
        block, before = self._mirror[key], self._mirror[prev].event
        origin = block.event
        return (
            block.parent == prev[1]
            and origin.block_size == before.block_size
            and origin.lora_id == before.lora_id
            and origin.lora_name == before.lora_name
            and origin.medium == before.medium
            and (origin.extra_keys is None) == (before.extra_keys is None)
        )

    def _stored(self, run: list[tuple[int, object]], *, reused: bool) -> BlockStored:
        """One BlockStored for a parent-first run of blocks of one group."""
        g = run[0][0]
        first = self._mirror[run[0]]
        origin = first.event
        token_ids: list[int] = []
        extra_keys: list | None = [] if origin.extra_keys is not None else None
        for key in run:
            block = self._mirror[key]
            token_ids.extend(block.token_ids())
            if extra_keys is not None:
                extra_keys.append(block.extra_keys())
        return BlockStored(
            block_hashes=[h for _, h in run],  # type: ignore[misc]  # the mirror keys are (group_idx, hash) with hash int | bytes, typed object
            parent_block_hash=first.parent,  # type: ignore[arg-type]  # the mirror's parent is int | bytes | None, typed object
            token_ids=token_ids,
            block_size=origin.block_size,
            lora_id=origin.lora_id,
            medium=origin.medium,
            lora_name=origin.lora_name,
            extra_keys=extra_keys,
            group_idx=g,
            kv_cache_spec_kind=self.group_kinds[g],
            kv_cache_spec_sliding_window=self.group_windows[g],
            reused=reused,
        )

    def snapshot_batches(self, payload_format: int, group_idxs: tuple[int, ...] | None) -> list[pb.EventBatch]:
        """The snapshot as ``EventBatch`` messages with ``seq`` = the watermark (the head).

        A large snapshot is cut into parts of about ``snapshot_part_tokens`` tokens of events each
        (every part but the last has ``snapshot_more``), so no message nears gRPC's size limits;
        events are never split.
        """
        ts = time.time()
        parts: list[list[KVCacheEvent]] = [[]]
        num_tokens = 0
        limit = self.config.snapshot_part_tokens
        for event in self.snapshot_events(group_idxs):
            size = len(event.token_ids) if type(event) is BlockStored else 0
            if parts[-1] and num_tokens + size > limit:
                parts.append([])
                num_tokens = 0
            parts[-1].append(event)
            num_tokens += size
        messages = []
        for i, events in enumerate(parts):
            batch = KVEventBatch(ts, events, self.data_parallel_rank)  # type: ignore[arg-type]  # list[KVCacheEvent] holds only the KVEvent union's members (list is invariant)
            msg = batch_to_proto(batch, seq=self.head_seq, epoch=self.epoch, snapshot=True, payload_format=payload_format)
            msg.snapshot_more = i < len(parts) - 1
            messages.append(msg)
        return messages

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
    def check_format(payload_format: int) -> int:
        """Validate a payload format.

        Raises:
            InvalidArgumentError: unknown value (field ``payload_format``).
        """
        if payload_format not in _FORMATS:
            raise InvalidArgumentError("payload_format", f"unknown value {payload_format}")
        return pb.PAYLOAD_FORMAT_MSGPACK if payload_format == pb.PAYLOAD_FORMAT_MSGPACK else pb.PAYLOAD_FORMAT_PROTOBUF

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
        """Msgpack bytes of the batches held for replay."""
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
        """End every subscriber with ShuttingDownError naming its last seq."""
        self._closed = True
        for sub in self._subscribers:
            sub.end(self._shutting_down)

    # -- named consumers --------------------------------------------------------------------

    def take(
        self,
        consumer: str,
        *,
        max_batches: int,
        snapshot: bool,
        start_seq: int,
        epoch: str,
        payload_format: int,
        group_idxs: tuple[int, ...] | None,
    ) -> tuple[list[pb.EventBatch], int]:
        """Pull the batches after a named consumer's cursor and advance it.

        A new consumer starts at the live head (or at a snapshot, or at ``start_seq``). An answer
        carries at most ``max_take_bytes`` of batches (the rest come with the next take). Consumers
        that have not taken for ``consumer_idle_timeout_s`` are dropped first, so a take by an
        expired name starts like a new consumer's.

        Returns:
            (batches, the consumer's next seq).

        Raises:
            InvalidArgumentError: empty or over-long consumer name, bad start_seq.
            EpochMismatchError: start_seq from another epoch.
            SeqOutOfRangeError: the cursor (or start_seq) is below the retained log; take with
                ``snapshot`` to restart.
            CapacityExceededError: ``max_consumers`` consumers exist already, or the next batch
                (or the snapshot) alone is above ``max_take_bytes`` (the cursor does not move).
        """
        if not consumer:
            raise InvalidArgumentError("consumer", "must not be empty")
        if len(consumer.encode()) > 256:
            raise InvalidArgumentError("consumer", "longer than 256 bytes")
        limit = self.config.max_take_batches
        if max_batches == 0 or max_batches > limit:
            max_batches = limit
        if start_seq:
            self.check_start_seq(start_seq, epoch)
        self._expire_consumers()
        if consumer not in self._consumers and len(self._consumers) >= self.config.max_consumers:
            raise CapacityExceededError(f"max_consumers: {self.config.max_consumers} consumers exist already")
        batches: list[pb.EventBatch] = []
        max_bytes = self.config.max_take_bytes
        size = 0
        if snapshot:
            batches.extend(self.snapshot_batches(payload_format, group_idxs))
            size = sum(b.ByteSize() + 8 for b in batches)
            if size > max_bytes:
                raise CapacityExceededError(
                    f"snapshot is {size} bytes, above max_take_bytes {max_bytes} a TakeEvents answer carries: "
                    "take it with StreamEvents (sent in parts)"
                )
            cursor = self.head_seq + 1
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
        num_taken = 0
        for entry in self.entries_from(cursor, max_batches):
            batch = entry.to_proto(payload_format, group_idxs)
            batch_size = batch.ByteSize() + 8  # + the field's tag and length
            if size + batch_size > max_bytes:
                if num_taken == 0 and not snapshot:
                    raise CapacityExceededError(
                        f"batch seq {entry.seq} is {batch_size} bytes, above max_take_bytes {max_bytes} a "
                        f"TakeEvents answer carries; consumer {consumer!r} stays at seq {cursor}: read it "
                        "with StreamEvents"
                    )
                break
            batches.append(batch)
            size += batch_size
            num_taken += 1
        cursor += num_taken
        self._consumers[consumer] = cursor
        self._consumer_last_take[consumer] = self.clock()
        self._consumer_last_take.move_to_end(consumer)
        return batches, cursor

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
