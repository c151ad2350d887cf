"""kvservice_vllm.Worker's KV cache views over the attached pool are what vLLM's own
allocate_kv_cache builds for the same KVCacheConfig: shapes, strides, offsets, dtypes (CPU, shared
memory); a write through them lands in the server's block."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvservice_client import KVCacheClient
from kvservice_client.torch_view import attach
from kvservice_vllm.embedded import EmbeddedServer
from kvservice_vllm.worker import check_pool_placement, kv_caches_over

BLOCK = 16


class _Config:
    """What vLLM's planner reads of a VllmConfig (layout LBNHC, as vLLM resolves it when no backend
    asks for another)."""

    def __init__(self) -> None:
        import types

        self.cache_config = CacheConfig(block_size=BLOCK)
        self.cache_config.kv_cache_layout = "LBNHC"
        self.scheduler_config = types.SimpleNamespace(disable_hybrid_kv_cache_manager=False)
        self.attention_config = types.SimpleNamespace(hisparse_config=None)
        self.model_config = types.SimpleNamespace(supports_kv_cache_grouping=False)


def _kv_cache_config(kinds: list[str], budget: int):
    config = _Config()
    specs = {}
    for i, kind in enumerate(kinds):
        common = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.attn"] = (
            SlidingWindowSpec(**common, sliding_window=64) if kind == "sliding" else FullAttentionSpec(**common)
        )
    groups = get_kv_cache_groups(config, specs)
    return config, get_kv_cache_config_from_groups(config, groups, budget)


@pytest.mark.parametrize("kinds", [["full"] * 4, ["full", "sliding", "sliding", "sliding"] * 2], ids=["full", "hybrid"])
def test_the_views_over_the_pool_are_vllms_own(kinds):
    config, kv_cache_config = _kv_cache_config(kinds, 8 * 1024 * 1024)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    server = EmbeddedServer(
        kv_cache_config, max_model_len=4096, enable_prefix_caching=True, hash_algorithm="sha256", hash_seed="s"
    )
    client = KVCacheClient(server.address)
    try:
        check_pool_placement(client.get_kv_cache_group_metadata(), kv_cache_config)
        pool = attach(client)
        (storage,) = pool.storages
        ours = kv_caches_over(storage, kv_cache_config, "cpu", layout)
        theirs = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            a, b = ours[name], theirs[name]
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
            assert a.storage_offset() == b.storage_offset(), name
            assert a.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        # A write through a layer's view is the server's block (block 5 of the first layer's group).
        first = next(iter(theirs))
        view = ours[first]
        view[5].fill_(3)
        group = next(g for g, grp in enumerate(kv_cache_config.kv_cache_groups) if first in grp.layer_names)
        server_tensors = server.running.tensors.block_view(group, 5)
        assert any(bool((t.view(torch.bfloat16) == 3).any()) for t in server_tensors)
        pool.close()
    finally:
        client.close()
        server.stop()


def test_a_pool_placed_otherwise_is_refused_naming_the_field():
    _, kv_cache_config = _kv_cache_config(["full"] * 4, 8 * 1024 * 1024)
    _, other = _kv_cache_config(["full"] * 4, 4 * 1024 * 1024)
    server = EmbeddedServer(
        other, max_model_len=4096, enable_prefix_caching=True, hash_algorithm="sha256", hash_seed="s"
    )
    client = KVCacheClient(server.address)
    try:
        with pytest.raises(ValueError, match=r"kv_cache_tensors\[0\]\.size: the server has"):
            check_pool_placement(client.get_kv_cache_group_metadata(), kv_cache_config)
    finally:
        client.close()
        server.stop()


def test_the_worker_class_is_vllms_gpu_worker():
    from vllm.v1.worker.gpu_worker import Worker as VllmWorker

    import kvservice_vllm.worker as worker

    assert issubclass(worker.Worker, VllmWorker)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pool attached by CUDA IPC)")
def test_the_views_over_a_cuda_pool_are_vllms_own():
    """As the CPU test, with the pool in CUDA memory attached through its IPC handle (the device
    machine runs it; CI has none)."""
    config, kv_cache_config = _kv_cache_config(["full"] * 4, 8 * 1024 * 1024)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    server = EmbeddedServer(
        kv_cache_config,
        max_model_len=4096,
        enable_prefix_caching=True,
        hash_algorithm="sha256",
        hash_seed="s",
        device="cuda",
    )
    client = KVCacheClient(server.address)
    try:
        check_pool_placement(client.get_kv_cache_group_metadata(), kv_cache_config)
        pool = attach(client)
        (storage,) = pool.storages
        assert storage.is_cuda
        ours = kv_caches_over(storage, kv_cache_config, "cuda", layout)
        theirs = allocate_kv_cache(kv_cache_config, torch.device("cuda"), layout)
        for name in theirs:
            a, b = ours[name], theirs[name]
            assert (a.shape, a.stride(), a.dtype, a.storage_offset()) == (
                b.shape,
                b.stride(),
                b.dtype,
                b.storage_offset(),
            )
        pool.close()
    finally:
        client.close()
        server.stop()
