"""The remote KV cache manager: vLLM 0.33's ``KVCacheManager`` surface over ``ManagerStep`` RPCs.

vLLM's scheduler calls its manager synchronously inside its scheduling loop. This class answers
those calls from a kvservice server, where the blocks live (docs/ARCHITECTURE.md §9): it keeps no
cache of its own, only what the server told it (each request's block table, as ids) and what the
server holds of each request (how many of its tokens and hashes were sent).

Calls whose answer the scheduler does not read (``free``, ``cache_blocks``,
``remove_skipped_blocks``, ``pop_blocks_for_free``, ``block_pool.free_blocks``, ``evict_blocks``)
are queued and go with the next call that needs an answer, or with :meth:`flush`, which the
scheduler subclasses run before ``schedule()`` returns: after every ``schedule()`` the server's
pool is exactly what vLLM's in-process manager would hold. Each round trip is one ``ManagerStep``;
its calls run in order on the server, and the first that fails ends it: then this manager raises
:class:`RemoteManagerError` (the scheduler must stop: its view of the cache can no longer be
trusted), as it does when the server is unreachable.

Where vLLM and kvservice differ (kvservice's invariants win, see the README's vLLM section): a
refused allocation changes nothing on the server, and this manager then asks for the freeing of
skipped blocks that vLLM's own manager does before its check, so the pools stay equal; full-mode
reuse reports go out at admission, not at lookup; events report presence.
"""

from __future__ import annotations

import array
import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvservice_client import KVServiceError
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_vllm.layout import group_kinds

logger = logging.getLogger(__name__)

__all__ = ["RemoteKVCacheManager", "RemoteManagerError"]

_WINDOWED_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})


class RemoteManagerError(RuntimeError):
    """The kvservice server refused a manager call or could not be reached: the scheduler's view
    of the cache is no longer the server's, so it must stop (the message names the call and the
    server's status)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Coordinator:
    """What vLLM's scheduler reads of ``kv_cache_manager.coordinator``."""

    enable_partial_hash_hits = False

    def __init__(self, manager: RemoteKVCacheManager) -> None:
        self._manager = manager
        self.block_pool = manager.block_pool
        self.single_type_managers = tuple(
            _SingleTypeManager(manager, g, group.kv_cache_spec)
            for g, group in enumerate(manager.kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """vLLM's count with no new hit, from the server (vLLM's scheduler reserves it for an
        in-flight prefill)."""
        assert not any(new_computed_blocks), "the remote manager counts blocks with no new hit only"
        return self._manager._num_blocks_to_allocate(request_id, num_tokens, total_computed_tokens, apply_admission_cap)


class _GroupTables(Mapping[str, list[KVCacheBlock]]):
    """A group's block tables, read-only, as vLLM's ``single_type_managers[g].req_to_blocks``:
    request id -> its blocks, as the server last answered (a round trip first if calls are queued)."""

    def __init__(self, manager: RemoteKVCacheManager, group_idx: int) -> None:
        self._manager = manager
        self._group_idx = group_idx

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        manager = self._manager
        if manager._pending:
            manager.flush()
        table = manager._tables[request_id]  # KeyError: no table, as vLLM's defaultdict-less read
        return [manager._block(i) for i in table[self._group_idx]]

    def __iter__(self) -> Iterator[str]:
        if self._manager._pending:
            self._manager.flush()
        return iter(list(self._manager._tables))

    def __len__(self) -> int:
        if self._manager._pending:
            self._manager.flush()
        return len(self._manager._tables)


class _SingleTypeManager:
    """What vLLM's scheduler (and its tests) read of one ``coordinator.single_type_managers[g]``:
    the group's spec, block size, index and block tables."""

    def __init__(self, manager: RemoteKVCacheManager, group_idx: int, kv_cache_spec: Any) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_group_id = group_idx
        self.req_to_blocks = _GroupTables(manager, group_idx)


class _BlockPool:
    """What vLLM's scheduler reads of ``kv_cache_manager.block_pool``."""

    def __init__(self, manager: RemoteKVCacheManager, num_gpu_blocks: int, hash_block_size: int) -> None:
        self._manager = manager
        self.num_gpu_blocks = num_gpu_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = manager.enable_caching
        self.null_block = manager._null_block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Free blocks ``pop_blocks_for_free`` handed out, the first evicted first (queued)."""
        self._manager._free_popped_blocks(ordered_blocks)

    def get_num_free_blocks(self) -> int:
        """Free blocks on the server after the queued calls have run (a round trip if any are queued)."""
        return self._manager._num_free_blocks_now()

    def get_usage(self) -> float:
        """Fraction of the pool in use (0..1)."""
        return self._manager.usage


class _PendingBlocks(KVCacheBlocks):
    """A ``KVCacheBlocks`` whose block ids come with the next round trip: reading ``blocks`` (or
    anything built on it, as ``get_block_ids``) sends the queued calls first. The scheduler reads
    them when it builds the step's output, once its loop has made every call of the step."""

    def __init__(self, manager: RemoteKVCacheManager) -> None:  # no dataclass __init__: blocks come later
        self._manager = manager
        self._blocks: tuple[Sequence[KVCacheBlock], ...] | None = None

    @property  # type: ignore[override]  # vLLM's field, read-only here: set by the round trip
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]:
        if self._blocks is None:
            self._manager.flush()
            assert self._blocks is not None, "the round trip answered no blocks for a pending allocation"
        return self._blocks


class _Lookup:
    """A lookup's answer, and where the logs of queued calls stood when the server made it: it
    is still the hit vLLM's manager would find as long as no later call could have changed it
    (:meth:`RemoteKVCacheManager._still_valid`)."""

    __slots__ = (
        "block_ids",
        "num_computed_tokens",
        "num_free_hit_blocks",
        "num_free_blocks_ahead",
        "num_free_blocks",
        "removed_at",
        "cached_at",
        "frees_at",
        "evictions_at",
        "num_hashes",
        "last_hash",
    )

    def __init__(
        self, manager: RemoteKVCacheManager, answer: pb.ManagerResult.ComputedBlocks, request: Request
    ) -> None:
        self.block_ids = [list(g.block_ids) for g in answer.block_ids]
        self.num_computed_tokens = answer.num_computed_tokens
        self.num_free_hit_blocks = list(answer.num_free_hit_blocks)
        self.num_free_blocks_ahead = answer.num_free_blocks_ahead
        self.num_free_blocks = 0  # set from the round trip's answer
        self.removed_at = manager._num_removed
        self.cached_at = manager._cached_log_end
        self.frees_at = manager._num_frees
        self.evictions_at = manager._num_evictions
        self.num_hashes = len(request.block_hashes)
        self.last_hash = request.block_hashes[-1] if request.block_hashes else None


class _RunningBatch:
    """Running requests' allocations answered ahead, packed into one ``AllocateSlotsBatch`` call
    (a step's running loop: one call, not two messages a request)."""

    __slots__ = (
        "request_ids", "computed", "in_flight", "new", "lookahead", "token_counts", "tokens",
        "hash_counts", "hashes", "results", "needs",
    )  # fmt: skip

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.computed: list[int] = []
        self.in_flight: list[int] = []
        self.new: list[int] = []
        self.lookahead: list[int] = []
        self.token_counts: list[int] = []
        self.tokens: list[bytes] = []
        self.hash_counts: list[int] = []
        self.hashes: list[bytes] = []
        self.results: list[_PendingBlocks] = []
        self.needs: list[int] = []

    def call(self) -> pb.ManagerCall:
        batch = pb.ManagerCall.AllocateSlotsBatch(
            request_ids=self.request_ids,
            num_computed_tokens=self.computed,
            num_new_tokens=self.new,
            num_new_token_ids=self.token_counts,
            packed_token_ids=b"".join(self.tokens),
            num_new_block_hashes=self.hash_counts,
            block_hashes=b"".join(self.hashes),
        )
        if any(self.in_flight):
            batch.num_in_flight_tokens.extend(self.in_flight)
        if any(self.lookahead):
            batch.num_lookahead_tokens.extend(self.lookahead)
        return pb.ManagerCall(allocate_slots_batch=batch)


class _StepWrites:
    """A request of a step whose output is coming: its allocation's report position (shared with
    the manager, advanced as blocks are reported) and, per group, the block ids from that
    position up to its scheduled tokens (taken before vLLM frees anything)."""

    __slots__ = ("request", "writing", "block_ids")

    def __init__(self, request: Request, writing: tuple[int, list[int]], block_ids: list[list[int]]) -> None:
        self.request = request
        self.writing = writing
        self.block_ids = block_ids


class _Synced:
    """What the server holds of one request: its first ``num_tokens`` tokens, ``num_hashes`` hashes."""

    __slots__ = ("num_tokens", "num_hashes", "last_hash", "request")

    def __init__(self, request: Request) -> None:
        self.num_tokens = 0
        self.num_hashes = 0
        self.last_hash: bytes | None = None
        self.request = weakref.ref(request)  # another Request object of the same id: sent anew


class RemoteKVCacheManager:
    """vLLM 0.33's ``KVCacheManager``, answered by a kvservice server.

    Args:
        client: a ``kvservice_client.KVCacheClient`` to the server.
        kv_cache_config: vLLM's ``KVCacheConfig`` (the server holds the same groups and pool).
        max_model_len: the longest request, in tokens.
        enable_caching: vLLM's ``enable_prefix_caching``.
        log_stats: keep prefix-cache stats for vLLM's metrics.
        watermark: vLLM's ``scheduler_config.watermark`` (a fraction of the pool kept free when
            admitting waiting and preempted requests while others run).
        max_in_flight_tokens: vLLM's ``max_in_flight_tokens`` (the windowed groups' admission cap).
        owner: the name this scheduler claims the pool under.
        claim_ttl_s: seconds the claim outlives this scheduler's last call.
        enable_kv_cache_events: hand the server's events to the scheduler in :meth:`take_events`.
        needs_kv_cache_zeroing: record new block ids for the worker to zero (vLLM's
            ``KVCacheConfig.needs_kv_cache_zeroing``).
        timeout_s: deadline of one round trip, in seconds.

    Attributes:
        num_round_trips: ``ManagerStep`` RPCs sent.
        num_calls: manager calls sent in them.
    """

    def __init__(
        self,
        client: Any,
        kv_cache_config: Any,
        *,
        max_model_len: int,
        enable_caching: bool,
        log_stats: bool,
        watermark: float,
        max_in_flight_tokens: int | None,
        owner: str,
        claim_ttl_s: float = 30.0,
        enable_kv_cache_events: bool = False,
        needs_kv_cache_zeroing: bool = False,
        timeout_s: float = 60.0,
    ) -> None:
        self._client = client
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.max_in_flight_tokens = max_in_flight_tokens
        self.owner = owner
        self.claim_ttl_s = claim_ttl_s
        self.timeout_s = timeout_s
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._null_block = KVCacheBlock(0)
        self._null_block.is_null = True
        self._tables: dict[str, list[list[int]]] = {}
        self._pending: list[pb.ManagerCall] = []
        self.block_pool = _BlockPool(
            self, kv_cache_config.num_blocks, kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        )
        self.coordinator = _Coordinator(self)
        kinds = group_kinds(kv_cache_config)
        self._windowed = any(kind in _WINDOWED_KINDS for kind in kinds)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self._block_sizes = [spec.block_size for spec in specs]
        self._cross = [isinstance(spec, CrossAttentionSpec) for spec in specs]
        self._clipped = [not isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)) for spec in specs]
        self._zeroing = needs_kv_cache_zeroing
        self.new_block_ids: list[int] = []
        self.num_round_trips = 0
        self.num_calls = 0
        self.num_free_blocks = kv_cache_config.num_blocks - 1
        self._blocks: dict[int, KVCacheBlock] = {0: self._null_block}
        self._on_result: list[Callable[[pb.ManagerResult], None] | None] = []
        self._synced: dict[str, _Synced] = {}
        self._tables_stale: set[str] = set()
        self._cached_tokens: dict[str, int] = {}
        self._predicted_cached: dict[str, int] = {}
        """Request id -> its cached tokens once its queued cache_blocks call has run (see cache_blocks)."""
        self.num_cached_estimate_misses = 0
        """Answers whose cached tokens differed from the estimate given before them (stays 0)."""
        self._tables_pending: set[str] = set()
        self._after_flush: list[Callable[[], None]] = []
        self._lookups_sent: list[_Lookup] = []
        self._queue_claim = False
        self._open_batch: _RunningBatch | None = None
        """Requests whose table the queued calls change in ways known only from the answer."""
        self._lookups: dict[str, _Lookup] = {}
        """Request id -> its last lookup (made ahead of the scheduler's call, or by it)."""
        self._scheduler: Any = None
        """The scheduler whose waiting queues are looked up ahead (set by ``install``)."""
        self.lookahead_depth = 8
        """Waiting requests looked up ahead, at most, with each round trip."""
        self.free_queue_horizon = min(4096, kv_cache_config.num_blocks)
        """How deep in the free queue a lookup made ahead checks its hit's blocks."""
        # Logs of what queued calls may do, since start (docs/ARCHITECTURE.md §9): blocks they may
        # take out of the free queue, hashes they may cache, calls that may free a cached block,
        # evictions.
        self._num_removed = 0
        self._cached_log: list[bytes] = []
        self._cached_log_base = 0
        self._num_frees = 0
        self._num_evictions = 0
        self.num_lookups_ahead_used = 0
        """get_computed_blocks calls answered by a lookup made ahead."""
        self.num_refused_ahead = 0
        """allocate_slots calls refused without a round trip (the refusal was certain)."""
        self._free_lower = self.num_free_blocks
        """At least this many blocks are free once the queued calls have run (docs/ARCHITECTURE.md §9)."""
        self._free_upper = self.num_free_blocks
        """At most this many blocks are free once the queued calls have run."""
        self._certain_ok = all(kind not in _WINDOWED_KINDS for kind in kinds) and not any(self._cross)
        """Whether an allocation can be answered before its round trip when its outcome is certain
        (full-attention groups only: a windowed group frees blocks by its skip rule)."""
        self.num_answered_ahead = 0
        """allocate_slots calls answered before their round trip (the outcome was certain)."""
        self._events: list[Any] = []
        self._closed = False
        self.mark_blocks_written = False
        """Report the blocks each finished step completed as written (``written_blocks``): only
        when the workers' KV cache is the server's pool (``kvservice_vllm.Worker``); set by
        ``install``."""
        self.epoch = ""
        """The server epoch, as the last round trip answered (the allocation ids' epoch)."""
        self._writing: dict[str, tuple[int, list[int]]] = {}
        """Request id -> (its allocation id, [the first block position not yet reported written]):
        positions below are its prefix-cache hit or reported already."""
        self._written: dict[tuple[str, int], list[list[int]]] = {}
        """(request id, allocation id) -> per group, block ids to report written with the next round trip."""
        self.num_blocks_reported_written = 0
        """Block ids sent in ``written_blocks``."""
        self.num_blocks_written = 0
        """Of those, blocks the server marked written."""
        self.num_written_skipped = 0
        """Of those, blocks the server skipped (their request could no longer write them)."""

    # -- round trips ----------------------------------------------------------------------------

    def flush(self, *, release: bool = False) -> None:
        """Send the queued calls (one ``ManagerStep``); nothing happens when none is queued,
        unless ``release`` (end the claim: the scheduler stops).

        Raises:
            RemoteManagerError: a call failed or the server could not be reached.
        """
        if not self._pending and not release and not self._queue_claim and not self._written:
            return
        self._queue_claim = False
        if not release:
            self._look_ahead()
        calls, handlers = self._pending, self._on_result
        self._pending, self._on_result = [], []
        self._open_batch = None
        calls = [c.call() if isinstance(c, _RunningBatch) else c for c in calls]
        request = pb.ManagerStepRequest(
            owner=self.owner,
            claim_ttl_s=self.claim_ttl_s,
            calls=calls,
            release=release,
            return_events=self.enable_kv_cache_events,
        )
        if self._written:
            written, self._written = self._written, {}
            for (request_id, allocation_id), groups in written.items():
                entry = request.written_blocks.add(request_id=request_id, allocation_id=allocation_id)
                for ids in groups:
                    entry.block_ids.add(block_ids=ids)
                    self.num_blocks_reported_written += len(ids)
            request.written_epoch = self.epoch
        self.num_round_trips += 1
        self.num_calls += len(calls)
        try:
            response = self._client.manager_step(request, timeout=self.timeout_s)
        except KVServiceError as exc:
            self._closed = True
            raise RemoteManagerError(
                f"kvservice ManagerStep of {len(calls)} call(s) failed: {exc.code.name}: {exc.message}"
            ) from exc
        self.epoch = response.epoch
        self.num_blocks_written += response.num_blocks_written
        self.num_written_skipped += response.num_written_skipped
        results = response.results
        for i, (call, result) in enumerate(zip(calls, results)):
            if result.WhichOneof("result") == "error":
                self._closed = True
                raise RemoteManagerError(
                    f"kvservice refused {call.WhichOneof('call')} (call {i + 1} of {len(calls)}): "
                    f"{_status_name(result.error.code)}: {result.error.message}"
                )
            handler = handlers[i]
            if handler is not None:
                handler(result)
        self.num_free_blocks = response.num_free_blocks
        self._free_lower = self._free_upper = response.num_free_blocks
        for lookup in self._lookups_sent:
            lookup.num_free_blocks = response.num_free_blocks
        self._lookups_sent = []
        self._trim_cached_log()
        if response.events_msgpack:
            self._events.extend(_decode_events(response.events_msgpack))
        after, self._after_flush = self._after_flush, []
        for resolve in after:
            resolve()

    def claim(self) -> None:
        """Claim the pool now (an empty round trip), so a second scheduler on the same pool is
        refused at its start, not at its first step.

        Raises:
            RemoteManagerError: another scheduler owns the pool (named), or the server is unreachable.
        """
        self._queue_claim = True
        self.flush()

    def _needs_flush(self, request_id: str) -> bool:
        return request_id in self._tables_stale or request_id in self._tables_pending

    def _has_pending_ids(self, request_id: str) -> bool:
        table = self._tables.get(request_id)
        return table is not None and any(ids and ids[-1] is None for ids in table)

    def _queue_after_flush(self, resolve: Callable[[], None]) -> None:
        """Run ``resolve`` once the next round trip has been answered."""
        self._after_flush.append(resolve)

    def _queue(self, call: Any, on_result: Callable[[pb.ManagerResult], None] | None = None) -> None:
        self._open_batch = None  # calls keep their order: a later allocation starts a new batch
        if self._closed:
            raise RemoteManagerError("the remote KV cache manager stopped after an error; restart the engine")
        self._pending.append(call)
        self._on_result.append(on_result)

    def _ask(self, call: pb.ManagerCall) -> pb.ManagerResult:
        """Queue ``call`` and send everything queued; its result."""
        box: list[pb.ManagerResult] = []
        self._queue(call, box.append)
        self.flush()
        return box[0]

    # -- requests -------------------------------------------------------------------------------

    def _sync(self, request: Request) -> None:
        """Queue what the server lacks of the request's tokens and hashes (registering it first)."""
        request_id = request.request_id
        synced = self._synced.get(request_id)
        tokens = request.all_token_ids
        hashes = request.block_hashes if self.enable_caching else ()
        if synced is not None and synced.request() is not request:
            synced.num_tokens = synced.num_hashes = 0  # a new request of an id in use: replace it whole
            synced.request = weakref.ref(request)
            self._lookups.pop(request_id, None)
        if synced is None:
            synced = self._synced[request_id] = _Synced(request)
            update = pb.ManagerCall.UpdateRequest(request_id=request_id, num_prompt_tokens=request.num_prompt_tokens)
            if request.lora_request is not None:
                update.lora.lora_id = request.lora_request.lora_int_id
                update.lora.lora_name = request.lora_request.lora_name
                update.lora.lora_path = request.lora_request.lora_path or ""
            if request.cache_salt is not None:
                update.cache_salt = request.cache_salt
            if getattr(request, "session_id", None) is not None:
                update.session_id = request.session_id
        else:
            num_tokens, num_hashes = len(tokens), len(hashes)
            kept_hashes = synced.num_hashes
            if num_hashes < kept_hashes or (kept_hashes and hashes[kept_hashes - 1] != synced.last_hash):
                kept_hashes = 0  # vLLM recomputed the hashes (a resumed streaming request): resend
            if num_tokens == synced.num_tokens and num_hashes == kept_hashes:
                return
            update = pb.ManagerCall.UpdateRequest(
                request_id=request_id,
                num_tokens_kept=min(synced.num_tokens, num_tokens),
                num_block_hashes_kept=kept_hashes,
            )
        start = update.num_tokens_kept
        if len(tokens) > start:
            update.packed_token_ids = np.asarray(tokens[start:], dtype="<i4").tobytes()
        first_hash = update.num_block_hashes_kept
        if len(hashes) > first_hash:
            update.block_hashes = b"".join(hashes[first_hash:])
        synced.num_tokens = len(tokens)
        synced.num_hashes = len(hashes)
        synced.last_hash = hashes[-1] if hashes else None
        self._queue(pb.ManagerCall(update_request=update))

    def _forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._writing.pop(request_id, None)
        self._synced.pop(request_id, None)
        self._tables.pop(request_id, None)
        self._tables_stale.discard(request_id)
        self._cached_tokens.pop(request_id, None)
        self._predicted_cached.pop(request_id, None)

    def _block(self, block_id: int) -> KVCacheBlock:
        block = self._blocks.get(block_id)
        if block is None:
            block = self._blocks[block_id] = KVCacheBlock(block_id)
        return block

    def _to_blocks(self, groups: Sequence[Sequence[int]]) -> KVCacheBlocks:
        if not any(len(ids) for ids in groups):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple([self._block(i) for i in ids] for ids in groups))

    def _apply_null_heads(self, request_id: str, num_null_blocks: Sequence[int]) -> None:
        table = self._tables.get(request_id)
        if table is None:
            return
        for ids, n in zip(table, num_null_blocks):
            for i in range(min(n, len(ids))):
                ids[i] = 0
        self._tables_stale.discard(request_id)

    # -- vLLM's KVCacheManager ------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1 (as of the last round trip)."""
        return 1.0 - self.num_free_blocks / (self.kv_cache_config.num_blocks - 1)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Take (and reset) the prefix-cache stats; None when stats are off."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a prefix-cache lookup may run for the request."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admission's lookup in the prefix-cache stats (vLLM records at admission)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's prefix-cache hit: (blocks per group, hit length in tokens, 0: no shared
        prefix boundary, a Mamba notion). Answered by a lookup made ahead (with an earlier round
        trip) while no call since can have changed it, else by a round trip."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        request_id = request.request_id
        lookup = self._lookups.get(request_id)
        if max_cache_hit_length is None and lookup is not None and self._still_valid(request, lookup):
            self.num_lookups_ahead_used += 1
        else:
            self._sync(request)
            call = pb.ManagerCall.GetComputedBlocks(request_id=request_id, free_queue_horizon=self.free_queue_horizon)
            if max_cache_hit_length is not None:
                call.max_cache_hit_length = max(0, max_cache_hit_length)
            box: list[_Lookup] = []
            self._queue_lookup(call, request, box)
            self.flush()
            lookup = box[0]
            if max_cache_hit_length is None:
                self._lookups[request_id] = lookup
        return self._to_blocks(lookup.block_ids), lookup.num_computed_tokens, 0

    def _queue_lookup(self, call: pb.ManagerCall.GetComputedBlocks, request: Request, box: list[_Lookup]) -> None:
        def done(result: pb.ManagerResult) -> None:
            lookup = _Lookup(self, result.computed_blocks, request)
            self._lookups_sent.append(lookup)
            box.append(lookup)

        self._queue(pb.ManagerCall(get_computed_blocks=call), done)

    def _look_ahead(self) -> None:
        """Queue lookups of the next waiting requests (whose last lookup no longer holds), so the
        scheduler's next get_computed_blocks calls need no round trip of their own."""
        scheduler = self._scheduler
        if scheduler is None or not self.enable_caching or not self._certain_ok or not self.lookahead_depth:
            return
        num = 0
        for queue in (getattr(scheduler, "kv_holding_waiting", ()), scheduler.waiting):
            for request in queue:
                if num >= self.lookahead_depth:
                    return
                num += 1
                if request.num_computed_tokens or not self.prefix_cache_lookup_enabled(request):
                    continue
                lookup = self._lookups.get(request.request_id)
                if lookup is not None and self._still_valid(request, lookup):
                    continue
                self._sync(request)
                box: list[_Lookup] = []
                self._queue_lookup(
                    pb.ManagerCall.GetComputedBlocks(
                        request_id=request.request_id, free_queue_horizon=self.free_queue_horizon
                    ),
                    request,
                    box,
                )
                request_id = request.request_id
                self._after_flush.append(lambda rid=request_id, b=box: self._lookups.__setitem__(rid, b[0]))

    def _still_valid(self, request: Request, lookup: _Lookup) -> bool:
        """Whether vLLM's manager would find the same hit now, once the queued calls have run: no
        eviction since; fewer blocks taken out of the free queue since than stood before the
        hit's first free block (or before any block, when a call since may have freed one of the
        hit's); no hash of the request past its hit cached since; the request's hashes unchanged."""
        hashes = request.block_hashes
        if lookup.evictions_at != self._num_evictions or lookup.num_hashes != len(hashes):
            return False
        if hashes and hashes[-1] != lookup.last_hash:
            return False
        synced = self._synced.get(request.request_id)
        if synced is None or synced.request() is not request:
            return False
        ahead = lookup.num_free_blocks_ahead
        if self._num_frees != lookup.frees_at:
            ahead = min(ahead, lookup.num_free_blocks)
        if self._num_removed - lookup.removed_at >= ahead:
            return False
        if self._cached_log_end != lookup.cached_at:
            start = lookup.cached_at - self._cached_log_base
            if start < 0:
                return False
            block_size = self._block_sizes[0]
            beyond = set(hashes[lookup.num_computed_tokens // block_size :])
            if not beyond.isdisjoint(self._cached_log[start:]):
                return False
            lookup.cached_at = self._cached_log_end  # checked up to here: the next check starts here
        return True

    @property
    def _cached_log_end(self) -> int:
        return self._cached_log_base + len(self._cached_log)

    def _trim_cached_log(self) -> None:
        """Drop the part of the cached-hash log no kept lookup needs."""
        if not self._cached_log:
            return
        keep = min((lookup.cached_at for lookup in self._lookups.values()), default=self._cached_log_end)
        drop = keep - self._cached_log_base
        if drop > 0:
            del self._cached_log[:drop]
            self._cached_log_base = keep

    def _log_allocation(self, request: Request, num_removed: int, num_cached_from: int, num_tokens: int) -> None:
        """Log what an allocation may do: take ``num_removed`` blocks out of the free queue and
        cache the request's hashes from block ``num_cached_from`` up to ``num_tokens`` tokens."""
        self._num_removed += num_removed
        if self.enable_caching:
            block_size = self._block_sizes[0]
            hashes = request.block_hashes
            self._cached_log.extend(hashes[num_cached_from : min(num_tokens // block_size, len(hashes))])

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """As vLLM's: with no Mamba group the local hit never diverges across groups."""
        return *self.get_computed_blocks(request, max_cache_hit_length), False

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots`` (arguments as vLLM's): the new blocks per group, or None when
        the pool has too few free blocks.

        Raises:
            ValueError: no tokens to compute and nothing to adopt (as vLLM).
            RemoteManagerError: the server refused the call or is unreachable.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        request_id = request.request_id
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        table = self._tables.get(request_id)
        if (
            table is not None
            and self._certain_ok
            and not (num_new_computed_tokens or num_external_computed_tokens or num_encoder_tokens)
            and not (full_sequence_must_fit or delay_cache_blocks)
            and (new_computed_blocks is None or not any(new_computed_blocks.blocks))
            and request_id not in self._tables_pending
        ):
            need_slot = min(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
            need = 0
            for ids, bs in zip(table, self._block_sizes):
                n = -(-need_slot // bs) - len(ids)
                if n > 0:
                    need += n
            if need + watermark_blocks + reserved_blocks <= self._free_lower:
                batched = self._batch_ahead(request, table, num_new_tokens, num_lookahead_tokens, need_slot, need)
                if batched is not None:
                    return batched
        self._sync(request)
        call = pb.ManagerCall.AllocateSlots(
            request_id=request_id,
            num_computed_tokens=request.num_computed_tokens,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            watermark_blocks=watermark_blocks,
        )
        if self.max_in_flight_tokens is not None:
            call.max_in_flight_tokens = self.max_in_flight_tokens
        hit = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        hit_ids = [[b.block_id for b in group] for group in hit] if any(hit) else []
        for ids in hit_ids:
            call.computed_block_ids.add(block_ids=ids)
        bounds = self._bounds(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hit_ids,
            num_lookahead_tokens,
            num_external_computed_tokens,
        )
        if bounds is not None:
            need, need_lower, full, full_lower = bounds
            margin = watermark_blocks + reserved_blocks
            fits = need + margin <= self._free_lower and (
                not full_sequence_must_fit or full + watermark_blocks <= self._free_lower
            )
            if fits:
                return self._allocate_ahead(call, request, hit_ids, need, need_lower, skip_zeroing_group_ids)
            if need_lower + margin > self._free_upper or (
                full_sequence_must_fit and full_lower + watermark_blocks > self._free_upper
            ):
                self.num_refused_ahead += 1  # certain: vLLM's manager refuses too, changing nothing
                return None
        answer = self._ask(pb.ManagerCall(allocate_slots=call)).allocated
        if not answer.allocated:
            if not answer.refused_full_sequence and self._windowed and request_id in self._tables:
                # vLLM's manager frees the skipped blocks before it checks; the server's refusal
                # changed nothing, so the same freeing goes as its own call.
                total = min(
                    request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
                    self.max_model_len,
                )
                self.remove_skipped_blocks(request_id, max(0, total - request.num_in_flight_tokens))
            return None
        new_ids = self._apply_allocated(
            request_id,
            answer,
            hit_ids,
            skip_zeroing_group_ids,
            (call.num_computed_tokens + call.num_new_computed_tokens) // self._block_sizes[0],
        )
        table = self._tables.get(request_id, ())
        taken = (  # at most: every block of a new table (hit, external, new), or the new ones
            sum(1 for ids in table for i in ids if i) if answer.block_ids else sum(len(ids) for ids in new_ids)
        )
        self._log_allocation(
            request,
            taken,
            0,
            min(
                request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens,
                request.num_tokens,
            ),
        )
        self._lookups.pop(request_id, None)
        return self._to_blocks(new_ids)

    def _apply_allocated(
        self,
        request_id: str,
        answer: pb.ManagerResult.Allocated,
        hit_ids: Sequence[Sequence[int]],
        skip_zeroing_group_ids: tuple[int, ...],
        first_position: int = 0,
    ) -> list[list[int]]:
        """Bring the request's table up to date with an allocation's answer; its new block ids.
        ``first_position``: on an admission, the first block position the request computes (its
        computed and hit tokens before the call, in blocks)."""
        new_ids = [list(g.block_ids) for g in answer.new_block_ids]
        if answer.block_ids:
            table = [list(g.block_ids) for g in answer.block_ids]
            if self._zeroing:
                hit = {i for ids in hit_ids for i in ids}
                skipped = set(skip_zeroing_group_ids)
                for g, ids in enumerate(table):
                    if g in skipped:
                        self.new_block_ids.extend(new_ids[g])
                    else:
                        self.new_block_ids.extend(i for i in ids if i and i not in hit)
            self._tables[request_id] = table
        else:
            table = self._tables.setdefault(request_id, [[] for _ in range(self.num_kv_cache_groups)])
            for ids, new in zip(table, new_ids):
                # Ids answered ahead were held as None: the answer fills them in.
                num_pending = 0
                while num_pending < len(ids) and ids[len(ids) - 1 - num_pending] is None:
                    num_pending += 1
                if num_pending:
                    assert num_pending == len(new), f"{num_pending} pending ids, {len(new)} answered"
                    ids[len(ids) - num_pending :] = new
                else:
                    ids.extend(new)
            if self._zeroing:
                self.new_block_ids.extend(itertools.chain.from_iterable(new_ids))
        self._apply_null_heads(request_id, answer.num_null_blocks)
        self._cached_tokens[request_id] = answer.num_cached_tokens
        if answer.allocation_id:
            writing = self._writing.get(request_id)
            if writing is None or writing[0] != answer.allocation_id:
                # An admission: the hit's positions are the cache's, not this request's to write.
                self._writing[request_id] = (answer.allocation_id, [first_position])
        return new_ids

    def _bounds(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hit_ids: Sequence[Sequence[int]],
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> tuple[int, int, int, int] | None:
        """Bounds on the free blocks an allocation takes: (most, fewest) for the step, and (most,
        fewest) the full-sequence gate counts; None when they cannot be told here (ask the
        server).

        Bounds, not vLLM's rule (the server applies that): a full-attention group needs the
        blocks beyond its table (or, on admission, beyond the hit) up to the tokens that need a
        slot, plus, at most, the hit's blocks that were free when it was looked up (all of them
        if a call since may have freed one): taking them takes them out of the free queue.
        """
        if not self._certain_ok:
            return None
        request_id = request.request_id
        table = self._tables.get(request_id)
        total = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        need_slot = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if table is not None:
            if hit_ids or num_external_computed_tokens or request_id in self._tables_pending:
                return None
            need = sum(max(0, _cdiv(need_slot, bs) - len(ids)) for ids, bs in zip(table, self._block_sizes))
            return need, need, 0, 0
        lookup = self._lookups.get(request_id)
        free_hit = []
        for g in range(self.num_kv_cache_groups):
            ids = hit_ids[g] if hit_ids else []
            num_real = sum(1 for i in ids if i)
            if (
                lookup is not None
                and lookup.frees_at == self._num_frees
                and lookup.block_ids[g][: len(ids)] == list(ids)
                and g < len(lookup.num_free_hit_blocks)
            ):
                free_hit.append(min(lookup.num_free_hit_blocks[g], num_real))
            else:
                free_hit.append(num_real)
        held = [len(hit_ids[g]) if hit_ids else 0 for g in range(self.num_kv_cache_groups)]
        new = [max(0, _cdiv(need_slot, bs) - h) for bs, h in zip(self._block_sizes, held)]
        full_tokens = min(request.num_tokens, self.max_model_len)
        full_new = [max(0, _cdiv(full_tokens, bs) - h) for bs, h in zip(self._block_sizes, held)]
        most, most_full = sum(new) + sum(free_hit), sum(full_new) + sum(free_hit)
        if (
            lookup is not None
            and lookup.removed_at == self._num_removed
            and lookup.frees_at == self._num_frees
            and lookup.evictions_at == self._num_evictions
            and lookup.block_ids == [list(ids) for ids in hit_ids] + [[]] * (len(lookup.block_ids) - len(hit_ids))
        ):
            # Nothing queued since the lookup could have taken or freed a block: the hit's free
            # blocks are exactly as it counted them, so the bounds meet.
            return most, most, most_full, most_full
        return most, sum(new), most_full, sum(full_new)

    def _batch_ahead(
        self,
        request: Request,
        table: list[list[int]],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        need_slot: int,
        need: int,
    ) -> KVCacheBlocks | None:
        """Answer a running request's allocation certain to succeed, into the open batch (its new
        tokens and hashes with it); None when its tokens or hashes changed otherwise than by
        appending (then the call goes on its own)."""
        request_id = request.request_id
        synced = self._synced.get(request_id)
        if synced is None or synced.request() is not request:
            return None
        tokens = request.all_token_ids
        hashes = request.block_hashes if self.enable_caching else ()
        kept = synced.num_hashes
        if len(tokens) < synced.num_tokens or len(hashes) < kept or (kept and hashes[kept - 1] != synced.last_hash):
            return None
        batch = self._open_batch
        if batch is None:
            batch = _RunningBatch()
            self._queue(batch, functools.partial(self._apply_batch, batch))
            self._open_batch = batch
        num_new_ids = len(tokens) - synced.num_tokens
        batch.request_ids.append(request_id)
        batch.computed.append(request.num_computed_tokens)
        batch.in_flight.append(request.num_in_flight_tokens)
        batch.new.append(num_new_tokens)
        batch.lookahead.append(num_lookahead_tokens)
        batch.token_counts.append(num_new_ids)
        if num_new_ids:
            batch.tokens.append(array.array("i", tokens[synced.num_tokens :]).tobytes())
        num_new_hashes = len(hashes) - kept
        batch.hash_counts.append(num_new_hashes)
        if num_new_hashes:
            batch.hashes.append(b"".join(hashes[kept:]))
            synced.last_hash = hashes[-1]
        synced.num_tokens = len(tokens)
        synced.num_hashes = len(hashes)
        for ids, bs in zip(table, self._block_sizes):
            n = -(-need_slot // bs) - len(ids)
            if n > 0:
                ids.extend([None] * n)  # type: ignore[list-item]  # ids to come with the round trip
        result = _PendingBlocks(self)
        batch.results.append(result)
        batch.needs.append(need)
        self._free_lower -= need
        self._free_upper -= need
        cached_from = self._cached_tokens.get(request_id, 0) // self._block_sizes[0]
        self._log_allocation(
            request, need, cached_from, min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
        )
        self.num_answered_ahead += 1
        return result

    def _apply_batch(self, batch: _RunningBatch, result: pb.ManagerResult) -> None:
        answer = result.allocated_batch
        if answer.refused or answer.num_run != len(batch.request_ids):
            request_id = batch.request_ids[answer.num_run - 1] if answer.num_run else "?"
            raise RemoteManagerError(
                f"kvservice refused allocate_slots of {request_id!r} answered ahead as certain: the server's pool "
                "is not what this scheduler's calls made it"
            )
        num_groups = self.num_kv_cache_groups
        changed = dict(zip(answer.changed_indices, range(len(answer.changed_indices))))
        ids_at = 0
        empty = self.empty_kv_cache_blocks.blocks
        new_ids_flat = answer.new_block_ids
        counts = answer.num_new_block_ids
        heads = answer.num_null_blocks
        for i, request_id in enumerate(batch.request_ids):
            self._cached_tokens[request_id] = answer.num_cached_tokens[i]
            k = changed.get(i)
            if k is None:
                batch.results[i]._blocks = empty
                continue
            groups = []
            for g in range(num_groups):
                n = counts[k * num_groups + g]
                groups.append(list(new_ids_flat[ids_at : ids_at + n]))
                ids_at += n
            table = self._tables.get(request_id)
            if table is not None:
                for ids, new in zip(table, groups):
                    pending = 0
                    while pending < len(ids) and ids[len(ids) - 1 - pending] is None:
                        pending += 1
                    if pending:
                        ids[len(ids) - pending :] = new
                if self._windowed:
                    self._apply_null_heads(request_id, heads[k * num_groups : (k + 1) * num_groups])
            if self._zeroing:
                self.new_block_ids.extend(itertools.chain.from_iterable(groups))
            batch.results[i]._blocks = tuple([self._block(b) for b in ids] for ids in groups)

    def _allocate_ahead(
        self,
        call: pb.ManagerCall.AllocateSlots,
        request: Request,
        hit_ids: Sequence[Sequence[int]],
        need: int,
        need_lower: int,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> KVCacheBlocks:
        """Answer an allocation certain to succeed now; its block ids come with the round trip."""
        request_id = request.request_id
        result = _PendingBlocks(self)
        table = self._tables.get(request_id)
        if table is None:
            self._tables_pending.add(request_id)
        else:
            total_slot = min(
                call.num_computed_tokens + call.num_new_tokens + call.num_lookahead_tokens, self.max_model_len
            )
            for ids, bs in zip(table, self._block_sizes):
                ids.extend([None] * max(0, _cdiv(total_slot, bs) - len(ids)))  # type: ignore[list-item]  # ids to come

        def done(answer: pb.ManagerResult) -> None:
            allocated = answer.allocated
            if not allocated.allocated:
                raise RemoteManagerError(
                    f"kvservice refused allocate_slots of {request_id!r} answered ahead as certain "
                    f"({need} blocks): the server's pool is not what this scheduler's calls made it"
                )
            self._tables_pending.discard(request_id)
            new_ids = self._apply_allocated(
                request_id,
                allocated,
                hit_ids,
                skip_zeroing_group_ids,
                (call.num_computed_tokens + call.num_new_computed_tokens) // self._block_sizes[0],
            )
            result._blocks = tuple([self._block(i) for i in ids] for ids in new_ids)

        self._free_lower -= need
        self._free_upper -= need_lower
        cached = self._cached_tokens.get(request_id, 0) // self._block_sizes[0]
        self._log_allocation(
            request,
            need,
            cached,
            min(
                call.num_computed_tokens
                + call.num_new_computed_tokens
                + call.num_external_computed_tokens
                + call.num_new_tokens,
                request.num_tokens,
            ),
        )
        self._lookups.pop(request_id, None)
        self.num_answered_ahead += 1
        self._queue(pb.ManagerCall(allocate_slots=call), done)
        return result

    def free(self, request: Request) -> None:
        """Free the request's blocks, tail first (queued); a finished request is forgotten, a
        preempted one keeps its tokens on the server."""
        request_id = request.request_id
        if request_id not in self._synced:
            return
        forget = request.is_finished()
        self._note_free(sum(1 for ids in self._tables.get(request_id, ()) for i in ids if i != 0))
        self._queue(pb.ManagerCall(free=pb.ManagerCall.Free(request_id=request_id, forget=forget)))
        if forget:
            self._forget(request_id)
        else:
            self._tables.pop(request_id, None)
            self._cached_tokens.pop(request_id, None)
            self._predicted_cached.pop(request_id, None)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks off its tables without freeing them (queued); the blocks in
        table order, each group's leading null blocks left out. Free them with
        ``block_pool.free_blocks``."""
        request_id = request.request_id
        if request_id not in self._synced:
            return []
        if self._needs_flush(request_id) or self._has_pending_ids(request_id):
            self.flush()
        table = self._tables.get(request_id, [])
        blocks: list[KVCacheBlock] = []
        for ids in table:
            start = 0
            while start < len(ids) and ids[start] == 0:
                start += 1
            blocks.extend(self._block(i) for i in ids[start:])
        forget = request.is_finished()
        self._queue(
            pb.ManagerCall(pop_blocks_for_free=pb.ManagerCall.PopBlocksForFree(request_id=request_id, forget=forget))
        )
        if forget:
            self._forget(request_id)
        else:
            self._tables.pop(request_id, None)
        return blocks

    def _note_free(self, num_blocks: int) -> None:
        """A queued call may free up to ``num_blocks`` blocks (and make a cached one free)."""
        self._num_frees += 1
        self._free_upper += num_blocks

    def _free_popped_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        ids = [b.block_id for b in ordered_blocks if not b.is_null]
        if ids:
            self._note_free(len(ids))
            self._queue(pb.ManagerCall(free_blocks=pb.ManagerCall.FreeBlocks(block_ids=ids)))

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the positions windowed groups no longer need (queued)."""
        if not self._windowed or request_id not in self._synced:
            return
        self._tables_stale.add(request_id)

        def done(result: pb.ManagerResult) -> None:
            self._apply_null_heads(request_id, result.table.num_null_blocks)

        self._queue(
            pb.ManagerCall(
                remove_skipped_blocks=pb.ManagerCall.RemoveSkippedBlocks(
                    request_id=request_id, num_processed_tokens=processed_computed_tokens
                )
            ),
            done,
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_computed_tokens`` tokens (queued)."""
        if not self.enable_caching or request.request_id not in self._tables:
            return
        request_id = request.request_id
        self._sync(request)

        before = self._cached_tokens.pop(request_id, None)
        if before is None:
            before = self._predicted_cached.get(request_id)
        predicted = None
        if before is not None and self._certain_ok and len(set(self._block_sizes)) == 1:
            # vLLM 0.33's estimate_cached_tokens is the request's deepest cached block's
            # block_hash_num_tokens; caching its full hashed blocks up to num_computed_tokens sets it
            # to those blocks' end (single_type_kv_cache_manager.cache_blocks). Checked on the answer.
            bs = self._block_sizes[0]
            predicted = max(before, min(max(0, num_computed_tokens), len(request.block_hashes) * bs) // bs * bs)
            self._predicted_cached[request_id] = predicted
        else:
            self._predicted_cached.pop(request_id, None)

        def done(result: pb.ManagerResult) -> None:
            cached = result.table.num_cached_tokens
            self._cached_tokens[request_id] = cached
            if predicted is not None:
                if self._predicted_cached.get(request_id) == predicted:
                    del self._predicted_cached[request_id]
                if cached != predicted:
                    self.num_cached_estimate_misses += 1
                    logger.warning(
                        "kvservice: request %s has %d cached tokens, %d were estimated before the answer",
                        request_id,
                        cached,
                        predicted,
                    )

        self._log_allocation(request, 0, (before or 0) // self._block_sizes[0], num_computed_tokens)
        self._queue(
            pb.ManagerCall(
                cache_blocks=pb.ManagerCall.CacheBlocks(request_id=request_id, num_tokens=max(0, num_computed_tokens))
            ),
            done,
        )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the cached hashes of these blocks (queued)."""
        ids = sorted(i for i in block_ids if i)
        if ids:
            self._cached_tokens.clear()  # a held block may lose its hash
            self._predicted_cached.clear()
            self._num_evictions += 1
            self._queue(pb.ManagerCall(evict_blocks=pb.ManagerCall.EvictBlocks(block_ids=ids)))

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache unless a block is held."""
        answer = self._ask(pb.ManagerCall(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
        reset = answer.reset_prefix_cache.reset
        if reset:
            self._num_evictions += 1  # every lookup made before is void
        if reset and self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return reset

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM (cascade attention is gone): 0 per group."""
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[Any]:
        """The server's events since the last take (vLLM's event classes; kvservice's presence
        semantics), when vLLM's KV events are on."""
        events, self._events = self._events, []
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table per group (its ids come with the next round trip when an
        allocation answered ahead changed it)."""
        if self._needs_flush(request_id) or self._has_pending_ids(request_id):
            result = _PendingBlocks(self)

            def resolve() -> None:
                table = self._tables.get(request_id)
                result._blocks = (
                    tuple([self._block(i) for i in ids] for ids in table)
                    if table
                    else self.empty_kv_cache_blocks.blocks
                )

            self._queue_after_flush(resolve)
            return result
        table = self._tables.get(request_id)
        return self._to_blocks(table) if table is not None else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (0 = null block)."""
        if self._needs_flush(request_id) or self._has_pending_ids(request_id):
            self.flush()
        table = self._tables.get(request_id)
        if table is None:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(ids) for ids in table)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """Block ids covering the computed tokens (attention groups clipped, as vLLM's)."""
        block_ids = self.get_block_ids(request_id)
        return tuple(
            ids[: _cdiv(num_computed_tokens, bs)] if clipped else ids
            for ids, bs, clipped in zip(block_ids, self._block_sizes, self._clipped)
        )

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request in cached blocks, in every prefix-cacheable group."""
        request_id = request.request_id
        if request_id not in self._synced:
            return 0
        if self._pending:
            predicted = self._predicted_cached.get(request_id)
            if predicted is not None and self._queued_for(request_id) <= {"cache_blocks", "update_request"}:
                # Only this request's caching and token updates are queued: their effect on its cached
                # tokens is known without the round trip (verified when the answer comes).
                return predicted
            self.flush()
        cached = self._cached_tokens.get(request_id)
        if cached is None:
            call = pb.ManagerCall.EstimateCachedTokens(request_id=request_id)
            cached = self._ask(pb.ManagerCall(estimate_cached_tokens=call)).cached_tokens.num_cached_tokens
            self._cached_tokens[request_id] = cached
        return cached

    def _queued_for(self, request_id: str) -> set[str]:
        """The kinds of the queued calls that name ``request_id``."""
        kinds = set()
        for call in self._pending:
            if isinstance(call, _RunningBatch):
                if request_id in call.request_ids:
                    kinds.add("allocate_slots_batch")
                continue
            kind = call.WhichOneof("call")
            if getattr(getattr(call, kind), "request_id", None) == request_id:
                kinds.add(kind)
        return kinds

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Blocks as a result (the shared empty one when there are none)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """A lookup result cut at ``num_computed_tokens`` (pure slicing, as vLLM's)."""
        truncated: list[list[KVCacheBlock]] = []
        for group_blocks, bs, cross in zip(blocks.blocks, self._block_sizes, self._cross, strict=True):
            if cross:
                assert not group_blocks
                truncated.append([])
                continue
            assert num_computed_tokens % bs == 0
            num_blocks = num_computed_tokens // bs
            assert num_blocks <= len(group_blocks)
            truncated.append(list(group_blocks[:num_blocks]))
        return self.create_kv_cache_blocks(tuple(truncated))

    def before_step_output(
        self, requests: Mapping[str, Request], num_scheduled_tokens: Mapping[str, int]
    ) -> list[_StepWrites]:
        """Before vLLM's ``update_from_output`` of a step: per request the step ran whose blocks
        it may complete, what :meth:`after_step_output` needs once vLLM has counted the output
        (the request freed meanwhile included). Empty unless :attr:`mark_blocks_written`.

        Left out: a request gone or finished before its output came back (aborted while the
        forward ran: vLLM does not count its output), and one preempted while the step ran
        (vLLM's stale output: its blocks were freed before the forward finished, so they are
        not its to report; the server would skip them too).
        """
        if not self.mark_blocks_written:
            return []
        steps: list[_StepWrites] = []
        block_size = self._block_sizes[0]
        for request_id in num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.is_finished() or request.num_stale_output_tokens > 0:
                continue
            writing = self._writing.get(request_id)
            table = self._tables.get(request_id)
            if writing is None or table is None:
                continue
            start = writing[1][0]
            stop = request.num_computed_tokens // block_size  # at most: the tokens scheduled so far
            if stop <= start:
                continue
            ids = [table[g][start:stop] if self._clipped[g] else [] for g in range(self.num_kv_cache_groups)]
            steps.append(_StepWrites(request, writing, ids))
        return steps

    def after_step_output(self, steps: Sequence[_StepWrites]) -> None:
        """After vLLM's ``update_from_output``: queue, for the next round trip, the blocks of
        ``steps`` whose every token the step's forward computed (vLLM's ``num_computed_tokens -
        num_in_flight_tokens``: rejected draft tokens rolled back, later in-flight steps left
        out), each once per allocation; the null block and cross-attention groups never."""
        block_size = self._block_sizes[0]
        for step in steps:
            request = step.request
            allocation_id, position = step.writing
            start = position[0]
            num_done = (request.num_computed_tokens - request.num_in_flight_tokens) // block_size - start
            num_done = min(num_done, max((len(ids) for ids in step.block_ids), default=0))
            if num_done <= 0:
                continue
            if any(None in ids[:num_done] for ids in step.block_ids):  # ids not answered yet: next time
                continue
            done = [[i for i in ids[:num_done] if i] for ids in step.block_ids]
            position[0] = start + num_done
            if not any(done):
                continue
            key = (request.request_id, allocation_id)
            queued = self._written.get(key)
            if queued is None:
                self._written[key] = done
            else:
                for q, ids in zip(queued, done):
                    q.extend(ids)

    def take_new_block_ids(self) -> list[int]:
        """Block ids allocated since the last take, for the worker to zero."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's blocks from ``start_token`` on for zeroing again (a failed load)."""
        if not self._zeroing:
            return
        for ids, bs in zip(self.get_block_ids(request_id), self._block_sizes):
            assert start_token % bs == 0
            self.new_block_ids.extend(ids[start_token // bs :])

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        """No copy-on-write copies: kvservice takes no partial-block hits."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """No boundary states: kvservice holds no Mamba groups."""
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """No partial tails: kvservice holds no Mamba groups."""
        return []

    def new_step_starts(self) -> None:
        """Nothing to do at a step's start (a Mamba notion)."""

    # -- what the facades ask -----------------------------------------------------------------

    def _num_free_blocks_now(self) -> int:
        self.flush()
        return self.num_free_blocks

    def _num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, apply_admission_cap: bool
    ) -> int:
        call = pb.ManagerCall.GetNumBlocksToAllocate(
            request_id=request_id,
            num_tokens=num_tokens,
            num_computed_tokens=num_computed_tokens,
            apply_admission_cap=apply_admission_cap,
        )
        if self.max_in_flight_tokens is not None:
            call.max_in_flight_tokens = self.max_in_flight_tokens
        return self._ask(pb.ManagerCall(get_num_blocks_to_allocate=call)).num_blocks.num_blocks

    def close(self) -> None:
        """Send what is queued and end this scheduler's claim on the pool (idempotent)."""
        if self._closed:
            return
        try:
            self.flush(release=True)
        finally:
            self._closed = True


def _status_name(code: int) -> str:
    from kvservice_client import StatusCode

    return StatusCode.of(code).name


def _decode_events(data: bytes) -> list[Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return list(msgspec.msgpack.decode(data, type=KVEventBatch).events)
