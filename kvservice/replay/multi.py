"""``kvservice replay --instances N``: KV-aware routing over N servers, against round-robin.

The same trace is replayed twice, each time through N fresh embedded servers (one scheduler per
server, the :class:`~kvservice.replay.scheduler.ReplayScheduler` of the single-server replay), once
per routing policy, in two worker processes:

* ``routed``: a router keeps one mirror per instance (a :class:`MirrorFeed`; by default a
  ``StreamEvents`` watcher, snapshot first, feeding a
  :class:`~kvservice_client.watcher.PrefixIndex` as large as the instance's pool). For each arriving request it hashes the prompt
  once, predicts the prefix-cache hit on every instance with a
  :class:`~kvservice_client.watcher.HitPredictor`, and sends it to the instance with the longest
  predicted hit; ties go to the least loaded instance (fewest routed requests not yet finished),
  then round-robin (the first tied instance at or after ``trace index mod N``).
* ``round-robin``: request ``i`` of the trace goes to instance ``i mod N``. Its mirrors only
  predict at admission (for the report), never route.

Simulated time is shared: one clock advances ``step_ms`` per tick; at each tick the requests that
arrived are routed, then every instance with work runs one scheduler step (the instances' Step
RPCs run concurrently). When no instance has work the clock jumps to the next arrival, as a
single scheduler does.

**Freshness rule.** A routing decision uses only what the mirrors have applied, and each mirror is
waited for up to the ``StepResponse.head_seq`` its instance's scheduler last received (every Step
of the previous tick has returned, and only that scheduler changes its server), so the router
sees each instance's cache exactly as it stands when the request arrives, bounded only by the
mirror's capacity. It never asks a server for a hit. Requests that arrive in the same tick are
routed in trace order against that same state (none of them is admitted yet); the load tie-break
counts the ones already routed. The router predicts at arrival; the request may wait before it
is admitted, so the report gives both the routing prediction against the hit the server used at
the request's first admission, and each instance mirror's prediction at admission (as the
single-server replay reports).

**Pool and load.** Each instance is the single-server replay's server: ``num_blocks`` blocks
(32,768 by default), and the trace arrives N times faster (``arrival_rate_scale``, default N:
arrival times divided by N), so each instance carries about the load the single server carries and
the fleet serves N times the traffic, as a fleet is sized. (Splitting one pool N ways at the
trace's own rate leaves each instance room for a few of the trace's long prompts: requests of up to
120k tokens then preempt one another over and over, history is evicted before a conversation comes
back, and recomputed prefills dominate both the run time and the hit counts.) Routing matters
because conversations come back to their earlier turns: round-robin scatters a conversation's
turns over the instances, the router sends a turn to the instance that holds its history.

**A limit of longest-hit routing.** An instance whose cache lost a prefix that every request
shares (a system prompt) predicts less than every warm instance for every request, so it receives
none and never warms again (the balance row shows it). The embedded trace opens with ten
requests at once, so every instance warms at the start; a trace that opens with one request at a
time sends everything to the first instance.

**Hit rates** are counted over each request's first admission, i.e. over the trace's prompts (the
same tokens for both policies); a recompute after a preemption hits its own blocks, which says
nothing about routing, and is reported apart.

**Feeds.** A mirror is "a :class:`~kvservice_client.watcher.PrefixIndex` fed by some transport":
:class:`MirrorFeed` is that seam (``index``, ``start``, ``wait_applied(seq)``, ``close``), built per
instance by a :data:`FeedFactory`. :func:`grpc_stream_feed` is the gRPC ``StreamEvents`` feed (the
default); with ``nats_url`` (``--nats-url``) every server publishes to NATS JetStream and
:class:`~kvservice.replay.jetstream_feed.JetStreamFeeds` feeds the mirrors from one durable consumer
(a stream per policy run). Both carry the event log's seq, so the freshness rule and the results
are the same over either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvservice.replay.progress import Progress, ProgressCallback, run_in_workers, worker_progress
from kvservice.replay.report import (
    _LATENCY_FIELDS,
    AgreementStats,
    LatencySummary,
    _agreement_from_dict,
    _agreement_to_dict,
    _fmt_pct,
    _pct,
    write_json_with_compact_lists,
)
from kvservice.replay.runner import DEFAULT_NUM_BLOCKS, MirrorWatcher, ReplayConfig, load_requests
from kvservice.replay.scheduler import ReplayRequest, ReplayScheduler, SchedulerConfig
from kvservice.replay.traces import DEFAULT_TRACE, TraceRequest, ideal_prefix_hits
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.watcher import HitPredictor, PrefixIndex

__all__ = [
    "GRPC_FEED_NAME",
    "MULTI_REPORT_SCHEMA",
    "POLICIES",
    "FeedFactory",
    "Instance",
    "MirrorFeed",
    "MultiReplayConfig",
    "MultiReport",
    "PolicyReport",
    "PolicyRun",
    "Router",
    "RoutingDecision",
    "grpc_stream_feed",
    "read_multi_json",
    "render_multi_table",
    "replay_policy",
    "run_multi_replay",
    "write_multi_json",
]

POLICIES = ("routed", "round-robin")
"""The routing policies compared, in report order."""

MULTI_REPORT_SCHEMA = "kvservice.replay.multi/v1"
"""The ``schema`` value of a report written by :func:`write_multi_json`."""


@dataclass(frozen=True)
class MultiReplayConfig:
    """What a multi-instance replay runs.

    Attributes:
        trace, trace_format, limit: the trace (None = the embedded Mooncake sample), as
            :class:`~kvservice.replay.runner.ReplayConfig`.
        instances: servers per policy (>= 2).
        preset, block_size, device, hash_algorithm: every embedded server's settings.
        num_blocks: each instance's pool, in blocks (the null block included, as ``--num-blocks``).
        rate_scale: arrival-rate multiplier (arrival times are divided by it); None = ``instances``,
            so each instance carries about the single-server replay's load.
        report_mode: ``kv_cache_report_mode`` of every request ("full" keeps the mirrors' recency
            right; "incremental").
        mirror_capacity: each mirror's size in blocks; None = an instance's pool (a router that
            forgets blocks its instance still holds cannot route to them; the single-server replay's
            default, half the pool, loses most conversation histories here); 0 = unbounded.
        scheduler: each instance's scheduler limits (its report mode is replaced by ``report_mode``).
        policies: the policies to run, in order (a subset of :data:`POLICIES`).
        show_progress: draw progress bars.
        nats_url: NATS server URL(s): every server publishes to JetStream and the mirrors are fed
            over it (:class:`~kvservice.replay.jetstream_feed.JetStreamFeeds`); None = the gRPC feed.

    Raises:
        ValueError: a field out of its bounds (named in the message).
    """

    trace: str | None = None
    trace_format: str = "auto"
    limit: int | None = None
    instances: int = 2
    preset: str = "llama-3-8b"
    block_size: int | None = None
    num_blocks: int = DEFAULT_NUM_BLOCKS
    rate_scale: float | None = None
    device: str = "meta"
    hash_algorithm: str = "sha256_cbor"
    report_mode: str = "full"
    mirror_capacity: int | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    policies: tuple[str, ...] = POLICIES
    show_progress: bool = True
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


# --------------------------------------------------------------------------------------------
# Mirrors: the feed seam


class MirrorFeed(Protocol):
    """A per-instance mirror: a :class:`PrefixIndex` kept by some transport.

    ``wait_applied(seq)`` is the freshness contract: it returns once every batch of the instance's
    event log up to ``seq`` (the log's own seq, as ``StepResponse.head_seq`` names it) is applied
    to ``index``; ``seq`` 0 means the initial state (a snapshot) is applied. Counters are for the
    report.
    """

    index: PrefixIndex
    num_events: int
    num_batches: int

    async def start(self) -> None:
        """Start following; returns once the initial state is applied."""

    async def wait_applied(self, seq: int) -> None:
        """Return once every batch up to ``seq`` is applied (raises if the feed failed)."""

    async def close(self) -> None:
        """Stop following."""


@dataclass
class Instance:
    """One server of a policy run, its scheduler and its mirror.

    Attributes:
        idx: the instance's number, 0..N-1.
        address: its "host:port".
        client: a client of it (the scheduler's and the feed's).
        metadata: its ``GetKVCacheGroupMetadata``.
        capacity_blocks: the mirror's capacity in blocks (None = unbounded).
        scheduler: its scheduler (set once the feed is built).
        feed: its mirror.
        predictor: a :class:`HitPredictor` over ``feed.index``.
    """

    idx: int
    address: str
    client: AsyncKVCacheClient
    metadata: pb.GetKVCacheGroupMetadataResponse
    capacity_blocks: int | None
    scheduler: ReplayScheduler | None = None
    feed: MirrorFeed | None = None
    predictor: HitPredictor | None = None

    @property
    def load(self) -> int:
        """Requests routed here and not finished (pending, waiting or running)."""
        s = self.scheduler
        assert s is not None, "the instance has no scheduler yet"
        return len(s.pending) + len(s.waiting) + len(s.running)


FeedFactory = Callable[[Instance], MirrorFeed]
"""Builds an (unstarted) mirror of one instance (a run builds every instance's before starting any)."""

GRPC_FEED_NAME = "grpc StreamEvents (snapshot first)"
"""The gRPC feed's name in a report's ``metadata["feed"]``."""


def grpc_stream_feed(instance: Instance) -> MirrorFeed:
    """The gRPC feed: a ``StreamEvents`` watcher (snapshot first) of ``instance`` applying every
    batch to a :class:`PrefixIndex` of ``instance.capacity_blocks`` (the single-server replay's
    :class:`~kvservice.replay.runner.MirrorWatcher`)."""
    return MirrorWatcher(instance.client, instance.metadata, instance.capacity_blocks)


# --------------------------------------------------------------------------------------------
# Router


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where one request went and why.

    Attributes:
        index: the request's position in the trace.
        instance: the instance chosen.
        predicted_hit_tokens: per instance, the hit the router predicted (tokens); empty for
            round-robin.
        reason: "hit" (one instance had the longest predicted hit), "load" (tied on hit, least
            loaded), "round-robin" (tied on both, or the round-robin policy).
    """

    index: int
    instance: int
    predicted_hit_tokens: tuple[int, ...] = ()
    reason: str = "round-robin"


class Router:
    """Assigns each arriving request to an instance (see the module docstring for both policies).

    Args:
        policy: "routed" or "round-robin".
        instances: the instances, each with its scheduler, feed and predictor.

    Raises:
        ValueError: an unknown policy, or instances that hash prompts differently.
    """

    def __init__(self, policy: str, instances: Sequence[Instance]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
        rules = {
            (m.metadata.hash_algorithm, m.metadata.hash_seed, m.metadata.hash_block_size, m.metadata.block_hash_format)
            for m in instances
        }
        if len(rules) != 1:
            raise ValueError(f"instances must share one hash rule; got {sorted(map(str, rules))}")
        self.policy = policy
        self.instances = list(instances)
        self.decisions: list[RoutingDecision] = []
        self.hashes: dict[int, tuple[int, tuple[list, ...]]] = {}
        """Prompt hashes computed at routing, by trace index: (prompt tokens, per-group hashes), kept
        until the request's first admission (its instance's predictor reuses them)."""

    async def route(self, index: int, request: TraceRequest) -> RoutingDecision:
        """Choose the instance of request ``index`` (records the decision in :attr:`decisions`).

        Raises:
            RuntimeError: a mirror's feed ended.
        """
        n = len(self.instances)
        if self.policy == "round-robin":
            decision = RoutingDecision(index, index % n)
        else:
            first = self.instances[0]
            assert first.predictor is not None
            hashes = first.predictor.hash_prompt(request.prompt_token_ids)
            num_tokens = len(request.prompt_token_ids)
            self.hashes[index] = (num_tokens, hashes)
            predicted = []
            for inst in self.instances:
                assert inst.feed is not None and inst.scheduler is not None and inst.predictor is not None
                await inst.feed.wait_applied(inst.scheduler.head_seq)
                predicted.append(inst.predictor.predict_hit_tokens_from_hashes(hashes, num_tokens))
            best = max(predicted)
            tied = [i for i in range(n) if predicted[i] == best]
            reason = "hit"
            if len(tied) > 1:
                least = min(self.instances[i].load for i in tied)
                tied = [i for i in tied if self.instances[i].load == least]
                reason = "load" if len(tied) == 1 else "round-robin"
            start = index % n
            chosen = min(tied, key=lambda i: (i - start) % n)
            decision = RoutingDecision(index, chosen, tuple(predicted), reason)
        self.decisions.append(decision)
        return decision


# --------------------------------------------------------------------------------------------
# A policy's run


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
            ``config.nats_url``, else :func:`grpc_stream_feed`). With ``config.nats_url`` every
            server publishes to a stream of this run, deleted at the end.
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
    try:
        for i in range(config.instances):
            server = await start_server(
                port=0,
                preset=config.preset,
                block_size=config.block_size,
                num_blocks=config.num_blocks,
                device=config.device,
                hash_algorithm=config.hash_algorithm,
                grace_seconds=1.0,
                **(nats_feeds.server_settings(i) if nats_feeds is not None else {}),
            )
            servers.append(server)
            client = AsyncKVCacheClient(server.address, timeout=120.0)
            metadata = await client.get_kv_cache_group_metadata()
            pool_blocks = metadata.groups[0].num_blocks - 1
            capacity = config.mirror_capacity if config.mirror_capacity is not None else pool_blocks
            instances.append(Instance(i, server.address, client, metadata, capacity or None))
        router = Router(policy, instances)
        for inst in instances:  # every feed is built before any starts (FeedFactory)
            inst.feed = feed_factory(inst)
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
    finally:
        for inst in instances:
            if inst.feed is not None:
                await inst.feed.close()
            await inst.client.close()
        for server in servers:
            await server.stop(0)
        if nats_feeds is not None:
            await nats_feeds.delete_stream()
    run.wall_time_s = time.perf_counter() - started
    if runs is not None:
        runs.append(run)
    return summarise_policy(run, config)


def summarise_policy(run: PolicyRun, config: MultiReplayConfig) -> PolicyReport:
    """The :class:`PolicyReport` of a run."""
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


# --------------------------------------------------------------------------------------------
# Report


@dataclass(slots=True)
class PolicyReport:
    """The figures of one policy (sums over its instances).

    Attributes:
        policy: "routed" or "round-robin".
        num_requests: requests that finished.
        num_skipped: trace requests not routed (prompt of ``max_model_len`` tokens or more).
        num_prompt_tokens, num_hit_tokens: the trace's prompt tokens and those the servers hit, at
            each request's first admission.
        num_prompt_blocks, num_hit_blocks: the same in full blocks.
        num_admitted_tokens, num_admitted_hit_tokens: tokens and hits over every admission,
            recomputes after a preemption included (a recompute hits its own blocks).
        num_requests_per_instance: requests routed to each instance (index = instance).
        num_prompt_tokens_per_instance, num_hit_tokens_per_instance: per instance, as the totals.
        num_decisions_by_reason: routing decisions by what decided them ("hit", "load",
            "round-robin").
        routing_agreement: the router's predicted hit on the chosen instance at arrival against
            the hit the server used at the request's first admission (None for round-robin).
        admission_agreement: each instance mirror's prediction just before each admission against
            the hit used (every admission).
        num_preemptions: preemptions over all instances.
        num_steps: scheduler steps over all instances (one Step RPC each, at least).
        num_events, num_batches: events and batches the mirrors received.
        rpc_latency: every Step RPC's round trip.
        wall_time_s: the policy's wall-clock time (servers started and stopped), in seconds.
        mirror_capacity_blocks: each mirror's capacity (0 = unbounded).
        block_size: the servers' block size (group 0), in tokens.
        max_model_len: the servers' longest request, in tokens.
        assignments: per routed request, (trace index, instance), in arrival order.
        hit_series: per request, (trace index, prompt tokens, hit tokens) at its first admission,
            in trace order (the routing plot's hit rate over time).
    """

    policy: str
    num_requests: int
    num_skipped: int
    num_prompt_tokens: int
    num_hit_tokens: int
    num_prompt_blocks: int
    num_hit_blocks: int
    num_admitted_tokens: int
    num_admitted_hit_tokens: int
    num_requests_per_instance: list[int]
    num_prompt_tokens_per_instance: list[int]
    num_hit_tokens_per_instance: list[int]
    num_decisions_by_reason: dict[str, int]
    routing_agreement: AgreementStats | None
    admission_agreement: AgreementStats
    num_preemptions: int
    num_steps: int
    num_events: int
    num_batches: int
    rpc_latency: LatencySummary
    wall_time_s: float
    mirror_capacity_blocks: int
    block_size: int
    max_model_len: int
    assignments: list[tuple[int, int]] = field(default_factory=list)
    hit_series: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def hit_rate_tokens_pct(self) -> float | None:
        """Prefix-cache hit rate in tokens, percent (None without prompt tokens)."""
        return _pct(self.num_hit_tokens, self.num_prompt_tokens)

    @property
    def hit_rate_blocks_pct(self) -> float | None:
        """Prefix-cache hit rate in blocks, percent (None without prompt blocks)."""
        return _pct(self.num_hit_blocks, self.num_prompt_blocks)

    _SCALARS = (
        "policy",
        "num_requests",
        "num_skipped",
        "num_prompt_tokens",
        "num_hit_tokens",
        "num_prompt_blocks",
        "num_hit_blocks",
        "num_admitted_tokens",
        "num_admitted_hit_tokens",
        "num_requests_per_instance",
        "num_prompt_tokens_per_instance",
        "num_hit_tokens_per_instance",
        "num_decisions_by_reason",
        "num_preemptions",
        "num_steps",
        "num_events",
        "num_batches",
        "wall_time_s",
        "mirror_capacity_blocks",
        "block_size",
        "max_model_len",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data (derived percentages included for readers)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in self._SCALARS}
        d["hit_rate_tokens_pct"] = self.hit_rate_tokens_pct
        d["hit_rate_blocks_pct"] = self.hit_rate_blocks_pct
        d["routing_agreement"] = _agreement_to_dict(self.routing_agreement)
        d["admission_agreement"] = _agreement_to_dict(self.admission_agreement)
        d["rpc_latency"] = {k: getattr(self.rpc_latency, k) for k in _LATENCY_FIELDS}
        d["assignments"] = [list(p) for p in self.assignments]
        d["hit_series"] = [list(p) for p in self.hit_series]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyReport:
        """Rebuilds from :meth:`to_dict` output (derived fields are ignored).

        Raises:
            KeyError: a required field is missing.
        """
        routing = d.get("routing_agreement")
        return cls(
            **{k: d[k] for k in cls._SCALARS},
            routing_agreement=_agreement_from_dict(routing) if routing else None,
            admission_agreement=_agreement_from_dict(d["admission_agreement"]),
            rpc_latency=LatencySummary(**{k: d["rpc_latency"][k] for k in _LATENCY_FIELDS}),
            assignments=[(int(i), int(j)) for i, j in d.get("assignments", [])],
            hit_series=[(int(i), int(n), int(h)) for i, n, h in d.get("hit_series", [])],
        )


@dataclass(slots=True)
class MultiReport:
    """A multi-instance replay: its setting and one :class:`PolicyReport` per policy.

    Attributes:
        trace_path, num_trace_lines: the trace and the lines (requests) replayed.
        preset, block_size: every server's layout (block size in tokens).
        instances: servers per policy.
        num_blocks_per_instance: each instance's pool, in blocks.
        arrival_rate_scale: the trace's arrival times were divided by this.
        report_mode: the ``kv_cache_report_mode`` of every request.
        policies: per policy, in run order.
        ideal_hit_rate_tokens_pct: the infinite-cache prefix hit rate of the trace at ``block_size``.
        metadata: other run facts, JSON scalars only.
    """

    trace_path: str
    num_trace_lines: int
    preset: str
    block_size: int
    instances: int
    num_blocks_per_instance: int
    arrival_rate_scale: float
    report_mode: str
    policies: list[PolicyReport]
    ideal_hit_rate_tokens_pct: float | None = None
    metadata: dict[str, str | int | float | bool | None] = field(default_factory=dict)

    def policy(self, name: str) -> PolicyReport:
        """The report of policy ``name``.

        Raises:
            KeyError: that policy did not run.
        """
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(name)

    def gain(self) -> tuple[float, float | None] | None:
        """(routed - round-robin hit rate in percentage points, routed / round-robin), in tokens;
        None unless both ran with prompt tokens (the ratio is None when round-robin hit nothing)."""
        try:
            routed, rr = self.policy("routed").hit_rate_tokens_pct, self.policy("round-robin").hit_rate_tokens_pct
        except KeyError:
            return None
        if routed is None or rr is None:
            return None
        return routed - rr, (routed / rr if rr else None)

    _SCALARS = (
        "trace_path",
        "num_trace_lines",
        "preset",
        "block_size",
        "instances",
        "num_blocks_per_instance",
        "arrival_rate_scale",
        "report_mode",
        "ideal_hit_rate_tokens_pct",
    )

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready plain data (the gain included for readers)."""
        gain = self.gain()
        return {
            "schema": MULTI_REPORT_SCHEMA,
            **{k: getattr(self, k) for k in self._SCALARS},
            "gain_hit_rate_tokens_points": gain[0] if gain else None,
            "gain_hit_rate_tokens_ratio": gain[1] if gain else None,
            "metadata": dict(self.metadata),
            "policies": [p.to_dict() for p in self.policies],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MultiReport:
        """Rebuilds a report from :meth:`to_dict` output (derived fields are ignored).

        Raises:
            ValueError: an unknown ``schema``.
            KeyError: a required field is missing.
        """
        if data.get("schema") != MULTI_REPORT_SCHEMA:
            raise ValueError(f"unknown report schema {data.get('schema')!r}; expected {MULTI_REPORT_SCHEMA!r}")
        return cls(
            **{k: data[k] for k in cls._SCALARS},
            policies=[PolicyReport.from_dict(p) for p in data["policies"]],
            metadata=dict(data.get("metadata", {})),
        )


def write_multi_json(report: MultiReport, path: str | Path) -> Path:
    """Writes ``report`` as JSON (indented; each assignment list on one line), creating parent
    folders. Returns the path written."""
    data = report.to_dict()
    return write_json_with_compact_lists(
        data, path, [(p, key) for p in data["policies"] for key in ("assignments", "hit_series")]
    )


def read_multi_json(path: str | Path) -> MultiReport:
    """Reads a report written by :func:`write_multi_json`.

    Raises:
        ValueError: not JSON, or an unknown schema.
        KeyError: a required field is missing.
    """
    return MultiReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _fmt_capacity(blocks: int) -> str:
    return f"{blocks:,} blocks" if blocks else "unbounded"


def _fmt_agreement(a: AgreementStats | None) -> str:
    if a is None:
        return "-"
    return f"{_fmt_pct(a.exact_match_pct)} of {a.num_compared:,}, MAE {a.mean_abs_error_blocks:.3f}"


def _policy_rows(p: PolicyReport) -> list[tuple[str, str]]:
    lat = p.rpc_latency
    reasons = p.num_decisions_by_reason
    per_instance_hit = " / ".join(
        f"{100.0 * h / t:.1f}" if t else "-"
        for h, t in zip(p.num_hit_tokens_per_instance, p.num_prompt_tokens_per_instance, strict=True)
    )
    return [
        ("requests", f"{p.num_requests:,}"),
        ("prompt tokens", f"{p.num_prompt_tokens:,}"),
        ("prefix hit rate (tokens)", _fmt_pct(p.hit_rate_tokens_pct)),
        ("prefix hit rate (blocks)", _fmt_pct(p.hit_rate_blocks_pct)),
        ("with recomputes after preemption (tokens)", _fmt_pct(_pct(p.num_admitted_hit_tokens, p.num_admitted_tokens))),
        ("requests per instance", " / ".join(f"{n:,}" for n in p.num_requests_per_instance)),
        ("hit rate per instance (tokens, %)", per_instance_hit),
        (
            "decided by hit / load / round-robin",
            f"{reasons.get('hit', 0):,} / {reasons.get('load', 0):,} / {reasons.get('round-robin', 0):,}",
        ),
        ("routing prediction vs hit: exact, MAE", _fmt_agreement(p.routing_agreement)),
        ("mirror at admission: exact, MAE", _fmt_agreement(p.admission_agreement)),
        ("preemptions", f"{p.num_preemptions:,}"),
        ("scheduler steps", f"{p.num_steps:,}"),
        ("RPC latency p50 / p99 (ms)", "-" if lat.p50_ms is None else f"{lat.p50_ms:.3f} / {lat.p99_ms:.3f}"),
        ("events / batches received", f"{p.num_events:,} / {p.num_batches:,}"),
        ("wall time (s)", f"{p.wall_time_s:.2f}"),
    ]


def render_multi_table(report: MultiReport, *, width: int = 120) -> str:
    """The report as a plain-text terminal table (rich, no colour codes), policies side by side,
    then the gain and the ideal hit rate."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=(
            f"kvservice replay --instances {report.instances}: {Path(report.trace_path).name} "
            f"({report.num_trace_lines:,} lines), report mode {report.report_mode}\n"
            f"preset {report.preset}, block_size {report.block_size} tokens; per instance: {report.num_blocks_per_instance:,} "
            f"blocks, mirror {_fmt_capacity(report.policies[0].mirror_capacity_blocks)}; arrivals "
            f"{report.arrival_rate_scale:g}x the trace's rate"
            + (f"\nmirrors fed by {report.metadata['feed']}" if report.metadata.get("feed") else "")
        ),
        title_justify="left",
    )
    table.add_column("metric")
    for p in report.policies:
        table.add_column(p.policy, justify="right")
    rows = [_policy_rows(p) for p in report.policies]
    for i, (label, _) in enumerate(rows[0]):
        table.add_row(label, *(r[i][1] for r in rows))
    notes = []
    gain = report.gain()
    if gain is not None:
        ratio = "-" if gain[1] is None else f"{gain[1]:.2f}x"
        notes.append(f"gain, routed over round-robin: {gain[0]:+.2f} points of prefix hit rate (tokens), ratio {ratio}")
    skipped = max(p.num_skipped for p in report.policies)
    if skipped:
        notes.append(f"skipped {skipped:,} trace requests whose prompt is max_model_len tokens or longer")
    if report.ideal_hit_rate_tokens_pct is not None:
        notes.append(f"ideal prefix hit rate, infinite cache (tokens): {_fmt_pct(report.ideal_hit_rate_tokens_pct)}")
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False, markup=False)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
