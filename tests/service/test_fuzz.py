"""Generated messages at every RPC of a live server (hypothesis).

Two kinds of input go through a raw channel call (no client-side serializer, so any bytes pass):

* structurally valid messages with random field values: ids and strings (empty, huge, multi-byte),
  token ids (negative, above int32, int64 extremes), counts, enums (unknown values too), seqs,
  epochs, group filters, multimodal placeholders, LoRA fields, whole Steps;
* malformed bytes: random bytes, truncated valid messages, messages of another type, and wire
  fields with random numbers, types and payloads (strings that are not UTF-8).

After every example: the status is one the service documents (``docs/VALIDATION.md``), never
UNKNOWN or INTERNAL, and it is the server's own (not a transport error); an INVALID_ARGUMENT
message starts with the field it names; a call that failed changed nothing (usage, cached set,
requests, block tables, the event log and consumers); the engine's invariants hold; the event
log's mirror equals the pool's cached set; no stream subscription is left behind; the server
still answers Ping.

One server per test (state carries over between examples, as on a real server). Each test is a
plain function that drives its own event loop, so hypothesis runs the examples; the budget keeps
the file near 20-40 s on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice.server.app import RunningServer, start_server
from kvservice.server.event_log import EventLog
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from tests.service.conftest import SMALL_SERVER
from tests.service.helpers import pool_hashes, server_state, wait_until

pytestmark = pytest.mark.timeout(180)

SERVICE = "kvservice.v1.KVCacheService"
REQUEST_TYPES: dict[str, Any] = {
    "GetComputedBlocks": pb.GetComputedBlocksRequest,
    "AllocateSlots": pb.AllocateSlotsRequest,
    "Free": pb.FreeRequest,
    "ResetPrefixCache": pb.ResetPrefixCacheRequest,
    "GetUsage": pb.GetUsageRequest,
    "Step": pb.StepRequest,
    "StreamEvents": pb.StreamEventsRequest,
    "TakeEvents": pb.TakeEventsRequest,
    "GetKVCacheGroupMetadata": pb.GetKVCacheGroupMetadataRequest,
    "Ping": pb.PingRequest,
}
METHODS = sorted(REQUEST_TYPES)

SERVER = {
    "max_num_requests": 6,
    "event_max_batches": 6,
    "max_consumers": 3,
    "max_step_ops": 6,
}
"""Small bounds, so the fuzz reaches them (block size 4, 16 blocks, max_model_len 64)."""

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # our own cancel of a stream
}
"""The statuses of the validation table (docs/VALIDATION.md), plus the two a caller causes."""
FIELD_FIRST = re.compile(r"^[a-z_][a-z_0-9]*(\[\d+\])?(\.[a-z_][a-z_0-9]*(\[\d+\])?)*: ")
"""An INVALID_ARGUMENT message starts with the field it names (``ops[1].free.request_id: ...``)."""
TRANSPORT_ERRORS = ("Stream removed", "Received message larger", "Failed to parse", "Exception")
CALL_TIMEOUT_S = 20.0
REQUEST_IDS = ["r0", "r1", "r2", "r3"]
CONSUMERS = ["c0", "c1", "c2", "c3"]  # one more than max_consumers
EXAMPLES = {"generated": 800, "malformed": 500}
"""Examples per test: 5 to 30 ms each on a 2-core machine, by its load."""


def _settings(name: str) -> settings:
    return settings(
        max_examples=EXAMPLES[name],
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# -- field strategies -------------------------------------------------------------------------
# Each request strategy is ``st.one_of(accepted, wild)``: values a server accepts (so its state
# moves on: requests registered, blocks cached and evicted, consumers advancing) or any value.

huge_text = st.builds(
    lambda char, n: char * n,
    st.sampled_from(["a", "é", "\U0001f600", "\x00"]),
    st.sampled_from([256, 257, 1024, 1025, 20_000, 100_000]),
)
text = st.one_of(st.text(max_size=10), huge_text)
short_text = st.text(min_size=1, max_size=6)
request_ids = st.one_of(st.sampled_from(REQUEST_IDS), text)
int64s = st.one_of(
    st.integers(0, 40),
    st.sampled_from([-1, -(2**63), 2**31 - 1, 2**31, 2**32, 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
uint32s = st.one_of(st.integers(0, 70), st.sampled_from([2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
uint64s = st.one_of(st.integers(0, 12), st.sampled_from([2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
enums = st.one_of(st.integers(0, 3), st.integers(-(2**31), 2**31 - 1))


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def _set(message: Any, **fields: Any) -> Any:
    """``message`` with the fields that are not None set."""
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            getattr(message, name).extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _get_computed_blocks(rid, prompt, session, mode, lora, salt, mm) -> pb.GetComputedBlocksRequest:  # type: ignore[no-untyped-def]
    return _set(
        pb.GetComputedBlocksRequest(),
        request_id=rid,
        prompt_token_ids=prompt,
        session_id=session,
        kv_cache_report_mode=mode,
        lora=lora,
        cache_salt=salt,
        mm_features=mm,
    )


def _lora(lora_id: int, name: str, path: str) -> pb.LoRA:
    return pb.LoRA(lora_id=lora_id, lora_name=name, lora_path=path)


def _mm(identifier: str, offset: int, length: int) -> pb.MultiModalFeature:
    return pb.MultiModalFeature(identifier=identifier, offset=offset, length=length)


get_computed_blocks = st.one_of(
    st.builds(
        _get_computed_blocks,
        st.sampled_from(REQUEST_IDS),
        st.lists(st.integers(0, 30), min_size=1, max_size=40),
        _optional(short_text),
        _optional(st.integers(0, 2)),
        _optional(st.builds(_lora, st.integers(0, 3), st.sampled_from(["a", "b"]), st.just(""))),
        _optional(st.sampled_from(["", "salt"])),
        _optional(
            st.lists(st.builds(_mm, st.sampled_from(["i", "j"]), st.integers(0, 3), st.integers(1, 4)), max_size=2)
        ),
    ),
    st.builds(
        _get_computed_blocks,
        request_ids,
        st.lists(int64s, max_size=70),
        _optional(text),
        _optional(enums),
        _optional(st.builds(_lora, int64s, text, text)),
        _optional(text),
        _optional(st.lists(st.builds(_mm, text, uint32s, uint32s), max_size=3)),
    ),
)


def _allocate_slots(rid, n, lookahead, new) -> pb.AllocateSlotsRequest:  # type: ignore[no-untyped-def]
    return _set(
        pb.AllocateSlotsRequest(), request_id=rid, num_new_tokens=n, num_lookahead_tokens=lookahead, new_token_ids=new
    )


allocate_slots = st.one_of(
    st.builds(
        _allocate_slots,
        st.sampled_from(REQUEST_IDS),
        st.integers(1, 64),
        _optional(st.integers(0, 4)),
        _optional(st.lists(st.integers(0, 30), max_size=4)),
    ),
    st.builds(_allocate_slots, request_ids, uint32s, _optional(uint32s), _optional(st.lists(int64s, max_size=12))),
)
frees = st.builds(lambda rid: pb.FreeRequest(request_id=rid), request_ids)
step_ops = st.one_of(
    get_computed_blocks.map(lambda r: pb.StepOp(get_computed_blocks=r)),
    allocate_slots.map(lambda r: pb.StepOp(allocate_slots=r)),
    frees.map(lambda r: pb.StepOp(free=r)),
    st.just(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest())),
    st.just(pb.StepOp(get_usage=pb.GetUsageRequest())),
    st.just(pb.StepOp()),
)
steps = st.builds(lambda ops: pb.StepRequest(ops=ops), st.lists(step_ops, max_size=6))
pings = st.builds(
    lambda payload: pb.PingRequest(payload=payload),
    st.one_of(st.binary(max_size=64), st.sampled_from([b"x" * 70_000, b"\xff" * 5_000_000])),
)
EMPTY_MESSAGES = {
    "ResetPrefixCache": st.just(pb.ResetPrefixCacheRequest()),
    "GetUsage": st.just(pb.GetUsageRequest()),
    "GetKVCacheGroupMetadata": st.just(pb.GetKVCacheGroupMetadataRequest()),
}


def event_strategies(log: EventLog) -> dict[str, st.SearchStrategy]:
    """StreamEvents and TakeEvents requests. Seqs near the log's head are drawn when the example
    is (just before it runs), so they land inside, below and just above the retained window."""

    def near_head(back: int) -> int:
        return max(1, log.head_seq + 1 - back)

    seqs = st.integers(0, 8).map(near_head)
    wild_seqs = st.one_of(seqs, uint64s)
    epochs = st.sampled_from(["", log.epoch])
    wild_epochs = st.one_of(epochs, st.just("feedface"), text, huge_text)
    groups = st.sampled_from([[], [0], [0, 0]])
    wild_groups = st.lists(st.one_of(st.just(0), uint32s), max_size=3)
    formats = _optional(st.integers(0, 2))

    def stream(start, seq, epoch, group_idxs, payload_format) -> pb.StreamEventsRequest:  # type: ignore[no-untyped-def]
        return _set(
            pb.StreamEventsRequest(),
            start=start,
            start_seq=seq,
            epoch=epoch,
            group_idxs=group_idxs,
            payload_format=payload_format,
        )

    def take(consumer, max_batches, snapshot, seq, epoch, group_idxs, payload_format) -> pb.TakeEventsRequest:  # type: ignore[no-untyped-def]
        return _set(
            pb.TakeEventsRequest(),
            consumer=consumer,
            max_batches=max_batches,
            snapshot=snapshot,
            start_seq=seq,
            epoch=epoch,
            group_idxs=group_idxs,
            payload_format=payload_format,
        )

    streams = st.one_of(
        st.builds(stream, st.integers(0, 3), seqs, epochs, groups, formats),
        st.builds(stream, enums, wild_seqs, wild_epochs, wild_groups, _optional(enums)),
    )
    takes = st.one_of(
        st.builds(
            take,
            st.sampled_from(CONSUMERS),
            _optional(st.integers(0, 3)),
            st.booleans(),
            st.one_of(st.just(0), seqs),
            epochs,
            groups,
            formats,
        ),
        st.builds(
            take,
            st.one_of(st.sampled_from(CONSUMERS), st.just(""), text),
            _optional(uint32s),
            st.booleans(),
            st.one_of(st.just(0), wild_seqs),
            wild_epochs,
            wild_groups,
            _optional(enums),
        ),
    )
    return {"StreamEvents": streams, "TakeEvents": takes}


def message_strategies(log: EventLog) -> dict[str, st.SearchStrategy]:
    """Per RPC, structurally valid requests with random field values."""
    return {
        "GetComputedBlocks": get_computed_blocks,
        "AllocateSlots": allocate_slots,
        "Free": frees,
        "Step": steps,
        "Ping": pings,
        **EMPTY_MESSAGES,
        **event_strategies(log),
    }


# -- malformed bytes ------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _wire_field(number: int, wire_type: int, payload: bytes, value: int) -> bytes:
    key = _varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + _varint(value)
    if wire_type == 1:
        return key + value.to_bytes(8, "little")
    if wire_type == 5:
        return key + (value & 0xFFFFFFFF).to_bytes(4, "little")
    return key + _varint(len(payload)) + payload


wire_fields = st.builds(
    _wire_field,
    st.integers(1, 16),
    st.sampled_from([0, 1, 2, 2, 2, 5]),
    st.one_of(
        st.binary(max_size=12), st.sampled_from([b"\xc3\x28", b"\xed\xa0\x80", b"\xff", b"r0", b"\x0a\x02\xc3\x28"])
    ),
    st.integers(0, 2**64 - 1),
)


def malformed_bytes(messages: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Random bytes, truncated valid messages of any RPC, wire fields with random payloads."""
    any_message = st.one_of(*messages.values()).map(lambda m: m.SerializeToString())
    return st.one_of(
        st.binary(max_size=48),
        st.tuples(any_message, st.integers(0, 2**16)).map(lambda t: t[0][: t[1] % (len(t[0]) + 1)]),
        any_message,  # a message of any type: mostly another RPC's
        st.lists(wire_fields, min_size=1, max_size=5).map(b"".join),
    )


# -- one live server, driven from a plain test function ---------------------------------------


class LiveServer:
    """A server and a raw channel on an event loop of their own (hypothesis runs the examples)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.running: RunningServer = self.run(start_server(**{**SMALL_SERVER, **SERVER}))
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = self.run(self._open(options))
        self.num_produced = 0
        self.codes: dict[str, set[str]] = {}

    async def _open(self, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.running.address, options=options)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.channel.close())
        self.run(self.running.stop(0))
        self.loop.close()

    async def unary(self, method: str, data: bytes) -> tuple[grpc.StatusCode, str, bytes | None]:
        try:
            response = await self.channel.unary_unary(f"/{SERVICE}/{method}")(data, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details() or "", None
        return grpc.StatusCode.OK, "", response

    async def stream(self, data: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
        """Open StreamEvents, read at most two messages, cancel. An open subscription with nothing
        to send yet gets a batch (a request registered, allocated and freed), so every accepted
        stream delivers at least one message and no read waits on a timer."""
        log = self.running.event_log
        call = self.channel.unary_stream(f"/{SERVICE}/StreamEvents")(data, timeout=CALL_TIMEOUT_S)
        messages: list[bytes] = []
        code, details = grpc.StatusCode.OK, ""
        try:
            for _ in range(2):
                read = asyncio.ensure_future(call.read())
                subscribed = asyncio.ensure_future(wait_until(lambda: log.num_subscribers > 0, CALL_TIMEOUT_S))
                await asyncio.wait({read, subscribed}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    await self.produce_batch()
                subscribed.cancel()
                message = await read
                if message is grpc.aio.EOF:
                    break
                messages.append(message)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
        finally:
            call.cancel()
        await wait_until(lambda: log.num_subscribers == 0, CALL_TIMEOUT_S)  # no subscription is left behind
        if code == grpc.StatusCode.OK and call.done() and not call.cancelled():
            code, details = await call.code(), await call.details() or ""
        return code, details, messages

    async def produce_batch(self) -> None:
        """Append one batch: free every registered request, then register, allocate and free a
        request with a prompt never seen (its blocks are stored: one BlockStored at least)."""
        self.num_produced += 1
        base = 10**6 + 8 * self.num_produced
        prompt = list(range(base, base + 8))
        for request_id in list(self.running.engine.requests):
            await self.call_ok("Free", pb.FreeRequest(request_id=request_id))
        head = self.running.event_log.head_seq
        await self.call_ok(
            "GetComputedBlocks", pb.GetComputedBlocksRequest(request_id="fuzz-producer", prompt_token_ids=prompt)
        )
        await self.call_ok("AllocateSlots", pb.AllocateSlotsRequest(request_id="fuzz-producer", num_new_tokens=8))
        await self.call_ok("Free", pb.FreeRequest(request_id="fuzz-producer"))
        assert self.running.event_log.head_seq > head

    async def call_ok(self, method: str, request: Any) -> bytes:
        code, details, response = await self.unary(method, request.SerializeToString())
        assert code == grpc.StatusCode.OK, (method, code, details)
        assert response is not None
        return response

    async def check(self, method: str, data: bytes) -> None:
        """One call and every check of the module docstring."""
        running = self.running
        before = server_state(running)
        if method == "StreamEvents":
            code, details, _ = await self.stream(data)
        else:
            code, details, response = await self.unary(method, data)
        self.codes.setdefault(method, set()).add(code.name)
        assert code in ALLOWED, (method, code, details)
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            assert not details.startswith(TRANSPORT_ERRORS), (method, code, details)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert FIELD_FIRST.match(details), (method, details)
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            assert server_state(running) == before, (method, code, details)
        if method == "Step" and code == grpc.StatusCode.OK:
            self._check_step(pb.StepResponse.FromString(response), before)
        running.engine.check_invariants()
        assert running.snapshots.mirror.cached_hashes() == pool_hashes(running), "the event log's mirror left the pool"
        assert running.event_log.num_subscribers == 0
        ping = pb.PingResponse.FromString(await self.call_ok("Ping", pb.PingRequest(payload=b"alive")))
        assert ping.payload == b"alive"
        # Requests under generated names would fill the table for good: forget them.
        for request_id in [r for r in running.engine.requests if r not in REQUEST_IDS]:
            await self.call_ok("Free", pb.FreeRequest(request_id=request_id))

    def _check_step(self, response: pb.StepResponse, before: dict[str, Any]) -> None:
        allowed = {code.value[0] for code in ALLOWED}
        kinds = []
        for result in response.results:
            kinds.append(result.WhichOneof("result"))
            if result.WhichOneof("result") == "error":
                assert result.error.code in allowed, result.error
                if result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                    assert FIELD_FIRST.match(result.error.message), result.error.message
        assert response.epoch == self.running.event_log.epoch
        if all(kind in ("error", "get_usage") for kind in kinds):  # every op failed or only read
            assert server_state(self.running) == before, "a Step of failed ops changed something"


def _drive(draw_examples: Callable[[LiveServer], None]) -> LiveServer:
    server = LiveServer()
    try:
        draw_examples(server)
    finally:
        server.close()
    return server


def test_generated_messages_at_every_rpc():
    """Structurally valid requests with random field values, at all ten RPCs."""

    def examples(server: LiveServer) -> None:
        messages = message_strategies(server.running.event_log)
        calls = st.one_of(*(st.tuples(st.just(m), messages[m]) for m in METHODS))

        @_settings("generated")
        @given(call=calls)
        def run(call: tuple[str, Any]) -> None:
            method, request = call
            server.run(server.check(method, request.SerializeToString()))

        run()

    server = _drive(examples)
    assert set(server.codes) == set(METHODS)
    seen = set().union(*server.codes.values())
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= seen, seen


def test_malformed_bytes_at_every_rpc():
    """Random bytes, truncated messages, messages of another type and wire fields with random
    payloads (strings that are not UTF-8), at all ten RPCs."""

    def examples(server: LiveServer) -> None:
        data = malformed_bytes(message_strategies(server.running.event_log))

        @_settings("malformed")
        @given(method=st.sampled_from(METHODS), payload=data)
        def run(method: str, payload: bytes) -> None:
            server.run(server.check(method, payload))

        run()

    server = _drive(examples)
    assert set(server.codes) == set(METHODS)
    assert "INVALID_ARGUMENT" in set().union(*server.codes.values())
