"""Cutting a snapshot from the mirror's table: the events, in record segments, and the :class:`Snapshot` that holds them.

:func:`snapshot_runs` reads a :class:`~kvservice.server.snapshot.mirror.BlockView` as stretches of
records and yields one event at a time as a :data:`Run` (record segments, no object per block);
:func:`materialize` makes the event a run stands for, when it is encoded. A :class:`Snapshot` is
one cut's parts, produced by :class:`~kvservice.server.snapshot.source.SnapshotSource` while its
callers read them. The rules (which blocks, in which order, at which cost) are
:func:`snapshot_runs`'s docstring and docs/ARCHITECTURE.md §4.4 and §4.7.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_right
from collections.abc import AsyncGenerator, Callable, Coroutine, Hashable, Iterator, Sequence
from itertools import chain, compress, islice, repeat
from operator import itemgetter, ne
from typing import Any, Union

from kvservice.server.snapshot.budget import YIELD_EVERY_TOKENS, HalfShare
from kvservice.server.snapshot.mirror import BlockView, CachedSetMirror, StoredRecord
from kvservice_client.events import AllBlocksCleared, BlockStored, KVEvent

__all__ = [
    "Run",
    "Segment",
    "Snapshot",
    "materialize",
    "run_tokens",
    "snapshot_events",
    "snapshot_runs",
]

_hash_of_key: Callable[[Any], Any] = itemgetter(1)
"""A table key's hash (the key is ``(group_idx, hash)`` where the table has several groups)."""

Segment = tuple[StoredRecord, int, int]
"""Blocks ``start`` to ``stop`` (exclusive) of one mirror record, ``(record, start, stop)``: in a
snapshot event they come in the record's own order (parent first)."""

Run = Union[None, tuple[int, bool, tuple[Segment, ...], int]]
"""One snapshot event as the cut holds it: None is AllBlocksCleared; ``(group_idx, reused,
segments, num_tokens)`` is a BlockStored of the blocks of those :data:`Segment` (in order),
``num_tokens`` token ids in all; materialized only when encoded (:func:`materialize`).

A part so keeps a reference per record segment, not per block: a record is never changed in what
a cut reads (packing its token ids keeps the ids, a compaction makes a new record, a clear drops
the table's references), so a part outlives the mirror's next batches unchanged. A record of
512 live blocks announced in one go is one segment per event of the cut."""


def _same_kind(a: StoredRecord, b: StoredRecord) -> bool:
    """Whether blocks of ``a`` and ``b`` may share one BlockStored: equal block_size, lora_id,
    lora_name, medium, both with or both without extra_keys, and both with or both without token ids
    (a tier's blocks may have none: docs/tier.md)."""
    return a is b or (
        (len(a.tokens) == 0) == (len(b.tokens) == 0)
        and a.block_size == b.block_size
        and a.lora_id == b.lora_id
        and a.lora_name == b.lora_name
        and a.medium == b.medium
        and (a.extra_keys is None) == (b.extra_keys is None)
    )


class _Records:
    """What one cut learns about the records it meets (kept for that cut only, never on the
    records): a record's index per hash, whether its hashes are distinct, where its parent chain
    breaks."""

    __slots__ = ("_index", "_distinct", "_breaks")

    def __init__(self) -> None:
        self._index: dict[StoredRecord, dict[Any, int]] = {}
        self._distinct: dict[StoredRecord, bool] = {}
        self._breaks: dict[StoredRecord, tuple[int, ...]] = {}

    def position(self, record: StoredRecord, block_hash: Any) -> int:
        """:meth:`StoredRecord.position` (the smallest index of a hash named twice), without keeping an
        index on the record."""
        hashes = record.hashes
        if len(hashes) <= 256:
            return hashes.index(block_hash)  # the first occurrence: C-level
        index = self._index.get(record)
        if index is None:
            index = self._index[record] = dict(zip(reversed(hashes), range(len(hashes) - 1, -1, -1)))
        return index[block_hash]

    def distinct(self, record: StoredRecord) -> bool:
        """Whether no hash is named twice in the record (then a hash's index is its position)."""
        known = self._distinct.get(record)
        if known is None:
            known = self._distinct[record] = len(set(record.hashes)) == len(record.hashes)
        return known

    def breaks(self, record: StoredRecord) -> tuple[int, ...]:
        """The indexes ``i >= 1`` whose parent is not ``hashes[i - 1]`` (only a compacted record,
        whose parents are written out, has any), ascending."""
        parents = record.parents
        if parents is None:
            return ()
        known = self._breaks.get(record)
        if known is None:
            hashes = record.hashes
            known = self._breaks[record] = tuple(compress(range(1, len(hashes)), map(ne, parents[1:], hashes[:-1])))
        return known


def _longest(matches: Callable[[int], bool], limit: int) -> int:
    """The largest ``m <= limit`` with ``matches(m)``, for a predicate true up to some length and
    false beyond (``matches(0)`` is true): galloping, then halving; O(m log m) for ``matches``
    costing O(m)."""
    good, size = 0, 16
    while True:
        size = min(size, limit)
        if not matches(size):
            bad = size
            break
        good = size
        if size == limit:
            return good
        size *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if matches(mid):
            good = mid
        else:
            bad = mid
    return good


_WINDOW = 4_096
"""Table entries a cut reads at a time (a record's whole stretch is read at once when longer)."""


def _stretches(
    records: dict[Any, StoredRecord], by_hash: bool, group_idxs: tuple[int, ...] | None, known: _Records
) -> Iterator[tuple[StoredRecord, int, int]]:
    """The table in order as stretches ``(record, hi, lo)``: entries for the record's blocks
    ``hi, hi - 1, ..., lo`` one after the other (so in table order a stretch reads deepest block
    first), each key mapping to its record at its own position, and each block ``i`` of it but
    the last read (``lo < i <= hi``) the child of block ``i - 1``. Groups outside ``group_idxs``
    are left out.

    A record announced in one BlockStored, all of it live and never refreshed, is one stretch,
    found with C-level comparisons (its keys' slice against its reversed hashes, its values'
    count); elsewhere (a reuse refresh moved some blocks, a partial record, a hash named twice, a
    compacted record's chain broken) a stretch is as long as such comparisons find, down to one
    block, a hash named twice in a record giving one-block stretches.

    A key's group is its record's (the mirror keys a record's blocks in its own group only)."""
    keys_it = iter(records) if by_hash else map(_hash_of_key, records)
    values_it = iter(records.values())
    hashes_w: tuple = ()
    records_w: tuple = ()
    i = 0

    def read(need: int) -> None:  # at least ``need`` entries from ``i`` on, where the table has them
        nonlocal hashes_w, records_w, i
        more = max(_WINDOW, need) - (len(hashes_w) - i)
        hashes_w = hashes_w[i:] + tuple(islice(keys_it, more))
        records_w = records_w[i:] + tuple(islice(values_it, more))
        i = 0

    while True:
        if i >= len(hashes_w):
            read(1)
            if not hashes_w:
                return
        h = hashes_w[i]
        record = records_w[i]
        hashes = record.hashes
        n = len(hashes)
        wanted = group_idxs is None or record.group_idx in group_idxs  # else skipped, a stretch at a time
        # The common case: a record's deepest block, followed by the rest of it in order. A match
        # means n distinct keys, so n distinct hashes, each at its position.
        if h == hashes[-1]:
            if len(hashes_w) - i < n:
                read(n)
            if records_w[i : i + n].count(record) == n and hashes_w[i : i + n] == hashes[::-1]:
                i += n
                if wanted:
                    yield from _split(record, n - 1, 0, known)
                continue
        k = known.position(record, h)
        m = 0
        if k and known.distinct(record):
            if len(hashes_w) - i <= k:
                read(k + 1)
            start = i + 1
            expected = hashes[k - 1 :: -1]

            def matches(
                size: int, start: int = start, expected: tuple = expected, record: StoredRecord = record
            ) -> bool:
                return (
                    records_w[start : start + size].count(record) == size
                    and hashes_w[start : start + size] == expected[:size]
                )

            m = _longest(matches, min(k, len(hashes_w) - start))
        i += 1 + m
        if wanted:
            yield from _split(record, k, k - m, known)


def _split(record: StoredRecord, hi: int, lo: int, known: _Records) -> Iterator[tuple[StoredRecord, int, int]]:
    """A contiguous stretch cut where the record's chain breaks (deepest part first)."""
    breaks = known.breaks(record)
    if not breaks:
        yield record, hi, lo
        return
    b = bisect_right(breaks, hi)
    while b and breaks[b - 1] > lo:
        yield record, hi, breaks[b - 1]
        hi = breaks[b - 1] - 1
        b -= 1
    yield record, hi, lo


class _Sent:
    """The blocks a cut's first half has sent, per record as sorted disjoint index ranges: the
    same as a set of the hashes sent (the table maps each hash to one record and position while a
    cut reads it), without a dict of every hash (at a million blocks its last resizes alone held
    the loop for about 30 ms).

    The blocks sent are closed under "parent in the table": a block is sent with its ancestors,
    so within a stretch (and a record's blocks in the table at their places, chained) those sent
    are a prefix, parent side."""

    __slots__ = ("_ranges",)

    def __init__(self) -> None:
        self._ranges: dict[StoredRecord, list[int]] = {}  # per record, [start0, stop0, start1, stop1, ...]

    def has(self, record: StoredRecord, i: int) -> bool:
        """Whether block ``i`` of ``record`` was sent."""
        ranges = self._ranges.get(record)
        return ranges is not None and bisect_right(ranges, i) % 2 == 1

    def num_from(self, record: StoredRecord, start: int, stop: int) -> int:
        """How many of blocks ``start:stop`` of ``record`` were sent from ``start`` on without a gap."""
        ranges = self._ranges.get(record)
        if ranges is None:
            return 0
        j = bisect_right(ranges, start)
        return min(ranges[j], stop) - start if j % 2 == 1 else 0

    def add(self, record: StoredRecord, start: int, stop: int) -> None:
        """Count blocks ``start:stop`` of ``record`` (none of them sent yet) as sent."""
        ranges = self._ranges.get(record)
        if ranges is None:
            self._ranges[record] = [start, stop]
            return
        j = bisect_right(ranges, start)
        left = j > 0 and ranges[j - 1] == start
        right = j < len(ranges) and ranges[j] == stop
        if left and right:
            del ranges[j - 1 : j + 1]
        elif left:
            ranges[j - 1] = stop
        elif right:
            ranges[j] = start
        else:
            ranges[j:j] = [start, stop]


def _append(segments: list[list[Any]], record: StoredRecord, start: int, stop: int) -> None:
    """Add blocks ``start:stop`` of ``record`` after the last segment (merged with it when they
    follow it in the same record)."""
    if segments:
        last = segments[-1]
        if last[0] is record and last[2] == start:
            last[2] = stop
            return
    segments.append([record, start, stop])


def _runs(g: int, reused: bool, segments: list[list[Any]]) -> Iterator[Run]:
    """One chain (segments in event order, parent first) as runs of one kind (:func:`_same_kind`:
    a BlockStored has one block_size, lora and medium, and extra_keys for all its blocks or none)
    of at most ``YIELD_EVERY_TOKENS`` token ids (at least one block each): a longer chain (a
    128k-token prompt), or one whose kind changes (a child with multimodal extra keys under a
    text-only prefix), is several BlockStored, each naming the block before it as its parent, so
    encoding one event never holds the loop for more and no block's metadata is lost."""
    event: list[Segment] = []
    count = num_tokens = step = 0
    kind: StoredRecord | None = None  # the current event's first record
    for record, start, stop in segments:
        if kind is None or not _same_kind(kind, record):
            if event:
                yield g, reused, tuple(event), num_tokens
                event, count, num_tokens = [], 0, 0
            kind = record
            step = max(1, YIELD_EVERY_TOKENS // record.block_size)  # blocks per event, at this kind's size
        while start < stop:
            take = min(stop - start, step - count)
            event.append((record, start, start + take))
            count += take
            num_tokens += take * record.block_size
            start += take
            if count == step:
                yield g, reused, tuple(event), num_tokens
                event, count, num_tokens = [], 0, 0
    if event:
        yield g, reused, tuple(event), num_tokens


def snapshot_runs(table: BlockView, group_idxs: tuple[int, ...] | None) -> Iterator[Run]:
    """The snapshot of ``table`` (a mirror's table, least recently announced first:
    :attr:`CachedSetMirror.table`), one event (as a :data:`Run`) at a time: AllBlocksCleared;
    BlockStored for every block, parents before children; then the same blocks re-announced in
    recency order (``reused``).

    ``table`` must not change while this runs (:class:`SnapshotSource` holds batches back from its
    mirror while a cut is in production).

    The first half gives the cached set (a consumer building a tree meets every parent before its
    children): each block not yet sent, in table order, goes with its ancestors up to one sent (or
    absent, or block 0), root first. The second half, like a reuse report, changes no presence; a
    consumer that bounds its index by recency of announcement (an LRU) ends up ordered as one
    that watched from the start would be. Consecutive blocks of one chain with the same
    block_size, lora_id, lora_name, medium and presence of extra_keys share one BlockStored, up
    to about ``YIELD_EVERY_TOKENS`` token ids (a longer chain goes in several, each naming the
    block before it as its parent). A chain whose kind changes along it (a block and the
    ancestors walked up with it, in half 1) goes in one BlockStored per stretch of one kind, each
    naming the block before it as its parent (the block-by-block cut put them in one event with
    the first block's metadata, dropping a child's extra keys under a prefix without them).

    Cost: the table is read as :func:`_stretches` of records and every step works on a stretch
    or a record segment (C-level slices, counts and lookups), so a record announced in one
    BlockStored and left alone costs no Python work per block; per-block work is left to the
    irregular parts of a table (a hash named twice, a walk meeting a record in pieces). The
    events are the same as a walk block by block would give (``tests/unit/snapshot_reference.py``
    is that walk; ``tests/unit/test_snapshot_cut.py`` compares them).
    """
    records = table.records
    by_hash = table.by_hash
    known = _Records()
    get = records.get
    yield None
    # Half 1: parents first (a record's group is its blocks': the blocks sent are per group too).
    sent = _Sent()
    run_g = -1
    run: list[list[Any]] = []  # segments ([record, start, stop]) in event order
    run_last: tuple[StoredRecord, int] | None = None  # the run's last block
    for record, hi, lo in _stretches(records, by_hash, group_idxs, known):
        g = record.group_idx
        if sent.has(record, hi):
            continue  # the whole stretch was sent with a descendant
        done = sent.num_from(record, lo, hi + 1)
        if done:  # part of it was: send the rest (its parent is sent)
            chain: list[list[Any]] = [[record, lo + done, hi + 1]]
        else:
            chain = [[record, lo, hi + 1]]
            up = _ancestors(get, by_hash, g, sent, record.parent_of(lo), known)
            if up:
                chain = []
                for r, start, stop in reversed(up):
                    _append(chain, r, start, stop)
                _append(chain, record, lo, hi + 1)
        for r, start, stop in chain:
            sent.add(r, start, stop)
        first, first_start = chain[0][0], chain[0][1]
        if (
            run_last is not None
            and run_g == g
            and first.parent_of(first_start) == run_last[0].hashes[run_last[1]]
            and _same_kind(run_last[0], first)
        ):
            for r, start, stop in chain:
                _append(run, r, start, stop)
        else:
            if run:
                yield from _runs(run_g, False, run)
            run_g, run = g, chain
        last = chain[-1]
        run_last = (last[0], last[2] - 1)
    if run:
        yield from _runs(run_g, False, run)
    del sent
    # Half 2: recency order, least recent first; a run is a chain listed child first.
    run = []  # segments child first
    run_last = None  # the run's last block read (its root so far)
    for record, hi, lo in _stretches(records, by_hash, group_idxs, known):
        g = record.group_idx
        if (
            run_last is not None
            and run_g == g
            and run_last[0].parent_of(run_last[1]) == record.hashes[hi]
            and _same_kind(record, run_last[0])
        ):
            last = run[-1]
            if last[0] is record and last[1] == hi + 1:
                last[1] = lo
            else:
                run.append([record, lo, hi + 1])
        else:
            if run:
                run.reverse()
                yield from _runs(run_g, True, run)
            run_g, run = g, [[record, lo, hi + 1]]
        run_last = (record, lo)
    if run:
        run.reverse()
        yield from _runs(run_g, True, run)


def _ancestors(
    get: Callable[[Any], StoredRecord | None],
    by_hash: bool,
    g: int,
    sent: _Sent,
    parent: Any,
    known: _Records,
) -> list[list[Any]]:
    """The ancestors of a block to send with it, nearest first, as segments (each in event
    order): from ``parent`` up while the block is not sent and is in the table (a record's blocks
    are taken in one step as far as they are in the table at their places, unsent, and chained)."""
    up: list[list[Any]] = []
    while parent is not None:
        record = get(parent if by_hash else (g, parent))
        if record is None:
            break
        k = known.position(record, parent)
        if sent.has(record, k):
            break
        low = k
        if k and known.distinct(record):
            breaks = known.breaks(record)
            floor = breaks[bisect_right(breaks, k) - 1] if breaks and breaks[0] <= k else 0
            hashes = record.hashes
            if by_hash:

                def held(m: int, k: int = k, hashes: tuple = hashes, record: StoredRecord = record) -> bool:
                    return list(map(get, hashes[k - m : k])).count(record) == m

            else:

                def held(m: int, k: int = k, hashes: tuple = hashes, record: StoredRecord = record) -> bool:
                    return list(map(get, zip(repeat(g), hashes[k - m : k]))).count(record) == m

            low = k - _longest(held, k - floor)
            low += sent.num_from(record, low, k)  # sent from there down (a prefix: see _Sent)
        up.append([record, low, k + 1])
        parent = record.parent_of(low)
    return up


def _token_ids(record: StoredRecord, start: int, stop: int) -> list[int]:
    """The token ids of blocks ``start:stop`` of ``record`` (a slice of its list, or of its
    packed bytes read as int64: the same ids)."""
    tokens = record.tokens
    width = record.block_size
    if isinstance(tokens, bytes):
        return memoryview(tokens).cast("q")[start * width : stop * width].tolist()
    return tokens[start * width : stop * width]


def materialize(item: Run, group_kinds: Sequence[str | None], group_windows: Sequence[int | None]) -> KVEvent:
    """The event a :data:`Run` stands for: per segment one slice of its record's hashes, token ids
    and extra_keys (no per-block loop); the parent is the first block's."""
    if item is None:
        return AllBlocksCleared()
    g, reused, segments, _ = item
    first, first_start, _ = segments[0]
    extra_keys: list | None
    if len(segments) == 1:
        record, start, stop = first, first_start, segments[0][2]
        block_hashes = list(record.hashes[start:stop])
        token_ids = _token_ids(record, start, stop)
        extra = record.extra_keys
        extra_keys = extra[start:stop] if extra is not None else None
    else:
        block_hashes = list(first.hashes[first_start : segments[0][2]])
        token_ids = _token_ids(first, first_start, segments[0][2])  # a new list: extended in place
        for r, start, stop in segments[1:]:
            block_hashes.extend(r.hashes[start:stop])
            token_ids.extend(_token_ids(r, start, stop))
        extra_keys = None
        if first.extra_keys is not None:  # a block of a record without them has None (a walked chain may mix)
            extra_keys = list(
                chain.from_iterable(
                    r.extra_keys[start:stop] if r.extra_keys is not None else repeat(None, stop - start)
                    for r, start, stop in segments
                )
            )
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=first.parent_of(first_start),
        token_ids=token_ids,
        block_size=first.block_size,
        lora_id=first.lora_id,
        medium=first.medium,
        lora_name=first.lora_name,
        extra_keys=extra_keys,
        group_idx=g,
        kv_cache_spec_kind=group_kinds[g],
        kv_cache_spec_sliding_window=group_windows[g],
        reused=reused,
    )


def snapshot_events(mirror: CachedSetMirror, group_idxs: tuple[int, ...] | None = None) -> list[KVEvent]:
    """The whole snapshot of ``mirror`` as it is now, its events at once (tests and small caches;
    a server's snapshots come from a :class:`~kvservice.server.snapshot.source.SnapshotSource`)."""
    kinds, windows = mirror.group_kinds, mirror.group_windows
    return [materialize(item, kinds, windows) for item in snapshot_runs(mirror.table, group_idxs)]


def run_tokens(item: Run) -> int:
    """Token ids in a :data:`Run`."""
    if item is None:
        return 0
    return item[3]


class Snapshot:
    """One cut: its watermark and its parts, produced by a task while callers read them.

    Attributes:
        seq: the watermark (the mirror's seq when cut); continue from ``seq + 1``.
        ts: wall-clock time of the cut, in seconds.
        group_idxs: the group filter (None: all groups).
        parts: the parts produced so far, each about ``part_tokens`` token ids (an event is never
            split), as :data:`Run` tuples (record segments, shared with the mirror); read
            one with :meth:`part_events`.
        done: all parts produced.
        num_tokens: token ids in the parts produced so far.
    """

    def __init__(
        self,
        seq: int,
        group_idxs: tuple[int, ...] | None,
        group_kinds: Sequence[str | None] = (),
        group_windows: Sequence[int | None] = (),
    ) -> None:
        self.seq = seq
        self.ts = time.time()
        self.group_idxs = group_idxs
        self.group_kinds = tuple(group_kinds)
        self.group_windows = tuple(group_windows)
        self.parts: list[list[Run]] = []
        self.done = False
        self.num_tokens = 0
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self._encodings: dict[Hashable, list[bytes | None]] = {}
        self._encoding: dict[tuple[Hashable, int], asyncio.Task[bytes]] = {}

    def part_events(self, i: int) -> list[KVEvent]:
        """Part ``i``'s events (made now: the caller encodes and drops them)."""
        kinds, windows = self.group_kinds, self.group_windows
        return [materialize(item, kinds, windows) for item in self.parts[i]]

    async def presence_events(self) -> list[KVEvent]:
        """The snapshot's first half as one list of events, as its parts are produced:
        AllBlocksCleared, then a BlockStored for every cached block once, parents first, without
        the recency-order re-announcements (``reused``), which a reader that ignores ``reused``
        would count as second copies. Made in steps of about ``YIELD_EVERY_TOKENS`` token ids that
        take at most about half the loop (:class:`HalfShare`); for a wire that sends a snapshot as
        one batch (the ZMQ replay, :mod:`kvservice.server.zmq_publisher`).

        Raises:
            Exception: the production failed (its error).
        """
        kinds, windows = self.group_kinds, self.group_windows
        events: list[KVEvent] = []
        num_tokens = 0
        share = HalfShare()
        async with contextlib.aclosing(self.iter_parts()) as parts:
            async for i, _ in parts:
                for item in self.parts[i]:
                    if item is not None and item[1]:  # the second half begins: the first is whole
                        return events
                    events.append(materialize(item, kinds, windows))
                    num_tokens += run_tokens(item)
                    if num_tokens >= YIELD_EVERY_TOKENS:
                        num_tokens = 0
                        await share.step()
        return events

    def _add_part(self, part: list[Run], num_tokens: int) -> None:
        self.parts.append(part)
        self.num_tokens += num_tokens
        self._changed.set()
        self._changed = asyncio.Event()

    def _finish(self, error: BaseException | None = None) -> None:
        self.done = True
        self.error = error
        self._changed.set()

    async def wait_done(self) -> None:
        """Return once every part is produced.

        Raises:
            Exception: the production failed (its error).
        """
        while not self.done:
            await self._changed.wait()
        if self.error is not None:
            raise self.error

    async def iter_parts(self) -> AsyncGenerator[tuple[int, bool], None]:
        """(index, more) for each part in order, as soon as it is produced and it is known whether
        another follows (``more`` is the wire's ``snapshot_more``).

        Raises:
            Exception: the production failed (its error).
        """
        i = 0
        while True:
            while not self.done and len(self.parts) <= i + 1:
                await self._changed.wait()
            if self.error is not None:
                raise self.error
            if i >= len(self.parts):
                return
            yield i, i + 1 < len(self.parts)
            i += 1

    def encoded(self, i: int, key: Hashable, encode: Callable[[Snapshot, int], bytes]) -> bytes:
        """Part ``i`` encoded by ``encode(self, i)``, made once per ``key`` (a payload format) and
        shared by every caller."""
        parts = self._encodings.setdefault(key, [])
        while len(parts) <= i:
            parts.append(None)
        data = parts[i]
        if data is None:
            data = parts[i] = encode(self, i)
        return data

    async def encoded_in_steps(
        self, i: int, key: Hashable, encode: Callable[[Snapshot, int], Coroutine[Any, Any, bytes]]
    ) -> bytes:
        """:meth:`encoded` with an encoding that awaits (yields to the loop between steps): made
        once per ``key`` by a task of its own (a caller that leaves does not cancel it), every
        caller meanwhile waits for that task."""
        parts = self._encodings.setdefault(key, [])
        while len(parts) <= i:
            parts.append(None)
        data = parts[i]
        if data is not None:
            return data
        task = self._encoding.get((key, i))
        if task is None:
            task = self._encoding[(key, i)] = asyncio.get_running_loop().create_task(encode(self, i))

            def done(task: asyncio.Task[bytes], key: Hashable = key) -> None:
                del self._encoding[(key, i)]
                if not task.cancelled() and task.exception() is None:
                    parts[i] = task.result()

            task.add_done_callback(done)
        return await asyncio.shield(task)
