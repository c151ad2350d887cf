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
        if a.WhichOneof("result") == "allocate_slots":  # each server answers its own epoch
            assert (a.allocate_slots.epoch, b.allocate_slots.epoch) == (
                (plain_server.event_log.epoch, packed_server.event_log.epoch)
                if a.allocate_slots.allocated
                else ("", "")
            )
            a.allocate_slots.ClearField("epoch")
            b.allocate_slots.ClearField("epoch")
        assert a == b, f"op {i} ({ops[i].WhichOneof('op')}): {a} != {b}"
    assert await server_state(plain_server, plain) == await server_state(packed_server, packed_client)
    plain_events = flat_events((await plain.take_events("all")).batches)
    assert flat_events((await packed_client.take_events("all")).batches) == plain_events
    assert len(plain_events) == 16 and any(isinstance(e, BlockRemoved) for e in plain_events)
    packed_server.engine.check_invariants()
    # Both Steps' prompts were hashed beside the loop (every lookup with a prompt: no extra keys here).
    num_prompts = sum(op.get_computed_blocks.packed_prompt_token_ids != b"" for op in packed)
    assert (
        packed_server.servicer.num_prompts_hashed_ahead == plain_server.servicer.num_prompts_hashed_ahead == num_prompts
    )


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


async def test_a_step_of_packed_prompts_hashed_ahead_answers_as_the_same_prompts_as_lists(start_kv_server, connect):
    """Lookups whose prompts are hashed beside the loop (two or more, no extra keys) beside
    ones that are not (LoRA, cache salt, a negative id, a bad length, a repeat), against the same
    Step with every prompt as a list on a twin server: the same answers (errors naming the field
    each caller set), state and events."""
    shared = list(range(100, 132))  # two blocks of 16
    plain = [
        pb.GetComputedBlocksRequest(request_id="a", prompt_token_ids=shared + [1, 2, 3]),
        pb.GetComputedBlocksRequest(request_id="lora", prompt_token_ids=shared, lora=pb.LoRA(lora_id=1, lora_name="x")),
        pb.GetComputedBlocksRequest(request_id="salted", prompt_token_ids=shared, cache_salt="s"),
        pb.GetComputedBlocksRequest(request_id="negative", prompt_token_ids=shared[:20] + [-4] + shared[21:]),
        pb.GetComputedBlocksRequest(request_id="b", prompt_token_ids=shared + list(range(16))),
        pb.GetComputedBlocksRequest(request_id="a", prompt_token_ids=shared + [1, 2, 3]),  # a waiting request again
    ]
    packed = [pb.GetComputedBlocksRequest.FromString(r.SerializeToString()) for r in plain]
    for request in packed:
        ids = list(request.prompt_token_ids)
        del request.prompt_token_ids[:]
        request.packed_prompt_token_ids = struct.pack(f"<{len(ids)}i", *ids)
    bad_length = pb.GetComputedBlocksRequest(request_id="odd", packed_prompt_token_ids=b"\1\0\0\0\2")
    plain_server, packed_server = await start_kv_server(), await start_kv_server()
    plain_client, packed_client = await connect(plain_server), await connect(packed_server)
    admit = [pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id="a", num_new_tokens=35))]
    plain_results = (await plain_client.step([pb.StepOp(get_computed_blocks=r) for r in plain] + admit)).results
    packed_step = [pb.StepOp(get_computed_blocks=r) for r in packed] + [pb.StepOp(get_computed_blocks=bad_length)]
    packed_results = (await packed_client.step(packed_step + admit)).results
    # Hashed ahead: all but the LoRA and salted lookups; of the varints, not the one with a negative id.
    assert packed_server.servicer.num_prompts_hashed_ahead == 5 and plain_server.servicer.num_prompts_hashed_ahead == 3
    for i, (a, b) in enumerate(zip(plain_results[:6], packed_results[:6], strict=True)):
        if i == 3:
            assert a.error.message == "prompt_token_ids: token id -4 outside 0..2147483647"
            assert b.error.message == "packed_prompt_token_ids: token id -4 outside 0..2147483647"
            assert a.error.code == b.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            continue
        assert a == b, f"op {i}: {a} != {b}"
    assert packed_results[6].error.message.startswith("packed_prompt_token_ids: 5 bytes, not a multiple of 4")
    assert (plain_results[6].allocate_slots.epoch, packed_results[7].allocate_slots.epoch) == (
        plain_server.event_log.epoch,
        packed_server.event_log.epoch,
    )
    plain_results[6].allocate_slots.ClearField("epoch")  # each server answers its own epoch
    packed_results[7].allocate_slots.ClearField("epoch")
    assert plain_results[6] == packed_results[7] and plain_results[6].allocate_slots.allocated
    assert await server_state(plain_server, plain_client) == await server_state(packed_server, packed_client)
    for name in ("a", "lora", "salted", "b"):
        assert packed_server.engine.requests[name].block_hashes == plain_server.engine.requests[name].block_hashes
    assert packed_server.engine.requests["a"].block_hashes != packed_server.engine.requests["lora"].block_hashes
    plain_events = flat_events((await plain_client.take_events("all", start_seq=1)).batches)
    assert flat_events((await packed_client.take_events("all", start_seq=1)).batches) == plain_events
    assert len(plain_events) == 1 and plain_events[0].block_hashes  # a's two blocks, stored by its admission
