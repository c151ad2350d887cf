"""The router of ``kvservice replay --instances N`` and the seam its mirrors are fed through.

A policy run (:mod:`kvservice.replay.multi`) gives every instance (:class:`Instance`: a server, its
scheduler and its mirror) a :class:`MirrorFeed`, and asks a :class:`Router` where each arriving
request goes:

* ``routed``: the router keeps one mirror per instance (a :class:`MirrorFeed`; by default a
  ``StreamEvents`` watcher, snapshot first, feeding a
  :class:`~kvservice_client.watcher.PrefixIndex` as large as the instance's pool). For each arriving
  request it hashes the prompt once, predicts the prefix-cache hit on every instance with a
  :class:`~kvservice_client.watcher.HitPredictor`, and sends it to the instance with the longest
  predicted hit; ties go to the least loaded instance (fewest routed requests not yet finished),
  then round-robin (the first tied instance at or after ``trace index mod N``).
* ``round-robin``: request ``i`` of the trace goes to instance ``i mod N``. Its mirrors only
  predict at admission (for the report), never route.

**Freshness rule.** A routing decision uses only what the mirrors have applied, and each mirror is
waited for up to the ``StepResponse.head_seq`` its instance's scheduler last received (every Step
of the previous tick has returned, and only that scheduler changes its server), so the router
sees each instance's cache exactly as it stands when the request arrives, bounded only by the
mirror's capacity. It never asks a server for a hit. Requests that arrive in the same tick are
routed in trace order against that same state (none of them is admitted yet); the load tie-break
counts the ones already routed.

**A limit of longest-hit routing.** An instance whose cache lost a prefix that every request
shares (a system prompt) predicts less than every warm instance for every request, so it receives
none and never warms again (the balance row shows it). The embedded trace opens with ten
requests at once, so every instance warms at the start; a trace that opens with one request at a
time sends everything to the first instance.

**Feeds.** A mirror is "a :class:`~kvservice_client.watcher.PrefixIndex` fed by some transport":
:class:`MirrorFeed` is that seam (``index``, ``start``, ``wait_applied(seq)``, ``close``), built per
instance by a :data:`FeedFactory`. :func:`grpc_stream_feed` is the gRPC ``StreamEvents`` feed (the
default); with ``nats_url`` (``--nats-url``) every server publishes to NATS JetStream and
:class:`~kvservice.replay.jetstream_feed.JetStreamFeeds` feeds the mirrors from one durable consumer
(a stream per policy run). Both carry the event log's seq, so the freshness rule and the results
are the same over either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvservice.replay.runner import MirrorWatcher
from kvservice.replay.scheduler import ReplayScheduler
from kvservice.replay.traces import TraceRequest
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.watcher import HitPredictor, PrefixIndex

__all__ = [
    "GRPC_FEED_NAME",
    "POLICIES",
    "FeedFactory",
    "Instance",
    "MirrorFeed",
    "Router",
    "RoutingDecision",
    "grpc_stream_feed",
]

POLICIES = ("routed", "round-robin")
"""The routing policies compared, in report order."""


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
