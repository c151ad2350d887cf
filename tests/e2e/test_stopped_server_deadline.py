"""A blocking client's stream-unary calls end at their deadline against a server that stopped
reading (SIGSTOP: alive, connected, its Unix socket's small buffer full), as its unary calls do.

grpcio's blocking stream-unary call (1.85) returns only once its request thread's pending send
completed: a ``put_blocks`` with a 2 s deadline came back when the stopped server resumed (20 s
later in the first measurement), so a ``TierClient`` store job over gRPC held its thread for as
long as the server was stopped. The client now waits on the call's future, which ends at the
deadline.
"""

from __future__ import annotations

import hashlib
import signal
import threading

import pytest

from kvservice_client.client import KVCacheClient
from kvservice_client.errors import KVServiceError, StatusCode
from tests.e2e.test_cli import TIMEOUT_S, Lines, _spawn

BLOCK_BYTES = 1 << 20  # opaque:1048576
NUM_BLOCKS = 32  # 32 MiB in one PutBlocks: more than the stream window and the socket buffers hold


@pytest.mark.slow
def test_put_blocks_against_a_stopped_server_ends_at_its_deadline_not_when_the_server_resumes(tmp_path):
    socket_path = tmp_path / "kvservice.sock"
    serve = _spawn(
        "serve",
        "--uds",
        str(socket_path),
        "--port",
        "0",
        "--device",
        "cpu",
        "--kv-cache-layout",
        f"opaque:{BLOCK_BYTES}",
        "--block-size",
        "16",
        "--num-blocks",
        str(2 * NUM_BLOCKS),
    )
    resumed_by_watchdog = threading.Event()

    def resume() -> None:  # only if the call has not come back by then: the test then fails
        resumed_by_watchdog.set()
        serve.send_signal(signal.SIGCONT)

    watchdog = threading.Timer(TIMEOUT_S, resume)
    try:
        Lines(serve.stdout).wait_for("kvservice listening on")
        with KVCacheClient(f"unix:{socket_path}", timeout=2) as client:
            keys = [hashlib.sha256(bytes([i])).digest() for i in range(NUM_BLOCKS)]
            assert list(client.lookup_blocks(0, keys[:1]).present) == [False]  # the server answers
            serve.send_signal(signal.SIGSTOP)
            watchdog.start()
            with pytest.raises(KVServiceError) as refused:
                client.put_blocks(
                    0,
                    [(k, bytes([i]) * BLOCK_BYTES) for i, k in enumerate(keys)],
                    bytes_per_block=BLOCK_BYTES,
                    chunk_bytes=BLOCK_BYTES,
                )
            assert (refused.value.code, resumed_by_watchdog.is_set()) == (StatusCode.DEADLINE_EXCEEDED, False)
            watchdog.cancel()
            serve.send_signal(signal.SIGCONT)
            # Resumed, the server may complete a block whose bytes (and checksum) it had before the
            # cancel: each key it holds reads back exactly what was sent, the rest miss.
            present = list(client.lookup_blocks(0, keys).present)
            held = [(i, k) for i, k in enumerate(keys) if present[i]]
            assert [b.data for b in client.read_blocks([(0, k) for _, k in held])] == [
                bytes([i]) * BLOCK_BYTES for i, _ in held
            ]
    finally:
        watchdog.cancel()
        serve.send_signal(signal.SIGCONT)
        serve.kill()
        serve.wait()
