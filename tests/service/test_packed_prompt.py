"""``packed_prompt_token_ids`` (little-endian int32) is the same prompt as ``prompt_token_ids``:
the same ops with every prompt packed give the same answers op by op, the same final state and the
same events on a second fresh server; the client sends int32 buffers packed (which ones:
tests/unit/test_request_builders.py); a Step counts packed prompts against ``max_step_tokens`` as it counts the others."""

from __future__ import annotations

import struct
from array import array

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError, StepBuilder
from kvservice_client.events import BlockRemoved
from tests.service.helpers import flat_events
from tests.service.test_step_equivalence import MAX_MODEL_LEN, NUM_OPS, build_ops, server_state

pytestmark = pytest.mark.timeout(30)


def packed_ops(ops: list[pb.StepOp]) -> list[pb.StepOp]:
    """``ops`` with every GetComputedBlocks prompt moved to ``packed_prompt_token_ids``."""
    out = []
    for op in ops:
        op = pb.StepOp.FromString(op.SerializeToString())
        if op.WhichOneof("op") == "get_computed_blocks":
            request = op.get_computed_blocks
            ids = list(request.prompt_token_ids)
            del request.prompt_token_ids[:]
            request.packed_prompt_token_ids = struct.pack(f"<{len(ids)}i", *ids)
        out.append(op)
    return out


async def test_packed_prompts_give_the_same_answers_state_and_events(start_kv_server, connect):
    ops = build_ops(seed=3)
    packed = packed_ops(ops)
    assert sum(op.get_computed_blocks.packed_prompt_token_ids != b"" for op in packed) > 20
    plain_server = await start_kv_server(num_blocks=24, max_model_len=MAX_MODEL_LEN)
    packed_server = await start_kv_server(num_blocks=24, max_model_len=MAX_MODEL_LEN)
    plain, packed_client = await connect(plain_server), await connect(packed_server)
    for client in (plain, packed_client):
        await client.take_events("all")
    plain_results = list((await plain.step(ops)).results)
    packed_results = list((await packed_client.step(packed)).results)
    assert len(packed_results) == NUM_OPS
    for i, (a, b) in enumerate(zip(plain_results, packed_results, strict=True)):
        if i == 41:  # the one empty prompt: nothing was packed, so the field named is the same
            assert b.error.message.startswith("prompt_token_ids: length 0 outside 1..64")
        assert a == b, f"op {i} ({ops[i].WhichOneof('op')}): {a} != {b}"
    assert await server_state(plain_server, plain) == await server_state(packed_server, packed_client)
    plain_events = flat_events((await plain.take_events("all")).batches)
    assert flat_events((await packed_client.take_events("all")).batches) == plain_events
    assert len(plain_events) == 16 and any(isinstance(e, BlockRemoved) for e in plain_events)
    packed_server.engine.check_invariants()


async def test_the_client_sends_int32_buffers_packed_and_the_server_answers_the_same(start_kv_server, connect):
    running = await start_kv_server()
    client = await connect(running)
    prompt = [7, 300, 2**31 - 1, 0, 5, 6, 7, 8, 9]
    a = await client.get_computed_blocks("list", prompt)
    b = await client.get_computed_blocks("array", array("i", prompt))
    c = await client.step(StepBuilder().get_computed_blocks("bytes", struct.pack("<9i", *prompt)))
    assert a == b == c.results[0].get_computed_blocks
    engine = running.engine
    assert engine.requests["list"].all_token_ids == engine.requests["array"].all_token_ids == prompt
    assert engine.requests["bytes"].all_token_ids == prompt


async def test_a_step_counts_packed_prompts_against_max_step_tokens(start_kv_server, connect):
    running = await start_kv_server(max_step_tokens=10)
    client = await connect(running)
    step = StepBuilder().get_computed_blocks("a", array("i", range(1, 7))).get_computed_blocks("b", range(1, 6))
    with pytest.raises(KVServiceError) as err:
        await client.step(step)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == (
        "ops: 11 tokens (prompt_token_ids, packed_prompt_token_ids and new_token_ids over all ops), above max_step_tokens 10"
    )
    assert running.engine.requests == {} and running.event_log.head_seq == 0
