"""The RPC table: each RPC as the proto defines it, and everything derived from it (docs/ARCHITECTURE.md §6.5).

The table is read from the service descriptor and the ``(kvservice.v1.roles)`` options; these tests
read the descriptor again, on their own, and pin the table, so a method in the proto but not in the
table (or the other way round), a role or a Step op that changed, fails here.
"""

from __future__ import annotations

import pytest

from kvservice.server import auth
from kvservice.server.servicer import SERVICE_NAME, KVCacheServicer
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.rpc_table import KV_CACHE_SERVICE, ROLES, service_table, snake_case
from tests.unit.rpc_fixtures import Method, service_with

SCHEDULER = frozenset({"scheduler"})
WATCHER = frozenset({"scheduler", "watcher"})
WORKER = frozenset({"scheduler", "worker"})
WORKER_TIER = frozenset({"scheduler", "worker", "tier"})
TIER = frozenset({"scheduler", "tier"})
EVERYONE = frozenset(ROLES)

# name -> (request, response, kind, roles, Step op)
EXPECTED = {
    "GetComputedBlocks": (
        "GetComputedBlocksRequest",
        "GetComputedBlocksResponse",
        "unary_unary",
        SCHEDULER,
        "get_computed_blocks",
    ),
    "AllocateSlots": ("AllocateSlotsRequest", "AllocateSlotsResponse", "unary_unary", SCHEDULER, "allocate_slots"),
    "Free": ("FreeRequest", "FreeResponse", "unary_unary", SCHEDULER, "free"),
    "ResetPrefixCache": (
        "ResetPrefixCacheRequest",
        "ResetPrefixCacheResponse",
        "unary_unary",
        SCHEDULER,
        "reset_prefix_cache",
    ),
    "GetUsage": ("GetUsageRequest", "GetUsageResponse", "unary_unary", EVERYONE, "get_usage"),
    "Step": ("StepRequest", "StepResponse", "unary_unary", SCHEDULER, None),
    "StreamEvents": ("StreamEventsRequest", "EventBatch", "unary_stream", WATCHER, None),
    "TakeEvents": ("TakeEventsRequest", "TakeEventsResponse", "unary_unary", WATCHER, None),
    "GetKVCacheGroupMetadata": (
        "GetKVCacheGroupMetadataRequest",
        "GetKVCacheGroupMetadataResponse",
        "unary_unary",
        EVERYONE,
        None,
    ),
    "Ping": ("PingRequest", "PingResponse", "unary_unary", EVERYONE, None),
    "AttachKVCache": ("AttachKVCacheRequest", "AttachKVCacheResponse", "unary_unary", WORKER_TIER, None),
    "WriteBlocks": ("WriteBlocksChunk", "WriteBlocksResponse", "stream_unary", WORKER, None),
    "ReadBlocks": ("ReadBlocksRequest", "ReadBlocksChunk", "unary_stream", WORKER_TIER, None),
    "ManagerStep": ("ManagerStepRequest", "ManagerStepResponse", "unary_unary", frozenset({"scheduler"}), None),
    "LookupBlocks": ("LookupBlocksRequest", "LookupBlocksResponse", "unary_unary", EVERYONE, None),
    "ReserveBlocks": ("ReserveBlocksRequest", "ReserveBlocksResponse", "unary_unary", TIER, None),
    "CommitBlocks": ("CommitBlocksRequest", "CommitBlocksResponse", "unary_unary", TIER, None),
    "PutBlocks": ("PutBlocksMessage", "PutBlocksResponse", "stream_unary", TIER, None),
    "LeaseBlocks": ("LeaseBlocksRequest", "LeaseBlocksResponse", "unary_unary", TIER, None),
    "ReleaseLease": ("ReleaseLeaseRequest", "ReleaseLeaseResponse", "unary_unary", TIER, None),
}


def test_the_table_holds_exactly_the_protos_methods_in_its_order():
    service = pb.DESCRIPTOR.services_by_name["KVCacheService"]
    assert list(KV_CACHE_SERVICE.rpcs) == [m.name for m in service.methods]
    assert KV_CACHE_SERVICE.name == service.full_name == SERVICE_NAME == "kvservice.v1.KVCacheService"
    for method in service.methods:
        rpc = KV_CACHE_SERVICE.rpcs[method.name]
        assert rpc.method == f"/kvservice.v1.KVCacheService/{method.name}"
        assert rpc.request.DESCRIPTOR.full_name == method.input_type.full_name
        assert rpc.response.DESCRIPTOR.full_name == method.output_type.full_name
        assert (rpc.request_streaming, rpc.response_streaming) == (method.client_streaming, method.server_streaming)


def test_the_table_is_the_contract_as_pinned():
    got = {
        rpc.name: (rpc.request.__name__, rpc.response.__name__, rpc.kind, rpc.roles, rpc.step_op)
        for rpc in KV_CACHE_SERVICE
    }
    assert got == EXPECTED


def test_the_step_ops_are_the_stepop_members_whose_request_an_rpc_takes():
    members = {f.name: f.message_type.name for f in pb.StepOp.DESCRIPTOR.oneofs_by_name["op"].fields}
    assert members == {
        "get_computed_blocks": "GetComputedBlocksRequest",
        "allocate_slots": "AllocateSlotsRequest",
        "free": "FreeRequest",
        "reset_prefix_cache": "ResetPrefixCacheRequest",
        "get_usage": "GetUsageRequest",
        "decode": "DecodeRequest",  # a Step op only: no RPC takes a DecodeRequest
    }
    assert {rpc.step_op: rpc.request.__name__ for rpc in KV_CACHE_SERVICE if rpc.step_op} == {
        name: request for name, request in members.items() if name != "decode"
    }
    # The servicer runs each member through its method of the member's name (made in __init__).
    assert all(callable(getattr(KVCacheServicer, f"_{name}", None)) for name in members)


def test_the_role_sets_of_auth_are_the_tables():
    def names(methods: frozenset[str]) -> set[str]:
        assert all(m.startswith(f"/{SERVICE_NAME}/") for m in methods)
        return {m.rsplit("/", 1)[1] for m in methods}

    assert names(auth.WATCHER_METHODS) == {
        "StreamEvents",
        "TakeEvents",
        "GetKVCacheGroupMetadata",
        "GetUsage",
        "Ping",
        "LookupBlocks",
    }
    assert names(auth.WORKER_METHODS) == {
        "AttachKVCache",
        "ReadBlocks",
        "WriteBlocks",
        "GetKVCacheGroupMetadata",
        "GetUsage",
        "Ping",
        "LookupBlocks",
    }
    # A tier: blocks named by hash, the shared memory, block reads; no scheduler call, no
    # WriteBlocks into a request's block, no reset, no events (docs/tier.md).
    assert names(auth.TIER_METHODS) == {
        "LookupBlocks",
        "ReserveBlocks",
        "CommitBlocks",
        "PutBlocks",
        "LeaseBlocks",
        "ReleaseLease",
        "AttachKVCache",
        "ReadBlocks",
        "GetKVCacheGroupMetadata",
        "GetUsage",
        "Ping",
    }
    assert names(auth.MUTATING_METHODS) == {
        "GetComputedBlocks",
        "AllocateSlots",
        "Free",
        "ResetPrefixCache",
        "Step",
        "ManagerStep",
    }
    assert auth.ROLES == ROLES == ("scheduler", "watcher", "worker", "tier")


@pytest.mark.parametrize(
    ("name", "snake"),
    [
        ("GetComputedBlocks", "get_computed_blocks"),
        ("GetKVCacheGroupMetadata", "get_kv_cache_group_metadata"),
        ("AttachKVCache", "attach_kv_cache"),
        ("Ping", "ping"),
        ("GetV2Usage", "get_v2_usage"),
    ],
)
def test_snake_case_keeps_a_run_of_capitals_one_word(name: str, snake: str):
    assert snake_case(name) == snake


def test_a_new_rpc_is_in_the_table_with_the_roles_its_option_names():
    _, service = service_with(
        "TableWithTwoMore",
        [
            Method("Echo", "PingRequest", "PingResponse", roles=(pb.ROLE_WATCHER, pb.ROLE_WORKER)),
            Method("CurrentUsage", "GetUsageRequest", "GetUsageResponse"),
            Method("TailEvents", "StreamEventsRequest", "EventBatch", roles=(pb.ROLE_WATCHER,), server_streaming=True),
        ],
    )
    table = service_table(service, pb.StepOp.DESCRIPTOR)
    assert list(table.rpcs) == [*KV_CACHE_SERVICE.rpcs, "Echo", "CurrentUsage", "TailEvents"]
    echo, usage, tail = table.rpcs["Echo"], table.rpcs["CurrentUsage"], table.rpcs["TailEvents"]
    assert (echo.method, echo.client_method, echo.roles, echo.step_op, echo.kind) == (
        "/kvservice.v1.TableWithTwoMore/Echo",
        "echo",
        frozenset({"scheduler", "watcher", "worker"}),
        None,
        "unary_unary",
    )
    assert (usage.roles, usage.step_op, usage.request, usage.response) == (
        SCHEDULER,
        "get_usage",
        pb.GetUsageRequest,
        pb.GetUsageResponse,
    )
    assert (tail.roles, tail.kind) == (WATCHER, "unary_stream")
    assert table.methods_of("worker") == {
        f"/kvservice.v1.TableWithTwoMore/{name}"
        for name in (*(n for n, e in EXPECTED.items() if "worker" in e[3]), "Echo")
    }
    assert table.by_client_method("current_usage") is usage
    with pytest.raises(KeyError, match="has no RPC whose client method is 'nope'"):
        table.by_client_method("nope")


def test_a_roles_option_naming_no_role_is_refused():
    _, service = service_with(
        "TableWithUnspecifiedRole",
        [Method("Echo", "PingRequest", "PingResponse", roles=(pb.ROLE_UNSPECIFIED,))],
        keep_kv_cache_service=False,
    )
    with pytest.raises(
        ValueError,
        match=r"kvservice\.v1\.TableWithUnspecifiedRole\.Echo: option \(kvservice\.v1\.roles\) names ROLE_UNSPECIFIED",
    ):
        service_table(service)


def test_two_rpcs_with_one_client_method_name_are_refused():
    _, service = service_with(
        "TableWithTwins",
        [
            Method("GetKVUsage", "GetUsageRequest", "GetUsageResponse"),
            Method("GetKvUsage", "PingRequest", "PingResponse"),
        ],
        keep_kv_cache_service=False,
    )
    with pytest.raises(ValueError, match="a second RPC whose client method is 'get_kv_usage'"):
        service_table(service)


def test_the_step_builder_adds_any_step_op_by_its_request():
    from kvservice_client.client import StepBuilder

    request = pb.DecodeRequest(request_ids=["a"], new_token_ids=[5])
    built = StepBuilder().op(pb.GetUsageRequest()).op(request).op(pb.FreeRequest(request_id="r")).build()
    assert built == pb.StepRequest(
        ops=[
            pb.StepOp(get_usage=pb.GetUsageRequest()),
            pb.StepOp(decode=request),
            pb.StepOp(free=pb.FreeRequest(request_id="r")),
        ]
    )
    with pytest.raises(
        TypeError, match=r"no Step op takes a kvservice\.v1\.PingRequest; the ops take kvservice\.v1\.Allo"
    ):
        StepBuilder().op(pb.PingRequest())
