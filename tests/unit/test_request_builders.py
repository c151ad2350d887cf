"""Building requests and Steps on the client side, before any call (no server)."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from array import array

import grpc
import grpc.aio
import pytest

from kvservice_client._proto.kvservice import v1
from kvservice_client.client import (
    KVServiceError,
    StepBuilder,
)
from kvservice_client.request_builders import get_computed_blocks_request, pack_token_ids


def test_request_and_fields_together_are_refused() -> None:
    with pytest.raises(TypeError, match="pass either a GetComputedBlocksRequest or its fields, not both"):
        StepBuilder().get_computed_blocks(v1.GetComputedBlocksRequest(request_id="r"), [1])
    with pytest.raises(TypeError, match="needs num_new_tokens"):
        StepBuilder().allocate_slots("r")
    with pytest.raises(ValueError, match="kv_cache_report_mode must be 'incremental' or 'full'"):
        StepBuilder().get_computed_blocks("r", [1], kv_cache_report_mode="sometimes")  # type: ignore[arg-type]


def test_step_builder_builds_ops_in_order() -> None:
    request = (
        StepBuilder()
        .get_computed_blocks("r1", [1, 2], kv_cache_report_mode="incremental")
        .allocate_slots("r1", 2, num_lookahead_tokens=1, new_token_ids=[3])
        .free("r0")
        .reset_prefix_cache()
        .get_usage()
        .build()
    )
    assert [op.WhichOneof("op") for op in request.ops] == [
        "get_computed_blocks",
        "allocate_slots",
        "free",
        "reset_prefix_cache",
        "get_usage",
    ]
    assert request.ops[0].get_computed_blocks.kv_cache_report_mode == v1.KV_CACHE_REPORT_MODE_INCREMENTAL
    assert request.ops[1].allocate_slots == v1.AllocateSlotsRequest(
        request_id="r1", num_new_tokens=2, num_lookahead_tokens=1, new_token_ids=[3]
    )


def test_op_status_with_an_unknown_code_is_unknown() -> None:
    err = KVServiceError.from_op_status(v1.OpStatus(code=99, message="?"))
    assert err.code == grpc.StatusCode.UNKNOWN


def test_importing_events_and_hashing_loads_no_grpc() -> None:
    code = (
        "import sys, kvservice_client, kvservice_client.events, kvservice_client.hashing\n"
        "assert 'grpc' not in sys.modules and 'google.protobuf' not in sys.modules, sorted(sys.modules)\n"
        "from kvservice_client import KVCacheClient, v1\n"
        "assert 'grpc' in sys.modules and v1.PingRequest\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_out_of_range_arguments_fail_before_the_call_naming_the_field() -> None:
    from kvservice_client.client import KVCacheClient

    with KVCacheClient("127.0.0.1:1") as client:  # never reached: the request cannot be built
        with pytest.raises(ValueError, match=r"^num_new_tokens: Value out of range: -1"):
            client.allocate_slots("w", -1)
        with pytest.raises(ValueError, match=r"^num_lookahead_tokens: Value out of range"):
            client.allocate_slots("w", 1, num_lookahead_tokens=2**40)
        with pytest.raises(ValueError, match=r"^prompt_token_ids: Value out of range"):
            client.get_computed_blocks("w", [1, 2**70])


@pytest.mark.parametrize("token", ["", "é" * 20, "two words", "tab\there"])
def test_a_token_that_cannot_be_sent_as_metadata_is_refused_at_construction(token):
    from kvservice_client.client import KVCacheClient

    with pytest.raises(ValueError, match="token: must be non-empty printable ASCII without spaces"):
        KVCacheClient("127.0.0.1:1", token=token)


def test_pack_token_ids_packs_int32_buffers_and_nothing_else():
    ids = [1, 2, 2**31 - 1]
    expected = struct.pack("<3i", *ids)
    assert pack_token_ids(array("i", ids)) == expected
    assert pack_token_ids(expected) == expected
    assert pack_token_ids(bytearray(expected)) == expected
    assert pack_token_ids(memoryview(expected)) == expected
    for not_packed in (ids, tuple(ids), range(3), array("q", ids), array("h", [1, 2]), iter(ids)):
        assert pack_token_ids(not_packed) is None, not_packed
    with pytest.raises(ValueError, match="prompt_token_ids: 7 bytes, not a multiple of 4"):
        pack_token_ids(expected[:7])
    request = get_computed_blocks_request("r", array("i", ids), None, None, None, None, ())
    assert request.packed_prompt_token_ids == expected and not request.prompt_token_ids
    request = get_computed_blocks_request("r", ids, None, None, None, None, ())
    assert list(request.prompt_token_ids) == ids and not request.packed_prompt_token_ids


@pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="numpy is not installed (the client needs none)")
def test_pack_token_ids_packs_a_numpy_int32_array_and_leaves_int64_alone():
    import numpy as np

    assert pack_token_ids(np.array([1, 2, 3], dtype=np.int32)) == struct.pack("<3i", 1, 2, 3)
    assert pack_token_ids(np.array([1, 2, 3], dtype=np.int64)) is None
    assert pack_token_ids(np.array([1, 2, 3], dtype=">i4")) is None  # not native: as prompt_token_ids


def test_a_buffer_of_unsigned_bytes_that_is_not_bytes_goes_as_token_ids():
    # array('B') (and a numpy uint8 array) has the byte format of bytes: these are token ids, one
    # per item, not little-endian int32 bytes (array('B', [1, 2, 3, 4]) packed was token 67305985)
    request = get_computed_blocks_request("r", array("B", [1, 2, 3, 4]), None, None, None, None, ())
    assert list(request.prompt_token_ids) == [1, 2, 3, 4] and not request.packed_prompt_token_ids
    assert pack_token_ids(array("B", [1, 2, 3])) is None
    assert pack_token_ids(memoryview(bytes([1, 0, 0, 0]))) == struct.pack("<i", 1)


@pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="numpy is not installed (the client needs none)")
def test_a_numpy_uint8_array_goes_as_token_ids():
    import numpy as np

    request = get_computed_blocks_request("r", np.array([5, 6, 7], dtype=np.uint8), None, None, None, None, ())
    assert list(request.prompt_token_ids) == [5, 6, 7] and not request.packed_prompt_token_ids


# --- decode: per-request token lists -------------------------------------------------------------


def test_decode_takes_one_token_list_per_request_as_the_flat_form():
    from kvservice_client.request_builders import decode_request

    flat = decode_request(["a", "b", "c"], [7, 8, 9, 10], [1, 2, 1], (), ())
    assert decode_request(["a", "b", "c"], [[7], [8, 9], [10]], (), (), ()) == flat
    assert decode_request(["a", "b", "c"], [(7,), array("i", [8, 9]), [10]], [1, 2, 1], (), ()) == flat
    assert list(decode_request(["a", "b"], [5, 6], (), (), ()).new_token_ids) == [5, 6]  # one each, as before


@pytest.mark.parametrize(
    ("new_token_ids", "num_new_token_ids", "error", "message"),
    [
        ([[1]], (), ValueError, "new_token_ids has 1 per-request lists for 2 request_ids"),
        ([[1], [2]], [1, 2], ValueError, r"num_new_token_ids \[1, 2\] differs from the lengths .* \[1, 1\]"),
        ([[1], 2], (), TypeError, "must be ints, or one sequence of ints per request"),
        (["x", "y"], (), TypeError, "new_token_ids is one flat sequence of ints, request after request, or one"),
    ],
)
def test_decode_token_ids_of_another_shape_are_named(new_token_ids, num_new_token_ids, error, message):
    from kvservice_client.request_builders import decode_request

    with pytest.raises(error, match=message):
        decode_request(["a", "b"], new_token_ids, num_new_token_ids, (), ())
