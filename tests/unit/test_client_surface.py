"""The public surface of kvservice_client: the curated namespace, the twin clients' parity, the
status enum and TLSConfig (no server)."""

from __future__ import annotations

import datetime
import importlib
import inspect
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import pytest

import kvservice_client
import kvservice_client.client as client_module
from kvservice_client import (
    AsyncKVCacheClient,
    KVCacheClient,
    KVServiceError,
    StatusCode,
    StepBuilder,
    TLSConfig,
)
from kvservice_client._facade import _RPC, _PlanMethod, unary
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._proto.kvservice.v1 import kv_cache_service_rpcs as rpcs
from kvservice_client.data import AsyncDataPlaneMethods, BlockingDataPlaneMethods, DataPlaneRPCs
from kvservice_client.rpc_table import KV_CACHE_SERVICE, snake_case
from kvservice_client.tier import TierRPCs
from kvservice_client.tls import resolve_channel_security

ISSUE_NAMES = {
    "KVCacheClient",
    "AsyncKVCacheClient",
    "StepBuilder",
    "EventWatcher",
    "JetStreamWatcher",
    "PrefixIndex",
    "HitPredictor",
    "RetryPolicy",
    "TLSConfig",
    "KVServiceError",
    "StatusCode",
}


def test_the_namespace_exports_the_public_names():
    assert ISSUE_NAMES <= set(kvservice_client.__all__)
    for name in kvservice_client.__all__:
        assert getattr(kvservice_client, name) is not None, name
    assert kvservice_client.EventWatcher.__name__ == "EventWatcher"
    with pytest.raises(AttributeError):
        _ = kvservice_client.NoSuchName  # type: ignore[attr-defined]  # the point of the test


def _public_modules() -> list[str]:
    return [
        f"kvservice_client.{info.name}"
        for info in pkgutil.iter_modules(kvservice_client.__path__)
        if not info.name.startswith("_")
    ]


@pytest.mark.parametrize("module_name", _public_modules())
def test_every_module_declares_all_and_has_each_name(module_name: str):
    if module_name == "kvservice_client.torch_view":  # the kvservice-client[torch] extra
        pytest.importorskip("torch")
    module = importlib.import_module(module_name)
    assert isinstance(module.__all__, list) and module.__all__, module_name
    assert [name for name in module.__all__ if not hasattr(module, name)] == []


@pytest.mark.parametrize(
    ("module_name", "name"),
    [
        ("kvservice_client.client", "KVServiceError"),
        ("kvservice_client.client", "StepBuilder"),
        ("kvservice_client.client", "StepOpResponse"),
        ("kvservice_client.client", "step_results"),
        ("kvservice_client.client", "Metadata"),
        ("kvservice_client.client", "ReportMode"),
        ("kvservice_client.watcher", "EventWatcher"),
        ("kvservice_client.watcher", "RetryPolicy"),
        ("kvservice_client.jetstream", "JetStreamWatcher"),
    ],
)
def test_the_old_import_paths_still_work(module_name: str, name: str):
    assert hasattr(importlib.import_module(module_name), name)


def test_the_namespace_and_jetstream_import_without_nats():
    """nats-py is optional: importing the namespace and JetStreamWatcher needs it not."""
    code = (
        "import sys\n"
        "sys.modules['nats'] = None\n"  # makes `import nats` raise ImportError
        "import kvservice_client\n"
        "w = kvservice_client.JetStreamWatcher\n"
        "from kvservice_client.jetstream import import_nats\n"
        "try:\n"
        "    import_nats()\n"
        "except RuntimeError as e:\n"
        "    print(str(e).split(' (')[0], '|', str(e).split(': ')[-1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert (
        out
        == "JetStreamWatcher needs nats-py, which is not installed | pip install nats-py (kvservice-client's nats extra)\n"
    )


def test_torch_view_without_torch_says_how_to_install_it():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "try:\n"
        "    import kvservice_client.torch_view\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == (
        "torch | kvservice_client.torch_view maps the server's KV memory as torch tensors and needs torch, which is "
        "not installed: pip install torch (or './clients/python[torch]' from a kvservice checkout); "
        "kvservice_client.data reads and writes blocks as bytes without it\n"
    )


# --- the twin clients ------------------------------------------------------------------------


def _public_methods(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


def test_both_clients_have_the_same_public_methods():
    assert sorted(_public_methods(KVCacheClient)) == sorted(_public_methods(AsyncKVCacheClient))
    assert {
        "get_computed_blocks",
        "allocate_slots",
        "free",
        "step",
        "stream_events",
        "take_events",
        "ping",
        "close",
        "attach_kv_cache",
        "write_blocks",
        "read_blocks",
        "iter_read_blocks",
    } <= set(_public_methods(KVCacheClient))


def _normalized_signature(function: object) -> str:
    text = str(inspect.signature(function))  # type: ignore[arg-type]  # a function, checked by the caller
    return text.replace("AsyncIterator[", "Iterator[").replace("grpc.aio.Channel", "grpc.Channel")


@pytest.mark.parametrize("name", sorted(_public_methods(KVCacheClient)))
def test_the_twin_methods_have_identical_signatures_and_docs(name: str):
    """The async client is the sync one as coroutines: same parameters, defaults, annotations
    (``AsyncIterator`` for ``Iterator``) and the very same docstring."""
    sync, async_ = _public_methods(KVCacheClient)[name], _public_methods(AsyncKVCacheClient)[name]
    assert inspect.getdoc(sync) and inspect.getdoc(sync) == inspect.getdoc(async_)
    if isinstance(sync, property):
        assert isinstance(async_, property)
        return
    assert _normalized_signature(sync) == _normalized_signature(async_)
    assert not inspect.iscoroutinefunction(sync)
    server_streaming = {rpc.client_method for rpc in KV_CACHE_SERVICE if rpc.response_streaming}
    assert server_streaming == {"stream_events", "read_blocks"}
    # read_blocks is the data-plane helper (a list of blocks); iter_read_blocks streams them.
    assert inspect.iscoroutinefunction(async_) == (name not in ("stream_events", "iter_read_blocks"))


def test_the_constructors_take_the_same_arguments():
    assert _normalized_signature(KVCacheClient.__init__) == _normalized_signature(AsyncKVCacheClient.__init__)


RPC_METHODS = {
    "get_computed_blocks": "pb.GetComputedBlocksResponse",
    "allocate_slots": "pb.AllocateSlotsResponse",
    "free": "pb.FreeResponse",
    "reset_prefix_cache": "pb.ResetPrefixCacheResponse",
    "get_usage": "pb.GetUsageResponse",
    "step": "pb.StepResponse",
    "decode": "pb.DecodeResponse",
    "take_events": "pb.TakeEventsResponse",
    "get_kv_cache_group_metadata": "pb.GetKVCacheGroupMetadataResponse",
    "ping": "pb.PingResponse",
}


# The RPCs whose method is the generated default (it takes the request message).
DEFAULT_RPC_METHODS = {
    "manager_step": "pb.ManagerStepResponse",
}

# The RPCs whose method is a plain data-plane helper (kvservice_client.data) over the default.
DATA_PLANE_METHODS = ("read_blocks",)

# The tier's unary RPCs (kvservice_client.tier.TierRPCs entries) and their answers; PutBlocks is a
# plan entry of the same table (it asks the layout first when it must), over the default.
TIER_RPC_METHODS = {
    "lookup_blocks": "pb.LookupBlocksResponse",
    "reserve_blocks": "pb.ReserveBlocksResponse",
    "commit_blocks": "pb.CommitBlocksResponse",
    "lease_blocks": "pb.LeaseBlocksResponse",
    "release_lease": "pb.ReleaseLeaseResponse",
}

# The methods that are plans (entries of kvservice_client.tier.TierRPCs and
# kvservice_client.data.DataPlaneRPCs): the RPCs each calls, and its answer.
PLAN_METHODS = {
    "put_blocks": (TierRPCs, ("GetKVCacheGroupMetadata", "PutBlocks"), "pb.PutBlocksResponse"),
    "attach_kv_cache": (DataPlaneRPCs, ("AttachKVCache",), "pb.AttachKVCacheResponse"),
    "write_blocks": (DataPlaneRPCs, ("GetKVCacheGroupMetadata", "WriteBlocks"), "pb.WriteBlocksResponse"),
}


def _entries() -> dict[str, _RPC]:
    """Each client method's entry: the hand-written one, else the generated default."""
    generated = {n: e for n, e in vars(rpcs.KVCacheServiceMethods).items() if isinstance(e, _RPC)}
    written = {n: e for n, e in vars(client_module._KVCacheServiceRPCs).items() if isinstance(e, _RPC)}
    tier = {n: e for n, e in vars(TierRPCs).items() if isinstance(e, _RPC)}
    return {**generated, **tier, **written}


def test_each_rpc_of_the_proto_has_a_method_generated_or_written():
    """The generated defaults are one per RPC of the proto, under the RPC's snake-case name, and
    each hand-written entry calls an RPC of the proto (``decode`` calls Step)."""
    service = pb.DESCRIPTOR.services_by_name["KVCacheService"]
    generated = {n: e for n, e in vars(rpcs.KVCacheServiceMethods).items() if isinstance(e, _RPC)}
    assert {name: entry.method for name, entry in generated.items()} == {
        snake_case(m.name): m.name for m in service.methods
    }
    written = {n: e.method for n, e in vars(client_module._KVCacheServiceRPCs).items() if isinstance(e, _RPC)}
    assert written == {
        **{name: generated[name].method for name in RPC_METHODS if name != "decode"},
        "decode": "Step",
    } | {"stream_events": "StreamEvents"}


def test_each_rpc_of_the_table_is_a_plain_function_of_each_client():
    """Both clients' RPC methods come from one table (the generated defaults, some replaced by the
    hand-written entries of client._KVCacheServiceRPCs); each client holds its own function per
    entry, with the entry's docstring and the method's return type."""
    entries = {n: e for n, e in _entries().items() if n not in (*DATA_PLANE_METHODS, *PLAN_METHODS)}
    unary_methods = {**RPC_METHODS, **DEFAULT_RPC_METHODS, **TIER_RPC_METHODS}
    assert set(entries) == {*unary_methods, "stream_events"}
    for name in DATA_PLANE_METHODS:  # the helpers replace the generated defaults
        assert inspect.getattr_static(KVCacheClient, name) is inspect.getattr_static(BlockingDataPlaneMethods, name)
        assert inspect.getattr_static(AsyncKVCacheClient, name) is inspect.getattr_static(AsyncDataPlaneMethods, name)
    for name, (table, calls, answer) in PLAN_METHODS.items():  # run by the blocking client, awaited by the async one
        plan = vars(table)[name]
        assert isinstance(plan, _PlanMethod) and plan.calls == calls
        for cls in (KVCacheClient, AsyncKVCacheClient):
            function = vars(cls)[name]
            assert (function.__qualname__, function.__module__) == (f"{cls.__name__}.{name}", "kvservice_client.client")
            assert (function.__doc__, inspect.signature(function).return_annotation) == (plan.doc, answer)
            assert inspect.iscoroutinefunction(function) == (cls is AsyncKVCacheClient)
    returns = {
        cls: {name: inspect.signature(vars(cls)[name]).return_annotation for name in entries}
        for cls in (KVCacheClient, AsyncKVCacheClient)
    }
    assert returns[KVCacheClient] == {**unary_methods, "stream_events": "Iterator[pb.EventBatch]"}
    assert returns[AsyncKVCacheClient] == {**unary_methods, "stream_events": "AsyncIterator[pb.EventBatch]"}
    for cls in (KVCacheClient, AsyncKVCacheClient):
        for name, entry in entries.items():
            function = vars(cls)[name]
            assert inspect.isfunction(function)
            assert (function.__qualname__, function.__module__) == (f"{cls.__name__}.{name}", "kvservice_client.client")
            assert function.__doc__ == entry.build.__doc__


def test_a_generated_default_takes_the_request_message_and_is_documented_by_the_proto():
    signature = inspect.signature(KVCacheClient.manager_step)
    assert str(signature) == (
        "(self, request: 'pb.ManagerStepRequest | None' = None, *, timeout: 'Timeout' = None, "
        "metadata: 'Metadata' = None) -> 'pb.ManagerStepResponse'"
    )
    assert KVCacheClient.manager_step.__doc__.startswith("vLLM's KV cache manager for a scheduler")
    assert str(inspect.signature(rpcs.KVCacheServiceMethods.write_blocks.build)).startswith("(self, requests")


def _calls_of_each_method(client: Any) -> list[tuple[str, Callable[[], object]]]:
    """(method name, a call of it) for each RPC method of ``client``."""
    return [
        (
            "get_computed_blocks",
            lambda: client.get_computed_blocks("r", [1, 2], kv_cache_report_mode="full", timeout=2.0),
        ),
        ("allocate_slots", lambda: client.allocate_slots("r", 4, new_token_ids=[7], metadata={"k": "v"})),
        ("free", lambda: client.free(pb.FreeRequest(request_id="r"))),
        ("reset_prefix_cache", lambda: client.reset_prefix_cache()),
        ("get_usage", lambda: client.get_usage(GIVEN_USAGE_REQUEST, timeout=datetime.timedelta(seconds=3))),
        ("step", lambda: client.step(StepBuilder().get_usage())),
        ("decode", lambda: client.decode(["a", "b"], [5, 6])),
        ("stream_events", lambda: client.stream_events(start_seq=3)),
        ("take_events", lambda: client.take_events("c", max_batches=2)),
        ("get_kv_cache_group_metadata", lambda: client.get_kv_cache_group_metadata()),
        ("ping", lambda: client.ping(b"x")),
    ]


GIVEN_USAGE_REQUEST = pb.GetUsageRequest()
DECODED = pb.DecodeResponse(num_groups=1, changed_indices=[1])


def _answer(method: str) -> object:
    if method == "Step":
        return pb.StepResponse(results=[pb.StepOpResult(decode=DECODED)])
    return f"{method} answer"


EXPECTED_RPCS = [
    (
        "GetComputedBlocks",
        pb.GetComputedBlocksRequest(
            request_id="r", prompt_token_ids=[1, 2], kv_cache_report_mode=pb.KV_CACHE_REPORT_MODE_FULL
        ),
        2.0,
        None,
    ),
    ("AllocateSlots", pb.AllocateSlotsRequest(request_id="r", num_new_tokens=4, new_token_ids=[7]), None, {"k": "v"}),
    ("Free", pb.FreeRequest(request_id="r"), None, None),
    ("ResetPrefixCache", pb.ResetPrefixCacheRequest(), None, None),
    ("GetUsage", pb.GetUsageRequest(), datetime.timedelta(seconds=3), None),
    ("Step", pb.StepRequest(ops=[pb.StepOp(get_usage=pb.GetUsageRequest())]), None, None),
    (
        "Step",
        pb.StepRequest(ops=[pb.StepOp(decode=pb.DecodeRequest(request_ids=["a", "b"], new_token_ids=[5, 6]))]),
        None,
        None,
    ),
    ("StreamEvents", pb.StreamEventsRequest(start=pb.EVENT_START_SEQ, start_seq=3), None, None),
    ("TakeEvents", pb.TakeEventsRequest(consumer="c", max_batches=2), None, None),
    ("GetKVCacheGroupMetadata", pb.GetKVCacheGroupMetadataRequest(), None, None),
    ("Ping", pb.PingRequest(payload=b"x"), None, None),
]


EXPECTED_RESULTS = [
    ("get_computed_blocks", "GetComputedBlocks answer"),
    ("allocate_slots", "AllocateSlots answer"),
    ("free", "Free answer"),
    ("reset_prefix_cache", "ResetPrefixCache answer"),
    ("get_usage", "GetUsage answer"),
    ("step", _answer("Step")),
    ("decode", DECODED),
    ("stream_events", "StreamEvents answer"),
    ("take_events", "TakeEvents answer"),
    ("get_kv_cache_group_metadata", "GetKVCacheGroupMetadata answer"),
    ("ping", "Ping answer"),
]


def test_each_blocking_method_sends_its_rpc_the_request_its_arguments_make():
    sent: list[tuple[str, object, object, object]] = []

    class Recording(KVCacheClient):
        def _rpc(self, method, request, timeout, metadata):
            sent.append((method, request, timeout, metadata))
            return _answer(method)

    with Recording("127.0.0.1:1") as client:
        results = [(name, call()) for name, call in _calls_of_each_method(client)]
    assert sent == EXPECTED_RPCS
    assert sent[3][1] is not GIVEN_USAGE_REQUEST and sent[4][1] is GIVEN_USAGE_REQUEST  # a given request is sent as is
    assert results == EXPECTED_RESULTS


async def test_each_async_method_sends_its_rpc_the_request_its_arguments_make():
    sent: list[tuple[str, object, object, object]] = []

    class Recording(AsyncKVCacheClient):
        def _rpc(self, method, request, timeout, metadata):
            sent.append((method, request, timeout, metadata))
            if method == "StreamEvents":
                return _answer(method)  # the async client's _rpc gives streams as they are

            async def answer() -> object:
                return _answer(method)

            return answer()

    async with Recording("127.0.0.1:1") as client:
        results = []
        for name, call in _calls_of_each_method(client):
            result = call()
            results.append((name, result if name == "stream_events" else await result))
    assert sent == EXPECTED_RPCS
    assert sent[4][1] is GIVEN_USAGE_REQUEST
    assert results == EXPECTED_RESULTS


def test_a_table_entry_needs_keyword_only_timeout_and_metadata():
    def build(self, request_id: str, timeout: object = None, *, metadata: object = None) -> pb.FreeRequest:
        return pb.FreeRequest(request_id=request_id)

    with pytest.raises(TypeError, match="build: needs a keyword-only 'timeout' defaulting to None"):
        unary("Free", pb.FreeResponse)(build)


# --- StatusCode and KVServiceError ------------------------------------------------------------


def test_status_code_numbers_and_names_are_grpcs():
    assert [(code.name, code.value) for code in StatusCode] == [(code.name, code.value) for code in grpc.StatusCode]
    assert [int(code) for code in StatusCode] == list(range(17))


def test_status_code_mixes_with_grpc_status_code():
    assert StatusCode.NOT_FOUND == grpc.StatusCode.NOT_FOUND
    assert grpc.StatusCode.NOT_FOUND == StatusCode.NOT_FOUND
    assert StatusCode.NOT_FOUND != grpc.StatusCode.INTERNAL
    assert StatusCode.NOT_FOUND in {grpc.StatusCode.NOT_FOUND}
    assert grpc.StatusCode.UNAVAILABLE in frozenset({StatusCode.UNAVAILABLE})
    assert StatusCode.NOT_FOUND.grpc_code is grpc.StatusCode.NOT_FOUND
    assert StatusCode.NOT_FOUND != 5  # an enum, not an int: compare with int(code)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.ALREADY_EXISTS, StatusCode.ALREADY_EXISTS),
        (StatusCode.ABORTED, StatusCode.ABORTED),
        (11, StatusCode.OUT_OF_RANGE),
        (99, StatusCode.UNKNOWN),
        (None, StatusCode.UNKNOWN),
    ],
)
def test_kvservice_error_keeps_the_package_status(code: object, expected: StatusCode):
    err = KVServiceError(code, "m")  # type: ignore[arg-type]  # None is the odd one, on purpose
    assert err.code is expected
    assert str(err) == f"{expected.name}: m"


def test_a_failed_step_op_becomes_the_package_status():
    err = KVServiceError.from_op_status(pb.OpStatus(code=5, message="request_id 'x' is not registered"))
    assert (err.code, err.message) == (StatusCode.NOT_FOUND, "request_id 'x' is not registered")
    assert KVServiceError.from_op_status(pb.OpStatus(code=99, message="?")).code is StatusCode.UNKNOWN


def test_reading_an_error_code_needs_no_grpc_import():
    code = (
        "import sys\n"
        "from kvservice_client import KVServiceError, StatusCode\n"
        "print('grpc' in sys.modules, KVServiceError(StatusCode.NOT_FOUND, 'x').code is StatusCode.NOT_FOUND)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False True\n"


# --- TLSConfig --------------------------------------------------------------------------------


def test_tls_config_needs_key_and_chain_together():
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        TLSConfig(private_key=b"k")
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        resolve_channel_security(False, None, None, b"c", None)


def test_plain_text_without_tls():
    assert resolve_channel_security(False, None, None, None, None) == (None, [])


def test_tls_config_gives_credentials_and_the_name_override():
    creds, options = resolve_channel_security(TLSConfig(target_name_override="kv.internal"), None, None, None, None)
    assert isinstance(creds, grpc.ChannelCredentials)
    assert options == [("grpc.ssl_target_name_override", "kv.internal")]


def test_the_loose_pem_arguments_are_still_accepted():
    creds, options = resolve_channel_security(False, b"ca", None, None, None)
    assert isinstance(creds, grpc.ChannelCredentials) and options == []


@pytest.mark.parametrize(
    ("tls", "root", "credentials", "message"),
    [
        (TLSConfig(), b"ca", None, "pass either tls=TLSConfig"),
        (True, None, "creds", "pass either credentials or tls/PEM bytes"),
        (False, b"ca", "creds", "pass either credentials or tls/PEM bytes"),
    ],
)
def test_conflicting_tls_arguments_are_refused(tls: object, root: bytes | None, credentials: object, message: str):
    with pytest.raises(TypeError, match=message):
        resolve_channel_security(tls, root, None, None, credentials)  # type: ignore[arg-type]  # stand-in creds


def test_a_tls_config_with_a_ready_channel_is_refused():
    channel = grpc.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(TypeError, match="apply only when target is an address"):
            KVCacheClient(channel, tls=TLSConfig())
    finally:
        channel.close()


def test_tls_config_reads_pem_files(tmp_path):
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "c.pem").write_bytes(b"CERT")
    (tmp_path / "c.key").write_bytes(b"KEY")
    config = TLSConfig.from_files(tmp_path / "ca.pem", cert=tmp_path / "c.pem", key=tmp_path / "c.key")
    assert config == TLSConfig(root_certificates=b"CA", private_key=b"KEY", certificate_chain=b"CERT")


def test_retry_codes_match_whichever_enum_they_are_given_in():
    from kvservice_client import RetryPolicy

    assert KVServiceError(grpc.StatusCode.UNAVAILABLE, "x").code in RetryPolicy().retryable_codes
    legacy = RetryPolicy(retryable_codes=frozenset({grpc.StatusCode.UNAVAILABLE}))
    assert KVServiceError(StatusCode.UNAVAILABLE, "x").code in legacy.retryable_codes
    assert StatusCode.NOT_FOUND not in RetryPolicy().retryable_codes


@pytest.mark.parametrize("cls", [KVCacheClient, AsyncKVCacheClient])
@pytest.mark.parametrize(
    ("name", "args", "kwargs", "message"),
    [
        ("ping", (b"x", 2), {}, "ping() takes from 1 to 2 positional arguments but 3 were given"),
        ("ping", (), {"foo": 1}, "ping() got an unexpected keyword argument 'foo'"),
        ("get_usage", (1, 2), {}, "get_usage() takes from 1 to 2 positional arguments but 3 were given"),
        ("get_usage", (), {"bar": 1}, "get_usage() got an unexpected keyword argument 'bar'"),
        ("get_computed_blocks", (), {}, "get_computed_blocks() missing 1 required positional argument: 'request_id'"),
        ("put_blocks", (0, []), {"chunk": 4}, "put_blocks() got an unexpected keyword argument 'chunk'"),
    ],
)
async def test_a_wrong_call_names_the_clients_method(cls, name, args, kwargs, message):
    """A call with the wrong arguments raises TypeError naming the user's method
    (``KVCacheClient.ping()``), not the table's builder (``_KVCacheServiceRPCs.ping()``,
    ``_whole_request.<locals>.build()``)."""
    client = cls("127.0.0.1:1")
    try:
        with pytest.raises(TypeError) as err:
            result = getattr(client, name)(*args, **kwargs)
            if inspect.isawaitable(result):
                await result
        assert str(err.value) == f"{cls.__name__}.{message}"
    finally:
        closed = client.close()
        if inspect.isawaitable(closed):
            await closed


BAD_METADATA = [
    ({"X-Upper": "v"}, "metadata: key 'X-Upper'"),
    ([("x-a", "\u00e9")], "metadata: the value of 'x-a'"),
    ([("", "v")], "metadata: key ''"),
    ([("x-a", "line\nbreak")], "metadata: the value of 'x-a'"),
]


@pytest.mark.parametrize(("metadata", "message"), BAD_METADATA)
def test_bad_metadata_is_a_value_error_naming_it_in_both_clients(metadata, message):
    """Metadata gRPC would refuse (a key not lower-case ASCII letters, digits, '-', '_', '.'; a
    value of a non -bin key not printable ASCII) is a ValueError naming the key, at construction
    and per call, in both clients, before anything is sent: today the blocking client's call fails
    with INTERNAL 'Invalid metadata' and the async one with grpc's internal ExecuteBatchError."""
    with pytest.raises(ValueError, match=message):
        KVCacheClient("127.0.0.1:1", metadata=metadata)
    with pytest.raises(ValueError, match=message):
        AsyncKVCacheClient("127.0.0.1:1", metadata=metadata)
    with KVCacheClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match=message):
            client.ping(b"x", metadata=metadata)


@pytest.mark.parametrize(("metadata", "message"), BAD_METADATA)
async def test_bad_call_metadata_is_a_value_error_in_the_async_client(metadata, message):
    async with AsyncKVCacheClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match=message):
            await client.ping(b"x", metadata=metadata)
        with pytest.raises(ValueError, match=message):
            client.stream_events(metadata=metadata)


def test_good_metadata_passes_as_given():
    pairs = (("x-a", "v 1"), ("x-b.c_d", "~"), ("x-bin", b"\x00\xff"))
    with KVCacheClient("127.0.0.1:1", metadata=dict(pairs)) as client:
        assert client._call_options("Ping", None, [("x-c", b"ok")])["metadata"] == (*pairs, ("x-c", b"ok"))


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "field"),
    [
        ("stream_events", (), {"start_seq": -1}, "start_seq"),
        ("stream_events", (), {"group_idxs": [-1]}, "group_idxs"),
        ("take_events", ("c",), {"start_seq": -1}, "start_seq"),
        ("take_events", ("c",), {"max_batches": -1}, "max_batches"),
        ("take_events", ("c",), {"group_idxs": [2**32]}, "group_idxs"),
        ("get_computed_blocks", ("r", "abc"), {}, "prompt_token_ids"),
    ],
)
def test_a_value_protobuf_refuses_is_a_value_error_naming_the_field(name, args, kwargs, field):
    """As allocate_slots already does ("num_new_tokens: Value out of range: -1"), not protobuf's
    bare "Value out of range: -1" (or an AttributeError for a string of token ids)."""
    with KVCacheClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match=f"^{field}: "):
            getattr(client, name)(*args, **kwargs)


@pytest.mark.parametrize("client_type", ["KVCacheClient", "AsyncKVCacheClient"])
def test_a_target_that_is_a_bare_path_is_refused_naming_the_unix_form(client_type):
    # gRPC would look "/run/kvservice.sock" up as a host name ("Domain name not found").
    client_class = getattr(kvservice_client, client_type)
    with pytest.raises(ValueError) as caught:
        client_class("/run/kvservice.sock")
    assert (
        str(caught.value)
        == "target '/run/kvservice.sock' is a path: a Unix socket's target is 'unix:/run/kvservice.sock'"
    )
