"""Mirror the prefix caches of several kvservice instances from a NATS JetStream stream.

The servers publish with ``kvservice serve --nats-url ...`` (``kvservice.server.nats_sink``): one
message per event batch on ``{subject_prefix}.{instance}``, the payload the batch's msgpack in
vLLM's layout, the position in headers (:data:`HEADER_SEQ`, :data:`HEADER_EPOCH`,
:data:`HEADER_INSTANCE`, ...). :class:`JetStreamWatcher` consumes the stream through a durable push
consumer and keeps, per instance, an :class:`InstanceMirror`: a
:class:`~kvservice_client.watcher.PrefixIndex` plus the epoch and seq applied. It acks a message
only after applying it, so a watcher restarted with the same durable name continues where the last
one stopped (hand it the previous mirrors, or rebuild them from snapshots).

Per instance, in stream order:

* a batch of the followed epoch with seq ``last_seq + 1`` is applied; one with seq <= ``last_seq``
  is a redelivery and is skipped;
* a batch of a new epoch (the server restarted; a new epoch starts with an empty cache) clears the
  mirror and expects seq 1; the epoch's first message, its *epoch start* (seq 0, one
  AllBlocksCleared, for consumers that know nothing of epochs), is skipped;
* a seq gap (the sink dropped batches: the message then carries :data:`HEADER_RESYNC`; or the
  stream's retention removed them before this consumer read them) puts the instance in
  :attr:`MirrorState.RESYNC_NEEDED`: its mirror is no longer the server's cache; its later batches
  are skipped until :meth:`JetStreamWatcher.rebuild_from_snapshot` (automatic when the watcher was
  given the instance's gRPC address) loads a snapshot over gRPC and continues after its watermark.

Example::

    async with JetStreamWatcher("nats://nats:4222", durable="router-1",
                                snapshot_sources={"node1-50051": "node1:50051"}) as watcher:
        ...
        index = watcher.mirrors["node1-50051"].index
        index.predict_hit_blocks(block_hashes)

nats-py is an optional dependency (``pip install nats-py``, the ``nats`` extra); this module imports
it only when a watcher starts, so the constants here need no NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvservice_client import events as ev

if TYPE_CHECKING:
    from kvservice_client.client import AsyncKVCacheClient
    from kvservice_client.watcher import PrefixIndex

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STREAM",
    "DEFAULT_SUBJECT_PREFIX",
    "HEADER_DATA_PARALLEL_RANK",
    "HEADER_EPOCH",
    "HEADER_INSTANCE",
    "HEADER_RESYNC",
    "HEADER_SEQ",
    "InstanceMirror",
    "JetStreamWatcher",
    "MirrorState",
    "NatsCredentialsRefusedError",
    "ResyncNeededError",
    "connect_nats",
    "import_nats",
    "is_authorization_error",
    "msg_id",
    "redact_url",
    "subject_for",
]

DEFAULT_SUBJECT_PREFIX = "kvservice.events"
"""The servers' default ``nats_subject_prefix``."""
DEFAULT_STREAM = "KVSERVICE_EVENTS"
"""The servers' default ``nats_stream``."""

HEADER_SEQ = "Kvservice-Seq"
"""The batch's seq (decimal): gap-free from 1 within an epoch."""
HEADER_EPOCH = "Kvservice-Epoch"
"""The publishing server's epoch (changes on restart)."""
HEADER_INSTANCE = "Kvservice-Instance"
"""The publishing server's instance name (also the last subject token)."""
HEADER_DATA_PARALLEL_RANK = "Kvservice-Data-Parallel-Rank"
"""The server's data-parallel rank (decimal), only when configured."""
HEADER_RESYNC = "Kvservice-Resync"
"""``{first}-{last}``: seqs of this epoch the publisher dropped just before this batch."""


def subject_for(subject_prefix: str, instance: str) -> str:
    """The subject an instance publishes on: ``{subject_prefix}.{instance}``."""
    return f"{subject_prefix}.{instance}"


def msg_id(epoch: str, seq: int) -> str:
    """The ``Nats-Msg-Id`` of a batch: ``{epoch}:{seq}`` (JetStream drops a re-publish of it)."""
    return f"{epoch}:{seq}"


def redact_url(url: Any) -> str:
    """A NATS URL, or several comma-separated, fit to print or log: the password or token in its
    userinfo replaced by ``***`` (``nats://u:***@host:4222``; a token or a user alone,
    ``nats://***@host:4222``). Every place kvservice prints or logs a NATS server address goes
    through it.

    Args:
        url: a ``str``, or anything with ``geturl()`` (the ``urllib.parse.ParseResult`` that nats-py
            hands out as ``connected_url`` and ``servers``); None gives ``"?"``.
    """
    if url is None:
        return "?"
    text = url.geturl() if hasattr(url, "geturl") else str(url)
    return ", ".join(_redact_one(part.strip()) for part in text.split(","))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, host = rest.rpartition("@")  # the last '@': a password may hold an unescaped one
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{hidden}@{host}"


def is_authorization_error(error: BaseException) -> bool:
    """Whether a nats-py error says the server refused the credentials (``AuthorizationError``, or
    the ``'Authorization Violation'`` / ``'Authentication ...'`` error nats-py raises while
    connecting)."""
    if type(error).__name__ in ("AuthorizationError", "InvalidUserCredentialsError"):
        return True
    text = str(error).lower()
    return "authorization violation" in text or "authentication" in text


class NatsCredentialsRefusedError(RuntimeError):
    """The NATS server refused the credentials while connecting (the message names the redacted
    URLs and nats-py's error).

    Attributes:
        servers: the redacted URLs.
    """

    def __init__(self, servers: str, error: BaseException) -> None:
        detail = str(error) or type(error).__name__
        super().__init__(
            f"the NATS server at {servers} refused the credentials ({detail}); check the user and password "
            "or token in the URL (or the credentials file)"
        )
        self.servers = servers


async def connect_nats(
    nats: Any,
    servers: list[str],
    *,
    connect_timeout_s: float,
    error_cb: Callable[[Exception], Any] | None = None,
    **options: Any,
) -> Any:
    """``nats.connect(servers=servers, **options)``, bounded by ``connect_timeout_s`` seconds, and
    failing at once when a server refuses the credentials (nats-py itself would retry them until
    the timeout). ``error_cb`` (async) still sees every error.

    Raises:
        NatsCredentialsRefusedError: a server refused the credentials.
        asyncio.TimeoutError: not connected within ``connect_timeout_s``.
        nats.errors.Error, OSError: as ``nats.connect`` (e.g. ``NoServersError``).
    """
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()

    async def on_error(e: Exception) -> None:
        if is_authorization_error(e) and not refused.done():
            refused.set_result(e)
        if error_cb is not None:
            await error_cb(e)

    connecting = loop.create_task(nats.connect(servers=servers, error_cb=on_error, **options))
    try:
        done, _ = await asyncio.wait(
            {connecting, refused}, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:
        connecting.cancel()
        raise
    if connecting in done:
        refused.cancel()  # later errors (a refusal on reconnect included) only reach error_cb
        return connecting.result()
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    if refused in done:
        raise NatsCredentialsRefusedError(redact_url(",".join(servers)), refused.result())
    raise asyncio.TimeoutError()


def import_nats(needed_by: str = "JetStreamWatcher", extra: str = "kvservice-client's nats") -> Any:
    """Import nats-py (with ``nats.js.api`` and ``nats.js.errors``) and return the ``nats`` module.

    Args:
        needed_by: what needs it, for the error message.
        extra: the package extra that installs it, for the error message.

    Raises:
        RuntimeError: nats-py is not installed (the message names ``pip install nats-py`` and the extra).
    """
    try:
        import nats
        import nats.js.api
        import nats.js.errors
    except ImportError as e:
        raise RuntimeError(
            f"{needed_by} needs nats-py, which is not installed ({e}): pip install nats-py ({extra} extra)"
        ) from None
    return nats


class MirrorState(str, enum.Enum):
    """Whether an :class:`InstanceMirror` holds its server's cached set (as of ``last_seq``)."""

    SYNCED = "synced"
    """Every batch of the epoch up to ``last_seq`` was applied (or a snapshot stands for them)."""
    RESYNC_NEEDED = "resync_needed"
    """A gap: batches are missing; the index is stale until rebuilt from a snapshot."""


class ResyncNeededError(Exception):
    """An instance's mirror has a gap and must be rebuilt from a snapshot.

    Attributes:
        instance: the instance.
        reason: what was missing.
    """

    def __init__(self, instance: str, reason: str) -> None:
        super().__init__(f"instance {instance!r} needs a resync from a snapshot: {reason}")
        self.instance = instance
        self.reason = reason


@dataclass
class InstanceMirror:
    """One server instance as the watcher knows it.

    Attributes:
        instance: the instance name (the :data:`HEADER_INSTANCE` of its messages).
        index: its cached block hashes, per KV cache group.
        epoch: the server epoch followed (None before the first batch).
        last_seq: seq of the last batch applied in ``epoch`` (0 before any; a snapshot's watermark
            after a rebuild).
        state: SYNCED, or RESYNC_NEEDED after a gap.
        resync_reason: why it needs a resync (None when synced).
        data_parallel_rank: from the last batch's header (None when the server sets none).
        num_batches: batches applied (all epochs).
        num_skipped: messages skipped: redeliveries, batches of a retired epoch, batches read while
            a resync was needed.
        num_epoch_changes: times a new epoch cleared the mirror (the first epoch seen is not one).
        num_resyncs: times the mirror needed a resync.
        retired_epochs: epochs followed before the current one (their late batches are skipped).
    """

    instance: str
    index: PrefixIndex
    epoch: str | None = None
    last_seq: int = 0
    state: MirrorState = MirrorState.SYNCED
    resync_reason: str | None = None
    data_parallel_rank: int | None = None
    num_batches: int = 0
    num_skipped: int = 0
    num_epoch_changes: int = 0
    num_resyncs: int = 0
    retired_epochs: set[str] = field(default_factory=set)

    def hashes(self, num_groups: int) -> list[set[ev.ExternalBlockHash]]:
        """Per group 0..num_groups-1, the cached hashes (the shape of the server's
        ``SnapshotSource.mirror.cached_hashes()``)."""
        held = self.index.snapshot()
        return [held.get(g, set()) for g in range(num_groups)]

    def _need_resync(self, reason: str) -> None:
        if self.state is not MirrorState.RESYNC_NEEDED:
            self.num_resyncs += 1
            logger.warning("JetStream watcher: instance %s needs a resync from a snapshot: %s", self.instance, reason)
        self.state = MirrorState.RESYNC_NEEDED
        self.resync_reason = reason


REBUILD_RETRY_S = 5.0
"""After an automatic rebuild fails, seconds before the watcher tries that instance again."""


class JetStreamWatcher:
    """Consumes the kvservice event stream from JetStream and mirrors each instance's cache.

    The consumer is a durable push consumer, created on first use with deliver-all and ack-all
    policies (a new durable starts at the stream's first retained message); the server pushes
    messages as they are stored, at most ``max_ack_pending`` unacked. A background task applies
    them in stream order (see the module docstring), up to ``ack_batch`` at a time, then acks the
    last one applied and waits for the server to confirm it, so a later watcher with the same
    ``durable`` never gets a message this one applied and acked. One watcher at a time may bind a
    durable. Use it inside ``async with`` (which starts and closes it).

    Args:
        servers: NATS URL(s) (the watcher connects and closes the connection; credentials go in
            the userinfo, ``nats://user:password@host:4222`` or ``nats://token@host:4222``, and are
            redacted wherever logged), or a connected ``nats.aio.client.Client`` (left open).
        durable: the durable consumer's name; the same name resumes from its acked position.
        stream: the JetStream stream (the servers' ``nats_stream``).
        subject_prefix: the servers' ``nats_subject_prefix``.
        instances: only these instances (the consumer filters their subjects); None = all.
            Only used when the durable is created.
        mirrors: mirrors to continue from (e.g. a previous watcher's :attr:`mirrors` in the same
            process), by instance; None = start empty.
        snapshot_sources: per instance, its gRPC ``host:port`` (a plain client: no token, no TLS)
            or an open :class:`~kvservice_client.client.AsyncKVCacheClient` (build it with the
            token and TLS settings of a server that needs them): a gap is then repaired at once
            from a snapshot (:meth:`rebuild_from_snapshot`); without one the instance stays
            RESYNC_NEEDED until the caller rebuilds it.
        capacity_blocks: bound of each new mirror's :class:`PrefixIndex`, in blocks (None = none).
        ack_batch: most messages applied before one ack (>= 1).
        max_ack_pending: most messages the server pushes without an ack (>= ``ack_batch``); only
            used when the durable is created.
        ack_wait_s: how long the server waits for an ack before redelivering, in seconds (> 0);
            only used when the durable is created.
        connect_timeout_s: how long :meth:`start` tries to reach NATS, in seconds (> 0; when given
            URLs). Once connected, the client reconnects by itself for as long as it takes.
        on_batch: called as ``on_batch(mirror, seq, batch)`` after each batch is applied (not for
            skipped ones), on the watcher's task; an exception it raises stops the watcher.

    Raises:
        ValueError: ``ack_batch < 1``, ``max_ack_pending < ack_batch``, ``ack_wait_s <= 0`` or
            ``connect_timeout_s <= 0``.
    """

    def __init__(
        self,
        servers: str | Iterable[str] | Any,
        *,
        durable: str = "kvservice-watcher",
        stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        instances: Iterable[str] | None = None,
        mirrors: Mapping[str, InstanceMirror] | None = None,
        snapshot_sources: Mapping[str, str | AsyncKVCacheClient] | None = None,
        capacity_blocks: int | None = None,
        ack_batch: int = 256,
        max_ack_pending: int = 4096,
        ack_wait_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        on_batch: Callable[[InstanceMirror, int, ev.KVEventBatch], None] | None = None,
    ) -> None:
        if ack_batch < 1:
            raise ValueError(f"ack_batch must be >= 1; got {ack_batch}")
        if max_ack_pending < ack_batch:
            raise ValueError(f"max_ack_pending must be >= ack_batch ({ack_batch}); got {max_ack_pending}")
        if not ack_wait_s > 0:
            raise ValueError(f"ack_wait_s must be > 0 seconds; got {ack_wait_s}")
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0 seconds; got {connect_timeout_s}")
        self._connect_timeout_s = connect_timeout_s
        if isinstance(servers, str):
            self._servers: list[str] | None = [s.strip() for s in servers.split(",") if s.strip()]
        elif isinstance(servers, Iterable):
            self._servers = list(servers)
        else:
            self._servers = None
        self._nc: Any = None if self._servers is not None else servers
        self._owns_nc = self._servers is not None
        self.durable = durable
        self.stream = stream
        self.subject_prefix = subject_prefix
        self._instances = None if instances is None else tuple(instances)
        self.mirrors: dict[str, InstanceMirror] = dict(mirrors or {})
        """The mirrors, by instance (live; read them between the watcher's steps, e.g. in
        :meth:`wait_until`'s predicate or ``on_batch``)."""
        self._snapshot_sources = dict(snapshot_sources or {})
        self._no_rebuild_until: dict[str, float] = {}  # instance -> loop time
        self._capacity_blocks = capacity_blocks
        self._ack_batch = ack_batch
        self._max_ack_pending = max_ack_pending
        self._ack_wait_s = ack_wait_s
        self._on_batch = on_batch
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # held while applying; a rebuild holds it to pause consumption
        self._changed: asyncio.Condition | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self.num_messages = 0
        """Messages received (applied or skipped)."""
        self.num_foreign = 0
        """Messages without the kvservice headers (acked and ignored)."""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (when given URLs), bind or create the durable consumer, start consuming.

        Raises:
            RuntimeError: nats-py is missing, or the watcher is closed.
            asyncio.TimeoutError: NATS could not be reached within ``connect_timeout_s``.
            NatsCredentialsRefusedError: the NATS server refused the credentials in the URL.
            nats.errors.Error: the stream does not exist (``nats.js.errors.NotFoundError``), or
                another watcher is bound to the durable.
        """
        if self._closed:
            raise RuntimeError("JetStreamWatcher is closed")
        if self._task is not None:
            return
        nats = import_nats()
        api = nats.js.api
        self._changed = asyncio.Condition()
        if self._owns_nc:

            async def on_error(e: Exception) -> None:
                logger.debug("JetStream watcher: %s: %s", type(e).__name__, e)

            # Reconnects forever once connected; the first connection is bounded.
            assert self._servers is not None
            self._nc = await connect_nats(
                nats,
                self._servers,
                connect_timeout_s=self._connect_timeout_s,
                error_cb=on_error,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
            )
        try:
            await self._subscribe(api)
        except BaseException:
            if self._owns_nc:
                await self._nc.close()
                self._nc = None
            raise
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvservice-jetstream-watcher")

    async def _subscribe(self, api: Any) -> None:
        js = self._nc.jetstream()
        everything = f"{self.subject_prefix}.>"
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.ALL,
            ack_wait=self._ack_wait_s,
            max_ack_pending=self._max_ack_pending,
        )
        if self._instances is not None:
            config.filter_subjects = [subject_for(self.subject_prefix, i) for i in self._instances]
        self._sub = await js.subscribe(
            everything, durable=self.durable, stream=self.stream, config=config, manual_ack=True
        )

    async def close(self) -> None:
        """Stop consuming (a message being applied is finished and acked first) and close the
        connection if the watcher opened it. The durable consumer stays. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            async with self._lock:  # never cancel between applying and acking
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
                await self._nc.flush()  # the server has unbound the durable: the next watcher may bind
        if self._nc is not None and self._owns_nc:
            with contextlib.suppress(Exception):
                await self._nc.close()
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def __aenter__(self) -> JetStreamWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the consuming task, if one did."""
        return self._failure

    # -- waiting ---------------------------------------------------------------------------

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Return once ``predicate()`` is true; it is evaluated now and after every step of the
        watcher (messages applied, a rebuild).

        Raises:
            asyncio.TimeoutError: not within ``timeout_s`` seconds.
            RuntimeError: the watcher is not started, or it stopped (closed, or failed: the
                failure is the cause).
        """
        if self._changed is None:
            raise RuntimeError("JetStreamWatcher is not started")
        changed = self._changed

        async def wait() -> None:
            async with changed:
                while not predicate():
                    if self._failure is not None:
                        raise RuntimeError("JetStream watcher stopped on an error") from self._failure
                    if self._closed:
                        raise RuntimeError("JetStream watcher is closed")
                    await changed.wait()

        await asyncio.wait_for(wait(), timeout_s)

    async def wait_for_seq(
        self, instance: str, seq: int, *, epoch: str | None = None, timeout_s: float | None = None
    ) -> InstanceMirror:
        """Wait until ``instance``'s mirror has applied ``seq`` (of ``epoch`` when given).

        Returns:
            The instance's mirror.

        Raises:
            ResyncNeededError: the instance needs a resync (before reaching ``seq``).
            asyncio.TimeoutError, RuntimeError: as :meth:`wait_until`.
        """

        def reached() -> bool:
            mirror = self.mirrors.get(instance)
            if mirror is None:
                return False
            if mirror.state is MirrorState.RESYNC_NEEDED:
                raise ResyncNeededError(instance, mirror.resync_reason or "")
            return (epoch is None or mirror.epoch == epoch) and mirror.last_seq >= seq

        await self.wait_until(reached, timeout_s)
        return self.mirrors[instance]

    # -- consuming -------------------------------------------------------------------------

    async def _run(self) -> None:
        nats = import_nats()
        sub = self._sub
        try:
            while True:
                msgs = [await sub.next_msg(timeout=None)]
                while len(msgs) < self._ack_batch and sub.pending_msgs:
                    msgs.append(await sub.next_msg(timeout=None))  # already here: no wait
                async with self._lock:
                    for msg in msgs:
                        await self._process(msg)
                    try:
                        await msgs[-1].ack_sync()  # ack-all: every message up to it
                    except nats.errors.Error as e:  # redelivered after ack_wait_s, then skipped by seq
                        logger.warning("JetStream watcher: ack failed (%s: %s)", type(e).__name__, e)
                assert self._changed is not None
                async with self._changed:
                    self._changed.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.error("JetStream watcher stopped: %s: %s", type(e).__name__, e)
            self._failure = e
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

    def _mirror(self, instance: str) -> InstanceMirror:
        mirror = self.mirrors.get(instance)
        if mirror is None:
            from kvservice_client.watcher import PrefixIndex

            mirror = self.mirrors[instance] = InstanceMirror(instance, PrefixIndex(self._capacity_blocks))
        return mirror

    async def _process(self, msg: Any) -> None:
        """Apply (or skip) one message, in stream order."""
        self.num_messages += 1
        headers = msg.headers or {}
        try:
            instance = headers[HEADER_INSTANCE]
            epoch = headers[HEADER_EPOCH]
            seq = int(headers[HEADER_SEQ])
        except (KeyError, ValueError):
            self.num_foreign += 1
            logger.warning("JetStream watcher: ignored a message on %s without kvservice headers", msg.subject)
            return
        mirror = self._mirror(instance)
        if epoch in mirror.retired_epochs:
            mirror.num_skipped += 1
            return
        if epoch != mirror.epoch:
            # A new epoch: the server restarted with an empty cache (its epoch start, seq 0, is skipped below).
            if mirror.epoch is not None:
                mirror.retired_epochs.add(mirror.epoch)
                mirror.num_epoch_changes += 1
            mirror.index.clear()
            mirror.epoch = epoch
            mirror.last_seq = 0
            mirror.state = MirrorState.SYNCED
            mirror.resync_reason = None
        if mirror.state is MirrorState.SYNCED and seq > mirror.last_seq + 1:
            dropped = headers.get(HEADER_RESYNC)
            mirror._need_resync(
                f"expected seq {mirror.last_seq + 1} of epoch {epoch}, got seq {seq}"
                + (f" (the publisher dropped seqs {dropped})" if dropped else " (missing from the stream)")
            )
        if mirror.state is MirrorState.RESYNC_NEEDED:
            await self._maybe_rebuild(mirror)
        if mirror.state is MirrorState.RESYNC_NEEDED or epoch != mirror.epoch or seq <= mirror.last_seq:
            mirror.num_skipped += 1  # a gap not yet repaired, a redelivery, or covered by a snapshot
            return
        if seq != mirror.last_seq + 1:
            mirror._need_resync(f"the snapshot's watermark, seq {mirror.last_seq}, is before seq {seq} - 1")
            mirror.num_skipped += 1
            return
        try:
            batch = ev.decode_event_batch(msg.data)
        except Exception as e:
            mirror._need_resync(f"seq {seq} of epoch {epoch} could not be decoded: {e}")
            mirror.num_skipped += 1
            return
        mirror.index.apply_batch(batch)
        mirror.last_seq = seq
        mirror.num_batches += 1
        rank = headers.get(HEADER_DATA_PARALLEL_RANK)
        mirror.data_parallel_rank = None if rank is None else int(rank)
        if self._on_batch is not None:
            self._on_batch(mirror, seq, batch)

    # -- snapshots -------------------------------------------------------------------------

    async def rebuild_from_snapshot(self, instance: str, source: str | AsyncKVCacheClient) -> InstanceMirror:
        """Reload ``instance``'s mirror (the same :class:`PrefixIndex` object) from a snapshot of its
        server's cache, taken over gRPC (StreamEvents with a snapshot, all its parts), and continue
        after its watermark: later batches of that epoch with seq <= the watermark are skipped, and
        batches of the epoch followed before are dropped as retired. Consumption pauses meanwhile.

        Args:
            instance: the instance (need not be known yet).
            source: its gRPC ``host:port`` (an insecure client is opened and closed) or an open
                :class:`~kvservice_client.client.AsyncKVCacheClient`.

        Returns:
            The rebuilt mirror (SYNCED; ``epoch`` and ``last_seq`` are the snapshot's).

        Raises:
            KVServiceError: the StreamEvents call failed (the mirror is unchanged).
            RuntimeError: the server's stream did not start with a snapshot.
        """
        async with self._lock:
            mirror = self._mirror(instance)
            await self._rebuild(mirror, source)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
        return mirror

    async def _maybe_rebuild(self, mirror: InstanceMirror) -> None:
        """Rebuild from the instance's snapshot source, if it has one and no rebuild failed in the
        last :data:`REBUILD_RETRY_S` seconds (a failure is logged; the mirror stays RESYNC_NEEDED)."""
        source = self._snapshot_sources.get(mirror.instance)
        now = asyncio.get_running_loop().time()
        if source is None or now < self._no_rebuild_until.get(mirror.instance, 0.0):
            return
        try:
            await self._rebuild(mirror, source)
        except Exception:
            self._no_rebuild_until[mirror.instance] = now + REBUILD_RETRY_S

    async def _rebuild(self, mirror: InstanceMirror, source: str | AsyncKVCacheClient) -> None:
        from kvservice_client.client import AsyncKVCacheClient
        from kvservice_client.convert import proto_to_batch

        client = AsyncKVCacheClient(source) if isinstance(source, str) else source
        parts: list[ev.KVEventBatch] = []
        try:
            stream = client.stream_events(snapshot=True)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]  # grpc's stream iterator is typed without aclose(), which aclosing needs; it has it
                async for part in stream:
                    if not part.snapshot:
                        raise RuntimeError(f"instance {mirror.instance}: StreamEvents sent no snapshot first")
                    parts.append(proto_to_batch(part))
                    if not part.snapshot_more:
                        break
                else:
                    raise RuntimeError(f"instance {mirror.instance}: the snapshot stream ended early")
        except Exception as e:
            logger.warning("JetStream watcher: rebuilding instance %s failed: %s", mirror.instance, e)
            raise
        finally:
            if isinstance(source, str):
                await client.close()
        # Applied in one go (no await), into the same index: readers never see half a snapshot.
        for batch in parts:  # the first event is AllBlocksCleared
            mirror.index.apply_batch(batch)
        if mirror.epoch is not None and mirror.epoch != part.epoch:
            mirror.retired_epochs.add(mirror.epoch)
        mirror.retired_epochs.discard(part.epoch)
        mirror.epoch = part.epoch
        mirror.last_seq = part.seq
        mirror.state = MirrorState.SYNCED
        mirror.resync_reason = None
        logger.info(
            "JetStream watcher: instance %s rebuilt from a snapshot at seq %d of epoch %s",
            mirror.instance,
            part.seq,
            part.epoch,
        )
