"""Server lifecycle: configuration, start (the one public start function), graceful stop.

Configuration comes from, in increasing precedence: defaults, a TOML file, ``KVSERVICE_*``
environment variables, and explicit arguments (the CLI's flags). :func:`start_server` builds the
cache manager, the KV tensors, the event log and the servicer, registers health and reflection,
binds (port 0 picks a free port) and returns a :class:`RunningServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvservice.core.engine import EngineLimits, KVCacheEngine
from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig, PrefixCachingConfig, is_block_hash_format
from kvservice.core.kv_cache_spec import KVCacheConfig, max_tokens_in_pool
from kvservice.core.model_config import (
    KNOWN_ARCHITECTURES,
    OPAQUE_PREFIX,
    ModelKVLayout,
    get_preset,
    load_kv_cache_layout,
    load_model_config,
    model_kv_layout,
    opaque_kv_layout,
)
from kvservice.memory import (
    KVCacheTensors,
    allocate_kv_cache_tensors,
    cuda_memory_budget,
    is_meta_device,
    num_blocks_from_budget,
    resolve_device,
)
from kvservice.server.auth import AuthSetup, build_auth, is_loopback_host
from kvservice.server.event_log import EventLog
from kvservice.server.observability import announce
from kvservice.server.probes import ProbePort
from kvservice.server.reaper import RequestReaper
from kvservice.server.servicer import SERVICE_NAME, KVCacheServicer, build_metadata_response
from kvservice.server.settings import (
    DEFAULT_REQUEST_IDLE_TIMEOUT_S,
    CacheSettings,
    ServerConfig,
    load_config,
    parse_bytes,
)
from kvservice.server.sinks import EventSink, NullEventSink, SinkContext, start_sinks
from kvservice.server.snapshot import SnapshotSource

if TYPE_CHECKING:  # imported lazily where used (the sinks' optional dependencies); here only for annotations
    import torch

    from kvservice.core.kv_cache_spec import KVCacheGroupSpec
    from kvservice.server.metrics import ServerMetrics
    from kvservice.server.nats_sink import NatsJetStreamSink
    from kvservice.server.zmq_publisher import ZmqEventPublisher
    from kvservice.shm import SharedMemoryAllocator
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

logger = logging.getLogger(__name__)

__all__ = ["RunningServer", "ServerConfig", "load_config", "parse_bytes", "run_server", "start_server"]

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class RunningServer:
    """A started server.

    Attributes:
        address: "host:port" it listens on (the real port when 0 was asked).
        port: the bound port.
        server: the grpc.aio server.
        engine, event_log, servicer: its parts (tests and the replay's invariant checks use them).
        snapshots: where every snapshot is cut (``StreamEvents``, ``TakeEvents``, other wires).
        tensors: the KV tensors.
        config: the effective configuration (num_blocks resolved).
    """

    address: str
    port: int
    server: grpc.aio.Server
    engine: KVCacheEngine
    event_log: EventLog
    servicer: KVCacheServicer
    tensors: KVCacheTensors
    config: ServerConfig
    health: health_aio.HealthServicer | None = field(repr=False, default=None)
    snapshots: SnapshotSource | None = field(repr=False, default=None)
    notes: list[str] = field(default_factory=list)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list, repr=False)
    """Async callables run (in reverse order) after the gRPC server stopped: publishers, reapers,
    the metrics endpoint."""
    reaper: RequestReaper | None = field(default=None, repr=False)
    """The request reaper (with ``request_idle_timeout_s``; None without)."""
    probes: ProbePort = field(default_factory=ProbePort, repr=False)
    """The probe ports (``health_port``, ``health_http_port``; unbound when off)."""
    stop_timeline: list[tuple[str, float]] = field(default_factory=list, repr=False)
    """(step, ``time.monotonic()``) of each step of :meth:`stop`, in order."""
    sinks: dict[str, EventSink] = field(default_factory=dict, repr=False)
    """The started event sinks by kind ("zmq", "nats"; see ``kvservice.server.sinks``)."""
    _stopped: bool = field(default=False, repr=False)

    def sink(self, kind: str) -> EventSink:
        """The started sink of ``kind``, or a :class:`~kvservice.server.sinks.NullEventSink`."""
        return self.sinks.get(kind) or NullEventSink()

    @property
    def zmq_publisher(self) -> ZmqEventPublisher | None:
        """The ZMQ sink (None without ``zmq_endpoint``)."""
        from kvservice.server.zmq_publisher import ZmqEventPublisher

        sink = self.sinks.get("zmq")
        return sink if isinstance(sink, ZmqEventPublisher) else None

    @property
    def nats_sink(self) -> NatsJetStreamSink | None:
        """The NATS JetStream sink (None without ``nats_url``)."""
        from kvservice.server.nats_sink import NatsJetStreamSink

        sink = self.sinks.get("nats")
        return sink if isinstance(sink, NatsJetStreamSink) else None

    @property
    def metrics_port(self) -> int | None:
        """The bound port of the Prometheus endpoint (None when metrics are off)."""
        return self.config.metrics.port

    def describe(self) -> str:
        """Where it listens, what it holds, and the notes: the start banner's lines as text."""
        return "\n".join(message for message, _, _ in self.banner_lines())

    def banner_lines(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The start banner as (message, event, fields) per line: "listening" (``address``,
        ``epoch``), "layout" (``preset``, ``num_blocks``, ``max_model_len``; its message goes on
        over the KV tensors' lines), then one "note" each. ``kvservice serve`` writes them as text
        or as JSON objects (``kvservice.server.observability.announce``)."""
        meta = self.servicer.metadata
        groups = ", ".join(
            f"group {g.group_idx}: {_kind_name(g.kind)} block_size {g.block_size}"
            + (f" window {g.sliding_window}" if g.HasField("sliding_window") else "")
            for g in meta.groups
        )
        layout = (
            f"preset {meta.preset}: {self.config.cache.num_blocks} blocks ({groups}), max_model_len "
            f"{self.config.cache.max_model_len} tokens; hash {meta.hash_algorithm} seed {meta.hash_seed!r}; "
            f"{self.tensors.describe()}"
        )
        return [
            (
                f"kvservice listening on {self.address} (epoch {self.event_log.epoch})",
                "listening",
                {"address": self.address, "epoch": self.event_log.epoch},
            ),
            (
                layout,
                "layout",
                {
                    "preset": meta.preset,
                    "num_blocks": self.config.cache.num_blocks,
                    "max_model_len": self.config.cache.max_model_len,
                },
            ),
            *((f"note: {note}", "note", {}) for note in self.notes),
        ]

    def check_invariants(self) -> None:
        """Run the engine's own consistency check now (pool, ref counts, block tables; see
        :meth:`kvservice.core.engine.KVCacheEngine.check_invariants`).

        Raises:
            AssertionError: an invariant does not hold (the message names it).
        """
        self.engine.check_invariants()

    def cached_hashes(self) -> list[set[int | bytes]]:
        """Per KV cache group (index = group_idx), the block hashes cached now, in their published
        form: what a watcher that applied every batch holds (docs/ARCHITECTURE.md §3.4)."""
        assert self.snapshots is not None
        return self.snapshots.cached_hashes()  # the mirror's, with any batches a cut holds back

    async def stop(self, grace: float | None = None, *, drain_delay_s: float = 0.0) -> None:
        """Stop gracefully, in this order (each step's ``time.monotonic()`` goes into
        :attr:`stop_timeline`):

        1. ``not_serving``: health (main and probe ports) says NOT_SERVING, ``/readyz`` 503;
        2. ``drained``: after ``drain_delay_s`` seconds in which the port still serves as before
           (load balancers take the server out meanwhile);
        3. ``streams_ended``: open streams end with UNAVAILABLE naming their last seq;
        4. ``stopped``: calls in flight finish, within ``grace`` seconds (default
           ``shutdown_grace_s``) of step 2 (streams get at least 1 s to end with their status);
           then the sinks, the reaper and the metrics endpoint close;
        5. ``probes_closed``: the probe ports close last.
        """
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.bind.shutdown_grace_s if grace is None else grace
        self.probes.ready = False
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        self._mark("not_serving")
        if drain_delay_s > 0:
            await asyncio.sleep(drain_delay_s)
        self._mark("drained")
        started = time.monotonic()
        self.event_log.close()
        # Let each open stream end with its UNAVAILABLE status before the server cancels calls.
        await self.event_log.wait_drained(max(grace, 1.0))
        self._mark("streams_ended")
        await self.server.stop(max(0.0, grace - (time.monotonic() - started)))
        for close in reversed(self.closers):
            try:
                await close()
            except Exception:
                logger.exception("closing %r failed", close)
        self._mark("stopped")
        await self.probes.close()
        self._mark("probes_closed")

    def _mark(self, step: str) -> None:
        self.stop_timeline.append((step, time.monotonic()))


def _kind_name(kind: pb.KVCacheSpecKind.ValueType) -> str:
    """A KVCacheSpecKind enum value as its lower-case name."""
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

    return pb.KVCacheSpecKind.Name(kind).removeprefix("KV_CACHE_SPEC_KIND_").lower()


def _model_kv_layout(cache: CacheSettings) -> ModelKVLayout:
    """The per-layer KV specs the settings name: ``model_config``, ``kv_cache_layout`` or ``preset``.

    Raises:
        ValueError: a bad config or layout file (the message names the file and the field).
    """
    if cache.model_config is not None:
        model_config = load_model_config(cache.model_config)
        try:
            return model_kv_layout(
                model_config, name=cache.model_config, block_size=cache.block_size, kv_cache_dtype=cache.kv_cache_dtype
            )
        except ValueError as e:
            architecture = (model_config.get("architectures") or [None])[0]
            if architecture in KNOWN_ARCHITECTURES:
                raise
            raise ValueError(
                f"{e}. Any other model: describe its layers in a layout file for --kv-cache-layout "
                "(kind, count, heads, head size, dtype, window ... per run of layers; docs/operations.md, "
                "KV cache layout)"
            ) from None
    if cache.kv_cache_layout is not None and cache.kv_cache_layout.startswith(OPAQUE_PREFIX):
        return opaque_kv_layout(cache.kv_cache_layout, block_size=cache.block_size)
    if cache.kv_cache_layout is not None:
        return load_kv_cache_layout(
            cache.kv_cache_layout, block_size=cache.block_size, kv_cache_dtype=cache.kv_cache_dtype
        )
    return get_preset(cache.preset).kv_layout(cache.block_size, cache.kv_cache_dtype)


def _resolve_num_blocks(
    cache: CacheSettings, kv_cache_config_groups: Sequence[KVCacheGroupSpec], device: torch.device | str
) -> int:
    """Blocks in the pool: ``num_blocks``, else what the KV tensor budget holds."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif not isinstance(device, str) and device.type == "cuda":
        budget = cuda_memory_budget(device, cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
    else:
        if cache.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization needs a CUDA device; give kv_cache_memory or num_blocks")
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    return num_blocks_from_budget(kv_cache_config_groups, budget)


@dataclass
class _Core:
    """What :func:`start_server` builds before anything listens: the cache and its edges."""

    config: ServerConfig
    engine: KVCacheEngine
    tensors: KVCacheTensors
    event_log: EventLog
    servicer: KVCacheServicer
    notes: list[str]
    metrics: ServerMetrics | None = None
    shm: SharedMemoryAllocator | None = None  # the KV memory (CPU) and the control segment
    snapshots: SnapshotSource | None = None  # where every snapshot is cut


def _size_pool(config: ServerConfig) -> tuple[ServerConfig, KVCacheConfig, torch.device | str, list[str], str]:
    """The pool's size and max_model_len resolved (the config says them); the device (a torch
    device, or the string ``"meta"``: a meta pool needs no torch, so none is imported for it).

    A request the pool cannot hold would be registered and then never allocated: a preset's
    max_model_len is lowered to what fits; an explicit one is kept (the engine refuses longer
    prompts at registration). Either way the start says so in a note.
    """
    cache = config.cache
    layout = _model_kv_layout(cache)
    device = "meta" if is_meta_device(cache.device) else resolve_device(cache.device)
    groups = layout.kv_cache_groups()
    kv_cache_config = KVCacheConfig(_resolve_num_blocks(cache, groups, device), groups)
    fits = max_tokens_in_pool(kv_cache_config)
    max_model_len = cache.max_model_len or layout.max_model_len
    notes = []
    if max_model_len > fits:
        if cache.max_model_len is None:
            whose = "preset's" if cache.model_config is None and cache.kv_cache_layout is None else "model's"
            notes.append(
                f"max_model_len lowered from the {whose} {max_model_len} to {fits} tokens, what the pool holds"
            )
            max_model_len = fits
        else:
            notes.append(
                f"the pool holds one request of at most {fits} tokens, below max_model_len {max_model_len}: "
                "longer prompts are refused"
            )
    config = config.replace(num_blocks=kv_cache_config.num_blocks, max_model_len=max_model_len)
    return config, kv_cache_config, device, notes, layout.name


def _build_core(config: ServerConfig) -> _Core:
    """Allocate the KV tensors, build the cache manager, the engine, the event log, the servicer.

    Raises:
        ValueError, kvservice.memory.KVCacheAllocationError: as :func:`start_server`.
    """
    config, kv_cache_config, device, notes, layout_name = _size_pool(config)
    cache = config.cache
    # The data plane: CPU memory in POSIX shared memory (a control segment on CUDA too).
    device_type = "meta" if isinstance(device, str) else device.type
    shm = None
    if device_type in ("cpu", "cuda"):
        from kvservice.shm import SharedMemoryAllocator, remove_stale_segments

        remove_stale_segments()
        # The control segment's lease table: one slot per lease the tier may hold.
        shm = SharedMemoryAllocator(lease_slots=config.tier.limits.max_leases)
    try:
        tensors = allocate_kv_cache_tensors(kv_cache_config, device, allocator=shm if device_type == "cpu" else None)
    except BaseException:
        if shm is not None:
            shm.close()
        raise
    medium = config.events.kv_events_medium
    block_hash_format = cache.block_hash_format
    assert is_block_hash_format(block_hash_format), f"{block_hash_format!r}: CacheSettings checks it"
    manager = KVCacheManager(
        kv_cache_config,
        cast(int, cache.max_model_len),  # resolved by _size_pool (the preset's or the pool's when None)
        prefix_caching=PrefixCachingConfig(cache.hash_algorithm, cache.hash_seed)
        if cache.enable_prefix_caching
        else None,
        kv_events=KVEventsConfig(
            block_hash_format=block_hash_format,
            medium=medium,
            locality=config.events.kv_events_locality,
            ownership=config.events.kv_events_ownership,
        ),
    )
    limits = config.limits
    engine = KVCacheEngine(
        manager,
        EngineLimits(max_num_requests=limits.max_num_requests, max_waiting_tokens=limits.max_waiting_tokens or None),
    )
    meta = manager.get_kv_cache_group_metadata()
    # The tier's calls (docs/tier.md): blocks named by hash alone, over the same pool.
    from kvservice.core.tier import TierStore

    tier_limits = config.tier.limits
    engine.tier = TierStore(
        manager.block_pool,
        [g.block_size for g in meta.groups],
        digest_bytes=16 if (cache.hash_algorithm or "").startswith("xxhash") else 32,
        limits=tier_limits,
    )
    if shm is not None and device_type == "cpu":  # a reader through the mapped memory checks its lease there
        engine.tier.lease_board = shm
    # An answer always fits what this server may send and what any gRPC client accepts.
    events = dataclasses.replace(
        config.events, max_take_bytes=min(4 * 1024 * 1024, config.limits.max_message_bytes - 1024)
    )
    event_log = EventLog(
        manager.num_groups,
        [g.kind for g in meta.groups],
        [g.sliding_window for g in meta.groups],
        events,
        data_parallel_rank=events.data_parallel_rank,
    )
    # First listener: the mirror a snapshot is cut from is up to date when any other listener runs.
    snapshots = SnapshotSource.attach(
        event_log,
        part_tokens=events.snapshot_part_tokens,
        max_concurrent_cuts=events.max_snapshot_cuts,
        max_bytes_in_flight=events.max_snapshot_bytes_in_flight,
        max_bytes_per_s=events.max_snapshot_bytes_per_s,
        max_bytes_stalled=events.max_snapshot_bytes_stalled,
    )
    metadata = build_metadata_response(
        engine,
        epoch=event_log.epoch,
        device=tensors.device_name,
        dtypes=[tensors.dtype_name(g) for g in range(manager.num_groups)],
        preset=layout_name,
        data_parallel_rank=events.data_parallel_rank,
    )
    servicer = KVCacheServicer(
        engine,
        event_log,
        metadata,
        max_step_ops=limits.max_step_ops,
        max_message_bytes=limits.max_message_bytes,
        check_invariants=cache.check_invariants,
        max_step_tokens=limits.max_step_tokens,
        snapshots=snapshots,
    )
    if layout_name.startswith(OPAQUE_PREFIX):
        metadata.opaque_block_bytes = kv_cache_config.block_bytes
    metadata.tier_limits.max_keys_per_call = tier_limits.max_keys_per_call
    metadata.tier_limits.default_lease_ttl_s = tier_limits.default_lease_ttl_s
    metadata.tier_limits.max_lease_ttl_s = tier_limits.max_lease_ttl_s
    metadata.tier_limits.max_leases = tier_limits.max_leases
    if device_type != "meta":
        metadata.max_data_chunk_bytes = limits.chunk_bytes
    if shm is not None:
        shm.set_epoch(event_log.epoch)
        if device_type == "cpu":
            notes.append(
                f"KV memory in {len(shm.segments)} POSIX shared-memory segments (mode 0600): workers attach with AttachKVCache"
            )
    return _Core(config, engine, tensors, event_log, servicer, notes, shm=shm, snapshots=snapshots)


def _add_data_plane(core: _Core, auth: AuthSetup, closers: list[Callable[[], Awaitable[None]]]) -> None:
    """AttachKVCache, ReadBlocks and WriteBlocks (``kvservice.server.data_plane``); with auth off,
    attach only from loopback or the Unix socket. The shared memory is removed at stop."""
    from kvservice.server.data_plane import DataPlane

    shm = core.shm
    if shm is not None:

        async def close_shm() -> None:
            shm.close()

        closers.append(close_shm)
    core.servicer.data_plane = DataPlane(
        core.engine,
        core.tensors,
        epoch=core.event_log.epoch,
        shm=shm,
        chunk_bytes=core.config.limits.chunk_bytes,
        attach_requires_local=auth.interceptor is None and core.config.auth.tls_client_ca_file is None,
        max_streams=core.config.limits.max_data_streams,
        stalled_timeout_s=core.config.events.stalled_write_timeout_s,
        worker_priority=core.config.limits.data_worker_priority,
        window_bytes=core.config.limits.window_bytes,
    )
    closers.append(core.servicer.data_plane.close)


def _add_observability(
    core: _Core, interceptors: list[grpc.aio.ServerInterceptor], closers: list[Callable[[], Awaitable[None]]]
) -> None:
    """The RPC context for JSON logs (``log_format`` json) and a span per RPC (``otel_tracing``;
    spans go where the ``OTEL_*`` variables say, flushed at stop), ahead of auth so refused calls
    are seen too.

    Raises:
        RuntimeError, ValueError: as :func:`kvservice.server.observability.configure_tracing`.
    """
    settings = core.config.logging
    if settings.log_format == "json" or settings.log_level.upper() == "DEBUG":
        from kvservice.server.observability import RpcContextInterceptor

        interceptors.insert(0, RpcContextInterceptor())
    if settings.otel_tracing:
        from kvservice.server.observability import configure_tracing, tracing_interceptor

        interceptor = tracing_interceptor()
        note, flush = configure_tracing()
        core.notes.append(note)
        if flush is not None:
            closers.append(flush)
        interceptors.insert(0, interceptor)


def _start_metrics(
    core: _Core, interceptors: list[grpc.aio.ServerInterceptor], closers: list[Callable[[], Awaitable[None]]]
) -> None:
    """Serve Prometheus metrics (with ``metrics_port``); the bound port goes into ``core.config``."""
    settings = core.config.metrics
    if settings.port is None:
        return
    from kvservice.server.metrics import ServerMetrics

    metrics = ServerMetrics(core.engine, core.event_log, snapshots=core.snapshots)
    metrics.data_plane = core.servicer.data_plane
    core.metrics = metrics
    # First, so calls that another interceptor refuses (UNAUTHENTICATED ...) are counted too.
    interceptors.insert(0, metrics.interceptor)
    port = metrics.start_http_server(settings.host, settings.port)
    closers.append(metrics.close)
    core.config = core.config.replace(metrics_port=port)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    core.notes.append(f"Prometheus metrics on http://{host}:{port}/metrics")
    if not is_loopback_host(settings.host):
        core.notes.append(f"metrics on non-loopback {settings.host}: plain HTTP, no auth (usage and counters only)")


def grpc_server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments under ``config``: message bounds, HTTP/2 keepalive, and
    a fixed receive window per stream (``limits.stream_window_bytes``; BDP probing off)."""
    max_message_bytes = config.limits.max_message_bytes
    keepalive = config.bind
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        # HTTP/2 keepalive: find connections that died without a word, accept clients' pings.
        ("grpc.keepalive_time_ms", int(keepalive.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive.keepalive_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(keepalive.keepalive_timeout_s * 1000)),  # what grpcio 1.85 applies
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(keepalive.keepalive_min_client_interval_s * 1000)),
        # No BDP probing: it grows a stream's receive window to many MiB, so 16 WriteBlocks streams
        # of 64 MiB left about 400 MiB queued in gRPC (issue 24). Without it the window is fixed at
        # lookahead_bytes: two data chunks rather than HTTP/2's 64 KiB, so a client sends the next
        # chunk while the server copies one (at 64 KiB a 1 MiB chunk took 16 window round trips).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", config.limits.window_bytes),
    ]


async def _bind(
    core: _Core,
    interceptors: list[grpc.aio.ServerInterceptor],
    credentials: grpc.ServerCredentials | None,
    closers: list[Callable[[], Awaitable[None]]],
) -> tuple[grpc.aio.Server, health_aio.HealthServicer, str]:
    """Build the gRPC server (the service, health, reflection), bind and start it; health SERVING.

    Returns:
        (server, health servicer, "host:port" with the bound port); ``core.config`` gets the port.

    Raises:
        RuntimeError: the address cannot be bound (what started before is closed first).
    """
    options = grpc_server_options(core.config)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers((core.servicer.generic_handler(),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server)
    host, port = core.config.bind.host, core.config.bind.port
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    started = False
    try:
        in_use = _address_in_use(host, port)
        if in_use is not None:
            raise RuntimeError(
                f"cannot bind {bind}: {in_use} (another kvservice or another program listens on port {port}): "
                "choose another --port, or --port 0 for a free one"
            )
        try:
            bound = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
        except RuntimeError as e:  # grpc's own words name GRPC_VERBOSITY: ours name the address
            raise RuntimeError(f"cannot bind {bind}: {e}") from None
        if bound == 0:
            raise RuntimeError(f"cannot bind {bind}")
        uds = core.config.bind.uds
        if uds is not None:
            _add_uds_port(server, uds, credentials, closers)
        started = True  # before: a cancellation inside start() leaves it running too
        await server.start()
        if uds is not None:
            os.chmod(uds, 0o600)  # only this user connects (the socket is made by bind)
            core.notes.append(f"also listening on unix:{uds} (mode 0600)")
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:  # a failure, or a cancellation (Ctrl-C in a replay worker)
        if started:  # else grpc's Server.__del__ schedules its shutdown on a closed loop (noise)
            # A start() cancelled half-way can refuse its stop (grpc: InvalidStateError); the
            # failure or cancellation that got here is what the caller must see.
            with contextlib.suppress(Exception):
                await server.stop(0)
        for close in reversed(closers):  # what started before the bind (the metrics endpoint)
            await close()
        raise
    core.config = core.config.replace(port=bound)
    return server, health, bind.rsplit(":", 1)[0] + f":{bound}"


def _address_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` is taken ("Address already in use"), tried with a plain socket before
    gRPC binds it (gRPC's own failure writes a raw internal line to stderr first); None when free,
    when ``port`` is 0, or when the host does not resolve (gRPC's bind then says why)."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return e.strerror
    return None


async def _start_probes(running: RunningServer) -> None:
    """Bind the probe ports (``health_port``, ``health_http_port``) when set; bound ports go into
    the config. A failure stops the server."""
    bind = running.config.bind
    if bind.health_port is None and bind.health_http_port is None:
        return
    try:
        running.probes = await ProbePort.start(
            running.health, bind.health_host or bind.host, bind.health_port, bind.health_http_port
        )
    except BaseException:
        await running.stop(0)
        raise
    running.config = running.config.replace(
        health_port=running.probes.grpc_port, health_http_port=running.probes.http_port
    )
    running.notes.append(running.probes.describe())


def _start_reaper(running: RunningServer) -> None:
    """Free requests not called for ``request_idle_timeout_s`` (unless 0 or None); the start notes
    a timeout other than the default, or none."""
    timeout_s = running.config.limits.request_idle_timeout_s
    if not timeout_s:
        running.notes.append(
            "request_idle_timeout_s off: a request whose scheduler stopped calling holds its blocks until freed"
        )
        return
    running.reaper = RequestReaper(running.engine, running.servicer.publish, timeout_s)
    running.reaper.start()
    running.closers.append(running.reaper.stop)
    if timeout_s != DEFAULT_REQUEST_IDLE_TIMEOUT_S:
        running.notes.append(f"requests not called for {timeout_s:g} s are freed (request_idle_timeout_s)")


async def _start_sinks(running: RunningServer) -> None:
    """Start the event sinks the config turns on (:data:`kvservice.server.sinks.SINKS`); a
    failure stops the server."""
    config = running.config
    ctx = SinkContext(running.event_log, running.port, config.auth.allow_insecure_bind, running.snapshots)
    try:
        started = await start_sinks(config, ctx)
    except BaseException:
        await running.stop(0)
        raise
    for name, done in started.items():
        running.sinks[name] = done.sink
        running.closers.append(done.sink.close)
        running.notes.append(done.sink.describe())
        running.notes.extend(done.sink.notes)
        if done.resolved:
            running.config = running.config.replace(**done.resolved)
        if done.zmq_seq_base is not None:
            running.servicer.metadata.zmq_seq_base = done.zmq_seq_base


async def start_server(config: ServerConfig | None = None, **overrides: Any) -> RunningServer:
    """Build and start a server; the one public start function (the replay starts its embedded
    server through it).

    Steps: size the pool and build the cache, the event log and the servicer
    (:func:`_build_core`); auth and metrics (interceptors, credentials); bind and start with
    health SERVING (:func:`_bind`); then what needs the bound port: the request reaper and the
    event sinks.

    Args:
        config: the configuration (default: :class:`ServerConfig` defaults).
        **overrides: flat settings replacing the config's (``port=0, zmq_endpoint=...``).

    Returns:
        The running server; ``await running.stop()`` to stop it. Its ``config`` has the resolved
        values (num_blocks, max_model_len, port, metrics_port, nats_instance).

    Raises:
        ValueError: a bad setting (naming it).
        kvservice.memory.KVCacheAllocationError: the KV tensors do not fit (bytes asked and
            available in the message).
        RuntimeError: the address cannot be bound.
    """
    config = (config or ServerConfig()).replace(**overrides)
    core = _build_core(config)
    auth = build_auth(core.config.bind.host, core.config.auth)
    core.notes.extend(auth.notes)
    interceptors: list[grpc.aio.ServerInterceptor] = [] if auth.interceptor is None else [auth.interceptor]
    assert core.snapshots is not None
    closers: list[Callable[[], Awaitable[None]]] = [
        core.snapshots.close,
        core.servicer.heap_trimmer.close,
        core.servicer.close,
    ]
    _add_observability(core, interceptors, closers)
    _add_data_plane(core, auth, closers)
    _start_metrics(core, interceptors, closers)
    server, health, address = await _bind(core, interceptors, auth.credentials, closers)
    running = RunningServer(
        address,
        core.config.bind.port,
        server,
        core.engine,
        core.event_log,
        core.servicer,
        core.tensors,
        core.config,
        health,
        snapshots=core.snapshots,
        notes=core.notes,
        closers=closers,
    )
    try:
        await _start_probes(running)
        _start_reaper(running)
        await _start_sinks(running)
    except BaseException:  # a failure, or a cancellation while starting: stop what runs (idempotent)
        await running.stop(0)
        raise
    if core.metrics is not None:
        core.metrics.sinks = running.sinks
    return running


def _add_uds_port(
    server: grpc.aio.Server,
    path: str,
    credentials: grpc.ServerCredentials | None,
    closers: list[Callable[[], Awaitable[None]]],
) -> None:
    """Listen on the Unix-domain socket ``path`` too (a stale socket file there is replaced; any
    other file is refused); the file is removed at stop.

    Raises:
        ValueError: ``path`` exists and is not a socket.
        RuntimeError: it cannot be bound.
    """
    import stat as stat_module

    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        if not stat_module.S_ISSOCK(st.st_mode):
            raise ValueError(f"uds {path!r} exists and is not a socket; refusing to replace it")
        os.unlink(path)
    target = f"unix:{path}"
    port = server.add_insecure_port(target) if credentials is None else server.add_secure_port(target, credentials)
    if port == 0:
        raise RuntimeError(f"cannot bind {target}")

    async def remove_socket() -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    closers.append(remove_socket)


async def run_server(config: ServerConfig, *, ready: Callable[[RunningServer], None] | None = None) -> None:
    """Start a server, print where it listens and what it holds, and serve until SIGTERM/SIGINT;
    then stop gracefully (open streams end with UNAVAILABLE naming their last seq)."""
    running = await start_server(config)
    # Everything built so far (the pool's blocks, the imported modules) lives as long as the
    # process: keep it out of the cycle collector's full passes, which would otherwise hold the
    # loop for about 300 ms each here (a process-wide choice, so only the serving process makes it).
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the banner: a signal right after it still drains
        loop.add_signal_handler(sig, stop.set)
    for message, event, fields in running.banner_lines():
        announce(message, event, **fields)
    profile_path = os.environ.get("KVSERVICE_PROFILE", "")  # a cProfile dump of the serving loop, for benchmarks
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if ready is not None:
        ready(running)
    await stop.wait()
    bind = running.config.bind
    announce(
        f"kvservice: stopping (graceful): NOT_SERVING, drain {bind.drain_delay_s:g} s, then stop within "
        f"{bind.shutdown_grace_s:g} s",
        "stopping",
        drain_delay_s=bind.drain_delay_s,
        shutdown_grace_s=bind.shutdown_grace_s,
    )
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    await running.stop(drain_delay_s=bind.drain_delay_s)
    announce("kvservice: stopped", "stopped")
