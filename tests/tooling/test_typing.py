"""The type check: mypy (pinned in the dev extra; configuration in pyproject.toml ``[tool.mypy]``)
over ``kvservice/`` and ``clients/python/kvservice_client`` (the generated stubs through their
.pyi), zero errors, no unused ``# type: ignore`` (``warn_unused_ignores``), and every ignore left
names its error code and says why."""

from __future__ import annotations

import re

from tests.tooling.tools import ROOT, run_tool

CHECKED = [ROOT / "kvservice", ROOT / "clients/python/kvservice_client"]
_IGNORE = re.compile(r"#\s*type:\s*ignore")
_JUSTIFIED = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(, [a-z-]+)*\]  # \S.*$")


def test_mypy_finds_no_error():
    result = run_tool("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found"), result.stdout


def test_every_type_ignore_names_its_code_and_a_reason():
    unjustified = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for base in CHECKED
        for path in sorted(base.rglob("*.py"))
        if "_proto" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _IGNORE.search(line) and not _JUSTIFIED.search(line)
    ]
    assert unjustified == []


def test_the_checker_is_configured_strictly_enough():
    text = (ROOT / "pyproject.toml").read_text()
    for setting in (
        "warn_unused_ignores = true",
        "warn_return_any = true",
        "disallow_untyped_defs = true",
        'enable_error_code = ["ignore-without-code"]',
    ):
        assert setting in text, setting


# The clients' RPC methods are made from one table (kvservice_client.client._KVCacheServiceRPCs);
# the table's typed __get__ overloads are all a type checker sees of them. This use of both
# clients must check exactly as if the methods were written out: each line marked "# E: code"
# fails with that code and no other line fails (an Any-typed method would fail none).
_CLIENT_USE = """\
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio

from kvservice_client import AsyncKVCacheClient, KVCacheClient, StepBuilder
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb


async def use(client: KVCacheClient, aclient: AsyncKVCacheClient) -> None:
    hit: pb.GetComputedBlocksResponse = client.get_computed_blocks("r", [1], kv_cache_report_mode="full", timeout=1.0)
    ahit: pb.GetComputedBlocksResponse = await aclient.get_computed_blocks("r", [1], metadata={"k": "v"})
    slots: pb.AllocateSlotsResponse = client.allocate_slots("r", 4, new_token_ids=[5])
    freed: pb.FreeResponse = await aclient.free("r")
    step: pb.StepResponse = client.step(StepBuilder().get_usage())
    decoded: pb.DecodeResponse = await aclient.decode(["r"], [1])
    batches: Iterator[pb.EventBatch] = client.stream_events(start_seq=1)
    abatches: AsyncIterator[pb.EventBatch] = aclient.stream_events(snapshot=True)
    taken: pb.TakeEventsResponse = client.take_events("c", max_batches=2)
    meta: pb.GetKVCacheGroupMetadataResponse = await aclient.get_kv_cache_group_metadata()
    pong: pb.PingResponse = KVCacheClient.ping(client, b"x")
    put: pb.PutBlocksResponse = client.put_blocks(0, [(b"k" * 32, b"")], chunk_bytes=4)
    aput: pb.PutBlocksResponse = await aclient.put_blocks(0, [], bytes_per_block=4)
    attached: pb.AttachKVCacheResponse = await aclient.attach_kv_cache(timeout=1.0)
    wrote: pb.WriteBlocksResponse = client.write_blocks("r", [(0, 1, b"")], chunk_bytes=4)
    channel: grpc.Channel = client.channel
    achannel: grpc.aio.Channel = aclient.channel
    client.ping(1)  # E: arg-type
    unawaited_put: pb.PutBlocksResponse = aclient.put_blocks(0, [])  # E: assignment
    client.put_blocks(0, [], chunk=4)  # E: call-arg
    client.write_blocks(1, [])  # E: arg-type
    client.free("r", bogus=1)  # E: call-arg
    client.allocate_slots("r", 4, 0)  # E: call-arg
    wrong: pb.PingResponse = client.free("r")  # E: assignment
    unawaited: pb.PingResponse = aclient.ping()  # E: assignment
    sync_batches: Iterator[pb.EventBatch] = aclient.stream_events()  # E: assignment
    await aclient.get_usage(timeout="1s")  # E: arg-type
    KVCacheClient(aclient.channel)  # E: arg-type
"""


def test_the_clients_methods_are_typed_as_if_written_out(tmp_path):
    source = tmp_path / "client_use.py"
    source.write_text(_CLIENT_USE)
    result = run_tool("mypy", "--config-file", str(ROOT / "pyproject.toml"), str(source))
    found = sorted(
        (int(match[1]), match[2])
        for match in re.finditer(r"^[^:\n]+:(\d+): error: .*\[([a-z-]+)\]$", result.stdout, re.MULTILINE)
    )
    expected = sorted(
        (n, line.split("# E: ")[1]) for n, line in enumerate(_CLIENT_USE.splitlines(), 1) if "# E: " in line
    )
    assert found == expected, result.stdout
