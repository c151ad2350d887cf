"""``kvservice replay``: a trace through the service, watchers' mirrors beside it, and a report.

For each report mode (``incremental``, ``full``, or both: two fresh servers, same trace) it
starts an embedded server through ``kvservice.server.app.start_server`` (or uses ``--target``),
runs the :class:`~kvservice.replay.scheduler.ReplayScheduler` over the trace, and runs one or more
watchers: each subscribes to ``StreamEvents`` (snapshot first), keeps a
:class:`~kvservice_client.watcher.PrefixIndex` bounded by an LRU on last announcement (as a
memory-bounded KV-aware router does), and, before every admission, predicts the request's hit by
hashing the prompt itself with the published rule. A *late watcher* can join halfway through from
a snapshot. The report compares predictions with the hits the server used.

Why incremental mode decays: a hot prefix (a system prompt, a long conversation's history) is
announced once, when it is first cached. The server keeps it (every hit refreshes its place in the
free queue) but a bounded mirror, which only sees announcements, lets it age out behind newer
blocks, and then predicts a miss where the server hits. In full mode every admission that reuses a
prefix re-announces it (``reused`` BlockStored), so the mirror's recency follows the server's and
hot prefixes stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

from kvservice.replay.progress import Progress, ProgressCallback, run_in_workers, worker_progress
from kvservice.replay.report import AgreementStats, LatencySummary, ModeReport, ReplayReport
from kvservice.replay.scheduler import ReplayRequest, ReplayScheduler, SchedulerConfig, SchedulerStats
from kvservice.replay.traces import DEFAULT_TRACE, TraceFormat, TraceRequest, ideal_prefix_hits, read_trace
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.watcher import EventWatcher, HitPredictor, PrefixIndex

__all__ = [
    "DEFAULT_NUM_BLOCKS",
    "PARALLEL_MIN_REQUESTS",
    "MirrorWatcher",
    "ModeResult",
    "ModeRun",
    "ReplayConfig",
    "load_requests",
    "replay_mode",
    "run_mode",
    "run_replay",
]

DEFAULT_NUM_BLOCKS = 32768
"""Default pool: 32k blocks of 16 tokens (512k tokens); the embedded trace needs ~680k distinct
blocks, so the pool evicts and the report modes differ."""


@dataclass(frozen=True)
class ReplayConfig:
    """What to replay and how.

    Attributes:
        trace: trace file (None = the embedded Mooncake conversation sample).
        trace_format: "auto", "mooncake", "azure" or "tokens".
        limit: replay only the first N requests.
        target: an existing server "host:port" (its prefix cache is reset before each mode);
            None = start an embedded server per mode.
        preset, block_size, num_blocks, device, hash_algorithm: the embedded server's settings
            (device "meta": real tensor shapes, no memory, as no model runs in a replay).
        model_config: a Hugging Face ``config.json`` (or its folder) whose KV layout the embedded
            server takes instead of ``preset`` (the server's ``model_config``).
        kv_cache_memory: size the embedded server's pool from this many bytes of KV cache (as
            vLLM sizes it: ``bytes // the largest group's bytes per block``) instead of
            ``num_blocks`` (None: use ``num_blocks``).
        report_modes: the modes to run, in order.
        watchers: watchers per mode (each predicts; watcher 0 is reported).
        late_watcher: add a watcher that joins from a snapshot halfway through.
        mirror_capacity: mirror size in blocks; None = half the pool; 0 = unbounded.
        scheduler: scheduler limits.
        show_progress: draw a progress bar (True), plain lines (False), or a bar only in a
            terminal (None).
        kv_data: "shm" (a worker writes every newly computed block through the attached memory
            and checks every hit's blocks at admission), "grpc" (the same over WriteBlocks /
            ReadBlocks) or "off"; see ``kvservice.replay.kv_data``. Needs a device with memory.
        kv_data_sample: move and check 1 in N blocks (chosen by hash).
        kv_data_lag: the worker writes a step's blocks this many steps later (0: at once), so hits
            come before their bytes and requests are freed before theirs are written.
    """

    trace: str | None = None
    trace_format: TraceFormat | Literal["auto"] = "auto"
    limit: int | None = None
    target: str | None = None
    preset: str = "llama-3-8b"
    model_config: str | None = None
    block_size: int | None = None
    num_blocks: int = DEFAULT_NUM_BLOCKS
    kv_cache_memory: int | None = None
    device: str = "meta"
    hash_algorithm: str = "sha256_cbor"
    report_modes: tuple[str, ...] = ("incremental", "full")
    watchers: int = 1
    late_watcher: bool = False
    mirror_capacity: int | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    show_progress: bool | None = None
    kv_data: str = "off"
    kv_data_sample: int = 1
    kv_data_lag: int = 0

    def __post_init__(self) -> None:
        if self.kv_data not in ("shm", "grpc", "off"):
            raise ValueError(f"kv_data must be 'shm', 'grpc' or 'off'; got {self.kv_data!r}")
        if self.kv_data != "off" and self.device == "meta" and self.target is None:
            raise ValueError(
                f"kv_data {self.kv_data!r} needs memory behind the KV tensors: device 'cpu' (or cuda), not meta"
            )
        if self.kv_data_sample < 1:
            raise ValueError(f"kv_data_sample must be >= 1; got {self.kv_data_sample}")
        if self.kv_data_lag < 0:
            raise ValueError(f"kv_data_lag must be >= 0; got {self.kv_data_lag}")
        if self.watchers < 1:
            raise ValueError(f"watchers must be >= 1; got {self.watchers}")
        if not self.report_modes or any(m not in ("incremental", "full") for m in self.report_modes):
            raise ValueError(f"report_modes must be 'incremental' and/or 'full'; got {self.report_modes!r}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0; got {self.limit}")
        if self.mirror_capacity is not None and self.mirror_capacity < 0:
            raise ValueError(f"mirror_capacity must be >= 0 (0: unbounded); got {self.mirror_capacity}")


class MirrorWatcher:
    """A watcher task: applies the event stream to a bounded :class:`PrefixIndex` and predicts hits.

    Args:
        client: the service.
        metadata: its ``GetKVCacheGroupMetadata``.
        capacity_blocks: the index's capacity (None = unbounded).
    """

    def __init__(
        self, client: AsyncKVCacheClient, metadata: pb.GetKVCacheGroupMetadataResponse, capacity_blocks: int | None
    ) -> None:
        self.index = PrefixIndex(capacity_blocks)
        self.predictor = HitPredictor(metadata, self.index)
        self.watcher = EventWatcher(client, max_pending_batches=256)
        self.applied_seq = -1
        self.num_batches = 0
        self.num_events = 0
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start following the stream; returns once the initial snapshot is applied."""
        self._task = asyncio.create_task(self._run())
        await self.wait_applied(0)

    async def _run(self) -> None:
        try:
            async for watched in self.watcher:
                self.index.apply_batch(watched.batch)
                self.num_batches += 1
                self.num_events += len(watched.batch.events)
                if watched.snapshot_more:
                    continue  # the mirror matches the server only once the snapshot is whole
                self.applied_seq = watched.seq
                self._progress.set()
        finally:
            self._progress.set()  # a waiter wakes and finds the task ended

    async def wait_applied(self, seq: int) -> None:
        """Return once every batch up to ``seq`` is applied.

        Raises:
            the watcher task's error, if it failed.
        """
        assert self._task is not None
        while self.applied_seq < seq:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the event stream ended")
            self._progress.clear()
            await self._progress.wait()

    async def close(self) -> None:
        """Stop following."""
        await self.watcher.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@dataclass
class ModeRun:
    """One mode's results, before they are summarised.

    Attributes:
        mode: the report mode.
        stats: the scheduler's stats.
        watchers: the watchers (watcher 0 first).
        late: the late watcher, if any.
        late_join_admission: admissions made before the late watcher joined.
        pool_blocks: blocks in the server's pool.
        block_size: the service's block size (group 0).
        usage: the server's usage at the end.
        server_cached: the server's cached hashes per group at the end (embedded servers only).
    """

    mode: str
    stats: SchedulerStats
    watchers: list[MirrorWatcher]
    late: MirrorWatcher | None
    late_join_admission: int
    pool_blocks: int
    block_size: int
    usage: pb.GetUsageResponse
    server_cached: list[set] | None = None
    mirror_capacity: int = 0
    max_model_len: int = 0
    preset: str = ""
    kv_data: dict | None = None


async def run_mode(
    mode: str,
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    address: str,
    *,
    progress: ProgressCallback | None = None,
) -> ModeRun:
    """Replay ``requests`` in one report mode against the server at ``address``; ``progress``
    is told ``(mode, requests finished)`` after every step.

    However it ends, every watcher is closed before the client (a replay that fails leaves no
    watcher task behind to fail later, unseen)."""
    async with AsyncKVCacheClient(address, timeout=120.0) as client, contextlib.AsyncExitStack() as watching:
        metadata = await client.get_kv_cache_group_metadata()
        pool_blocks = metadata.groups[0].num_blocks - 1
        capacity = config.mirror_capacity
        if capacity is None:
            capacity = max(pool_blocks // 2, 1)
        capacity_blocks = capacity or None
        watchers = [MirrorWatcher(client, metadata, capacity_blocks) for _ in range(config.watchers)]
        for w in watchers:
            watching.push_async_callback(w.close)
            await w.start()
        late: MirrorWatcher | None = None
        late_join_admission = -1
        hasher = watchers[0].predictor
        scheduler_config = dataclasses.replace(config.scheduler, kv_cache_report_mode=mode)
        num_requests = len(requests)

        async def predict(r: ReplayRequest, head_seq: int) -> list[int | None]:
            """Every watcher's prediction (the late one last; None before it joins)."""
            active = watchers + ([late] if late is not None else [])
            for w in active:
                await w.wait_applied(head_seq)
            hashes = hasher.hash_prompt(r.token_ids)  # once, for every watcher
            predictions: list[int | None] = [
                w.predictor.predict_hit_tokens_from_hashes(hashes, len(r.token_ids)) for w in active
            ]
            if config.late_watcher and late is None:
                predictions.append(None)
            return predictions

        async def on_step(stats: SchedulerStats, head_seq: int) -> None:
            nonlocal late, late_join_admission
            if progress is not None:
                progress(mode, stats.num_finished)
            if config.late_watcher and late is None and len(stats.admissions) >= num_requests // 2:
                late = MirrorWatcher(client, metadata, capacity_blocks)
                watching.push_async_callback(late.close)
                await late.start()
                late_join_admission = len(stats.admissions)

        kv_worker = None
        if config.kv_data != "off":
            from kvservice.replay.kv_data import KVDataWorker

            view = None
            if config.kv_data == "shm":
                from kvservice_client.torch_view import aattach

                view = await aattach(client)
            kv_worker = KVDataWorker(
                config.kv_data, client, metadata, view=view, sample=config.kv_data_sample, lag=config.kv_data_lag
            )
        scheduler = ReplayScheduler(
            client,
            requests,
            scheduler_config,
            predictor=predict,
            on_step=on_step,
            max_model_len=metadata.max_model_len,
            kv_worker=kv_worker,
        )
        stats = await scheduler.run()
        usage = await client.get_usage()
        for w in watchers + ([late] if late is not None else []):
            await w.wait_applied(scheduler.head_seq)
        return ModeRun(
            mode,
            stats,
            watchers,
            late,
            late_join_admission,
            pool_blocks,
            metadata.groups[0].block_size,
            usage,
            mirror_capacity=capacity,
            max_model_len=metadata.max_model_len,
            preset=metadata.preset,
            kv_data=kv_worker.stats.to_dict() if kv_worker is not None else None,
        )


def summarise(run: ModeRun, wall_time_s: float) -> ModeReport:
    """The :class:`ModeReport` of a run (agreement of watcher 0)."""
    bs = run.block_size
    admissions = run.stats.admissions
    w0 = run.watchers[0]
    predicted = [a.prediction(0) // bs for a in admissions]
    actual = [a.actual_hit_tokens // bs for a in admissions]
    firsts = [a for a in admissions if not a.readmission]
    return ModeReport(
        mode=run.mode,
        num_requests=run.stats.num_finished,
        num_prompt_tokens=sum(a.num_tokens for a in admissions),
        num_hit_tokens=sum(a.actual_hit_tokens for a in admissions),
        num_prompt_blocks=sum(a.num_tokens // bs for a in admissions),
        num_hit_blocks=sum(a.actual_hit_tokens // bs for a in admissions),
        num_first_admission_prompt_tokens=sum(a.num_tokens for a in firsts),
        num_first_admission_hit_tokens=sum(a.actual_hit_tokens for a in firsts),
        num_prefill_tokens=run.stats.num_prefill_tokens,
        agreement=AgreementStats.from_pairs(predicted, actual),
        num_events=w0.num_events,
        num_batches=w0.num_batches,
        num_preemptions=run.stats.num_preemptions,
        rpc_latency=LatencySummary.from_samples(run.stats.rpc_latency_ms),
        wall_time_s=wall_time_s,
        mirror_capacity_blocks=run.mirror_capacity,
        pool_size_blocks=run.pool_blocks,
        num_readmission_max_hit_tokens=sum(max(a.num_tokens - 1, 0) // bs * bs for a in admissions if a.readmission),
        series=[(i, p, a) for i, (p, a) in enumerate(zip(predicted, actual))],
        kv_data=run.kv_data,
    )


def late_agreements(run: ModeRun) -> tuple[AgreementStats, AgreementStats] | None:
    """(late watcher, watcher 0) agreement over the admissions after the late watcher joined."""
    if run.late is None:
        return None
    bs = run.block_size
    after = run.stats.admissions[run.late_join_admission :]
    actual = [a.actual_hit_tokens // bs for a in after]
    late = [a.prediction(-1) // bs for a in after]
    first = [a.prediction(0) // bs for a in after]
    return AgreementStats.from_pairs(late, actual), AgreementStats.from_pairs(first, actual)


@dataclass
class ModeResult:
    """What one mode's replay returns (picklable: it may come back from a worker process).

    Attributes:
        report: the mode's figures.
        late: (late watcher, watcher 0) agreement after the late watcher joined, if one ran.
        server_hit_rate: the server's own prefix-cache counters (hits / queries, lookups included
            that did not lead to an admission).
        preset, block_size, num_blocks: the server's layout.
    """

    report: ModeReport
    late: tuple[AgreementStats, AgreementStats] | None
    server_hit_rate: float | None
    preset: str
    block_size: int
    num_blocks: int
    num_skipped: int = 0
    num_length_capped: int = 0
    max_model_len: int = 0


def load_requests(config: ReplayConfig) -> list[TraceRequest]:
    """The trace's requests (``config.limit`` of them)."""
    trace_path = config.trace or str(DEFAULT_TRACE)
    return list(read_trace(trace_path, format=config.trace_format, limit=config.limit))


async def replay_mode(
    mode: str,
    config: ReplayConfig,
    *,
    requests: Sequence[TraceRequest] | None = None,
    progress: ProgressCallback | None = None,
    runs: list[ModeRun] | None = None,
) -> ModeResult:
    """Replay the trace in one report mode on a fresh embedded server (or ``config.target``).

    Args:
        mode: "incremental" or "full".
        config: what to replay.
        requests: the trace (default: loaded from ``config``).
        progress: told ``(mode, requests finished)`` as the replay goes (it draws nothing itself).
        runs: when given, the raw :class:`ModeRun` is appended (tests inspect it).

    Raises:
        RuntimeError: ``config.target`` holds blocks (its cache cannot be reset), or a request
            cannot fit the pool.
    """
    from kvservice.server.app import start_server

    if requests is None:
        requests = load_requests(config)
    started = time.perf_counter()
    server = None
    if config.target is None:
        server = await start_server(
            port=0,
            preset=config.preset,
            model_config=config.model_config,
            block_size=config.block_size,
            num_blocks=None if config.kv_cache_memory is not None else config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            device=config.device,
            hash_algorithm=config.hash_algorithm,
            grace_seconds=1.0,
        )
        address = server.address
    else:
        address = config.target
        async with AsyncKVCacheClient(address) as client:
            if not (await client.reset_prefix_cache()).reset:
                raise RuntimeError(f"{address} holds blocks; replay needs a server whose cache it can reset")
    try:
        run = await run_mode(mode, requests, config, address, progress=progress)
        if server is not None:
            server.check_invariants()
            run.server_cached = server.cached_hashes()
    finally:
        if server is not None:
            await server.stop(0)
    if runs is not None:
        runs.append(run)
    usage = run.usage
    report = summarise(run, time.perf_counter() - started)
    late = late_agreements(run)
    if late is not None:
        report.late_watcher, report.first_watcher_since_late_join = late
    return ModeResult(
        report=report,
        late=late,
        server_hit_rate=usage.prefix_cache_hits / usage.prefix_cache_queries if usage.prefix_cache_queries else None,
        preset=run.preset or "(unknown)",
        block_size=run.block_size,
        num_blocks=run.pool_blocks + 1,
        num_skipped=run.stats.num_skipped,
        num_length_capped=run.stats.num_length_capped,
        max_model_len=run.max_model_len,
    )


PARALLEL_MIN_REQUESTS = 200
"""Below this many requests the modes run one after the other in this process. A worker process
first pays its own start-up (the replay and the server imported again, torch too on a device with
memory: 0.4 to 0.7 s on a loaded 2-core machine with ``meta``, about one ``import torch`` more
otherwise) which a mode this short (about 0.1 s per request there) does not win back; longer
replays run one worker per mode, in parallel."""


def _replay_mode_in_process(mode: str, config: ReplayConfig) -> ModeResult:
    """Worker-process entry point: one mode, its own event loop and embedded server; progress
    goes to the parent through the queue the pool was started with."""
    return asyncio.run(replay_mode(mode, config, progress=worker_progress()))


async def run_replay(
    config: ReplayConfig,
    *,
    runs: list[ModeRun] | None = None,
    parallel: bool = True,
    progress_stream: TextIO | None = None,
) -> ReplayReport:
    """Run every mode of ``config`` and build the report.

    With several modes on embedded servers and at least :data:`PARALLEL_MIN_REQUESTS` requests,
    each mode runs in its own worker process (the modes are independent: two fresh servers, same
    trace), so the replay uses two cores. Progress is one display in this process
    (:class:`~kvservice.replay.progress.Progress`): a bar with ``show_progress`` (by default in a
    terminal), else a plain line every 10 s and at the end of each mode.

    Args:
        config: what to replay.
        runs: when given, each mode runs in this process and its raw :class:`ModeRun` is appended.
        parallel: allow worker processes.
        progress_stream: where progress goes (default stdout).
    """
    requests = load_requests(config)
    modes = list(config.report_modes)
    progress = Progress(modes, len(requests), bar=config.show_progress, stream=progress_stream)
    try:
        if (
            parallel
            and runs is None
            and config.target is None
            and len(modes) > 1
            and len(requests) >= PARALLEL_MIN_REQUESTS
            and (os.cpu_count() or 1) > 1
        ):
            results = await run_in_workers(_replay_mode_in_process, [(mode, config) for mode in modes], progress)
        else:
            results = [
                await replay_mode(mode, config, requests=requests, progress=progress.update, runs=runs)
                for mode in modes
            ]
    finally:
        progress.close()
    metadata: dict[str, str | int | float | bool | None] = {}
    for mode, result in zip(modes, results):
        metadata[f"requests_skipped_longer_than_max_model_len_{mode}"] = result.num_skipped
        metadata[f"requests_stopped_at_max_model_len_{mode}"] = result.num_length_capped
        metadata[f"server_prefix_cache_hit_rate_{mode}"] = result.server_hit_rate
    first = results[0]
    # The ideal covers the requests a server accepts (a prompt under max_model_len).
    accepted = [r for r in requests if len(r.prompt_token_ids) < first.max_model_len]
    ideal = ideal_prefix_hits(accepted, first.block_size) if accepted else []
    ideal_pct = 100.0 * sum(ideal) / max(sum(len(r.prompt_token_ids) for r in accepted), 1)
    for result in results:  # the bound over each mode's own admissions (readmissions included)
        result.report.num_ideal_hit_tokens = sum(ideal) + result.report.num_readmission_max_hit_tokens
    metadata.update(
        {
            "hash_algorithm": config.hash_algorithm,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "step_ms": config.scheduler.step_ms,
            "watchers": config.watchers,
            "device": config.device,
            "kv_data": config.kv_data,
        }
    )
    return ReplayReport(
        trace_path=config.trace or str(DEFAULT_TRACE),
        num_trace_lines=len(requests),
        preset=first.preset,
        block_size=first.block_size,
        num_blocks=first.num_blocks,
        modes=[r.report for r in results],
        ideal_hit_rate_tokens_pct=ideal_pct,
        metadata=metadata,
    )
