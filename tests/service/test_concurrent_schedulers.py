"""Two schedulers on separate channels allocating concurrently never hold the same non-shared block."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvservice_client.client import StepBuilder, step_results
from tests.service.helpers import BLOCK_SIZE

pytestmark = pytest.mark.timeout(60)

SYSTEM_PROMPT = list(range(1, 9))  # two full blocks several requests share


def ids(groups) -> list[int]:
    [group] = groups
    return list(group.block_ids)


def assert_no_block_double_booked(engine) -> None:
    """Every block id held by two running requests is a cached prefix block: same position in both
    tables, a hash, and the same tokens up to its end in both requests."""
    manager = engine.manager
    owner: dict[int, tuple[str, int]] = {}
    for rid in sorted(engine.running):
        [table] = manager.get_block_ids(rid)
        for pos, block_id in enumerate(table):
            if block_id == 0:
                continue
            if block_id in owner:
                other, other_pos = owner[block_id]
                assert pos == other_pos, f"block {block_id} at {other_pos} of {other} and {pos} of {rid}"
                assert manager.block_pool.blocks[block_id].block_hash is not None, f"shared block {block_id} uncached"
                end = (pos + 1) * BLOCK_SIZE
                assert engine.requests[rid].prompt_token_ids[:end] == engine.requests[other].prompt_token_ids[:end], (
                    f"block {block_id}: prefixes differ"
                )
            else:
                owner[block_id] = (rid, pos)
    for rid in set(engine.requests) - engine.running:
        assert manager.get_block_ids(rid) in (([],), ()), f"waiting request {rid} holds blocks"


def prompt_for(rng: random.Random, scheduler: int, i: int) -> list[int]:
    unique = [10_000 * (scheduler + 1) + 100 * i + t for t in range(rng.randint(1, 14))]
    return SYSTEM_PROMPT + unique if i % 2 == 0 else unique + [7]


async def test_concurrent_admissions_decodes_and_frees(start_kv_server, connect):
    running = await start_kv_server(num_blocks=64)
    engine = running.engine
    clients = [await connect(running), await connect(running)]
    assert clients[0].channel is not clients[1].channel
    rng = random.Random(1234)
    prompts = {f"s{s}-r{i}": prompt_for(rng, s, i) for s in range(2) for i in range(20)}

    async def admit(scheduler: int, rid: str, use_step: bool):
        client = clients[scheduler]
        prompt = prompts[rid]
        if use_step:
            results = step_results(
                await client.step(StepBuilder().get_computed_blocks(rid, prompt).allocate_slots(rid, len(prompt)))
            )
            return rid, results[1]
        await client.get_computed_blocks(rid, prompt)
        return rid, await client.allocate_slots(rid, len(prompt))

    admissions = await asyncio.gather(
        *(admit(int(rid[1]), rid, use_step=rng.random() < 0.5) for rid in rng.sample(sorted(prompts), len(prompts)))
    )
    granted = {rid: r for rid, r in admissions if r.allocated}
    refused = {rid for rid, r in admissions if not r.allocated}
    assert granted and refused, "the pool must be contended"
    # No block was handed out twice: new blocks of all grants are disjoint (nothing was freed).
    new_ids = [b for r in granted.values() for b in ids(r.new_block_ids)]
    assert len(new_ids) == len(set(new_ids))
    for rid, r in granted.items():
        assert engine.manager.get_block_ids(rid) == (ids(r.computed_block_ids) + ids(r.new_block_ids),)
        assert r.num_computed_tokens == r.num_tokens == len(prompts[rid])
    assert engine.running == set(granted)
    assert set(engine.requests) == set(prompts)
    held = {b for rid in granted for b in engine.manager.get_block_ids(rid)[0]}
    usage = await clients[0].get_usage()
    assert (usage.num_free_blocks, usage.num_running_requests, usage.num_waiting_requests) == (
        63 - len(held),
        len(granted),
        len(refused),
    )
    assert_no_block_double_booked(engine)
    engine.check_invariants()

    # Both schedulers now decode, free and admit at once.
    tables_before = {rid: engine.manager.get_block_ids(rid)[0] for rid in granted}
    to_free = set(rng.sample(sorted(granted), len(granted) // 2))

    async def decode(rid: str):
        client = clients[rng.randrange(2)]
        token = 50_000 + len(engine.requests[rid].prompt_token_ids)
        return rid, await client.allocate_slots(rid, 1, new_token_ids=[token])

    async def free(rid: str):
        return rid, await clients[rng.randrange(2)].free(rid)

    jobs = [decode(rid) for rid in sorted(set(granted) - to_free)]
    jobs += [free(rid) for rid in sorted(to_free)]
    jobs += [admit(int(rid[1]), rid, use_step=True) for rid in sorted(refused)]
    rng.shuffle(jobs)
    results = dict(await asyncio.gather(*jobs))
    for rid in to_free:
        assert rid not in engine.requests
        assert results[rid].num_freed_blocks == len([b for b in tables_before[rid] if b != 0])
    for rid in set(granted) - to_free:
        r = results[rid]
        if r.allocated:
            assert engine.manager.get_block_ids(rid) == (tables_before[rid] + ids(r.new_block_ids),)
            assert r.num_computed_tokens == r.num_tokens == len(prompts[rid]) + 1
        else:
            assert engine.manager.get_block_ids(rid) == (tables_before[rid],)
    for rid in refused:
        r = results[rid]
        if r.allocated:
            assert engine.manager.get_block_ids(rid) == (ids(r.computed_block_ids) + ids(r.new_block_ids),)
    assert_no_block_double_booked(engine)
    engine.check_invariants()
    usage = await clients[1].get_usage()
    held = {b for rid in engine.running for b in engine.manager.get_block_ids(rid)[0] if b != 0}
    assert usage.num_free_blocks == 63 - len(held)
