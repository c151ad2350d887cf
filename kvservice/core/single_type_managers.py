"""One manager per KV cache group: block tables, the group's hit rule and its skip rule.

Mirrors vLLM's ``vllm/v1/core/single_type_kv_cache_manager.py``. Each manager owns, for every
request, the group's block table (append-only, except that positions a group stops needing are
replaced by the null block) and how many of its blocks are cached. The kinds differ in two rules:

* *hit rule* (:meth:`SingleTypeKVCacheManager.find_longest_cache_hit`): which cached prefix the
  group can reuse;
* *skip rule* (:meth:`SingleTypeKVCacheManager.get_num_skipped_tokens`): which leading tokens the
  group no longer needs once tokens are computed (their blocks are freed and replaced by the null
  block).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvservice.core.block_pool import BlockPool, KVCacheBlock
from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvservice.core.request import Request

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager(ABC):
    """Block tables and rules of one KV cache group.

    Args:
        kv_cache_spec: the group's spec (``block_size`` in tokens).
        block_pool: the pool shared by all groups.
        group_idx: this group's index.

    Attributes:
        req_to_blocks: request id -> the group's block table (index = block position).
        num_cached_block: request id -> leading blocks of the table already cached.
    """

    holds_encoder_tokens = False
    """Whether the group's blocks hold a request's encoder tokens (cross-attention) rather than
    its decoder tokens."""

    prefix_cacheable = True
    """Whether the group's full blocks are cached and hit (not cross-attention)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_idx: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.group_idx = group_idx
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- allocation -------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_total_computed_tokens: int = 0,
        max_num_blocks: int | None = None,
    ) -> int:
        """Free blocks this group would consume to hold ``num_tokens`` tokens (vLLM 0.33:
        ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``).

        A request that has a table needs the blocks beyond it. One being admitted needs the blocks
        beyond its skipped positions or its hit, whichever reaches further, plus the hit blocks
        that are free (touching them takes them out of the free queue); hit blocks its skip rule
        drops are not touched, so they do not count.

        Args:
            request_id: the request.
            num_tokens: tokens that need a slot, those already allocated included.
            new_computed_blocks: the prefix-cache hit taken now (admission only), null-padded.
            num_total_computed_tokens: tokens computed once the hit (and a connector's external
                tokens) is taken; the skip rule applies to it.
            max_num_blocks: most blocks the request needs at once (vLLM's recycling-aware
                admission cap of a sliding window or chunked local group); None: no cap.
        """
        num_required = -(-num_tokens // self.block_size)
        if max_num_blocks is not None and num_required > max_num_blocks:
            num_required = max_num_blocks
        table = self.req_to_blocks.get(request_id)
        if table is not None:
            assert not new_computed_blocks, "a request with a block table cannot take a new prefix-cache hit"
            return num_required - len(table) if num_required > len(table) else 0
        num_skipped_blocks = self.get_num_skipped_tokens(num_total_computed_tokens) // self.block_size
        num_held = max(num_skipped_blocks, len(new_computed_blocks))
        num_new = num_required - num_held if num_required > num_held else 0
        if not new_computed_blocks:
            return num_new
        touched = new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks else new_computed_blocks
        return num_new + sum(1 for b in touched if b.ref_cnt == 0 and not b.is_null)

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int
    ) -> None:
        """Start the request's table with its prefix-cache hit, all cached (vLLM 0.33:
        ``add_local_computed_blocks``): the positions the skip rule drops at
        ``num_total_computed_tokens`` are null (their hit blocks are not taken), the rest of the hit
        is touched. A request that already has a table keeps it (the hit must then be empty)."""
        if request_id in self.req_to_blocks:
            assert not new_computed_blocks, "a running request cannot take a new prefix-cache hit"
            return
        num_skipped_blocks = self.get_num_skipped_tokens(num_total_computed_tokens) // self.block_size
        if num_skipped_blocks:
            kept = new_computed_blocks[num_skipped_blocks:]
            table = [self.null_block] * num_skipped_blocks
            table.extend(kept)
        else:
            kept = new_computed_blocks
            table = list(new_computed_blocks)
        self.block_pool.touch(kept)
        self.req_to_blocks[request_id] = table
        self.num_cached_block[request_id] = len(table)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Blocks for the tokens a KV connector loads (vLLM 0.33: ``allocate_external_computed_blocks``):
        the table grows to hold ``num_local_computed_tokens + num_external_computed_tokens``, minus
        what the skip rule drops at that point. Run after every group's hit is touched, so one
        group's new blocks cannot evict another group's hit.

        Returns:
            The new blocks (appended to the table).
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(num_total - num_skipped_tokens, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return []
        table = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = -(-num_total // self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append blocks until the table holds ``num_tokens`` tokens; returns the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = _cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Cache the table's full blocks among the first ``num_tokens`` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.block_size, self.group_idx
        )
        self.num_cached_block[request_id] = num_full

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's table without freeing its blocks: the blocks in table order, the
        leading null blocks (skipped positions) left out (vLLM 0.33: ``pop_blocks_for_free``)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        start = 0
        while start < len(blocks) and blocks[start].is_null:
            start += 1
        return blocks[start:] if start else blocks

    def free(self, request_id: str) -> int:
        """Free the request's blocks tail first (its deepest block is evicted first).

        Returns:
            Blocks whose ref count dropped.
        """
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return self.block_pool.free_blocks(reversed(blocks))

    def num_cached_tokens(self, request_id: str) -> int:
        """Tokens the request's cached blocks cover: the end of its deepest cached block, 0 when
        none is (vLLM 0.33: the largest ``block_hash_num_tokens`` of its table)."""
        blocks = self.req_to_blocks.get(request_id, ())
        for i in range(len(blocks) - 1, -1, -1):
            if blocks[i].block_hash is not None:
                return (i + 1) * self.block_size
        return 0

    # -- skipping ---------------------------------------------------------------------------

    @property
    def has_skip_rule(self) -> bool:
        """Whether the group frees positions it stops needing (sliding window, chunked local,
        Mamba): its tables and hits may hold null blocks."""
        return type(self).get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens this group no longer needs once ``num_computed_tokens`` are computed."""
        return 0

    def get_num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks :meth:`remove_skipped_blocks` would return to the free queue (held by this request
        alone), without changing anything."""
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_blocks <= 0 or not blocks:
            return 0
        num_freeable = 0
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            num_freeable += block.ref_cnt == 1
        return num_freeable

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks of skipped positions and put the null block in their place.

        Walks back from the last skipped position and stops at the first null block (everything
        before it was replaced earlier). Frees tail first.
        """
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            removed.append(block)
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)

    # -- hits -------------------------------------------------------------------------------

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        """The longest reusable prefix of at most ``max_length`` tokens, as this group sees it.

        Args:
            block_hashes: the request's hashes at this group's block size.
            max_length: the longest hit allowed, in tokens.

        Returns:
            The hit's block table: ``len(result) * block_size`` tokens, null blocks at positions
            the group does not need.
        """


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA, sink, cross, encoder-only): a hit needs every block of the prefix."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        """Blocks 0..k-1 while each is cached (vLLM: FullAttentionManager)."""
        get_one_block = self.block_pool.cached_block_hash_to_block[self.group_idx].get_one_block
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        computed: list[KVCacheBlock] = []
        for i in range(max_num_blocks):
            block = get_one_block(block_hashes[i])
            if block is None:
                break
            computed.append(block)
        return computed


class CrossAttentionManager(FullAttentionManager):
    """Cross-attention (encoder-decoder models): a request's blocks hold its encoder tokens, given
    once at its first allocation; never cached, never hit (vLLM 0.33: ``CrossAttentionManager``)."""

    holds_encoder_tokens = True
    prefix_cacheable = False

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        return []

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_total_computed_tokens: int
    ) -> None:
        assert not new_computed_blocks, "cross-attention blocks are never a prefix-cache hit"

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> list[KVCacheBlock]:
        return []

    def cache_blocks(self, request: Request, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        return


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: only the last ``sliding_window - 1`` tokens before a position matter.

    Hit rule (vLLM: SlidingWindowManager): scanning back from the longest allowed prefix, the
    first run of ``ceil((sliding_window - 1) / block_size)`` consecutive cached blocks ends the
    hit; earlier positions are null. A run touching block 0 is a hit too, however short.
    Skip rule: tokens before ``num_computed_tokens - sliding_window + 1``.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_idx: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_idx)
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        self.sliding_window = kv_cache_spec.sliding_window
        self._num_contiguous_blocks = max(_cdiv(self.sliding_window - 1, self.block_size), 1)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        get_one_block = self.block_pool.cached_block_hash_to_block[self.group_idx].get_one_block
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        computed = [self.null_block] * max_num_blocks
        num_contiguous = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = get_one_block(block_hashes[i])
            if block is None:
                num_contiguous = 0
                continue
            computed[i] = block
            num_contiguous += 1
            if num_contiguous >= self._num_contiguous_blocks:
                del computed[i + num_contiguous :]
                return computed
        # No full window found: only a run starting at block 0 is usable.
        del computed[num_contiguous:]
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention (Llama 4): a token sees only its own ``attention_chunk_size`` chunk.

    Hit rule (vLLM: ChunkedLocalAttentionManager): blocks before the current chunk's start are not
    needed (null); from the chunk's start, consecutive cached blocks. Skip rule: tokens before the
    current chunk.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_idx: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_idx)
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        get_one_block = self.block_pool.cached_block_hash_to_block[self.group_idx].get_one_block
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        chunk_start = (max_length // self.attention_chunk_size) * self.attention_chunk_size
        start_block = min(chunk_start // self.block_size, max_num_blocks)
        computed = [self.null_block] * start_block
        for i in range(start_block, max_num_blocks):
            block = get_one_block(block_hashes[i])
            if block is None:
                break
            computed.append(block)
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.attention_chunk_size) * self.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """Mamba (state-space) layers: block ``i`` holds the recurrent state after ``(i + 1) * block_size``
    tokens, so one block is enough to resume.

    Hit rule: the latest cached state at or before the longest allowed prefix (earlier positions
    null). Skip rule: every block before the one holding the latest computed state. This is a
    simplification of vLLM's Mamba prefix caching ("all" mode); it keeps the same accounting.
    """

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> list[KVCacheBlock]:
        get_one_block = self.block_pool.cached_block_hash_to_block[self.group_idx].get_one_block
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        for i in range(max_num_blocks - 1, -1, -1):
            block = get_one_block(block_hashes[i])
            if block is not None:
                return [self.null_block] * i + [block]
        return []

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if num_computed_tokens <= 0:
            return 0
        return ((num_computed_tokens - 1) // self.block_size) * self.block_size


_MANAGER_BY_SPEC: tuple[tuple[type[KVCacheSpec], type[SingleTypeKVCacheManager]], ...] = (
    (SlidingWindowSpec, SlidingWindowManager),
    (ChunkedLocalAttentionSpec, ChunkedLocalAttentionManager),
    (MambaSpec, MambaManager),
    (FullAttentionSpec, FullAttentionManager),
    (CrossAttentionSpec, CrossAttentionManager),
    (EncoderOnlyAttentionSpec, FullAttentionManager),
)


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_idx: int
) -> SingleTypeKVCacheManager:
    """The manager for a group's spec (subclasses first; MLA and sink are full attention).

    A :class:`UniformTypeKVCacheSpecs` uses the manager of its inner specs' common class.

    Raises:
        ValueError: a spec class no manager handles, or a uniform wrapper of mixed classes.
    """
    spec = kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner_types = {type(s) for s in spec.kv_cache_specs.values()}
        if len(inner_types) != 1:
            raise ValueError(f"a UniformTypeKVCacheSpecs group needs one inner spec class; got {inner_types}")
        spec = next(iter(spec.kv_cache_specs.values()))
    for spec_cls, manager_cls in _MANAGER_BY_SPEC:
        if isinstance(spec, spec_cls):
            return manager_cls(spec, block_pool, group_idx)
    raise ValueError(f"no KV cache manager for {type(kv_cache_spec).__name__}")
