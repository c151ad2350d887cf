"""Spec classes: page sizes, kind inference (subclasses first, uniform unwrap), window inference, presets."""

from __future__ import annotations

import pytest

from kvservice.core.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvservice.core.model_config import PRESETS, get_preset

ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")

KIND_CASES = [
    (FullAttentionSpec(**ATTN), KVCacheSpecKind.FULL_ATTENTION, None),
    (MLAAttentionSpec(16, 1, 576), KVCacheSpecKind.MLA_ATTENTION, None),
    (SlidingWindowSpec(**ATTN, sliding_window=1024), KVCacheSpecKind.SLIDING_WINDOW, 1024),
    (SlidingWindowMLASpec(16, 1, 576, sliding_window=512), KVCacheSpecKind.SLIDING_WINDOW_MLA, 512),
    (ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=8192), KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION, None),
    (SinkFullAttentionSpec(**ATTN, sink_len=4), KVCacheSpecKind.SINK_FULL_ATTENTION, None),
    (MambaSpec(16, shapes=((4, 128), (16, 64)), dtypes=("bfloat16", "float32")), KVCacheSpecKind.MAMBA, None),
    (CrossAttentionSpec(**ATTN), KVCacheSpecKind.CROSS_ATTENTION, None),
    (EncoderOnlyAttentionSpec(**ATTN), KVCacheSpecKind.ENCODER_ONLY_ATTENTION, None),
    (AttentionSpec(**ATTN), KVCacheSpecKind.UNKNOWN, None),
    (KVCacheSpec(16), KVCacheSpecKind.UNKNOWN, None),
]


@pytest.mark.parametrize("spec,kind,window", KIND_CASES, ids=lambda x: type(x).__name__)
def test_kind_and_window_per_class(spec, kind, window):
    assert get_kv_cache_spec_kind(spec) is kind
    assert get_kv_cache_spec_sliding_window(spec) == window


def test_kind_values_are_the_published_strings():
    assert [k.value for k in KVCacheSpecKind] == [
        "full_attention",
        "mla_attention",
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "chunked_local_attention",
        "sink_full_attention",
        "encoder_only_attention",
        "cross_attention",
        "unknown",
    ]
    assert KVCacheSpecKind.SLIDING_WINDOW == "sliding_window"  # a str enum


def test_uniform_wrapper_unwraps_one_kind_and_mixed_is_unknown():
    sw = SlidingWindowSpec(**ATTN, sliding_window=1024)
    sw2 = SlidingWindowSpec(**ATTN, sliding_window=512)
    one = UniformTypeKVCacheSpecs(16, {"a": sw, "b": sw})
    assert get_kv_cache_spec_kind(one) is KVCacheSpecKind.SLIDING_WINDOW
    assert get_kv_cache_spec_sliding_window(one) == 1024
    differing_windows = UniformTypeKVCacheSpecs(16, {"a": sw, "b": sw2})
    assert get_kv_cache_spec_kind(differing_windows) is KVCacheSpecKind.SLIDING_WINDOW
    assert get_kv_cache_spec_sliding_window(differing_windows) is None
    mixed = UniformTypeKVCacheSpecs(16, {"a": sw, "b": FullAttentionSpec(**ATTN)})
    assert get_kv_cache_spec_kind(mixed) is KVCacheSpecKind.UNKNOWN
    assert get_kv_cache_spec_sliding_window(mixed) is None
    assert get_kv_cache_spec_kind(UniformTypeKVCacheSpecs(16, {})) is KVCacheSpecKind.UNKNOWN
    assert one.page_size_bytes == 2 * sw.page_size_bytes


def test_page_sizes_in_bytes():
    assert FullAttentionSpec(**ATTN).page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536
    assert MLAAttentionSpec(64, 1, 576).page_size_bytes == 64 * 576 * 2
    assert SlidingWindowMLASpec(64, 1, 576, sliding_window=8).page_size_bytes == 64 * 576 * 2
    assert (
        MambaSpec(16, shapes=((4, 128), (16, 64)), dtypes=("bfloat16", "float32")).page_size_bytes
        == 4 * 128 * 2 + 16 * 64 * 4
    )
    assert FullAttentionSpec(16, 8, 128, "float8_e4m3fn").page_size_bytes == 32768
    with pytest.raises(ValueError, match="dtype must be one of"):
        _ = FullAttentionSpec(16, 8, 128, "float64").page_size_bytes


def test_bad_specs_and_configs():
    with pytest.raises(ValueError, match="sliding_window must be >= 1 token; got 0"):
        SlidingWindowSpec(**ATTN)
    with pytest.raises(ValueError, match="attention_chunk_size must be >= 1 token; got 0"):
        ChunkedLocalAttentionSpec(**ATTN)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        get_preset("llama-3-8b").kv_cache_config(1)
    with pytest.raises(ValueError, match="kv_cache_groups must hold at least one group"):
        KVCacheConfig(4, ())
    with pytest.raises(ValueError, match="preset must be one of llama-3-8b, qwen-2.5-0.5b"):
        get_preset("gpt-5")


def test_presets_are_real_layouts():
    llama = get_preset("llama-3-8b").kv_cache_config(100)
    assert [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in llama.kv_cache_groups] == ["full_attention"]
    assert llama.kv_cache_groups[0].num_layers == 32
    assert llama.block_bytes == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB per block id
    gemma = get_preset("gemma-3-27b").kv_cache_config(100)
    # vLLM 0.33's grouping: 6 sliding window groups (52 layers) and 1 full attention group (10).
    assert [
        (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec), g.num_layers)
        for g in gemma.kv_cache_groups
    ] == [("sliding_window", 1024, n) for n in (9, 9, 9, 9, 8, 8)] + [("full_attention", None, 10)]
    assert gemma.block_bytes == 10 * 2 * 16 * 16 * 128 * 2
    llama4 = get_preset("llama-4-scout").kv_cache_config(100)
    assert [get_kv_cache_spec_kind(g.kv_cache_spec).value for g in llama4.kv_cache_groups] == [
        "chunked_local_attention"
    ] * 3 + ["full_attention"]
    assert llama4.kv_cache_groups[1].kv_cache_spec.attention_chunk_size == 8192
    ds = get_preset("deepseek-v3").kv_cache_config(100)
    assert get_kv_cache_spec_kind(ds.kv_cache_groups[0].kv_cache_spec) is KVCacheSpecKind.MLA_ATTENTION
    assert ds.kv_cache_groups[0].kv_cache_spec.block_size == 16  # vLLM 0.33 on H100/H200
    assert (
        get_preset("llama-3-8b").kv_cache_config(100, block_size=32).kv_cache_groups[0].kv_cache_spec.block_size == 32
    )
    assert set(PRESETS) >= {"llama-3-8b", "gemma-3-27b", "llama-4-scout"}
