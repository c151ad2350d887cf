"""The data plane under hostile load (issue 24): stalled streams cut after
``stalled_write_timeout_s``, the ``max_data_streams`` bound, a malformed WriteBlocks message.

The servers keep their KV tensors on the CPU (shared memory): qwen-2.5-0.5b at block size 4,
49,152 bytes per block.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import grpc
import pytest
import torch

from kvservice.server.app import ServerConfig
from kvservice.server.data_plane import WORKER_NICE, _lower_priority, block_checksum
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVServiceError

BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2
CPU = {"device": "cpu"}
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks of 4
NO_BDP = [("grpc.http2.bdp_probe", 0)]  # the client's receive window stays small: a stall is a stall
WRITE_BLOCKS = "/kvservice.v1.KVCacheService/WriteBlocks"


async def admit(client: AsyncKVCacheClient, request_id: str, prompt: list[int]) -> list[int]:
    await client.get_computed_blocks(request_id, prompt)
    response = await client.allocate_slots(request_id, len(prompt))
    assert response.allocated
    return list(response.new_block_ids[0].block_ids)


async def until(predicate, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``predicate()`` holds; the server runs on this loop, so each turn lets it
    move."""
    async with asyncio.timeout(timeout_s) if hasattr(asyncio, "timeout") else _nullcontext():
        while not predicate():  # noqa: ASYNC110 (the server's counters have no event to wait on)
            await asyncio.sleep(0.01)


class _nullcontext:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_a_write_whose_client_stops_sending_mid_block_is_cut_after_the_timeout(start_kv_server, connect):
    running = await start_kv_server(**CPU, stalled_write_timeout_s=0.5, data_chunk_bytes=16384)
    client = await connect(running)
    [block_id, *_] = await admit(client, "w", PROMPT)
    dp = running.servicer.data_plane
    never = asyncio.Event()

    async def chunks():
        yield pb.WriteBlocksChunk(request_id="w", group_idx=0, block_id=block_id, data=b"\1" * 16384)
        await never.wait()  # the client stops sending inside the block

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.WriteBlocks(chunks())
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "stream cut: no chunk within stalled_write_timeout_s 0.5 s (the client stopped sending); blocks completed "
        "before it stay written, nothing of the block in progress is",
    )
    assert (dp.num_streams_cut, dp.num_open_streams, dp.buffered_bytes) == ({"read": 0, "write": 1}, 0, 0)


async def test_a_read_whose_client_does_not_read_is_cut_after_the_timeout(start_kv_server, connect):
    running = await start_kv_server(**CPU, stalled_write_timeout_s=0.5, data_chunk_bytes=4096)
    client = await connect(running, options=NO_BDP)
    dp = running.servicer.data_plane
    [block_id, *_] = await admit(client, "w", PROMPT)
    # Written first: a block nobody wrote is refused before any byte (its byte state).
    chunks = [
        pb.WriteBlocksChunk(request_id="w", group_idx=0, block_id=block_id, offset_bytes=at, data=b"\1" * 4096)
        for at in range(0, BLOCK_BYTES, 4096)
    ]
    chunks[-1].checksum = block_checksum(b"\1" * BLOCK_BYTES)
    assert (await client.stub.WriteBlocks(iter(chunks))).num_blocks_written == 1
    # 4,000 refs to that block (196 MB): far beyond what the windows and buffers on the way hold.
    call = client.stub.ReadBlocks(pb.ReadBlocksRequest(blocks=[pb.BlockRef(group_idx=0, block_id=block_id)] * 4000))
    await until(lambda: dp.num_streams_cut["read"] == 1)  # the client reads nothing
    await until(lambda: dp.num_open_streams == 0)
    assert (dp.num_streams_cut, dp.buffered_bytes) == ({"read": 1, "write": 0}, 0)
    call.cancel()


async def test_max_data_streams_refuses_one_more_naming_the_setting(start_kv_server, connect):
    running = await start_kv_server(**CPU, max_data_streams=1, data_chunk_bytes=16384)
    client = await connect(running)
    [block_id, *_] = await admit(client, "w", PROMPT)
    dp = running.servicer.data_plane
    release = asyncio.Event()

    async def chunks():
        yield pb.WriteBlocksChunk(request_id="w", group_idx=0, block_id=block_id, data=b"\1" * 16384)
        await release.wait()

    first = client.stub.WriteBlocks(chunks())
    await until(lambda: dp.num_open_streams == 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in client.stub.ReadBlocks(pb.ReadBlocksRequest(blocks=[pb.BlockRef(group_idx=0, block_id=1)])):
            pass
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_data_streams: 1 data streams (WriteBlocks, ReadBlocks) are open already; wait for one to end or raise "
        "max_data_streams",
    )
    assert dp.num_streams_refused == 1
    first.cancel()


async def test_a_malformed_write_blocks_message_is_invalid_argument(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    call = client.channel.stream_unary(WRITE_BLOCKS, request_serializer=None, response_deserializer=None)

    async def messages():
        yield b"\x0a\x05ab"  # field 1 (request_id) says 5 bytes, 2 follow

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(messages())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("chunks[0]: not a valid kvservice.v1.WriteBlocksChunk (")


@pytest.mark.parametrize("value", [0, -1])
def test_max_data_streams_is_checked(value):
    with pytest.raises(ValueError, match="max_data_streams"):
        ServerConfig(max_data_streams=value)


@pytest.mark.parametrize("chunk_bytes", [4096, BLOCK_BYTES])  # chunks copied on the loop, on a worker thread
async def test_a_cancelled_read_is_not_logged_as_an_internal_error(start_kv_server, connect, caplog, chunk_bytes):
    caplog.set_level(logging.DEBUG)
    running = await start_kv_server(**CPU, data_chunk_bytes=chunk_bytes)
    client = await connect(running, options=NO_BDP)
    dp = running.servicer.data_plane
    [block_id, *_] = await admit(client, "w", PROMPT)
    data = bytes(range(256)) * (BLOCK_BYTES // 256)
    chunks = [
        pb.WriteBlocksChunk(request_id="w", group_idx=0, block_id=block_id, offset_bytes=at, data=data[at : at + 4096])
        for at in range(0, BLOCK_BYTES, 4096)
    ]
    chunks[-1].checksum = block_checksum(data)
    assert (await client.stub.WriteBlocks(iter(chunks))).num_blocks_written == 1
    # 1,000 refs to that block (49 MB), cancelled after its first chunk.
    call = client.stub.ReadBlocks(pb.ReadBlocksRequest(blocks=[pb.BlockRef(group_idx=0, block_id=block_id)] * 1000))
    first = await call.read()
    assert (first.block_index, first.block_id, first.offset_bytes, first.data) == (0, block_id, 0, data[:chunk_bytes])
    assert call.cancel()
    await until(lambda: dp.num_open_streams == 0)
    assert (await client.ping(b"after")).payload == b"after"  # the server went on serving
    assert (dp.num_open_streams, dp.buffered_bytes, dp.num_streams_cut) == (0, 0, {"read": 0, "write": 0})
    assert [
        (r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info
    ] == []


def _in_a_thread_of_nice_one_above(priority: str) -> tuple[int, int, int, int]:
    """``_lower_priority(priority)`` in a worker started from a thread at nice n (one above this
    process's, which any user may set): (n, the worker's nice, the worker's policy, the starter's
    policy after)."""
    seen: list[tuple[int, int, int, int]] = []

    def start() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 1))
        before = os.getpriority(os.PRIO_PROCESS, tid)

        def in_worker() -> None:
            _lower_priority(priority)
            seen.append((before, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), os.sched_getscheduler(0)))

        worker = threading.Thread(target=in_worker)
        worker.start()
        worker.join()
        seen[0] += (os.sched_getscheduler(0),)

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    [result] = seen
    return result


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice values here")
def test_a_nice_worker_thread_runs_worker_nice_above_the_thread_that_started_it():
    """``data_worker_priority`` nice. Relative, not absolute: a worker runs at
    min(19, n + WORKER_NICE); an absolute nice 10 would run the workers of a server under
    ``nice -n 19`` ahead of its loop. Its policy stays the starter's (SCHED_OTHER)."""
    before, after, policy, starter_policy = _in_a_thread_of_nice_one_above("nice")
    assert (after, policy, starter_policy) == (min(19, before + WORKER_NICE), os.SCHED_OTHER, os.SCHED_OTHER)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE here")
def test_an_idle_worker_thread_runs_under_sched_idle_and_only_it():
    """``data_worker_priority`` idle (the default): the worker thread alone becomes SCHED_IDLE
    (Linux applies the policy per thread; the thread that started it keeps SCHED_OTHER) and its
    nice is left as it was."""
    before, after, policy, starter_policy = _in_a_thread_of_nice_one_above("idle")
    assert (after, policy, starter_policy) == (before, os.SCHED_IDLE, os.SCHED_OTHER)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE here")
@pytest.mark.parametrize("priority", ["idle", "nice"])
async def test_the_copy_threads_take_the_servers_data_worker_priority(start_kv_server, priority):
    """The setting reaches a real server's copy threads: their policy and nice, as set."""
    running = await start_kv_server(**CPU, data_worker_priority=priority)
    dp = running.servicer.data_plane
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    policy = await dp._off_loop(os.sched_getscheduler, 0)
    nice = await dp._off_loop(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    expected = (os.SCHED_IDLE, loop_nice) if priority == "idle" else (os.SCHED_OTHER, min(19, loop_nice + WORKER_NICE))
    assert (dp.worker_priority, policy, nice) == (priority, *expected)


def test_data_worker_priority_is_checked():
    with pytest.raises(ValueError, match="data_worker_priority must be one of idle, nice; got 'low'"):
        ServerConfig(data_worker_priority="low")


async def initial_window_size(port: int) -> int:
    """The SETTINGS_INITIAL_WINDOW_SIZE (RFC 9113 6.5.2, id 0x4) a server at ``127.0.0.1:port``
    announces in its first SETTINGS frame: what a client stream may send ahead of the server."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # The client preface, then an empty SETTINGS frame (length 0, type 4, flags 0, stream 0).
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        await writer.drain()
        while True:
            header = await reader.readexactly(9)
            length, frame_type, flags = int.from_bytes(header[:3], "big"), header[3], header[4]
            payload = await reader.readexactly(length)
            if frame_type == 4 and not flags & 1:  # SETTINGS, not its ACK
                settings = {
                    int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(payload[i + 2 : i + 6], "big")
                    for i in range(0, length, 6)
                }
                return settings.get(0x4, 65535)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("overrides", "window"),
    [
        ({}, 2 << 20),  # two data chunks of the default 1 MiB
        ({"data_chunk_bytes": 65536}, 131072),  # two chunks of the chunk size set
        ({"data_chunk_bytes": 16384}, 65536),  # and never below HTTP/2's own 64 KiB
        ({"stream_window_bytes": 4 << 20}, 4 << 20),  # as set
    ],
)
async def test_the_server_announces_a_stream_window_of_two_chunks_or_the_one_set(start_kv_server, overrides, window):
    """``stream_window_bytes`` reaches the wire: a WriteBlocks or PutBlocks client sends the next
    chunk while the server copies one (HTTP/2's own 64 KiB made a 1 MiB chunk 16 round trips), and
    no more (BDP probing stays off: gRPC's queue is bounded by it)."""
    running = await start_kv_server(**CPU, **overrides)
    assert running.config.limits.window_bytes == window
    assert await initial_window_size(running.port) == window


@pytest.mark.parametrize("value", [65535, 1 << 31])
def test_stream_window_bytes_is_checked(value):
    with pytest.raises(ValueError, match="stream_window_bytes must be in 65536..2147483647"):
        ServerConfig(stream_window_bytes=value)


@pytest.mark.parametrize("chunk_bytes", [16384, 1 << 20])
async def test_a_refused_write_whose_client_is_still_sending_gets_its_status_not_internal(
    start_kv_server, connect, chunk_bytes
):
    """A WriteBlocks refused at its first chunk while the client still sends a stream window and a
    chunk more (what it may have in flight, and waits on the window to send) answers the refusal, INVALID_ARGUMENT naming the field,
    every time: the server reads and drops what is in flight before the status (grpc.aio's client
    otherwise reports its failed write as ``INTERNAL: Internal error from Core``, grpc/grpc#36066:
    with 16 KiB chunks and a window of two, a 3-block write refused at its first chunk got it),
    and nothing is written."""
    running = await start_kv_server(**CPU, data_chunk_bytes=chunk_bytes)
    client = await connect(running)
    block_ids = await admit(client, "w", PROMPT)
    dp = running.servicer.data_plane
    before = [bytes(running.tensors.block_view(0, b)[0].flatten().view(torch.uint8).numpy()) for b in block_ids]
    piece = min(chunk_bytes, BLOCK_BYTES)
    bad = pb.WriteBlocksChunk(request_id="w", block_id=999, data=bytes(piece))
    in_flight = [
        pb.WriteBlocksChunk(request_id="w", block_id=block_ids[0], offset_bytes=0, data=bytes([7]) * piece)
        for _ in range((dp.window_bytes + dp.chunk_bytes) // piece)  # more than the window: the client waits on it
    ]
    for _ in range(10):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.stub.WriteBlocks(iter([bad, *in_flight]), timeout=10.0)
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "chunks[0].block_id: 999 is out of range [1, 16) (0 is the null block)",
        )
    after = [bytes(running.tensors.block_view(0, b)[0].flatten().view(torch.uint8).numpy()) for b in block_ids]
    assert (after, dp.num_blocks_written, dp.num_open_streams) == (before, 0, 0)


async def test_a_write_refused_at_max_data_streams_gets_resource_exhausted_while_it_still_sends_8_mib(
    start_kv_server, connect
):
    """The status a client backs off on: an 8 MiB write (4 blocks of llama-3-8b's 2 MiB) refused at
    ``max_data_streams`` is RESOURCE_EXHAUSTED 10 times out of 10 through the async client, not the
    INTERNAL grpc.aio reports when its write loses the race with the status (8 of 10 before the
    refused stream drained up to DRAIN_WRITE_BYTES)."""
    running = await start_kv_server(
        device="cpu", preset="llama-3-8b", block_size=16, num_blocks=8, max_model_len=128, max_data_streams=1
    )
    client = await connect(running)
    ids = await admit(client, "w", list(range(1, 97)))
    dp = running.servicer.data_plane
    size = running.tensors.bytes_per_block(0)
    release = asyncio.Event()

    async def holder():
        yield pb.WriteBlocksChunk(request_id="w", block_id=ids[0], data=b"\1" * 4096)
        await release.wait()

    hold = client.stub.WriteBlocks(holder())  # the one stream allowed, open
    await until(lambda: dp.num_open_streams == 1)
    for _ in range(10):
        with pytest.raises(KVServiceError) as err:
            await client.write_blocks("w", [(0, b, bytes(size)) for b in ids[1:5]])
        assert (err.value.code, err.value.message.split(";")[0]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_data_streams: 1 data streams (WriteBlocks, ReadBlocks) are open already",
        )
    hold.cancel()
    assert dp.num_blocks_written == 0


@pytest.mark.parametrize("after", ["empty messages", "nothing"])
async def test_a_refused_writes_status_comes_while_its_client_still_sends_empties_or_waits(
    start_kv_server, connect, after
):
    """The drain is bounded in time, not only in bytes: a client that keeps sending empty messages
    after its refusal (no bytes to count), or sends nothing and never half-closes, still gets its
    INVALID_ARGUMENT (DRAIN_MAX_S, DRAIN_IDLE_S), long before ``stalled_write_timeout_s`` (60 s
    here); the wait for it is bounded at 20 s."""
    running = await start_kv_server(**CPU, stalled_write_timeout_s=60.0)
    client = await connect(running)
    await admit(client, "w", PROMPT)
    stop = asyncio.Event()

    async def messages():
        yield pb.WriteBlocksChunk(request_id="w", block_id=999, data=b"x")
        while not stop.is_set():
            if after == "empty messages":
                yield pb.WriteBlocksChunk()
                await asyncio.sleep(0.01)  # a client's pace, not a wait for the server
            else:
                await stop.wait()

    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.stub.WriteBlocks(messages(), timeout=20.0)
    finally:
        stop.set()
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunks[0].block_id: 999 is out of range [1, 16) (0 is the null block)",
    )
