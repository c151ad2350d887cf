"""The KV cache manager: the facade a scheduler calls.

Mirrors vLLM's ``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``, ``allocate_slots``,
``free``, ``reset_prefix_cache``, ``take_events``) and adds kvservice's three features:

* full report mode: a request in ``kv_cache_report_mode="full"`` has its prefix-cache hit reported
  as BlockStored (``reused=True``) by the allocation that takes the hit (docs/ARCHITECTURE.md §3.5);
* ``session_id`` on every BlockStored a request triggers (docs/ARCHITECTURE.md §3.6);
* every BlockStored and BlockRemoved annotated with its group's kind and sliding window when taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from kvservice.core.block_pool import BlockPool, KVCacheBlock
from kvservice.core.coordinator import get_kv_cache_coordinator
from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvservice.core.request import Request
from kvservice_client.events import BlockRemoved, BlockStored, KVEvent
from kvservice_client.hashing import (
    DEFAULT_HASH_ALGORITHM,
    DEFAULT_HASH_SEED,
    BlockHasher,
    block_hash_to_int,
    get_hash_fn,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BlockHashFormat",
    "KVCacheBlocks",
    "KVCacheGroupMetadata",
    "KVCacheManager",
    "KVCacheMetadata",
    "KVEventsConfig",
    "is_block_hash_format",
    "PrefixCacheStats",
    "PrefixCachingConfig",
]


def _publish_digest(block_hash: bytes) -> bytes:
    return block_hash


class KVCacheBlocks:
    """An allocation result: one list of blocks per group (index = ``group_idx``). Opaque to callers
    beyond :meth:`get_block_ids`."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group (0 = null block)."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks, strict=True)))

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


@dataclass(frozen=True)
class PrefixCachingConfig:
    """Prefix caching: the block-hash rule (see :mod:`kvservice_client.hashing`).

    Attributes:
        hash_algorithm: "sha256_cbor" (default), "sha256", "xxhash" or "xxhash_cbor".
        hash_seed: the root seed.
    """

    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    hash_seed: str = DEFAULT_HASH_SEED


BlockHashFormat = Literal["int64", "digest"]
"""How events publish a block hash (see :class:`KVEventsConfig`)."""


def is_block_hash_format(value: str) -> TypeGuard[BlockHashFormat]:
    """Whether ``value`` names a :data:`BlockHashFormat` (a setting read as a string)."""
    return value in ("int64", "digest")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV events: how they are published.

    Attributes:
        block_hash_format: "int64" (the digest's last 8 bytes, big-endian; vLLM's form) or
            "digest" (raw bytes).
        medium: the events' ``medium`` ("GPU" by default, as vLLM's primary pool; ``ServerConfig.kv_events_medium``).
        locality: vLLM 0.33's ``locality`` of every BlockStored / BlockRemoved ("LOCAL" or "REMOTE"
            relative to the publisher); None: not published (``kv_events_locality``).
        ownership: vLLM 0.33's ``ownership`` (the secondary tier that generated the event, e.g.
            "kvservice" for a tier's server); None: not published (``kv_events_ownership``).
    """

    block_hash_format: BlockHashFormat = "int64"
    medium: str = "GPU"
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        if not is_block_hash_format(self.block_hash_format):
            raise ValueError(f"block_hash_format must be 'int64' or 'digest'; got {self.block_hash_format!r}")


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start.

    Attributes:
        requests: lookups (requests).
        queries: tokens looked up.
        hits: tokens found cached.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class KVCacheGroupMetadata:
    """One group, as published (``GetKVCacheGroupMetadata``).

    Attributes:
        group_idx: the group's index.
        kind: the group's ``KVCacheSpecKind`` value.
        block_size: tokens per block.
        sliding_window: window in tokens (windowed kinds only).
        attention_chunk_size: chunk in tokens (chunked local attention only).
        num_blocks: blocks in the shared pool (null block included).
        num_layers: layers in the group.
        page_size_bytes: bytes per block per layer.
        block_bytes: bytes per block over the group's layers.
        dtype: KV dtype name, when the spec has one.
    """

    group_idx: int
    kind: str
    block_size: int
    sliding_window: int | None
    attention_chunk_size: int | None
    num_blocks: int
    num_layers: int
    page_size_bytes: int
    block_bytes: int
    dtype: str | None


@dataclass(frozen=True)
class KVCacheMetadata:
    """Every group plus the hash rule a watcher needs to hash prompts itself.

    Attributes:
        groups: per group metadata, by ``group_idx``.
        hash_algorithm, hash_seed: the block-hash rule (None when prefix caching is off).
        hash_block_size: tokens per hashed block.
        block_hash_format: how events publish hashes.
        medium: the events' medium.
    """

    groups: tuple[KVCacheGroupMetadata, ...]
    hash_algorithm: str | None
    hash_seed: str | None
    hash_block_size: int
    block_hash_format: str
    medium: str


class KVCacheManager:
    """A vLLM-style KV cache manager over one block pool and one or more KV cache groups.

    Args:
        kv_cache_config: pool size and groups.
        max_model_len: the longest request, in tokens (slots are never reserved beyond it).
        prefix_caching: the hash rule; None turns prefix caching off (no hashes, no hits).
        kv_events: how events are published; None turns events off (nothing is recorded).

    Usage, as vLLM's scheduler does: ``get_computed_blocks(request)`` for a waiting request, then
    ``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)`` to
    admit it; then ``request.num_computed_tokens`` is advanced by the caller, and each later step
    calls ``allocate_slots(request, num_new_tokens)``; ``free(request)`` at the end.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        prefix_caching: PrefixCachingConfig | None = PrefixCachingConfig(),
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 token; got {max_model_len}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.kv_events = kv_events
        self.enable_caching = prefix_caching is not None
        encoder: Callable[[bytes], int | bytes] = block_hash_to_int
        if kv_events is not None and kv_events.block_hash_format == "digest":
            encoder = _publish_digest
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            len(kv_cache_config.kv_cache_groups),
            enable_caching=self.enable_caching,
            enable_kv_cache_events=kv_events is not None,
            block_hash_encoder=encoder,
            medium=kv_events.medium if kv_events is not None else "GPU",
            locality=kv_events.locality if kv_events is not None else None,
            ownership=kv_events.ownership if kv_events is not None else None,
        )
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, self.block_pool)
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.hash_block_size = self.coordinator.hash_block_size
        self.block_hasher: BlockHasher | None = (
            BlockHasher(self.hash_block_size, prefix_caching.hash_algorithm, prefix_caching.hash_seed)
            if prefix_caching is not None
            else None
        )
        self.prefix_cache_stats = PrefixCacheStats()
        self.metadata = self._build_metadata()
        self._no_hit: tuple[list[KVCacheBlock], ...] = tuple([] for _ in range(self.num_groups))
        """Read-only: the empty hit of a running request (never mutated)."""
        self._has_skip_rule = any(m.has_skip_rule for m in self.coordinator.managers)
        """Whether some group frees positions it stops needing (sliding window, chunked local)."""
        self._group_kind = tuple(g.kind for g in self.metadata.groups)
        self.last_refusal_full_sequence = False
        """Whether the last refused :meth:`allocate_slots` was refused by its full-sequence gate
        (vLLM checks it before freeing skipped blocks) rather than by the step's own blocks."""
        self.hash_digest_size = len(get_hash_fn(prefix_caching.hash_algorithm)(b"")) if prefix_caching else 32
        """Bytes of one block hash (32 for sha256*, 16 for xxhash*)."""
        self._group_window = tuple(g.sliding_window for g in self.metadata.groups)

    # -- requests ---------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt_token_ids: Iterable[int], **kwargs: Any) -> Request:
        """A :class:`Request` hashed with this manager's rule (kwargs as ``Request``'s own)."""
        return Request(request_id, prompt_token_ids, block_hasher=self.block_hasher, **kwargs)

    def empty_blocks(self) -> KVCacheBlocks:
        """An empty result (no blocks in any group)."""
        return KVCacheBlocks(tuple([] for _ in range(self.num_groups)))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The prefix-cache hit of a waiting request.

        The hit never covers the whole request: the last token is always computed (vLLM:
        ``max_cache_hit_length = num_tokens - 1``). Counts one lookup in :attr:`prefix_cache_stats`.

        Returns:
            (hit blocks per group, hit length in tokens: a multiple of every group's block size).
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(request, request.num_tokens - 1)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_new_computed_tokens
        return KVCacheBlocks(blocks), num_new_computed_tokens

    def find_longest_cache_hit(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """As :meth:`get_computed_blocks`, without counting a lookup (a re-check at admission)."""
        if not self.enable_caching:
            return self.empty_blocks(), 0
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(request, request.num_tokens - 1)
        return KVCacheBlocks(blocks), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        max_in_flight_tokens: int | None = None,
        reserved_blocks: int = 0,
        watermark_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Allocate slots for the tokens the request computes this step (vLLM 0.33:
        ``KVCacheManager.allocate_slots``).

        Args:
            request: the request (``num_computed_tokens`` = tokens computed before this step;
                ``num_in_flight_tokens`` = of those, tokens scheduled but not yet processed).
            num_new_tokens: tokens to compute this step, excluding the hit (>= 1, or 0 when the
                step only adopts a hit or external tokens).
            num_new_computed_tokens: the prefix-cache hit taken now, in tokens (admission only).
            new_computed_blocks: the hit's blocks per group (from :meth:`get_computed_blocks`).
            num_lookahead_tokens: extra slots (speculative tokens), not cached.
            num_external_computed_tokens: tokens a KV connector loads (admission only): blocks
                are allocated for them after the hit.
            delay_cache_blocks: cache nothing now (the external tokens arrive later: vLLM's
                asynchronous KV load); :meth:`cache_blocks` caches them when they have.
            num_encoder_tokens: the encoder tokens a cross-attention group holds (encoder-decoder
                models; allocated at the first allocation).
            full_sequence_must_fit: refuse (None) unless the whole request (``num_tokens``) fits
                the free blocks beside ``watermark_blocks``, each sliding-window or chunked-local
                group counted at most at its admission cap (vLLM's ``scheduler_reserve_full_isl``
                gate: chunked prefill would otherwise admit on the first chunk alone).
            max_in_flight_tokens: tokens scheduled but not yet processed at most (vLLM's
                ``max_in_flight_tokens``): the windowed groups' admission cap; None = max_model_len.
            reserved_blocks: free blocks to leave to other requests (vLLM: an asynchronous KV load
                may not take blocks an in-flight prefill relies on).
            watermark_blocks: free blocks to keep for running requests (vLLM's watermark, given
                by the caller for waiting and preempted requests while others are scheduled).

        Returns:
            The newly allocated blocks per group (blocks taken for external tokens are not among
            them: :meth:`get_block_ids` has the whole table), or None when the pool has too few
            free blocks (then nothing changed and nothing was emitted: blocks of skipped
            positions count as free, as in vLLM, but are released only when the allocation goes
            ahead, docs/ARCHITECTURE.md §3.9).

        Raises:
            ValueError: ``num_new_tokens < 1`` with no hit and no external tokens to adopt.

        Blocks of positions a group no longer needs at ``computed - in flight`` tokens are freed
        (skip rule); then the hit is touched, blocks are taken for external tokens and for the
        new tokens (evicting LRU cached blocks), and, unless ``delay_cache_blocks``, every full
        block up to ``computed + hit + external + num_new_tokens`` tokens (at most the request's
        tokens) is cached. In full report mode a non-empty hit is reported (once: this is the
        admission).
        """
        if num_new_tokens < 1 and not num_external_computed_tokens and not num_new_computed_tokens:
            raise ValueError(
                f"num_new_tokens must be >= 1 when no hit or external tokens are adopted; got {num_new_tokens}"
            )
        if (
            new_computed_blocks is None
            and not num_new_computed_tokens
            and not (num_external_computed_tokens or num_encoder_tokens or full_sequence_must_fit)
            and not (reserved_blocks or watermark_blocks or delay_cache_blocks)
        ):
            running = self._allocate_running(request, num_new_tokens, num_lookahead_tokens)
            if running is not False:
                return running
        hit = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_hit
        coordinator = self.coordinator
        request_id = request.request_id
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_total_computed_tokens = min(num_local_computed_tokens + num_external_computed_tokens, self.max_model_len)
        num_free_blocks = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            num_needed = coordinator.get_num_blocks_to_allocate(
                request_id,
                num_full,
                hit,
                num_total_computed_tokens,
                num_encoder_tokens,
                self.admission_caps(max_in_flight_tokens),
            )
            if num_needed + watermark_blocks > num_free_blocks:
                self.last_refusal_full_sequence = True
                return None
        num_tokens_need_slot = min(
            num_total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_processed_tokens = max(0, num_total_computed_tokens - request.num_in_flight_tokens)
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit, num_total_computed_tokens, num_encoder_tokens
        )
        num_required = num_blocks_to_allocate + watermark_blocks + reserved_blocks
        if num_required > num_free_blocks:
            # Blocks of positions outside a window count as free (vLLM frees them first), but they
            # are freed only once the allocation is sure to succeed: a refusal changes nothing.
            freeable = coordinator.get_num_freeable_skipped_blocks(request_id, num_processed_tokens)
            if num_required > num_free_blocks + freeable:
                self.last_refusal_full_sequence = False
                return None
        coordinator.remove_skipped_blocks(request_id, num_processed_tokens)
        if self.enable_caching:
            if num_new_computed_tokens > 0 and request.report_reuse:
                for group_idx, group_blocks in enumerate(hit):
                    if group_blocks:
                        self.block_pool.report_reused_blocks(
                            request,
                            group_blocks,
                            coordinator.group_block_hashes(request, group_idx),
                            coordinator.block_sizes[group_idx],
                            group_idx,
                        )
        else:
            assert not any(hit), "a hit without prefix caching"
        if any(hit) or num_external_computed_tokens:
            coordinator.add_computed_blocks(request_id, hit, num_local_computed_tokens, num_external_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot, num_encoder_tokens)
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(request, min(num_total_computed_tokens + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def admission_caps(self, max_in_flight_tokens: int | None) -> tuple[int | None, ...]:
        """Per group, the most blocks a request holds at once (vLLM 0.33's
        ``max_admission_blocks_per_request``): a sliding window keeps ``sliding_window - 1``
        tokens plus those in flight (one block more, as the window may start inside a block), a
        chunked local group a chunk plus those in flight; None for the others."""
        in_flight = self.max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        caps: list[int | None] = []
        for group in self.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                caps.append(-(-min(spec.sliding_window - 1 + in_flight, self.max_model_len) // spec.block_size) + 1)
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                caps.append(-(-min(spec.attention_chunk_size + in_flight, self.max_model_len) // spec.block_size))
            else:
                caps.append(None)
        return tuple(caps)

    def _allocate_running(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int
    ) -> KVCacheBlocks | None | Literal[False]:
        """:meth:`allocate_slots` of a request that has a block table in every group and takes no
        hit (a running request's decode or next chunk), with the same effects in the same order,
        minus the work an empty hit makes (no touch, no report, no table to start). False when
        the request has no table yet (the general path handles it)."""
        request_id = request.request_id
        managers = self.coordinator.managers
        num_computed_tokens = request.num_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_blocks_to_allocate = 0
        for m in managers:
            blocks = m.req_to_blocks.get(request_id)
            if blocks is None or m.holds_encoder_tokens:
                return False
            num_new = -(-num_tokens_need_slot // m.block_size) - len(blocks)
            if num_new > 0:
                num_blocks_to_allocate += num_new
        coordinator = self.coordinator
        num_processed_tokens = (
            num_computed_tokens - request.num_in_flight_tokens if request.num_in_flight_tokens else num_computed_tokens
        )
        if num_blocks_to_allocate:
            num_free_blocks = self.block_pool.get_num_free_blocks()
            if num_blocks_to_allocate > num_free_blocks:
                freeable = coordinator.get_num_freeable_skipped_blocks(request_id, max(0, num_processed_tokens))
                if num_blocks_to_allocate > num_free_blocks + freeable:
                    self.last_refusal_full_sequence = False
                    return None
        if self._has_skip_rule:
            coordinator.remove_skipped_blocks(request_id, max(0, num_processed_tokens))
        if num_blocks_to_allocate:
            new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        else:
            new_blocks = tuple([] for _ in managers)
        if self.enable_caching:
            num_tokens = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            block_hashes = request.block_hashes
            hash_block_size = self.hash_block_size
            for i, m in enumerate(managers):
                if m.block_size == hash_block_size:
                    # cache_blocks returns at once unless a block became full.
                    num_full = min(num_tokens // hash_block_size, len(block_hashes))
                    if num_full <= m.num_cached_block[request_id]:
                        continue
                m.cache_blocks(request, coordinator.group_block_hashes(request, i), num_tokens)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request | str) -> int:
        """Free every block the request holds (tail first in each group).

        Returns:
            Blocks whose ref count dropped.
        """
        request_id = request if isinstance(request, str) else request.request_id
        return self.coordinator.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's tables without freeing their blocks (vLLM 0.33:
        ``pop_blocks_for_free``; a KV connector still reads them): every group's blocks in table
        order, leading null blocks left out. Free them later, tail first, with
        :meth:`free_blocks`."""
        return self.coordinator.pop_blocks_for_free(request_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference from each block, the first evicted first (``BlockPool.free_blocks``).

        Returns:
            Blocks whose ref count dropped.
        """
        return self.block_pool.free_blocks(ordered_blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens (at most its
        hashed tokens), when prefix caching is on (vLLM 0.33: ``KVCacheManager.cache_blocks``,
        called when delayed external tokens have arrived or a request resumes)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Free the blocks of positions no group needs once ``num_processed_tokens`` tokens are
        processed, null in their place (vLLM 0.33: ``remove_skipped_blocks``)."""
        self.coordinator.remove_skipped_blocks(request_id, num_processed_tokens)

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Tokens of the request covered by cached blocks in every prefix-cacheable group: per
        group the end of its deepest cached block, the least over groups (vLLM 0.33:
        ``estimate_cached_tokens``; 0 when no group is prefix-cacheable)."""
        num_tokens: int | None = None
        for m in self.coordinator.managers:
            if m.prefix_cacheable and not isinstance(m.kv_cache_spec, EncoderOnlyAttentionSpec):
                n = m.num_cached_tokens(request_id)
                num_tokens = n if num_tokens is None else min(num_tokens, n)
        return num_tokens or 0

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (0 = null block)."""
        return tuple([b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache if no block is held (one AllBlocksCleared); else False."""
        return self.block_pool.reset_prefix_cache()

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the cached hashes of these block ids (see :meth:`BlockPool.evict_blocks`)."""
        return self.block_pool.evict_blocks(block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return self.block_pool.get_usage()

    # -- events -----------------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """Drain the pool's events, annotating BlockStored and BlockRemoved with their group's kind
        and sliding window (metadata computed once at construction). An event whose ``group_idx``
        is out of range is logged as a warning and passed on unannotated."""
        events = self.block_pool.take_events()
        kinds, windows = self._group_kind, self._group_window
        num_groups = len(kinds)
        for event in events:
            if type(event) is BlockStored or type(event) is BlockRemoved:
                g = event.group_idx
                if g is not None and 0 <= g < num_groups:
                    event.kv_cache_spec_kind = kinds[g]
                    event.kv_cache_spec_sliding_window = windows[g]
                else:
                    logger.warning("KV event with group_idx %r outside 0..%d; passed on unannotated", g, num_groups - 1)
        return events

    # -- metadata ---------------------------------------------------------------------------

    def get_kv_cache_group_metadata(self) -> KVCacheMetadata:
        """Per-group layout and the hash rule (computed once)."""
        return self.metadata

    def _build_metadata(self) -> KVCacheMetadata:
        groups = []
        for group_idx, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            groups.append(
                KVCacheGroupMetadata(
                    group_idx=group_idx,
                    kind=get_kv_cache_spec_kind(spec).value,
                    block_size=spec.block_size,
                    sliding_window=get_kv_cache_spec_sliding_window(spec),
                    attention_chunk_size=(
                        spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None
                    ),
                    num_blocks=self.kv_cache_config.num_blocks,
                    num_layers=group.num_layers,
                    page_size_bytes=spec.page_size_bytes,
                    block_bytes=group.block_bytes,
                    dtype=getattr(spec, "dtype", None),
                )
            )
        pc = self.prefix_caching
        ev = self.kv_events or KVEventsConfig()
        return KVCacheMetadata(
            groups=tuple(groups),
            hash_algorithm=pc.hash_algorithm if pc else None,
            hash_seed=pc.hash_seed if pc else None,
            hash_block_size=self.hash_block_size,
            block_hash_format=ev.block_hash_format,
            medium=ev.medium,
        )

    # -- checks -----------------------------------------------------------------------------

    def check_invariants(
        self, request_ids: Sequence[str] | None = None, *, references_off_tables: Mapping[int, int] | None = None
    ) -> None:
        """Assert the pool's consistency and that ref counts equal the number of holders.

        Every non-null block's ref count equals the number of (request, group) tables holding it
        (a block appears at most once per table), plus ``references_off_tables[block_id]``: the
        references taken off tables by :meth:`pop_blocks_for_free` and not freed yet (the engine
        keeps that count).

        Raises:
            AssertionError: naming the broken invariant.
        """
        self.block_pool.check_invariants()
        holders: dict[int, int] = dict(references_off_tables or {})
        for manager in self.coordinator.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                seen = set()
                for block in blocks:
                    if block.is_null:
                        continue
                    assert block.block_id not in seen, f"block {block.block_id} twice in {request_id}'s table"
                    seen.add(block.block_id)
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if not block.is_null:
                assert block.ref_cnt == holders.get(block.block_id, 0), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders {holders.get(block.block_id, 0)}"
                )
