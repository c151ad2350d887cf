"""Bad input, table-driven: each case fails with its status code, names the field in its message,
and changes nothing (usage, cached set, request table, block tables, event log head, consumers).
The same bad ops inside a Step answer an OpStatus with the same code and message, and the ops
around them still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError
from tests.service.helpers import next_batch, observed_state

pytestmark = pytest.mark.timeout(30)

MAX_MODEL_LEN = 64
IA = grpc.StatusCode.INVALID_ARGUMENT

SERVER = {
    "max_model_len": MAX_MODEL_LEN,
    "event_max_batches": 4,
    "max_num_requests": 2,
    "max_consumers": 2,
    "max_step_ops": 8,
}


@dataclass
class Ctx:
    """What a case may refer to: the server's epoch and head seq after setup."""

    epoch: str
    head_seq: int
    oldest_seq: int


async def prepare(start_kv_server, connect):
    """A server holding: "run" (running, prompt 1..8 fully computed, blocks 1-2), "wait" (waiting,
    prompt 20..27), six batches with the oldest three trimmed (retention 4: seqs 3..6 kept), consumers
    c1 and c2 (the most allowed) and a full request table (max_num_requests 2)."""
    running = await start_kv_server(**SERVER)
    client = await connect(running)
    await client.get_computed_blocks("run", range(1, 9))
    assert (await client.allocate_slots("run", 8)).allocated
    for i in range(5):
        prompt = [100 * (i + 1) + t for t in range(4)]
        await client.get_computed_blocks(f"p{i}", prompt)
        await client.allocate_slots(f"p{i}", 4)
        await client.free(f"p{i}")
    await client.get_computed_blocks("wait", range(20, 28), session_id="s")
    await client.take_events("c1")
    await client.take_events("c2")
    log = running.event_log
    assert (log.head_seq, log.oldest_seq, set(running.engine.requests)) == (6, 3, {"run", "wait"})
    return running, client, Ctx(log.epoch, log.head_seq, log.oldest_seq)


def gcb(request_id: str = "new", prompt=(1, 2, 3, 4, 5), **fields: Any) -> pb.StepOp:
    request = pb.GetComputedBlocksRequest(request_id=request_id, prompt_token_ids=prompt, **fields)
    return pb.StepOp(get_computed_blocks=request)


def alloc(request_id: str = "wait", num_new_tokens: int = 8, **fields: Any) -> pb.StepOp:
    request = pb.AllocateSlotsRequest(request_id=request_id, num_new_tokens=num_new_tokens, **fields)
    return pb.StepOp(allocate_slots=request)


def free(request_id: str) -> pb.StepOp:
    return pb.StepOp(free=pb.FreeRequest(request_id=request_id))


def stream(**fields: Any) -> pb.StreamEventsRequest:
    return pb.StreamEventsRequest(**fields)


def take(consumer: str = "c1", **fields: Any) -> pb.TakeEventsRequest:
    return pb.TakeEventsRequest(consumer=consumer, **fields)


SEQ = pb.EVENT_START_SEQ


@dataclass
class Case:
    """A bad call: ``build(ctx)`` gives a StepOp (a scheduler op, also run inside a Step), a
    StreamEventsRequest, a TakeEventsRequest or a StepRequest."""

    name: str
    build: Callable[[Ctx], Any]
    code: grpc.StatusCode
    names: tuple[str, ...]  # substrings the message must hold: the field (and the bound)


CASES = [
    # GetComputedBlocks
    Case("empty request id", lambda c: gcb(""), IA, ("request_id: must not be empty",)),
    Case("request id over 256 bytes", lambda c: gcb("r" * 257), IA, ("request_id: longer than 256 bytes",)),
    Case("request id over 256 UTF-8 bytes", lambda c: gcb("é" * 129), IA, ("request_id: longer than 256 bytes",)),
    Case("empty prompt", lambda c: gcb(prompt=[]), IA, ("prompt_token_ids: length 0 outside 1..64",)),
    Case("prompt longer than max_model_len", lambda c: gcb(prompt=range(1, 66)), IA,
         ("prompt_token_ids: length 65 outside 1..64 (max_model_len)",)),
    Case("negative token id", lambda c: gcb(prompt=[1, -1, 2]), IA, ("prompt_token_ids: token id -1",)),
    Case("token id 2^31", lambda c: gcb(prompt=[1, 2**31]), IA, ("prompt_token_ids: token id 2147483648",)),
    Case("unknown report mode", lambda c: gcb(kv_cache_report_mode=7), IA, ("kv_cache_report_mode", "7")),
    Case("empty LoRA name", lambda c: gcb(lora=pb.LoRA(lora_id=1, lora_name="")), IA,
         ("lora.lora_name: must not be empty",)),
    Case("negative LoRA id", lambda c: gcb(lora=pb.LoRA(lora_id=-3, lora_name="a")), IA, ("lora.lora_id", "-3")),
    Case("LoRA path over 1024 bytes", lambda c: gcb(lora=pb.LoRA(lora_id=1, lora_name="a", lora_path="p" * 1025)),
         IA, ("lora.lora_path: longer than 1024 bytes",)),
    Case("multimodal placeholder past the prompt",
         lambda c: gcb(mm_features=[pb.MultiModalFeature(identifier="img", offset=2, length=5)]), IA,
         ("mm_features[0]", "[2, 7)", "(0..5)")),
    Case("multimodal placeholder of length 0",
         lambda c: gcb(mm_features=[pb.MultiModalFeature(identifier="img", offset=1, length=0)]), IA,
         ("mm_features[0]", "non-empty")),
    Case("multimodal placeholder without identifier",
         lambda c: gcb(mm_features=[pb.MultiModalFeature(identifier="img", offset=0, length=1),
                                    pb.MultiModalFeature(identifier="", offset=1, length=1)]), IA,
         ("mm_features[1].identifier: must not be empty",)),
    Case("session id over 1024 bytes", lambda c: gcb(session_id="s" * 1025), IA, ("session_id: longer than 1024",)),
    Case("cache salt over 1024 bytes", lambda c: gcb(cache_salt="s" * 1025), IA, ("cache_salt: longer than 1024",)),
    Case("running request registered again", lambda c: gcb("run", range(1, 9)), grpc.StatusCode.ALREADY_EXISTS,
         ("request_id 'run' is already running",)),
    Case("waiting request with another prompt", lambda c: gcb("wait", range(20, 29), session_id="s"),
         grpc.StatusCode.ALREADY_EXISTS, ("request_id 'wait'", "another prompt")),
    Case("waiting request with another session", lambda c: gcb("wait", range(20, 28), session_id="t"),
         grpc.StatusCode.ALREADY_EXISTS, ("request_id 'wait'", "another prompt or options")),
    Case("request table full", lambda c: gcb("third"), grpc.StatusCode.RESOURCE_EXHAUSTED, ("max_num_requests: 2",)),
    # AllocateSlots
    Case("num_new_tokens 0", lambda c: alloc("wait", 0), IA, ("num_new_tokens: 0 outside 1..64",)),
    Case("num_new_tokens beyond max_model_len", lambda c: alloc("wait", 65), IA, ("num_new_tokens: 65 outside 1..64",)),
    Case("num_lookahead_tokens beyond max_model_len", lambda c: alloc("wait", 8, num_lookahead_tokens=65), IA,
         ("num_lookahead_tokens: 65 outside 0..64",)),
    Case("new tokens beyond max_model_len", lambda c: alloc("run", 1, new_token_ids=range(57)), IA,
         ("new_token_ids: request would hold 65 tokens, above max_model_len 64",)),
    Case("negative new token id", lambda c: alloc("run", 1, new_token_ids=[5, -2]), IA,
         ("new_token_ids: token id -2",)),
    Case("new token id 2^31", lambda c: alloc("run", 1, new_token_ids=[2**31]), IA,
         ("new_token_ids: token id 2147483648",)),
    Case("fully computed request without new tokens", lambda c: alloc("run", 1), IA,
         ("num_new_tokens: all 8 tokens of 'run' are computed",)),
    Case("allocate an unknown request", lambda c: alloc("ghost", 4), grpc.StatusCode.NOT_FOUND,
         ("request_id 'ghost' is not registered",)),
    Case("allocate an empty request id", lambda c: alloc("", 4), IA, ("request_id: must not be empty",)),
    # Free
    Case("free an unknown request", lambda c: free("ghost"), grpc.StatusCode.NOT_FOUND,
         ("request_id 'ghost' is not registered",)),
    Case("free an empty request id", lambda c: free(""), IA, ("request_id: must not be empty",)),
    Case("free an over-long request id", lambda c: free("r" * 300), IA, ("request_id: longer than 256 bytes",)),
    # StreamEvents
    Case("stream from another epoch", lambda c: stream(start=SEQ, start_seq=4, epoch="feedface"),
         grpc.StatusCode.FAILED_PRECONDITION, ("epoch 'feedface'",)),
    Case("stream beyond head + 1", lambda c: stream(start=SEQ, start_seq=c.head_seq + 2), IA,
         ("start_seq: 8 is beyond the head seq 6 + 1",)),
    Case("stream from seq 0", lambda c: stream(start=SEQ, start_seq=0), IA, ("start_seq: 0 must be >= 1",)),
    Case("stream below retention", lambda c: stream(start=SEQ, start_seq=2), grpc.StatusCode.OUT_OF_RANGE,
         ("start_seq 2", "oldest retained batch, seq 3")),
    Case("stream of an unknown group", lambda c: stream(group_idxs=[0, 1]), IA, ("group_idxs: 1 outside 0..0",)),
    Case("stream in an unknown payload format", lambda c: stream(payload_format=9), IA, ("payload_format", "9")),
    Case("stream from an unknown start", lambda c: stream(start=9), IA, ("start: unknown value 9",)),
    # TakeEvents
    Case("take with an empty consumer", lambda c: take(""), IA, ("consumer: must not be empty",)),
    Case("take with an over-long consumer", lambda c: take("c" * 257), IA, ("consumer: longer than 256 bytes",)),
    Case("take from another epoch", lambda c: take(start_seq=4, epoch="feedface"), grpc.StatusCode.FAILED_PRECONDITION,
         ("epoch 'feedface'",)),
    Case("take beyond head + 1", lambda c: take(start_seq=c.head_seq + 2), IA, ("start_seq: 8 is beyond",)),
    Case("take below retention", lambda c: take(start_seq=1), grpc.StatusCode.OUT_OF_RANGE,
         ("start_seq 1", "seq 3")),
    Case("take of an unknown group", lambda c: take(group_idxs=[3]), IA, ("group_idxs: 3 outside 0..0",)),
    Case("take in an unknown payload format", lambda c: take(payload_format=5), IA, ("payload_format", "5")),
    Case("take by one consumer too many", lambda c: take("c3"), grpc.StatusCode.RESOURCE_EXHAUSTED,
         ("max_consumers: 2",)),
    # Step
    Case("step with too many ops", lambda c: pb.StepRequest(ops=[pb.StepOp(get_usage=pb.GetUsageRequest())] * 9),
         IA, ("ops: 9 ops, above max_step_ops 8",)),
]


async def call(client, request: Any) -> Any:
    """Run a bad call through the client facade; return its KVServiceError."""
    with pytest.raises(KVServiceError) as err:
        if isinstance(request, pb.StepOp):
            which = request.WhichOneof("op")
            method = {"get_computed_blocks": client.get_computed_blocks, "allocate_slots": client.allocate_slots,
                      "free": client.free}[which]
            await method(getattr(request, which))
        elif isinstance(request, pb.StreamEventsRequest):
            await next_batch(client.stream_events(request))
        elif isinstance(request, pb.TakeEventsRequest):
            await client.take_events(request)
        else:
            await client.step(request)
    return err.value


def assert_names(message: str, case: Case) -> None:
    for part in case.names:
        assert part in message, f"{case.name}: {part!r} not in {message!r}"


def test_the_table_is_large_enough():
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_call_fails_naming_the_field_and_changes_nothing(start_kv_server, connect, case):
    running, client, ctx = await prepare(start_kv_server, connect)
    before = await observed_state(running, client)
    err = await call(client, case.build(ctx))
    assert err.code == case.code, err
    assert_names(err.message, case)
    assert await observed_state(running, client) == before
    running.engine.check_invariants()


STEP_CASES = [c for c in CASES if isinstance(c.build(Ctx("", 6, 3)), pb.StepOp)]


@pytest.mark.parametrize("case", STEP_CASES, ids=[c.name for c in STEP_CASES])
async def test_bad_op_in_a_step_answers_its_own_status(start_kv_server, connect, case):
    running, client, ctx = await prepare(start_kv_server, connect)
    bad = case.build(ctx)
    unary_error = await call(client, bad)  # changes nothing: the Step below sees the same state
    before = await observed_state(running, client)
    ops = [pb.StepOp(get_usage=pb.GetUsageRequest()), bad, pb.StepOp(get_usage=pb.GetUsageRequest()),
           alloc("run", 1, new_token_ids=[9])]
    results = list((await client.step(pb.StepRequest(ops=ops))).results)
    assert [r.WhichOneof("result") for r in results] == ["get_usage", "error", "get_usage", "allocate_slots"]
    assert results[1].error == pb.OpStatus(code=case.code.value[0], message=unary_error.message)
    assert_names(results[1].error.message, case)
    assert results[0].get_usage == results[2].get_usage == before["usage"]  # the bad op changed nothing
    decode = results[3].allocate_slots
    assert (decode.allocated, decode.num_tokens, decode.num_computed_tokens) == (True, 9, 9)
    after = await observed_state(running, client)
    assert after["requests"] == {**before["requests"], "run": (9, 9)}
    assert after["block_ids"]["run"] == (before["block_ids"]["run"][0] + list(decode.new_block_ids[0].block_ids),)
    for key in ("cached", "pool", "head_seq", "consumers", "running"):
        assert after[key] == before[key], key
    running.engine.check_invariants()


async def test_an_op_with_nothing_set_fails_alone(start_kv_server, connect):
    running, client, _ = await prepare(start_kv_server, connect)
    before = await observed_state(running, client)
    ops = [pb.StepOp(), pb.StepOp(get_usage=pb.GetUsageRequest())]
    results = list((await client.step(pb.StepRequest(ops=ops))).results)
    assert results[0].error == pb.OpStatus(code=IA.value[0], message="op: not set")
    assert results[1].get_usage == before["usage"]
    assert await observed_state(running, client) == before
