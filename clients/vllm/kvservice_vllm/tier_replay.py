"""vLLM instances sharing prefix chunks through one kvservice tier, over a trace, with real bytes.

``kvservice replay --scheduler vllm-tier`` (``kvservice.replay.vllm_mode``) runs this: ``N`` (2)
vLLM 0.33 schedulers (:func:`kvservice_vllm.drive.make_scheduler`, the model never run), each
with its own ``OffloadingConnector`` (scheduler side) on ``TieringOffloadingSpec``: vLLM's CPU
primary tier with :class:`~kvservice_vllm.tier.KVServiceTier` as its secondary tier, every
instance on one kvservice server (``--device cpu --kv-cache-layout opaque:CHUNK_BYTES``,
:class:`~kvservice_vllm.embedded.EmbeddedTierServer`). A router sends request ``i`` of the trace
to instance ``i mod N`` (round robin), so a conversation's next turn usually lands on the other
instance, and the prefix one instance computed reaches the other through kvservice.

The instances step in lockstep on one clock (a step is ``step_ms`` of the trace); after each
instance's step its tier's lookups and transfer jobs are waited for, so the run is deterministic
(the same trace gives the same counts).

**The worker side is simulated** (:class:`_SimulatedWorker`, what vLLM's
``OffloadingConnectorWorker`` and the model would do): a GPU block holds the KV of the block hash
the "forward pass" computed into it; a store job copies those bytes into its CPU primary chunk;
a load job reads its chunks back into GPU blocks. A block's bytes are the replay's
``--kv-data`` rule (:func:`kvservice.replay.kv_data.block_bytes`: per layer the 8-byte word
``xxh3_64(block hash + layer)`` repeated), so the tier's stores carry real bytes, and each chunk
that arrives from kvservice into the primary tier (:class:`ReplayTier`, a ``KVServiceTier`` that
checks what its loads copied) and each chunk a load job reads is compared with its hash's bytes.
Completions go back to the scheduler as vLLM's worker reports them
(``OffloadingWorkerMetadata.completed_jobs``, ``finished_recving`` for asynchronous loads), one
step after a store job was issued (vLLM's worker defers stores a step) and in the step of a load.

Needs the ``kvservice`` package (the embedded server and the byte rule).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvservice_vllm.tier import KVServiceTier
from kvservice_vllm.tier_client import rows_of

__all__ = ["InstanceStats", "ReplayTier", "TierReplayResult", "run_tier_replay"]

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 1, 32, 16
"""The replay's model: small, so kvservice's pool holds many chunks in little memory. One layer's
KV of a 16-token block is K and V x 1 KV head x 32 x bf16 x 16 tokens = 2,048 bytes; a chunk (one
block, both layers) 4,096 bytes, vLLM's page, so no padding."""
CHUNK_BYTES = 2 * NUM_KV_HEADS * HEAD_SIZE * 2 * BLOCK_SIZE * NUM_LAYERS


@dataclass
class InstanceStats:
    """What one instance did (units in the names; a block is a chunk: one block per chunk).

    Attributes:
        name: ``A``, ``B``, ...
        num_requests: requests routed to it.
        num_steps: scheduler steps it took (empty ones included).
        hit_tokens: prefix-cache hit tokens at admission, all sources (vLLM's
            ``num_computed_tokens`` of each newly scheduled request).
        hit_tokens_gpu: of them, from vLLM's own (GPU) prefix cache.
        hit_blocks_cpu, hit_tokens_cpu: loaded from its own CPU primary tier (chunks it offloaded,
            or promoted there for an earlier request).
        hit_blocks_kvservice_own, hit_tokens_kvservice_own: promoted from kvservice for this
            request, chunks this instance had computed itself (gone from its CPU tier since).
        hit_blocks_cross, hit_tokens_cross: promoted from kvservice for this request, chunks this
            instance never computed: another instance's, through kvservice.
        blocks_computed: full blocks its forward passes computed.
        chunks_offloaded: chunks its store jobs copied into its CPU primary tier.
        chunks_stored: chunks its tier's store jobs put in kvservice (already present ones
            included); ``chunks_written`` of them copied (the rest were there already).
        store_failures: chunks of store jobs that failed.
        chunks_loaded: chunks its tier's loads copied from kvservice into its CPU tier.
        load_failures: chunks a tier load could not copy (evicted since the lookup, lost lease).
        chunks_verified, mismatches: chunks loaded from kvservice compared with their hash's
            bytes, and those that differed.
        gpu_loads_verified, gpu_load_mismatches: chunks load jobs read from the CPU tier into
            GPU blocks, compared likewise.
        num_preemptions: preemptions.
    """

    name: str
    num_requests: int = 0
    num_steps: int = 0
    hit_tokens: int = 0
    hit_tokens_gpu: int = 0
    hit_blocks_cpu: int = 0
    hit_tokens_cpu: int = 0
    hit_blocks_kvservice_own: int = 0
    hit_tokens_kvservice_own: int = 0
    hit_blocks_cross: int = 0
    hit_tokens_cross: int = 0
    blocks_computed: int = 0
    chunks_offloaded: int = 0
    chunks_stored: int = 0
    chunks_written: int = 0
    store_failures: int = 0
    chunks_loaded: int = 0
    load_failures: int = 0
    chunks_verified: int = 0
    mismatches: int = 0
    gpu_loads_verified: int = 0
    gpu_load_mismatches: int = 0
    num_preemptions: int = 0


@dataclass
class TierReplayResult:
    """The run.

    Attributes:
        instances: per instance, in order (``A`` first).
        num_requests: requests replayed (those longer than ``max_model_len`` are left out).
        max_model_len: tokens.
        chunk_bytes: bytes of one offload chunk (one server block).
        num_layers: layers of the model (slices of a chunk in the byte rule).
        num_gpu_blocks, num_cpu_chunks: per instance; ``num_server_blocks``: kvservice's pool.
        num_steps: lockstep steps.
        wall_s: seconds the run took (server start to stop).
    """

    instances: list[InstanceStats]
    num_requests: int
    max_model_len: int
    chunk_bytes: int
    num_layers: int
    num_gpu_blocks: int
    num_cpu_chunks: int
    num_server_blocks: int
    num_steps: int
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``instances`` a list of dicts)."""
        return asdict(self)


def _chunk_bytes(block_hash: bytes, num_layers: int, num_bytes: int) -> bytes:
    from kvservice.replay.kv_data import block_bytes  # the replay's --kv-data rule

    return block_bytes(block_hash, num_layers, num_bytes)


class ReplayTier(KVServiceTier):
    """:class:`~kvservice_vllm.tier.KVServiceTier` that checks the bytes its loads copy into the
    primary tier against :func:`kvservice.replay.kv_data.block_bytes` of each key's hash, and
    counts its stores and loads (in :attr:`stats`, an :class:`InstanceStats`). Loaded by vLLM as
    any tier: ``{"type": "ReplayTier", "module_path": "kvservice_vllm.tier_replay", "num_layers":
    L, ...}``.

    Args:
        num_layers: layers in a chunk (its bytes are ``num_layers`` equal slices).
        *args, **kwargs: :class:`~kvservice_vllm.tier.KVServiceTier`'s.
    """

    def __init__(self, *args: Any, num_layers: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_layers = num_layers
        self.stats = InstanceStats(name="")
        self.primary_rows = rows_of(self._primary_kv_view)
        """vLLM's CPU primary tier, ``(num_chunks, chunk_bytes)`` uint8 (the region the worker maps)."""
        self.promoted: set[tuple[str, OffloadKey]] = set()
        """(request id, key) of each chunk a load brought from kvservice for that request."""
        self._loads: dict[int, tuple[str, list[OffloadKey], list[int]]] = {}
        self._stores: dict[int, int] = {}

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._stores[job_metadata.job_id] = len(job_metadata.keys)
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads[job_metadata.job_id] = (
            job_metadata.req_context.req_id,
            list(job_metadata.keys),
            [int(c) for c in job_metadata.chunk_ids],
        )
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = list(super().get_finished_jobs())
        stats = self.stats
        for result in results:
            num_keys = self._stores.pop(result.job_id, None)
            if num_keys is not None:
                if result.success:
                    stats.chunks_stored += num_keys
                    stats.chunks_written += (result.transfer_bytes or 0) // self.block_size_bytes
                else:
                    stats.store_failures += num_keys
            load = self._loads.pop(result.job_id, None)
            if load is None:
                continue
            req_id, keys, chunk_ids = load
            arrived = set(keys) if result.success else set(result.successful_keys or ())
            for key, chunk_id in zip(keys, chunk_ids):
                if key not in arrived:
                    stats.load_failures += 1
                    continue
                stats.chunks_loaded += 1
                stats.chunks_verified += 1
                expected = _chunk_bytes(get_offload_block_hash(key), self.num_layers, self.block_size_bytes)
                stats.mismatches += bytes(self.primary_rows[chunk_id].numpy()) != expected
                self.promoted.add((req_id, key))
        return results


class _SimulatedWorker:
    """The worker side of one instance's ``OffloadingConnector`` and its model: see the module
    docstring. Called with each ``SchedulerOutput``; returns the step's ``KVConnectorOutput``."""

    def __init__(self, scheduler: Any, tier: ReplayTier, stats: InstanceStats) -> None:
        self.scheduler = scheduler
        self.tier = tier
        self.stats = stats
        self.rows = tier.primary_rows
        self.num_layers = tier.num_layers
        self.chunk_bytes = tier.block_size_bytes
        self.block_size = scheduler.block_size
        self.gpu: dict[int, bytes | None] = {}
        """GPU block id -> the block hash whose KV it holds (None: bytes that matched no hash)."""
        self.computed: set[bytes] = set()
        """Block hashes this instance's forward passes computed."""
        self._deferred: list[tuple[int, Any]] = []

    def __call__(self, output: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        meta = output.kv_connector_metadata
        completed = OffloadingWorkerMetadata()
        finished_recving: set[str] = set()
        # Before the forward pass: last step's stores and the flushed ones (their GPU blocks are
        # about to be reused), then the loads.
        stores, self._deferred = self._deferred, []
        for job_id in meta.jobs_to_flush or ():
            job = meta.store_jobs.pop(job_id, None)
            if job is not None:
                stores.append((job_id, job))
        for job_id, job in stores:
            self._store(job)
            completed.mark_completed(job_id)
        for job_id, job in meta.load_jobs.items():
            self._load(job)
            completed.mark_completed(job_id)
            if not job.sync:
                finished_recving.add(job.req_id)
        self._forward(output)
        self._deferred.extend(meta.store_jobs.items())
        return KVConnectorOutput(
            finished_recving=finished_recving or None,
            kv_connector_worker_meta=completed if completed.completed_jobs else None,
        )

    def _bytes_of(self, block_hash: bytes | None) -> bytes:
        if block_hash is None:
            return bytes(self.chunk_bytes)
        return _chunk_bytes(block_hash, self.num_layers, self.chunk_bytes)

    def _store(self, job: Any) -> None:
        import torch

        block_ids = [int(b) for b in job.src_spec.block_ids]
        chunk_ids = [int(c) for c in job.dst_spec.chunk_ids]
        assert len(block_ids) == len(chunk_ids), f"{len(block_ids)} GPU blocks for {len(chunk_ids)} chunks"
        for block_id, chunk_id in zip(block_ids, chunk_ids):
            payload = self._bytes_of(self.gpu.get(block_id))
            self.rows[chunk_id].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.stats.chunks_offloaded += len(chunk_ids)

    def _load(self, job: Any) -> None:
        request = self.scheduler.requests[job.req_id]
        block_ids = [int(b) for b in job.dst_spec.block_ids]
        chunk_ids = [int(c) for c in job.src_spec.chunk_ids]
        assert len(block_ids) == len(chunk_ids), f"{len(chunk_ids)} chunks for {len(block_ids)} GPU blocks"
        first = int(job.dst_spec.block_indices[0])
        stats = self.stats
        for i, (block_id, chunk_id) in enumerate(zip(block_ids, chunk_ids)):
            block_hash = request.block_hashes[first + i]
            ok = bytes(self.rows[chunk_id].numpy()) == self._bytes_of(block_hash)
            stats.gpu_loads_verified += 1
            stats.gpu_load_mismatches += not ok
            self.gpu[block_id] = block_hash if ok else None
            if (job.req_id, make_offload_key(block_hash, 0)) in self.tier.promoted:
                if block_hash in self.computed:
                    stats.hit_blocks_kvservice_own += 1
                else:
                    stats.hit_blocks_cross += 1
            else:
                stats.hit_blocks_cpu += 1

    def _forward(self, output: Any) -> None:
        """The blocks this step's scheduled tokens fill now hold their hashes' KV."""
        before = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        manager = self.scheduler.kv_cache_manager
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = before[req_id]
            first, end = start // self.block_size, (start + num_tokens) // self.block_size
            if end <= first:
                continue
            (block_ids, *_others) = manager.get_block_ids(req_id)
            for idx in range(first, end):
                block_hash = request.block_hashes[idx]
                self.gpu[block_ids[idx]] = block_hash
                self.computed.add(block_hash)
            self.stats.blocks_computed += end - first


def _kv_transfer_config(*, target: str, num_cpu_chunks: int, chunk_bytes: int, num_layers: int, transport: str) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=f"kvservice-tier-replay-{uuid.uuid4().hex[:12]}",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": num_cpu_chunks * chunk_bytes,
            "secondary_tiers": [
                {
                    "type": "ReplayTier",
                    "module_path": "kvservice_vllm.tier_replay",
                    "target": target,
                    "transport": transport,
                    "num_layers": num_layers,
                }
            ],
        },
    )


def run_tier_replay(
    items: Sequence[Any],
    *,
    num_instances: int = 2,
    num_gpu_blocks: int = 4096,
    num_cpu_chunks: int = 8192,
    num_server_blocks: int = 131072,
    max_model_len: int = 131072,
    transport: str = "shm",
    max_num_batched_tokens: int = 8192,
) -> TierReplayResult:
    """Serve ``items`` (:class:`kvservice_vllm.drive.TraceItem` s) with ``num_instances`` vLLM
    schedulers sharing one kvservice tier (see the module docstring).

    Args:
        num_gpu_blocks: each instance's GPU KV cache, in 16-token blocks.
        num_cpu_chunks: each instance's CPU primary tier, in chunks (one block each,
            :data:`CHUNK_BYTES`).
        num_server_blocks: kvservice's pool, in chunks (block 0 is the null block).
        max_model_len: tokens; longer requests (and those the GPU pool cannot hold) are left out.
        transport: the tier's ``shm`` or ``grpc``.

    Raises:
        ValueError: fewer than 2 instances.
        AssertionError: the scheduler and the simulated worker disagree on a job's shape.
    """
    from kvservice_vllm.drive import TraceDriver, make_scheduler
    from kvservice_vllm.embedded import EmbeddedTierServer

    if num_instances < 2:
        raise ValueError(f"num_instances must be at least 2, got {num_instances}")
    block_size, chunk_bytes, num_layers = BLOCK_SIZE, CHUNK_BYTES, NUM_LAYERS
    max_model_len = min(max_model_len, (num_gpu_blocks - 1) * block_size)
    kept = [it for it in items if len(it.prompt_token_ids) + len(it.output_token_ids) <= max_model_len]
    started = time.perf_counter()
    server = EmbeddedTierServer(chunk_bytes, num_blocks=num_server_blocks, block_size=block_size)
    schedulers: list[Any] = []
    try:
        drivers: list[TraceDriver] = []
        tiers: list[ReplayTier] = []
        for i in range(num_instances):
            config = _kv_transfer_config(
                target=server.target,
                num_cpu_chunks=num_cpu_chunks,
                chunk_bytes=chunk_bytes,
                num_layers=num_layers,
                transport=transport,
            )
            scheduler = make_scheduler(
                num_blocks=num_gpu_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                num_layers=num_layers,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                kv_transfer_config=config,
            )
            schedulers.append(scheduler)
            tier = scheduler.connector.connector_scheduler.manager.secondary_tiers[0]
            assert isinstance(tier, ReplayTier), type(tier)
            tier.stats.name = chr(ord("A") + i)
            routed = kept[i::num_instances]  # the router: request k to instance k mod N
            tier.stats.num_requests = len(routed)
            drivers.append(TraceDriver(scheduler, routed, worker=_SimulatedWorker(scheduler, tier, tier.stats)))
            tiers.append(tier)
        num_steps = 0
        while any(d.busy for d in drivers):
            for driver, tier in zip(drivers, tiers):
                driver.step()
                # The tier's lookups and copies finish before anything else steps: deterministic.
                tier.wait_lookups()
                tier.drain_jobs()
            num_steps += 1
        for driver, tier in zip(drivers, tiers):
            stats = tier.stats
            stats.num_steps = driver.num_steps
            stats.num_preemptions = driver.result.num_preemptions
            stats.hit_tokens = driver.result.num_hit_tokens
            stats.hit_tokens_cpu = stats.hit_blocks_cpu * block_size
            stats.hit_tokens_kvservice_own = stats.hit_blocks_kvservice_own * block_size
            stats.hit_tokens_cross = stats.hit_blocks_cross * block_size
            stats.hit_tokens_gpu = (
                stats.hit_tokens - stats.hit_tokens_cpu - stats.hit_tokens_kvservice_own - stats.hit_tokens_cross
            )
    finally:
        for scheduler in schedulers:
            scheduler.shutdown()
        server.close()
    return TierReplayResult(
        instances=[t.stats for t in tiers],
        num_requests=len(kept),
        max_model_len=max_model_len,
        chunk_bytes=chunk_bytes,
        num_layers=num_layers,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_chunks=num_cpu_chunks,
        num_server_blocks=num_server_blocks,
        num_steps=num_steps,
        wall_s=time.perf_counter() - started,
    )
