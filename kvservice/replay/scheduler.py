"""A continuous-batching scheduler client that replays a trace through the service.

It behaves like vLLM's scheduler in simulated time, talking to the service only through ``Step``
RPCs (one per scheduler step in the common case):

* time: a simulated clock advances ``step_ms`` per step; a request joins the waiting queue once
  the clock passes its arrival; an idle scheduler jumps to the next arrival. Wall time is as fast
  as the service answers (time compression).
* each step: one ``Step`` RPC carries the frees of requests that finished last step and, for
  running requests oldest first, a prefill chunk (chunked prefill) or one decode token (the token
  sampled last step is appended), within the token budget ``max_num_batched_tokens``: each run of
  consecutive decodes is one ``decode`` op (packed arrays, answering only what changed; the same
  semantics as one ``allocate_slots`` with ``new_token_ids`` per request, in the same order). Then, if no request was preempted, waiting requests are admitted
  (``GetComputedBlocks`` + ``AllocateSlots``) while fewer than ``max_num_seqs`` run and budget is
  left. Each admission is its own ``Step`` round trip: the hit of a request depends on blocks the
  ops before it cached or evicted, so a watcher can predict it exactly only once it has applied
  their batch (admissions are few next to decode steps: about one extra round trip per request).
* preemption: when a running request's allocation fails, the newest running request is preempted
  (freed on the server, its tokens so far, outputs included, become its prompt, and it goes to the
  front of the waiting queue to be recomputed later), and the allocation is retried, as vLLM does
  (``Scheduler.schedule``, recompute preemption). An admission that fails stops admissions for the
  step; the request stays waiting.
* a request finishes when it has generated ``output_length`` tokens (the first one is sampled by
  the step that completes its prefill), or when one more token would exceed ``max_model_len`` (as
  vLLM stops at the length cap); it is freed at the start of the next step. A trace request whose
  prompt alone is ``max_model_len`` tokens or longer is skipped (a server rejects it) and counted.

An optional *kv worker* (``kvservice.replay.kv_data.KVDataWorker``) is told every allocation,
admission and free, and flushed after every Step RPC that allocated, before the next one: it writes
the blocks the allocation computed and checks a new admission's hit blocks, so block contents move
in the same order the cache changes.

Before each admission an optional *predictor* is asked for the hit it expects (a watcher's mirror);
it is given ``head_seq``, the newest batch the service published (``StepResponse.head_seq``), and
waits until its watcher has applied it, so predictions and hits describe the same cache state.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvservice.replay.traces import TraceRequest, output_token_ids
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVServiceError
from kvservice_client.request_builders import pack_token_ids
from kvservice_client.step import decode_new_block_ids

__all__ = ["Admission", "ReplayRequest", "ReplayScheduler", "SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits (vLLM's names).

    Attributes:
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        step_ms: simulated milliseconds per step.
        kv_cache_report_mode: "incremental" or "full", sent with every request.
        send_session_id: send the trace's (derived) session id.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    step_ms: float = 20.0
    kv_cache_report_mode: str = "incremental"
    send_session_id: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if not (math.isfinite(self.step_ms) and self.step_ms > 0):
            raise ValueError(f"step_ms must be a finite number > 0; got {self.step_ms}")
        if self.kv_cache_report_mode not in ("incremental", "full"):
            raise ValueError(f"kv_cache_report_mode must be 'incremental' or 'full'; got {self.kv_cache_report_mode!r}")


class ReplayRequest:
    """A trace request as the scheduler tracks it."""

    __slots__ = (
        "trace",
        "index",
        "request_id",
        "token_ids",
        "num_computed_tokens",
        "num_generated",
        "pending_token",
        "outputs",
        "num_preemptions",
    )

    def __init__(self, trace: TraceRequest, index: int) -> None:
        self.trace = trace
        self.index = index
        self.request_id = trace.request_id
        self.token_ids: array = array("i", trace.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_generated = 0
        self.pending_token: int | None = None
        self.outputs = output_token_ids(trace.request_id, max(trace.output_length, 1))
        self.num_preemptions = 0

    @property
    def finished(self) -> bool:
        """Generated every output token."""
        return self.num_generated >= max(self.trace.output_length, 1)

    def sample(self) -> None:
        """The step that computed every token produced the next output token."""
        self.pending_token = self.outputs[self.num_generated]
        self.num_generated += 1

    def preempt(self) -> None:
        """Forget the computed state: the tokens so far (pending one included) are recomputed."""
        if self.pending_token is not None:
            self.token_ids.append(self.pending_token)
            self.pending_token = None
        self.num_computed_tokens = 0
        self.num_preemptions += 1


@dataclass(frozen=True, slots=True)
class Admission:
    """One admission of a request (a preempted request is admitted again later).

    Attributes:
        index: the request's position in the trace (0-based).
        request_id: its id.
        num_tokens: tokens it was admitted with (prompt, plus outputs after a preemption).
        predicted_hit_tokens: the first predictor's expected hit in tokens (None without one).
        actual_hit_tokens: the hit the server used.
        readmission: True after a preemption.
        predictions: every predictor's expected hit (tokens; None for one not asked).
    """

    index: int
    request_id: str
    num_tokens: int
    predicted_hit_tokens: int | None
    actual_hit_tokens: int
    readmission: bool
    predictions: tuple[int | None, ...] = ()

    def prediction(self, i: int) -> int:
        """Predictor ``i``'s expected hit (tokens; ``i`` may be negative, as for a tuple).

        Raises:
            AssertionError: predictor ``i`` was not asked for this admission.
        """
        value = self.predictions[i]
        assert value is not None, f"request {self.index}: predictor {i} was not asked"
        return value


@dataclass
class SchedulerStats:
    """What a replay did.

    Attributes:
        admissions: every admission, in order.
        num_steps: scheduler steps.
        num_rpcs: Step RPCs (steps plus preemption retries).
        num_preemptions: preemptions.
        num_prefill_tokens: tokens computed while their request was prefilling, in tokens: each
            admission's and each later prefill chunk's ``num_scheduled_tokens``, so the tokens a
            recompute preemption makes a request compute again count again, and prefix-cache hits
            do not count (decode tokens do not count either).
        rpc_latency_ms: each Step RPC's round trip, in milliseconds.
        num_finished: requests that finished.
        num_skipped: trace requests skipped: prompt of ``max_model_len`` tokens or more.
        num_length_capped: requests that stopped at ``max_model_len`` before their output length.
        wall_time_s: wall-clock time of the replay.
        sim_time_ms: simulated time at the end.
    """

    admissions: list[Admission] = field(default_factory=list)
    num_steps: int = 0
    num_rpcs: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    rpc_latency_ms: list[float] = field(default_factory=list)
    num_finished: int = 0
    num_skipped: int = 0
    num_length_capped: int = 0
    wall_time_s: float = 0.0
    sim_time_ms: float = 0.0


Predictor = Callable[[ReplayRequest, int], Awaitable[Sequence[int | None]]]
"""Given a request about to be admitted and the newest published seq, the hit each watcher expects
(tokens; the first one is the main watcher's)."""


class ReplayScheduler:
    """Replays trace requests through a service with continuous batching.

    Args:
        client: the service.
        requests: the trace, in arrival order.
        config: scheduler limits and the report mode.
        predictor: asked before each admission (see module docstring), optional.
        on_step: called after each step with (stats, head_seq); a progress bar hooks here.
        max_model_len: the server's longest request, in tokens (``GetKVCacheGroupMetadata``).
        kv_worker: moves and checks block contents (see the module docstring), optional.
    """

    def __init__(
        self,
        client: AsyncKVCacheClient,
        requests: Iterable[TraceRequest],
        config: SchedulerConfig = SchedulerConfig(),
        *,
        predictor: Predictor | None = None,
        on_step: Callable[[SchedulerStats, int], Awaitable[None] | None] | None = None,
        max_model_len: int | None = None,
        kv_worker: Any = None,
    ) -> None:
        self.kv_worker = kv_worker
        self.client = client
        self.config = config
        self.predictor = predictor
        self.on_step = on_step
        self.max_model_len = max_model_len
        self.stats = SchedulerStats()
        self.pending: deque[ReplayRequest] = deque()
        for i, t in enumerate(requests):
            self.add_request(t, i)
        self.waiting: deque[ReplayRequest] = deque()
        self.running: list[ReplayRequest] = []
        self.to_free: list[ReplayRequest] = []
        self.head_seq = 0
        self.clock_ms = 0.0
        self._last_scheduled = 0
        self._num_groups = 1  # KV cache groups, as the last decode op's answer says
        self._mode = (
            pb.KV_CACHE_REPORT_MODE_FULL
            if config.kv_cache_report_mode == "full"
            else pb.KV_CACHE_REPORT_MODE_INCREMENTAL
        )

    @property
    def num_requests(self) -> int:
        """Requests not yet finished or still to arrive."""
        return len(self.pending) + len(self.waiting) + len(self.running)

    async def run(self) -> SchedulerStats:
        """Replay every request to completion.

        Raises:
            KVServiceError: a call failed (the service answered an error status).
            RuntimeError: a request cannot be admitted even with an empty pool.
        """
        start = time.perf_counter()
        while self.pending or self.has_work:
            if not self.has_work:
                self.clock_ms = max(self.clock_ms, self.pending[0].trace.arrival_ms)
            await self.step()
        self.stats.wall_time_s = time.perf_counter() - start
        self.stats.sim_time_ms = self.clock_ms
        return self.stats

    def add_request(self, trace: TraceRequest, index: int) -> bool:
        """Queue a trace request; it joins the waiting queue at the first step whose clock has
        passed its arrival. Requests must be added in arrival order (as :meth:`run` expects).

        Args:
            trace: the request.
            index: its position in the trace (0-based; :attr:`Admission.index`).

        Returns:
            False when it is skipped: its prompt is ``max_model_len`` tokens or longer (counted in
            ``stats.num_skipped``).
        """
        if self.max_model_len is not None and len(trace.prompt_token_ids) >= self.max_model_len:
            self.stats.num_skipped += 1
            return False
        self.pending.append(ReplayRequest(trace, index))
        return True

    @property
    def has_work(self) -> bool:
        """A step would do something: requests wait, run, or are to be freed (arrivals still
        pending do not count)."""
        return bool(self.waiting or self.running or self.to_free)

    async def step(self) -> None:
        """One scheduler step at ``clock_ms``: arrivals up to the clock join the waiting queue,
        one step runs (see the module docstring), the clock advances ``step_ms`` and ``on_step``
        is called. A driver of several schedulers in one simulated time (``replay.multi``) sets
        ``clock_ms`` and calls this; :meth:`run` is this in a loop.

        Raises:
            KVServiceError, RuntimeError: as :meth:`run`.
        """
        while self.pending and self.pending[0].trace.arrival_ms <= self.clock_ms:
            self.waiting.append(self.pending.popleft())
        await self._step()
        self.clock_ms += self.config.step_ms
        self.stats.num_steps += 1
        if self.on_step is not None:
            result = self.on_step(self.stats, self.head_seq)
            if result is not None:
                await result

    async def _call(self, ops: list[pb.StepOp]) -> list[pb.StepOpResult]:
        t0 = time.perf_counter()
        response = await self.client.step(pb.StepRequest(ops=ops))
        self.stats.rpc_latency_ms.append((time.perf_counter() - t0) * 1e3)
        self.stats.num_rpcs += 1
        self.head_seq = response.head_seq
        for result in response.results:
            if result.WhichOneof("result") == "error":
                raise KVServiceError.from_op_status(result.error)
        return list(response.results)

    def _running_op(self, r: ReplayRequest, budget: int) -> tuple[pb.StepOp, int]:
        if r.num_computed_tokens < len(r.token_ids):
            n = min(budget, len(r.token_ids) - r.num_computed_tokens)
            return pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=r.request_id, num_new_tokens=n)), n
        assert r.pending_token is not None
        op = pb.StepOp(
            allocate_slots=pb.AllocateSlotsRequest(
                request_id=r.request_id, num_new_tokens=1, new_token_ids=[r.pending_token]
            )
        )
        return op, 1

    def _apply_allocation(
        self, r: ReplayRequest, response: pb.AllocateSlotsResponse, *, admitted: bool = False
    ) -> None:
        num_computed_before = r.num_computed_tokens
        if num_computed_before < len(r.token_ids):  # a prefill chunk (a decode step has computed every token)
            self.stats.num_prefill_tokens += response.num_scheduled_tokens
        self._apply(r, response)
        if self.kv_worker is not None:
            if admitted:
                self.kv_worker.admitted(r.request_id, r.token_ids, response)
            else:
                self.kv_worker.allocated(r.request_id, r.token_ids, num_computed_before, response)

    async def _flush_kv(self) -> None:
        if self.kv_worker is not None:
            await self.kv_worker.flush()

    def _free_op(self, r: ReplayRequest) -> pb.StepOp:
        if self.kv_worker is not None:
            self.kv_worker.forget(r.request_id)
        return pb.StepOp(free=pb.FreeRequest(request_id=r.request_id))

    def _apply(self, r: ReplayRequest, response: pb.AllocateSlotsResponse) -> None:
        if r.pending_token is not None and response.num_tokens == len(r.token_ids) + 1:
            r.token_ids.append(r.pending_token)
            r.pending_token = None
        r.num_computed_tokens = response.num_computed_tokens
        if r.num_computed_tokens == len(r.token_ids):
            r.sample()
            capped = self.max_model_len is not None and len(r.token_ids) + 1 > self.max_model_len
            if capped and not r.finished:
                self.stats.num_length_capped += 1
            if r.finished or capped:
                self.running.remove(r)
                self.to_free.append(r)
                self.stats.num_finished += 1

    async def _step(self) -> None:
        cfg = self.config
        ops: list[pb.StepOp] = [self._free_op(r) for r in self.to_free]
        self.to_free = []
        budget = cfg.max_num_batched_tokens
        # Per scheduled request, in running order: its op's index and its index in that decode op
        # (-1: its own allocate_slots op, a prefill chunk).
        scheduled: list[tuple[ReplayRequest, int, int]] = []
        decode_ids: list[str] = []
        decode_tokens: list[int] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.num_computed_tokens < len(r.token_ids):
                if decode_ids:
                    ops.append(pb.StepOp(decode=pb.DecodeRequest(request_ids=decode_ids, new_token_ids=decode_tokens)))
                    decode_ids, decode_tokens = [], []
                op, n = self._running_op(r, budget)
                scheduled.append((r, len(ops), -1))
                ops.append(op)
                budget -= n
            else:
                assert r.pending_token is not None
                scheduled.append((r, len(ops), len(decode_ids)))
                decode_ids.append(r.request_id)
                decode_tokens.append(r.pending_token)
                budget -= 1
        if decode_ids:
            ops.append(pb.StepOp(decode=pb.DecodeRequest(request_ids=decode_ids, new_token_ids=decode_tokens)))
        failed: list[ReplayRequest] = []
        if ops:
            results = await self._call(ops)
            decoded: dict[int, tuple[set[int], dict[int, tuple[list[int], ...]]]] = {}
            for r, op_index, k in scheduled:
                if k < 0:
                    response = results[op_index].allocate_slots
                else:
                    if op_index not in decoded:
                        decoded[op_index] = self._decoded(results[op_index].decode)
                    refused, new_blocks = decoded[op_index]
                    response = self._decode_response(r, k in refused, new_blocks.get(k))
                if response.allocated:
                    self._apply_allocation(r, response)
                else:
                    failed.append(r)
            await self._flush_kv()
        num_preemptions = self.stats.num_preemptions
        for r in failed:
            await self._preempt_until_allocated(r)
        if self.stats.num_preemptions != num_preemptions:
            return  # as vLLM: no admission in a step that preempted
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            r = self.waiting[0]
            if not await self._admit(r, budget):
                if not self.running and not self.to_free:
                    raise RuntimeError(
                        f"request {r.request_id} ({len(r.token_ids)} tokens) does not fit in the empty pool"
                    )
                break  # it stays waiting (registered on the server)
            self.waiting.popleft()
            budget -= self._last_scheduled

    def _decoded(self, response: pb.DecodeResponse) -> tuple[set[int], dict[int, tuple[list[int], ...]]]:
        """A decode op's refusals and new blocks by index.

        Raises:
            KVServiceError: an item failed (as its own ``allocate_slots`` op would have).
        """
        if response.error_indices:
            raise KVServiceError.from_op_status(response.errors[0])
        self._num_groups = response.num_groups
        return set(response.refused_indices), decode_new_block_ids(response)

    def _decode_response(
        self, r: ReplayRequest, refused: bool, new_block_ids: tuple[list[int], ...] | None
    ) -> pb.AllocateSlotsResponse:
        """The ``AllocateSlotsResponse`` one decode's own ``allocate_slots`` op would have got: one
        token scheduled and computed, appended to the request's tokens (nothing when refused)."""
        if refused:
            return pb.AllocateSlotsResponse(allocated=False)
        groups = new_block_ids if new_block_ids is not None else tuple([] for _ in range(self._num_groups))
        return pb.AllocateSlotsResponse(
            allocated=True,
            new_block_ids=[pb.GroupBlockIds(block_ids=ids) for ids in groups],
            num_scheduled_tokens=1,
            num_computed_tokens=r.num_computed_tokens + 1,
            num_tokens=len(r.token_ids) + 1,
        )

    async def _admit(self, r: ReplayRequest, budget: int) -> bool:
        """Look up and allocate one waiting request in its own round trip, after the predictor
        has seen every batch so far, so the prediction and the server's hit describe one state."""
        predictions = tuple(await self.predictor(r, self.head_seq)) if self.predictor is not None else ()
        if self.max_model_len is not None:  # a chunk is at most a request (the server's bound)
            budget = min(budget, self.max_model_len)
        results = await self._call(
            [
                pb.StepOp(get_computed_blocks=self._lookup_request(r)),
                pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=r.request_id, num_new_tokens=budget)),
            ]
        )
        response = results[1].allocate_slots
        if not response.allocated:
            return False
        self.stats.admissions.append(
            Admission(
                r.index,
                r.request_id,
                len(r.token_ids),
                predictions[0] if predictions else None,
                response.num_new_computed_tokens,
                r.num_preemptions > 0,
                predictions,
            )
        )
        self.running.append(r)
        self._last_scheduled = response.num_scheduled_tokens
        self._apply_allocation(r, response, admitted=True)
        await self._flush_kv()
        return True

    def _lookup_request(self, r: ReplayRequest) -> pb.GetComputedBlocksRequest:
        request = pb.GetComputedBlocksRequest(  # the array's buffer: no varint per token id to encode or parse
            request_id=r.request_id,
            packed_prompt_token_ids=cast(bytes, pack_token_ids(r.token_ids)),
            kv_cache_report_mode=self._mode,
        )
        if self.config.send_session_id and r.trace.session_id is not None:
            request.session_id = r.trace.session_id
        return request

    async def _preempt_until_allocated(self, r: ReplayRequest) -> None:
        """vLLM's recompute preemption: free the newest running request until ``r`` fits (or ``r``
        itself is the newest and is preempted)."""
        while r in self.running:
            victim = self.running[-1]
            self.running.pop()
            ops = [self._free_op(victim)]
            victim.preempt()
            self.waiting.appendleft(victim)
            self.stats.num_preemptions += 1
            if victim is r:
                await self._call(ops)
                return
            op, _ = self._running_op(r, self.config.max_num_batched_tokens)
            ops.append(op)
            results = await self._call(ops)
            response = results[1].allocate_slots
            if response.allocated:
                self._apply_allocation(r, response)
                await self._flush_kv()
                return
