"""Snapshots of the cached set: a compact mirror fed by the event log, cut in parts, shared.

A snapshot is AllBlocksCleared, then BlockStored for every cached block (parents before children),
then the same blocks re-announced in the server's recency order (``reused``), all at a watermark
seq: a subscriber that applies it and then every batch from watermark + 1 holds exactly the
server's cached set and misses nothing.

Cost rules (issue 15):

* The mirror (:class:`CachedSetMirror`) keeps, per cached (group_idx, block hash), a reference to
  one record per stored run (the BlockStored's hashes, token ids and keys), not an object per
  block; a block's tuple is made when a cut reads it. A record whose blocks are mostly gone is
  compacted to its live blocks, so one surviving block does not pin a whole prompt, and token ids
  beyond the newest ``UNPACKED_TOKENS`` are packed to 8 bytes each. It is fed by an event-log
  listener; its ``seq`` is the last batch applied.
* :meth:`SnapshotSource.get` is the one entry point (gRPC ``StreamEvents`` and ``TakeEvents``
  use it; so can any other wire). Every caller that asks for the same group filter at the same
  mirror seq shares one cut (:attr:`SnapshotSource.num_cuts` counts cuts, exported as
  ``kvservice_snapshot_cuts``). A cut copies the mirror's table (one C-level dict copy, the only
  step that holds the loop in proportion to the cache: about 50 ms per million blocks here) and is
  then produced by a task in parts of about ``part_tokens`` token ids that yields to the loop every
  ``YIELD_EVERY_TOKENS`` tokens; callers read parts as they are produced.
* At most ``max_concurrent_cuts`` cuts are produced at once; a caller that would start one more
  joins the newest cut of its filter in production (an older watermark is still exact: the
  caller follows live batches from that watermark + 1, which are retained), or waits for one to
  finish.
* :meth:`SnapshotSource.min_bytes` is a lower bound on a snapshot's encoded size known before any
  cut (one byte per token id, twice: both halves carry every block), so an answer
  with a byte limit (TakeEvents) is refused at once when the bound is above it.

Nothing here knows protobuf: parts are lists of events; the servicer edge encodes them (once per
payload format, memoized on the :class:`Snapshot`, so a burst of subscribers shares the bytes too).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Mapping, Sequence
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, Union, cast

from kvservice.core.errors import ShuttingDownError
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "CachedSetMirror",
    "MirroredBlock",
    "Snapshot",
    "SnapshotSource",
    "YIELD_EVERY_TOKENS",
    "materialize",
    "snapshot_runs",
]

YIELD_EVERY_TOKENS = 8_192
"""A cut in production yields to the loop after about this many token ids of events (and at every
part boundary), so one cut holds the loop for about 500 blocks' worth of work at a time."""

_Key = tuple[int, Any]  # (group_idx, block hash)

_held: Callable[[Any], Any] = itemgetter(1)
"""A (key, record or None) pair's record: true where the block was held."""

UNPACKED_TOKENS = 1 << 18
"""Token ids the mirror keeps as the announcing events' own lists (about 40 bytes each: a list
slot and an int object) before it packs the oldest into int64 bytes (8 each); see
:class:`CachedSetMirror`. At most about 10 MiB of lists."""


MirroredBlock = tuple
"""One cached block as a cut reads it (made from the mirror's :class:`_Stored` record when read):
a plain tuple (immutable, so a cut may share it; and untracked by CPython's cycle collector once
it has looked at it, since it holds only ints, strings, None and bytes), indexed by:"""

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
        hashes: the blocks' hashes, in the event's order (parent first).
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
        hashes: list,
        parents: list | None,
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
            event.block_hashes,
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
        """Every block's :data:`MirroredBlock`, in :attr:`hashes` order (C-level passes; packs the
        record first)."""
        self.pack()
        n = len(self.hashes)
        width = 8 * self.block_size
        data = memoryview(cast(bytes, self.tokens))
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

    def block(self, block_hash: Any) -> MirroredBlock:
        """The :data:`MirroredBlock` of one of its blocks (packs the record first)."""
        self.pack()
        i = self.position(block_hash)
        width = 8 * self.block_size
        extra = self.extra_keys
        return (
            self.parent_of(i),
            cast(bytes, self.tokens)[i * width : (i + 1) * width],
            self.block_size,
            self.lora_id,
            self.lora_name,
            self.medium,
            extra is not None,
            extra[i] if extra is not None else None,
        )


class BlockView(Mapping):
    """(group_idx, hash) -> :data:`MirroredBlock` over a table of :class:`_Stored` records, in the
    table's order; each block's tuple is made when first read and then kept (so a cut that reads a
    block twice gets the same tuple). The table must not change while it is read through this
    (a cut reads a copy).

    Args:
        records: the table: keyed by (group_idx, hash), or by hash alone (``by_hash``: one group,
            group_idx 0).
    """

    def __init__(self, records: dict[Any, _Stored], by_hash: bool = False) -> None:
        self._records = records
        self._by_hash = by_hash
        self._blocks: dict[_Key, MirroredBlock] = {}

    def __getitem__(self, key: _Key) -> MirroredBlock:
        block = self._blocks.get(key)
        if block is None:
            if self._by_hash and key[0] != 0:
                raise KeyError(key)
            record = self._records[key[1] if self._by_hash else key]
            block = self._blocks[key] = record.block(key[1])
        return block

    def get(self, key: _Key, default: Any = None) -> Any:
        if key not in self:
            return default
        return self[key]

    def __contains__(self, key: object) -> bool:
        if self._by_hash:
            return type(key) is tuple and len(key) == 2 and key[0] == 0 and key[1] in self._records
        return key in self._records

    def __iter__(self) -> Iterator[_Key]:
        if self._by_hash:
            return zip(repeat(0), self._records)
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def fill(self, step_blocks: int = 4096) -> Iterator[dict[_Key, MirroredBlock]]:
        """Make every block's tuple, record by record, pausing (yielding an empty dict) after
        about ``step_blocks`` blocks; the last item is the filled table: a plain dict in this
        view's order, which a cut then reads at dict speed."""
        records, by_hash, made = self._records, self._by_hash, self._blocks
        done = 0
        for record in dict.fromkeys(records.values()):
            g = record.group_idx
            for i, (h, block) in enumerate(zip(record.hashes, record.blocks())):
                if records.get(h if by_hash else (g, h)) is record and record.position(h) == i:
                    made.setdefault((g, h), block)
            done += len(record.hashes)
            if done >= step_blocks:
                done = 0
                yield {}
        if by_hash:
            yield {key: made[key] for key in zip(repeat(0), records)}
        else:
            yield {key: made[key] for key in records}

    def filled(self) -> dict[_Key, MirroredBlock]:
        """:meth:`fill` at once (tests, small caches, synchronous callers)."""
        *_, table = self.fill(1 << 62)
        return table


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
      event's own lists. A block's tuple is made only when a cut reads it.
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
            [record.hashes[i] for i in live],
            [record.parent_of(i) for i in live],
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
        is made when read): a cut reads it while the mirror moves on (records are never changed
        in what a view reads: a compaction makes a new record, packing keeps the ids)."""
        return BlockView(self._blocks.copy(), self._by_hash)

    def events(self, group_idxs: tuple[int, ...] | None = None) -> list[KVEvent]:
        """The whole snapshot's events at once (tests and small caches; servers use a
        :class:`SnapshotSource`)."""
        view = self.view().filled()
        return [
            materialize(view, item, self.group_kinds, self.group_windows) for item in snapshot_runs(view, group_idxs)
        ]


_Run = Union[None, tuple[list[_Key], bool]]
"""One snapshot event as the cut holds it: None is AllBlocksCleared; (run, reused) is a
BlockStored of those blocks (parent first), materialized from the view only when encoded."""


def snapshot_runs(view: Mapping[_Key, MirroredBlock], group_idxs: tuple[int, ...] | None) -> Iterator[_Run]:
    """The snapshot of ``view``, one event (as a :data:`_Run`) at a time: AllBlocksCleared;
    BlockStored for every block, parents before children; then the same blocks re-announced in
    recency order (``reused``).

    The first half gives the cached set (a consumer building a tree meets every parent before its
    children). The second half, like a reuse report, changes no presence; a consumer that bounds
    its index by recency of announcement (an LRU) ends up ordered as one that watched from the
    start would be. Consecutive blocks of one chain share one BlockStored, so one event carries at
    most one chain (at most max_model_len tokens).
    """

    def continues(prev: _Key, key: _Key) -> bool:
        if prev[0] != key[0]:
            return False
        block, before = view[key], view[prev]
        same: bool = (
            block[PARENT] == prev[1]
            and block[BLOCK_SIZE] == before[BLOCK_SIZE]
            and block[LORA_ID] == before[LORA_ID]
            and block[LORA_NAME] == before[LORA_NAME]
            and block[MEDIUM] == before[MEDIUM]
            and block[HAS_EXTRA_KEYS] == before[HAS_EXTRA_KEYS]
        )
        return same

    yield None
    # Half 1: parents first. Walk each block's ancestors up to an emitted (or absent) one.
    emitted: set = set()
    run: list[_Key] | None = None
    for key in view:
        if (group_idxs is not None and key[0] not in group_idxs) or key in emitted:
            continue
        g = key[0]
        chain = [key]
        parent = view[key][PARENT]
        while parent is not None and (g, parent) in view and (g, parent) not in emitted:
            chain.append((g, parent))
            parent = view[(g, parent)][PARENT]
        chain.reverse()
        emitted.update(chain)
        if run is not None and continues(run[-1], chain[0]):
            run.extend(chain)
        else:
            if run is not None:
                yield run, False
            run = chain
    if run is not None:
        yield run, False
    del emitted
    # Half 2: recency order, least recent first; a run is a chain listed child first.
    run = None
    for key in view:
        if group_idxs is not None and key[0] not in group_idxs:
            continue
        if run is not None and continues(key, run[-1]):
            run.append(key)
        else:
            if run is not None:
                run.reverse()
                yield run, True
            run = [key]
    if run is not None:
        run.reverse()
        yield run, True


def materialize(
    view: Mapping[_Key, MirroredBlock],
    item: _Run,
    group_kinds: Sequence[str | None],
    group_windows: Sequence[int | None],
) -> KVEvent:
    """The event a :data:`_Run` stands for."""
    if item is None:
        return AllBlocksCleared()
    run, reused = item
    g = run[0][0]
    first = view[run[0]]
    token_ids: list[int] = []
    extra_keys: list | None = [] if first[HAS_EXTRA_KEYS] else None
    for key in run:
        block = view[key]
        token_ids.extend(memoryview(block[TOKEN_IDS]).cast("q"))
        if extra_keys is not None:
            extra_keys.append(block[EXTRA_KEYS])
    return BlockStored(
        block_hashes=[h for _, h in run],
        parent_block_hash=first[PARENT],
        token_ids=token_ids,
        block_size=first[BLOCK_SIZE],
        lora_id=first[LORA_ID],
        medium=first[MEDIUM],
        lora_name=first[LORA_NAME],
        extra_keys=extra_keys,
        group_idx=g,
        kv_cache_spec_kind=group_kinds[g],
        kv_cache_spec_sliding_window=group_windows[g],
        reused=reused,
    )


def _run_tokens(view: Mapping[_Key, MirroredBlock], item: _Run) -> int:
    if item is None:
        return 0
    run = item[0]
    block_size: int = view[run[0]][BLOCK_SIZE]
    return len(run) * block_size


class Snapshot:
    """One cut: its watermark and its parts, produced by a task while callers read them.

    Attributes:
        seq: the watermark (the mirror's seq when cut); continue from ``seq + 1``.
        ts: wall-clock time of the cut, in seconds.
        group_idxs: the group filter (None: all groups).
        parts: the parts produced so far, each about ``part_tokens`` token ids (an event is never
            split), as runs of the cut's view (compact: a key reference per block); read one with
            :meth:`part_events`.
        done: all parts produced.
        num_tokens: token ids in the parts produced so far.
    """

    def __init__(
        self,
        seq: int,
        group_idxs: tuple[int, ...] | None,
        view: Mapping[_Key, MirroredBlock] | None = None,
        group_kinds: Sequence[str | None] = (),
        group_windows: Sequence[int | None] = (),
    ) -> None:
        self.seq = seq
        self.ts = time.time()
        self.group_idxs = group_idxs
        self.view = view if view is not None else {}
        self.group_kinds = tuple(group_kinds)
        self.group_windows = tuple(group_windows)
        self.parts: list[list[_Run]] = []
        self.done = False
        self.num_tokens = 0
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        self._encodings: dict[Hashable, list[bytes | None]] = {}

    def part_events(self, i: int) -> list[KVEvent]:
        """Part ``i``'s events (made now from the view: the caller encodes and drops them)."""
        view, kinds, windows = self.view, self.group_kinds, self.group_windows
        return [materialize(view, item, kinds, windows) for item in self.parts[i]]

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


class SnapshotSource:
    """Where every snapshot comes from: shared cuts of a :class:`CachedSetMirror`, bounded.

    Args:
        mirror: the mirror to cut (fed by the event log; see :meth:`attach`).
        part_tokens: token ids per part, about (>= 1).
        max_concurrent_cuts: cuts produced at once (>= 1).

    Attributes:
        num_cuts: cuts made (a burst of callers at one head makes one).
    """

    def __init__(self, mirror: CachedSetMirror, *, part_tokens: int = 32_768, max_concurrent_cuts: int = 2) -> None:
        if part_tokens < 1:
            raise ValueError(f"part_tokens must be >= 1; got {part_tokens}")
        if max_concurrent_cuts < 1:
            raise ValueError(f"max_concurrent_cuts must be >= 1; got {max_concurrent_cuts}")
        self.mirror = mirror
        self.part_tokens = part_tokens
        self.max_concurrent_cuts = max_concurrent_cuts
        self.num_cuts = 0
        self._latest: dict[tuple[int, ...] | None, Snapshot] = {}  # per filter, the newest cut
        self._in_production: set[Snapshot] = set()
        self._tasks: set[asyncio.Task] = set()
        self._slot_freed: asyncio.Event | None = None

    @classmethod
    def attach(cls, event_log: Any, *, part_tokens: int = 32_768, max_concurrent_cuts: int = 2) -> SnapshotSource:
        """A source whose mirror follows ``event_log`` (a :class:`~kvservice.server.event_log.EventLog`):
        call before any batch is appended, and before other listeners are added."""
        mirror = CachedSetMirror(event_log.num_groups, event_log.group_kinds, event_log.group_windows)
        source = cls(mirror, part_tokens=part_tokens, max_concurrent_cuts=max_concurrent_cuts)
        event_log.add_listener(source.on_batch)
        return source

    def on_batch(self, entry: Any) -> None:
        """Apply an appended batch (an event-log listener) and drop finished cuts it made stale."""
        self.mirror.apply(entry.seq, entry.events)
        if self._latest:
            for key, snap in list(self._latest.items()):
                if snap.done:
                    del self._latest[key]

    def min_bytes(self, group_idxs: tuple[int, ...] | None) -> int:
        """A lower bound on the encoded size of a snapshot now, in bytes, known without a cut:
        one byte per token id, in both halves of the snapshot."""
        tokens = self.mirror.num_tokens_per_group
        num_tokens = sum(tokens) if group_idxs is None else sum(tokens[g] for g in group_idxs)
        return 2 * num_tokens

    async def get(self, group_idxs: tuple[int, ...] | None = None) -> Snapshot:
        """The snapshot for a group filter: the cut at the mirror's seq if one exists (in
        production or done), else a new cut, within ``max_concurrent_cuts`` (at the bound: the
        newest cut of this filter still in production, else wait for a slot).

        Read its parts with :meth:`Snapshot.iter_parts` (or :meth:`Snapshot.wait_done`), then
        follow batches from ``snapshot.seq + 1``.
        """
        while True:
            snap = self._latest.get(group_idxs)
            if (
                snap is not None
                and snap.error is None
                and (snap.seq == self.mirror.seq or (not snap.done and self._at_bound()))
            ):
                return snap
            if not self._at_bound():
                return self._cut(group_idxs)
            if self._slot_freed is None:
                self._slot_freed = asyncio.Event()
            await self._slot_freed.wait()

    def _at_bound(self) -> bool:
        return len(self._in_production) >= self.max_concurrent_cuts

    def _cut(self, group_idxs: tuple[int, ...] | None) -> Snapshot:
        mirror = self.mirror
        snap = Snapshot(mirror.seq, group_idxs, mirror.view(), mirror.group_kinds, mirror.group_windows)
        self.num_cuts += 1
        self._latest[group_idxs] = snap
        self._in_production.add(snap)
        task = asyncio.get_running_loop().create_task(self._produce(snap))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return snap

    async def _produce(self, snap: Snapshot) -> None:
        limit = self.part_tokens
        error: BaseException | None = None
        try:
            if isinstance(snap.view, BlockView):  # every block's tuple first, in steps; then dict speed
                for table in snap.view.fill(max(1, YIELD_EVERY_TOKENS // 16)):
                    if table:
                        snap.view = table
                    else:
                        await asyncio.sleep(0)
            view = snap.view
            part: list[_Run] = []
            part_tokens = 0
            since_yield = 0
            for item in snapshot_runs(view, snap.group_idxs):
                size = _run_tokens(view, item)
                if part and part_tokens + size > limit:
                    snap._add_part(part, part_tokens)
                    part, part_tokens = [], 0
                    since_yield = YIELD_EVERY_TOKENS
                part.append(item)
                part_tokens += size
                since_yield += size
                if since_yield >= YIELD_EVERY_TOKENS:
                    since_yield = 0
                    await asyncio.sleep(0)
            snap._add_part(part, part_tokens)
        except BaseException as exc:  # a failed cut fails its callers, never the loop
            error = exc if isinstance(exc, Exception) else ShuttingDownError("snapshot cut cancelled: shutting down")
            if not isinstance(exc, Exception):
                raise
        finally:
            snap._finish(error)
            self._in_production.discard(snap)
            if self._slot_freed is not None:
                self._slot_freed.set()
                self._slot_freed = None

    async def close(self) -> None:
        """Cancel cuts in production (their callers get an error)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            try:
                await task
            except BaseException:
                pass
