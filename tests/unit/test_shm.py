"""POSIX shared-memory segments of the KV memory: names, modes, removal at close and after a crash.

Ownership is a flock on the control segment, never a pid: the cases a pid gets wrong (the server is
PID 1 in its container after every restart; a process in another PID namespace shares /dev/shm)
run in real PID namespaces (``unshare``, as root) and are skipped, saying why, where that fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvservice.memory import KVCacheAllocationError
from kvservice.shm import (
    CONTROL_CLOSED,
    CONTROL_FORMAT_LOCKED,
    CONTROL_OPEN,
    LEASE_TABLE_OFFSET,
    SharedMemoryAllocator,
    remove_stale_segments,
)

# A process that makes an allocator with two segments in argv[1], prints its names (control first)
# and pid as it sees it, and waits until stdin closes or it is killed.
_HOLDER = """
import json, os, sys
from pathlib import Path
import torch
from kvservice.shm import SharedMemoryAllocator
shm = SharedMemoryAllocator("e", shm_dir=Path(sys.argv[1]))
shm(4096, torch.device("cpu")); shm(100, torch.device("cpu"))
print(json.dumps({"pid": os.getpid(), "names": [shm.control_name] + [n for n, _s, _t in shm.segments]}), flush=True)
sys.stdin.read()
"""

# A process that runs the start-up cleanup on argv[1] and prints what it removed and its pid.
_CLEANER = """
import json, os, sys
from pathlib import Path
from kvservice.shm import remove_stale_segments
print(json.dumps({"pid": os.getpid(), "removed": remove_stale_segments(Path(sys.argv[1]))}), flush=True)
"""

_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _pid_namespaces_or_skip() -> None:
    """Skip, saying why, unless this machine lets us make PID namespaces (root and unshare(1))."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) (util-linux) is not installed: no PID namespace to run the server in")
    probe = subprocess.run(
        [*_UNSHARE, sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip(
            f"unshare --pid --fork --mount-proc failed (rc {probe.returncode}: {probe.stderr.strip()[:200]!r}); "
            "it needs root or user namespaces"
        )


def _start_holder(shm_dir: Path, *, namespace: bool) -> tuple[subprocess.Popen[str], dict]:
    argv = (
        [*_UNSHARE, sys.executable, "-c", _HOLDER, str(shm_dir)]
        if namespace
        else [sys.executable, "-c", _HOLDER, str(shm_dir)]
    )
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the holder exited before making its segments"
    return proc, json.loads(line)


def _kill_holder(proc: subprocess.Popen[str], *, namespace: bool) -> None:
    """SIGKILL the allocator's process (in a namespace: the PID 1 that unshare forked, as the host
    sees it) and wait until it is gone (unshare reaps it, then exits)."""
    target = proc.pid
    if namespace:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        target = int(children[0])
    os.kill(target, signal.SIGKILL)
    proc.wait()
    assert proc.stdin is not None
    proc.stdin.close()


def _clean(shm_dir: Path, *, namespace: bool) -> dict:
    argv = (
        [*_UNSHARE, sys.executable, "-c", _CLEANER, str(shm_dir)]
        if namespace
        else [sys.executable, "-c", _CLEANER, str(shm_dir)]
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_segments_are_unguessable_0600_and_removed_at_close(tmp_path):
    shm = SharedMemoryAllocator("epoch-1", shm_dir=tmp_path)
    a = shm(4096, torch.device("cpu"))
    b = shm(100, torch.device("cpu"))
    names = [name for name, _size, _t in shm.segments]
    assert [n.rsplit("-", 1)[1] for n in names] == ["0", "1"]
    prefix = f"kvservice-{os.getpid()}-"
    token = names[0][len(prefix) :].rsplit("-", 1)[0]
    assert names[0].startswith(prefix) and len(token) == 32 and int(token, 16) >= 0
    assert sorted(os.listdir(tmp_path)) == sorted([*names, shm.control_name])
    assert {oct(os.stat(tmp_path / n).st_mode & 0o777) for n in os.listdir(tmp_path)} == {"0o600"}
    assert (a.dtype, a.numel(), b.numel()) == (torch.uint8, 4096, 100)
    a[10] = 42  # the tensor is the segment
    assert (tmp_path / names[0]).read_bytes()[10] == 42
    control = (tmp_path / shm.control_name).read_bytes()
    assert (control[0], control[1], control[8:15]) == (CONTROL_OPEN, CONTROL_FORMAT_LOCKED, b"epoch-1")
    with open(tmp_path / shm.control_name, "rb") as other:  # the live allocator holds the lock
        with pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert shm.segment_of(a.data_ptr() + 7) == (0, 7) and shm.segment_of(b.data_ptr()) == (1, 0)
    with open(tmp_path / shm.control_name, "rb") as f:  # a worker's mapping of the control segment
        shm.close()
        assert f.read(1)[0] == CONTROL_CLOSED
    assert os.listdir(tmp_path) == []
    shm.close()  # idempotent


def test_the_control_segment_holds_a_lease_table_of_8_byte_little_endian_slots(tmp_path):
    plain = SharedMemoryAllocator("e", shm_dir=tmp_path)
    assert len((tmp_path / plain.control_name).read_bytes()) == LEASE_TABLE_OFFSET == 64
    plain.close()
    shm = SharedMemoryAllocator("epoch-2", shm_dir=tmp_path, lease_slots=3)
    path = tmp_path / shm.control_name
    assert path.read_bytes() == bytes([CONTROL_OPEN, CONTROL_FORMAT_LOCKED]) + bytes(6) + b"epoch-2" + bytes(49 + 24)
    shm.publish_lease(1, 0x0102030405060708)
    shm.publish_lease(3, 2**63 - 1)
    assert path.read_bytes()[64:] == bytes.fromhex("0807060504030201") + bytes(8) + (2**63 - 1).to_bytes(8, "little")
    shm.clear_lease(1)
    assert path.read_bytes()[64:] == bytes(16) + (2**63 - 1).to_bytes(8, "little")
    with pytest.raises(AssertionError, match="lease slot 4 outside"):
        shm.publish_lease(4, 1)
    with pytest.raises(ValueError, match="lease_slots must be >= 0; got -1"):
        SharedMemoryAllocator("e", shm_dir=tmp_path, lease_slots=-1)
    shm.close()
    shm.clear_lease(3)  # after close: nothing to write (the segment is gone, readers see closed)


def test_stale_segments_of_a_dead_process_are_removed_and_marked_closed(tmp_path):
    """Control segments of format 0 (a kvservice from before the lock, holding none) keep the pid
    rule, so an upgrade never removes a running older server's memory."""
    dead = _dead_pid()
    stale = [f"kvservice-{dead}-{'a' * 32}-0", f"kvservice-{dead}-{'a' * 32}-ctl"]
    alive = [f"kvservice-{os.getpid()}-{'b' * 32}-0", f"kvservice-{os.getpid()}-{'b' * 32}-ctl"]
    other = ["kvservice-notours", f"kvservice-{dead}-short-0", "psm_1234"]
    for name in stale + alive + other:
        (tmp_path / name).write_bytes(bytes([1]) + bytes(63))
    ctl = open(tmp_path / stale[1], "rb")  # noqa: SIM115 (held open across the removal, as a worker would)
    assert remove_stale_segments(tmp_path) == [stale[1], stale[0]]
    assert ctl.read(1)[0] == CONTROL_CLOSED
    ctl.close()
    assert sorted(os.listdir(tmp_path)) == sorted(alive + other)


def test_an_unlocked_control_segment_is_stale_whatever_its_pid(tmp_path):
    """A pid reused by another process (the server is PID 1 again in its container) does not keep
    segments alive: nobody holds the lock, so they go; data segments without a control segment too."""
    mine = f"kvservice-{os.getpid()}-{'c' * 32}"
    for name in (f"{mine}-ctl", f"{mine}-0", f"{mine}-1", f"kvservice-1-{'d' * 32}-0"):
        (tmp_path / name).write_bytes(bytes([CONTROL_OPEN, CONTROL_FORMAT_LOCKED]) + bytes(62))
    assert remove_stale_segments(tmp_path) == [f"kvservice-1-{'d' * 32}-0", f"{mine}-ctl", f"{mine}-0", f"{mine}-1"]
    assert os.listdir(tmp_path) == []


def test_a_live_allocator_is_never_removed_whatever_its_pid(tmp_path):
    """Even under a name whose pid no process has (as a server in another PID namespace looks), a
    held lock keeps every segment; a second allocator in the same process is no exception."""
    shm = SharedMemoryAllocator("e", shm_dir=tmp_path)
    shm(4096, torch.device("cpu"))
    other = SharedMemoryAllocator("f", shm_dir=tmp_path)
    dead = _dead_pid()
    for name in os.listdir(tmp_path):  # the inodes (and the lock) stay; only the pid in the name changes
        if name.startswith(shm._token):
            os.rename(tmp_path / name, tmp_path / name.replace(f"-{os.getpid()}-", f"-{dead}-", 1))
    before = sorted(os.listdir(tmp_path))
    assert remove_stale_segments(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == before
    other.close()
    assert sorted(os.listdir(tmp_path)) == [n for n in before if not n.startswith(other._token)]


def test_a_killed_allocators_segments_are_removed_by_the_next_start(tmp_path):
    proc, held = _start_holder(tmp_path, namespace=False)
    assert remove_stale_segments(tmp_path) == []  # alive: nothing goes
    assert sorted(os.listdir(tmp_path)) == sorted(held["names"])
    _kill_holder(proc, namespace=False)
    assert remove_stale_segments(tmp_path) == held["names"]
    assert os.listdir(tmp_path) == []


def test_pid_1_in_a_container_after_kill_9_removes_the_previous_pid_1s_segments(tmp_path):
    """The server is PID 1 in its namespace; after a kill -9 the next PID-1 start (whose own pid is
    the one in the dead server's names) removes them, where the pid rule saw "itself" alive."""
    _pid_namespaces_or_skip()
    proc, held = _start_holder(tmp_path, namespace=True)
    assert held["pid"] == 1 and all(n.startswith("kvservice-1-") for n in held["names"])
    _kill_holder(proc, namespace=True)
    assert _clean(tmp_path, namespace=True) == {"pid": 1, "removed": held["names"]}
    assert os.listdir(tmp_path) == []


def test_another_pid_namespace_sharing_dev_shm_never_removes_a_live_servers_segments(tmp_path):
    """A sidecar in its own PID namespace starts while a server (PID 1 of another namespace, and
    one in this namespace) runs: it removes nothing of theirs, though neither pid exists where it
    looks; once the namespaced server is killed, it removes exactly that server's segments."""
    _pid_namespaces_or_skip()
    proc, held = _start_holder(tmp_path, namespace=True)
    here = SharedMemoryAllocator("host", shm_dir=tmp_path)
    here(4096, torch.device("cpu"))
    before = sorted(os.listdir(tmp_path))
    try:
        assert _clean(tmp_path, namespace=True) == {"pid": 1, "removed": []}
        assert sorted(os.listdir(tmp_path)) == before
        _kill_holder(proc, namespace=True)
        assert _clean(tmp_path, namespace=True) == {"pid": 1, "removed": held["names"]}
        assert sorted(os.listdir(tmp_path)) == sorted([here.control_name, here.segments[0][0]])
    finally:
        if proc.poll() is None:
            _kill_holder(proc, namespace=True)
        here.close()


def test_a_full_shared_memory_folder_is_named_with_its_free_bytes(tmp_path, monkeypatch):
    """The error names the folder and its free bytes (statvfs), not the host's free RAM."""

    class _Full:
        f_bavail, f_frsize = 3, 4096

    shm = SharedMemoryAllocator("e", shm_dir=tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: _Full)
    with pytest.raises(KVCacheAllocationError) as excinfo:
        shm(1 << 20, torch.device("cpu"))
    assert excinfo.value.bytes_available == 3 * 4096 and excinfo.value.bytes_asked == 1 << 20
    assert str(excinfo.value) == (
        f"KV cache does not fit on cpu: {tmp_path} (shared memory: not enough free bytes; give it more room, "
        "e.g. docker run --shm-size): asked 1048576 bytes (1.0 MiB), available 12288 bytes (12.0 KiB); "
        "lower num_blocks or the memory budget"
    )
    assert sorted(os.listdir(tmp_path)) == [shm.control_name]  # nothing half-made
    shm.close()
