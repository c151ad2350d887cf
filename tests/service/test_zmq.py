"""The vLLM-compatible ZMQ publisher, seen by a subscriber written only against vLLM's framing.

:class:`VllmSubscriber` knows nothing of kvservice's decoder: it reads what vLLM 0.33's
``ZmqEventPublisher`` documents (PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack
payload)``; replay by sending ``(b"", start_seq as 8 bytes)`` from a DEALER to the ROUTER, answered
with ``(b"", topic, seq, payload)`` per batch and the end marker ``(b"", b"", -1 as 8 signed
bytes, b"")``), decodes payloads with plain msgpack into lists and maps, and reads them by vLLM's
field names: a batch is ``[ts, events, data_parallel_rank]`` (the rank nil when unset); an
event is a map tagged by ``"type"``: ``BlockStored`` (block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, then optional extra_keys, group_idx,
kv_cache_spec_kind, ...), ``BlockRemoved`` (block_hashes, medium, optional group_idx, ...),
``AllBlocksCleared``. It keeps a set of (group_idx, hash), as a router's index does, and must end
with the server's cached set (the event log's mirror).

PUB/SUB joins late (ZMQ's slow joiner): a subscriber waits for its subscription to reach the
publisher by making probe batches (a prefix-cache reset: one AllBlocksCleared) until one arrives,
then fills everything before it from the replay socket, as a vLLM subscriber does after a gap.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys

import msgspec
import pytest

from kvservice.server.app import ServerConfig, load_config, start_server
from kvservice.server.snapshot import snapshot_events
from kvservice.server.zmq_publisher import ZmqEventPublisher, check_endpoint_exposure
from kvservice_client.events import KVEventBatch, encode_event_batch
from tests.service.conftest import SMALL_SERVER
from tests.service.helpers import hashes, next_batch

zmq = pytest.importorskip("zmq")
zmq_asyncio = pytest.importorskip("zmq.asyncio")

pytestmark = pytest.mark.timeout(30)

VLLM_END_SEQ = b"\xff" * 8
"""vLLM's end-of-replay seq frame: -1 as 8 signed big-endian bytes."""
RECV_TIMEOUT_S = 5.0
"""Deadline of one receive: a hang fails the test instead of blocking the suite."""
PROBE_POLL_MS = 20
"""How long a joining subscriber waits for each probe batch before making another."""


class VllmSubscriber:
    """A router's side of vLLM's ZMQ protocol: a SUB socket, a DEALER for replays, and the cached
    set as a set of (group_idx, hash)."""

    def __init__(
        self,
        ctx: zmq_asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None,
        subscribe: bytes = b"",
        *,
        bind: bool = False,
        ipv6: bool = False,
    ) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.IPV6, int(ipv6))
        self.sub.setsockopt(zmq.SUBSCRIBE, subscribe)
        if bind:
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
        self.dealer = None
        if replay_endpoint is not None:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.IPV6, int(ipv6))
            self.dealer.connect(replay_endpoint)
        self.cached: set[tuple[int | None, object]] = set()
        self.last_seq: int | None = None
        self.live: dict[int, list[bytes]] = {}  # seq -> the live message's frames

    async def recv(self) -> list[bytes]:
        """The next live message's frames."""
        return await asyncio.wait_for(self.sub.recv_multipart(), RECV_TIMEOUT_S)

    async def join(self, client) -> list[bytes]:
        """Make probe batches until one arrives (the subscription is in place); its frames."""
        for _ in range(int(RECV_TIMEOUT_S * 1000 / PROBE_POLL_MS)):
            assert await client.reset_prefix_cache()
            if await self.sub.poll(PROBE_POLL_MS):
                return await self.recv()
        raise TimeoutError("the subscription never reached the publisher")

    async def replay(self, start_seq: int) -> list[list[bytes]]:
        """Every message a replay from ``start_seq`` answers, the end marker included."""
        assert self.dealer is not None
        await self.dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        messages = []
        while True:
            frames = await asyncio.wait_for(self.dealer.recv_multipart(), RECV_TIMEOUT_S)
            assert frames[0] == b"", "a ROUTER reply to a DEALER starts with the empty delimiter"
            messages.append(frames[1:])
            if frames[2] == VLLM_END_SEQ:
                return messages

    def apply(self, frames: list[bytes], *, topic: bytes = b"", contiguous: bool = True) -> None:
        """Apply one message ``(topic, seq, payload)``; seqs must follow one another (unless not
        ``contiguous``: a replay's answer, applied as it comes, as Dynamo's indexer does)."""
        assert len(frames) == 3, frames
        msg_topic, seq_bytes, payload = frames
        assert msg_topic == topic and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq is not None and contiguous:
            assert seq == self.last_seq + 1, f"gap: {self.last_seq} -> {seq}"
        self.last_seq = seq
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float), batch
        for event in batch[1]:
            tag = event["type"]
            group_idx = event.get("group_idx")
            if tag == "BlockStored":
                self.cached.update((group_idx, h) for h in event["block_hashes"])
            elif tag == "BlockRemoved":
                self.cached.difference_update((group_idx, h) for h in event["block_hashes"])
            else:
                assert tag == "AllBlocksCleared", tag
                self.cached.clear()

    async def follow_to(self, head_seq: int, *, topic: bytes = b"") -> None:
        """Apply live messages until seq ``head_seq``, keeping their frames."""
        while self.last_seq is None or self.last_seq < head_seq:
            frames = await self.recv()
            self.live[int.from_bytes(frames[1], "big")] = frames
            self.apply(frames, topic=topic)

    async def receive_with_watermark(self, frames: list[bytes]) -> list[list[bytes]] | None:
        """Handle one live message as a seq-tracking router does (Dynamo's indexer): a seq past
        ``last_seq + 1`` (or any first seq above 0) asks for a replay from there and applies its
        answer in order; a seq at or below the watermark is dropped. The replay's answer, if any."""
        seq = int.from_bytes(frames[1], "big")
        answer = None
        if (self.last_seq is None and seq > 0) or (self.last_seq is not None and seq > self.last_seq + 1):
            answer = (await self.replay(0 if self.last_seq is None else self.last_seq + 1))[:-1]
            for message in answer:
                self.apply(message, contiguous=False)
        if self.last_seq is None or seq > self.last_seq:
            self.apply(frames)
        return answer

    async def catch_up(self, client, head_seq_of, *, topic: bytes = b"") -> None:
        """Join live, fill the start from a replay from seq 1, then follow live to the head."""
        first = await self.join(client)
        first_seq = int.from_bytes(first[1], "big")
        for frames in (await self.replay(1))[:-1]:
            if int.from_bytes(frames[1], "big") < first_seq:
                self.apply(frames, topic=topic)
        self.live[first_seq] = first
        self.apply(first, topic=topic)
        await self.follow_to(head_seq_of(), topic=topic)


def cached_pairs(running) -> set[tuple[int, object]]:
    """The server's cached set as (group_idx, hash) pairs (the event log's mirror)."""
    return {(g, h) for g, group in enumerate(running.snapshots.mirror.cached_hashes()) for h in group}


async def workload(client, num_requests: int = 10) -> None:
    """Requests sharing prefixes in threes, in full report mode: stores, reuse reports, evictions
    (16 blocks of 4 tokens), then a reset (AllBlocksCleared) and a few more stores."""
    for i in range(num_requests):
        prompt = [1000 * (i % 3 + 1) + t for t in range(8)] + [50_000 + 10 * i + t for t in range(8)]
        await client.get_computed_blocks(f"w{i}", prompt, session_id=f"s{i % 3}", kv_cache_report_mode="full")
        assert (await client.allocate_slots(f"w{i}", len(prompt))).allocated
        await client.free(f"w{i}")
        if i == num_requests // 2:
            assert await client.reset_prefix_cache()


@pytest.fixture
async def zctx():
    ctx = zmq_asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_live_subscriber_mirrors_the_cached_set(start_kv_server, connect, zctx):
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    client = await connect(running)
    endpoint, replay_endpoint = running.zmq_publisher.endpoint, running.zmq_publisher.replay_endpoint
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    assert running.notes[-1] == f"ZMQ KV events on {endpoint} (bound), topic '', replay on {replay_endpoint}"
    subscriber = VllmSubscriber(zctx, endpoint, replay_endpoint)
    await subscriber.catch_up(client, lambda: running.zmq_publisher.seq_base + running.event_log.head_seq)

    head = running.event_log.head_seq
    prompt = list(range(1, 9))
    await client.get_computed_blocks("r", prompt, session_id="chat-7")
    assert (await client.allocate_slots("r", 8)).allocated
    frames = await subscriber.recv()
    assert frames[:2] == [b"", (running.zmq_publisher.seq_base + head + 1).to_bytes(8, "big")]
    ts, events, data_parallel_rank = msgspec.msgpack.decode(frames[2])
    assert data_parallel_rank is None and isinstance(ts, float)
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": hashes(prompt),
            "parent_block_hash": None,
            "token_ids": prompt,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "session_id": "chat-7",
        }
    ]
    subscriber.apply(frames)
    await client.free("r")

    await workload(client)
    await subscriber.follow_to(running.zmq_publisher.seq_base + running.event_log.head_seq)
    assert subscriber.cached == cached_pairs(running)
    assert len(subscriber.cached) > 0
    removals = [
        e for f in subscriber.live.values() for e in msgspec.msgpack.decode(f[2])[1] if e["type"] == "BlockRemoved"
    ]
    assert removals, "the workload evicts blocks"
    assert running.zmq_publisher.num_published == running.event_log.head_seq
    assert running.zmq_publisher.num_dropped == 0


async def test_replay_is_byte_identical_to_live_and_ends_with_the_marker(start_kv_server, connect, zctx, tmp_path):
    running = await start_kv_server(
        zmq_endpoint=f"ipc://{tmp_path}/pub", zmq_replay_endpoint=f"ipc://{tmp_path}/replay", data_parallel_rank=3
    )
    client = await connect(running)
    subscriber = VllmSubscriber(zctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    await subscriber.catch_up(client, lambda: running.zmq_publisher.seq_base + running.event_log.head_seq)
    await workload(client)
    head = running.event_log.head_seq
    base = running.zmq_publisher.seq_base
    await subscriber.follow_to(base + head)
    first_live = min(subscriber.live)

    everything = await subscriber.replay(1)  # below the epoch's first seq: the epoch start, then every batch
    assert everything[-1] == [b"", VLLM_END_SEQ, b""]
    assert [int.from_bytes(m[1], "big") for m in everything[:-1]] == list(range(base, base + head + 1))
    assert msgspec.msgpack.decode(everything[0][2])[1:] == [[{"type": "AllBlocksCleared"}], 3]
    for message in everything[:-1]:
        seq = int.from_bytes(message[1], "big")
        assert message[0] == b""
        if seq >= first_live:
            assert message == subscriber.live[seq]
        assert msgspec.msgpack.decode(message[2])[2] == 3  # data_parallel_rank

    middle = head // 2
    assert await subscriber.replay(base + middle) == everything[middle:]
    assert await subscriber.replay(base + head + 1) == [[b"", VLLM_END_SEQ, b""]]  # beyond the head: the marker alone
    assert running.zmq_publisher.num_replays == 4  # the catch-up's and these three


async def test_a_late_joiner_below_retention_gets_a_snapshot_first_and_ends_exact(start_kv_server, connect, zctx):
    """History dropped (3 batches retained of many): a replay from 0 is answered with the snapshot
    (AllBlocksCleared, then every cached block) at the head's seq; the subscriber that applies it
    and then follows live holds the server's cached set. Within retention, replays stay exact."""
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", event_max_batches=3
    )
    client = await connect(running)
    await workload(client, num_requests=12)
    head, oldest, base = running.event_log.head_seq, running.event_log.oldest_seq, running.zmq_publisher.seq_base
    assert oldest == head - 2 > 1 and cached_pairs(running)
    subscriber = VllmSubscriber(zctx, running.zmq_publisher.endpoint, running.zmq_publisher.replay_endpoint)
    for start in (0, 1, base, base + oldest - 1):
        replayed = await subscriber.replay(start)
        assert [m[1] for m in replayed] == [(base + head).to_bytes(8, "big"), VLLM_END_SEQ]
        ts, events, rank = msgspec.msgpack.decode(replayed[0][2])
        assert events[0] == {"type": "AllBlocksCleared"} and rank is None
        assert all(e["type"] == "BlockStored" for e in events[1:])
    assert running.zmq_publisher.num_snapshot_replays == 4
    assert (await subscriber.replay(base + oldest))[:-1] == [
        [b"", (base + e.seq).to_bytes(8, "big"), e.msgpack] for e in running.event_log.entries_from(oldest)
    ]

    # The late joiner: live first (a seq far above 0), a replay from 0 (the snapshot), then live.
    await subscriber.sub.poll(0)
    for i in range(100):  # new batches until one reaches the subscription (ZMQ's slow joiner)
        await client.get_computed_blocks(f"late{i}", [7000 + i] * 8)
        assert (await client.allocate_slots(f"late{i}", 8)).allocated
        await client.free(f"late{i}")
        if await subscriber.sub.poll(PROBE_POLL_MS):
            break
    answer = await subscriber.receive_with_watermark(await subscriber.recv())
    assert answer is not None and msgspec.msgpack.decode(answer[0][2])[1][0] == {"type": "AllBlocksCleared"}
    await workload(client, num_requests=6)
    while subscriber.last_seq < base + running.event_log.head_seq:
        await subscriber.receive_with_watermark(await subscriber.recv())
    assert subscriber.cached == cached_pairs(running) and subscriber.cached


async def test_a_snapshot_bigger_than_the_replay_high_water_mark_comes_whole_as_one_batch(
    start_kv_server, connect, zctx
):
    """The replay socket's high-water mark is sized by retention (2 x (event_max_batches + 1)
    messages: 4 here), not by the cache. A late joiner's snapshot of 200 blocks, far more than
    snapshot_part_tokens (4) per part, still comes whole: on ZMQ it is one batch at the head's seq
    (one seq, one message, as every batch of vLLM's framing), so it neither overflows the socket
    (a replay abandoned mid-snapshot leaves the joiner partial, without an end marker) nor asks a
    seq-tracking consumer to apply several messages of one seq."""
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*",
        zmq_replay_endpoint="tcp://127.0.0.1:*",
        event_max_batches=1,
        snapshot_part_tokens=4,
        num_blocks=256,
    )
    client = await connect(running)
    for i in range(100):
        prompt = [100_000 + 10 * i + t for t in range(8)]
        await client.get_computed_blocks(f"r{i}", prompt)
        assert (await client.allocate_slots(f"r{i}", 8)).allocated
        await client.free(f"r{i}")
    log, publisher = running.event_log, running.zmq_publisher
    assert len(cached_pairs(running)) == 200 and log.oldest_seq == log.head_seq > 1
    snapshot = await running.snapshots.get()
    await snapshot.wait_done()
    assert len(snapshot.parts) > 2 * (1 + 1)  # the gRPC snapshot's parts overflow it
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint)
    replayed = await subscriber.replay(0)
    assert [m[1] for m in replayed] == [(publisher.seq_base + log.head_seq).to_bytes(8, "big"), VLLM_END_SEQ]
    _, events, rank = msgspec.msgpack.decode(replayed[0][2])
    assert rank is None
    presence = [
        e for e in snapshot_events(running.snapshots.mirror) if not getattr(e, "reused", False)
    ]  # each block once
    assert len(presence) == 1 + 100  # AllBlocksCleared, then one BlockStored per request's chain
    assert events == msgspec.msgpack.decode(encode_event_batch(KVEventBatch(0.0, presence, None)))[1]
    subscriber.apply(replayed[0])
    assert subscriber.cached == cached_pairs(running)
    assert publisher.num_replays_abandoned == 0 and publisher.num_snapshot_replays == 1


async def test_a_late_joiner_that_counts_stores_against_removals_ends_exact(start_kv_server, connect, zctx):
    """A router that counts BlockStored against BlockRemoved per (group_idx, hash) (as vLLM's
    per-copy events need) and, as a vLLM reader, knows nothing of ``reused``: in incremental mode
    the server stores each hash once per presence, so it stays exact, and the snapshot it late-joins
    from must announce each cached block once too. Then evictions remove each block once: every
    count ends 0 or 1, and the blocks counted 1 are the server's cached set."""
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", event_max_batches=2
    )
    client = await connect(running)

    async def request(name: str, prompt: list[int]) -> None:
        await client.get_computed_blocks(name, prompt)  # incremental: no reuse reports
        assert (await client.allocate_slots(name, len(prompt))).allocated
        await client.free(name)

    for i in range(6):  # 12 blocks of 16, two shared prefixes
        await request(f"r{i}", [1000 * (i % 2 + 1) + t for t in range(4)] + [5000 + 10 * i + t for t in range(4)])
    log, publisher = running.event_log, running.zmq_publisher
    assert log.oldest_seq > 1 and len(cached_pairs(running)) == 8
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint)
    counts: dict[tuple[int | None, object], int] = {}

    def count(payload: bytes) -> None:
        for event in msgspec.msgpack.decode(payload)[1]:
            keys = [(event.get("group_idx"), h) for h in event.get("block_hashes", ())]
            if event["type"] == "BlockStored":
                for key in keys:
                    counts[key] = counts.get(key, 0) + 1
            elif event["type"] == "BlockRemoved":
                for key in keys:
                    counts[key] -= 1
            else:
                counts.clear()

    for i in range(100):  # new batches until one reaches the subscription (ZMQ's slow joiner)
        await request(f"join{i}", [7000 + i] * 8)
        if await subscriber.sub.poll(PROBE_POLL_MS):
            break
    (snapshot, end) = await subscriber.replay(0)  # subscribed: every later batch comes live
    assert end == [b"", VLLM_END_SEQ, b""]
    snapshot_seq = int.from_bytes(snapshot[1], "big")
    assert snapshot_seq == publisher.seq_base + log.head_seq
    count(snapshot[2])
    assert counts == dict.fromkeys(cached_pairs(running), 1)
    for i in range(12):  # evict every block the snapshot announced
        await request(f"e{i}", [9000 + 10 * i + t for t in range(8)])
    seq = 0
    while seq < publisher.seq_base + log.head_seq:
        frames = await subscriber.recv()
        if (seq := int.from_bytes(frames[1], "big")) > snapshot_seq:
            count(frames[2])
    assert set(counts.values()) <= {0, 1}
    assert {key for key, n in counts.items() if n == 1} == cached_pairs(running)


async def test_a_replay_longer_than_one_slice_comes_whole(start_kv_server, connect, zctx):
    """A replay yields to the loop between slices of batches; the answer stays whole and ordered,
    with batches published meanwhile (the answer holds what was retained when it began)."""
    from kvservice.server.zmq_publisher import REPLAY_YIELD_EVERY

    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    client = await connect(running)
    num_batches = 2 * REPLAY_YIELD_EVERY + 1
    for _ in range(num_batches):
        assert await client.reset_prefix_cache()
    subscriber = VllmSubscriber(zctx, running.zmq_publisher.endpoint, running.zmq_publisher.replay_endpoint)
    request = asyncio.ensure_future(subscriber.replay(1))
    while not request.done():  # more batches while the replay is under way
        assert await client.reset_prefix_cache()
    replayed = await request
    base = running.zmq_publisher.seq_base
    assert [int.from_bytes(m[1], "big") for m in replayed[:-1]] == list(range(base, base + len(replayed) - 1))
    assert num_batches + 1 <= len(replayed) - 1 <= running.event_log.head_seq + 1 and replayed[-1][1] == VLLM_END_SEQ


async def test_topic_frames_and_prefix_filtering(start_kv_server, connect, zctx):
    topic = b"kv@pod-a@qwen-2.5-0.5b"
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", zmq_topic=topic.decode()
    )
    client = await connect(running)
    other = VllmSubscriber(zctx, running.zmq_publisher.endpoint, None, subscribe=b"kv@pod-b")
    publisher = running.zmq_publisher
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint, b"kv@pod-a")
    await subscriber.catch_up(client, lambda: running.zmq_publisher.seq_base + running.event_log.head_seq, topic=topic)
    await workload(client)
    await subscriber.follow_to(running.zmq_publisher.seq_base + running.event_log.head_seq, topic=topic)
    assert subscriber.cached == cached_pairs(running)
    assert all(m[0] == topic for m in (await subscriber.replay(1))[:-1])
    # Nothing reached the non-matching subscription (a late message could only make this pass
    # wrongly, never fail wrongly: the two connections are not ordered with each other).
    assert await other.sub.poll(0) == 0


async def test_publisher_connects_to_a_bound_subscriber(start_kv_server, connect, zctx):
    """llm-d's topology: the router binds its SUB socket, each engine's PUB connects to it."""
    router = VllmSubscriber(zctx, "tcp://127.0.0.1:*", None, bind=True)
    running = await start_kv_server(zmq_endpoint=router.endpoint)
    assert running.zmq_publisher.endpoint == router.endpoint and not running.zmq_publisher.bound
    assert running.notes[-1] == f"ZMQ KV events on {router.endpoint} (connected), topic '', no replay"
    client = await connect(running)
    router.apply(await router.join(client))
    await workload(client)
    await router.follow_to(running.zmq_publisher.seq_base + running.event_log.head_seq)
    assert router.cached == cached_pairs(running)


async def test_grpc_msgpack_payload_is_the_same_bytes(start_kv_server, connect, zctx):
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    client = await connect(running)
    await workload(client)
    head = running.event_log.head_seq
    subscriber = VllmSubscriber(zctx, running.zmq_publisher.endpoint, running.zmq_publisher.replay_endpoint)
    replayed = (await subscriber.replay(1))[1:-1]  # without the epoch start
    stream = client.stream_events(start_seq=1, payload_format="msgpack")
    batches = [await next_batch(stream) for _ in range(head)]
    base = running.zmq_publisher.seq_base
    assert [(b.seq, b.msgpack) for b in batches] == [(int.from_bytes(m[1], "big") - base, m[2]) for m in replayed]


async def test_a_malformed_replay_request_is_ignored(start_kv_server, connect, zctx, caplog):
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    client = await connect(running)
    assert await client.reset_prefix_cache()
    subscriber = VllmSubscriber(zctx, running.zmq_publisher.endpoint, running.zmq_publisher.replay_endpoint)
    with caplog.at_level(logging.WARNING, "kvservice.server.zmq_publisher"):
        await subscriber.dealer.send_multipart([b"", b"\x00" * 8, b"extra"])  # 4 frames at the ROUTER: no answer
        # The answer to the next (valid) request is the first one to come back on this connection.
        base = running.zmq_publisher.seq_base
        assert [m[1] for m in await subscriber.replay(1)] == [
            base.to_bytes(8, "big"),
            (base + 1).to_bytes(8, "big"),
            VLLM_END_SEQ,
        ]
    assert running.zmq_publisher.num_bad_requests == 1
    assert "invalid ZMQ replay request of 4 frames" in caplog.text


async def test_a_refused_send_is_counted_and_logged(start_kv_server, connect, caplog):
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_hwm=7)
    client = await connect(running)
    publisher = running.zmq_publisher
    real_pub = publisher._pub

    class RefusingSocket:
        def send_multipart(self, *args, **kwargs):
            raise zmq.Again()

        def getsockopt(self, option):
            return real_pub.getsockopt(option)

    publisher._pub = RefusingSocket()
    with caplog.at_level(logging.WARNING, "kvservice.server.zmq_publisher"):
        for _ in range(3):
            assert await client.reset_prefix_cache()
    publisher._pub = real_pub
    assert (publisher.num_dropped, publisher.num_published) == (3, 0)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2  # the first drop, then at powers of two
    assert logged[0].startswith(f"ZMQ publisher dropped batch seq {publisher.seq_base + 1} (")
    assert logged[1].endswith("; 2 dropped so far (zmq_hwm 7 messages per subscriber)")


async def test_close_stops_publishing(start_kv_server):
    running = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    publisher = running.zmq_publisher
    await running.stop(0)
    assert publisher._closed and publisher._pub.closed and publisher._router.closed
    assert publisher._replay_task.done()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="zmq_replay_endpoint needs zmq_endpoint"):
        ServerConfig(zmq_replay_endpoint="tcp://*:5558", allow_insecure_bind=True)
    with pytest.raises(ValueError, match=r"zmq_hwm must be >= 1 messages; got 0"):
        ServerConfig(zmq_endpoint="tcp://*:5557", zmq_hwm=0, allow_insecure_bind=True)
    with pytest.raises(ValueError, match=r"zmq_endpoint must be a ZMQ endpoint such as tcp://\*:5557"):
        ServerConfig(zmq_endpoint="localhost:5557")
    config = load_config(
        environ={
            "KVSERVICE_ZMQ_ENDPOINT": "tcp://*:5557",
            "KVSERVICE_ZMQ_HWM": "10",
            "KVSERVICE_ZMQ_TOPIC": "kv@a@b",
            "KVSERVICE_ALLOW_INSECURE_BIND": "1",
        },
        zmq_replay_endpoint="tcp://*:5558",
    )
    assert (config.zmq.endpoint, config.zmq.replay_endpoint, config.zmq.topic, config.zmq.hwm) == (
        "tcp://*:5557",
        "tcp://*:5558",
        "kv@a@b",
        10,
    )
    assert ServerConfig().zmq.topic == "" and ServerConfig().zmq.endpoint is None


# -- exposure: ZMQ has no authentication, so a bind off loopback needs allow_insecure_bind ----------

OPEN_BIND_REFUSED = (
    r"{setting} '{endpoint}' binds a non-loopback address and ZMQ has no authentication or encryption: anyone "
    r"who reaches the port reads the KV events \(prompt token ids\), whatever TLS or tokens the gRPC port has; "
    r"bind loopback \(e\.g\. tcp://127\.0\.0\.1:\*\) or ipc://, or set allow_insecure_bind "
    r"\(--allow-insecure-bind\) to bind anyway$"
)


def open_bind_note(setting: str, endpoint: str) -> str:
    return (
        f"{setting} {endpoint} bound on a non-loopback address (allow_insecure_bind): ZMQ carries no authentication "
        "or encryption; the KV events (token ids) are readable by anyone who reaches the port"
    )


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://[::]:5557", "tcp://*:*", "tcp://[::ffff:10.0.0.5]:5557"])
def test_a_pub_bind_off_loopback_is_refused_without_the_flag(endpoint):
    with pytest.raises(
        ValueError, match=OPEN_BIND_REFUSED.format(setting="zmq_endpoint", endpoint=re.escape(endpoint))
    ):
        ServerConfig(zmq_endpoint=endpoint)
    assert ServerConfig(zmq_endpoint=endpoint, allow_insecure_bind=True).zmq.endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5558",
        "tcp://0.0.0.0:5558",
        "tcp://[::]:5558",
        "tcp://10.0.0.5:5558",
        "tcp://eth0:5558",
        "tcp://indexer:5558",
    ],
)
def test_a_replay_bind_off_loopback_is_refused_without_the_flag(endpoint):
    """The replay socket is always bound, so an address vLLM's rule would connect to is bound too."""
    with pytest.raises(
        ValueError, match=OPEN_BIND_REFUSED.format(setting="zmq_replay_endpoint", endpoint=re.escape(endpoint))
    ):
        ServerConfig(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint=endpoint)
    assert check_endpoint_exposure("tcp://127.0.0.1:*", endpoint, allow_insecure_bind=True) == [
        open_bind_note("zmq_replay_endpoint", endpoint)
    ]


@pytest.mark.parametrize(
    "endpoint, replay_endpoint",
    [
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:5558"),  # loopback binds (a wildcard port is no wildcard host)
        ("tcp://[::1]:5557", "tcp://localhost:5558"),
        ("ipc:///run/kvservice/events", "ipc:///run/kvservice/replay"),  # guarded by file permissions
        ("inproc://events", None),
        ("tcp://10.0.0.5:5557", None),  # connects (vLLM's rule): the router binds that port
        ("tcp://indexer:5557", "tcp://127.0.0.2:5558"),
        ("tcp://0.0.0.0:5557", None),  # no wildcard: connected, not bound
    ],
)
def test_loopback_ipc_and_connect_endpoints_need_no_flag(endpoint, replay_endpoint):
    config = ServerConfig(zmq_endpoint=endpoint, zmq_replay_endpoint=replay_endpoint)
    assert (config.zmq.endpoint, config.zmq.replay_endpoint) == (endpoint, replay_endpoint)
    assert check_endpoint_exposure(endpoint, replay_endpoint, allow_insecure_bind=False) == []
    assert check_endpoint_exposure(endpoint, replay_endpoint, allow_insecure_bind=True) == []


async def test_an_open_bind_with_the_flag_starts_with_the_warning(start_kv_server, connect, zctx):
    running = await start_kv_server(zmq_endpoint="tcp://*:*", zmq_replay_endpoint="tcp://*:*", allow_insecure_bind=True)
    publisher = running.zmq_publisher
    assert publisher.bound and publisher.endpoint.startswith("tcp://0.0.0.0:")
    assert running.notes[-2:] == [
        open_bind_note("zmq_endpoint", "tcp://*:*"),
        open_bind_note("zmq_replay_endpoint", "tcp://*:*"),
    ]
    assert "note: " + open_bind_note("zmq_replay_endpoint", "tcp://*:*") in running.describe()
    client = await connect(running)
    assert await client.reset_prefix_cache()
    port = publisher.replay_endpoint.rsplit(":", 1)[1]
    subscriber = VllmSubscriber(zctx, publisher.endpoint, f"tcp://127.0.0.1:{port}")
    base = publisher.seq_base
    assert [m[1] for m in await subscriber.replay(1)] == [
        base.to_bytes(8, "big"),
        (base + 1).to_bytes(8, "big"),
        VLLM_END_SEQ,
    ]


async def test_ipc_and_connect_endpoints_start_without_a_warning(start_kv_server, tmp_path):
    running = await start_kv_server(zmq_endpoint=f"ipc://{tmp_path}/pub", zmq_replay_endpoint=f"ipc://{tmp_path}/rep")
    assert running.zmq_publisher.notes == [] and "non-loopback" not in running.describe()
    # A connect to a non-loopback address (TEST-NET-1, never reached: ZMQ connects in the background).
    running = await start_kv_server(zmq_endpoint="tcp://192.0.2.1:5557")
    assert not running.zmq_publisher.bound and running.zmq_publisher.notes == []
    assert running.notes[-1] == "ZMQ KV events on tcp://192.0.2.1:5557 (connected), topic '', no replay"


async def test_the_publisher_refuses_an_open_bind_itself():
    """Started without ServerConfig, the publisher applies the rule before opening a socket."""
    with pytest.raises(ValueError, match=OPEN_BIND_REFUSED.format(setting="zmq_endpoint", endpoint=r"tcp://\*:\*")):
        await ZmqEventPublisher.start(None, endpoint="tcp://*:*")  # type: ignore[arg-type]


def test_serve_refuses_an_open_zmq_bind_before_allocating(monkeypatch):
    from click.testing import CliRunner

    from kvservice import cli
    from kvservice.server import app

    started = []
    monkeypatch.setattr(app, "run_server", lambda *args, **kwargs: started.append(args))
    result = CliRunner().invoke(
        cli.main, ["serve", "--zmq-endpoint", "tcp://*:5557"], env={"KVSERVICE_ALLOW_INSECURE_BIND": None}
    )
    assert result.exit_code == 1 and started == []
    assert "zmq_endpoint 'tcp://*:5557' binds a non-loopback address" in result.output
    assert "set allow_insecure_bind (--allow-insecure-bind) to bind anyway" in result.output


async def test_an_endpoint_in_use_fails_the_start(start_kv_server):
    first = await start_kv_server(zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*")
    taken = first.zmq_publisher.replay_endpoint  # the replay socket is always bound
    with pytest.raises(RuntimeError, match=rf"zmq_replay_endpoint: cannot bind '{taken}': Address already in use"):
        await start_server(**{**SMALL_SERVER, "zmq_endpoint": "tcp://127.0.0.1:*", "zmq_replay_endpoint": taken})


async def test_missing_pyzmq_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(RuntimeError, match=r"pip install pyzmq \(kvservice's zmq extra\)"):
        await start_server(**{**SMALL_SERVER, "zmq_endpoint": "tcp://127.0.0.1:*"})


async def test_ipv6_loopback_endpoints_work(start_kv_server, connect, zctx):
    running = await start_kv_server(zmq_endpoint="tcp://[::1]:*", zmq_replay_endpoint="tcp://[::1]:*")
    publisher = running.zmq_publisher
    assert publisher.endpoint.startswith("tcp://[::1]:") and publisher.replay_endpoint.startswith("tcp://[::1]:")
    client = await connect(running)
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint, ipv6=True)
    await subscriber.catch_up(client, lambda: publisher.seq_base + running.event_log.head_seq)
    await workload(client)
    await subscriber.follow_to(publisher.seq_base + running.event_log.head_seq)
    assert subscriber.cached == cached_pairs(running) and subscriber.cached


async def test_a_restart_on_the_same_endpoints_is_a_seq_jump_whose_replay_clears_first(
    start_kv_server, connect, zctx, tmp_path
):
    """The restarted server's wire seqs start above the dead one's last (a jump, never a rewind);
    a subscriber that tracks seqs asks for a replay from its last seq + 1 and is answered with the
    new epoch's start (AllBlocksCleared) and its batches, so it never keeps the dead cache's blocks."""
    # Bound endpoints that can be bound again (tcp://127.0.0.1:PORT would connect, vLLM's rule).
    endpoint, replay_endpoint = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    first = await start_kv_server(zmq_endpoint=endpoint, zmq_replay_endpoint=replay_endpoint)
    client = await connect(first)
    subscriber = VllmSubscriber(zctx, endpoint, replay_endpoint)
    await subscriber.catch_up(client, lambda: first.zmq_publisher.seq_base + first.event_log.head_seq)
    await workload(client)
    await subscriber.follow_to(first.zmq_publisher.seq_base + first.event_log.head_seq)
    old_last = subscriber.last_seq
    assert subscriber.cached == cached_pairs(first) and subscriber.cached
    await first.stop(0)

    second = await start_kv_server(zmq_endpoint=endpoint, zmq_replay_endpoint=replay_endpoint)
    base = second.zmq_publisher.seq_base
    assert base > old_last
    client = await connect(second)
    assert (await client.get_kv_cache_group_metadata()).zmq_seq_base == base
    for i in range(200):  # new batches until one reaches the reconnected subscription
        prompt = [9000 + i] * 8
        await client.get_computed_blocks(f"n{i}", prompt)
        assert (await client.allocate_slots(f"n{i}", 8)).allocated
        await client.free(f"n{i}")
        if await subscriber.sub.poll(PROBE_POLL_MS):
            break
    frames = await subscriber.recv()
    assert int.from_bytes(frames[1], "big") > old_last + 1  # a jump
    answer = await subscriber.receive_with_watermark(frames)
    assert answer is not None and int.from_bytes(answer[0][1], "big") == base
    assert msgspec.msgpack.decode(answer[0][2])[1] == [{"type": "AllBlocksCleared"}]
    await subscriber.follow_to(base + second.event_log.head_seq)
    assert subscriber.cached == cached_pairs(second)
    assert {h for _, h in subscriber.cached}.isdisjoint({h for _, h in cached_pairs(first)})


async def test_a_replay_asked_for_in_the_turn_a_batch_was_appended_includes_it(
    start_kv_server, connect, zctx, monkeypatch
):
    """The replay settles the event log before it reads the mirror: a batch sequenced in this turn
    of the loop, not yet handed to the mirror, is in a snapshot answer (at the head's seq) and in
    a replay within retention."""
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", event_max_batches=3
    )
    client = await connect(running)
    await workload(client, num_requests=12)
    publisher, log, base = running.zmq_publisher, running.event_log, running.zmq_publisher.seq_base
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint)
    identities: list[bytes] = []
    answer = publisher._replay

    async def recording(frames: list[bytes]) -> None:
        identities.append(frames[0])
        await answer(frames)

    monkeypatch.setattr(publisher, "_replay", recording)
    await subscriber.replay(0)  # the ROUTER knows the DEALER now; its routing id is recorded

    async def replay_in_this_turn(start_seq: int, n: int) -> list[list[bytes]]:
        # Sequenced, not settled: no await between the append and the replay's own settle.
        running.engine.get_computed_blocks(f"turn{n}", [9000 + 100 * n + t for t in range(16)])
        assert running.engine.allocate_slots(f"turn{n}", 16).allocated
        running.servicer.publish()
        assert running.snapshots.mirror.seq == log.head_seq - 1  # not handed to the mirror yet
        await answer([identities[0], b"", start_seq.to_bytes(8, "big")])
        messages = []
        while True:
            frames = await asyncio.wait_for(subscriber.dealer.recv_multipart(), RECV_TIMEOUT_S)
            messages.append(frames[1:])
            if frames[2] == VLLM_END_SEQ:
                return messages

    snapshot = await replay_in_this_turn(0, 1)  # below retention: the snapshot
    assert [m[1] for m in snapshot] == [(base + log.head_seq).to_bytes(8, "big"), VLLM_END_SEQ]
    stored = {h for e in msgspec.msgpack.decode(snapshot[0][2])[1][1:] for h in e["block_hashes"]}
    assert stored == {h for _, h in cached_pairs(running)} and len(stored) == len(cached_pairs(running))
    within = await replay_in_this_turn(base + log.head_seq + 1, 2)  # from the batch this turn appends
    assert within[:-1] == [[b"", (base + log.head_seq).to_bytes(8, "big"), log.entries_from(log.head_seq)[0].msgpack]]


async def test_a_snapshot_replay_keeps_the_batches_published_while_its_events_are_made(
    start_kv_server, connect, zctx, monkeypatch
):
    """The replay's snapshot comes from the server's SnapshotSource, and its events are made in
    steps that yield to the loop, so batches are published meanwhile: they follow the snapshot in
    the answer even when retention (3 batches) has dropped them by the time it is sent."""
    from kvservice.server.snapshot import Snapshot

    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", event_max_batches=3
    )
    client = await connect(running)
    await workload(client, num_requests=12)
    log, publisher, source = running.event_log, running.zmq_publisher, running.snapshots
    assert log.oldest_seq > 1
    cuts_before = source.num_cuts
    presence_events = Snapshot.presence_events
    seqs = []

    async def churning(snap: Snapshot) -> list:
        seqs.append(snap.seq)
        for n in range(4):  # one more batch than retention holds
            running.engine.get_computed_blocks(f"churn{n}", [9000 + 100 * n + t for t in range(16)])
            assert running.engine.allocate_slots(f"churn{n}", 16).allocated
            running.engine.free(f"churn{n}")
            running.servicer.publish()
            log.settle()
        assert log.oldest_seq > seqs[0] + 1
        return await presence_events(snap)

    monkeypatch.setattr(Snapshot, "presence_events", churning)
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint)
    replayed = await subscriber.replay(0)
    base = publisher.seq_base
    assert seqs == [log.head_seq - 4] and source.num_cuts == cuts_before + 1
    assert [m[1] for m in replayed] == [(base + s).to_bytes(8, "big") for s in range(seqs[0], log.head_seq + 1)] + [
        VLLM_END_SEQ
    ]
    for message in replayed[:-1]:
        subscriber.apply(message)
    assert subscriber.cached == cached_pairs(running) and subscriber.cached
    assert publisher.num_snapshot_replays == 1 and publisher.num_replays_abandoned == 0


async def test_a_snapshot_joined_in_production_is_followed_by_the_batches_the_source_holds_back(
    start_kv_server, connect, zctx, monkeypatch
):
    """A cut in production holds back from the mirror every batch after its watermark: when the
    log's retention (3 batches) drops them before the snapshot is handed over, the replay takes
    them from the source (SnapshotSource.batches_after), and the answer is still the snapshot at
    its watermark, then every batch after it."""
    running = await start_kv_server(
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*", event_max_batches=3
    )
    client = await connect(running)
    await workload(client, num_requests=12)
    log, publisher, source = running.event_log, running.zmq_publisher, running.snapshots
    get = source.get
    handed: list[int] = []

    async def late(group_idxs=None):
        snap = await get(group_idxs)  # its production has just started
        handed.append(snap.seq)
        for n in range(4):  # four batches past it before it is handed over
            running.engine.get_computed_blocks(f"late{n}", [9000 + 100 * n + t for t in range(16)])
            assert running.engine.allocate_slots(f"late{n}", 16).allocated
            running.engine.free(f"late{n}")
            running.servicer.publish()
            log.settle()
        assert log.oldest_seq > snap.seq + 1 and not snap.done
        return snap

    monkeypatch.setattr(source, "get", late)
    subscriber = VllmSubscriber(zctx, publisher.endpoint, publisher.replay_endpoint)
    replayed = await subscriber.replay(0)
    base = publisher.seq_base
    assert handed == [log.head_seq - 4]
    assert [m[1] for m in replayed] == [(base + s).to_bytes(8, "big") for s in range(handed[0], log.head_seq + 1)] + [
        VLLM_END_SEQ
    ]
    for message in replayed[:-1]:
        subscriber.apply(message)
    assert subscriber.cached == cached_pairs(running) and subscriber.cached
    assert publisher.num_snapshot_replays == 1 and publisher.num_replays_abandoned == 0
