"""Block contents over gRPC: ``WriteBlocks`` and ``ReadBlocks`` helpers (no torch).

A block's bytes are laid out as the proto's data-plane comment says (each view of
``block_view(group_idx, block_id)`` in order, row-major, little-endian); their length is the
group's ``bytes_per_block``. Each block travels in chunks of at most ``max_data_chunk_bytes``
(``GetKVCacheGroupMetadata``), the last one carrying the block's xxh3_64 checksum.

Example::

    with KVCacheClient("127.0.0.1:50051", token=worker_token) as client:
        write_blocks(client, "req-1", [(0, 7, block_bytes)])
        for block in read_blocks(client, [block_ref(0, block_id=7)]):
            assert block.data == block_bytes

Both helpers keep about one chunk (``write_blocks``: one chunk; ``iter_read_blocks``: one block)
in memory at a time; the async twins (``awrite_blocks``, ``aiter_read_blocks``) take an
:class:`~kvservice_client.client.AsyncKVCacheClient`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import xxhash

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient, KVServiceError, Metadata, Timeout

__all__ = [
    "ReadBlock",
    "aattach_kv_cache",
    "attach_kv_cache",
    "aiter_read_blocks",
    "aread_blocks",
    "awrite_blocks",
    "block_checksum",
    "block_ref",
    "iter_read_blocks",
    "read_blocks",
    "write_block_chunks",
    "write_blocks",
]


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3_64 (seed 0) of a block's bytes, as WriteBlocks / ReadBlocks carry it."""
    return xxhash.xxh3_64_intdigest(data)


def block_ref(group_idx: int, *, block_id: int | None = None, block_hash: bytes | None = None) -> pb.BlockRef:
    """A ``BlockRef`` by block id or by block hash (the full digest).

    Raises:
        ValueError: neither or both of ``block_id`` and ``block_hash``.
    """
    if (block_id is None) == (block_hash is None):
        raise ValueError("give exactly one of block_id or block_hash")
    if block_id is not None:
        return pb.BlockRef(group_idx=group_idx, block_id=block_id)
    return pb.BlockRef(group_idx=group_idx, block_hash=block_hash)


@dataclass(frozen=True, slots=True)
class ReadBlock:
    """One block as ReadBlocks delivered it.

    Attributes:
        block_index: its position in the request.
        group_idx, block_id: where it was read.
        data: its bytes (None when ``evicted``).
        checksum: the server's xxh3_64 of ``data`` (checked on arrival; None when ``evicted``).
        evicted: read by hash, it left the cache while it streamed: no bytes.
    """

    block_index: int
    group_idx: int
    block_id: int
    data: bytes | None
    checksum: int | None
    evicted: bool


def write_block_chunks(
    request_id: str, blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]], chunk_bytes: int
) -> Iterator[pb.WriteBlocksChunk]:
    """The WriteBlocks chunks of ``blocks`` ((group_idx, block_id, bytes) each), made lazily.

    Raises:
        ValueError: ``chunk_bytes < 1`` or an empty block.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
    for group_idx, block_id, data in blocks:
        view = memoryview(data).cast("B")
        if not len(view):
            raise ValueError(f"block {block_id}: no bytes")
        hasher = xxhash.xxh3_64()
        for offset in range(0, len(view), chunk_bytes):
            piece = view[offset : offset + chunk_bytes]
            hasher.update(piece)
            chunk = pb.WriteBlocksChunk(
                request_id=request_id, group_idx=group_idx, block_id=block_id, offset_bytes=offset, data=bytes(piece)
            )
            if offset + len(piece) == len(view):
                chunk.checksum = hasher.intdigest()
            yield chunk


class _Assembler:
    """Reassembles ReadBlocksChunk messages into :class:`ReadBlock` values, checking order and
    checksums."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._index = -1
        self._offset = 0

    def feed(self, chunk: pb.ReadBlocksChunk) -> ReadBlock | None:
        """The completed block, or None while one is incomplete.

        Raises:
            KVServiceError: DATA_LOSS when chunks arrive out of order or a checksum does not match.
        """
        if chunk.block_index != self._index:
            self._index, self._offset, self._parts = chunk.block_index, 0, []
        if chunk.evicted:
            self._parts = []
            return ReadBlock(chunk.block_index, chunk.group_idx, chunk.block_id, None, None, True)
        if chunk.offset_bytes != self._offset:
            raise KVServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"block {chunk.block_index}: chunk at offset {chunk.offset_bytes}, expected {self._offset}",
            )
        self._parts.append(chunk.data)
        self._offset += len(chunk.data)
        if not chunk.HasField("checksum"):
            return None
        data = b"".join(self._parts)
        self._parts = []
        if block_checksum(data) != chunk.checksum:
            raise KVServiceError(grpc.StatusCode.DATA_LOSS, f"block {chunk.block_index}: checksum mismatch")
        return ReadBlock(chunk.block_index, chunk.group_idx, chunk.block_id, data, chunk.checksum, False)


def _options(client: Any, method: str, timeout: Timeout, metadata: Metadata) -> dict[str, Any]:
    return client._call_options(method, timeout, metadata)  # noqa: SLF001 (the client's one option path)


def attach_kv_cache(
    client: KVCacheClient, *, timeout: Timeout = None, metadata: Metadata = None
) -> pb.AttachKVCacheResponse:
    """The server's description of its KV memory (``AttachKVCache``); map it with
    ``kvservice_client.torch_view.KVCacheView`` (or :func:`kvservice_client.torch_view.attach`).

    Raises:
        KVServiceError: FAILED_PRECONDITION ("no memory behind a meta device"), PERMISSION_DENIED
            (a watcher token; or auth off and the call came neither over loopback nor a Unix socket).
    """
    try:
        return client.stub.AttachKVCache(
            pb.AttachKVCacheRequest(), **_options(client, "AttachKVCache", timeout, metadata)
        )
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err


async def aattach_kv_cache(
    client: AsyncKVCacheClient, *, timeout: Timeout = None, metadata: Metadata = None
) -> pb.AttachKVCacheResponse:
    """:func:`attach_kv_cache` for an :class:`AsyncKVCacheClient`."""
    try:
        return await client.stub.AttachKVCache(
            pb.AttachKVCacheRequest(), **_options(client, "AttachKVCache", timeout, metadata)
        )
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err


def write_blocks(
    client: KVCacheClient,
    request_id: str,
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]],
    *,
    chunk_bytes: int | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> pb.WriteBlocksResponse:
    """Write whole blocks of a running request (WriteBlocks).

    Args:
        client: the service.
        request_id: the running request the blocks were allocated to.
        blocks: (group_idx, block_id, the block's bytes) each, bytes_per_block long.
        chunk_bytes: chunk size (at most the server's ``max_data_chunk_bytes``; None: that, asked
            with GetKVCacheGroupMetadata).

    Raises:
        KVServiceError: FAILED_PRECONDITION (a block the request may not write, named),
            INVALID_ARGUMENT (a bad chunk: the field is named), PERMISSION_DENIED ...
    """
    if chunk_bytes is None:
        chunk_bytes = client.get_kv_cache_group_metadata(timeout=timeout, metadata=metadata).max_data_chunk_bytes or 1
    try:
        return client.stub.WriteBlocks(
            write_block_chunks(request_id, blocks, chunk_bytes), **_options(client, "WriteBlocks", timeout, metadata)
        )
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err


def iter_read_blocks(
    client: KVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> Iterator[ReadBlock]:
    """Read blocks (ReadBlocks), one :class:`ReadBlock` at a time, in request order.

    Raises:
        KVServiceError: NOT_FOUND (a hash not cached, named), INVALID_ARGUMENT, FAILED_PRECONDITION,
            DATA_LOSS (a checksum that does not match) ...
    """
    call = client.stub.ReadBlocks(
        pb.ReadBlocksRequest(blocks=list(refs)), **_options(client, "ReadBlocks", timeout, metadata)
    )
    assembler = _Assembler()
    try:
        for chunk in call:
            block = assembler.feed(chunk)
            if block is not None:
                yield block
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


def read_blocks(
    client: KVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> list[ReadBlock]:
    """:func:`iter_read_blocks` as a list."""
    return list(iter_read_blocks(client, refs, timeout=timeout, metadata=metadata))


async def awrite_blocks(
    client: AsyncKVCacheClient,
    request_id: str,
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]],
    *,
    chunk_bytes: int | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> pb.WriteBlocksResponse:
    """:func:`write_blocks` for an :class:`AsyncKVCacheClient`."""
    if chunk_bytes is None:
        chunk_bytes = (
            await client.get_kv_cache_group_metadata(timeout=timeout, metadata=metadata)
        ).max_data_chunk_bytes or 1
    try:
        return await client.stub.WriteBlocks(
            write_block_chunks(request_id, blocks, chunk_bytes), **_options(client, "WriteBlocks", timeout, metadata)
        )
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err


async def aiter_read_blocks(
    client: AsyncKVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> AsyncIterator[ReadBlock]:
    """:func:`iter_read_blocks` for an :class:`AsyncKVCacheClient`."""
    call = client.stub.ReadBlocks(
        pb.ReadBlocksRequest(blocks=list(refs)), **_options(client, "ReadBlocks", timeout, metadata)
    )
    assembler = _Assembler()
    try:
        async for chunk in call:
            block = assembler.feed(chunk)
            if block is not None:
                yield block
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


async def aread_blocks(
    client: AsyncKVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> list[ReadBlock]:
    """:func:`aiter_read_blocks` as a list."""
    return [block async for block in aiter_read_blocks(client, refs, timeout=timeout, metadata=metadata)]
