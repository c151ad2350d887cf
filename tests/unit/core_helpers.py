"""Factories for core tests: tiny configs, admission as vLLM's scheduler does it."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvservice.core.request import Request


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 1, "float16")


def make_manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec] | None = None,
    *,
    events: bool = True,
    max_model_len: int = 4096,
) -> KVCacheManager:
    specs = specs or [full()]
    config = KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs)))
    return KVCacheManager(config, max_model_len, kv_events=KVEventsConfig() if events else None)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Lookup + allocation of a waiting request; advances num_computed_tokens on success.

    Returns (hit tokens, new block ids per group) or (hit, None) when allocation failed.
    """
    blocks, hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - hit
    new = manager.allocate_slots(request, num_new_tokens, hit, blocks)
    if new is None:
        return hit, None
    request.num_computed_tokens = hit + num_new_tokens
    return hit, new.get_block_ids()


def step(
    manager: KVCacheManager, request: Request, new_token_ids: Sequence[int] = (), num_new_tokens: int | None = None
):
    """One step of a running request: append tokens, allocate, advance."""
    if new_token_ids:
        request.append_output_token_ids(list(new_token_ids))
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - request.num_computed_tokens
    new = manager.allocate_slots(request, num_new_tokens)
    if new is None:
        return None
    request.num_computed_tokens += num_new_tokens
    return new.get_block_ids()
