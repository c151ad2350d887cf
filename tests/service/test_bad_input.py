"""Bad input, table-driven: each case fails with its status code, names the field in its message,
and changes nothing (usage, cached set, request table, block tables, the event log's head, retained
batches and snapshot, consumers' cursors, subscribers). The same bad ops inside a Step answer an
OpStatus with the same code and message, and the ops around them still run.

The table covers every RPC: the fields a scheduler or a watcher can get wrong, and, for every RPC,
request bytes that are not a valid message (sent raw, as a broken client would). ``docs/VALIDATION.md``
is generated from it by ``scripts/gen_validation_doc.py`` (``tests/service/test_validation_doc.py``
fails when the document is stale).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError
from tests.service.helpers import next_batch, observed_state

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 64
IA = grpc.StatusCode.INVALID_ARGUMENT
SERVICE = "kvservice.v1.KVCacheService"

SERVER = {
    "max_model_len": MAX_MODEL_LEN,
    "event_max_batches": 4,
    "max_num_requests": 2,
    "max_consumers": 2,
    "max_step_ops": 8,
}
"""Overrides of the test server (block size 4, 16 blocks: the pool holds at most 60 tokens)."""


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


def packed(token_ids) -> bytes:
    """``packed_prompt_token_ids`` of ``token_ids``: little-endian int32."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def alloc(request_id: str = "wait", num_new_tokens: int = 8, **fields: Any) -> pb.StepOp:
    request = pb.AllocateSlotsRequest(request_id=request_id, num_new_tokens=num_new_tokens, **fields)
    return pb.StepOp(allocate_slots=request)


def free(request_id: str) -> pb.StepOp:
    return pb.StepOp(free=pb.FreeRequest(request_id=request_id))


def stream(**fields: Any) -> pb.StreamEventsRequest:
    return pb.StreamEventsRequest(**fields)


def take(consumer: str = "c1", **fields: Any) -> pb.TakeEventsRequest:
    return pb.TakeEventsRequest(consumer=consumer, **fields)


def mm(identifier: str = "img", offset: int = 0, length: int = 1) -> pb.MultiModalFeature:
    return pb.MultiModalFeature(identifier=identifier, offset=offset, length=length)


@dataclass(frozen=True)
class Raw:
    """Request bytes sent as they are to ``method`` (no client-side serializer), as a broken or
    foreign client would send them."""

    method: str
    data: bytes


SEQ = pb.EVENT_START_SEQ
LIVE = pb.EVENT_START_LIVE
U32 = 2**32 - 1
U64 = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
BAD_UTF8 = b"\xc3\x28"  # a two-byte UTF-8 lead byte followed by a non-continuation byte


@dataclass
class Case:
    """A bad call: ``build(ctx)`` gives a StepOp (a scheduler op, also run inside a Step), a
    StreamEventsRequest, a TakeEventsRequest, a StepRequest or :class:`Raw` bytes.

    Attributes:
        name: the test id.
        field: the field that is bad (``request`` for bytes that are not a message).
        value: the bad value, as the docs show it.
        code: the status the call gets.
        names: substrings the message must hold: the field (and the bound).
    """

    name: str
    field: str
    value: str
    build: Callable[[Ctx], Any]
    code: grpc.StatusCode
    names: tuple[str, ...]


CASES = [
    # GetComputedBlocks
    Case("empty request id", "request_id", '""', lambda c: gcb(""), IA, ("request_id: must not be empty",)),
    Case(
        "request id over 256 bytes",
        "request_id",
        '"r" * 257',
        lambda c: gcb("r" * 257),
        IA,
        ("request_id: longer than 256 bytes",),
    ),
    Case(
        "request id over 256 UTF-8 bytes",
        "request_id",
        '"é" * 129 (258 bytes)',
        lambda c: gcb("é" * 129),
        IA,
        ("request_id: longer than 256 bytes",),
    ),
    Case(
        "request id not UTF-8",
        "request_id",
        "bytes c3 28",
        lambda c: Raw(
            "GetComputedBlocks",
            b"\x0a\x02" + BAD_UTF8 + pb.GetComputedBlocksRequest(prompt_token_ids=[1]).SerializeToString(),
        ),
        IA,
        ("request_id: not valid UTF-8 (a string of kvservice.v1.GetComputedBlocksRequest)",),
    ),
    Case(
        "empty prompt",
        "prompt_token_ids",
        "[]",
        lambda c: gcb(prompt=[]),
        IA,
        ("prompt_token_ids: length 0 outside 1..64",),
    ),
    Case(
        "prompt longer than max_model_len",
        "prompt_token_ids",
        "65 tokens",
        lambda c: gcb(prompt=range(1, 66)),
        IA,
        ("prompt_token_ids: length 65 outside 1..64 (max_model_len)",),
    ),
    Case(
        "prompt the pool can never hold",
        "prompt_token_ids",
        "61 tokens (pool: 15 blocks of 4)",
        lambda c: gcb(prompt=range(1, 62)),
        IA,
        ("prompt_token_ids: length 61 needs at least 16 blocks", "the pool has 15 (at most 60 tokens)"),
    ),
    Case(
        "negative token id",
        "prompt_token_ids",
        "[1, -1, 2]",
        lambda c: gcb(prompt=[1, -1, 2]),
        IA,
        ("prompt_token_ids: token id -1",),
    ),
    Case(
        "token id 2^31",
        "prompt_token_ids",
        "[1, 2^31]",
        lambda c: gcb(prompt=[1, 2**31]),
        IA,
        ("prompt_token_ids: token id 2147483648",),
    ),
    Case(
        "most negative token id in a long prompt",
        "prompt_token_ids",
        "20 tokens, the 13th -2^63",
        lambda c: gcb(prompt=[*range(12), I64_MIN, *range(7)]),
        IA,
        (f"prompt_token_ids: token id {I64_MIN} outside 0..2147483647",),
    ),
    Case(
        "largest int64 token id in a long prompt",
        "prompt_token_ids",
        "20 tokens, the last 2^63-1",
        lambda c: gcb(prompt=[*range(19), I64_MAX]),
        IA,
        (f"prompt_token_ids: token id {I64_MAX}",),
    ),
    Case(
        "packed prompt beside prompt_token_ids",
        "packed_prompt_token_ids",
        "[1, 2] packed, with prompt_token_ids [1, 2]",
        lambda c: gcb(prompt=[1, 2], packed_prompt_token_ids=packed([1, 2])),
        IA,
        ("packed_prompt_token_ids: set with 2 prompt_token_ids: set one of the two",),
    ),
    Case(
        "packed prompt not a multiple of 4 bytes",
        "packed_prompt_token_ids",
        "7 bytes",
        lambda c: gcb(prompt=[], packed_prompt_token_ids=packed([1, 2])[:7]),
        IA,
        ("packed_prompt_token_ids: 7 bytes, not a multiple of 4 (little-endian int32 token ids)",),
    ),
    Case(
        "negative token id, packed",
        "packed_prompt_token_ids",
        "[1, -1, 2]",
        lambda c: gcb(prompt=[], packed_prompt_token_ids=packed([1, -1, 2])),
        IA,
        ("packed_prompt_token_ids: token id -1 outside 0..2147483647",),
    ),
    Case(
        "negative token id in a long packed prompt",
        "packed_prompt_token_ids",
        "20 tokens, the 13th -2^31",
        lambda c: gcb(prompt=[], packed_prompt_token_ids=packed([*range(12), -(2**31), *range(7)])),
        IA,
        ("packed_prompt_token_ids: token id -2147483648 outside 0..2147483647",),
    ),
    Case(
        "packed prompt longer than max_model_len",
        "packed_prompt_token_ids",
        "65 tokens",
        lambda c: gcb(prompt=[], packed_prompt_token_ids=packed(range(1, 66))),
        IA,
        ("packed_prompt_token_ids: length 65 outside 1..64 (max_model_len)",),
    ),
    Case(
        "unknown report mode",
        "kv_cache_report_mode",
        "7",
        lambda c: gcb(kv_cache_report_mode=7),
        IA,
        ("kv_cache_report_mode", "7"),
    ),
    Case(
        "negative report mode",
        "kv_cache_report_mode",
        "-1",
        lambda c: gcb(kv_cache_report_mode=-1),
        IA,
        ("kv_cache_report_mode: unknown value -1",),
    ),
    Case(
        "empty LoRA name",
        "lora.lora_name",
        '""',
        lambda c: gcb(lora=pb.LoRA(lora_id=1, lora_name="")),
        IA,
        ("lora.lora_name: must not be empty",),
    ),
    Case(
        "LoRA name over 1024 bytes",
        "lora.lora_name",
        '"n" * 1025',
        lambda c: gcb(lora=pb.LoRA(lora_id=1, lora_name="n" * 1025)),
        IA,
        ("lora.lora_name: longer than 1024 bytes",),
    ),
    Case(
        "negative LoRA id",
        "lora.lora_id",
        "-3",
        lambda c: gcb(lora=pb.LoRA(lora_id=-3, lora_name="a")),
        IA,
        ("lora.lora_id", "-3"),
    ),
    Case(
        "most negative LoRA id",
        "lora.lora_id",
        "-2^63",
        lambda c: gcb(lora=pb.LoRA(lora_id=I64_MIN, lora_name="a")),
        IA,
        (f"lora.lora_id: {I64_MIN} is negative",),
    ),
    Case(
        "LoRA path over 1024 bytes",
        "lora.lora_path",
        '"p" * 1025',
        lambda c: gcb(lora=pb.LoRA(lora_id=1, lora_name="a", lora_path="p" * 1025)),
        IA,
        ("lora.lora_path: longer than 1024 bytes",),
    ),
    Case(
        "multimodal placeholder past the prompt",
        "mm_features[0]",
        "offset 2, length 5 (5-token prompt)",
        lambda c: gcb(mm_features=[mm(offset=2, length=5)]),
        IA,
        ("mm_features[0]", "[2, 7)", "(0..5)"),
    ),
    Case(
        "multimodal placeholder at the prompt's end",
        "mm_features[0]",
        "offset 5, length 1 (5-token prompt)",
        lambda c: gcb(mm_features=[mm(offset=5, length=1)]),
        IA,
        ("mm_features[0]: placeholder [5, 6)", "(0..5)"),
    ),
    Case(
        "multimodal placeholder at offset 2^32-1",
        "mm_features[0]",
        "offset 2^32-1, length 1",
        lambda c: gcb(mm_features=[mm(offset=U32, length=1)]),
        IA,
        ("mm_features[0]: placeholder [4294967295, ",),
    ),
    Case(
        "multimodal placeholder of length 2^32-1",
        "mm_features[1]",
        "offset 0, length 2^32-1",
        lambda c: gcb(mm_features=[mm(), mm(offset=0, length=U32)]),
        IA,
        ("mm_features[1]: placeholder [0, 4294967295)",),
    ),
    Case(
        "multimodal placeholders out of prompt order",
        "mm_features[1]",
        "offsets 3 then 0",
        lambda c: gcb(mm_features=[mm("a", offset=3, length=1), mm("b", offset=0, length=2)]),
        IA,
        ("mm_features[1]: placeholder [0, 2) starts before the end of mm_features[0] (4)", "in prompt order"),
    ),
    Case(
        "overlapping multimodal placeholders",
        "mm_features[1]",
        "[0, 3) then [2, 4)",
        lambda c: gcb(mm_features=[mm("a", offset=0, length=3), mm("b", offset=2, length=2)]),
        IA,
        ("mm_features[1]: placeholder [2, 4) starts before the end of mm_features[0] (3)", "disjoint"),
    ),
    Case(
        "multimodal placeholder of length 0",
        "mm_features[0]",
        "offset 1, length 0",
        lambda c: gcb(mm_features=[mm(offset=1, length=0)]),
        IA,
        ("mm_features[0]", "non-empty"),
    ),
    Case(
        "multimodal placeholder without identifier",
        "mm_features[1].identifier",
        '""',
        lambda c: gcb(mm_features=[mm(), mm("", offset=1)]),
        IA,
        ("mm_features[1].identifier: must not be empty",),
    ),
    Case(
        "multimodal identifier over 1024 bytes",
        "mm_features[0].identifier",
        '"h" * 1025',
        lambda c: gcb(mm_features=[mm("h" * 1025)]),
        IA,
        ("mm_features[0].identifier: longer than 1024 bytes",),
    ),
    Case(
        "session id over 1024 bytes",
        "session_id",
        '"s" * 1025',
        lambda c: gcb(session_id="s" * 1025),
        IA,
        ("session_id: longer than 1024",),
    ),
    Case(
        "session id over 1024 UTF-8 bytes",
        "session_id",
        '"é" * 513 (1026 bytes)',
        lambda c: gcb(session_id="é" * 513),
        IA,
        ("session_id: longer than 1024 bytes",),
    ),
    Case(
        "cache salt over 1024 bytes",
        "cache_salt",
        '"s" * 1025',
        lambda c: gcb(cache_salt="s" * 1025),
        IA,
        ("cache_salt: longer than 1024",),
    ),
    Case(
        "cache salt over 1024 UTF-8 bytes",
        "cache_salt",
        '"\U0001f9c2" * 257 (1028 bytes)',
        lambda c: gcb(cache_salt="\U0001f9c2" * 257),
        IA,
        ("cache_salt: longer than 1024 bytes",),
    ),
    Case(
        "running request registered again",
        "request_id",
        '"run" (running)',
        lambda c: gcb("run", range(1, 9)),
        grpc.StatusCode.ALREADY_EXISTS,
        ("request_id 'run' is already running",),
    ),
    Case(
        "waiting request with another prompt",
        "request_id",
        '"wait" with another prompt',
        lambda c: gcb("wait", range(20, 29), session_id="s"),
        grpc.StatusCode.ALREADY_EXISTS,
        ("request_id 'wait'", "another prompt"),
    ),
    Case(
        "waiting request with another session",
        "request_id",
        '"wait" with another session_id',
        lambda c: gcb("wait", range(20, 28), session_id="t"),
        grpc.StatusCode.ALREADY_EXISTS,
        ("request_id 'wait'", "another prompt or options"),
    ),
    Case(
        "waiting request with another cache salt",
        "request_id",
        '"wait" with a cache_salt',
        lambda c: gcb("wait", range(20, 28), session_id="s", cache_salt="x"),
        grpc.StatusCode.ALREADY_EXISTS,
        ("request_id 'wait' is already registered with another prompt or options",),
    ),
    Case(
        "waiting request in another report mode",
        "request_id",
        '"wait" in full report mode',
        lambda c: gcb("wait", range(20, 28), session_id="s", kv_cache_report_mode=pb.KV_CACHE_REPORT_MODE_FULL),
        grpc.StatusCode.ALREADY_EXISTS,
        ("request_id 'wait' is already registered with another prompt or options",),
    ),
    Case(
        "request table full",
        "request_id",
        '"third" (2 registered)',
        lambda c: gcb("third"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        ("max_num_requests: 2",),
    ),
    Case(
        "not a GetComputedBlocksRequest",
        "request",
        "a message cut inside a varint",
        lambda c: Raw(
            "GetComputedBlocks",
            pb.GetComputedBlocksRequest(request_id="new", prompt_token_ids=[300]).SerializeToString()[:-1],
        ),
        IA,
        ("request: not a valid kvservice.v1.GetComputedBlocksRequest",),
    ),
    # AllocateSlots
    Case(
        "num_new_tokens 0", "num_new_tokens", "0", lambda c: alloc("wait", 0), IA, ("num_new_tokens: 0 outside 1..64",)
    ),
    Case(
        "num_new_tokens beyond max_model_len",
        "num_new_tokens",
        "65",
        lambda c: alloc("wait", 65),
        IA,
        ("num_new_tokens: 65 outside 1..64",),
    ),
    Case(
        "num_new_tokens 2^32-1",
        "num_new_tokens",
        "2^32-1",
        lambda c: alloc("run", U32, new_token_ids=[9]),
        IA,
        ("num_new_tokens: 4294967295 outside 1..64 (max_model_len)",),
    ),
    Case(
        "num_lookahead_tokens beyond max_model_len",
        "num_lookahead_tokens",
        "65",
        lambda c: alloc("wait", 8, num_lookahead_tokens=65),
        IA,
        ("num_lookahead_tokens: 65 outside 0..64",),
    ),
    Case(
        "num_lookahead_tokens 2^32-1",
        "num_lookahead_tokens",
        "2^32-1",
        lambda c: alloc("run", 1, num_lookahead_tokens=U32, new_token_ids=[9]),
        IA,
        ("num_lookahead_tokens: 4294967295 outside 0..64",),
    ),
    Case(
        "new tokens beyond max_model_len",
        "new_token_ids",
        "57 ids (8 held)",
        lambda c: alloc("run", 1, new_token_ids=range(57)),
        IA,
        ("new_token_ids: request would hold 65 tokens, above max_model_len 64",),
    ),
    Case(
        "new tokens of a waiting request beyond max_model_len",
        "new_token_ids",
        '57 ids to "wait" (8 held)',
        lambda c: alloc("wait", 8, new_token_ids=range(57)),
        IA,
        ("new_token_ids: request would hold 65 tokens, above max_model_len 64",),
    ),
    Case(
        "negative new token id",
        "new_token_ids",
        "[5, -2]",
        lambda c: alloc("run", 1, new_token_ids=[5, -2]),
        IA,
        ("new_token_ids: token id -2",),
    ),
    Case(
        "new token id 2^31",
        "new_token_ids",
        "[2^31]",
        lambda c: alloc("run", 1, new_token_ids=[2**31]),
        IA,
        ("new_token_ids: token id 2147483648",),
    ),
    Case(
        "negative new token id in a long list",
        "new_token_ids",
        "12 ids, the last -1",
        lambda c: alloc("run", 1, new_token_ids=[*range(11), -1]),
        IA,
        ("new_token_ids: token id -1 outside 0..2147483647",),
    ),
    Case(
        "fully computed request without new tokens",
        "num_new_tokens",
        '1 for "run" (all computed)',
        lambda c: alloc("run", 1),
        IA,
        ("num_new_tokens: all 8 tokens of 'run' are computed",),
    ),
    Case(
        "allocate an unknown request",
        "request_id",
        '"ghost"',
        lambda c: alloc("ghost", 4),
        grpc.StatusCode.NOT_FOUND,
        ("request_id 'ghost' is not registered",),
    ),
    Case(
        "allocate an empty request id",
        "request_id",
        '""',
        lambda c: alloc("", 4),
        IA,
        ("request_id: must not be empty",),
    ),
    Case(
        "allocate an over-long request id",
        "request_id",
        '"r" * 257',
        lambda c: alloc("r" * 257, 4),
        IA,
        ("request_id: longer than 256 bytes",),
    ),
    Case(
        "not an AllocateSlotsRequest",
        "request",
        "a message cut inside a varint",
        lambda c: Raw(
            "AllocateSlots", pb.AllocateSlotsRequest(request_id="wait", num_new_tokens=300).SerializeToString()[:-1]
        ),
        IA,
        ("request: not a valid kvservice.v1.AllocateSlotsRequest",),
    ),
    # Free
    Case(
        "free an unknown request",
        "request_id",
        '"ghost"',
        lambda c: free("ghost"),
        grpc.StatusCode.NOT_FOUND,
        ("request_id 'ghost' is not registered",),
    ),
    Case("free an empty request id", "request_id", '""', lambda c: free(""), IA, ("request_id: must not be empty",)),
    Case(
        "free an over-long request id",
        "request_id",
        '"r" * 300',
        lambda c: free("r" * 300),
        IA,
        ("request_id: longer than 256 bytes",),
    ),
    Case(
        "free a request id that is not UTF-8",
        "request_id",
        "bytes c3 28",
        lambda c: Raw("Free", b"\x0a\x02" + BAD_UTF8),
        IA,
        ("request_id: not valid UTF-8",),
    ),
    # ResetPrefixCache, GetUsage, GetKVCacheGroupMetadata, Ping: no field to get wrong, only the bytes
    Case(
        "not a ResetPrefixCacheRequest",
        "request",
        "field 1 claims 5 bytes, 2 follow",
        lambda c: Raw("ResetPrefixCache", b"\x0a\x05ab"),
        IA,
        ("request: not a valid kvservice.v1.ResetPrefixCacheRequest",),
    ),
    Case(
        "not a GetUsageRequest",
        "request",
        "bytes ff (a tag cut short)",
        lambda c: Raw("GetUsage", b"\xff"),
        IA,
        ("request: not a valid kvservice.v1.GetUsageRequest",),
    ),
    Case(
        "not a GetKVCacheGroupMetadataRequest",
        "request",
        "bytes 08 (a tag without its value)",
        lambda c: Raw("GetKVCacheGroupMetadata", b"\x08"),
        IA,
        ("request: not a valid kvservice.v1.GetKVCacheGroupMetadataRequest",),
    ),
    Case(
        "not a PingRequest",
        "request",
        "payload claims 10 bytes, 3 follow",
        lambda c: Raw("Ping", b"\x0a\x0aabc"),
        IA,
        ("request: not a valid kvservice.v1.PingRequest",),
    ),
    # StreamEvents
    Case(
        "stream from another epoch",
        "epoch",
        '"feedface" (start SEQ)',
        lambda c: stream(start=SEQ, start_seq=4, epoch="feedface"),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("epoch 'feedface'",),
    ),
    Case(
        "live stream from another epoch",
        "epoch",
        '"feedface" (start LIVE)',
        lambda c: stream(start=LIVE, epoch="feedface"),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("epoch 'feedface' is not this server's epoch",),
    ),
    Case(
        "stream with an over-long epoch",
        "epoch",
        '"e" * 257',
        lambda c: stream(start=SEQ, start_seq=4, epoch="e" * 257),
        IA,
        ("epoch: longer than 256 bytes",),
    ),
    Case(
        "live stream with a huge epoch",
        "epoch",
        '"e" * 100000 (start LIVE)',
        lambda c: stream(start=LIVE, epoch="e" * 100_000),
        IA,
        ("epoch: longer than 256 bytes",),
    ),
    Case(
        "stream with an epoch that is not UTF-8",
        "epoch",
        "bytes c3 28",
        lambda c: Raw("StreamEvents", b"\x1a\x02" + BAD_UTF8),
        IA,
        ("epoch: not valid UTF-8 (a string of kvservice.v1.StreamEventsRequest)",),
    ),
    Case(
        "stream beyond head + 1",
        "start_seq",
        "head + 2",
        lambda c: stream(start=SEQ, start_seq=c.head_seq + 2),
        IA,
        ("start_seq: 8 is beyond the head seq 6 + 1",),
    ),
    Case(
        "stream from seq 2^64-1",
        "start_seq",
        "2^64-1",
        lambda c: stream(start=SEQ, start_seq=U64),
        IA,
        ("start_seq: 18446744073709551615 is beyond the head seq 6 + 1",),
    ),
    Case(
        "stream from seq 0",
        "start_seq",
        "0",
        lambda c: stream(start=SEQ, start_seq=0),
        IA,
        ("start_seq: 0 must be >= 1",),
    ),
    Case(
        "stream below retention",
        "start_seq",
        "2 (oldest retained: 3)",
        lambda c: stream(start=SEQ, start_seq=2),
        grpc.StatusCode.OUT_OF_RANGE,
        ("start_seq 2", "oldest retained batch, seq 3"),
    ),
    Case(
        "stream of an unknown group",
        "group_idxs",
        "[0, 1] (one group)",
        lambda c: stream(group_idxs=[0, 1]),
        IA,
        ("group_idxs: 1 outside 0..0",),
    ),
    Case(
        "stream of group 2^32-1",
        "group_idxs",
        "[2^32-1]",
        lambda c: stream(start=pb.EVENT_START_SNAPSHOT, group_idxs=[U32]),
        IA,
        ("group_idxs: 4294967295 outside 0..0",),
    ),
    Case(
        "stream in an unknown payload format",
        "payload_format",
        "9",
        lambda c: stream(payload_format=9),
        IA,
        ("payload_format", "9"),
    ),
    Case(
        "stream in a negative payload format",
        "payload_format",
        "-1",
        lambda c: stream(payload_format=-1),
        IA,
        ("payload_format: unknown value -1",),
    ),
    Case("stream from an unknown start", "start", "9", lambda c: stream(start=9), IA, ("start: unknown value 9",)),
    Case("stream from a negative start", "start", "-2", lambda c: stream(start=-2), IA, ("start: unknown value -2",)),
    Case(
        "not a StreamEventsRequest",
        "request",
        "random bytes ff ff ff",
        lambda c: Raw("StreamEvents", b"\xff\xff\xff"),
        IA,
        ("request: not a valid kvservice.v1.StreamEventsRequest",),
    ),
    # TakeEvents
    Case("take with an empty consumer", "consumer", '""', lambda c: take(""), IA, ("consumer: must not be empty",)),
    Case(
        "take with an over-long consumer",
        "consumer",
        '"c" * 257',
        lambda c: take("c" * 257),
        IA,
        ("consumer: longer than 256 bytes",),
    ),
    Case(
        "take with a consumer over 256 UTF-8 bytes",
        "consumer",
        '"ç" * 129 (258 bytes)',
        lambda c: take("ç" * 129),
        IA,
        ("consumer: longer than 256 bytes",),
    ),
    Case(
        "take with a consumer that is not UTF-8",
        "consumer",
        "bytes c3 28",
        lambda c: Raw("TakeEvents", b"\x0a\x02" + BAD_UTF8),
        IA,
        ("consumer: not valid UTF-8",),
    ),
    Case(
        "take from another epoch",
        "epoch",
        '"feedface" (with start_seq)',
        lambda c: take(start_seq=4, epoch="feedface"),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("epoch 'feedface'",),
    ),
    Case(
        "take from another epoch without start_seq",
        "epoch",
        '"feedface" (no start_seq)',
        lambda c: take(epoch="feedface"),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("epoch 'feedface' is not this server's epoch", "take with snapshot=true"),
    ),
    Case(
        "take with an over-long epoch",
        "epoch",
        '"e" * 257',
        lambda c: take(epoch="e" * 257),
        IA,
        ("epoch: longer than 256 bytes",),
    ),
    Case(
        "take from seq 4 with a huge epoch",
        "epoch",
        '"e" * 100000 (with start_seq)',
        lambda c: take(start_seq=4, epoch="e" * 100_000),
        IA,
        ("epoch: longer than 256 bytes",),
    ),
    Case(
        "take beyond head + 1",
        "start_seq",
        "head + 2",
        lambda c: take(start_seq=c.head_seq + 2),
        IA,
        ("start_seq: 8 is beyond",),
    ),
    Case(
        "take from seq 2^64-1",
        "start_seq",
        "2^64-1",
        lambda c: take(start_seq=U64),
        IA,
        ("start_seq: 18446744073709551615 is beyond the head seq 6 + 1",),
    ),
    Case(
        "take below retention",
        "start_seq",
        "1 (oldest retained: 3)",
        lambda c: take(start_seq=1),
        grpc.StatusCode.OUT_OF_RANGE,
        ("start_seq 1", "seq 3"),
    ),
    Case(
        "take of an unknown group",
        "group_idxs",
        "[3] (one group)",
        lambda c: take(group_idxs=[3]),
        IA,
        ("group_idxs: 3 outside 0..0",),
    ),
    Case(
        "take of group 2^32-1",
        "group_idxs",
        "[0, 2^32-1]",
        lambda c: take(group_idxs=[0, U32]),
        IA,
        ("group_idxs: 4294967295 outside 0..0",),
    ),
    Case(
        "take in an unknown payload format",
        "payload_format",
        "5",
        lambda c: take(payload_format=5),
        IA,
        ("payload_format", "5"),
    ),
    Case(
        "take in a negative payload format",
        "payload_format",
        "-7",
        lambda c: take(payload_format=-7),
        IA,
        ("payload_format: unknown value -7",),
    ),
    Case(
        "take by one consumer too many",
        "consumer",
        '"c3" (2 exist)',
        lambda c: take("c3"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        ("max_consumers: 2",),
    ),
    Case(
        "take a snapshot by one consumer too many",
        "consumer",
        '"c3" with snapshot (2 exist)',
        lambda c: take("c3", snapshot=True),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        ("max_consumers: 2",),
    ),
    # Step
    Case(
        "step with too many ops",
        "ops",
        "9 ops (max_step_ops 8)",
        lambda c: pb.StepRequest(ops=[pb.StepOp(get_usage=pb.GetUsageRequest())] * 9),
        IA,
        ("ops: 9 ops, above max_step_ops 8",),
    ),
    Case(
        "step with a truncated op",
        "request",
        "an op cut inside its request id",
        lambda c: Raw("Step", pb.StepRequest(ops=[free("run")]).SerializeToString()[:-1]),
        IA,
        ("request: not a valid kvservice.v1.StepRequest",),
    ),
    Case(
        "step with an op whose request id is not UTF-8",
        "ops[1].free.request_id",
        "bytes c3 28 in the 2nd op",
        lambda c: Raw(
            "Step",
            pb.StepRequest(ops=[pb.StepOp(get_usage=pb.GetUsageRequest())]).SerializeToString()
            + b"\x0a\x06\x1a\x04\x0a\x02"
            + BAD_UTF8,
        ),
        IA,
        ("ops[1].free.request_id: not valid UTF-8 (a string of kvservice.v1.StepRequest)",),
    ),
    # Data plane (the rules with memory behind the tensors: tests/service/test_data_plane.py)
    Case(
        "attach on a meta device",
        "device",
        "meta (the test server's)",
        lambda c: Raw("AttachKVCache", b""),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("no memory behind a meta device",),
    ),
    Case(
        "write blocks on a meta device",
        "device",
        "meta (the test server's)",
        lambda c: Raw("WriteBlocks", pb.WriteBlocksChunk(request_id="run", block_id=1, data=b"x").SerializeToString()),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("no memory behind a meta device",),
    ),
    Case(
        "read blocks request truncated",
        "request",
        "a block ref cut inside it",
        lambda c: Raw("ReadBlocks", pb.ReadBlocksRequest(blocks=[pb.BlockRef(block_id=1)]).SerializeToString()[:-1]),
        IA,
        ("request: not a valid kvservice.v1.ReadBlocksRequest",),
    ),
    # The tier (docs/tier.md): each new field's bound; on the meta test server the calls that move
    # bytes through the memory are refused for it first.
    Case(
        "lookup blocks hash of the wrong length",
        "block_hashes[0]",
        "8 bytes",
        lambda c: Raw("LookupBlocks", pb.LookupBlocksRequest(block_hashes=[bytes(8)]).SerializeToString()),
        IA,
        ("block_hashes[0]: 8 bytes; a block hash is the server's 32-byte digest",),
    ),
    Case(
        "lookup blocks group out of range",
        "group_idx",
        "7",
        lambda c: Raw(
            "LookupBlocks", pb.LookupBlocksRequest(group_idx=7, block_hashes=[bytes(32)]).SerializeToString()
        ),
        IA,
        ("group_idx: 7 is out of range [0, 1)",),
    ),
    Case(
        "lookup blocks more keys than max_keys_per_call",
        "block_hashes",
        "4097 keys",
        lambda c: Raw("LookupBlocks", pb.LookupBlocksRequest(block_hashes=[bytes(32)] * 4097).SerializeToString()),
        IA,
        ("block_hashes: 4097 keys, above tier_max_keys_per_call 4096",),
    ),
    Case(
        "lookup blocks group_idxs not one per key",
        "group_idxs",
        "2 for 1 key",
        lambda c: Raw(
            "LookupBlocks", pb.LookupBlocksRequest(block_hashes=[bytes(32)], group_idxs=[0, 0]).SerializeToString()
        ),
        IA,
        ("group_idxs: 2 groups for 1 keys",),
    ),
    Case(
        "reserve blocks on a meta device",
        "device",
        "meta (the test server's)",
        lambda c: Raw("ReserveBlocks", pb.ReserveBlocksRequest(block_hashes=[bytes(32)]).SerializeToString()),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("no memory behind a meta device",),
    ),
    Case(
        "lease blocks on a meta device",
        "device",
        "meta (the test server's)",
        lambda c: Raw("LeaseBlocks", pb.LeaseBlocksRequest(block_hashes=[bytes(32)]).SerializeToString()),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("no memory behind a meta device",),
    ),
    Case(
        "commit blocks request truncated",
        "request",
        "a lease id cut inside it",
        lambda c: Raw("CommitBlocks", b"\x08\xff"),
        IA,
        ("request: not a valid kvservice.v1.CommitBlocksRequest",),
    ),
    Case(
        "release lease request truncated",
        "request",
        "a lease id cut inside it",
        lambda c: Raw("ReleaseLease", b"\x08\xff"),
        IA,
        ("request: not a valid kvservice.v1.ReleaseLeaseRequest",),
    ),
    Case(
        "put blocks without a header first",
        "header",
        "a chunk first",
        lambda c: Raw("PutBlocks", pb.PutBlocksMessage(chunk=pb.PutBlocksChunk(data=b"x")).SerializeToString()),
        IA,
        ("header: the first PutBlocks message must be the header",),
    ),
    # ManagerStep: refused whole (a failing call inside one is answered in its results:
    # tests/service/test_manager_step.py)
    Case(
        "manager step without an owner",
        "owner",
        '""',
        lambda c: pb.ManagerStepRequest(),
        IA,
        ("owner: must not be empty",),
    ),
    Case(
        "manager step owner over 256 bytes",
        "owner",
        '"o" * 257',
        lambda c: pb.ManagerStepRequest(owner="o" * 257),
        IA,
        ("owner: longer than 256 bytes",),
    ),
    Case(
        "manager step claim of two hours",
        "claim_ttl_s",
        "7200",
        lambda c: pb.ManagerStepRequest(owner="s", claim_ttl_s=7200),
        IA,
        ("claim_ttl_s: 7200.0 outside 0 < ttl <= 3600 seconds",),
    ),
    Case(
        "manager step marks blocks written on a meta device",
        "written_blocks",
        'a block of "run" (the test server\'s device is meta)',
        lambda c: pb.ManagerStepRequest(
            owner="s",
            written_blocks=[
                pb.WrittenBlocks(request_id="run", allocation_id=1, block_ids=[pb.GroupBlockIds(block_ids=[1])])
            ],
            written_epoch=c.epoch,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        ("written_blocks: no memory behind a meta device",),
    ),
]


def rpc_of(request: Any) -> str:
    """The RPC a case's request goes to."""
    if isinstance(request, Raw):
        return request.method
    if isinstance(request, pb.StepOp):
        return {"get_computed_blocks": "GetComputedBlocks", "allocate_slots": "AllocateSlots", "free": "Free"}[
            request.WhichOneof("op")
        ]
    return {
        pb.StreamEventsRequest: "StreamEvents",
        pb.TakeEventsRequest: "TakeEvents",
        pb.StepRequest: "Step",
        pb.ManagerStepRequest: "ManagerStep",
    }[type(request)]


async def _raw_call(client, raw: Raw) -> None:
    path = f"/{SERVICE}/{raw.method}"
    try:
        if raw.method in ("WriteBlocks", "PutBlocks"):
            await client.channel.stream_unary(path)(iter([raw.data]), timeout=10.0)
        elif raw.method in ("StreamEvents", "ReadBlocks"):
            call = client.channel.unary_stream(path)(raw.data, timeout=10.0)
            try:
                message = await call.read()
            finally:
                call.cancel()
            assert message is grpc.aio.EOF, "the stream sent a message"
        else:
            await client.channel.unary_unary(path)(raw.data, timeout=10.0)
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from None


async def error_of(client, request: Any) -> KVServiceError:
    """Run a bad call (through the client facade, or raw bytes through its channel) and return its
    error.

    Raises:
        AssertionError: the call succeeded.
    """
    try:
        if isinstance(request, Raw):
            await _raw_call(client, request)
        elif isinstance(request, pb.StepOp):
            which = request.WhichOneof("op")
            method = {
                "get_computed_blocks": client.get_computed_blocks,
                "allocate_slots": client.allocate_slots,
                "free": client.free,
            }[which]
            await method(getattr(request, which))
        elif isinstance(request, pb.StreamEventsRequest):
            await next_batch(client.stream_events(request))
        elif isinstance(request, pb.TakeEventsRequest):
            await client.take_events(request)
        elif isinstance(request, pb.ManagerStepRequest):
            await client.manager_step(request)
        else:
            await client.step(request)
    except KVServiceError as err:
        return err
    raise AssertionError(f"the call succeeded: {rpc_of(request)}")


def assert_names(message: str, case: Case) -> None:
    for part in case.names:
        assert part in message, f"{case.name}: {part!r} not in {message!r}"


def test_the_table_covers_every_rpc():
    assert len(CASES) >= 80
    assert len({c.name for c in CASES}) == len(CASES)
    rpcs = {rpc_of(c.build(Ctx("e", 6, 3))) for c in CASES}
    assert rpcs == set(pb.DESCRIPTOR.services_by_name["KVCacheService"].methods_by_name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_call_fails_naming_the_field_and_changes_nothing(start_kv_server, connect, case):
    running, client, ctx = await prepare(start_kv_server, connect)
    before = await observed_state(running, client)
    err = await error_of(client, case.build(ctx))
    assert err.code == case.code, err
    assert_names(err.message, case)
    if case.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a capacity error names its bound (in ``names``)
        assert case.field.split("[")[0] in err.message, (case.field, err.message)
    assert await observed_state(running, client) == before
    running.engine.check_invariants()


STEP_CASES = [c for c in CASES if isinstance(c.build(Ctx("", 6, 3)), pb.StepOp)]


@pytest.mark.parametrize("case", STEP_CASES, ids=[c.name for c in STEP_CASES])
async def test_bad_op_in_a_step_answers_its_own_status(start_kv_server, connect, case):
    running, client, ctx = await prepare(start_kv_server, connect)
    bad = case.build(ctx)
    unary_error = await error_of(client, bad)  # changes nothing: the Step below sees the same state
    before = await observed_state(running, client)
    ops = [
        pb.StepOp(get_usage=pb.GetUsageRequest()),
        bad,
        pb.StepOp(get_usage=pb.GetUsageRequest()),
        alloc("run", 1, new_token_ids=[9]),
    ]
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


async def test_a_snapshot_take_restarts_a_consumer_of_another_epoch(start_kv_server, connect):
    """Regression: a consumer that still names the epoch of a server that restarted was told
    "take with snapshot=true" and then refused again when it did."""
    running, client, ctx = await prepare(start_kv_server, connect)
    taken = await client.take_events("c1", snapshot=True, epoch="feedface")
    assert [(b.seq, b.snapshot, b.epoch) for b in taken.batches] == [(ctx.head_seq, True, ctx.epoch)]
    assert (taken.next_seq, taken.epoch) == (ctx.head_seq + 1, ctx.epoch)
    assert running.event_log.consumer_cursor("c1") == ctx.head_seq + 1
