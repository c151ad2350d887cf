"""The block pool: blocks, the free queue, the prefix-cache index, and the KV events.

This module mirrors vLLM's ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``
(``KVCacheBlock``, ``FreeKVCacheBlockQueue``, ``BlockHashToBlockMap``) and is the only source of
KV events. It knows nothing of attention kinds or report modes: callers tell it what to cache and
what to report; the manager annotates events with group semantics when it takes them.

Presence semantics (docs/ARCHITECTURE.md §3.3): per group, a hash is *present* while at least one
physical block carries it. BlockStored is emitted exactly when a hash becomes present in a group;
BlockRemoved exactly when its last physical copy leaves; AllBlocksCleared on reset. A second
physical copy of a present hash (vLLM does not dedup: a block-aligned prompt sent twice recomputes
its last block) emits nothing, and evicting one of two copies emits nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, final

import numpy as np

from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvservice_client.hashing import block_event_extra_keys, block_hash_to_int

if TYPE_CHECKING:
    from kvservice.core.request import Request

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "BlockHashToBlockMap"]


@final  # no subclass: `type(value) is KVCacheBlock` then tells a block from a dict of them, for mypy too
class KVCacheBlock:
    """One block id of the pool.

    Attributes:
        block_id: index into every group's KV tensors (dimension ``num_blocks``); 0 is the null
            block.
        ref_cnt: requests holding the block.
        block_hash: the hash while the block is cached (full and indexed), else None.
        group_idx: the group whose index holds ``block_hash`` (meaningful while cached).
        prev_free_block, next_free_block: the free queue's links (None when not free).
        is_null: True for block 0, the placeholder for positions a group does not keep; it is
            never freed, never cached, never evicted.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_idx", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_idx = -1
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


_LINKED = "a listed block's links are never None (the sentinels close the list)"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: an intrusive doubly-linked list with two sentinels.

    The head is evicted (reused) first. Eviction order:

    1. Blocks freed without a hash (never cached: partial or uncomputed blocks) are *prepended*:
       they hold nothing worth keeping, so they are reused before any cached block.
    2. Cached blocks are *appended* when their ref count drops to 0, so the least recently freed
       cached block is evicted first (LRU).
    3. A request frees its blocks tail first, so its deepest block is evicted before its prefix
       (a prefix shared by more requests stays longest).
    4. A cached free block that is hit again leaves the queue (``remove``, O(1)) and re-enters at
       the tail when freed again.

    Pop from the head, removal from the middle and append are O(1); no per-operation allocation.
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Pop the head (the next block to evict).

        Raises:
            ValueError: the queue is empty.
        """
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free blocks")
        nxt = block.next_free_block
        assert nxt is not None, _LINKED
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first ``n`` blocks, in order.

        Raises:
            ValueError: fewer than ``n`` free blocks.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks; {self.num_free_blocks} free")
        out = []
        block = self.fake_head.next_free_block
        for _ in range(n):
            assert block is not None, _LINKED
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None, _LINKED
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from the middle of the queue (O(1)).

        Raises:
            RuntimeError: ``block`` is not in the queue.
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self.fake_tail.prev_free_block
        assert last is not None, _LINKED
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in order (the first of them is evicted first among them):
        ``append`` of each, in one pass."""
        if not blocks:
            return
        tail = self.fake_tail
        last = tail.prev_free_block
        assert last is not None, _LINKED
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (evicted first)."""
        first = self.fake_head.next_free_block
        assert first is not None, _LINKED
        first.prev_free_block = block
        block.next_free_block = first
        block.prev_free_block = self.fake_head
        self.fake_head.next_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks, head (next evicted) first."""
        out = []
        block = self.fake_head.next_free_block
        while block is not self.fake_tail:
            assert block is not None, _LINKED
            out.append(block)
            block = block.next_free_block
        return out


class BlockHashToBlockMap:
    """Per group: block hash -> the cached block(s) carrying it.

    Usually one physical block carries a hash; a second copy can exist (two requests computed the
    same block concurrently, or a block-aligned prompt recomputed its last block). The value is the
    block itself, or a ``{block_id: block}`` dict when there are several copies (as vLLM's map, to
    keep the common case small).
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._map

    def get_one_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any one block carrying ``block_hash``, or None."""
        value = self._map.get(block_hash)
        if value is None or type(value) is KVCacheBlock:
            return value
        return next(iter(value.values()))

    def insert(self, block_hash: bytes, block: KVCacheBlock) -> bool:
        """Index ``block`` under ``block_hash``; True when the hash was not present before."""
        value = self._map.get(block_hash)
        if value is None:
            self._map[block_hash] = block
            return True
        if type(value) is KVCacheBlock:
            self._map[block_hash] = {value.block_id: value, block.block_id: block}
        else:
            value[block.block_id] = block
        return False

    def pop(self, block_hash: bytes, block_id: int) -> bool:
        """Unindex block ``block_id`` from ``block_hash``; True when no copy of the hash is left.

        Raises:
            KeyError: the block is not indexed under the hash.
        """
        value = self._map[block_hash]
        if type(value) is KVCacheBlock:
            if value.block_id != block_id:
                raise KeyError((block_hash.hex(), block_id))
            del self._map[block_hash]
            return True
        del value[block_id]
        if len(value) == 1:
            self._map[block_hash] = next(iter(value.values()))
        return False

    def num_copies(self, block_hash: bytes) -> int:
        """Physical blocks carrying ``block_hash``."""
        value = self._map.get(block_hash)
        if value is None:
            return 0
        return 1 if type(value) is KVCacheBlock else len(value)

    def hashes(self) -> list[bytes]:
        """The present hashes, in insertion order."""
        return list(self._map)

    def blocks(self) -> Iterable[KVCacheBlock]:
        """Every indexed block."""
        for value in self._map.values():
            if type(value) is KVCacheBlock:
                yield value
            else:
                yield from value.values()

    def clear(self) -> None:
        self._map.clear()


class BlockPool:
    """``num_blocks`` blocks shared by every KV cache group, with the prefix-cache index.

    Block 0 is taken at construction as the null block. Events are appended as values to an
    internal queue and drained by :meth:`take_events`; the pool never publishes anything.

    Args:
        num_blocks: blocks in the pool, null block included (>= 2).
        num_groups: KV cache groups sharing the pool (each has its own hash index).
        enable_caching: keep full blocks indexed by hash for prefix-cache hits.
        enable_kv_cache_events: record events (off: no event object is ever built).
        block_hash_encoder: maps a digest to its published form (default: 64-bit int, vLLM's).
        medium: the ``medium`` field of every event ("GPU", vLLM's primary pool's, by default).
        locality, ownership: vLLM 0.33's fields of every BlockStored and BlockRemoved (None: not
            published).

    Raises:
        ValueError: ``num_blocks < 2`` or ``num_groups < 1``.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        block_hash_encoder: Callable[[bytes], int | bytes] = block_hash_to_int,
        medium: str = "GPU",
        locality: str | None = None,
        ownership: str | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block); got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1; got {num_groups}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.block_hash_encoder = block_hash_encoder
        self.medium = medium
        self.locality = locality
        self.ownership = ownership
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = [BlockHashToBlockMap() for _ in range(num_groups)]
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVEvent] = []
        self.num_evictions = 0
        """Cached blocks reused for new content since start (blocks)."""
        self.evicted_while_held: set[int] = set()
        """Ids of held blocks whose hash :meth:`evict_blocks` dropped (their KV was invalid), until
        freed: the only held blocks two requests may share uncached."""

    # -- lookup -----------------------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes, group_idx: int) -> KVCacheBlock | None:
        """A cached block of ``group_idx`` carrying ``block_hash``, or None."""
        return self.cached_block_hash_to_block[group_idx].get_one_block(block_hash)

    def get_num_free_blocks(self) -> int:
        """Free blocks (cached-but-unreferenced included), null block excluded."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the pool's blocks in use (0..1), null block excluded."""
        total = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total

    def get_num_cached_blocks(self) -> int:
        """Present hashes over all groups (one per hash, however many copies)."""
        return sum(len(m) for m in self.cached_block_hash_to_block)

    # -- allocation -------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, ref count 1 each.

        Cached blocks among them are evicted first (their hashes unindexed; BlockRemoved for each
        hash whose last copy leaves, one event per group per call).

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        removed: dict[int, list[bytes]] | None = None
        index = self.cached_block_hash_to_block
        events = self.enable_kv_cache_events
        num_evictions = 0
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                # The common case inline: the block is its hash's only copy (else the map's pop).
                hash_map = index[block.group_idx]
                if hash_map._map.get(block_hash) is block:
                    del hash_map._map[block_hash]
                    last = True
                else:
                    last = hash_map.pop(block_hash, block.block_id)
                if last and events:
                    if removed is None:
                        removed = {}
                    group_removed = removed.get(block.group_idx)
                    if group_removed is None:
                        removed[block.group_idx] = [block_hash]
                    else:
                        group_removed.append(block_hash)
                block.block_hash = None
                num_evictions += 1
            block.ref_cnt = 1
        self.num_evictions += num_evictions
        if removed:
            self._emit_removed(removed)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hit blocks (leaving the free queue if unreferenced)."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference from each block, in eviction-priority order (first = evicted first).

        Blocks reaching ref count 0 re-enter the free queue: cached ones at the tail, in the given
        order; uncached ones at the head (see :class:`FreeKVCacheBlockQueue`). The null block is
        skipped.

        Returns:
            Blocks whose ref count dropped (null block excluded).
        """
        queue = self.free_block_queue
        uncached: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        num_freed = 0
        for block in ordered_blocks:
            if block.is_null:
                continue
            num_freed += 1
            ref_cnt = block.ref_cnt - 1
            assert ref_cnt >= 0, f"{block} freed more often than held"
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if self.evicted_while_held:
                    self.evicted_while_held.discard(block.block_id)
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    cached.append(block)
        queue.append_n(cached)  # in the given order, as one append each would
        for block in reversed(uncached):
            queue.appendleft(block)
        return num_freed

    # -- caching ----------------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_idx: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes in ``group_idx``.

        Args:
            request: the request the blocks belong to (tokens, LoRA, salt, session for events).
            blocks: the request's block table in this group.
            block_hashes: the request's hashes at this group's block size.
            num_cached_blocks: blocks of the table already cached (skipped).
            num_full_blocks: full blocks of the table now (tokens // block_size).
            block_size: the group's block size, in tokens.
            group_idx: the group.

        Null blocks (positions the group does not keep) are skipped. BlockStored is emitted for
        each run of consecutive blocks whose hash became present, so every event's hashes chain
        and match its tokens; copies of present hashes emit nothing.
        """
        if num_full_blocks <= num_cached_blocks:
            return
        hash_map = self.cached_block_hash_to_block[group_idx]
        raw_map = hash_map._map
        events = self.enable_kv_cache_events
        run_start = -1
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                if run_start >= 0:
                    self._emit_stored(request, block_hashes, run_start, i, block_size, group_idx, False)
                    run_start = -1
                continue
            assert block.block_hash is None, f"{block} is cached already"
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            block.group_idx = group_idx
            if block_hash not in raw_map:  # the common case inline: the first copy of its hash
                raw_map[block_hash] = block
                newly_present = True
            else:
                newly_present = hash_map.insert(block_hash, block)
            if not events:
                continue
            if newly_present:
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._emit_stored(request, block_hashes, run_start, i, block_size, group_idx, False)
                run_start = -1
        if run_start >= 0:
            self._emit_stored(request, block_hashes, run_start, num_full_blocks, block_size, group_idx, False)

    def report_reused_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        block_size: int,
        group_idx: int,
    ) -> None:
        """Emit BlockStored marked ``reused`` for the prefix-cache hit ``blocks`` of a request.

        One event per run of consecutive non-null blocks (from block 0 with parent None when the
        group holds the whole prefix; a windowed group names only the blocks it holds, with their
        real parent). Built by the same builder as new-block events; changes no block state.
        Nothing is emitted when events are off.
        """
        if not self.enable_kv_cache_events:
            return
        run_start = -1
        for i, block in enumerate(blocks):
            if block.is_null:
                if run_start >= 0:
                    self._emit_stored(request, block_hashes, run_start, i, block_size, group_idx, True)
                    run_start = -1
            elif run_start < 0:
                run_start = i
        if run_start >= 0:
            self._emit_stored(request, block_hashes, run_start, len(blocks), block_size, group_idx, True)

    def cache_blocks_by_hash(
        self,
        group_idx: int,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        parent_block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int] | None,
        block_size: int,
    ) -> list[bool]:
        """Index held, uncached ``blocks`` under ``block_hashes`` in ``group_idx``: a tier's put,
        its bytes complete (``kvservice.core.tier``). No request is involved.

        Args:
            group_idx: the group.
            blocks: the blocks (held, uncached), one per hash.
            block_hashes: their hashes (full digests), one per block.
            parent_block_hashes: per block, its parent's hash, or None (unknown or none).
            token_ids: the blocks' token ids, ``block_size`` per block, or None (unknown).
            block_size: the group's block size, in tokens.

        A hash present already (another copy was cached meanwhile) leaves its block uncached (it
        is freed uncached by the caller) and emits nothing. BlockStored is emitted for each run of
        newly present blocks whose parents chain (``parent_block_hashes[i] == block_hashes[i-1]``),
        with the run's first parent (None when unknown) and its token ids, or none when
        ``token_ids`` is None: the documented exception to ``len(token_ids) == len(block_hashes) *
        block_size`` (docs/tier.md).

        Returns:
            Per block, whether it was cached now (False: its hash was present already).
        """
        hash_map = self.cached_block_hash_to_block[group_idx]
        cached: list[bool] = []
        run_start = -1
        events = self.enable_kv_cache_events
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            assert block.block_hash is None and block.ref_cnt > 0, f"{block} is cached or free"
            if block_hash in hash_map:
                cached.append(False)
                if run_start >= 0:
                    self._emit_stored_by_hash(
                        group_idx, block_hashes, parent_block_hashes, token_ids, run_start, i, block_size
                    )
                    run_start = -1
                continue
            block.block_hash = block_hash
            block.group_idx = group_idx
            hash_map.insert(block_hash, block)
            cached.append(True)
            if not events:
                continue
            chains = run_start >= 0 and parent_block_hashes[i] == block_hashes[i - 1] and cached[i - 1]
            if run_start >= 0 and not chains:
                self._emit_stored_by_hash(
                    group_idx, block_hashes, parent_block_hashes, token_ids, run_start, i, block_size
                )
                run_start = -1
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._emit_stored_by_hash(
                group_idx, block_hashes, parent_block_hashes, token_ids, run_start, len(blocks), block_size
            )
        return cached

    def _emit_stored_by_hash(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        parent_block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int] | None,
        start: int,
        end: int,
        block_size: int,
    ) -> None:
        """BlockStored for tier blocks ``start .. end - 1`` (no request: no LoRA, salt, session)."""
        parent = parent_block_hashes[start]
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=self._encode_hashes(block_hashes[start:end]),
                parent_block_hash=self.block_hash_encoder(parent) if parent is not None else None,
                token_ids=list(token_ids[start * block_size : end * block_size]) if token_ids is not None else [],
                block_size=block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                group_idx=group_idx,
                locality=self.locality,
                ownership=self.ownership,
            )
        )

    # -- eviction and reset -----------------------------------------------------------------

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the cached hashes of these blocks (e.g. their KV was found invalid).

        The blocks stay where they are, held or free (a free one keeps its place in the free queue,
        as vLLM 0.33's ``evict_blocks`` leaves it). Ids that are not cached are ignored. A held
        block that loses its hash is remembered in :attr:`evicted_while_held` until it is freed.

        Returns:
            Blocks whose hash was dropped.

        Raises:
            IndexError: an id outside ``0 .. num_blocks - 1``.
        """
        removed: dict[int, list[bytes]] = {}
        num_evicted = 0
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if self._uncache(block):
                removed.setdefault(block.group_idx, []).append(block.block_hash)
            block.block_hash = None
            num_evicted += 1
            if block.ref_cnt:
                self.evicted_while_held.add(block.block_id)
        if removed and self.enable_kv_cache_events:
            self._emit_removed(removed)
        return num_evicted

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, if no block is held.

        Returns:
            False (nothing changes, nothing is emitted) while any block is held; else True after
            unindexing every block and emitting one AllBlocksCleared.
        """
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for hash_map in self.cached_block_hash_to_block:
            hash_map.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- events -----------------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """Drain the event queue (oldest first)."""
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events

    def _uncache(self, block: KVCacheBlock) -> bool:
        assert block.block_hash is not None, f"{block} is not cached"
        return self.cached_block_hash_to_block[block.group_idx].pop(block.block_hash, block.block_id)

    def _encode_hashes(self, hashes: Sequence[bytes]) -> list[int | bytes]:
        """``[block_hash_encoder(h) for h in hashes]``; for the default encoder (the last 8 bytes
        as a big-endian uint64) one vectorized pass when every hash has the same length, a
        multiple of 8 bytes (always, for one algorithm at one block size)."""
        encode = self.block_hash_encoder
        n = len(hashes)
        if encode is block_hash_to_int and n > 4:
            width = len(hashes[0])
            if width % 8 == 0 and width:
                joined = b"".join(hashes)
                if len(joined) == n * width:
                    words = width // 8
                    ints: list[int | bytes] = np.frombuffer(joined, dtype=">u8")[words - 1 :: words].tolist()
                    return ints
        return [encode(h) for h in hashes]

    def _emit_removed(self, removed: dict[int, list[bytes]]) -> None:
        for group_idx, hashes in removed.items():
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=self._encode_hashes(hashes),
                    medium=self.medium,
                    group_idx=group_idx,
                    locality=self.locality,
                    ownership=self.ownership,
                )
            )

    def _emit_stored(
        self,
        request: Request,
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        block_size: int,
        group_idx: int,
        reused: bool,
    ) -> None:
        """The one builder of BlockStored: blocks ``start .. end - 1`` of ``request``."""
        encode = self.block_hash_encoder
        lora = request.lora
        extra_keys = None
        if lora is not None or request.cache_salt is not None or request.mm_features:
            per_block = [
                block_event_extra_keys(
                    i, block_size, lora=lora, cache_salt=request.cache_salt, mm_features=request.mm_features
                )
                for i in range(start, end)
            ]
            if any(k is not None for k in per_block):
                extra_keys = per_block
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=self._encode_hashes(block_hashes[start:end]),
                parent_block_hash=encode(block_hashes[start - 1]) if start > 0 else None,
                token_ids=request.all_token_ids[start * block_size : end * block_size],
                block_size=block_size,
                lora_id=lora.lora_id if lora is not None else None,
                medium=self.medium,
                lora_name=lora.lora_name if lora is not None else None,
                extra_keys=extra_keys,
                group_idx=group_idx,
                locality=self.locality,
                ownership=self.ownership,
                session_id=request.session_id,
                reused=reused,
            )
        )

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests and the server's own check).

        Free queue: every block in it has ref count 0 and is not null; its length equals
        ``num_free_blocks``; every non-null block with ref count 0 is in it. Index: every indexed
        block carries that hash and group; every block with a hash is indexed.

        Raises:
            AssertionError: naming the broken invariant.
        """
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free queue length != num_free_blocks"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        for block in self.blocks:
            if block.is_null:
                assert block.block_id not in free_ids and block.block_hash is None, "null block free or cached"
                continue
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{block}: ref count vs free queue"
        indexed = 0
        for group_idx, hash_map in enumerate(self.cached_block_hash_to_block):
            for block_hash in hash_map.hashes():
                for block in _copies(hash_map, block_hash):
                    assert block.block_hash == block_hash and block.group_idx == group_idx, f"{block} misindexed"
                    indexed += 1
        assert indexed == sum(b.block_hash is not None for b in self.blocks), "a cached block is not indexed"


def _copies(hash_map: BlockHashToBlockMap, block_hash: bytes) -> list[KVCacheBlock]:
    value = hash_map._map[block_hash]
    return [value] if type(value) is KVCacheBlock else list(value.values())
