"""Where every snapshot comes from: :class:`SnapshotSource`, shared cuts of the mirror within bounds."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kvservice.core.errors import ShuttingDownError
from kvservice.server.snapshot.budget import (
    DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT,
    DEFAULT_SNAPSHOT_BYTES_PER_S,
    YIELD_EVERY_TOKENS,
    ByteBudget,
    HalfShare,
)
from kvservice.server.snapshot.cut import Run, Snapshot, run_tokens, snapshot_runs
from kvservice.server.snapshot.mirror import CachedSetMirror
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from kvservice.server.event_log import EventLog, LogEntry

__all__ = ["SnapshotSource"]


class SnapshotSource:
    """Where every snapshot comes from: shared cuts of a :class:`CachedSetMirror`, bounded.

    A cut copies nothing: while any cut is in production the source holds appended batches back
    from the mirror (in order, in ``pending``), so the parts are read from the mirror's own table
    as it was at the watermark; when the last production ends a task applies the held batches,
    yielding every ``YIELD_EVERY_TOKENS`` tokens of events. Meanwhile callers join a cut at the
    mirror's seq or wait; no new cut starts until the mirror has caught up (so holding back is
    bounded by one production). Held batches stay in memory until applied, even if the event log
    has dropped them meanwhile (outside ``max_bytes``): one production's worth of batches.

    Args:
        mirror: the mirror to cut (fed by the event log through :meth:`on_batch`; see :meth:`attach`).
        part_tokens: token ids per part, about (>= 1).
        max_concurrent_cuts: cuts produced at once (>= 1).
        max_bytes_in_flight: the :class:`ByteBudget` every snapshot stream writes its parts within,
            bytes (>= 1).
        max_bytes_per_s: that budget's rate, bytes per second (>= 1).
        max_bytes_stalled: that budget's ``max_let_go_bytes`` (None: its default, 16 x
            ``max_bytes_in_flight``).

    Attributes:
        num_cuts: cuts made (a burst of callers at one head makes one).
        budget: the shared :class:`ByteBudget` for snapshot parts being written.
        pending: batches appended while a cut was in production, not yet applied to the mirror
            (their seqs follow ``mirror.seq`` with no gap).
    """

    def __init__(
        self,
        mirror: CachedSetMirror,
        *,
        part_tokens: int = 32_768,
        max_concurrent_cuts: int = 2,
        max_bytes_in_flight: int = DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT,
        max_bytes_per_s: float = DEFAULT_SNAPSHOT_BYTES_PER_S,
        max_bytes_stalled: int | None = None,
    ) -> None:
        if part_tokens < 1:
            raise ValueError(f"part_tokens must be >= 1; got {part_tokens}")
        if max_concurrent_cuts < 1:
            raise ValueError(f"max_concurrent_cuts must be >= 1; got {max_concurrent_cuts}")
        self.mirror = mirror
        self.part_tokens = part_tokens
        self.max_concurrent_cuts = max_concurrent_cuts
        self.budget = ByteBudget(max_bytes_in_flight, max_bytes_per_s, max_let_go_bytes=max_bytes_stalled)
        self.num_cuts = 0
        self.pending: deque[LogEntry] = deque()
        self._latest: dict[tuple[int, ...] | None, Snapshot] = {}  # per filter, the newest cut
        self._in_production: set[Snapshot] = set()
        self._tasks: set[asyncio.Task] = set()
        self._catching_up = False
        self._wake: asyncio.Event | None = None
        # The feeding log's settle (see attach): the log hands a batch over after the callback that
        # appended it, so every read of the mirror's state settles the log first.
        self._settle_log: Callable[[], None] = lambda: None

    @classmethod
    def attach(
        cls,
        event_log: EventLog,
        *,
        part_tokens: int = 32_768,
        max_concurrent_cuts: int = 2,
        max_bytes_in_flight: int = DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT,
        max_bytes_per_s: float = DEFAULT_SNAPSHOT_BYTES_PER_S,
        max_bytes_stalled: int | None = None,
    ) -> SnapshotSource:
        """A source whose mirror follows ``event_log`` (a :class:`~kvservice.server.event_log.EventLog`):
        call before any batch is appended, and before other listeners are added."""
        mirror = CachedSetMirror(event_log.num_groups, event_log.group_kinds, event_log.group_windows)
        source = cls(
            mirror,
            part_tokens=part_tokens,
            max_concurrent_cuts=max_concurrent_cuts,
            max_bytes_in_flight=max_bytes_in_flight,
            max_bytes_per_s=max_bytes_per_s,
            max_bytes_stalled=max_bytes_stalled,
        )
        event_log.add_listener(source.on_batch)
        source._settle_log = event_log.settle
        return source

    def on_batch(self, entry: LogEntry) -> None:
        """Apply an appended batch (an event-log listener; ``entry`` has ``seq`` and ``events``), or
        hold it back while a cut is in production or held batches wait."""
        if self._in_production or self.pending:
            self.pending.append(entry)
            return
        self._apply(entry)

    def _apply(self, entry: LogEntry) -> None:
        self.mirror.apply(entry.seq, entry.events)
        if self._latest:  # drop finished cuts the batch made stale
            for key, snap in list(self._latest.items()):
                if snap.done:
                    del self._latest[key]

    @property
    def head_seq(self) -> int:
        """The seq of the last batch this source was given (``mirror.seq`` once nothing is held)."""
        self._settle_log()
        return self.pending[-1].seq if self.pending else self.mirror.seq

    def cached_hashes(self) -> list[set]:
        """Per group, the hashes cached at :attr:`head_seq` (the mirror's, with held batches on top)."""
        self._settle_log()
        groups = self.mirror.cached_hashes()
        for entry in self.pending:
            for event in entry.events:
                if type(event) is BlockStored:
                    if not event.reused:
                        groups[cast(int, event.group_idx)].update(event.block_hashes)
                elif type(event) is BlockRemoved:
                    groups[cast(int, event.group_idx)].difference_update(event.block_hashes)
                elif type(event) is AllBlocksCleared:
                    for group in groups:
                        group.clear()
        return groups

    def batches_after(self, snapshot: Snapshot) -> list[LogEntry] | None:
        """The batches after ``snapshot``'s watermark up to the head, as this source holds them
        (while a cut is in production it holds back every batch after the mirror's seq), or None
        when it no longer holds them all (its mirror has moved past the watermark: the log's
        retention is the only place left). Right after :meth:`get` returns it never is None: the
        snapshot is at the mirror's seq."""
        self._settle_log()
        pending = self.pending
        if pending:
            return list(pending) if pending[0].seq == snapshot.seq + 1 else None
        return [] if self.mirror.seq == snapshot.seq else None

    def min_bytes(self, group_idxs: tuple[int, ...] | None) -> int:
        """A lower bound on the encoded size of a snapshot now, in bytes, known without a cut:
        one byte per token id, in both halves of the snapshot (at the mirror's seq, which the
        next cut is at while batches are held back)."""
        self._settle_log()
        tokens = self.mirror.num_tokens_per_group
        num_tokens = sum(tokens) if group_idxs is None else sum(tokens[g] for g in group_idxs)
        return 2 * num_tokens

    async def get(self, group_idxs: tuple[int, ...] | None = None) -> Snapshot:
        """The snapshot for a group filter: the cut at the mirror's seq if one exists (in
        production; or done, with no batch held back), else a new cut, within
        ``max_concurrent_cuts`` and once the mirror has caught up with held batches (else wait
        for that).

        Read its parts with :meth:`Snapshot.iter_parts` (or :meth:`Snapshot.wait_done`), then
        follow batches from ``snapshot.seq + 1`` (while batches are held back that is below the
        event log's head: those batches are retained, or the caller finds out from the log).
        """
        while True:
            self._settle_log()  # a batch appended in this turn of the loop: the cut includes it
            snap = self._latest.get(group_idxs)
            if (
                snap is not None
                and snap.error is None
                and snap.seq == self.mirror.seq
                and not (snap.done and self.pending)  # done, and the mirror is behind: a fresher cut follows
            ):
                return snap
            if not self.pending and len(self._in_production) < self.max_concurrent_cuts:
                return self._cut(group_idxs)
            if self._wake is None:
                self._wake = asyncio.Event()
            await self._wake.wait()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def _cut(self, group_idxs: tuple[int, ...] | None) -> Snapshot:
        mirror = self.mirror
        snap = Snapshot(mirror.seq, group_idxs, mirror.group_kinds, mirror.group_windows)
        self.num_cuts += 1
        self._latest[group_idxs] = snap
        self._in_production.add(snap)
        self._start(self._produce(snap))
        return snap

    def _start(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, snap: Snapshot) -> None:
        limit = self.part_tokens
        error: BaseException | None = None
        try:
            part: list[Run] = []
            part_tokens = 0
            since_yield = 0
            share = HalfShare()
            for item in snapshot_runs(self.mirror.table, snap.group_idxs):
                size = run_tokens(item)
                if part and part_tokens + size > limit:
                    snap._add_part(part, part_tokens)
                    part, part_tokens = [], 0
                    since_yield = YIELD_EVERY_TOKENS
                part.append(item)
                part_tokens += size
                since_yield += size
                if since_yield >= YIELD_EVERY_TOKENS:
                    since_yield = 0
                    await share.step()
            snap._add_part(part, part_tokens)
        except BaseException as exc:  # a failed cut fails its callers, never the loop
            error = exc if isinstance(exc, Exception) else ShuttingDownError("snapshot cut cancelled: shutting down")
            if not isinstance(exc, Exception):
                raise
        finally:
            snap._finish(error)
            self._in_production.discard(snap)
            if not self._in_production and self.pending and not self._catching_up:
                self._catching_up = True
                self._start(self._catch_up())
            self._notify()

    async def _catch_up(self) -> None:
        """Apply the held batches in order, yielding every ``YIELD_EVERY_TOKENS`` tokens of events."""
        try:
            pending = self.pending
            since_yield = 0
            while pending:
                entry = pending[0]
                self._apply(entry)
                pending.popleft()
                for event in entry.events:
                    if type(event) is BlockStored:
                        since_yield += len(event.token_ids)
                    elif type(event) is BlockRemoved:
                        since_yield += len(event.block_hashes)
                if since_yield >= YIELD_EVERY_TOKENS and pending:
                    since_yield = 0
                    await asyncio.sleep(0)
        finally:
            self._catching_up = False
            self._notify()

    async def close(self) -> None:
        """Cancel cuts in production (their callers get an error)."""
        while self._tasks:  # a cut's end may start the catch-up task: cancel that too
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                try:
                    await task
                except BaseException:
                    pass
