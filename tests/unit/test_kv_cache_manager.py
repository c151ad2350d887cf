"""The manager on tiny configs: exact block ids, free-queue order and event lists.

The first five tests are the issue's "small inputs that must give these answers" (block_size 4).
"""

from __future__ import annotations

import json
import logging

import pytest

from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice_client.hashing import BlockHasher, block_hash_to_int
from tests.conftest import VECTORS_DIR
from tests.unit.core_helpers import admit, free_ids, full, make_manager, step

H = [block_hash_to_int(h) for h in BlockHasher(4).hash_prompt(list(range(1, 17)))]  # hashes of 1..16
VECTOR_1_12 = next(
    c
    for c in json.loads((VECTORS_DIR / "vllm_sha256_cbor_block_hashes.json").read_text())["cases"]
    if c["name"] == "tokens 1..12, block 4"
)


def stored(
    hashes, parent, tokens, *, group=0, kind="full_attention", window=None, session=None, reused=False, block_size=4
):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        session_id=session,
        reused=reused,
    )


def removed(hashes, group=0, kind="full_attention", window=None):
    return BlockRemoved(hashes, "GPU", group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def test_hashes_match_vllm_vector():
    assert H[:3] == VECTOR_1_12["block_hashes_int64"]


# -- the small inputs ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "incremental"])
def test_full_mode_reports_reuse_once_on_admission(mode):
    m = make_manager(8)
    a = m.new_request("A", range(1, 13), kv_cache_report_mode=mode)
    assert admit(m, a) == (0, ([1, 2, 3],))
    assert m.take_events() == [stored(H[:3], None, range(1, 13))]
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 7, 3, 2, 1]

    b = m.new_request("B", list(range(1, 9)) + [99], kv_cache_report_mode=mode)
    # A lookup not followed by an allocation reports nothing.
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (8, ([1, 2],))
    assert m.take_events() == []
    assert admit(m, b) == (8, ([4],))
    expected = [stored(H[:2], None, range(1, 9), reused=True)] if mode == "full" else []
    assert m.take_events() == expected
    assert free_ids(m) == [5, 6, 7, 3]
    # Decoding further never reports the hit again.
    assert step(m, b, [100]) == ([],)
    assert m.take_events() == []
    m.check_invariants()


def test_failed_allocation_reports_nothing_in_full_mode():
    m = make_manager(5)
    a = m.new_request("A", range(1, 9), kv_cache_report_mode="full")
    admit(m, a)
    m.free(a)
    m.take_events()
    hog = m.new_request("hog", range(100, 108))
    assert admit(m, hog) == (0, ([3, 4],))  # takes both never-cached blocks
    m.take_events()
    b = m.new_request("B", list(range(1, 9)) + list(range(50, 60)), kv_cache_report_mode="full")
    assert admit(m, b) == (8, None)  # hit 2 blocks, needs 3 more, none free
    assert m.take_events() == []
    assert free_ids(m) == [2, 1]
    m.check_invariants()


def test_second_physical_copy_emits_nothing_and_last_copy_removal_once():
    m = make_manager(6)
    a = m.new_request("A", range(1, 9))
    assert admit(m, a) == (0, ([1, 2],))
    m.free(a)
    assert m.take_events() == [stored(H[:2], None, range(1, 9))]
    assert free_ids(m) == [3, 4, 5, 2, 1]

    b = m.new_request("B", range(1, 9))
    # The last token is always computed: the hit is 1 block, and B recomputes block 1.
    assert admit(m, b) == (4, ([3],))
    assert m.get_block_ids("B") == ([1, 3],)
    assert m.take_events() == []  # block 3 is a second copy of H[1]: nothing emitted
    assert m.block_pool.cached_block_hash_to_block[0].num_copies(BlockHasher(4).hash_prompt(range(1, 9))[1]) == 2
    assert free_ids(m) == [4, 5, 2]

    c = m.new_request("C", range(200, 212))
    assert admit(m, c) == (0, ([4, 5, 2],))  # evicts block 2, A's copy of H[1]
    c_hashes = [block_hash_to_int(h) for h in BlockHasher(4).hash_prompt(range(200, 212))]
    assert m.take_events() == [stored(c_hashes, None, range(200, 212))]  # no BlockRemoved: B's copy stays

    d = m.new_request("D", list(range(1, 9)) + [5])
    blocks, hit = m.get_computed_blocks(d)
    assert (hit, blocks.get_block_ids()) == (8, ([1, 3],))

    m.free(b)
    assert free_ids(m) == [3, 1]
    m.free(c)
    assert free_ids(m) == [3, 1, 2, 5, 4]
    e = m.new_request("E", range(300, 304))
    e_hash = [block_hash_to_int(h) for h in BlockHasher(4).hash_prompt(range(300, 304))]
    assert admit(m, e) == (0, ([3],))  # evicts B's copy: now the last one
    assert m.take_events() == [removed([H[1]]), stored(e_hash, None, range(300, 304))]
    f = m.new_request("F", range(400, 404))
    assert admit(m, f) == (0, ([1],))
    f_hash = [block_hash_to_int(h) for h in BlockHasher(4).hash_prompt(range(400, 404))]
    assert m.take_events() == [removed([H[0]]), stored(f_hash, None, range(400, 404))]
    m.check_invariants()


def test_one_call_chains_and_extension_chains_from_parent():
    m = make_manager(10)
    a = m.new_request("A", range(1, 13))
    admit(m, a)
    events = m.take_events()
    assert events == [stored(H[:3], None, range(1, 13))]
    assert len(events[0].token_ids) == len(events[0].block_hashes) * events[0].block_size == 12
    assert step(m, a, [13, 14, 15, 16]) == ([4],)
    assert m.take_events() == [stored([H[3]], H[2], range(13, 17))]


def test_sliding_window_nulls_skipped_blocks_and_events_pair_hashes_with_their_tokens():
    m = make_manager(12, [SlidingWindowSpec(4, 1, 1, "float16", sliding_window=4)])
    kw = dict(kind="sliding_window", window=4)
    a = m.new_request("A", range(1, 13), kv_cache_report_mode="full")
    assert admit(m, a) == (0, ([1, 2, 3],))
    assert m.take_events() == [stored(H[:3], None, range(1, 13), **kw)]
    assert step(m, a, [13]) == ([4],)
    # 12 computed tokens, window 4: tokens 0..8 are out of the window, blocks 0-1 are null now.
    assert m.get_block_ids("A") == ([0, 0, 3, 4],)
    assert free_ids(m)[-2:] == [2, 1]
    b = m.new_request("B", range(1, 14), kv_cache_report_mode="full")
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (12, ([0, 0, 3],))
    assert admit(m, b) == (12, ([5],))
    # The reuse report names only the block the group holds, with its real parent.
    assert m.take_events() == [stored([H[2]], H[1], range(9, 13), reused=True, **kw)]
    for event in m.take_events():
        assert event.kv_cache_spec_kind == "sliding_window" and event.kv_cache_spec_sliding_window == 4
    m.check_invariants()


def test_reset_refused_while_held_then_clears_everything():
    m = make_manager(8)
    a = m.new_request("A", range(1, 9))
    admit(m, a)
    m.take_events()
    before = (free_ids(m), m.get_block_ids("A"))
    assert m.reset_prefix_cache() is False
    assert m.take_events() == [] and (free_ids(m), m.get_block_ids("A")) == before
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert sorted(free_ids(m)) == list(range(1, 8)) and m.usage == 0.0
    blocks, hit = m.get_computed_blocks(m.new_request("N", range(1, 10)))
    assert hit == 0 and blocks.get_block_ids() == ([],)
    m.check_invariants()


# -- eviction order --------------------------------------------------------------------------


def test_eviction_is_lru_and_tail_of_a_freed_request_first():
    m = make_manager(7, events=False)
    a = m.new_request("A", range(1, 9))  # blocks 1,2
    b = m.new_request("B", range(101, 109))  # blocks 3,4
    admit(m, a)
    admit(m, b)
    m.free(b)
    m.free(a)  # freed later: evicted later
    assert free_ids(m) == [5, 6, 4, 3, 2, 1]
    c = m.new_request("C", range(201, 213))  # needs 3: 5, 6 then B's tail block 4
    assert admit(m, c) == (0, ([5, 6, 4],))
    assert m.get_computed_blocks(m.new_request("B2", range(101, 110)))[1] == 4  # B's prefix survived
    assert m.get_computed_blocks(m.new_request("A2", range(1, 10)))[1] == 8
    # A hit block leaves the queue and re-enters at the tail when freed again.
    a3 = m.new_request("A3", range(1, 10))
    assert admit(m, a3) == (8, ([3],))  # the hit takes 1,2; the new block evicts B's block 3
    m.free(a3)
    assert free_ids(m) == [3, 2, 1]  # block 3 holds only token 9 (uncached): it goes to the head
    m.check_invariants()


# -- hit rules per manager -------------------------------------------------------------------


def test_chunked_local_attention_hit_and_skip():
    m = make_manager(20, [ChunkedLocalAttentionSpec(4, 1, 1, "float16", attention_chunk_size=8)])
    # Chunks attend only within themselves, so earlier chunks never need computing (vLLM's rule):
    # a fresh 12-token prompt "hits" its first chunk (8 tokens) with null blocks.
    a = m.new_request("A", range(1, 13))
    assert admit(m, a) == (8, ([1],))
    assert m.get_block_ids("A") == ([0, 0, 1],)
    assert m.take_events() == [stored([H[2]], H[1], range(9, 13), kind="chunked_local_attention")]
    b = m.new_request("B", range(1, 15))  # max hit 13 tokens: chunk starts at 8, block 2 is cached
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (12, ([0, 0, 1],))
    # Once 16 tokens are computed A only needs its current chunk: blocks 2-3 are skipped.
    assert step(m, a, [13, 14, 15, 16]) == ([2],)
    assert step(m, a, [17]) == ([3],)
    assert m.get_block_ids("A") == ([0, 0, 0, 0, 3],)
    m.check_invariants()


def test_mamba_hit_is_the_latest_cached_state():
    m = make_manager(20, [MambaSpec(4, shapes=((2,),), dtypes=("float32",))])
    a = m.new_request("A", range(1, 13))
    admit(m, a)
    assert step(m, a, [13]) == ([4],)
    assert m.get_block_ids("A") == ([0, 0, 3, 4],)  # only the block with the latest state is kept
    b = m.new_request("B", range(1, 14))
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (12, ([0, 0, 3],))


def test_hybrid_full_and_sliding_window_agree_on_the_hit():
    sw = SlidingWindowSpec(4, 1, 1, "float16", sliding_window=8)
    m = make_manager(40, [full(), sw])
    a = m.new_request("A", range(1, 17), kv_cache_report_mode="full", session_id="s-a")
    assert admit(m, a) == (0, ([1, 2, 3, 4], [5, 6, 7, 8]))
    assert m.take_events() == [
        stored(H[:4], None, range(1, 17), session="s-a"),
        stored(H[:4], None, range(1, 17), group=1, kind="sliding_window", window=8, session="s-a"),
    ]
    m.free(a)
    # Evict the full-attention copy of block 2 only: the full group now accepts 2 blocks, and the
    # window group (needs 2 consecutive cached blocks before the end) accepts them too.
    m.evict_blocks([3])
    m.take_events()
    b = m.new_request("B", range(1, 18), kv_cache_report_mode="full", session_id="s-b")
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (8, ([1, 2], [5, 6]))
    # Now evict window block 1 (id 6): the window group has no 2 consecutive cached blocks
    # ending at length 8; a run that starts at block 0 still counts (vLLM's rule): 4 tokens.
    m.evict_blocks([6])
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (4, ([1], [5]))
    m.check_invariants()


def test_hybrid_full_and_chunked_local():
    m = make_manager(40, [full(), ChunkedLocalAttentionSpec(4, 1, 1, "float16", attention_chunk_size=8)])
    a = m.new_request("A", range(1, 21))
    admit(m, a)
    b = m.new_request("B", range(1, 20))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16
    assert blocks.get_block_ids()[1] == [0, 0, 0, 0]
    assert len(blocks.get_block_ids()[0]) == 4


def test_groups_with_different_block_sizes_use_merged_hashes():
    m = make_manager(40, [full(4), full(8)])
    assert m.hash_block_size == 4
    a = m.new_request("A", range(1, 17))
    assert admit(m, a) == (0, ([1, 2, 3, 4], [5, 6]))
    events = m.take_events()
    hashes4 = BlockHasher(4).hash_prompt(range(1, 17))
    assert events[1].block_hashes == [block_hash_to_int(hashes4[1]), block_hash_to_int(hashes4[3])]
    assert events[1].block_size == 8 and len(events[1].token_ids) == 16
    blocks, hit = m.get_computed_blocks(m.new_request("B", range(1, 17)))
    assert hit == 8  # 15 tokens allowed: the 8-token group limits the hit to 8


# -- session_id, annotations, metadata -------------------------------------------------------


def test_session_id_on_new_and_reused_stores_never_in_hashes_or_hits():
    m = make_manager(10)
    a = m.new_request("A", range(1, 9), session_id="s1", kv_cache_report_mode="full")
    b_plain = m.new_request("x", range(1, 9))
    assert a.block_hashes == b_plain.block_hashes
    admit(m, a)
    assert m.take_events() == [stored(H[:2], None, range(1, 9), session="s1")]
    m.free(a)
    b = m.new_request("B", list(range(1, 9)) + [1, 2, 3, 4], session_id="s2", kv_cache_report_mode="full")
    c = m.new_request("C", list(range(1, 9)) + [1, 2, 3, 4])
    assert m.get_computed_blocks(b)[1] == m.get_computed_blocks(c)[1] == 8
    admit(m, b)
    b_hash = block_hash_to_int(b.block_hashes[2])
    assert m.take_events() == [
        stored(H[:2], None, range(1, 9), session="s2", reused=True),
        stored([b_hash], H[1], [1, 2, 3, 4], session="s2"),
    ]


def test_out_of_range_group_idx_is_warned_and_passed_on(caplog):
    m = make_manager(4)
    bogus = BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=7)
    m.block_pool.kv_event_queue.append(bogus)
    with caplog.at_level(logging.WARNING):
        events = m.take_events()
    assert events == [BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None, group_idx=7)]
    assert "group_idx 7 outside 0..0" in caplog.text


def test_events_off_records_nothing():
    m = make_manager(8, events=False)
    a = m.new_request("A", range(1, 13), kv_cache_report_mode="full")
    admit(m, a)
    m.free(a)
    admit(m, m.new_request("B", range(1, 13), kv_cache_report_mode="full"))
    assert m.take_events() == [] and m.block_pool.kv_event_queue == []


def test_metadata_and_stats():
    m = make_manager(16, [full(), SlidingWindowSpec(4, 2, 8, "bfloat16", sliding_window=16)])
    meta = m.get_kv_cache_group_metadata()
    assert [
        (g.group_idx, g.kind, g.block_size, g.sliding_window, g.num_blocks, g.page_size_bytes) for g in meta.groups
    ] == [
        (0, "full_attention", 4, None, 16, 16),
        (1, "sliding_window", 4, 16, 16, 256),
    ]
    assert (meta.hash_algorithm, meta.hash_seed, meta.hash_block_size, meta.block_hash_format) == (
        "sha256_cbor",
        "vllm-none-hash",
        4,
        "int64",
    )
    a = m.new_request("A", range(1, 10))
    admit(m, a)
    m.get_computed_blocks(m.new_request("B", range(1, 10)))
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 18, 8)


def test_report_mode_validation_and_num_new_tokens():
    m = make_manager(8)
    with pytest.raises(ValueError, match="kv_cache_report_mode must be 'incremental' or 'full'; got 'all'"):
        m.new_request("A", [1, 2], kv_cache_report_mode="all")
    with pytest.raises(
        ValueError, match="num_new_tokens must be >= 1 when no hit or external tokens are adopted; got 0"
    ):
        m.allocate_slots(m.new_request("A", [1, 2]), 0)


def test_lookahead_slots_and_max_model_len_cap():
    m = make_manager(20, max_model_len=10)
    a = m.new_request("A", range(1, 7))
    blocks, hit = m.get_computed_blocks(a)
    new = m.allocate_slots(a, 6, hit, blocks, num_lookahead_tokens=8)
    assert new.get_block_ids() == ([1, 2, 3],)  # min(6 + 8, 10) tokens -> 3 blocks
    assert m.take_events() == [stored(H[:1], None, range(1, 5))]  # lookahead slots are not cached
