"""Server lifecycle: graceful shutdown ends streams with UNAVAILABLE, health, reflection, deadlines,
and the memory-budget path (num_blocks from kv_cache_memory)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvservice.server.app import start_server
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVServiceError
from tests.service.helpers import H, events_of, next_batch, read_batches, stored

pytestmark = pytest.mark.timeout(30)

SERVICE = "kvservice.v1.KVCacheService"


async def admit(client, request_id, prompt):
    await client.get_computed_blocks(request_id, prompt)
    assert (await client.allocate_slots(request_id, len(prompt))).allocated


async def test_shutdown_ends_open_streams_with_unavailable_naming_the_last_seq(kv_server, connect):
    scheduler, watcher, health_client = [await connect(kv_server) for _ in range(3)]
    epoch = kv_server.event_log.epoch
    health = health_pb2_grpc.HealthStub(health_client.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

    caught_up = watcher.stream_events(start_seq=1)
    await admit(scheduler, "A", range(1, 9))
    await admit(scheduler, "B", range(20, 24))
    assert [b.seq for b in await read_batches(caught_up, 2)] == [1, 2]
    live = watcher.stream_events(start_seq=3)
    snapshot = watcher.stream_events(snapshot=True)
    snap = await next_batch(snapshot)
    assert (snap.seq, snap.snapshot) == (2, True)
    pending = [asyncio.ensure_future(next_batch(s)) for s in (caught_up, live, snapshot)]

    stopping = asyncio.ensure_future(kv_server.stop(5.0))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    for task in pending:
        with pytest.raises(KVServiceError) as err:
            await task
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert err.value.message == f"server shutting down; last seq delivered 2 of epoch {epoch}"
    await stopping  # every call ended: the grace period is not waited out
    assert kv_server.event_log.num_subscribers == 0


async def test_health_serving_for_the_server_and_the_service(kv_server, client):
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", SERVICE):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_service_and_serves_its_descriptor(kv_server, client):
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await call.read()
    assert {s.name for s in listed.list_services_response.service} == {
        SERVICE,
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.health.v1.Health",
    }
    await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE))
    files = (await call.read()).file_descriptor_response.file_descriptor_proto
    await call.done_writing()
    # The service's file, then what it imports (descriptor.proto: the RPCs' method options).
    descriptor, imported = (descriptor_pb2.FileDescriptorProto.FromString(f) for f in files)
    assert imported.name == "google/protobuf/descriptor.proto"
    assert list(descriptor.dependency) == ["google/protobuf/descriptor.proto"]
    # The staged path gen_protos.py documents; resolution is by symbol, which is what clients use.
    assert descriptor.name == "kvservice_client/_proto/kvservice/v1/kv_cache_service.proto"
    assert descriptor.package == "kvservice.v1"
    [service] = descriptor.service
    assert (service.name, [m.name for m in service.method]) == (
        "KVCacheService",
        [
            "GetComputedBlocks",
            "AllocateSlots",
            "Free",
            "ResetPrefixCache",
            "GetUsage",
            "Step",
            "StreamEvents",
            "TakeEvents",
            "GetKVCacheGroupMetadata",
            "Ping",
            "AttachKVCache",
            "WriteBlocks",
            "ReadBlocks",
            "ManagerStep",
            "LookupBlocks",
            "ReserveBlocks",
            "CommitBlocks",
            "PutBlocks",
            "LeaseBlocks",
            "ReleaseLease",
        ],
    )


async def test_ping_echoes_and_a_deadline_ends_an_idle_stream(kv_server, client):
    assert (await client.ping(b"\x00payload")).payload == b"\x00payload"
    with pytest.raises(KVServiceError) as err:
        await next_batch(client.stream_events(timeout=0.2))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


QWEN_BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2
"""qwen-2.5-0.5b at block size 4: 24 layers x (K and V) x 4 tokens x 2 KV heads x 64 x bf16 bytes."""


async def test_memory_budget_sizes_the_pool(start_kv_server, connect):
    assert QWEN_BLOCK_BYTES == 49152
    running = await start_kv_server(device="cpu", num_blocks=None, kv_cache_memory=10 * QWEN_BLOCK_BYTES + 100)
    client = await connect(running)
    meta = await client.get_kv_cache_group_metadata()
    assert running.config.cache.num_blocks == 10
    assert [(g.num_blocks, g.bytes_per_block, g.device, g.dtype, g.num_layers) for g in meta.groups] == [
        (10, QWEN_BLOCK_BYTES, "cpu", "bfloat16", 24)
    ]
    assert (meta.medium, meta.preset) == ("GPU", "qwen-2.5-0.5b")  # vLLM's primary pool says GPU on any device
    usage = await client.get_usage()
    assert (usage.num_total_blocks, usage.num_free_blocks) == (9, 9)
    stream = client.stream_events(start_seq=1)
    await admit(client, "A", range(1, 13))
    assert events_of(await next_batch(stream)) == [stored(H[:3], None, range(1, 13))]
    usage = await client.get_usage()
    assert (usage.num_free_blocks, usage.usage) == (6, pytest.approx(3 / 9))


async def test_a_budget_below_two_blocks_is_refused_naming_it():
    with pytest.raises(ValueError, match="memory budget"):
        await start_server(
            host="127.0.0.1",
            port=0,
            device="cpu",
            preset="qwen-2.5-0.5b",
            block_size=4,
            kv_cache_memory=QWEN_BLOCK_BYTES + 1,
        )


async def test_metadata_head_seq_follows_the_log(kv_server, client):
    assert (await client.get_kv_cache_group_metadata()).head_seq == 0
    await admit(client, "A", range(1, 5))
    meta = await client.get_kv_cache_group_metadata()
    assert (meta.head_seq, meta.epoch) == (1, kv_server.event_log.epoch)
    assert meta.groups[0].kind == pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION


async def test_kv_events_medium_names_the_tier_on_every_event(start_kv_server, connect):
    running = await start_kv_server(device="cpu", kv_events_medium="CPU")
    client = await connect(running)
    assert (await client.get_kv_cache_group_metadata()).medium == "CPU"
    stream = client.stream_events(start_seq=1)
    await admit(client, "A", range(1, 9))
    assert events_of(await next_batch(stream)) == [stored(H[:2], None, range(1, 9), medium="CPU")]
