"""Block pool: free-queue order, copies of a hash, evict_blocks, reset, invariant check."""

from __future__ import annotations

import pytest

from kvservice.core.block_pool import BlockHashToBlockMap, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvservice_client.events import AllBlocksCleared, BlockRemoved


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_pop_remove_append_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5] and q.num_free_blocks == 6
    assert q.popleft().block_id == 0
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    q.append(blocks[3])
    q.appendleft(blocks[0])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]
    assert ids(q.popleft_n(3)) == [0, 1, 2]
    assert ids(q.get_all_free_blocks()) == [4, 5, 3] and q.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[0])
    with pytest.raises(ValueError, match="asked for 4 free blocks; 3 free"):
        q.popleft_n(4)
    assert ids(q.popleft_n(3)) == [4, 5, 3]
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [2]


def test_null_block_is_block_zero_and_never_freed():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert pool.free_blocks([pool.null_block]) == 0
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    pool.check_invariants()


def test_free_blocks_appends_cached_and_prepends_uncached():
    pool = BlockPool(8)
    b = pool.get_new_blocks(4)  # ids 1..4
    assert ids(b) == [1, 2, 3, 4] and all(x.ref_cnt == 1 for x in b)
    b[0].block_hash, b[0].group_idx = b"h1", 0
    b[1].block_hash, b[1].group_idx = b"h2", 0
    pool.cached_block_hash_to_block[0].insert(b"h1", b[0])
    pool.cached_block_hash_to_block[0].insert(b"h2", b[1])
    # Freed in eviction priority (tail first): 4 (uncached), 3 (uncached), 2, 1.
    assert pool.free_blocks(reversed(b)) == 4
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_hash_map_copies():
    m = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    assert m.insert(b"x", a) is True
    assert m.insert(b"x", b) is False and m.insert(b"x", c) is False
    assert m.num_copies(b"x") == 3 and len(m) == 1
    assert m.pop(b"x", 2) is False and m.num_copies(b"x") == 2
    assert m.pop(b"x", 1) is False and m.get_one_block(b"x") is c
    assert m.pop(b"x", 3) is True and b"x" not in m and m.get_one_block(b"x") is None
    with pytest.raises(KeyError):
        m.pop(b"x", 3)


def test_evict_blocks_drops_hash_and_leaves_a_free_block_in_place():
    """As vLLM 0.33's evict_blocks: the block keeps its place in the free queue (measured with
    vLLM's own manager side by side: clients/vllm/tests/test_core_equivalence.py)."""
    pool = BlockPool(6, enable_kv_cache_events=True, medium="CPU")
    b = pool.get_new_blocks(2)
    for blk, h in zip(b, (b"a" * 8, b"b" * 8)):
        blk.block_hash, blk.group_idx = h, 0
        pool.cached_block_hash_to_block[0].insert(h, blk)
    pool.free_blocks(reversed(b))  # queue: 3 4 5 2 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    assert pool.evict_blocks([1, 4]) == 1  # 4 is not cached
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    assert pool.evicted_while_held == set()  # 1 was free
    assert pool.take_events() == [BlockRemoved([int.from_bytes(b"a" * 8, "big")], "CPU", group_idx=0)]
    with pytest.raises(IndexError, match="block id 9 outside 0..5"):
        pool.evict_blocks([9])
    pool.check_invariants()


def test_reset_refuses_while_held_then_clears():
    pool = BlockPool(4, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)
    b[0].block_hash, b[0].group_idx = b"h", 0
    pool.cached_block_hash_to_block[0].insert(b"h", b[0])
    assert pool.reset_prefix_cache() is False and pool.take_events() == []
    assert pool.get_cached_block(b"h", 0) is b[0]
    pool.free_blocks(b)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(b"h", 0) is None and b[0].block_hash is None
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(4)
    b = pool.get_new_blocks(1)
    b[0].ref_cnt = 0  # held block with ref 0, not in the queue
    with pytest.raises(AssertionError, match="ref count vs free queue"):
        pool.check_invariants()
