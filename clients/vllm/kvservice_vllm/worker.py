"""vLLM's GPU worker with its KV cache on the kvservice pool (``--worker-cls kvservice_vllm.Worker``).

vLLM's model runner allocates one flat int8 buffer for its KV cache tensors
(``vllm.v1.worker.utils.allocate_kv_cache``: every ``KVCacheTensor`` places its layers in that one
allocation) and views each layer's pages over it (``vllm.v1.kv_cache_interface.create_kv_cache_views``).
This worker does the same over the server's memory instead: it attaches to the pool
(``AttachKVCache``: CUDA IPC on a GPU, POSIX shared memory on CPU), checks that the server places
the tensors exactly as the engine's ``KVCacheConfig`` does, and hands vLLM's own view function the
attached buffer, so the workers write into the blocks the manager hands out and readers (routers,
tiers, ``ReadBlocks``) see them.

Settings: the ``kvservice`` entry of ``--additional-config`` (``kvservice_vllm.scheduler``):
``target`` and a ``worker_token`` (``KVSERVICE_WORKER_TOKEN``) or ``token``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Worker", "check_pool_placement", "kv_caches_over", "on_hosted_pool"]


def kv_caches_over(
    buffer: Any, kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: Sequence[int] | None = None
) -> dict[str, Any]:
    """vLLM's ``allocate_kv_cache`` over a given buffer: layer name -> its KV cache view, built by
    vLLM's ``create_kv_cache_views`` from each ``KVCacheTensor``'s placement.

    Args:
        buffer: one flat byte tensor of at least the tensors' size (the attached pool).
        kv_cache_config: vLLM's ``KVCacheConfig``.
        device: unused (vLLM's signature; the buffer's device is the views').
        layout: vLLM's resolved ``KVCacheLayout``.
        kernel_block_sizes: per group, the attention kernel's block size (vLLM's).

    Raises:
        ValueError: the buffer is smaller than the tensors' allocation.
    """
    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return {}
    size = max(t.size for t in kv_cache_config.kv_cache_tensors)
    raw = buffer.view(torch.int8)
    if raw.numel() < size:
        raise ValueError(f"the attached pool holds {raw.numel()} bytes; the KV cache tensors need {size}")
    raw = raw[:size]
    caches: dict[str, Any] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        group_id, group = next(
            (g, group)
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            if tensor.layers[0] in group.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        if not spec.has_layer_views:
            caches.update((name, raw) for name in tensor.layers)
            continue
        kernel = (
            kernel_block_sizes[group_id]
            if kernel_block_sizes is not None and group_id < len(kernel_block_sizes)
            else None
        )
        views = create_kv_cache_views(
            raw, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor, kernel_block_size=kernel
        )
        caches.update(zip(tensor.layers, views))
    return caches


def check_pool_placement(metadata: Any, kv_cache_config: Any) -> None:
    """Refuse a server whose KV cache tensors are not placed as vLLM's ``KVCacheConfig`` places
    them (the first tensor and field that differ, with both values).

    Raises:
        ValueError: a difference (count, layers, size, offset, layer or block stride).
    """
    served = list(metadata.kv_cache_tensors)
    ours = list(kv_cache_config.kv_cache_tensors)
    if len(served) != len(ours):
        raise ValueError(f"kv_cache_tensors: the server has {len(served)}, vLLM's config {len(ours)}")
    for i, (have, want) in enumerate(zip(served, ours)):
        for field, a, b in (
            ("layers", len(have.layer_names), len(want.layers)),
            ("size", have.size_bytes, want.size),
            ("offset", have.offset_bytes, want.offset),
            ("layer_stride", have.layer_stride_bytes, want.layer_stride),
            ("block_stride", have.block_stride_bytes, want.block_stride),
        ):
            if a != b:
                raise ValueError(f"kv_cache_tensors[{i}].{field}: the server has {a}, vLLM's config {b}")


@contextlib.contextmanager
def on_hosted_pool(buffer: Any) -> Iterator[None]:
    """vLLM's model runner allocates its KV cache over ``buffer`` while this is entered (its
    ``allocate_kv_cache`` is ``kv_caches_over(buffer, ...)``)."""
    import vllm.v1.worker.gpu_model_runner as runner

    original = runner.allocate_kv_cache
    runner.allocate_kv_cache = functools.partial(kv_caches_over, buffer)
    try:
        yield
    finally:
        runner.allocate_kv_cache = original


def _worker_base() -> type:
    from vllm.v1.worker.gpu_worker import Worker as VllmWorker

    return VllmWorker


class Worker(_worker_base()):  # type: ignore[misc]  # vLLM's class, resolved at import
    """vLLM 0.33's GPU ``Worker`` whose KV cache is the kvservice pool (``--worker-cls
    kvservice_vllm.Worker``; the server on the same host, its device the worker's)."""

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        from kvservice_client import KVCacheClient
        from kvservice_client.torch_view import attach
        from kvservice_vllm.scheduler import kvservice_settings

        settings = kvservice_settings(self.vllm_config)
        token = os.environ.get("KVSERVICE_WORKER_TOKEN") or settings.get("worker_token") or settings.get("token")
        client = KVCacheClient(settings["target"], token=token)
        try:
            check_pool_placement(client.get_kv_cache_group_metadata(), kv_cache_config)
            self.kvservice_pool = attach(client)
        finally:
            client.close()
        (storage,) = self.kvservice_pool.storages
        runner = self.model_runner
        allocate = runner.initialize_kv_cache_tensors

        def initialize_kv_cache_tensors(*args: Any, **kwargs: Any) -> Any:
            with on_hosted_pool(storage):
                return allocate(*args, **kwargs)

        runner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
        super().initialize_from_config(kv_cache_config)
