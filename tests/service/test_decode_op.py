"""The batched decode op equals the same allocations as per-request ops, on a second fresh server.

Two servers get the same admissions, then the same 30 decode steps: one as a Step of
``allocate_slots`` ops (one per request), the other as a Step of one ``decode`` op carrying the
same requests in packed arrays. Every request's outcome (new block ids per group, refusal, error
code and message), every step's event batch, and the final state must be equal.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVCacheClient, KVServiceError, StepBuilder, decode_new_block_ids, step_results
from kvservice_client.events import BlockStored
from tests.service.helpers import FULL_SLIDING, flat_events
from tests.service.test_step_equivalence import server_state

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 64
NUM_STEPS = 30


def _outcome_of_allocate(result: pb.StepOpResult) -> tuple:
    """A per-request op's outcome in the decode op's terms."""
    if result.WhichOneof("result") == "error":
        return ("error", result.error.code, result.error.message)
    a = result.allocate_slots
    if not a.allocated:
        return ("refused",)
    ids = tuple(tuple(g.block_ids) for g in a.new_block_ids)
    return ("changed", ids) if any(ids) else ("same",)


def _outcomes_of_decode(response: pb.DecodeResponse, num_requests: int) -> list[tuple]:
    out: list[tuple] = [("same",)] * num_requests
    for i, ids in decode_new_block_ids(response).items():
        out[i] = ("changed", tuple(tuple(g) for g in ids))
    for i in response.refused_indices:
        out[i] = ("refused",)
    for i, status in zip(response.error_indices, response.errors, strict=True):
        out[i] = ("error", status.code, status.message)
    return out


@pytest.mark.parametrize(
    ("layout", "num_blocks"),
    [({"preset": "qwen-2.5-0.5b"}, 28), (FULL_SLIDING, 48)],
    ids=["qwen-2.5-0.5b", "full-sliding"],
)
async def test_decode_op_equals_per_request_allocations(start_kv_server, connect, layout, num_blocks):
    rng = random.Random(7)
    servers = [await start_kv_server(**layout, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN) for _ in range(2)]
    per_request, batched = [await connect(s) for s in servers]
    prefix = [rng.randrange(1, 40) for _ in range(8)]
    admit = StepBuilder()
    request_ids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(request_ids):
        prompt = (prefix if i % 2 else []) + [rng.randrange(1, 40) for _ in range(rng.randint(3, 10))]
        admit.get_computed_blocks(rid, prompt, kv_cache_report_mode="full" if i % 3 == 0 else None)
        admit.allocate_slots(rid, len(prompt))
    admit.get_computed_blocks("waiting", [1, 2, 3])  # registered, never admitted
    for client in (per_request, batched):
        assert not any(isinstance(r, KVServiceError) for r in step_results(await client.step(admit)))
        await client.take_events("all")

    kinds: set[str] = set()
    for step in range(NUM_STEPS):
        ids = request_ids + ["ghost"] + (["waiting"] if step % 5 == 0 else [])
        rng.shuffle(ids)
        counts = [rng.choice([1, 1, 1, 2]) for _ in ids]
        tokens = [[rng.randrange(1, 40) for _ in range(n)] for n in counts]
        if step == 4:
            tokens[0][0] = 2**31  # out of range: that item fails alone
        num_new = [n + rng.choice([0, 0, 0, 3]) for n in counts]
        lookahead = [rng.choice([0, 0, 0, 2]) for _ in ids]
        ops = StepBuilder()
        for rid, t, n, la in zip(ids, tokens, num_new, lookahead):
            if rid != "waiting":  # allocate_slots would admit it; decode refuses a request not running
                ops.allocate_slots(rid, n, new_token_ids=t, num_lookahead_tokens=la)
        expected = [_outcome_of_allocate(r) for r in (await per_request.step(ops)).results]
        response = await batched.step(
            StepBuilder().decode(
                ids,
                [x for t in tokens for x in t],
                num_new_token_ids=counts,
                num_new_tokens=num_new,
                num_lookahead_tokens=lookahead,
            )
        )
        assert len(response.results) == 1 and response.results[0].WhichOneof("result") == "decode"
        got = _outcomes_of_decode(response.results[0].decode, len(ids))
        waiting = [i for i, rid in enumerate(ids) if rid == "waiting"]
        for i in waiting:
            assert got[i] == (
                "error",
                grpc.StatusCode.INVALID_ARGUMENT.value[0],
                "request_ids: request 'waiting' is not running: admit it with allocate_slots first",
            )
        assert [g for i, g in enumerate(got) if i not in waiting] == expected, f"step {step}"
        kinds.update(o[0] for o in got)
        a, b = (await per_request.take_events("all")).batches, (await batched.take_events("all")).batches
        assert len(a) == len(b) <= 1 and flat_events(a) == flat_events(b), f"step {step}"
    # The workload did what it is for: new blocks, refusals, errors and unchanged requests.
    assert kinds == {"changed", "refused", "error", "same"}
    assert await server_state(servers[0], per_request) == await server_state(servers[1], batched)
    for s in servers:
        s.engine.check_invariants()


async def test_decode_default_lists_are_one_token_each(kv_server, client):
    await client.step(
        StepBuilder()
        .get_computed_blocks("a", [1, 2, 3])
        .allocate_slots("a", 3)
        .get_computed_blocks("b", list(range(5, 13)))
        .allocate_slots("b", 8)
    )
    await client.take_events("all")
    response = await client.decode(["a", "b"], [4, 13])
    # "a" completes its first block (tokens 1..4) in place; "b" (blocks 2 and 3 full) needs a third.
    assert list(response.changed_indices) == [1]
    assert decode_new_block_ids(response) == {1: ([4],)}
    assert not response.refused_indices and not response.error_indices
    events = flat_events((await client.take_events("all")).batches)
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].token_ids == [1, 2, 3, 4]
    assert kv_server.engine.requests["a"].num_computed_tokens == 4
    assert kv_server.engine.requests["b"].num_computed_tokens == 9


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_new_token_ids=[1]), "num_new_token_ids: 1 entries for 2 request_ids (give one each or none)"),
        (dict(num_new_tokens=[1, 1, 1]), "num_new_tokens: 3 entries for 2 request_ids (give one each or none)"),
        (dict(num_lookahead_tokens=[0]), "num_lookahead_tokens: 1 entries for 2 request_ids (give one each or none)"),
        (dict(num_new_token_ids=[2, 2]), "new_token_ids: 2 ids, but num_new_token_ids adds up to 4"),
    ],
)
async def test_decode_lists_that_do_not_fit_change_nothing(kv_server, client, fields, message):
    await client.step(StepBuilder().get_computed_blocks("a", [1, 2, 3]).allocate_slots("a", 3))
    before = kv_server.engine.requests["a"].num_tokens
    with pytest.raises(KVServiceError) as info:
        await client.decode(["a", "a"], [4, 5], **fields)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == message
    assert kv_server.engine.requests["a"].num_tokens == before


async def test_decode_requests_count_toward_max_step_ops(start_kv_server, connect):
    running = await start_kv_server(max_step_ops=4)
    client = await connect(running)
    with pytest.raises(KVServiceError) as info:
        await client.step(StepBuilder().decode([f"r{i}" for i in range(4)], [1, 2, 3, 4]).get_usage())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == "ops: 5 ops (each decode request counts as one), above max_step_ops 4"


def test_decode_new_block_ids_checks_counts():
    response = pb.DecodeResponse(changed_indices=[2], new_block_ids=[7], num_new_block_ids=[1, 1], num_groups=2)
    with pytest.raises(ValueError, match="2 counts summing to 2 for 1 changed requests of 2 groups and 1 block ids"):
        decode_new_block_ids(response)
    ok = pb.DecodeResponse(
        changed_indices=[0, 3], new_block_ids=[7, 8, 9], num_new_block_ids=[1, 0, 1, 1], num_groups=2
    )
    assert decode_new_block_ids(ok) == {0: ([7], []), 3: ([8], [9])}


async def test_sync_client_decode_and_its_errors(kv_server):
    def run() -> tuple[pb.DecodeResponse, KVServiceError]:
        with KVCacheClient(kv_server.address) as sync_client:
            sync_client.step(StepBuilder().get_computed_blocks("a", [1, 2, 3]).allocate_slots("a", 3))
            response = sync_client.decode(["a", "ghost"], [4, 5])
            with pytest.raises(KVServiceError) as info:
                sync_client.decode(["a"], [4, 5])
            with pytest.raises(TypeError, match="a sequence of request ids, not one string"):
                sync_client.decode("a", [4])
            return response, info.value

    response, error = await asyncio.to_thread(run)
    assert list(response.changed_indices) == [] and list(response.error_indices) == [1]
    assert response.errors[0].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "new_token_ids: 2 ids, but num_new_token_ids adds up to 1"
    assert kv_server.engine.requests["a"].num_computed_tokens == 4
