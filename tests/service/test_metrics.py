"""Prometheus metrics (``metrics_port``): exact values after a known sequence of calls, scraped over HTTP.

The server is the small test server (block size 4, 15 usable blocks). Block ids follow the free
queue: never-used blocks in id order, a freed request's uncached blocks back at the head and its
cached ones at the tail, deepest first.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.server.app import load_config
from kvservice.server.event_log import ENTRY_OVERHEAD_BYTES
from kvservice.server.metrics import MetricsInterceptor
from kvservice_client.client import KVServiceError
from tests.service.helpers import next_batch, wait_until

pytestmark = pytest.mark.timeout(30)

SERVICE = "kvservice.v1.KVCacheService"
A = list(range(1, 17)) + [100, 101, 102]  # 19 tokens: 4 full blocks + 3 tokens
B = list(range(1, 17)) + [200, 201]  # 18 tokens: shares A's 4 full blocks (16 tokens)
C = list(range(300, 348))  # 48 tokens: 12 blocks, more than the 9 free while A and B run


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    """GET /metrics (on a thread: the server's loop must stay free) as {(sample name, labels): value}."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()

    text = await asyncio.to_thread(get)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def by_method_and_code(samples: Samples, name: str, **extra: str) -> dict[tuple[str, str], float]:
    """{(method, code): value} of an RPC metric's samples for the KV service."""
    out = {}
    for (sample, labels), v in samples.items():
        labels = dict(labels)
        if sample != name or labels.pop("service", None) != SERVICE:
            continue
        if all(labels.pop(k) == x for k, x in extra.items()):
            out[(labels["method"], labels["code"])] = v
    return out


async def test_metrics_after_a_known_sequence(start_kv_server, connect):
    running = await start_kv_server(metrics_port=0)
    assert running.metrics_port not in (None, 0) and running.config.metrics.port == running.metrics_port
    scheduler, watcher = await connect(running), await connect(running)

    assert (await scheduler.get_computed_blocks("a", A)).num_computed_tokens == 0
    assert list((await scheduler.allocate_slots("a", len(A))).new_block_ids[0].block_ids) == [1, 2, 3, 4, 5]  # seq 1
    assert (await scheduler.get_computed_blocks("b", B)).num_computed_tokens == 16
    assert list((await scheduler.allocate_slots("b", len(B))).new_block_ids[0].block_ids) == [6]
    assert (await scheduler.get_computed_blocks("c", C)).num_computed_tokens == 0
    assert not (await scheduler.allocate_slots("c", len(C))).allocated  # 12 blocks needed, 9 free
    with pytest.raises(KVServiceError) as err:
        await scheduler.free("nobody")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    await scheduler.free("a")
    await scheduler.free("b")
    # Free queue now [6, 5, 7..15, 4, 3, 2, 1]: C takes 12 blocks and evicts cached block 4 (seq 2).
    admitted = await scheduler.allocate_slots("c", len(C))
    assert list(admitted.new_block_ids[0].block_ids) == [6, 5, *range(7, 16), 4]

    mid = await scrape(running.metrics_port)
    assert value(mid, "kvservice_num_requests_running") == 1
    assert value(mid, "kvservice_num_requests_waiting") == 0
    assert value(mid, "kvservice_kv_cache_num_blocks") == 15
    assert value(mid, "kvservice_kv_cache_num_free_blocks") == 3
    assert value(mid, "kvservice_kv_cache_usage_perc") == 1.0 - 3 / 15
    assert value(mid, "kvservice_kv_cache_num_cached_blocks", group_idx="0") == 3 + 12  # A's first 3 + C's 12

    await scheduler.free("c")
    assert (await scheduler.reset_prefix_cache()).reset  # seq 3
    taken = await watcher.take_events("metrics", start_seq=1, payload_format="msgpack")
    assert [b.seq for b in taken.batches] == [1, 2, 3]
    usage = await scheduler.get_usage()
    with pytest.raises(KVServiceError) as err:
        await next_batch(watcher.stream_events(start_seq=5))  # beyond head + 1
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    stream = watcher.stream_events(snapshot=True)
    assert (await next_batch(stream)).seq == 3  # subscribed: open during the scrape

    final = await scrape(running.metrics_port)
    expected_gauges = {
        "kvservice_num_requests_running": 0,
        "kvservice_num_requests_waiting": 0,
        "kvservice_kv_cache_usage_perc": 0.0,
        "kvservice_kv_cache_num_blocks": 15,
        "kvservice_kv_cache_num_free_blocks": 15,
        "kvservice_event_log_head_seq": 3,
        "kvservice_event_log_oldest_seq": 1,
        "kvservice_event_log_retained_batches": 3,
        # msgpack bytes and the per-batch overhead; TakeEvents caches no encoding on the log
        "kvservice_event_log_retained_bytes": sum(len(b.msgpack) for b in taken.batches) + 3 * ENTRY_OVERHEAD_BYTES,
        "kvservice_event_stream_subscribers": 1,
        "kvservice_event_stream_max_lag_batches": 0,
        "kvservice_event_consumers": 1,
        # Counters, read from the engine when scraped.
        "kvservice_prefix_cache_requests_total": 3,
        "kvservice_prefix_cache_queries_total": 19 + 18 + 48,
        "kvservice_prefix_cache_hits_total": 16,
        "kvservice_prefix_cache_evictions_total": 1,
        "kvservice_allocation_failures_total": 1,
        "kvservice_requests_freed_total": 3,
        "kvservice_kv_event_batches_total": 3,
        "kvservice_snapshot_cuts_total": 1,
    }
    assert {name: value(final, name) for name in expected_gauges} == expected_gauges
    assert value(final, "kvservice_kv_cache_num_cached_blocks", group_idx="0") == 0
    # Batch 1: BlockStored (A); batch 2: BlockRemoved (block 4) + BlockStored (C); batch 3: AllBlocksCleared.
    event_types = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    events = {t: value(final, "kvservice_kv_events_total", type=t) for t in event_types}
    assert events == {"BlockStored": 2, "BlockRemoved": 1, "AllBlocksCleared": 1}
    # The metrics agree with GetUsage's counters.
    assert (usage.prefix_cache_queries, usage.prefix_cache_hits) == (85, 16)

    calls = {
        ("GetComputedBlocks", "OK"): 3,
        ("AllocateSlots", "OK"): 4,  # allocated=false is an answer, not an error
        ("Free", "OK"): 3,
        ("Free", "NOT_FOUND"): 1,
        ("ResetPrefixCache", "OK"): 1,
        ("TakeEvents", "OK"): 1,
        ("GetUsage", "OK"): 1,
        ("StreamEvents", "INVALID_ARGUMENT"): 1,
    }
    assert by_method_and_code(final, "kvservice_rpc_calls_total") == calls
    assert by_method_and_code(final, "kvservice_rpc_duration_seconds_count") == calls
    assert by_method_and_code(final, "kvservice_rpc_duration_seconds_bucket", le="+Inf") == calls

    # A stream is recorded when it ends: here the client cancels it.
    await stream.aclose()
    await wait_until(lambda: running.event_log.num_subscribers == 0)
    after = await scrape(running.metrics_port)
    assert value(after, "kvservice_event_stream_subscribers") == 0
    assert by_method_and_code(after, "kvservice_rpc_calls_total") == {**calls, ("StreamEvents", "CANCELLED"): 1}


async def test_subscriber_lag_is_batches_behind_the_head(start_kv_server, connect):
    running = await start_kv_server(metrics_port=0)
    scheduler = await connect(running)
    for i, request_id in enumerate(("x", "y")):
        await scheduler.get_computed_blocks(request_id, [10 * i + t for t in range(1, 5)] + [99])
        await scheduler.allocate_slots(request_id, 5)  # one full block: one batch each
    # A cursor that has delivered nothing yet (its handler not scheduled) is 2 batches behind.
    sub = running.event_log.subscribe(1, 0, None)
    try:
        samples = await scrape(running.metrics_port)
        assert value(samples, "kvservice_event_stream_max_lag_batches") == 2
        assert value(samples, "kvservice_event_stream_subscribers") == 1
    finally:
        running.event_log.unsubscribe(sub)


async def test_metrics_are_off_by_default(start_kv_server):
    before = {t.ident for t in threading.enumerate()}
    running = await start_kv_server()
    assert running.metrics_port is None and running.config.metrics.port is None
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not [name for name in started if "serve_forever" in name], started
    assert not any("metrics" in note for note in running.notes)


async def test_two_servers_keep_their_own_metrics(start_kv_server, connect):
    first, second = await start_kv_server(metrics_port=0), await start_kv_server(metrics_port=0)
    assert first.metrics_port != second.metrics_port
    with pytest.raises(KVServiceError):
        await (await connect(first)).free("nobody")
    one, other = await scrape(first.metrics_port), await scrape(second.metrics_port)
    assert by_method_and_code(one, "kvservice_rpc_calls_total") == {("Free", "NOT_FOUND"): 1}
    assert by_method_and_code(other, "kvservice_rpc_calls_total") == {}


async def test_metrics_settings_are_checked(start_kv_server):
    with pytest.raises(ValueError, match=r"metrics_port must be in 0\.\.65535; got 70000"):
        load_config(metrics_port=70000)
    config = load_config(environ={"KVSERVICE_METRICS_PORT": "9400", "KVSERVICE_METRICS_HOST": "0.0.0.0"})
    assert (config.metrics.port, config.metrics.host) == (9400, "0.0.0.0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot bind the metrics endpoint 127.0.0.1:{port}"):
            await start_kv_server(metrics_port=port)


async def test_interceptor_records_the_final_status_code():
    """Every way a call ends, on a bare server with the interceptor alone."""
    recorded: list[tuple[str, str, grpc.StatusCode]] = []
    done = asyncio.Event()
    never = asyncio.Event()

    def record(service: str, method: str, code: grpc.StatusCode, duration_s: float) -> None:
        assert duration_s >= 0
        recorded.append((service, method, code))
        done.set()

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
        if request == b"set_code":
            context.set_code(grpc.StatusCode.ALREADY_EXISTS)
        if request == b"raise":
            raise ValueError("unexpected")
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.write(b"first")
        await never.wait()

    async def generator(request: bytes, context: grpc.aio.ServicerContext):
        yield b"one"
        yield b"two"

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Generator": grpc.unary_stream_rpc_method_handler(generator),
    }
    handlers["Third"] = grpc.unary_unary_rpc_method_handler(unary)
    server = grpc.aio.server(interceptors=[MetricsInterceptor(record, max_methods=3)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary_call = channel.unary_unary("/test.S/Unary")
            assert await unary_call(b"ok") == b"ok"
            for request, code in (
                (b"abort", grpc.StatusCode.PERMISSION_DENIED),
                (b"set_code", grpc.StatusCode.ALREADY_EXISTS),
                (b"raise", grpc.StatusCode.UNKNOWN),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unary_call(request)
                assert err.value.code() == code
            assert [m async for m in channel.unary_stream("/test.S/Generator")(b"")] == [b"one", b"two"]
            call = channel.unary_stream("/test.S/Stream")(b"")
            assert await call.read() == b"first"
            done.clear()
            call.cancel()
            await asyncio.wait_for(done.wait(), 5)
            assert await channel.unary_unary("/test.S/Third")(b"ok") == b"ok"  # a 4th path: "other"
    finally:
        await server.stop(0)
    assert [(m, c) for _, m, c in recorded] == [
        ("Unary", grpc.StatusCode.OK),
        ("Unary", grpc.StatusCode.PERMISSION_DENIED),
        ("Unary", grpc.StatusCode.ALREADY_EXISTS),
        ("Unary", grpc.StatusCode.UNKNOWN),
        ("Generator", grpc.StatusCode.OK),
        ("Stream", grpc.StatusCode.CANCELLED),
        ("other", grpc.StatusCode.OK),
    ]
    assert [s for s, m, _ in recorded if m != "other"] == ["test.S"] * 6
    assert [s for s, m, _ in recorded if m == "other"] == [""]


async def test_metrics_on_a_non_loopback_host_warn_at_start(start_kv_server):
    running = await start_kv_server(metrics_port=0, metrics_host="0.0.0.0")
    assert "metrics on non-loopback 0.0.0.0: plain HTTP, no auth (usage and counters only)" in running.notes
    local = await start_kv_server(metrics_port=0)
    assert not any(note.startswith("metrics on non-loopback") for note in local.notes)


async def test_a_sample_taken_in_the_turn_a_batch_was_appended_counts_it(start_kv_server):
    """The log hands a batch to its listeners (the metrics' event counts among them) and applies
    retention by bytes when it settles, after the callback that appended it: a sample taken
    before then (a scrape's callback can be queued ahead of the settling) settles it first, so its
    event counts, oldest seq and retained batches and bytes all describe the same log."""
    import dataclasses

    from kvservice.server.event_log import ENTRY_OVERHEAD_BYTES
    from kvservice.server.metrics import ServerMetrics

    running = await start_kv_server()
    log, engine = running.event_log, running.engine
    metrics = ServerMetrics(engine, log)
    for i, rid in enumerate(("a", "b")):
        engine.get_computed_blocks(rid, [100 * i + t for t in range(9)])
        assert engine.allocate_slots(rid, 9).allocated
        running.servicer.publish()  # BlockStored of two blocks, sequenced: settled by the next append
        if i == 0:
            first = log.entries_from(1)[0]
            first_bytes = log.retained_bytes
            # The second batch fits while only its overhead is counted, and not once its bytes are.
            log.config = dataclasses.replace(log.config, max_bytes=first_bytes + ENTRY_OVERHEAD_BYTES)
    assert first.num_bytes == first_bytes
    sample = metrics.sample()
    assert (sample.head_seq, sample.oldest_seq, sample.num_retained_batches) == (2, 2, 1)
    assert dict(sample.num_events_by_type)["BlockStored"] == 2
    assert sample.retained_bytes == log.entries_from(2)[0].num_bytes
