"""KV cache planning: vLLM 0.33's grouping, page unification, pool sharing and sizing, exact values."""

from __future__ import annotations

import pytest

from kvservice.core.kv_cache_planning import (
    get_kv_cache_bytes_per_block,
    get_kv_cache_config,
    get_kv_cache_groups,
    get_kv_cache_tensors,
    get_num_blocks,
    unify_kv_cache_spec_page_size,
)
from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

FULL = FullAttentionSpec(16, 16, 128)
SWA = SlidingWindowSpec(16, 16, 128, sliding_window=1024)
PAGE = 2 * 16 * 16 * 128 * 2  # 131072 bytes


def gemma3_27b_like() -> dict:
    """62 layers, every 6th full attention, the rest a 1024-token window (Gemma-3-27B's pattern)."""
    return {f"layers.{i}": FULL if (i + 1) % 6 == 0 else SWA for i in range(62)}


def test_gemma3_pattern_gives_seven_groups_of_at_most_ten_layers() -> None:
    groups = get_kv_cache_groups(gemma3_27b_like())
    assert [(type(g.kv_cache_spec).__name__, g.num_layers) for g in groups] == [
        ("SlidingWindowSpec", 9),
        ("SlidingWindowSpec", 9),
        ("SlidingWindowSpec", 9),
        ("SlidingWindowSpec", 9),
        ("SlidingWindowSpec", 8),
        ("SlidingWindowSpec", 8),
        ("FullAttentionSpec", 10),
    ]
    sliding = [i for i in range(62) if (i + 1) % 6]
    # Group i of a bucket takes layers[i::num_groups] (vLLM's PP-friendly assignment).
    assert groups[0].layer_names == tuple(f"layers.{i}" for i in sliding[0::6])
    assert groups[5].layer_names == tuple(f"layers.{i}" for i in sliding[5::6])
    assert groups[6].layer_names == tuple(f"layers.{i}" for i in range(5, 62, 6))
    assert get_kv_cache_bytes_per_block(groups) == 10 * PAGE
    assert get_num_blocks(groups, 64 << 30) == 52428  # vLLM 0.33's figure (tests/data/vectors)
    assert get_num_blocks(groups, 1 << 30) == 819


def test_close_bucket_sizes_pad_the_smaller_to_the_larger() -> None:
    # gpt-oss-20b + a drafter: 12 sliding + 13 full -> (12 padded to 13, 13), not (12, 13 -> 24).
    specs = {f"s{i}": SWA for i in range(12)} | {f"f{i}": FULL for i in range(13)}
    groups = get_kv_cache_groups(specs)
    assert [g.num_layers for g in groups] == [12, 13]
    assert get_kv_cache_bytes_per_block(groups) == 13 * PAGE


def test_uniform_models_get_one_group() -> None:
    [group] = get_kv_cache_groups({f"l{i}": FULL for i in range(4)})
    assert group.kv_cache_spec == FULL and group.num_layers == 4
    [group] = get_kv_cache_groups({f"l{i}": SWA for i in range(4)})
    assert group.kv_cache_spec == SWA
    # Full attention layers of different shapes are one type: one UniformTypeKVCacheSpecs group.
    small = FullAttentionSpec(16, 8, 128)
    [group] = get_kv_cache_groups({"a": FULL, "b": small, "c": FULL})
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.block_bytes == 2 * PAGE + PAGE // 2
    # A sink layer merges with full attention layers of the same shape.
    [group] = get_kv_cache_groups({"a": FULL, "b": SinkFullAttentionSpec(16, 16, 128, sink_len=4)})
    assert group.kv_cache_spec == FULL


def test_page_sizes_are_unified_by_block_size_or_padding() -> None:
    half = ChunkedLocalAttentionSpec(16, 8, 128, attention_chunk_size=8192)  # half of PAGE
    odd = SlidingWindowSpec(16, 3, 128, sliding_window=512)  # 3/16 of PAGE: padded
    unified = unify_kv_cache_spec_page_size({"f": FULL, "c": half, "s": odd})
    assert unified["f"] == FULL
    assert unified["c"] == ChunkedLocalAttentionSpec(32, 8, 128, attention_chunk_size=8192)
    assert unified["s"] == SlidingWindowSpec(16, 3, 128, sliding_window=512, page_size_padded=PAGE)
    assert {spec.page_size_bytes for spec in unified.values()} == {PAGE}
    mamba = MambaSpec(16, shapes=((4, 100),), dtypes=("float32",))
    assert unify_kv_cache_spec_page_size({"f": FULL, "m": mamba})["m"].page_size_padded == PAGE


def test_an_mla_page_that_does_not_divide_cannot_be_padded() -> None:
    with pytest.raises(ValueError, match=r"layer m: page size 18432 bytes does not divide the largest page \(131072"):
        get_kv_cache_groups({"f": FULL, "m": MLAAttentionSpec(16, 1, 576), "s": SWA})


def test_groups_alias_one_pool_from_byte_zero_layer_outermost() -> None:
    groups = get_kv_cache_groups({"s0": SWA, "f0": FULL, "s1": SWA, "f1": FULL})
    assert [g.layer_names for g in groups] == [("s0", "s1"), ("f0", "f1")]
    tensors = get_kv_cache_tensors(groups, 10)
    assert [(t.group_idx, t.layer_names, t.size, t.layer_stride, t.block_stride, t.offset) for t in tensors] == [
        (0, ("s0", "s1"), 10 * 2 * PAGE, 10 * PAGE, PAGE, 0),
        (1, ("f0", "f1"), 10 * 2 * PAGE, 10 * PAGE, PAGE, 0),
    ]


def test_config_from_a_budget_or_a_block_count() -> None:
    config = get_kv_cache_config(gemma3_27b_like(), budget_bytes=64 << 30)
    assert (config.num_blocks, config.block_bytes, len(config.kv_cache_groups)) == (52428, 10 * PAGE, 7)
    assert config.total_bytes == 52428 * 10 * PAGE <= 64 << 30
    assert get_kv_cache_config(gemma3_27b_like(), num_blocks=5).num_blocks == 5
    with pytest.raises(ValueError, match="exactly one of budget_bytes and num_blocks"):
        get_kv_cache_config(gemma3_27b_like())
    with pytest.raises(ValueError, match="at least one layer"):
        get_kv_cache_groups({})
