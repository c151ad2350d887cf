"""The JetStream feed of ``kvservice replay --instances N --nats-url URL``: the router's mirrors fed
over NATS JetStream instead of one gRPC ``StreamEvents`` stream per instance.

One policy run (N fresh embedded servers) is one :class:`JetStreamFeeds`: a
:data:`~kvservice.replay.routing.FeedFactory` that also names the NATS settings of each server it
feeds (:meth:`JetStreamFeeds.server_settings`). Every run draws a fresh run id, so the two policy
processes, and reruns against the same NATS server, never share a stream, a subject or a consumer:

* stream ``KVSERVICE_REPLAY_<run id>`` capturing ``kvservice.replay.<run id>.>`` (each server's
  sink creates it, or updates it to the same settings, at start);
* subject ``kvservice.replay.<run id>.<policy>-<run id>-<i>``: server ``i``'s ``nats_instance``;
* one :class:`~kvservice_client.jetstream.JetStreamWatcher` (durable ``replay-router-<run id>``,
  deliver-all, so it reads each server's batches from seq 1) holds one
  :class:`~kvservice_client.jetstream.InstanceMirror` per server; each instance's
  :class:`JetStreamFeed` is a view of its mirror implementing
  :class:`~kvservice.replay.routing.MirrorFeed`.

The freshness contract is the gRPC feed's: :meth:`JetStreamFeed.wait_applied` returns once the
instance's mirror applied every batch up to ``seq`` (the event log's seq, which the sink carries in
the ``Kvservice-Seq`` header), so the router decides on the same mirror contents over either
transport and the replay's results are the same. A seq gap (a batch the sink dropped, e.g. one
above the NATS server's ``max_payload``) is repaired by the watcher from a gRPC snapshot of that
instance (:attr:`JetStreamFeed.num_resyncs` counts them). :meth:`JetStreamFeeds.delete_stream`
removes the run's stream once its servers stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from kvservice_client import events as ev
from kvservice_client.jetstream import InstanceMirror, JetStreamWatcher, connect_nats, import_nats, redact_url
from kvservice_client.watcher import PrefixIndex

if TYPE_CHECKING:
    from kvservice_client.client import AsyncKVCacheClient


class Instance(Protocol):
    """What a feed reads of a policy run's server (:class:`kvservice.replay.routing.Instance` has
    it; a protocol here, so a feed depends on these three fields only)."""

    @property
    def idx(self) -> int: ...
    @property
    def capacity_blocks(self) -> int | None: ...
    @property
    def client(self) -> AsyncKVCacheClient: ...


logger = logging.getLogger(__name__)

__all__ = ["JetStreamFeed", "JetStreamFeeds", "describe_jetstream_feed"]


def describe_jetstream_feed(nats_url: str) -> str:
    """The feed's name in a report: the NATS URL(s) with credentials redacted."""
    return f"NATS JetStream ({redact_url(nats_url)}; one durable consumer per policy run)"


class JetStreamFeed:
    """One instance's mirror, kept by the run's shared :class:`JetStreamWatcher` (a
    :class:`~kvservice.replay.routing.MirrorFeed`).

    Attributes:
        name: the instance's ``nats_instance`` (its subject's last token).
        index: the mirror's :class:`PrefixIndex` (the watcher's :class:`InstanceMirror` index).
        num_events, num_batches: events and batches applied to it (seq-ordered batches of the
            stream; a snapshot rebuild is not counted).
    """

    def __init__(self, feeds: JetStreamFeeds, name: str, capacity_blocks: int | None) -> None:
        self._feeds = feeds
        self.name = name
        self.mirror = InstanceMirror(name, PrefixIndex(capacity_blocks))
        self.index = self.mirror.index
        self.num_events = 0
        self.num_batches = 0
        self._started = False

    @property
    def num_resyncs(self) -> int:
        """Times the mirror met a seq gap and was rebuilt from a gRPC snapshot."""
        return self.mirror.num_resyncs

    async def start(self) -> None:
        """Start the run's watcher (the first feed to start does) and return once the initial
        state is applied (a fresh server's: empty, seq 0).

        Raises:
            RuntimeError: nats-py is missing, or the watcher could not start (the cause attached).
            asyncio.TimeoutError: NATS could not be reached within the connect timeout.
        """
        await self._feeds._acquire()
        self._started = True
        await self.wait_applied(0)

    async def wait_applied(self, seq: int) -> None:
        """Return once the mirror applied every batch of the instance's event log up to ``seq``.

        Raises:
            RuntimeError: the watcher stopped, the instance needs a resync it could not get, or
                ``seq`` was not applied within the feeds' ``wait_timeout_s`` seconds.
        """
        watcher = self._feeds.watcher
        if watcher is None:
            raise RuntimeError(f"the JetStream feed of {self.name} is not started")
        if self.mirror.last_seq >= seq:
            return
        try:
            await watcher.wait_for_seq(self.name, seq, timeout_s=self._feeds.wait_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"the JetStream mirror of {self.name} did not apply seq {seq} within "
                f"{self._feeds.wait_timeout_s:g} s (applied: seq {self.mirror.last_seq})"
            ) from None
        except Exception as e:
            raise RuntimeError(f"the JetStream mirror of {self.name} failed at seq {seq}: {e}") from e

    async def close(self) -> None:
        """Stop following (the last feed to close closes the watcher). Idempotent."""
        if self._started:
            self._started = False
            await self._feeds._release()


class JetStreamFeeds:
    """The JetStream :data:`~kvservice.replay.routing.FeedFactory` of one policy run.

    Calling it with an instance builds that instance's (unstarted) :class:`JetStreamFeed`; every
    feed is built before any is started (the watcher, created at the first start, takes every
    mirror and every instance's gRPC client as its snapshot source). Start each server with
    :meth:`server_settings` so it publishes where the watcher reads.

    Args:
        nats_url: NATS server URL(s), comma-separated; credentials in the userinfo.
        policy: the run's policy (part of each instance name).
        run_id: the run's id (default: a fresh random one; ``[A-Za-z0-9_-]+``).
        connect_timeout_s: how long the watcher tries to reach NATS at start, in seconds.
        wait_timeout_s: how long :meth:`JetStreamFeed.wait_applied` waits for one seq, in seconds.

    Attributes:
        subject_prefix, stream, durable: the run's subject prefix, stream and consumer names.
        watcher: the shared watcher (None until the first feed starts).
        feeds: the feeds built, by instance name.

    Raises:
        ValueError: an empty ``nats_url``.
    """

    def __init__(
        self,
        nats_url: str,
        policy: str,
        *,
        run_id: str | None = None,
        connect_timeout_s: float = 10.0,
        wait_timeout_s: float = 60.0,
    ) -> None:
        if not nats_url or not nats_url.strip():
            raise ValueError("nats_url must name at least one NATS server; got an empty string")
        self.nats_url = nats_url
        self.policy = policy
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.subject_prefix = f"kvservice.replay.{self.run_id}"
        self.stream = f"KVSERVICE_REPLAY_{self.run_id}"
        self.durable = f"replay-router-{self.run_id}"
        self.connect_timeout_s = connect_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.watcher: JetStreamWatcher | None = None
        self.feeds: dict[str, JetStreamFeed] = {}
        self._clients: dict[str, Any] = {}
        self._lock = asyncio.Lock()
        self._users = 0

    def instance_name(self, idx: int) -> str:
        """Server ``idx``'s ``nats_instance``: ``<policy>-<run id>-<idx>``."""
        return f"{self.policy}-{self.run_id}-{idx}"

    def server_settings(self, idx: int) -> dict[str, Any]:
        """The :class:`~kvservice.server.app.ServerConfig` overrides of server ``idx``: the NATS
        sink on, publishing on this run's stream and subject prefix under its own instance name."""
        return {
            "nats_url": self.nats_url,
            "nats_instance": self.instance_name(idx),
            "nats_subject_prefix": self.subject_prefix,
            "nats_stream": self.stream,
        }

    def __call__(self, instance: Instance) -> JetStreamFeed:
        """Build the (unstarted) feed of ``instance`` (started with :meth:`server_settings` of
        ``instance.idx``).

        Raises:
            RuntimeError: a feed is built after the watcher started.
        """
        if self.watcher is not None:
            raise RuntimeError("every JetStream feed must be built before the first one starts")
        name = self.instance_name(instance.idx)
        feed = self.feeds[name] = JetStreamFeed(self, name, instance.capacity_blocks)
        self._clients[name] = instance.client
        return feed

    def _on_batch(self, mirror: InstanceMirror, seq: int, batch: ev.KVEventBatch) -> None:
        feed = self.feeds.get(mirror.instance)
        if feed is not None:
            feed.num_batches += 1
            feed.num_events += len(batch.events)

    async def _acquire(self) -> None:
        async with self._lock:
            if self.watcher is None:
                watcher = JetStreamWatcher(
                    self.nats_url,
                    durable=self.durable,
                    stream=self.stream,
                    subject_prefix=self.subject_prefix,
                    mirrors={name: f.mirror for name, f in self.feeds.items()},
                    snapshot_sources=dict(self._clients),
                    connect_timeout_s=self.connect_timeout_s,
                    on_batch=self._on_batch,
                )
                try:
                    await watcher.start()
                except asyncio.TimeoutError:
                    raise RuntimeError(
                        f"could not reach NATS at {redact_url(self.nats_url)} within {self.connect_timeout_s:g} s"
                    ) from None
                self.watcher = watcher
            self._users += 1

    async def _release(self) -> None:
        async with self._lock:
            self._users -= 1
            if self._users == 0 and self.watcher is not None:
                await self.watcher.close()

    async def delete_stream(self) -> bool:
        """Delete the run's stream (its consumer with it). Call it once the run's servers stopped
        (a sink still running would create it again). Never raises: a failure (NATS away, nats-py
        missing) is logged as a warning, and a stream already gone counts as deleted.

        Returns:
            Whether the stream is gone.
        """
        try:
            nats = import_nats("the replay's JetStream feed", "kvservice's nats")

            async def quiet(error: Exception) -> None:
                """Connection errors surface through the raise."""

            nc = await connect_nats(
                nats,
                [s.strip() for s in self.nats_url.split(",") if s.strip()],
                connect_timeout_s=self.connect_timeout_s,
                error_cb=quiet,
            )
            try:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await nc.jetstream().delete_stream(self.stream)
            finally:
                await nc.close()
        except Exception as e:
            logger.warning(
                "could not delete the replay's JetStream stream %s at %s: %s: %s",
                self.stream,
                redact_url(self.nats_url),
                type(e).__name__,
                e,
            )
            return False
        return True
