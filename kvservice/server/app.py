"""Server lifecycle: configuration, start (the one public start function), graceful stop.

Configuration comes from, in increasing precedence: defaults, a TOML file, ``KVSERVICE_*``
environment variables, and explicit arguments (the CLI's flags). :func:`start_server` builds the
cache manager, the KV tensors, the event log and the servicer, registers health and reflection,
binds (port 0 picks a free port) and returns a :class:`RunningServer`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice.core.engine import EngineLimits, KVCacheEngine
from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig, PrefixCachingConfig
from kvservice.core.kv_cache_spec import KVCacheConfig, get_preset, max_tokens_in_pool
from kvservice.memory import (
    KVCacheTensors,
    allocate_kv_cache_tensors,
    cuda_memory_budget,
    num_blocks_from_budget,
    resolve_device,
)
from kvservice.server.auth import build_auth, check_auth_settings, is_loopback_host
from kvservice.server.event_log import EventLog, EventLogConfig
from kvservice.server.nats_sink import check_nats_settings, start_nats_sink
from kvservice.server.reaper import RequestReaper
from kvservice.server.servicer import SERVICE_NAME, KVCacheServicer, build_metadata_response
from kvservice.server.snapshot import SnapshotSource
from kvservice.server.zmq_publisher import check_endpoint_exposure
from kvservice_client.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED, HASH_ALGORITHMS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger(__name__)

__all__ = ["RunningServer", "ServerConfig", "load_config", "parse_bytes", "run_server", "start_server"]

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kvservice serve`` can be told.

    Attributes:
        host: address to bind ("127.0.0.1"; "0.0.0.0" or "[::]" for all interfaces).
        port: port to bind; 0 picks a free one (the bound address is printed).
        preset: model KV layout (see ``kvservice.core.kv_cache_spec.PRESETS``).
        block_size: tokens per block (default: the preset's).
        num_blocks: blocks in the pool, null block included (default: from the memory budget).
        kv_cache_memory: KV tensor budget in bytes (default 1 GiB on CPU/meta).
        gpu_memory_utilization: fraction of free CUDA memory for KV tensors (default 0.9 on CUDA).
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:N" or "meta" (shapes only).
        max_model_len: longest request in tokens (default: the preset's).
        hash_algorithm, hash_seed: the block-hash rule.
        block_hash_format: "int64" (vLLM's published form) or "digest".
        data_parallel_rank: copied onto every event batch.
        event_max_batches, event_max_bytes: event log retention: batches, and bytes the log holds
            for them (msgpack bytes, the wire encodings cached for subscribers, a fixed overhead per
            batch: within 1.5x of the Python memory it takes).
        max_subscriber_lag: batches a stream subscriber may fall behind before it is ended.
        max_consumers: named TakeEvents consumers.
        snapshot_part_tokens: token ids per snapshot message, about (big snapshots go in parts;
            default 32,768: encoding one part holds the loop about 15 ms here).
        stalled_write_timeout_s: the longest one StreamEvents write may take, in seconds (a client
            that stopped reading, or whose connection died silently): then the stream is ended with
            DEADLINE_EXCEEDED naming the bound, behind or not (default 30).
        max_num_requests: registered requests at once.
        max_step_ops: ops per Step.
        max_step_tokens: tokens per Step (prompt_token_ids + new_token_ids over all its ops);
            bounds how long one Step holds the event loop (default 262,144: about 0.1 s here, 0.8 s
            under heavy load; a
            Step runs whole, without yielding, so its events are one batch).
        request_idle_timeout_s: a request not called (GetComputedBlocks/AllocateSlots, unary or in
            a Step) for this many seconds is freed as by Free (None: never, the default).
        consumer_idle_timeout_s: a named TakeEvents consumer that has not taken for this many
            seconds is dropped; a later take by its name starts like a new consumer's.
        max_streams: open StreamEvents subscriptions at once.
        max_message_bytes: largest gRPC message accepted or sent, in bytes.
        grace_seconds: how long a graceful stop waits for calls in flight.
        check_invariants: debug: check the cache's invariants after every mutating call and Step
            (slow: it walks the whole pool); a failure is logged at ERROR and counted.
        tls_cert_file, tls_key_file: the server's TLS certificate chain and private key (PEM files;
            both or neither). Without them the port is plain text.
        tls_client_ca_file: CA certificates (PEM) that client certificates must chain to: mutual
            TLS (needs tls_cert_file).
        auth_tokens_file: TOML file of bearer tokens with roles (scheduler, watcher); see
            ``kvservice.server.auth``. Without it no token is asked for.
        allow_insecure_bind: bind a non-loopback host with neither TLS nor tokens (refused
            otherwise); also bind a ZMQ socket (zmq_endpoint, zmq_replay_endpoint) on a
            non-loopback address, which has no authentication at all (refused otherwise).
        zmq_endpoint: publish every event batch on a ZMQ PUB socket in vLLM's framing, e.g.
            "tcp://*:5557" (None: off, the default). Bound when it has a wildcard or is ipc://,
            connected otherwise (vLLM's rule); ``RunningServer.zmq_publisher.endpoint`` is the
            bound one (a wildcard port resolved). A bind off loopback (``tcp://*``) needs
            allow_insecure_bind: ZMQ has no authentication.
        zmq_replay_endpoint: ROUTER endpoint (bound) answering vLLM replay requests from the
            retained event log (None: no replay; needs zmq_endpoint). Off loopback it needs
            allow_insecure_bind.
        zmq_topic: topic frame of every ZMQ message ("", vLLM's default; None, as an empty flag or
            variable gives, is "" too).
        zmq_hwm: PUB send high-water mark, messages queued per subscriber before ZMQ drops (>= 1).
        nats_url: publish every event batch to NATS JetStream, e.g. "nats://nats:4222" (several
            comma-separated; None: off, the default). Credentials go in the userinfo
            (``nats://user:password@host:4222``, ``nats://token@host:4222``); every note, log line
            and error shows them as ``***``. A refused credential fails the start at once. See
            ``kvservice.server.nats_sink``.
        nats_subject_prefix: batches go to ``<prefix>.<instance>``; the stream captures ``<prefix>.>``.
        nats_stream: the JetStream stream, created or updated to the retention below at start.
        nats_instance: this server's subject token, ``[A-Za-z0-9_-]+`` (None: ``<hostname>-<port>``
            with other characters as ``_``).
        nats_max_age_s, nats_max_msgs, nats_max_bytes: stream retention in seconds, messages and
            bytes (0 = no limit; defaults 1 hour, none, 1 GiB).
        nats_duplicate_window_s: seconds the stream drops a re-published batch (same
            ``Nats-Msg-Id``, ``<epoch>:<seq>``) in (> 0, <= nats_max_age_s when that is set).
        nats_max_pending_batches: batches queued while NATS is slow or away before new ones are
            dropped (logged at ERROR; watchers see the seq gap and resync) (>= 1).
        metrics_port: serve Prometheus metrics over HTTP on this port (None: off, the default;
            0 picks a free one; ``RunningServer.metrics_port`` is the bound one).
        metrics_host: address the metrics endpoint binds ("127.0.0.1").
        keepalive_time_s: seconds between HTTP/2 keepalive pings the server sends on a connection
            (> 0; default 30), so a client that vanished without closing (a dead host, a NAT or a
            load balancer that dropped the flow) is found and its streams end.
        keepalive_timeout_s: seconds a ping may go unanswered before the connection is closed
            (> 0; default 10).
        keepalive_min_client_interval_s: the most often (seconds) a client may ping on a quiet
            connection before it is told "too many pings" (> 0; default 5, below the client's
            default of 30 s).
        max_waiting_tokens: prompt tokens held by waiting requests (registered, not yet admitted)
            at once (default 8,388,608, about 370 MiB of server memory; 0: no bound). One more is
            refused with RESOURCE_EXHAUSTED naming max_waiting_tokens.
        max_snapshot_cuts: snapshots cut at once (>= 1; default 2). Callers asking at the same
            head share one cut; at the bound a caller joins the newest cut of its group filter in
            production, or waits for one to finish.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    preset: str = "llama-3-8b"
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    device: str = "auto"
    max_model_len: int | None = None
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    hash_seed: str = DEFAULT_HASH_SEED
    block_hash_format: str = "int64"
    data_parallel_rank: int | None = None
    event_max_batches: int = 100_000
    event_max_bytes: int = 256 * 1024 * 1024
    max_subscriber_lag: int = 10_000
    max_consumers: int = 1024
    snapshot_part_tokens: int = 32_768
    stalled_write_timeout_s: float = 30.0
    max_num_requests: int = 65536
    max_step_ops: int = 4096
    max_message_bytes: int = 64 * 1024 * 1024
    grace_seconds: float = 5.0
    check_invariants: bool = False
    # -- auth settings --
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    auth_tokens_file: str | None = None
    allow_insecure_bind: bool = False
    # -- limits and request lifetime settings --
    max_step_tokens: int = 1 << 18
    request_idle_timeout_s: float | None = None
    consumer_idle_timeout_s: float = 3600.0
    max_streams: int = 1024
    # -- ZMQ publisher settings --
    zmq_endpoint: str | None = None
    zmq_replay_endpoint: str | None = None
    zmq_topic: str | None = ""
    zmq_hwm: int = 100_000
    # -- NATS JetStream sink settings --
    nats_url: str | None = field(default=None, repr=False)  # may hold a password or token
    nats_subject_prefix: str = "kvservice.events"
    nats_stream: str = "KVSERVICE_EVENTS"
    nats_instance: str | None = None
    nats_max_age_s: float = 3600.0
    nats_max_msgs: int = 0
    nats_max_bytes: int = 1 << 30
    nats_duplicate_window_s: float = 120.0
    nats_max_pending_batches: int = 10_000
    # -- metrics settings --
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # -- bounded cost settings (issue 15) --
    max_snapshot_cuts: int = 2
    max_waiting_tokens: int = 8 * 1024 * 1024
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    keepalive_min_client_interval_s: float = 5.0

    def __post_init__(self) -> None:
        get_preset(self.preset)  # raises naming the known presets
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {', '.join(HASH_ALGORITHMS)}; got {self.hash_algorithm!r}")
        if self.block_hash_format not in ("int64", "digest"):
            raise ValueError(f"block_hash_format must be 'int64' or 'digest'; got {self.block_hash_format!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535; got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535; got {self.metrics_port}")
        for name in ("block_size", "num_blocks", "kv_cache_memory", "max_model_len", "event_max_batches",
                     "event_max_bytes", "max_subscriber_lag", "max_consumers", "max_num_requests", "max_step_ops",
                     "snapshot_part_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if not self.stalled_write_timeout_s > 0:
            raise ValueError(f"stalled_write_timeout_s must be > 0 seconds; got {self.stalled_write_timeout_s}")
        if not self.grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0 seconds; got {self.grace_seconds}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"max_message_bytes must be >= 4096 bytes; got {self.max_message_bytes}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        # issue 6: limits and request lifetime
        for name in ("max_step_tokens", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.request_idle_timeout_s is not None and not 0 < self.request_idle_timeout_s < float("inf"):
            raise ValueError(
                f"request_idle_timeout_s must be a finite number > 0 seconds (or unset: off); got {self.request_idle_timeout_s}"
            )
        if not self.consumer_idle_timeout_s > 0:
            raise ValueError(f"consumer_idle_timeout_s must be > 0 seconds; got {self.consumer_idle_timeout_s}")
        # issue 15: bounded cost
        if self.max_snapshot_cuts < 1:
            raise ValueError(f"max_snapshot_cuts must be >= 1; got {self.max_snapshot_cuts}")
        if self.max_waiting_tokens < 0:
            raise ValueError(f"max_waiting_tokens must be >= 0 (0: no bound); got {self.max_waiting_tokens}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "keepalive_min_client_interval_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0 seconds; got {value}")
        # issue 7: ZMQ publisher
        if self.zmq_replay_endpoint is not None and self.zmq_endpoint is None:
            raise ValueError("zmq_replay_endpoint needs zmq_endpoint (replays answer what the PUB socket published)")
        for name in ("zmq_endpoint", "zmq_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and "://" not in value:
                raise ValueError(f"{name} must be a ZMQ endpoint such as tcp://*:5557 or ipc:///path; got {value!r}")
        if self.zmq_hwm < 1:
            raise ValueError(f"zmq_hwm must be >= 1 messages; got {self.zmq_hwm}")
        # ZMQ has no authentication: a non-loopback bind needs allow_insecure_bind (refused here,
        # before anything is allocated; the start lines carry the warning).
        check_endpoint_exposure(
            self.zmq_endpoint, self.zmq_replay_endpoint, allow_insecure_bind=self.allow_insecure_bind
        )
        # issue 7: NATS JetStream sink
        check_nats_settings(self)
        check_auth_settings(  # issue 6: TLS files go together
            tls_cert_file=self.tls_cert_file, tls_key_file=self.tls_key_file, tls_client_ca_file=self.tls_client_ca_file
        )


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(value: str | int) -> int:
    """Parse a byte count: an int, or a number with a unit ("512MiB", "1.5GB", "1g").

    Raises:
        ValueError: not a byte count.
    """
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {value!r} (e.g. 1073741824, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _coerce(name: str, value: Any) -> Any:
    """``value`` (from TOML, the environment or a flag) as the type of setting ``name``.

    Raises:
        ValueError: it is not one (the message names the expected type).
    """
    target = str({f.name: f.type for f in fields(ServerConfig)}[name])
    if value is None or value == "":
        if "None" in target:
            return None
        raise ValueError("must be set")
    if name in ("kv_cache_memory", "event_max_bytes", "max_message_bytes", "nats_max_bytes"):
        return parse_bytes(value)
    if target == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r} (true/false, 1/0, yes/no, on/off)")
    if "int" in target:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"not an integer: {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"not an integer: {value!r}") from None
    if "float" in target:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"not a number: {value!r}") from None
    return str(value)


def _coerced(name: str, value: Any, source: str) -> Any:
    try:
        return _coerce(name, value)
    except ValueError as e:
        raise ValueError(f"{source}: {name}: {e}") from None


def load_config(
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Build a :class:`ServerConfig` from a TOML file, ``KVSERVICE_*`` variables and overrides.

    Overrides whose value is None are ignored (flags not given). Precedence: overrides >
    environment > file > defaults. A relative path in the file (``*_file`` settings) is relative
    to the file's directory; in the environment and overrides, to the working directory.

    Raises:
        ValueError: an unknown key (file, environment or override) or a bad value, naming it.
    """
    names = {f.name for f in fields(ServerConfig)}
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{config_file}: not valid TOML: {e}") from None
        data = data.get("kvservice", data)
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ValueError(f"{config_file}: unknown key {key!r}")
            value = _coerced(key, value, str(config_file))
            if key.endswith("_file") and isinstance(value, str) and not os.path.isabs(value):
                # A path in a config file is relative to that file, not to where the server starts.
                value = str(Path(config_file).resolve().parent / value)
            values[key] = value
    environ = os.environ if environ is None else environ
    for env_key, value in environ.items():
        if env_key.startswith("KVSERVICE_"):
            key = env_key[len("KVSERVICE_"):].lower()
            if key in names:
                values[key] = _coerced(key, value, env_key)
    for key, value in overrides.items():
        if key not in names:
            raise ValueError(f"unknown setting {key!r}")
        if value is not None:
            values[key] = _coerced(key, value, f"--{key.replace('_', '-')}")
    return ServerConfig(**values)


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
    health: Any = field(repr=False, default=None)
    snapshots: SnapshotSource | None = field(repr=False, default=None)
    notes: list[str] = field(default_factory=list)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list, repr=False)
    """Async callables run (in reverse order) after the gRPC server stopped: publishers, reapers,
    the metrics endpoint."""
    reaper: RequestReaper | None = field(default=None, repr=False)
    """The request reaper (with ``request_idle_timeout_s``; None without)."""
    zmq_publisher: Any = field(default=None, repr=False)
    """The ZMQ event publisher (``kvservice.server.zmq_publisher.ZmqEventPublisher`` with
    ``zmq_endpoint``; None without)."""
    nats_sink: Any = field(default=None, repr=False)
    """The NATS JetStream sink (``kvservice.server.nats_sink.NatsJetStreamSink`` with ``nats_url``;
    None without)."""
    _stopped: bool = field(default=False, repr=False)

    @property
    def metrics_port(self) -> int | None:
        """The bound port of the Prometheus endpoint (None when metrics are off)."""
        return self.config.metrics_port

    def describe(self) -> str:
        """Two lines: where it listens and what it holds."""
        meta = self.servicer.metadata
        groups = ", ".join(
            f"group {g.group_idx}: {_kind_name(g.kind)} block_size {g.block_size}"
            + (f" window {g.sliding_window}" if g.HasField("sliding_window") else "")
            for g in meta.groups
        )
        return (
            f"kvservice listening on {self.address} (epoch {self.event_log.epoch})\n"
            f"preset {self.config.preset}: {self.config.num_blocks} blocks ({groups}), max_model_len "
            f"{self.config.max_model_len} tokens; hash {meta.hash_algorithm} seed {meta.hash_seed!r}; "
            f"{self.tensors.describe()}"
            + "".join(f"\nnote: {note}" for note in self.notes)
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop gracefully: mark NOT_SERVING, end open streams with UNAVAILABLE naming their last
        seq, then let calls in flight finish for ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_seconds if grace is None else grace
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        self.event_log.close()
        # Let each open stream end with its UNAVAILABLE status before the server cancels calls.
        await self.event_log.wait_drained(max(grace, 1.0))
        await self.server.stop(grace)
        for close in reversed(self.closers):
            try:
                await close()
            except Exception:
                logger.exception("closing %r failed", close)


def _kind_name(kind: int) -> str:
    """A KVCacheSpecKind enum value as its lower-case name."""
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

    return pb.KVCacheSpecKind.Name(kind).removeprefix("KV_CACHE_SPEC_KIND_").lower()


def _resolve_num_blocks(config: ServerConfig, kv_cache_config_groups: Any, device: Any) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = cuda_memory_budget(device, config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
    else:
        if config.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization needs a CUDA device; give kv_cache_memory or num_blocks")
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    return num_blocks_from_budget(kv_cache_config_groups, budget)


async def start_server(config: ServerConfig | None = None, **overrides: Any) -> RunningServer:
    """Build and start a server; the one public start function (the replay starts its embedded
    server through it).

    Args:
        config: the configuration (default: :class:`ServerConfig` defaults).
        **overrides: fields replacing the config's.

    Returns:
        The running server; ``await running.stop()`` to stop it.

    Raises:
        ValueError: a bad setting (naming it).
        kvservice.memory.KVCacheAllocationError: the KV tensors do not fit (bytes asked and
            available in the message).
        RuntimeError: the address cannot be bound.
    """
    config = dataclasses.replace(config or ServerConfig(), **overrides)
    preset = get_preset(config.preset)
    device = resolve_device(config.device)
    groups = preset.kv_cache_groups(config.block_size)
    num_blocks = _resolve_num_blocks(config, groups, device)
    kv_cache_config = KVCacheConfig(num_blocks, groups)
    # A request the pool cannot hold would be registered and then never allocated: a preset's
    # max_model_len is lowered to what fits; an explicit one is kept (the engine refuses longer
    # prompts at registration). Either way the start says so.
    fits = max_tokens_in_pool(kv_cache_config)
    max_model_len = config.max_model_len or preset.max_model_len
    notes = []
    if max_model_len > fits:
        if config.max_model_len is None:
            notes.append(f"max_model_len lowered from the preset's {max_model_len} to {fits} tokens, what the pool holds")
            max_model_len = fits
        else:
            notes.append(
                f"the pool holds one request of at most {fits} tokens, below max_model_len {max_model_len}: "
                "longer prompts are refused"
            )
    config = dataclasses.replace(config, num_blocks=num_blocks, max_model_len=max_model_len)
    tensors = allocate_kv_cache_tensors(kv_cache_config, device)
    medium = "GPU" if device.type == "cuda" else "CPU"
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len,
        prefix_caching=PrefixCachingConfig(config.hash_algorithm, config.hash_seed),
        kv_events=KVEventsConfig(block_hash_format=config.block_hash_format, medium=medium),  # type: ignore[arg-type]
    )
    engine = KVCacheEngine(manager, EngineLimits(max_num_requests=config.max_num_requests, max_waiting_tokens=config.max_waiting_tokens or None))
    meta = manager.get_kv_cache_group_metadata()
    event_log = EventLog(
        manager.num_groups,
        [g.kind for g in meta.groups],
        [g.sliding_window for g in meta.groups],
        EventLogConfig(
            max_batches=config.event_max_batches,
            max_bytes=config.event_max_bytes,
            max_subscriber_lag=config.max_subscriber_lag,
            max_consumers=config.max_consumers,
            snapshot_part_tokens=config.snapshot_part_tokens,
            stalled_write_timeout_s=config.stalled_write_timeout_s,
            consumer_idle_timeout_s=config.consumer_idle_timeout_s,
            max_streams=config.max_streams,
            # An answer always fits what this server may send and what any gRPC client accepts.
            max_take_bytes=min(4 * 1024 * 1024, config.max_message_bytes - 1024),
        ),
        data_parallel_rank=config.data_parallel_rank,
    )
    # First listener: the mirror a snapshot is cut from is up to date when any other listener runs.
    snapshots = SnapshotSource.attach(
        event_log, part_tokens=config.snapshot_part_tokens, max_concurrent_cuts=config.max_snapshot_cuts
    )
    metadata = build_metadata_response(
        engine,
        epoch=event_log.epoch,
        device=str(device),
        dtypes=[tensors.dtype(g) and str(tensors.dtype(g)).removeprefix("torch.") for g in range(manager.num_groups)],
        preset=config.preset,
        data_parallel_rank=config.data_parallel_rank,
    )
    servicer = KVCacheServicer(
        engine, event_log, metadata, max_step_ops=config.max_step_ops, max_message_bytes=config.max_message_bytes,
        check_invariants=config.check_invariants, max_step_tokens=config.max_step_tokens, snapshots=snapshots,
    )
    closers: list[Callable[[], Awaitable[None]]] = [snapshots.close]
    interceptors: list[grpc.aio.ServerInterceptor] = []
    # -- auth: interceptor and credentials --
    auth = build_auth(
        host=config.host, tls_cert_file=config.tls_cert_file, tls_key_file=config.tls_key_file,
        tls_client_ca_file=config.tls_client_ca_file, auth_tokens_file=config.auth_tokens_file,
        allow_insecure_bind=config.allow_insecure_bind,
    )
    notes.extend(auth.notes)
    if auth.interceptor is not None:
        interceptors.append(auth.interceptor)
    # -- metrics --
    if config.metrics_port is not None:
        from kvservice.server.metrics import ServerMetrics

        metrics = ServerMetrics(engine, event_log, snapshots=snapshots)
        # First, so calls that another interceptor refuses (UNAUTHENTICATED ...) are counted too.
        interceptors.insert(0, metrics.interceptor)
        metrics_port = metrics.start_http_server(config.metrics_host, config.metrics_port)
        closers.append(metrics.close)
        config = dataclasses.replace(config, metrics_port=metrics_port)
        metrics_host = f"[{config.metrics_host}]" if ":" in config.metrics_host else config.metrics_host
        notes.append(f"Prometheus metrics on http://{metrics_host}:{metrics_port}/metrics")
        if not is_loopback_host(config.metrics_host):
            notes.append(f"metrics on non-loopback {config.metrics_host}: plain HTTP, no auth (usage and counters only)")
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # HTTP/2 keepalive: find connections that died without a word, accept clients' pings.
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),  # what grpcio 1.85 applies
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.keepalive_min_client_interval_s * 1000)),
    ]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers((servicer.generic_handler(),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server)
    host = config.host
    bind = f"[{host}]:{config.port}" if ":" in host and not host.startswith("[") else f"{host}:{config.port}"
    server_credentials: grpc.ServerCredentials | None = None
    # -- auth: server credentials --
    server_credentials = auth.credentials
    try:
        if server_credentials is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, server_credentials)
        if port == 0:
            raise RuntimeError(f"cannot bind {bind}")
        await server.start()
    except BaseException:
        for close in reversed(closers):  # what started before the bind (the metrics endpoint)
            await close()
        raise
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = bind.rsplit(":", 1)[0] + f":{port}"
    config = dataclasses.replace(config, port=port)
    running = RunningServer(
        address, port, server, engine, event_log, servicer, tensors, config, health, snapshots=snapshots,
        notes=notes, closers=closers,
    )
    # -- background tasks started after bind: reapers --
    if config.request_idle_timeout_s is not None:
        running.reaper = RequestReaper(engine, servicer.publish, config.request_idle_timeout_s)
        running.reaper.start()
        closers.append(running.reaper.stop)
        notes.append(f"requests not called for {config.request_idle_timeout_s:g} s are freed (request_idle_timeout_s)")
    # -- event publishers: ZMQ --
    if config.zmq_endpoint is not None:
        from kvservice.server.zmq_publisher import ZmqEventPublisher

        try:
            running.zmq_publisher = await ZmqEventPublisher.start(
                event_log, endpoint=config.zmq_endpoint, replay_endpoint=config.zmq_replay_endpoint,
                topic=config.zmq_topic or "", hwm=config.zmq_hwm, allow_insecure_bind=config.allow_insecure_bind,
            )
        except BaseException:
            await running.stop(0)
            raise
        closers.append(running.zmq_publisher.close)
        notes.append(running.zmq_publisher.describe())
        notes.extend(running.zmq_publisher.notes)
    # -- event publishers: NATS JetStream --
    if config.nats_url is not None:
        try:
            running.nats_sink = await start_nats_sink(event_log, config)
        except BaseException:
            await running.stop(0)
            raise
        closers.append(running.nats_sink.close)
        running.config = config = dataclasses.replace(config, nats_instance=running.nats_sink.config.instance)
        notes.append(running.nats_sink.describe())
    return running


async def run_server(config: ServerConfig, *, ready: Any = None) -> None:
    """Start a server, print where it listens and what it holds, and serve until SIGTERM/SIGINT;
    then stop gracefully (open streams end with UNAVAILABLE naming their last seq)."""
    running = await start_server(config)
    # Everything built so far (the pool's blocks, the imported modules) lives as long as the
    # process: keep it out of the cycle collector's full passes, which would otherwise hold the
    # loop for about 300 ms each here (a process-wide choice, so only the serving process makes it).
    gc.collect()
    gc.freeze()
    print(running.describe(), flush=True)
    profile_path = os.environ.get("KVSERVICE_PROFILE")  # a cProfile dump of the serving loop, for benchmarks
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(running)
    await stop.wait()
    print("kvservice: stopping (graceful)", flush=True)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    await running.stop()
