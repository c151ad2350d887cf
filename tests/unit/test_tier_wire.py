"""The tier's PutBlocks messages written and read by hand: the client's (kvservice_client.tier)
byte for byte what protobuf makes of the same messages; the server's reading of a chunk in place
(kvservice.server.wire.put_chunk) what protobuf parses, or None (then protobuf parses it)."""

from __future__ import annotations

import pytest

from kvservice.server.wire import put_chunk
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.tier import _put_serialized, _varint, put_blocks_messages, reserve_blocks_request


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
