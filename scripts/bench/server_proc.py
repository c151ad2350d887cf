"""Start ``kvservice serve`` in a child process for a benchmark and stop it afterwards."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def serve(*flags: str, with_pid: bool = False) -> Iterator:
    """Run a server on a free port with ``flags``; yield its address (and pid with ``with_pid``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "serve", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("kvservice listening on"):
                address = line.split()[3]
                break
        else:
            raise RuntimeError(f"server did not start (exit {proc.wait()})")
        yield (address, proc.pid) if with_pid else address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
