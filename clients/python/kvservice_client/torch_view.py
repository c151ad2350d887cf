"""Map the server's KV cache memory into this process (needs torch: ``pip install torch``, or
``pip install './clients/python[torch]'`` from a checkout).

``attach(client)`` calls ``AttachKVCache`` and maps what it describes, without copying: CPU memory
lives in POSIX shared-memory segments (``/dev/shm/<name>``, mode 0600: same host, same user),
CUDA memory is opened from its IPC handle (``torch.multiprocessing``'s
``rebuild_cuda_tensor``, same host). The :class:`KVCacheView` it returns gives the same
``block_view(group_idx, block_id)`` as the server's ``KVCacheTensors``: a tuple of tensors sharing
memory with the cache (writing them writes the block), built only from the description, so it
follows whatever layout the server uses.

Rules a worker follows (the server cannot check writes to mapped memory): write only blocks the
manager allocated to a running request for computing (``AllocateSlotsResponse.new_block_ids``),
while the request runs; never a block another request reads from the prefix cache (see
``kvservice.server.data_plane`` for the rule WriteBlocks enforces).

The view carries the server's epoch. Before every use it checks the server's control segment:
once that server stopped, or died however it died (kill -9 included, with no restart), or a
restarted server removed its memory, :meth:`KVCacheView.block_view` raises
:class:`KVCacheViewClosedError` instead of handing out memory that no longer belongs to a running
cache. A stop marks the control segment's state byte closed; a crash marks nothing, so the view
tests the lock a live server holds on the control segment (an exclusive ``flock``, which the kernel
drops when the process ends: ``kvservice.shm``): a non-blocking shared ``flock`` on the view's own
descriptor of it succeeds only when no live server holds it, and is let go at once. (A server's
start removing stale segments in the same microseconds as that test finds the segment locked and
leaves it to the next start; a process forked from the server without exec shares its lock, so the
view reports open until that one exits too.) A tensor taken before that is a plain tensor over the mapping and is not checked: it
keeps reading the old memory without a word, so take views per use, or call :meth:`KVCacheView.check`
before trusting one kept across calls.

Example::

    with KVCacheClient("unix:/run/kvservice.sock", token=worker_token) as client:
        view = attach(client)
        for tensor in view.block_view(0, block_id):
            tensor.fill_(0)
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Sequence

try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(
        "kvservice_client.torch_view maps the server's KV memory as torch tensors and needs torch, which is not "
        "installed: pip install torch (or './clients/python[torch]' from a kvservice checkout); "
        "kvservice_client.data reads and writes blocks as bytes without it",
        name="torch",
    ) from None

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient, Metadata, Timeout
from kvservice_client.data import aattach_kv_cache, attach_kv_cache

__all__ = ["KVCacheView", "KVCacheViewClosedError", "aattach", "attach"]

SHM_DIR = "/dev/shm"
_CONTROL_OPEN = 1
_CONTROL_FORMAT_LOCKED = 1
"""Control segment byte 1: its server holds an exclusive flock on it while it lives
(``kvservice.shm.CONTROL_FORMAT_LOCKED``); 0 (a server from before the lock): no lock to test."""
_LEASE_TABLE_OFFSET = 64
"""Byte offset of the control segment's lease table (``kvservice.shm.LEASE_TABLE_OFFSET``)."""


class KVCacheViewClosedError(RuntimeError):
    """The server whose memory a :class:`KVCacheView` maps has stopped or restarted: attach again."""


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def _map_storage(storage: pb.KVCacheStorage, device: str) -> torch.Tensor:
    """A flat uint8 tensor over one storage (shared, no copy)."""
    if storage.shm_name:
        path = os.path.join(SHM_DIR, storage.shm_name)
        return torch.from_file(path, shared=True, size=storage.size_bytes, dtype=torch.uint8)
    if storage.cuda_ipc_handle:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            (storage.size_bytes,),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            storage.cuda_device,
            storage.cuda_ipc_handle,
            storage.size_bytes,
            storage.cuda_storage_offset_bytes,
            False,
            storage.cuda_ref_counter_handle,
            storage.cuda_ref_counter_offset,
            storage.cuda_event_handle or None,
            storage.cuda_event_sync_required,
        )
        return tensor
    raise ValueError(f"storage {storage.storage_idx} has neither a shared-memory name nor a CUDA IPC handle ({device})")


class KVCacheView:
    """The server's KV cache memory mapped into this process.

    Args:
        description: the ``AttachKVCache`` answer.

    Attributes:
        epoch: the server epoch the memory belongs to.
        device: its device.
        num_blocks: blocks in the pool (ids ``0..num_blocks-1``; 0 is the null block).
        bytes_per_block: per group, bytes a block occupies (all its views).

    Raises:
        OSError: a segment cannot be opened (another host, another user, or the server is gone).
        ValueError: a description this client cannot map.
    """

    def __init__(self, description: pb.AttachKVCacheResponse) -> None:
        self.description = description
        self.epoch = description.epoch
        self.device = description.device
        self.num_blocks = description.num_blocks
        self.bytes_per_block = tuple(description.bytes_per_block)
        self._control: mmap.mmap | None = None
        self._control_fd = -1  # kept open: the descriptor the lock test runs on
        self._server_gone = False
        self._closed = False  # close() was called: nothing of it may be used any more
        self._fence = threading.Lock()  # taken between a copy and the lease check (a memory barrier)
        if description.control_shm_name:
            fd = os.open(os.path.join(SHM_DIR, description.control_shm_name), os.O_RDONLY)
            try:
                # The header and, after it, the lease table (a server from before it: 64 bytes).
                self._control = mmap.mmap(fd, max(64, os.fstat(fd).st_size), prot=mmap.PROT_READ)
            except BaseException:
                os.close(fd)
                raise
            self._control_fd = fd
        storages = [_map_storage(s, description.device) for s in description.storages]
        num_groups = len(description.bytes_per_block)
        group_views: list[list[tuple[int, torch.Tensor, int]]] = [[] for _ in range(num_groups)]
        for v in description.views:
            base = storages[v.storage_idx]
            dtype = _torch_dtype(v.dtype)
            if v.offset_bytes % dtype.itemsize:
                raise ValueError(
                    f"view ({v.group_idx}, {v.view_idx}): offset {v.offset_bytes} is not a multiple of "
                    f"{dtype.itemsize} bytes"
                )
            tensor = torch.as_strided(
                base.view(dtype), tuple(v.shape), tuple(v.strides), v.offset_bytes // dtype.itemsize
            )
            group_views[v.group_idx].append((v.view_idx, tensor, v.block_axis))
        self._groups: tuple[tuple[tuple[torch.Tensor, int], ...], ...] = tuple(
            tuple((t, axis) for _idx, t, axis in sorted(views, key=lambda x: x[0])) for views in group_views
        )
        self._storages = storages

    @property
    def storages(self) -> tuple[torch.Tensor, ...]:
        """The mapped storages, each a flat uint8 tensor over the server's memory (index =
        ``storage_idx``): what a worker views its own way (``kvservice_vllm.Worker`` builds
        vLLM's KV cache views over it). Not checked against the server's stop: see :meth:`check`."""
        return tuple(self._storages)

    @property
    def num_groups(self) -> int:
        """KV cache groups."""
        return len(self._groups)

    @property
    def closed(self) -> bool:
        """Whether the server that owns the memory has stopped, died (kill -9 included) or restarted:
        its control segment says closed, or no live process holds its lock (see the module
        docstring), or this view was closed. False for an open view without a control segment (CUDA)."""
        if self._closed:
            return True
        control = self._control
        if control is None:
            return False
        if self._server_gone or control[0] != _CONTROL_OPEN:
            return True
        if control[1] != _CONTROL_FORMAT_LOCKED:
            return False  # a server from before the lock: only its state byte tells
        try:
            fcntl.flock(self._control_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # the live server holds it
        fcntl.flock(self._control_fd, fcntl.LOCK_UN)
        self._server_gone = True  # a dead server does not come back
        return True

    def check(self) -> None:
        """Raise :class:`KVCacheViewClosedError` when the owning server has stopped, died or
        restarted (:attr:`closed`)."""
        if self.closed:
            raise KVCacheViewClosedError(
                f"the kvservice server of epoch {self.epoch} that owns this KV memory has stopped or restarted "
                "(or died); its memory is no longer the cache: attach again"
            )

    def lease_live(self, lease_slot: int, lease_id: int) -> bool:
        """Whether tier lease ``lease_id`` still holds slot ``lease_slot`` of the control
        segment's lease table (``lease_slot`` of a LeaseBlocks or ReserveBlocks answer, 1-based)
        and its server lives. Call it after a copy made under the lease: the server clears the slot
        before it unpins, frees or caches the lease's blocks, so True means none of them was
        unpinned (let alone reused) before the copy ended: a read lease's copy holds their bytes (no
        ``ReleaseLease`` answer needed), a put lease's reservation held through its copy.

        False for a slot of 0 or outside the table (a server without one), a view without a
        control segment, another lease in the slot (this one ended), or a stopped server.
        """
        control = self._control
        offset = _LEASE_TABLE_OFFSET + 8 * (lease_slot - 1)
        if control is None or lease_slot < 1 or offset + 8 > len(control):
            return False
        with self._fence:  # a full barrier: the copy's reads come before the slot's
            pass
        if int.from_bytes(control[offset : offset + 8], "little") != lease_id:
            return False
        return not self.closed

    def tensors(self, group_idx: int) -> tuple[torch.Tensor, ...]:
        """Group ``group_idx``'s whole tensors (block axis included), as the description gives them.

        Raises:
            KVCacheViewClosedError: the server stopped.
            IndexError: no such group.
        """
        self.check()
        return tuple(t for t, _axis in self._group(group_idx))

    def _group(self, group_idx: int) -> Sequence[tuple[torch.Tensor, int]]:
        if not 0 <= group_idx < len(self._groups):
            raise IndexError(f"group_idx must be in [0, {len(self._groups)}); got {group_idx}")
        return self._groups[group_idx]

    def block_view(self, group_idx: int, block_id: int) -> tuple[torch.Tensor, ...]:
        """Views of block ``block_id`` in each of group ``group_idx``'s tensors, as the server's
        ``KVCacheTensors.block_view`` (same shapes, same memory).

        Raises:
            KVCacheViewClosedError: the server stopped or restarted.
            IndexError: no such group, or ``block_id`` outside ``[0, num_blocks)``.
        """
        self.check()
        views = self._group(group_idx)
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id must be in [0, {self.num_blocks}); got {block_id}")
        return tuple(t.select(axis, block_id) for t, axis in views)

    def block_bytes(self, group_idx: int, block_id: int) -> bytes:
        """A copy of the block's bytes in the wire layout (each view row-major, in order)."""
        return b"".join(
            v.contiguous().view(torch.uint8).cpu().numpy().tobytes() for v in self.block_view(group_idx, block_id)
        )

    def close(self) -> None:
        """Drop the mappings (tensors handed out keep theirs alive until dropped); the view is
        :attr:`closed` from now on."""
        self._closed = True
        self._groups = ()
        self._storages = []
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._control_fd >= 0:
            os.close(self._control_fd)
            self._control_fd = -1

    def __repr__(self) -> str:
        return (
            f"KVCacheView(epoch={self.epoch!r}, device={self.device}, num_groups={len(self._groups)}, "
            f"num_blocks={self.num_blocks})"
        )


def attach(client: KVCacheClient, *, timeout: Timeout = None, metadata: Metadata = None) -> KVCacheView:
    """Attach to the server's KV memory (``AttachKVCache``) and map it.

    Raises:
        KVServiceError: FAILED_PRECONDITION ("no memory behind a meta device"), PERMISSION_DENIED
            (not a worker or scheduler token; or auth off and not over loopback or a Unix socket).
        OSError: the memory cannot be mapped here (another host or user).
    """
    return KVCacheView(attach_kv_cache(client, timeout=timeout, metadata=metadata))


async def aattach(client: AsyncKVCacheClient, *, timeout: Timeout = None, metadata: Metadata = None) -> KVCacheView:
    """:func:`attach` for an :class:`AsyncKVCacheClient`."""
    return KVCacheView(await aattach_kv_cache(client, timeout=timeout, metadata=metadata))
