"""A Step of 100 mixed ops equals the same ops one by one, on a second fresh server.

Same answers op by op (a failing op answers its own OpStatus and the ops after it still run), same
final state (usage, block tables, request table, cached set) and the same flattened event list;
the Step's events form exactly one batch.
"""

from __future__ import annotations

import random

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError
from kvservice_client.events import BlockRemoved
from tests.service.helpers import FULL_SLIDING, flat_events, pool_hashes, without_epoch

pytestmark = pytest.mark.timeout(30)

NUM_OPS = 100
FAILING = {40: grpc.StatusCode.NOT_FOUND, 41: grpc.StatusCode.INVALID_ARGUMENT, 70: grpc.StatusCode.ALREADY_EXISTS}
"""Op index -> the error it is built to answer; every other op succeeds."""

MAX_MODEL_LEN = 64


def build_ops(seed: int) -> list[pb.StepOp]:
    """Lookups, allocations (prefills, chunked prefills, decodes), frees, usage queries and resets,
    tracking the request table so that only the ops in FAILING fail."""
    rng = random.Random(seed)
    families = [[500 * f + t for t in range(8)] for f in range(1, 4)]
    registered: dict[str, int] = {}  # request id -> tokens
    allocated_once: set[str] = set()
    ops: list[pb.StepOp] = []
    next_id = 0
    for index in range(NUM_OPS):
        if index == 40:
            ops.append(pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id="ghost", num_new_tokens=4)))
            continue
        if index == 41:
            ops.append(pb.StepOp(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="empty")))
            continue
        if index == 70:
            rid = sorted(allocated_once & set(registered))[0]
            ops.append(
                pb.StepOp(get_computed_blocks=pb.GetComputedBlocksRequest(request_id=rid, prompt_token_ids=[1, 2, 3]))
            )
            continue
        roll = rng.random()
        if roll < 0.3 or not registered:
            rid = f"s{next_id}"
            next_id += 1
            prefix = rng.choice(families)[: rng.choice([0, 4, 8])]
            prompt = prefix + [rng.randrange(1, 40) for _ in range(rng.randint(1, 16))]
            request = pb.GetComputedBlocksRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                kv_cache_report_mode=rng.choice([pb.KV_CACHE_REPORT_MODE_FULL, pb.KV_CACHE_REPORT_MODE_INCREMENTAL]),
            )
            if rng.random() < 0.3:
                request.session_id = f"session-{rng.randrange(3)}"
            registered[rid] = len(prompt)
            ops.append(pb.StepOp(get_computed_blocks=request))
        elif roll < 0.65:
            rid = rng.choice(sorted(registered))
            if rid not in allocated_once:
                allocated_once.add(rid)
                request = pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=rng.randint(1, registered[rid]))
            elif registered[rid] + 2 > MAX_MODEL_LEN:
                ops.append(pb.StepOp(free=pb.FreeRequest(request_id=rid)))
                del registered[rid]
                continue
            else:
                new = [rng.randrange(1, 40) for _ in range(rng.randint(1, 2))]
                registered[rid] += len(new)
                request = pb.AllocateSlotsRequest(
                    request_id=rid,
                    num_new_tokens=rng.randint(1, 8),
                    new_token_ids=new,
                    num_lookahead_tokens=rng.choice([0, 0, 3]),
                )
            ops.append(pb.StepOp(allocate_slots=request))
        elif roll < 0.85:
            rid = rng.choice(sorted(registered))
            del registered[rid]
            allocated_once.discard(rid)
            ops.append(pb.StepOp(free=pb.FreeRequest(request_id=rid)))
        elif roll < 0.95:
            ops.append(pb.StepOp(get_usage=pb.GetUsageRequest()))
        else:
            ops.append(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
    return ops


async def run_one(client, op: pb.StepOp) -> pb.StepOpResult:
    """Run one op as its unary RPC; answer it as a Step would."""
    which = op.WhichOneof("op")
    method = {
        "get_computed_blocks": client.get_computed_blocks,
        "allocate_slots": client.allocate_slots,
        "free": client.free,
        "reset_prefix_cache": client.reset_prefix_cache,
        "get_usage": client.get_usage,
    }[which]
    try:
        response = await method(getattr(op, which))
    except KVServiceError as err:
        return pb.StepOpResult(error=pb.OpStatus(code=err.code.value[0], message=err.message))
    return pb.StepOpResult(**{which: response})


async def server_state(running, client) -> dict:
    engine = running.engine
    return {
        "usage": await client.get_usage(),
        "requests": {rid: (r.num_tokens, r.num_computed_tokens) for rid, r in engine.requests.items()},
        "running": set(engine.running),
        "block_ids": {rid: engine.manager.get_block_ids(rid) for rid in engine.requests},
        "cached": running.snapshots.mirror.cached_hashes(),
        "pool": pool_hashes(running),
    }


@pytest.mark.parametrize(("preset", "num_blocks"), [("qwen-2.5-0.5b", 24), ("full-sliding", 40)])
async def test_step_equals_the_same_ops_one_by_one(start_kv_server, connect, preset, num_blocks):
    ops = build_ops(seed=3)
    assert len(ops) == NUM_OPS
    layout = FULL_SLIDING if preset == "full-sliding" else {"preset": preset}
    stepped = await start_kv_server(**layout, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN)
    single = await start_kv_server(**layout, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN)
    step_client, single_client = await connect(stepped), await connect(single)
    for client in (step_client, single_client):
        await client.take_events("all")

    step_results = list((await step_client.step(ops)).results)
    one_by_one = [await run_one(single_client, op) for op in ops]

    assert len(step_results) == NUM_OPS
    failed = {i: r.error.code for i, r in enumerate(step_results) if r.WhichOneof("result") == "error"}
    assert failed == {i: code.value[0] for i, code in FAILING.items()}
    assert "request_id 'ghost' is not registered" in step_results[40].error.message
    assert step_results[41].error.message.startswith("prompt_token_ids: length 0 outside 1..64")
    pairs = zip(without_epoch(step_results, stepped.event_log.epoch), without_epoch(one_by_one, single.event_log.epoch))
    for i, (a, b) in enumerate(pairs):
        assert a == b, f"op {i} ({ops[i].WhichOneof('op')}): {a} != {b}"
    # The workload did what it is for: admissions with hits, refusals or evictions, resets tried.
    kinds = [r.WhichOneof("result") for r in step_results]
    assert kinds.count("allocate_slots") > 20 and kinds.count("free") >= 10 and "reset_prefix_cache" in kinds
    assert any(r.allocate_slots.num_new_computed_tokens for r in step_results)
    assert any(k == "allocate_slots" and not r.allocate_slots.allocated for k, r in zip(kinds, step_results))

    assert await server_state(stepped, step_client) == await server_state(single, single_client)
    step_batches = (await step_client.take_events("all")).batches
    single_batches = (await single_client.take_events("all")).batches
    assert [b.seq for b in step_batches] == [1]  # a Step is one call: one batch
    assert len(single_batches) > 10
    assert flat_events(step_batches) == flat_events(single_batches)
    assert any(isinstance(e, BlockRemoved) for e in flat_events(step_batches))
    stepped.engine.check_invariants()
    single.engine.check_invariants()
