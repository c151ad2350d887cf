"""Server reflection over the committed stubs, on a real grpc.aio server (127.0.0.1, port 0)."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest


async def test_server_reflection_resolves_the_service_by_symbol() -> None:
    """The staged descriptor file name breaks nothing that resolves by symbol (grpcurl, reflection)."""
    reflection = pytest.importorskip("grpc_reflection.v1alpha.reflection")
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kvservice_client._proto.kvservice import v1

    service_name = v1.KVCacheServiceStub.__name__.removesuffix("Stub")
    full_name = f"kvservice.v1.{service_name}"
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    v1.add_KVCacheServiceServicer_to_server(v1.KVCacheServiceServicer(), server)
    reflection.enable_server_reflection([full_name, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=full_name)]), timeout=10
            )
            responses = [response async for response in call]
    finally:
        await server.stop(None)
    (response,) = responses
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(serialized)
        for serialized in response.file_descriptor_response.file_descriptor_proto
    ]
    # The service's file first, then what it imports (descriptor.proto, for the method options):
    # a pool takes a file after its dependencies, as grpcurl adds them.
    assert [f.name for f in files] == [
        "kvservice_client/_proto/kvservice/v1/kv_cache_service.proto",
        "google/protobuf/descriptor.proto",
    ]
    pool = descriptor_pool.DescriptorPool()
    for file in reversed(files):
        pool.Add(file)
    service = pool.FindServiceByName(full_name)
    assert [m.name for m in service.methods][:2] == ["GetComputedBlocks", "AllocateSlots"]
    assert pool.FindMessageTypeByName("kvservice.v1.EventBatch").fields_by_name["msgpack"].number == 6
