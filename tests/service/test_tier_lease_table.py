"""The lease table of the control segment on a real server (docs/tier.md, "The lease table"):
its bytes for every kind of lease (read, put, PutBlocks), refusals, slot reuse, expiry, the
reaper, a reset, a server without a board; and what a lease's end must never let happen.

Written by an attack on the lease table; the problems it found are fixed, each pinned by a test
whose first comment states the rule.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.tier import TierLimits, TierStore
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.data import awrite_blocks
from kvservice_client.errors import KVServiceError
from kvservice_client.hashing import BlockHasher
from kvservice_client.tier import put_blocks_messages, reserve_blocks_request
from kvservice_client.torch_view import SHM_DIR, aattach
from tests.service.test_tier import CPU, block_bytes, h, pattern, write_block

WRITE = pb.BLOCK_PUT_STATUS_WRITE


def table(view: Any, num_slots: int) -> list[int]:
    """The lease table's slots (lease ids, 0 = free), read from the control segment's file."""
    raw = Path(SHM_DIR, view.description.control_shm_name).read_bytes()
    assert len(raw) == 64 + 8 * num_slots
    return [int.from_bytes(raw[64 + 8 * k : 72 + 8 * k], "little") for k in range(num_slots)]


def control_exists(view: Any) -> bool:
    return Path(SHM_DIR, view.description.control_shm_name).exists()


def fake_clock(running: Any) -> list[float]:
    now = [1000.0]
    running.engine.clock = lambda: now[0]
    return now


class HeldPut:
    """A PutBlocks stream whose header went out and whose chunks wait for :meth:`send_rest`
    (``reserved`` is set once the server's reservation made the put lease)."""

    def __init__(self, client: Any, running: Any, keys: list[int], *, ttl_s: float = 0.0) -> None:
        self.messages = list(
            put_blocks_messages(
                reserve_blocks_request(0, [h(k) for k in keys], ttl_s=ttl_s), [pattern(k) for k in keys], 1 << 20
            )
        )
        self.go = asyncio.Event()
        self.reserved = asyncio.Event()
        self.result: Any = None
        tier = running.engine.tier
        real_reserve = tier.reserve

        def reserve(*args: Any, **kwargs: Any) -> Any:
            result = real_reserve(*args, **kwargs)
            if not self.reserved.is_set():
                self.result = result
                self.reserved.set()
                del tier.reserve  # the next reservations are not this stream's
            return result

        tier.reserve = reserve
        self.call = asyncio.ensure_future(client._rpc("PutBlocks", self._stream(), None, None))

    async def _stream(self) -> AsyncIterator[pb.PutBlocksMessage]:
        yield self.messages[0]
        await self.go.wait()
        for message in self.messages[1:]:
            yield message

    async def send_rest(self) -> pb.PutBlocksResponse:
        self.go.set()
        return await asyncio.wait_for(self.call, 30)


async def test_the_table_holds_each_live_lease_s_id_put_blocks_leases_included_and_reuses_freed_slots(
    start_kv_server, connect
):
    running = await start_kv_server(**CPU, tier_max_leases=3)
    client = await connect(running)
    view = await aattach(client)
    assert table(view, 3) == [0, 0, 0]
    await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))])
    assert table(view, 3) == [0, 0, 0]  # a PutBlocks that ended: its slot is free again
    read = await client.lease_blocks(0, [h(1)])
    put = await client.reserve_blocks(0, [h(3)])
    held = HeldPut(client, running, [4])
    await asyncio.wait_for(held.reserved.wait(), 30)
    assert (read.lease_slot, put.lease_slot) == (1, 2)
    assert table(view, 3) == [read.lease_id, put.lease_id, held.result.lease_id]
    assert held.result.slot == 3 and view.lease_live(3, held.result.lease_id)
    # Every slot taken: a fourth lease is refused and the table is unchanged.
    with pytest.raises(KVServiceError) as refused:
        await client.lease_blocks(0, [h(2)])
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert table(view, 3) == [read.lease_id, put.lease_id, held.result.lease_id]
    # Slot 1 freed, then taken at once by a new lease with a new id: the old id is not live there.
    assert (await client.release_lease(read.lease_id)).valid
    assert table(view, 3) == [0, put.lease_id, held.result.lease_id]
    again = await client.lease_blocks(0, [h(1)])
    assert again.lease_slot == 1 and again.lease_id != read.lease_id
    assert not view.lease_live(1, read.lease_id) and view.lease_live(1, again.lease_id)
    # The PutBlocks's commit frees slot 3; the reservation's commit slot 2; the release slot 1.
    response = await held.send_rest()
    assert (response.reserved, list(response.status), response.num_blocks_written) == (True, [WRITE], 1)
    assert table(view, 3) == [again.lease_id, put.lease_id, 0]
    write_block(view, put.block_ids[0], pattern(3))
    assert (await client.commit_blocks(put.lease_id)).committed
    assert (await client.release_lease(again.lease_id)).valid
    assert table(view, 3) == [0, 0, 0]
    assert [b.data for b in await client.read_blocks([(0, h(k)) for k in (1, 2, 3, 4)])] == [
        pattern(k) for k in (1, 2, 3, 4)
    ]
    assert running.engine.tier.num_leases == 0
    view.close()


async def test_a_put_blocks_stream_cancelled_or_refused_mid_way_frees_its_slot(start_kv_server, connect, monkeypatch):
    running = await start_kv_server(**CPU, tier_max_leases=2)
    client = await connect(running)
    view = await aattach(client)
    tier = running.engine.tier
    ended: dict[int, asyncio.Event] = {}
    real_end = TierStore._end

    def end(self: TierStore, lease: Any) -> None:
        real_end(self, lease)
        ended.setdefault(lease.lease_id, asyncio.Event()).set()

    monkeypatch.setattr(TierStore, "_end", end)
    held = HeldPut(client, running, [1, 2])
    await asyncio.wait_for(held.reserved.wait(), 30)
    lease_id = held.result.lease_id
    assert table(view, 2) == [lease_id, 0]
    held.call.cancel()  # the client goes away mid-stream, no block sent
    await asyncio.wait_for(ended.setdefault(lease_id, asyncio.Event()).wait(), 30)
    assert table(view, 2) == [0, 0] and tier.num_leases == 0
    assert (await client.get_usage()).num_free_blocks == 5
    # A bad chunk: refused, its reservation freed and its slot cleared.
    messages = list(put_blocks_messages(reserve_blocks_request(0, [h(3)]), [pattern(3)], 1 << 20))
    messages[-1].chunk.checksum ^= 1
    with pytest.raises(KVServiceError) as err:
        await client._rpc("PutBlocks", iter(messages), None, None)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert table(view, 2) == [0, 0] and tier.num_leases == 0
    assert list((await client.lookup_blocks(0, [h(1), h(2), h(3)])).present) == [False, False, False]
    view.close()


async def test_a_put_blocks_stream_never_writes_into_the_block_its_expired_lease_gave_up(start_kv_server, connect):
    # PutBlocks checks its put lease is live right before each block write (nothing awaited in
    # between): a lease that expired while the stream was read writes nothing more.
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    client = await connect(running)
    other = await connect(running)
    view = await aattach(other)
    held = HeldPut(client, running, [1], ttl_s=2.0)
    await asyncio.wait_for(held.reserved.wait(), 30)
    assert held.result.block_ids == [1]
    now[0] += 2.0  # the stream is slow: its put lease's 2 s pass
    put = await other.reserve_blocks(0, [h(2)])  # ends the PutBlocks's lease (today: takes its block 1)
    assert running.engine.tier.num_expired == 1
    write_block(view, put.block_ids[0], pattern(2))
    assert (await other.commit_blocks(put.lease_id)).committed
    try:
        response = await held.send_rest()
        # Nothing of the late put is stored (its commit found the lease expired).
        assert (response.reserved, list(response.status), response.num_blocks_written) == (True, [0], 0)
    except KVServiceError:
        pass  # (a fix may refuse the late chunk instead)
    lease = await other.lease_blocks(0, [h(2)])
    bytes_now = block_bytes(view, lease.block_ids[0])
    assert view.lease_live(lease.lease_slot, lease.lease_id)
    assert (await other.release_lease(lease.lease_id)).valid
    assert bytes_now == pattern(2), "h(2)'s committed block holds the expired PutBlocks's bytes"
    view.close()


async def test_lease_blocks_never_pins_a_cached_block_whose_bytes_are_not_written(start_kv_server, connect):
    # LeaseBlocks answers a cached block whose bytes are not written (its hash registered at
    # allocation, before its forward pass) as a miss, as LookupBlocks and ReadBlocks do.
    running = await start_kv_server(**CPU)
    scheduler = await connect(running)
    tier = await connect(running)
    view = await aattach(tier)
    prompt = list(range(1, 10))  # 2 full blocks of 4 tokens and a partial one
    await scheduler.get_computed_blocks("r1", prompt)
    slots = await scheduler.allocate_slots("r1", num_new_tokens=len(prompt))
    assert list(slots.new_block_ids[0].block_ids) == [1, 2, 3]
    digests = BlockHasher(4).hash_prompt(prompt)
    assert [running.engine.manager.block_pool.blocks[b].block_hash for b in (1, 2)] == digests[:2]
    assert list((await tier.lookup_blocks(0, digests[:1])).present) == [False]  # not written: absent
    lease = await tier.lease_blocks(0, digests[:1])
    copy = block_bytes(view, lease.block_ids[0]) if lease.lease_id else None
    vouched = view.lease_live(lease.lease_slot, lease.lease_id)
    # The forward pass then writes the key's real bytes.
    written = await awrite_blocks(scheduler, "r1", [(0, 1, pattern(1))], allocation=slots)
    assert written.num_blocks_written == 1
    if lease.lease_id:
        assert (await tier.release_lease(lease.lease_id)).valid
    assert (list(lease.block_ids), lease.lease_id) == ([0], 0), (
        f"LeaseBlocks pinned unwritten block {list(lease.block_ids)}; slot live {vouched}; the copy "
        f"{'is' if copy == pattern(1) else 'is not'} the key's bytes"
    )
    view.close()


async def test_expiry_and_the_reaper_clear_the_slot_before_the_blocks_are_let_go(start_kv_server, connect):
    running = await start_kv_server(**CPU, tier_max_leases=2)
    now = fake_clock(running)
    client = await connect(running)
    view = await aattach(client)
    await client.put_blocks(0, [(h(1), pattern(1))])
    tier = running.engine.tier
    pool = running.engine.manager.block_pool
    board = tier.lease_board
    seen: list[tuple[int, list[int], list[int]]] = []  # (slot, blocks 1 and 2's ref counts, table) at each clear

    class Recording:
        def publish_lease(self, slot: int, lease_id: int) -> None:
            board.publish_lease(slot, lease_id)

        def clear_lease(self, slot: int) -> None:
            seen.append((slot, [pool.blocks[1].ref_cnt, pool.blocks[2].ref_cnt], table(view, 2)))
            board.clear_lease(slot)

    tier.lease_board = Recording()
    read = await client.lease_blocks(0, [h(1)], ttl_s=2.0)
    put = await client.reserve_blocks(0, [h(2)], ttl_s=3.0)
    assert table(view, 2) == [read.lease_id, put.lease_id] and list(put.block_ids) == [2]
    now[0] += 3.0
    assert running.reaper is not None
    running.reaper.reap()
    # Each slot cleared while its lease still held its block (pinned or reserved: ref 1), then the
    # read lease's block let go; the lapsed put lease's block stays held one more ttl (its putter
    # may still be copying into it) until its putter's commit (refused) lets it go.
    assert seen == [(1, [1, 1], [read.lease_id, put.lease_id]), (2, [0, 1], [0, put.lease_id])]
    assert table(view, 2) == [0, 0] and [pool.blocks[1].ref_cnt, pool.blocks[2].ref_cnt] == [0, 1]
    assert not view.lease_live(1, read.lease_id) and not view.lease_live(2, put.lease_id)
    assert (await client.release_lease(read.lease_id)).valid is False
    assert (await client.commit_blocks(put.lease_id)).committed is False
    assert pool.blocks[2].ref_cnt == 0 and tier.num_leased_blocks == 0
    view.close()


async def test_a_lapsed_put_lease_holds_its_blocks_one_more_ttl_then_the_reaper_frees_them(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    now = fake_clock(running)
    client = await connect(running)
    tier = running.engine.tier
    pool = running.engine.manager.block_pool
    put = await client.reserve_blocks(0, [h(1), h(2)], ttl_s=3.0)
    assert list(put.block_ids) == [1, 2]
    now[0] += 3.0  # expired: the putter's copy may still be running
    other = await client.reserve_blocks(0, [h(3)], ttl_s=10.0)
    assert list(other.block_ids) == [3]  # not block 1 or 2: a late copy cannot land in another key's block
    assert tier.num_leased_blocks == 3 and tier.next_deadline() == 1006.0
    running.check_invariants()  # the lapsed lease's holds are accounted for
    now[0] += 3.0
    assert running.reaper is not None
    running.reaper.reap()  # one ttl after the expiry: free again, uncached (no event)
    assert [pool.blocks[b].ref_cnt for b in (1, 2, 3)] == [0, 0, 1]
    assert tier.num_leased_blocks == 1 and tier.next_deadline() == 1013.0
    assert (await client.release_lease(put.lease_id)).valid is False
    assert (await client.release_lease(other.lease_id)).valid


async def test_reset_prefix_cache_is_refused_while_any_lease_holds_blocks_and_leaves_the_table(
    start_kv_server, connect
):
    running = await start_kv_server(**CPU, tier_max_leases=2)
    client = await connect(running)
    view = await aattach(client)
    await client.put_blocks(0, [(h(1), pattern(1))])
    read = await client.lease_blocks(0, [h(1)])
    assert (await client.reset_prefix_cache()).reset is False
    assert table(view, 2) == [read.lease_id, 0]
    assert view.lease_live(1, read.lease_id) and block_bytes(view, 1) == pattern(1)
    assert (await client.release_lease(read.lease_id)).valid
    put = await client.reserve_blocks(0, [h(2)])
    assert (await client.reset_prefix_cache()).reset is False  # a reserved block is held too
    assert table(view, 2) == [put.lease_id, 0]
    assert (await client.release_lease(put.lease_id)).valid
    assert (await client.reset_prefix_cache()).reset is True
    assert table(view, 2) == [0, 0]
    assert list((await client.lookup_blocks(0, [h(1)])).present) == [False]
    view.close()


async def test_a_server_without_a_lease_board_answers_slot_0_and_writes_no_slot(start_kv_server, connect):
    running = await start_kv_server(**CPU, tier_max_leases=2)
    running.engine.tier.lease_board = None
    client = await connect(running)
    view = await aattach(client)
    await client.put_blocks(0, [(h(1), pattern(1))])
    read = await client.lease_blocks(0, [h(1)])
    put = await client.reserve_blocks(0, [h(2)])
    assert (read.lease_slot, put.lease_slot) == (0, 0) and read.lease_id and put.lease_id
    assert table(view, 2) == [0, 0]
    assert not view.lease_live(read.lease_slot, read.lease_id)
    assert (await client.release_lease(read.lease_id)).valid
    assert (await client.commit_blocks(put.lease_id)).committed is True
    assert running.engine.tier.num_leases == 0
    view.close()


async def test_a_stopped_server_s_table_reads_no_lease_live_even_with_ids_left_in_it(start_kv_server, connect):
    # The server does not clear the slots of leases live at its stop (nothing drops them): the
    # control segment's closed state is what a reader goes by.
    running = await start_kv_server(**CPU, tier_max_leases=2)
    client = await connect(running)
    view = await aattach(client)
    await client.put_blocks(0, [(h(1), pattern(1))])
    read = await client.lease_blocks(0, [h(1)])
    control = view._control
    assert control is not None
    await running.stop(0)
    assert int.from_bytes(control[64:72], "little") == read.lease_id
    assert view.closed and not view.lease_live(1, read.lease_id)
    assert not control_exists(view)
    view.close()


def test_lease_slots_cost_memory_in_proportion_to_live_leases_not_to_tier_max_leases():
    # Slots are handed out as leases start (a high-water mark and the freed ones), not built for
    # every possible lease at start.
    pool = BlockPool(6, 1, enable_kv_cache_events=True)
    tracemalloc.start()
    try:
        tier = TierStore(pool, [4], digest_bytes=32, limits=TierLimits(max_leases=200_000))
        allocated, _peak = tracemalloc.get_traced_memory()  # while it lives
    finally:
        tracemalloc.stop()
    assert tier.num_leases == 0
    assert allocated < 1 << 20, f"a TierStore with no lease live holds {allocated} bytes"


async def test_a_lease_carries_the_releases_of_leases_its_caller_is_done_with(start_kv_server, connect):
    running = await start_kv_server(**CPU, tier_max_leases=2)
    client = await connect(running)
    view = await aattach(client)
    tier = running.engine.tier
    await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))])
    first = await client.lease_blocks(0, [h(1)])
    second = await client.lease_blocks(0, [h(2)])
    assert tier.num_leases == 2
    # At tier_max_leases: a lease carrying the first's release ends it first, then takes its slot.
    third = await client.lease_blocks(
        pb.LeaseBlocksRequest(group_idx=0, block_hashes=[h(1)], release_lease_ids=[first.lease_id])
    )
    assert (list(third.block_ids), third.lease_slot) == ([1], 1)
    assert not view.lease_live(1, first.lease_id) and view.lease_live(1, third.lease_id)
    # A bad field refuses the whole call first: nothing it names is ended.
    with pytest.raises(KVServiceError) as caught:
        await client.lease_blocks(
            pb.LeaseBlocksRequest(group_idx=0, block_hashes=[bytes(3)], release_lease_ids=[second.lease_id])
        )
    assert (caught.value.code, caught.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "block_hashes[0]: 3 bytes; a block hash is the server's 32-byte digest",
    )
    with pytest.raises(KVServiceError) as caught:
        await client.lease_blocks(pb.LeaseBlocksRequest(group_idx=0, release_lease_ids=[second.lease_id] * 3))
    assert (caught.value.code, caught.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "release_lease_ids: 3 leases, above tier_max_leases 2",
    )
    assert tier.num_leases == 2 and view.lease_live(2, second.lease_id)
    # A lease of no key carrying releases only ends them (unknown or ended ids are skipped).
    done = await client.lease_blocks(
        pb.LeaseBlocksRequest(group_idx=0, release_lease_ids=[second.lease_id, first.lease_id])
    )
    assert (done.lease_id, list(done.block_ids), tier.num_leases) == (0, [], 1)
    done = await client.lease_blocks(pb.LeaseBlocksRequest(group_idx=0, release_lease_ids=[third.lease_id]))
    assert (done.lease_id, list(done.block_ids), tier.num_leases) == (0, [], 0)
    assert not view.lease_live(1, third.lease_id) and not view.lease_live(2, second.lease_id)
    view.close()
