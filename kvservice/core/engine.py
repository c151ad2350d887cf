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

from kvservice.core.errors import (
    CapacityExceededError,
    InvalidArgumentError,
    KVServiceDomainError,
    RequestAlreadyExistsError,
    RequestNotFoundError,
)
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.kv_cache_spec import max_tokens_in_pool, min_blocks_for_request
from kvservice.core.request import KVCacheReportMode, Request
from kvservice_client.events import KVEvent
from kvservice_client.hashing import LoRA, MultiModalFeature

__all__ = ["AllocateResult", "ComputedBlocksResult", "DecodeResult", "EngineLimits", "KVCacheEngine", "Usage"]

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
    """

    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


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


def check_token_ids(field: str, token_ids: Sequence[int]) -> list[int]:
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
        return token_ids.tolist()
    if len(token_ids) <= 8 and type(token_ids) is not np.ndarray:  # an array's items are numpy scalars
        for t in token_ids:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidArgumentError(field, f"token id {t} outside 0..{MAX_TOKEN_ID}")
        return list(token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = (ids < 0) | (ids > MAX_TOKEN_ID)
    if bad.any():
        raise InvalidArgumentError(field, f"token id {int(ids[bad][0])} outside 0..{MAX_TOKEN_ID}")
    return ids.tolist()  # type: ignore[no-any-return]  # numpy's tolist() is typed Any


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
        self._no_blocks: tuple[list[int], ...] = tuple([] for _ in range(manager.num_groups))
        self._max_tokens_in_pool = max_tokens_in_pool(manager.kv_cache_config)
        self.num_failed_allocations = 0
        self.num_freed_requests = 0
        self.num_waiting_tokens = 0
        """Prompt tokens held by waiting requests (bounded by ``limits.max_waiting_tokens``)."""
        self.num_freed_tokens = 0
        """Tokens of every request freed so far (the server returns heap memory after many)."""

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
            if feature.length < 1 or feature.offset < 0 or feature.offset + feature.length > n:
                raise InvalidArgumentError(
                    f"mm_features[{i}]",
                    f"placeholder [{feature.offset}, {feature.offset + feature.length}) must be non-empty and "
                    f"within the prompt (0..{n})",
                )
            if feature.offset < previous_end:
                raise InvalidArgumentError(
                    f"mm_features[{i}]",
                    f"placeholder [{feature.offset}, {feature.offset + feature.length}) starts before the end of "
                    f"mm_features[{i - 1}] ({previous_end}): placeholders must be in prompt order and disjoint",
                )
            previous_end = feature.offset + feature.length
        try:
            mode = KVCacheReportMode.parse(kv_cache_report_mode)
        except ValueError as e:
            raise InvalidArgumentError("kv_cache_report_mode", str(e).split("; ", 1)[-1]) from None

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
        del self._last_call[request_id]
        self.num_freed_requests += 1
        return self.manager.free(request_id)

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
        ``idle_timeout_s`` seconds (None when no request is registered). No request can become idle
        earlier: a call only moves its request's time later."""
        for last_call in self._last_call.values():
            return last_call + idle_timeout_s
        return None

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
        (request, group) tables holding it), plus what only the request table can tell:

        * every running request is registered, and only running requests hold blocks;
        * a block is held in one group only;
        * a held block that is cached sits, in every holder's table, at the position whose hash it
          carries in that group (requests share a block only where their prefixes agree);
        * a block held by two or more requests is a shared cached block (it carries a hash; its
          ref count was matched to its holders above);
        * ``num_waiting_tokens`` is the prompt tokens of the requests not running.

        A held block loses its hash only through ``KVCacheManager.evict_blocks``, which no RPC
        reaches; after such a direct call a shared block may fail the last check.

        Raises:
            AssertionError: naming the broken invariant.
        """
        manager = self.manager
        manager.check_invariants()
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
        for block_id, request_ids in holders.items():
            if len(request_ids) > 1:
                assert manager.block_pool.blocks[block_id].block_hash is not None, (
                    f"block {block_id} held by {sorted(request_ids)} at once but not cached"
                )
        waiting_tokens = sum(r.num_prompt_tokens for rid, r in self.requests.items() if rid not in self.running)
        assert self.num_waiting_tokens == waiting_tokens, (
            f"num_waiting_tokens {self.num_waiting_tokens} != {waiting_tokens} held by waiting requests"
        )

    def _touch(self, request_id: str) -> None:
        """Record a call of ``request_id`` now (it becomes the most recently called)."""
        self._last_call[request_id] = self.clock()
        self._last_call.move_to_end(request_id)

    def _check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id", "must not be empty")
        if len(request_id.encode()) > self.limits.max_request_id_bytes:
            raise InvalidArgumentError("request_id", f"longer than {self.limits.max_request_id_bytes} bytes")
