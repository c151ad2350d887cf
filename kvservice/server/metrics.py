"""Prometheus metrics of one server, served over HTTP (``metrics_port``; off by default).

Every server has its own ``CollectorRegistry`` (several servers may run in one process) and its own
HTTP endpoint (prometheus_client's server, on a daemon thread), stopped with the server.

Costs on the serving path are kept to what cannot be read later:

* State and the engine's own counters are read at scrape time by :class:`_StateCollector`, on the
  server's event loop (between two handlers, so a scrape never sees a call half done): pool
  blocks, usage, requests, prefix-cache queries and hits, failed allocations, freed requests,
  evictions, the event log's head, retention and subscribers.
* An event-log listener counts events by type, once per batch.
* An interceptor times every RPC and records its final status code (aborts, unexpected errors,
  cancellations and deadlines included; a stream when it ends).

Names follow vLLM's where vLLM has one (``prefix_cache_queries``, ``prefix_cache_hits``,
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``), with the
``kvservice_`` prefix; units are in the names (tokens, blocks, batches, bytes, seconds).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvservice.core.engine import KVCacheEngine
from kvservice.server.build_info import build_info
from kvservice.server.event_log import EventLog, LogEntry
from kvservice.server.observability import CallInterceptor
from kvservice.server.sinks import EventSink
from kvservice.server.snapshot import SnapshotSource
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored

logger = logging.getLogger(__name__)

__all__ = ["RPC_LATENCY_BUCKETS_S", "MetricsInterceptor", "ServerMetrics"]

RPC_LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds of the RPC latency histogram's buckets, in seconds (+Inf is added)."""

SCRAPE_TIMEOUT_S = 10.0
"""How long a scrape waits for the event loop to take its sample (a long Step delays it)."""

_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


@dataclass(frozen=True, slots=True)
class _Sample:
    """The state read in one go on the event loop (units in the names)."""

    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks_per_group: tuple[int, ...]
    num_requests_running: int
    num_requests_waiting: int
    prefix_cache_requests: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_failed_allocations: int
    num_freed_requests: int
    num_evicted_blocks: int
    head_seq: int
    oldest_seq: int
    num_retained_batches: int
    retained_bytes: int
    num_snapshot_cuts: int
    num_subscribers: int
    max_subscriber_lag_batches: int
    num_consumers: int
    num_events_by_type: tuple[tuple[str, int], ...]


class ServerMetrics:
    """The metrics of one server: a registry, the RPC interceptor, the event listener, the endpoint.

    Args:
        engine: the server's engine (pool, requests, prefix-cache counters).
        event_log: the server's event log (a listener is added to it).
        loop: the loop the server runs on (default: the running loop); scrapes read state there.
        snapshots: the server's snapshot source (for ``kvservice_snapshot_cuts``; None: 0).

    Attributes:
        registry: this server's ``CollectorRegistry`` (what ``/metrics`` serves).
        interceptor: the ``grpc.aio.ServerInterceptor`` that times RPCs (put it first).
        port: the bound port of the HTTP endpoint (None until :meth:`start_http_server`).

    Raises:
        RuntimeError: no ``loop`` given and none running.
    """

    def __init__(
        self,
        engine: KVCacheEngine,
        event_log: EventLog,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        snapshots: SnapshotSource | None = None,
    ) -> None:
        self.engine = engine
        self.event_log = event_log
        self.snapshots = snapshots
        self._loop = loop or asyncio.get_running_loop()
        self.registry = CollectorRegistry()
        self.rpc_calls = Counter(
            "kvservice_rpc_calls",
            "RPCs handled, by service, method and final status code.",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "kvservice_rpc_duration_seconds",
            "RPC handling time in seconds, by service, method and final status code (a stream: its lifetime).",
            ["service", "method", "code"],
            buckets=RPC_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(self))
        self.sinks: Mapping[str, EventSink] = {}
        """The server's event sinks by kind (set once they started; read at scrape)."""
        self.registry.register(_SinkCollector(self))
        self.data_plane: Any = None
        """The server's :class:`kvservice.server.data_plane.DataPlane` (None: no data-plane metrics)."""
        self.registry.register(_DataPlaneCollector(self))
        Info(
            "kvservice_build", "The server's version and build (labels; the value is 1).", registry=self.registry
        ).info(build_info())
        ProcessCollector(registry=self.registry)  # process_*: CPU seconds, resident memory, open fds
        GCCollector(registry=self.registry)  # python_gc_*
        self.interceptor = MetricsInterceptor(self.record_rpc)
        self._num_events_by_type = dict.fromkeys(_EVENT_TYPES, 0)
        event_log.add_listener(self._on_batch)
        self._rpc_children: dict[tuple[str, str, grpc.StatusCode], tuple[Any, Any]] = {}
        self._httpd: Any = None
        self._thread: Any = None
        self.port: int | None = None

    # -- recording ----------------------------------------------------------------------------

    def _on_batch(self, entry: LogEntry) -> None:
        counts = self._num_events_by_type
        for event in entry.events:
            counts[type(event)] += 1

    def record_rpc(self, service: str, method: str, code: grpc.StatusCode, duration_s: float) -> None:
        """Count one finished RPC and observe its duration (seconds)."""
        key = (service, method, code)
        children = self._rpc_children.get(key)
        if children is None:
            labels = (service, method, code.name)
            children = self._rpc_children[key] = (self.rpc_calls.labels(*labels), self.rpc_duration.labels(*labels))
        children[0].inc()
        children[1].observe(duration_s)

    # -- state, read at scrape time --------------------------------------------------------------

    def sample(self) -> _Sample:
        """Read the engine's and the event log's state (call on the server's loop)."""
        engine = self.engine
        pool = engine.manager.block_pool
        stats = engine.manager.prefix_cache_stats
        log = self.event_log
        log.settle()  # a batch appended in this turn: counted (our listener) and retention applied first
        lags = log.subscriber_lags()
        return _Sample(
            kv_cache_usage=pool.get_usage(),
            num_blocks=pool.num_blocks - 1,
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks_per_group=tuple(len(m) for m in pool.cached_block_hash_to_block),
            num_requests_running=len(engine.running),
            num_requests_waiting=len(engine.requests) - len(engine.running),
            prefix_cache_requests=stats.requests,
            prefix_cache_queries_tokens=stats.queries,
            prefix_cache_hits_tokens=stats.hits,
            num_failed_allocations=engine.num_failed_allocations,
            num_freed_requests=engine.num_freed_requests,
            num_evicted_blocks=pool.num_evictions,
            head_seq=log.head_seq,
            oldest_seq=log.oldest_seq,
            num_retained_batches=log.num_retained_batches,
            retained_bytes=log.retained_bytes,
            num_snapshot_cuts=self.snapshots.num_cuts if self.snapshots is not None else 0,
            num_subscribers=log.num_subscribers,
            max_subscriber_lag_batches=max(lags, default=0),
            num_consumers=log.num_consumers,
            num_events_by_type=tuple((cls.__name__, n) for cls, n in self._num_events_by_type.items()),
        )

    def sample_on_loop(self, timeout_s: float = SCRAPE_TIMEOUT_S) -> _Sample:
        """:meth:`sample`, taken on the server's loop from any thread (directly when on it).

        Raises:
            TimeoutError: the loop did not take the sample within ``timeout_s`` seconds.
            RuntimeError: the loop is closed.
        """
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return self.sample()
        future: concurrent.futures.Future[_Sample] = concurrent.futures.Future()

        def take() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.sample())
                except Exception as exc:
                    future.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the server's event loop took no metrics sample within {timeout_s} seconds") from None

    # -- the HTTP endpoint ----------------------------------------------------------------------

    def start_http_server(self, host: str, port: int) -> int:
        """Serve ``/metrics`` (any path, in fact) on ``host:port``; port 0 picks a free one.

        Returns:
            The bound port (also :attr:`port`).

        Raises:
            RuntimeError: the address cannot be bound (the message names it and why).
        """
        assert self._httpd is None, "the metrics endpoint is started already"
        try:
            self._httpd, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"cannot bind the metrics endpoint {host}:{port}: {e.strerror or e}") from None
        self.port = int(self._httpd.server_port)
        return self.port

    async def close(self) -> None:
        """Stop the HTTP endpoint (a scrape in progress may still finish)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        await asyncio.to_thread(httpd.shutdown)
        httpd.server_close()


SINK_METRICS: tuple[tuple[str, str, str, str], ...] = (
    (
        "kvservice_event_sink_published",
        "counter",
        "num_published",
        "Event batches a sink published (NATS: acked as stored), by sink.",
    ),
    (
        "kvservice_event_sink_dropped",
        "counter",
        "num_dropped",
        "Event batches a sink dropped (watchers see the seq gap and resync), by sink.",
    ),
    ("kvservice_event_sink_pending", "gauge", "num_pending", "Event batches queued in a sink, not yet published."),
    ("kvservice_event_sink_retries", "counter", "num_retries", "Publishes that failed and were retried, by sink."),
    ("kvservice_event_sink_reconnects", "counter", "num_reconnects", "Reconnects of a sink's client, by sink."),
    ("kvservice_event_sink_replays", "counter", "num_replays", "Replay requests answered (ZMQ), by sink."),
)
"""(metric, type, the counter's name in ``EventSink.counters()``, help): a sink that does not count
it has no sample."""


class _SinkCollector(Collector):
    """The event sinks' counters (``kvservice.server.sinks``), read when scraped."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """One family per :data:`SINK_METRICS` row, a sample per sink that counts it."""
        counters = {name: sink.counters() for name, sink in self._metrics.sinks.items()}
        for name, kind, counter, doc in SINK_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["sink"])
            for sink_name, values in counters.items():
                value = values.get(counter)
                if value is not None:
                    family.add_metric([sink_name], value)
            yield family


class _DataPlaneCollector(Collector):
    """The data plane's streams and bytes (``kvservice.server.data_plane``), read when scraped
    (plain integers the loop updates; a scrape may see one chunk's update late)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """The data-plane families (none when the server has no data plane)."""
        dp = self._metrics.data_plane
        if dp is None:
            return
        yield GaugeMetricFamily(
            "kvservice_data_streams_open", "WriteBlocks and ReadBlocks streams open.", value=dp.num_open_streams
        )
        yield GaugeMetricFamily(
            "kvservice_data_buffered_bytes",
            "Bytes the open data streams hold in the server (blocks being assembled, chunks being copied or sent).",
            value=dp.buffered_bytes,
        )
        yield CounterMetricFamily(
            "kvservice_data_streams_refused",
            "Data streams refused at max_data_streams (RESOURCE_EXHAUSTED).",
            value=dp.num_streams_refused,
        )
        cut = CounterMetricFamily(
            "kvservice_data_streams_cut",
            "Data streams cut after stalled_write_timeout_s (DEADLINE_EXCEEDED), by direction: read (a chunk not "
            "taken), write (no next chunk).",
            labels=["direction"],
        )
        for direction, n in sorted(dp.num_streams_cut.items()):
            cut.add_metric([direction], n)
        yield cut
        for name, doc, value in (
            ("kvservice_data_bytes_written", "Block bytes written by WriteBlocks.", dp.num_bytes_written),
            ("kvservice_data_bytes_read", "Block bytes sent by ReadBlocks.", dp.num_bytes_read),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class _StateCollector(Collector):
    """Gauges and counters read from the server's state when scraped (nothing per operation)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """The families of one sample (see the README's "Metrics" for each name)."""
        s = self._metrics.sample_on_loop()
        gauges = (
            ("kvservice_num_requests_running", "Requests admitted (holding blocks).", s.num_requests_running),
            ("kvservice_num_requests_waiting", "Requests registered, not yet admitted.", s.num_requests_waiting),
            ("kvservice_kv_cache_usage_perc", "Fraction of the pool's blocks in use (0..1).", s.kv_cache_usage),
            ("kvservice_kv_cache_num_blocks", "Blocks in the pool, null block excluded.", s.num_blocks),
            ("kvservice_kv_cache_num_free_blocks", "Free blocks (cached but unreferenced too).", s.num_free_blocks),
            ("kvservice_event_log_head_seq", "Seq of the newest batch (0 when none).", s.head_seq),
            ("kvservice_event_log_oldest_seq", "Seq of the oldest batch retained (head + 1 when none).", s.oldest_seq),
            ("kvservice_event_log_retained_batches", "Batches retained for replay.", s.num_retained_batches),
            (
                "kvservice_event_log_retained_bytes",
                "Bytes the retained batches hold (msgpack, cached encodings, per-batch overhead).",
                s.retained_bytes,
            ),
            ("kvservice_event_stream_subscribers", "Open StreamEvents subscriptions.", s.num_subscribers),
            (
                "kvservice_event_stream_max_lag_batches",
                "Batches the furthest-behind StreamEvents subscriber is behind the head (0 when none).",
                s.max_subscriber_lag_batches,
            ),
            ("kvservice_event_consumers", "Named TakeEvents consumers tracked.", s.num_consumers),
        )
        counters = (
            ("kvservice_prefix_cache_requests", "Prefix-cache lookups (requests).", s.prefix_cache_requests),
            (
                "kvservice_prefix_cache_queries",
                "Prefix-cache queries, in tokens looked up.",
                s.prefix_cache_queries_tokens,
            ),
            ("kvservice_prefix_cache_hits", "Prefix-cache hits, in tokens found cached.", s.prefix_cache_hits_tokens),
            (
                "kvservice_prefix_cache_evictions",
                "Cached blocks evicted to make room for new ones.",
                s.num_evicted_blocks,
            ),
            (
                "kvservice_allocation_failures",
                "AllocateSlots answered allocated=false (too few free blocks).",
                s.num_failed_allocations,
            ),
            ("kvservice_requests_freed", "Requests freed.", s.num_freed_requests),
            ("kvservice_kv_event_batches", "Event batches appended to the event log.", s.head_seq),
            (
                "kvservice_snapshot_cuts",
                "Snapshots cut (callers asking at one head share one cut).",
                s.num_snapshot_cuts,
            ),
        )
        for name, doc, v in gauges:
            yield GaugeMetricFamily(name, doc, value=v)
        for name, doc, v in counters:
            yield CounterMetricFamily(name, doc, value=v)
        cached = GaugeMetricFamily(
            "kvservice_kv_cache_num_cached_blocks",
            "Block hashes present in the prefix cache, per group.",
            labels=["group_idx"],
        )
        for g, n in enumerate(s.num_cached_blocks_per_group):
            cached.add_metric([str(g)], n)
        yield cached
        events = CounterMetricFamily(
            "kvservice_kv_events", "KV events appended to the event log, by type.", labels=["type"]
        )
        for event_type, n in s.num_events_by_type:
            events.add_metric([event_type], n)
        yield events


RecordRpc = Callable[[str, str, grpc.StatusCode, float], None]


class MetricsInterceptor(CallInterceptor):
    """Times every RPC and records its final status code with ``record(service, method, code, seconds)``.

    The code is the one the client gets: OK, the code of ``context.abort`` or ``context.set_code``,
    UNKNOWN for an unexpected exception, CANCELLED (DEADLINE_EXCEEDED once the deadline passed) for
    a call cancelled under the handler. A streaming call is recorded when its stream ends. Calls
    to unknown methods (UNIMPLEMENTED, answered by gRPC itself) are not recorded.

    Args:
        record: called once per finished call, on the server's loop.
        max_methods: distinct method paths labelled by name; calls to further paths (say, made-up
            names refused by an auth interceptor before gRPC finds them unknown) are labelled
            service "" and method "other", so a client cannot grow the label set without bound.
    """

    def __init__(self, record: RecordRpc, *, max_methods: int = 256) -> None:
        super().__init__(max_methods=max_methods)
        self._record = record
        self._clock = time.perf_counter

    def begin(self, path: str | None, request: Any) -> Any:
        """(service, method, start time) of a call (``path`` None: beyond ``max_methods``)."""
        service, _, method = path.rpartition("/") if path is not None else ("", "", "other")
        return service, method, self._clock()

    def end(self, state: Any, code: grpc.StatusCode) -> None:
        """Record the call."""
        service, method, start = state
        self._record(service, method, code, self._clock() - start)
