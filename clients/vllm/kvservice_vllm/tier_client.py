"""Blocks named by hash on a kvservice server, moved to and from a row-addressed buffer: the data
side of :class:`kvservice_vllm.tier.KVServiceTier` (it imports no vLLM, so the tier's transfers are
tested and measured on their own).

A *row* is one offload chunk of vLLM's CPU primary tier: ``rows[chunk_id]`` is a contiguous run of
``chunk_bytes`` bytes (``primary_kv_view.strides[0]``). A *key* is ``(group_idx, block_hash)``:
vLLM's ``OffloadKey`` is the same pair (its block hash, then the group index as 4 big-endian
bytes). The server's block for a key holds exactly one row's bytes: a server started with the
opaque layout ``--kv-cache-layout opaque:BYTES`` where ``BYTES == chunk_bytes`` (checked at
:meth:`TierClient.connect`).

Two transports, chosen at connect (``transport``):

* ``shm`` (same host): the server's KV memory is mapped (``AttachKVCache``,
  :mod:`kvservice_client.torch_view`); a store reserves blocks (``ReserveBlocks``), copies each
  row into its block and commits them (``CommitBlocks``: ``BlockStored`` goes out then, never
  before); a load pins the blocks under a read lease (``LeaseBlocks``), copies them out and ends
  the lease (``ReleaseLease``). After its copy each reads its lease's slot in the mapped control
  segment (``KVCacheView.lease_live``): the server clears a slot before it unpins, frees or
  caches the lease's blocks, so finding the lease id there says the lease held through the copy
  (no block reused under a load; a store's reservation still there to commit). The call then
  returns without waiting for an answer: a store's ``CommitBlocks`` goes on a background thread,
  a load's release with the next ``LeaseBlocks`` (``release_lease_ids``) or, when none follows
  within :data:`RELEASE_GRACE_S`, with the others pending in one call from the releaser thread:
  one round trip per call of at most ``max_keys_per_call`` keys, the bytes by ``memcpy``. A commit is sent in the background only while more than half of the put lease's
  time is left (:func:`_commit_margin_s`; else its answer is waited for), so it arrives long
  before the lease could expire; one that still does not commit (the server restarted in
  between) is logged and counted (``num_commits_lost``): its keys, reported stored, are misses,
  as after an eviction, and never published. A server without lease slots: both answers are
  waited for (two round trips; ``ReleaseLease``'s ``valid`` and ``committed`` say it).
  Calls from several threads overlap, but a direction's copies run one at a time (a lock per
  direction): a call's round trips proceed while another call copies, and two copies never
  split the memory bandwidth between them (two at once moved 1.2-1.4x the bytes of one here,
  not 2x, so each would take longer). ``KVServiceTier`` runs two job threads per direction.
* ``grpc`` (another host, or no shared memory): a store is one ``PutBlocks`` stream, a load one
  ``ReadBlocks`` stream by hash (a block evicted while it streams ends with ``evicted``, never
  another block's bytes).

``auto`` (the default) takes ``shm`` when the memory maps here and ``grpc`` otherwise.

A server restart is seen, never trusted through: the mapped memory's control segment says the old
server stopped (the view is re-attached before the next copy), and a lease of the old server is
unknown to the new one (its copy is reported failed). Nothing here retries: a failed call fails its
keys, and the caller (the tier) reports them as vLLM's tier API says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kvservice_client import KVCacheClient, KVServiceError, StatusCode
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.data import read_blocks_into
from kvservice_client.tls import TLSConfig
from kvservice_client.torch_view import KVCacheView, KVCacheViewClosedError, attach

__all__ = [
    "DIGEST_BYTES",
    "LoadResult",
    "StoreResult",
    "TierClient",
    "TierLayoutError",
    "rows_of",
]

logger = logging.getLogger(__name__)

DIGEST_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
"""Bytes of a full block-hash digest per hash algorithm (vLLM 0.33's ``--prefix-caching-hash-algo``
names; the server's ``GetKVCacheGroupMetadata.hash_algorithm``)."""

TRANSPORTS = ("auto", "shm", "grpc")


class TierLayoutError(ValueError):
    """The server's layout cannot hold vLLM's offload chunks as they are (the message names the
    field, both values and the ``kvservice serve`` flag that fits)."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What one :meth:`TierClient.store` did.

    Attributes:
        stored: per key, in order: the key is in the server now, or will be once another
            instance's put of it commits (``PRESENT``, ``IN_FLIGHT`` or written and committed).
        written: per key: its bytes were copied to the server by this call.
        num_bytes: bytes copied to the server.
    """

    stored: list[bool]
    written: list[bool]
    num_bytes: int


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one :meth:`TierClient.load` did.

    Attributes:
        loaded: per key, in order: its row now holds the server's bytes of the key (False: a miss,
            an eviction before the read, a lost lease or a failed call; the row may then hold
            anything and must not be used).
        num_bytes: bytes copied into rows.
    """

    loaded: list[bool]
    num_bytes: int


def rows_of(primary_kv_view: memoryview) -> torch.Tensor:
    """vLLM's primary tier buffer as a ``(num_chunks, chunk_bytes)`` uint8 tensor over the same memory
    (no copy): ``primary_kv_view`` is the memoryview a secondary tier is built with (shape
    ``(num_chunks, row_stride_bytes)``, ``strides[0]`` bytes per chunk)."""
    assert primary_kv_view.strides is not None, "primary_kv_view.strides cannot be None"
    array = np.asarray(primary_kv_view)
    if array.ndim != 2:
        array = array.reshape(-1, primary_kv_view.strides[0])
    tensor = torch.from_numpy(array)
    if tensor.dtype != torch.uint8:
        tensor = tensor.view(torch.uint8)
    return tensor


RELEASE_GRACE_S = 0.005
"""How long a read lease done with waits for the next LeaseBlocks to carry its release before the
releaser thread sends it (a load that follows within it saves a round trip)."""

_Request = TypeVar("_Request")
_Answer = TypeVar("_Answer")


def _commit_margin_s(ttl_s: float) -> float:
    """Time a put lease must have left for its commit to go in the background: half its ttl."""
    return ttl_s / 2


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


class TierClient:
    """A kvservice server as a store of offload chunks named by ``(group_idx, block_hash)``.

    Args:
        target: ``HOST:PORT`` or ``unix:PATH``.
        chunk_bytes: bytes of one row (vLLM's ``primary_kv_view.strides[0]``).
        group_idxs: the KV cache groups keys come from (vLLM's ``KVCacheConfig`` group indices).
        token: a ``tier`` token (role ``tier``), when the server checks tokens.
        tls: TLS to the server (``True``: the system's roots; a :class:`TLSConfig`).
        transport: ``auto``, ``shm`` or ``grpc`` (see the module docstring).
        lease_ttl_s: seconds a put or read lease lasts (0: the server's default); a copy slower
            than this fails, never returns wrong bytes.
        timeout_s: deadline of one RPC, in seconds.

    Methods are blocking and thread-safe (the gRPC channel is shared; each call holds its own
    leases); over shared memory the copies of one direction take turns (see the module
    docstring).
    """

    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int,
        group_idxs: Sequence[int] = (0,),
        token: str | None = None,
        tls: bool | TLSConfig = False,
        transport: str = "auto",
        lease_ttl_s: float = 0.0,
        timeout_s: float = 30.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        if lease_ttl_s < 0:
            raise ValueError(f"lease_ttl_s must be >= 0; got {lease_ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.group_idxs = tuple(group_idxs)
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        self._requested_transport = transport
        self.client = KVCacheClient(target, token=token, tls=tls, timeout=timeout_s)
        self._view_lock = threading.Lock()
        self._view: KVCacheView | None = None
        self.transport = "grpc" if transport == "grpc" else "shm"
        self.max_keys_per_call = 1
        self.max_leases = 1  # the server's tier_max_leases: most releases one LeaseBlocks carries
        self.max_data_chunk_bytes = 1 << 20
        self.digest_bytes = 32
        self.hash_algorithm = ""
        self.epoch = ""
        self._warned_digest = False
        self._store_copy = threading.Lock()
        self._load_copy = threading.Lock()
        # ReleaseLease and CommitBlocks of copies checked by their lease's slot, in order.
        self._background: ThreadPoolExecutor | None = None
        self._background_lock = threading.Lock()
        self._closed = False
        # Read leases whose copies their slots vouched for, not yet released: the next LeaseBlocks
        # carries them (release_lease_ids), or the releaser thread sends them RELEASE_GRACE_S later.
        self._pending_releases: list[int] = []
        self._releases = threading.Condition()
        self._releaser: threading.Thread | None = None
        self._sending_releases = threading.Lock()  # held while the releaser sends: flush() waits for it
        self._num_carrying = 0  # LeaseBlocks calls in flight carrying releases: close() waits for them
        self._blocks_of: dict[tuple[int, int], _GroupBlocks] = {}  # (id(view), group_idx) -> its blocks
        self.num_commits_lost = 0
        """Commits sent in the background that did not commit (their keys were reported stored)."""

    # -- connect and check ---------------------------------------------------------------------

    def connect(self) -> None:
        """Read the server's layout, check it holds this tier's chunks, and map its memory (``shm``).

        Raises:
            TierLayoutError: the server's blocks are not ``chunk_bytes`` long, a group is missing,
                or the server has no memory (``--device meta``).
            KVServiceError: the server cannot be reached (UNAVAILABLE), the token is missing or
                refused, or its role may not make the tier's calls (UNAUTHENTICATED,
                PERMISSION_DENIED: the message says to give a ``tier`` token), or
                ``transport="shm"`` and the memory cannot be attached.
            OSError: ``transport="shm"`` and the memory cannot be mapped here (another host or user).
        """
        try:
            metadata = self.client.get_kv_cache_group_metadata()
            # A call only the tier's role may make, of nothing (lease 0: no lease, no side effect):
            # a token of another role is refused here, not at every store and load once vLLM runs.
            self.client.release_lease(0)
        except KVServiceError as exc:
            if exc.code not in (StatusCode.UNAUTHENTICATED, StatusCode.PERMISSION_DENIED):
                raise
            raise KVServiceError(
                exc.code,
                f"{exc.message}; the kvservice tier needs a token of role 'tier' from the server's token file "
                "(the 'token' key of its secondary_tiers entry)",
            ) from exc
        check_tier_layout(metadata, self.chunk_bytes, self.group_idxs)
        limits = metadata.tier_limits
        self.max_keys_per_call = max(1, limits.max_keys_per_call or 1)
        self.max_leases = max(1, limits.max_leases or 1)
        self.max_data_chunk_bytes = metadata.max_data_chunk_bytes or self.max_data_chunk_bytes
        self.hash_algorithm = metadata.hash_algorithm
        self.digest_bytes = DIGEST_BYTES.get(metadata.hash_algorithm, 32)
        if self.lease_ttl_s and limits.max_lease_ttl_s and self.lease_ttl_s > limits.max_lease_ttl_s:
            raise TierLayoutError(
                f"lease_ttl_s {self.lease_ttl_s} is above the server's max_lease_ttl_s {limits.max_lease_ttl_s}"
            )
        if self._requested_transport == "grpc":
            self.transport = "grpc"
            return
        try:
            self._attach()
            self.transport = "shm"
        except (KVServiceError, OSError, ValueError) as exc:
            if self._requested_transport == "shm":
                raise
            logger.info("kvservice tier: the server's memory does not map here (%s); moving bytes over gRPC", exc)
            self.transport = "grpc"

    def _attach(self) -> KVCacheView:
        with self._view_lock:
            if self._view is not None and not self._view.closed:
                return self._view
            old, self._view = self._view, None
            self._blocks_of.clear()  # the old view's arrays: let its mapping go
            if old is not None:
                old.close()
            view = attach(self.client)
            if view.device != "cpu":
                view.close()
                raise ValueError(f"the server's memory is on {view.device}; the tier copies through CPU memory")
            self._view = view
            self.epoch = view.epoch
            return view

    def _current_view(self) -> KVCacheView:
        """The mapped memory of the server that answers now (re-attached after a restart).

        Raises:
            KVServiceError, OSError, ValueError: it cannot be attached (the server is down).
        """
        view = self._view
        if view is None or view.closed:
            view = self._attach()
        return view

    def _group_blocks(self, view: KVCacheView, group_idx: int) -> _GroupBlocks:
        """The group's blocks in ``view`` (built once per view and group), after checking that its
        server still lives.

        Raises:
            KVCacheViewClosedError: the server stopped or restarted.
        """
        view.check()
        blocks = self._blocks_of.get((id(view), group_idx))
        if blocks is None or blocks.view is not view:
            blocks = self._blocks_of[(id(view), group_idx)] = _GroupBlocks(view, group_idx)
        return blocks

    def _hash_fits(self, block_hash: bytes) -> bool:
        """Whether a hash is the server's digest length; logs the first that is not (vLLM hashing
        with another algorithm than the server's: every such key is a miss, never an error)."""
        if len(block_hash) == self.digest_bytes:
            return True
        if not self._warned_digest:
            self._warned_digest = True
            logger.error(
                "kvservice tier: vLLM's block hashes are %d bytes, the server's (%s) %d: start the server with "
                "--hash-algorithm set to the engine's --prefix-caching-hash-algo; every key is a miss until then",
                len(block_hash),
                self.hash_algorithm,
                self.digest_bytes,
            )
        return False

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[tuple[int, bytes]], *, touch: bool = False) -> list[bool]:
        """Which keys the server holds (readable), per key, in order: one ``LookupBlocks`` per
        ``max_keys_per_call`` keys, no side effect (``touch``: present free blocks become the most
        recently used).

        Raises:
            KVServiceError: the server cannot be reached or refused the call (a bad hash length:
                INVALID_ARGUMENT).
        """
        present = [False] * len(keys)
        sendable = [i for i, (_g, h) in enumerate(keys) if self._hash_fits(h)]
        for start, end in _chunks(len(sendable), self.max_keys_per_call):
            part = [keys[i] for i in sendable[start:end]]
            answer = self.client.lookup_blocks(
                pb.LookupBlocksRequest(
                    block_hashes=[h for _g, h in part], group_idxs=[g for g, _h in part], touch=touch
                )
            )
            for i, hit in zip(sendable[start:end], answer.present):
                present[i] = hit
        return present

    # -- stores --------------------------------------------------------------------------------

    def store(
        self,
        group_idx: int,
        block_hashes: Sequence[bytes],
        parent_block_hashes: Sequence[bytes],
        rows: torch.Tensor,
        chunk_ids: Sequence[int],
    ) -> StoreResult:
        """Put ``rows[chunk_ids[i]]`` under ``(group_idx, block_hashes[i])`` for every i (a key the
        server holds already, or another put has reserved, is not copied again).

        Args:
            group_idx: the keys' group.
            block_hashes: full digests, one per chunk.
            parent_block_hashes: per key, the hash of the block before it (published on
                ``BlockStored``), ``b""`` when unknown; or empty.
            rows: the ``(num_chunks, chunk_bytes)`` uint8 buffer (:func:`rows_of`).
            chunk_ids: per key, its row.

        A call that fails part way reports its keys not stored; nothing half-written is ever
        published (a put lease not committed frees its blocks).
        """
        stored: list[bool] = []
        written: list[bool] = []
        num_bytes = 0
        if not all(self._hash_fits(h) for h in block_hashes):
            return StoreResult([False] * len(block_hashes), [False] * len(block_hashes), 0)
        for start, end in _chunks(len(block_hashes), self.max_keys_per_call):
            header = pb.ReserveBlocksRequest(
                group_idx=group_idx,
                block_hashes=block_hashes[start:end],
                parent_block_hashes=parent_block_hashes[start:end] if parent_block_hashes else (),
                ttl_s=self.lease_ttl_s,
            )
            ids = chunk_ids[start:end]
            try:
                if self.transport == "shm":
                    part_stored, part_written = self._store_shm(header, rows, ids)
                else:
                    part_stored, part_written = self._store_grpc(header, rows, ids)
            except (KVServiceError, KVCacheViewClosedError, OSError, ValueError) as exc:
                logger.warning("kvservice tier: a store of %d blocks failed: %s", end - start, exc)
                part_stored = part_written = [False] * (end - start)
            stored.extend(part_stored)
            written.extend(part_written)
            num_bytes += sum(part_written) * self.chunk_bytes
        return StoreResult(stored, written, num_bytes)

    def _store_shm(
        self, header: pb.ReserveBlocksRequest, rows: torch.Tensor, chunk_ids: Sequence[int]
    ) -> tuple[list[bool], list[bool]]:
        n = len(chunk_ids)
        # The memory copied into is taken before the reservation, and only it: a view taken after
        # could be a restarted server's, whose blocks of the same ids belong to other keys.
        view = self._current_view()
        sent = time.monotonic()
        answer = self._with_room(self.client.reserve_blocks, header)
        if not answer.reserved:
            return [False] * n, [False] * n
        statuses = list(answer.status)
        to_write = [i for i, s in enumerate(statuses) if s == pb.BLOCK_PUT_STATUS_WRITE]
        if to_write:
            try:
                with self._store_copy:
                    blocks = self._group_blocks(view, header.group_idx)
                    source = rows.numpy()
                    for i in to_write:
                        _copy_into_block(blocks, answer.block_ids[i], source[chunk_ids[i]])
            except BaseException:
                self._release(answer.lease_id)
                raise
            if answer.lease_slot:
                # The slot, read in the memory copied into, says whether this lease held through
                # the copy there (another server's table never holds its id).
                if not view.lease_live(answer.lease_slot, answer.lease_id):
                    self._in_background(self._release, answer.lease_id)
                    committed = False
                # The lease expires at the earliest ttl_s after the request left (the server's
                # clock started later): with more than half of that left, a commit sent now is in time.
                elif time.monotonic() + _commit_margin_s(answer.ttl_s) < sent + answer.ttl_s:
                    self._in_background(self._commit, answer.lease_id)
                    committed = True
                else:
                    committed = self.client.commit_blocks(answer.lease_id).committed
            elif view.closed:  # no slots to read: the server copied into is gone, nothing to commit
                self._release(answer.lease_id)
                committed = False
            else:
                committed = self.client.commit_blocks(answer.lease_id).committed
        else:
            committed = True
            if answer.lease_id:
                self._release(answer.lease_id)
        stored = [
            s in (pb.BLOCK_PUT_STATUS_PRESENT, pb.BLOCK_PUT_STATUS_IN_FLIGHT)
            or (s == pb.BLOCK_PUT_STATUS_WRITE and committed)
            for s in statuses
        ]
        written = [s == pb.BLOCK_PUT_STATUS_WRITE and committed for s in statuses]
        return stored, written

    def _store_grpc(
        self, header: pb.ReserveBlocksRequest, rows: torch.Tensor, chunk_ids: Sequence[int]
    ) -> tuple[list[bool], list[bool]]:
        answer = self.client.put_blocks(
            header.group_idx,
            [(h, memoryview(rows[c].numpy())) for h, c in zip(header.block_hashes, chunk_ids)],
            parent_block_hashes=list(header.parent_block_hashes) or None,
            chunk_bytes=self.max_data_chunk_bytes,
            bytes_per_block=self.chunk_bytes,  # checked at connect: no layout call per stream
        )
        n = len(chunk_ids)
        if not answer.reserved:
            return [False] * n, [False] * n
        if answer.lease_expired:
            logger.warning(
                "kvservice tier: a PutBlocks of %d blocks outlived its put lease (lease_ttl_s %s): nothing stored",
                n,
                self.lease_ttl_s,
            )
        statuses = list(answer.status)
        stored = [
            s in (pb.BLOCK_PUT_STATUS_WRITE, pb.BLOCK_PUT_STATUS_PRESENT, pb.BLOCK_PUT_STATUS_IN_FLIGHT)
            for s in statuses
        ]
        written = [s == pb.BLOCK_PUT_STATUS_WRITE for s in statuses]
        return stored, written

    # -- loads ---------------------------------------------------------------------------------

    def load(
        self, group_idx: int, block_hashes: Sequence[bytes], rows: torch.Tensor, chunk_ids: Sequence[int]
    ) -> LoadResult:
        """Copy the server's bytes of ``(group_idx, block_hashes[i])`` into ``rows[chunk_ids[i]]``.

        A key the server does not hold, one evicted before its copy, a copy whose lease was lost
        (expired, or the server restarted) and a failed call all report ``loaded[i] = False``: its row
        is never reported holding bytes it might not hold.
        """
        loaded: list[bool] = []
        num_bytes = 0
        if not all(self._hash_fits(h) for h in block_hashes):
            return LoadResult([False] * len(block_hashes), 0)
        for start, end in _chunks(len(block_hashes), self.max_keys_per_call):
            hashes = block_hashes[start:end]
            ids = chunk_ids[start:end]
            try:
                if self.transport == "shm":
                    part = self._load_shm(group_idx, hashes, rows, ids)
                else:
                    part = self._load_grpc(group_idx, hashes, rows, ids)
            except (KVServiceError, KVCacheViewClosedError, OSError, ValueError) as exc:
                logger.warning("kvservice tier: a load of %d blocks failed: %s", end - start, exc)
                part = [False] * (end - start)
            loaded.extend(part)
            num_bytes += sum(part) * self.chunk_bytes
        return LoadResult(loaded, num_bytes)

    def _load_shm(
        self, group_idx: int, block_hashes: Sequence[bytes], rows: torch.Tensor, chunk_ids: Sequence[int]
    ) -> list[bool]:
        view = self._current_view()  # taken before the lease, and only it copied from (as a store's)
        releases = self._take_pending_releases(self.max_leases, carry=True)  # done with: ended first
        try:
            answer = self._with_room(
                self.client.lease_blocks,
                pb.LeaseBlocksRequest(
                    group_idx=group_idx,
                    block_hashes=block_hashes,
                    ttl_s=self.lease_ttl_s,
                    release_lease_ids=releases,
                ),
            )
        except BaseException:
            self._requeue_releases(releases)  # maybe not ended: the releaser sends them (again)
            raise
        finally:
            self._carried(releases)
        block_ids = list(answer.block_ids)
        if not answer.lease_id:
            return [False] * len(chunk_ids)
        slot_valid: bool | None = None  # what the lease's slot said after the copy (None: not read)
        try:
            with self._load_copy:
                blocks = self._group_blocks(view, group_idx)
                target = rows.numpy()
                for i, block_id in enumerate(block_ids):
                    if block_id:
                        _copy_from_block(blocks, block_id, target[chunk_ids[i]])
            if answer.lease_slot:
                slot_valid = view.lease_live(answer.lease_slot, answer.lease_id)
        finally:
            if slot_valid is None:
                # No slot to read: the release's answer says the lease held, and the memory copied
                # from must still be that server's (a restart before the lease made it another's).
                valid = self._release(answer.lease_id) and not view.closed
            else:
                valid = slot_valid
                self._release_soon(answer.lease_id)
        return [bool(block_id) and valid for block_id in block_ids]

    def _with_room(self, call: Callable[[_Request], _Answer], request: _Request) -> _Answer:
        """``call(request)``; once more after :meth:`flush` when the server is at ``tier_max_leases``
        and this client has commits or releases queued (its own leases, still live, hold that
        room).

        Raises:
            KVServiceError: as ``call``.
        """
        try:
            return call(request)
        except KVServiceError as exc:
            # Anything of this client's still queued or being sent (a commit, a load's release)?
            if exc.code != StatusCode.RESOURCE_EXHAUSTED or (self._background is None and self._releaser is None):
                raise
        self.flush()
        return call(request)

    def _load_grpc(
        self, group_idx: int, block_hashes: Sequence[bytes], rows: torch.Tensor, chunk_ids: Sequence[int]
    ) -> list[bool]:
        target = rows.numpy()
        try:
            # Straight into the rows (one copy each, checksummed); missing_ok: a key evicted since
            # its lookup is one missing block, the others still load.
            return read_blocks_into(
                self.client,
                [(group_idx, h) for h in block_hashes],
                [target[c] for c in chunk_ids],
                missing_ok=True,
            )
        except KVServiceError as exc:
            # A server from before missing_ok fails the whole call on a key it does not hold.
            if exc.code not in (StatusCode.NOT_FOUND, StatusCode.FAILED_PRECONDITION):
                raise
        return [False] * len(chunk_ids)

    def _in_background(self, call: Callable[[int], object], lease_id: int) -> None:
        """``call(lease_id)`` on the background thread, in submission order (its answer is not
        needed: the copy was checked by the lease's slot); after :meth:`close`, on this thread
        (the channel is closed: it fails, and is logged and counted as any failure)."""
        with self._background_lock:
            if not self._closed:
                if self._background is None:
                    self._background = ThreadPoolExecutor(1, thread_name_prefix="kvservice_tier_background")
                self._background.submit(call, lease_id)
                return
        call(lease_id)

    def _release_soon(self, lease_id: int) -> None:
        """End a read lease without waiting: the next LeaseBlocks carries it, or the releaser
        thread sends it with the others pending :data:`RELEASE_GRACE_S` later (one call); after
        :meth:`close`, at once on this thread."""
        with self._releases:
            if not self._closed:
                self._pending_releases.append(lease_id)
                if self._releaser is None:
                    self._releaser = threading.Thread(
                        target=self._release_loop, name="kvservice_tier_releaser", daemon=True
                    )
                    self._releaser.start()
                self._releases.notify_all()
                return
        self._release_many([lease_id])

    def _take_pending_releases(self, limit: int | None = None, *, carry: bool = False) -> list[int]:
        """The pending releases (at most ``limit``, the oldest), no longer pending; ``carry``: a
        LeaseBlocks carries them (:meth:`close` waits for it: :meth:`_carried`)."""
        with self._releases:
            taken = self._pending_releases[:limit]
            del self._pending_releases[: len(taken)]
            if carry and taken:
                self._num_carrying += 1
            return taken

    def _carried(self, lease_ids: list[int]) -> None:
        """A LeaseBlocks that carried ``lease_ids`` (taken with ``carry``) has answered or failed."""
        if lease_ids:
            with self._releases:
                self._num_carrying -= 1
                self._releases.notify_all()

    def _requeue_releases(self, lease_ids: list[int]) -> None:
        if lease_ids:
            with self._releases:
                self._pending_releases.extend(lease_ids)
                self._releases.notify_all()

    def _release_loop(self) -> None:
        """The releaser thread: what is pending and was not taken by a LeaseBlocks within
        :data:`RELEASE_GRACE_S` goes as one call; until :meth:`close`."""
        while True:
            with self._releases:
                while not self._pending_releases and not self._closed:
                    self._releases.wait()
                since = time.monotonic()
                while (
                    self._pending_releases
                    and not self._closed
                    and (left := since + RELEASE_GRACE_S - time.monotonic()) > 0
                ):
                    self._releases.wait(left)  # a LeaseBlocks may take them meanwhile
                if not self._pending_releases and self._closed:
                    return
            with self._sending_releases:
                self._release_many(self._take_pending_releases())

    def _release_many(self, lease_ids: list[int]) -> None:
        """End read leases in one call (a LeaseBlocks of no key: ``release_lease_ids``); a failure
        is logged (the leases expire on the server)."""
        try:
            for start, end in _chunks(len(lease_ids), self.max_leases):
                self.client.lease_blocks(pb.LeaseBlocksRequest(release_lease_ids=lease_ids[start:end]))
        except Exception as exc:  # noqa: BLE001 - the server gone or the channel closed: the leases expire there
            logger.warning("kvservice tier: releasing %d leases failed: %s", len(lease_ids), exc)

    def flush(self) -> None:
        """Block until every commit and release sent to the background so far has answered (a
        store's keys are then visible to every lookup, a load's leases ended), also while
        :meth:`close` runs."""
        with self._sending_releases:
            self._release_many(self._take_pending_releases())
        with self._background_lock:
            background = self._background
        if background is None:
            return
        try:
            background.submit(lambda: None).result()
        except RuntimeError:  # close() is shutting it down: wait for what it still runs
            background.shutdown(wait=True)

    def _commit(self, lease_id: int) -> None:
        """Commit a put lease whose copy its slot vouched for; one that does not commit is logged
        and counted (its keys are misses: nothing was published)."""
        try:
            committed = self.client.commit_blocks(lease_id).committed
            reason = "the lease had ended (the server restarted?)"
        except Exception as exc:  # noqa: BLE001 - the server gone or the channel closed: counted, never raised
            committed, reason = False, str(exc)
        if not committed:
            self.num_commits_lost += 1
            logger.warning("kvservice tier: CommitBlocks %d sent after its copy did not commit: %s", lease_id, reason)

    def _release(self, lease_id: int) -> bool:
        """End a lease; whether it was live until now (False on any failure, logged)."""
        try:
            return bool(self.client.release_lease(lease_id).valid)
        except Exception as exc:  # noqa: BLE001 - the server gone or the channel closed: the lease expires there
            logger.warning("kvservice tier: ReleaseLease %d failed: %s", lease_id, exc)
            return False

    # -- end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Send the commits and releases still queued, drop the mapping and close the channel (a
        store or load still running meanwhile fails its keys; a commit it still sends is counted
        lost)."""
        with self._background_lock, self._releases:
            self._closed = True
            background = self._background
            releaser = self._releaser
            self._releases.notify_all()
        if releaser is not None:
            releaser.join()  # it sends what is pending, then ends
        with self._releases:  # loads whose LeaseBlocks carry releases: answered, or failed and requeued
            while self._num_carrying:
                self._releases.wait()
        self._release_many(self._take_pending_releases())
        if background is not None:
            background.shutdown(wait=True)  # flush() meanwhile waits for it too
        with self._background_lock:
            self._background = None
        with self._view_lock:
            self._blocks_of.clear()
            if self._view is not None:
                self._view.close()
                self._view = None
        self.client.close()


class _GroupBlocks:
    """One group's blocks in the mapped memory (:meth:`TierClient._group_blocks` keeps one per view
    and checks the server's liveness once per call: each ``block_view`` would check it again per
    block, a syscall pair): a group whose blocks are each one contiguous run of bytes (the opaque
    layout) is one ``(num_blocks, bytes_per_block)`` uint8 array, so a row's copy is a single
    ``np.copyto`` with no per-block views.

    Raises:
        KVCacheViewClosedError: the server stopped or restarted.
    """

    __slots__ = ("group_idx", "rows", "view")

    def __init__(self, view: KVCacheView, group_idx: int) -> None:
        view.check()
        self.view = view
        self.group_idx = group_idx
        rows = _block_rows(view, group_idx)
        self.rows: np.ndarray | None = None if rows is None else rows.numpy()

    def block(self, block_id: int) -> np.ndarray | tuple[torch.Tensor, ...]:
        """Block ``block_id``'s bytes as one uint8 row (a numpy view), or (another layout) its views."""
        if self.rows is not None:
            if not 0 <= block_id < self.rows.shape[0]:
                raise IndexError(f"block_id must be in [0, {self.rows.shape[0]}); got {block_id}")
            return self.rows[block_id]
        return self.view.block_view(self.group_idx, block_id)


def _block_rows(view: KVCacheView, group_idx: int) -> torch.Tensor | None:
    """The group's blocks as a ``(num_blocks, bytes_per_block)`` uint8 tensor over the mapped
    memory, or None when a block is not one contiguous run of its group's only tensor."""
    axes = [v.block_axis for v in view.description.views if v.group_idx == group_idx]
    if len(axes) != 1:
        return None
    tensor = view.tensors(group_idx)[0].movedim(axes[0], 0)
    try:
        flat = tensor.view(tensor.shape[0], -1)
    except RuntimeError:
        return None
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return None
    return flat.view(torch.uint8)


def _copy_into_block(blocks: _GroupBlocks, block_id: int, row: np.ndarray) -> None:
    """Copy a row (a uint8 numpy view of it) into a block. A whole-row block copies with numpy,
    which lets go of the GIL for the copy (torch's ``copy_`` holds it: another job thread's round
    trip, whose answer needs the GIL, then waited for the whole copy instead of overlapping it)."""
    target = blocks.block(block_id)
    if isinstance(target, np.ndarray):
        np.copyto(target, row)
        return
    as_tensor = torch.from_numpy(row)
    offset = 0
    for tensor in target:
        n = tensor.numel() * tensor.element_size()
        tensor.copy_(as_tensor[offset : offset + n].view(tensor.dtype).view(tensor.shape))
        offset += n


def _copy_from_block(blocks: _GroupBlocks, block_id: int, row: np.ndarray) -> None:
    """Copy a block into a row (a uint8 numpy view of it; numpy for a whole-row block: see
    :func:`_copy_into_block`)."""
    source = blocks.block(block_id)
    if isinstance(source, np.ndarray):
        np.copyto(row, source)
        return
    as_tensor = torch.from_numpy(row)
    offset = 0
    for tensor in source:
        n = tensor.numel() * tensor.element_size()
        as_tensor[offset : offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        offset += n


def check_tier_layout(
    metadata: pb.GetKVCacheGroupMetadataResponse, chunk_bytes: int, group_idxs: Sequence[int]
) -> None:
    """Refuse a server whose blocks are not vLLM's offload chunks.

    Raises:
        TierLayoutError: naming the field, both values, and the server flag that fits.
    """
    fix = f"start the server with --kv-cache-layout opaque:{chunk_bytes}"
    if not metadata.groups:
        raise TierLayoutError(f"the server has no KV cache groups; {fix}")
    for group_idx in group_idxs:
        if group_idx >= len(metadata.groups):
            raise TierLayoutError(
                f"vLLM offloads KV cache group {group_idx}; the server has {len(metadata.groups)} group(s): "
                f"{fix} and one group per vLLM group"
            )
        group = metadata.groups[group_idx]
        if group.device == "meta":
            raise TierLayoutError(
                f"the server has no memory (--device meta): start it with --device cpu --kv-cache-layout opaque:{chunk_bytes}"
            )
        if group.bytes_per_block != chunk_bytes:
            raise TierLayoutError(
                f"group {group_idx}: the server's block holds {group.bytes_per_block} bytes, vLLM's offload chunk "
                f"(primary_kv_view.strides[0]) {chunk_bytes} bytes; {fix}"
            )
