"""A vLLM-compatible ZMQ publisher of the event log, so routers built for vLLM's publisher subscribe unchanged.

The wire is the one vLLM's ``ZmqEventPublisher`` (``vllm.distributed.kv_events``, 0.33) speaks:

* **PUB socket** (``zmq_endpoint``): every event-log batch as one 3-frame message
  ``(topic, seq, payload)``: ``topic`` the UTF-8 bytes of ``zmq_topic`` (subscribers filter on
  it by prefix, as ZMQ does); ``seq`` the batch's seq as 8 bytes, big-endian, unsigned;
  ``payload`` the batch in vLLM's msgpack layout (:attr:`LogEntry.msgpack
  <kvservice.server.event_log.LogEntry>`: ``[ts, events, data_parallel_rank]``, events as maps
  tagged by ``"type"``, kvservice's additions as optional fields a vLLM reader ignores). The
  seq is the *wire seq* (see "Restarts" below): ``seq_base + seq`` for the event log's seq.
* **ROUTER socket** (``zmq_replay_endpoint``, optional, always bound): a client (a DEALER
  socket) sends ``(b"", start_seq)``, ``start_seq`` as 8 bytes big-endian (so the ROUTER reads
  ``(identity, b"", start_seq)``; a request of any other frame count is logged and ignored, as
  vLLM does; any length of ``start_seq`` is read big-endian unsigned, as vLLM does). The answer
  is, per retained batch with seq >= ``start_seq``, the frames ``(b"", topic, seq, payload)``,
  byte-identical to the live message of that seq, then the end marker ``(b"", b"", END_SEQ,
  b"")`` where ``END_SEQ`` is -1 as 8 signed big-endian bytes (``ff`` x 8). Batches come from
  the event log's retention (``event_max_batches``, ``event_max_bytes``), not a second buffer.

**Restarts are visible.** vLLM's seq counts from 0 per publisher, so after an engine restart a
router that tracks seqs (Dynamo's indexer keeps a watermark and drops every batch at or below it)
silently ignores the new engine's batches until they pass the old seq, and keeps the dead cache's
blocks. kvservice's wire seq never rewinds across restarts of one instance: each start takes
``seq_base`` = the wall clock in microseconds (``time.time_ns() // 1000``), and publishes the
event log's batch ``seq`` (gap-free from 1 per epoch, as the gRPC stream has it) as
``seq_base + seq``. Any earlier epoch of the instance published fewer batches than it lived
microseconds, so its seqs are below the new base (as long as the clock does not step back by
more than the downtime). The wire seq ``seq_base`` itself is the *epoch start*: a batch of one
``AllBlocksCleared``, published at start and answered first by a replay that reaches it. So a
consumer sees a jump, never a rewind: a seq-tracking one asks for a replay from its old seq and
gets the epoch start or a snapshot (below), both clearing the cache first; the first batch it
can apply after a restart clears the cache. The price of not counting from 0 as vLLM: a router
attaching for the first time sees seq ``seq_base + n`` where it may expect 0 and asks for a
replay from 0 (one "gap" line in its log), and is answered with the whole epoch, exact.

**A start below retention** (below ``seq_base + oldest retained seq``, when the log has dropped
batches) is answered with a snapshot first: ``AllBlocksCleared`` and a ``BlockStored`` for every
cached block, parents first (the event log's snapshot events, as ``StreamEvents`` sends them), as
*one* batch with the wire seq it was cut at (the snapshot's watermark), then every batch after that
seq (the retained ones, and those published while the snapshot's events were made), then the end
marker. The snapshot comes from the server's ``SnapshotSource`` as every
snapshot does (a cut shared with the gRPC callers at that head, produced and made into events in
steps that yield to the loop). A consumer that applies the replay in
order ends exact whatever it missed (vLLM's buffer answers from the oldest retained batch instead,
leaving such a consumer partial for good). Two differences from the gRPC snapshot:

* one batch, not parts of about ``snapshot_part_tokens`` tokens: in vLLM's framing one seq is one
  batch (a seq-tracking consumer may drop a second message of a seq it holds), ZMQ has no message
  size limit, and the replay socket's high-water mark counts messages and is sized by retention,
  so a snapshot in more parts than that would overflow it and be abandoned midway, leaving the
  joiner partial and without an end marker;
* each cached block announced once: without the recency-order re-announcements (flagged
  ``reused``, a flag a vLLM reader ignores), which a router that counts stores against removals
  would count as a second copy and never drop.

A start at or below ``seq_base`` while nothing was dropped gets the epoch start and every batch. A
start beyond the head gets the end marker alone.

**Never blocking the loop.** The event log calls :meth:`ZmqEventPublisher.publish` on the server's
loop after each batch; it sends without waiting (``DONTWAIT``): a PUB socket never blocks, it
queues up to ``zmq_hwm`` messages per subscriber in ZMQ's I/O thread and past that drops that
subscriber's messages, as vLLM's does (``hwm``). ZMQ does this silently: the publisher cannot
see it; the subscriber sees the seq gap and asks the replay socket. A send that fails where the
publisher can see it (the socket refused it) is counted in :attr:`ZmqEventPublisher.num_dropped`
and logged (the first, then at every power of two). Replays are served by one task on the loop,
yielding every :data:`REPLAY_YIELD_EVERY` batches; the replay socket's send high-water mark holds
a whole replay plus its marker (2 x (``event_max_batches`` + 1) messages, vLLM's sizing), and
a replay whose client cannot take more (or left) is abandoned, counted and logged.

**No authentication.** ZMQ carries no authentication and no encryption: anyone who reaches a
bound port reads every batch (the prompts' token ids) and may send replay requests, whatever TLS
and tokens the gRPC port has. So, as the gRPC bind does (``allow_insecure_bind`` in
:func:`kvservice.server.auth.build_auth`), :func:`check_endpoint_exposure` refuses a socket that
kvservice *binds* on a non-loopback address (``tcp://*``, ``tcp://0.0.0.0``, ``tcp://[::]``, a
LAN address, an interface name) unless ``allow_insecure_bind`` is set, and then warns at start.
``ipc://`` (guarded by file permissions) and ``inproc://`` binds, loopback binds
(``tcp://127.0.0.1:*``, ``tcp://[::1]:5557``) and connects to a ``tcp://host:port`` the operator
named (the receiving router binds it) are allowed.

pyzmq is an optional dependency: ``pip install pyzmq`` (the ``zmq`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from kvservice.server.endpoints import check_endpoint_exposure, is_bind_endpoint, is_loopback_endpoint
from kvservice_client.events import AllBlocksCleared, KVEventBatch, encode_event_batch

if TYPE_CHECKING:
    from kvservice.server.event_log import EventLog, LogEntry
    from kvservice.server.snapshot import SnapshotSource

logger = logging.getLogger(__name__)

__all__ = [
    "END_SEQ",
    "REPLAY_YIELD_EVERY",
    "ZmqEventPublisher",
    "check_endpoint_exposure",
    "import_zmq",
    "is_bind_endpoint",
    "is_loopback_endpoint",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

REPLAY_YIELD_EVERY = 256
"""Replayed batches sent between two yields to the loop (a long replay never stalls other calls)."""

_SNAPSHOT_TRIES = 3
"""Snapshots a replay from below retention is cut from, at most (see ``_snapshot_messages``)."""


def import_zmq() -> Any:
    """Import pyzmq (and ``zmq.asyncio``).

    Raises:
        RuntimeError: pyzmq is not installed (the message names ``pip install pyzmq``).
    """
    try:
        import zmq
        import zmq.asyncio
    except ImportError as e:
        raise RuntimeError(
            f"zmq_endpoint needs pyzmq, which is not installed ({e}): pip install pyzmq (kvservice's zmq extra)"
        ) from None
    return zmq


class ZmqEventPublisher:
    """Publishes every event-log batch on a ZMQ PUB socket and answers replays on a ROUTER socket,
    in vLLM's framing (see the module docstring). Build it with :meth:`start` on the server's loop.

    Attributes:
        endpoint: the PUB endpoint, as bound (a wildcard port resolved) or as connected.
        bound: whether the PUB socket was bound (else connected).
        replay_endpoint: the ROUTER endpoint as bound, or None when replay is off.
        topic: the topic frame of every message, as bytes.
        num_published: batches handed to the PUB socket.
        num_dropped: batches the PUB socket refused (counted and logged; ZMQ's own per-subscriber
            high-water-mark drops are invisible to a publisher, see the module docstring).
        num_replays: replay requests answered (end marker sent).
        num_replays_abandoned: replays given up because their client took no more or left.
        num_bad_requests: replay requests not of 3 frames (ignored).
        num_snapshot_replays: replays answered with a snapshot first (their start was below
            retention).
        seq_base: the wire seq of this epoch's start batch; the event log's seq ``s`` goes out as
            ``seq_base + s`` (see "Restarts are visible" in the module docstring).
        notes: warnings for the start lines, one per socket bound on a non-loopback address
            (see :func:`check_endpoint_exposure`).
    """

    def __init__(
        self,
        event_log: EventLog,
        zmq: Any,
        ctx: Any,
        pub: Any,
        router: Any | None,
        endpoint: str,
        bound: bool,
        replay_endpoint: str | None,
        topic: str,
    ) -> None:
        """Use :meth:`start`; this only assembles the parts."""
        self._log = event_log
        self._snapshots: SnapshotSource | None = None
        self._zmq = zmq
        self._ctx = ctx
        self._pub = pub
        self._router = router
        self.endpoint = endpoint
        self.bound = bound
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.num_published = 0
        self.num_dropped = 0
        self.num_replays = 0
        self.num_replays_abandoned = 0
        self.num_bad_requests = 0
        self.num_snapshot_replays = 0
        self.seq_base = time.time_ns() // 1000
        self._epoch_start = encode_event_batch(
            KVEventBatch(time.time(), [AllBlocksCleared()], event_log.data_parallel_rank)
        )
        self.notes: list[str] = []
        self._closed = False
        self._replay_task: asyncio.Task | None = None
        self._following: list[list[LogEntry]] = []  # per snapshot replay in the making, the batches since

    @classmethod
    async def start(
        cls,
        event_log: EventLog,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        hwm: int = 100_000,
        allow_insecure_bind: bool = False,
        snapshots: SnapshotSource | None = None,
    ) -> ZmqEventPublisher:
        """Open the sockets, register with ``event_log`` and start serving replays.

        Args:
            event_log: the log whose batches are published (its retention answers replays).
            endpoint: PUB endpoint; bound or connected by :func:`is_bind_endpoint`.
            replay_endpoint: ROUTER endpoint (always bound), or None for no replay.
            topic: topic frame of every message (vLLM's default "").
            hwm: PUB send high-water mark, in messages per subscriber (>= 1).
            allow_insecure_bind: bind a non-loopback address anyway (with a warning in
                :attr:`notes`); refused otherwise.
            snapshots: the server's snapshot source: a replay from below retention is answered
                with a snapshot from it (None: with the retained batches only).

        Raises:
            ValueError: a non-loopback bind without ``allow_insecure_bind`` (see
                :func:`check_endpoint_exposure`; raised before any socket is opened).
            RuntimeError: pyzmq is missing, or an endpoint cannot be bound/connected (the message
                names the setting and the endpoint).
        """
        notes = check_endpoint_exposure(endpoint, replay_endpoint, allow_insecure_bind=allow_insecure_bind)
        zmq = import_zmq()
        ctx = zmq.Context()
        pub = router = None
        try:
            pub = ctx.socket(zmq.PUB)
            if _is_ipv6(endpoint):  # tcp://[::1]:PORT (IPv4 endpoints keep IPv4-only sockets and their names)
                pub.setsockopt(zmq.IPV6, 1)
            pub.setsockopt(zmq.SNDHWM, hwm)
            pub.setsockopt(zmq.LINGER, 0)
            bound = is_bind_endpoint(endpoint)
            endpoint = _open(zmq, pub, endpoint, "zmq_endpoint", bind=bound)
            if replay_endpoint is not None:
                router = zmq.asyncio.Socket(ctx, zmq.ROUTER)
                if _is_ipv6(replay_endpoint):
                    router.setsockopt(zmq.IPV6, 1)
                # A whole replay plus its end marker fits (ZMQ sees reads only every HWM/2 messages).
                router.setsockopt(zmq.SNDHWM, 2 * (event_log.config.max_batches + 1))
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished client raises, not drops
                router.setsockopt(zmq.LINGER, 0)
                replay_endpoint = _open(zmq, router, replay_endpoint, "zmq_replay_endpoint", bind=True)
        except BaseException:
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()
            raise
        publisher = cls(event_log, zmq, ctx, pub, router, endpoint, bound, replay_endpoint, topic)
        publisher.notes = notes
        publisher._snapshots = snapshots
        publisher._send_live(publisher.seq_base, publisher._epoch_start)  # the epoch start (AllBlocksCleared)
        event_log.add_listener(publisher.publish)
        if router is not None:
            publisher._replay_task = asyncio.get_running_loop().create_task(
                publisher._serve_replays(), name="zmq-replay"
            )
        return publisher

    def describe(self) -> str:
        """One line: where events go and where replays are answered."""
        mode = "bound" if self.bound else "connected"
        replay = f", replay on {self.replay_endpoint}" if self.replay_endpoint else ", no replay"
        return f"ZMQ KV events on {self.endpoint} ({mode}), topic {self.topic.decode()!r}{replay}"

    def counters(self) -> dict[str, int]:
        """Published, dropped and replays answered (the EventSink's counters; ZMQ's own
        per-subscriber drops are invisible to a publisher)."""
        return {"num_published": self.num_published, "num_dropped": self.num_dropped, "num_replays": self.num_replays}

    # -- live --------------------------------------------------------------------------------

    def publish(self, entry: LogEntry) -> None:
        """Send one batch as ``(topic, seq, payload)`` without waiting (the event log's listener).

        A refused send is counted in :attr:`num_dropped` and logged; it never raises."""
        if self._closed:
            return
        for after in self._following:  # a snapshot replay whose events are being made
            after.append(entry)
        if self._send_live(self.seq_base + entry.seq, entry.msgpack):
            self.num_published += 1

    def _send_live(self, wire_seq: int, payload: bytes) -> bool:
        try:
            self._pub.send_multipart(
                (self.topic, wire_seq.to_bytes(8, "big"), payload), flags=self._zmq.DONTWAIT, copy=False
            )
        except self._zmq.ZMQError as e:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # the first, then at powers of two
                logger.warning(
                    "ZMQ publisher dropped batch seq %d (%s); %d dropped so far (zmq_hwm %d messages per subscriber)",
                    wire_seq,
                    e,
                    self.num_dropped,
                    self._pub.getsockopt(self._zmq.SNDHWM),
                )
            return False
        return True

    # -- replay ------------------------------------------------------------------------------

    async def _serve_replays(self) -> None:
        assert self._router is not None, "no replay socket"
        while True:
            frames = await self._router.recv_multipart()
            try:
                await self._replay(frames)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("ZMQ replay failed")

    async def _replay(self, frames: list[bytes]) -> None:
        """Answer one request ``(identity, b"", start_seq)`` (a wire seq): the epoch start or a
        snapshot when the start is below what is retained, retained batches from start_seq, then
        the end marker."""
        if len(frames) != 3:
            self.num_bad_requests += 1
            logger.warning("invalid ZMQ replay request of %d frames (expected identity, b'', 8-byte seq)", len(frames))
            return
        identity, _, start_bytes = frames
        start_seq = int.from_bytes(start_bytes, "big")
        log = self._log
        log.settle()  # a batch appended in this turn of the loop is in what follows
        base = self.seq_base
        messages: list[tuple[int, bytes]] = []  # (wire seq, payload)
        if start_seq <= base + log.head_seq:
            oldest = log.oldest_seq
            if start_seq < base + oldest and oldest > 1 and self._snapshots is not None:  # below retention
                self.num_snapshot_replays += 1
                answer = await self._snapshot_messages(start_seq, self._snapshots)
                if answer is None:
                    return
                messages = answer
            else:
                if start_seq <= base:
                    messages.append((base, self._epoch_start))
                # entries_from returns a copy: trimming the log meanwhile leaves it whole.
                messages.extend((base + e.seq, e.msgpack) for e in log.entries_from(max(start_seq - base, oldest)))
        for i, (seq, payload) in enumerate(messages):
            if not self._send_reply(identity, (self.topic, seq.to_bytes(8, "big"), payload)):
                return
            if i % REPLAY_YIELD_EVERY == REPLAY_YIELD_EVERY - 1:
                await asyncio.sleep(0)
        if self._send_reply(identity, (b"", END_SEQ, b"")):
            self.num_replays += 1

    async def _snapshot_messages(self, start_seq: int, source: SnapshotSource) -> list[tuple[int, bytes]] | None:
        """A replay's answer from a snapshot (its start was below retention): the snapshot as one
        batch at its wire seq, then every batch after it, as ``(wire seq, payload)``.

        The snapshot comes from ``source`` as every snapshot does (:meth:`SnapshotSource.get`: a
        cut shared with the gRPC callers at that head, produced and made into events in steps
        that yield to the loop). One batch, not the gRPC stream's parts: see "A start below
        retention" in the module docstring; presence only (:meth:`Snapshot.presence_events`): the
        recency-order re-announcements (``reused``) would be a second BlockStored per block to a
        vLLM reader, which ignores ``reused``.

        The batches after the watermark: those the source holds when it hands the snapshot over
        (:meth:`SnapshotSource.batches_after`: the batches a cut in production holds back from
        its mirror; none when the cut is at the head), then every batch published while its
        events are made (kept here as :meth:`publish` sends them), so retention trimmed meanwhile
        loses none. Should the source not hold them (never right after ``get``), the log's
        retention is read, and a snapshot whose next batch it dropped is asked for again, at most
        ``_SNAPSHOT_TRIES`` times; then the replay is abandoned (None; counted in
        :attr:`num_replays_abandoned`, logged).
        """
        log = self._log
        base = self.seq_base
        for _ in range(_SNAPSHOT_TRIES):
            snapshot = await source.get(None)  # settled: every batch up to the head is published
            after = source.batches_after(snapshot)
            if after is None:
                if snapshot.seq + 1 < log.oldest_seq:
                    await snapshot.wait_done()  # let the mirror move on: the next ask cuts afresh
                    continue
                after = log.entries_from(snapshot.seq + 1)  # a copy
            self._following.append(after)  # publish() appends the later ones
            try:
                events = await snapshot.presence_events()
            finally:
                self._following.remove(after)
            logger.info(
                "ZMQ replay from seq %d is below the oldest retained seq %d: answered with a snapshot at seq %d",
                start_seq,
                base + log.oldest_seq,
                base + snapshot.seq,
            )
            batch = encode_event_batch(KVEventBatch(snapshot.ts, events, log.data_parallel_rank))
            return [(base + snapshot.seq, batch), *((base + e.seq, e.msgpack) for e in after)]
        self.num_replays_abandoned += 1
        logger.warning(
            "ZMQ replay from seq %d abandoned: the batch after each of %d snapshots had left retention when it "
            "was handed over (raise event_max_batches / event_max_bytes)",
            start_seq,
            _SNAPSHOT_TRIES,
        )
        return None

    def _send_reply(self, identity: bytes, frames: tuple[bytes, bytes, bytes]) -> bool:
        """Send one reply message; False (the replay abandoned, counted, logged) when the client
        takes no more or left."""
        zmq = self._zmq
        assert self._router is not None, "no replay socket"
        future = self._router.send_multipart((identity, b"", *frames), flags=zmq.DONTWAIT, copy=False)
        error = future.exception()
        if error is None:
            return True
        self.num_replays_abandoned += 1
        if isinstance(error, zmq.Again):
            logger.warning("ZMQ replay abandoned: the client reads too slowly (seq frame %s)", frames[1].hex())
        elif isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            logger.info("ZMQ replay abandoned: the client left")
        else:
            raise error
        return False

    # -- stop --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop publishing and replaying and close the sockets (pending messages are dropped,
        as vLLM's shutdown does). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` names an IPv6 address (``tcp://[::1]:5557``): its socket needs ZMQ_IPV6."""
    return endpoint.startswith("tcp://[")


def _open(zmq: Any, sock: Any, endpoint: str, setting: str, *, bind: bool) -> str:
    """Bind or connect ``sock``; the endpoint as bound (wildcard port resolved) or as given.

    Raises:
        RuntimeError: ZMQ refused the endpoint (the message names ``setting``).
    """
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise RuntimeError(f"{setting}: cannot {'bind' if bind else 'connect'} {endpoint!r}: {e}") from None
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the wildcard port resolved
    return bound
