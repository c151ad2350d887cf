"""Factories for core tests: tiny configs, admission as vLLM's scheduler does it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from kvservice.core.engine import KVCacheEngine
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


def engine_state(engine: KVCacheEngine) -> dict[str, Any]:
    """Everything a refused engine call must leave as it was: the free-queue order, every block's ref
    count, hash and group, the hash index, the block tables and their cached counts, the request
    table (tokens, hashes, counts, options), who runs, who is scheduler-owned, the blocks popped and
    not freed, the claim, the waiting-token count, the prefix-cache counters and the queued events."""
    manager = engine.manager
    pool = manager.block_pool
    return {
        "free_queue": free_ids(manager),
        "blocks": [(b.ref_cnt, b.block_hash, b.group_idx) for b in pool.blocks],
        "index": [
            {h: sorted(b.block_id for b in _copies(index, h)) for h in index.hashes()}
            for index in pool.cached_block_hash_to_block
        ],
        "tables": [
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
            for m in manager.coordinator.managers
        ],
        "num_cached_block": [dict(m.num_cached_block) for m in manager.coordinator.managers],
        "requests": {
            rid: (
                list(r.all_token_ids),
                list(r.block_hashes),
                r.num_prompt_tokens,
                r.num_computed_tokens,
                r.num_in_flight_tokens,
                r.session_id,
                r.kv_cache_report_mode,
                r.lora,
                r.cache_salt,
                r.mm_features,
            )
            for rid, r in engine.requests.items()
        },
        "running": sorted(engine.running),
        "owned": list(engine.owned),
        "detached": dict(engine._detached),
        "claim": engine.claim,
        "num_waiting_tokens": engine.num_waiting_tokens,
        "stats": dataclasses.astuple(manager.prefix_cache_stats),
        "last_call": dict(engine._last_call),
        "events": copy.deepcopy(pool.kv_event_queue),
    }


def _copies(index: Any, block_hash: bytes) -> list[Any]:
    value = index._map[block_hash]
    return list(value.values()) if isinstance(value, dict) else [value]
