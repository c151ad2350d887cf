"""Scheduler-call semantics through the service: a hit that shrinks between lookup and admission, and
"not enough free blocks" as a normal answer that changes nothing."""

from __future__ import annotations

import pytest

from tests.service.helpers import H, TakeReader, events_of, hashes, observed_state, removed, stored

pytestmark = pytest.mark.timeout(30)


def ids(groups) -> list[list[int]]:
    return [list(g.block_ids) for g in groups]


async def test_admission_uses_the_hit_as_it_is_now(start_kv_server, connect):
    running = await start_kv_server(num_blocks=8)
    client = await connect(running)
    reader = await TakeReader.open(client, running)
    await client.get_computed_blocks("A", range(1, 13))
    await client.allocate_slots("A", 12)
    await client.free("A")
    hit = await client.get_computed_blocks("B", [*range(1, 9), 99], kv_cache_report_mode="full")
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (8, [[1, 2]])
    # Another scheduler's request evicts H[1] and H[2] (free queue: 4, 5, 6, 7, 3, 2, 1), then leaves.
    c_prompt = list(range(200, 224))
    await client.get_computed_blocks("C", c_prompt)
    c = await client.allocate_slots("C", 24)
    assert ids(c.new_block_ids) == [[4, 5, 6, 7, 3, 2]]
    await client.free("C")

    b = await client.allocate_slots("B", 9)
    assert (
        b.allocated,
        b.num_new_computed_tokens,
        ids(b.computed_block_ids),
        ids(b.new_block_ids),
        b.num_scheduled_tokens,
        b.num_computed_tokens,
    ) == (True, 4, [[1]], [[2, 3]], 5, 9)
    c_hashes = hashes(c_prompt)
    a_batch, c_batch, b_batch = await reader.batches(3)
    assert events_of(a_batch) == [stored(H[:3], None, range(1, 13))]
    assert events_of(c_batch) == [removed([H[2], H[1]]), stored(c_hashes, None, c_prompt)]
    # The reuse report names the hit actually used; C's tail blocks 2 and 3 are evicted for B's.
    assert events_of(b_batch) == [
        stored([H[0]], None, range(1, 5), reused=True),
        removed([c_hashes[5], c_hashes[4]]),
        stored([H[1]], H[0], range(5, 9)),
    ]
    running.engine.check_invariants()


async def test_not_enough_blocks_is_a_normal_answer_that_changes_nothing(start_kv_server, connect):
    running = await start_kv_server(num_blocks=4)
    client = await connect(running)
    reader = await TakeReader.open(client, running)
    await client.get_computed_blocks("A", range(1, 9), kv_cache_report_mode="full")
    await client.allocate_slots("A", 8)
    await client.get_computed_blocks("B", range(20, 24))
    await client.allocate_slots("B", 4)
    await reader.batches(2)
    before = await observed_state(running, client)

    refused = await client.allocate_slots("A", 4, new_token_ids=[9, 10, 11, 12])
    assert (
        refused.allocated,
        ids(refused.new_block_ids),
        refused.num_scheduled_tokens,
        refused.num_computed_tokens,
        refused.num_tokens,
    ) == (False, [[]], 0, 8, 8)
    waiting = await client.get_computed_blocks("W", range(1, 10), kv_cache_report_mode="full")
    assert waiting.num_computed_tokens == 8
    assert not (await client.allocate_slots("W", 9)).allocated  # needs a third block: none free
    await client.free("W")
    after = await observed_state(running, client)
    assert after["requests"] == before["requests"] and after["block_ids"] == before["block_ids"]
    assert (after["cached"], after["head_seq"]) == (before["cached"], before["head_seq"])
    assert after["usage"].num_free_blocks == before["usage"].num_free_blocks == 0

    await client.free("B")
    granted = await client.allocate_slots("A", 4, new_token_ids=[9, 10, 11, 12])
    assert (granted.allocated, ids(granted.new_block_ids), granted.num_computed_tokens) == (True, [[3]], 12)
    # Block 3 held B's evicted hash; A's third block chains from H[1] as if never refused (no reuse
    # report: A was admitted long ago).
    [batch] = await reader.batches(1)
    assert events_of(batch) == [removed([hashes(range(20, 24))[0]]), stored([H[2]], H[1], range(9, 13))]
    running.engine.check_invariants()
