"""kvservice_client.client against a fake servicer on a real grpc.aio server (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest

from kvservice_client import hashing
from kvservice_client._proto.kvservice import v1
from kvservice_client.client import (
    AsyncKVCacheClient,
    KVCacheClient,
    KVServiceError,
    StepBuilder,
    step_results,
)

_OUR_KEYS = {"authorization", "x-client", "x-call", "x-trace-bin"}


@dataclass
class _Seen:
    method: str
    request: object
    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining: float | None


class FakeKVCacheService(v1.KVCacheServiceServicer):
    """Implements a few RPCs; records what each call saw."""

    def __init__(self) -> None:
        self.seen: list[_Seen] = []
        self.release = asyncio.Event()  # GetUsage waits on it: lets a test hit its deadline
        self.stream_error: tuple[grpc.StatusCode, str] | None = None

    def _record(self, method: str, request: object, context: grpc.aio.ServicerContext) -> None:
        metadata = tuple((k, v) for k, v in context.invocation_metadata() if k in _OUR_KEYS)
        self.seen.append(_Seen(method, request, metadata, context.time_remaining()))

    async def GetComputedBlocks(self, request, context):  # type: ignore[no-untyped-def]
        self._record("GetComputedBlocks", request, context)
        return v1.GetComputedBlocksResponse(num_computed_tokens=32, block_ids=[v1.GroupBlockIds(block_ids=[1, 2])])

    async def Free(self, request, context):  # type: ignore[no-untyped-def]
        self._record("Free", request, context)
        if request.request_id != "known":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not registered")
        return v1.FreeResponse(num_freed_blocks=4)

    async def GetUsage(self, request, context):  # type: ignore[no-untyped-def]
        self._record("GetUsage", request, context)
        await self.release.wait()
        return v1.GetUsageResponse(usage=0.5)

    async def Ping(self, request, context):  # type: ignore[no-untyped-def]
        self._record("Ping", request, context)
        return v1.PingResponse(payload=request.payload)

    async def Step(self, request, context):  # type: ignore[no-untyped-def]
        self._record("Step", request, context)
        results = []
        for op in request.ops:
            which = op.WhichOneof("op")
            if which == "free":
                results.append(v1.StepOpResult(error=v1.OpStatus(code=5, message="request_id 'r0' is not registered")))
            elif which == "get_usage":
                results.append(v1.StepOpResult(get_usage=v1.GetUsageResponse(num_free_blocks=9)))
            else:
                results.append(v1.StepOpResult(error=v1.OpStatus(code=12, message=f"{which} not faked")))
        return v1.StepResponse(results=results)

    async def StreamEvents(self, request, context):  # type: ignore[no-untyped-def]
        self._record("StreamEvents", request, context)
        for seq in (request.start_seq, request.start_seq + 1):
            yield v1.EventBatch(seq=seq, epoch="ep", events=[v1.KVEvent(all_blocks_cleared=v1.AllBlocksCleared())])
        if self.stream_error is not None:
            await context.abort(*self.stream_error)


def _about(seconds: float) -> object:
    """A deadline as the server sees it: a little spent in flight, a little added by rounding."""
    return pytest.approx(seconds, rel=0.05, abs=1.5)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, FakeKVCacheService]]:
    """Start the fake on 127.0.0.1:0; yield (address, servicer)."""
    fake = FakeKVCacheService()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    v1.add_KVCacheServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        fake.release.set()
        await server.stop(None)


# --- async client -------------------------------------------------------------------------------


async def test_get_computed_blocks_builds_the_request_from_keywords(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    async with AsyncKVCacheClient(address) as client:
        response = await client.get_computed_blocks(
            "req-1",
            [1, 2, 3],
            session_id="s-1",
            kv_cache_report_mode="full",
            lora=hashing.LoRA(lora_id=7, lora_name="adapter"),
            cache_salt="salt",
            mm_features=[hashing.MultiModalFeature(identifier="img", offset=1, length=2)],
        )
    assert response == v1.GetComputedBlocksResponse(
        num_computed_tokens=32, block_ids=[v1.GroupBlockIds(block_ids=[1, 2])]
    )
    (seen,) = fake.seen
    assert seen.method == "GetComputedBlocks"
    assert seen.request == v1.GetComputedBlocksRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3],
        session_id="s-1",
        kv_cache_report_mode=v1.KV_CACHE_REPORT_MODE_FULL,
        lora=v1.LoRA(lora_id=7, lora_name="adapter", lora_path=""),
        cache_salt="salt",
        mm_features=[v1.MultiModalFeature(identifier="img", offset=1, length=2)],
    )
    assert seen.metadata == ()
    assert seen.time_remaining is None  # no deadline unless asked for


async def test_a_proto_request_goes_through_unchanged(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    request = v1.GetComputedBlocksRequest(request_id="r", prompt_token_ids=[5])
    async with AsyncKVCacheClient(address) as client:
        await client.get_computed_blocks(request)
    assert fake.seen[0].request == request
    assert not fake.seen[0].request.HasField("session_id")


async def test_deadline_is_passed_through(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    async with AsyncKVCacheClient(address, timeout=100.0) as client:
        await client.ping(b"a", timeout=datetime.timedelta(seconds=30))
        await client.ping(b"b", timeout=7.5)
        await client.ping(b"c")  # the client's default
    # gRPC rounds the grpc-timeout header up to a coarser unit, so the server sees a little more.
    assert [seen.time_remaining for seen in fake.seen] == [
        _about(30.0),
        _about(7.5),
        _about(100.0),
    ]


async def test_deadline_exceeded_is_a_kvservice_error(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    async with AsyncKVCacheClient(address) as client:
        with pytest.raises(KVServiceError) as info:
            await client.get_usage(timeout=0.05)  # the fake waits until teardown
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_error_translation_keeps_code_and_message(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    async with AsyncKVCacheClient(address) as client:
        assert (await client.free("known")).num_freed_blocks == 4
        with pytest.raises(KVServiceError) as info:
            await client.free("ghost")
    err = info.value
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert err.message == "request_id 'ghost' is not registered"
    assert str(err) == "NOT_FOUND: request_id 'ghost' is not registered"
    assert isinstance(err.__cause__, grpc.aio.AioRpcError)


async def test_unreachable_server_is_unavailable() -> None:
    # Port 1 on loopback: nothing listens there, so the connection is refused at once.
    async with AsyncKVCacheClient("127.0.0.1:1") as client:
        with pytest.raises(KVServiceError) as info:
            await client.ping(timeout=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


async def test_metadata_token_then_client_then_call(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    async with AsyncKVCacheClient(address, token="s3cret", metadata={"x-client": "c"}) as client:
        await client.ping(metadata=[("x-call", "1"), ("x-trace-bin", b"\x00\x01")])
        await client.ping()
    assert fake.seen[0].metadata == (
        ("authorization", "Bearer s3cret"),
        ("x-client", "c"),
        ("x-call", "1"),
        ("x-trace-bin", b"\x00\x01"),
    )
    assert fake.seen[1].metadata == (("authorization", "Bearer s3cret"), ("x-client", "c"))


async def test_stream_events_yields_batches_then_translates_the_error(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    fake.stream_error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "subscriber fell behind; last seq 4")
    seqs = []
    async with AsyncKVCacheClient(address) as client:
        with pytest.raises(KVServiceError) as info:
            async for batch in client.stream_events(start_seq=3, payload_format="msgpack", group_idxs=[1]):
                seqs.append(batch.seq)
    assert seqs == [3, 4]
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "subscriber fell behind; last seq 4"
    assert fake.seen[0].request == v1.StreamEventsRequest(
        start=v1.EVENT_START_SEQ, start_seq=3, group_idxs=[1], payload_format=v1.PAYLOAD_FORMAT_MSGPACK
    )


async def test_stream_events_ends_cleanly(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    async with AsyncKVCacheClient(address) as client:
        batches = [b async for b in client.stream_events(snapshot=True)]
    assert [b.seq for b in batches] == [0, 1]
    assert fake.seen[0].request.start == v1.EVENT_START_SNAPSHOT


async def test_step_with_builder_and_results(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    ops = StepBuilder().get_usage().free("r0")
    assert len(ops) == 2
    async with AsyncKVCacheClient(address) as client:
        response = await client.step(ops)
    assert fake.seen[0].request == v1.StepRequest(
        ops=[v1.StepOp(get_usage=v1.GetUsageRequest()), v1.StepOp(free=v1.FreeRequest(request_id="r0"))]
    )
    usage, error = step_results(response)
    assert usage == v1.GetUsageResponse(num_free_blocks=9)
    assert isinstance(error, KVServiceError)
    assert (error.code, error.message) == (grpc.StatusCode.NOT_FOUND, "request_id 'r0' is not registered")


async def test_given_channel_is_not_closed_by_the_client(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    async with grpc.aio.insecure_channel(address) as channel:
        async with AsyncKVCacheClient(channel) as client:
            assert client.channel is channel
        assert (await AsyncKVCacheClient(channel).ping(b"still open")).payload == b"still open"


# --- sync client (run off the event loop that serves the fake) ----------------------------------


async def test_sync_client_call_path_deadline_metadata_and_errors(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served

    def run() -> tuple[bytes, KVServiceError]:
        with KVCacheClient(address, token="tok") as client:
            payload = client.ping(b"hi", timeout=datetime.timedelta(seconds=20), metadata={"x-call": "2"}).payload
            with pytest.raises(KVServiceError) as info:
                client.free("ghost")
            return payload, info.value

    payload, err = await asyncio.to_thread(run)
    assert payload == b"hi"
    assert (err.code, err.message) == (grpc.StatusCode.NOT_FOUND, "request_id 'ghost' is not registered")
    assert isinstance(err.__cause__, grpc.RpcError)
    ping = fake.seen[0]
    assert ping.metadata == (("authorization", "Bearer tok"), ("x-call", "2"))
    assert ping.time_remaining == _about(20.0)


async def test_sync_stream_events_translates_errors(served) -> None:  # type: ignore[no-untyped-def]
    address, fake = served
    fake.stream_error = (grpc.StatusCode.OUT_OF_RANGE, "start_seq 1 is below the oldest seq held (5)")

    def run() -> tuple[list[int], KVServiceError]:
        seqs: list[int] = []
        with KVCacheClient(address) as client:
            with pytest.raises(KVServiceError) as info:
                for batch in client.stream_events(start_seq=1):
                    seqs.append(batch.seq)
        return seqs, info.value

    seqs, err = await asyncio.to_thread(run)
    assert seqs == [1, 2]
    assert err.code == grpc.StatusCode.OUT_OF_RANGE
    assert err.message == "start_seq 1 is below the oldest seq held (5)"


async def test_sync_stream_closed_early_cancels_the_call(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served

    def run() -> int:
        with KVCacheClient(address) as client:
            stream: Iterator[v1.EventBatch] = client.stream_events()
            first = next(stream)
            stream.close()  # type: ignore[attr-defined]
            return first.seq

    assert await asyncio.to_thread(run) == 0


# --- request building without a server ----------------------------------------------------------
