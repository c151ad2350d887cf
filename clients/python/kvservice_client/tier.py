"""Blocks named by hash alone: the tier RPCs' client methods (no torch).

A shared tier (kvservice-vllm's ``KVServiceTier``, a secondary tier of vLLM 0.33's
``OffloadingConnector``) keeps blocks in kvservice by key: ``(group_idx, block hash)``, the pair
vLLM's ``OffloadKey`` packs (``make_offload_key(block_hash, group_idx)``). A block hash is the full
digest of the server's hash algorithm (32 bytes for sha256*, 16 for xxhash*). See docs/tier.md for
the contract (leases, events, the opaque layout, tensor parallelism).

Both clients have these as methods (the entries of :class:`TierRPCs`, a base of both clients'
table: one RPC each, and ``put_blocks``, a plan run by the blocking client and awaited by the async
one)::

    with KVCacheClient("unix:/run/kvservice.sock", token=tier_token) as client:
        present = client.lookup_blocks(0, [h0, h1]).present          # no side effect
        put = client.reserve_blocks(0, [h0, h1])                      # same host
        for status, block_id, data in zip(put.status, put.block_ids, chunks):
            if status == pb.BLOCK_PUT_STATUS_WRITE:
                ...copy data into view.block_view(0, block_id)...
        client.commit_blocks(put.lease_id)                            # BlockStored now
        lease = client.lease_blocks(0, [h0, h1])                      # pin for a copy out
        ...copy out of view.block_view(0, block_id) for each non-zero block id...
        assert client.release_lease(lease.lease_id).valid             # else: the copy failed
        client.put_blocks(0, [(h2, data2)])                           # across hosts: one stream

Units: block ids as pool indices, bytes as bytes, ttl in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import xxhash

from kvservice_client._facade import Metadata, Timeout, facade, plan_method
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._proto.kvservice.v1 import kv_cache_service_rpcs as rpcs
from kvservice_client._wire import varint
from kvservice_client.data import _awaiting, _blocking, _Plan, _uint32
from kvservice_client.request_builders import pack_token_ids

__all__ = [
    "TierRPCs",
    "aput_blocks",
    "lease_blocks_request",
    "lookup_blocks_request",
    "put_blocks",
    "put_blocks_messages",
    "reserve_blocks_request",
]


def _hashes(name: str, block_hashes: Iterable[bytes]) -> list[bytes]:
    hashes = list(block_hashes)
    for i, block_hash in enumerate(hashes):
        if not isinstance(block_hash, (bytes, bytearray, memoryview)):
            raise TypeError(f"{name}[{i}]: a block hash is bytes (the full digest), not {type(block_hash).__name__}")
    return [bytes(h) for h in hashes]


def _packed_tokens(token_ids: Any) -> bytes:
    """Token ids as little-endian int32 bytes (a list of ints, an int32 buffer, or bytes already)."""
    if token_ids is None:
        return b""
    packed = pack_token_ids(token_ids)
    if packed is not None:
        return packed
    from array import array

    try:
        values = array("i", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token_ids: {exc}") from None
    if __import__("sys").byteorder != "little":
        values.byteswap()
    return values.tobytes()


def lookup_blocks_request(
    group_idx: int | pb.LookupBlocksRequest,
    block_hashes: Iterable[bytes] = (),
    *,
    group_idxs: Sequence[int] | None = None,
    touch: bool = False,
) -> pb.LookupBlocksRequest:
    """The ``LookupBlocksRequest`` of these keys (or ``group_idx`` itself, when it is one).

    Raises:
        ValueError: a group index outside the uint32 range. TypeError: a hash that is not bytes.
    """
    if isinstance(group_idx, pb.LookupBlocksRequest):
        return group_idx
    return pb.LookupBlocksRequest(
        group_idx=_uint32("group_idx", group_idx),
        block_hashes=_hashes("block_hashes", block_hashes),
        group_idxs=[_uint32(f"group_idxs[{i}]", g) for i, g in enumerate(group_idxs or ())],
        touch=touch,
    )


def reserve_blocks_request(
    group_idx: int | pb.ReserveBlocksRequest,
    block_hashes: Iterable[bytes] = (),
    *,
    parent_block_hashes: Sequence[bytes | None] | None = None,
    token_ids: Any = None,
    ttl_s: float = 0.0,
) -> pb.ReserveBlocksRequest:
    """The ``ReserveBlocksRequest`` of these keys (or ``group_idx`` itself, when it is one).

    Args:
        group_idx: the KV cache group of every key.
        block_hashes: the keys' block hashes (full digests).
        parent_block_hashes: per key, its parent's hash (None or b"": unknown / none); None: unknown
            for every key.
        token_ids: the keys' token ids, block_size per key (a list, an int32 buffer, or packed
            little-endian int32 bytes); None: unknown (BlockStored then carries none).
        ttl_s: the put lease's seconds (0: the server's default).

    Raises:
        ValueError, TypeError: a field protobuf would refuse, named.
    """
    if isinstance(group_idx, pb.ReserveBlocksRequest):
        return group_idx
    parents = [] if parent_block_hashes is None else [p or b"" for p in parent_block_hashes]
    return pb.ReserveBlocksRequest(
        group_idx=_uint32("group_idx", group_idx),
        block_hashes=_hashes("block_hashes", block_hashes),
        parent_block_hashes=_hashes("parent_block_hashes", parents),
        packed_token_ids=_packed_tokens(token_ids),
        ttl_s=float(ttl_s),
    )


def lease_blocks_request(
    group_idx: int | pb.LeaseBlocksRequest, block_hashes: Iterable[bytes] = (), *, ttl_s: float = 0.0
) -> pb.LeaseBlocksRequest:
    """The ``LeaseBlocksRequest`` of these keys (or ``group_idx`` itself, when it is one)."""
    if isinstance(group_idx, pb.LeaseBlocksRequest):
        return group_idx
    return pb.LeaseBlocksRequest(
        group_idx=_uint32("group_idx", group_idx),
        block_hashes=_hashes("block_hashes", block_hashes),
        ttl_s=float(ttl_s),
    )


# -- PutBlocks (client streaming) -------------------------------------------------------------------


def put_blocks_messages(
    header: pb.ReserveBlocksRequest, data: Sequence[bytes | bytearray | memoryview | None], chunk_bytes: int
) -> Iterator[pb.PutBlocksMessage]:
    """The PutBlocks stream: ``header``, then each key's bytes (``data[i]``; None: skip the key) in
    chunks of at most ``chunk_bytes``, the last carrying its xxh3_64 checksum.

    Raises:
        ValueError: ``chunk_bytes < 1``, or ``len(data) != len(header.block_hashes)`` (before any
            message is made).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
    if len(data) != len(header.block_hashes):
        raise ValueError(f"data: {len(data)} blocks for {len(header.block_hashes)} keys")
    return _put_messages(header, data, chunk_bytes)


def _put_messages(
    header: pb.ReserveBlocksRequest, data: Sequence[bytes | bytearray | memoryview | None], chunk_bytes: int
) -> Iterator[pb.PutBlocksMessage]:
    yield pb.PutBlocksMessage(header=header)
    for index, block in enumerate(data):
        if block is None:
            continue
        view = memoryview(block).cast("B")
        hasher = xxhash.xxh3_64()
        for offset in range(0, len(view), chunk_bytes):
            piece = view[offset : offset + chunk_bytes]
            hasher.update(piece)
            chunk = pb.PutBlocksChunk(block_index=index, offset_bytes=offset, data=bytes(piece))
            if offset + len(piece) == len(view):
                chunk.checksum = hasher.intdigest()
            yield pb.PutBlocksMessage(chunk=chunk)


_CHUNK_FIELD = b"\x12"  # PutBlocksMessage.chunk: field 2, length-delimited
_DATA_FIELD = b"\x1a"  # PutBlocksChunk.data: field 3, length-delimited


def _put_serialized(
    header: pb.ReserveBlocksRequest, data: Sequence[memoryview | None], chunk_bytes: int
) -> Iterator[bytes]:
    """:func:`put_blocks_messages`'s stream, each message serialized with one copy of its bytes.

    ``SerializeToString`` of a chunk made from the block's memory copies its data three times
    (``bytes(piece)``, into the message, out of it); here the chunk's other fields are serialized
    by protobuf and its ``data`` field is put between them in the wire format, in field order, so
    a piece of a block is copied once, by the join: the bytes are those ``SerializeToString`` makes
    of :func:`put_blocks_messages`'s message (a unit test checks it byte for byte)."""
    yield pb.PutBlocksMessage(header=header).SerializeToString()
    for index, block in enumerate(data):
        if block is None:
            continue
        hasher = xxhash.xxh3_64()
        for offset in range(0, len(block), chunk_bytes):
            piece = block[offset : offset + chunk_bytes]
            hasher.update(piece)
            head = pb.PutBlocksChunk(block_index=index, offset_bytes=offset).SerializeToString()
            head += _DATA_FIELD + varint(len(piece))
            tail = b""
            if offset + len(piece) == len(block):
                tail = pb.PutBlocksChunk(checksum=hasher.intdigest()).SerializeToString()
            yield b"".join((_CHUNK_FIELD, varint(len(head) + len(piece) + len(tail)), head, piece, tail))


def _put_blocks(
    client: Any,
    group_idx: int,
    blocks: Iterable[tuple[bytes, bytes | bytearray | memoryview]],
    *,
    parent_block_hashes: Sequence[bytes | None] | None = None,
    token_ids: Any = None,
    chunk_bytes: int | None = None,
    bytes_per_block: int | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> _Plan[pb.PutBlocksResponse]:
    """Store blocks by key across hosts (PutBlocks: reserve, write and commit in one stream).

    Args:
        client: the service.
        group_idx: the KV cache group of every key.
        blocks: (block hash, the block's bytes) each, the bytes exactly the group's
            ``bytes_per_block`` long.
        parent_block_hashes, token_ids: as :meth:`TierRPCs.reserve_blocks`.
        chunk_bytes: chunk size (None: the server's ``max_data_chunk_bytes``).
        bytes_per_block: the group's ``bytes_per_block``, when the caller knows it already (from
            its own GetKVCacheGroupMetadata): with ``chunk_bytes`` too, the layout is not asked
            (one round trip less per call); a block of another size is then refused by the
            server (INVALID_ARGUMENT naming the chunk; nothing of the call is stored).

    Unless both ``chunk_bytes`` and ``bytes_per_block`` are given, the layout is asked first
    (GetKVCacheGroupMetadata), so a block of the wrong size is refused by name before any byte is
    sent.

    Returns:
        ``reserved`` (False: the pool is too full of pinned blocks; nothing changed), per key
        ``status`` and ``block_ids``, ``num_blocks_written``, ``num_bytes_written``,
        ``lease_expired`` (the put lease's ``ttl_s`` passed while the bytes streamed: nothing stored).

    Raises:
        ValueError, TypeError: a bad key or block (named), before any byte is sent.
        KVServiceError: INVALID_ARGUMENT (a bad chunk or field, named), RESOURCE_EXHAUSTED,
            FAILED_PRECONDITION (no memory: meta), PERMISSION_DENIED ...
    """
    pairs = list(blocks)
    header = reserve_blocks_request(
        group_idx, [h for h, _ in pairs], parent_block_hashes=parent_block_hashes, token_ids=token_ids
    )
    data = [memoryview(d).cast("B") for _, d in pairs]
    if bytes_per_block is None or chunk_bytes is None:
        layout = yield client._rpc("GetKVCacheGroupMetadata", pb.GetKVCacheGroupMetadataRequest(), timeout, metadata)
        if group_idx >= len(layout.groups):
            raise ValueError(f"group_idx {group_idx} out of range (the server has {len(layout.groups)} groups)")
        if bytes_per_block is None:
            bytes_per_block = layout.groups[group_idx].bytes_per_block
        if chunk_bytes is None:
            chunk_bytes = layout.max_data_chunk_bytes or 1
    size = bytes_per_block
    for i, view in enumerate(data):
        if len(view) != size:
            raise ValueError(
                f"blocks[{i}]: {len(view)} bytes, but a block of group {group_idx} is {size} bytes "
                "(bytes_per_block); nothing was sent"
            )
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
    messages = _put_serialized(header, data, chunk_bytes)
    response: pb.PutBlocksResponse = yield client._rpc("PutBlocks", messages, timeout, metadata)
    return response


put_blocks = _blocking(_put_blocks)
aput_blocks = _awaiting(_put_blocks)


# -- the methods ------------------------------------------------------------------------------------


class TierRPCs:
    """The tier's methods both clients have (entries of the client's RPC table; see
    :mod:`kvservice_client._facade`): one per unary RPC, and ``put_blocks`` (the plan
    :func:`_put_blocks`: the layout asked when needed, then the PutBlocks stream)."""

    @facade(rpcs.lookup_blocks)
    def lookup_blocks(
        self,
        group_idx: int | pb.LookupBlocksRequest,
        block_hashes: Iterable[bytes] = (),
        *,
        group_idxs: Sequence[int] | None = None,
        touch: bool = False,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.LookupBlocksRequest:
        """Which keys are cached and readable (LookupBlocks): no side effect (no request
        registered; no LRU touch unless ``touch``).

        Args:
            group_idx: the KV cache group of every key (or a ``LookupBlocksRequest``).
            block_hashes: the block hashes (full digests), at most ``tier_limits.max_keys_per_call``.
            group_idxs: per key, its group (None: ``group_idx`` for all).
            touch: mark the present free blocks most recently used.
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            ``present`` (per key) and ``num_prefix_blocks`` (the longest present prefix, in blocks).

        Raises:
            KVServiceError: INVALID_ARGUMENT (a hash of the wrong length, a group out of range, too
                many keys: named), PERMISSION_DENIED ...
        """
        return lookup_blocks_request(group_idx, block_hashes, group_idxs=group_idxs, touch=touch)

    @facade(rpcs.reserve_blocks)
    def reserve_blocks(
        self,
        group_idx: int | pb.ReserveBlocksRequest,
        block_hashes: Iterable[bytes] = (),
        *,
        parent_block_hashes: Sequence[bytes | None] | None = None,
        token_ids: Any = None,
        ttl_s: float = 0.0,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.ReserveBlocksRequest:
        """Reserve a block for each key not cached yet, under a put lease (ReserveBlocks): write
        the bytes of each ``BLOCK_PUT_STATUS_WRITE`` key into its block id through the attached
        memory, then :meth:`commit_blocks` (or :meth:`release_lease` to abandon it).

        Args:
            group_idx: the KV cache group of every key (or a ``ReserveBlocksRequest``).
            block_hashes: the block hashes (full digests), no key twice.
            parent_block_hashes: per key, its parent's hash (None: unknown).
            token_ids: the keys' token ids, block_size per key (None: unknown).
            ttl_s: the lease's seconds (0: the server's default; at most ``max_lease_ttl_s``).
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            ``reserved`` (False: the pool is too full of pinned blocks; nothing changed),
            ``lease_id``, per key ``status`` and ``block_ids``, ``ttl_s``.

        Raises:
            KVServiceError: INVALID_ARGUMENT (a bad field, named), RESOURCE_EXHAUSTED (too many live
                leases), FAILED_PRECONDITION (no memory: meta), PERMISSION_DENIED ...
        """
        return reserve_blocks_request(
            group_idx, block_hashes, parent_block_hashes=parent_block_hashes, token_ids=token_ids, ttl_s=ttl_s
        )

    @facade(rpcs.commit_blocks)
    def commit_blocks(
        self, lease_id: int | pb.CommitBlocksRequest, *, timeout: Timeout = None, metadata: Metadata = None
    ) -> pb.CommitBlocksRequest:
        """Make a put lease's blocks cached: their BlockStored goes out now (CommitBlocks).

        Returns:
            ``committed`` (False: the lease expired or is unknown: nothing stored) and
            ``num_blocks_stored``.
        """
        if isinstance(lease_id, pb.CommitBlocksRequest):
            return lease_id
        return pb.CommitBlocksRequest(lease_id=lease_id)

    @facade(rpcs.lease_blocks)
    def lease_blocks(
        self,
        group_idx: int | pb.LeaseBlocksRequest,
        block_hashes: Iterable[bytes] = (),
        *,
        ttl_s: float = 0.0,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.LeaseBlocksRequest:
        """Pin the cached blocks of these keys for a copy through the attached memory (LeaseBlocks).

        Returns:
            ``lease_id`` (0: nothing pinned), per key ``block_ids`` (0: a miss), ``num_leased``,
            ``ttl_s``. Release it with :meth:`release_lease`; a copy is good only if that answers
            ``valid``.

        Raises:
            KVServiceError: INVALID_ARGUMENT (a bad field, named), RESOURCE_EXHAUSTED (too many live
                leases), FAILED_PRECONDITION (no memory: meta), PERMISSION_DENIED ...
        """
        return lease_blocks_request(group_idx, block_hashes, ttl_s=ttl_s)

    @facade(rpcs.release_lease)
    def release_lease(
        self, lease_id: int | pb.ReleaseLeaseRequest, *, timeout: Timeout = None, metadata: Metadata = None
    ) -> pb.ReleaseLeaseRequest:
        """End a lease (ReleaseLease): a read lease's blocks unpinned, a put lease's uncommitted
        blocks freed (no event).

        Returns:
            ``valid`` (True: the lease was live until now, so a copy made under it is good) and
            ``num_blocks``.
        """
        if isinstance(lease_id, pb.ReleaseLeaseRequest):
            return lease_id
        return pb.ReleaseLeaseRequest(lease_id=lease_id)

    put_blocks = plan_method(rpcs.get_kv_cache_group_metadata, rpcs.put_blocks)(_put_blocks)
