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

import inspect
import operator
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterable, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import grpc.aio
import xxhash

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import (
    AsyncKVCacheClient,
    KVCacheClient,
    KVServiceError,
    Metadata,
    Timeout,
    _aiterate_stream,
    _iterate_stream,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")

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
    if block_id is not None and block_hash is None:
        return pb.BlockRef(group_idx=group_idx, block_id=block_id)
    if block_hash is not None and block_id is None:
        return pb.BlockRef(group_idx=group_idx, block_hash=block_hash)
    raise ValueError("give exactly one of block_id or block_hash")


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


_UINT32_MAX = 2**32 - 1


def _uint32(name: str, value: Any) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: {value!r} is not an integer") from None
    if not 0 <= number <= _UINT32_MAX:
        raise ValueError(f"{name}: {number} outside 0..{_UINT32_MAX}")
    return number


def _checked_blocks(
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]], chunk_bytes: int
) -> list[tuple[int, int, memoryview]]:
    """``blocks`` as (group_idx, block_id, a byte view of the data) each (no copy), checked.

    Raises:
        ValueError: ``chunk_bytes < 1``, an id outside the uint32 range, or an empty block.
        TypeError: an id that is not an integer, or data that is not bytes-like.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
    checked = []
    for group_idx, block_id, data in blocks:
        group_idx, block_id = _uint32("group_idx", group_idx), _uint32("block_id", block_id)
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise TypeError(f"block {block_id}: its bytes must be bytes-like, not {type(data).__name__}") from None
        if not len(view):
            raise ValueError(f"block {block_id}: no bytes")
        checked.append((group_idx, block_id, view))
    return checked


def write_block_chunks(
    request_id: str, blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]], chunk_bytes: int
) -> Iterator[pb.WriteBlocksChunk]:
    """The WriteBlocks chunks of ``blocks`` ((group_idx, block_id, bytes) each): every block is
    checked at once (before the first chunk, so nothing raises while gRPC iterates the chunks),
    the chunks are made lazily.

    Raises:
        ValueError: ``chunk_bytes < 1``, a group_idx or block_id outside the uint32 range, or an
            empty block.
        TypeError: an id that is not an integer, or a block's data that is not bytes-like.
    """
    return _block_chunks(request_id, _checked_blocks(blocks, chunk_bytes), chunk_bytes)


def _block_chunks(
    request_id: str, blocks: list[tuple[int, int, memoryview]], chunk_bytes: int
) -> Iterator[pb.WriteBlocksChunk]:
    for group_idx, block_id, view in blocks:
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


# Each unary helper is written once, as a plan: a generator that takes the client first, yields
# each call it makes (what a client method or the client's ``_rpc`` returns) and is sent that
# call's answer. _blocking runs a plan on a KVCacheClient, whose calls answer at once;
# _awaiting runs it on an AsyncKVCacheClient, awaiting each call. Both give the helper the plan's
# name, docstring and parameters.

_Plan = Generator[Any, Any, _R]


def _advance(steps: Generator[Any, Any, Any], answer: Any) -> tuple[bool, Any]:
    """Sends ``answer`` into a running plan: ``(True, its result)`` once it returns, else
    ``(False, the next call it makes)``."""
    try:
        return False, steps.send(answer)
    except StopIteration as done:
        return True, done.value


def _named(helper: Callable[..., Any], plan: Callable[..., Any], prefix: str, client_type: str) -> None:
    returns = plan.__annotations__["return"]
    if not (returns.startswith("_Plan[") and returns.endswith("]")):
        raise TypeError(f"{plan.__qualname__}: annotate its return as _Plan[<what the helper returns>]")
    signature = inspect.signature(plan)
    client, *rest = signature.parameters.values()
    helper.__name__ = helper.__qualname__ = prefix + plan.__name__.lstrip("_")
    helper.__doc__ = plan.__doc__
    helper.__dict__["__signature__"] = signature.replace(  # what inspect.signature reads (a function's __dict__)
        parameters=[client.replace(annotation=client_type), *rest], return_annotation=returns[len("_Plan[") : -1]
    )


def _blocking(plan: Callable[Concatenate[Any, _P], _Plan[_R]]) -> Callable[Concatenate[KVCacheClient, _P], _R]:
    """The helper that runs ``plan`` on a :class:`KVCacheClient`."""

    def helper(client: KVCacheClient, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        steps = plan(client, *args, **kwargs)
        done, value = _advance(steps, None)
        while not done:
            done, value = _advance(steps, value)
        result: _R = value
        return result

    _named(helper, plan, "", "KVCacheClient")
    return helper


def _awaiting(
    plan: Callable[Concatenate[Any, _P], _Plan[_R]],
) -> Callable[Concatenate[AsyncKVCacheClient, _P], Coroutine[Any, Any, _R]]:
    """The helper (a coroutine function) that runs ``plan`` on an :class:`AsyncKVCacheClient`."""

    async def helper(client: AsyncKVCacheClient, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        steps = plan(client, *args, **kwargs)
        done, value = _advance(steps, None)
        while not done:
            done, value = _advance(steps, await value)
        result: _R = value
        return result

    _named(helper, plan, "a", "AsyncKVCacheClient")
    return helper


def _attach_kv_cache(
    client: Any, *, timeout: Timeout = None, metadata: Metadata = None
) -> _Plan[pb.AttachKVCacheResponse]:
    """The server's description of its KV memory (``AttachKVCache``); map it with
    ``kvservice_client.torch_view.KVCacheView`` (or :func:`kvservice_client.torch_view.attach`).

    Raises:
        KVServiceError: FAILED_PRECONDITION ("no memory behind a meta device"), PERMISSION_DENIED
            (a watcher token; or auth off and the call came neither over loopback nor a Unix socket).
    """
    response: pb.AttachKVCacheResponse = yield client._rpc(
        "AttachKVCache", pb.AttachKVCacheRequest(), timeout, metadata
    )
    return response


def _write_blocks(
    client: Any,
    request_id: str,
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]],
    *,
    chunk_bytes: int | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> _Plan[pb.WriteBlocksResponse]:
    """Write whole blocks of a running request (WriteBlocks).

    Args:
        client: the service.
        request_id: the running request the blocks were allocated to.
        blocks: (group_idx, block_id, the block's bytes) each, bytes_per_block long.
        chunk_bytes: chunk size (at most the server's ``max_data_chunk_bytes``; None: that, asked
            with GetKVCacheGroupMetadata).

    Raises:
        ValueError, TypeError: a bad block or ``chunk_bytes`` (see :func:`write_block_chunks`),
            before any call.
        KVServiceError: FAILED_PRECONDITION (a block the request may not write, named),
            INVALID_ARGUMENT (a bad chunk: the field is named), PERMISSION_DENIED ...
    """
    checked = _checked_blocks(blocks, 1 if chunk_bytes is None else chunk_bytes)  # before any call
    if chunk_bytes is None:
        layout = yield client.get_kv_cache_group_metadata(timeout=timeout, metadata=metadata)
        chunk_bytes = layout.max_data_chunk_bytes or 1
    chunks = _block_chunks(request_id, checked, chunk_bytes)
    response: pb.WriteBlocksResponse = yield client._rpc("WriteBlocks", chunks, timeout, metadata)
    return response


attach_kv_cache = _blocking(_attach_kv_cache)
aattach_kv_cache = _awaiting(_attach_kv_cache)
write_blocks = _blocking(_write_blocks)
awrite_blocks = _awaiting(_write_blocks)


def _read_blocks_call(client: Any, refs: Iterable[pb.BlockRef], timeout: Timeout, metadata: Metadata) -> Any:
    options = client._call_options("ReadBlocks", timeout, metadata)
    return client.stub.ReadBlocks(pb.ReadBlocksRequest(blocks=list(refs)), **options)


def iter_read_blocks(
    client: KVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> Iterator[ReadBlock]:
    """Read blocks (ReadBlocks), one :class:`ReadBlock` at a time, in request order.

    Raises:
        KVServiceError: NOT_FOUND (a hash not cached, named), INVALID_ARGUMENT, FAILED_PRECONDITION,
            DATA_LOSS (a checksum that does not match) ...
    """
    assembler = _Assembler()
    with closing(_iterate_stream(_read_blocks_call(client, refs, timeout, metadata))) as chunks:
        for chunk in chunks:
            if (block := assembler.feed(chunk)) is not None:
                yield block


def read_blocks(
    client: KVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> list[ReadBlock]:
    """:func:`iter_read_blocks` as a list."""
    return list(iter_read_blocks(client, refs, timeout=timeout, metadata=metadata))


async def aiter_read_blocks(
    client: AsyncKVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> AsyncIterator[ReadBlock]:
    """:func:`iter_read_blocks` for an :class:`AsyncKVCacheClient`."""
    assembler = _Assembler()
    async with aclosing(_aiterate_stream(_read_blocks_call(client, refs, timeout, metadata))) as chunks:
        async for chunk in chunks:
            if (block := assembler.feed(chunk)) is not None:
                yield block


async def aread_blocks(
    client: AsyncKVCacheClient, refs: Iterable[pb.BlockRef], *, timeout: Timeout = None, metadata: Metadata = None
) -> list[ReadBlock]:
    """:func:`aiter_read_blocks` as a list."""
    return [block async for block in aiter_read_blocks(client, refs, timeout=timeout, metadata=metadata)]
