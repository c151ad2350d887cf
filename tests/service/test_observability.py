"""Logs and traces: --log-format json lines parse and carry the RPC and request id; an
OpenTelemetry span per RPC (the SDK's in-memory exporter), with Step's op counts."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvservice.server.observability import configure_logging
from kvservice_client.client import KVServiceError, StepBuilder

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

SERVICE = "kvservice.v1.KVCacheService"


@pytest.fixture
def json_log():
    """The root logger writing JSON at DEBUG into a buffer (restored after the test)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("DEBUG", "json", stream=buffer)
    yield buffer
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])


async def test_json_log_lines_parse_and_carry_the_rpc_and_request_id(start_kv_server, connect, json_log):
    running = await start_kv_server(log_format="json")
    client = await connect(running)
    await client.get_computed_blocks("r1", list(range(8)))
    await client.step(StepBuilder().allocate_slots("r1", 8).get_usage())
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    done = [
        (line["rpc"], line.get("request_id"), line["code"], line["level"], line["logger"])
        for line in lines
        if line["message"] == "rpc done"
    ]
    assert done == [
        ("KVCacheService/GetComputedBlocks", "r1", "OK", "DEBUG", "kvservice.server.observability"),
        ("KVCacheService/Step", None, "OK", "DEBUG", "kvservice.server.observability"),
    ]
    assert all(isinstance(line["duration_ms"], float) for line in lines if line["message"] == "rpc done")


def test_log_format_is_checked_and_text_stays_the_default():
    from kvservice.server.app import ServerConfig

    assert ServerConfig().logging.log_format == "text" and ServerConfig().logging.otel_tracing is False
    with pytest.raises(ValueError, match="log_format must be one of text, json; got 'xml'"):
        ServerConfig(log_format="xml")


@pytest.fixture(scope="module")
def spans():
    """OpenTelemetry's global tracer provider, once per process, exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = otel_sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another test set OpenTelemetry's global tracer provider first")
    return exporter


async def test_a_span_per_rpc_with_the_request_id_and_steps_op_counts(start_kv_server, connect, spans):
    running = await start_kv_server(otel_tracing=True)
    assert any(note.startswith("OpenTelemetry: a span per RPC") for note in running.notes)
    client = await connect(running)
    spans.clear()
    await client.get_computed_blocks("r1", list(range(8)))
    step = StepBuilder().get_computed_blocks("r2", list(range(100, 108))).allocate_slots("r2", 8)
    await client.step(step.allocate_slots("r1", 8).get_usage())
    with pytest.raises(KVServiceError):
        await client.free("nobody")
    got = [(s.name, s.kind.name, dict(s.attributes), s.status.status_code.name) for s in spans.get_finished_spans()]
    assert got == [
        (
            f"{SERVICE}/GetComputedBlocks",
            "SERVER",
            {
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": "GetComputedBlocks",
                "kvservice.request_id": "r1",
                "rpc.grpc.status_code": 0,
            },
            "UNSET",
        ),
        (
            f"{SERVICE}/Step",
            "SERVER",
            {
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": "Step",
                "kvservice.step.num_ops": 4,
                "kvservice.step.ops.allocate_slots": 2,
                "kvservice.step.ops.get_computed_blocks": 1,
                "kvservice.step.ops.get_usage": 1,
                "kvservice.request_ids": ("r1", "r2"),
                "rpc.grpc.status_code": 0,
            },
            "UNSET",
        ),
        (
            f"{SERVICE}/Free",
            "SERVER",
            {
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": "Free",
                "kvservice.request_id": "nobody",
                "rpc.grpc.status_code": 5,
            },
            "ERROR",
        ),
    ]
