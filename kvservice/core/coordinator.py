"""Coordinators: run a request's allocation across every KV cache group of the model.

Mirrors vLLM's ``vllm/v1/core/kv_cache_coordinator.py``. All groups share one block pool; each has
its own :class:`~kvservice.core.single_type_managers.SingleTypeKVCacheManager`. Results are tuples
with one entry per group (index = ``group_idx``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvservice.core.block_pool import BlockPool, KVCacheBlock
from kvservice.core.kv_cache_spec import KVCacheConfig
from kvservice.core.request import Request
from kvservice.core.single_type_managers import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from kvservice_client.hashing import resolve_block_hashes

__all__ = ["HybridKVCacheCoordinator", "KVCacheCoordinator", "UnitaryKVCacheCoordinator", "get_kv_cache_coordinator"]


class KVCacheCoordinator:
    """Fans a request's calls out to every group's manager.

    Args:
        kv_cache_config: the groups and the pool size.
        block_pool: the pool all groups share.

    Attributes:
        hash_block_size: tokens per hashed block: the gcd of the groups' block sizes, so every
            group's block size is a multiple of it.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, block_pool, group_idx)
            for group_idx, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        self.block_sizes = tuple(m.block_size for m in self.managers)
        self.hash_block_size = math.gcd(*self.block_sizes)

    def group_block_hashes(self, request: Request, group_idx: int) -> Sequence[bytes]:
        """The request's hashes at group ``group_idx``'s block size."""
        return resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_sizes[group_idx])

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_total_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
        max_num_blocks: Sequence[int | None] | None = None,
    ) -> int:
        """Free blocks all groups together would consume to hold ``num_tokens`` tokens (a
        cross-attention group holds ``num_encoder_tokens``); arguments as
        :meth:`SingleTypeKVCacheManager.get_num_blocks_to_allocate`, ``max_num_blocks`` per group."""
        total = 0
        for i, m in enumerate(self.managers):
            cap = max_num_blocks[i] if max_num_blocks is not None else None
            if m.holds_encoder_tokens:
                total += m.get_num_blocks_to_allocate(request_id, num_encoder_tokens, (), 0, cap)
            else:
                total += m.get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[i], num_total_computed_tokens, cap
                )
        return total

    def add_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Start each group's table with its part of the prefix-cache hit, then give every group
        blocks for a KV connector's external tokens (vLLM 0.33: ``allocate_new_computed_blocks``,
        in two phases so one group's new blocks cannot evict another group's untouched hit).

        Returns:
            Per group, the blocks taken for the external tokens.
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_total)
        if not num_external_computed_tokens:
            return tuple([] for _ in self.managers)
        return tuple(
            m.allocate_external_computed_blocks(request_id, num_local_computed_tokens, num_external_computed_tokens)
            for m in self.managers
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group's table to hold ``num_tokens`` tokens (a cross-attention group
        ``num_encoder_tokens``); the new blocks per group."""
        return tuple(
            [
                m.allocate_new_blocks(request_id, num_encoder_tokens if m.holds_encoder_tokens else num_tokens)
                for m in self.managers
            ]
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache every group's full blocks among the first ``num_tokens`` tokens."""
        for i, m in enumerate(self.managers):
            m.cache_blocks(request, self.group_block_hashes(request, i), num_tokens)

    def free(self, request_id: str) -> int:
        """Free the request's blocks in every group (group order; tail first within a group)."""
        return sum(m.free(request_id) for m in self.managers)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's tables without freeing their blocks (vLLM 0.33:
        ``pop_blocks_for_free``): every group's blocks in table order, each group's leading null
        blocks left out. The caller frees them later (tail first) with ``BlockPool.free_blocks``."""
        blocks: list[KVCacheBlock] = []
        for m in self.managers:
            blocks.extend(m.pop_blocks_for_free(request_id))
        return blocks

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks every group's skip rule would return to the free queue (nothing changes)."""
        total = 0
        for m in self.managers:
            total += m.get_num_freeable_skipped_blocks(request_id, num_computed_tokens)
        return total

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Apply every group's skip rule."""
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table in each group."""
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def find_longest_cache_hit(
        self, request: Request, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix-cache hit every group accepts.

        Args:
            request: the request (its ``block_hashes``).
            max_cache_hit_length: the longest hit allowed, in tokens.

        Returns:
            (hit blocks per group, hit length in tokens).
        """
        raise NotImplementedError


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: its hit rule alone decides."""

    def find_longest_cache_hit(
        self, request: Request, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        manager = self.managers[0]
        blocks = manager.find_longest_cache_hit(self.group_block_hashes(request, 0), max_cache_hit_length)
        return (blocks,), len(blocks) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups (e.g. full attention + sliding window).

    The hit is the longest length every group accepts: each group in turn shrinks the candidate
    length to its own longest hit within it, until no group shrinks it (full attention accepts any
    shorter prefix of a hit; a sliding window needs the window before the end cached, so it is
    asked again at the shorter length). The result is a multiple of every group's block size.
    """

    def find_longest_cache_hit(
        self, request: Request, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        managers = self.managers
        hashes = [self.group_block_hashes(request, i) for i in range(len(managers))]
        hit_length = max_cache_hit_length
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        while True:
            changed = False
            for i, manager in enumerate(managers):
                if not manager.prefix_cacheable:
                    continue  # cross-attention: per-request blocks, never part of a hit
                blocks = manager.find_longest_cache_hit(hashes[i], hit_length)
                hits[i] = blocks
                length = len(blocks) * manager.block_size
                if length < hit_length:
                    hit_length = length
                    changed = True
            if not changed:
                break
        return tuple(hits), hit_length


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> KVCacheCoordinator:
    """The coordinator for a config: unitary for one group, hybrid for several."""
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, block_pool)
    return HybridKVCacheCoordinator(kv_cache_config, block_pool)
