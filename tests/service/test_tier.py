"""The tier RPCs on a real server (docs/tier.md): puts by hash through the shared memory and over
gRPC, lookups, leases, eviction, refusals, events and two TP ranks' halves of one chunk."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.errors import KVServiceError
from kvservice_client.torch_view import aattach
from tests.service.helpers import events_of, observed_state

CPU = {"device": "cpu", "num_blocks": 6}  # block ids 1..5
BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2  # qwen-2.5-0.5b at block size 4: one block, every layer
WRITE, PRESENT = pb.BLOCK_PUT_STATUS_WRITE, pb.BLOCK_PUT_STATUS_PRESENT


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def pattern(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(BLOCK_BYTES))


def stored(hashes: list[int], parent: int | None = None) -> Any:
    from kvservice_client.events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(hashes: list[int]) -> Any:
    from kvservice_client.events import BlockRemoved

    return BlockRemoved(hashes, "GPU", group_idx=0, kv_cache_spec_kind="full_attention")


async def taken(client: Any) -> list[Any]:
    response = await client.take_events("t")
    return [e for batch in response.batches for e in events_of(batch)]


def block_bytes(view: Any, block_id: int) -> bytes:
    """The block's bytes through an attached view (its views in order, as the data plane defines them)."""
    from kvservice.server.data_plane import _BlockBytes

    block = _BlockBytes(view.block_view(0, block_id))
    return block.read(0, block.total)


def write_block(view: Any, block_id: int, data: bytes, start: int = 0) -> None:
    """Write ``data`` at byte ``start`` of the block's bytes through an attached view (a tier's
    copy into the shared memory; the rest of the block is left as it is)."""
    from kvservice.server.data_plane import _BlockBytes

    block = _BlockBytes(view.block_view(0, block_id))
    whole = bytearray(block.read(0, block.total))
    whole[start : start + len(data)] = data
    block.write(whole)


async def test_a_put_through_shared_memory_is_a_hit_whose_load_is_the_same_bytes(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.take_events("t")
    view = await aattach(client)
    put = await client.reserve_blocks(0, [h(1), h(2)], parent_block_hashes=[None, h(1)])
    assert (put.reserved, list(put.status), list(put.block_ids)) == (True, [WRITE, WRITE], [1, 2])
    write_block(view, 1, pattern(1))
    write_block(view, 2, pattern(2))
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [False, False]
    assert await taken(client) == []  # nothing before the commit
    assert (await client.commit_blocks(put.lease_id)).committed
    assert await taken(client) == [stored([1, 2])]
    found = await client.lookup_blocks(0, [h(1), h(2), h(3)])
    assert (list(found.present), found.num_prefix_blocks) == ([True, True, False], 2)
    lease = await client.lease_blocks(0, [h(2), h(3)])
    assert (list(lease.block_ids), lease.num_leased) == ([2, 0], 1)
    copy = block_bytes(view, 2)
    assert (await client.release_lease(lease.lease_id)).valid
    assert copy == pattern(2)
    # Idempotent re-put: nothing to write, no event.
    again = await client.reserve_blocks(0, [h(1)])
    assert (list(again.status), again.lease_id) == ([PRESENT], 0)
    assert await taken(client) == []
    # Across hosts: the same bytes by hash.
    [block] = await client.read_blocks([(0, h(1))])
    assert block.data == pattern(1)


async def test_put_blocks_over_grpc_then_read_by_hash_and_eviction_with_blockremoved(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.take_events("t")
    response = await client.put_blocks(0, [(h(i), pattern(i)) for i in range(1, 6)], chunk_bytes=10_000)
    assert (response.reserved, list(response.block_ids), response.num_blocks_written, response.lease_expired) == (
        True,
        [1, 2, 3, 4, 5],
        5,
        False,
    )
    assert await taken(client) == [stored([1]), stored([2]), stored([3]), stored([4]), stored([5])]
    # All present: nothing reserved, so no lease to expire.
    again = await client.put_blocks(0, [(h(2), pattern(2))])
    assert (list(again.status), again.num_blocks_written, again.lease_expired) == ([PRESENT], 0, False)
    blocks = await client.read_blocks([(0, h(3)), (0, h(5))])
    assert [b.data for b in blocks] == [pattern(3), pattern(5)]
    # The pool is full: the next put evicts the least recently used unpinned block (h1's).
    more = await client.put_blocks(0, [(h(6), pattern(6))])
    assert list(more.block_ids) == [1]
    assert await taken(client) == [removed([1]), stored([6])]
    assert list((await client.lookup_blocks(0, [h(1), h(6)])).present) == [False, True]
    with pytest.raises(KVServiceError) as err:
        await client.read_blocks([(0, h(1))])
    assert err.value.code == grpc.StatusCode.NOT_FOUND


async def test_put_blocks_given_the_layout_asks_no_metadata_and_the_server_refuses_a_wrong_size(
    start_kv_server, connect, monkeypatch
):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    methods: list[str] = []
    real_rpc = type(client)._rpc

    def recording(self: Any, method: str, *args: Any) -> Any:
        methods.append(method)
        return real_rpc(self, method, *args)

    monkeypatch.setattr(type(client), "_rpc", recording)
    put = await client.put_blocks(0, [(h(1), pattern(1))], chunk_bytes=10_000, bytes_per_block=BLOCK_BYTES)
    assert (put.reserved, list(put.block_ids), put.num_bytes_written) == (True, [1], BLOCK_BYTES)
    assert methods == ["PutBlocks"]
    # A caller that names the wrong size is refused by the server, and nothing of the call is stored.
    with pytest.raises(KVServiceError) as err:
        await client.put_blocks(0, [(h(2), pattern(2)[:-8])], chunk_bytes=10_000, bytes_per_block=BLOCK_BYTES - 8)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [True, False]
    [block] = await client.read_blocks([(0, h(1))])
    assert block.data == pattern(1)


async def test_a_pool_of_pinned_blocks_refuses_a_put_and_changes_nothing(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.put_blocks(0, [(h(i), pattern(i)) for i in range(1, 6)])
    lease = await client.lease_blocks(0, [h(i) for i in range(1, 6)])
    assert list(lease.block_ids) == [1, 2, 3, 4, 5]
    before = await observed_state(running, client)
    refused = await client.reserve_blocks(0, [h(7)])
    assert (refused.reserved, refused.lease_id, list(refused.status)) == (False, 0, [])
    put = await client.put_blocks(0, [(h(8), pattern(8))])
    assert (put.reserved, put.num_blocks_written) == (False, 0)
    assert await observed_state(running, client) == before
    assert (await client.release_lease(lease.lease_id)).valid


async def test_an_expired_lease_is_invalid_at_release_and_an_expired_put_stores_nothing(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    now = [1000.0]
    running.engine.clock = lambda: now[0]
    client = await connect(running)
    await client.put_blocks(0, [(h(1), pattern(1))])
    await client.take_events("t")
    lease = await client.lease_blocks(0, [h(1)], ttl_s=2.0)
    put = await client.reserve_blocks(0, [h(2)], ttl_s=2.0)
    now[0] += 2.0
    assert (await client.release_lease(lease.lease_id)).valid is False
    assert (await client.commit_blocks(put.lease_id)).committed is False
    assert await taken(client) == []
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [True, False]
    assert running.engine.tier is not None and running.engine.tier.num_leases == 0


async def test_a_lease_s_slot_in_the_control_segment_holds_its_id_exactly_while_it_is_live(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    now = [1000.0]
    running.engine.clock = lambda: now[0]
    client = await connect(running)
    view = await aattach(client)
    await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))])
    read = await client.lease_blocks(0, [h(1)], ttl_s=2.0)
    put = await client.reserve_blocks(0, [h(3)])
    other = await client.lease_blocks(0, [h(2)])
    assert (read.lease_slot, put.lease_slot, other.lease_slot) == (1, 2, 3)
    assert view.lease_live(1, read.lease_id) and view.lease_live(2, put.lease_id) and view.lease_live(3, other.lease_id)
    # Another id, slot 0, a slot past the table (tier_max_leases 4096): never live.
    assert not view.lease_live(1, put.lease_id)
    assert not view.lease_live(0, read.lease_id) and not view.lease_live(4097, read.lease_id)
    # Released, committed, expired: the slot no longer names the lease.
    assert (await client.release_lease(other.lease_id)).valid
    assert not view.lease_live(3, other.lease_id)
    assert (await client.commit_blocks(put.lease_id)).committed
    assert not view.lease_live(2, put.lease_id)
    # Past its deadline a lease holds its blocks until something ends it (a lookup does not: it
    # changes nothing), and its slot says so; the next call that takes or ends leases ends it first.
    now[0] += 2.0
    assert list((await client.lookup_blocks(0, [h(1)])).present) == [True]
    assert view.lease_live(1, read.lease_id)
    again = await client.lease_blocks(0, [h(1)])
    assert not view.lease_live(1, read.lease_id)
    # A lease's slot is live only while its server is: stopped, the view reads no lease live.
    assert again.lease_slot == 1 and view.lease_live(1, again.lease_id)
    await running.stop(0)
    assert not view.lease_live(1, again.lease_id)
    view.close()


async def test_two_tp_ranks_halves_of_one_chunk_are_stored_and_found_together(start_kv_server, connect):
    """One key holds every rank's bytes (docs/tier.md): rank 0 writes the first half of the
    reserved block, rank 1 the second (each through its own attached view), one commit."""
    running = await start_kv_server(**CPU)
    rank0, rank1 = await connect(running), await connect(running)
    view0, view1 = await aattach(rank0), await aattach(rank1)
    chunk = pattern(9)
    half = BLOCK_BYTES // 2
    put = await rank0.reserve_blocks(0, [h(9)])
    [block_id] = put.block_ids
    write_block(view0, block_id, chunk[:half], 0)
    write_block(view1, block_id, chunk[half:], half)
    assert (await rank0.commit_blocks(put.lease_id)).committed
    lease = await rank1.lease_blocks(0, [h(9)])
    both = block_bytes(view1, lease.block_ids[0])
    assert (await rank1.release_lease(lease.lease_id)).valid
    assert (both[:half], both[half:]) == (chunk[:half], chunk[half:])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.lookup_blocks(0, [bytes(8)]), "block_hashes[0]: 8 bytes"),
        (lambda c: c.lookup_blocks(2, [h(1)]), "group_idx: 2 is out of range [0, 1)"),
        (lambda c: c.reserve_blocks(0, [h(1), h(1)]), "block_hashes[1]:"),
        (lambda c: c.reserve_blocks(0, [h(1)], token_ids=[1]), "packed_token_ids: 1 token ids for 1 keys"),
        (lambda c: c.reserve_blocks(0, [h(1)], ttl_s=1e9), "ttl_s: 1000000000.0"),
        (lambda c: c.lease_blocks(0, [h(1)] * 4097), "block_hashes: 4097 keys, above tier_max_keys_per_call 4096"),
    ],
)
async def test_bad_fields_are_invalid_argument_naming_the_field(start_kv_server, connect, call, message):
    running = await start_kv_server(**CPU)
    client = await connect(running)
    before = await observed_state(running, client)
    with pytest.raises(KVServiceError) as err:
        await call(client)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message
    assert await observed_state(running, client) == before


async def test_the_opaque_layout_blocks_are_exactly_the_chunk_and_the_metadata_says_so(start_kv_server, connect):
    running = await start_kv_server(device="cpu", kv_cache_layout="opaque:3000", block_size=16, num_blocks=4)
    client = await connect(running)
    meta = await client.get_kv_cache_group_metadata()
    assert (meta.opaque_block_bytes, [g.bytes_per_block for g in meta.groups], meta.groups[0].dtype) == (
        3000,
        [3000],
        "uint8",
    )
    assert meta.tier_limits == pb.TierLimits(
        max_keys_per_call=4096, default_lease_ttl_s=10.0, max_lease_ttl_s=300.0, max_leases=4096
    )
    chunk = bytes(i % 256 for i in range(3000))
    put = await client.put_blocks(0, [(h(1), chunk)])
    assert (list(put.block_ids), put.num_bytes_written) == ([1], 3000)
    [block] = await client.read_blocks([(0, h(1))])
    assert block.data == chunk
    view = await aattach(client)
    lease = await client.lease_blocks(0, [h(1)])
    assert block_bytes(view, lease.block_ids[0]) == chunk
    assert (await client.release_lease(lease.lease_id)).valid


async def test_tier_events_carry_the_configured_locality_and_ownership(start_kv_server, connect):
    running = await start_kv_server(
        device="cpu", num_blocks=3, kv_events_locality="LOCAL", kv_events_ownership="kvservice"
    )
    client = await connect(running)
    await client.take_events("t")
    await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))])
    await client.put_blocks(0, [(h(3), pattern(3))])
    events = await taken(client)
    assert [(type(e).__name__, e.block_hashes, e.locality, e.ownership) for e in events] == [
        ("BlockStored", [1], "LOCAL", "kvservice"),
        ("BlockStored", [2], "LOCAL", "kvservice"),
        ("BlockRemoved", [1], "LOCAL", "kvservice"),
        ("BlockStored", [3], "LOCAL", "kvservice"),
    ]


async def test_a_bad_put_chunk_stores_nothing_of_the_call(start_kv_server, connect):
    from kvservice_client.tier import put_blocks_messages, reserve_blocks_request

    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.take_events("t")
    messages = list(put_blocks_messages(reserve_blocks_request(0, [h(1), h(2)]), [pattern(1), pattern(2)], 1 << 20))
    messages[-1].chunk.checksum ^= 1  # block 1's checksum is wrong
    with pytest.raises(KVServiceError) as err:
        await client._rpc("PutBlocks", iter(messages), None, None)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[2].chunk.checksum" in err.value.message
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [False, False]
    assert await taken(client) == [] and running.engine.tier is not None and running.engine.tier.num_leases == 0
    assert (await client.get_usage()).num_free_blocks == 5


async def test_the_reaper_ends_a_lapsed_lease_and_unpins_its_blocks(start_kv_server, connect):
    running = await start_kv_server(**CPU)
    now = [1000.0]
    running.engine.clock = lambda: now[0]
    client = await connect(running)
    await client.put_blocks(0, [(h(1), pattern(1))])
    lease = await client.lease_blocks(0, [h(1)], ttl_s=2.0)
    assert (await client.get_usage()).num_free_blocks == 4
    now[0] += 2.0
    assert running.reaper is not None
    running.reaper.reap()
    assert (await client.get_usage()).num_free_blocks == 5  # unpinned without a tier call
    assert (await client.release_lease(lease.lease_id)).valid is False


async def test_a_snapshot_holds_tier_blocks_without_token_ids_and_a_watcher_follows(start_kv_server, connect):
    from kvservice_client.events import AllBlocksCleared

    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))], parent_block_hashes=[None, h(1)])
    response = await client.take_events("snap", snapshot=True)
    events = [e for batch in response.batches for e in events_of(batch)]
    # The snapshot's cached set (its parents-first half; the recency half re-announces them, reused).
    assert events[:2] == [AllBlocksCleared(), stored([1, 2])]
    assert all(e.token_ids == [] and e.block_hashes == [1, 2] for e in events[1:])
