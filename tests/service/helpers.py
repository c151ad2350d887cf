"""Helpers of the service tests: expected events, readers of the event stream, observed server state.

Readers never sleep to synchronize: a stream reader waits for the next message (with a deadline
that only turns a hang into a failure), and a subscription whose start must not race the first
batch starts at an explicit seq (``head_seq + 1``), which the server replays from its log.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvservice.server.app import RunningServer
from kvservice.server.snapshot import snapshot_events
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.convert import proto_to_batch
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice_client.hashing import BlockHasher, block_hash_to_int

BLOCK_SIZE = 4
FULL_SLIDING = {"kv_cache_layout": str(Path(__file__).resolve().parents[1] / "data" / "layouts" / "full-sliding.toml")}
"""Server settings for a two-group hybrid: group 0 full attention, group 1 a 1024-token sliding
window (10 layers each, Gemma-3-27B's shape): the hybrid the old two-group gemma-3-27b preset was."""
READ_TIMEOUT_S = 5.0
"""Deadline of one read of a stream: a hang fails the test instead of blocking the suite."""


def hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, **kwargs: Any) -> list[int]:
    """Published (int) hashes of every full block of ``token_ids`` (the default hash rule)."""
    return [block_hash_to_int(h) for h in BlockHasher(block_size).hash_prompt(list(token_ids), **kwargs)]


H = hashes(range(1, 17))
"""Hashes of the blocks of tokens 1..16 at block size 4 (the unit tests' H)."""


def stored(
    block_hashes: list[int],
    parent: int | None,
    tokens: Iterable[int],
    *,
    group: int = 0,
    kind: str = "full_attention",
    window: int | None = None,
    session: str | None = None,
    reused: bool = False,
    block_size: int = BLOCK_SIZE,
    medium: str = "GPU",
) -> BlockStored:
    """A BlockStored as the server publishes it by default (medium "GPU", as vLLM's primary pool)."""
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        session_id=session,
        reused=reused,
    )


def removed(
    block_hashes: list[int], *, group: int = 0, kind: str = "full_attention", window: int | None = None
) -> BlockRemoved:
    """A BlockRemoved as the server publishes it by default (medium "GPU")."""
    return BlockRemoved(
        block_hashes, "GPU", group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window
    )


def events_of(batch: pb.EventBatch) -> list[KVCacheEvent]:
    """The msgspec events of one EventBatch (either payload format)."""
    return list(proto_to_batch(batch).events)


def snapshot_presence_events(batch: pb.EventBatch) -> list[KVCacheEvent]:
    """The presence part of a snapshot batch: AllBlocksCleared, then the unmarked BlockStored events
    that list every cached block, parents first. Reuse-marked events a snapshot may add (to convey
    recency) change no presence and are checked separately (every hash they name is cached)."""
    assert batch.snapshot, f"batch {batch.seq} is not a snapshot"
    events = events_of(batch)
    presence = [e for e in events if not (isinstance(e, BlockStored) and e.reused)]
    named = {(e.group_idx, h) for e in presence if isinstance(e, BlockStored) for h in e.block_hashes}
    for event in events:
        if isinstance(event, BlockStored) and event.reused:
            assert {(event.group_idx, h) for h in event.block_hashes} <= named, "snapshot re-announces an absent hash"
    return presence


def flat_events(batches: Iterable[pb.EventBatch]) -> list[KVCacheEvent]:
    """Every event of ``batches``, in order."""
    return [event for batch in batches for event in events_of(batch)]


async def next_batch(stream: AsyncIterator[pb.EventBatch], timeout: float = READ_TIMEOUT_S) -> pb.EventBatch:
    """The next batch of a stream (a hang becomes a TimeoutError after ``timeout`` seconds)."""
    return await asyncio.wait_for(anext(stream), timeout)


async def read_batches(stream: AsyncIterator[pb.EventBatch], n: int) -> list[pb.EventBatch]:
    """The next ``n`` batches of a stream."""
    return [await next_batch(stream) for _ in range(n)]


async def wait_until(predicate: Callable[[], bool], timeout: float = READ_TIMEOUT_S) -> None:
    """Wait for a server-side condition (e.g. a subscription registered) by yielding to the loop
    the server runs on; fails after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)


class StreamReader:
    """Reads batches from one StreamEvents subscription that starts at an explicit seq."""

    name = "stream"

    def __init__(self, client: AsyncKVCacheClient, stream: AsyncIterator[pb.EventBatch]) -> None:
        self.client = client
        self.stream = stream

    @classmethod
    async def open(cls, client: AsyncKVCacheClient, running: RunningServer, **kwargs: Any) -> StreamReader:
        return cls(client, client.stream_events(start_seq=running.event_log.head_seq + 1, **kwargs))

    async def batches(self, n: int) -> list[pb.EventBatch]:
        return await read_batches(self.stream, n)


class TakeReader:
    """Reads batches through TakeEvents with a named consumer (registered at the live head)."""

    name = "take"

    def __init__(self, client: AsyncKVCacheClient, consumer: str, kwargs: dict[str, Any]) -> None:
        self.client = client
        self.consumer = consumer
        self.kwargs = kwargs

    @classmethod
    async def open(
        cls, client: AsyncKVCacheClient, running: RunningServer, consumer: str = "reader", **kwargs: Any
    ) -> TakeReader:
        response = await client.take_events(consumer, **kwargs)
        assert list(response.batches) == [] and response.next_seq == running.event_log.head_seq + 1
        return cls(client, consumer, kwargs)

    async def batches(self, n: int) -> list[pb.EventBatch]:
        response = await self.client.take_events(self.consumer, **self.kwargs)
        assert len(response.batches) == n, [b.seq for b in response.batches]
        return list(response.batches)


READERS = {"stream": StreamReader, "take": TakeReader}


def pool_hashes(running: RunningServer) -> list[set[int]]:
    """Per group, the hashes the block pool holds, in their published (int) form."""
    return [
        {block_hash_to_int(h) for h in hash_map.hashes()}
        for hash_map in running.engine.manager.block_pool.cached_block_hash_to_block
    ]


async def observed_state(running: RunningServer, client: AsyncKVCacheClient) -> dict[str, Any]:
    """Everything a failed call must leave unchanged: usage (through GetUsage), the cached set (the
    log's mirror and the pool), the request table, block tables, the event log (head, retained
    batches, the snapshot it would cut), consumers' cursors and subscribers."""
    return {"usage": await client.get_usage(), **server_state(running)}


def server_state(running: RunningServer) -> dict[str, Any]:
    """As :func:`observed_state`, read in-process (usage from the engine): for callers that cannot
    make an RPC in between (the fuzz compares it around one raw call)."""
    engine = running.engine
    log = running.event_log
    return {
        "engine_usage": engine.get_usage(),
        "retained": [entry.seq for entry in log.entries_from(log.oldest_seq)],
        "snapshot": snapshot_events(running.snapshots.mirror),
        "cached": running.snapshots.mirror.cached_hashes(),
        "pool": pool_hashes(running),
        "requests": {rid: (r.num_tokens, r.num_computed_tokens) for rid, r in engine.requests.items()},
        "running": set(engine.running),
        "block_ids": {rid: engine.manager.get_block_ids(rid) for rid in engine.requests},
        "head_seq": log.head_seq,
        "oldest_seq": log.oldest_seq,
        "consumers": dict(log._consumers),  # no public accessor: a failed take must not register one
        "num_subscribers": log.num_subscribers,
    }


class Mirror:
    """A watcher's view of the cached set: per group, a set of hashes, built only from events."""

    def __init__(self, num_groups: int) -> None:
        self.groups: list[set[int]] = [set() for _ in range(num_groups)]
        self.last_seq: int | None = None

    def apply(self, batch: pb.EventBatch) -> None:
        if self.last_seq is not None and not batch.snapshot:
            assert batch.seq == self.last_seq + 1, f"gap: {self.last_seq} -> {batch.seq}"
        self.last_seq = batch.seq
        for event in events_of(batch):
            if isinstance(event, AllBlocksCleared):
                for group in self.groups:
                    group.clear()
            elif isinstance(event, BlockStored):
                if event.reused:
                    assert set(event.block_hashes) <= self.groups[event.group_idx], "reuse report of an absent hash"
                self.groups[event.group_idx].update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert set(event.block_hashes) <= self.groups[event.group_idx], "removal of an absent hash"
                self.groups[event.group_idx].difference_update(event.block_hashes)


def without_epoch(results: Iterable[pb.StepOpResult], epoch: str) -> list[pb.StepOpResult]:
    """Step results with each allocated answer's epoch (asserted to be ``epoch``, its server's)
    cleared, so the answers of two servers compare equal where all else is."""
    out = []
    for result in results:
        result = pb.StepOpResult.FromString(result.SerializeToString())
        if result.WhichOneof("result") == "allocate_slots":
            answer = result.allocate_slots
            assert answer.epoch == (epoch if answer.allocated else ""), (answer.epoch, epoch)
            answer.ClearField("epoch")
        out.append(result)
    return out
