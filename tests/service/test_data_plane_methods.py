"""The data plane as methods of both clients (``client.write_blocks``, ``client.read_blocks``,
``client.iter_read_blocks``, ``client.attach_kv_cache``), blocks named by ``(group_idx, block_id)``
or ``(group_idx, block_hash)``, and a block of the wrong size refused by name before any byte goes.

The server keeps its KV tensors on the CPU (shared memory); its layout (qwen-2.5-0.5b at block
size 4) has 49,152 bytes per block.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvservice_client.client import KVCacheClient, KVServiceError
from kvservice_client.hashing import BlockHasher

BLOCK_BYTES = 49_152
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks of 4


def pattern(seed: int, num_bytes: int = BLOCK_BYTES) -> bytes:
    unit = seed.to_bytes(8, "little") + bytes(range(248))
    return (unit * (num_bytes // len(unit) + 1))[:num_bytes]


async def test_the_async_clients_methods_write_and_read_by_id_and_by_hash(start_kv_server, connect):
    running = await start_kv_server(device="cpu", data_chunk_bytes=4096)
    client = await connect(running)
    await client.get_computed_blocks("w", PROMPT)
    ids = list((await client.allocate_slots("w", len(PROMPT))).new_block_ids[0].block_ids)
    assert ids == [1, 2, 3]
    written = await client.write_blocks("w", [(0, b, pattern(b)) for b in ids])
    assert (written.num_blocks_written, written.num_bytes_written) == (3, 3 * BLOCK_BYTES)
    await client.free("w")  # cached now: readable by hash
    digests = BlockHasher(4).hash_prompt(PROMPT)
    blocks = await client.read_blocks([(0, 2), (0, digests[2])])
    assert [(b.block_index, b.block_id, b.data == pattern(b.block_id)) for b in blocks] == [(0, 2, True), (1, 3, True)]
    streamed = [b.block_id async for b in client.iter_read_blocks([(0, 1), (0, 3)])]
    assert streamed == [1, 3]
    assert list((await client.attach_kv_cache()).bytes_per_block) == [BLOCK_BYTES]


async def test_the_blocking_clients_methods(start_kv_server, connect):
    running = await start_kv_server(device="cpu")
    client = await connect(running)
    await client.get_computed_blocks("w", PROMPT)
    ids = list((await client.allocate_slots("w", len(PROMPT))).new_block_ids[0].block_ids)

    def blocking() -> tuple[int, list[int], list[bool], int]:
        with KVCacheClient(running.address, timeout=10.0) as sync_client:
            written = sync_client.write_blocks("w", [(0, b, pattern(b)) for b in ids]).num_blocks_written
            read = sync_client.read_blocks([(0, b) for b in ids])
            streamed = [b.data == pattern(b.block_id) for b in sync_client.iter_read_blocks([(0, b) for b in ids])]
            return written, [b.block_id for b in read], streamed, sync_client.attach_kv_cache().num_blocks

    assert await asyncio.to_thread(blocking) == (3, [1, 2, 3], [True, True, True], 16)


@pytest.mark.parametrize(
    ("num_bytes", "group_idx", "message"),
    [
        (
            BLOCK_BYTES - 1,
            0,
            f"block 1 of group 0: {BLOCK_BYTES - 1} bytes, but a block of that group is {BLOCK_BYTES} bytes "
            "(bytes_per_block); nothing was sent",
        ),
        (
            BLOCK_BYTES + 4096,
            0,
            f"block 1 of group 0: {BLOCK_BYTES + 4096} bytes, but a block of that group is {BLOCK_BYTES} bytes",
        ),
        (BLOCK_BYTES, 3, "block 1: group_idx 3 out of range (the server has 1 groups)"),
    ],
)
async def test_a_block_of_the_wrong_size_is_named_and_nothing_is_sent(
    start_kv_server, connect, num_bytes, group_idx, message
):
    running = await start_kv_server(device="cpu")
    client = await connect(running)
    await client.get_computed_blocks("w", PROMPT)
    await client.allocate_slots("w", len(PROMPT))
    await client.write_blocks("w", [(0, 1, pattern(7))])
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        await client.write_blocks("w", [(0, 2, pattern(2)), (group_idx, 1, pattern(1, num_bytes))])
    assert [b.data == pattern(7) for b in await client.read_blocks([(0, 1)])] == [True]  # block 1 unchanged
    with pytest.raises(KVServiceError, match=r"^FAILED_PRECONDITION: blocks\[0\].block_id: block 2 is not written yet"):
        await client.read_blocks([(0, 2)])  # nor block 2: still not written
    assert running.tensors.block_view(0, 2)[0].view(torch.uint8).flatten().numpy().tobytes() == bytes(BLOCK_BYTES)


async def test_a_ref_of_another_shape_is_named(start_kv_server, connect):
    client = await connect(await start_kv_server(device="cpu"))
    with pytest.raises(TypeError, match=r"a block to read is a BlockRef, \(group_idx, block_id\) or \(group_idx, "):
        await client.read_blocks([7])


async def test_a_tensor_kept_past_the_stop_reads_old_memory_and_check_says_so(start_kv_server, connect):
    """What docs/data-plane.md says of a stale tensor: the view refuses (block_view, check()), a
    tensor taken before the stop is not checked and still reads the segment's last contents."""
    from kvservice_client.torch_view import KVCacheViewClosedError, aattach

    running = await start_kv_server(device="cpu")
    client = await connect(running)
    view = await aattach(client)
    [kept] = view.block_view(0, 1)
    kept[0, 0, 0, :4] = 7  # through the mapping, as a worker writes
    await running.stop()
    assert kept[0, 0, 0, :4].tolist() == [7.0, 7.0, 7.0, 7.0]  # no error: the old memory
    with pytest.raises(KVCacheViewClosedError, match="has stopped or restarted"):
        view.check()
    with pytest.raises(KVCacheViewClosedError):
        view.block_view(0, 1)
    view.close()
