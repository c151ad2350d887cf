"""Streams cannot hold the server (issue 15): a stream that never reads is cut by its write timeout
even when it is not behind; a connection that dies silently is found by HTTP/2 keepalive and the
client's EventWatcher resumes on a new one.

A real server on port 0, the generated client; the dead peer is a TCP proxy in the test that stops
forwarding on the connections it holds (as a NAT or a load balancer that dropped the flow). No
test waits on the clock: each waits on the thing, with a generous bound.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice_client.client import AsyncKVCacheClient, KVServiceError
from kvservice_client.watcher import EventWatcher, RetryPolicy
from tests.service.helpers import next_batch, wait_until
from tests.service.test_stream_resume import MAX_STALL_BATCHES, STALL_TOKENS, publish

pytestmark = pytest.mark.timeout(120)


async def test_a_stream_that_never_reads_is_cut_by_its_write_timeout_though_not_behind(start_kv_server, connect):
    # max_subscriber_lag (10,000) is never reached: only the write timeout can end this stream.
    running = await start_kv_server(
        num_blocks=STALL_TOKENS // 4 + 2, max_model_len=STALL_TOKENS, stalled_write_timeout_s=2.0
    )
    scheduler = await connect(running)
    stalled_client = await connect(running, options=[("grpc.http2.bdp_probe", 0)])
    stalled = stalled_client.stream_events(start_seq=1)
    await publish(scheduler, 0, STALL_TOKENS)
    assert (await next_batch(stalled)).seq == 1
    log = running.event_log
    (sub,) = log._subscribers
    for i in range(1, MAX_STALL_BATCHES):  # until a write blocks (the client's window is full)
        await publish(scheduler, i, STALL_TOKENS)
        if sub.num_write_timeouts or not log.num_subscribers:
            break
    await wait_until(lambda: log.num_subscribers == 0, timeout=60)
    assert sub.num_write_timeouts == 1 and running.servicer.num_stream_write_timeouts == 1
    assert running.event_log.head_seq - sub.last_seq < running.config.events.max_subscriber_lag  # never behind
    assert not sub.ended.done() or sub.ended.cancelled()  # not ended for lag: cut by the timer
    # The call really ended: reading on, the client gets what was in flight, then the status.
    with pytest.raises(KVServiceError) as err:
        while True:
            await next_batch(stalled)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stream cut: a write took over stalled_write_timeout_s 2 s (the client is not reading)" in str(err.value)


class FreezingProxy:
    """A TCP proxy to ``target``; :meth:`freeze` stops forwarding on every connection open now
    (they stay open, silent both ways); later connections forward normally."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen: list[asyncio.Event] = []  # per connection: set = frozen
        self.num_connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def freeze(self) -> None:
        for frozen in self.frozen:
            frozen.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        frozen = asyncio.Event()
        self.frozen.append(frozen)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while not frozen.is_set():
                data = await src.read(65536)
                if not data or frozen.is_set():
                    break
                dst.write(data)
                await dst.drain()
            if frozen.is_set():
                await asyncio.Event().wait()  # silent forever (until cancelled at close)
            dst.close()

        self._pumps = getattr(self, "_pumps", [])
        self._pumps += [asyncio.create_task(pump(reader, up_writer)), asyncio.create_task(pump(up_reader, writer))]

    async def close(self) -> None:
        for task in getattr(self, "_pumps", []):
            task.cancel()
        if self.server is not None:
            self.server.close()


async def test_keepalive_finds_a_silently_dead_connection_and_the_watcher_resumes(start_kv_server, connect):
    running = await start_kv_server(keepalive_min_client_interval_s=0.1)
    scheduler = await connect(running)
    await publish(scheduler, 0)
    proxy = FreezingProxy(running.port)
    address = await proxy.start()
    # Ping every 0.5 s while the stream is open; a ping unanswered for 2 s closes the connection.
    watched_client = AsyncKVCacheClient(
        address,
        options=[
            ("grpc.keepalive_time_ms", 500),
            ("grpc.keepalive_timeout_ms", 2000),
            ("grpc.http2.ping_timeout_ms", 2000),
        ],
    )
    try:
        async with EventWatcher(watched_client, retry=RetryPolicy(max_retries=None)) as watcher:
            batches = aiter(watcher)
            first = await asyncio.wait_for(anext(batches), 30)
            assert first.snapshot and first.seq == 1
            await publish(scheduler, 1)
            assert (await asyncio.wait_for(anext(batches), 30)).seq == 2
            proxy.freeze()  # the path dies without a FIN or RST
            await publish(scheduler, 2)
            await publish(scheduler, 3)
            # Keepalive ends the dead call (UNAVAILABLE); the watcher reconnects and resumes at 3.
            assert [(await asyncio.wait_for(anext(batches), 60)).seq for _ in range(2)] == [3, 4]
            assert watcher.stats.num_reconnects >= 1 and watcher.stats.num_resyncs == 0
            assert proxy.num_connections >= 2  # one more if a ping was late under load
    finally:
        await watched_client.close()
        await proxy.close()


def test_a_client_channel_has_keepalive_unless_its_options_say_otherwise():
    from kvservice_client.client import DEFAULT_KEEPALIVE_OPTIONS, _channel_options

    assert set(DEFAULT_KEEPALIVE_OPTIONS) <= set(_channel_options(None))
    assert dict(DEFAULT_KEEPALIVE_OPTIONS)["grpc.keepalive_time_ms"] == 30_000
    mine = dict(_channel_options([("grpc.keepalive_time_ms", 500)]))
    assert mine["grpc.keepalive_time_ms"] == 500 and mine["grpc.http2.ping_timeout_ms"] == 10_000
