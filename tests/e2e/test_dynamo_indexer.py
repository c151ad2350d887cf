"""NVIDIA Dynamo's standalone KV indexer as the referee: it follows kvservice over ZMQ, exactly,
through a kvservice restart, an indexer restart and a retention shorter than the history.

Dynamo (PyPI ``ai-dynamo-runtime``, ``python -m dynamo.indexer``) is a consumer nobody here wrote:
it subscribes to vLLM's ZMQ events, keeps a watermark seq per worker (a seq past it + 1 asks the
replay socket for the gap; a seq at or below it is dropped) and answers prefix-match queries over
HTTP (``POST /register``, ``GET /dump``, ``POST /query``, found by running it). After each
disruption the test waits (polling with a bounded deadline) until Dynamo's view of the worker
(the block hashes its ``/dump`` lists) equals kvservice's cached set, then checks that Dynamo's
overlap for probe prompts equals the hit kvservice's ``GetComputedBlocks`` reports. The worker is
registered once per indexer process (a restarted indexer starts empty and is registered like a
new one); a kvservice restart needs no re-registration.

Dynamo's HTTP server binds 0.0.0.0 (1.6.1 has no option to bind loopback only); the test talks to
it on 127.0.0.1. Skipped, with the reason, where the wheel is not installed (``ai-dynamo-runtime`` has Linux
x86_64 wheels; ``scripts/setup.sh`` installs it there).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import SMALL_SERVER

pytest.importorskip("zmq")
pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime (Dynamo's KV indexer) has no wheel for this platform")

pytestmark = pytest.mark.timeout(240)

WORKER_ID = 7
MODEL = "kvservice-test"
DEADLINE_S = 30.0
"""Longest wait for Dynamo's view to settle after a disruption (polled, not slept)."""
POLL_S = 0.05
BLOCK_SIZE = SMALL_SERVER["block_size"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DynamoIndexer:
    """One ``python -m dynamo.indexer`` process and its HTTP API."""

    def __init__(self, log_path) -> None:
        self.port = _free_port()
        self.log = open(log_path, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        return await asyncio.to_thread(self._call, method, path, body)

    async def wait_healthy(self) -> None:
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while True:
            assert self.proc.poll() is None, f"dynamo.indexer exited with {self.proc.returncode}"
            try:
                if (await self.call("GET", "/health"))[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            assert asyncio.get_running_loop().time() < deadline, "dynamo.indexer never became healthy"
            await asyncio.sleep(POLL_S)

    async def register(self, endpoint: str, replay_endpoint: str) -> None:
        status, body = await self.call(
            "POST",
            "/register",
            {
                "instance_id": WORKER_ID,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
            },
        )
        assert status == 201, body

    async def view(self) -> set[int]:
        """The block hashes Dynamo holds for the worker (its ``/dump``)."""
        status, dump = await self.call("GET", "/dump")
        assert status == 200, dump
        hashes: set[int] = set()
        for indexer in dump.values():
            for event in indexer.get("events", []):
                if event["worker_id"] != WORKER_ID:
                    continue
                stored = event["event"]["data"].get("stored")
                assert stored is not None, event
                hashes.update(block["block_hash"] for block in stored["blocks"])
        return hashes

    async def overlap(self, prompt: list[int]) -> int:
        """Dynamo's overlap for ``prompt`` on the worker, in tokens (0 when none)."""
        status, body = await self.call("POST", "/query", {"token_ids": prompt, "model_name": MODEL})
        if status == 404:  # no indexer yet for the model
            return 0
        assert status == 200, body
        return int(body["scores"].get(str(WORKER_ID), {}).get("0", 0))

    def log_text(self) -> str:
        """What the indexer has logged so far (its warnings say what it dropped)."""
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def indexers(tmp_path):
    started: list[DynamoIndexer] = []

    def start() -> DynamoIndexer:
        indexer = DynamoIndexer(tmp_path / "dynamo-indexer.log")
        started.append(indexer)
        return indexer

    yield start
    for indexer in started:
        if indexer.proc.poll() is None:
            indexer.stop()


def cached(running) -> set[int]:
    (group,) = running.cached_hashes()
    return set(group)


def prompt_of(family: int, turn: int) -> list[int]:
    """Families share their first 8 tokens (2 blocks); turns extend them."""
    return [100 * (family + 1) + t for t in range(8)] + [
        10_000 + 100 * family + 10 * turn + t for t in range(4 + turn % 3 * 4)
    ]


async def admit_and_free(client, request_id: str, prompt: list[int], **fields: Any) -> None:
    """One request's whole life: its lookup, its allocation (cached blocks announced), its free."""
    await client.get_computed_blocks(request_id, prompt, **fields)
    assert (await client.allocate_slots(request_id, len(prompt))).allocated
    await client.free(request_id)


async def workload(client, tag: str, num_requests: int) -> None:
    """Shared prefixes, both report modes, and evictions (16 blocks of 4 tokens)."""
    for i in range(num_requests):
        prompt = prompt_of(i % 4, i // 4)
        mode = "full" if i % 2 else "incremental"
        await admit_and_free(client, f"{tag}{i}", prompt, kv_cache_report_mode=mode)


PROBES = [prompt_of(f, t) + [1] for f in range(5) for t in range(6)]
"""Each probe one token past full blocks, so kvservice's hit (never the whole prompt) can cover
all of its full blocks, as Dynamo's overlap does."""


async def kvservice_hit(client, prompt: list[int]) -> int:
    hit = await client.get_computed_blocks("probe", prompt)
    await client.free("probe")
    return hit.num_computed_tokens


NUDGE_EVERY = 10
"""Polls between two new batches while Dynamo's view differs: a (re)connecting SUB socket misses
what was published before it joined (ZMQ's slow joiner) and learns of a gap only from the next
batch it receives, as it would from a live engine's traffic."""


async def assert_dynamo_equals(indexer: DynamoIndexer, running, client, dropped: frozenset[int] = frozenset()) -> None:
    """Wait until Dynamo's view equals the cached set (less ``dropped``: the blocks Dynamo cannot
    index, see :func:`test_dynamo_drops_token_less_tier_blocks_and_their_children_and_follows_the_rest`),
    then compare overlaps with hits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    polls = 0
    while (view := await indexer.view()) != (expected := cached(running) - dropped):
        assert loop.time() < deadline, (
            f"Dynamo's view never equalled kvservice's cached set: {len(view - expected)} stale, "
            f"{len(expected - view)} missing (log: {indexer.log.name})"
        )
        polls += 1
        if polls % NUDGE_EVERY == 0:
            await admit_and_free(client, f"nudge{polls}", [50_000 + polls] * 8)
        await asyncio.sleep(POLL_S)
    hits = [await kvservice_hit(client, p) for p in PROBES]
    overlaps = [await indexer.overlap(p) for p in PROBES]
    assert overlaps == hits
    assert any(hits), "some probes hit"


class Followed:
    """A kvservice publishing on ZMQ endpoints of its own and a Dynamo indexer registered on them.

    Attributes:
        running: the kvservice server now (a restart replaces it, on the same endpoints).
        client: a client of ``running``.
        indexer: the indexer process now (a restart replaces it).
    """

    def __init__(self, start_kv_server, connect, indexers, endpoint: str, replay_endpoint: str, settings) -> None:
        self._start_kv_server, self._connect, self._indexers = start_kv_server, connect, indexers
        self._endpoints = (endpoint, replay_endpoint)
        self._settings = {"zmq_endpoint": endpoint, "zmq_replay_endpoint": replay_endpoint, **settings}
        self.running: Any = None
        self.client: Any = None
        self.indexer: DynamoIndexer | None = None

    async def start_server(self) -> None:
        """Start kvservice (again) with the same settings and endpoints, and connect to it."""
        self.running = await self._start_kv_server(**self._settings)
        self.client = await self._connect(self.running)

    async def restart_server(self) -> None:
        """Stop kvservice and start a new one (another epoch) on the same endpoints: Dynamo is not
        told (no re-registration)."""
        await self.running.stop(0)
        await self.start_server()

    async def start_indexer(self) -> None:
        """Start a Dynamo indexer process (empty) and register the worker with it."""
        self.indexer = self._indexers()
        await self.indexer.wait_healthy()
        await self.indexer.register(*self._endpoints)

    async def assert_dynamo_equals(self, dropped: frozenset[int] = frozenset()) -> None:
        """:func:`assert_dynamo_equals` of the indexer and the server now."""
        await assert_dynamo_equals(self.indexer, self.running, self.client, dropped)


@pytest.fixture
def follow(start_kv_server, connect, indexers, tmp_path):
    """Factory: ``await follow(**settings)`` starts kvservice (:data:`SMALL_SERVER` with ``settings``)
    on ZMQ endpoints under ``tmp_path``, and an indexer registered on them (:class:`Followed`)."""

    async def start(**settings: Any) -> Followed:
        followed = Followed(
            start_kv_server, connect, indexers, f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", settings
        )
        await followed.start_server()
        await followed.start_indexer()
        return followed

    return start


async def test_dynamo_follows_kvservice_through_restarts_and_short_retention(follow):
    # 1. A fresh indexer follows a live kvservice (seq far above 0 at attach: a replay from 0).
    f = await follow(event_max_batches=6)
    await workload(f.client, "a", 24)
    assert f.running.event_log.head_seq > 6  # the history is longer than the retention
    assert f.running.engine.manager.block_pool.num_evictions > 0
    await f.assert_dynamo_equals()
    before_restart = cached(f.running)

    # 2. kvservice restarts on the same endpoints: the wire seq jumps, Dynamo asks for the gap and
    #    is answered with the new epoch's start (AllBlocksCleared) or a snapshot; no re-registration.
    await f.restart_server()
    await workload(f.client, "b", 6)
    assert before_restart - cached(f.running), "the dead server held blocks the new one does not"
    await f.assert_dynamo_equals()

    # 3. The indexer restarts (a new process, registered as a new one), after more history than is
    #    retained: its replay from 0 is answered with a snapshot.
    await workload(f.client, "c", 20)
    f.indexer.stop()
    assert f.running.event_log.oldest_seq > 1
    await f.start_indexer()
    snapshots = f.running.zmq_publisher.num_snapshot_replays
    await workload(f.client, "d", 4)
    await f.assert_dynamo_equals()
    assert f.running.zmq_publisher.num_snapshot_replays > snapshots


async def test_dynamo_catches_up_on_a_restart_with_a_snapshot_bigger_than_the_replay_high_water_mark(follow):
    """A restarted kvservice with a one-batch retention (a replay socket high-water mark of 4
    messages) and over 128 cached blocks, far more than snapshot_part_tokens (4) per gRPC part: Dynamo,
    still holding the dead server's blocks, sees the seq jump, asks for the gap and is answered with
    the snapshot as one batch, and ends equal to the new server's cached set."""
    f = await follow(event_max_batches=1, snapshot_part_tokens=4, num_blocks=256)
    await workload(f.client, "a", 8)
    await f.assert_dynamo_equals()
    before_restart = cached(f.running)

    await f.restart_server()
    running, client = f.running, f.client
    await workload(client, "b", 4)  # the probes' prefixes again, without the dead server's later turns
    probed = cached(running)
    for i in range(64):  # 128 more blocks
        await admit_and_free(client, f"big{i}", [200_000 + 10 * i + t for t in range(8)])
    assert len(cached(running)) == len(probed) + 128
    assert before_restart - cached(running), "the dead server held blocks the new one does not"
    snapshot = await running.snapshots.get()
    await snapshot.wait_done()
    assert len(snapshot.parts) > 2 * (1 + 1)  # the gRPC snapshot's parts would overflow the replay socket
    await f.assert_dynamo_equals()
    assert running.zmq_publisher.num_snapshot_replays >= 1
    assert running.zmq_publisher.num_replays_abandoned == 0


async def test_dynamo_drops_token_less_tier_blocks_and_their_children_and_follows_the_rest(follow):
    """Blocks a tier stores by hash without token ids (docs/tier.md: the marked exception to
    tokens = hashes x block size) reach Dynamo 1.6.1 on the ZMQ wire, and it cannot index them: it
    keys its tree by its own hash of each block's tokens, so it drops such a BlockStored ("token_ids
    too short: need 4, got 0"), then every BlockStored whose parent it dropped ("Failed to find parent
    block"), and skips their removals. Measured here, exactly: its view is kvservice's cached set less
    those blocks, a prompt whose prefix the tier stored overlaps 0 there (kvservice hits it), blocks
    a tier stores *with* token ids are indexed like any other, and everything else (the probes, the
    evictions of all of these) it follows as before."""
    from kvservice_client.hashing import BlockHasher, block_hash_to_int

    f = await follow(device="cpu")
    running, client, indexer = f.running, f.client, f.indexer
    await workload(client, "a", 8)
    await f.assert_dynamo_equals()

    hasher = BlockHasher(BLOCK_SIZE)
    size = (await client.get_kv_cache_group_metadata()).groups[0].bytes_per_block
    tokenless, with_tokens = [70_000 + t for t in range(8)], [80_000 + t for t in range(8)]  # not the workload's
    for prompt, token_ids in [(tokenless, None), (with_tokens, with_tokens)]:
        keys = [bytes(k) for k in hasher.hash_prompt(prompt)]
        put = await client.put_blocks(
            0, [(k, bytes(size)) for k in keys], parent_block_hashes=[None, keys[0]], token_ids=token_ids
        )
        assert (put.reserved, put.num_blocks_written) == (True, 2), put
    child = [*tokenless, 90_000, 90_001, 90_002, 90_003, 1]  # a scheduler's prompt extending the tier's prefix
    assert await kvservice_hit(client, child) == 8
    await admit_and_free(client, "child", child)
    marker = [95_000 + t for t in range(4)] + [1]  # indexed: a view with it has seen everything before it
    await admit_and_free(client, "marker", marker)
    dropped = frozenset(block_hash_to_int(k) for k in hasher.hash_prompt(child[:12]))  # the tier's 2 and the child
    assert dropped <= cached(running) and len(dropped) == 3
    await f.assert_dynamo_equals(dropped)
    assert block_hash_to_int(hasher.hash_prompt(marker[:4])[0]) in await indexer.view()
    answers = [
        (await kvservice_hit(client, p), await indexer.overlap(p)) for p in ([*tokenless, 1], child, [*with_tokens, 1])
    ]
    assert answers == [(8, 0), (12, 0), (8, 8)]
    log = indexer.log_text()
    assert "token_ids too short: need 4, got 0" in log and "Failed to find parent block" in log

    # Evictions take the dropped blocks too: Dynamo skips their removals and still equals the rest.
    await workload(client, "b", 16)
    assert not dropped & cached(running)
    await f.assert_dynamo_equals(dropped)
    assert "Failed to find block to remove" in indexer.log_text()
