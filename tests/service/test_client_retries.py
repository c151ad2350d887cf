"""The client's gRPC retry policy, against a scripted servicer on a real grpc.aio server (port 0):
an idempotent call that ends UNAVAILABLE is sent again; a call that changes state is not."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import IDEMPOTENT_METHODS, AsyncKVCacheClient, KVCacheClient, KVServiceError, StatusCode

SERVICE = "kvservice.v1.KVCacheService"


class Flaky:
    """Answers each method UNAVAILABLE ``failures`` times, then OK; counts the attempts."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts: dict[str, int] = {}

    def handler(self, method: str, request_type: type, response: object) -> grpc.RpcMethodHandler:
        async def behavior(request: object, context: grpc.aio.ServicerContext) -> object:
            self.attempts[method] = self.attempts.get(method, 0) + 1
            if self.attempts[method] <= self.failures:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "server restarting")
            return response

        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=request_type.FromString, response_serializer=lambda m: m.SerializeToString()
        )


async def _serve(flaky: Flaky) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    handlers = {
        "Ping": flaky.handler("Ping", pb.PingRequest, pb.PingResponse(payload=b"x")),
        "GetUsage": flaky.handler("GetUsage", pb.GetUsageRequest, pb.GetUsageResponse(num_free_blocks=7)),
        "AllocateSlots": flaky.handler("AllocateSlots", pb.AllocateSlotsRequest, pb.AllocateSlotsResponse()),
        "Free": flaky.handler("Free", pb.FreeRequest, pb.FreeResponse()),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_an_idempotent_call_is_sent_again_after_unavailable():
    flaky = Flaky(failures=3)
    server, address = await _serve(flaky)
    try:
        async with AsyncKVCacheClient(address, timeout=30) as client:
            assert (await client.ping(b"x")).payload == b"x"
            assert (await client.get_usage()).num_free_blocks == 7
        assert flaky.attempts == {"Ping": 4, "GetUsage": 4}  # 3 UNAVAILABLE, then the answer
    finally:
        await server.stop(0)


async def test_retries_end_after_four_attempts_with_the_last_status():
    flaky = Flaky(failures=10)
    server, address = await _serve(flaky)
    try:
        async with AsyncKVCacheClient(address, timeout=30) as client:
            with pytest.raises(KVServiceError) as failed:
                await client.ping(b"x")
        assert (failed.value.code, failed.value.message) == (StatusCode.UNAVAILABLE, "server restarting")
        assert flaky.attempts == {"Ping": 4}
    finally:
        await server.stop(0)


@pytest.mark.parametrize("method", ["AllocateSlots", "Free"])
async def test_a_call_that_changes_state_is_not_sent_again(method):
    flaky = Flaky(failures=1)
    server, address = await _serve(flaky)
    try:
        async with AsyncKVCacheClient(address, timeout=30) as client:
            with pytest.raises(KVServiceError) as failed:
                if method == "AllocateSlots":
                    await client.allocate_slots("r1", 8)
                else:
                    await client.free("r1")
        assert failed.value.code is StatusCode.UNAVAILABLE
        assert flaky.attempts == {method: 1}
    finally:
        await server.stop(0)


async def test_the_blocking_client_retries_too_and_a_channels_own_config_wins():
    import asyncio
    import json

    flaky = Flaky(failures=1)
    server, address = await _serve(flaky)
    try:

        def calls() -> None:
            with KVCacheClient(address, timeout=30) as client:
                assert client.ping(b"x").payload == b"x"
            no_retries = [("grpc.service_config", json.dumps({"methodConfig": []}))]
            with KVCacheClient(address, timeout=30, options=no_retries) as client:
                with pytest.raises(KVServiceError):
                    client.get_usage()

        await asyncio.to_thread(calls)
        assert flaky.attempts == {"Ping": 2, "GetUsage": 1}
    finally:
        await server.stop(0)


def test_the_idempotent_methods_are_rpcs_of_the_service():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["KVCacheService"].methods}
    assert set(IDEMPOTENT_METHODS) <= methods
    assert not {"AllocateSlots", "Free", "Step", "ResetPrefixCache", "TakeEvents", "WriteBlocks"} & set(
        IDEMPOTENT_METHODS
    )
