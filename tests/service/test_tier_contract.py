"""The tier's contract on a real server (docs/tier.md), beyond tests/service/test_tier.py: the
``tier_*`` bounds as settings, the parent hashes and the configured fields on StreamEvents, the
LRU touch's exact eviction order, and two opaque groups' keys independent of each other."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.errors import KVServiceError
from kvservice_client.events import BlockRemoved, BlockStored
from kvservice_client.torch_view import aattach
from tests.service.helpers import StreamReader, flat_events, observed_state
from tests.service.test_tier import CPU, block_bytes, h, pattern, removed, stored, taken

WRITE, PRESENT = pb.BLOCK_PUT_STATUS_WRITE, pb.BLOCK_PUT_STATUS_PRESENT


def tier_state(running: Any) -> dict[str, Any]:
    """What a refused tier call must also leave as it was: the leases, the blocks they hold, the
    free queue's order (the LRU order), the keys in flight."""
    tier = running.engine.tier
    pool = running.engine.manager.block_pool
    return {
        "leases": sorted(tier._leases),
        "held": sorted(tier.held_block_ids()),
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "in_flight": dict(tier._in_flight),
    }


# -- the bounds are settings ------------------------------------------------------------------


TIGHT = {
    "tier_max_keys_per_call": 2,
    "tier_max_leases": 1,
    "tier_max_lease_ttl_s": 5.0,
    "tier_default_lease_ttl_s": 1.5,
}


async def test_the_tier_bounds_set_on_the_server_refuse_exactly_there_and_change_nothing(start_kv_server, connect):
    running = await start_kv_server(**CPU, **TIGHT)
    client = await connect(running)
    meta = await client.get_kv_cache_group_metadata()
    assert meta.tier_limits == pb.TierLimits(
        max_keys_per_call=2, default_lease_ttl_s=1.5, max_lease_ttl_s=5.0, max_leases=1
    )
    put = await client.put_blocks(0, [(h(1), pattern(1)), (h(2), pattern(2))])  # 2 keys: at the bound
    assert (put.reserved, list(put.block_ids)) == (True, [1, 2])
    lease = await client.lease_blocks(0, [h(1)])  # the one lease, the default ttl
    assert (list(lease.block_ids), lease.ttl_s) == ([1], 1.5)
    await client.take_events("t")
    before = (await observed_state(running, client), tier_state(running))
    refusals = [
        (
            lambda: client.lookup_blocks(0, [h(1), h(2), h(3)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "block_hashes: 3 keys, above tier_max_keys_per_call 2",
        ),
        (
            lambda: client.put_blocks(0, [(h(i), pattern(i)) for i in (3, 4, 5)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "block_hashes: 3 keys, above tier_max_keys_per_call 2",
        ),
        (
            lambda: client.lease_blocks(0, [h(2)], ttl_s=5.5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "ttl_s: 5.5; must be 0 (the default) .. 5.0 seconds (tier_max_lease_ttl_s)",
        ),
        (
            lambda: client.reserve_blocks(0, [h(3)]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "leases: 1 live, at tier_max_leases 1; release some first",
        ),
        (
            lambda: client.lease_blocks(0, [h(2)]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "leases: 1 live, at tier_max_leases 1; release some first",
        ),
        (
            lambda: client.put_blocks(0, [(h(3), pattern(3))]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "leases: 1 live, at tier_max_leases 1; release some first",
        ),
    ]
    for call, code, message in refusals:
        with pytest.raises(KVServiceError) as err:
            await call()
        assert (err.value.code, err.value.message) == (code, message), repr(err.value.message)
        assert (await observed_state(running, client), tier_state(running)) == before, message
    assert await taken(client) == []
    # A lookup needs no lease; a put of present keys takes none: both still answer at the bound.
    assert list((await client.lookup_blocks(0, [h(1), h(2)])).present) == [True, True]
    again = await client.reserve_blocks(0, [h(1), h(2)])
    assert (list(again.status), again.lease_id) == ([PRESENT, PRESENT], 0)
    assert (await client.release_lease(lease.lease_id)).valid
    later = await client.reserve_blocks(0, [h(3)], ttl_s=5.0)  # the lease is free again; 5 s is allowed
    assert (later.reserved, list(later.block_ids), later.ttl_s) == (True, [3], 5.0)


# -- events of blocks stored by hash ----------------------------------------------------------


def tier_stored(hashes: list[int], parent: int | None, *, group: int = 0, block_size: int = 4, **fields: Any) -> Any:
    """A BlockStored of tier blocks: no token ids (the marked exception, docs/tier.md), no LoRA."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[],
        block_size=block_size,
        lora_id=None,
        medium=fields.pop("medium", "GPU"),
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind="full_attention",
        **fields,
    )


async def test_parent_hashes_of_a_put_chain_reach_blockstored_on_streamevents_with_the_configured_fields(
    start_kv_server, connect
):

    running = await start_kv_server(
        device="cpu",
        num_blocks=7,  # block ids 1..6
        kv_events_medium="CPU_TIER",
        kv_events_locality="REMOTE",
        kv_events_ownership="kvservice",
    )
    client = await connect(running)
    reader = await StreamReader.open(client, running)
    configured = {"medium": "CPU_TIER", "locality": "REMOTE", "ownership": "kvservice"}
    # A chain of 3 under a known parent (the chain's root is not in this server): one BlockStored.
    chain = await client.put_blocks(0, [(h(i), pattern(i)) for i in (1, 2, 3)], parent_block_hashes=[h(9), h(1), h(2)])
    assert (chain.reserved, list(chain.block_ids)) == (True, [1, 2, 3])
    # Through the shared memory (Reserve/Commit), a chain from the root: one BlockStored, parent None.
    put = await client.reserve_blocks(0, [h(4), h(5)], parent_block_hashes=[None, h(4)])
    assert (await client.commit_blocks(put.lease_id)).committed
    # Parents that do not chain: one BlockStored per key, each with its own parent.
    await client.put_blocks(0, [(h(6), pattern(6)), (h(7), pattern(7))], parent_block_hashes=[h(3), h(5)])
    batches = await reader.batches(4)
    assert flat_events(batches) == [
        tier_stored([1, 2, 3], 9, **configured),
        tier_stored([4, 5], None, **configured),
        BlockRemoved(
            [1], "CPU_TIER", group_idx=0, kv_cache_spec_kind="full_attention", locality="REMOTE", ownership="kvservice"
        ),
        tier_stored([6], 3, **configured),
        tier_stored([7], 5, **configured),
    ]
    assert [b.seq for b in batches] == [1, 2, 3, 4]  # a PutBlocks that evicts: its reservation, then its commit


# -- touch: the LRU refresh -------------------------------------------------------------------


def free_queue(running: Any) -> list[int]:
    """The free queue's block ids, head (evicted first) to tail."""
    return [b.block_id for b in running.engine.manager.block_pool.free_block_queue.get_all_free_blocks()]


async def test_a_touched_block_survives_the_eviction_that_takes_the_untouched_ones_in_exact_order(
    start_kv_server, connect
):
    running = await start_kv_server(**CPU)  # block ids 1..5
    client = await connect(running)
    await client.put_blocks(0, [(h(i), pattern(i)) for i in range(1, 6)])
    assert free_queue(running) == [1, 2, 3, 4, 5]  # committed in key order: h1's block is evicted first
    await client.take_events("t")
    # A lookup without touch changes no order; with touch, each present key (in the call's order)
    # goes to the tail; a missing key is skipped; no event either way.
    assert list((await client.lookup_blocks(0, [h(1), h(3)])).present) == [True, True]
    assert free_queue(running) == [1, 2, 3, 4, 5]
    touched = await client.lookup_blocks(0, [h(3), h(8), h(1)], touch=True)
    assert (list(touched.present), touched.num_prefix_blocks) == ([True, False, True], 1)
    assert free_queue(running) == [2, 4, 5, 3, 1]
    assert await taken(client) == []
    # A put of one key evicts the least recently used: h2's block, not h1's.
    one = await client.put_blocks(0, [(h(6), pattern(6))])
    assert list(one.block_ids) == [2]
    assert await taken(client) == [removed([2]), stored([6])]
    # Three more: h4, h5, then h3 (touched before h1), in that order, in one BlockRemoved.
    three = await client.put_blocks(0, [(h(i), pattern(i)) for i in (7, 8, 9)])
    assert list(three.block_ids) == [4, 5, 3]
    assert await taken(client) == [removed([4, 5, 3]), stored([7]), stored([8]), stored([9])]
    assert list((await client.lookup_blocks(0, [h(i) for i in range(1, 10)])).present) == [
        True, False, False, False, False, True, True, True, True,
    ]  # fmt: skip
    # A re-put of a present key touches it as well (PRESENT: nothing to write, no event).
    again = await client.reserve_blocks(0, [h(1)])
    assert (list(again.status), again.lease_id) == ([PRESENT], 0)
    assert free_queue(running) == [2, 4, 5, 3, 1]
    assert await taken(client) == []


# -- the hybrid path: two opaque groups -------------------------------------------------------


async def test_two_opaque_groups_keep_their_keys_apart_in_puts_lookups_leases_reads_and_events(
    start_kv_server, connect
):

    running = await start_kv_server(device="cpu", kv_cache_layout="opaque:256x2", block_size=16, num_blocks=6)
    client = await connect(running)
    meta = await client.get_kv_cache_group_metadata()
    assert [(g.group_idx, g.bytes_per_block, g.block_size) for g in meta.groups] == [(0, 256, 16), (1, 256, 16)]
    await client.take_events("t")

    def chunk(group: int, i: int) -> bytes:
        return bytes((group * 101 + i * 7 + k) % 256 for k in range(256))

    # h2 in both groups, with other bytes in each; h1 only in group 0, h3 only in group 1.
    zero = await client.put_blocks(0, [(h(1), chunk(0, 1)), (h(2), chunk(0, 2))], parent_block_hashes=[None, h(1)])
    one = await client.put_blocks(1, [(h(2), chunk(1, 2)), (h(3), chunk(1, 3))], parent_block_hashes=[None, h(2)])
    assert (list(zero.status), list(zero.block_ids)) == ([WRITE, WRITE], [1, 2])
    assert (list(one.status), list(one.block_ids)) == ([WRITE, WRITE], [3, 4])  # one pool: the next free ids
    assert await taken(client) == [
        tier_stored([1, 2], None, group=0, block_size=16),
        tier_stored([2, 3], None, group=1, block_size=16),
    ]
    keys = [h(1), h(2), h(3)]
    assert list((await client.lookup_blocks(0, keys)).present) == [True, True, False]
    assert list((await client.lookup_blocks(1, keys)).present) == [False, True, True]
    mixed = await client.lookup_blocks(0, [h(1), h(1), h(3), h(3)], group_idxs=[0, 1, 0, 1])
    assert (list(mixed.present), mixed.num_prefix_blocks) == ([True, False, False, True], 1)
    # A key present in one group is a write in the other.
    for group, key, status in [(1, h(1), WRITE), (0, h(3), WRITE), (0, h(2), PRESENT)]:
        put = await client.reserve_blocks(group, [key])
        assert (list(put.status), list(put.block_ids)) == ([status], [5 if status == WRITE else 0])
        if put.lease_id:  # aborted: freed uncached, no event
            assert (await client.release_lease(put.lease_id)).valid
    # Reads and leases by (group, hash) give each group's own bytes.
    blocks = await client.read_blocks([(0, h(2)), (1, h(2)), (1, h(3))])
    assert [b.data for b in blocks] == [chunk(0, 2), chunk(1, 2), chunk(1, 3)]
    view = await aattach(client)
    lease = await client.lease_blocks(1, [h(1), h(2)])
    assert (list(lease.block_ids), lease.num_leased) == ([0, 3], 1)
    assert block_bytes(view, 3) == chunk(1, 2)
    assert (await client.release_lease(lease.lease_id)).valid
    # An eviction names its group: the pool's least recently used block is group 0's h1.
    assert await taken(client) == []
    evicting = await client.put_blocks(1, [(h(5), chunk(1, 5)), (h(6), chunk(1, 6))])
    assert list(evicting.block_ids) == [5, 1]
    assert await taken(client) == [
        BlockRemoved([1], "GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
        tier_stored([5], None, group=1, block_size=16),
        tier_stored([6], None, group=1, block_size=16),
    ]
    assert list((await client.lookup_blocks(0, keys)).present) == [False, True, False]
    assert list((await client.lookup_blocks(1, [*keys, h(5), h(6)])).present) == [False, True, True, True, True]


async def test_a_put_refused_at_its_first_chunk_answers_its_status_while_the_client_still_streams(
    start_kv_server, connect
):
    """5 blocks (about 1 MB, far past one HTTP/2 window), the first one's checksum wrong: the
    server refuses at the first chunk and drains the rest, so grpc.aio's client reads the
    INVALID_ARGUMENT it sent, not "Internal error from Core" (grpc/grpc#36066; docs/tier.md)."""
    from kvservice_client.tier import put_blocks_messages, reserve_blocks_request

    running = await start_kv_server(**CPU)
    client = await connect(running)
    await client.take_events("t")
    before = (await observed_state(running, client), tier_state(running))
    keys = [h(i) for i in range(1, 6)]
    messages = list(put_blocks_messages(reserve_blocks_request(0, keys), [pattern(i) for i in range(1, 6)], 1 << 20))
    messages[1].chunk.checksum ^= 1
    with pytest.raises(KVServiceError) as err:
        await client._rpc("PutBlocks", iter(messages), None, None)
    assert (err.value.code, err.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[1].chunk.checksum: missing or not the xxh3_64 of block 0's bytes; nothing of the call was stored",
    )
    assert (await observed_state(running, client), tier_state(running)) == before
    assert await taken(client) == []


# -- more keys than the pool has blocks ---------------------------------------------------------


async def test_more_keys_to_write_than_the_pool_has_blocks_is_invalid_argument_not_a_retry(start_kv_server, connect):
    """``reserved = false`` says "the pool is busy: retry"; a call whose keys to write outnumber
    the whole pool (5 blocks here) could never be answered otherwise, so it is named instead (a
    helper's trial put 300 keys into 255 blocks and got ``reserved = false`` for ever)."""
    running = await start_kv_server(**CPU)  # block ids 1..5
    client = await connect(running)
    put = await client.put_blocks(0, [(h(1), pattern(1))])
    assert (put.reserved, list(put.block_ids)) == (True, [1])
    await client.take_events("t")
    before = (await observed_state(running, client), tier_state(running))
    message = "block_hashes: 6 keys to write, more than the pool's 5 blocks; split the call"
    for call in (
        lambda: client.reserve_blocks(0, [h(i) for i in range(2, 8)]),
        lambda: client.put_blocks(0, [(h(i), pattern(i)) for i in range(2, 8)]),
    ):
        with pytest.raises(KVServiceError) as err:
            await call()
        assert (err.value.code, err.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert (await observed_state(running, client), tier_state(running)) == before
    assert await taken(client) == []
    # The present keys count: they stay pinned while the call allocates.
    with pytest.raises(KVServiceError) as err:
        await client.reserve_blocks(0, [h(i) for i in range(1, 7)])
    assert (
        err.value.message
        == "block_hashes: 5 keys to write and 1 present, more than the pool's 5 blocks; split the call"
    )
    assert (await observed_state(running, client), tier_state(running)) == before
    fits = await client.reserve_blocks(0, [h(i) for i in range(1, 6)])  # four to write and one present
    assert (fits.reserved, list(fits.status), list(fits.block_ids)) == (True, [PRESENT] + [WRITE] * 4, [0, 2, 3, 4, 5])
