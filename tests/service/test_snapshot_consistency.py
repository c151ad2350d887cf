"""Snapshot + live batches equal the server's cached set, after a random workload.

A watcher that starts from a snapshot and applies every later batch in order holds exactly the
snapshot mirror (``running.snapshots.mirror.cached_hashes()``) and exactly the hashes the block pool indexes;
so does one that joins mid-way with a snapshot, over StreamEvents and over TakeEvents.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvservice_client.client import KVServiceError, StepBuilder, step_results
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.service.helpers import FULL_SLIDING, Mirror, events_of, next_batch, pool_hashes

pytestmark = pytest.mark.timeout(60)

FAMILIES = [[1000 * f + t for t in range(8)] for f in range(1, 5)]
"""Shared two-block prefixes, so requests hit each other's blocks."""


class Workload:
    """A seeded mix of admissions, decodes, frees and resets through unary calls and Steps."""

    def __init__(self, client, running, seed: int) -> None:
        self.client = client
        self.running = running
        self.rng = random.Random(seed)
        self.next_id = 0

    def _new_prompt(self) -> list[int]:
        rng = self.rng
        prefix = rng.choice(FAMILIES)[: rng.choice([0, 4, 8])]
        return prefix + [rng.randrange(1, 50) for _ in range(rng.randint(1, 20))]

    async def run(self, num_ops: int) -> None:
        rng, client, engine = self.rng, self.client, self.running.engine
        for _ in range(num_ops):
            admitted = sorted(engine.running)
            waiting = sorted(set(engine.requests) - engine.running)
            roll = rng.random()
            if roll < 0.4 or not engine.requests:
                rid = f"q{self.next_id}"
                self.next_id += 1
                prompt = self._new_prompt()
                mode = rng.choice(["full", "incremental"])
                if rng.random() < 0.5:
                    await client.step(
                        StepBuilder()
                        .get_computed_blocks(rid, prompt, kv_cache_report_mode=mode)
                        .allocate_slots(rid, rng.randint(1, len(prompt)))
                    )
                else:
                    await client.get_computed_blocks(rid, prompt, kv_cache_report_mode=mode)
                    await client.allocate_slots(rid, len(prompt))
            elif roll < 0.7 and admitted:
                rid = rng.choice(admitted)
                request = engine.requests[rid]
                new_tokens = [rng.randrange(1, 50) for _ in range(rng.randint(0, 4))]
                if not new_tokens and request.num_computed_tokens == request.num_tokens:
                    new_tokens = [1]
                if request.num_tokens + len(new_tokens) > engine.max_model_len:
                    await client.free(rid)
                    continue
                await client.allocate_slots(rid, rng.randint(1, 6), new_token_ids=new_tokens)
            elif roll < 0.97:
                victims = rng.sample(admitted + waiting, min(len(admitted + waiting), rng.randint(1, 3)))
                builder = StepBuilder()
                for rid in victims:
                    builder.free(rid)
                results = step_results(await client.step(builder))
                assert not any(isinstance(r, KVServiceError) for r in results)
            else:
                for rid in sorted(engine.requests):
                    await client.free(rid)
                assert (await client.reset_prefix_cache()).reset


async def catch_up(stream, mirror: Mirror, head_seq: int) -> None:
    while mirror.last_seq != head_seq:
        mirror.apply(await next_batch(stream))


def assert_mirror_is_the_server_cache(mirror: Mirror, running) -> None:
    assert mirror.groups == running.snapshots.mirror.cached_hashes() == pool_hashes(running)


@pytest.mark.parametrize("preset", ["qwen-2.5-0.5b", "full-sliding"])
@pytest.mark.parametrize("seed", [7, 8])
async def test_snapshot_plus_live_equals_the_cached_set(start_kv_server, connect, preset, seed):
    layout = FULL_SLIDING if preset == "full-sliding" else {"preset": preset}
    running = await start_kv_server(**layout, num_blocks=24)
    num_groups = running.engine.manager.num_groups
    scheduler, early_client, late_client, taker = [await connect(running) for _ in range(4)]

    early = early_client.stream_events(snapshot=True)
    early_mirror = Mirror(num_groups)
    first = await next_batch(early)
    assert (first.seq, first.snapshot, events_of(first)) == (0, True, [AllBlocksCleared()])
    early_mirror.apply(first)

    workload = Workload(scheduler, running, seed)
    await workload.run(80)
    head = running.event_log.head_seq
    assert head > 10

    late = late_client.stream_events(snapshot=True)
    late_mirror = Mirror(num_groups)
    snap = await next_batch(late)
    assert (snap.seq, snap.snapshot) == (head, True)
    late_mirror.apply(snap)
    assert_mirror_is_the_server_cache(late_mirror, running)
    taken = await taker.take_events("late-taker", snapshot=True)
    assert (len(taken.batches), taken.batches[0].seq, taken.next_seq) == (1, head, head + 1)
    take_mirror = Mirror(num_groups)
    take_mirror.apply(taken.batches[0])
    assert take_mirror.groups == late_mirror.groups
    await catch_up(early, early_mirror, head)
    assert early_mirror.groups == late_mirror.groups

    await workload.run(80)
    head = running.event_log.head_seq
    for stream, mirror in ((early, early_mirror), (late, late_mirror)):
        await catch_up(stream, mirror, head)
        assert_mirror_is_the_server_cache(mirror, running)
    while take_mirror.last_seq != head:
        for batch in (await taker.take_events("late-taker")).batches:
            take_mirror.apply(batch)
    assert_mirror_is_the_server_cache(take_mirror, running)

    # The workload exercised every kind of event.
    kinds = Counter()
    for entry in running.event_log.entries_from(running.event_log.oldest_seq):
        for event in entry.events:
            kinds[(type(event), getattr(event, "reused", False))] += 1
    assert kinds[(BlockStored, False)] and kinds[(BlockStored, True)] and kinds[(BlockRemoved, False)]
    assert kinds[(AllBlocksCleared, False)]
    running.engine.check_invariants()


async def test_large_snapshot_comes_in_parts_that_together_equal_the_cached_set(start_kv_server, connect):
    from kvservice_client.watcher import EventWatcher

    running = await start_kv_server(num_blocks=40, snapshot_part_tokens=8)
    scheduler, streamer, taker, watched_client = [await connect(running) for _ in range(4)]
    for i, family in enumerate(FAMILIES):
        await scheduler.get_computed_blocks(f"r{i}", family + [7, 7, 7, 7, 1], kv_cache_report_mode="full")
        await scheduler.allocate_slots(f"r{i}", 13)
    head = running.event_log.head_seq
    cached = running.snapshots.mirror.cached_hashes()
    assert len(cached[0]) == 12  # 4 chains of 3 blocks: 48 tokens of stores, twice (parents first, recency)

    stream = streamer.stream_events(snapshot=True)
    parts = [await next_batch(stream)]
    while parts[-1].snapshot_more:
        parts.append(await next_batch(stream))
    assert len(parts) > 2
    assert all(p.snapshot and p.seq == head for p in parts)
    assert [p.snapshot_more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert events_of(parts[0])[0] == AllBlocksCleared()
    for p in parts:  # about snapshot_part_tokens each; an event is never split
        stores = [e for e in events_of(p) if isinstance(e, BlockStored)]
        assert sum(len(e.token_ids) for e in stores) <= 12
    mirror = Mirror(1)
    for p in parts:
        mirror.apply(p)
    assert_mirror_is_the_server_cache(mirror, running)

    taken = await taker.take_events("t", snapshot=True)
    assert [b.snapshot_more for b in taken.batches] == [p.snapshot_more for p in parts]
    assert taken.next_seq == head + 1

    # The watcher yields the parts in order, marked, and resumes after the whole snapshot.
    async with EventWatcher(watched_client) as watcher:
        seen = []
        async for item in watcher:
            seen.append(item)
            if not item.snapshot_more:
                break
        assert [w.snapshot_more for w in seen] == [p.snapshot_more for p in parts]
        assert watcher.last_seq == head
