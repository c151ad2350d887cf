"""write_blocks / awrite_blocks check their blocks before anything is sent: a bad block is the
ValueError or TypeError their docstring names, raised to the caller in both clients (not the
blocking client's UNKNOWN "Exception iterating requests!" from inside gRPC's request thread, nor a
CancelledError out of the async one), and no call is made (here: a client of a closed port, whose
first call would be UNAVAILABLE)."""

from __future__ import annotations

import pytest

from kvservice_client import AsyncKVCacheClient, KVCacheClient
from kvservice_client.data import awrite_blocks, write_block_chunks, write_blocks

BAD_WRITES = [
    ([(0, 1, b"xx")], {"chunk_bytes": 0}, ValueError, "chunk_bytes must be >= 1; got 0"),
    ([(0, 1, b"")], {}, ValueError, "block 1: no bytes"),
    ([(0, -1, b"xx")], {"chunk_bytes": 1}, ValueError, r"block_id: -1 outside 0..4294967295"),
    ([(2**32, 1, b"xx")], {"chunk_bytes": 1}, ValueError, r"group_idx: 4294967296 outside 0..4294967295"),
    ([(0, 1, "xx")], {"chunk_bytes": 1}, TypeError, "block 1: its bytes must be bytes-like"),
    ([(0, 1.5, b"xx")], {"chunk_bytes": 1}, TypeError, "block_id: 1.5 is not an integer"),
]


@pytest.mark.parametrize(("blocks", "kwargs", "error", "message"), BAD_WRITES)
def test_a_bad_block_is_refused_before_the_call(blocks, kwargs, error, message):
    with KVCacheClient("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(error, match=message):
            write_blocks(client, "r", blocks, **kwargs)
    with pytest.raises(error, match=message):
        list(write_block_chunks("r", blocks, kwargs.get("chunk_bytes", 1)))


@pytest.mark.parametrize(("blocks", "kwargs", "error", "message"), BAD_WRITES)
async def test_a_bad_block_is_refused_before_the_call_async(blocks, kwargs, error, message):
    async with AsyncKVCacheClient("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(error, match=message):
            await awrite_blocks(client, "r", blocks, **kwargs)


def test_good_blocks_make_the_same_chunks():
    chunks = list(write_block_chunks("r", [(0, 3, b"abc"), (1, 4, bytearray(b"de"))], 2))
    assert [(c.group_idx, c.block_id, c.offset_bytes, c.data, c.HasField("checksum")) for c in chunks] == [
        (0, 3, 0, b"ab", False),
        (0, 3, 2, b"c", True),
        (1, 4, 0, b"de", True),
    ]
