"""POSIX shared-memory segments of the KV memory: names, modes, removal at close and after a crash."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvservice.shm import CONTROL_CLOSED, CONTROL_OPEN, SharedMemoryAllocator, remove_stale_segments


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
    assert (control[0], control[8:15]) == (CONTROL_OPEN, b"epoch-1")
    assert shm.segment_of(a.data_ptr() + 7) == (0, 7) and shm.segment_of(b.data_ptr()) == (1, 0)
    with open(tmp_path / shm.control_name, "rb") as f:  # a worker's mapping of the control segment
        shm.close()
        assert f.read(1)[0] == CONTROL_CLOSED
    assert os.listdir(tmp_path) == []
    shm.close()  # idempotent


def test_stale_segments_of_a_dead_process_are_removed_and_marked_closed(tmp_path):
    dead = _dead_pid()
    stale = [f"kvservice-{dead}-{'a' * 32}-0", f"kvservice-{dead}-{'a' * 32}-ctl"]
    alive = [f"kvservice-{os.getpid()}-{'b' * 32}-0"]
    other = ["kvservice-notours", f"kvservice-{dead}-short-0", "psm_1234"]
    for name in stale + alive + other:
        (tmp_path / name).write_bytes(bytes([1]) + bytes(63))
    ctl = open(tmp_path / stale[1], "rb")  # noqa: SIM115 (held open across the removal, as a worker would)
    assert remove_stale_segments(tmp_path) == [stale[1], stale[0]]
    assert ctl.read(1)[0] == CONTROL_CLOSED
    ctl.close()
    assert sorted(os.listdir(tmp_path)) == sorted(alive + other)
