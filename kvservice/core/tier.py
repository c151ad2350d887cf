"""Blocks named by hash alone: a shared tier's lookups, puts and leases over the block pool.

A tier (kvservice-vllm's ``KVServiceTier``, a secondary tier of vLLM 0.33's
``OffloadingConnector``) keeps chunks here by key, ``(group_idx, block hash)``, with no request.
This module is the cache side of its calls (docs/tier.md); the server (``kvservice.server.tier``)
turns protos into these calls and publishes the events. Pure Python: no gRPC, no torch, no I/O;
time is the caller's (``now``: monotonic seconds).

How it sits on the pool (``kvservice.core.block_pool``):

* A **put lease** (:meth:`TierStore.reserve`) takes one block per key to write from the head of the
  free queue (``BlockPool.get_new_blocks``: the least recently used unpinned cached blocks are
  evicted, BlockRemoved) and holds it (ref count 1) **uncached**: no lookup, lease, read or event
  sees it until :meth:`TierStore.commit` indexes it (``BlockPool.cache_blocks_by_hash``:
  BlockStored now) and drops the hold (the block is then free and cached, at the LRU tail). An
  aborted put lease frees its blocks uncached (to the head), with no event. An *expired* one holds
  them one more ttl first (**lapsed**): its putter may still be copying into them through the
  mapped memory, which the server cannot stop, and reused at once they could take that late copy
  under another key; its putter's CommitBlocks (``committed = false``) or ReleaseLease frees them
  at once, the reaper after that ttl.
* A **read lease** (:meth:`TierStore.lease`) takes a reference on each present block (``touch``):
  a referenced block is not in the free queue, so nothing can evict or reuse it until the lease
  ends (:meth:`TierStore.release`, or expiry) and drops the reference.
* A lease (read or put) has a **slot** (1 .. ``tier_max_leases``) when the server publishes
  leases in shared memory (:attr:`TierStore.lease_board`): the board holds the lease id in the
  slot while the lease is live and is cleared when it ends, *before* its blocks are unpinned,
  freed or cached, so a reader that finds its lease id in the slot after its copy knows no block
  was reused under it, and a putter that finds it after its copy knows its reservation still
  held (``lease_slot`` of LeaseBlocks' and ReserveBlocks' answers; the server's board is the
  control segment's lease table, ``kvservice.shm``).
* Present keys a put names are pinned while the put allocates, so the allocation never evicts a
  key the same call answers PRESENT; they go back to the LRU tail (a put of a present key marks
  it recently used, as vLLM's primary tier touches a stored key).

Every call checks all of its fields before it changes anything (a refused call changes nothing);
expired leases are ended first, at the start of every call (:meth:`TierStore.expire`), so a lease
is live exactly until its deadline whether or not the server's reaper ran.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from kvservice.core.block_pool import BlockPool, KVCacheBlock
from kvservice.core.errors import CapacityExceededError, InvalidArgumentError

__all__ = [
    "LeaseBoard",
    "LeaseResult",
    "LookupResult",
    "PutStatus",
    "ReleaseResult",
    "ReserveResult",
    "TierLimits",
    "TierStore",
]

MAX_TOKEN_ID = 2**31 - 1


class PutStatus(IntEnum):
    """What a put does for one key (the proto's ``BlockPutStatus``, same numbers)."""

    NOT_SENT = 0
    """PutBlocks only: the key's bytes were not sent; not stored."""
    WRITE = 1
    """A block was reserved for the key (write it), or (PutBlocks) it was written and stored."""
    PRESENT = 2
    """Cached already: nothing to write, no event."""
    IN_FLIGHT = 3
    """Another live put lease reserved it: nothing to write."""


@dataclass(frozen=True)
class TierLimits:
    """The tier calls' bounds: the server's settings ``tier_*`` (``kvservice.server.settings.TierSettings``,
    whose defaults are these), named by those settings in every refusal.

    Attributes:
        max_keys_per_call: most keys one lookup, reserve, put or lease names (``tier_max_keys_per_call``).
        default_lease_ttl_s: a lease's seconds when the call asks 0 (``tier_default_lease_ttl_s``).
        max_lease_ttl_s: the longest lease a call may ask for, seconds (``tier_max_lease_ttl_s``).
        max_leases: leases (read and put) live at once (``tier_max_leases``).

    Raises:
        ValueError: a count below 1, or not ``0 < default_lease_ttl_s <= max_lease_ttl_s < inf``.
    """

    max_keys_per_call: int = 4096
    default_lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 300.0
    max_leases: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_keys_per_call", "max_leases"):
            if getattr(self, name) < 1:
                raise ValueError(f"tier_{name} must be >= 1; got {getattr(self, name)}")
        if not 0 < self.default_lease_ttl_s <= self.max_lease_ttl_s < float("inf"):
            raise ValueError(
                "need 0 < tier_default_lease_ttl_s <= tier_max_lease_ttl_s < inf seconds; got "
                f"{self.default_lease_ttl_s} and {self.max_lease_ttl_s}"
            )


class LeaseBoard(Protocol):
    """Where live leases (read and put) are published for copiers without a round trip (the server's: the
    control segment's lease table, :class:`kvservice.shm.SharedMemoryAllocator`)."""

    def publish_lease(self, slot: int, lease_id: int) -> None:
        """Slot ``slot`` (1-based) holds ``lease_id`` from now on."""

    def clear_lease(self, slot: int) -> None:
        """Slot ``slot`` holds no lease from now on (called before the lease's blocks are unpinned)."""


@dataclass
class _Lease:
    """A live lease: a read lease's pinned blocks, or a put lease's reserved blocks and keys."""

    lease_id: int
    deadline: float
    group_idx: int
    blocks: list[KVCacheBlock]
    put: bool
    hashes: list[bytes] = field(default_factory=list)
    parents: list[bytes | None] = field(default_factory=list)
    token_ids: list[int] | None = None
    slot: int = 0
    ttl: float = 0.0


@dataclass(frozen=True)
class LookupResult:
    """Per key whether it is present (cached and readable), and the longest present prefix (blocks)."""

    present: list[bool]
    num_prefix_blocks: int


@dataclass(frozen=True)
class ReserveResult:
    """A reservation: ``reserved`` False = refused for room (nothing changed, the rest empty);
    ``slot`` the put lease's slot on the lease board (0: no board, or no lease)."""

    reserved: bool
    lease_id: int
    status: list[PutStatus]
    block_ids: list[int]
    ttl_s: float
    slot: int = 0


@dataclass(frozen=True)
class LeaseResult:
    """A read lease: per key its pinned block id (0: a miss); ``lease_id`` 0 when nothing is pinned;
    ``slot`` its slot on the lease board (0: no board, or nothing pinned)."""

    lease_id: int
    block_ids: list[int]
    num_leased: int
    ttl_s: float
    slot: int = 0


@dataclass(frozen=True)
class ReleaseResult:
    """``valid``: the lease was live until the release; ``num_blocks``: blocks unpinned or freed."""

    valid: bool
    num_blocks: int


class TierStore:
    """The tier's calls over one block pool.

    Args:
        pool: the pool (shared with the scheduler's requests: tier blocks are cached blocks).
        block_sizes: per group, tokens per block (the events' ``block_size``).
        digest_bytes: the length of a block hash (the server's hash algorithm's digest).
        limits: the bounds.

    Attributes:
        num_expired: leases ended by expiry since start.
        num_committed_blocks: blocks that became present by commits since start.
    """

    def __init__(
        self, pool: BlockPool, block_sizes: Sequence[int], *, digest_bytes: int, limits: TierLimits = TierLimits()
    ) -> None:
        self.pool = pool
        self.block_sizes = tuple(block_sizes)
        self.num_groups = len(self.block_sizes)
        self.digest_bytes = digest_bytes
        self.limits = limits
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, lease_id); stale entries skipped
        self._in_flight: dict[tuple[int, bytes], int] = {}  # (group_idx, hash) reserved -> its put lease
        self.num_expired = 0
        self.num_committed_blocks = 0
        self.on_blocks_reserved: Callable[[list[int]], None] | None = None
        """Called with the block ids a put reservation took (their bytes not written yet)."""
        self.on_blocks_stored: Callable[[list[int]], None] | None = None
        """Called with the block ids a commit cached (their bytes complete: the putter wrote them)."""
        self.on_deadline: Callable[[], None] | None = None
        """Called when a lease or a lapsed hold with a deadline is added (the server's reaper wakes
        to sleep until the earliest one: :meth:`next_deadline`)."""
        self.lease_board: LeaseBoard | None = None
        """Where leases are published (None: nowhere; leases then have no slot)."""
        # Board slots: those freed (the last freed is taken first), then 1 + the highest ever taken
        # (at most max_leases leases are live, so a slot never passes it). Memory grows with the
        # leases live at once, not with max_leases.
        self._freed_slots: list[int] = []
        self._num_slots_taken = 0
        # Lapsed put leases (expired, their blocks still held): lease id -> (free at, blocks); a heap.
        self._lapsed: dict[int, tuple[float, list[KVCacheBlock]]] = {}
        self._lapsed_heap: list[tuple[float, int]] = []

    # -- checks -------------------------------------------------------------------------------

    def _check_group(self, name: str, group_idx: int) -> None:
        if not 0 <= group_idx < self.num_groups:
            raise InvalidArgumentError(name, f"{group_idx} is out of range [0, {self.num_groups})")

    def check_block_hash(self, name: str, block_hash: bytes, *, empty_ok: bool = False) -> None:
        """The one rule for a block hash named by a caller (the tier's calls, a ReadBlocks by hash):
        exactly the server's digest, :attr:`digest_bytes` long (or empty, where ``empty_ok``).

        Raises:
            InvalidArgumentError: (INVALID_ARGUMENT) another length, naming ``name``.
        """
        if len(block_hash) != self.digest_bytes and not (empty_ok and not block_hash):
            raise InvalidArgumentError(
                name,
                f"{len(block_hash)} bytes; a block hash is the server's {self.digest_bytes}-byte digest"
                + (" (or empty)" if empty_ok else ""),
            )

    def _check_hashes(self, name: str, block_hashes: Sequence[bytes], *, distinct: bool) -> None:
        n = len(block_hashes)
        if n > self.limits.max_keys_per_call:
            raise InvalidArgumentError(name, f"{n} keys, above tier_max_keys_per_call {self.limits.max_keys_per_call}")
        for i, block_hash in enumerate(block_hashes):
            self.check_block_hash(f"{name}[{i}]", block_hash)
        if distinct and len(set(block_hashes)) != n:
            seen: set[bytes] = set()
            for i, block_hash in enumerate(block_hashes):
                if block_hash in seen:
                    raise InvalidArgumentError(f"{name}[{i}]", f"{block_hash.hex()} is named twice")
                seen.add(block_hash)

    def _ttl(self, ttl_s: float) -> float:
        limits = self.limits
        if not ttl_s == ttl_s or ttl_s < 0 or ttl_s > limits.max_lease_ttl_s:  # NaN included
            raise InvalidArgumentError(
                "ttl_s", f"{ttl_s}; must be 0 (the default) .. {limits.max_lease_ttl_s} seconds (tier_max_lease_ttl_s)"
            )
        return ttl_s or limits.default_lease_ttl_s

    def _check_room_for_lease(self) -> None:
        if len(self._leases) >= self.limits.max_leases:
            raise CapacityExceededError(
                f"leases: {len(self._leases)} live, at tier_max_leases {self.limits.max_leases}; release some first"
            )

    def _new_lease_id(self) -> int:
        while True:
            lease_id = secrets.randbits(63) or 1
            if (
                lease_id not in self._leases and lease_id not in self._lapsed
            ):  # a lapsed lease's late commit must not end it
                return lease_id

    # -- calls --------------------------------------------------------------------------------

    def lookup(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        *,
        group_idxs: Sequence[int] = (),
        touch: bool = False,
        readable: Callable[[int, KVCacheBlock], bool] | None = None,
    ) -> LookupResult:
        """Which keys are cached (LookupBlocks). No side effect unless ``touch``: then each present
        free block moves to the tail of the free queue (most recently used; no event).

        Args:
            group_idx: the group of every key (unless ``group_idxs``).
            block_hashes: the hashes.
            group_idxs: per key, its group (empty: ``group_idx`` for all).
            touch: mark present free blocks most recently used.
            readable: a callable ``(group_idx, block) -> bool`` that says whether a cached block's
                bytes are complete (the server's data plane: a block a running request may still
                write is not); None: every cached block is.

        Raises:
            InvalidArgumentError: (INVALID_ARGUMENT) a group out of range, a hash of the wrong
                length, more keys than ``tier_max_keys_per_call``, ``group_idxs`` not one per key.
        """
        n = len(block_hashes)
        self._check_hashes("block_hashes", block_hashes, distinct=False)
        if group_idxs:
            if len(group_idxs) != n:
                raise InvalidArgumentError("group_idxs", f"{len(group_idxs)} groups for {n} keys; give one per key")
            for i, g in enumerate(group_idxs):
                self._check_group(f"group_idxs[{i}]", g)
        else:
            self._check_group("group_idx", group_idx)
        index = self.pool.cached_block_hash_to_block
        present: list[bool] = []
        found: list[KVCacheBlock] = []
        for i, block_hash in enumerate(block_hashes):
            g = group_idxs[i] if group_idxs else group_idx
            block = index[g].get_one_block(block_hash)
            ok = block is not None and (readable is None or readable(g, block))
            present.append(ok)
            if ok and touch:
                assert block is not None
                found.append(block)
        prefix = present.index(False) if False in present else n
        if touch:
            queue = self.pool.free_block_queue
            for block in found:
                if block.ref_cnt == 0:
                    queue.remove(block)
                    queue.append(block)
        return LookupResult(present, prefix)

    def reserve(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        *,
        parent_block_hashes: Sequence[bytes | None] = (),
        token_ids: Sequence[int] | None = None,
        ttl_s: float = 0.0,
        now: float,
    ) -> ReserveResult:
        """Reserve a block for each key not present and not in flight (ReserveBlocks).

        Args:
            group_idx: the group of every key.
            block_hashes: the hashes, distinct.
            parent_block_hashes: per key its parent's hash or None; empty: unknown for all.
            token_ids: the keys' token ids (``block_size`` per key), or None: unknown.
            ttl_s: the put lease's seconds (0: the default).
            now: monotonic seconds.

        Returns:
            ``reserved`` False when fewer blocks are free (free or cached and unpinned, the keys
            answered PRESENT not counted) than keys to write: nothing changed. Else per key its
            status and block id (WRITE: the reserved block, else 0) and the lease (0 when no key
            is WRITE: nothing is held).

        Raises:
            InvalidArgumentError: (INVALID_ARGUMENT) a bad field, named with its bound; more keys
                to write (with the keys present, pinned while it allocates) than the whole pool has
                blocks (``num_blocks - 1``), which no wait cures.
            CapacityExceededError: (RESOURCE_EXHAUSTED) ``tier_max_leases`` leases are live.
        """
        self.expire(now)
        self._check_group("group_idx", group_idx)
        n = len(block_hashes)
        self._check_hashes("block_hashes", block_hashes, distinct=True)
        parents: list[bytes | None]
        if parent_block_hashes:
            if len(parent_block_hashes) != n:
                raise InvalidArgumentError(
                    "parent_block_hashes", f"{len(parent_block_hashes)} parents for {n} keys; give one per key or none"
                )
            for i, parent in enumerate(parent_block_hashes):
                self.check_block_hash(f"parent_block_hashes[{i}]", parent or b"", empty_ok=True)
            parents = [p or None for p in parent_block_hashes]
        else:
            parents = [None] * n
        block_size = self.block_sizes[group_idx]
        tokens: list[int] | None = None
        if token_ids is not None and len(token_ids):
            if len(token_ids) != n * block_size:
                raise InvalidArgumentError(
                    "packed_token_ids",
                    f"{len(token_ids)} token ids for {n} keys of {block_size} tokens (block_size); give "
                    f"{n * block_size} or none",
                )
            tokens = list(token_ids)
            if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID):
                bad = next(i for i, t in enumerate(tokens) if not 0 <= t <= MAX_TOKEN_ID)
                raise InvalidArgumentError("packed_token_ids", f"token id {tokens[bad]} at {bad} is outside 0..2^31-1")
        ttl = self._ttl(ttl_s)
        index = self.pool.cached_block_hash_to_block[group_idx]
        status: list[PutStatus] = []
        present: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = index.get_one_block(block_hash)
            if block is not None:
                status.append(PutStatus.PRESENT)
                present.append(block)
            elif (group_idx, block_hash) in self._in_flight:
                status.append(PutStatus.IN_FLIGHT)
            else:
                status.append(PutStatus.WRITE)
        num_write = status.count(PutStatus.WRITE)
        pool = self.pool
        capacity = pool.num_blocks - 1  # block 0 is the null block
        if num_write + len(present) > capacity:  # the present keys stay pinned while it allocates
            # Never answerable: not `reserved = false`, which says "retry later".
            keys = f"{num_write} keys to write" + (f" and {len(present)} present" if present else "")
            raise InvalidArgumentError(
                "block_hashes", f"{keys}, more than the pool's {capacity} blocks; split the call"
            )
        if num_write:
            self._check_room_for_lease()
        num_present_free = sum(1 for b in present if b.ref_cnt == 0)
        if num_write > pool.get_num_free_blocks() - num_present_free:
            return ReserveResult(False, 0, [], [], 0.0)
        # Pin the present keys while allocating (the allocation never evicts a key answered
        # PRESENT), then give them back at the LRU tail.
        pool.touch(present)
        blocks = pool.get_new_blocks(num_write) if num_write else []
        pool.free_blocks(present)
        if blocks and self.on_blocks_reserved is not None:
            self.on_blocks_reserved([b.block_id for b in blocks])
        block_ids = [0] * n
        lease_id = slot = 0
        if num_write:
            lease_id = self._new_lease_id()
            writes = [i for i, s in enumerate(status) if s is PutStatus.WRITE]
            for i, block in zip(writes, blocks):
                block_ids[i] = block.block_id
                self._in_flight[(group_idx, block_hashes[i])] = lease_id
            lease = _Lease(
                lease_id,
                now + ttl,
                group_idx,
                blocks,
                True,
                [block_hashes[i] for i in writes],
                [parents[i] for i in writes],
                [t for i in writes for t in tokens[i * block_size : (i + 1) * block_size]]
                if tokens is not None
                else None,
                ttl=ttl,
            )
            self._add(lease)
            slot = lease.slot
        return ReserveResult(True, lease_id, status, block_ids, ttl if lease_id else 0.0, slot)

    def commit(self, lease_id: int, *, now: float, written: Sequence[bool] | None = None) -> tuple[bool, int]:
        """Make a put lease's blocks cached (CommitBlocks): BlockStored for the keys that became
        present (queued on the pool; the caller publishes), the blocks freed to the LRU tail.
        ``written`` (PutBlocks): per reserved block, in reservation order, whether its bytes were
        written; the others are freed uncached, no event (None: all were).

        Returns:
            (committed, blocks stored): (False, 0) for a lease unknown, expired, ended or not a
            put lease (nothing changes). A key another caller cached meanwhile counts as stored
            (their copy is kept, ours freed uncached, no second event).
        """
        self.expire(now)
        lease = self._leases.get(lease_id)
        if lease is None or not lease.put:
            self._free_lapsed(lease_id)  # its putter is done with it
            return False, 0
        self._end(lease)
        if written is not None and not all(written):
            size = self.block_sizes[lease.group_idx]
            keep = [i for i, w in enumerate(written) if w]
            self.pool.free_blocks([b for b, w in zip(lease.blocks, written) if not w])
            tokens = lease.token_ids
            lease.blocks = [lease.blocks[i] for i in keep]
            lease.hashes = [lease.hashes[i] for i in keep]
            lease.parents = [lease.parents[i] for i in keep]
            if tokens is not None:
                lease.token_ids = [t for i in keep for t in tokens[i * size : (i + 1) * size]]
        cached = self.pool.cache_blocks_by_hash(
            lease.group_idx,
            lease.blocks,
            lease.hashes,
            lease.parents,
            lease.token_ids,
            self.block_sizes[lease.group_idx],
        )
        if self.on_blocks_stored is not None:
            self.on_blocks_stored([b.block_id for b, c in zip(lease.blocks, cached) if c])
        # Cached blocks to the tail in key order (a chain's root is evicted first); a copy of a hash
        # that was present already is freed uncached, to the head.
        self.pool.free_blocks(lease.blocks)
        self.num_committed_blocks += sum(cached)
        return True, len(lease.blocks)

    def lease(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        *,
        ttl_s: float = 0.0,
        now: float,
        readable: Callable[[int, KVCacheBlock], bool] | None = None,
        release_lease_ids: Sequence[int] = (),
    ) -> LeaseResult:
        """Pin the cached blocks of these keys (LeaseBlocks).

        Args:
            readable: as :meth:`lookup`'s: a cached block it answers False for is a miss (not
                pinned), as LookupBlocks answers it absent; None: every cached block is readable.
            release_lease_ids: leases the caller is done with, each ended first as :meth:`release`
                ends it (after every field is checked: a bad one ends nothing), even when the
                new lease is then refused for room.

        Returns:
            Per key its block id (0: not cached now, or not readable); ``lease_id`` 0 when none
            is (nothing held).

        Raises:
            InvalidArgumentError: (INVALID_ARGUMENT) a bad field, named with its bound.
            CapacityExceededError: (RESOURCE_EXHAUSTED) ``tier_max_leases`` leases are live.
        """
        self.expire(now)
        self._check_group("group_idx", group_idx)
        self._check_hashes("block_hashes", block_hashes, distinct=False)
        ttl = self._ttl(ttl_s)
        if len(release_lease_ids) > self.limits.max_leases:
            raise InvalidArgumentError(
                "release_lease_ids",
                f"{len(release_lease_ids)} leases, above tier_max_leases {self.limits.max_leases}",
            )
        for lease_id in release_lease_ids:
            self.release(lease_id, now=now)
        index = self.pool.cached_block_hash_to_block[group_idx]
        blocks: list[KVCacheBlock] = []
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block = index.get_one_block(block_hash)
            if block is None or (readable is not None and not readable(group_idx, block)):
                block_ids.append(0)
            else:
                blocks.append(block)
                block_ids.append(block.block_id)
        if not blocks:
            return LeaseResult(0, block_ids, 0, 0.0)
        self._check_room_for_lease()
        self.pool.touch(blocks)
        lease = _Lease(self._new_lease_id(), now + ttl, group_idx, blocks, False)
        self._add(lease)
        return LeaseResult(lease.lease_id, block_ids, len(blocks), ttl, lease.slot)

    def release(self, lease_id: int, *, now: float) -> ReleaseResult:
        """End a lease (ReleaseLease): a read lease's blocks unpinned (to the LRU tail when free);
        a put lease's blocks freed uncached (to the head), no event.

        Returns:
            ``valid`` True when the lease was live until now; False (nothing changes) for one
            unknown, expired or ended before.
        """
        self.expire(now)
        lease = self._leases.get(lease_id)
        if lease is None:
            return ReleaseResult(False, self._free_lapsed(lease_id))
        self._end(lease)
        self.pool.free_blocks(lease.blocks)
        return ReleaseResult(True, len(lease.blocks))

    def live(self, lease_id: int, *, now: float) -> bool:
        """Whether a lease is live now (leases past their deadline are ended first, as every call
        ends them): a putter writing blocks itself checks it before each write, with nothing
        awaited in between, so it never writes a block its lease gave up."""
        self.expire(now)
        return lease_id in self._leases

    def expire(self, now: float) -> int:
        """End every lease whose deadline is at or before ``now`` (no event): a read lease's blocks
        unpinned, a put lease's held one more ttl (lapsed: see the module docstring); then free
        the blocks of lapsed leases whose time is up.

        Returns:
            Leases ended.
        """
        heap = self._deadlines
        ended = 0
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None or lease.deadline != deadline:
                continue  # ended before
            self._end(lease)
            if lease.put:
                free_at = deadline + lease.ttl
                self._lapsed[lease_id] = (free_at, lease.blocks)
                heapq.heappush(self._lapsed_heap, (free_at, lease_id))
                if self.on_deadline is not None:
                    self.on_deadline()
            else:
                self.pool.free_blocks(lease.blocks)
            ended += 1
        lapsed = self._lapsed_heap
        while lapsed and lapsed[0][0] <= now:
            self._free_lapsed(heapq.heappop(lapsed)[1])
        self.num_expired += ended
        return ended

    def _free_lapsed(self, lease_id: int) -> int:
        """Free a lapsed put lease's blocks (uncached, to the head of the free queue): how many."""
        held = self._lapsed.pop(lease_id, None)
        if held is None:
            return 0
        self.pool.free_blocks(held[1])
        return len(held[1])

    def next_deadline(self) -> float | None:
        """The earliest live lease's deadline or lapsed lease's end (monotonic seconds), or None."""
        heap = self._deadlines
        while heap and heap[0][1] not in self._leases:
            heapq.heappop(heap)
        lapsed = self._lapsed_heap
        while lapsed and lapsed[0][1] not in self._lapsed:
            heapq.heappop(lapsed)
        times = [h[0][0] for h in (heap, lapsed) if h]
        return min(times) if times else None

    def drop_all(self) -> None:
        """Forget every lease, freeing its blocks, lapsed ones' too (the server stops; no event)."""
        for lease in list(self._leases.values()):
            self._end(lease)
            self.pool.free_blocks(lease.blocks)
        for lease_id in list(self._lapsed):
            self._free_lapsed(lease_id)

    # -- state ---------------------------------------------------------------------------------

    @property
    def num_leases(self) -> int:
        """Leases live now (read and put)."""
        return len(self._leases)

    @property
    def num_leased_blocks(self) -> int:
        """Blocks held by leases now (pinned by read leases, reserved by put leases, still held for
        lapsed put leases)."""
        return sum(len(lease.blocks) for lease in self._leases.values()) + sum(
            len(blocks) for _free_at, blocks in self._lapsed.values()
        )

    def held_block_ids(self) -> list[int]:
        """Every block id a lease holds (one per hold, lapsed put leases' included), for the
        engine's invariant check."""
        held = [block.block_id for lease in self._leases.values() for block in lease.blocks]
        return held + [block.block_id for _free_at, blocks in self._lapsed.values() for block in blocks]

    def _add(self, lease: _Lease) -> None:
        """Make a lease live (and publish it on the board, when there is one)."""
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        if self.on_deadline is not None:
            self.on_deadline()
        if self.lease_board is not None:
            if self._freed_slots:
                lease.slot = self._freed_slots.pop()
            else:
                self._num_slots_taken += 1
                lease.slot = self._num_slots_taken
            self.lease_board.publish_lease(lease.slot, lease.lease_id)

    def _end(self, lease: _Lease) -> None:
        """Forget a lease (its caller then frees or caches its blocks: after the board's slot is
        cleared, so a reader that still finds its lease id there knows the blocks were pinned)."""
        del self._leases[lease.lease_id]
        if lease.slot:
            assert self.lease_board is not None, "a lease with a slot and no board"
            self.lease_board.clear_lease(lease.slot)
            self._freed_slots.append(lease.slot)
            lease.slot = 0
        if lease.put:
            for block_hash in lease.hashes:
                if self._in_flight.get((lease.group_idx, block_hash)) == lease.lease_id:
                    del self._in_flight[(lease.group_idx, block_hash)]
