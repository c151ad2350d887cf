"""The compact mirror of the cached set: one record per stored run, fed by the event log's batches.

:class:`CachedSetMirror` holds, per cached (group_idx, block hash), a reference to the
:class:`StoredRecord` of the BlockStored that announced it; :class:`BlockView` reads its table
block by block (tests, the reference cut) or record by record (the cut,
:mod:`kvservice.server.snapshot.cut`). Nothing here cuts a snapshot or knows the loop.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, cast

from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEvent

__all__ = [
    "BLOCK_SIZE",
    "EXTRA_KEYS",
    "HAS_EXTRA_KEYS",
    "LORA_ID",
    "LORA_NAME",
    "MEDIUM",
    "PARENT",
    "TOKEN_IDS",
    "UNPACKED_TOKENS",
    "BlockView",
    "CachedSetMirror",
    "MirroredBlock",
    "StoredRecord",
]

_Key = tuple[int, ExternalBlockHash]  # (group_idx, block hash)

_held: Callable[[Any], Any] = itemgetter(1)
"""A (key, record or None) pair's record: true where the block was held."""

UNPACKED_TOKENS = 1 << 18
"""Token ids the mirror keeps as the announcing events' own lists (about 40 bytes each: a list
slot and an int object) before it packs the oldest into int64 bytes (8 each); see
:class:`CachedSetMirror`. At most about 10 MiB of lists."""


MirroredBlock = tuple
"""One cached block as :class:`BlockView` reads it (made from the mirror's :class:`StoredRecord`
record when read; tests, and the block-by-block reference cut in ``tests/unit/``; a cut reads
record segments instead): a plain tuple, indexed by:"""

PARENT, TOKEN_IDS, BLOCK_SIZE, LORA_ID, LORA_NAME, MEDIUM, HAS_EXTRA_KEYS, EXTRA_KEYS = range(8)
"""Fields of a :data:`MirroredBlock`: the parent block hash (None at block 0); this block's own
``block_size`` token ids (int64 in native byte order, as ``array('q').tobytes()``); block_size, lora_id, lora_name, medium of the
BlockStored that announced it; whether that event carried ``extra_keys`` at all; this block's own
entry of them (None when it had none)."""


class StoredRecord:
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
        hashes: tuple[ExternalBlockHash, ...],
        parents: tuple[ExternalBlockHash | None, ...] | None,
        parent_block_hash: ExternalBlockHash | None,
        block_size: int,
        lora_id: int | None,
        lora_name: str | None,
        medium: str | None,
        extra_keys: list | None,
        tokens: list[int] | bytes,
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
        self._index: dict[ExternalBlockHash, int] | None = None

    @classmethod
    def of(cls, event: BlockStored) -> StoredRecord:
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

    def position(self, block_hash: ExternalBlockHash) -> int:
        """The index of ``block_hash`` in :attr:`hashes` (its last application: the smallest
        index when an event named it twice, as hashes are applied last to first)."""
        index = self._index
        if index is None:
            n = len(self.hashes)
            index = self._index = dict(zip(reversed(self.hashes), range(n - 1, -1, -1)))
        return index[block_hash]

    def parent_of(self, i: int) -> ExternalBlockHash | None:
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

    def __init__(self, records: dict[Any, StoredRecord], by_hash: bool = False) -> None:
        self.records = records
        self.by_hash = by_hash
        # per record read, its blocks by hash
        self._made: dict[StoredRecord, dict[ExternalBlockHash, MirroredBlock]] = {}

    def _record(self, key: Any) -> StoredRecord | None:
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
    BlockStored that announced the block (:class:`StoredRecord`); read per block through
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
        self._blocks: dict[Any, StoredRecord] = {}
        self._unpacked: dict[StoredRecord, int] = {}  # records still holding lists, oldest first: their group
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
                record = StoredRecord.of(event)
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

    def _drop(self, g: int, records: list[StoredRecord]) -> None:
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

    def _compact(self, g: int, record: StoredRecord) -> None:
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
        moved = StoredRecord(
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

    @property
    def table(self) -> BlockView:
        """The table itself (no copy), block by block, least recently announced first: read it
        only where nothing can apply a batch meanwhile (synchronously, or while a
        :class:`SnapshotSource` holds batches back); never change it."""
        return BlockView(self._blocks, self._by_hash)
