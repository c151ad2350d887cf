"""KV cache memory in POSIX shared memory, so a worker on the same host maps it without copying.

:class:`SharedMemoryAllocator` is an allocator for :func:`kvservice.memory.allocate_kv_cache_tensors`
(``(num_bytes, device) -> flat uint8 tensor``): each call creates one segment under ``/dev/shm``
and maps it into a torch tensor (``torch.from_file(..., shared=True)``, MAP_SHARED), so the KV
tensors *are* the shared memory and a worker that maps the segment sees the same bytes.

Segments:

- names are ``kvservice-<pid>-<32 random hex digits>`` (:func:`secrets.token_hex`): not guessable,
  and the owner's pid tells a later start whether the owner is still alive;
- created with ``O_CREAT | O_EXCL`` and mode 0600: only the server's user can map them;
- removed (unlinked) by :meth:`SharedMemoryAllocator.close` at shutdown, and by an ``atexit`` hook
  when the process exits without it; mappings already made stay valid until unmapped, so a worker
  never touches freed memory, but it sees a dead server's bytes;
- after a crash (SIGKILL, OOM killer) nothing runs: :func:`remove_stale_segments`, called at every
  start, removes the segments of our name whose pid is no longer alive and that this user owns,
  after marking their control segment closed.

One extra small *control* segment per allocator holds a state byte (1 = open, 2 = closed) and the
server epoch. :meth:`SharedMemoryAllocator.close` (and stale removal) sets it to closed before
unlinking, and a worker's view checks it before every use (``kvservice_client.torch_view``), so a
view of a stopped or restarted server refuses to be used instead of reading memory nobody owns.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import stat
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CONTROL_BYTES",
    "CONTROL_CLOSED",
    "CONTROL_OPEN",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "SharedMemoryAllocator",
    "remove_stale_segments",
]

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared-memory segments live on Linux (``shm_open`` names are files here)."""

SEGMENT_PREFIX = "kvservice-"
"""Every segment this module creates starts with it."""

_SEGMENT_RE = re.compile(r"kvservice-(\d+)-[0-9a-f]{32}-(?:ctl|\d+)")

CONTROL_BYTES = 64
"""Size of a control segment: byte 0 is the state, bytes 8..63 the epoch (ASCII, NUL-padded)."""

CONTROL_OPEN = 1
"""Control state: the server that owns the memory runs."""

CONTROL_CLOSED = 2
"""Control state: the server stopped (or crashed and a later start found it); the memory is gone."""


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (any owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _create_segment(path: Path, num_bytes: int) -> None:
    """Create ``path`` (exclusive, mode 0600) with ``num_bytes`` zero bytes reserved.

    ``posix_fallocate`` reserves the pages now: a full tmpfs fails here with ENOSPC (raised as
    MemoryError) instead of killing the process with SIGBUS at the first write to a sparse page.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit about the mode
        try:
            os.posix_fallocate(fd, 0, num_bytes)
        except OSError as e:
            os.close(fd)
            fd = -1
            os.unlink(path)
            raise MemoryError(
                f"cannot reserve {num_bytes} bytes of shared memory in {path.parent}: {e.strerror}"
            ) from e
    finally:
        if fd >= 0:
            os.close(fd)


def _mark_closed(control_path: Path) -> None:
    """Set a control segment's state byte to closed (no-op when it is gone)."""
    try:
        fd = os.open(control_path, os.O_RDWR)
    except OSError:
        return
    try:
        os.pwrite(fd, bytes([CONTROL_CLOSED]), 0)
    finally:
        os.close(fd)


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the segments a crashed kvservice process of this user left behind.

    A segment is stale when its name is ours (``kvservice-<pid>-<hex>``, control segments
    included), this user owns it, and no process with that pid exists. Control segments are marked
    closed first, so a worker still mapping them refuses further use.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    uid = os.getuid()
    stale = []
    for name in entries:
        match = _SEGMENT_RE.fullmatch(name)
        if match is None:
            continue
        try:
            st = os.stat(shm_dir / name, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or _pid_alive(int(match.group(1))):
            continue
        stale.append(name)
    for name in sorted(stale, key=lambda n: not n.endswith("-ctl")):  # control segments first
        if name.endswith("-ctl"):
            _mark_closed(shm_dir / name)
        try:
            os.unlink(shm_dir / name)
        except OSError:
            continue
        removed.append(name)
    if removed:
        logger.warning("removed %d shared-memory segments of a kvservice process that is gone", len(removed))
    return removed


class SharedMemoryAllocator:
    """Allocates KV cache memory as POSIX shared-memory segments (see the module docstring).

    Call it as the ``allocator`` of :func:`kvservice.memory.allocate_kv_cache_tensors`. Only
    ``cpu`` devices are served.

    Args:
        epoch: the server epoch, written into the control segment (or later, :meth:`set_epoch`).
        shm_dir: the shared-memory directory (``/dev/shm``; tests may pass another tmpfs folder).

    Attributes:
        segments: ``(name, size in bytes, tensor)`` of every segment, in allocation order.
        control_name: the control segment's name.

    Raises:
        OSError: ``shm_dir`` is not writable (at construction: the control segment is made then).
    """

    def __init__(self, epoch: str = "", *, shm_dir: Path = SHM_DIR) -> None:
        self.shm_dir = Path(shm_dir)
        self._token = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.segments: list[tuple[str, int, torch.Tensor]] = []
        self.control_name = f"{self._token}-ctl"
        self._lock = threading.Lock()
        self._closed = False
        path = self.shm_dir / self.control_name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, CONTROL_BYTES)
            os.pwrite(fd, bytes([CONTROL_OPEN]) + bytes(7) + epoch.encode("ascii")[: CONTROL_BYTES - 8], 0)
        finally:
            os.close(fd)
        atexit.register(self.close)

    def set_epoch(self, epoch: str) -> None:
        """Write the server epoch (ASCII, at most 56 characters kept) into the control segment."""
        data = epoch.encode("ascii")[: CONTROL_BYTES - 8]
        fd = os.open(self.shm_dir / self.control_name, os.O_RDWR)
        try:
            os.pwrite(fd, data + bytes(CONTROL_BYTES - 8 - len(data)), 8)
        finally:
            os.close(fd)

    def __call__(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A flat ``uint8`` tensor of ``num_bytes`` bytes in a new segment (zero-filled, not yet
        committed: the caller's zero-fill touches the pages).

        Raises:
            ValueError: ``device`` is not a CPU device, or ``num_bytes < 1``.
            MemoryError: the shared-memory folder has no room for it (ENOSPC).
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
            _create_segment(path, num_bytes)
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
        """Mark the control segment closed and unlink every segment (idempotent). Tensors mapped
        here or in workers stay valid until dropped; the names are gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _mark_closed(self.shm_dir / self.control_name)
        for name, _size, _tensor in self.segments:
            try:
                os.unlink(self.shm_dir / name)
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.shm_dir / self.control_name)
        except FileNotFoundError:
            pass
        atexit.unregister(self.close)
