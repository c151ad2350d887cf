"""Servers started from a model's config.json or a layout file: vLLM 0.33's groups and pool size,
and bad configs refused at start naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
SLIDING, FULL = pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW, pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION


async def test_gemma3_config_at_64_gib_gets_vllms_seven_groups_and_block_count(start_kv_server, connect):
    running = await start_kv_server(
        model_config=str(CONFIGS / "gemma-3-27b"), block_size=16, num_blocks=None, kv_cache_memory=64 << 30
    )
    assert running.config.cache.num_blocks == 52428  # vLLM 0.33's (tests/data/vectors); main gave 8456
    meta = await (await connect(running)).get_kv_cache_group_metadata()
    assert [(g.kind, g.num_layers, g.block_size) for g in meta.groups] == [
        (SLIDING, 9, 16),
        (SLIDING, 9, 16),
        (SLIDING, 9, 16),
        (SLIDING, 9, 16),
        (SLIDING, 8, 16),
        (SLIDING, 8, 16),
        (FULL, 10, 16),
    ]
    assert {g.num_blocks for g in meta.groups} == {52428}
    assert meta.preset == str(CONFIGS / "gemma-3-27b")
    assert running.tensors.total_bytes == 52428 * 10 * 2 * 16 * 16 * 128 * 2


async def test_the_gemma_preset_is_the_same_layout(start_kv_server):
    running = await start_kv_server(preset="gemma-3-27b", block_size=16, num_blocks=None, kv_cache_memory=64 << 30)
    assert running.config.cache.num_blocks == 52428
    assert running.servicer.metadata.preset == "gemma-3-27b"


async def test_kv_cache_dtype_fp8_halves_the_page(start_kv_server):
    running = await start_kv_server(
        model_config=str(CONFIGS / "llama-3.1-8b" / "config.json"),
        block_size=16,
        kv_cache_dtype="fp8",
        num_blocks=None,
        kv_cache_memory=1 << 30,
    )
    [group] = running.servicer.metadata.groups
    assert (group.dtype, group.page_size_bytes, running.config.cache.num_blocks) == ("float8_e4m3fn", 32768, 1024)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("num_hidden_layers"), "missing field 'num_hidden_layers'"),
        (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1; got 0"),
        (lambda c: c.update(architectures=["FalconForCausalLM"]), "unknown architecture 'FalconForCausalLM'"),
        (
            lambda c: c.update(sliding_window=65536),
            "sliding_window of 65536 tokens exceeds max_model_len (32768 tokens)",
        ),
    ],
)
async def test_bad_model_configs_fail_at_start_naming_the_field(start_kv_server, tmp_path, edit, message):
    config = json.loads((CONFIGS / "mistral-7b-v0.1" / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as excinfo:
        await start_kv_server(model_config=str(tmp_path))
    assert message in str(excinfo.value) and str(tmp_path) in str(excinfo.value)


async def test_model_config_and_layout_file_exclude_each_other(start_kv_server, tmp_path):
    with pytest.raises(ValueError, match="give model_config or kv_cache_layout, not both"):
        await start_kv_server(model_config=str(CONFIGS / "qwen3-8b"), kv_cache_layout=str(tmp_path / "x.toml"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto"):
        await start_kv_server(kv_cache_dtype="int4")


async def test_metadata_names_each_groups_layers_and_each_kv_cache_tensor(start_kv_server, connect):
    running = await start_kv_server(model_config=str(CONFIGS / "gemma-3-27b"), num_blocks=100)
    meta = await (await connect(running)).get_kv_cache_group_metadata()
    page = 2 * 4 * 16 * 128 * 2  # block size 4 (the test server's)
    sliding = [i for i in range(62) if (i + 1) % 6]
    assert list(meta.groups[0].layer_names) == [f"language_model.model.layers.{i}.self_attn.attn" for i in sliding[::6]]
    assert list(meta.groups[6].layer_names) == [
        f"language_model.model.layers.{i}.self_attn.attn" for i in range(5, 62, 6)
    ]
    assert [len(g.layer_names) for g in meta.groups] == [g.num_layers for g in meta.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert meta.pool_bytes_per_block == 10 * page
    assert [
        (
            t.group_idx,
            len(t.layer_names),
            t.size_bytes,
            t.offset_bytes,
            t.layer_stride_bytes,
            t.block_stride_bytes,
            t.page_size_bytes,
            t.dtype,
        )
        for t in meta.kv_cache_tensors
    ] == [(g, n, 100 * 10 * page, 0, 100 * page, page, page, "bfloat16") for g, n in enumerate([9, 9, 9, 9, 8, 8, 10])]
    assert [list(t.layer_names) for t in meta.kv_cache_tensors] == [list(g.layer_names) for g in meta.groups]
