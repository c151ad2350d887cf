"""Snapshots of the cached set: a compact mirror fed by the event log, cut in parts, shared.

A snapshot is AllBlocksCleared, then BlockStored for every cached block (parents before children),
then the same blocks re-announced in the server's recency order (``reused``), all at a watermark
seq: a subscriber that applies it and then every batch from watermark + 1 holds exactly the
server's cached set and misses nothing.

Cost rules (issue 15):

* The mirror (:class:`CachedSetMirror`) keeps, per cached (group_idx, block hash), a reference to
  one record per stored run (the BlockStored's hashes, token ids and keys), not an object per
  block; a cut reads the records in segments, never a tuple per block. A record whose blocks are mostly gone is
  compacted to its live blocks, so one surviving block does not pin a whole prompt, and token ids
  beyond the newest ``UNPACKED_TOKENS`` are packed to 8 bytes each. It is fed by an event-log
  listener; its ``seq`` is the last batch applied.
* :meth:`SnapshotSource.get` is the one entry point (gRPC ``StreamEvents`` and ``TakeEvents``
  use it; so can any other wire). Every caller that asks for the same group filter at the same
  mirror seq shares one cut (:attr:`SnapshotSource.num_cuts` counts cuts, exported as
  ``kvservice_snapshot_cuts``). A cut copies nothing: while one is in production the source holds
  appended batches back from the mirror, so the cut reads the mirror's own table as it was at its
  watermark; its parts keep record segments (``(record, start, stop)``: a record is never
  changed in what a cut reads), so they stay exact after the mirror moves on. A record announced
  in one BlockStored and left alone is cut in C-level slices and comparisons, with no Python
  work per block (see :func:`snapshot_runs`); a part's events are made (one slice of tokens per
  segment) only when it is encoded. A cut is produced by a task in parts of about
  ``part_tokens`` token ids that yields to the loop every ``YIELD_EVERY_TOKENS`` tokens; callers
  read parts as they are produced. What a cut builds for the cycle collector to walk is a few
  small tuples per event (its segments refer to records); its dicts of hashes are untracked.
* The held batches are applied when the last cut in production ends (by a task that yields every
  ``YIELD_EVERY_TOKENS`` tokens of events); no new cut starts before that, so holding back is
  bounded by one production.
* At most ``max_concurrent_cuts`` cuts are produced at once; a caller joins the cut of its filter
  at the mirror's seq (in production, its watermark may be below the log's head while batches are
  held, which is still exact: the caller follows batches from that watermark + 1, which are
  retained; or done, when no batch is held), or waits for a slot or for the mirror to catch up.
* Every stream writes its parts within one shared :class:`ByteBudget` (``max_bytes_in_flight``,
  ``max_bytes_per_s``): however many streams read snapshots at once, at most that many bytes are
  being written, at most that rate on average, one write started per turn of the loop, so other
  calls get their turns and snapshot traffic takes a bounded share of the machine.
* :meth:`SnapshotSource.min_bytes` is a lower bound on a snapshot's encoded size known before any
  cut (one byte per token id, twice: both halves carry every block), so an answer
  with a byte limit (TakeEvents) is refused at once when the bound is above it.

Nothing here knows protobuf: parts are lists of events; the servicer edge encodes them (once per
payload format, memoized on the :class:`Snapshot`, so a burst of subscribers shares the bytes too).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterator, Mapping, Sequence
from itertools import chain, compress, islice, repeat
from operator import itemgetter, ne
from typing import Any, Union, cast

from kvservice.core.errors import ShuttingDownError
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT",
    "DEFAULT_SNAPSHOT_BYTES_PER_S",
    "ByteBudget",
    "CachedSetMirror",
    "MirroredBlock",
    "Snapshot",
    "SnapshotSource",
    "YIELD_EVERY_TOKENS",
    "materialize",
    "run_tokens",
    "HalfShare",
    "snapshot_runs",
]

DEFAULT_SNAPSHOT_BYTES_IN_FLIGHT = 1024 * 1024
"""The default :class:`ByteBudget` of snapshot part bytes being written, over all streams
(``max_snapshot_bytes_in_flight``)."""

DEFAULT_SNAPSHOT_BYTES_PER_S = 64 * 1024 * 1024
"""The default rate of that budget, bytes per second (``max_snapshot_bytes_per_s``): a snapshot of a
million 16-token blocks (about 100 MB) streams in under 2 s."""

YIELD_EVERY_TOKENS = 1_024
"""A cut in production yields to the loop after about this many token ids of events (and at every
part boundary), a part is serialized in steps of about this many, and a snapshot event carries at
most about this many (at least one block): so a snapshot holds the loop for about 64 blocks'
worth of work at a time (at 1M cached blocks of 16 tokens, with one snapshot client, the loop
thread's CPU between two turns had p99 3.3 ms at 8,192 and 1.75 ms at 2,048 here)."""

_Key = tuple[int, Any]  # (group_idx, block hash)

_held: Callable[[Any], Any] = itemgetter(1)
"""A (key, record or None) pair's record: true where the block was held."""

UNPACKED_TOKENS = 1 << 18
"""Token ids the mirror keeps as the announcing events' own lists (about 40 bytes each: a list
slot and an int object) before it packs the oldest into int64 bytes (8 each); see
:class:`CachedSetMirror`. At most about 10 MiB of lists."""


MirroredBlock = tuple
"""One cached block as :class:`BlockView` reads it (made from the mirror's :class:`_Stored`
record when read; tests, and the block-by-block reference cut in ``tests/unit/``; a cut reads
record segments instead): a plain tuple, indexed by:"""

PARENT, TOKEN_IDS, BLOCK_SIZE, LORA_ID, LORA_NAME, MEDIUM, HAS_EXTRA_KEYS, EXTRA_KEYS = range(8)
"""Fields of a :data:`MirroredBlock`: the parent block hash (None at block 0); this block's own
``block_size`` token ids (int64 in native byte order, as ``array('q').tobytes()``); block_size, lora_id, lora_name, medium of the
BlockStored that announced it; whether that event carried ``extra_keys`` at all; this block's own
entry of them (None when it had none)."""


class _Stored:
    """The blocks one BlockStored announced, as the mirror holds them: one record shared by every
    block of the run (the table maps each block's key to it), never copied per block.

    Attributes:
        group_idx: the KV cache group.
        hashes: the blocks' hashes, in the event's order (parent first), as a tuple (a list would
            stay tracked by the cycle collector, which would walk every cached hash in each full
            collection).
        parents: per block, its parent hash; None: the chain rule (``hashes[i - 1]``, and
            ``parent_block_hash`` for the first), as in the event.
        parent_block_hash, block_size, lora_id, lora_name, medium: the event's.
        extra_keys: the event's (per block), or None.
        tokens: the blocks' token ids, ``block_size`` per hash: the event's list (unpacked) or
            int64 bytes in native byte order (packed; same ids).
        num_live: blocks of this record the table maps to it.
    """

    __slots__ = (
        "group_idx",
        "hashes",
        "parents",
        "parent_block_hash",
        "block_size",
        "lora_id",
        "lora_name",
        "medium",
        "extra_keys",
        "tokens",
        "num_live",
        "_index",
    )

    def __init__(
        self,
        group_idx: int,
        hashes: tuple,
        parents: tuple | None,
        parent_block_hash: Any,
        block_size: int,
        lora_id: int | None,
        lora_name: str | None,
        medium: str | None,
        extra_keys: list | None,
        tokens: Any,
    ) -> None:
        self.group_idx = group_idx
        self.hashes = hashes
        self.parents = parents
        self.parent_block_hash = parent_block_hash
        self.block_size = block_size
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.medium = medium
        self.extra_keys = extra_keys
        self.tokens = tokens
        self.num_live = 0
        self._index: dict | None = None

    @classmethod
    def of(cls, event: BlockStored) -> _Stored:
        return cls(
            cast(int, event.group_idx),  # the engine's events always name their group
            tuple(event.block_hashes),  # a tuple of ints or bytes: the cycle collector stops walking it
            None,
            event.parent_block_hash,
            event.block_size,
            event.lora_id,
            event.lora_name,
            event.medium,
            event.extra_keys,
            event.token_ids,
        )

    def pack(self) -> None:
        """Hold the token ids as int64 bytes (one C-level pass; the event's list is let go)."""
        if type(self.tokens) is not bytes:
            self.tokens = struct.pack(f"{len(self.tokens)}q", *self.tokens)

    def position(self, block_hash: Any) -> int:
        """The index of ``block_hash`` in :attr:`hashes` (its last application: the smallest
        index when an event named it twice, as hashes are applied last to first)."""
        index = self._index
        if index is None:
            n = len(self.hashes)
            index = self._index = dict(zip(reversed(self.hashes), range(n - 1, -1, -1)))
        return index[block_hash]  # type: ignore[no-any-return]  # the dict maps hashes to ints

    def parent_of(self, i: int) -> Any:
        if self.parents is not None:
            return self.parents[i]
        return self.hashes[i - 1] if i else self.parent_block_hash

    def blocks(self) -> list[MirroredBlock]:
        """Every block's :data:`MirroredBlock`, in :attr:`hashes` order (C-level passes; the record
        is left as it is: an unpacked one is packed for this call only)."""
        n = len(self.hashes)
        width = 8 * self.block_size
        tokens = self.tokens
        data = memoryview(tokens if type(tokens) is bytes else struct.pack(f"{len(tokens)}q", *tokens))
        parents = self.parents if self.parents is not None else [self.parent_block_hash, *self.hashes[: n - 1]]
        extra = self.extra_keys
        return list(
            zip(
                parents,
                map(
                    bytes,
                    map(data.__getitem__, map(slice, range(0, n * width, width), range(width, (n + 1) * width, width))),
                ),
                repeat(self.block_size),
                repeat(self.lora_id),
                repeat(self.lora_name),
                repeat(self.medium),
                repeat(extra is not None),
                extra if extra is not None else repeat(None),
            )
        )


class BlockView(Mapping):
    """A mirror's table: the records it holds (what :func:`snapshot_runs` reads, a stretch of
    records at a time), and read block by block as a Mapping (group_idx, hash) ->
    :data:`MirroredBlock` in the table's order (tests, and what a watcher would hold). A record's
    blocks' tuples are made together (C-level passes) the first time one of them is read, then
    kept as long as this view. The table must not change while it is read through this (a
    :class:`SnapshotSource` holds batches back while a cut reads the mirror's own table).

    Args:
        records: the table: keyed by (group_idx, hash), or by hash alone (``by_hash``: one group,
            group_idx 0).
    """

    def __init__(self, records: dict[Any, _Stored], by_hash: bool = False) -> None:
        self.records = records
        self.by_hash = by_hash
        self._made: dict[_Stored, dict[Any, MirroredBlock]] = {}  # per record read, its blocks by hash

    def _record(self, key: Any) -> _Stored | None:
        if not self.by_hash:
            return self.records.get(key)
        if type(key) is not tuple or len(key) != 2 or key[0] != 0:
            return None
        return self.records.get(key[1])

    def __getitem__(self, key: _Key) -> MirroredBlock:
        record = self._record(key)
        if record is None:
            raise KeyError(key)
        blocks = self._made.get(record)
        if blocks is None:  # the smallest index of a hash named twice wins, as it was applied
            blocks = self._made[record] = dict(zip(reversed(record.hashes), reversed(record.blocks())))
        return blocks[key[1]]

    def __contains__(self, key: object) -> bool:
        return self._record(key) is not None

    def __iter__(self) -> Iterator[_Key]:
        if self.by_hash:
            return zip(repeat(0), self.records)
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


class CachedSetMirror:
    """The cached set as the event batches describe it: (group_idx, hash) -> the record of the
    BlockStored that announced the block (:class:`_Stored`); read per block through
    :meth:`view`.

    Ordered least recently announced first. Within one BlockStored the first block counts as the
    most recent (hashes are applied last to first), as the server's free queue evicts a request's
    deepest block first; reuse reports refresh.

    Cost rules (issue 17; the pinning bound is issue 15's):

    * Recording a BlockStored costs a key per block and one ``dict.update`` (C-level passes), no
      object per block: every block of the event maps to one shared record, which holds the
      event's own lists. A cut reads record segments, never a tuple per block.
    * Its token ids stay the event's list (no per-token work) while they are among the newest
      ``unpacked_tokens`` token ids recorded; then they are packed into int64 bytes (8 bytes a
      token id, one C-level pass). A record whose blocks all went before that (a pool that turns
      over quickly) is never packed.
    * A record never pins much more than its live blocks: once fewer than half of its blocks are
      live, the live ones move to a new record of their own (their own tokens packed, their
      parents written out), so the token bytes pinned stay below twice the live blocks' own
      (issue 15: one surviving block must not pin a whole prompt).

    Args:
        num_groups: KV cache groups.
        group_kinds: per group, the kind string put on snapshot events.
        group_windows: per group, the sliding window put on snapshot events.
        unpacked_tokens: token ids kept as lists at most, about (>= 0; 0 packs at once).

    Attributes:
        seq: the seq of the last batch applied (0 before any).
        num_tokens_per_group: per group, token ids held (block_size per cached block).
    """

    def __init__(
        self,
        num_groups: int,
        group_kinds: Sequence[str | None],
        group_windows: Sequence[int | None],
        *,
        unpacked_tokens: int = UNPACKED_TOKENS,
    ) -> None:
        if unpacked_tokens < 0:
            raise ValueError(f"unpacked_tokens must be >= 0; got {unpacked_tokens}")
        self.num_groups = num_groups
        self.group_kinds = tuple(group_kinds)
        self.group_windows = tuple(group_windows)
        self.unpacked_tokens = unpacked_tokens
        self.seq = 0
        self.num_tokens_per_group = [0] * num_groups
        self._by_hash = num_groups == 1  # one group: keyed by the hash alone (no key tuple per block)
        self._blocks: dict[Any, _Stored] = {}
        self._unpacked: dict[_Stored, int] = {}  # records still holding lists, oldest first: their group
        self._num_unpacked_tokens = 0

    def apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        """Apply one batch's events (in order) and record its seq.

        Each event is applied in C-level passes over its hashes (``zip``/``map`` into one
        ``dict.update``), not a Python loop per block. An event that names one hash twice (never
        one chain's, whose hashes each cover their parent) is applied block by block, as the rule
        reads.
        """
        blocks = self._blocks
        tokens = self.num_tokens_per_group
        by_hash = self._by_hash
        for event in events:
            if type(event) is BlockStored:
                g = cast(int, event.group_idx)  # the engine's events always name their group
                hashes = event.block_hashes
                n = len(hashes)
                # applied last to first
                keys: list[Any] = list(reversed(hashes)) if by_hash else list(zip(repeat(g, n), reversed(hashes)))
                if event.reused:  # refresh the blocks held: they move to the most recent end
                    if len(set(hashes)) < n:
                        self._refresh_per_block(keys)
                    else:
                        refreshed: Iterator[Any] = filter(_held, zip(keys, list(map(blocks.pop, keys, repeat(None)))))
                        blocks.update(refreshed)
                    continue
                if not blocks.keys().isdisjoint(keys):  # hashes stored again move to the most recent end
                    self._drop(g, list(filter(None, map(blocks.pop, keys, repeat(None)))))
                record = _Stored.of(event)
                size = len(blocks)
                blocks.update(zip(keys, repeat(record)))
                added = len(blocks) - size
                if added < n:  # one hash twice: the rule puts each at its last application
                    for key in keys:
                        blocks.pop(key, None)
                        blocks[key] = record
                record.num_live = added
                tokens[g] += event.block_size * added
                self._unpacked[record] = g
                self._num_unpacked_tokens += len(event.token_ids)
                if self._num_unpacked_tokens > self.unpacked_tokens:
                    self._pack_oldest()
            elif type(event) is BlockRemoved:
                g = cast(int, event.group_idx)  # the engine's events always name their group
                hashes = event.block_hashes
                removed = hashes if by_hash else zip(repeat(g, len(hashes)), hashes)
                self._drop(g, list(filter(None, map(blocks.pop, removed, repeat(None)))))
            elif type(event) is AllBlocksCleared:
                blocks.clear()
                self._unpacked.clear()
                self._num_unpacked_tokens = 0
                self.num_tokens_per_group = tokens = [0] * self.num_groups
        self.seq = seq

    def _drop(self, g: int, records: list[_Stored]) -> None:
        """Account for blocks of group ``g`` just popped from the table (their records, one per
        block; usually all one record): live counts, token counts, then the pinning bound."""
        if not records:
            return
        first = records[0]
        counts = {first: len(records)} if records.count(first) == len(records) else Counter(records)
        tokens = self.num_tokens_per_group
        for record, count in counts.items():
            record.num_live -= count
            tokens[g] -= record.block_size * count
            if record.num_live == 0:
                if self._unpacked.pop(record, None) is not None:
                    self._num_unpacked_tokens -= len(record.hashes) * record.block_size
            elif 2 * record.num_live < len(record.hashes):
                self._compact(g, record)

    def _compact(self, g: int, record: _Stored) -> None:
        """Move the live blocks of ``record`` (under half of its blocks) to a record of their own,
        keeping their places in the table."""
        blocks = self._blocks
        by_hash = self._by_hash
        live = [
            i
            for i, h in enumerate(record.hashes)
            if blocks.get(h if by_hash else (g, h)) is record and record.position(h) == i
        ]
        width = record.block_size
        old_tokens = record.tokens
        if type(old_tokens) is bytes:
            data = b"".join([old_tokens[8 * width * i : 8 * width * (i + 1)] for i in live])
        else:
            data = struct.pack(
                f"{width * len(live)}q", *chain.from_iterable(old_tokens[width * i : width * (i + 1)] for i in live)
            )
        extra = record.extra_keys
        moved = _Stored(
            g,
            tuple([record.hashes[i] for i in live]),
            tuple([record.parent_of(i) for i in live]),
            record.parent_of(live[0]),
            width,
            record.lora_id,
            record.lora_name,
            record.medium,
            [extra[i] for i in live] if extra is not None else None,
            data,
        )
        moved.num_live = len(live)
        for h in moved.hashes:
            blocks[h if by_hash else (g, h)] = moved  # an existing key keeps its place
        if self._unpacked.pop(record, None) is not None:
            self._num_unpacked_tokens -= len(record.hashes) * width
        record.num_live = 0

    def _pack_oldest(self) -> None:
        """Pack the oldest unpacked records until the lists are within ``unpacked_tokens``."""
        unpacked = self._unpacked
        while self._num_unpacked_tokens > self.unpacked_tokens and unpacked:
            record = next(iter(unpacked))
            del unpacked[record]
            self._num_unpacked_tokens -= len(record.hashes) * record.block_size
            record.pack()

    def _refresh_per_block(self, keys: list[_Key]) -> None:
        """:meth:`apply`'s reuse report, one block at a time (the rule as written)."""
        blocks = self._blocks
        for key in keys:
            block = blocks.pop(key, None)
            if block is not None:
                blocks[key] = block

    @property
    def num_blocks(self) -> int:
        """Cached blocks held, over all groups."""
        return len(self._blocks)

    @property
    def num_unpacked_tokens(self) -> int:
        """Token ids held as the events' lists (at most about ``unpacked_tokens``)."""
        return self._num_unpacked_tokens

    def pinned_token_ids(self) -> int:
        """Token ids the records of held blocks keep, over all of them (tests of the pinning
        bound: at most twice the held blocks' own)."""
        records = {id(r): r for r in self._blocks.values()}
        return sum(len(r.hashes) * r.block_size for r in records.values())

    def cached_hashes(self) -> list[set]:
        """Per group, the hashes held (what a watcher applying every batch holds)."""
        if self._by_hash:
            return [set(self._blocks)]
        groups: list[set] = [set() for _ in range(self.num_groups)]
        for g, h in self._blocks:
            groups[g].add(h)
        return groups

    def view(self) -> BlockView:
        """The table as it is now, block by block (one C-level copy of the table; a block's tuple
        is made when read; tests): it reads the same while the mirror moves on (records are never
        changed in what a view reads: a compaction makes a new record, packing keeps the ids)."""
        return BlockView(self._blocks.copy(), self._by_hash)

    def events(self, group_idxs: tuple[int, ...] | None = None) -> list[KVEvent]:
        """The whole snapshot's events at once (tests and small caches; servers use a
        :class:`SnapshotSource`)."""
        return [
            materialize(item, self.group_kinds, self.group_windows) for item in snapshot_runs(self.table, group_idxs)
        ]

    @property
    def table(self) -> BlockView:
        """The table itself (no copy), block by block, least recently announced first: read it
        only where nothing can apply a batch meanwhile (synchronously, or while a
        :class:`SnapshotSource` holds batches back); never change it."""
        return BlockView(self._blocks, self._by_hash)


class HalfShare:
    """Yields for a task doing snapshot work in steps (a cut's production, a part's encoding), so
    that it takes at most about half of the loop's time however long it is: between steps it
    yields a turn (``sleep(0)``), and once its steps since the last pause add up to
    ``PAUSE_AFTER_S`` it sleeps that long (one timer per couple of milliseconds, not per step:
    the loop's timers round up to 1 ms). Other calls so wait behind at most one step, and a
    machine the server shares with its clients keeps CPU for them.

    Why ``PAUSE_AFTER_S`` is 2 ms: measured with the segment cut on issue 15's stall row
    (``scripts/bench/bounded_bench.py stall --blocks 1048576 --clients 1``, GetUsage p99 while a
    client loops 1M-block snapshots over its idle p99 in the same run; a loaded 2-core machine,
    load average 0.6-1.9, the server run from copies of the tree differing only in this value),
    2 ms, 1 ms and 0.5 ms gave medians 1.87x (8 runs, 0.94-3.06x), 2.12x (8 runs, 1.04-2.75x)
    and 1.70x (5 runs, 1.27-2.28x): no pause clearly better for the other calls, within the runs'
    spread; while the snapshots the client got through in 11 s of load fell from 4.5 to 3.75 and
    2.8 (mean): a shorter pause makes each snapshot slower, and a cut in production holds the
    event log's batches back from the mirror for longer. (With the block-by-block cut this
    replaced, 1 ms and 0.5 ms had helped: 2.4-2.9x against 3.4-4.0x at 2 ms; its cut cost about
    ten times the CPU, so its pacing mattered more.)"""

    PAUSE_AFTER_S = 0.002

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._worked = 0.0

    async def step(self) -> None:
        """Yield between two steps (the time since the last one returned counts as work)."""
        self._worked += time.perf_counter() - self._started
        if self._worked >= self.PAUSE_AFTER_S:
            await asyncio.sleep(self._worked)
            self._worked = 0.0
        else:
            await asyncio.sleep(0)
        self._started = time.perf_counter()


_Segment = tuple[_Stored, int, int]
"""Blocks ``start`` to ``stop`` (exclusive) of one mirror record, ``(record, start, stop)``: in a
snapshot event they come in the record's own order (parent first)."""

_Run = Union[None, tuple[int, bool, tuple[_Segment, ...], int]]
"""One snapshot event as the cut holds it: None is AllBlocksCleared; ``(group_idx, reused,
segments, num_tokens)`` is a BlockStored of the blocks of those :data:`_Segment` (in order),
``num_tokens`` token ids in all; materialized only when encoded (:func:`materialize`).

A part so keeps a reference per record segment, not per block: a record is never changed in what
a cut reads (packing its token ids keeps the ids, a compaction makes a new record, a clear drops
the table's references), so a part outlives the mirror's next batches unchanged. A record of
512 live blocks announced in one go is one segment per event of the cut."""


def _same_kind(a: _Stored, b: _Stored) -> bool:
    """Whether blocks of ``a`` and ``b`` may share one BlockStored: equal block_size, lora_id,
    lora_name, medium, and both with or both without extra_keys."""
    return a is b or (
        a.block_size == b.block_size
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
        self._index: dict[_Stored, dict[Any, int]] = {}
        self._distinct: dict[_Stored, bool] = {}
        self._breaks: dict[_Stored, tuple[int, ...]] = {}

    def position(self, record: _Stored, block_hash: Any) -> int:
        """:meth:`_Stored.position` (the smallest index of a hash named twice), without keeping an
        index on the record."""
        hashes = record.hashes
        if len(hashes) <= 256:
            return hashes.index(block_hash)  # the first occurrence: C-level
        index = self._index.get(record)
        if index is None:
            index = self._index[record] = dict(zip(reversed(hashes), range(len(hashes) - 1, -1, -1)))
        return index[block_hash]

    def distinct(self, record: _Stored) -> bool:
        """Whether no hash is named twice in the record (then a hash's index is its position)."""
        known = self._distinct.get(record)
        if known is None:
            known = self._distinct[record] = len(set(record.hashes)) == len(record.hashes)
        return known

    def breaks(self, record: _Stored) -> tuple[int, ...]:
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
    records: dict[Any, _Stored], by_hash: bool, group_idxs: tuple[int, ...] | None, known: _Records
) -> Iterator[tuple[_Stored, int, int]]:
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
    keys_it = iter(records) if by_hash else map(_held, records)
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

            def matches(size: int, start: int = start, expected: tuple = expected, record: _Stored = record) -> bool:
                return (
                    records_w[start : start + size].count(record) == size
                    and hashes_w[start : start + size] == expected[:size]
                )

            m = _longest(matches, min(k, len(hashes_w) - start))
        i += 1 + m
        if wanted:
            yield from _split(record, k, k - m, known)


def _split(record: _Stored, hi: int, lo: int, known: _Records) -> Iterator[tuple[_Stored, int, int]]:
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
        self._ranges: dict[_Stored, list[int]] = {}  # per record, [start0, stop0, start1, stop1, ...]

    def has(self, record: _Stored, i: int) -> bool:
        """Whether block ``i`` of ``record`` was sent."""
        ranges = self._ranges.get(record)
        return ranges is not None and bisect_right(ranges, i) % 2 == 1

    def num_from(self, record: _Stored, start: int, stop: int) -> int:
        """How many of blocks ``start:stop`` of ``record`` were sent from ``start`` on without a gap."""
        ranges = self._ranges.get(record)
        if ranges is None:
            return 0
        j = bisect_right(ranges, start)
        return min(ranges[j], stop) - start if j % 2 == 1 else 0

    def add(self, record: _Stored, start: int, stop: int) -> None:
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


def _append(segments: list[list[Any]], record: _Stored, start: int, stop: int) -> None:
    """Add blocks ``start:stop`` of ``record`` after the last segment (merged with it when they
    follow it in the same record)."""
    if segments:
        last = segments[-1]
        if last[0] is record and last[2] == start:
            last[2] = stop
            return
    segments.append([record, start, stop])


def _runs(g: int, reused: bool, segments: list[list[Any]]) -> Iterator[_Run]:
    """One chain (segments in event order, parent first) as runs of one kind (:func:`_same_kind`:
    a BlockStored has one block_size, lora and medium, and extra_keys for all its blocks or none)
    of at most ``YIELD_EVERY_TOKENS`` token ids (at least one block each): a longer chain (a
    128k-token prompt), or one whose kind changes (a child with multimodal extra keys under a
    text-only prefix), is several BlockStored, each naming the block before it as its parent, so
    encoding one event never holds the loop for more and no block's metadata is lost."""
    event: list[_Segment] = []
    count = num_tokens = step = 0
    kind: _Stored | None = None  # the current event's first record
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


def snapshot_runs(table: BlockView, group_idxs: tuple[int, ...] | None) -> Iterator[_Run]:
    """The snapshot of ``table`` (a mirror's table, least recently announced first:
    :attr:`CachedSetMirror.table`), one event (as a :data:`_Run`) at a time: AllBlocksCleared;
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
    run_last: tuple[_Stored, int] | None = None  # the run's last block
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
    get: Callable[[Any], _Stored | None],
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

                def held(m: int, k: int = k, hashes: tuple = hashes, record: _Stored = record) -> bool:
                    return list(map(get, hashes[k - m : k])).count(record) == m

            else:

                def held(m: int, k: int = k, hashes: tuple = hashes, record: _Stored = record) -> bool:
                    return list(map(get, zip(repeat(g), hashes[k - m : k]))).count(record) == m

            low = k - _longest(held, k - floor)
            low += sent.num_from(record, low, k)  # sent from there down (a prefix: see _Sent)
        up.append([record, low, k + 1])
        parent = record.parent_of(low)
    return up


def _token_ids(record: _Stored, start: int, stop: int) -> list[int]:
    """The token ids of blocks ``start:stop`` of ``record`` (a slice of its list, or of its
    packed bytes read as int64: the same ids)."""
    tokens = record.tokens
    width = record.block_size
    if type(tokens) is bytes:
        return memoryview(tokens).cast("q")[start * width : stop * width].tolist()
    return tokens[start * width : stop * width]  # type: ignore[no-any-return]  # the event's list of ints


def materialize(item: _Run, group_kinds: Sequence[str | None], group_windows: Sequence[int | None]) -> KVEvent:
    """The event a :data:`_Run` stands for: per segment one slice of its record's hashes, token ids
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


def run_tokens(item: _Run) -> int:
    """Token ids in a :data:`_Run`."""
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
            split), as :data:`_Run` tuples (record segments, shared with the mirror); read
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
        self.parts: list[list[_Run]] = []
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

    def _add_part(self, part: list[_Run], num_tokens: int) -> None:
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

    async def iter_parts(self) -> AsyncIterator[tuple[int, bool]]:
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


class ByteBudget:
    """Snapshot bytes being written, shared by every snapshot stream: at most ``max_bytes`` in
    flight, at most ``bytes_per_s`` on average, one writer let in per turn of the loop.

    A part's encoded bytes count from before its write until the write completes (the client
    took it, or gRPC buffered it within its HTTP/2 flow-control window). A writer waits (first
    come, first served) while its part would take ``in_flight`` above ``max_bytes`` (a part bigger
    than the whole budget goes alone, when nothing else is in flight), while the rate's bucket
    (``max_bytes`` deep) is in debt, and until the loop's next turn after the last writer let in.
    Starting a write copies and frames its bytes on the loop (about 0.1 ms per 100 KB here), so
    another call waits behind at most one part's write start however many streams read snapshots,
    and the rate bounds what snapshot writing (and encoding, and the readers' parsing, where they
    share the machine) takes from everything else.

    A write that has not completed ``hold_s`` after it was let in (its client stopped reading,
    or reads slowly) stops counting then (:meth:`held`): it is still in flight in gRPC, bounded
    per stream by one message and cut by the stream's own write timeout, but it no longer holds
    the budget, so clients that stop reading mid-snapshot delay every other snapshot stream by
    ``hold_s`` per wave of blocked writes that fills ``max_bytes``, not until their streams are cut
    (issue 15: no client stalls the others). Writers are let in first come, first served, so blocked
    writes that do not fit in ``max_bytes`` together take turns: N such streams whose parts are P
    bytes delay the others by up to about ``hold_s * N / max(1, max_bytes // P)`` (measured on a real
    server: 1 MiB, parts of 32,768 token ids (about 183 KB), 12 clients that read one part and
    stopped: another client's 11.5 MB snapshot took 1.87 s instead of 0.59 s). The writes let go
    stay within ``max_let_go_bytes`` (the memory such clients hold in the server); beyond it a
    blocked write keeps counting until it completes, its stream is cut, or room frees up.

    Args:
        max_bytes: bytes in flight, and the bucket's depth (>= 1).
        bytes_per_s: average bytes per second let in (>= 1).
        hold_s: the longest one write counts in flight, seconds (> 0), while the writes let go
            and not yet complete stay within ``max_let_go_bytes``.
        max_let_go_bytes: bytes of writes let go at ``hold_s`` and not yet complete, at most
            (>= 0; default 16 x ``max_bytes``): so snapshot parts held in gRPC for clients that
            stopped reading stay within ``max_bytes + max_let_go_bytes`` however many there are;
            beyond it a blocked write keeps counting (and is asked again every ``hold_s``).

    Attributes:
        in_flight: bytes acquired and not yet released.
        peak: the most ``in_flight`` has been.
        num_waits: acquisitions that had to wait (for bytes, the rate, or the loop's next turn).
        num_bytes: bytes let in so far.
        num_let_go: writes through :meth:`held` that stopped counting at ``hold_s`` so far (a count:
            it stays when they complete later).
        let_go_bytes: bytes of the writes let go that have not completed yet.
    """

    def __init__(
        self,
        max_bytes: int,
        bytes_per_s: float = float("inf"),
        hold_s: float = 0.5,
        max_let_go_bytes: int | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1; got {max_bytes}")
        if not bytes_per_s >= 1:
            raise ValueError(f"bytes_per_s must be >= 1; got {bytes_per_s}")
        if not hold_s > 0:
            raise ValueError(f"hold_s must be > 0; got {hold_s}")
        self.max_bytes = max_bytes
        self.bytes_per_s = bytes_per_s
        self.hold_s = hold_s
        self.max_let_go_bytes = 16 * max_bytes if max_let_go_bytes is None else max_let_go_bytes
        if self.max_let_go_bytes < 0:
            raise ValueError(f"max_let_go_bytes must be >= 0; got {max_let_go_bytes}")
        self.num_let_go = 0
        self.let_go_bytes = 0
        self.in_flight = 0
        self.peak = 0
        self.num_waits = 0
        self.num_bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._closed_until_next_turn = False
        self._credit = float(max_bytes)  # the rate's bucket, bytes (negative: in debt)
        self._credit_at = time.monotonic()

    def _fits(self, num_bytes: int) -> bool:
        return not self._closed_until_next_turn and (
            self.in_flight == 0 or self.in_flight + num_bytes <= self.max_bytes
        )

    def _refill(self) -> float:
        if self.bytes_per_s == float("inf"):
            return float(self.max_bytes)
        now = time.monotonic()
        self._credit = min(float(self.max_bytes), self._credit + (now - self._credit_at) * self.bytes_per_s)
        self._credit_at = now
        return self._credit

    def _take(self, num_bytes: int) -> None:
        self.in_flight += num_bytes
        self.peak = max(self.peak, self.in_flight)
        self.num_bytes += num_bytes
        if self.bytes_per_s != float("inf"):
            self._credit -= num_bytes
        self._closed_until_next_turn = True
        loop = asyncio.get_running_loop()
        if self._credit < 0:  # in debt: the next writer waits until the bucket is back at 0
            loop.call_later(-self._credit / self.bytes_per_s, self._next_turn)
        else:
            loop.call_soon(self._next_turn)  # runs in the loop's next turn

    def _next_turn(self) -> None:
        self._closed_until_next_turn = False
        self._wake()

    async def acquire(self, num_bytes: int) -> None:
        """Wait until ``num_bytes`` fit, the rate allows and it is this writer's turn, then count
        them in flight (pair with :meth:`release`)."""
        if not self._waiters and self._fits(num_bytes) and self._refill() >= 0:
            self._take(num_bytes)
            return
        self.num_waits += 1
        waiter = (num_bytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[1]
        except BaseException:
            if waiter[1].done() and not waiter[1].cancelled():
                self.release(num_bytes)  # let in, then cancelled before it ran: hand it on
            else:
                self._waiters.remove(waiter)
                self._wake()
            raise

    def release(self, num_bytes: int) -> None:
        """Count ``num_bytes`` out of flight and let the next waiter in (when the turn and the rate allow)."""
        self.in_flight -= num_bytes
        self._wake()

    @contextlib.asynccontextmanager
    async def held(self, num_bytes: int) -> AsyncIterator[None]:
        """Count ``num_bytes`` in flight (:meth:`acquire`) for the write made in the ``async with``
        body, until it completes or ``hold_s`` passes, whichever comes first."""
        await self.acquire(num_bytes)
        counted = True
        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []  # the pending one

        def let_go() -> None:
            nonlocal counted
            if self.let_go_bytes + num_bytes > self.max_let_go_bytes:  # memory bound: keep counting, ask again
                timer[0] = loop.call_later(self.hold_s, let_go)
                return
            counted = False
            self.num_let_go += 1
            self.let_go_bytes += num_bytes
            self.release(num_bytes)

        timer.append(loop.call_later(self.hold_s, let_go))
        try:
            yield
        finally:
            timer[0].cancel()
            if counted:
                self.release(num_bytes)
            else:
                self.let_go_bytes -= num_bytes

    def _wake(self) -> None:
        waiters = self._waiters
        if waiters and self._fits(waiters[0][0]):
            if self._refill() < 0:  # in debt, and no timer pending (it would have closed the turn)
                self._closed_until_next_turn = True
                asyncio.get_running_loop().call_later(-self._credit / self.bytes_per_s, self._next_turn)
                return
            num_bytes, future = waiters.popleft()
            self._take(num_bytes)
            future.set_result(None)


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
        self.pending: deque[Any] = deque()
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
        event_log: Any,
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

    def on_batch(self, entry: Any) -> None:
        """Apply an appended batch (an event-log listener; ``entry`` has ``seq`` and ``events``), or
        hold it back while a cut is in production or held batches wait."""
        if self._in_production or self.pending:
            self.pending.append(entry)
            return
        self._apply(entry)

    def _apply(self, entry: Any) -> None:
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

    def _start(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, snap: Snapshot) -> None:
        limit = self.part_tokens
        error: BaseException | None = None
        try:
            part: list[_Run] = []
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
