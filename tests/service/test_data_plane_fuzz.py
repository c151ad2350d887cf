"""1,000 fuzzed data-plane messages against a CPU server (issue 24): no INTERNAL, nothing changed by
a refused call.

Seeded (``random.Random(24)``), so every run sends the same messages and gets the same answers.
Half are ``WriteBlocks`` streams, half ``ReadBlocks`` requests, all through raw channel calls (no
client-side serializer, so any bytes pass):

* random bytes, and valid messages truncated (a field cut short);
* a valid one-block write (three 16 KiB chunks) with one field of one chunk mutated: offset,
  data size, block id, group, allocation id, epoch, checksum, in_memory, request id; or chunks
  dropped, repeated or swapped;
* reads naming block ids out of range or never written, hashes of the wrong length or unknown,
  groups out of range, refs with neither field, lists above ``MAX_READ_BLOCKS``.

After every call: its status is OK or one of :data:`ALLOWED` (never INTERNAL or UNKNOWN); an
INVALID_ARGUMENT message starts with the field it names; the engine's invariants hold; no data
stream is left open and no byte held; and a refused call left the KV memory (every block's bytes)
and every block's byte state exactly as they were.

The server: qwen-2.5-0.5b at block size 4 (49,152 bytes per block), 16 blocks on the CPU.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import grpc
import grpc.aio
import pytest

from kvservice.server.app import RunningServer
from kvservice.server.data_plane import MAX_READ_BLOCKS, _BlockBytes, block_checksum
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

pytestmark = pytest.mark.timeout(240)

WRITE_BLOCKS = "/kvservice.v1.KVCacheService/WriteBlocks"
READ_BLOCKS = "/kvservice.v1.KVCacheService/ReadBlocks"
BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2
CHUNK = 16384
NUM_BLOCKS = 16
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks of 4
MESSAGES = 1000
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
FIELD_FIRST = re.compile(r"^[a-z_][a-z_0-9]*(\[\d+\])?(\.[a-z_][a-z_0-9]*(\[\d+\])?)*: ")
U32 = [2**31, 2**32 - 1]
U64 = [2**63, 2**64 - 1]


def memory(running: RunningServer) -> list[bytes]:
    """Every block's bytes (group 0), read from the server's tensors."""
    tensors = running.servicer.data_plane.tensors
    return [_BlockBytes(tensors.block_view(0, b)).read(0, BLOCK_BYTES) for b in range(NUM_BLOCKS)]


def block_chunks(
    request_id: str, block_id: int, data: bytes, allocation_id: int, epoch: str
) -> list[pb.WriteBlocksChunk]:
    chunks = [
        pb.WriteBlocksChunk(
            request_id=request_id,
            group_idx=0,
            block_id=block_id,
            offset_bytes=at,
            data=data[at : at + CHUNK],
            allocation_id=allocation_id,
            epoch=epoch,
        )
        for at in range(0, len(data), CHUNK)
    ]
    chunks[-1].checksum = block_checksum(data)
    return chunks


def mutate_write(rng: random.Random, chunks: list[pb.WriteBlocksChunk], written: int, epoch: str) -> tuple[str, list]:
    """One mutation of a valid one-block write: (its name, the messages as bytes)."""
    chunks = [pb.WriteBlocksChunk.FromString(c.SerializeToString()) for c in chunks]
    i = rng.randrange(len(chunks))
    c = chunks[i]
    kind = rng.choice(
        [
            "offset", "size", "block_id", "group", "allocation_id", "epoch", "checksum", "no_checksum",
            "in_memory", "request_id", "drop", "repeat", "swap", "written_block",
        ]
    )  # fmt: skip
    if kind == "offset":
        c.offset_bytes = rng.choice([1, CHUNK - 1, CHUNK + 1, BLOCK_BYTES, *U64, c.offset_bytes + rng.randrange(1, 9)])
    elif kind == "size":
        c.data = rng.choice([b"", b"\7" * (CHUNK + 1), c.data[: rng.randrange(len(c.data))], c.data + b"\7"])
    elif kind == "block_id":
        c.block_id = rng.choice([0, NUM_BLOCKS, *U32, rng.randrange(NUM_BLOCKS)])
    elif kind == "group":
        c.group_idx = rng.choice([1, 2, *U32])
    elif kind == "allocation_id":
        c.allocation_id = rng.choice([0, 1, c.allocation_id + 1, *U64]) if c.allocation_id != 0 else 7
    elif kind == "epoch":
        c.epoch = rng.choice(["", "x", epoch + "0", "é" * 3])
    elif kind == "checksum":
        if c.HasField("checksum"):
            c.checksum ^= 1 << rng.randrange(64)
        else:
            c.checksum = rng.choice([0, *U64])
    elif kind == "no_checksum":
        chunks[-1].ClearField("checksum")
    elif kind == "in_memory":
        c.in_memory = True
        if rng.random() < 0.5 and i == 0:
            c.ClearField("data")
            c.ClearField("checksum")
            c.checksum = rng.choice([0, block_checksum(b"\0" * BLOCK_BYTES)])
            chunks = [c]
    elif kind == "request_id":
        c.request_id = rng.choice(["", "nobody", "w ", "é" * 300, "x" * 20_000])
    elif kind == "drop":
        del chunks[i]
    elif kind == "repeat":  # not the last chunk: the block would be complete (and written) before it
        i = rng.randrange(len(chunks) - 1)
        chunks.insert(i, chunks[i])
    elif kind == "swap" and len(chunks) > 1:
        j = (i + 1) % len(chunks)
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif kind == "written_block":
        for chunk in chunks:
            chunk.block_id = written
    return kind, [chunk.SerializeToString() for chunk in chunks]


def wild_bytes(rng: random.Random, valid: bytes) -> bytes:
    """Random bytes, or ``valid`` cut short, or ``valid`` with random bytes flipped."""
    which = rng.randrange(3)
    if which == 0:
        return rng.randbytes(rng.randrange(1, 64))
    if which == 1:
        return valid[: rng.randrange(1, len(valid))]
    data = bytearray(valid)
    for _ in range(rng.randrange(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def read_request(rng: random.Random, written: int, unwritten: int, written_hash: bytes) -> bytes:
    """A ReadBlocksRequest (as bytes): mostly wrong, sometimes right."""
    kind = rng.randrange(8)
    if kind == 0:
        refs = [pb.BlockRef(group_idx=0, block_id=rng.choice([NUM_BLOCKS, NUM_BLOCKS + 1, *U32]))]
    elif kind == 1:
        refs = [pb.BlockRef(group_idx=0, block_id=rng.choice([0, unwritten]))]
    elif kind == 2:
        length = rng.choice([0, 1, 7, 9, 31, 33, 1000])
        refs = [pb.BlockRef(group_idx=0, block_hash=rng.randbytes(length))]
    elif kind == 3:
        refs = [pb.BlockRef(group_idx=rng.choice([1, *U32]), block_id=written)]
    elif kind == 4:
        refs = [pb.BlockRef(group_idx=0), pb.BlockRef(group_idx=0, block_id=written)]
    elif kind == 5:
        # Above the bound, and never cut short (65,536 refs of a written block would be 3 GiB).
        refs = [pb.BlockRef(group_idx=0, block_id=written)] * (MAX_READ_BLOCKS + rng.randrange(1, 3))
        return pb.ReadBlocksRequest(blocks=refs).SerializeToString()
    elif kind == 6:
        refs = [pb.BlockRef(group_idx=0, block_hash=written_hash)]
    else:
        refs = [pb.BlockRef(group_idx=0, block_id=written), pb.BlockRef(group_idx=0, block_id=unwritten)]
    data = pb.ReadBlocksRequest(blocks=refs).SerializeToString()
    return wild_bytes(rng, data) if rng.random() < 0.3 else data


async def test_a_thousand_fuzzed_data_plane_messages_get_no_internal(start_kv_server, connect):
    running = await start_kv_server(device="cpu", data_chunk_bytes=CHUNK)
    client = await connect(running)
    dp = running.servicer.data_plane
    await client.get_computed_blocks("w", PROMPT)
    allocated = await client.allocate_slots("w", len(PROMPT))
    assert allocated.allocated
    written, second, third = allocated.new_block_ids[0].block_ids
    allocation_id, epoch = allocated.allocation_id, allocated.epoch
    first_bytes = bytes(range(256)) * (BLOCK_BYTES // 256)
    response = await client.stub.WriteBlocks(iter(block_chunks("w", written, first_bytes, allocation_id, epoch)))
    assert (response.num_blocks_written, response.num_bytes_written) == (1, BLOCK_BYTES)
    written_hash = bytes(running.engine.manager.block_pool.blocks[written].block_hash)
    targets = [second, third]  # allocated to "w", not written: a mutated write of one may land
    write = client.channel.stream_unary(WRITE_BLOCKS, request_serializer=None, response_deserializer=None)
    read = client.channel.unary_stream(READ_BLOCKS, request_serializer=None, response_deserializer=None)

    rng = random.Random(24)
    request_id = "w"
    codes: Counter[tuple[str, str]] = Counter()
    landed: list[str] = []
    for n in range(MESSAGES):
        before, states = memory(running), bytes(dp.byte_state)
        if n % 2 == 0:
            target = rng.choice(targets)
            valid = block_chunks(request_id, target, rng.randbytes(BLOCK_BYTES), allocation_id, epoch)
            if rng.random() < 0.25:
                kind, messages = "bytes", [wild_bytes(rng, valid[0].SerializeToString())]
            else:
                kind, messages = mutate_write(rng, valid, written, epoch)
            try:
                await write(iter(messages), timeout=20)
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
            rpc = "WriteBlocks"
        else:
            kind, request = "read", read_request(rng, written, rng.choice(targets), written_hash)
            call = read(request, timeout=20)
            try:
                async for _ in call:
                    pass
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
            rpc = "ReadBlocks"
        where = f"message {n} ({rpc}, {kind}): {code.name} {details[:200]!r}"
        assert code in ALLOWED and not details.startswith("Stream removed"), where  # the server's own status
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert FIELD_FIRST.match(details), where
        codes[(rpc, code.name)] += 1
        running.engine.check_invariants()
        assert (dp.num_open_streams, dp.buffered_bytes) == (0, 0), where
        if code == grpc.StatusCode.OK and rpc == "WriteBlocks":
            landed.append(kind)
            targets = [b for b in targets if dp.byte_state[b] == 0]  # written now: final
            if not targets:  # the next request computes fresh blocks, so mutated writes keep a target
                await client.free(request_id)
                request_id = f"r{n}"
                await client.get_computed_blocks(request_id, [10_000 + 16 * n + t for t in range(12)])
                again = await client.allocate_slots(request_id, 12)
                assert again.allocated, where
                targets = list(again.new_block_ids[0].block_ids)
                allocation_id, epoch = again.allocation_id, again.epoch
        else:
            assert memory(running) == before, where
            assert bytes(dp.byte_state) == states, where
    assert sum(codes.values()) == MESSAGES
    assert dict(codes) == {
        ("WriteBlocks", "INVALID_ARGUMENT"): 454,
        ("WriteBlocks", "FAILED_PRECONDITION"): 43,
        ("WriteBlocks", "OK"): 3,
        ("ReadBlocks", "INVALID_ARGUMENT"): 349,  # 58 of them a hash not 32 bytes long
        ("ReadBlocks", "FAILED_PRECONDITION"): 98,
        ("ReadBlocks", "NOT_FOUND"): 5,
        ("ReadBlocks", "OK"): 48,
    }
    # The writes that landed: two in-memory marks of zero blocks (the checksum of zeros), one whose
    # mutated allocation_id drew the same value.
    assert landed == ["in_memory", "allocation_id", "in_memory"]


async def test_a_write_naming_a_request_id_above_the_bound_is_refused_naming_it(start_kv_server, connect):
    """The status names the bound and does not echo the id (a 20,000-character id echoed made the
    status trailer exceed the client's metadata limit: RESOURCE_EXHAUSTED from the transport)."""
    running = await start_kv_server(device="cpu", data_chunk_bytes=CHUNK)
    client = await connect(running)
    chunk = pb.WriteBlocksChunk(request_id="x" * 20_000, group_idx=0, block_id=1, data=b"\1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.WriteBlocks(iter([chunk]))
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunks[0].request_id: longer than 256 bytes (max_request_id_bytes)",
    )
    assert (running.servicer.data_plane.num_open_streams, bytes(running.servicer.data_plane.byte_state)) == (
        0,
        bytes(NUM_BLOCKS),
    )
