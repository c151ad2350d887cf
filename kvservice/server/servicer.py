"""The kvservice.v1 servicer: proto in, engine call, proto out; one table maps errors to statuses.

Handlers run on one asyncio loop and never await between reading and changing the cache, so two
schedulers can never be handed the same block. Every mutating call's events become one batch of
the event log (a ``Step`` is one call: one batch).

Deadlines: a call (unary, ``Step`` or ``TakeEvents``) whose deadline has passed when its handler
is about to run changes nothing and is answered DEADLINE_EXCEEDED. Once an op starts it completes
(no await between reading and changing the cache), so the honest limit is the other way round: a
call that completed on the server but whose answer reaches the client after the client's deadline
has been applied, although the client sees DEADLINE_EXCEEDED. A scheduler that gets
DEADLINE_EXCEEDED must not assume nothing happened: look the request up again (GetComputedBlocks
of a running request answers ALREADY_EXISTS) or free it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
import xxhash
from google.protobuf.message import DecodeError

from kvservice.core.engine import (
    MAX_TOKEN_ID,
    AllocateResult,
    CheckedTokenIds,
    ComputedBlocksResult,
    DecodeResult,
    KVCacheEngine,
    Usage,
)
from kvservice.core.errors import (
    CapacityExceededError,
    EpochMismatchError,
    InvalidArgumentError,
    KVServiceDomainError,
    PreconditionFailedError,
    RequestAlreadyExistsError,
    RequestNotFoundError,
    SeqOutOfRangeError,
    ShuttingDownError,
)
from kvservice.core.request import KVCacheReportMode
from kvservice.server.build_info import build_info
from kvservice.server.encoding import (
    batch_message,
    check_format,
    encoded_batch,
    encoded_snapshot_part_in_steps,
    take_response,
)
from kvservice.server.event_log import EventLog, LogEntry, Subscriber
from kvservice.server.heap import HeapTrimmer
from kvservice.server.observability import note_request
from kvservice.server.snapshot import SnapshotSource
from kvservice.server.wire import WireChunk, invalid_utf8_field, put_chunk
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.convert import kv_cache_spec_kind_to_proto
from kvservice_client.hashing import LoRA, MultiModalFeature
from kvservice_client.rpc_table import KV_CACHE_SERVICE, ServiceTable

if TYPE_CHECKING:  # the data plane is imported lazily where it is used; here only for the annotations
    from kvservice.server.data_plane import DataPlane

logger = logging.getLogger(__name__)

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_Result = TypeVar("_Result")
_Handler = TypeVar("_Handler", bound=Callable[..., Any])

__all__ = ["KVCacheServicer", "STATUS_BY_ERROR", "status_for", "SERVICE_NAME"]

SERVICE_NAME = KV_CACHE_SERVICE.name
"""``kvservice.v1.KVCacheService``."""

DEFAULT_CLAIM_TTL_S = 30.0
"""Seconds a scheduler's claim on the pool lasts after its last ManagerStep, unless it asks otherwise."""

# A refused client stream's drain (KVCacheServicer._drain_stream): what it reads and drops before
# the status goes out. Bytes in flight arrive within milliseconds; a client that goes quiet for
# DRAIN_IDLE_S, or is still sending after DRAIN_MAX_S, gets the status then.
DRAIN_WRITE_BYTES = 64 << 20  # a refused WriteBlocks: at most this much (or a window and a chunk, if more)
DRAIN_IDLE_S = 0.25
DRAIN_MAX_S = 2.0
_GRPC_MESSAGE_PREFIX_BYTES = 5  # each message counts at least its length-prefixed frame: empties too

_DEADLINE_PASSED = "deadline: it had passed when the call was about to run; nothing was changed"

STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (RequestAlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (EpochMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (PreconditionFailedError, grpc.StatusCode.FAILED_PRECONDITION),
    (SeqOutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),
    (CapacityExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
)
"""The one table from domain errors to gRPC status codes; anything else is INTERNAL."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message for an exception (INTERNAL, logged, for anything unexpected)."""
    for cls, code in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code, str(exc)
    logger.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error (see the server log)"


_SENDS_SERIALIZED = "_kvservice_sends_serialized"


def _sends_serialized(handler: _Handler) -> _Handler:
    """Marks an RPC handler that writes its responses already serialized (bytes), so its
    registration has no response serializer."""
    setattr(handler, _SENDS_SERIALIZED, True)
    return handler


_JOIN_BESIDE_THE_LOOP_BYTES = 1 << 20
"""A TakeEvents answer of at least this many snapshot bytes is joined on a worker thread: CPython's
``bytes.join`` releases the GIL while it copies 1 MiB or more (about 3 ms for 4 MB here), so the loop
is not held for the copy."""


def _on_done(context: grpc.aio.ServicerContext, callback: Callable[[grpc.aio.ServicerContext], None]) -> None:
    """Run ``callback(context)`` when the RPC ends (answered, failed or cancelled)."""
    context.add_done_callback(callback)  # type: ignore[arg-type]  # grpc-stubs types the callback as a generic class with __call__, not a Protocol, so no function matches it


_REPORT_MODES = {
    pb.KV_CACHE_REPORT_MODE_UNSPECIFIED: KVCacheReportMode.INCREMENTAL,
    pb.KV_CACHE_REPORT_MODE_INCREMENTAL: KVCacheReportMode.INCREMENTAL,
    pb.KV_CACHE_REPORT_MODE_FULL: KVCacheReportMode.FULL,
}


def _groups(block_ids: tuple[list[int], ...]) -> list[pb.GroupBlockIds]:
    return [pb.GroupBlockIds(block_ids=ids) for ids in block_ids]


def _fill_groups(field: Any, block_ids: tuple[list[int], ...]) -> None:
    """Append one GroupBlockIds per group to a repeated field (index = group_idx)."""
    for ids in block_ids:
        field.add().block_ids.extend(ids)


def _computed_blocks_response(result: ComputedBlocksResult) -> pb.GetComputedBlocksResponse:
    response = pb.GetComputedBlocksResponse(num_computed_tokens=result.num_computed_tokens)
    _fill_groups(response.block_ids, result.block_ids)  # in place: no per-group message to copy in
    return response


def _allocate_response(result: AllocateResult) -> pb.AllocateSlotsResponse:
    return pb.AllocateSlotsResponse(
        allocated=result.allocated,
        new_block_ids=_groups(result.new_block_ids),
        num_new_computed_tokens=result.num_new_computed_tokens,
        num_scheduled_tokens=result.num_scheduled_tokens,
        num_computed_tokens=result.num_computed_tokens,
        num_tokens=result.num_tokens,
        computed_block_ids=_groups(result.computed_block_ids),
    )


def _decode_response(result: DecodeResult, num_groups: int) -> pb.DecodeResponse:
    new_block_ids: list[int] = []
    counts: list[int] = []
    for per_group in result.new_block_ids:
        for ids in per_group:
            new_block_ids += ids
            counts.append(len(ids))
    errors = []
    error_indices = []
    for i, exc in result.errors:
        code, message = status_for(exc)
        error_indices.append(i)
        errors.append(pb.OpStatus(code=code.value[0], message=message))
    return pb.DecodeResponse(
        changed_indices=result.changed_indices,
        new_block_ids=new_block_ids,
        num_new_block_ids=counts,
        refused_indices=result.refused_indices,
        error_indices=error_indices,
        errors=errors,
        num_groups=num_groups,
    )


def _usage_response(usage: Usage) -> pb.GetUsageResponse:
    return pb.GetUsageResponse(
        usage=usage.usage,
        num_free_blocks=usage.num_free_blocks,
        num_total_blocks=usage.num_total_blocks,
        prefix_cache_queries=usage.prefix_cache_queries,
        prefix_cache_hits=usage.prefix_cache_hits,
        num_running_requests=usage.num_running_requests,
        num_waiting_requests=usage.num_waiting_requests,
        num_cached_blocks=usage.num_cached_blocks,
        prefix_cache_requests=usage.prefix_cache_requests,
    )


class KVCacheServicer:
    """Implements ``kvservice.v1.KVCacheService`` over a :class:`KVCacheEngine` and an :class:`EventLog`.

    Args:
        engine: the manager and its request table.
        event_log: where each mutating call's events go.
        metadata: the ``GetKVCacheGroupMetadata`` answer (built once by the app).
        max_step_ops: most ops one Step may carry.
        max_message_bytes: the largest message the server sends (a batch above it ends the stream
            with RESOURCE_EXHAUSTED naming its seq).
        check_invariants: debug: run ``engine.check_invariants()`` after every successful unary
            call and every Step (after its events are published). A failure changes no answer: it
            is logged at ERROR and recorded.
        max_step_tokens: most tokens (prompt_token_ids, packed_prompt_token_ids and new_token_ids
            over all ops) one Step may carry; bounds how long one Step holds the event loop.
        snapshots: where snapshots come from (default: a :class:`SnapshotSource` attached to
            ``event_log`` now, which must then have no batch yet).

    Attributes:
        num_deadline_exceeded: calls refused with DEADLINE_EXCEEDED before they ran.
        num_stream_write_timeouts: streams cut because one write took over ``stalled_write_timeout_s``.
        num_prompts_hashed_ahead: Step lookups whose prompt was hashed beside the loop
            (:meth:`_prehash`).
        num_invariant_checks: invariant checks run (with ``check_invariants``).
        num_invariant_failures: checks that failed.
        invariant_failures: the first 100 failures' messages.
    """

    def __init__(
        self,
        engine: KVCacheEngine,
        event_log: EventLog,
        metadata: pb.GetKVCacheGroupMetadataResponse,
        *,
        max_step_ops: int = 4096,
        max_message_bytes: int = 64 * 1024 * 1024,
        check_invariants: bool = False,
        max_step_tokens: int = 1 << 18,
        snapshots: SnapshotSource | None = None,
    ) -> None:
        if snapshots is None:
            assert event_log.head_seq == 0, "attach the snapshot source before the first batch"
            snapshots = SnapshotSource.attach(event_log, part_tokens=event_log.config.snapshot_part_tokens)
        self.snapshots = snapshots
        self.heap_trimmer = HeapTrimmer(lambda: engine.num_freed_tokens)
        hasher = engine.manager.block_hasher
        # The hasher whose chains a Step's prompts are hashed by beside the loop: None with prefix
        # caching off, or where the compiled chain does not cover the algorithm (xxhash) or is not built.
        self._block_hasher = hasher if hasher is not None and hasher.packed_chains([]) is not None else None
        self._hash_thread: ThreadPoolExecutor | None = None  # hashes a Step's prompts (made on first use)
        self.num_prompts_hashed_ahead = 0
        self.max_step_tokens = max_step_tokens
        self.num_deadline_exceeded = 0
        self.num_stream_write_timeouts = 0
        self.max_message_bytes = max_message_bytes
        self.check_invariants = check_invariants
        self.num_invariant_checks = 0
        self.num_invariant_failures = 0
        self.invariant_failures: list[str] = []
        self.engine = engine
        self.event_log = event_log
        self.metadata = metadata
        self.max_step_ops = max_step_ops
        self.data_plane: DataPlane | None = None
        """The :class:`kvservice.server.data_plane.DataPlane` (set by the app); None: the data-plane
        RPCs answer FAILED_PRECONDITION."""
        # One op per member of the StepOp oneof, the method named after it (``_free`` for ``free``);
        # the unary RPC of the same request runs the same op (``Free`` is ``_unary(self._free)``).
        self._ops: dict[str, Callable[[Any], Any]] = {}
        # Step ops whose answer is written straight into the StepResponse (no message per op, no
        # copy): ``_fill_<op>`` where there is one.
        self._step_fills: dict[str, Callable[[Any, Any], None]] = {}
        for op in pb.StepOp.DESCRIPTOR.oneofs_by_name["op"].fields:
            run = getattr(self, f"_{op.name}", None)
            if run is None:
                raise TypeError(f"{type(self).__name__} has no _{op.name} for the Step op {op.name}")
            self._ops[op.name] = run
            fill = getattr(self, f"_fill_{op.name}", None)
            if fill is not None:
                self._step_fills[op.name] = fill
        # One handler per member of the ManagerCall oneof: ``_manager_<call>`` (ManagerStep).
        self._manager_calls: dict[str, Callable[[Any, pb.ManagerResult], None]] = {}
        for call in pb.ManagerCall.DESCRIPTOR.oneofs_by_name["call"].fields:
            handler = getattr(self, f"_manager_{call.name}", None)
            if handler is None:
                raise TypeError(f"{type(self).__name__} has no _manager_{call.name} for the ManagerCall {call.name}")
            self._manager_calls[call.name] = handler

    # -- ops shared by unary calls and Step --------------------------------------------------

    def _get_computed_blocks(self, request: pb.GetComputedBlocksRequest) -> pb.GetComputedBlocksResponse:
        return _computed_blocks_response(self._run_get_computed_blocks(request))

    def _fill_get_computed_blocks(
        self, request: pb.GetComputedBlocksRequest, out: pb.GetComputedBlocksResponse, hashed: Any = None
    ) -> None:
        """As :meth:`_get_computed_blocks`, written into a Step result's own message (no copy);
        ``hashed``: the prompt's hashes being made beside the loop (an entry of :meth:`_prehash`)."""
        result = self._run_get_computed_blocks(request, hashed)
        out.SetInParent()
        out.num_computed_tokens = result.num_computed_tokens
        _fill_groups(out.block_ids, result.block_ids)

    def _fill_allocate_slots(self, request: pb.AllocateSlotsRequest, out: pb.AllocateSlotsResponse) -> None:
        """As :meth:`_allocate_slots`, written into a Step result's own message (no copy)."""
        result = self._run_allocate_slots(request)
        out.SetInParent()
        out.allocated = result.allocated
        _fill_groups(out.new_block_ids, result.new_block_ids)
        out.num_new_computed_tokens = result.num_new_computed_tokens
        out.num_scheduled_tokens = result.num_scheduled_tokens
        out.num_computed_tokens = result.num_computed_tokens
        out.num_tokens = result.num_tokens
        _fill_groups(out.computed_block_ids, result.computed_block_ids)
        self._fill_allocation(request.request_id, out)

    def _run_get_computed_blocks(
        self, request: pb.GetComputedBlocksRequest, hashed: Any = None
    ) -> ComputedBlocksResult:
        self.engine.check_claim(None)
        mode = _REPORT_MODES.get(request.kv_cache_report_mode)
        if mode is None:
            raise InvalidArgumentError("kv_cache_report_mode", f"unknown value {request.kv_cache_report_mode}")
        lora = None
        if request.HasField("lora"):
            lora = LoRA(request.lora.lora_id, request.lora.lora_name, request.lora.lora_path or None)
        prompt: Any = request.prompt_token_ids
        packed = request.packed_prompt_token_ids
        block_hashes = None
        if hashed is not None:
            chains, i, ids = hashed
            block_hashes = chains.hashes(i)  # None (a bad id, say): the engine hashes and names the error
            if ids is not None:  # the varints, checked and read as int32 by _prehash
                prompt = ids
        if packed:
            prompt = _unpack_prompt(packed, len(prompt))
        elif type(prompt) is not np.ndarray:  # int64 varints: ints for sure, so a min and a max check them
            prompt = CheckedTokenIds.of(prompt)
        try:
            return self.engine.get_computed_blocks(
                request.request_id,
                prompt,
                session_id=request.session_id if request.HasField("session_id") else None,
                kv_cache_report_mode=mode,
                lora=lora,
                cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                mm_features=[MultiModalFeature(f.identifier, f.offset, f.length) for f in request.mm_features]
                if request.mm_features
                else (),
                block_hashes=block_hashes,
            )
        except InvalidArgumentError as exc:
            if packed and exc.field == "prompt_token_ids":  # name the field the caller set
                raise InvalidArgumentError("packed_prompt_token_ids", str(exc).split(": ", 1)[1]) from None
            raise

    def _prehash(self, kinds: Sequence[str | None], subs: list[Any]) -> dict[int, tuple[Any, int, Any]] | None:
        """Start hashing a Step's prompts on a thread beside the loop, in op order, so each lookup
        finds its hashes made (``BlockHasher.packed_chains``: C, the GIL released) while the loop
        runs the ops before it. Only for lookups the rule hashes with no extra keys (no LoRA, cache
        salt or multimodal features), whose prompt is packed, or varints all in ``0 .. 2^31 - 1``
        (read once into an int32 array, which the lookup then takes as its prompt), and only with
        two or more of them (one would only wait). Not for a lookup refused whatever its prompt's
        ids (an unknown ``kv_cache_report_mode``, refused before its hashes are taken; a prompt
        above ``max_model_len``): every prompt hashed here is one its lookup waits for, so a Step
        leaves no hashing behind its answer (a later Step's lookups would wait behind it).

        Returns:
            op index -> (the chains, the prompt's index in them, the int32 ids read from varints or
            None for a packed prompt); None when nothing is hashed ahead (no compiled chain,
            prefix caching off, or fewer than two such lookups).
        """
        if self._block_hasher is None:
            return None
        max_model_len = self.engine.max_model_len
        picked: list[tuple[int, Any, Any]] = []  # (op index, buffer to hash, ids read from varints)
        for i, (which, sub) in enumerate(zip(kinds, subs)):
            if which != "get_computed_blocks" or sub.HasField("lora") or sub.cache_salt or sub.mm_features:
                continue
            if sub.kv_cache_report_mode not in _REPORT_MODES:
                continue  # refused before its prompt is read: nothing would wait for the hashes
            packed, varints = sub.packed_prompt_token_ids, sub.prompt_token_ids
            if len(packed) > 4 * max_model_len or len(varints) > max_model_len:
                continue  # refused whatever its ids: not worth the hashing
            if packed and not varints:
                picked.append((i, packed, None))
            elif varints and not packed:
                ids = np.asarray(varints, dtype=np.int64)
                if ids.min() >= 0 and ids.max() <= MAX_TOKEN_ID:  # else the lookup names the bad id
                    ids = ids.astype("<i4")
                    picked.append((i, ids, ids))
        if len(picked) < 2:
            return None
        chains = self._block_hasher.packed_chains([data for _, data, _ in picked])
        if chains is None:
            return None
        if self._hash_thread is None:
            self._hash_thread = ThreadPoolExecutor(1, thread_name_prefix="kvservice-hash")
        self._hash_thread.submit(chains.run)
        self.num_prompts_hashed_ahead += len(picked)
        return {i: (chains, k, ids) for k, (i, _, ids) in enumerate(picked)}

    async def close(self) -> None:
        """Stop the hashing thread (a Step's chains in progress finish there first)."""
        thread, self._hash_thread = self._hash_thread, None
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.shutdown)

    def _allocate_slots(self, request: pb.AllocateSlotsRequest) -> pb.AllocateSlotsResponse:
        response = _allocate_response(self._run_allocate_slots(request))
        self._fill_allocation(request.request_id, response)
        return response

    def _fill_allocation(self, request_id: str, out: pb.AllocateSlotsResponse) -> None:
        """An allocated answer's allocation: the request's allocation id and this epoch (what its
        WriteBlocks streams name)."""
        if out.allocated:
            out.allocation_id = self.engine.requests[request_id].allocation_id
            out.epoch = self.event_log.epoch

    def _run_allocate_slots(self, request: pb.AllocateSlotsRequest) -> AllocateResult:
        self.engine.check_claim(None)
        result = self.engine.allocate_slots(
            request.request_id,
            request.num_new_tokens,
            num_lookahead_tokens=request.num_lookahead_tokens,
            new_token_ids=request.new_token_ids,
        )
        if result.allocated and self.data_plane is not None:
            self.data_plane.note_allocated(request.request_id, result.new_block_ids)  # who may write them
        return result

    def _decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        self.engine.check_claim(None)
        result = self.engine.decode(
            request.request_ids,
            request.new_token_ids,
            num_new_token_ids=request.num_new_token_ids,
            num_new_tokens=request.num_new_tokens,
            num_lookahead_tokens=request.num_lookahead_tokens,
        )
        if self.data_plane is not None:  # who may write the decode's new blocks
            for index, new_block_ids in zip(result.changed_indices, result.new_block_ids):
                self.data_plane.note_allocated(request.request_ids[index], new_block_ids)
        return _decode_response(result, self.engine.manager.num_groups)

    def _free(self, request: pb.FreeRequest) -> pb.FreeResponse:
        self.engine.check_claim(None)
        return pb.FreeResponse(num_freed_blocks=self.engine.free(request.request_id))

    def _fill_free(self, request: pb.FreeRequest, out: pb.FreeResponse) -> None:
        """As :meth:`_free`, written into a Step result's own message (no copy)."""
        self.engine.check_claim(None)
        num_freed_blocks = self.engine.free(request.request_id)
        out.SetInParent()  # a free of nothing answers an empty FreeResponse, not an unset result
        out.num_freed_blocks = num_freed_blocks

    def _reset_prefix_cache(self, request: pb.ResetPrefixCacheRequest) -> pb.ResetPrefixCacheResponse:
        self.engine.check_claim(None)
        return pb.ResetPrefixCacheResponse(reset=self.engine.reset_prefix_cache())

    def _get_usage(self, request: pb.GetUsageRequest) -> pb.GetUsageResponse:
        return _usage_response(self.engine.get_usage())

    def publish(self) -> None:
        """Append the engine's pending events to the event log as one batch (none when there are
        none), exactly as a mutating call does when it ends (the request reaper publishes here)."""
        self._publish()

    def _publish(self) -> LogEntry | None:
        entry = self.event_log.append(self.engine.take_events())
        self.heap_trimmer.maybe_trim()
        if self.check_invariants:
            self._check_invariants()
        return entry

    def _check_invariants(self) -> None:
        self.num_invariant_checks += 1
        try:
            self.engine.check_invariants()
        except AssertionError as exc:
            self.num_invariant_failures += 1
            if len(self.invariant_failures) < 100:
                self.invariant_failures.append(str(exc))
            logger.error(
                "invariant check %d failed (head seq %d): %s",
                self.num_invariant_checks,
                self.event_log.head_seq,
                exc,
                exc_info=exc,
            )

    def _deadline_passed(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call's deadline has passed (then it must change nothing); counts it."""
        remaining = context.time_remaining()
        if remaining is None or remaining > 0:
            return False
        self.num_deadline_exceeded += 1
        return True

    async def _unary(
        self, op: Callable[[_Request], _Response], request: _Request, context: grpc.aio.ServicerContext
    ) -> _Response:
        if self._deadline_passed(context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE_PASSED)
        try:
            response = op(request)
        except Exception as exc:  # one table maps every error
            code, message = status_for(exc)
            await context.abort(code, message)
        self._publish()
        return response

    # -- RPCs ---------------------------------------------------------------------------------

    async def GetComputedBlocks(
        self, request: pb.GetComputedBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetComputedBlocksResponse:
        """Prefix-cache lookup; registers the request on first sight."""
        return await self._unary(self._get_computed_blocks, request, context)

    async def AllocateSlots(
        self, request: pb.AllocateSlotsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateSlotsResponse:
        """Allocate slots for this step's tokens."""
        return await self._unary(self._allocate_slots, request, context)

    async def Free(self, request: pb.FreeRequest, context: grpc.aio.ServicerContext) -> pb.FreeResponse:
        """Free a request's blocks and forget it."""
        return await self._unary(self._free, request, context)

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        """Drop the prefix cache if nothing is held."""
        return await self._unary(self._reset_prefix_cache, request, context)

    async def GetUsage(self, request: pb.GetUsageRequest, context: grpc.aio.ServicerContext) -> pb.GetUsageResponse:
        """Usage and prefix-cache counters."""
        return await self._unary(self._get_usage, request, context)

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        """Run the ops in order; a failed op answers its own OpStatus and the rest go on.

        A Step above ``max_step_ops`` ops (each request of a ``decode`` op counts as one op) or
        ``max_step_tokens`` tokens is refused whole (INVALID_ARGUMENT naming ``ops`` and the
        bound); one past its deadline is refused whole (DEADLINE_EXCEEDED). Either way nothing
        runs.
        """
        if self._deadline_passed(context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE_PASSED)
        step_ops = request.ops
        num_ops = len(step_ops)
        if num_ops > self.max_step_ops:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"ops: {num_ops} ops, above max_step_ops {self.max_step_ops}"
            )
        kinds = [op.WhichOneof("op") for op in step_ops]
        # Each op's own message, read once (every access to a oneof member makes a new wrapper).
        subs: list[Any] = [getattr(op, which) if which is not None else None for which, op in zip(kinds, step_ops)]
        num_tokens = 0
        for which, sub in zip(kinds, subs):
            if which == "get_computed_blocks":
                num_tokens += len(sub.prompt_token_ids) + len(sub.packed_prompt_token_ids) // 4
            elif which == "allocate_slots":
                num_tokens += len(sub.new_token_ids)
            elif which == "decode":
                num_tokens += len(sub.new_token_ids)
                num_ops += len(sub.request_ids) - 1
        if num_ops > self.max_step_ops:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ops: {num_ops} ops (each decode request counts as one), above max_step_ops {self.max_step_ops}",
            )
        if num_tokens > self.max_step_tokens:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ops: {num_tokens} tokens (prompt_token_ids, packed_prompt_token_ids and new_token_ids over all ops), above max_step_tokens "
                f"{self.max_step_tokens}",
            )
        response = pb.StepResponse()
        results = response.results
        ops, fills = self._ops, self._step_fills
        hashed = self._prehash(kinds, subs)
        for i, (which, sub) in enumerate(zip(kinds, subs)):
            if which is None:
                results.add(error=pb.OpStatus(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="op: not set"))
                continue
            fill = fills.get(which)
            if fill is not None:
                result = results.add()
                try:
                    if hashed is not None and i in hashed:
                        self._fill_get_computed_blocks(sub, result.get_computed_blocks, hashed[i])
                    else:
                        fill(sub, getattr(result, which))  # raises before writing anything
                except Exception as exc:
                    code, message = status_for(exc)
                    result.error.code = code.value[0]  # setting error clears the oneof's other member
                    result.error.message = message
                continue
            try:
                answer = ops[which](sub)
            except Exception as exc:
                code, message = status_for(exc)
                results.add(error=pb.OpStatus(code=code.value[0], message=message))
                continue
            results.add(**{which: answer})
        self._publish()
        response.head_seq = self.event_log.head_seq
        response.epoch = self.event_log.epoch
        return response

    # -- vLLM's KV cache manager (ManagerStep) -----------------------------------------------

    def _manager_update_request(self, call: pb.ManagerCall.UpdateRequest, out: pb.ManagerResult) -> None:
        lora = None
        if call.HasField("lora"):
            lora = LoRA(call.lora.lora_id, call.lora.lora_name, call.lora.lora_path or None)
        mode = _REPORT_MODES.get(call.kv_cache_report_mode)
        if mode is None:
            raise InvalidArgumentError("kv_cache_report_mode", f"unknown value {call.kv_cache_report_mode}")
        packed = call.packed_token_ids
        if len(packed) % 4:
            raise InvalidArgumentError(
                "packed_token_ids", f"{len(packed)} bytes, not a multiple of 4 (little-endian int32 token ids)"
            )
        digests = call.block_hashes
        size = self.engine.manager.hash_digest_size
        if len(digests) % size:
            raise InvalidArgumentError(
                "block_hashes", f"{len(digests)} bytes, not a multiple of the {size}-byte digests of the hash algorithm"
            )
        self.engine.update_request(
            call.request_id,
            num_tokens_kept=call.num_tokens_kept,
            token_ids=np.frombuffer(packed, dtype="<i4"),
            num_block_hashes_kept=call.num_block_hashes_kept,
            block_hashes=[digests[i : i + size] for i in range(0, len(digests), size)],
            num_prompt_tokens=call.num_prompt_tokens,
            session_id=call.session_id if call.HasField("session_id") else None,
            kv_cache_report_mode=mode,
            lora=lora,
            cache_salt=call.cache_salt if call.HasField("cache_salt") else None,
            mm_features=[MultiModalFeature(f.identifier, f.offset, f.length) for f in call.mm_features],
        )
        out.done.SetInParent()

    def _manager_get_computed_blocks(self, call: pb.ManagerCall.GetComputedBlocks, out: pb.ManagerResult) -> None:
        limit = call.max_cache_hit_length if call.HasField("max_cache_hit_length") else None
        result = self.engine.find_cache_hit(call.request_id, limit, free_queue_horizon=call.free_queue_horizon)
        answer = out.computed_blocks
        answer.SetInParent()
        answer.num_computed_tokens = result.num_computed_tokens
        _fill_groups(answer.block_ids, result.block_ids)
        answer.num_free_hit_blocks.extend(result.num_free_hit_blocks)
        answer.num_free_blocks_ahead = result.num_free_blocks_ahead

    def _manager_allocate_slots(self, call: pb.ManagerCall.AllocateSlots, out: pb.ManagerResult) -> None:
        engine = self.engine
        result = engine.allocate_owned(
            call.request_id,
            num_computed_tokens=call.num_computed_tokens,
            num_new_tokens=call.num_new_tokens,
            num_in_flight_tokens=call.num_in_flight_tokens,
            num_new_computed_tokens=call.num_new_computed_tokens,
            computed_block_ids=[g.block_ids for g in call.computed_block_ids],
            num_lookahead_tokens=call.num_lookahead_tokens,
            num_external_computed_tokens=call.num_external_computed_tokens,
            delay_cache_blocks=call.delay_cache_blocks,
            num_encoder_tokens=call.num_encoder_tokens,
            full_sequence_must_fit=call.full_sequence_must_fit,
            max_in_flight_tokens=call.max_in_flight_tokens if call.HasField("max_in_flight_tokens") else None,
            reserved_blocks=call.reserved_blocks,
            watermark_blocks=call.watermark_blocks,
        )
        answer = out.allocated
        answer.SetInParent()
        answer.allocated = result.allocated
        if not result.allocated:
            answer.refused_full_sequence = result.refused_full_sequence
            return
        _fill_groups(answer.new_block_ids, result.new_block_ids)
        if result.block_ids is not None:
            _fill_groups(answer.block_ids, result.block_ids)
        answer.num_null_blocks.extend(result.num_null_blocks)
        answer.num_cached_tokens = engine.estimate_cached_tokens(call.request_id)
        answer.allocation_id = engine.requests[call.request_id].allocation_id
        if self.data_plane is not None:  # who may write: the blocks taken for computing, never the hit's
            written = result.new_block_ids
            if result.block_ids is not None:  # an admission: the connector's blocks too, after the hit
                hit = call.computed_block_ids
                written = tuple(
                    ids[max(len(hit[g].block_ids) if g < len(hit) else 0, num_null) :]
                    for g, (ids, num_null) in enumerate(zip(result.block_ids, result.num_null_blocks))
                )
            self.data_plane.note_allocated(call.request_id, written)

    def _manager_allocate_slots_batch(self, call: pb.ManagerCall.AllocateSlotsBatch, out: pb.ManagerResult) -> None:
        packed = call.packed_token_ids
        if len(packed) % 4:
            raise InvalidArgumentError(
                "packed_token_ids", f"{len(packed)} bytes, not a multiple of 4 (little-endian int32 token ids)"
            )
        digests = call.block_hashes
        size = self.engine.manager.hash_digest_size
        if len(digests) % size:
            raise InvalidArgumentError(
                "block_hashes", f"{len(digests)} bytes, not a multiple of the {size}-byte digests of the hash algorithm"
            )
        result = self.engine.allocate_running(
            call.request_ids,
            num_computed_tokens=call.num_computed_tokens,
            num_new_tokens=call.num_new_tokens,
            num_in_flight_tokens=call.num_in_flight_tokens,
            num_lookahead_tokens=call.num_lookahead_tokens,
            num_new_token_ids=call.num_new_token_ids,
            token_ids=np.frombuffer(packed, dtype="<i4"),
            num_new_block_hashes=call.num_new_block_hashes,
            block_hashes=[digests[i : i + size] for i in range(0, len(digests), size)],
        )
        answer = out.allocated_batch
        answer.SetInParent()
        answer.num_run = result.num_run
        answer.refused = result.refused
        answer.changed_indices.extend(result.changed_indices)
        for ids in result.new_block_ids:
            for group in ids:
                answer.new_block_ids.extend(group)
                answer.num_new_block_ids.append(len(group))
        for heads in result.num_null_blocks:
            answer.num_null_blocks.extend(heads)
        answer.num_cached_tokens.extend(result.num_cached_tokens)
        data_plane = self.data_plane
        if data_plane is not None:  # who may write the new blocks
            for index, new_block_ids in zip(result.changed_indices, result.new_block_ids):
                data_plane.note_allocated(call.request_ids[index], new_block_ids)

    def _manager_cache_blocks(self, call: pb.ManagerCall.CacheBlocks, out: pb.ManagerResult) -> None:
        engine = self.engine
        engine.cache_blocks(call.request_id, call.num_tokens)
        answer = out.table
        answer.SetInParent()
        answer.num_cached_tokens = engine.estimate_cached_tokens(call.request_id)

    def _manager_remove_skipped_blocks(self, call: pb.ManagerCall.RemoveSkippedBlocks, out: pb.ManagerResult) -> None:
        engine = self.engine
        num_null_blocks = engine.remove_skipped_blocks(call.request_id, call.num_processed_tokens)
        answer = out.table
        answer.SetInParent()
        answer.num_null_blocks.extend(num_null_blocks)
        answer.num_cached_tokens = engine.estimate_cached_tokens(call.request_id)

    def _manager_free(self, call: pb.ManagerCall.Free, out: pb.ManagerResult) -> None:
        out.done.num_blocks = self.engine.free_owned(call.request_id, forget=call.forget)
        out.done.SetInParent()

    def _manager_pop_blocks_for_free(self, call: pb.ManagerCall.PopBlocksForFree, out: pb.ManagerResult) -> None:
        block_ids = self.engine.pop_blocks_for_free(call.request_id, forget=call.forget)
        out.popped_blocks.SetInParent()
        out.popped_blocks.block_ids.extend(block_ids)

    def _manager_free_blocks(self, call: pb.ManagerCall.FreeBlocks, out: pb.ManagerResult) -> None:
        out.done.num_blocks = self.engine.free_blocks(call.block_ids)
        out.done.SetInParent()

    def _manager_evict_blocks(self, call: pb.ManagerCall.EvictBlocks, out: pb.ManagerResult) -> None:
        num_blocks = self.engine.manager.kv_cache_config.num_blocks
        for block_id in call.block_ids:
            if not 0 < block_id < num_blocks:
                raise InvalidArgumentError("block_ids", f"block id {block_id} outside 1..{num_blocks - 1}")
        out.done.num_blocks = self.engine.manager.evict_blocks(call.block_ids)
        out.done.SetInParent()

    def _manager_reset_prefix_cache(self, call: pb.ResetPrefixCacheRequest, out: pb.ManagerResult) -> None:
        out.reset_prefix_cache.reset = self.engine.reset_prefix_cache()
        out.reset_prefix_cache.SetInParent()

    def _manager_estimate_cached_tokens(self, call: pb.ManagerCall.EstimateCachedTokens, out: pb.ManagerResult) -> None:
        out.cached_tokens.num_cached_tokens = self.engine.estimate_cached_tokens(call.request_id)
        out.cached_tokens.SetInParent()

    def _manager_get_num_blocks_to_allocate(
        self, call: pb.ManagerCall.GetNumBlocksToAllocate, out: pb.ManagerResult
    ) -> None:
        out.num_blocks.num_blocks = self.engine.get_num_blocks_to_allocate(
            call.request_id,
            call.num_tokens,
            call.num_computed_tokens,
            apply_admission_cap=call.apply_admission_cap,
            max_in_flight_tokens=call.max_in_flight_tokens if call.HasField("max_in_flight_tokens") else None,
        )
        out.num_blocks.SetInParent()

    async def ManagerStep(
        self, request: pb.ManagerStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.ManagerStepResponse:
        """Claim (or renew) the pool for ``owner``, run the calls in order until one fails, answer
        each; all their events form one batch (docs/ARCHITECTURE.md §9).

        Refused whole, with nothing run: past its deadline (DEADLINE_EXCEEDED), above
        ``max_step_ops`` calls (INVALID_ARGUMENT naming ``calls``), a bad owner or claim_ttl_s
        (INVALID_ARGUMENT), the pool claimed by another live owner (FAILED_PRECONDITION naming it),
        a malformed ``written_blocks`` or ``written_epoch`` (INVALID_ARGUMENT naming the entry and field;
        FAILED_PRECONDITION for another ``written_epoch`` or a server without KV memory). ``written_blocks`` are marked
        before the calls run (:meth:`kvservice.server.data_plane.DataPlane.mark_written_in_place`).
        """
        if self._deadline_passed(context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE_PASSED)
        calls = request.calls
        if len(calls) > self.max_step_ops:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"calls: {len(calls)} calls, above max_step_ops {self.max_step_ops}"
            )
        data_plane = self.data_plane
        if request.written_blocks:  # checked whole before anything runs, the claim included
            from kvservice.server.data_plane import NO_MEMORY, DataPlaneError

            if data_plane is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"written_blocks: {NO_MEMORY}")
            try:
                data_plane.check_written_in_place(request.written_blocks, request.written_epoch)
            except DataPlaneError as exc:
                await context.abort(exc.code, str(exc))
        engine = self.engine
        try:
            engine.claim_pool(request.owner, request.claim_ttl_s or DEFAULT_CLAIM_TTL_S)
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        response = pb.ManagerStepResponse()
        if request.written_blocks:
            assert data_plane is not None, "written_blocks were checked against the data plane"
            response.num_blocks_written, response.num_written_skipped = data_plane.mark_written_in_place(
                request.written_blocks
            )
        results = response.results
        handlers = self._manager_calls
        for call in calls:
            which = call.WhichOneof("call")
            out = results.add()
            try:
                if which is None:
                    raise InvalidArgumentError("call", "not set")
                handlers[which](getattr(call, which), out)
            except Exception as exc:
                code, message = status_for(exc)
                out.error.code = code.value[0]  # setting error clears the oneof's other member
                out.error.message = message
                break
        if request.release:
            engine.release_claim(request.owner)
        entry = self._publish()
        if entry is not None and request.return_events:
            response.events_msgpack = entry.msgpack
        response.num_free_blocks = engine.manager.block_pool.get_num_free_blocks()
        response.head_seq = self.event_log.head_seq
        response.epoch = self.event_log.epoch
        return response

    @_sends_serialized
    async def StreamEvents(self, request: pb.StreamEventsRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream batches from a seq, a snapshot or the live head (serialized once, shared)."""
        log = self.event_log
        try:
            payload_format = check_format(request.payload_format)
            group_idxs = log.check_filter(request.group_idxs)
            log.check_epoch_length(request.epoch)
            log.check_can_subscribe()  # max_streams: refused before a snapshot is asked for
            start = request.start
            snapshot = None
            if start == pb.EVENT_START_SEQ:
                log.check_start_seq(request.start_seq, request.epoch)
                next_seq = request.start_seq
            elif start == pb.EVENT_START_SNAPSHOT:
                snapshot = await self.snapshots.get(group_idxs)  # shared with every caller at this head
                next_seq = snapshot.seq + 1
                if next_seq < log.oldest_seq:
                    raise SeqOutOfRangeError(
                        f"the snapshot's watermark seq {snapshot.seq} left the retained log while it was cut "
                        f"(oldest {log.oldest_seq} of epoch {log.epoch}): ask for a snapshot again",
                        log.oldest_seq,
                    )
            elif start in (pb.EVENT_START_LIVE, pb.EVENT_START_UNSPECIFIED):
                if request.epoch and request.epoch != log.epoch:
                    raise EpochMismatchError(
                        f"epoch {request.epoch!r} is not this server's epoch {log.epoch!r} (the server restarted): "
                        "resync from a snapshot"
                    )
                next_seq = log.head_seq + 1
            else:
                raise InvalidArgumentError("start", f"unknown value {start}")
            sub = log.subscribe(next_seq, payload_format, group_idxs, handler=asyncio.current_task())
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        mid_snapshot = snapshot is not None  # a stream ended now has part of a snapshot, no seq to resume from
        try:
            if snapshot is not None:
                rank = log.data_parallel_rank
                budget = self.snapshots.budget  # shared by every snapshot stream: bounds the loop's writing
                async for i, more in snapshot.iter_parts():
                    data = await encoded_snapshot_part_in_steps(
                        snapshot, i, more=more, payload_format=payload_format, epoch=log.epoch, data_parallel_rank=rank
                    )
                    async with budget.held(len(data)):  # until written, or the budget's hold_s
                        await self._write(context, sub, data, snapshot.seq)
                mid_snapshot = False
            while True:
                sub.raise_if_ended()
                entries = log.entries_from(sub.next_seq)
                if not entries:
                    await log.wait_for(sub)
                    continue
                for entry in entries:
                    await self._write(context, sub, encoded_batch(log, entry, payload_format, group_idxs), entry.seq)
                    sub.next_seq = entry.seq + 1
                    sub.raise_if_ended()
        except KVServiceDomainError as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
        except asyncio.CancelledError:
            if sub.num_write_timeouts == 0 and not sub.abandoned:
                raise  # the client went away
            # We cut it (a write timed out): end the call with a status, or it would stay open on
            # the wire, its pending message buffered, until the connection closes.
            if sub.num_write_timeouts:
                self.num_stream_write_timeouts += 1
            log.unsubscribe(sub)
            if sub.num_write_timeouts:
                code, message = (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    (
                        f"stream cut: a write took over stalled_write_timeout_s {sub.stalled_write_timeout_s:g} s (the "
                        f"client is not reading); last seq delivered {sub.last_seq} of epoch {log.epoch}"
                    ),
                )
            else:  # ended (fell behind, shutdown) while blocked in a write: that status
                code, message = status_for(sub.ended.result()(sub.last_seq))
            if mid_snapshot:  # what "last seq delivered" would claim is not whole on the client
                assert snapshot is not None
                message = (
                    f"{message.split('; last seq delivered')[0]}; cut mid-snapshot (seq {snapshot.seq} of epoch "
                    f"{log.epoch}, not all of its parts delivered): start again from a snapshot"
                )
            abort = context.abort(code, message)
            try:
                await asyncio.wait_for(abort, sub.stalled_write_timeout_s)
            except asyncio.TimeoutError:
                raise asyncio.CancelledError from None
        finally:
            log.unsubscribe(sub)

    async def _write(self, context: grpc.aio.ServicerContext, sub: Subscriber, data: bytes, seq: int) -> None:
        """Write one message unless the subscription was ended (then raise its error).

        A message handed to gRPC cannot be taken back and no status can follow while it is in
        flight, so an ended subscriber's pending write is left to finish (a reading client
        finishes it) and the status then names that message's seq as the last delivered. Every
        write has ``EventLogConfig.stalled_write_timeout_s`` to complete, behind or not: a client
        that stops reading, or whose connection died without a word, is cut off then
        (DEADLINE_EXCEEDED naming ``stalled_write_timeout_s`` and the last seq delivered). A stream so holds at most one message (``max_message_bytes``) in the server
        beyond gRPC's HTTP/2 flow-control window.
        """
        sub.raise_if_ended()
        if len(data) > self.max_message_bytes:
            raise CapacityExceededError(
                f"batch seq {seq} is {len(data)} bytes, above max_message_bytes {self.max_message_bytes}; "
                f"last seq delivered {sub.last_seq}: raise max_message_bytes to read it"
            )
        timer = asyncio.get_running_loop().call_later(sub.stalled_write_timeout_s, sub.write_timed_out)
        try:
            await context.write(data)
        finally:
            timer.cancel()

    @_sends_serialized
    async def TakeEvents(self, request: pb.TakeEventsRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Pull batches after a named consumer's cursor (the answer serialized here: a snapshot's
        parts are the bytes its streams get, joined; see :meth:`_snapshot_for_take`)."""
        log = self.event_log
        if self._deadline_passed(context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE_PASSED)
        snapshot_parts: list[bytes] = []
        try:
            payload_format = check_format(request.payload_format)
            group_idxs = log.check_filter(request.group_idxs)
            log.check_epoch_length(request.epoch)
            # A take with snapshot=true restarts the consumer: the epoch it knew does not matter.
            if request.epoch and not request.start_seq and not request.snapshot and request.epoch != log.epoch:
                raise EpochMismatchError(
                    f"epoch {request.epoch!r} is not this server's epoch {log.epoch!r} (the server restarted): "
                    "take with snapshot=true"
                )
            log.check_consumer(request.consumer)
            if request.start_seq:
                log.check_start_seq(request.start_seq, request.epoch)
            previous = log.consumer_cursor(request.consumer)
            max_bytes = log.config.max_take_bytes
            snapshot_seq = None
            if request.snapshot:
                snapshot_seq, snapshot_parts = await self._snapshot_for_take(group_idxs, payload_format, max_bytes)
                max_bytes -= sum(len(data) + 8 for data in snapshot_parts)
            messages: dict[int, pb.EventBatch] = {}

            def size_of(entry: LogEntry) -> int:
                msg = messages[entry.seq] = batch_message(entry, payload_format, group_idxs)
                return msg.ByteSize() + 8  # + the field's tag and length

            entries, next_seq = log.take(
                request.consumer,
                max_batches=request.max_batches,
                start_seq=request.start_seq,
                epoch=request.epoch,
                snapshot_seq=snapshot_seq,
                size_of=size_of,
                max_bytes=max_bytes,
            )
            response = pb.TakeEventsResponse(
                batches=[messages[entry.seq] for entry in entries], next_seq=next_seq, epoch=log.epoch
            )
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)

        def restore_if_cancelled(ctx: grpc.aio.ServicerContext) -> None:
            # The cursor stays put if the answer never reaches the consumer (deadline, cancellation).
            if ctx.cancelled():
                log.restore_consumer(request.consumer, previous, next_seq)

        _on_done(context, restore_if_cancelled)
        if not snapshot_parts:
            return response.SerializeToString()
        # Written within the snapshot streams' shared budget, as their parts are: one answer of up
        # to max_take_bytes is one write start on the loop, taken in turn and at the budget's rate.
        num_bytes = sum(len(data) for data in snapshot_parts)
        finish = await self.snapshots.budget.admit(num_bytes)
        _on_done(context, lambda ctx: finish())
        if num_bytes < _JOIN_BESIDE_THE_LOOP_BYTES:
            return take_response(snapshot_parts, response)
        # A join of 1 MiB or more copies its bytes with the GIL released: the loop runs meanwhile.
        return await asyncio.to_thread(take_response, snapshot_parts, response)

    async def _snapshot_for_take(
        self, group_idxs: tuple[int, ...] | None, payload_format: int, max_bytes: int
    ) -> tuple[int, list[bytes]]:
        """A snapshot for one TakeEvents answer: its watermark seq and its parts, each a serialized
        ``EventBatch``, made as a stream's are (:func:`encoded_snapshot_part_in_steps`: in steps that
        yield to the loop, once per payload format and shared with every stream and take at that
        head), so building the answer never holds the loop for more than a step.

        Raises:
            CapacityExceededError: the snapshot is above ``max_bytes``: at once (before any cut)
                when its lower bound (:meth:`SnapshotSource.min_bytes`) is, else once its parts
                are made (the size named exactly).
        """
        bound = self.snapshots.min_bytes(group_idxs)
        if bound > max_bytes:
            raise CapacityExceededError(
                f"snapshot is at least {bound} bytes, above max_take_bytes {max_bytes} a TakeEvents answer carries: "
                "take it with StreamEvents (sent in parts)"
            )
        snapshot = await self.snapshots.get(group_idxs)
        log = self.event_log
        parts = []
        async for i, more in snapshot.iter_parts():
            parts.append(
                await encoded_snapshot_part_in_steps(
                    snapshot,
                    i,
                    more=more,
                    payload_format=payload_format,
                    epoch=log.epoch,
                    data_parallel_rank=log.data_parallel_rank,
                )
            )
            await asyncio.sleep(0)  # a turn between parts too: parts of fewer tokens than a step add up
        size = sum(len(data) + 8 for data in parts)
        if size > max_bytes:
            raise CapacityExceededError(
                f"snapshot is {size} bytes, above max_take_bytes {max_bytes} a TakeEvents answer carries: "
                "take it with StreamEvents (sent in parts)"
            )
        return snapshot.seq, parts

    async def GetKVCacheGroupMetadata(
        self, request: pb.GetKVCacheGroupMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetKVCacheGroupMetadataResponse:
        """Per-group layout, the hash rule, the epoch and the head seq."""
        response = pb.GetKVCacheGroupMetadataResponse()
        response.CopyFrom(self.metadata)
        response.head_seq = self.event_log.head_seq
        return response

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingResponse:
        """Echo the payload, with the server's build info."""
        return pb.PingResponse(payload=request.payload, build_info=self.metadata.build_info)

    # -- data plane (kvservice.server.data_plane) ---------------------------------------------

    async def _data_plane_call(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[DataPlane], Awaitable[_Result]],
        raw_messages: AsyncIterator[bytes] | None = None,
    ) -> _Result:
        """``call(data_plane)``, its refusals as their status. With ``raw_messages`` (a client
        stream's), a refused call first reads and drops what the client still sends
        (:meth:`_drain_stream`: up to :data:`DRAIN_WRITE_BYTES`, bounded in time), so the client
        gets the status and not gRPC's INTERNAL; a stream cut for stalling is not drained."""
        from kvservice.server.data_plane import NO_MEMORY, DataPlaneError, DataStreamStalled

        if self.data_plane is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_MEMORY)
        try:
            return await call(self.data_plane)
        except DataStreamStalled as exc:  # a message in flight to a client not reading holds the status back
            try:
                await asyncio.wait_for(context.abort(exc.code, str(exc)), self.data_plane.stalled_timeout_s)
            except asyncio.TimeoutError:
                raise asyncio.CancelledError from None
            raise  # pragma: no cover (abort raises)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # DataPlaneError's own status, else the one table (INTERNAL, logged)
            code, message = (exc.code, str(exc)) if isinstance(exc, DataPlaneError) else status_for(exc)
        # Drained outside the except block: the refusal's traceback (and the block being assembled
        # in its frames) is let go first.
        if raw_messages is not None:
            dp = self.data_plane
            await self._drain_stream(raw_messages, max(DRAIN_WRITE_BYTES, dp.window_bytes + dp.chunk_bytes))
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    async def AttachKVCache(
        self, request: pb.AttachKVCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachKVCacheResponse:
        """Describe the KV memory for a same-host worker (shared memory or CUDA IPC)."""

        async def call(dp: DataPlane) -> pb.AttachKVCacheResponse:
            return dp.attach(context.peer())

        return await self._data_plane_call(context, call)

    async def WriteBlocks(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.WriteBlocksResponse:
        """Write whole blocks' contents (client streaming; the chunks arrive as bytes, parsed by
        :func:`_parsed_stream`: one that does not parse is INVALID_ARGUMENT)."""
        chunks = _parsed_stream(request_iterator, pb.WriteBlocksChunk, "chunks")
        return await self._data_plane_call(context, lambda dp: dp.write_blocks(chunks), request_iterator)

    @_sends_serialized
    async def ReadBlocks(self, request: pb.ReadBlocksRequest, context: grpc.aio.ServicerContext) -> None:
        """Read blocks' contents (server streaming; chunks serialized on the data plane's threads)."""
        await self._data_plane_call(context, lambda dp: dp.read_blocks(request, context.write))

    # -- tier (kvservice.core.tier): blocks named by hash alone (docs/tier.md) ---------------

    def _tier(self, needs_memory: bool) -> Any:
        """The engine's TierStore (FAILED_PRECONDITION when the server has none, or, for a call
        that moves bytes through the memory, when there is no memory)."""
        from kvservice.server.data_plane import NO_MEMORY

        tier = self.engine.tier
        if tier is None:
            raise PreconditionFailedError("this server offers no tier calls")
        if needs_memory and (self.data_plane is None or not self.data_plane.has_memory):
            raise PreconditionFailedError(NO_MEMORY)
        return tier

    async def _tier_call(self, context: grpc.aio.ServicerContext, call: Callable[[], _Result]) -> _Result:
        """Run a tier call with no await inside, publish its events (one batch), map its errors."""
        try:
            result = call()
        except Exception as exc:
            self.engine.manager.block_pool.take_events()  # nothing of a refused call is published
            code, message = status_for(exc)
            await context.abort(code, message)
        self._publish()
        return result

    def _readable(self) -> Any:
        """The tier's ``readable`` predicate: a cached block is present for LookupBlocks and
        LeaseBlocks only when its bytes may be read under its hash (``DataPlane.readable_by_hash``);
        None (every cached block) on a server without memory."""
        dp = self.data_plane
        if dp is None or not dp.has_memory:
            return None
        return lambda group_idx, block: dp.readable_by_hash(block.block_id)

    async def LookupBlocks(
        self, request: pb.LookupBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupBlocksResponse:
        """Which keys are cached and readable; no side effect unless ``touch`` (docs/tier.md)."""

        def call() -> pb.LookupBlocksResponse:
            result = self._tier(False).lookup(
                request.group_idx,
                request.block_hashes,
                group_idxs=request.group_idxs,
                touch=request.touch,
                readable=self._readable(),
            )
            return pb.LookupBlocksResponse(present=result.present, num_prefix_blocks=result.num_prefix_blocks)

        return await self._tier_call(context, call)

    def _reserve(self, request: pb.ReserveBlocksRequest) -> Any:
        tier = self._tier(True)
        tokens = None
        if request.packed_token_ids:
            if len(request.packed_token_ids) % 4:
                raise InvalidArgumentError(
                    "packed_token_ids",
                    f"{len(request.packed_token_ids)} bytes, not a multiple of 4 (little-endian int32 token ids)",
                )
            tokens = np.frombuffer(request.packed_token_ids, dtype="<i4").tolist()
        return tier.reserve(
            request.group_idx,
            request.block_hashes,
            parent_block_hashes=request.parent_block_hashes,
            token_ids=tokens,
            ttl_s=request.ttl_s,
            now=self.engine.clock(),
        )

    async def ReserveBlocks(
        self, request: pb.ReserveBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveBlocksResponse:
        """Reserve blocks for keys under a put lease (docs/tier.md)."""

        def call() -> pb.ReserveBlocksResponse:
            r = self._reserve(request)
            return pb.ReserveBlocksResponse(
                reserved=r.reserved,
                lease_id=r.lease_id,
                status=r.status,
                block_ids=r.block_ids,
                ttl_s=r.ttl_s,
                lease_slot=r.slot,
            )

        return await self._tier_call(context, call)

    async def CommitBlocks(
        self, request: pb.CommitBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitBlocksResponse:
        """Commit a put lease: BlockStored now (docs/tier.md)."""

        def call() -> pb.CommitBlocksResponse:
            committed, num = self._tier(False).commit(request.lease_id, now=self.engine.clock())
            return pb.CommitBlocksResponse(committed=committed, num_blocks_stored=num)

        return await self._tier_call(context, call)

    async def LeaseBlocks(
        self, request: pb.LeaseBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseBlocksResponse:
        """Pin cached blocks for a copy through the attached memory (docs/tier.md)."""

        def call() -> pb.LeaseBlocksResponse:
            r = self._tier(True).lease(
                request.group_idx,
                request.block_hashes,
                ttl_s=request.ttl_s,
                now=self.engine.clock(),
                readable=self._readable(),
                release_lease_ids=request.release_lease_ids,
            )
            return pb.LeaseBlocksResponse(
                lease_id=r.lease_id, block_ids=r.block_ids, num_leased=r.num_leased, ttl_s=r.ttl_s, lease_slot=r.slot
            )

        return await self._tier_call(context, call)

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        """End a lease; ``valid`` says whether it was live until now (docs/tier.md)."""

        def call() -> pb.ReleaseLeaseResponse:
            r = self._tier(False).release(request.lease_id, now=self.engine.clock())
            return pb.ReleaseLeaseResponse(valid=r.valid, num_blocks=r.num_blocks)

        return await self._tier_call(context, call)

    async def PutBlocks(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PutBlocksResponse:
        """Reserve, write and commit in one client stream (docs/tier.md): a bad chunk is
        INVALID_ARGUMENT and stores nothing of the call (its reservation freed, no event)."""
        from kvservice.server.data_plane import _BlockBytes

        lease_id = 0
        raw_messages = request_iterator
        num_announced_bytes = 0  # what the header's keys may still send; drained on a refusal
        request_iterator = _put_stream(request_iterator)
        try:
            first = await anext(aiter(request_iterator), None)
            if not isinstance(first, pb.PutBlocksMessage) or first.WhichOneof("message") != "header":
                raise InvalidArgumentError("header", "the first PutBlocks message must be the header")
            num_announced_bytes = len(first.header.block_hashes) * self._max_block_bytes()
            reserved = self._reserve(first.header)
            self._publish()  # evictions the reservation made
            if not reserved.reserved:
                return pb.PutBlocksResponse(reserved=False)
            lease_id = reserved.lease_id
            assert self.data_plane is not None
            dp = self.data_plane
            group_idx = first.header.group_idx
            size = dp.tensors.bytes_per_block(group_idx)
            chunk_bytes = dp.chunk_bytes
            status = list(reserved.status)
            write_order = [i for i, st in enumerate(status) if st == 1]
            written = dict.fromkeys(write_order, False)
            done: set[int] = set()
            current = -1
            received = 0
            staging = bytearray(size)
            hasher = xxhash.xxh3_64()
            num_bytes = 0
            index = 0
            tier = self._tier(False)
            lapsed = False  # the put lease ended while the stream was read: no more writes into its blocks

            def may_write() -> bool:
                # Checked right before each block write, nothing awaited between: a lease that
                # expired meanwhile gave its blocks back (another put may hold them now).
                nonlocal lapsed
                lapsed = lapsed or not tier.live(lease_id, now=self.engine.clock())
                return not lapsed

            async for message in request_iterator:
                index += 1
                where = f"messages[{index}].chunk"
                if isinstance(message, WireChunk):
                    chunk = message
                elif message.WhichOneof("message") != "chunk":
                    raise InvalidArgumentError(f"messages[{index}]", "only the first message is the header")
                else:
                    parsed = message.chunk
                    checksum = parsed.checksum if parsed.HasField("checksum") else None
                    chunk = WireChunk(parsed.block_index, parsed.offset_bytes, memoryview(parsed.data), checksum)
                k = chunk.block_index
                if not 0 <= k < len(status):
                    raise InvalidArgumentError(f"{where}.block_index", f"{k} is out of range [0, {len(status)})")
                if k != current:
                    if current >= 0:
                        raise InvalidArgumentError(
                            f"{where}.block_index",
                            f"{k} starts before block {current} is complete ({received} of {size} bytes)",
                        )
                    if k in done or (done and k < max(done)):
                        raise InvalidArgumentError(f"{where}.block_index", f"{k}: blocks go in key order, each once")
                    if chunk.offset_bytes != 0:
                        raise InvalidArgumentError(
                            f"{where}.offset_bytes", f"{chunk.offset_bytes}; a block's first chunk starts at 0"
                        )
                    current, received = k, 0
                    hasher.reset()
                elif chunk.offset_bytes != received:
                    raise InvalidArgumentError(f"{where}.offset_bytes", f"{chunk.offset_bytes}, expected {received}")
                data = chunk.data
                if not 1 <= len(data) <= chunk_bytes or received + len(data) > size:
                    raise InvalidArgumentError(
                        f"{where}.data",
                        f"{len(data)} bytes at offset {received}; chunks are 1..{chunk_bytes} bytes (max_data_chunk_bytes) "
                        f"within the block's {size} bytes",
                    )
                # A block in one chunk goes straight into its reserved block (the put lease's alone,
                # uncached and unread until the commit; a refused call frees it uncached), not
                # through the staging buffer.
                direct = received == 0 and len(data) == size and k in written
                if direct and may_write():
                    _BlockBytes(dp.tensors.block_view(group_idx, reserved.block_ids[k])).write(data)
                else:
                    staging[received : received + len(data)] = data
                hasher.update(data)
                received += len(data)
                if received < size:
                    if chunk.checksum is not None:
                        raise InvalidArgumentError(
                            f"{where}.checksum", "set on a chunk that does not complete the block"
                        )
                    continue
                if chunk.checksum is None or chunk.checksum != hasher.intdigest():
                    raise InvalidArgumentError(
                        f"{where}.checksum",
                        f"missing or not the xxh3_64 of block {k}'s bytes; nothing of the call was stored",
                    )
                if k in written:  # a key found PRESENT or IN_FLIGHT: its bytes are dropped
                    if not direct and may_write():
                        block_id = reserved.block_ids[k]
                        _BlockBytes(dp.tensors.block_view(group_idx, block_id)).write(memoryview(staging))
                    written[k] = True
                    num_bytes += size
                done.add(k)
                current = -1
            if current >= 0:
                raise InvalidArgumentError(
                    "chunks", f"the stream ended inside block {current} ({received} of {size} bytes)"
                )
            committed, _ = tier.commit(lease_id, now=self.engine.clock(), written=[written[i] for i in write_order])
            lease_id = 0
            self._publish()
            block_ids = list(reserved.block_ids)
            for i in write_order:
                if not written[i]:
                    status[i], block_ids[i] = 0, 0
            if not committed:  # expired while the bytes streamed
                for i in write_order:
                    status[i], block_ids[i] = 0, 0
            num_written = sum(written.values()) if committed else 0
            return pb.PutBlocksResponse(
                reserved=True,
                status=status,
                block_ids=block_ids,
                num_blocks_written=num_written,
                num_bytes_written=num_bytes if committed else 0,
                lease_expired=bool(reserved.lease_id) and not committed,  # 0: nothing was reserved
            )
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message = status_for(exc)
            if lease_id and self.engine.tier is not None:  # nothing of the call stored, before any await
                self.engine.tier.release(lease_id, now=self.engine.clock())
                lease_id = 0
            await self._drain_stream(raw_messages, num_announced_bytes)
            await context.abort(code, message)
        finally:
            if lease_id and self.engine.tier is not None:  # cancelled mid-stream: nothing stored
                self.engine.tier.release(lease_id, now=self.engine.clock())

    def _max_block_bytes(self) -> int:
        """The largest block of any group, bytes (0 without memory)."""
        dp = self.data_plane
        if dp is None or not dp.has_memory:
            return 0
        return max(dp.tensors.bytes_per_block(g) for g in range(self.engine.manager.num_groups))

    async def _drain_stream(self, raw_messages: AsyncIterator[bytes], num_bytes: int) -> None:
        """Read and drop what a refused client stream's client still sends: until it half-closes,
        or up to ``num_bytes`` (a PutBlocks: the bytes its header announced; a WriteBlocks:
        :data:`DRAIN_WRITE_BYTES`) + 64 KiB, each message counted at least as its 5-byte frame
        prefix, or until the client is quiet for :data:`DRAIN_IDLE_S` (or
        ``stalled_write_timeout_s``, if less), or :data:`DRAIN_MAX_S` have passed.

        grpc.aio's client (grpcio 1.85; grpc/grpc#36066) reports a write that fails because the
        server ended the call first as ``INTERNAL: Internal error from Core``, in place of the
        status the server sent: so the status goes out once the client has half-closed (what it
        sent is dropped: the refused call writes nothing more). A client still sending past those
        bounds gets the status then (and may see that INTERNAL)."""
        budget = num_bytes + 65536
        stalled_s = self.data_plane.stalled_timeout_s if self.data_plane is not None else 30.0
        idle_s = min(DRAIN_IDLE_S, stalled_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_MAX_S
        messages = aiter(raw_messages)
        try:
            while budget > 0 and (left := deadline - loop.time()) > 0:
                data = await asyncio.wait_for(anext(messages), min(idle_s, left))
                budget -= len(data) + _GRPC_MESSAGE_PREFIX_BYTES
        except (StopAsyncIteration, asyncio.TimeoutError):
            pass
        except grpc.aio.AioRpcError:  # pragma: no cover (the call ended under us: nothing to drain)
            pass

    # -- registration ---------------------------------------------------------------------

    def _step_op_handler(self, op: Callable[[Any], Any]) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The unary RPC of a Step op that has no handler of its own: the op, as :meth:`_unary` runs it."""

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._unary(op, request, context)

        return handler

    def generic_handler(self, service: ServiceTable = KV_CACHE_SERVICE) -> grpc.GenericRpcHandler:
        """Method handlers for every RPC of ``service`` (default: kvservice.v1's own table), each
        the servicer's method of the RPC's name, of the RPC's kind, with its request and response
        types (see :mod:`kvservice_client.rpc_table`). A unary RPC that is also a Step op needs no
        method of its own: without one, it runs the Step op's (``_<op>``) as a unary call.

        A request that does not parse is answered INVALID_ARGUMENT (:func:`_parsed`); a handler marked
        :func:`_sends_serialized` sends bytes serialized once for every reader (StreamEvents, TakeEvents).

        Raises:
            TypeError: an RPC of ``service`` without a handler method (named).
        """
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for rpc in service:
            method = getattr(self, rpc.name, None)
            if method is None and rpc.step_op is not None and not (rpc.request_streaming or rpc.response_streaming):
                method = self._step_op_handler(self._ops[rpc.step_op])
            if method is None:
                raise TypeError(f"{type(self).__name__} has no handler {rpc.name} for {rpc.method}")
            response_serializer = None if getattr(method, _SENDS_SERIALIZED, False) else rpc.response.SerializeToString
            make = getattr(grpc, f"{rpc.kind}_rpc_method_handler")
            if rpc.request_streaming:  # the handler parses the messages of the stream (_parsed_stream)
                handlers[rpc.name] = make(method, request_deserializer=None, response_serializer=response_serializer)
            else:
                handlers[rpc.name] = make(
                    _parsed(method, rpc.request), request_deserializer=None, response_serializer=response_serializer
                )
        return grpc.method_handlers_generic_handler(service.name, handlers)


def _unpack_prompt(packed: bytes, num_repeated: int) -> Any:
    """``GetComputedBlocksRequest.packed_prompt_token_ids`` as an int32 array (no copy), checked:
    little-endian int32, 4 bytes a token id, and not beside ``prompt_token_ids`` (the ids' range
    and the length are the engine's checks; the caller names this field in their errors).

    Raises:
        InvalidArgumentError: (INVALID_ARGUMENT) naming ``packed_prompt_token_ids`` and the bound.
    """
    if num_repeated:
        raise InvalidArgumentError(
            "packed_prompt_token_ids", f"set with {num_repeated} prompt_token_ids: set one of the two"
        )
    if len(packed) % 4:
        raise InvalidArgumentError(
            "packed_prompt_token_ids", f"{len(packed)} bytes, not a multiple of 4 (little-endian int32 token ids)"
        )
    return np.frombuffer(packed, dtype="<i4")


def _parsed(method: Callable[[Any, grpc.aio.ServicerContext], Any], request_type: Any) -> Callable[..., Any]:
    """``method`` taking the request's raw bytes: a message that does not parse is answered
    INVALID_ARGUMENT naming the string field that is not UTF-8, else ``request`` (gRPC's own
    deserializer failure would be UNKNOWN, naming Python classes)."""

    async def handler(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = request_type.FromString(data)
        except DecodeError as e:
            name = request_type.DESCRIPTOR.full_name
            field = invalid_utf8_field(request_type.DESCRIPTOR, data)
            message = (
                f"{field}: not valid UTF-8 (a string of {name})" if field else f"request: not a valid {name} ({e})"
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        note_request(request)
        return await method(request, context)

    return handler


async def _parsed_stream(messages: AsyncIterator[bytes], request_type: Any, field: str) -> AsyncIterator[Any]:
    """The messages of a client stream (raw bytes: registered without a deserializer), parsed; one
    that does not parse raises InvalidArgumentError naming it (``{field}[i]``) and the string field
    that is not UTF-8, as :func:`_parsed` does for unary requests (gRPC's own deserializer failure
    is INTERNAL with a traceback).

    Raises:
        InvalidArgumentError: (INVALID_ARGUMENT) a message that is not a ``request_type``.
    """
    index = 0
    async for data in messages:
        yield _parse_message(data, request_type, field, index)
        index += 1


def _parse_message(data: bytes, request_type: Any, field: str, index: int) -> Any:
    """``data`` parsed as a ``request_type``, the stream's message ``index``.

    Raises:
        InvalidArgumentError: it does not parse (named ``{field}[index]``, with the string field
            that is not UTF-8).
    """
    try:
        return request_type.FromString(data)
    except DecodeError as e:
        name = request_type.DESCRIPTOR.full_name
        bad = invalid_utf8_field(request_type.DESCRIPTOR, data)
        raise InvalidArgumentError(
            f"{field}[{index}]" + (f".{bad}" if bad else ""),
            f"not valid UTF-8 (a string of {name})" if bad else f"not a valid {name} ({e})",
        ) from None


async def _put_stream(messages: AsyncIterator[bytes]) -> AsyncIterator[pb.PutBlocksMessage | WireChunk]:
    """A PutBlocks stream's messages: a chunk as kvservice's clients send it read in place
    (:func:`kvservice.server.wire.put_chunk`: its data a view of the received bytes, not copied
    twice more), any other message parsed as :func:`_parsed_stream` parses it (the same errors)."""
    index = 0
    async for data in messages:
        chunk = put_chunk(data) if index else None
        yield chunk if chunk is not None else _parse_message(data, pb.PutBlocksMessage, "messages", index)
        index += 1


def build_metadata_response(
    engine: KVCacheEngine,
    *,
    epoch: str,
    device: str,
    dtypes: list[str | None],
    preset: str,
    data_parallel_rank: int | None,
) -> pb.GetKVCacheGroupMetadataResponse:
    """The ``GetKVCacheGroupMetadata`` answer for an engine (computed once at start)."""
    meta = engine.manager.get_kv_cache_group_metadata()
    response = pb.GetKVCacheGroupMetadataResponse(
        hash_algorithm=meta.hash_algorithm or "",
        hash_seed=meta.hash_seed or "",
        hash_block_size=meta.hash_block_size,
        epoch=epoch,
        block_hash_format=pb.BLOCK_HASH_FORMAT_DIGEST
        if meta.block_hash_format == "digest"
        else pb.BLOCK_HASH_FORMAT_INT64,
        medium=meta.medium,
        max_model_len=engine.max_model_len,
        preset=preset,
        build_info=pb.BuildInfo(**build_info()),
    )
    if data_parallel_rank is not None:
        response.data_parallel_rank = data_parallel_rank
    for g, dtype in zip(meta.groups, dtypes, strict=True):
        group = response.groups.add(
            group_idx=g.group_idx,
            kind=kv_cache_spec_kind_to_proto(g.kind),
            block_size=g.block_size,
            num_blocks=g.num_blocks,
            dtype=dtype or g.dtype or "",
            bytes_per_block=g.block_bytes,
            device=device,
            num_layers=g.num_layers,
            page_size_bytes=g.page_size_bytes,
        )
        if g.sliding_window is not None:
            group.sliding_window = g.sliding_window
        if g.attention_chunk_size is not None:
            group.attention_chunk_size = g.attention_chunk_size
    # Issue 12: the layers of each group and where each KV cache tensor places them in the pool.
    kv_cache_config = engine.manager.kv_cache_config
    for group, spec_group in zip(response.groups, kv_cache_config.kv_cache_groups, strict=True):
        group.layer_names.extend(spec_group.layer_names)
    for tensor in kv_cache_config.kv_cache_tensors:
        spec = tensor.kv_cache_spec
        response.kv_cache_tensors.add(
            group_idx=tensor.group_idx,
            layer_names=tensor.layer_names,
            size_bytes=tensor.size,
            offset_bytes=tensor.offset,
            layer_stride_bytes=tensor.layer_stride,
            block_stride_bytes=tensor.block_stride,
            page_size_bytes=getattr(spec, "real_page_size_bytes", spec.page_size_bytes),
            dtype=getattr(spec, "dtype", "uint8"),
        )
    response.pool_bytes_per_block = kv_cache_config.block_bytes
    return response
