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


def _rpc_attributes(method: str, code: int) -> dict:
    return {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method, "rpc.grpc.status_code": code}


_LIBRARY_ATTRIBUTES = {"rpc.user_agent", "net.peer.ip", "net.peer.port", "net.peer.name"}


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
    stream = client.stream_events(snapshot=True)
    assert (await anext(stream)).events  # a response-streaming call (context.write) gets its span too
    await running.stop()  # the stream's span ends with it
    await stream.aclose()
    got = [
        (s.name, s.kind.name, {k: v for k, v in s.attributes.items() if k not in _LIBRARY_ATTRIBUTES})
        for s in spans.get_finished_spans()
    ]
    assert got == [
        (
            f"/{SERVICE}/GetComputedBlocks",
            "SERVER",
            {**_rpc_attributes("GetComputedBlocks", 0), "kvservice.request_id": "r1"},
        ),
        (
            f"/{SERVICE}/Step",
            "SERVER",
            {
                **_rpc_attributes("Step", 0),
                "kvservice.step.num_ops": 4,
                "kvservice.step.ops.allocate_slots": 2,
                "kvservice.step.ops.get_computed_blocks": 1,
                "kvservice.step.ops.get_usage": 1,
                "kvservice.request_ids": ("r1", "r2"),
            },
        ),
        (f"/{SERVICE}/Free", "SERVER", {**_rpc_attributes("Free", 5), "kvservice.request_id": "nobody"}),
        (f"/{SERVICE}/StreamEvents", "SERVER", _rpc_attributes("StreamEvents", 14)),  # UNAVAILABLE: the stop
    ]
    statuses = [s.status.status_code.name for s in spans.get_finished_spans()]
    assert statuses == ["UNSET", "UNSET", "UNSET", "ERROR"]  # NOT_FOUND is the caller's: no server error
    assert all(s.parent is None for s in spans.get_finished_spans())  # no caller's context: each a root


async def test_a_span_is_the_child_of_the_callers_span(start_kv_server, spans):
    """The caller's context comes in W3C ``traceparent`` metadata: from the library's client
    interceptor on the channel a kvservice client is given, or written by hand."""
    import grpc
    from opentelemetry.instrumentation.grpc import aio_client_interceptors
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvservice_client import AsyncKVCacheClient

    running = await start_kv_server(otel_tracing=True)
    caller_spans = InMemorySpanExporter()
    caller = otel_sdk.TracerProvider()  # the calling program's own provider
    caller.add_span_processor(SimpleSpanProcessor(caller_spans))
    channel = grpc.aio.insecure_channel(running.address, interceptors=aio_client_interceptors(tracer_provider=caller))
    spans.clear()
    async with AsyncKVCacheClient(channel) as client:
        with caller.get_tracer("scheduler").start_as_current_span("schedule step"):
            await client.get_computed_blocks("r1", list(range(8)))
        await channel.close()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with AsyncKVCacheClient(running.address, metadata={"traceparent": f"00-{trace_id}-{parent_id}-01"}) as client:
        await client.ping(b"x")
    (step, client_call), (server_lookup, server_ping) = (
        caller_spans.get_finished_spans()[::-1],
        spans.get_finished_spans(),
    )
    assert (step.name, client_call.kind.name) == ("schedule step", "CLIENT")
    assert server_lookup.context.trace_id == step.context.trace_id
    assert server_lookup.parent.span_id == client_call.context.span_id
    assert (format(server_ping.context.trace_id, "032x"), format(server_ping.parent.span_id, "016x")) == (
        trace_id,
        parent_id,
    )


def test_json_mode_logs_uncaught_exceptions_and_warnings(json_log, monkeypatch):
    import sys
    import warnings

    from kvservice.server.observability import log_uncaught_exceptions_and_warnings

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    log_uncaught_exceptions_and_warnings()
    try:
        try:
            raise KeyError("boom")
        except KeyError:
            sys.excepthook(*sys.exc_info())
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    crash, warned = [json.loads(line) for line in json_log.getvalue().splitlines()]
    assert (crash["level"], crash["logger"], crash["message"]) == ("CRITICAL", "kvservice", "uncaught KeyError: 'boom'")
    assert crash["exc_info"].startswith("Traceback") and "KeyError: 'boom'" in crash["exc_info"]
    assert (warned["level"], warned["logger"]) == ("WARNING", "py.warnings")
    assert "DeprecationWarning: a deprecated thing" in warned["message"]


def test_banner_lines_are_text_or_json_at_any_level():
    from kvservice.server.observability import announce, banner, configure_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level, list(banner.handlers))
    try:
        for log_format in ("text", "json"):
            out, err = io.StringIO(), io.StringIO()
            configure_logging("ERROR", log_format, stream=err, out=out)
            announce("kvservice listening on 127.0.0.1:1 (epoch e)", "listening", address="127.0.0.1:1")
            if log_format == "text":
                assert out.getvalue() == "kvservice listening on 127.0.0.1:1 (epoch e)\n"
            else:
                line = json.loads(out.getvalue())
                assert (line["level"], line["logger"], line["event"], line["address"]) == (
                    "INFO",
                    "kvservice.serve",
                    "listening",
                    "127.0.0.1:1",
                )
            assert err.getvalue() == ""
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        for handler in list(banner.handlers):
            banner.removeHandler(handler)
        for handler in saved[2]:
            banner.addHandler(handler)


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, [("otlp", "OTLPSpanExporter")]),  # the specification's default
        ({"OTEL_TRACES_EXPORTER": "console"}, [("console", "ConsoleSpanExporter")]),
        (
            {"OTEL_TRACES_EXPORTER": "console, otlp_proto_grpc"},
            [("console", "ConsoleSpanExporter"), ("otlp_proto_grpc", "OTLPSpanExporter")],
        ),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ],
)
def test_the_exporters_are_the_ones_otel_traces_exporter_names(environ, exporters):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from kvservice.server.observability import _span_exporters

    assert [(name, type(exporter).__name__) for name, exporter in _span_exporters(environ)] == exporters


def test_an_exporter_nothing_provides_stops_the_start():
    from kvservice.server.observability import _span_exporters

    with pytest.raises(
        ValueError, match=r"OTEL_TRACES_EXPORTER: no installed exporter is called 'zipkin' \(pip install"
    ):
        _span_exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    import importlib.util

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:  # not in the otel extra
        with pytest.raises(ValueError, match="'otlp'"):
            _span_exporters({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
