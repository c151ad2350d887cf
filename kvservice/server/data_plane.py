"""The data plane: ``AttachKVCache``, ``WriteBlocks``, ``ReadBlocks`` over the server's KV memory.

The cache manager hands out block ids; :class:`kvservice.memory.KVCacheTensors` holds the memory
they name. This module lets workers reach that memory:

- **Attach** (same host, zero copy): the memory is described generically, so it survives layout
  changes: per backing storage (a POSIX shared-memory segment on CPU, a CUDA IPC handle on CUDA)
  its size; per (group_idx, view_idx) of ``block_view(group_idx, block_id)`` the whole tensor as a
  strided view of a storage (byte offset, shape, strides in elements, dtype, block axis). The
  description is derived from ``block_view`` itself (block 0 and block 1 give the block stride),
  so whatever ``KVCacheTensors`` does inside, a worker rebuilds the same ``block_view`` from it.
- **Block contents over gRPC**: a block's bytes are its views' bytes in order, each view in
  row-major order (see the proto's data-plane comment), moved in chunks of at most
  ``chunk_bytes``, with an xxh3_64 checksum per block. xxh3_64, not crc32c: ``xxhash`` is already
  a dependency of the client (one of the block-hash algorithms), it runs at memory speed in
  Python, and 64 bits make an undetected corruption far less likely than crc32c's 32; crc32c would
  need another native package on both sides.

Byte state (a block's bytes exist only once written): vLLM registers a block's hash when it
allocates the block, before the forward pass that computes it, so a second request can hit a block
whose bytes nobody wrote yet. Each block therefore has a state, reset when it is allocated for
computing: *not written*; *partial* (written before it had a hash: a block still filling); or
*written* (written while carrying its hash: final). The state lives here, beside the memory; the
cache, its hits and its events are those of vLLM (the data plane changes no cache state and never
touches the event log).

Write rule: a block may be written only by the running request it was allocated to for computing
(not taken from the prefix cache as part of a hit), in the allocation (``allocation_id``, the
admission, and the epoch) the write names, while that request holds it at the position it was
allocated at, and until it is written. Other requests may hold it already (a hit before the
bytes): its computer still writes it, as its content is the one its hash names. Once written it is
immutable: a second write is refused (FAILED_PRECONDITION "already written").

Who marks a block stored in place (through the attached memory, invisible to the server): a
writer that stores and then says so (``WriteBlocks`` chunks ``in_memory``, as the replay's
``--kv-data shm`` does), or, for vLLM's workers on the pool (``kvservice_vllm.Worker``), their
scheduler: once a step's output is back (its forward finished on every rank) the remote manager
reports each full block whose last token that step computed, with the allocation that gave it,
on its next ManagerStep (``written_blocks``, applied before the calls:
:meth:`DataPlane.mark_written_in_place`); such a block is *written* even before its hash is
cached, because its every token is final. A report for a block its request may no longer write
is skipped under the write rule.

Read rule: a read by hash answers FAILED_PRECONDITION naming the hash unless the block is
*written* (a hit before its computer wrote it: retry; a block freed before it was written stays
cached and announced, as in vLLM, but is never readable until evicted); a read by id answers
FAILED_PRECONDITION naming the block while it is *not written* (allocated and nobody wrote it, or
never allocated), so no read ever returns a previous tenant's bytes. A block read by hash is
resolved when the call starts (NOT_FOUND naming the hash when no block of that group carries it)
and checked again before every chunk is copied (no await between the check and the copy): when it
left the cache, or was reused, meanwhile, the stream says ``evicted`` for it and sends no more of
it.

Off the loop (issue 24): a chunk's bytes (the staging copy and checksum of a write, the block copy,
the read's copy, checksum and serialization) are handled on two worker threads
(:data:`DATA_THREADS`; torch copies and xxhash release the GIL), so the event loop that answers the
schedulers only routes messages. Because a copy then runs while the loop serves other calls, a
block being copied into is marked: a read by hash of it is refused (FAILED_PRECONDITION) when the
call starts, and a read by hash checks before *and after* each chunk's copy that the block still
carries its hash, was not reallocated and had no copy into it meanwhile (else ``evicted``); a second
write of the same block waits for the first. By-hash reads of many blocks are resolved in slices of
:data:`RESOLVE_SLICE` blocks that yield to the loop in between.

Bounds: at most ``max_data_streams`` data streams (WriteBlocks and ReadBlocks together) are open
at once (one more: RESOURCE_EXHAUSTED naming the setting); a stream holds at most one chunk being
copied plus one being written (a read), or one block being assembled plus one chunk (a write):
:attr:`DataPlane.buffered_bytes` counts them. A stream whose client stops reading (a ReadBlocks
write not taken) or stops sending (no next WriteBlocks chunk) for ``stalled_write_timeout_s`` is
cut with DEADLINE_EXCEEDED naming the setting (:class:`DataStreamStalled`).

The data plane never touches the event log and changes no cache state. It imports torch only
where it touches memory, so a ``meta`` server (no memory: every call is refused) never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import xxhash

from kvservice.core.engine import KVCacheEngine
from kvservice.core.request import Request
from kvservice.memory import KVCacheTensors
from kvservice.server.event_log import MAX_EPOCH_BYTES
from kvservice.server.settings import DATA_WORKER_PRIORITIES
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._wire import varint

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BLOCK_NOT_WRITTEN",
    "BLOCK_PARTIAL",
    "BLOCK_WRITTEN",
    "DATA_THREADS",
    "DataPlane",
    "DataPlaneError",
    "DataStreamStalled",
    "MAX_READ_BLOCKS",
    "RESOLVE_SLICE",
    "WORKER_NICE",
    "block_checksum",
    "describe_memory",
]

MAX_READ_BLOCKS = 65536
"""Most blocks one ReadBlocks may name."""

RESOLVE_SLICE = 4096
"""Blocks of a ReadBlocks resolved between two yields to the loop (65,536 by-hash refs: 16 slices
of about 5 ms each here, instead of one hold of about 90 ms)."""

DATA_THREADS = min(2, os.cpu_count() or 1)
"""Worker threads copying and hashing data-plane bytes (shared by every stream). Two, not four: the
parts of a chunk that hold the GIL (protobuf serialization, the staging copy) make every extra
thread one more for the loop's thread to wait on; with four, a scheduler's p99 beside 16 + 16
streams of 64 MiB was about 2x that of the same machine with every CPU merely busy, with two
about 1x, at the price of slower streams (2 GiB in 16.5-46 s against 13-18 s; one thread: 31 s
in one run; BENCHMARKS.md, issue 24)."""

WORKER_NICE = 10
"""How much nicer (Linux nice) a worker thread runs than the thread that started it (at most 19),
under ``data_worker_priority`` ``nice`` (and under ``idle`` where SCHED_IDLE is not available)."""


INLINE_BYTES = 16384
"""Chunks up to this many bytes are handled on the loop (a thread hop costs more than they do)."""

NO_MEMORY = "no memory behind a meta device"

BLOCK_NOT_WRITTEN = 0
"""Byte state: nobody wrote the block since it was allocated for computing (or ever)."""
BLOCK_PARTIAL = 1
"""Byte state: written before it carried a block hash (a block still filling); its computer may
write it again; readable by id, not by hash."""
BLOCK_WRITTEN = 2
"""Byte state: written while carrying its block hash: final, immutable until reallocated."""


class DataPlaneError(Exception):
    """A data-plane call refused; ``code`` is its gRPC status, the message names the field or block."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DataStreamStalled(DataPlaneError):
    """A data stream cut because its client stopped reading or sending for ``stalled_write_timeout_s``
    (DEADLINE_EXCEEDED). The handler ends the call with a bounded wait (a message in flight to a
    client that does not read holds the status back)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, message)


class _StallTimer:
    """Cancels the current task if one await takes over ``timeout_s``; :meth:`stalled` tells that
    cancellation apart from the client's (Python 3.10 has no ``asyncio.timeout``)."""

    __slots__ = ("_loop", "_task", "_timeout_s", "_handle", "fired")

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def _fire(self) -> None:
        self.fired = True
        if self._task is not None:
            self._task.cancel()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """One await under the timer; raises ``asyncio.CancelledError`` when it fired (check
        :attr:`fired`)."""
        self._handle = self._loop.call_later(self._timeout_s, self._fire)
        try:
            yield
        finally:
            self._handle.cancel()


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3_64 (seed 0) of a block's bytes, as the wire carries it (unsigned 64-bit)."""
    return xxhash.xxh3_64_intdigest(data)


def _peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer string names a loopback TCP peer or a Unix-socket peer."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


# -- describing memory -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ViewLayout:
    """One view of a group's block_view as a strided tensor over a storage."""

    storage_key: int
    offset_bytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    block_axis: int


def _view_layout(tensors: KVCacheTensors, group_idx: int, view_idx: int, storage_key_of: Any) -> _ViewLayout:
    """The whole tensor behind view ``view_idx`` of ``block_view(group_idx, .)``, from blocks 0, 1
    and the last (the block stride must be uniform)."""
    num_blocks = tensors.num_blocks
    v0 = tensors.block_view(group_idx, 0)[view_idx]
    v1 = tensors.block_view(group_idx, 1)[view_idx]
    last = tensors.block_view(group_idx, num_blocks - 1)[view_idx]
    itemsize = v0.dtype.itemsize
    stride_bytes = v1.data_ptr() - v0.data_ptr()
    assert stride_bytes > 0 and stride_bytes % itemsize == 0, f"block stride of {stride_bytes} bytes"
    assert last.data_ptr() - v0.data_ptr() == (num_blocks - 1) * stride_bytes, "block views are not evenly strided"
    block_stride = stride_bytes // itemsize
    # The block axis goes where the strides stay descending (where it was in a C-ordered tensor).
    axis = sum(1 for s in v0.stride() if s > block_stride)
    shape = (*v0.shape[:axis], num_blocks, *v0.shape[axis:])
    strides = (*v0.stride()[:axis], block_stride, *v0.stride()[axis:])
    key, offset = storage_key_of(v0)
    return _ViewLayout(key, offset, tuple(shape), tuple(strides), v0.dtype, axis)


def _cuda_storage_fields(flat: torch.Tensor) -> dict[str, Any]:
    """The KVCacheStorage fields of a CUDA uint8 tensor spanning one whole storage, from torch's
    multiprocessing reduction (the handle a process on the same host opens with
    ``rebuild_cuda_tensor``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(flat)
    (
        _cls,
        _size,
        _stride,
        _offset,
        _storage_cls,
        _dtype,
        device,
        handle,
        size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return {
        "size_bytes": int(size_bytes),
        "cuda_ipc_handle": bytes(handle),
        "cuda_device": int(device),
        "cuda_storage_offset_bytes": int(storage_offset_bytes),
        "cuda_ref_counter_handle": bytes(ref_counter_handle),
        "cuda_ref_counter_offset": int(ref_counter_offset),
        "cuda_event_handle": bytes(event_handle) if event_handle is not None else b"",
        "cuda_event_sync_required": bool(event_sync_required),
    }


def describe_memory(
    tensors: KVCacheTensors, *, epoch: str, shm: Any | None, chunk_bytes: int
) -> pb.AttachKVCacheResponse:
    """The ``AttachKVCache`` answer for ``tensors``.

    Args:
        tensors: the KV tensors (CPU ones allocated by ``shm``, or CUDA ones).
        epoch: the server epoch.
        shm: the :class:`kvservice.shm.SharedMemoryAllocator` that holds CPU tensors (None on CUDA).
        chunk_bytes: the largest data chunk.

    Raises:
        DataPlaneError: FAILED_PRECONDITION on ``meta`` ("no memory behind a meta device") or CPU
            memory not in shared memory.
    """
    if tensors.device_type == "meta":
        raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, NO_MEMORY)
    import torch

    device = tensors.device
    response = pb.AttachKVCacheResponse(
        epoch=epoch,
        device=str(device),
        num_blocks=tensors.num_blocks,
        max_data_chunk_bytes=chunk_bytes,
        bytes_per_block=[tensors.bytes_per_block(g) for g in range(tensors.num_groups)],
    )
    storage_index: dict[int, int] = {}
    if shm is not None:
        response.control_shm_name = shm.control_name
    if device.type == "cpu":
        if shm is None or not shm.segments:
            raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, "the CPU KV memory is not in shared memory")

        def storage_key_of(view: torch.Tensor) -> tuple[int, int]:
            found: tuple[int, int] | None = shm.segment_of(view.data_ptr())
            assert found is not None, "a KV tensor outside the shared-memory segments"
            return found

        for idx, (name, size, _tensor) in enumerate(shm.segments):
            storage_index[idx] = idx
            response.storages.add(storage_idx=idx, size_bytes=size, shm_name=name)
    elif device.type == "cuda":
        cuda_storages: dict[int, torch.UntypedStorage] = {}

        def storage_key_of(view: torch.Tensor) -> tuple[int, int]:
            storage = view.untyped_storage()
            cuda_storages.setdefault(storage.data_ptr(), storage)
            return storage.data_ptr(), view.data_ptr() - storage.data_ptr()
    else:
        raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, f"no shared handle for device {device}")
    layouts = []
    for g in range(tensors.num_groups):
        for j in range(len(tensors.block_view(g, 0))):
            layouts.append((g, j, _view_layout(tensors, g, j, storage_key_of)))
    if device.type == "cuda":
        for key, storage in cuda_storages.items():
            storage_index[key] = len(response.storages)
            flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            response.storages.add(storage_idx=storage_index[key], **_cuda_storage_fields(flat))
    for g, j, layout in layouts:
        response.views.add(
            group_idx=g,
            view_idx=j,
            storage_idx=storage_index[layout.storage_key],
            offset_bytes=layout.offset_bytes,
            shape=layout.shape,
            strides=layout.strides,
            dtype=str(layout.dtype).removeprefix("torch."),
            block_axis=layout.block_axis,
        )
    return response


# -- block bytes -----------------------------------------------------------------------------------


def _byte_rows(view: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``view``'s bytes as a 2-D uint8 tensor ``[rows, row_bytes]``, rows in row-major order, and
    whether it shares ``view``'s memory (False only for layouts whose leading axes cannot be
    merged: then it is a copy, fine for reading)."""
    import torch

    raw = view.view(torch.uint8) if view.dim() else view.reshape(1).view(torch.uint8)
    shape, strides = raw.shape, raw.stride()
    k = raw.dim()
    expected = 1
    while k > 0 and strides[k - 1] == expected:  # the contiguous suffix of axes
        expected *= shape[k - 1]
        k -= 1
    row = math.prod(shape[k:])
    try:
        return raw.view(-1, row), True
    except RuntimeError:
        return raw.reshape(-1, row), False


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as int64 when each row is whole 8-byte words (copies of wide elements run at memory
    speed; byte-wise strided copies do not)."""
    import torch

    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 and rows.stride(0) % 8 == 0 else rows


class _BlockBytes:
    """The bytes of one block (all views of its group, in order), read or written by byte range."""

    __slots__ = ("views", "rows", "shares", "sizes", "total")

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = tuple(views)
        rows = [_byte_rows(v) for v in self.views]
        self.rows = [r for r, _ in rows]
        self.shares = [shares for _, shares in rows]
        self.sizes = [r.numel() for r in self.rows]
        self.total = sum(self.sizes)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the block, copied now."""
        parts = []
        base = 0
        for rows, size in zip(self.rows, self.sizes):
            lo, hi = max(start - base, 0), min(end - base, size)
            if lo < hi:
                row_bytes = rows.shape[1]
                r0, r1 = lo // row_bytes, (hi - 1) // row_bytes + 1
                piece = rows[r0:r1]
                data = (piece.cpu() if piece.device.type != "cpu" else piece).numpy().tobytes()
                trim = lo - r0 * row_bytes, hi - r0 * row_bytes
                parts.append(data if trim == (0, len(data)) else data[trim[0] : trim[1]])
            base += size
            if base >= end:
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def pieces(self, start: int, end: int) -> list[memoryview] | None:
        """Bytes ``[start, end)`` of the block as views of its memory, in order (no copy), or None
        when they are not all in CPU memory this block's views share (then :meth:`read` copies)."""
        if not all(shares and rows.device.type == "cpu" for rows, shares in zip(self.rows, self.shares)):
            return None
        out = []
        base = 0
        for rows, size in zip(self.rows, self.sizes):
            lo, hi = max(start - base, 0), min(end - base, size)
            if lo < hi:
                row_bytes = rows.shape[1]
                array = rows.numpy()
                for r in range(lo // row_bytes, (hi - 1) // row_bytes + 1):
                    row = memoryview(array[r])
                    a, b = max(lo - r * row_bytes, 0), min(hi - r * row_bytes, row_bytes)
                    out.append(row if (a, b) == (0, row_bytes) else row[a:b])
            base += size
            if base >= end:
                break
        return out

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Overwrite the whole block with ``data`` (``total`` bytes).

        In CPU memory the bytes go by numpy's single-threaded copy, not torch's ``copy_``: torch
        splits a copy of a block (1 MiB: 131,072 int64 words) across its intra-op threads, and
        their barrier on a loaded 2-core machine made a 1 MiB write 4-8 ms (0.1-0.2 GB/s; numpy
        3-5 GB/s, measured side by side)."""
        assert len(data) == self.total
        import torch

        base = 0
        for view, rows, shares, size in zip(self.views, self.rows, self.shares, self.sizes):
            if size and rows.device.type == "cpu":
                src_array = np.frombuffer(data, dtype=np.uint8, count=size, offset=base)
                raw = view.view(torch.uint8) if view.dim() else view.reshape(1).view(torch.uint8)
                dst_array = (rows if shares else raw).numpy()
                np.copyto(dst_array, src_array.reshape(dst_array.shape))
            elif size:
                src = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=base).view(rows.shape)
                if shares:
                    _wide(rows).copy_(_wide(src))
                else:
                    dst = view.view(torch.uint8) if view.dim() else view.reshape(1).view(torch.uint8)
                    dst.copy_(src.reshape(dst.shape))
            base += size


def _write_block(tensors: KVCacheTensors, group_idx: int, block_id: int, data: memoryview) -> None:
    """Overwrite a whole block with ``data`` (a worker thread)."""
    _BlockBytes(tensors.block_view(group_idx, block_id)).write(data)


def _lower_priority(priority: str = "idle") -> None:
    """A data-plane worker thread yields the CPU to the event loop's thread (Linux scheduling
    policy and nice are per thread; nothing where neither is supported).

    Args:
        priority: ``idle``: the thread's policy becomes ``SCHED_IDLE`` (it runs only on CPU time no
            normal thread wants: beside 16 + 16 streams of 64 MiB on 2 cores a scheduler's p99 was
            0.6-0.8x that of the same machine with every CPU merely busy, against about 1x under
            ``nice``; BENCHMARKS.md, issue 24). Its cost: the streams get almost nothing while
            every core is busy with other work (CFS weight 3 against 1,024 for a nice-0 thread).
            Falls back to ``nice`` where ``SCHED_IDLE`` is unavailable. ``nice``: the thread's
            nice value becomes :data:`WORKER_NICE` above the thread that started it (at most 19;
            weight about 110 against 1,024). Relative, not absolute: a server started under
            ``nice -n 19`` whose workers were set to nice 10 would run them *ahead* of its loop
            (root may lower a nice value).
    """
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
            return
        except OSError:
            pass
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))


def _stage(staging: bytearray, offset: int, data: bytes, hasher: Any) -> None:
    """Copy a write chunk into the block being assembled and feed its checksum (a worker thread)."""
    memoryview(staging)[offset : offset + len(data)] = data
    hasher.update(data)


def _read_chunk(tensors: KVCacheTensors, start: int, end: int, hasher: Any, fields: dict[str, Any]) -> bytes:
    """Bytes ``[start, end)`` of block ``fields["block_id"]`` of group ``fields["group_idx"]`` as a
    serialized ReadBlocksChunk with ``fields``, the checksum on the block's last chunk (a worker
    thread: the views, copy, hash and serialization release the loop)."""
    block = _BlockBytes(tensors.block_view(fields["group_idx"], fields["block_id"]))
    pieces = block.pieces(start, end) if end > start else None
    if pieces is None:
        data = block.read(start, end)
        hasher.update(data)
        message = pb.ReadBlocksChunk(offset_bytes=start, data=data, **fields)
        if end == block.total:
            message.checksum = hasher.intdigest()
        return message.SerializeToString()
    # Serialized by hand, in field order (the bytes SerializeToString makes of the message above):
    # the block's bytes copied once, by the join, not three times (out of the tensor, into the
    # message, out of it).
    for piece in pieces:
        hasher.update(piece)
    head = pb.ReadBlocksChunk(offset_bytes=start, **fields).SerializeToString()
    head += _READ_DATA_FIELD + varint(end - start)
    tail = pb.ReadBlocksChunk(checksum=hasher.intdigest()).SerializeToString() if end == block.total else b""
    return b"".join((head, *pieces, tail))


_READ_DATA_FIELD = b"\x2a"  # ReadBlocksChunk.data: field 5, length-delimited


# -- the service ---------------------------------------------------------------------------------


class DataPlane:
    """The data-plane RPCs of one server (see the module docstring for the rules).

    Args:
        engine: the cache manager and its request table (read, never changed).
        tensors: the KV tensors.
        epoch: the server epoch.
        shm: the shared-memory allocator holding CPU tensors (None on CUDA or meta).
        chunk_bytes: the largest data chunk, in bytes (the ``data_chunk_bytes`` setting).
        attach_requires_local: refuse AttachKVCache to peers other than loopback or the Unix
            socket (auth off).
        max_streams: data streams (WriteBlocks and ReadBlocks) open at once (the
            ``max_data_streams`` setting).
        stalled_timeout_s: how long a stream may wait on its client (a read not taken, a next
            chunk not sent) before it is cut, seconds (the ``stalled_write_timeout_s`` setting).
        worker_priority: the copy threads' CPU priority, ``idle`` or ``nice``
            (:func:`_lower_priority`; the ``data_worker_priority`` setting).
        window_bytes: the HTTP/2 receive window of each stream the server reads, in bytes (the
            ``stream_window_bytes`` setting, as in force): what a client may have in flight when
            its write stream is refused (the servicer drains that much before the status).

    Attributes:
        num_blocks_written, num_bytes_written, num_blocks_read, num_bytes_read: totals since start.
        num_blocks_marked_in_place, num_marks_skipped: blocks schedulers reported complete in the
            attached memory (ManagerStep ``written_blocks``), marked and skipped, since start.
        num_open_streams: data streams open now.
        buffered_bytes: bytes the open streams hold in the server now (blocks being assembled,
            chunks being copied or written), beyond what gRPC holds for them.
        num_streams_refused: streams refused at ``max_streams``.
        num_streams_cut: streams cut by ``stalled_timeout_s``, by direction (``read``, ``write``).
    """

    def __init__(
        self,
        engine: KVCacheEngine,
        tensors: KVCacheTensors,
        *,
        epoch: str,
        shm: Any | None,
        chunk_bytes: int,
        attach_requires_local: bool,
        max_streams: int = 64,
        stalled_timeout_s: float = 30.0,
        worker_priority: str = "idle",
        window_bytes: int = 2 << 20,
    ) -> None:
        if worker_priority not in DATA_WORKER_PRIORITIES:
            raise ValueError(
                f"worker_priority must be one of {', '.join(DATA_WORKER_PRIORITIES)}; got {worker_priority!r}"
            )
        self.worker_priority = worker_priority
        self.engine = engine
        self.tensors = tensors
        self.epoch = epoch
        self.shm = shm
        self.chunk_bytes = chunk_bytes
        self.window_bytes = window_bytes
        self.attach_requires_local = attach_requires_local
        self.has_memory = tensors.device_type != "meta"
        self._pool = engine.manager.block_pool
        self._coordinator = engine.manager.coordinator
        self._num_groups = tensors.num_groups
        self._num_blocks = tensors.num_blocks
        # block id -> (request it was allocated to for computing, that admission's allocation id,
        # group_idx, position in its block table).
        self._allocated_to: list[tuple[Request, int, int, int] | None] = [None] * self._num_blocks
        # block id -> BLOCK_NOT_WRITTEN / BLOCK_PARTIAL / BLOCK_WRITTEN since that allocation.
        self.byte_state = bytearray(self._num_blocks)
        tier = getattr(engine, "tier", None)
        if tier is not None and self.has_memory:
            # A tier's put (docs/tier.md) writes its blocks before their hashes are cached: reserved
            # blocks have no bytes of their own, committed ones are complete (written).
            tier.on_blocks_reserved = self.note_tier_reserved
            tier.on_blocks_stored = self.note_tier_stored
        self._attach: pb.AttachKVCacheResponse | None = None
        self.num_blocks_written = 0
        self.num_bytes_written = 0
        self.num_blocks_marked_in_place = 0
        self.num_marks_skipped = 0
        self.num_blocks_read = 0
        self.num_bytes_read = 0
        self.max_streams = max_streams
        self.stalled_timeout_s = stalled_timeout_s
        self.num_open_streams = 0
        self.buffered_bytes = 0
        self.num_streams_refused = 0
        self.num_streams_cut = {"read": 0, "write": 0}
        self._executor: ThreadPoolExecutor | None = None
        # Copies into blocks in flight (block id -> done when the copy ended), and per block a count
        # bumped when such a copy starts and ends (a read by hash compares it around its copy).
        self._copying: dict[int, asyncio.Future[None]] = {}
        self._copy_gen = [0] * self._num_blocks

    # -- streams, threads, bounds ------------------------------------------------------------------

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        """One open data stream, counted against ``max_streams``.

        Raises:
            DataPlaneError: RESOURCE_EXHAUSTED naming ``max_data_streams`` at the bound.
        """
        if self.num_open_streams >= self.max_streams:
            self.num_streams_refused += 1
            raise DataPlaneError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_data_streams: {self.max_streams} data streams (WriteBlocks, ReadBlocks) are open already; "
                "wait for one to end or raise max_data_streams",
            )
        self.num_open_streams += 1
        try:
            yield
        finally:
            self.num_open_streams -= 1

    @contextlib.contextmanager
    def _holding(self, num_bytes: int) -> Iterator[None]:
        """Count ``num_bytes`` in :attr:`buffered_bytes` while the block runs."""
        self.buffered_bytes += num_bytes
        try:
            yield
        finally:
            self.buffered_bytes -= num_bytes

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                DATA_THREADS,
                thread_name_prefix="kvservice-data",
                initializer=_lower_priority,
                initargs=(self.worker_priority,),
            )
        return self._executor.submit(fn, *args)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a data-plane worker thread (a cancelled caller leaves it to finish)."""
        return await asyncio.wrap_future(self._submit(fn, *args))

    async def close(self) -> None:
        """Stop the worker threads (copies in progress finish first)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    async def _copy_into_block(
        self, group_idx: int, block_id: int, data: memoryview, check: Callable[[], None]
    ) -> None:
        """Copy a whole block's bytes into ``block_view(group_idx, block_id)`` on a worker thread,
        the block marked as being copied into until the copy ended (even if the caller is
        cancelled meanwhile). A copy of the same block already in flight is waited for first;
        ``check`` (the write rule) runs on the loop right before the copy starts.

        Raises:
            DataPlaneError: as ``check``.
        """
        while (pending := self._copying.get(block_id)) is not None:
            await asyncio.shield(pending)
        check()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._copying[block_id] = done
        self._copy_gen[block_id] += 1

        def ended() -> None:
            self._copy_gen[block_id] += 1
            del self._copying[block_id]
            done.set_result(None)

        def on_done(_: Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing waits
                loop.call_soon_threadsafe(ended)

        copy = self._submit(_write_block, self.tensors, group_idx, block_id, data)
        copy.add_done_callback(on_done)
        await asyncio.shield(asyncio.wrap_future(copy))

    async def _stage(self, staging: bytearray, offset: int, data: bytes, hasher: Any) -> None:
        """:func:`_stage`, on a worker thread unless ``data`` is small."""
        if len(data) <= INLINE_BYTES:
            _stage(staging, offset, data, hasher)
        else:
            with self._holding(len(data)):
                await self._off_loop(_stage, staging, offset, data, hasher)

    async def _chunks_until_stalled(
        self, chunks: AsyncIterator[pb.WriteBlocksChunk]
    ) -> AsyncIterator[pb.WriteBlocksChunk]:
        """``chunks``, cut with :class:`DataStreamStalled` when the next one takes over ``stalled_timeout_s``."""
        timer = _StallTimer(self.stalled_timeout_s)
        iterator = chunks.__aiter__()
        while True:
            try:
                with timer.armed():
                    chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not timer.fired:
                    raise
                self.num_streams_cut["write"] += 1
                raise DataStreamStalled(
                    f"stream cut: no chunk within stalled_write_timeout_s {self.stalled_timeout_s:g} s (the client "
                    "stopped sending); blocks completed before it stay written, nothing of the block in progress is"
                ) from None
            yield chunk

    async def _send(self, write: Callable[[bytes], Any], timer: _StallTimer, data: bytes) -> None:
        """``write(data)``, cut with :class:`DataStreamStalled` when it takes over ``stalled_timeout_s``."""
        try:
            with timer.armed():
                await write(data)
        except asyncio.CancelledError:
            if not timer.fired:
                raise
            self.num_streams_cut["read"] += 1
            raise DataStreamStalled(
                f"stream cut: a chunk was not taken within stalled_write_timeout_s {self.stalled_timeout_s:g} s (the "
                "client is not reading)"
            ) from None

    # -- bookkeeping (called by the servicer) ----------------------------------------------------

    def note_allocated(self, request_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Record the blocks ``AllocateSlots`` just gave ``request_id`` for computing (per group,
        appended to its block table): these, and only these, it may write, in its current
        allocation; their bytes are *not written* from now on. Nothing on meta, where no block is
        ever written or read (every data-plane call is refused there before it asks)."""
        if not self.has_memory or not any(new_block_ids):
            return
        request = self.engine.requests[request_id]
        allocation_id = request.allocation_id
        tables = self._coordinator.get_blocks(request_id)
        allocated_to, byte_state = self._allocated_to, self.byte_state
        for g, ids in enumerate(new_block_ids):
            for position, block_id in enumerate(ids, len(tables[g]) - len(ids)):
                allocated_to[block_id] = (request, allocation_id, g, position)
                byte_state[block_id] = BLOCK_NOT_WRITTEN

    def note_tier_reserved(self, block_ids: list[int]) -> None:
        """Blocks a tier's put reservation took: no request computes them; *not written*."""
        for block_id in block_ids:
            self._allocated_to[block_id] = None
            self.byte_state[block_id] = BLOCK_NOT_WRITTEN

    def note_tier_stored(self, block_ids: list[int]) -> None:
        """Blocks a tier's commit cached: their putter wrote them whole (through the memory or
        PutBlocks) before committing; *written*, final."""
        for block_id in block_ids:
            self.byte_state[block_id] = BLOCK_WRITTEN

    def check_written_in_place(self, written: Sequence[pb.WrittenBlocks], epoch: str) -> None:
        """Check a ManagerStep's ``written_blocks`` whole, before anything of the step runs.

        Raises:
            DataPlaneError: FAILED_PRECONDITION without KV memory or on another ``written_epoch``;
                INVALID_ARGUMENT naming ``written_epoch`` (not set, longer than
                :data:`~kvservice.server.event_log.MAX_EPOCH_BYTES`) or ``written_blocks[i]`` and its
                field (no request id, an allocation id of 0, more groups than the server's, a block
                id out of range).
        """
        if not written:
            return
        if not self.has_memory:
            raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, f"written_blocks: {NO_MEMORY}")
        if not epoch:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "written_epoch: must be set with written_blocks (the epoch of their allocation ids: "
                "ManagerStepResponse.epoch)",
            )
        self._check_epoch("written_epoch", epoch, "the allocations are gone); nothing was run")
        num_blocks = self._num_blocks
        for i, entry in enumerate(written):
            where = f"written_blocks[{i}]"
            if not entry.request_id:
                raise DataPlaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.request_id: must be set")
            if entry.allocation_id == 0:
                raise DataPlaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.allocation_id: must be >= 1")
            if len(entry.block_ids) > self._num_groups:
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.block_ids: {len(entry.block_ids)} groups; the server has {self._num_groups}",
                )
            for g, ids in enumerate(entry.block_ids):
                for j, block_id in enumerate(ids.block_ids):
                    if not 1 <= block_id < num_blocks:
                        raise DataPlaneError(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{where}.block_ids[{g}].block_ids[{j}]: {block_id} is out of range [1, {num_blocks}) "
                            "(0 is the null block)",
                        )

    def mark_written_in_place(self, written: Sequence[pb.WrittenBlocks]) -> tuple[int, int]:
        """Mark the blocks of a checked ``written_blocks`` (:meth:`check_written_in_place`)
        *written*: ``(marked, skipped)``, in blocks.

        A reported block is complete (every token of it computed by a finished forward pass), so
        it is *written*, final, whether or not it carries its hash yet: under async scheduling the
        caching that gives it its hash may come in the same step, after the marks. A block its
        request may not write now (the write rule: freed, preempted or admitted again since, no
        longer at its position, already written, being copied into) is skipped, not refused: the
        report is about bytes the scheduler knows complete, the server knows who still owns them.
        """
        marked = skipped = 0
        byte_state, allocated_to = self.byte_state, self._allocated_to
        for entry in written:
            for g, ids in enumerate(entry.block_ids):
                for block_id in ids.block_ids:
                    writer = self._writer(g, block_id)
                    owner = allocated_to[block_id]
                    if (
                        writer is None
                        or owner is None
                        or writer.request_id != entry.request_id
                        or owner[1] != entry.allocation_id
                        or byte_state[block_id] == BLOCK_WRITTEN
                        or block_id in self._copying
                    ):
                        skipped += 1
                        continue
                    byte_state[block_id] = BLOCK_WRITTEN
                    marked += 1
        self.num_blocks_marked_in_place += marked
        self.num_marks_skipped += skipped
        return marked, skipped

    # -- rules -------------------------------------------------------------------------------------

    def _writer(self, group_idx: int, block_id: int) -> Request | None:
        """The running request that may still write the block, or None."""
        entry = self._allocated_to[block_id]
        if entry is None:
            return None
        request, allocation_id, g, position = entry
        if g != group_idx or self.engine.requests.get(request.request_id) is not request:
            return None
        if request.allocation_id != allocation_id or request.request_id not in self.engine.running:
            return None
        table = self._coordinator.get_blocks(request.request_id)[g]
        if position >= len(table) or table[position] is not self._pool.blocks[block_id]:
            return None
        return request

    def readable_by_hash(self, block_id: int) -> bool:
        """Whether a cached block's bytes may be read under its hash now: *written* (final) and no
        WriteBlocks copy into it in flight. The one rule of ReadBlocks by hash, LookupBlocks and
        LeaseBlocks: a block allocated for computing (its hash registered before its bytes exist)
        or freed before it was written is never read, looked up or leased as present."""
        return self.byte_state[block_id] == BLOCK_WRITTEN and block_id not in self._copying

    def _check_epoch(self, field: str, epoch: str, gone: str) -> None:
        """Raise unless ``epoch`` (set) is this server's; the refusal quotes it, so it is bounded first.

        Raises:
            DataPlaneError: INVALID_ARGUMENT naming ``field`` when longer than
                :data:`~kvservice.server.event_log.MAX_EPOCH_BYTES`; FAILED_PRECONDITION naming it
                when another epoch (``gone`` says what the restart took).
        """
        if len(epoch.encode()) > MAX_EPOCH_BYTES:
            raise DataPlaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: longer than {MAX_EPOCH_BYTES} bytes")
        if epoch != self.epoch:
            raise DataPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{field}: {epoch!r} is not this server's epoch {self.epoch!r} (the server restarted: {gone}",
            )

    def _check_allocation(self, where: str, request_id: str, allocation_id: int, epoch: str) -> None:
        """Raise unless a write naming ``allocation_id`` and ``epoch`` (both or neither) is for the
        current allocation of ``request_id`` in this epoch (nothing to check without them).

        Raises:
            DataPlaneError: INVALID_ARGUMENT naming the field when only one of the two is set;
                INVALID_ARGUMENT naming the epoch when longer than
                :data:`~kvservice.server.event_log.MAX_EPOCH_BYTES`; FAILED_PRECONDITION naming the
                epoch or the allocation id that is stale.
        """
        if not allocation_id and not epoch:
            return
        if not allocation_id or not epoch:
            field, other = ("allocation_id", "epoch") if epoch else ("epoch", "allocation_id")
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{where}.{field}: must be set with {other} (both or neither)"
            )
        self._check_epoch(f"{where}.epoch", epoch, f"allocation {allocation_id} is gone); nothing was written")
        request = self.engine.requests.get(request_id)
        current = request.allocation_id if request is not None and request_id in self.engine.running else 0
        if allocation_id != current:
            now = f"its allocation is {current}" if current else "it is not running"
            raise DataPlaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}.allocation_id: {allocation_id} is not request {request_id!r}'s current allocation ({now}): "
                "the stream was begun for an earlier admission of that request id; nothing was written",
            )

    def _check_writable(self, request_id: str, group_idx: int, block_id: int) -> None:
        """Raise FAILED_PRECONDITION naming the block unless ``request_id`` may write it now."""
        writer = self._writer(group_idx, block_id)
        where = f"block {block_id} (group {group_idx})"
        if writer is not None and writer.request_id == request_id:
            if self.byte_state[block_id] != BLOCK_WRITTEN:
                return
            block_hash = self._pool.blocks[block_id].block_hash
            named = f" (block hash {block_hash.hex()})" if block_hash is not None else ""
            reason = f"already written{named}: a written block's bytes are final"
        elif request_id not in self.engine.running:
            reason = f"request {request_id!r} is not running (unknown, waiting or freed)"
        else:
            entry = self._allocated_to[block_id]
            request = self.engine.requests.get(request_id)
            owned = (
                entry is not None
                and request is not None
                and entry[0] is request
                and entry[1] == request.allocation_id
                and entry[2] == group_idx
            )
            if not owned:
                reason = (
                    f"it was not allocated to request {request_id!r} for computing (not its block, or part of its "
                    "prefix-cache hit)"
                )
            else:
                reason = f"request {request_id!r} no longer holds it at the position it was allocated at"
        raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {reason}; nothing was written")

    def _mark_written(self, block_id: int) -> None:
        """The block's bytes were just written whole: *written* (final) when it carries its hash,
        else *partial*."""
        self.byte_state[block_id] = (
            BLOCK_WRITTEN if self._pool.blocks[block_id].block_hash is not None else BLOCK_PARTIAL
        )

    def _check_group(self, field: str, group_idx: int) -> None:
        if not 0 <= group_idx < self._num_groups:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {group_idx} is out of range [0, {self._num_groups})"
            )

    def _check_memory(self) -> None:
        if not self.has_memory:
            raise DataPlaneError(grpc.StatusCode.FAILED_PRECONDITION, NO_MEMORY)

    # -- AttachKVCache ----------------------------------------------------------------------------

    def attach(self, peer: str) -> pb.AttachKVCacheResponse:
        """The AttachKVCache answer.

        Raises:
            DataPlaneError: FAILED_PRECONDITION on meta; PERMISSION_DENIED for a peer that is
                neither loopback nor the Unix socket while auth is off.
        """
        self._check_memory()
        if self.attach_requires_local and not _peer_is_local(peer):
            raise DataPlaneError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"AttachKVCache: with auth off only loopback or Unix-socket peers may attach; peer is {peer}",
            )
        if self._attach is None:
            self._attach = describe_memory(self.tensors, epoch=self.epoch, shm=self.shm, chunk_bytes=self.chunk_bytes)
        return self._attach

    # -- WriteBlocks ------------------------------------------------------------------------------

    async def write_blocks(self, chunks: AsyncIterator[pb.WriteBlocksChunk]) -> pb.WriteBlocksResponse:
        """Apply a WriteBlocks stream (see the proto's WriteBlocksChunk for the rules); the stream
        holds one block being assembled (counted in :attr:`buffered_bytes`) and one chunk.

        Raises:
            DataPlaneError: INVALID_ARGUMENT naming the field of a bad chunk; FAILED_PRECONDITION
                naming a block its request may not write; RESOURCE_EXHAUSTED at
                ``max_data_streams``; DEADLINE_EXCEEDED (:class:`DataStreamStalled`) when the next
                chunk takes over ``stalled_write_timeout_s``; blocks completed before stay written.
        """
        self._check_memory()
        with self._stream():
            held = [0]  # bytes of the block being assembled, counted in buffered_bytes
            try:
                return await self._write_blocks(self._chunks_until_stalled(chunks), held)
            finally:
                self.buffered_bytes -= held[0]

    async def _write_blocks(
        self, chunks: AsyncIterator[pb.WriteBlocksChunk], held: list[int]
    ) -> pb.WriteBlocksResponse:
        num_blocks = num_bytes = 0
        staging: bytearray | None = None
        current: tuple[str, int, int] | None = None  # (request_id, group_idx, block_id) being received
        allocation: tuple[int, str] = (0, "")  # (allocation_id, epoch) of the block being received
        received = 0
        hasher = xxhash.xxh3_64()
        size = 0
        index = -1
        async for chunk in chunks:
            index += 1
            where = f"chunks[{index}]"
            if current is None:
                if not chunk.request_id:
                    raise DataPlaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.request_id: must be set")
                limit = self.engine.limits.max_request_id_bytes
                if len(chunk.request_id.encode()) > limit:  # as the engine's rule: no request has such an id
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.request_id: longer than {limit} bytes (max_request_id_bytes)",
                    )
                self._check_group(f"{where}.group_idx", chunk.group_idx)
                if not 1 <= chunk.block_id < self._num_blocks:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.block_id: {chunk.block_id} is out of range [1, {self._num_blocks}) (0 is the null block)",
                    )
                if chunk.offset_bytes != 0:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.offset_bytes: {chunk.offset_bytes}; a block's first chunk starts at 0",
                    )
                self._check_allocation(where, chunk.request_id, chunk.allocation_id, chunk.epoch)
                self._check_writable(chunk.request_id, chunk.group_idx, chunk.block_id)
                if chunk.in_memory:
                    num_blocks += self._commit_in_memory(where, chunk)
                    continue
                current = (chunk.request_id, chunk.group_idx, chunk.block_id)
                allocation = (chunk.allocation_id, chunk.epoch)
                size = self.tensors.bytes_per_block(chunk.group_idx)
                if staging is None or len(staging) < size:
                    staging = bytearray(size)
                    self.buffered_bytes += size - held[0]
                    held[0] = size
                received = 0
                hasher.reset()
            else:
                if (chunk.request_id, chunk.group_idx, chunk.block_id) != current:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}: block {chunk.block_id} (group {chunk.group_idx}) starts before block {current[2]} "
                        f"(group {current[1]}) is complete ({received} of {size} bytes); nothing of block {current[2]} "
                        "was written",
                    )
                if chunk.in_memory:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.in_memory: set inside block {current[2]}'s chunks (an in-memory mark is a block's "
                        "only chunk); nothing of it was written",
                    )
                if (chunk.allocation_id, chunk.epoch) != allocation:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.allocation_id: {chunk.allocation_id} (epoch {chunk.epoch!r}) differs from block "
                        f"{current[2]}'s first chunk ({allocation[0]}, epoch {allocation[1]!r}); nothing of it was written",
                    )
                if chunk.offset_bytes != received:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.offset_bytes: {chunk.offset_bytes}, expected {received} (chunks of a block are "
                        "consecutive)",
                    )
            data = chunk.data
            if not 1 <= len(data) <= self.chunk_bytes:
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.data: {len(data)} bytes; must be 1..{self.chunk_bytes} (max_data_chunk_bytes)",
                )
            if received + len(data) > size:
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.data: {len(data)} bytes at offset {received} run past the block's {size} bytes "
                    f"(bytes_per_block of group {current[1]})",
                )
            assert staging is not None
            await self._stage(staging, received, data, hasher)
            received += len(data)
            if received < size:
                if chunk.HasField("checksum"):
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.checksum: set on a chunk that does not complete the block ({received} of {size} bytes)",
                    )
                continue
            request_id, group_idx, block_id = current
            if not chunk.HasField("checksum"):
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.checksum: required on the chunk that completes block {block_id}; nothing of it was written",
                )
            if chunk.checksum != hasher.intdigest():
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.checksum: {chunk.checksum:#018x} does not match block {block_id}'s bytes "
                    f"(xxh3_64 {hasher.intdigest():#018x}); nothing of it was written",
                )

            # The request may have been freed (or freed and admitted again), or the block written,
            # while chunks streamed: check again right before the copy starts (the block is marked as
            # being copied into until it ended: see the module docstring), and after it before the
            # block is marked written (a free during the copy leaves the block unwritten).
            def check(
                where: str = where,
                allocation: tuple[int, str] = allocation,
                group_idx: int = group_idx,
                block_id: int = block_id,
                request_id: str = request_id,
            ) -> None:
                self._check_allocation(where, request_id, *allocation)
                self._check_writable(request_id, group_idx, block_id)

            await self._copy_into_block(group_idx, block_id, memoryview(staging)[:size], check)
            check()
            self._mark_written(block_id)
            num_blocks += 1
            num_bytes += size
            current = None
        if current is not None:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunks: the stream ended inside block {current[2]} (group {current[1]}) after {received} of {size} "
                "bytes; nothing of it was written",
            )
        self.num_blocks_written += num_blocks
        self.num_bytes_written += num_bytes
        return pb.WriteBlocksResponse(num_blocks_written=num_blocks, num_bytes_written=num_bytes)

    def _commit_in_memory(self, where: str, chunk: pb.WriteBlocksChunk) -> int:
        """Mark a block stored through the attached memory written (its write rule already checked):
        1, the block counted.

        Raises:
            DataPlaneError: INVALID_ARGUMENT when the chunk carries data, or its checksum does not
                match the memory (nothing marked).
        """
        if chunk.data:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.data: {len(chunk.data)} bytes with in_memory set (the bytes are in the memory already)",
            )
        if chunk.HasField("checksum"):
            block = _BlockBytes(self.tensors.block_view(chunk.group_idx, chunk.block_id))
            actual = block_checksum(block.read(0, block.total))
            if actual != chunk.checksum:
                raise DataPlaneError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.checksum: {chunk.checksum:#018x} does not match block {chunk.block_id}'s bytes in memory "
                    f"(xxh3_64 {actual:#018x}); nothing was marked written",
                )
        self._mark_written(chunk.block_id)
        return 1

    # -- ReadBlocks -------------------------------------------------------------------------------

    async def _resolve_in_slices(self, request: pb.ReadBlocksRequest) -> list[tuple[int, int, bytes | None, Any]]:
        """:meth:`_resolve` of every block, :data:`RESOLVE_SLICE` at a time with a yield to the loop
        between two slices (each chunk checks its block again, so a block that changes meanwhile is
        caught as it would be mid-stream)."""
        resolved = self._resolve(request, 0, RESOLVE_SLICE)
        for start in range(RESOLVE_SLICE, len(request.blocks), RESOLVE_SLICE):
            await asyncio.sleep(0)
            resolved += self._resolve(request, start, start + RESOLVE_SLICE)
        return resolved

    def _resolve(
        self, request: pb.ReadBlocksRequest, start: int = 0, stop: int | None = None
    ) -> list[tuple[int, int, bytes | None, Any]]:
        """Per requested block of ``blocks[start:stop]``: (group_idx, block_id, block hash or None,
        residency token); block id 0 for a block read by hash that cannot be read now when the
        request sets ``missing_ok`` (answered ``missing``).

        Raises:
            InvalidArgumentError: (INVALID_ARGUMENT) a hash not of the server's digest length
                (:meth:`TierStore.check_block_hash`), even under ``missing_ok``.
            DataPlaneError: INVALID_ARGUMENT (a field out of range), NOT_FOUND (a hash not cached),
                FAILED_PRECONDITION (a block read by hash that its computing request may still write,
                or that a WriteBlocks copy is writing now); the last two not under ``missing_ok``.
        """
        if len(request.blocks) > MAX_READ_BLOCKS:
            raise DataPlaneError(
                grpc.StatusCode.INVALID_ARGUMENT, f"blocks: {len(request.blocks)} blocks, above {MAX_READ_BLOCKS}"
            )
        resolved: list[tuple[int, int, bytes | None, Any]] = []
        tier = self.engine.tier  # its hash rule: a hash of another length is named (InvalidArgumentError)
        for i, ref in enumerate(request.blocks[start:stop], start):
            where = f"blocks[{i}]"
            self._check_group(f"{where}.group_idx", ref.group_idx)
            which = ref.WhichOneof("block")
            if which == "block_id":
                if not 0 <= ref.block_id < self._num_blocks:
                    raise DataPlaneError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}.block_id: {ref.block_id} is out of range [0, {self._num_blocks})",
                    )
                if self.byte_state[ref.block_id] == BLOCK_NOT_WRITTEN:
                    raise DataPlaneError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{where}.block_id: block {ref.block_id} is not written yet (nobody wrote it since it was "
                        "allocated): its memory holds no bytes of its own",
                    )
                resolved.append((ref.group_idx, ref.block_id, None, None))
            elif which == "block_hash":
                if tier is not None:
                    tier.check_block_hash(f"{where}.block_hash", ref.block_hash)
                copies = self._pool.get_cached_blocks(ref.block_hash, ref.group_idx)
                block = next((b for b in copies if self.byte_state[b.block_id] == BLOCK_WRITTEN), None)
                if block is None or not self.readable_by_hash(block.block_id):
                    if request.missing_ok:  # answered with one `missing` chunk (block id 0)
                        resolved.append((ref.group_idx, 0, ref.block_hash, None))
                        continue
                    if not copies:
                        raise DataPlaneError(
                            grpc.StatusCode.NOT_FOUND,
                            f"{where}.block_hash: {ref.block_hash.hex()} is not cached in group {ref.group_idx}",
                        )
                    if block is None:
                        raise DataPlaneError(
                            grpc.StatusCode.FAILED_PRECONDITION, self._not_written(where, ref, copies[0])
                        )
                    raise DataPlaneError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{where}.block_hash: {ref.block_hash.hex()} is block {block.block_id}, which a WriteBlocks is "
                        "copying into now",
                    )
                resolved.append((ref.group_idx, block.block_id, ref.block_hash, self._allocated_to[block.block_id]))
            else:
                raise DataPlaneError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: set block_id or block_hash")
        return resolved

    def _not_written(self, where: str, ref: pb.BlockRef, block: Any) -> str:
        """Why a cached block read by hash has no bytes yet (the FAILED_PRECONDITION message)."""
        writer = self._writer(ref.group_idx, block.block_id)
        head = f"{where}.block_hash: {ref.block_hash.hex()} is block {block.block_id}, not written yet"
        if writer is not None:
            return f"{head}: request {writer.request_id!r} computes it (retry once its worker wrote it)"
        return (
            f"{head}: the request that computed it was freed before its bytes were written, so they never will be "
            "(the hash stays cached, unreadable, until evicted)"
        )

    def _still_resident(self, group_idx: int, block_id: int, block_hash: bytes, token: Any) -> bool:
        """Whether the block still carries ``block_hash`` in ``group_idx`` and was not reallocated
        since it was resolved (an eviction followed by the same hash again is a reuse too)."""
        block = self._pool.blocks[block_id]
        return block.block_hash == block_hash and block.group_idx == group_idx and self._allocated_to[block_id] is token

    async def read_blocks(self, request: pb.ReadBlocksRequest, write: Callable[[bytes], Any]) -> None:
        """Stream the blocks of ``request`` through ``write`` (an async callable taking a serialized
        ReadBlocksChunk), at most one chunk being copied and one being written at a time (both
        counted in :attr:`buffered_bytes`).

        Raises:
            DataPlaneError: as :meth:`_resolve`, before anything is sent; RESOURCE_EXHAUSTED at
                ``max_data_streams``; DEADLINE_EXCEEDED (:class:`DataStreamStalled`) when a chunk is
                not taken within ``stalled_write_timeout_s``.
        """
        self._check_memory()
        with self._stream():
            resolved = await self._resolve_in_slices(request)
            timer = _StallTimer(self.stalled_timeout_s)
            chunk_bytes = self.chunk_bytes
            for index, (group_idx, block_id, block_hash, token) in enumerate(resolved):
                if block_hash is not None and not block_id:  # missing_ok: a block read by hash it could not read
                    missing = pb.ReadBlocksChunk(block_index=index, group_idx=group_idx, missing=True)
                    await self._send(write, timer, missing.SerializeToString())
                    continue
                total = self.tensors.bytes_per_block(group_idx)
                hasher = xxhash.xxh3_64()
                fields = {"block_index": index, "group_idx": group_idx, "block_id": block_id}
                offset = 0
                while True:
                    end = min(offset + chunk_bytes, total)
                    with self._holding(2 * (end - offset)):  # the copy, and its serialized message
                        data = await self._read_checked(offset, end, hasher, fields, block_hash, token)
                        if data is None:
                            evicted = pb.ReadBlocksChunk(
                                block_index=index,
                                group_idx=group_idx,
                                block_id=block_id,
                                offset_bytes=offset,
                                evicted=True,
                            )
                            await self._send(write, timer, evicted.SerializeToString())
                            break
                        self.num_bytes_read += end - offset
                        offset = end
                        await self._send(write, timer, data)
                    if offset == total:
                        self.num_blocks_read += 1
                        break

    async def _read_checked(
        self,
        start: int,
        end: int,
        hasher: Any,
        fields: dict[str, Any],
        block_hash: bytes | None,
        token: Any,
    ) -> bytes | None:
        """The serialized chunk of bytes ``[start, end)`` (:func:`_read_chunk`, on a worker thread
        unless small), or None when a block read by hash no longer holds what was resolved: checked
        before the copy and after it (evicted, reallocated, or copied into meanwhile)."""
        block_id, group_idx = fields["block_id"], fields["group_idx"]
        if block_hash is None:  # by id: no promise about what the block holds
            if end - start <= INLINE_BYTES:
                return _read_chunk(self.tensors, start, end, hasher, fields)
            data: bytes = await self._off_loop(_read_chunk, self.tensors, start, end, hasher, fields)
            return data
        if block_id in self._copying or not self._still_resident(group_idx, block_id, block_hash, token):
            return None
        gen = self._copy_gen[block_id]
        if end - start <= INLINE_BYTES:  # no await between the check and the copy
            return _read_chunk(self.tensors, start, end, hasher, fields)
        data = await self._off_loop(_read_chunk, self.tensors, start, end, hasher, fields)
        if self._copy_gen[block_id] != gen or not self._still_resident(group_idx, block_id, block_hash, token):
            return None
        return data
