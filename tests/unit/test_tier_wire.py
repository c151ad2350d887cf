"""The tier's hand-serialized PutBlocks messages (kvservice_client.tier): byte for byte what
protobuf makes of the same messages."""

from __future__ import annotations

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
