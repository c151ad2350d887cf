"""Follow the KV event stream and mirror the server's prefix cache, as a KV-aware router does.

* :class:`EventWatcher`: an ``async`` iterator over ``StreamEvents`` that never applies a gap. It
  starts from a snapshot (or resumes from a given seq and epoch), yields :class:`WatchedBatch` in
  order, and recovers by itself: a dropped connection resumes from ``last_seq + 1`` in the same
  epoch; a server restart (FAILED_PRECONDITION), a position below retention (OUT_OF_RANGE), a
  subscriber the server dropped for falling behind (RESOURCE_EXHAUSTED), a seq gap or a batch from
  another epoch restart it from a snapshot, which begins with AllBlocksCleared, so a consumer that
  applies every yielded batch in order holds exactly the server's cached set again.
* :class:`PrefixIndex`: per KV cache group, the set of cached block hashes (in their published
  form: ints by default, bytes when the server publishes digests), optionally bounded by an LRU on
  last announcement.
* :class:`HitPredictor`: hashes a prompt exactly as the server does (from the server's
  ``GetKVCacheGroupMetadata``) and predicts its prefix-cache hit, in tokens, from a PrefixIndex with
  a copy of the server's hit rules (:func:`find_longest_group_hit`, :func:`find_longest_cache_hit`).

Example::

    async with AsyncKVCacheClient(address) as client:
        index = PrefixIndex()
        predictor = HitPredictor(await client.get_kv_cache_group_metadata(), index)
        async with EventWatcher(client) as watcher:
            async for watched in watcher:
                index.apply_batch(watched.batch)
                ...
                hit_tokens = predictor.predict_hit_tokens(prompt_token_ids)

This module imports neither torch nor the server package (``kvservice``); the hit rules are copied
from the server and tested against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import grpc
import grpc.aio

from kvservice_client import events as ev
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVServiceError, Metadata
from kvservice_client.convert import (
    PayloadFormatLike,
    kv_cache_spec_kind_from_proto,
    payload_format_value,
    proto_to_batch,
)
from kvservice_client.errors import StatusCode
from kvservice_client.hashing import (
    BlockHasher,
    LoRA,
    MultiModalFeature,
    block_hash_to_int,
    resolve_block_hashes,
)

__all__ = [
    "DEFAULT_RETRYABLE_CODES",
    "EventWatcher",
    "GroupHitRule",
    "HitPredictor",
    "PrefixIndex",
    "ResyncReason",
    "RetryPolicy",
    "WatchedBatch",
    "WatcherStats",
    "find_longest_cache_hit",
    "find_longest_group_hit",
    "group_hit_rule",
]

logger = logging.getLogger(__name__)


# =============================================================================================
# EventWatcher


class ResyncReason(str, enum.Enum):
    """Why an :class:`EventWatcher` restarted from a snapshot."""

    EPOCH_CHANGED = "epoch_changed"
    """A resume got FAILED_PRECONDITION: the position belongs to another server epoch (restart)."""
    OUT_OF_RANGE = "out_of_range"
    """A resume got OUT_OF_RANGE: the position is below the server's retained event log."""
    FELL_BEHIND = "fell_behind"
    """The stream ended with RESOURCE_EXHAUSTED: the server dropped this subscriber as too slow."""
    SEQ_GAP = "seq_gap"
    """A batch's seq was not ``last_seq + 1`` within the epoch followed."""
    EPOCH_MISMATCH = "epoch_mismatch"
    """A batch came from another epoch than the one followed."""
    MISSING_SNAPSHOT = "missing_snapshot"
    """A snapshot was asked for and the stream's first batch was not one."""


DEFAULT_RETRYABLE_CODES: frozenset[StatusCode | grpc.StatusCode] = frozenset(
    {
        StatusCode.UNAVAILABLE,
        StatusCode.CANCELLED,
        StatusCode.ABORTED,
        StatusCode.INTERNAL,
        StatusCode.UNKNOWN,
        StatusCode.DEADLINE_EXCEEDED,
    }
)
"""Status codes that end a stream without saying anything about the position: the watcher
reconnects and resumes from ``last_seq + 1``. (A connection that drops shows as UNAVAILABLE, a
server stopping its calls as UNAVAILABLE or CANCELLED, a broken HTTP/2 stream as INTERNAL.)"""


@dataclass(frozen=True)
class RetryPolicy:
    """How an :class:`EventWatcher` retries.

    Every StreamEvents call that ends (error, gap, or a stream that just ends) is followed by
    another, until ``max_retries`` calls in a row have been reopened without a batch arriving in
    between: the next end is then raised.

    Attributes:
        max_retries: calls reopened in a row without any batch delivered in between before the
            watcher gives up (0 = give up at the first end); None = never give up. A delivered
            batch resets the count.
        initial_backoff_s: wait before the first retry of a reconnect, in seconds (a resync's
            first retry does not wait: the server answered, it is there).
        max_backoff_s: the longest wait between two calls, in seconds.
        backoff_multiplier: factor applied to the wait after each call that delivered nothing.
        jitter: relative random spread of each wait (0.2 = +-20%).
        connect_timeout_s: when the connection is gone, the watcher waits for the channel to be
            ready again (gRPC's own reconnection) instead of sleeping; this bounds one such wait,
            in seconds (None = wait as long as it takes). A wait that times out counts as a retry.
        retryable_codes: status codes treated as a dropped connection (reconnect and resume);
            :class:`~kvservice_client.errors.StatusCode` members (``grpc.StatusCode`` ones of the
            same name match too).
            FAILED_PRECONDITION, OUT_OF_RANGE and RESOURCE_EXHAUSTED always resync from a snapshot;
            any other code is raised at once.
    """

    max_retries: int | None = 10
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    jitter: float = 0.2
    connect_timeout_s: float | None = 10.0
    retryable_codes: frozenset[StatusCode | grpc.StatusCode] = DEFAULT_RETRYABLE_CODES

    def __post_init__(self) -> None:
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None; got {self.max_retries}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(
                f"backoffs must be >= 0 seconds; got initial_backoff_s={self.initial_backoff_s}, "
                f"max_backoff_s={self.max_backoff_s}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be >= 1; got {self.backoff_multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1); got {self.jitter}")
        if self.connect_timeout_s is not None and self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0 seconds or None; got {self.connect_timeout_s}")

    def backoff_s(self, num_failures: int) -> float:
        """The wait after ``num_failures`` (>= 1) consecutive calls that delivered nothing, in
        seconds, before jitter."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.backoff_multiplier ** (num_failures - 1))


@dataclass(frozen=True, slots=True)
class WatchedBatch:
    """One batch of the event stream, as the watcher yields it.

    Attributes:
        seq: the batch's sequence number in its epoch (a snapshot carries its watermark: the seq of
            the last batch it includes, 0 when none).
        epoch: the server epoch the batch belongs to.
        snapshot: True for a snapshot batch (AllBlocksCleared, then BlockStored for every cached
            block, parents first).
        batch: the events.
        snapshot_more: the snapshot continues in the next batch (same seq): a consumer's state is
            the server's as of ``seq`` only once a snapshot part without it has been applied.
    """

    seq: int
    epoch: str
    snapshot: bool
    batch: ev.KVEventBatch
    snapshot_more: bool = False


@dataclass
class WatcherStats:
    """What an :class:`EventWatcher` has done so far.

    Attributes:
        num_batches: batches yielded (snapshots included).
        num_events: events in those batches.
        num_snapshots: snapshot batches yielded (the first one included).
        num_reconnects: calls reopened to resume after a dropped connection (attempts, whether or
            not they then succeeded).
        resyncs: restarts from a snapshot, by reason (the initial snapshot is not a resync).
    """

    num_batches: int = 0
    num_events: int = 0
    num_snapshots: int = 0
    num_reconnects: int = 0
    resyncs: dict[ResyncReason, int] = field(default_factory=dict)

    @property
    def num_resyncs(self) -> int:
        """Restarts from a snapshot, all reasons."""
        return sum(self.resyncs.values())


@dataclass(frozen=True, slots=True)
class _Resync:
    reason: ResyncReason
    error: KVServiceError


@dataclass(frozen=True, slots=True)
class _Reconnect:
    error: KVServiceError


@dataclass(frozen=True, slots=True)
class _Failure:
    error: BaseException


_CLOSED = object()
_QueueItem = Union[WatchedBatch, _Failure, object]


class EventWatcher:
    """Follows ``StreamEvents`` and yields every batch in order, exactly once, never across a gap.

    Use as an async iterator, ideally inside ``async with`` (which closes it)::

        async with EventWatcher(client) as watcher:
            async for watched in watcher:
                index.apply_batch(watched.batch)

    A background task reads the stream into a bounded buffer (``max_pending_batches``); the
    iterator takes from it. The watcher keeps two positions: the *cursor* (the last batch the
    task accepted, which is where it resumes) and :attr:`last_seq` / :attr:`epoch` (the last batch
    yielded to the caller). To continue later in another process, pass ``start_seq=last_seq + 1``
    and ``epoch`` to a new watcher.

    Recovery, without the caller doing anything:

    * The call ends with a code in ``retry.retryable_codes`` (a dropped connection, the server
      stopping) or ends without a status: reopen it from ``cursor + 1`` in the same epoch. When the
      channel is not connected the watcher waits for it to be ready (bounded by
      ``retry.connect_timeout_s``) rather than sleeping; when it is connected it sleeps an
      exponential, jittered backoff.
    * A resume answered FAILED_PRECONDITION (another epoch: the server restarted) or OUT_OF_RANGE
      (below retention), or a stream ended with RESOURCE_EXHAUSTED (fell behind): restart from a
      snapshot.
    * A batch whose seq is not ``cursor + 1``, or whose epoch is not the cursor's, or a first batch
      that is not the snapshot asked for: drop it, cancel the call, restart from a snapshot.
    * Any other status (UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT ...) is raised.

    A snapshot batch the server sends unasked is accepted: it is self-contained (it starts with
    AllBlocksCleared) and becomes the new position. With ``group_idxs`` the server still sends
    every seq (batches may then be empty); a filter that skipped batches would look like gaps.

    Args:
        client: an :class:`AsyncKVCacheClient` (left open by :meth:`close`), or a ``host:port``
            address (the watcher opens a client with ``client_kwargs`` and closes it).
        start_seq: resume from this seq (>= 1) instead of from a snapshot; the caller has applied
            every batch before it.
        epoch: with ``start_seq``: the epoch it belongs to (None = the server's current one; the
            first batch's epoch is then followed).
        group_idxs: only these groups' events (AllBlocksCleared always); empty = all groups.
        payload_format: ``"protobuf"`` (default) or ``"msgpack"``; either way the watcher yields
            decoded :class:`~kvservice_client.events.KVEventBatch`.
        retry: reconnect and backoff policy.
        max_pending_batches: batches read ahead of the caller (>= 1). A caller slower than the
            server fills it, then gRPC flow control, then the server's bound (RESOURCE_EXHAUSTED).
        metadata: extra metadata on every StreamEvents call.
        client_kwargs: with an address: keyword arguments of the :class:`AsyncKVCacheClient` the
            watcher opens (``token``, ``tls``, ``root_certificates``, ``private_key``,
            ``certificate_chain``, ``credentials``, ``options`` ...); None: a plain-text client.

    Raises:
        ValueError: ``epoch`` without ``start_seq``, ``start_seq < 1``, ``max_pending_batches < 1``
            or an unknown payload format.
        TypeError: ``client_kwargs`` with a client (configure that client instead).
    """

    def __init__(
        self,
        client: AsyncKVCacheClient | str,
        *,
        start_seq: int | None = None,
        epoch: str | None = None,
        group_idxs: Iterable[int] = (),
        payload_format: PayloadFormatLike | None = None,
        retry: RetryPolicy = RetryPolicy(),
        max_pending_batches: int = 16,
        metadata: Metadata = None,
        client_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if start_seq is None and epoch is not None:
            raise ValueError("epoch applies only with start_seq")
        if start_seq is not None and start_seq < 1:
            raise ValueError(f"start_seq must be >= 1; got {start_seq}")
        if max_pending_batches < 1:
            raise ValueError(f"max_pending_batches must be >= 1; got {max_pending_batches}")
        self._group_idxs = tuple(group_idxs)
        self._payload_format = payload_format_value(
            payload_format if payload_format is not None else pb.PAYLOAD_FORMAT_UNSPECIFIED
        )
        if isinstance(client, str):
            self._client = AsyncKVCacheClient(client, **(client_kwargs or {}))
            self._owns_client = True
        else:
            if client_kwargs is not None:
                raise TypeError("client_kwargs apply only when client is an address")
            self._client = client
            self._owns_client = False
        self._retry = retry
        self._max_pending_batches = max_pending_batches
        self._metadata = metadata
        self._stats = WatcherStats()
        # The cursor: where the reading task is (resume point); None/True = take a snapshot.
        self._need_snapshot = start_seq is None
        self._snapshot_part_of: tuple[int, str] | None = None  # (seq, epoch) of a snapshot in progress
        self._cursor_seq: int | None = None if start_seq is None else start_seq - 1
        self._cursor_epoch: str | None = epoch or None
        # What the caller has been given.
        self._last_seq = self._cursor_seq
        self._epoch = self._cursor_epoch
        self._queue: asyncio.Queue[_QueueItem] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._rng = random.Random()

    # -- public state --------------------------------------------------------------------------

    @property
    def last_seq(self) -> int | None:
        """Seq of the last batch yielded (``start_seq - 1`` before any when resuming; None before
        the first snapshot)."""
        return self._last_seq

    @property
    def epoch(self) -> str | None:
        """Epoch of the last batch yielded (the given epoch, or None, before any)."""
        return self._epoch

    @property
    def stats(self) -> WatcherStats:
        """Counters (live object)."""
        return self._stats

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading the stream (done by the first iteration or ``async with``; idempotent).

        Raises:
            RuntimeError: the watcher is closed, or no event loop is running.
        """
        if self._closed:
            raise RuntimeError("EventWatcher is closed")
        if self._task is None:
            self._queue = asyncio.Queue(self._max_pending_batches)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvservice-event-watcher")

    async def close(self) -> None:
        """Stop: cancel the call, end any pending iteration (it raises StopAsyncIteration), drop
        buffered batches, and close the client if the watcher opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        if self._queue is not None:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_CLOSED)
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> EventWatcher:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __aiter__(self) -> EventWatcher:
        return self

    async def __anext__(self) -> WatchedBatch:
        """The next batch, in order.

        Raises:
            StopAsyncIteration: the watcher was closed.
            KVServiceError: a status the watcher does not recover from, or ``retry.max_retries``
                exceeded (the last error; DATA_LOSS when the last call ended on a gap it detected).
                Raised again by every later call.
            ValueError / msgspec.DecodeError: a batch the server sent could not be decoded.
        """
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StopAsyncIteration
        self.start()
        assert self._queue is not None
        item = await self._queue.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            self._failure = item.error
            raise item.error
        assert isinstance(item, WatchedBatch)
        self._last_seq = item.seq
        self._epoch = item.epoch
        stats = self._stats
        stats.num_batches += 1
        stats.num_events += len(item.batch.events)
        if item.snapshot:
            stats.num_snapshots += 1
        return item

    # -- the reading task ----------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._queue is not None
        try:
            await self._follow()
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError in the reader when the call is cancelled under it (the
            # client's channel was closed); unless this task itself is being cancelled (close(),
            # loop shutdown), hand that to the caller, whose iteration would otherwise wait forever.
            # (Python 3.10 has no Task.cancelling(): there the task just ends.)
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if self._closed or cancelling is None or cancelling():
                raise
            await self._queue.put(
                _Failure(
                    KVServiceError(
                        grpc.StatusCode.CANCELLED,
                        "event stream: the call was cancelled under the watcher (channel closed)",
                    )
                )
            )
        except BaseException as err:  # handed to the caller; the task itself ends cleanly
            await self._queue.put(_Failure(err))

    async def _follow(self) -> None:
        retry = self._retry
        num_failures = 0  # consecutive calls that ended without delivering a batch
        while True:
            num_delivered, outcome = await self._follow_one_call()
            num_failures = 1 if num_delivered else num_failures + 1
            if retry.max_retries is not None and num_failures > retry.max_retries:
                logger.warning(
                    "event stream: giving up after %d failed calls in a row: %s", num_failures, outcome.error
                )
                raise outcome.error
            if isinstance(outcome, _Resync):
                self._need_snapshot = True
                self._cursor_seq = None
                self._cursor_epoch = None
                self._stats.resyncs[outcome.reason] = self._stats.resyncs.get(outcome.reason, 0) + 1
                logger.info("event stream: resync from a snapshot (%s): %s", outcome.reason.value, outcome.error)
                if num_failures > 1:
                    await asyncio.sleep(self._jittered(retry.backoff_s(num_failures - 1)))
            else:
                self._stats.num_reconnects += 1
                logger.info(
                    "event stream: reconnecting to resume at seq %s of epoch %r: %s",
                    None if self._cursor_seq is None else self._cursor_seq + 1,
                    self._cursor_epoch,
                    outcome.error,
                )
                await self._wait_to_reconnect(retry.backoff_s(num_failures))

    async def _follow_one_call(self) -> tuple[int, _Resync | _Reconnect]:
        """Open one StreamEvents call and hand its batches over until it ends.

        Returns:
            (batches delivered, what ended it). Raises the statuses that are not recovered from.
        """
        assert self._queue is not None
        queue = self._queue
        asked_snapshot = self._need_snapshot
        self._snapshot_part_of = None
        request = self._next_request()
        num_delivered = 0
        stream = self._client.stream_events(request, metadata=self._metadata)
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]  # grpc's stream iterator is typed without aclose(), which aclosing needs; it has it
                async for msg in stream:
                    reason = self._check(msg, expect_snapshot=asked_snapshot and num_delivered == 0)
                    if reason is not None:
                        return num_delivered, _Resync(reason, self._gap_error(reason, msg))
                    watched = WatchedBatch(msg.seq, msg.epoch, msg.snapshot, proto_to_batch(msg), msg.snapshot_more)
                    # A snapshot in parts is a resume point only once complete: until then a
                    # broken call asks for a new snapshot.
                    self._snapshot_part_of = (msg.seq, msg.epoch) if msg.snapshot_more else None
                    self._need_snapshot = msg.snapshot_more
                    self._cursor_seq = msg.seq
                    self._cursor_epoch = msg.epoch
                    await queue.put(watched)
                    num_delivered += 1
        except KVServiceError as err:
            return num_delivered, self._classify(err, resumed=not asked_snapshot)
        ended = KVServiceError(grpc.StatusCode.UNAVAILABLE, "event stream ended without a status")
        return num_delivered, _Reconnect(ended)

    def _next_request(self) -> pb.StreamEventsRequest:
        if self._need_snapshot:
            return pb.StreamEventsRequest(
                start=pb.EVENT_START_SNAPSHOT,
                group_idxs=self._group_idxs,
                payload_format=self._payload_format,
            )
        assert self._cursor_seq is not None
        return pb.StreamEventsRequest(
            start=pb.EVENT_START_SEQ,
            start_seq=self._cursor_seq + 1,
            epoch=self._cursor_epoch or "",
            group_idxs=self._group_idxs,
            payload_format=self._payload_format,
        )

    def _check(self, msg: pb.EventBatch, *, expect_snapshot: bool) -> ResyncReason | None:
        """Why ``msg`` cannot be applied after the cursor, or None when it can."""
        if self._snapshot_part_of is not None:
            # The next part of a snapshot must follow, with the same seq and epoch.
            if msg.snapshot and (msg.seq, msg.epoch) == self._snapshot_part_of:
                return None
            return ResyncReason.SEQ_GAP
        if msg.snapshot:
            return None  # self-contained: starts with AllBlocksCleared
        if expect_snapshot:
            return ResyncReason.MISSING_SNAPSHOT
        if self._cursor_epoch is not None and msg.epoch != self._cursor_epoch:
            return ResyncReason.EPOCH_MISMATCH
        if self._cursor_seq is not None and msg.seq != self._cursor_seq + 1:
            return ResyncReason.SEQ_GAP
        return None

    def _gap_error(self, reason: ResyncReason, msg: pb.EventBatch) -> KVServiceError:
        if self._cursor_seq is None:
            expected = "a snapshot"
        else:
            expected = f"seq {self._cursor_seq + 1} of epoch {self._cursor_epoch!r}"
        return KVServiceError(
            grpc.StatusCode.DATA_LOSS,
            f"event stream: {reason.value}: expected {expected}, got "
            f"{'snapshot ' if msg.snapshot else ''}seq {msg.seq} of epoch {msg.epoch!r}",
        )

    def _classify(self, err: KVServiceError, *, resumed: bool) -> _Resync | _Reconnect:
        code = err.code
        if resumed and code == grpc.StatusCode.FAILED_PRECONDITION:
            return _Resync(ResyncReason.EPOCH_CHANGED, err)
        if resumed and code == grpc.StatusCode.OUT_OF_RANGE:
            return _Resync(ResyncReason.OUT_OF_RANGE, err)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return _Resync(ResyncReason.FELL_BEHIND, err)
        if code in self._retry.retryable_codes:
            return _Reconnect(err)
        raise err

    async def _wait_to_reconnect(self, backoff_s: float) -> None:
        """Wait for the channel when the connection is gone, else sleep the backoff."""
        channel = self._client.channel
        if channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY:
            # gRPC reconnects on its own schedule; waiting on it beats guessing a sleep.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(channel.channel_ready(), self._retry.connect_timeout_s)
            return
        delay = self._jittered(backoff_s)
        if delay > 0:
            await asyncio.sleep(delay)

    def _jittered(self, seconds: float) -> float:
        jitter = self._retry.jitter
        return seconds * (1 + jitter * (2 * self._rng.random() - 1)) if jitter else seconds


# =============================================================================================
# PrefixIndex


class PrefixIndex:
    """What a KV-aware router keeps of one server: per KV cache group, the cached block hashes.

    Hashes are kept in the form events carry them (unsigned 64-bit ints by default, digest bytes
    when the server publishes digests); an event without ``group_idx`` (older vLLM) counts as group 0.
    Applying every batch of an :class:`EventWatcher` in order, with no capacity, holds exactly the
    server's cached set (docs/ARCHITECTURE.md §3.4).

    Recency and eviction: one LRU over all groups, on last announcement. A BlockStored (new or
    ``reused``) makes each of its hashes most recent, the *last* hash first and the first hash
    last, so within one announcement the deepest block is the least recent: capacity eviction drops
    deepest blocks first, as the server's free queue does, and keeps prefixes usable (a child
    without its parent can never be part of a leading run). Lookups do not change recency.

    Args:
        capacity_blocks: most hashes held over all groups (blocks); None = unbounded.

    Attributes:
        num_evictions: hashes dropped for capacity (not counting BlockRemoved or clears).

    Raises:
        ValueError: ``capacity_blocks < 1``.
    """

    __slots__ = ("_capacity_blocks", "_lru", "num_evictions")

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None; got {capacity_blocks}")
        self._capacity_blocks = capacity_blocks
        # (group_idx, hash) -> None, least recently announced first.
        self._lru: OrderedDict[tuple[int, ev.ExternalBlockHash], None] = OrderedDict()
        self.num_evictions = 0

    @property
    def capacity_blocks(self) -> int | None:
        """Most hashes held (blocks), or None."""
        return self._capacity_blocks

    def apply(self, event: ev.KVEvent) -> None:
        """Apply one event: BlockStored inserts or refreshes, BlockRemoved deletes (hashes not held
        are ignored: they may have been evicted for capacity), AllBlocksCleared empties every group.

        Raises:
            TypeError: not one of the three event types.
        """
        lru = self._lru
        if type(event) is ev.BlockStored:
            group_idx = event.group_idx or 0
            capacity = self._capacity_blocks
            for block_hash in reversed(event.block_hashes):
                key = (group_idx, block_hash)
                if key in lru:
                    lru.move_to_end(key)
                    continue
                lru[key] = None
                if capacity is not None and len(lru) > capacity:
                    lru.popitem(last=False)
                    self.num_evictions += 1
        elif type(event) is ev.BlockRemoved:
            group_idx = event.group_idx or 0
            for block_hash in event.block_hashes:
                lru.pop((group_idx, block_hash), None)
        elif type(event) is ev.AllBlocksCleared:
            lru.clear()
        else:
            raise TypeError(f"expected a BlockStored, BlockRemoved or AllBlocksCleared; got {type(event).__name__}")

    def apply_batch(self, batch: ev.KVEventBatch | WatchedBatch) -> None:
        """Apply a batch's events in order (a :class:`WatchedBatch` is unwrapped).

        Raises:
            TypeError: an event of an unknown type (the events before it are applied).
        """
        if isinstance(batch, WatchedBatch):
            batch = batch.batch
        for event in batch.events:
            self.apply(event)

    def contains(self, block_hash: ev.ExternalBlockHash, group_idx: int = 0) -> bool:
        """Whether ``block_hash`` is cached in group ``group_idx``."""
        return (group_idx, block_hash) in self._lru

    def __contains__(self, key: object) -> bool:
        """``(group_idx, hash) in index``, or ``hash in index`` for group 0."""
        if isinstance(key, tuple):
            return key in self._lru
        return (0, key) in self._lru

    def __len__(self) -> int:
        """Hashes held over all groups (blocks)."""
        return len(self._lru)

    def clear(self) -> None:
        """Forget everything (as AllBlocksCleared; ``num_evictions`` is kept)."""
        self._lru.clear()

    def snapshot(self) -> dict[int, set[ev.ExternalBlockHash]]:
        """A copy of the held hashes: group_idx -> set of hashes (groups holding none are absent)."""
        out: dict[int, set[ev.ExternalBlockHash]] = {}
        for group_idx, block_hash in self._lru:
            out.setdefault(group_idx, set()).add(block_hash)
        return out

    def lru_order(self) -> list[tuple[int, ev.ExternalBlockHash]]:
        """Every ``(group_idx, hash)`` held, least recently announced (next evicted) first."""
        return list(self._lru)

    def predict_hit_blocks(self, block_hashes: Sequence[ev.ExternalBlockHash], group_idx: int = 0) -> int:
        """The longest leading run of ``block_hashes`` held in ``group_idx``, in blocks.

        This is the full-attention rule with no cap; :class:`HitPredictor` applies the server's
        whole rule (last token always computed, hybrid groups).
        """
        lru = self._lru
        num_blocks = 0
        for block_hash in block_hashes:
            if (group_idx, block_hash) not in lru:
                break
            num_blocks += 1
        return num_blocks


# =============================================================================================
# Hit rules (copies of the server's) and HitPredictor

HitRule = Literal["full_attention", "sliding_window", "chunked_local_attention", "mamba"]

_RULE_BY_KIND: dict[str | None, HitRule] = {
    "full_attention": "full_attention",
    "mla_attention": "full_attention",
    "sink_full_attention": "full_attention",
    "cross_attention": "full_attention",
    "encoder_only_attention": "full_attention",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "chunked_local_attention": "chunked_local_attention",
    "mamba": "mamba",
}
"""Group kind -> hit rule; mirrors ``_MANAGER_BY_SPEC`` in the server's
``kvservice/core/single_type_managers.py`` (MLA and sink are full attention there too)."""


@dataclass(frozen=True, slots=True)
class GroupHitRule:
    """A KV cache group's prefix-cache hit rule, from its published metadata.

    Attributes:
        group_idx: the group.
        kind: the published kind string (None when unpublished).
        rule: the hit rule applied (see :func:`group_hit_rule` for the fallbacks).
        block_size: tokens per block.
        sliding_window: window in tokens (sliding_window rule).
        attention_chunk_size: chunk in tokens (chunked_local_attention rule).
    """

    group_idx: int
    kind: str | None
    rule: HitRule
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


def group_hit_rule(group: pb.KVCacheGroupMetadata) -> GroupHitRule:
    """The hit rule of a group as ``GetKVCacheGroupMetadata`` describes it.

    Kinds map as the server picks its managers (full attention, MLA, sink, cross and encoder-only
    attention share the full-attention rule). A kind this client does not know, an unpublished
    kind, or a windowed/chunked kind without its window/chunk size falls back to the
    full-attention rule: every block of the prefix must be cached. For the kinds the server runs
    today that fallback is never taken (the server refuses groups it has no manager for).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if group.block_size < 1:
        raise ValueError(f"group {group.group_idx}: block_size must be >= 1; got {group.block_size}")
    kind = kv_cache_spec_kind_from_proto(group.kind)
    rule: HitRule = _RULE_BY_KIND.get(kind, "full_attention")
    window = group.sliding_window if group.HasField("sliding_window") else None
    chunk = group.attention_chunk_size if group.HasField("attention_chunk_size") else None
    if (rule == "sliding_window" and not window) or (rule == "chunked_local_attention" and not chunk):
        rule = "full_attention"
    return GroupHitRule(group.group_idx, kind, rule, group.block_size, window, chunk)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def find_longest_group_hit(
    rule: GroupHitRule,
    block_hashes: Sequence[ev.ExternalBlockHash],
    is_cached: Callable[[ev.ExternalBlockHash], bool],
    max_length: int,
) -> int:
    """The longest prefix-cache hit of one group, in blocks (null positions included).

    Mirrors ``find_longest_cache_hit`` of the server's managers in
    ``kvservice/core/single_type_managers.py`` (which mirror vLLM's), with ``is_cached`` in place
    of the pool's hash index; the result is the length of the block table the server would return:

    * full attention (``FullAttentionManager``): blocks 0..k-1 while each is cached.
    * sliding window (``SlidingWindowManager``): scanning back from the longest allowed prefix, the
      first run of ``max(ceil((sliding_window - 1) / block_size), 1)`` consecutive cached blocks
      ends the hit; if there is none, a run starting at block 0 (however short), else 0.
    * chunked local attention (``ChunkedLocalAttentionManager``): blocks before the chunk holding
      ``max_length`` are not needed; from that chunk's first block, consecutive cached blocks.
    * mamba (``MambaManager``): the last cached block at or before the longest allowed prefix.

    Args:
        rule: the group's rule.
        block_hashes: the prompt's hashes at this group's block size, published form.
        is_cached: whether a hash is cached in this group.
        max_length: the longest hit allowed, in tokens.
    """
    block_size = rule.block_size
    max_num_blocks = min(max_length // block_size, len(block_hashes))
    if max_num_blocks <= 0:
        return 0
    if rule.rule == "sliding_window":
        assert rule.sliding_window is not None
        num_needed = max(_cdiv(rule.sliding_window - 1, block_size), 1)
        num_contiguous = 0
        for i in range(max_num_blocks - 1, -1, -1):
            if not is_cached(block_hashes[i]):
                num_contiguous = 0
                continue
            num_contiguous += 1
            if num_contiguous >= num_needed:
                return i + num_contiguous
        return num_contiguous
    if rule.rule == "chunked_local_attention":
        assert rule.attention_chunk_size is not None
        chunk_start = (max_length // rule.attention_chunk_size) * rule.attention_chunk_size
        num_blocks = min(chunk_start // block_size, max_num_blocks)
        while num_blocks < max_num_blocks and is_cached(block_hashes[num_blocks]):
            num_blocks += 1
        return num_blocks
    if rule.rule == "mamba":
        for i in range(max_num_blocks - 1, -1, -1):
            if is_cached(block_hashes[i]):
                return i + 1
        return 0
    num_blocks = 0
    while num_blocks < max_num_blocks and is_cached(block_hashes[num_blocks]):
        num_blocks += 1
    return num_blocks


def find_longest_cache_hit(
    rules: Sequence[GroupHitRule],
    group_block_hashes: Sequence[Sequence[ev.ExternalBlockHash]],
    index: PrefixIndex,
    max_length: int,
) -> int:
    """The longest prefix-cache hit every group accepts, in tokens.

    Mirrors ``find_longest_cache_hit`` of the server's coordinators in
    ``kvservice/core/coordinator.py``: one group (``UnitaryKVCacheCoordinator``) decides alone;
    several (``HybridKVCacheCoordinator``) shrink the candidate length, group by group, to each
    group's own hit within it until no group shrinks it (a fixed point: full attention accepts any
    shorter prefix, a sliding window is asked again at the shorter length).

    Args:
        rules: per group (index = group_idx), its rule.
        group_block_hashes: per group, the prompt's hashes at that group's block size.
        index: what is cached.
        max_length: the longest hit allowed, in tokens (the server uses prompt length - 1).
    """
    if len(rules) != len(group_block_hashes):
        raise ValueError(f"{len(rules)} rules but hashes for {len(group_block_hashes)} groups")
    lru = index._lru

    def cached_in(group_idx: int) -> Callable[[ev.ExternalBlockHash], bool]:
        return lambda block_hash: (group_idx, block_hash) in lru

    is_cached = [cached_in(rule.group_idx) for rule in rules]
    if len(rules) == 1:
        rule = rules[0]
        return find_longest_group_hit(rule, group_block_hashes[0], is_cached[0], max_length) * rule.block_size
    hit_length = max_length
    while True:
        changed = False
        for i, rule in enumerate(rules):
            length = find_longest_group_hit(rule, group_block_hashes[i], is_cached[i], hit_length) * rule.block_size
            if length < hit_length:
                hit_length = length
                changed = True
        if not changed:
            return hit_length


class HitPredictor:
    """Predicts a prompt's prefix-cache hit on one server, from a :class:`PrefixIndex` of it.

    Hashes the prompt exactly as the server does (its algorithm and seed at its hash block size,
    resolved to each group's block size, published as 64-bit ints or digests as its events are)
    and applies the server's hit rule: the hit never covers the last prompt token (at most
    ``len(prompt) - 1`` tokens), each group's rule decides what it accepts, and hybrid models take
    the longest length every group accepts (:func:`find_longest_cache_hit`). With a complete index
    (no capacity, every batch applied) the prediction equals the hit ``GetComputedBlocks`` would
    return at that point of the stream.

    Args:
        metadata: the server's ``GetKVCacheGroupMetadata`` answer.
        index: the index to look up (kept as :attr:`index`).

    Raises:
        ValueError: no groups, a group block size that is not a multiple of ``hash_block_size``,
            an unknown hash algorithm, or ``hash_block_size < 1`` with prefix caching on.
    """

    def __init__(self, metadata: pb.GetKVCacheGroupMetadataResponse, index: PrefixIndex) -> None:
        if not metadata.groups:
            raise ValueError("GetKVCacheGroupMetadataResponse has no groups")
        self.index = index
        self.rules: tuple[GroupHitRule, ...] = tuple(group_hit_rule(g) for g in metadata.groups)
        self.hash_block_size = metadata.hash_block_size
        self.publishes_digests = metadata.block_hash_format == pb.BLOCK_HASH_FORMAT_DIGEST
        self.hasher: BlockHasher | None = None
        if metadata.hash_algorithm:  # empty: prefix caching is off, nothing is ever hit
            if self.hash_block_size < 1:
                raise ValueError(f"hash_block_size must be >= 1; got {self.hash_block_size}")
            for rule in self.rules:
                if rule.block_size % self.hash_block_size:
                    raise ValueError(
                        f"group {rule.group_idx}: block_size {rule.block_size} is not a multiple of "
                        f"hash_block_size {self.hash_block_size}"
                    )
            self.hasher = BlockHasher(self.hash_block_size, metadata.hash_algorithm, metadata.hash_seed)

    @classmethod
    async def from_client(cls, client: AsyncKVCacheClient, index: PrefixIndex) -> HitPredictor:
        """Build from ``client.get_kv_cache_group_metadata()``.

        Raises:
            KVServiceError: the metadata call failed.
            ValueError: as the constructor.
        """
        return cls(await client.get_kv_cache_group_metadata(), index)

    def hash_prompt(
        self,
        prompt_token_ids: Sequence[int],
        *,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> tuple[list[ev.ExternalBlockHash], ...]:
        """Per group (index = group_idx), the hashes of the prompt's full blocks at that group's block
        size, in the published form (empty lists when prefix caching is off)."""
        if self.hasher is None:
            return tuple([] for _ in self.rules)
        digests = self.hasher.hash_prompt(prompt_token_ids, lora=lora, cache_salt=cache_salt, mm_features=mm_features)
        out: list[list[ev.ExternalBlockHash]] = []
        for rule in self.rules:
            resolved = resolve_block_hashes(digests, self.hash_block_size, rule.block_size)
            if self.publishes_digests:
                out.append(list(resolved))
            else:
                out.append([block_hash_to_int(h) for h in resolved])
        return tuple(out)

    def predict_hit_tokens(
        self,
        prompt_token_ids: Sequence[int],
        *,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> int:
        """The prompt's predicted prefix-cache hit, in tokens (a multiple of every group's block
        size, < ``len(prompt_token_ids)``; 0 for an empty prompt or with prefix caching off)."""
        group_block_hashes = self.hash_prompt(
            prompt_token_ids, lora=lora, cache_salt=cache_salt, mm_features=mm_features
        )
        return self.predict_hit_tokens_from_hashes(group_block_hashes, len(prompt_token_ids))

    def predict_hit_tokens_from_hashes(
        self, group_block_hashes: Sequence[Sequence[ev.ExternalBlockHash]], num_prompt_tokens: int
    ) -> int:
        """As :meth:`predict_hit_tokens`, from hashes already computed by :meth:`hash_prompt`.

        Args:
            group_block_hashes: per group, the prompt's hashes (published form).
            num_prompt_tokens: the prompt's length, in tokens.
        """
        if self.hasher is None or num_prompt_tokens < 1:
            return 0
        return find_longest_cache_hit(self.rules, group_block_hashes, self.index, num_prompt_tokens - 1)
