"""The data plane: AttachKVCache (shared memory), WriteBlocks / ReadBlocks and their rules.

The servers here keep their KV tensors on the CPU, so they live in POSIX shared memory: the test
server's layout (qwen-2.5-0.5b at block size 4) is one tensor ``[24, 2, 16, 4, 2, 64]`` bfloat16,
49,152 bytes per block.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any

import grpc
import pytest
import torch

from kvservice.server.data_plane import _peer_is_local, block_checksum
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient, KVServiceError
from kvservice_client.data import (
    aattach_kv_cache,
    aread_blocks,
    attach_kv_cache,
    awrite_blocks,
    block_ref,
    read_blocks,
    read_blocks_into,
    write_block_chunks,
    write_blocks,
)
from kvservice_client.hashing import BlockHasher
from kvservice_client.torch_view import KVCacheView, KVCacheViewClosedError, aattach

BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2
CPU = {"device": "cpu"}
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks of 4


def pattern(seed: int, num_bytes: int = BLOCK_BYTES) -> bytes:
    """Bytes no two seeds share: seed's 8 bytes then a ramp, repeated."""
    unit = seed.to_bytes(8, "little") + bytes(range(248))
    return (unit * (num_bytes // len(unit) + 1))[:num_bytes]


async def admit(client: AsyncKVCacheClient, request_id: str, prompt: list[int]) -> pb.AllocateSlotsResponse:
    await client.get_computed_blocks(request_id, prompt)
    response = await client.allocate_slots(request_id, len(prompt))
    assert response.allocated
    return response


async def code_and_message(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVServiceError) as err:
        await call
    return err.value.code, err.value.message


# -- attach ------------------------------------------------------------------------------------


async def test_attach_describes_the_memory_and_the_view_is_the_servers(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    description = await aattach_kv_cache(client)
    assert description.epoch == running.event_log.epoch
    assert (description.device, description.num_blocks, list(description.bytes_per_block)) == ("cpu", 16, [BLOCK_BYTES])
    assert description.max_data_chunk_bytes == 1 << 20
    [storage] = description.storages
    assert storage.size_bytes == 16 * BLOCK_BYTES and storage.shm_name.startswith(f"kvservice-{os.getpid()}-")
    assert oct(os.stat(f"/dev/shm/{storage.shm_name}").st_mode & 0o777) == "0o600"
    [view] = description.views
    assert (view.group_idx, view.view_idx, view.storage_idx, view.offset_bytes) == (0, 0, 0, 0)
    assert (list(view.shape), list(view.strides), view.dtype, view.block_axis) == (
        [24, 16, 4, 2, 128],
        [16 * 4 * 2 * 128, 4 * 2 * 128, 2 * 128, 128, 1],
        "bfloat16",
        1,
    )  # vLLM 0.33's layout: [layers, blocks, block_size, KV heads, K then V of head_size each]
    kv = KVCacheView(description)
    for block_id in (0, 5, 15):
        ours, theirs = kv.block_view(0, block_id), running.tensors.block_view(0, block_id)
        assert [(t.shape, t.stride(), t.data_ptr()) for t in ours] != [] and all(
            a.shape == b.shape and a.stride() == b.stride() for a, b in zip(ours, theirs)
        )
    kv.block_view(0, 5)[0].fill_(3.0)  # written through the view: the server's tensor sees it
    assert torch.equal(running.tensors.block_view(0, 5)[0], torch.full((24, 4, 2, 128), 3.0, dtype=torch.bfloat16))
    assert (await client.get_kv_cache_group_metadata()).max_data_chunk_bytes == 1 << 20


async def test_attach_on_meta_is_failed_precondition(start_kv_server, connect):
    client = await connect(await start_kv_server())
    assert await code_and_message(aattach_kv_cache(client)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "no memory behind a meta device",
    )
    assert (await client.get_kv_cache_group_metadata()).max_data_chunk_bytes == 0


def test_only_loopback_and_unix_peers_are_local():
    assert [
        _peer_is_local(p)
        for p in (
            "ipv4:127.0.0.1:5000",
            "ipv6:[::1]:5000",
            "unix:/tmp/s",
            "unix:",
            "ipv4:10.0.0.2:5000",
            "ipv6:[fe80::1]:5000",
            "ipv4:128.0.0.1:1",
        )
    ] == [True, True, True, True, False, False, False]


async def test_attach_over_a_unix_socket(start_kv_server, tmp_path):
    path = str(tmp_path / "kv.sock")
    running = await start_kv_server(uds=path, **CPU)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    async with AsyncKVCacheClient(f"unix:{path}", timeout=10.0) as client:
        kv = await aattach(client)
        assert kv.epoch == running.event_log.epoch and kv.num_blocks == 16
    await running.stop(0)
    assert not os.path.exists(path)  # noqa: ASYNC240  # the server has stopped: nothing to block on


async def test_a_second_process_attaches_writes_and_read_blocks_returns_those_bytes(start_kv_server, connect):
    """The worker stores through the attached memory, then marks the block written (no bytes sent):
    before that a read of it is refused, the server cannot see stores into mapped memory."""
    running = await start_kv_server(**CPU)
    client = await connect(running)
    slots = await admit(client, "w", PROMPT)
    block_id = slots.new_block_ids[0].block_ids[1]
    script = textwrap.dedent(f"""
        import torch
        from kvservice_client.client import KVCacheClient
        from kvservice_client.data import mark_blocks_written
        from kvservice_client.torch_view import attach
        with KVCacheClient({running.address!r}, timeout=10.0) as client:
            view = attach(client)
            unit = (7).to_bytes(8, "little") + bytes(range(248))
            data = torch.frombuffer(bytearray((unit * 200)[:{BLOCK_BYTES}]), dtype=torch.uint8)
            [tensor] = view.block_view(0, {block_id})
            tensor.copy_(data.view(torch.bfloat16).view(tensor.shape))
            print(view.epoch, flush=True)
            assert input() == "mark"
            allocation = ({slots.allocation_id}, {slots.epoch!r})
            print(mark_blocks_written(client, "w", [(0, {block_id})], allocation=allocation).num_blocks_written)
    """)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip() == running.event_log.epoch
    assert await code_and_message(aread_blocks(client, [block_ref(0, block_id=block_id)])) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"blocks[0].block_id: block {block_id} is not written yet (nobody wrote it since it was allocated): its "
        "memory holds no bytes of its own",
    )
    out, err = await asyncio.wait_for(proc.communicate(b"mark\n"), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "1"
    [block] = await aread_blocks(client, [block_ref(0, block_id=block_id)])
    assert (block.block_index, block.group_idx, block.block_id, block.evicted) == (0, 0, block_id, False)
    assert block.data == pattern(7) and block.checksum == block_checksum(pattern(7))


async def test_a_view_of_a_restarted_server_refuses_to_be_used(start_kv_server, connect):
    first = await start_kv_server(**CPU)
    kv = await aattach(await connect(first))
    kv.block_view(0, 1)
    port = first.port
    await first.stop(0)
    second = await start_kv_server(port=port, **CPU)
    with pytest.raises(KVCacheViewClosedError, match=f"epoch {first.event_log.epoch} .* has stopped or restarted"):
        kv.block_view(0, 1)
    assert kv.closed
    fresh = await aattach(await connect(second))
    assert fresh.epoch == second.event_log.epoch != kv.epoch and not fresh.closed


# -- WriteBlocks ---------------------------------------------------------------------------------


async def test_write_then_read_by_id_and_by_hash(start_kv_server, connect):
    running = await start_kv_server(**CPU, data_chunk_bytes=4096)
    client = await connect(running)
    ids = list((await admit(client, "w", PROMPT)).new_block_ids[0].block_ids)
    assert ids == [1, 2, 3]
    response = await awrite_blocks(client, "w", [(0, b, pattern(b)) for b in ids], chunk_bytes=4096)
    assert (response.num_blocks_written, response.num_bytes_written) == (3, 3 * BLOCK_BYTES)
    await client.free("w")  # now cached and fixed: readable by hash
    digests = BlockHasher(4).hash_prompt(PROMPT)
    blocks = await aread_blocks(client, [block_ref(0, block_hash=digests[2]), block_ref(0, block_id=1)])
    assert [(b.block_index, b.block_id, b.data == pattern(b.block_id)) for b in blocks] == [(0, 3, True), (1, 1, True)]


async def test_the_blocking_helpers_write_read_and_attach(start_kv_server, connect):
    """write_blocks, read_blocks and attach_kv_cache on a KVCacheClient (run in a thread: the
    server shares this loop). With no chunk_bytes, write_blocks asks the server's chunk limit
    (4,096 bytes here; a larger chunk would be refused)."""
    running = await start_kv_server(**CPU, data_chunk_bytes=4096)
    client = await connect(running)
    ids = list((await admit(client, "w", PROMPT)).new_block_ids[0].block_ids)

    def blocking() -> tuple[pb.WriteBlocksResponse, list, pb.AttachKVCacheResponse, tuple[grpc.StatusCode, str]]:
        with KVCacheClient(running.address, timeout=10.0) as sync_client:
            written = write_blocks(sync_client, "w", [(0, b, pattern(b)) for b in ids])
            blocks = read_blocks(sync_client, [block_ref(0, block_id=b) for b in ids])
            description = attach_kv_cache(sync_client)
            with pytest.raises(KVServiceError) as err:
                write_blocks(sync_client, "nobody", [(0, 1, pattern(1))])
            return written, blocks, description, (err.value.code, err.value.message)

    written, blocks, description, error = await asyncio.to_thread(blocking)
    assert (written.num_blocks_written, written.num_bytes_written) == (3, 3 * BLOCK_BYTES)
    assert [(b.block_index, b.block_id, b.data == pattern(b.block_id)) for b in blocks] == [
        (0, 1, True),
        (1, 2, True),
        (2, 3, True),
    ]
    assert (description.epoch, description.max_data_chunk_bytes) == (running.event_log.epoch, 4096)
    assert error == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "block 1 (group 0): request 'nobody' is not running (unknown, waiting or freed); nothing was written",
    )


async def test_writes_go_only_to_blocks_a_running_request_computes(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await admit(client, "a", PROMPT)  # blocks 1, 2, 3
    await client.free("a")
    # "b" hits a's first two blocks and computes one new block (4).
    b = await admit(client, "b", PROMPT[:8] + [90, 91, 92, 93])
    assert [list(g.block_ids) for g in b.computed_block_ids] == [[1, 2]]
    assert [list(g.block_ids) for g in b.new_block_ids] == [[4]]
    cases = [
        (
            "b",
            1,
            "block 1 (group 0): it was not allocated to request 'b' for computing (not its block, or part of its "
            "prefix-cache hit); nothing was written",
        ),
        ("a", 3, "block 3 (group 0): request 'a' is not running (unknown, waiting or freed); nothing was written"),
        (
            "b",
            3,
            "block 3 (group 0): it was not allocated to request 'b' for computing (not its block, or part of its "
            "prefix-cache hit); nothing was written",
        ),
    ]
    for request_id, block_id, message in cases:
        before = running.tensors.block_view(0, block_id)[0].clone()
        assert await code_and_message(awrite_blocks(client, request_id, [(0, block_id, pattern(9))])) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            message,
        )
        assert torch.equal(running.tensors.block_view(0, block_id)[0], before)
    assert (await awrite_blocks(client, "b", [(0, 4, pattern(4))], allocation=b)).num_blocks_written == 1
    # Block 4 is written (it carries its hash): final, though only its computer holds it.
    digest = BlockHasher(4).hash_prompt(PROMPT[:8] + [90, 91, 92, 93])[2]
    assert await code_and_message(awrite_blocks(client, "b", [(0, 4, pattern(5))], allocation=b)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"block 4 (group 0): already written (block hash {digest.hex()}): a written block's bytes are final; "
        "nothing was written",
    )
    assert running.tensors.block_view(0, 4)[0].view(torch.uint8).flatten().numpy().tobytes() == pattern(4)


def _chunks(request_id: str, block_id: int, data: bytes, chunk_bytes: int = 16384, group_idx: int = 0):
    return list(write_block_chunks(request_id, [(group_idx, block_id, data)], chunk_bytes))


async def _raw_write(client: AsyncKVCacheClient, chunks: list[pb.WriteBlocksChunk]) -> pb.WriteBlocksResponse:
    try:
        return await client.stub.WriteBlocks(iter(chunks), timeout=10.0)
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from None


@pytest.mark.parametrize(
    "case",
    [
        "short block",
        "long chunk",
        "bad checksum",
        "no checksum",
        "unknown block",
        "null block",
        "group out of range",
        "gap",
        "interleaved",
        "no request id",
        "epoch without allocation id",
        "allocation id without epoch",
        "allocation changes inside a block",
        "in-memory mark with data",
        "in-memory mark inside a block",
    ],
)
async def test_a_bad_chunk_is_invalid_argument_naming_the_field_and_writes_nothing_of_its_block(
    start_kv_server, connect, case
):
    running = await start_kv_server(**CPU, data_chunk_bytes=16384)
    client = await connect(running)
    await admit(client, "w", PROMPT)  # blocks 1, 2, 3
    good = _chunks("w", 1, pattern(1))  # block 1 goes first and is written whole in every case
    chunks = _chunks("w", 2, pattern(2))
    expected = {
        "short block": (chunks[:-1], "chunks: the stream ended inside block 2 (group 0) after 32768 of 49152 bytes"),
        "long chunk": (
            _chunks("w", 2, pattern(2), 24576),
            "chunks[3].data: 24576 bytes; must be 1..16384 (max_data_chunk_bytes)",
        ),
        "bad checksum": (
            [*chunks[:-1], pb.WriteBlocksChunk(**{**_fields(chunks[-1]), "checksum": 12345})],
            "chunks[5].checksum: 0x0000000000003039 does not match block 2's bytes",
        ),
        "no checksum": (
            [*chunks[:-1], pb.WriteBlocksChunk(**{k: v for k, v in _fields(chunks[-1]).items() if k != "checksum"})],
            "chunks[5].checksum: required on the chunk that completes block 2",
        ),
        "unknown block": (_chunks("w", 16, pattern(2)), "chunks[3].block_id: 16 is out of range [1, 16)"),
        "null block": (
            _chunks("w", 0, pattern(2)),
            "chunks[3].block_id: 0 is out of range [1, 16) (0 is the null block)",
        ),
        "group out of range": (
            _chunks("w", 2, pattern(2), group_idx=1),
            "chunks[3].group_idx: 1 is out of range [0, 1)",
        ),
        "gap": ([chunks[0], chunks[2]], "chunks[4].offset_bytes: 32768, expected 16384"),
        "interleaved": (
            [chunks[0], *_chunks("w", 3, pattern(3))],
            "chunks[4]: block 3 (group 0) starts before block 2",
        ),
        "no request id": (_chunks("", 2, pattern(2)), "chunks[3].request_id: must be set"),
        "epoch without allocation id": (
            [pb.WriteBlocksChunk(**{**_fields(c), "epoch": running.event_log.epoch}) for c in chunks],
            "chunks[3].allocation_id: must be set with epoch (both or neither)",
        ),
        "allocation id without epoch": (
            [pb.WriteBlocksChunk(**{**_fields(c), "allocation_id": 1}) for c in chunks],
            "chunks[3].epoch: must be set with allocation_id (both or neither)",
        ),
        "allocation changes inside a block": (
            [chunks[0], pb.WriteBlocksChunk(**{**_fields(chunks[1]), "allocation_id": 1, "epoch": "e"}), *chunks[2:]],
            "chunks[4].allocation_id: 1 (epoch 'e') differs from block 2's first chunk (0, epoch '')",
        ),
        "in-memory mark with data": (
            [pb.WriteBlocksChunk(request_id="w", block_id=2, data=b"x", in_memory=True)],
            "chunks[3].data: 1 bytes with in_memory set (the bytes are in the memory already)",
        ),
        "in-memory mark inside a block": (
            [chunks[0], pb.WriteBlocksChunk(request_id="w", block_id=2, in_memory=True)],
            "chunks[4].in_memory: set inside block 2's chunks (an in-memory mark is a block's only chunk)",
        ),
    }[case]
    before = {b: running.tensors.block_view(0, b)[0].clone() for b in (2, 3)}
    code, message = await code_and_message(_raw_write(client, good + expected[0]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(expected[1]), message
    assert running.tensors.block_view(0, 1)[0].view(torch.uint8).flatten().numpy().tobytes() == pattern(1)
    for b, tensor in before.items():
        assert torch.equal(running.tensors.block_view(0, b)[0], tensor), f"block {b} changed"


def _fields(chunk: pb.WriteBlocksChunk) -> dict:
    return {f.name: v for f, v in chunk.ListFields()}


# -- ReadBlocks ------------------------------------------------------------------------------------


async def test_read_by_hash_of_an_uncached_block_is_not_found_naming_the_hash(start_kv_server, connect):
    client = await connect(await start_kv_server(**CPU))
    digest = BlockHasher(4).hash_prompt([5, 6, 7, 8])[0]
    assert await code_and_message(aread_blocks(client, [block_ref(0, block_hash=digest)])) == (
        grpc.StatusCode.NOT_FOUND,
        f"blocks[0].block_hash: {digest.hex()} is not cached in group 0",
    )


@pytest.mark.parametrize("missing_ok", [False, True], ids=["strict", "missing_ok"])
async def test_read_by_a_hash_of_another_length_is_invalid_argument_naming_the_digest(
    start_kv_server, connect, missing_ok
):
    """A hash of another length than the server's digest can never be cached: as the tier's calls
    (docs/tier.md, "Keys"), it is named, not answered as a miss, so a reader hashing by another
    rule is told at once (a helper's trial got NOT_FOUND for a 5-byte hash)."""
    client = await connect(await start_kv_server(**CPU))
    digest = BlockHasher(4).hash_prompt([5, 6, 7, 8])[0]
    refs = [block_ref(0, block_hash=b"abcde"), block_ref(0, block_hash=digest)]
    assert await code_and_message(aread_blocks(client, refs, missing_ok=missing_ok)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "blocks[0].block_hash: 5 bytes; a block hash is the server's 32-byte digest",
    )


async def test_read_by_hash_of_a_block_still_being_computed_is_refused_until_written(start_kv_server, connect):
    client = await connect(await start_kv_server(**CPU))
    w = await admit(client, "w", PROMPT)
    digest = BlockHasher(4).hash_prompt(PROMPT)[0]
    assert await code_and_message(aread_blocks(client, [block_ref(0, block_hash=digest)])) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"blocks[0].block_hash: {digest.hex()} is block 1, not written yet: request 'w' computes it (retry once its "
        "worker wrote it)",
    )
    await awrite_blocks(client, "w", [(0, 1, pattern(1))], allocation=w)  # written: final, readable while w runs
    [block] = await aread_blocks(client, [block_ref(0, block_hash=digest)])
    assert (block.block_id, block.data) == (1, pattern(1))


async def test_with_missing_ok_a_hash_that_cannot_be_read_is_a_missing_block_and_the_others_arrive(
    start_kv_server, connect
):
    client = await connect(await start_kv_server(**CPU))
    hasher = BlockHasher(4)
    await admit(client, "a", PROMPT)
    await awrite_blocks(client, "a", [(0, 1, pattern(1)), (0, 3, pattern(3))])  # block 2 not written
    written, unwritten, last = hasher.hash_prompt(PROMPT)
    absent = hasher.hash_prompt([5, 6, 7, 8])[0]
    refs = [(0, written), (0, absent), (0, unwritten), (0, last)]
    blocks = await aread_blocks(client, refs, missing_ok=True)
    assert [(b.block_index, b.block_id, b.data, b.evicted, b.missing) for b in blocks] == [
        (0, 1, pattern(1), False, False),
        (1, 0, None, False, True),
        (2, 0, None, False, True),
        (3, 3, pattern(3), False, False),
    ]
    # Without it the same read fails whole, naming the first block it cannot read.
    assert await code_and_message(aread_blocks(client, refs)) == (
        grpc.StatusCode.NOT_FOUND,
        f"blocks[1].block_hash: {absent.hex()} is not cached in group 0",
    )
    # It covers reads by hash only: an unwritten block read by id is refused as before.
    assert await code_and_message(aread_blocks(client, [(0, 2)], missing_ok=True)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "blocks[0].block_id: block 2 is not written yet (nobody wrote it since it was allocated): its memory holds "
        "no bytes of its own",
    )


async def test_read_blocks_into_copies_each_chunk_once_into_the_caller_s_buffers_checked(start_kv_server, connect):
    """Chunks of 4,096 bytes (several per block), each copied into its block's buffer as it
    arrives; a hash that cannot be read leaves its buffer alone and answers False."""
    running = await start_kv_server(**CPU, data_chunk_bytes=4096)
    client = await connect(running)
    w = await admit(client, "a", PROMPT)
    await awrite_blocks(client, "a", [(0, b, pattern(b)) for b in (1, 2, 3)], allocation=w)
    digests = BlockHasher(4).hash_prompt(PROMPT)
    absent = BlockHasher(4).hash_prompt([5, 6, 7, 8])[0]

    def blocking() -> tuple[list[bool], list[bytes], str, str]:
        buffers = [bytearray(BLOCK_BYTES) for _ in range(4)]
        with KVCacheClient(running.address, timeout=10.0) as sync_client:
            refs = [(0, digests[2]), (0, absent), (0, 1), (0, digests[1])]
            arrived = read_blocks_into(sync_client, refs, buffers, missing_ok=True)
            with pytest.raises(ValueError) as few:
                read_blocks_into(sync_client, refs, buffers[:3])
            with pytest.raises(ValueError) as short:
                read_blocks_into(sync_client, [(0, 1)], [bytearray(BLOCK_BYTES - 1)])
        return arrived, [bytes(b) for b in buffers], str(few.value), str(short.value)

    arrived, buffers, few, short = await asyncio.to_thread(blocking)
    assert arrived == [True, False, True, True]
    assert buffers == [pattern(3), bytes(BLOCK_BYTES), pattern(1), pattern(2)]
    assert few == "buffers: 3 for 4 refs"
    assert short == f"block 0: more than its buffer's {BLOCK_BYTES - 1} bytes"


@pytest.mark.parametrize(
    "ref, message",
    [
        (pb.BlockRef(group_idx=1, block_id=1), "blocks[0].group_idx: 1 is out of range [0, 1)"),
        (pb.BlockRef(group_idx=0, block_id=16), "blocks[0].block_id: 16 is out of range [0, 16)"),
        (pb.BlockRef(group_idx=0), "blocks[0]: set block_id or block_hash"),
    ],
)
async def test_a_bad_block_ref_is_invalid_argument(start_kv_server, connect, ref, message):
    client = await connect(await start_kv_server(**CPU))
    assert await code_and_message(aread_blocks(client, [ref])) == (grpc.StatusCode.INVALID_ARGUMENT, message)


async def test_a_block_evicted_and_reused_while_its_read_streams_is_reported_evicted(start_kv_server, connect):
    """Deterministic: the read's writer evicts the block after the first chunk (the event loop runs
    other calls exactly there, between two chunks)."""
    running = await start_kv_server(**CPU, data_chunk_bytes=4096)
    client = await connect(running)
    await admit(client, "a", PROMPT)
    await awrite_blocks(client, "a", [(0, b, pattern(b)) for b in (1, 2, 3)])
    await client.free("a")
    digest = BlockHasher(4).hash_prompt(PROMPT)[0]
    servicer = running.servicer
    sent: list[pb.ReadBlocksChunk] = []

    async def write(data: bytes) -> None:  # the data plane hands over serialized chunks
        sent.append(pb.ReadBlocksChunk.FromString(data))
        if len(sent) == 1:  # evict every cached block: "b" takes the whole pool (60 tokens = 15 blocks)
            servicer._get_computed_blocks(pb.GetComputedBlocksRequest(request_id="b", prompt_token_ids=range(100, 160)))
            servicer._allocate_slots(pb.AllocateSlotsRequest(request_id="b", num_new_tokens=60))
            assert running.engine.manager.block_pool.blocks[1].block_hash != digest

    await servicer.data_plane.read_blocks(pb.ReadBlocksRequest(blocks=[block_ref(0, block_hash=digest)]), write)
    assert [(c.block_id, c.offset_bytes, len(c.data), c.evicted, c.HasField("checksum")) for c in sent] == [
        (1, 0, 4096, False, False),
        (1, 4096, 0, True, False),
    ]
    assert sent[0].data == pattern(1)[:4096]


async def test_read_blocks_streams_in_chunks_with_the_checksum_on_the_last(start_kv_server, connect):
    running = await start_kv_server(**CPU, data_chunk_bytes=16384)
    client = await connect(running)
    await admit(client, "w", PROMPT)
    await awrite_blocks(client, "w", [(0, 1, pattern(1))])
    chunks = [c async for c in client.stub.ReadBlocks(pb.ReadBlocksRequest(blocks=[block_ref(0, block_id=1)]))]
    assert [(c.offset_bytes, len(c.data), c.HasField("checksum")) for c in chunks] == [
        (0, 16384, False),
        (16384, 16384, False),
        (32768, 16384, True),
    ]
    assert chunks[-1].checksum == block_checksum(pattern(1))


def test_importing_the_client_does_not_import_torch():
    code = (
        "import sys, kvservice_client, kvservice_client.client, kvservice_client.data, kvservice_client.watcher; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


# -- CUDA IPC ------------------------------------------------------------------------------------


def test_cuda_ipc_fields_go_through_the_proto_to_rebuild_cuda_tensor(monkeypatch):
    """The CUDA code path without a device: torch's reduction output travels through
    KVCacheStorage into rebuild_cuda_tensor's arguments unchanged."""
    import torch.multiprocessing.reductions as reductions

    from kvservice.server import data_plane
    from kvservice_client import torch_view

    args = (
        torch.Tensor,
        (1024,),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        3,
        b"ipc-handle",
        1024,
        256,
        False,
        b"/torch_123_ref",
        8,
        b"event-handle",
        True,
    )
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (reductions.rebuild_cuda_tensor, args))
    fields = data_plane._cuda_storage_fields(torch.empty(0, dtype=torch.uint8))
    storage = pb.KVCacheStorage(storage_idx=0, **fields)
    assert storage == pb.KVCacheStorage(
        storage_idx=0,
        size_bytes=1024,
        cuda_ipc_handle=b"ipc-handle",
        cuda_device=3,
        cuda_storage_offset_bytes=256,
        cuda_ref_counter_handle=b"/torch_123_ref",
        cuda_ref_counter_offset=8,
        cuda_event_handle=b"event-handle",
        cuda_event_sync_required=True,
    )
    seen = []
    monkeypatch.setattr(
        reductions, "rebuild_cuda_tensor", lambda *a: seen.append(a) or torch.zeros(1024, dtype=torch.uint8)
    )
    torch_view._map_storage(pb.KVCacheStorage.FromString(storage.SerializeToString()), "cuda:3")
    assert seen == [
        (
            torch.Tensor,
            (1024,),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            3,
            b"ipc-handle",
            1024,
            256,
            False,
            b"/torch_123_ref",
            8,
            b"event-handle",
            True,
        )
    ]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_a_second_process_attaches_over_cuda_ipc(start_kv_server, connect):
    running = await start_kv_server(device="cuda")
    client = await connect(running)
    block_id = (await admit(client, "w", PROMPT)).new_block_ids[0].block_ids[0]
    script = textwrap.dedent(f"""
        import torch
        from kvservice_client.client import KVCacheClient
        from kvservice_client.torch_view import attach
        with KVCacheClient({running.address!r}, timeout=30.0) as client:
            view = attach(client)
            [tensor] = view.block_view(0, {block_id})
            assert tensor.is_cuda
            tensor.fill_(5.0)
            torch.cuda.synchronize()
            print(view.device)
    """)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == str(running.tensors.device)
    expected = torch.full(running.tensors.block_view(0, block_id)[0].shape, 5.0, dtype=torch.bfloat16)
    [block] = await aread_blocks(client, [block_ref(0, block_id=block_id)])
    assert block.data == expected.view(torch.uint8).flatten().numpy().tobytes()


async def test_reflection_lists_the_data_plane_rpcs(kv_server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    def methods() -> set[str]:
        with grpc.insecure_channel(kv_server.address) as channel:
            pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
            return {m.name for m in pool.FindServiceByName("kvservice.v1.KVCacheService").methods}

    assert {"AttachKVCache", "ReadBlocks", "WriteBlocks"} <= await asyncio.to_thread(methods)


def _non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback, if it has one."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out.split() if "." in a and not a.startswith("127.")), None)


async def test_with_auth_off_attach_from_a_non_loopback_peer_is_refused(start_kv_server):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    running = await start_kv_server(host="0.0.0.0", allow_insecure_bind=True, **CPU)
    async with AsyncKVCacheClient(f"{address}:{running.port}", timeout=10.0) as client:
        code, message = await code_and_message(aattach_kv_cache(client))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert message.startswith(
            f"AttachKVCache: with auth off only loopback or Unix-socket peers may attach; peer is ipv4:{address}:"
        )
        await client.get_usage()  # the rest of the service answers as before
    async with AsyncKVCacheClient(f"127.0.0.1:{running.port}", timeout=10.0) as client:
        assert (await aattach_kv_cache(client)).epoch == running.event_log.epoch


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"data_chunk_bytes": 4095},
            "data_chunk_bytes must be in 4096..max_message_bytes - 65536 (67043328) bytes; got 4095",
        ),
        ({"data_chunk_bytes": 64 << 20}, "data_chunk_bytes must be in 4096..max_message_bytes - 65536"),
        ({"uds": " "}, "uds must be a socket path"),
    ],
)
def test_data_plane_settings_are_checked(settings, message):
    from kvservice.server.app import ServerConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerConfig(**settings)


async def test_uds_refuses_to_replace_a_file_that_is_not_a_socket(start_kv_server, tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a socket"):
        await start_kv_server(uds=str(path))
    assert path.read_text() == "keep me"


async def test_a_request_freed_while_its_block_streams_in_gets_nothing_written(start_kv_server, connect):
    """Deterministic: the chunk source frees the request between the block's two chunks; the write
    permission is checked again before the copy."""
    from kvservice.server.data_plane import DataPlaneError

    running = await start_kv_server(**CPU, data_chunk_bytes=32768)
    client = await connect(running)
    await admit(client, "w", PROMPT)
    before = running.tensors.block_view(0, 1)[0].clone()
    first, second = _chunks("w", 1, pattern(1), 32768)

    async def chunks():
        yield first
        running.servicer._free(pb.FreeRequest(request_id="w"))
        yield second

    with pytest.raises(DataPlaneError) as err:
        await running.servicer.data_plane.write_blocks(chunks())
    assert (err.value.code, str(err.value)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "block 1 (group 0): request 'w' is not running (unknown, waiting or freed); nothing was written",
    )
    assert torch.equal(running.tensors.block_view(0, 1)[0], before)


# -- byte state: hits before the bytes, frees before the bytes, stale write streams ----------------


def _memory(running, block_id: int) -> bytes:
    return running.tensors.block_view(0, block_id)[0].view(torch.uint8).flatten().numpy().tobytes()


async def _old_tenant(client: AsyncKVCacheClient, running) -> None:
    """Blocks 1..3 hold an old tenant's bytes (pattern(100 + b)) under hashes that are then evicted:
    "old" computes and frees them, "filler" takes the whole pool (15 blocks) and frees, so the next
    allocation reuses them under new hashes."""
    old = await admit(client, "old", [7000 + i for i in range(12)])
    await awrite_blocks(client, "old", [(0, b, pattern(100 + b)) for b in (1, 2, 3)], allocation=old)
    await client.free("old")
    await admit(client, "filler", [8000 + i for i in range(60)])
    await client.free("filler")


async def test_a_hit_before_its_bytes_are_written_reads_no_old_bytes_and_the_computer_still_writes(
    start_kv_server, connect
):
    """vLLM registers a block's hash at allocation: "b" hits "a"'s blocks before a's worker wrote
    them. Reads (by hash and by id) are refused, never the previous tenant's bytes; a's worker then
    writes them though b shares them, and they read back exactly; a second write is refused."""
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await _old_tenant(client, running)
    a = await admit(client, "a", PROMPT)
    ids = list(a.new_block_ids[0].block_ids)
    assert [_memory(running, b) == pattern(100 + b) for b in ids] == [True, True, True]  # the old tenant's bytes
    b = await admit(client, "b", PROMPT[:8] + [90, 91, 92, 93])
    assert [list(g.block_ids) for g in b.computed_block_ids] == [ids[:2]]
    digests = BlockHasher(4).hash_prompt(PROMPT)
    for ref, message in [
        (
            block_ref(0, block_hash=digests[0]),
            f"blocks[0].block_hash: {digests[0].hex()} is block {ids[0]}, not written yet: request 'a' computes it "
            "(retry once its worker wrote it)",
        ),
        (
            block_ref(0, block_id=ids[1]),
            f"blocks[0].block_id: block {ids[1]} is not written yet (nobody wrote it since it was allocated): its "
            "memory holds no bytes of its own",
        ),
    ]:
        assert await code_and_message(aread_blocks(client, [ref])) == (grpc.StatusCode.FAILED_PRECONDITION, message)
    # b's worker may not write a's blocks (they are its hit); a's may, though b shares them.
    assert (await code_and_message(awrite_blocks(client, "b", [(0, ids[0], pattern(9))], allocation=b)))[0] == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    written = await awrite_blocks(client, "a", [(0, x, pattern(x)) for x in ids], allocation=a)
    assert written.num_blocks_written == 3
    blocks = await aread_blocks(client, [block_ref(0, block_hash=d) for d in digests] + [block_ref(0, block_id=ids[1])])
    assert [(blk.block_id, blk.data) for blk in blocks] == [(x, pattern(x)) for x in ids] + [(ids[1], pattern(ids[1]))]
    assert await code_and_message(awrite_blocks(client, "a", [(0, ids[0], pattern(9))], allocation=a)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"block {ids[0]} (group 0): already written (block hash {digests[0].hex()}): a written block's bytes are "
        "final; nothing was written",
    )
    assert _memory(running, ids[0]) == pattern(ids[0])


async def test_a_block_freed_before_its_bytes_are_written_is_never_readable(start_kv_server, connect):
    """Its request is freed before its worker wrote it: the hash stays cached (and announced: events
    are vLLM's), but reads of it answer FAILED_PRECONDITION, a later hit's too, never the old bytes;
    once evicted and reused, the new owner's bytes read back."""
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await _old_tenant(client, running)
    a = await admit(client, "a", PROMPT)
    ids = list(a.new_block_ids[0].block_ids)
    await client.free("a")
    digests = BlockHasher(4).hash_prompt(PROMPT)
    c = await admit(client, "c", PROMPT + [5])  # hits all three
    assert [list(g.block_ids) for g in c.computed_block_ids] == [ids]
    never = (
        f"blocks[0].block_hash: {digests[2].hex()} is block {ids[2]}, not written yet: the request that computed it "
        "was freed before its bytes were written, so they never will be (the hash stays cached, unreadable, until "
        "evicted)"
    )
    assert await code_and_message(aread_blocks(client, [block_ref(0, block_hash=digests[2])])) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        never,
    )
    assert (await code_and_message(aread_blocks(client, [block_ref(0, block_id=ids[2])])))[0] == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert (await code_and_message(awrite_blocks(client, "a", [(0, ids[2], pattern(9))], allocation=a)))[0] == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    assert [_memory(running, b) == pattern(100 + b) for b in ids] == [True, True, True]  # untouched, unread


async def test_a_stale_write_stream_is_refused(start_kv_server, connect):
    """A stream for an earlier admission of the same request id (freed and admitted again), one
    from before a restart (another epoch), and an epoch without an allocation id: refused, naming
    the field; the blocks keep their bytes. Without allocation_id and epoch a write is still bound
    to the request id alone (older clients)."""
    running = await start_kv_server(**CPU)
    client = await connect(running)
    first = await admit(client, "r", PROMPT)
    assert first.allocation_id >= 1 and first.epoch == running.event_log.epoch
    await client.free("r")
    second = await admit(client, "r", [4000 + i for i in range(12)])
    assert second.allocation_id == first.allocation_id + 1
    block = second.new_block_ids[0].block_ids[0]
    before = _memory(running, block)
    cases = [
        (
            (first.allocation_id, first.epoch),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"chunks[0].allocation_id: {first.allocation_id} is not request 'r''s current allocation (its allocation "
            f"is {second.allocation_id}): the stream was begun for an earlier admission of that request id; nothing "
            "was written",
        ),
        (
            (second.allocation_id, "an-old-epoch"),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"chunks[0].epoch: 'an-old-epoch' is not this server's epoch {running.event_log.epoch!r} (the server "
            f"restarted: allocation {second.allocation_id} is gone); nothing was written",
        ),
        (  # refused before it is quoted: a status echoing 20,000 characters outgrows the trailer
            (second.allocation_id, "e" * 20000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "chunks[0].epoch: longer than 256 bytes",
        ),
    ]
    for allocation, code, message in cases:
        assert await code_and_message(awrite_blocks(client, "r", [(0, block, pattern(9))], allocation=allocation)) == (
            code,
            message,
        )
    chunks = _chunks("r", block, pattern(9))
    chunks[0].epoch = running.event_log.epoch  # an epoch and no allocation id
    assert await code_and_message(_raw_write(client, chunks)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunks[0].allocation_id: must be set with epoch (both or neither)",
    )
    assert _memory(running, block) == before
    assert (await awrite_blocks(client, "r", [(0, block, pattern(block))])).num_blocks_written == 1  # legacy
    assert _memory(running, block) == pattern(block)


async def test_a_stream_from_before_a_restart_is_refused_by_the_new_server(start_kv_server, connect):
    first = await start_kv_server(**CPU)
    old = await admit(await connect(first), "r", PROMPT)
    port = first.port
    await first.stop(0)
    second = await start_kv_server(port=port, **CPU)
    client = await connect(second)
    new = await admit(client, "r", PROMPT)
    assert (
        new.allocation_id == old.allocation_id and new.epoch != old.epoch
    )  # same id, same request id: only the epoch tells
    assert await code_and_message(awrite_blocks(client, "r", [(0, 1, pattern(1))], allocation=old)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"chunks[0].epoch: {old.epoch!r} is not this server's epoch {new.epoch!r} (the server restarted: allocation "
        f"{old.allocation_id} is gone); nothing was written",
    )
    assert (await awrite_blocks(client, "r", [(0, 1, pattern(1))], allocation=new)).num_blocks_written == 1


async def test_an_in_memory_mark_with_a_wrong_checksum_marks_nothing(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    w = await admit(client, "w", PROMPT)
    chunk = pb.WriteBlocksChunk(
        request_id="w", group_idx=0, block_id=1, allocation_id=w.allocation_id, epoch=w.epoch, in_memory=True
    )
    chunk.checksum = block_checksum(pattern(1))  # the memory holds zeros
    code, message = await code_and_message(_raw_write(client, [chunk]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(
        f"chunks[0].checksum: {block_checksum(pattern(1)):#018x} does not match block 1's bytes in memory"
    )
    assert running.servicer.data_plane.byte_state[1] == 0
    chunk.checksum = block_checksum(bytes(BLOCK_BYTES))
    assert (await _raw_write(client, [chunk])).num_blocks_written == 1
    [block] = await aread_blocks(client, [block_ref(0, block_id=1)])
    assert block.data == bytes(BLOCK_BYTES)


@pytest.mark.parametrize(
    "chunks, error",
    [
        # The checksum of other bytes: the one chunk was copied, then refused.
        ([pb.ReadBlocksChunk(block_index=0, data=b"abcd", checksum=1)], "DATA_LOSS: block 0: checksum mismatch"),
        # A chunk at the wrong offset.
        (
            [pb.ReadBlocksChunk(block_index=0, offset_bytes=2, data=b"ab")],
            "DATA_LOSS: block 0: chunk at offset 2, expected 0",
        ),
    ],
)
async def test_read_blocks_into_refuses_bytes_it_cannot_check(chunks, error):
    """A scripted server sending a wrong checksum or chunks out of order: DATA_LOSS, the block not
    reported read."""

    async def read(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        for chunk in chunks:
            yield chunk.SerializeToString()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "kvservice.v1.KVCacheService", {"ReadBlocks": grpc.unary_stream_rpc_method_handler(read)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:

        def blocking() -> str:
            with KVCacheClient(f"127.0.0.1:{port}", timeout=10.0) as sync_client:
                with pytest.raises(KVServiceError) as err:
                    read_blocks_into(sync_client, [(0, 1)], [bytearray(4)])
                return str(err.value)

        assert await asyncio.to_thread(blocking) == error
    finally:
        await server.stop(0)
