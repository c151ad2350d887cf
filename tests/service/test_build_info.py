"""Versions: ``kvservice --version``, build info in Ping and GetKVCacheGroupMetadata, the
``kvservice_build_info`` metric, and the event sinks' publisher metrics."""

from __future__ import annotations

import importlib.metadata
import platform
import tomllib
from pathlib import Path

import pytest
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
    assert expected["torch_version"]  # the server imported torch for its KV tensors
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
