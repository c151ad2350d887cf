"""Lapsed put leases (an expired put lease's blocks held one more ttl), releases riding LeaseBlocks
(``release_lease_ids``), the reaper's wake-up for a lease taken while it sleeps, and a path as a
client target: written by a second attack on the lease table. The problems it found are fixed, each
pinned by a test whose first comment states the rule; the other tests pin behaviour not covered
elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

import grpc
import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.tier import TierStore
from kvservice.server.reaper import RequestReaper
from kvservice_client import KVCacheClient
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.errors import KVServiceError
from kvservice_client.torch_view import aattach
from tests.service.test_tier import CPU, block_bytes, h, pattern, write_block
from tests.service.test_tier_lease_table import HeldPut, fake_clock

WAIT_S = 30  # a bound on every wait on an event (never reached when things work)


def free_ids(running: Any) -> list[int]:
    """The pool's free queue, head (evicted or reused first) to tail."""
    return [b.block_id for b in running.engine.manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(running: Any, *block_ids: int) -> list[int]:
    pool = running.engine.manager.block_pool
    return [pool.blocks[b].ref_cnt for b in block_ids]


# -- lapsed put leases ---------------------------------------------------------------------------


async def test_a_lapsed_put_lease_s_release_frees_its_blocks_at_once_to_the_head_once_only(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    client = await connect(running)
    tier = running.engine.tier
    await client.put_blocks(0, [(h(9), pattern(9))])  # block 1 cached, at the tail
    put = await client.reserve_blocks(0, [h(1), h(2)], ttl_s=2.0)
    assert list(put.block_ids) == [2, 3]
    now[0] += 2.0
    assert list((await client.lookup_blocks(0, [h(1)])).present) == [False]  # a lookup ends nothing
    assert tier.num_leases == 1
    assert tier.expire(now[0]) == 1  # lapsed: blocks 2 and 3 still held
    assert (tier.num_leases, tier.num_leased_blocks, ref_counts(running, 2, 3)) == (0, 2, [1, 1])
    assert tier.next_deadline() == 1004.0
    running.check_invariants()
    # Its putter's release (valid False: the lease is over) frees them at once, uncached, to the
    # head of the free queue in their order; a second release (or commit, or the reaper) frees
    # nothing more.
    released = await client.release_lease(put.lease_id)
    assert (released.valid, released.num_blocks) == (False, 2)
    assert free_ids(running) == [2, 3, 4, 5, 1]
    assert (tier.num_leased_blocks, ref_counts(running, 2, 3), tier.next_deadline()) == (0, [0, 0], None)
    again = await client.release_lease(put.lease_id)
    assert (again.valid, again.num_blocks) == (False, 0)
    assert (await client.commit_blocks(put.lease_id)).committed is False
    now[0] += 10.0
    assert running.reaper is not None
    running.reaper.reap()
    assert free_ids(running) == [2, 3, 4, 5, 1] and ref_counts(running, 2, 3) == [0, 0]
    running.check_invariants()


async def test_a_lease_carrying_a_lapsed_put_lease_s_id_frees_its_blocks_even_when_refused_for_room(
    start_kv_server, connect
):
    # release_lease_ids ends a lapsed put lease as ReleaseLease does (its blocks freed at once),
    # also on a LeaseBlocks then refused at tier_max_leases (a lapsed lease holds no lease room).
    running = await start_kv_server(**CPU, tier_max_leases=1)
    now = fake_clock(running)
    client = await connect(running)
    tier = running.engine.tier
    await client.put_blocks(0, [(h(9), pattern(9))])  # block 1
    put = await client.reserve_blocks(0, [h(1)], ttl_s=2.0)
    now[0] += 2.0
    read = await client.lease_blocks(0, [h(9)])  # ends (lapses) the put lease, takes the only lease room
    assert (list(put.block_ids), list(read.block_ids), tier.num_leased_blocks) == ([2], [1], 2)
    with pytest.raises(KVServiceError) as refused:
        await client.lease_blocks(
            pb.LeaseBlocksRequest(group_idx=0, block_hashes=[h(9)], release_lease_ids=[put.lease_id])
        )
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (tier.num_leases, tier.num_leased_blocks, ref_counts(running, 1, 2)) == (1, 1, [1, 0])
    assert free_ids(running)[0] == 2
    running.check_invariants()
    assert (await client.release_lease(read.lease_id)).valid


async def test_a_pool_held_by_a_lapsed_put_lease_refuses_a_put_until_the_lease_s_second_ttl_ends(
    start_kv_server, connect
):
    running = await start_kv_server(**CPU)  # 5 blocks
    now = fake_clock(running)
    client = await connect(running)
    tier = running.engine.tier
    held = await client.reserve_blocks(0, [h(k) for k in range(1, 6)], ttl_s=2.0)
    assert list(held.block_ids) == [1, 2, 3, 4, 5]
    now[0] += 3.9  # expired 1.9 s ago: lapsed, its blocks held until 1004
    refused = await client.reserve_blocks(0, [h(6)])
    assert (refused.reserved, refused.lease_id) == (False, 0)
    assert (tier.num_expired, tier.num_leases, tier.num_leased_blocks) == (1, 0, 5)
    assert (await client.get_usage()).num_free_blocks == 0
    assert (await client.reset_prefix_cache()).reset is False  # lapsed holds count as held
    running.check_invariants()
    now[0] += 0.1  # 1004: the next call frees them (uncached, no event) before reserving
    put = await client.reserve_blocks(0, [h(6)])
    assert (put.reserved, list(put.block_ids)) == (True, [1])
    assert free_ids(running) == [2, 3, 4, 5]
    assert (await client.release_lease(put.lease_id)).valid
    assert (await client.reset_prefix_cache()).reset is True
    assert tier.num_leased_blocks == 0


async def test_a_put_blocks_whose_lease_expired_mid_stream_frees_its_block_at_once_not_a_ttl_later(
    start_kv_server, connect
):
    # PutBlocks writes its blocks itself (no copy outlives the call): its commit, refused, frees
    # the lapsed lease's blocks at once.
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    client = await connect(running)
    tier = running.engine.tier
    held = HeldPut(client, running, [1, 2], ttl_s=2.0)
    await asyncio.wait_for(held.reserved.wait(), WAIT_S)
    assert held.result.block_ids == [1, 2]
    now[0] += 2.0
    assert tier.expire(now[0]) == 1 and tier.num_leased_blocks == 2
    response = await held.send_rest()
    assert (response.reserved, list(response.status), response.num_blocks_written, response.lease_expired) == (
        True,
        [0, 0],
        0,
        True,
    )
    assert (tier.num_leases, tier.num_leased_blocks, tier.next_deadline()) == (0, 0, None)
    assert free_ids(running) == [1, 2, 3, 4, 5]
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [False, False]
    running.check_invariants()


async def test_a_scheduler_s_requests_and_lapsed_put_leases_share_the_pool_with_the_invariants_held(
    start_kv_server, connect
):
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    scheduler = await connect(running)
    tier_client = await connect(running)
    put = await tier_client.reserve_blocks(0, [h(1), h(2)], ttl_s=2.0)
    now[0] += 2.0
    assert running.engine.tier.expire(now[0]) == 1
    # The scheduler allocates around the held blocks: 3 free blocks, a 12-token prompt.
    await scheduler.get_computed_blocks("r1", list(range(1, 13)))
    slots = await scheduler.allocate_slots("r1", num_new_tokens=12)
    assert list(slots.new_block_ids[0].block_ids) == [3, 4, 5]
    running.check_invariants()
    await scheduler.free("r1")
    assert (await tier_client.commit_blocks(put.lease_id)).committed is False  # frees 1 and 2
    running.check_invariants()
    assert (await scheduler.get_usage()).num_free_blocks == 5


async def test_a_lapsed_lease_held_at_stop_leaves_a_restarted_pool_whole(start_kv_server, connect):
    # A server stopped with a lapsed lease's blocks held: a new server starts with every block free.
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    client = await connect(running)
    await client.reserve_blocks(0, [h(1)], ttl_s=2.0)
    now[0] += 2.0
    assert running.engine.tier.expire(now[0]) == 1 and running.engine.tier.num_leased_blocks == 1
    await running.stop(0)
    again = await start_kv_server(**CPU)
    other = await connect(again)
    assert (await other.get_usage()).num_free_blocks == 5
    assert (again.engine.tier.num_leases, again.engine.tier.num_leased_blocks) == (0, 0)


def test_a_new_lease_never_takes_a_lapsed_lease_s_id(monkeypatch):
    # A lease id is never one a lapsed put lease still holds (its late commit or release would end
    # the new lease, and the lapsed blocks would be forgotten, held for ever).
    pool = BlockPool(6, 1, enable_kv_cache_events=True)
    tier = TierStore(pool, [4], digest_bytes=32)
    ids = iter([7, 7, 8])
    monkeypatch.setattr(secrets, "randbits", lambda _bits: next(ids))
    first = tier.reserve(0, [h(1)], ttl_s=2.0, now=0.0)
    assert tier.expire(2.0) == 1  # lapsed, block 1 held until 4.0
    second = tier.reserve(0, [h(2)], ttl_s=1.0, now=2.0)
    assert tier.expire(3.0) == 1  # the second lapses too, until 4.0
    tier.expire(10.0)  # both lapsed leases' time is up
    assert (first.lease_id, first.block_ids, second.block_ids) == (7, [1], [2])
    assert [pool.blocks[b].ref_cnt for b in (1, 2)] == [0, 0], (
        f"lease id {second.lease_id} given twice: blocks 1, 2 ref counts "
        f"{[pool.blocks[b].ref_cnt for b in (1, 2)]}, held blocks {tier.held_block_ids()}"
    )


# -- releases riding LeaseBlocks ----------------------------------------------------------------


async def test_release_lease_ids_end_a_lease_exactly_as_release_lease_does_whoever_sends_them(start_kv_server, connect):
    # A caller may end any lease whose id it knows, as ReleaseLease already lets it (same roles,
    # same effect); a put lease named there is aborted (freed uncached, no event); an id named
    # twice is ended once; unknown ids are skipped.
    running = await start_kv_server(**CPU, tier_max_leases=4)  # the ids named count, repeats too
    owner = await connect(running)
    stranger = await connect(running)
    view = await aattach(owner)
    tier = running.engine.tier
    await owner.put_blocks(0, [(h(1), pattern(1))])  # block 1
    read = await owner.lease_blocks(0, [h(1)])
    put = await owner.reserve_blocks(0, [h(2)])  # block 2
    write_block(view, put.block_ids[0], pattern(2))
    done = await stranger.lease_blocks(
        pb.LeaseBlocksRequest(release_lease_ids=[read.lease_id, put.lease_id, read.lease_id, 12345])
    )
    assert (done.lease_id, list(done.block_ids), done.num_leased) == (0, [], 0)
    assert (tier.num_leases, tier.num_leased_blocks) == (0, 0)
    assert not view.lease_live(read.lease_slot, read.lease_id) and not view.lease_live(put.lease_slot, put.lease_id)
    assert (await owner.commit_blocks(put.lease_id)).committed is False  # aborted: its copy stores nothing
    assert (await owner.release_lease(read.lease_id)).valid is False
    assert list((await owner.lookup_blocks(0, [h(1), h(2)])).present) == [True, False]
    assert free_ids(running)[0] == 2  # the aborted put's block: uncached, to the head
    assert block_bytes(view, 1) == pattern(1)
    view.close()


# -- the reaper ----------------------------------------------------------------------------------


async def test_a_lease_taken_while_the_reaper_sleeps_wakes_it_to_sleep_until_its_deadline(
    start_kv_server, connect, monkeypatch
):
    # The reaper sleeps until the earliest deadline it knows of; a tier lease added meanwhile
    # (TierStore.on_deadline) wakes it to sleep again until that lease's, not request_idle_timeout_s
    # (600 s here) with the lease's blocks held all that time.
    running = await start_kv_server(**CPU)
    fake_clock(running)  # the lease ends at 1002, the clock stays at 1000
    client = await connect(running)
    assert running.reaper is not None
    await running.reaper.stop()
    waits: list[float] = []
    waited = [asyncio.Event(), asyncio.Event()]
    real_sleep_for = RequestReaper._sleep_for

    async def sleep_for(self: RequestReaper, delay: float) -> bool:
        waits.append(delay)
        if len(waits) <= len(waited):
            waited[len(waits) - 1].set()
        return await real_sleep_for(self, delay)

    monkeypatch.setattr(RequestReaper, "_sleep_for", sleep_for)
    reaper = RequestReaper(running.engine, running.servicer.publish, 600.0)
    running.reaper = reaper
    try:
        reaper.start()
        await asyncio.wait_for(waited[0].wait(), WAIT_S)
        assert waits == [600.0]  # nothing live: asleep for request_idle_timeout_s
        put = await client.reserve_blocks(0, [h(1)], ttl_s=2.0)
        assert put.reserved
        await asyncio.wait_for(waited[1].wait(), WAIT_S)
        assert waits == [600.0, 2.0]  # woken: until the lease's deadline
    finally:
        await reaper.stop()


# -- a bare path as a target ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/run/kvservice.sock", "/tmp"])
def test_an_absolute_path_target_is_refused_naming_the_unix_form(target):
    with pytest.raises(ValueError) as caught:
        KVCacheClient(target)
    assert str(caught.value) == f"target {target!r} is a path: a Unix socket's target is 'unix:{target}'"


@pytest.mark.parametrize("target", ["unix:/run/kvservice.sock", "unix:///run/kvservice.sock", "127.0.0.1:1"])
def test_the_unix_forms_and_an_address_are_accepted(target):
    KVCacheClient(target).close()


@pytest.mark.parametrize("target", ["./kvservice.sock", "../run/kvservice.sock", "~/kvservice.sock"])
def test_a_relative_path_target_is_refused_naming_the_unix_form(target):
    # ./, ../ and ~ paths are refused as an absolute one is (gRPC would look them up as host names).
    with pytest.raises(ValueError) as caught:
        KVCacheClient(target).close()
    expanded = os.path.expanduser(target)  # gRPC expands no "~": the suggestion does
    assert str(caught.value) == f"target {target!r} is a path: a Unix socket's target is 'unix:{expanded}'"
