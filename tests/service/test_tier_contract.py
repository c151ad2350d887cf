"""The tier's contract on a real server (docs/tier.md), beyond tests/service/test_tier.py: the
``tier_*`` bounds as settings, the parent hashes and the configured fields on StreamEvents, the
LRU touch's exact eviction order, and two opaque groups' keys independent of each other."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.errors import KVServiceError
from tests.service.helpers import observed_state
from tests.service.test_tier import CPU, h, pattern, taken

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
