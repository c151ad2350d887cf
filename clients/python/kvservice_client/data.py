"""Block contents over gRPC: ``WriteBlocks`` and ``ReadBlocks`` helpers (no torch).

A block's bytes are laid out as the proto's data-plane comment says (each view of
``block_view(group_idx, block_id)`` in order, row-major, little-endian); their length is the
group's ``bytes_per_block``. Each block travels in chunks of at most ``max_data_chunk_bytes``
(``GetKVCacheGroupMetadata``), the last one carrying the block's xxh3_64 checksum.

The helpers are methods of both clients too (:class:`BlockingDataPlaneMethods`,
:class:`AsyncDataPlaneMethods`, bases of ``KVCacheClient`` and ``AsyncKVCacheClient``). A block is
named by ``(group_idx, block_id)`` (the ids an allocation answers, ``new_block_ids[g].block_ids``),
by ``(group_idx, block_hash)`` (the full digest, for reads) or by a :func:`block_ref`.

Example::

    with KVCacheClient("127.0.0.1:50051", token=worker_token) as client:
        slots = client.allocate_slots("req-1", num_new_tokens=64)
        block_id = slots.new_block_ids[0].block_ids[0]
        client.write_blocks("req-1", [(0, block_id, block_bytes)], allocation=slots)
        for block in client.read_blocks([(0, block_id)]):
            assert block.data == block_bytes

Both keep about one chunk (``write_blocks``: one chunk; ``iter_read_blocks``: one block) in memory
at a time; the async twins (``awrite_blocks``, ``aiter_read_blocks``, or the same methods of an
:class:`~kvservice_client.client.AsyncKVCacheClient`) await.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, Union, cast

import grpc
import grpc.aio
import xxhash

# The client module takes this module's method classes as the clients' bases, so this module never
# imports it (docs/ARCHITECTURE.md §1.3): the call aliases come from the facade both use, and a
# client is what DataPlaneClient reads of it.
from kvservice_client._facade import (  # noqa: E402 (after the note on why not client)
    Metadata,
    Timeout,
    await_plan,
    plan_method,
    plan_returns,
    run_plan,
)
from kvservice_client._facade import Plan as _Plan  # the helpers' return type, as they annotate it
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._proto.kvservice.v1 import kv_cache_service_rpcs as rpcs
from kvservice_client._wire import flat_fields
from kvservice_client.errors import KVServiceError


class DataPlaneClient(Protocol):
    """What the helpers use of a :class:`~kvservice_client.client.KVCacheClient` (blocking
    helpers) or :class:`~kvservice_client.client.AsyncKVCacheClient` (the ``a...`` helpers)."""

    @property
    def stub(self) -> Any: ...

    def _rpc(self, method: str, request: object, timeout: Timeout, metadata: Metadata) -> Any: ...

    def _call_options(self, streaming: bool, timeout: Timeout, metadata: Metadata) -> dict[str, Any]: ...

    _calls: dict[str, tuple[Any, bool]]


_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = [
    "Allocation",
    "AsyncDataPlaneMethods",
    "BlockRefLike",
    "BlockingDataPlaneMethods",
    "DataPlaneClient",
    "DataPlaneRPCs",
    "Metadata",
    "ReadBlock",
    "aattach_kv_cache",
    "allocation_of",
    "attach_kv_cache",
    "aiter_read_blocks",
    "amark_blocks_written",
    "aread_blocks",
    "awrite_blocks",
    "block_checksum",
    "block_ref",
    "iter_read_blocks",
    "mark_blocks_written",
    "read_blocks",
    "read_blocks_into",
    "Timeout",
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


BlockRefLike = Union[pb.BlockRef, tuple[int, int], tuple[int, bytes]]
"""A block to read: a ``BlockRef``, ``(group_idx, block_id)`` or ``(group_idx, block_hash)`` (the
full digest as bytes)."""


def _block_refs(refs: Iterable[BlockRefLike]) -> list[pb.BlockRef]:
    """``refs`` as ``BlockRef`` messages.

    Raises:
        TypeError: an item that is neither a ``BlockRef`` nor a (group_idx, block id or hash) pair.
    """
    out = []
    for ref in refs:
        if isinstance(ref, pb.BlockRef):
            out.append(ref)
            continue
        try:
            group_idx, block = ref
        except (TypeError, ValueError):
            raise TypeError(
                f"a block to read is a BlockRef, (group_idx, block_id) or (group_idx, block_hash); got {ref!r}"
            ) from None
        if isinstance(block, (bytes, bytearray)):
            out.append(block_ref(_uint32("group_idx", group_idx), block_hash=bytes(block)))
        else:
            out.append(block_ref(_uint32("group_idx", group_idx), block_id=_uint32("block_id", block)))
    return out


@dataclass(frozen=True, slots=True)
class ReadBlock:
    """One block as ReadBlocks delivered it.

    Attributes:
        block_index: its position in the request.
        group_idx, block_id: where it was read.
        data: its bytes (None when ``evicted`` or ``missing``).
        checksum: the server's xxh3_64 of ``data`` (checked on arrival; None when ``evicted`` or
            ``missing``).
        evicted: read by hash, it left the cache while it streamed: no bytes.
        missing: read by hash with ``missing_ok``, it could not be read when the call started (not
            cached, or its bytes not written): no bytes, ``block_id`` 0.
    """

    block_index: int
    group_idx: int
    block_id: int
    data: bytes | None
    checksum: int | None
    evicted: bool
    missing: bool = False


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


Allocation = Union[tuple[int, str], Any]
"""The allocation a write names: ``(allocation_id, epoch)``, or an answer carrying both as
attributes (``AllocateSlotsResponse``)."""


def allocation_of(allocation: Allocation | None) -> tuple[int, str]:
    """``(allocation_id, epoch)`` of ``allocation`` (``(0, "")`` for None: a write bound to the
    request id alone, which cannot tell a stream for an earlier admission of that id apart).

    Raises:
        TypeError: neither a pair nor an object with ``allocation_id`` and ``epoch``.
        ValueError: an allocation id of 0 (a refused allocation has none) or an empty epoch.
    """
    if allocation is None:
        return 0, ""
    if isinstance(allocation, tuple):
        allocation_id, epoch = allocation
    elif hasattr(allocation, "allocation_id") and hasattr(allocation, "epoch"):
        allocation_id, epoch = allocation.allocation_id, allocation.epoch
    else:
        raise TypeError(
            f"allocation: (allocation_id, epoch) or an AllocateSlotsResponse; got {type(allocation).__name__}"
        )
    if not isinstance(allocation_id, int) or isinstance(allocation_id, bool) or not isinstance(epoch, str):
        raise TypeError(f"allocation: (int, str); got ({type(allocation_id).__name__}, {type(epoch).__name__})")
    if not 1 <= allocation_id < 1 << 64 or not epoch:
        raise ValueError(
            f"allocation: ({allocation_id}, {epoch!r}); the id is >= 1 and the epoch set (a refused allocation has none)"
        )
    return allocation_id, epoch


def write_block_chunks(
    request_id: str,
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]],
    chunk_bytes: int,
    *,
    allocation: Allocation | None = None,
) -> Iterator[pb.WriteBlocksChunk]:
    """The WriteBlocks chunks of ``blocks`` ((group_idx, block_id, bytes) each): every block is
    checked at once (before the first chunk, so nothing raises while gRPC iterates the chunks),
    the chunks are made lazily. ``allocation`` (see :func:`allocation_of`) goes on every chunk.

    Raises:
        ValueError: ``chunk_bytes < 1``, a group_idx or block_id outside the uint32 range, an
            empty block, or a bad allocation.
        TypeError: an id that is not an integer, or a block's data that is not bytes-like.
    """
    return _block_chunks(request_id, _checked_blocks(blocks, chunk_bytes), chunk_bytes, allocation_of(allocation))


def _check_block_sizes(blocks: list[tuple[int, int, memoryview]], bytes_per_block: list[int]) -> None:
    """Each block is exactly its group's ``bytes_per_block`` long (the server would see a block
    that ends early as a checksum on an incomplete block).

    Raises:
        ValueError: a group out of range, or a block of another size (both named).
    """
    for group_idx, block_id, view in blocks:
        if group_idx >= len(bytes_per_block):
            raise ValueError(
                f"block {block_id}: group_idx {group_idx} out of range (the server has {len(bytes_per_block)} groups)"
            )
        if len(view) != bytes_per_block[group_idx]:
            raise ValueError(
                f"block {block_id} of group {group_idx}: {len(view)} bytes, but a block of that group is "
                f"{bytes_per_block[group_idx]} bytes (bytes_per_block); nothing was sent"
            )


def _block_chunks(
    request_id: str, blocks: list[tuple[int, int, memoryview]], chunk_bytes: int, allocation: tuple[int, str]
) -> Iterator[pb.WriteBlocksChunk]:
    allocation_id, epoch = allocation
    for group_idx, block_id, view in blocks:
        hasher = xxhash.xxh3_64()
        for offset in range(0, len(view), chunk_bytes):
            piece = view[offset : offset + chunk_bytes]
            hasher.update(piece)
            chunk = pb.WriteBlocksChunk(
                request_id=request_id,
                group_idx=group_idx,
                block_id=block_id,
                offset_bytes=offset,
                data=bytes(piece),
                allocation_id=allocation_id,
                epoch=epoch,
            )
            if offset + len(piece) == len(view):
                chunk.checksum = hasher.intdigest()
            yield chunk


class _ReadChunk:
    """A ``ReadBlocksChunk`` as the client reads it: its ``data`` a view of the received bytes
    (protobuf's parse copies them into the message, and each read of ``chunk.data`` again).

    Attributes: as ``ReadBlocksChunk``'s; ``checksum`` None when the field is absent.
    """

    __slots__ = ("block_id", "block_index", "checksum", "data", "evicted", "group_idx", "missing", "offset_bytes")

    def __init__(
        self,
        block_index: int,
        group_idx: int,
        block_id: int,
        offset_bytes: int,
        data: memoryview,
        checksum: int | None,
        evicted: bool,
        missing: bool = False,
    ) -> None:
        self.block_index = block_index
        self.group_idx = group_idx
        self.block_id = block_id
        self.offset_bytes = offset_bytes
        self.data = data
        self.checksum = checksum
        self.evicted = evicted
        self.missing = missing


# ReadBlocksChunk's fields by tag byte (field << 3 | wire type): the bits a varint's value may use.
_READ_VARINT_BITS = {0x08: 32, 0x10: 32, 0x18: 32, 0x20: 64, 0x30: 64, 0x38: 1, 0x40: 1}
_READ_DATA_TAG = 0x2A


def _wire_read_chunk(data: bytes) -> _ReadChunk | None:
    """``data`` read as a ``ReadBlocksChunk`` holding at most one of each field, each in range, and
    nothing else (what kvservice's server sends), or None (protobuf then parses it, so the two
    readings never differ)."""
    fields = flat_fields(data, 0, len(data), _READ_VARINT_BITS, _READ_DATA_TAG)
    if fields is None:
        return None
    values, payload = fields
    return _ReadChunk(
        values.get(0x08, 0),
        values.get(0x10, 0),
        values.get(0x18, 0),
        values.get(0x20, 0),
        payload,
        values.get(0x30),
        bool(values.get(0x38, 0)),
        bool(values.get(0x40, 0)),
    )


def _read_chunk(data: bytes) -> _ReadChunk:
    """A ReadBlocks response message's bytes as a :class:`_ReadChunk` (the client's deserializer of
    ReadBlocks): read in place when it has the server's form, else parsed by protobuf.

    Raises:
        google.protobuf.message.DecodeError: the bytes are not a ``ReadBlocksChunk``.
    """
    chunk = _wire_read_chunk(data)
    if chunk is not None:
        return chunk
    message = pb.ReadBlocksChunk.FromString(data)
    return _ReadChunk(
        message.block_index,
        message.group_idx,
        message.block_id,
        message.offset_bytes,
        memoryview(message.data),
        message.checksum if message.HasField("checksum") else None,
        message.evicted,
        message.missing,
    )


class _Assembler:
    """Reassembles ReadBlocks chunks (:class:`_ReadChunk`) into :class:`ReadBlock` values, checking
    order and checksums."""

    def __init__(self) -> None:
        self._parts: list[memoryview] = []
        self._index = -1
        self._offset = 0

    def feed(self, chunk: _ReadChunk) -> ReadBlock | None:
        """The completed block, or None while one is incomplete.

        Raises:
            KVServiceError: DATA_LOSS when chunks arrive out of order or a checksum does not match.
        """
        if chunk.block_index != self._index:
            self._index, self._offset, self._parts = chunk.block_index, 0, []
        if chunk.evicted or chunk.missing:
            self._parts = []
            return ReadBlock(
                chunk.block_index, chunk.group_idx, chunk.block_id, None, None, chunk.evicted, chunk.missing
            )
        if chunk.offset_bytes != self._offset:
            raise KVServiceError(
                grpc.StatusCode.DATA_LOSS,
                f"block {chunk.block_index}: chunk at offset {chunk.offset_bytes}, expected {self._offset}",
            )
        self._parts.append(chunk.data)
        self._offset += len(chunk.data)
        if chunk.checksum is None:
            return None
        data = bytes(self._parts[0]) if len(self._parts) == 1 else b"".join(self._parts)  # the one copy
        self._parts = []
        if block_checksum(data) != chunk.checksum:
            raise KVServiceError(grpc.StatusCode.DATA_LOSS, f"block {chunk.block_index}: checksum mismatch")
        return ReadBlock(chunk.block_index, chunk.group_idx, chunk.block_id, data, chunk.checksum, False)


# Each unary helper is written once, as a plan (kvservice_client._facade.Plan): a generator that
# takes the client first, yields each call it makes (what a client method or the client's ``_rpc``
# returns) and is sent that call's answer. _blocking runs a plan on a KVCacheClient, whose calls
# answer at once; _awaiting runs it on an AsyncKVCacheClient, awaiting each call. Both give the
# helper the plan's name, docstring and parameters.


def _named(helper: Callable[..., object], plan: Callable[..., object], prefix: str, client_type: str) -> None:
    returns = plan_returns(plan)
    signature = inspect.signature(plan)
    client, *rest = signature.parameters.values()
    helper.__name__ = helper.__qualname__ = prefix + plan.__name__.lstrip("_")
    helper.__doc__ = plan.__doc__
    helper.__dict__["__signature__"] = signature.replace(  # what inspect.signature reads (a function's __dict__)
        parameters=[client.replace(annotation=client_type), *rest], return_annotation=returns
    )


def _blocking(
    plan: Callable[Concatenate[DataPlaneClient, _P], _Plan[_R]],
) -> Callable[Concatenate[DataPlaneClient, _P], _R]:
    """The helper that runs ``plan`` on a :class:`KVCacheClient`."""

    def helper(client: DataPlaneClient, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return run_plan(plan(client, *args, **kwargs))

    _named(helper, plan, "", "KVCacheClient")
    return helper


def _awaiting(
    plan: Callable[Concatenate[DataPlaneClient, _P], _Plan[_R]],
) -> Callable[Concatenate[DataPlaneClient, _P], Coroutine[object, None, _R]]:
    """The helper (a coroutine function) that runs ``plan`` on an :class:`AsyncKVCacheClient`."""

    async def helper(client: DataPlaneClient, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await await_plan(plan(client, *args, **kwargs))

    _named(helper, plan, "a", "AsyncKVCacheClient")
    return helper


def _attach_kv_cache(
    client: DataPlaneClient, *, timeout: Timeout = None, metadata: Metadata = None
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
    client: DataPlaneClient,
    request_id: str,
    blocks: Iterable[tuple[int, int, bytes | bytearray | memoryview]],
    *,
    allocation: Allocation | None = None,
    chunk_bytes: int | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> _Plan[pb.WriteBlocksResponse]:
    """Write whole blocks of a running request (WriteBlocks).

    Args:
        client: the service.
        request_id: the running request the blocks were allocated to.
        blocks: (group_idx, block_id, the block's bytes) each: block ids as the allocation answered
            them (``new_block_ids[g].block_ids``), the bytes exactly the group's ``bytes_per_block``.
        allocation: the allocation that gave them: the ``AllocateSlotsResponse`` (or
            ``(allocation_id, epoch)``), so the server refuses the write once that admission is
            over (freed, readmitted, or the server restarted). None: bound to ``request_id`` alone.
        chunk_bytes: chunk size (at most the server's ``max_data_chunk_bytes``; None: that).

    The layout is asked first (GetKVCacheGroupMetadata), so a block of the wrong size is refused
    by name before any byte is sent.

    Raises:
        ValueError, TypeError: a bad block or ``chunk_bytes`` (see :func:`write_block_chunks`),
            before any call; ValueError: a block whose bytes are not its group's
            ``bytes_per_block`` long, or a group the server does not have, before WriteBlocks.
        KVServiceError: FAILED_PRECONDITION (a block the request may not write, or one already
            written, named; a stale allocation id or epoch), INVALID_ARGUMENT (a bad chunk: the
            field is named), PERMISSION_DENIED ...
    """
    checked = _checked_blocks(blocks, 1 if chunk_bytes is None else chunk_bytes)  # before any call
    pair = allocation_of(allocation)
    layout = yield client._rpc("GetKVCacheGroupMetadata", pb.GetKVCacheGroupMetadataRequest(), timeout, metadata)
    _check_block_sizes(checked, [group.bytes_per_block for group in layout.groups])
    if chunk_bytes is None:
        chunk_bytes = layout.max_data_chunk_bytes or 1
    chunks = _block_chunks(request_id, checked, chunk_bytes, pair)
    response: pb.WriteBlocksResponse = yield client._rpc("WriteBlocks", chunks, timeout, metadata)
    return response


def _mark_blocks_written(
    client: Any,
    request_id: str,
    blocks: Iterable[tuple[int, int]],
    *,
    allocation: Allocation | None = None,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> _Plan[pb.WriteBlocksResponse]:
    """Tell the server blocks stored through the attached memory are written (WriteBlocks chunks
    ``in_memory``, no bytes sent): until then it answers reads of them FAILED_PRECONDITION ("not
    written yet"), as it cannot see stores into mapped memory.

    Args:
        client: the service.
        request_id: the running request the blocks were allocated to.
        blocks: (group_idx, block_id) each.
        allocation: as :func:`write_blocks`.

    Raises:
        KVServiceError: FAILED_PRECONDITION / INVALID_ARGUMENT under the write rules of
            :func:`write_blocks`.
    """
    allocation_id, epoch = allocation_of(allocation)
    chunks = [
        pb.WriteBlocksChunk(
            request_id=request_id,
            group_idx=group_idx,
            block_id=block_id,
            allocation_id=allocation_id,
            epoch=epoch,
            in_memory=True,
        )
        for group_idx, block_id in blocks
    ]
    response: pb.WriteBlocksResponse = yield client._rpc("WriteBlocks", iter(chunks), timeout, metadata)
    return response


attach_kv_cache = _blocking(_attach_kv_cache)
aattach_kv_cache = _awaiting(_attach_kv_cache)
write_blocks = _blocking(_write_blocks)
mark_blocks_written = _blocking(_mark_blocks_written)
amark_blocks_written = _awaiting(_mark_blocks_written)
awrite_blocks = _awaiting(_write_blocks)


def _iterate_stream(call: Any) -> Generator[Any, None, None]:
    try:
        yield from call
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


async def _aiterate_stream(call: Any) -> AsyncGenerator[Any, None]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


def _read_blocks_call(
    client: DataPlaneClient, refs: Iterable[BlockRefLike], missing_ok: bool, timeout: Timeout, metadata: Metadata
) -> Any:
    request = pb.ReadBlocksRequest(blocks=_block_refs(refs), missing_ok=missing_ok)
    options = client._call_options(False, timeout, metadata)  # a read has the client's default deadline
    return client._calls["ReadBlocks"][0](request, **options)  # its messages read by _read_chunk


def iter_read_blocks(
    client: DataPlaneClient,
    refs: Iterable[BlockRefLike],
    *,
    missing_ok: bool = False,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> Iterator[ReadBlock]:
    """Read blocks (ReadBlocks), one :class:`ReadBlock` at a time, in request order.

    Args:
        client: the service.
        refs: the blocks (:data:`BlockRefLike`: ``(group_idx, block_id)``, ``(group_idx,
            block_hash)`` or a :func:`block_ref`).
        missing_ok: a block read by hash that cannot be read when the call starts (not cached,
            not written yet) is a :class:`ReadBlock` with ``missing`` set, not a failed call.

    Raises:
        TypeError: a ref of another shape (before any call).
        KVServiceError: NOT_FOUND (a hash not cached, named; not with ``missing_ok``),
            INVALID_ARGUMENT, FAILED_PRECONDITION, DATA_LOSS (a checksum that does not match) ...
    """
    assembler = _Assembler()
    with closing(_iterate_stream(_read_blocks_call(client, refs, missing_ok, timeout, metadata))) as chunks:
        for chunk in chunks:
            if (block := assembler.feed(chunk)) is not None:
                yield block


def read_blocks_into(
    client: DataPlaneClient,
    refs: Sequence[BlockRefLike],
    buffers: Sequence[Any],
    *,
    missing_ok: bool = False,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> list[bool]:
    """Read blocks (ReadBlocks) straight into the caller's buffers: each chunk copied once, from
    the received message into ``buffers[i]``, with no block assembled in between (what
    :func:`iter_read_blocks` does), and its checksum checked as it arrives.

    Args:
        client: the service.
        refs: the blocks, as :func:`iter_read_blocks` takes them.
        buffers: per ref, a writable buffer of exactly the block's bytes (a numpy row, a
            ``bytearray``, a ``memoryview``).
        missing_ok: as :func:`iter_read_blocks`'s.

    Returns:
        Per ref whether its buffer now holds the block's bytes, checked (False: ``missing`` or
        ``evicted``; that buffer may then hold part of the block and must not be used).

    Raises:
        TypeError: a ref of another shape (before any call).
        ValueError: ``len(buffers) != len(refs)`` (before any call), or a block longer or shorter
            than its buffer.
        KVServiceError: as :func:`iter_read_blocks`'s; DATA_LOSS for a checksum that does not match
            or chunks out of order.
    """
    if len(buffers) != len(refs):
        raise ValueError(f"buffers: {len(buffers)} for {len(refs)} refs")
    arrived = [False] * len(refs)
    hasher = xxhash.xxh3_64()
    index, offset, target = -1, 0, memoryview(b"")
    with closing(_iterate_stream(_read_blocks_call(client, refs, missing_ok, timeout, metadata))) as chunks:
        for chunk in chunks:
            if chunk.block_index != index:
                index, offset = chunk.block_index, 0
                hasher.reset()
                target = memoryview(buffers[index]).cast("B")
            if chunk.evicted or chunk.missing:
                continue
            end = offset + len(chunk.data)
            if chunk.offset_bytes != offset or end > len(target):
                raise (
                    KVServiceError(
                        grpc.StatusCode.DATA_LOSS,
                        f"block {index}: chunk at offset {chunk.offset_bytes}, expected {offset}",
                    )
                    if chunk.offset_bytes != offset
                    else ValueError(f"block {index}: more than its buffer's {len(target)} bytes")
                )
            target[offset:end] = chunk.data  # the one copy
            hasher.update(chunk.data)
            offset = end
            if chunk.checksum is not None:
                if offset != len(target):
                    raise ValueError(f"block {index}: {offset} bytes, its buffer {len(target)}")
                if hasher.intdigest() != chunk.checksum:
                    raise KVServiceError(grpc.StatusCode.DATA_LOSS, f"block {index}: checksum mismatch")
                arrived[index] = True
    return arrived


def read_blocks(
    client: DataPlaneClient,
    refs: Iterable[BlockRefLike],
    *,
    missing_ok: bool = False,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> list[ReadBlock]:
    """:func:`iter_read_blocks` as a list."""
    return list(iter_read_blocks(client, refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata))


async def aiter_read_blocks(
    client: DataPlaneClient,
    refs: Iterable[BlockRefLike],
    *,
    missing_ok: bool = False,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> AsyncIterator[ReadBlock]:
    """:func:`iter_read_blocks` for an :class:`AsyncKVCacheClient`."""
    assembler = _Assembler()
    async with aclosing(_aiterate_stream(_read_blocks_call(client, refs, missing_ok, timeout, metadata))) as chunks:
        async for chunk in chunks:
            if (block := assembler.feed(chunk)) is not None:
                yield block


async def aread_blocks(
    client: DataPlaneClient,
    refs: Iterable[BlockRefLike],
    *,
    missing_ok: bool = False,
    timeout: Timeout = None,
    metadata: Metadata = None,
) -> list[ReadBlock]:
    """:func:`aiter_read_blocks` as a list."""
    return [
        block
        async for block in aiter_read_blocks(client, refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata)
    ]


# --- the same, as methods of the two clients ----------------------------------------------------

_ATTACH_DOC = """The server's description of its KV memory (``AttachKVCache``; see
:func:`kvservice_client.data.attach_kv_cache`); map it with
:func:`kvservice_client.torch_view.attach`.

Raises:
    KVServiceError: FAILED_PRECONDITION ("no memory behind a meta device"), PERMISSION_DENIED ...
"""
_WRITE_DOC = """Write whole blocks of a running request (WriteBlocks; see
:func:`kvservice_client.data.write_blocks`).

Args:
    request_id: the running request the blocks were allocated to.
    blocks: (group_idx, block_id, the block's bytes) each, the bytes exactly the group's
        ``bytes_per_block`` long.
    allocation: the ``AllocateSlotsResponse`` that gave them (or ``(allocation_id, epoch)``): a
        stream for an admission that is over is refused; None: bound to ``request_id`` alone.
    chunk_bytes: chunk size (None: the server's ``max_data_chunk_bytes``).
    timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
    metadata: extra metadata for this call.

Returns:
    ``num_blocks_written`` and ``num_bytes_written``.

Raises:
    ValueError, TypeError: a bad block (a wrong size named), before any byte is sent.
    KVServiceError: FAILED_PRECONDITION (a block the request may not write, named), ...
"""
_READ_DOC = """Read blocks (ReadBlocks; see :func:`kvservice_client.data.read_blocks`), as a list in
request order.

Args:
    refs: ``(group_idx, block_id)``, ``(group_idx, block_hash)`` or :func:`kvservice_client.data.block_ref` each.
    missing_ok: a block read by hash that cannot be read when the call starts (not cached, not
        written yet) comes back with ``missing`` set instead of failing the call.
    timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
    metadata: extra metadata for this call.

Returns:
    One :class:`kvservice_client.data.ReadBlock` per ref (``data``: its bytes; ``evicted``: read by
    hash, it left the cache while it streamed; ``missing``: with ``missing_ok``, not readable).

Raises:
    KVServiceError: NOT_FOUND (a hash not cached, named; not with ``missing_ok``),
        FAILED_PRECONDITION, DATA_LOSS ...
"""
_ITER_READ_DOC = """Read blocks (ReadBlocks) one :class:`kvservice_client.data.ReadBlock` at a time, holding
about one block in memory (see :meth:`read_blocks` for the arguments and errors).
"""


class DataPlaneRPCs:
    """The data plane's unary methods both clients have: plan entries of the client's RPC table
    (see :mod:`kvservice_client._facade`), run by the blocking client and awaited by the async one.
    The reads, a list or an iterator of a server stream, are :class:`BlockingDataPlaneMethods` /
    :class:`AsyncDataPlaneMethods`."""

    attach_kv_cache = plan_method(rpcs.attach_kv_cache, doc=_ATTACH_DOC)(_attach_kv_cache)
    write_blocks = plan_method(rpcs.get_kv_cache_group_metadata, rpcs.write_blocks, doc=_WRITE_DOC)(_write_blocks)


class BlockingDataPlaneMethods:
    """The data-plane reads as methods of :class:`~kvservice_client.client.KVCacheClient` (a base
    class of it): the helpers of this module with the client as ``self``."""

    __slots__ = ()

    def read_blocks(
        self,
        refs: Iterable[BlockRefLike],
        *,
        missing_ok: bool = False,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> list[ReadBlock]:
        return read_blocks(cast(DataPlaneClient, self), refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata)

    def iter_read_blocks(
        self,
        refs: Iterable[BlockRefLike],
        *,
        missing_ok: bool = False,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> Iterator[ReadBlock]:
        return iter_read_blocks(
            cast(DataPlaneClient, self), refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata
        )

    read_blocks.__doc__, iter_read_blocks.__doc__ = _READ_DOC, _ITER_READ_DOC


class AsyncDataPlaneMethods:
    """The data-plane reads as methods of :class:`~kvservice_client.client.AsyncKVCacheClient` (a
    base class of it): ``read_blocks`` a coroutine, ``iter_read_blocks`` an async iterator."""

    __slots__ = ()

    async def read_blocks(
        self,
        refs: Iterable[BlockRefLike],
        *,
        missing_ok: bool = False,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> list[ReadBlock]:
        return await aread_blocks(
            cast(DataPlaneClient, self), refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata
        )

    def iter_read_blocks(
        self,
        refs: Iterable[BlockRefLike],
        *,
        missing_ok: bool = False,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> AsyncIterator[ReadBlock]:
        return aiter_read_blocks(
            cast(DataPlaneClient, self), refs, missing_ok=missing_ok, timeout=timeout, metadata=metadata
        )

    read_blocks.__doc__, iter_read_blocks.__doc__ = _READ_DOC, _ITER_READ_DOC
