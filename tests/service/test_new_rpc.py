"""An RPC added to the proto needs its handler and nothing else: the token check, the registration
and both clients take it from the service's descriptor (docs/ARCHITECTURE.md §6.5).

The service here is kvservice.v1's own RPCs plus two new ones, built as a ``.proto`` would define them
(:mod:`tests.unit.rpc_fixtures`): ``Echo`` (callable by watchers too, by its ``roles`` option) with a
handler in a servicer subclass, and ``CurrentUsage``, whose request is a Step op's (GetUsageRequest),
with no handler at all. A real server (the app's engine, event log and servicer parts) serves it on
port 0 behind the unchanged ``AuthInterceptor``; the clients are the unchanged client classes given
the new table and what ``scripts/gen_protos.py`` generates for it. No module of the project is edited
or patched.
"""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from kvservice.server.auth import AuthInterceptor, TokenEntry, TokenTable
from kvservice.server.servicer import KVCacheServicer
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient, KVServiceError, _install_rpcs
from kvservice_client.rpc_table import service_table
from tests.unit.rpc_fixtures import Method, generated_methods, service_with

pytestmark = pytest.mark.timeout(60)

TOKENS = {"scheduler": "sched-token-0123456789abcdef", "watcher": "watch-token-0123456789abcdef"}
TOKENS["worker"] = "worker-token-0123456789abcdef"

FILE, SERVICE = service_with(
    "KVCacheServiceWithEcho",
    [
        Method("Echo", "PingRequest", "PingResponse", roles=(pb.ROLE_WATCHER,)),
        Method("CurrentUsage", "GetUsageRequest", "GetUsageResponse"),
    ],
)
TABLE = service_table(SERVICE, pb.StepOp.DESCRIPTOR)
GENERATED = generated_methods(FILE)


class EchoServicer(KVCacheServicer):
    """The new RPC's handler: all a new RPC needs of the server."""

    async def Echo(self, request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse(payload=request.payload[::-1])


class EchoClient(AsyncKVCacheClient, GENERATED.KVCacheServiceWithEchoMethods):
    _service = TABLE


class BlockingEchoClient(KVCacheClient, GENERATED.KVCacheServiceWithEchoMethods):
    _service = TABLE


_install_rpcs(EchoClient, asynchronous=True)
_install_rpcs(BlockingEchoClient, asynchronous=False)


@pytest.fixture
async def echo_server(kv_server):
    """``kv_server``'s cache served as KVCacheServiceWithEcho, with bearer tokens; its address."""
    part = kv_server.servicer
    servicer = EchoServicer(part.engine, part.event_log, part.metadata, snapshots=part.snapshots)
    tokens = TokenTable(
        TokenEntry(name=f"{role}-1", role=role, digest=hashlib.sha256(token.encode()).digest())
        for role, token in TOKENS.items()
    )
    server = grpc.aio.server(interceptors=[AuthInterceptor(tokens, TABLE)])
    server.add_generic_rpc_handlers((servicer.generic_handler(TABLE),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)
    await servicer.close()


async def test_the_new_rpcs_are_served_checked_and_called_with_no_edit(echo_server, kv_server):
    async with EchoClient(echo_server, token=TOKENS["scheduler"], timeout=10.0) as client:
        assert (await client.echo(pb.PingRequest(payload=b"abc"))).payload == b"cba"
        # A Step op's request with no handler: the op itself, as its unary RPC runs it.
        await client.get_computed_blocks("r", list(range(1, 9)))
        assert (await client.allocate_slots("r", 8)).allocated
        usage = await client.current_usage()
        assert usage == await client.get_usage()
        assert (usage.num_running_requests, usage.num_free_blocks) == (1, 13)
        # The old RPCs, hand-written and generated methods alike, under the new service's name.
        assert (await client.ping(b"x")).payload == b"x"
        assert (await client.free("r")).num_freed_blocks == 2

    async with EchoClient(echo_server, token=TOKENS["watcher"], timeout=10.0) as watcher:
        assert (await watcher.echo(pb.PingRequest(payload=b"ab"))).payload == b"ba"
        with pytest.raises(KVServiceError) as err:
            await watcher.current_usage()
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.message == (
            "/kvservice.v1.KVCacheServiceWithEcho/CurrentUsage: token 'watcher-1' has role 'watcher', which may "
            "call only Echo, GetKVCacheGroupMetadata, GetUsage, LookupBlocks, Ping, StreamEvents, TakeEvents and reflection"
        )

    async with EchoClient(echo_server, token=TOKENS["worker"], timeout=10.0) as worker:
        for call in (worker.echo(pb.PingRequest(payload=b"ab")), worker.current_usage()):
            with pytest.raises(KVServiceError) as err:
                await call
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert (await worker.get_usage()).num_running_requests == 0

    def blocking_echo() -> bytes:  # on a thread: the server runs on this loop
        with BlockingEchoClient(echo_server, token=TOKENS["scheduler"], timeout=10.0) as blocking:
            return blocking.echo(pb.PingRequest(payload=b"xy")).payload

    assert await asyncio.to_thread(blocking_echo) == b"yx"
    # The real service is untouched: it has no Echo.
    async with AsyncKVCacheClient(kv_server.address, timeout=10.0) as plain:
        assert not hasattr(plain, "echo")
        assert (await plain.ping(b"p")).payload == b"p"


def test_a_client_class_whose_table_lacks_a_method_for_an_rpc_is_refused():
    class Stale(AsyncKVCacheClient):  # the new table, but not the methods generated for it
        _service = TABLE

    with pytest.raises(TypeError, match=r"no method calls Echo, CurrentUsage of kvservice\.v1\.KVCacheServiceWithEcho"):
        _install_rpcs(Stale, asynchronous=True)


def test_a_servicer_without_the_new_handler_is_refused_at_registration(kv_server):
    part = kv_server.servicer
    with pytest.raises(
        TypeError, match=r"KVCacheServicer has no handler Echo for /kvservice\.v1\.KVCacheServiceWithEcho/Echo"
    ):
        part.generic_handler(TABLE)


def test_the_registration_serves_each_rpc_of_the_table_with_its_kind(kv_server):
    from kvservice_client.rpc_table import KV_CACHE_SERVICE

    generic = kv_server.servicer.generic_handler()

    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str) -> None:
            self.method, self.invocation_metadata = method, ()

    for rpc in KV_CACHE_SERVICE:
        handler = generic.service(Details(rpc.method))
        assert handler is not None, rpc.name
        assert (handler.request_streaming, handler.response_streaming) == (
            rpc.request_streaming,
            rpc.response_streaming,
        )
        # StreamEvents and TakeEvents send snapshot parts serialized once for every reader, ReadBlocks its chunks
        # serialized on the data plane's threads; the rest their messages.
        assert (handler.response_serializer is None) == (rpc.name in ("StreamEvents", "TakeEvents", "ReadBlocks")), (
            rpc.name
        )
        # Every request is parsed by the servicer: a unary one by _parsed, a client stream's messages by
        # _parsed_stream (INVALID_ARGUMENT naming the field, never gRPC's own INTERNAL).
        assert handler.request_deserializer is None, rpc.name
    assert generic.service(Details(f"/{KV_CACHE_SERVICE.name}/NoSuchMethod")) is None
