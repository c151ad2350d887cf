"""``kvservice replay --instances N``: KV-aware routing over N servers, against round-robin.

The same trace is replayed twice, each time through N fresh embedded servers (one scheduler per
server, the :class:`~kvservice.replay.scheduler.ReplayScheduler` of the single-server replay), once
per routing policy, in two worker processes. This module runs a policy; the router, its two
policies, the freshness rule and the mirrors' feed seam are :mod:`kvservice.replay.routing`, and the
report (what a run's figures mean, its JSON and table) is :mod:`kvservice.replay.multi_report`.

Simulated time is shared: one clock advances ``step_ms`` per tick; at each tick the requests that
arrived are routed, then every instance with work runs one scheduler step (the instances' Step
RPCs run concurrently). When no instance has work the clock jumps to the next arrival, as a
single scheduler does. Each server is started by ``kvservice.server.app.start_server`` and, of
what that returns, the run uses only its address, ``check_invariants``, ``cached_hashes`` and
``stop``; everything else goes through the client, over gRPC (docs/ARCHITECTURE.md §1.2).

**Pool and load.** Each instance is the single-server replay's server: ``num_blocks`` blocks
(32,768 by default), and the trace arrives N times faster (``arrival_rate_scale``, default N:
arrival times divided by N), so each instance carries about the load the single server carries and
the fleet serves N times the traffic, as a fleet is sized. (Splitting one pool N ways at the
trace's own rate leaves each instance room for a few of the trace's long prompts: requests of up to
120k tokens then preempt one another over and over, history is evicted before a conversation comes
back, and recomputed prefills dominate both the run time and the hit counts.) Routing matters
because conversations come back to their earlier turns: round-robin scatters a conversation's
turns over the instances, the router sends a turn to the instance that holds its history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvservice.replay.multi_report import MultiReport, PolicyReport
from kvservice.replay.progress import Progress, ProgressCallback, run_in_workers, worker_progress
from kvservice.replay.report import AgreementStats, LatencySummary
from kvservice.replay.routing import (
    GRPC_FEED_NAME,
    POLICIES,
    FeedFactory,
    Instance,
    Router,
    RoutingDecision,
    grpc_stream_feed,
)
from kvservice.replay.runner import DEFAULT_NUM_BLOCKS, ReplayConfig, load_requests
from kvservice.replay.scheduler import ReplayRequest, ReplayScheduler, SchedulerConfig
from kvservice.replay.traces import DEFAULT_TRACE, TraceFormat, TraceRequest, ideal_prefix_hits
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.watcher import HitPredictor

__all__ = [
    "MultiReplayConfig",
    "PolicyRun",
    "load_scaled_requests",
    "replay_policy",
    "run_multi_replay",
    "summarise_policy",
]


@dataclass(frozen=True)
class MultiReplayConfig:
    """What a multi-instance replay runs.

    Attributes:
        trace, trace_format, limit: the trace (None = the embedded Mooncake sample), as
            :class:`~kvservice.replay.runner.ReplayConfig`.
        instances: servers per policy (>= 2).
        preset, block_size, device, hash_algorithm: every embedded server's settings.
        model_config: a ``config.json`` (or its folder) whose KV layout the servers take instead
            of ``preset``.
        num_blocks: each instance's pool, in blocks (the null block included, as ``--num-blocks``).
        rate_scale: arrival-rate multiplier (arrival times are divided by it); None = ``instances``,
            so each instance carries about the single-server replay's load.
        report_mode: ``kv_cache_report_mode`` of every request ("full" keeps the mirrors' recency
            right; "incremental").
        mirror_capacity: each mirror's size in blocks; None = an instance's pool (a router that
            forgets blocks its instance still holds cannot route to them; the single-server replay's
            default, half the pool, loses most conversation histories here); 0 = unbounded.
        scheduler: each instance's scheduler limits (its report mode is replaced by ``report_mode``).
        policies: the policies to run, in order (a subset of :data:`~kvservice.replay.routing.POLICIES`).
        show_progress: draw a progress bar (True), plain lines (False), or a bar only in a
            terminal (None).
        nats_url: NATS server URL(s): every server publishes to JetStream and the mirrors are fed
            over it (:class:`~kvservice.replay.jetstream_feed.JetStreamFeeds`); None = the gRPC feed.

    Raises:
        ValueError: a field out of its bounds (named in the message).
    """

    trace: str | None = None
    trace_format: TraceFormat | Literal["auto"] = "auto"
    limit: int | None = None
    instances: int = 2
    preset: str = "llama-3-8b"
    model_config: str | None = None
    block_size: int | None = None
    num_blocks: int = DEFAULT_NUM_BLOCKS
    rate_scale: float | None = None
    device: str = "meta"
    hash_algorithm: str = "sha256_cbor"
    report_mode: str = "full"
    mirror_capacity: int | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    policies: tuple[str, ...] = POLICIES
    show_progress: bool | None = None
    nats_url: str | None = field(default=None, repr=False)  # may hold a password or token

    def __post_init__(self) -> None:
        if self.instances < 2:
            raise ValueError(f"instances must be >= 2 for a routing comparison; got {self.instances}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (the null block and one more); got {self.num_blocks}")
        if self.rate_scale is not None and not (math.isfinite(self.rate_scale) and self.rate_scale > 0):
            raise ValueError(f"rate_scale must be a finite number > 0; got {self.rate_scale}")
        if self.report_mode not in ("incremental", "full"):
            raise ValueError(f"report_mode must be 'incremental' or 'full'; got {self.report_mode!r}")
        if (
            not self.policies
            or any(p not in POLICIES for p in self.policies)
            or len(set(self.policies)) != len(self.policies)
        ):
            raise ValueError(f"policies must be distinct names among {POLICIES}; got {self.policies!r}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0; got {self.limit}")
        if self.mirror_capacity is not None and self.mirror_capacity < 0:
            raise ValueError(f"mirror_capacity must be >= 0 (0: unbounded); got {self.mirror_capacity}")
        if self.nats_url is not None and not self.nats_url.strip():
            raise ValueError("nats_url must name at least one NATS server (or be None); got an empty string")

    @property
    def arrival_rate_scale(self) -> float:
        """The arrival-rate multiplier in effect (``rate_scale``, or ``instances``)."""
        return float(self.rate_scale) if self.rate_scale is not None else float(self.instances)


def load_scaled_requests(config: MultiReplayConfig) -> list[TraceRequest]:
    """The trace's requests (``config.limit`` of them), arrival times divided by
    ``config.arrival_rate_scale``."""
    scale = config.arrival_rate_scale
    requests = load_requests(ReplayConfig(trace=config.trace, trace_format=config.trace_format, limit=config.limit))
    if scale == 1.0:
        return requests
    return [dataclasses.replace(r, arrival_ms=r.arrival_ms / scale) for r in requests]


@dataclass
class PolicyRun:
    """One policy's raw results (tests inspect it).

    Attributes:
        policy: the policy.
        decisions: every routing decision, in arrival order.
        instances: the instances (schedulers with their stats, feeds).
        num_skipped: trace requests not routed: prompt of ``max_model_len`` tokens or more.
        server_cached: per instance, the server's cached hashes per group at the end.
        wall_time_s: the run's wall-clock time (servers' start and stop included), in seconds.
    """

    policy: str
    decisions: list[RoutingDecision]
    instances: list[Instance]
    num_skipped: int = 0
    server_cached: list[list[set]] = field(default_factory=list)
    wall_time_s: float = 0.0


async def _drive(
    instances: list[Instance],
    router: Router,
    requests: Sequence[TraceRequest],
    step_ms: float,
    max_model_len: int,
    progress: Any | None,
) -> int:
    """Run the shared simulated clock until every request finished; returns the requests skipped."""
    arrivals = deque(enumerate(requests))
    num_skipped = 0
    clock_ms = 0.0
    num_admitted = [0] * len(instances)
    while True:
        if not any(inst.scheduler is not None and inst.scheduler.has_work for inst in instances):
            if not arrivals:
                break
            clock_ms = max(clock_ms, arrivals[0][1].arrival_ms)
        while arrivals and arrivals[0][1].arrival_ms <= clock_ms:
            index, request = arrivals.popleft()
            if len(request.prompt_token_ids) >= max_model_len:
                num_skipped += 1
                continue
            decision = await router.route(index, request)
            scheduler = instances[decision.instance].scheduler
            assert scheduler is not None
            scheduler.add_request(request, index)
        active = [
            inst.scheduler
            for inst in instances
            if inst.scheduler is not None and (inst.scheduler.has_work or inst.scheduler.pending)
        ]
        for s in active:
            s.clock_ms = clock_ms
        await asyncio.gather(*(s.step() for s in active))
        for inst in instances:  # routing-time hashes are reused only up to the first admission
            assert inst.scheduler is not None
            admissions = inst.scheduler.stats.admissions
            for a in admissions[num_admitted[inst.idx] :]:
                router.hashes.pop(a.index, None)
            num_admitted[inst.idx] = len(admissions)
        clock_ms += step_ms
        if progress is not None:
            progress(sum(inst.scheduler.stats.num_finished for inst in instances if inst.scheduler is not None))
    return num_skipped


def _admission_predictor(inst: Instance, router: Router) -> Callable[[ReplayRequest, int], Any]:
    """The instance mirror's prediction before each admission (after it applied ``head_seq``)."""

    async def predict(r: ReplayRequest, head_seq: int) -> list[int | None]:
        assert inst.feed is not None and inst.predictor is not None
        await inst.feed.wait_applied(head_seq)
        cached = router.hashes.get(r.index)
        num_tokens = len(r.token_ids)
        hashes = (
            cached[1] if cached is not None and cached[0] == num_tokens else inst.predictor.hash_prompt(r.token_ids)
        )
        return [inst.predictor.predict_hit_tokens_from_hashes(hashes, num_tokens)]

    return predict


async def replay_policy(
    policy: str,
    config: MultiReplayConfig,
    *,
    requests: Sequence[TraceRequest] | None = None,
    feed_factory: FeedFactory | None = None,
    progress: ProgressCallback | None = None,
    runs: list[PolicyRun] | None = None,
) -> PolicyReport:
    """Replay the trace under one routing policy on ``config.instances`` fresh embedded servers.

    Args:
        policy: "routed" or "round-robin".
        config: what to replay.
        requests: the trace (default: loaded from ``config``).
        feed_factory: builds each instance's mirror (default: a
            :class:`~kvservice.replay.jetstream_feed.JetStreamFeeds` of this run with
            ``config.nats_url``, else :func:`~kvservice.replay.routing.grpc_stream_feed`). With
            ``config.nats_url`` every server publishes to a stream of this run, deleted at the end.
        progress: told ``(policy, requests finished)`` as the replay goes (it draws nothing itself).
        runs: when given, the raw :class:`PolicyRun` is appended.

    Raises:
        KVServiceError: a call failed.
        RuntimeError: a request cannot fit an empty instance, or a feed ended.
        ValueError: a bad server setting.
    """
    from kvservice.server.app import start_server

    if requests is None:
        requests = load_scaled_requests(config)
    nats_feeds = None
    if config.nats_url is not None:
        from kvservice.replay.jetstream_feed import JetStreamFeeds

        nats_feeds = JetStreamFeeds(config.nats_url, policy)
    if feed_factory is None:
        feed_factory = nats_feeds if nats_feeds is not None else grpc_stream_feed
    started = time.perf_counter()
    scheduler_config = dataclasses.replace(config.scheduler, kv_cache_report_mode=config.report_mode)
    servers = []
    instances: list[Instance] = []
    # Unwound last in, first out, each step even when one before it raised: the feeds, then each
    # instance's client and server, then the run's stream.
    async with contextlib.AsyncExitStack() as closing:
        if nats_feeds is not None:
            closing.push_async_callback(nats_feeds.delete_stream)
        for i in range(config.instances):
            server = await start_server(
                port=0,
                preset=config.preset,
                model_config=config.model_config,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                device=config.device,
                hash_algorithm=config.hash_algorithm,
                grace_seconds=1.0,
                **(nats_feeds.server_settings(i) if nats_feeds is not None else {}),
            )
            closing.push_async_callback(server.stop, 0)
            servers.append(server)
            client = AsyncKVCacheClient(server.address, timeout=120.0)
            closing.push_async_callback(client.close)
            metadata = await client.get_kv_cache_group_metadata()
            pool_blocks = metadata.groups[0].num_blocks - 1
            capacity = config.mirror_capacity if config.mirror_capacity is not None else pool_blocks
            instances.append(Instance(i, server.address, client, metadata, capacity or None))
        router = Router(policy, instances)
        for inst in instances:  # every feed is built before any starts (FeedFactory)
            inst.feed = feed_factory(inst)
            closing.push_async_callback(inst.feed.close)
            inst.predictor = HitPredictor(inst.metadata, inst.feed.index)
            inst.scheduler = ReplayScheduler(
                inst.client,
                (),
                scheduler_config,
                predictor=_admission_predictor(inst, router),
                max_model_len=inst.metadata.max_model_len,
            )
        for inst in instances:
            assert inst.feed is not None
            await inst.feed.start()
        report = None if progress is None else (lambda finished: progress(policy, finished))
        num_skipped = await _drive(
            instances, router, requests, scheduler_config.step_ms, instances[0].metadata.max_model_len, report
        )
        for inst in instances:
            assert inst.feed is not None and inst.scheduler is not None
            await inst.feed.wait_applied(inst.scheduler.head_seq)
        for server in servers:
            server.check_invariants()
        run = PolicyRun(
            policy, router.decisions, instances, num_skipped, [server.cached_hashes() for server in servers]
        )
    run.wall_time_s = time.perf_counter() - started
    if runs is not None:
        runs.append(run)
    return summarise_policy(run, config)


def summarise_policy(run: PolicyRun, config: MultiReplayConfig) -> PolicyReport:
    """The :class:`~kvservice.replay.multi_report.PolicyReport` of a run."""
    bs = run.instances[0].metadata.groups[0].block_size
    schedulers = [inst.scheduler for inst in run.instances if inst.scheduler is not None]
    assert len(schedulers) == len(run.instances), "every instance has its scheduler once the run started"
    admissions = [a for s in schedulers for a in s.stats.admissions]
    first_admission = {a.index: a for a in admissions if not a.readmission}
    firsts = list(first_admission.values())
    routed = [d for d in run.decisions if d.predicted_hit_tokens]
    routing = (
        AgreementStats.from_pairs(
            [d.predicted_hit_tokens[d.instance] // bs for d in routed],
            [first_admission[d.index].actual_hit_tokens // bs for d in routed],
        )
        if routed
        else None
    )
    num_requests_per_instance = [0] * len(run.instances)
    for d in run.decisions:
        num_requests_per_instance[d.instance] += 1
    reasons = {r: sum(1 for d in run.decisions if d.reason == r) for r in ("hit", "load", "round-robin")}
    latency = [ms for s in schedulers for ms in s.stats.rpc_latency_ms]
    feeds = [inst.feed for inst in run.instances]
    return PolicyReport(
        policy=run.policy,
        num_requests=sum(s.stats.num_finished for s in schedulers),
        num_skipped=run.num_skipped,
        num_prompt_tokens=sum(a.num_tokens for a in firsts),
        num_hit_tokens=sum(a.actual_hit_tokens for a in firsts),
        num_prompt_blocks=sum(a.num_tokens // bs for a in firsts),
        num_hit_blocks=sum(a.actual_hit_tokens // bs for a in firsts),
        num_admitted_tokens=sum(a.num_tokens for a in admissions),
        num_admitted_hit_tokens=sum(a.actual_hit_tokens for a in admissions),
        num_requests_per_instance=num_requests_per_instance,
        num_hit_tokens_per_instance=[
            sum(a.actual_hit_tokens for a in s.stats.admissions if not a.readmission) for s in schedulers
        ],
        num_prompt_tokens_per_instance=[
            sum(a.num_tokens for a in s.stats.admissions if not a.readmission) for s in schedulers
        ],
        num_decisions_by_reason=reasons,
        routing_agreement=routing,
        admission_agreement=AgreementStats.from_pairs(
            [a.prediction(0) // bs for a in admissions], [a.actual_hit_tokens // bs for a in admissions]
        ),
        num_preemptions=sum(s.stats.num_preemptions for s in schedulers),
        num_steps=sum(s.stats.num_steps for s in schedulers),
        num_events=sum(f.num_events for f in feeds if f is not None),
        num_batches=sum(f.num_batches for f in feeds if f is not None),
        rpc_latency=LatencySummary.from_samples(latency),
        wall_time_s=run.wall_time_s,
        mirror_capacity_blocks=run.instances[0].capacity_blocks or 0,
        block_size=bs,
        max_model_len=run.instances[0].metadata.max_model_len,
        assignments=[(d.index, d.instance) for d in run.decisions],
        hit_series=sorted((a.index, a.num_tokens, a.actual_hit_tokens) for a in firsts),
    )


def _replay_policy_in_process(policy: str, config: MultiReplayConfig) -> PolicyReport:
    """Worker-process entry point: one policy, its own event loop and servers; progress goes to
    the parent through the queue the pool was started with."""
    return asyncio.run(replay_policy(policy, config, progress=worker_progress()))


async def run_multi_replay(
    config: MultiReplayConfig,
    *,
    runs: list[PolicyRun] | None = None,
    parallel: bool = True,
    feed_factory: FeedFactory | None = None,
) -> MultiReport:
    """Run every policy of ``config`` and build the report.

    With two policies, each runs in its own worker process (two fresh sets of servers, same trace),
    unless ``runs`` is given (then in this process, and each raw :class:`PolicyRun` is appended),
    ``parallel`` is False, ``feed_factory`` is given, or the machine has one core. The mirrors are
    fed by ``feed_factory`` (default: over JetStream with ``config.nats_url``, else over gRPC; see
    :func:`replay_policy`); ``metadata["feed"]`` names the feed.

    Raises:
        as :func:`replay_policy`.
    """
    requests = load_scaled_requests(config)
    policies = list(config.policies)
    if feed_factory is grpc_stream_feed and config.nats_url is None:
        feed_factory = None  # the default: the workers build it
    in_workers = parallel and runs is None and feed_factory is None and len(policies) > 1 and (os.cpu_count() or 1) > 1
    progress = Progress(policies, len(requests), bar=config.show_progress)
    try:
        if in_workers:
            reports = await run_in_workers(_replay_policy_in_process, [(p, config) for p in policies], progress)
        else:
            reports = [
                await replay_policy(
                    p, config, requests=requests, feed_factory=feed_factory, progress=progress.update, runs=runs
                )
                for p in policies
            ]
    finally:
        progress.close()
    block_size = reports[0].block_size
    # The ideal covers the requests the servers accept (a prompt under max_model_len).
    accepted = [requests[i] for i, _ in sorted(reports[0].assignments)]
    ideal = ideal_prefix_hits(accepted, block_size) if accepted else []
    return MultiReport(
        trace_path=config.trace or str(DEFAULT_TRACE),
        num_trace_lines=len(requests),
        preset=config.preset,
        block_size=block_size,
        instances=config.instances,
        num_blocks_per_instance=config.num_blocks,
        arrival_rate_scale=config.arrival_rate_scale,
        report_mode=config.report_mode,
        policies=reports,
        ideal_hit_rate_tokens_pct=100.0 * sum(ideal) / max(sum(len(r.prompt_token_ids) for r in accepted), 1),
        metadata={
            "hash_algorithm": config.hash_algorithm,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "step_ms": config.scheduler.step_ms,
            "device": config.device,
            "feed": _feed_name(config, feed_factory),
        },
    )


def _feed_name(config: MultiReplayConfig, feed_factory: FeedFactory | None) -> str:
    """The name of the feed a run used (``metadata["feed"]`` of its report)."""
    if feed_factory is None and config.nats_url is not None:
        from kvservice.replay.jetstream_feed import describe_jetstream_feed

        return describe_jetstream_feed(config.nats_url)
    if feed_factory is None or feed_factory is grpc_stream_feed:
        return GRPC_FEED_NAME
    return repr(feed_factory)
