"""KV cache memory in POSIX shared memory, so a worker on the same host maps it without copying.

:class:`SharedMemoryAllocator` is an allocator for :func:`kvservice.memory.allocate_kv_cache_tensors`
(``(num_bytes, device) -> flat uint8 tensor``): each call creates one segment under ``/dev/shm``
and maps it into a torch tensor (``torch.from_file(..., shared=True)``, MAP_SHARED), so the KV
tensors *are* the shared memory and a worker that maps the segment sees the same bytes.

Segments:

- names are ``kvservice-<pid>-<32 random hex digits>-<n>`` (:func:`secrets.token_hex`): not
  guessable; the pid is the creator's as its own PID namespace sees it, for people reading
  ``ls /dev/shm``, never trusted (in a container the server is PID 1 after every restart, and a
  process in another PID namespace sharing ``/dev/shm`` sees other pids or none);
- created with ``O_CREAT | O_EXCL`` and mode 0600: only the server's user can map them;
- **owned by a lock**: the live allocator holds an exclusive ``flock`` on its control segment (the
  ``-ctl`` one, created first) for as long as it lives. The kernel drops the lock when the last
  descriptor of that open file closes, however the process ends (SIGKILL and the OOM killer
  included), and the lock is on the inode, so every process sharing the tmpfs sees it whatever
  its PID namespace. ``flock``, not POSIX ``fcntl`` locks: those belong to the process, so a second
  allocator in the same process (an embedded replay runs two servers) could not tell a live one,
  and closing any descriptor of the file (the epoch write, a view in the same process) drops them;
- removed (unlinked) by :meth:`SharedMemoryAllocator.close` at shutdown, and by an ``atexit`` hook
  when the process exits without it; mappings already made stay valid until unmapped, so a worker
  never touches freed memory, but it sees a dead server's bytes;
- after a crash nothing runs: :func:`remove_stale_segments`, called at every start, removes exactly
  the segments of this user whose control segment nobody holds locked (it takes the lock itself,
  marks the control segment closed, unlinks the data segments and then the control one, and only
  then lets go), and data segments whose control segment is gone. A live server's segments are
  never removed.

One extra small *control* segment per allocator holds a state byte (1 = open, 2 = closed), a format
byte (1 = its owner holds the flock) and the server epoch, then (from byte :data:`LEASE_TABLE_OFFSET`)
the **lease table**: ``lease_slots`` slots of 8 bytes, each 0 or the id (little-endian) of the
tier lease (read or put) that holds it (``kvservice.core.tier``: a slot is cleared before its lease's
blocks are unpinned, freed or cached, so a copier that finds its lease id in its slot after a copy
knows the lease held through it, with no round trip; ``lease_slot`` of LeaseBlocks' and
ReserveBlocks' answers). :meth:`SharedMemoryAllocator.close` (and
stale removal) sets it to closed before unlinking, and a worker's view checks it before every use
(``kvservice_client.torch_view``), so a view of a stopped or restarted server refuses to be used
instead of reading memory nobody owns. A control segment of format 0 was made by a kvservice from
before the lock (it holds none): for those alone the old rule applies (stale when no process has
the pid of its name), so an upgrade never removes a running older server's memory.

A process forked (without exec) from the server shares the locked open file, so the segments stay
held until it exits too: the descriptor is close-on-exec, so a spawned process never holds it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import threading
from pathlib import Path

import torch

from kvservice.memory import KVCacheAllocationError

logger = logging.getLogger(__name__)

__all__ = [
    "CONTROL_BYTES",
    "CONTROL_CLOSED",
    "CONTROL_FORMAT_LOCKED",
    "CONTROL_OPEN",
    "LEASE_TABLE_OFFSET",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "SharedMemoryAllocator",
    "remove_stale_segments",
]

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared-memory segments live on Linux (``shm_open`` names are files here)."""

SEGMENT_PREFIX = "kvservice-"
"""Every segment this module creates starts with it."""

_SEGMENT_RE = re.compile(r"(kvservice-(\d+)-[0-9a-f]{32})-(ctl|\d+)")

CONTROL_BYTES = 64
"""Size of a control segment: byte 0 is the state, byte 1 the format, bytes 8..63 the epoch (ASCII,
NUL-padded)."""

LEASE_TABLE_OFFSET = CONTROL_BYTES
"""Byte offset of the lease table in a control segment: slot ``k`` (1-based) is the 8 bytes at
``LEASE_TABLE_OFFSET + 8 * (k - 1)``. A control segment of exactly ``CONTROL_BYTES`` has none."""

CONTROL_FORMAT_LOCKED = 1
"""Control format byte: the owner holds an exclusive flock on the control segment while it lives
(0: a kvservice from before the lock, judged by the pid of its name)."""

CONTROL_OPEN = 1
"""Control state: the server that owns the memory runs."""

CONTROL_CLOSED = 2
"""Control state: the server stopped (or crashed and a later start found it); the memory is gone."""


def _free_bytes(shm_dir: Path) -> int | None:
    """Bytes an unprivileged user may still reserve in ``shm_dir`` (``statvfs``: ``f_bavail *
    f_frsize``), or None when it cannot be asked."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _shm_full_error(shm_dir: Path, num_bytes: int, device: torch.device, cause: str) -> KVCacheAllocationError:
    """The error of a shared-memory folder too full for ``num_bytes``: it names the folder and its
    free bytes, never the host's free RAM (a full tmpfs is not a full host)."""
    return KVCacheAllocationError(
        num_bytes,
        _free_bytes(shm_dir),
        device,
        where=f"{shm_dir} (shared memory: {cause}; give it more room, e.g. docker run --shm-size)",
    )


def _create_segment(path: Path, num_bytes: int, device: torch.device) -> None:
    """Create ``path`` (exclusive, mode 0600) with ``num_bytes`` zero bytes reserved.

    ``posix_fallocate`` reserves the pages now: a full tmpfs fails here with ENOSPC instead of
    killing the process with SIGBUS at the first write to a sparse page.

    Raises:
        KVCacheAllocationError: the folder has fewer than ``num_bytes`` free (checked with
            ``statvfs`` first, then ENOSPC from the reservation); the message names the folder and
            its free bytes.
    """
    free = _free_bytes(path.parent)
    if free is not None and num_bytes > free:
        raise _shm_full_error(path.parent, num_bytes, device, "not enough free bytes")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit about the mode
        try:
            os.posix_fallocate(fd, 0, num_bytes)
        except OSError as e:
            os.close(fd)
            fd = -1
            os.unlink(path)
            if e.errno == errno.ENOSPC:
                raise _shm_full_error(path.parent, num_bytes, device, e.strerror or "ENOSPC") from e
            raise MemoryError(
                f"cannot reserve {num_bytes} bytes of shared memory in {path.parent}: {e.strerror}"
            ) from e
    finally:
        if fd >= 0:
            os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take the exclusive flock on ``fd`` without waiting; False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any owner) in this PID namespace (only for control
    segments of format 0, which carry no lock)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owned_by_us(path: Path, uid: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return st.st_uid == uid and stat.S_ISREG(st.st_mode)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the segments a kvservice process of this user that is gone left behind.

    Segments are taken by allocator (the ``kvservice-<pid>-<hex>`` part of the name). One is stale
    when this user owns it and either its control segment nobody holds locked (this call takes the
    lock, so no live allocator can be mistaken for a dead one, whatever the PID namespaces), or its
    control segment is gone. A control segment of format 0 (a kvservice from before the lock) is
    judged by the pid of its name instead. The control segment is marked closed first (so a worker
    still mapping it refuses further use), then the data segments are unlinked, then the control
    segment, and only then the lock is let go: an allocator that locks a control segment after
    this has unlinked it finds the name gone (see :class:`SharedMemoryAllocator`).

    Returns:
        The names removed: per allocator its control segment first, then its data segments.
    """
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    uid = os.getuid()
    by_token: dict[str, list[str]] = {}
    for name in entries:
        match = _SEGMENT_RE.fullmatch(name)
        if match is not None and match.group(3) != "ctl":
            by_token.setdefault(match.group(1), []).append(name)
        elif match is not None:
            by_token.setdefault(match.group(1), [])
    for token, data_names in by_token.items():
        control = shm_dir / f"{token}-ctl"
        try:
            fd = os.open(control, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1  # data segments without their control segment: nobody can own them
        except OSError:
            continue
        try:
            if fd >= 0:
                if not _owned_by_us(control, uid) or not _try_lock(fd):
                    continue  # another user's, or a live allocator holds it
                header = os.pread(fd, 2, 0)
                legacy = len(header) < 2 or header[1] != CONTROL_FORMAT_LOCKED
                if legacy and _pid_alive(int(token.split("-")[1])):
                    continue
                os.pwrite(fd, bytes([CONTROL_CLOSED]), 0)
                if _unlink(control):
                    removed.append(control.name)
            for name in sorted(data_names, key=lambda n: int(n.rsplit("-", 1)[1])):
                if _owned_by_us(shm_dir / name, uid) and _unlink(shm_dir / name):
                    removed.append(name)
        finally:
            if fd >= 0:
                os.close(fd)  # lets go of the lock, after everything of this allocator is gone
    if removed:
        logger.warning("removed %d shared-memory segments of a kvservice process that is gone", len(removed))
    return removed


def _create_control(shm_dir: Path, epoch: str, lease_slots: int = 0) -> tuple[str, int]:
    """Create and lock a control segment (with a lease table of ``lease_slots`` slots):
    ``(token, descriptor holding the lock)``.

    The name is created exclusively, then locked; a :func:`remove_stale_segments` running in
    between may take the lock first (then this one unlinks what it made) or unlink the name before
    this one locks it (then the name no longer names the locked file): both retry with a new token.
    """
    for _attempt in range(8):
        token = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        path = shm_dir / f"{token}-ctl"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if not _try_lock(fd):
            os.close(fd)
            _unlink(path)
            continue
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, LEASE_TABLE_OFFSET + 8 * lease_slots)
        os.pwrite(fd, bytes([CONTROL_OPEN, CONTROL_FORMAT_LOCKED]) + bytes(6) + _epoch_bytes(epoch), 0)
        return token, fd
    raise OSError(errno.EAGAIN, f"could not create a control segment in {shm_dir}: removed 8 times while created")


def _epoch_bytes(epoch: str) -> bytes:
    data = epoch.encode("ascii")[: CONTROL_BYTES - 8]
    return data + bytes(CONTROL_BYTES - 8 - len(data))


class SharedMemoryAllocator:
    """Allocates KV cache memory as POSIX shared-memory segments (see the module docstring).

    Call it as the ``allocator`` of :func:`kvservice.memory.allocate_kv_cache_tensors`. Only
    ``cpu`` devices are served. It holds the flock on its control segment (an open descriptor)
    until :meth:`close`.

    Args:
        epoch: the server epoch, written into the control segment (or later, :meth:`set_epoch`).
        shm_dir: the shared-memory directory (``/dev/shm``; tests may pass another folder).
        lease_slots: slots of the control segment's lease table (the server's
            ``tier_max_leases``; 0: none). It is the tier's lease board
            (:class:`kvservice.core.tier.LeaseBoard`: :meth:`publish_lease`, :meth:`clear_lease`).

    Attributes:
        segments: ``(name, size in bytes, tensor)`` of every segment, in allocation order.
        control_name: the control segment's name.

    Raises:
        OSError: ``shm_dir`` is not writable (at construction: the control segment is made then).
    """

    def __init__(self, epoch: str = "", *, shm_dir: Path = SHM_DIR, lease_slots: int = 0) -> None:
        if lease_slots < 0:
            raise ValueError(f"lease_slots must be >= 0; got {lease_slots}")
        self.shm_dir = Path(shm_dir)
        self.lease_slots = lease_slots
        self._token, self._control_fd = _create_control(self.shm_dir, epoch, lease_slots)
        self.segments: list[tuple[str, int, torch.Tensor]] = []
        self.control_name = f"{self._token}-ctl"
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def set_epoch(self, epoch: str) -> None:
        """Write the server epoch (ASCII, at most 56 characters kept) into the control segment."""
        os.pwrite(self._control_fd, _epoch_bytes(epoch), 8)

    def publish_lease(self, slot: int, lease_id: int) -> None:
        """Slot ``slot`` (1-based) of the lease table holds ``lease_id`` (> 0) from now on."""
        assert 1 <= slot <= self.lease_slots, f"lease slot {slot} outside [1, {self.lease_slots}]"
        assert 0 < lease_id < 1 << 64, f"lease id {lease_id}"
        if not self._closed:
            os.pwrite(self._control_fd, lease_id.to_bytes(8, "little"), LEASE_TABLE_OFFSET + 8 * (slot - 1))

    def clear_lease(self, slot: int) -> None:
        """Slot ``slot`` holds no lease from now on (the write completes before this returns, so
        whatever the caller does next, unpinning the lease's blocks, comes after it)."""
        assert 1 <= slot <= self.lease_slots, f"lease slot {slot} outside [1, {self.lease_slots}]"
        if not self._closed:
            os.pwrite(self._control_fd, bytes(8), LEASE_TABLE_OFFSET + 8 * (slot - 1))

    def __call__(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A flat ``uint8`` tensor of ``num_bytes`` bytes in a new segment (zero-filled, not yet
        committed: the caller's zero-fill touches the pages).

        Raises:
            ValueError: ``device`` is not a CPU device, or ``num_bytes < 1``.
            KVCacheAllocationError: the shared-memory folder has no room for it (its free bytes,
                from ``statvfs``, are in the message).
            OSError: the segment cannot be created otherwise.
        """
        if device.type != "cpu":
            raise ValueError(f"shared memory holds CPU tensors only; device is {device}")
        if num_bytes < 1:
            raise ValueError(f"num_bytes must be >= 1; got {num_bytes}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the allocator is closed")
            name = f"{self._token}-{len(self.segments)}"
            # The index suffix keeps every name unique; stale removal matches the token part.
            path = self.shm_dir / name
            _create_segment(path, num_bytes, device)
            tensor = torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
            self.segments.append((name, num_bytes, tensor))
        return tensor

    def segment_of(self, data_ptr: int) -> tuple[int, int] | None:
        """``(segment index, byte offset)`` of the address ``data_ptr``, or None when no segment
        of this allocator holds it."""
        for idx, (_name, size, tensor) in enumerate(self.segments):
            base = tensor.data_ptr()
            if base <= data_ptr < base + size:
                return idx, data_ptr - base
        return None

    def close(self) -> None:
        """Mark the control segment closed, unlink every segment, then let go of the lock
        (idempotent). Tensors mapped here or in workers stay valid until dropped; the names are
        gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.pwrite(self._control_fd, bytes([CONTROL_CLOSED]), 0)
        for name, _size, _tensor in self.segments:
            _unlink(self.shm_dir / name)
        _unlink(self.shm_dir / self.control_name)
        os.close(self._control_fd)
        atexit.unregister(self.close)
