"""kvservice_client.watcher without a server: PrefixIndex and hit rules on exact values,
HitPredictor against the server's own manager, the watcher's argument checks. EventWatcher's
recovery against a scripted server is tests/service/test_watcher_recovery.py.

Nothing here sleeps to wait: tests wait on the thing itself (a batch, a call opening or ending),
under an ``asyncio.wait_for`` deadline so a hang fails with a message instead of the suite timeout.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice_client._proto.kvservice import v1
from kvservice_client.convert import KV_CACHE_SPEC_KIND_TO_PROTO
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvservice_client.hashing import block_hash_to_int
from kvservice_client.watcher import (
    EventWatcher,
    GroupHitRule,
    HitPredictor,
    PrefixIndex,
    RetryPolicy,
    WatchedBatch,
    find_longest_cache_hit,
    find_longest_group_hit,
)


def stored(hashes, parent=None, *, group=0, reused=False, block_size=1):  # type: ignore[no-untyped-def]
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(len(hashes) * block_size)),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        reused=reused,
    )


def removed(hashes, *, group=0):  # type: ignore[no-untyped-def]
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=group)


def applied(*events, capacity=None) -> PrefixIndex:  # type: ignore[no-untyped-def]
    index = PrefixIndex(capacity)
    index.apply_batch(KVEventBatch(ts=0.0, events=list(events)))
    return index


# --- PrefixIndex ---------------------------------------------------------------------------------


def test_stored_inserts_deepest_first_so_the_root_is_most_recent() -> None:
    index = applied(stored([1, 2, 3]))
    assert index.lru_order() == [(0, 3), (0, 2), (0, 1)]
    index.apply(stored([4, 5], parent=3))
    assert index.lru_order() == [(0, 3), (0, 2), (0, 1), (0, 5), (0, 4)]
    assert len(index) == 5
    assert 2 in index and (0, 2) in index and index.contains(2, 0)
    assert 9 not in index and (1, 2) not in index and not index.contains(2, 1)


def test_reused_and_repeated_stores_refresh_recency_without_duplicates() -> None:
    index = applied(stored([1, 2, 3]), stored([4, 5], parent=3))
    index.apply(stored([2], parent=1, reused=True))
    assert index.lru_order() == [(0, 3), (0, 1), (0, 5), (0, 4), (0, 2)]
    index.apply(stored([1, 2, 3]))
    assert index.lru_order() == [(0, 5), (0, 4), (0, 3), (0, 2), (0, 1)]
    assert len(index) == 5


def test_capacity_evicts_the_least_recently_announced_over_all_groups() -> None:
    index = applied(stored([1, 2, 3]), capacity=3)
    assert index.num_evictions == 0
    index.apply(stored([10, 11], group=1))  # 11 goes in first: evicts (0, 3); then 10 evicts (0, 2)
    assert index.lru_order() == [(0, 1), (1, 11), (1, 10)]
    assert index.snapshot() == {0: {1}, 1: {10, 11}}
    assert index.num_evictions == 2
    index.apply(stored([1], reused=True))  # a reuse report refreshes: (0, 1) is now the newest
    assert index.lru_order() == [(1, 11), (1, 10), (0, 1)]
    index.apply(stored([20], parent=1))
    assert index.lru_order() == [(1, 10), (0, 1), (0, 20)]
    assert index.num_evictions == 3
    assert len(index) == 3 and index.capacity_blocks == 3


def test_an_announcement_longer_than_the_capacity_keeps_its_leading_blocks() -> None:
    index = applied(stored([1, 2, 3, 4]), capacity=2)
    assert index.lru_order() == [(0, 2), (0, 1)]
    assert index.num_evictions == 2
    assert index.predict_hit_blocks([1, 2, 3, 4]) == 2


def test_reused_store_of_an_evicted_hash_inserts_it_again() -> None:
    index = applied(stored([1]), stored([2]), capacity=1)
    assert index.snapshot() == {0: {2}}
    index.apply(stored([1], reused=True))
    assert index.snapshot() == {0: {1}} and index.num_evictions == 2


def test_removed_deletes_in_its_group_only_and_ignores_unknown_hashes() -> None:
    index = applied(stored([1, 2, 3]), stored([1, 2], group=1))
    index.apply(removed([2, 99]))
    assert index.snapshot() == {0: {1, 3}, 1: {1, 2}}
    index.apply(removed([1, 2], group=1))
    assert index.snapshot() == {0: {1, 3}}
    assert index.lru_order() == [(0, 3), (0, 1)]


def test_all_blocks_cleared_empties_every_group_and_keeps_the_eviction_count() -> None:
    index = applied(stored([1, 2, 3]), stored([7], group=2), capacity=3)
    assert index.num_evictions == 1
    index.apply(AllBlocksCleared())
    assert len(index) == 0 and index.snapshot() == {} and index.lru_order() == []
    assert index.num_evictions == 1
    index.apply(stored([5]))
    assert index.snapshot() == {0: {5}}


def test_events_without_group_idx_count_as_group_0_and_digests_are_kept_as_bytes() -> None:
    event = stored([b"\x01" * 32, b"\x02" * 32])
    event.group_idx = None
    index = applied(event)
    assert index.snapshot() == {0: {b"\x01" * 32, b"\x02" * 32}}
    index.apply(BlockRemoved(block_hashes=[b"\x02" * 32], medium=None))
    assert index.snapshot() == {0: {b"\x01" * 32}}


def test_apply_batch_takes_a_watched_batch_and_refuses_other_objects() -> None:
    index = PrefixIndex()
    index.apply_batch(WatchedBatch(1, "A", False, KVEventBatch(ts=0.0, events=[stored([1])])))
    assert index.snapshot() == {0: {1}}
    with pytest.raises(TypeError, match="expected a BlockStored"):
        index.apply("BlockStored")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def test_predict_hit_blocks_is_the_leading_run_only() -> None:
    index = applied(stored([1, 2]), stored([4, 5], parent=3), stored([1, 2, 3], group=1))
    assert index.predict_hit_blocks([1, 2, 3, 4, 5]) == 2
    assert index.predict_hit_blocks([3, 4, 5]) == 0
    assert index.predict_hit_blocks([]) == 0
    assert index.predict_hit_blocks([1, 2, 3, 4, 5], group_idx=1) == 3
    assert index.predict_hit_blocks([1, 2], group_idx=7) == 0


# --- hit rules on hand-made cases ----------------------------------------------------------------

H = [f"h{i}" for i in range(8)]  # stand-in hashes: the rules only compare them


def _group_hit(rule: GroupHitRule, cached: set[str], max_length: int, hashes: Sequence[str] = H) -> int:
    return find_longest_group_hit(rule, hashes, cached.__contains__, max_length)


FULL2 = GroupHitRule(0, "full_attention", "full_attention", 2)
SW2_W5 = GroupHitRule(1, "sliding_window", "sliding_window", 2, sliding_window=5)  # needs 2 blocks


def test_full_attention_rule_stops_at_the_first_hole_and_at_max_length() -> None:
    assert _group_hit(FULL2, {"h0", "h1", "h3"}, 100) == 2
    assert _group_hit(FULL2, {"h0", "h1", "h2", "h3"}, 5) == 2  # 5 tokens hold 2 blocks of 2
    assert _group_hit(FULL2, {"h1", "h2"}, 100) == 0
    assert _group_hit(FULL2, set(H), 100, hashes=H[:3]) == 3
    assert _group_hit(FULL2, set(H), -1) == 0


def test_sliding_window_rule_needs_the_window_before_the_end_or_a_run_from_block_0() -> None:
    # Scanning back from block 5 (max 12 tokens -> 6 blocks): 4 and 3 form the window: hit = 5 blocks.
    assert _group_hit(SW2_W5, {"h0", "h3", "h4"}, 12) == 5
    # 4 alone is too short; 1 and 0 are a window: hit = 2 blocks.
    assert _group_hit(SW2_W5, {"h0", "h1", "h4"}, 12) == 2
    # No full window anywhere: the run from block 0 (1 block) is still a hit.
    assert _group_hit(SW2_W5, {"h0", "h4"}, 12) == 1
    # No window and block 0 missing: nothing.
    assert _group_hit(SW2_W5, {"h1", "h4"}, 12) == 0
    # A window of 1 token needs 1 block (max(ceil(0 / 2), 1)).
    sw_w1 = GroupHitRule(0, "sliding_window", "sliding_window", 2, sliding_window=1)
    assert _group_hit(sw_w1, {"h3"}, 12) == 4


def test_chunked_local_and_mamba_rules() -> None:
    chunked = GroupHitRule(0, "chunked_local_attention", "chunked_local_attention", 2, attention_chunk_size=4)
    # max 11 tokens: the current chunk starts at token 8 = block 4; blocks 0..3 are not needed.
    assert _group_hit(chunked, {"h4"}, 11) == 5
    assert _group_hit(chunked, set(), 11) == 4
    assert _group_hit(chunked, {"h0", "h1"}, 7) == 2  # chunk starts at block 2; nothing cached there
    mamba = GroupHitRule(0, "mamba", "mamba", 2)
    assert _group_hit(mamba, {"h1", "h3", "h6"}, 12) == 4  # latest cached state within 6 blocks
    assert _group_hit(mamba, set(), 12) == 0


def _index_of(group_to_hashes: dict[int, Sequence[str]]) -> PrefixIndex:
    index = PrefixIndex()
    for group_idx, hashes in group_to_hashes.items():
        index.apply(stored(list(hashes), group=group_idx))
    return index


def test_hybrid_hit_is_the_fixed_point_every_group_accepts() -> None:
    sw_first = (
        GroupHitRule(0, "sliding_window", "sliding_window", 2, sliding_window=5),
        GroupHitRule(1, "full_attention", "full_attention", 2),
    )
    # The window accepts 10 tokens (blocks 3, 4), full attention only 6; the window, asked again at
    # 6, has no window before it but block 0: the hit is 2 tokens.
    index = _index_of({0: ["h0", "h3", "h4"], 1: ["h0", "h1", "h2"]})
    assert find_longest_cache_hit(sw_first, [H, H], index, 11) == 2
    # With blocks 1 and 2 in the window group too, 6 tokens stand.
    index = _index_of({0: ["h0", "h1", "h2", "h3", "h4"], 1: ["h0", "h1", "h2"]})
    assert find_longest_cache_hit(sw_first, [H, H], index, 11) == 6
    # Full attention first gives the same answers.
    full_first = (
        GroupHitRule(0, "full_attention", "full_attention", 2),
        GroupHitRule(1, "sliding_window", "sliding_window", 2, sliding_window=5),
    )
    index = _index_of({1: ["h0", "h3", "h4"], 0: ["h0", "h1", "h2"]})
    assert find_longest_cache_hit(full_first, [H, H], index, 11) == 2
    # Different block sizes: the hit is a multiple of both (full 2, window 4 tokens per block).
    mixed = (
        GroupHitRule(0, "full_attention", "full_attention", 2),
        GroupHitRule(1, "sliding_window", "sliding_window", 4, sliding_window=5),
    )
    index = _index_of({0: ["h0", "h1", "h2", "h3", "h4"], 1: ["h0", "h1"]})
    assert find_longest_cache_hit(mixed, [H, H[:3]], index, 11) == 8


def _metadata(groups: Sequence[v1.KVCacheGroupMetadata], **kwargs: object) -> v1.GetKVCacheGroupMetadataResponse:
    fields: dict = {"hash_algorithm": "sha256_cbor", "hash_seed": "vllm-none-hash", "hash_block_size": 2}
    fields.update(kwargs)
    return v1.GetKVCacheGroupMetadataResponse(groups=groups, **fields)


def test_hit_predictor_caps_the_hit_below_the_last_token() -> None:
    metadata = _metadata(
        [v1.KVCacheGroupMetadata(group_idx=0, kind=v1.KV_CACHE_SPEC_KIND_FULL_ATTENTION, block_size=2)]
    )
    index = PrefixIndex()
    predictor = HitPredictor(metadata, index)
    prompt = [1, 2, 3, 4, 5, 6]
    (hashes,) = predictor.hash_prompt(prompt)
    assert len(hashes) == 3 and all(isinstance(h, int) for h in hashes)
    index.apply(stored(hashes, block_size=2))
    assert predictor.predict_hit_tokens(prompt) == 4  # (6 - 1) // 2 = 2 blocks at most
    assert predictor.predict_hit_tokens(prompt + [7]) == 6
    assert predictor.predict_hit_tokens([]) == 0
    assert predictor.predict_hit_tokens(prompt, cache_salt="other tenant") == 0


def test_hit_predictor_rules_from_metadata_and_fallbacks() -> None:
    groups = [
        v1.KVCacheGroupMetadata(group_idx=0, kind=v1.KV_CACHE_SPEC_KIND_MLA_ATTENTION, block_size=2),
        v1.KVCacheGroupMetadata(
            group_idx=1, kind=v1.KV_CACHE_SPEC_KIND_SLIDING_WINDOW_MLA, block_size=4, sliding_window=8
        ),
        v1.KVCacheGroupMetadata(group_idx=2, kind=v1.KV_CACHE_SPEC_KIND_UNKNOWN, block_size=2),
        v1.KVCacheGroupMetadata(group_idx=3, kind=v1.KV_CACHE_SPEC_KIND_SLIDING_WINDOW, block_size=2),  # no window
        v1.KVCacheGroupMetadata(
            group_idx=4, kind=v1.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION, block_size=2, attention_chunk_size=8
        ),
        v1.KVCacheGroupMetadata(group_idx=5, kind=v1.KV_CACHE_SPEC_KIND_MAMBA, block_size=2),
    ]
    predictor = HitPredictor(_metadata(groups, block_hash_format=v1.BLOCK_HASH_FORMAT_DIGEST), PrefixIndex())
    assert [r.rule for r in predictor.rules] == [
        "full_attention",
        "sliding_window",
        "full_attention",
        "full_attention",
        "chunked_local_attention",
        "mamba",
    ]
    assert predictor.rules[1].sliding_window == 8 and predictor.rules[4].attention_chunk_size == 8
    hashes = predictor.hash_prompt(list(range(8)))
    assert [len(h) for h in hashes] == [4, 2, 4, 4, 4, 4]
    assert hashes[1][0] == hashes[0][0] + hashes[0][1]  # a 4-token block is two 2-token digests joined
    with pytest.raises(ValueError, match="not a multiple"):
        HitPredictor(_metadata([v1.KVCacheGroupMetadata(group_idx=0, block_size=3)]), PrefixIndex())
    with pytest.raises(ValueError, match="no groups"):
        HitPredictor(_metadata([]), PrefixIndex())
    off = HitPredictor(_metadata(groups[:1], hash_algorithm=""), PrefixIndex())
    assert off.hash_prompt([1, 2, 3]) == ([],) and off.predict_hit_tokens([1, 2, 3]) == 0


# --- HitPredictor == the server's rule -----------------------------------------------------------


def _spec(kind: str, block_size: int):  # type: ignore[no-untyped-def]
    if kind == "full":
        return FullAttentionSpec(block_size, 1, 1, "float16")
    if kind.startswith("sw"):
        return SlidingWindowSpec(block_size, 1, 1, "float16", sliding_window=int(kind[2:]))
    if kind.startswith("chunk"):
        return ChunkedLocalAttentionSpec(block_size, 1, 1, "float16", attention_chunk_size=int(kind[5:]))
    assert kind == "mamba"
    return MambaSpec(block_size, ((4,),), ("float16",))


CONFIGS = {
    "full4": ([("full", 4)], "int64"),
    "full4+sw6": ([("full", 4), ("sw6", 4)], "int64"),
    "full2+sw5@4": ([("full", 2), ("sw5", 4)], "int64"),
    "sw9+full4 digest": ([("sw9", 4), ("full", 4)], "digest"),
    "sw5+full4": ([("sw5", 4), ("full", 4)], "int64"),
    "full4+chunk8": ([("full", 4), ("chunk8", 4)], "int64"),
    "full4+mamba": ([("full", 4), ("mamba", 4)], "int64"),
}


def _make_manager(name: str, num_blocks: int) -> KVCacheManager:
    specs, fmt = CONFIGS[name]
    groups = tuple(KVCacheGroupSpec((f"layer{i}",), _spec(kind, bs)) for i, (kind, bs) in enumerate(specs))
    return KVCacheManager(KVCacheConfig(num_blocks, groups), 256, kv_events=KVEventsConfig(block_hash_format=fmt))


def _metadata_of(manager: KVCacheManager) -> v1.GetKVCacheGroupMetadataResponse:
    """What the server's GetKVCacheGroupMetadata carries for the manager (the fields the rule reads)."""
    md = manager.get_kv_cache_group_metadata()
    groups = []
    for g in md.groups:
        group = v1.KVCacheGroupMetadata(
            group_idx=g.group_idx,
            kind=KV_CACHE_SPEC_KIND_TO_PROTO[g.kind],
            block_size=g.block_size,
            num_blocks=g.num_blocks,
        )
        if g.sliding_window is not None:
            group.sliding_window = g.sliding_window
        if g.attention_chunk_size is not None:
            group.attention_chunk_size = g.attention_chunk_size
        groups.append(group)
    return v1.GetKVCacheGroupMetadataResponse(
        groups=groups,
        hash_algorithm=md.hash_algorithm,
        hash_seed=md.hash_seed,
        hash_block_size=md.hash_block_size,
        block_hash_format=v1.BLOCK_HASH_FORMAT_DIGEST
        if md.block_hash_format == "digest"
        else v1.BLOCK_HASH_FORMAT_INT64,
    )


def _server_cached_sets(manager: KVCacheManager) -> dict[int, set]:
    encode = (lambda h: h) if manager.metadata.block_hash_format == "digest" else block_hash_to_int
    out = {}
    for group_idx, hash_map in enumerate(manager.block_pool.cached_block_hash_to_block):
        hashes = {encode(h) for h in hash_map.hashes()}
        if hashes:
            out[group_idx] = hashes
    return out


_BASES = [random.Random(seed).choices(range(1, 6), k=40) for seed in range(3)]

# A prompt: a prefix of one of a few base prompts (so prompts share cached prefixes), a tail, maybe a salt.
_prompts = st.tuples(
    st.integers(0, len(_BASES) - 1),
    st.integers(0, 36),
    st.lists(st.integers(1, 3), max_size=6),
    st.sampled_from([None, None, None, "tenant-b"]),
).map(lambda t: (_BASES[t[0]][: t[1]] + t[2] or [1], t[3]))

_Op = Union[
    tuple[Literal["admit"], tuple[list[int], str | None], list[int], bool, Literal["incremental", "full"]],
    tuple[Literal["free_oldest"]],
    tuple[Literal["reset"]],
    tuple[Literal["evict"], list[int]],
]
_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            _prompts,
            st.lists(st.integers(1, 5), max_size=12),
            st.booleans(),
            st.sampled_from(["incremental", "full"]),
        ),
        st.tuples(st.just("free_oldest")),
        st.tuples(st.just("reset")),
        st.tuples(st.just("evict"), st.lists(st.integers(1, 39), max_size=3)),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, probes=st.lists(_prompts, max_size=8))
def test_hit_predictor_equals_the_servers_hit(config: str, ops: list[_Op], probes: list) -> None:
    manager = _make_manager(config, num_blocks=40)
    index = PrefixIndex()
    predictor = HitPredictor(_metadata_of(manager), index)
    running = []
    seen = list(probes)
    for n, op in enumerate(ops):
        if op[0] == "admit":
            (prompt, salt), decode, keep, mode = op[1], op[2], op[3], op[4]
            seen.extend([(prompt, salt), (prompt + decode, salt)])  # decoded blocks are cached too
            request = manager.new_request(f"r{n}", prompt, cache_salt=salt, kv_cache_report_mode=mode)
            blocks, hit = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None:
                request.num_computed_tokens = request.num_tokens
                for token in decode:  # one decode step per token (sliding windows drop blocks here)
                    request.append_output_token_ids(token)
                    if manager.allocate_slots(request, 1) is None:
                        break
                    request.num_computed_tokens += 1
                running.append(request)
                if not keep:
                    manager.free(running.pop())
        elif op[0] == "free_oldest" and running:
            manager.free(running.pop(0))
        elif op[0] == "reset":
            manager.reset_prefix_cache()
        elif op[0] == "evict":
            manager.evict_blocks(op[1])
        index.apply_batch(KVEventBatch(ts=0.0, events=manager.take_events()))
        assert index.snapshot() == _server_cached_sets(manager)  # docs/ARCHITECTURE.md §3.4: the mirror is exact
        for i, (prompt, salt) in enumerate(seen):
            _, server_hit = manager.get_computed_blocks(manager.new_request(f"probe{n}.{i}", prompt, cache_salt=salt))
            assert predictor.predict_hit_tokens(prompt, cache_salt=salt) == server_hit, (prompt, salt)


async def test_watcher_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="epoch applies only with start_seq"):
        EventWatcher("127.0.0.1:1", epoch="A")
    with pytest.raises(ValueError, match="start_seq"):
        EventWatcher("127.0.0.1:1", start_seq=0)
    with pytest.raises(ValueError, match="payload_format"):
        EventWatcher("127.0.0.1:1", payload_format="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    assert [RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5).backoff_s(n) for n in (1, 2, 3, 4)] == [
        0.1,
        0.2,
        0.4,
        0.5,
    ]
