"""Live fan-out: the server's CPU cost of delivering live event batches to 1 and 8 subscribers over
the vLLM-compatible ZMQ publisher (``--zmq-endpoint``) and over gRPC ``StreamEvents`` (live start,
msgpack payloads: the bytes ZMQ sends), with 0 subscribers as the production-only baseline.

One ``kvservice serve`` child process (ZMQ publisher on, bound to a free loopback port, for every
measurement so each carries the same publisher) serves all of them. Its pool is filled first, so
every later allocation evicts: each batch is 4 BlockStored of 16 blocks plus their removals.
For each measurement the bench process attaches K subscribers, produces probe batches until each
subscriber received one (ZMQ's slow joiner; a live gRPC stream likewise only sees batches after
it subscribed), then produces ``num_batches`` live batches with :func:`events_bench.produce` (new
prompts each time) and waits until every subscriber received each of them (counted by seq: ZMQ's
8-byte big-endian seq frame, the gRPC batch's ``seq``). The figure is the server process's CPU
seconds (user + system, all threads, ``/proc/<pid>/stat``) from the start of production to the
last delivery: production plus delivery; subtracting the 0-subscriber figure leaves delivery
(within the noise of production, which costs far more than ZMQ's delivery). For ZMQ the part spent
in libzmq's I/O threads (``/proc/<pid>/task``), which write each message to each subscriber's
connection, is measured apart, free of that noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from pathlib import Path

import zmq
import zmq.asyncio

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient

try:
    from events_bench import cpu_seconds, produce
    from server_proc import serve
except ImportError:
    from scripts.bench.events_bench import cpu_seconds, produce
    from scripts.bench.server_proc import serve

NUM_BLOCKS = 4096
"""Pool size (blocks); filled before measuring so every allocation evicts."""

BLOCKS_PER_BATCH = 4 * 256 // 16
"""Blocks one :func:`produce` batch allocates (4 requests of 256 tokens, block size 16)."""

DELIVERY_TIMEOUT_S = 120.0
"""Longest wait for every subscriber to receive every batch (a lost batch fails the bench, not hangs it)."""


def zmq_io_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process's libzmq I/O threads (named ``ZMQbg/IO/<n>``; Linux
    /proc): where ZMQ writes each message to each subscriber's TCP connection, apart from the
    loop thread that produces the batches."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            if (task / "comm").read_text().startswith("ZMQbg/IO"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Subscriber:
    """One subscriber's progress: whether it has seen any batch, and how many of ``(after, last]``."""

    def __init__(self) -> None:
        self.joined = asyncio.Event()
        self.done = asyncio.Event()
        self.after = self.last = -1  # the measured seq range, set once every subscriber joined
        self.count = 0

    def got(self, seq: int) -> None:
        self.joined.set()
        if self.after < seq <= self.last:
            self.count += 1
            if self.count == self.last - self.after:
                self.done.set()


async def _read_zmq(sock: zmq.asyncio.Socket, sub: _Subscriber) -> None:
    while True:
        _topic, seq, _payload = await sock.recv_multipart()
        sub.got(int.from_bytes(seq, "big"))


async def _read_grpc(client: AsyncKVCacheClient, sub: _Subscriber) -> None:
    request = pb.StreamEventsRequest(start=pb.EVENT_START_LIVE, payload_format=pb.PAYLOAD_FORMAT_MSGPACK)
    async for batch in client.stub.StreamEvents(request):
        sub.got(batch.seq)


async def _measure(
    address: str, pid: int, zmq_port: int, transport: str, num_subscribers: int, num_batches: int, seed: int
) -> tuple[float, float]:
    """Server CPU seconds to produce ``num_batches`` live batches and deliver each to
    ``num_subscribers`` subscribers over ``transport`` ("zmq", "grpc" or "none"), and the part
    of them spent in the server's ZMQ I/O threads."""
    subs = [_Subscriber() for _ in range(num_subscribers)]
    ctx = zmq.asyncio.Context()
    sockets: list[zmq.asyncio.Socket] = []
    clients: list[AsyncKVCacheClient] = []
    tasks: list[asyncio.Task] = []
    try:
        for sub in subs:
            if transport == "zmq":
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: the subscriber side never drops
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(f"tcp://127.0.0.1:{zmq_port}")
                sockets.append(sock)
                tasks.append(asyncio.create_task(_read_zmq(sock, sub)))
            else:
                client = AsyncKVCacheClient(address)
                clients.append(client)
                tasks.append(asyncio.create_task(_read_grpc(client, sub)))
        with KVCacheClient(address) as client:
            probe = 0
            while not all(s.joined.is_set() for s in subs):  # slow joiners: probe until each got a batch
                probe += 1
                await asyncio.to_thread(produce, client, 1, seed=seed * 1000 + probe)
                waits = [asyncio.create_task(s.joined.wait()) for s in subs if not s.joined.is_set()]
                if waits:  # wait on the subscribers, then probe again for those still joining
                    _, pending = await asyncio.wait(waits, timeout=0.05)
                    for w in pending:
                        w.cancel()
            meta = client.get_kv_cache_group_metadata()
            # ZMQ carries the wire seq (zmq_seq_base + the batch's seq); gRPC the batch's seq.
            after = meta.head_seq + (meta.zmq_seq_base if transport == "zmq" else 0)
            for s in subs:
                s.after, s.last = after, after + num_batches
            cpu0, io0 = cpu_seconds(pid), zmq_io_cpu_seconds(pid)
            await asyncio.to_thread(produce, client, num_batches, seed=seed)
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in subs)), DELIVERY_TIMEOUT_S)
            cpu, io = cpu_seconds(pid) - cpu0, zmq_io_cpu_seconds(pid) - io0
            assert client.get_kv_cache_group_metadata().head_seq == meta.head_seq + num_batches, "one batch per Step"
        return cpu, io
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for c in clients:
            await c.close()
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def run(quick: bool = False) -> dict[str, float]:
    """One round: server CPU seconds for 100 live batches with ``quick``, else 2000: keys
    ``live_0s_server_cpu_s`` (no subscriber), ``live_{grpc,zmq}_{1,8}s_server_cpu_s``, and for ZMQ
    ``live_zmq_{1,8}s_zmq_io_cpu_s`` (the part in ZMQ's I/O threads)."""
    num_batches = 100 if quick else 2000
    port = _free_port()
    out: dict[str, float] = {}
    # A fixed port binds only with a wildcard host (vLLM's bind rule), and a wildcard bind is off
    # loopback, which kvservice refuses without --allow-insecure-bind (ZMQ has no authentication).
    with serve(
        "--device",
        "meta",
        "--num-blocks",
        str(NUM_BLOCKS),
        "--zmq-endpoint",
        f"tcp://*:{port}",
        "--allow-insecure-bind",
        with_pid=True,
    ) as (address, pid):
        with KVCacheClient(address) as client:
            produce(client, NUM_BLOCKS // BLOCKS_PER_BATCH + 1, seed=1)  # fill the pool: every allocation evicts
        # Interleaved, so a noisy moment moves several figures, not one transport's.
        plan = [("none", 0), ("grpc", 1), ("zmq", 1), ("grpc", 8), ("zmq", 8)]
        for i, (transport, k) in enumerate(plan):
            cpu, io = asyncio.run(_measure(address, pid, port, transport, k, num_batches, seed=100 + i))
            out["live_0s_server_cpu_s" if k == 0 else f"live_{transport}_{k}s_server_cpu_s"] = cpu
            if transport == "zmq":
                out[f"live_zmq_{k}s_zmq_io_cpu_s"] = io
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
