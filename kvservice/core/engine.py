"""The scheduler-facing engine: the cache manager plus the table of requests it serves.

A remote scheduler cannot hand the manager its own ``Request`` objects, so the engine keeps them:
``get_computed_blocks`` registers a request (waiting), its first successful ``allocate_slots``
admits it (running), ``free`` forgets it. Every call validates all of its fields before it changes
anything, so a call that raises leaves the cache, the request table and the event queue exactly as
they were. The gRPC servicer is a thin shell over this class (unary calls and ``Step`` ops go
through the same methods).

The engine also records when each request was last called (``get_computed_blocks`` or
``allocate_slots`` that succeeded, unary or inside a ``Step``), so that requests whose scheduler
vanished can be freed by :meth:`KVCacheEngine.free_idle_requests` (the server's reaper calls it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.core.block_pool import KVCacheBlock
from kvservice.core.errors import (
    CapacityExceededError,
    InvalidArgumentError,
    KVServiceDomainError,
    PreconditionFailedError,
    RequestAlreadyExistsError,
    RequestNotFoundError,
)
from kvservice.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvservice.core.kv_cache_spec import max_tokens_in_pool, min_blocks_for_request
from kvservice.core.request import KVCacheReportMode, Request
from kvservice.core.tier import TierStore
from kvservice_client.events import KVEvent
from kvservice_client.hashing import LoRA, MultiModalFeature

__all__ = [
    "AllocateResult",
    "ComputedBlocksResult",
    "DecodeResult",
    "EngineLimits",
    "KVCacheEngine",
    "OwnedAllocateResult",
    "OwnedBatchResult",
    "PoolClaim",
    "Usage",
]

MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class EngineLimits:
    """Bounds checked at the edge.

    Attributes:
        max_request_id_bytes: longest request id, in UTF-8 bytes.
        max_num_requests: registered requests (waiting + running) at once.
        max_string_bytes: longest session id, cache salt, LoRA name/path or multimodal identifier.
        max_waiting_tokens: prompt tokens held by waiting requests (registered by
            GetComputedBlocks, not yet admitted by AllocateSlots) at once; None: no bound. Running
            requests are bounded by the pool; waiting ones only by this (about 46 bytes of server
            memory per token: a Python list of ints).
    """

    max_request_id_bytes: int = 256
    max_num_requests: int = 65536
    max_string_bytes: int = 1024
    max_waiting_tokens: int | None = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ComputedBlocksResult:
    """A prefix-cache lookup.

    Attributes:
        num_computed_tokens: the hit, in tokens.
        block_ids: per group, the hit's block ids (0 = null placeholder).
        num_free_hit_blocks: per group, the hit's blocks that are free (held by no request); empty
            when not counted.
        num_free_blocks_ahead: the hit's first free block's position in the free queue (0 = the
            head), when asked (:meth:`KVCacheEngine.find_cache_hit`); else 0.
    """

    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    num_free_hit_blocks: tuple[int, ...] = ()
    num_free_blocks_ahead: int = 0


@dataclass(frozen=True, slots=True)
class AllocateResult:
    """What one ``allocate_slots`` did.

    Attributes:
        allocated: False when the pool had too few free blocks (no block allocated, no token
            appended, nothing cached or emitted).
        new_block_ids: per group, block ids appended to the request's table.
        num_new_computed_tokens: the prefix-cache hit used on admission, in tokens (else 0).
        computed_block_ids: per group, the hit's block ids on admission (else empty lists).
        num_scheduled_tokens: tokens scheduled this step.
        num_computed_tokens: the request's computed tokens after this step.
        num_tokens: the request's tokens (prompt + appended).
    """

    allocated: bool
    new_block_ids: tuple[list[int], ...]
    num_new_computed_tokens: int
    computed_block_ids: tuple[list[int], ...]
    num_scheduled_tokens: int
    num_computed_tokens: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """What one :meth:`KVCacheEngine.decode` changed (indices are into its ``request_ids``).

    Attributes:
        changed_indices: requests that got new blocks, ascending.
        new_block_ids: per changed request (same order), per group, the block ids appended.
        refused_indices: requests answered ``allocated=False`` (nothing changed for them).
        errors: (index, error) of each item that raised, ascending; nothing changed for them.
    """

    changed_indices: list[int]
    new_block_ids: list[tuple[list[int], ...]]
    refused_indices: list[int]
    errors: list[tuple[int, KVServiceDomainError]]


@dataclass(frozen=True, slots=True)
class OwnedAllocateResult:
    """What one :meth:`KVCacheEngine.allocate_owned` did.

    Attributes:
        allocated: False when the pool had too few free blocks (nothing changed).
        new_block_ids: per group, the block ids appended for the new tokens (vLLM's
            ``allocate_slots`` result).
        block_ids: per group, the request's whole table after an admission (hit, external and
            new blocks; 0 = null); None for a request that already had a table.
        num_null_blocks: per group, the leading null blocks of the table now (positions a sliding
            window or chunked local group no longer keeps); empty when refused.
        refused_full_sequence: a refusal of the full-sequence gate (vLLM checks it before it frees
            skipped blocks); False for one of the step's own blocks.
    """

    allocated: bool
    new_block_ids: tuple[list[int], ...]
    block_ids: tuple[list[int], ...] | None
    num_null_blocks: tuple[int, ...]
    refused_full_sequence: bool = False


@dataclass(frozen=True, slots=True)
class OwnedBatchResult:
    """What one :meth:`KVCacheEngine.allocate_running` did (indices into its ``request_ids``).

    Attributes:
        num_run: requests run: all, unless one was refused (then it is the last run).
        refused: whether the last one run was refused (too few free blocks; nothing changed for it).
        changed_indices: requests that got new blocks, ascending.
        new_block_ids: per changed request (same order), per group, the block ids appended.
        num_null_blocks: per changed request, per group, the table's leading null blocks now.
        num_cached_tokens: per request allocated, its tokens in cached blocks now.
    """

    num_run: int
    refused: bool
    changed_indices: list[int]
    new_block_ids: list[tuple[list[int], ...]]
    num_null_blocks: list[tuple[int, ...]]
    num_cached_tokens: list[int]


@dataclass(frozen=True, slots=True)
class PoolClaim:
    """The scheduler that owns the pool (docs/ARCHITECTURE.md §9).

    Attributes:
        owner: the scheduler's name.
        expires_at: the engine clock's time the claim lapses at unless renewed, in seconds.
    """

    owner: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class Usage:
    """Pool usage and prefix-cache counters (units in the names: blocks, tokens, requests)."""

    usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running_requests: int
    num_waiting_requests: int


class CheckedTokenIds(list[int]):
    """Token ids their maker has checked: every one an ``int`` in ``0 .. MAX_TOKEN_ID``
    (:func:`check_token_ids` takes them as they are). Make with :meth:`of`."""

    __slots__ = ()

    @classmethod
    def of(cls, ints: Iterable[int]) -> CheckedTokenIds | list[int]:
        """``ints`` (every item an ``int``, e.g. an int64 protobuf field's) as checked ids when all
        are in range, else as a plain list (whose check then names the bad id)."""
        ids = cls(ints)
        if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
            return list(ids)
        return ids


def check_token_ids(field: str, token_ids: Sequence[int] | np.ndarray) -> list[int]:
    """The ids as a list, after checking every id is in ``0 .. 2^31 - 1`` (:class:`CheckedTokenIds`
    are taken as they are).

    Raises:
        InvalidArgumentError: an id out of range (the message names it and the field).
    """
    if type(token_ids) is CheckedTokenIds:
        return token_ids
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int32:  # int32 holds no id above MAX_TOKEN_ID
        if len(token_ids) and token_ids.min() < 0:
            raise InvalidArgumentError(field, f"token id {int(token_ids[token_ids < 0][0])} outside 0..{MAX_TOKEN_ID}")
        checked: list[int] = token_ids.tolist()
        return checked
    if len(token_ids) <= 8 and type(token_ids) is not np.ndarray:  # an array's items are numpy scalars
        for t in token_ids:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidArgumentError(field, f"token id {t} outside 0..{MAX_TOKEN_ID}")
        return list(token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = (ids < 0) | (ids > MAX_TOKEN_ID)
    if bad.any():
        raise InvalidArgumentError(field, f"token id {int(ids[bad][0])} outside 0..{MAX_TOKEN_ID}")
    as_list: list[int] = ids.tolist()
    return as_list


def _num_null_head(blocks: Sequence[KVCacheBlock]) -> int:
    """Leading null blocks of a table (positions a windowed group no longer keeps)."""
    n = 0
    for block in blocks:
        if not block.is_null:
            break
        n += 1
    return n


def _check_string(field: str, value: str | None, max_bytes: int, *, allow_empty: bool = True) -> None:
    if value is None:
        return
    if not allow_empty and not value:
        raise InvalidArgumentError(field, "must not be empty")
    if len(value.encode()) > max_bytes:
        raise InvalidArgumentError(field, f"longer than {max_bytes} bytes")


class KVCacheEngine:
    """The manager and its request table.

    Args:
        manager: the cache manager (one pool, one or more groups).
        limits: bounds checked at the edge.
        clock: seconds of a monotonic clock; when a request was last called (default
            ``time.monotonic``; tests inject their own).

    Attributes:
        requests: request id -> request (waiting or running).
        running: ids of admitted requests (holding blocks).
        num_failed_allocations: ``allocate_slots`` calls answered ``allocated=False`` since start.
        num_freed_requests: requests freed (forgotten by ``free``) since start.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        limits: EngineLimits = EngineLimits(),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.clock = clock
        # request id -> clock() at its last successful call, least recently called first.
        self._last_call: OrderedDict[str, float] = OrderedDict()
        self.limits = limits
        self.requests: dict[str, Request] = {}
        self.running: set[str] = set()
        self._num_admissions = 0  # the last allocation id issued (Request.allocation_id)
        self._no_blocks: tuple[list[int], ...] = tuple([] for _ in range(manager.num_groups))
        self._max_tokens_in_pool = max_tokens_in_pool(manager.kv_cache_config)
        self.num_failed_allocations = 0
        self.num_freed_requests = 0
        self.num_waiting_tokens = 0
        """Prompt tokens held by waiting requests (bounded by ``limits.max_waiting_tokens``)."""
        self.num_freed_tokens = 0
        """Tokens of every request freed so far (the server returns heap memory after many)."""
        self.claim: PoolClaim | None = None
        """The scheduler that owns the pool and its requests' token state, if any."""
        self.owned: dict[str, None] = {}
        """Ids of the requests whose scheduler owns their tokens and hashes (:meth:`update_request`),
        in registration order. They live as long as the scheduler's claim; the idle reaper leaves
        them alone."""
        self._detached: dict[int, int] = {}
        """Block id -> references taken off a table by :meth:`pop_blocks_for_free`, not freed yet."""
        self.tier: TierStore | None = None
        """The tier's lookups, puts and leases over this pool (:mod:`kvservice.core.tier`), when the
        server offers them; its leases' holds count in :meth:`check_invariants`."""

    @property
    def max_model_len(self) -> int:
        """The longest request, in tokens."""
        return self.manager.max_model_len

    # -- scheduler calls --------------------------------------------------------------------

    def get_computed_blocks(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        session_id: str | None = None,
        kv_cache_report_mode: str | KVCacheReportMode = KVCacheReportMode.INCREMENTAL,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        block_hashes: list[bytes] | None = None,
    ) -> ComputedBlocksResult:
        """Register the request on first sight (waiting) and look up its prefix-cache hit.

        Repeating the call for a waiting request with the same prompt and options looks up again.
        ``block_hashes``: the prompt's block hashes, computed by ``manager.block_hasher`` over the
        same ids with no extra keys (the server hashes a Step's packed prompts beside the loop:
        ``BlockHasher.hash_packed``); used for a new request without LoRA, salt or multimodal
        features, else ignored and the prompt hashed here.

        Raises:
            InvalidArgumentError: a field out of range (request_id empty or too long; prompt empty,
                longer than max_model_len or than the pool can ever hold, or with an id outside
                0..2^31-1; bad report mode, LoRA, salt, session or multimodal placeholder: empty,
                outside the prompt, or not after the previous one's end).
            RequestAlreadyExistsError: the id is running, or waiting with another prompt/options.
            CapacityExceededError: max_num_requests requests are registered, or registering this
                prompt would put waiting requests above max_waiting_tokens tokens.
        """
        self._check_request_id(request_id)
        n = len(prompt_token_ids)
        if not 1 <= n <= self.max_model_len:
            raise InvalidArgumentError(
                "prompt_token_ids", f"length {n} outside 1..{self.max_model_len} (max_model_len)"
            )
        if n > self._max_tokens_in_pool:
            raise InvalidArgumentError(
                "prompt_token_ids",
                f"length {n} needs at least {min_blocks_for_request(self.manager.kv_cache_config, n)} blocks at once; "
                f"the pool has {self.manager.kv_cache_config.num_blocks - 1} (at most {self._max_tokens_in_pool} tokens)",
            )
        prompt_token_ids = check_token_ids("prompt_token_ids", prompt_token_ids)
        mode = self._check_request_options(n, session_id, kv_cache_report_mode, lora, cache_salt, mm_features)

        request = self.requests.get(request_id)
        if request is not None:
            if request_id in self.running:
                raise RequestAlreadyExistsError(f"request_id {request_id!r} is already running")
            same = (
                request.prompt_token_ids == prompt_token_ids
                and request.session_id == session_id
                and request.kv_cache_report_mode is mode
                and request.lora == lora
                and request.cache_salt == cache_salt
                and request.mm_features == tuple(mm_features)
            )
            if not same:
                raise RequestAlreadyExistsError(
                    f"request_id {request_id!r} is already registered with another prompt or options"
                )
        else:
            if len(self.requests) >= self.limits.max_num_requests:
                raise CapacityExceededError(
                    f"max_num_requests: {self.limits.max_num_requests} requests are registered; free some first"
                )
            max_waiting = self.limits.max_waiting_tokens
            if max_waiting is not None and self.num_waiting_tokens + n > max_waiting:
                raise CapacityExceededError(
                    f"max_waiting_tokens: waiting requests hold {self.num_waiting_tokens} prompt tokens; {n} more would "
                    f"be above {max_waiting}: admit (AllocateSlots) or free waiting requests first"
                )
            if lora is not None or cache_salt or mm_features:
                block_hashes = None  # extra keys: only the rule's own pass covers them
            request = self.manager.new_request(
                request_id,
                prompt_token_ids,
                session_id=session_id,
                kv_cache_report_mode=mode,
                lora=lora,
                cache_salt=cache_salt,
                mm_features=mm_features,
                block_hashes=block_hashes,
            )
            self.requests[request_id] = request
            self.num_waiting_tokens += request.num_prompt_tokens
        self._touch(request_id)
        blocks, num_computed_tokens = self.manager.get_computed_blocks(request)
        return ComputedBlocksResult(num_computed_tokens, blocks.get_block_ids())

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Sequence[int] = (),
    ) -> AllocateResult:
        """Append ``new_token_ids``, then allocate slots for up to ``num_new_tokens`` tokens.

        On admission (the request's first successful call) the prefix-cache hit is looked up
        again and used as it is now (it may have shrunk since GetComputedBlocks). The tokens
        scheduled are ``min(num_new_tokens, tokens not yet computed)``; on success the request's
        ``num_computed_tokens`` advances by them (the caller runs them this step).

        Raises:
            InvalidArgumentError: num_new_tokens outside 1..max_model_len, num_lookahead_tokens
                above max_model_len, a new token id outside 0..2^31-1, the request would exceed
                max_model_len, or it has no uncomputed token to schedule.
            RequestNotFoundError: unknown request id.
        """
        request = self.requests.get(request_id)
        if request is None:
            self._check_request_id(request_id)
            raise RequestNotFoundError(request_id)
        max_len = self.max_model_len
        if not 1 <= num_new_tokens <= max_len:
            raise InvalidArgumentError("num_new_tokens", f"{num_new_tokens} outside 1..{max_len} (max_model_len)")
        if not 0 <= num_lookahead_tokens <= max_len:
            raise InvalidArgumentError("num_lookahead_tokens", f"{num_lookahead_tokens} outside 0..{max_len}")
        new_token_ids = check_token_ids("new_token_ids", new_token_ids)
        num_tokens_before = request.num_tokens
        num_tokens = num_tokens_before + len(new_token_ids)
        if num_tokens > max_len:
            raise InvalidArgumentError(
                "new_token_ids", f"request would hold {num_tokens} tokens, above max_model_len {max_len}"
            )
        admitted = request_id in self.running
        if admitted and num_tokens == request.num_computed_tokens:
            raise InvalidArgumentError(
                "num_new_tokens",
                f"all {num_tokens} tokens of {request_id!r} are computed; append new_token_ids first",
            )
        if new_token_ids:
            request.append_output_token_ids(new_token_ids)
        manager = self.manager
        if admitted:
            hit_tokens, hit_blocks = 0, None
            computed_block_ids = self._no_blocks
            num_scheduled = min(num_new_tokens, num_tokens - request.num_computed_tokens)
        else:
            hit_blocks, hit_tokens = manager.find_longest_cache_hit(request)
            computed_block_ids = hit_blocks.get_block_ids()
            num_scheduled = min(num_new_tokens, num_tokens - hit_tokens)
        self._touch(request_id)
        new_blocks = manager.allocate_slots(request, num_scheduled, hit_tokens, hit_blocks, num_lookahead_tokens)
        if new_blocks is None:
            request.truncate_tokens(num_tokens_before)
            self.num_failed_allocations += 1
            return AllocateResult(
                False, self._no_blocks, 0, self._no_blocks, 0, request.num_computed_tokens, request.num_tokens
            )
        request.num_computed_tokens += hit_tokens + num_scheduled
        if not admitted:
            self.num_waiting_tokens -= request.num_prompt_tokens
            self._admit(request)
        self.running.add(request_id)
        return AllocateResult(
            True,
            new_blocks.get_block_ids(),
            hit_tokens,
            computed_block_ids,
            num_scheduled,
            request.num_computed_tokens,
            num_tokens,
        )

    def decode(
        self,
        request_ids: Sequence[str],
        new_token_ids: Sequence[int],
        *,
        num_new_token_ids: Sequence[int] = (),
        num_new_tokens: Sequence[int] = (),
        num_lookahead_tokens: Sequence[int] = (),
    ) -> DecodeResult:
        """A decode step of many running requests: for each ``i`` in order, exactly
        ``allocate_slots(request_ids[i], num_new_tokens[i], num_lookahead_tokens=...,
        new_token_ids=<request i's slice>)``, answering only what changed.

        Args:
            request_ids: running requests, in the order they run.
            new_token_ids: tokens appended, request after request (request ``i`` owns the next
                ``num_new_token_ids[i]``).
            num_new_token_ids: tokens each request appends; empty = 1 each.
            num_new_tokens: most tokens each computes this step; empty = its appended count.
            num_lookahead_tokens: extra slots per request, in tokens; empty = 0 each.

        An item fails alone (its error is in ``errors``; nothing changed for it), as a Step op
        does: an unknown id (RequestNotFoundError), a request that is not running (not admitted:
        InvalidArgumentError naming ``request_ids``), or any error ``allocate_slots`` raises.

        Raises:
            InvalidArgumentError: the lists do not fit together (a per-request list whose length
                is not ``len(request_ids)``, or counts that do not add up to
                ``len(new_token_ids)``); then nothing ran.
        """
        num_requests = len(request_ids)
        for field, values in (
            ("num_new_token_ids", num_new_token_ids),
            ("num_new_tokens", num_new_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
        ):
            if len(values) and len(values) != num_requests:
                raise InvalidArgumentError(
                    field, f"{len(values)} entries for {num_requests} request_ids (give one each or none)"
                )
        if len(num_new_token_ids):
            counts = list(num_new_token_ids)
            total = sum(counts)
        else:
            counts = None
            total = num_requests
        if total != len(new_token_ids):
            raise InvalidArgumentError(
                "new_token_ids", f"{len(new_token_ids)} ids, but num_new_token_ids adds up to {total}"
            )
        tokens = list(new_token_ids)
        # One range check for every id (a C-level min and max); only when one is out of range does
        # each item check its own (so that item alone fails, with allocate_slots' message).
        tokens_ok = not tokens or (min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID)
        num_new = list(num_new_tokens) if len(num_new_tokens) else None
        lookahead = list(num_lookahead_tokens) if len(num_lookahead_tokens) else None
        requests, running = self.requests, self.running
        manager = self.manager
        max_len = self.max_model_len
        last_call, now = self._last_call, self.clock()  # one step: every request's last call is now
        changed: list[int] = []
        changed_ids: list[tuple[list[int], ...]] = []
        refused: list[int] = []
        errors: list[tuple[int, KVServiceDomainError]] = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            if counts is None:
                item_tokens = tokens[i : i + 1]
            else:
                item_tokens = tokens[offset : offset + counts[i]]
                offset += counts[i]
            try:
                if request_id not in running:
                    if request_id not in requests:
                        self._check_request_id(request_id)
                        raise RequestNotFoundError(request_id)
                    raise InvalidArgumentError(
                        "request_ids",
                        f"request {request_id!r} is not running: admit it with allocate_slots first",
                    )
                # allocate_slots of a running request, its checks in the same order and words.
                n = num_new[i] if num_new is not None else len(item_tokens)
                if not 1 <= n <= max_len:
                    raise InvalidArgumentError("num_new_tokens", f"{n} outside 1..{max_len} (max_model_len)")
                la = lookahead[i] if lookahead is not None else 0
                if not 0 <= la <= max_len:
                    raise InvalidArgumentError("num_lookahead_tokens", f"{la} outside 0..{max_len}")
                if not tokens_ok:
                    check_token_ids("new_token_ids", item_tokens)
                request = requests[request_id]
                num_tokens_before = len(request.all_token_ids)
                num_tokens = num_tokens_before + len(item_tokens)
                if num_tokens > max_len:
                    raise InvalidArgumentError(
                        "new_token_ids", f"request would hold {num_tokens} tokens, above max_model_len {max_len}"
                    )
                if num_tokens == request.num_computed_tokens:
                    raise InvalidArgumentError(
                        "num_new_tokens",
                        f"all {num_tokens} tokens of {request_id!r} are computed; append new_token_ids first",
                    )
            except KVServiceDomainError as exc:
                errors.append((i, exc))
                continue
            if item_tokens:
                request.append_output_token_ids(item_tokens)
            num_scheduled = min(n, num_tokens - request.num_computed_tokens)
            last_call[request_id] = now
            last_call.move_to_end(request_id)
            new_blocks = manager.allocate_slots(request, num_scheduled, 0, None, la)
            if new_blocks is None:
                request.truncate_tokens(num_tokens_before)
                self.num_failed_allocations += 1
                refused.append(i)
                continue
            request.num_computed_tokens += num_scheduled
            if any(new_blocks.blocks):
                changed.append(i)
                changed_ids.append(new_blocks.get_block_ids())
        return DecodeResult(changed, changed_ids, refused, errors)

    def free(self, request_id: str) -> int:
        """Free the request's blocks (tail first) and forget it.

        Returns:
            Blocks whose ref count dropped.

        Raises:
            RequestNotFoundError: unknown request id.
            InvalidArgumentError: malformed request id.
        """
        self._check_request_id(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            raise RequestNotFoundError(request_id)
        if request_id in self.running:
            self.running.discard(request_id)
        else:
            self.num_waiting_tokens -= request.num_prompt_tokens
        self.num_freed_tokens += request.num_tokens
        self._last_call.pop(request_id, None)
        self.owned.pop(request_id, None)
        self.num_freed_requests += 1
        return self.manager.free(request_id)

    # -- requests whose scheduler owns their token state (vLLM's) -----------------------------
    #
    # vLLM's scheduler keeps each request's tokens, block hashes and counts itself and asks its
    # KV cache manager for blocks only. These calls mirror that manager (vLLM 0.33's
    # ``KVCacheManager``): the caller says the counts and hashes, the engine answers with blocks.
    # The rules and the one-scheduler claim: docs/ARCHITECTURE.md §9.

    def claim_pool(self, owner: str, ttl_s: float) -> None:
        """Claim the pool for ``owner``, or renew its claim, for ``ttl_s`` seconds.

        A claim held by another owner that has lapsed is released first (its requests freed, as
        :meth:`release_claim`).

        Raises:
            InvalidArgumentError: ``owner`` empty or longer than max_request_id_bytes, or ``ttl_s``
                outside 0 < ttl_s <= 3600.
            PreconditionFailedError: another owner's claim is live (the message names it).
        """
        if not owner:
            raise InvalidArgumentError("owner", "must not be empty")
        if len(owner.encode()) > self.limits.max_request_id_bytes:
            raise InvalidArgumentError("owner", f"longer than {self.limits.max_request_id_bytes} bytes")
        if not 0 < ttl_s <= 3600:
            raise InvalidArgumentError("claim_ttl_s", f"{ttl_s} outside 0 < ttl <= 3600 seconds")
        now = self.clock()
        claim = self.claim
        if claim is not None and claim.owner != owner:
            if claim.expires_at > now:
                raise PreconditionFailedError(
                    f"owner: the pool is owned by scheduler {claim.owner!r} (its claim lapses in "
                    f"{claim.expires_at - now:.1f} s unless renewed); one scheduler owns a pool at a time"
                )
            self.release_claim(claim.owner)
        self.claim = PoolClaim(owner, now + ttl_s)

    def check_claim(self, owner: str | None) -> None:
        """Refuse a mutating call of a caller other than the pool's live owner.

        Raises:
            PreconditionFailedError: a live claim is held by someone else than ``owner``.
        """
        claim = self.claim
        if claim is not None and claim.owner != owner and claim.expires_at > self.clock():
            raise PreconditionFailedError(
                f"owner: the pool is owned by scheduler {claim.owner!r}; its requests and blocks are its own"
            )

    def release_claim(self, owner: str) -> list[str]:
        """End ``owner``'s claim: free and forget every request whose tokens a scheduler owns, and
        every block it took off a table and did not free. Nothing happens for another owner.

        Returns:
            The ids freed, in the order freed.
        """
        claim = self.claim
        if claim is None or claim.owner != owner:
            return []
        self.claim = None
        freed = list(self.owned)
        for request_id in freed:
            self.free(request_id)
        # The popped blocks, deepest first as a request's are freed (docs/ARCHITECTURE.md §2.3): each
        # pop added its blocks in table order.
        pool = self.manager.block_pool
        detached = self._detached
        pool.free_blocks([pool.blocks[block_id] for block_id in reversed(detached) for _ in range(detached[block_id])])
        detached.clear()
        return freed

    def expire_claim(self) -> list[str]:
        """Release a lapsed claim (the reaper's call); the ids freed."""
        claim = self.claim
        if claim is None or claim.expires_at > self.clock():
            return []
        return self.release_claim(claim.owner)

    def update_request(
        self,
        request_id: str,
        *,
        num_tokens_kept: int,
        token_ids: Sequence[int] | np.ndarray,
        num_block_hashes_kept: int,
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int = 0,
        session_id: str | None = None,
        kv_cache_report_mode: str | KVCacheReportMode = KVCacheReportMode.INCREMENTAL,
        lora: LoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> None:
        """Register a request whose scheduler owns its tokens and hashes (waiting, no blocks), or
        bring the engine's copy up to date: keep the first ``num_tokens_kept`` tokens and
        ``num_block_hashes_kept`` hashes, append ``token_ids`` and ``block_hashes``.

        The hashes are the scheduler's (vLLM hashes its requests itself): one per full block of
        ``manager.hash_block_size`` tokens, each a digest of the manager's hash algorithm; the
        engine never recomputes them, and events carry them. The options (session, report mode,
        LoRA, salt, multimodal placeholders) go on events only; they are set at registration.

        Raises:
            InvalidArgumentError: a field out of range (request id; a token id outside 0..2^31-1;
                more than max_model_len tokens; a kept count above what the engine holds, or one
                that cuts into cached blocks or the prompt; a digest of the wrong size; more hashes
                than full blocks; num_prompt_tokens outside 1..tokens at registration; a bad
                option, as :meth:`get_computed_blocks`).
            RequestNotFoundError: kept counts above 0 for an id the engine does not hold (it
                restarted or freed it: send the request whole again).
            RequestAlreadyExistsError: the id was registered by ``get_computed_blocks`` (its
                tokens are the engine's).
            CapacityExceededError: max_num_requests, or max_waiting_tokens, as
                :meth:`get_computed_blocks`.
        """
        self._check_request_id(request_id)
        token_ids = check_token_ids("token_ids", token_ids)
        request = self.requests.get(request_id)
        hash_size = self.manager.hash_digest_size
        for i, digest in enumerate(block_hashes):
            if len(digest) != hash_size:
                raise InvalidArgumentError(
                    "block_hashes", f"hash {i} is {len(digest)} bytes; the hash algorithm's digests are {hash_size}"
                )
        manager = self.manager
        hash_block_size = manager.hash_block_size
        if request is None:
            if num_tokens_kept or num_block_hashes_kept:
                raise RequestNotFoundError(request_id)
            num_tokens = len(token_ids)
            num_hashes = len(block_hashes)
            if not 1 <= num_prompt_tokens <= num_tokens:
                raise InvalidArgumentError(
                    "num_prompt_tokens", f"{num_prompt_tokens} outside 1..{num_tokens} (the tokens sent)"
                )
        else:
            if request_id not in self.owned:
                raise RequestAlreadyExistsError(
                    f"request_id {request_id!r} was registered by GetComputedBlocks: its tokens are the server's"
                )
            if num_tokens_kept > request.num_tokens or num_block_hashes_kept > len(request.block_hashes):
                raise InvalidArgumentError(
                    "num_tokens_kept",
                    f"keeps {num_tokens_kept} tokens and {num_block_hashes_kept} hashes of {request_id!r}; the server "
                    f"holds {request.num_tokens} and {len(request.block_hashes)}",
                )
            num_cached_tokens = max(
                (m.num_cached_block.get(request_id, 0) * m.block_size for m in manager.coordinator.managers), default=0
            )
            if num_block_hashes_kept * hash_block_size < num_cached_tokens or num_tokens_kept < num_cached_tokens:
                raise InvalidArgumentError(
                    "num_block_hashes_kept",
                    f"keeps {num_block_hashes_kept} hashes and {num_tokens_kept} tokens; {request_id!r} has "
                    f"{num_cached_tokens} tokens in cached blocks, whose hashes and tokens cannot change",
                )
            if 0 < num_tokens_kept < request.num_prompt_tokens:
                raise InvalidArgumentError(
                    "num_tokens_kept",
                    f"{num_tokens_kept} cuts into the prompt of {request_id!r} ({request.num_prompt_tokens} tokens): "
                    "keep the prompt, or send the request whole (num_tokens_kept 0)",
                )
            num_tokens = num_tokens_kept + len(token_ids)
            num_hashes = num_block_hashes_kept + len(block_hashes)
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                "token_ids", f"request would hold {num_tokens} tokens, above max_model_len {self.max_model_len}"
            )
        if num_hashes > num_tokens // hash_block_size:
            raise InvalidArgumentError(
                "block_hashes",
                f"{num_hashes} hashes for {num_tokens} tokens: at most one per full block of {hash_block_size} tokens",
            )
        if request is None:
            mode = self._check_request_options(
                num_prompt_tokens, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
            )
            if len(self.requests) >= self.limits.max_num_requests:
                raise CapacityExceededError(
                    f"max_num_requests: {self.limits.max_num_requests} requests are registered; free some first"
                )
            max_waiting = self.limits.max_waiting_tokens
            if max_waiting is not None and self.num_waiting_tokens + num_prompt_tokens > max_waiting:
                raise CapacityExceededError(
                    f"max_waiting_tokens: waiting requests hold {self.num_waiting_tokens} prompt tokens; "
                    f"{num_prompt_tokens} more would be above {max_waiting}: admit or free waiting requests first"
                )
            request = Request(
                request_id,
                (),
                block_hasher=None,
                lora=lora,
                cache_salt=cache_salt,
                mm_features=mm_features,
                session_id=session_id,
                kv_cache_report_mode=mode,
            )
            request.replace_tail(0, token_ids, 0, block_hashes)
            request.num_prompt_tokens = num_prompt_tokens
            self.requests[request_id] = request
            self.owned[request_id] = None
            self.num_waiting_tokens += num_prompt_tokens
        else:
            if num_tokens_kept == 0 and num_prompt_tokens:
                # Sent whole again (a new request under an id in use): its prompt may differ too.
                if request_id in self.running:
                    raise InvalidArgumentError(
                        "num_tokens_kept", f"0 for {request_id!r}, which holds blocks: its prompt cannot be replaced"
                    )
                if not 1 <= num_prompt_tokens <= num_tokens:
                    raise InvalidArgumentError(
                        "num_prompt_tokens", f"{num_prompt_tokens} outside 1..{num_tokens} (the tokens sent)"
                    )
                self.num_waiting_tokens += num_prompt_tokens - request.num_prompt_tokens
                request.num_prompt_tokens = num_prompt_tokens
            request.replace_tail(num_tokens_kept, token_ids, num_block_hashes_kept, block_hashes)
        self._touch(request_id)

    def find_cache_hit(
        self, request_id: str, max_cache_hit_length: int | None = None, *, free_queue_horizon: int = 0
    ) -> ComputedBlocksResult:
        """The prefix-cache hit of a waiting scheduler-owned request, by its own hashes (vLLM 0.33:
        ``get_computed_blocks``). Changes nothing: the server's prefix-cache counters count the
        admission that takes a hit (:meth:`allocate_owned`), as vLLM records its stats.

        Args:
            request_id: the request (registered by :meth:`update_request`, not running).
            max_cache_hit_length: the longest hit, in tokens (default ``num_tokens - 1``: the
                last token is always computed).
            free_queue_horizon: also find how deep in the free queue the hit's first free block
                is, looking at most this many blocks deep (0: do not look).

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: the request is running or not scheduler-owned,
                max_cache_hit_length outside 0..num_tokens, or free_queue_horizon above the pool.
        """
        request = self._owned_request(request_id)
        if request_id in self.running:
            raise InvalidArgumentError(
                "request_id", f"request {request_id!r} holds blocks; look up waiting requests only"
            )
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        if not 0 <= limit <= request.num_tokens:
            raise InvalidArgumentError(
                "max_cache_hit_length", f"{max_cache_hit_length} outside 0..{request.num_tokens} (the request's tokens)"
            )
        num_pool_blocks = self.manager.kv_cache_config.num_blocks
        if not 0 <= free_queue_horizon <= num_pool_blocks:
            raise InvalidArgumentError(
                "free_queue_horizon", f"{free_queue_horizon} outside 0..{num_pool_blocks} (the pool's blocks)"
            )
        manager = self.manager
        if not manager.enable_caching or limit <= 0:
            return ComputedBlocksResult(0, self._no_blocks, (), free_queue_horizon)
        blocks, num_tokens = manager.coordinator.find_longest_cache_hit(request, limit)
        free = {b.block_id for group in blocks for b in group if b.ref_cnt == 0 and not b.is_null}
        ahead = free_queue_horizon
        if free and free_queue_horizon:
            block = manager.block_pool.free_block_queue.fake_head.next_free_block
            for position in range(free_queue_horizon):
                if block is None or block.block_id < 0:
                    break
                if block.block_id in free:
                    ahead = position
                    break
                block = block.next_free_block
        return ComputedBlocksResult(
            num_tokens,
            tuple([b.block_id for b in group] for group in blocks),
            tuple(sum(1 for b in group if b.ref_cnt == 0 and not b.is_null) for group in blocks),
            ahead,
        )

    def allocate_owned(
        self,
        request_id: str,
        *,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_in_flight_tokens: int = 0,
        num_new_computed_tokens: int = 0,
        computed_block_ids: Sequence[Sequence[int]] = (),
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        max_in_flight_tokens: int | None = None,
        reserved_blocks: int = 0,
        watermark_blocks: int = 0,
    ) -> OwnedAllocateResult:
        """vLLM 0.33's ``allocate_slots`` for a scheduler-owned request, at the caller's counts
        (arguments as :meth:`KVCacheManager.allocate_slots`; ``num_computed_tokens`` and
        ``num_in_flight_tokens`` are the scheduler's ``request.num_computed_tokens`` and
        ``request.num_in_flight_tokens``; ``computed_block_ids`` the hit's ids per group).

        The hit must be blocks the cache holds now, each at a position whose hash it carries in its
        group (0 only where a windowed group skips): else FAILED_PRECONDITION, nothing changed
        (the caller's view of the cache is stale). A refusal (too few free blocks) changes nothing.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: a count outside its bound (each naming the field: negative, above
                max_model_len, in flight above computed, the block counts above the pool), a hit or
                external tokens for a request that has a table, a hit whose length is not the
                groups' blocks, or no tokens to compute or adopt.
            PreconditionFailedError: the hit names a block that does not hold it now.
        """
        request = self._owned_request(request_id)
        max_len = self.max_model_len
        for field, value in (
            ("num_computed_tokens", num_computed_tokens),
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_encoder_tokens", num_encoder_tokens),
        ):
            if not 0 <= value <= max_len:
                raise InvalidArgumentError(field, f"{value} outside 0..{max_len} (max_model_len)")
        if not 0 <= num_in_flight_tokens <= num_computed_tokens:
            raise InvalidArgumentError(
                "num_in_flight_tokens", f"{num_in_flight_tokens} outside 0..{num_computed_tokens} (num_computed_tokens)"
            )
        num_pool_blocks = self.manager.kv_cache_config.num_blocks
        for field, value in (("reserved_blocks", reserved_blocks), ("watermark_blocks", watermark_blocks)):
            if not 0 <= value <= num_pool_blocks:
                raise InvalidArgumentError(field, f"{value} outside 0..{num_pool_blocks} (the pool's blocks)")
        if max_in_flight_tokens is not None and not 1 <= max_in_flight_tokens <= 1 << 32:
            raise InvalidArgumentError("max_in_flight_tokens", f"{max_in_flight_tokens} outside 1..2^32")
        if not num_new_tokens and not num_new_computed_tokens and not num_external_computed_tokens:
            raise InvalidArgumentError(
                "num_new_tokens", "0, with no hit and no external tokens to adopt: nothing to allocate for"
            )
        manager = self.manager
        coordinator = manager.coordinator
        has_table = request_id in coordinator.managers[0].req_to_blocks
        hit = self._resolve_hit(request, num_new_computed_tokens, computed_block_ids, has_table)
        if has_table and num_external_computed_tokens:
            raise InvalidArgumentError(
                "num_external_computed_tokens",
                f"request {request_id!r} holds blocks; external tokens come on admission",
            )
        before = request.num_computed_tokens, request.num_in_flight_tokens
        request.num_computed_tokens = num_computed_tokens
        request.num_in_flight_tokens = num_in_flight_tokens
        self._touch(request_id)
        new_blocks = manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hit,
            num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            max_in_flight_tokens=max_in_flight_tokens,
            reserved_blocks=reserved_blocks,
            watermark_blocks=watermark_blocks,
        )
        if new_blocks is None:
            request.num_computed_tokens, request.num_in_flight_tokens = before
            self.num_failed_allocations += 1
            return OwnedAllocateResult(False, self._no_blocks, None, (), manager.last_refusal_full_sequence)
        if request_id not in self.running:
            self.running.add(request_id)
            self._admit(request)
            self.num_waiting_tokens -= request.num_prompt_tokens
            if manager.enable_caching:  # counted at admission, as vLLM records its stats
                stats = manager.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
        tables = coordinator.get_blocks(request_id)
        return OwnedAllocateResult(
            True,
            new_blocks.get_block_ids(),
            None if has_table else tuple([b.block_id for b in table] for table in tables),
            tuple(_num_null_head(table) for table in tables),
        )

    def allocate_running(
        self,
        request_ids: Sequence[str],
        *,
        num_computed_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        num_in_flight_tokens: Sequence[int] = (),
        num_lookahead_tokens: Sequence[int] = (),
        num_new_token_ids: Sequence[int] = (),
        token_ids: Sequence[int] | np.ndarray = (),
        num_new_block_hashes: Sequence[int] = (),
        block_hashes: Sequence[bytes] = (),
    ) -> OwnedBatchResult:
        """Many running scheduler-owned requests' ``allocate_slots`` (vLLM 0.33), as
        :meth:`update_request` (appending ``num_new_token_ids[i]`` tokens and
        ``num_new_block_hashes[i]`` hashes) then :meth:`allocate_owned` of each would run, request
        after request (a scheduler step's running requests, packed). A per-request list left empty
        is 0 for every request. The first request refused (too few free blocks) ends the batch;
        the ones before it stay allocated, as their own calls would have been.

        Raises:
            InvalidArgumentError: lists of other lengths, counts that do not add up, a request
                twice, a request holding no blocks, a count outside its bound (as
                :meth:`allocate_owned`), a token id outside 0..2^31-1, a request above max_model_len
                or with more hashes than full blocks. Checked for every request before any runs:
                then nothing changed.
            RequestNotFoundError: an unknown id (nothing changed).
        """
        num = len(request_ids)
        max_len = self.max_model_len

        def per_request(field: str, values: Sequence[int], low: int, high: int) -> list[int]:
            if not len(values):
                if low > 0:
                    raise InvalidArgumentError(field, f"empty; one per request is needed (>= {low})")
                return [0] * num
            if len(values) != num:
                raise InvalidArgumentError(field, f"{len(values)} entries for {num} request_ids (one each, or none)")
            out = list(values)
            if min(out) < low or max(out) > high:
                bad = next(v for v in out if not low <= v <= high)
                raise InvalidArgumentError(field, f"{bad} outside {low}..{high}")
            return out

        computed = per_request("num_computed_tokens", num_computed_tokens, 0, max_len)
        new = per_request("num_new_tokens", num_new_tokens, 1, max_len)
        in_flight = per_request("num_in_flight_tokens", num_in_flight_tokens, 0, max_len)
        lookahead = per_request("num_lookahead_tokens", num_lookahead_tokens, 0, max_len)
        token_counts = per_request("num_new_token_ids", num_new_token_ids, 0, max_len)
        hash_counts = per_request("num_new_block_hashes", num_new_block_hashes, 0, max_len)
        if sum(token_counts) != len(token_ids):
            raise InvalidArgumentError(
                "packed_token_ids", f"{len(token_ids)} ids, but num_new_token_ids adds up to {sum(token_counts)}"
            )
        if sum(hash_counts) != len(block_hashes):
            raise InvalidArgumentError(
                "block_hashes", f"{len(block_hashes)} hashes, but num_new_block_hashes adds up to {sum(hash_counts)}"
            )
        tokens = check_token_ids("packed_token_ids", token_ids)
        if len(set(request_ids)) != num:
            raise InvalidArgumentError("request_ids", "a request is named twice")
        hash_size = self.manager.hash_digest_size
        for digest in block_hashes:
            if len(digest) != hash_size:
                raise InvalidArgumentError(
                    "block_hashes", f"a hash of {len(digest)} bytes; the hash algorithm's digests are {hash_size}"
                )
        hash_block_size = self.manager.hash_block_size
        requests = []
        for i, request_id in enumerate(request_ids):
            request = self._owned_request(request_id)
            if request_id not in self.running:
                raise InvalidArgumentError(
                    "request_ids", f"request {request_id!r} holds no blocks: allocate it with AllocateSlots first"
                )
            if in_flight[i] > computed[i]:
                raise InvalidArgumentError(
                    "num_in_flight_tokens", f"{in_flight[i]} above num_computed_tokens {computed[i]} of {request_id!r}"
                )
            num_tokens = request.num_tokens + token_counts[i]
            if num_tokens > max_len:
                raise InvalidArgumentError(
                    "packed_token_ids", f"{request_id!r} would hold {num_tokens} tokens, above max_model_len {max_len}"
                )
            if len(request.block_hashes) + hash_counts[i] > num_tokens // hash_block_size:
                raise InvalidArgumentError(
                    "block_hashes", f"{request_id!r}: more hashes than full blocks of {hash_block_size} tokens"
                )
            requests.append(request)
        manager = self.manager
        coordinator = manager.coordinator
        changed: list[int] = []
        changed_ids: list[tuple[list[int], ...]] = []
        null_heads: list[tuple[int, ...]] = []
        cached: list[int] = []
        windowed = manager._has_skip_rule
        token_at = hash_at = 0
        for i, request in enumerate(requests):
            k = token_counts[i]
            if k:
                request.all_token_ids.extend(tokens[token_at : token_at + k])
                token_at += k
            h = hash_counts[i]
            if h:
                request.block_hashes.extend(block_hashes[hash_at : hash_at + h])
                hash_at += h
            before = request.num_computed_tokens, request.num_in_flight_tokens
            request.num_computed_tokens = computed[i]
            request.num_in_flight_tokens = in_flight[i]
            new_blocks = manager.allocate_slots(request, new[i], 0, None, lookahead[i])
            if new_blocks is None:
                request.num_computed_tokens, request.num_in_flight_tokens = before
                self.num_failed_allocations += 1
                return OwnedBatchResult(i + 1, True, changed, changed_ids, null_heads, cached)
            if any(new_blocks.blocks) or windowed:
                changed.append(i)
                changed_ids.append(new_blocks.get_block_ids())
                null_heads.append(
                    tuple(_num_null_head(t) for t in coordinator.get_blocks(request.request_id))
                    if windowed
                    else tuple(0 for _ in new_blocks.blocks)
                )
            cached.append(manager.estimate_cached_tokens(request.request_id))
        return OwnedBatchResult(num, False, changed, changed_ids, null_heads, cached)

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens (vLLM 0.33:
        ``cache_blocks``; after an asynchronous KV load completes, or a resumed request).

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: not scheduler-owned, ``num_tokens`` negative, or the request holds no
                blocks.
        """
        request = self._owned_request(request_id)
        if num_tokens < 0:
            raise InvalidArgumentError("num_tokens", f"{num_tokens} is negative")
        if request_id not in self.running:
            raise InvalidArgumentError("request_id", f"request {request_id!r} holds no blocks")
        self._touch(request_id)
        self.manager.cache_blocks(request, min(num_tokens, request.num_tokens))

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> tuple[int, ...]:
        """Free the blocks of positions the request's windowed groups no longer need once
        ``num_processed_tokens`` tokens are processed (vLLM 0.33: ``remove_skipped_blocks``).

        Returns:
            Per group, the leading null blocks of the table now.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: not scheduler-owned, or ``num_processed_tokens`` outside 0..max_model_len.
        """
        self._owned_request(request_id)
        if not 0 <= num_processed_tokens <= self.max_model_len:
            raise InvalidArgumentError(
                "num_processed_tokens", f"{num_processed_tokens} outside 0..{self.max_model_len} (max_model_len)"
            )
        self._touch(request_id)
        self.manager.remove_skipped_blocks(request_id, num_processed_tokens)
        return tuple(_num_null_head(table) for table in self.manager.coordinator.get_blocks(request_id))

    def free_owned(self, request_id: str, *, forget: bool) -> int:
        """Free a scheduler-owned request's blocks (tail first); forget it (finished) or keep its
        tokens and hashes, waiting (preempted: vLLM keeps the request).

        Returns:
            Blocks whose ref count dropped.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: not scheduler-owned.
        """
        request = self._owned_request(request_id)
        if forget:
            return self.free(request_id)
        self._touch(request_id)
        return self._drop_blocks(request, self.manager.free(request_id))

    def pop_blocks_for_free(self, request_id: str, *, forget: bool) -> list[int]:
        """Take a scheduler-owned request's blocks off its tables without freeing them (vLLM 0.33:
        ``pop_blocks_for_free``: a KV connector may still write them); free them later with
        :meth:`free_blocks`. Forget the request, or keep it waiting, as :meth:`free_owned`.

        Returns:
            The block ids, group after group in table order, leading null blocks left out.

        Raises:
            RequestNotFoundError, InvalidArgumentError: as :meth:`free_owned`.
        """
        request = self._owned_request(request_id)
        blocks = self.manager.pop_blocks_for_free(request_id)
        detached = self._detached
        for block in blocks:
            if not block.is_null:
                detached[block.block_id] = detached.get(block.block_id, 0) + 1
        if forget:
            self.free(request_id)  # its tables are gone: this forgets it
        else:
            self._touch(request_id)
            self._drop_blocks(request, 0)
        return [b.block_id for b in blocks]

    def free_blocks(self, block_ids: Sequence[int]) -> int:
        """Free blocks taken off tables by :meth:`pop_blocks_for_free`, the first evicted first.

        Returns:
            Blocks whose ref count dropped.

        Raises:
            InvalidArgumentError: an id that :meth:`pop_blocks_for_free` did not hand out (or that
                is freed more often than handed out); nothing is freed then.
        """
        detached = self._detached
        counts: dict[int, int] = {}
        for block_id in block_ids:
            counts[block_id] = counts.get(block_id, 0) + 1
            if counts[block_id] > detached.get(block_id, 0):
                raise InvalidArgumentError(
                    "block_ids", f"block {block_id} was not taken off a table by PopBlocksForFree (or is freed twice)"
                )
        for block_id, n in counts.items():
            left = detached[block_id] - n
            if left:
                detached[block_id] = left
            else:
                del detached[block_id]
        pool = self.manager.block_pool
        return pool.free_blocks([pool.blocks[i] for i in block_ids])

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int,
        *,
        apply_admission_cap: bool = False,
        max_in_flight_tokens: int | None = None,
    ) -> int:
        """Free blocks a scheduler-owned request still needs to hold ``num_tokens`` tokens, with
        no new hit (vLLM 0.33: ``coordinator.get_num_blocks_to_allocate``; its scheduler reserves
        them for in-flight prefills). Changes nothing.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: not scheduler-owned, or a count above max_model_len.
        """
        self._owned_request(request_id)
        for field, value in (("num_tokens", num_tokens), ("num_computed_tokens", num_computed_tokens)):
            if not 0 <= value <= self.max_model_len:
                raise InvalidArgumentError(field, f"{value} outside 0..{self.max_model_len} (max_model_len)")
        manager = self.manager
        caps = manager.admission_caps(max_in_flight_tokens) if apply_admission_cap else None
        return manager.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens, manager.empty_blocks().blocks, num_computed_tokens, 0, caps
        )

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Tokens of a request covered by cached blocks (vLLM 0.33: ``estimate_cached_tokens``).

        Raises:
            RequestNotFoundError: unknown id.
        """
        if request_id not in self.requests:
            self._check_request_id(request_id)
            raise RequestNotFoundError(request_id)
        return self.manager.estimate_cached_tokens(request_id)

    def _owned_request(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            self._check_request_id(request_id)
            raise RequestNotFoundError(request_id)
        if request_id not in self.owned:
            raise InvalidArgumentError(
                "request_id", f"request {request_id!r} was registered by GetComputedBlocks: its tokens are the server's"
            )
        return request

    def _drop_blocks(self, request: Request, num_freed: int) -> int:
        """A request that no longer holds blocks is waiting again (its prompt counts as waiting)."""
        request_id = request.request_id
        if request_id in self.running:
            self.running.discard(request_id)
            self.num_waiting_tokens += request.num_prompt_tokens
        return num_freed

    def _resolve_hit(
        self,
        request: Request,
        num_new_computed_tokens: int,
        computed_block_ids: Sequence[Sequence[int]],
        has_table: bool,
    ) -> KVCacheBlocks | None:
        """The hit's blocks, checked against the cache now (see :meth:`allocate_owned`)."""
        manager = self.manager
        coordinator = manager.coordinator
        if not num_new_computed_tokens and not any(len(ids) for ids in computed_block_ids):
            return None
        if has_table:
            raise InvalidArgumentError(
                "computed_block_ids", f"request {request.request_id!r} holds blocks; a hit comes on admission"
            )
        if len(computed_block_ids) != manager.num_groups:
            raise InvalidArgumentError(
                "computed_block_ids", f"{len(computed_block_ids)} groups; the pool has {manager.num_groups}"
            )
        pool = manager.block_pool
        blocks: list[list[KVCacheBlock]] = []
        for g, (m, ids) in enumerate(zip(coordinator.managers, computed_block_ids, strict=True)):
            if not m.prefix_cacheable:
                if len(ids):
                    raise InvalidArgumentError("computed_block_ids", f"group {g} ({type(m).__name__}) is never hit")
                blocks.append([])
                continue
            if num_new_computed_tokens % m.block_size or len(ids) != num_new_computed_tokens // m.block_size:
                raise InvalidArgumentError(
                    "computed_block_ids",
                    f"group {g}: {len(ids)} blocks of {m.block_size} tokens for a hit of {num_new_computed_tokens} tokens",
                )
            hashes = coordinator.group_block_hashes(request, g)
            if len(ids) > len(hashes):
                raise InvalidArgumentError(
                    "computed_block_ids", f"group {g}: a hit of {len(ids)} blocks; the request has {len(hashes)} hashes"
                )
            group_blocks = []
            # Null only where the group's skip rule drops the position at the hit's end (vLLM's
            # lookup pads exactly those); every later position must be a real cached block.
            num_skippable = m.get_num_skipped_tokens(num_new_computed_tokens) // m.block_size
            for i, block_id in enumerate(ids):
                if block_id == 0 and i < num_skippable:
                    group_blocks.append(m.null_block)
                    continue
                if block_id == 0:
                    raise InvalidArgumentError(
                        "computed_block_ids",
                        f"group {g}: the null block at position {i}, where the group needs the block "
                        f"(at {num_new_computed_tokens} tokens it skips positions 0..{num_skippable - 1} only)",
                    )
                if not 0 < block_id < pool.num_blocks:
                    raise InvalidArgumentError(
                        "computed_block_ids", f"group {g}: block id {block_id} outside 1..{pool.num_blocks - 1}"
                    )
                block = pool.blocks[block_id]
                if block.block_hash != hashes[i] or block.group_idx != g:
                    raise PreconditionFailedError(
                        f"computed_block_ids: group {g}, block {block_id} at position {i} no longer holds the "
                        f"request's hash there (evicted or reused since the lookup); look the request up again"
                    )
                group_blocks.append(block)
            blocks.append(group_blocks)
        return KVCacheBlocks(tuple(blocks))

    def idle_request_ids(self, idle_timeout_s: float) -> list[str]:
        """Requests not called for ``idle_timeout_s`` seconds or more, least recently called first.

        A call counts when ``get_computed_blocks`` or ``allocate_slots`` succeeded for the request
        (unary or inside a ``Step``; ``allocated=False`` counts, a call that raised does not).
        """
        now = self.clock()
        idle = []
        for request_id, last_call in self._last_call.items():
            if now - last_call < idle_timeout_s:
                break
            idle.append(request_id)
        return idle

    def next_idle_deadline(self, idle_timeout_s: float) -> float | None:
        """The clock time at which the least recently called request will have been idle for
        ``idle_timeout_s`` seconds, or the pool's claim lapses, whichever is first (None when
        neither can happen). Nothing can become idle earlier: a call only moves its request's time
        (or its claim's) later."""
        deadline = None
        for last_call in self._last_call.values():
            deadline = last_call + idle_timeout_s
            break
        claim = self.claim
        if claim is not None and (deadline is None or claim.expires_at < deadline):
            deadline = claim.expires_at
        return deadline

    def free_idle_requests(self, idle_timeout_s: float) -> list[str]:
        """Free every request not called for ``idle_timeout_s`` seconds or more, least recently
        called first, each exactly as :meth:`free` would (same events, same free-queue order as
        explicit frees in that order).

        Returns:
            The ids freed, in the order freed.
        """
        request_ids = self.idle_request_ids(idle_timeout_s)
        for request_id in request_ids:
            self.free(request_id)
        return request_ids

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache if no block is held (one AllBlocksCleared); else False."""
        return self.manager.reset_prefix_cache()

    def get_usage(self) -> Usage:
        """Current usage and counters."""
        pool = self.manager.block_pool
        stats = self.manager.prefix_cache_stats
        return Usage(
            usage=pool.get_usage(),
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=pool.num_blocks - 1,
            num_cached_blocks=pool.get_num_cached_blocks(),
            prefix_cache_requests=stats.requests,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.requests) - len(self.running),
        )

    def take_events(self) -> list[KVEvent]:
        """The manager's annotated events since the last take."""
        return self.manager.take_events()

    def check_invariants(self) -> None:
        """The manager's invariants (pool consistency; every block's ref count equals the number of
        (request, group) tables holding it, plus its references taken off tables by
        :meth:`pop_blocks_for_free` and not freed yet), plus what only the request table can tell:

        * every running request is registered, and only running requests hold blocks;
        * a block is held in one group only;
        * a held block that is cached sits, in every holder's table, at the position whose hash it
          carries in that group (requests share a block only where their prefixes agree);
        * a block held by two or more requests is a shared cached block (it carries a hash; its
          ref count was matched to its holders above);
        * ``num_waiting_tokens`` is the prompt tokens of the requests not running.

        A held block loses its hash only through ``KVCacheManager.evict_blocks`` (ManagerStep's
        EvictBlocks: a connector found its KV invalid); such blocks (``evicted_while_held``) may be
        shared uncached until freed.

        Raises:
            AssertionError: naming the broken invariant.
        """
        manager = self.manager
        references = self._detached
        if (
            self.tier is not None and self.tier.num_leased_blocks
        ):  # a tier lease's holds are off every table too (lapsed ones' too)
            references = dict(references)
            for block_id in self.tier.held_block_ids():
                references[block_id] = references.get(block_id, 0) + 1
        manager.check_invariants(references_off_tables=references)
        assert self.running <= self.requests.keys(), (
            f"running but not registered: {sorted(self.running - self.requests.keys())}"
        )
        coordinator = manager.coordinator
        holders: dict[int, list[str]] = {}
        group_of_block: dict[int, int] = {}
        for group_idx, group_manager in enumerate(coordinator.managers):
            for request_id, blocks in group_manager.req_to_blocks.items():
                if all(b.is_null for b in blocks):
                    continue
                assert request_id in self.running, f"{request_id} holds blocks but is not running"
                block_hashes = coordinator.group_block_hashes(self.requests[request_id], group_idx)
                for position, block in enumerate(blocks):
                    if block.is_null:
                        continue
                    first_group = group_of_block.setdefault(block.block_id, group_idx)
                    assert first_group == group_idx, (
                        f"block {block.block_id} held in groups {first_group} and {group_idx}"
                    )
                    holders.setdefault(block.block_id, []).append(request_id)
                    if block.block_hash is not None:
                        assert (
                            block.group_idx == group_idx
                            and position < len(block_hashes)
                            and (block.block_hash == block_hashes[position])
                        ), (
                            f"block {block.block_id} (cached in group {block.group_idx}) sits at position {position} "
                            f"of {request_id}'s group {group_idx} table, whose hash there differs"
                        )
        evicted = manager.block_pool.evicted_while_held
        for block_id, request_ids in holders.items():
            if len(request_ids) > 1 and block_id not in evicted:
                assert manager.block_pool.blocks[block_id].block_hash is not None, (
                    f"block {block_id} held by {sorted(request_ids)} at once but not cached"
                )
        waiting_tokens = sum(r.num_prompt_tokens for rid, r in self.requests.items() if rid not in self.running)
        assert self.num_waiting_tokens == waiting_tokens, (
            f"num_waiting_tokens {self.num_waiting_tokens} != {waiting_tokens} held by waiting requests"
        )

    def _check_request_options(
        self,
        num_prompt_tokens: int,
        session_id: str | None,
        kv_cache_report_mode: str | KVCacheReportMode,
        lora: LoRA | None,
        cache_salt: str | None,
        mm_features: Sequence[MultiModalFeature],
    ) -> KVCacheReportMode:
        """Check a request's options (what ``get_computed_blocks`` documents); the report mode.

        Raises:
            InvalidArgumentError: naming the bad option.
        """
        limit = self.limits.max_string_bytes
        if session_id is not None:
            _check_string("session_id", session_id, limit)
        if cache_salt is not None:
            _check_string("cache_salt", cache_salt, limit)
        if lora is not None:
            _check_string("lora.lora_name", lora.lora_name, limit, allow_empty=False)
            _check_string("lora.lora_path", lora.lora_path, limit)
            if lora.lora_id < 0:
                raise InvalidArgumentError("lora.lora_id", f"{lora.lora_id} is negative")
        previous_end = 0  # placeholders come in prompt order and do not overlap (vLLM's hash keys assume it)
        for i, feature in enumerate(mm_features):
            _check_string(f"mm_features[{i}].identifier", feature.identifier, limit, allow_empty=False)
            if feature.length < 1 or feature.offset < 0 or feature.offset + feature.length > num_prompt_tokens:
                raise InvalidArgumentError(
                    f"mm_features[{i}]",
                    f"placeholder [{feature.offset}, {feature.offset + feature.length}) must be non-empty and "
                    f"within the prompt (0..{num_prompt_tokens})",
                )
            if feature.offset < previous_end:
                raise InvalidArgumentError(
                    f"mm_features[{i}]",
                    f"placeholder [{feature.offset}, {feature.offset + feature.length}) starts before the end of "
                    f"mm_features[{i - 1}] ({previous_end}): placeholders must be in prompt order and disjoint",
                )
            previous_end = feature.offset + feature.length
        try:
            return KVCacheReportMode.parse(kv_cache_report_mode)
        except ValueError as e:
            raise InvalidArgumentError("kv_cache_report_mode", str(e).split("; ", 1)[-1]) from None

    def _admit(self, request: Request) -> None:
        """Issue ``request`` its allocation id for this admission (the next one; see
        :attr:`Request.allocation_id`)."""
        self._num_admissions += 1
        request.allocation_id = self._num_admissions

    def _touch(self, request_id: str) -> None:
        """Record a call of ``request_id`` now (it becomes the most recently called); a
        scheduler-owned request lives as long as its scheduler's claim instead."""
        if request_id in self.owned:
            return
        self._last_call[request_id] = self.clock()
        self._last_call.move_to_end(request_id)

    def _check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id", "must not be empty")
        if len(request_id.encode()) > self.limits.max_request_id_bytes:
            raise InvalidArgumentError("request_id", f"longer than {self.limits.max_request_id_bytes} bytes")
