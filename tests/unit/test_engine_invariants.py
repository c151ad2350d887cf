"""KVCacheEngine.check_invariants: what the request table adds to the manager's check.

Each corruption below keeps every ref count equal to its number of holders, so the manager's own
check passes; only the engine's sees that a block is shared without being cached, sits at a
position whose hash it does not carry, is held in two groups, or is held by a request that is not
running.
"""

from __future__ import annotations

import pytest

from kvservice.core.engine import KVCacheEngine
from tests.unit.core_helpers import full, make_manager


def two_sharing_requests(num_groups: int = 1) -> KVCacheEngine:
    """A holds tokens 1..9 (blocks 0-1 cached, block 2 partial); B shares A's two cached blocks."""
    engine = KVCacheEngine(make_manager(11, [full() for _ in range(num_groups)], max_model_len=64))
    engine.get_computed_blocks("A", range(1, 10))
    assert engine.allocate_slots("A", 9).allocated
    assert engine.get_computed_blocks("B", [*range(1, 9), 50]).num_computed_tokens == 8
    assert engine.allocate_slots("B", 1).allocated
    return engine


def table(engine: KVCacheEngine, request_id: str, group_idx: int = 0) -> list:
    return engine.manager.coordinator.managers[group_idx].req_to_blocks[request_id]


def test_shared_cached_blocks_pass() -> None:
    engine = two_sharing_requests()
    a, b = table(engine, "A"), table(engine, "B")
    assert [blk.block_id for blk in a] == [1, 2, 3] and [blk.block_id for blk in b] == [1, 2, 4]
    assert [blk.ref_cnt for blk in a] == [2, 2, 1]
    engine.check_invariants()


def test_a_block_shared_without_a_hash_fails() -> None:
    engine = two_sharing_requests()
    partial = table(engine, "A")[2]  # A's partial block (3): never cached
    engine.manager.block_pool.free_blocks([table(engine, "B")[2]])  # B's own partial block (4) goes back
    table(engine, "B")[2] = partial
    partial.ref_cnt += 1
    engine.manager.check_invariants()  # ref counts match their holders
    with pytest.raises(AssertionError, match=r"block 3 held by \['A', 'B'\] at once but not cached"):
        engine.check_invariants()


def test_a_cached_block_at_another_position_fails() -> None:
    engine = two_sharing_requests()
    b = table(engine, "B")
    b[0], b[1] = b[1], b[0]
    engine.manager.check_invariants()
    with pytest.raises(AssertionError, match=r"block 2 \(cached in group 0\) sits at position 0 of B's group 0 table"):
        engine.check_invariants()


def test_a_block_held_in_two_groups_fails() -> None:
    engine = two_sharing_requests(num_groups=2)
    block = table(engine, "A", 0)[2]
    table(engine, "A", 1).append(block)
    block.ref_cnt += 1
    engine.manager.check_invariants()
    with pytest.raises(AssertionError, match=rf"block {block.block_id} held in groups 0 and 1"):
        engine.check_invariants()


def test_blocks_held_by_a_request_that_is_not_running_fail() -> None:
    engine = two_sharing_requests()
    engine.running.discard("B")
    with pytest.raises(AssertionError, match="B holds blocks but is not running"):
        engine.check_invariants()
    engine.running.add("B")
    engine.running.add("ghost")
    with pytest.raises(AssertionError, match=r"running but not registered: \['ghost'\]"):
        engine.check_invariants()
