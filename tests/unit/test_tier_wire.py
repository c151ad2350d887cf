"""Block messages written and read by hand, checked against protobuf: the client's PutBlocks
chunks (kvservice_client.tier) and the server's ReadBlocks chunks (kvservice.server.data_plane)
byte for byte what SerializeToString makes of the same messages; the server's reading of a PutBlocks
chunk in place (kvservice.server.wire.put_chunk) what protobuf parses, or None (then protobuf
parses it)."""

from __future__ import annotations

import pytest

from kvservice.server.wire import put_chunk
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._wire import varint as _varint
from kvservice_client.tier import _put_serialized, put_blocks_messages, reserve_blocks_request


def test_varint_is_protobufs_encoding():
    for value in (0, 1, 127, 128, 300, 1 << 20, (1 << 32) - 1, (1 << 64) - 1):
        assert _varint(value) == pb.PutBlocksChunk(checksum=value).SerializeToString()[1:]  # field 4, then the varint


def test_put_serialized_is_put_blocks_messages_serialized():
    header = reserve_blocks_request(3, [bytes([i]) * 32 for i in range(4)], parent_block_hashes=[None, b"p" * 32])
    blocks = [bytes(range(256)) * 5, None, b"\x00" * 300, b"\xff"]  # 1280 bytes: 5 chunks of 256; none; 2; 1
    views = [None if b is None else memoryview(b) for b in blocks]
    ours = list(_put_serialized(header, views, 256))
    theirs = list(put_blocks_messages(header, blocks, 256))
    assert [pb.PutBlocksMessage.FromString(m) for m in ours] == theirs
    assert ours == [m.SerializeToString() for m in theirs]
    assert len(ours) == 1 + 5 + 2 + 1


def test_put_chunk_reads_what_protobuf_parses():
    header = reserve_blocks_request(0, [bytes([i]) * 32 for i in range(3)])
    blocks = [bytes(range(256)) * 2, b"", b"\x07" * 300]
    views = [memoryview(b) for b in blocks]
    messages = list(_put_serialized(header, views, 256))[1:]
    read = [put_chunk(m) for m in messages]
    assert [(c.block_index, c.offset_bytes, bytes(c.data), c.checksum) for c in read] == [
        (c.block_index, c.offset_bytes, c.data, c.checksum if c.HasField("checksum") else None)
        for c in (pb.PutBlocksMessage.FromString(m).chunk for m in messages)
    ]
    assert [(c.block_index, c.offset_bytes, len(c.data), c.checksum is None) for c in read] == [
        (0, 0, 256, True),
        (0, 256, 256, False),
        (2, 0, 256, True),
        (2, 256, 44, False),
    ]


def _chunk_message(inner: bytes) -> bytes:
    return b"\x12" + _varint(len(inner)) + inner


@pytest.mark.parametrize(
    "data",
    [
        b"",
        pb.PutBlocksMessage(header=reserve_blocks_request(0, [b"k" * 32])).SerializeToString(),
        _chunk_message(b"\x08\x01\x08\x02"),  # block_index twice (protobuf: the last wins)
        _chunk_message(b"\x1a\x01a\x1a\x01b"),  # data twice
        _chunk_message(b"\x28\x01"),  # an unknown field 5
        _chunk_message(b"\x08" + _varint(1 << 32)),  # block_index past uint32 (protobuf truncates)
        _chunk_message(b"\x10" + _varint(1 << 64)),  # offset_bytes past uint64
        _chunk_message(b"\x1a\x05abc"),  # data past the end
        _chunk_message(b"\x08\x80"),  # a varint cut short
        _chunk_message(b"\x08\x01") + b"\x12\x00",  # chunk twice (protobuf merges them)
        _chunk_message(b"\x08\x01")[:-1],  # shorter than its length
    ],
)
def test_put_chunk_leaves_anything_else_to_protobuf(data):
    assert put_chunk(data) is None


class _Tensors:
    """The one method of KVCacheTensors that ``_read_chunk`` calls: a block's views."""

    def __init__(self, pools: list[object]) -> None:
        self.pools = pools

    def block_view(self, group_idx: int, block_id: int) -> tuple[object, ...]:
        return tuple(pool[:, block_id] for pool in self.pools)


PIECES = {(0, 176): [64, 64, 24, 24], (0, 40): [40], (5, 37): [32], (30, 150): [34, 64, 22], (100, 176): [28, 24, 24]}


@pytest.mark.parametrize(("start", "end"), [(0, 176), (0, 40), (5, 37), (30, 150), (100, 176)])
def test_a_read_chunk_serialized_by_hand_is_the_message_protobuf_serializes(start, end):
    import torch
    import xxhash

    from kvservice.server.data_plane import _BlockBytes, _read_chunk

    # Two views of 3 blocks: [2 layers, 3 blocks, 4, 8] bfloat16 (rows of 64 bytes in 2 runs) and
    # [2 layers, 3 blocks, 24] uint8: a block is 2 * 64 + 2 * 24 = 176 bytes, in four runs.
    generator = torch.Generator().manual_seed(0)
    pools = [
        torch.randint(0, 1 << 15, (2, 3, 4, 8), dtype=torch.int16, generator=generator).view(torch.bfloat16),
        torch.randint(0, 256, (2, 3, 24), dtype=torch.uint8, generator=generator),
    ]
    tensors = _Tensors(pools)
    fields = {"block_index": 7, "group_idx": 0, "block_id": 1}
    hasher = xxhash.xxh3_64()
    ours = _read_chunk(tensors, start, end, hasher, fields)
    block = _BlockBytes(tensors.block_view(0, 1))
    assert [len(p) for p in block.pieces(start, end)] == PIECES[start, end]  # views, not copies
    data = block.read(start, end)
    expected = pb.ReadBlocksChunk(offset_bytes=start, data=data, **fields)
    if end == 176:
        expected.checksum = xxhash.xxh3_64_intdigest(data) if start == 0 else hasher.intdigest()
    assert ours == expected.SerializeToString()
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)


def _fields(chunk):
    return (
        chunk.block_index,
        chunk.group_idx,
        chunk.block_id,
        chunk.offset_bytes,
        bytes(chunk.data),
        chunk.checksum,
        chunk.evicted,
        chunk.missing,
    )


@pytest.mark.parametrize(
    "message",
    [
        pb.ReadBlocksChunk(block_index=4, group_idx=1, missing=True),
        pb.ReadBlocksChunk(block_index=3, group_idx=1, block_id=9, offset_bytes=1 << 20, data=b"abc" * 100),
        pb.ReadBlocksChunk(block_index=0, block_id=2, data=b"x", checksum=0),
        pb.ReadBlocksChunk(block_index=1, block_id=5, offset_bytes=7, evicted=True),
        pb.ReadBlocksChunk(checksum=(1 << 64) - 1, data=bytes(range(256))),
        pb.ReadBlocksChunk(),
    ],
)
def test_the_client_reads_a_read_chunk_in_place_as_protobuf_parses_it(message):
    from kvservice_client.data import _read_chunk, _wire_read_chunk

    data = message.SerializeToString()
    assert _wire_read_chunk(data) is not None  # the server's form: read in place
    assert _fields(_read_chunk(data)) == _message_fields(message)


def _message_fields(message: pb.ReadBlocksChunk) -> tuple:
    """A parsed ReadBlocksChunk's fields in :func:`_fields`'s order (checksum None when absent)."""
    return (
        message.block_index,
        message.group_idx,
        message.block_id,
        message.offset_bytes,
        message.data,
        message.checksum if message.HasField("checksum") else None,
        message.evicted,
        message.missing,
    )


@pytest.mark.parametrize(
    "data",
    [
        b"\x08\x01\x08\x02",  # block_index twice (protobuf: the last wins)
        b"\x2a\x01a\x2a\x01b",  # data twice (the last wins)
        b"\x38\x02",  # evicted as 2 (protobuf: True)
        b"\x40\x02",  # missing as 2 (protobuf: True)
        b"\x08" + _varint(1 << 32),  # block_index past uint32 (protobuf truncates)
        b"\x50\x01",  # an unknown field 10 (protobuf keeps it)
    ],
)
def test_the_client_leaves_any_other_read_chunk_to_protobuf(data):
    from kvservice_client.data import _read_chunk, _wire_read_chunk

    assert _wire_read_chunk(data) is None
    message = pb.ReadBlocksChunk.FromString(data)
    assert _fields(_read_chunk(data)) == _message_fields(message)


@pytest.mark.parametrize("data", [b"\x2a\x05abc", b"\x08\x80"])
def test_bytes_that_are_no_read_chunk_fail_as_protobuf_fails(data):
    from google.protobuf.message import DecodeError

    from kvservice_client.data import _read_chunk

    with pytest.raises(DecodeError):
        _read_chunk(data)
