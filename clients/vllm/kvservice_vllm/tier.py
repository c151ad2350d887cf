"""``KVServiceTier``: a kvservice server as a secondary tier of vLLM 0.33's ``OffloadingConnector``,
shared by every vLLM instance that names it.

Loaded by vLLM from configuration alone (no vLLM change): ``TieringOffloadingSpec`` builds each
``secondary_tiers`` entry with ``SecondaryTierFactory``, which imports ``type`` from
``module_path`` and constructs it by keyword (``offloading_spec``, ``primary_kv_view``,
``tier_type``, ``backpressure_detector`` and the entry's other keys)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592, "block_size": 16,
        "secondary_tiers": [{"type": "KVServiceTier", "module_path": "kvservice_vllm.tier",
                             "target": "unix:/run/kvservice.sock"}]}}'

What the tier does, in vLLM's tier API's terms (``vllm/v1/kv_offload/tiering/base.py``):

* **Keys.** vLLM's ``OffloadKey`` is its block hash followed by the KV cache group index as 4
  big-endian bytes (``vllm/v1/kv_offload/base.py``, ``make_offload_key``); kvservice's key is the
  same pair, ``(group_idx, block_hash)``. So a chunk one instance stores is a hit for every other
  instance that hashes the same tokens (same model, hash algorithm and seed, chunk size).
* **Lookups** (``lookup``) never wait on the server: the first lookup of a key answers
  ``RETRY`` and queues it; ``on_schedule_end`` sends the step's queued keys as one
  ``LookupBlocks`` (per ``max_keys_per_call`` keys) on the lookup thread; a later lookup reads the
  verdict (``HIT`` / ``MISS``), kept while a request that asked for it is live (vLLM's connector
  keeps scanning past ``RETRY``, so a whole prompt's keys go in one step's batch). A lookup that
  fails (the server down) answers ``MISS`` for its keys.
* **Stores and loads** (``submit_store``, ``submit_load``) queue a job and return; worker threads
  per direction (``job_threads``, 2 by default: one job's round trips overlap the other's copy)
  move the bytes (:class:`kvservice_vllm.tier_client.TierClient`: ``memcpy``
  through the server's mapped memory on the same host, ``PutBlocks`` / ``ReadBlocks`` otherwise);
  ``get_finished_jobs`` hands back ``JobResult`` s. A free store thread takes all the store jobs
  queued by then as one store (two round trips per ``max_keys_per_call`` keys, not per
  job); each job still reports on its own. A load that could not copy every key (evicted
  since the lookup, a lost lease, the server gone) is ``success=False`` with ``successful_keys``
  the keys that did arrive: vLLM's tiering manager then frees the primary slots of the others, and
  their next lookup is a ``MISS`` (the tier drops its verdict), so the request recomputes them.
* **A server restart** empties the pool: lookups miss, leases of the old server are unknown to
  the new one (their loads fail as above), the mapped memory is attached again before the next
  copy. No call raises into vLLM.

Checked at construction (:class:`TierLayoutError`, raised from vLLM's ``get_manager``): one
offload chunk (``primary_kv_view.strides[0]`` bytes) is exactly the server's block in every KV
cache group vLLM offloads; the message names the cause (page padding, KV heads replicated over TP
ranks, several blocks per chunk) and the ``kvservice serve`` flag that fits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvservice_client.tls import TLSConfig
from kvservice_vllm.tier_client import TierClient, TierLayoutError, rows_of

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KVServiceTier", "TierLayoutError"]

logger = logging.getLogger(__name__)

_PAGE_ALIGNMENT = 4096
"""vLLM's ``SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT`` (``mmap.PAGESIZE``): a primary chunk is
rounded up to it."""


@dataclass(slots=True)
class _Verdict:
    """One key's lookup: ``present`` None while its LookupBlocks is queued or in flight."""

    generation: int
    present: bool | None = None
    in_flight: bool = False
    req_ids: set[str] = field(default_factory=set)


class KVServiceTier(SecondaryTierManager):
    """A kvservice server as a shared secondary tier (see the module docstring).

    Args:
        offloading_spec: vLLM's ``TieringOffloadingSpec`` (its ``config``: groups, chunk size,
            parallelism).
        primary_kv_view: vLLM's CPU primary tier, ``(num_chunks, row_stride_bytes)``.
        tier_type: the entry's ``type`` (``KVServiceTier``).
        backpressure_detector: vLLM's, from the entry's ``backpressure``.
        target: the server: ``HOST:PORT`` or ``unix:PATH``.
        token: a ``tier`` token, when the server checks tokens.
        tls: TLS to the server (``target`` a ``HOST:PORT``).
        root_certificates: a PEM file of the CA the server's certificate chains to (implies
            ``tls``).
        transport: ``auto`` (default: shared memory when the server's memory maps here, else gRPC),
            ``shm`` or ``grpc``.
        lease_ttl_s: seconds a put or read lease lasts (0: the server's default).
        timeout_s: deadline of one RPC, in seconds (default 30).
        touch: send vLLM's ``touch`` (chunks used again) to the server, so its LRU keeps them
            (a ``LookupBlocks`` with ``touch``, batched per step).
        enable_kv_events: report the chunks this tier stored as vLLM ``OffloadingEvent`` s (when
            KV cache events are on in vLLM); the server publishes its own events either way.
        locality: ``LOCAL`` or ``REMOTE`` (vLLM's ``Locality``); default: ``LOCAL`` over shared
            memory, ``REMOTE`` over gRPC.
        job_threads: threads per direction that run store and load jobs (default 2): one job's
            round trips overlap another's copy (a direction's copies still take turns); 1 runs
            each direction's jobs one after the other.

    Raises:
        ValueError: ``job_threads`` is not an integer >= 1.
        TierLayoutError: the server's blocks are not this engine's offload chunks.
        KVServiceError: the server cannot be reached or refuses the token.
    """

    medium: ClassVar[Medium] = Medium.CPU
    # A shared pool in another process, maybe another host: vLLM's "remote store" source, not its
    # own host memory (HOST, which a CPU medium would imply).
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        target: str,
        token: str | None = None,
        tls: bool = False,
        root_certificates: str | None = None,
        transport: str = "auto",
        lease_ttl_s: float = 0.0,
        timeout_s: float = 30.0,
        touch: bool = True,
        enable_kv_events: bool = False,
        locality: str | None = None,
        job_threads: int = 2,
    ) -> None:
        if isinstance(job_threads, bool) or not isinstance(job_threads, int) or job_threads < 1:
            raise ValueError(f"KVServiceTier: job_threads must be an integer >= 1; got {job_threads!r}")
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        config = offloading_spec.config
        self._group_idxs = tuple(sorted({g.group_id for g in config.groups})) or (0,)
        self._tokens_per_chunk = {
            g.group_id: g.tokens_per_block * offloading_spec.blocks_per_chunk for g in config.groups
        }
        self._rows = rows_of(primary_kv_view)
        tls_config: bool | TLSConfig = TLSConfig.from_files(root_certificates) if root_certificates else tls
        self._client = TierClient(
            target,
            chunk_bytes=self.block_size_bytes,
            group_idxs=self._group_idxs,
            token=token,
            tls=tls_config,
            transport=transport,
            lease_ttl_s=lease_ttl_s,
            timeout_s=timeout_s,
        )
        try:
            self._client.connect()
        except TierLayoutError as exc:
            self._client.close()
            raise TierLayoutError(f"{exc}. {_chunk_breakdown(offloading_spec, self.block_size_bytes)}") from None
        except BaseException:
            self._client.close()
            raise
        self.locality = (
            Locality(locality) if locality else (Locality.LOCAL if self._client.transport == "shm" else Locality.REMOTE)
        )
        self._touch = touch
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []

        # Lookups: scheduler-thread state (under vLLM's manager lock), results from the lookup thread.
        self._verdicts: dict[OffloadKey, _Verdict] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._queued: list[tuple[OffloadKey, int]] = []
        self._touched: dict[OffloadKey, None] = {}
        self._next_generation = 0
        self._lookup_results: queue.SimpleQueue[list[tuple[OffloadKey, int, bool]]] = queue.SimpleQueue()
        self._lookups_in_flight = 0
        # Per request: (group_idx, end token) -> block hash, for the parent hash a put publishes.
        self._req_hashes: dict[str, dict[tuple[int, int], bytes]] = {}

        # Jobs: threads per direction, so a load never waits behind a long store, and one job's
        # round trips overlap another's copy.
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="kvservice_tier_lookup")
        self._load_pool = ThreadPoolExecutor(job_threads, thread_name_prefix="kvservice_tier_load")
        self._store_pool = ThreadPoolExecutor(job_threads, thread_name_prefix="kvservice_tier_store")
        self._jobs: dict[JobId, Future[JobResult]] = {}
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        self._finished: queue.SimpleQueue[JobId] = queue.SimpleQueue()
        # Store jobs not yet taken by a store thread (the next free one takes all of them: one call).
        self._pending_stores: list[_StoreJob] = []
        self._pending_lock = threading.Lock()
        self._closed = False
        logger.info(
            "KVServiceTier: %s over %s, %d-byte chunks, groups %s",
            target,
            self._client.transport,
            self.block_size_bytes,
            list(self._group_idxs),
        )

    @property
    def transport(self) -> str:
        """``shm`` or ``grpc``: how bytes move (chosen at construction)."""
        return self._client.transport

    @property
    def client(self) -> TierClient:
        """The data side (its ``client`` is a plain :class:`kvservice_client.KVCacheClient`)."""
        return self._client

    # -- requests ------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading (vLLM's default): chunks a prefix hit covers are not stored again."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's verdicts (kept while another live request asked for them, or while
        their LookupBlocks is in flight) and its hashes."""
        req_id = req_context.req_id
        self._req_hashes.pop(req_id, None)
        for key in self._req_keys.pop(req_id, ()):
            verdict = self._verdicts.get(key)
            if verdict is None:
                continue
            verdict.req_ids.discard(req_id)
            if not verdict.req_ids and not verdict.in_flight and verdict.present is not None:
                del self._verdicts[key]

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT`` / ``MISS`` when this key's LookupBlocks has answered, else ``RETRY`` (it is sent
        at the end of the step)."""
        self._drain_lookups()
        self._remember_hash(key, req_context)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = _Verdict(generation=self._next_generation)
            self._next_generation += 1
            self._verdicts[key] = verdict
            self._queued.append((key, verdict.generation))
        verdict.req_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if verdict.present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict.present else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Queue the keys as recently used (sent with the step's lookups)."""
        if self._touch:
            self._touched.update(dict.fromkeys(keys))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send the step's queued lookups (and touches) as one batch on the lookup thread."""
        self._drain_lookups()
        batch = [(key, generation) for key, generation in self._queued if self._is_current(key, generation)]
        self._queued = []
        touched = list(self._touched)
        self._touched = {}
        if batch:
            for key, _generation in batch:
                self._verdicts[key].in_flight = True
            self._lookups_in_flight += 1
            self._lookup_pool.submit(self._run_lookup, batch)
        if touched:
            self._lookup_pool.submit(self._run_touch, touched)

    def wait_lookups(self) -> None:
        """Block until every batch of lookups (and touches) sent so far has answered; the next
        ``lookup`` reads their verdicts. For tests and tools: vLLM never calls it (its loop asks
        again the next step)."""
        self._lookup_pool.submit(lambda: None).result()

    def _is_current(self, key: OffloadKey, generation: int) -> bool:
        verdict = self._verdicts.get(key)
        return verdict is not None and verdict.generation == generation

    def _run_lookup(self, batch: list[tuple[OffloadKey, int]]) -> None:
        """Lookup thread: one LookupBlocks per max_keys_per_call keys; a failure is a miss."""
        try:
            present = self._client.lookup([_key_pair(key) for key, _g in batch])
        except Exception as exc:  # noqa: BLE001 - the server gone or a bad key: every key a miss
            logger.warning("KVServiceTier: LookupBlocks of %d keys failed (answered as misses): %s", len(batch), exc)
            present = [False] * len(batch)
        self._lookup_results.put([(key, generation, hit) for (key, generation), hit in zip(batch, present)])

    def _run_touch(self, keys: list[OffloadKey]) -> None:
        try:
            self._client.lookup([_key_pair(key) for key in keys], touch=True)
        except Exception as exc:  # noqa: BLE001 - a touch is advice; losing one costs nothing
            logger.debug("KVServiceTier: touch of %d keys failed: %s", len(keys), exc)

    def _drain_lookups(self) -> None:
        while True:
            try:
                results = self._lookup_results.get_nowait()
            except queue.Empty:
                return
            self._lookups_in_flight -= 1
            for key, generation, hit in results:
                verdict = self._verdicts.get(key)
                if verdict is None or verdict.generation != generation:
                    continue
                verdict.in_flight = False
                if not verdict.req_ids:
                    del self._verdicts[key]
                    continue
                verdict.present = hit

    def _mark_missing(self, keys: Iterable[OffloadKey]) -> None:
        """A failed load's keys: their verdict becomes a miss, so the next lookup does not promote
        them again (the request recomputes them)."""
        for key in keys:
            verdict = self._verdicts.get(key)
            if verdict is not None and verdict.present is not None:
                verdict.present = False

    def _remember_hash(self, key: OffloadKey, req_context: ReqContext) -> None:
        end_token = req_context.get_offload_key_position(key)
        if end_token is not None:
            group_idx = get_offload_group_idx(key)
            self._req_hashes.setdefault(req_context.req_id, {})[(group_idx, end_token)] = get_offload_block_hash(key)

    def _parent_hash(self, key: OffloadKey, req_context: ReqContext) -> bytes:
        """The hash of the chunk before ``key`` in its request (``b""`` when not known: the first
        chunk, or one this tier never saw)."""
        end_token = req_context.get_offload_key_position(key)
        if end_token is None:
            return b""
        group_idx = get_offload_group_idx(key)
        tokens = self._tokens_per_chunk.get(group_idx)
        if not tokens or end_token <= tokens:
            return b""
        return self._req_hashes.get(req_context.req_id, {}).get((group_idx, end_token - tokens), b"")

    # -- jobs ----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a store of the job's primary chunks (pinned by vLLM until the job reports); the
        store thread takes every job queued by then as one store (:meth:`_run_pending_stores`)."""
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        assert len(keys) == len(chunk_ids), f"{len(keys)} keys but {len(chunk_ids)} chunk_ids"
        for key in keys:
            self._remember_hash(key, job_metadata.req_context)
        parents = [self._parent_hash(key, job_metadata.req_context) for key in keys]
        if self._events is not None:
            self._store_keys[job_metadata.job_id] = keys
        job = _StoreJob(job_metadata.job_id, keys, parents, chunk_ids, Future())
        self._jobs[job.job_id] = job.future
        with self._pending_lock:
            self._pending_stores.append(job)
        self._store_pool.submit(self._run_pending_stores)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a load of the job's keys into its primary chunks."""
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        assert len(keys) == len(chunk_ids), f"{len(keys)} keys but {len(chunk_ids)} chunk_ids"
        self._load_keys[job_metadata.job_id] = keys
        self._submit(job_metadata.job_id, self._load_pool, self._run_load, keys, chunk_ids)

    def _submit(self, job_id: JobId, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> None:
        def run() -> JobResult:
            # The id is queued before the future completes (a done-callback runs after the
            # future's waiters wake), so a get_finished_jobs after drain_jobs sees every job.
            try:
                return fn(job_id, *args)
            finally:
                self._finished.put(job_id)

        self._jobs[job_id] = pool.submit(run)

    def _run_pending_stores(self) -> None:
        """A store thread: every store job queued now, as one store per group (one reservation
        and one commit per ``max_keys_per_call`` keys, not per job: jobs queue while a copy runs,
        and each call costs two round trips). A key in several jobs is copied once (the first
        job's row: a key names its bytes). Each job reports on its own: success when all its keys
        are stored; the batch's time and, per job, the bytes of the keys it was first to hold.
        Nothing to do when an earlier run took the jobs already."""
        with self._pending_lock:
            jobs, self._pending_stores = self._pending_stores, []
        if not jobs:
            return
        start = time.perf_counter()
        try:
            stored: dict[OffloadKey, bool] = {}
            written: dict[OffloadKey, bool] = {}
            first: dict[OffloadKey, tuple[bytes, int]] = {}  # key -> (parent hash, chunk id)
            for job in jobs:
                for key, parent, chunk_id in zip(job.keys, job.parents, job.chunk_ids):
                    first.setdefault(key, (parent, chunk_id))
            keys = list(first)
            for group_idx, indices in _by_group(keys).items():
                result = self._client.store(
                    group_idx,
                    [get_offload_block_hash(keys[i]) for i in indices],
                    [first[keys[i]][0] for i in indices],
                    self._rows,
                    [first[keys[i]][1] for i in indices],
                )
                for i, ok, wrote in zip(indices, result.stored, result.written):
                    stored[keys[i]] = ok
                    written[keys[i]] = wrote
            elapsed = time.perf_counter() - start
            counted: set[OffloadKey] = set()
            results = []
            for job in jobs:
                mine = [k for k in dict.fromkeys(job.keys) if written.get(k) and k not in counted]
                counted.update(mine)
                results.append(
                    JobResult(
                        job_id=job.job_id,
                        success=all(stored.get(k, False) for k in job.keys),
                        transfer_time=elapsed,
                        transfer_bytes=len(mine) * self.block_size_bytes,
                    )
                )
        except BaseException as exc:
            for job in jobs:  # the id queued before the future completes (see _submit)
                self._finished.put(job.job_id)
                job.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for job, result in zip(jobs, results):
            self._finished.put(job.job_id)
            job.future.set_result(result)

    def _run_load(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        start = time.perf_counter()
        loaded = [False] * len(keys)
        num_bytes = 0
        for group_idx, indices in _by_group(keys).items():
            result = self._client.load(
                group_idx,
                [get_offload_block_hash(keys[i]) for i in indices],
                self._rows,
                [chunk_ids[i] for i in indices],
            )
            for i, ok in zip(indices, result.loaded):
                loaded[i] = ok
            num_bytes += result.num_bytes
        elapsed = time.perf_counter() - start
        if all(loaded):
            return JobResult(job_id=job_id, success=True, transfer_time=elapsed, transfer_bytes=num_bytes)
        successful = [key for key, ok in zip(keys, loaded) if ok]
        return JobResult(
            job_id=job_id,
            success=False,
            successful_keys=successful or None,
            transfer_time=elapsed,
            transfer_bytes=num_bytes,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the last call (a failed load's missing keys become misses)."""
        results: list[JobResult] = []
        while True:
            try:
                job_id = self._finished.get_nowait()
            except queue.Empty:
                break
            future = self._jobs.pop(job_id)
            load_keys = self._load_keys.pop(job_id, None)
            store_keys = self._store_keys.pop(job_id, None)
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - a bug or a cancelled job: a failed job, not a crash
                logger.warning("KVServiceTier: job %d failed: %s", job_id, exc)
                result = JobResult(job_id=job_id, success=False)
            if load_keys is not None and not result.success:
                kept = set(result.successful_keys or ())
                self._mark_missing(k for k in load_keys if k not in kept)
            if store_keys and result.success and self._events is not None:
                self._events.append(
                    OffloadingEvent(keys=store_keys, medium=self.medium, removed=False, locality=self.locality)
                )
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        """Jobs or lookups in flight: the engine keeps stepping until they report."""
        return bool(self._jobs) or self._lookups_in_flight > 0 or bool(self._queued)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stores this tier made (``enable_kv_events``)."""
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished (its result stays for ``get_finished_jobs``)
        and its commits and releases have answered (its stored keys are then visible to every
        lookup); a copy in progress is never cut short."""
        for future in list(self._jobs.values()):
            try:
                future.result()
            except Exception:  # noqa: BLE001, S110 - reported by get_finished_jobs
                pass
        self._client.flush()

    def shutdown(self) -> None:
        """Finish the jobs in flight, stop the threads, close the connection."""
        if self._closed:
            return
        self._closed = True
        for pool in (self._lookup_pool, self._load_pool, self._store_pool):
            pool.shutdown(wait=True)
        self._client.close()


@dataclass(frozen=True, slots=True)
class _StoreJob:
    """A store job queued for the store threads: vLLM's job id, its keys, per key the parent hash
    and the primary row, and the future its result is set on."""

    job_id: JobId
    keys: list[OffloadKey]
    parents: list[bytes]
    chunk_ids: list[int]
    future: Future[JobResult]


def _key_pair(key: OffloadKey) -> tuple[int, bytes]:
    return get_offload_group_idx(key), get_offload_block_hash(key)


def _by_group(keys: list[OffloadKey]) -> dict[int, list[int]]:
    """Key positions per group, in key order."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(get_offload_group_idx(key), []).append(i)
    return groups


def _chunk_breakdown(offloading_spec: Any, chunk_bytes: int) -> str:
    """What vLLM's offload chunk is made of, and which part a layout mismatch usually comes from
    (vLLM 0.33's ``CPUOffloadingSpec``: a chunk is ``worker_kv_bytes_per_block`` x copies x
    ``blocks_per_chunk``, rounded up to the page size)."""
    config = offloading_spec.config
    per_block = int(getattr(config, "worker_kv_bytes_per_block", 0))
    world = int(getattr(config.parallel, "world_size", 1))
    replicated = bool(getattr(offloading_spec, "replicated_layout", False))
    copies = 1 if replicated else world
    blocks = int(offloading_spec.blocks_per_chunk)
    raw = per_block * copies * blocks
    parts = [
        f"vLLM's chunk: {per_block} bytes per block per worker x {copies} worker cop{'y' if copies == 1 else 'ies'}"
        f" (world size {world}{', replicated layout' if replicated else ''}) x {blocks} block(s) per chunk"
        f" = {raw} bytes, {chunk_bytes} with the page padding"
    ]
    if raw and raw != chunk_bytes:
        parts.append(f"{chunk_bytes - raw} bytes are page padding (rounded up to {_PAGE_ALIGNMENT})")
    if copies > 1:
        parts.append(
            "under TP every rank's bytes are in the chunk (KV heads replicated over ranks count once per rank)"
        )
    if blocks > 1:
        parts.append(f"one server block holds the whole chunk of {blocks} blocks")
    return "; ".join(parts)
