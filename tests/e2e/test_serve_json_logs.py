"""``kvservice serve --log-format json``: every line the process writes, on stdout and stderr, is
one JSON object: the start-up lines, the notes (the probes' with HOST:PORT), log records, the
stop, and command-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from kvservice_client import KVCacheClient, KVServiceError, StatusCode
from tests.e2e.test_cli import TIMEOUT_S, Lines

SMALL = ("--preset", "qwen-2.5-0.5b", "--block-size", "4", "--num-blocks", "16")


def _spawn(*args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


def _objects(lines: list[str]) -> list[dict]:
    objects = [json.loads(line) for line in lines]  # every line, or the test fails here
    assert all(isinstance(o, dict) and {"time", "level", "logger", "message"} <= set(o) for o in objects), objects
    return objects


@pytest.mark.slow
def test_every_line_of_a_served_run_is_json():
    serve = _spawn(
        "serve",
        "--log-format",
        "json",
        "--log-level",
        "info",
        "--port",
        "0",
        *SMALL,
        "--health-port",
        "0",
        "--health-http-port",
        "0",
        "--metrics-port",
        "0",
        "--request-idle-timeout-s",
        "1",
        KVSERVICE_NO_SUCH_SETTING="1",  # a WARNING while the settings load
    )
    try:
        out = Lines(serve.stdout)
        listening = json.loads(out.wait_for('"event": "listening"'))
        address = listening["address"]
        assert listening["message"] == f"kvservice listening on {address} (epoch {listening['epoch']})"
        out.wait_for("request_idle_timeout_s")  # the last note
        with KVCacheClient(address) as client:
            assert client.get_computed_blocks("r1", list(range(9))).num_computed_tokens == 0
            assert list(client.allocate_slots("r1", 9).new_block_ids[0].block_ids) == [1, 2, 3]
            with pytest.raises(KVServiceError) as refused:
                client.free("no-such-request")
            assert refused.value.code is StatusCode.NOT_FOUND
            assert client.ping(b"x").payload == b"x"
        out.wait_for("freed 1 request(s) idle")  # the reaper's INFO line, logged on the loop
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(TIMEOUT_S) == 0
        out.wait_for('"event": "stopped"')
        assert out.rest() == []
    finally:
        if serve.poll() is None:
            serve.kill()
    objects = _objects(out.seen)
    assert [o.get("event") for o in objects if o["logger"] == "kvservice.serve"] == [
        "listening",
        "layout",
        *["note"] * 6,
        "stopping",
        "stopped",
    ]
    # kvservice.shm's note on the segments of a crashed kvservice it removed at start depends on
    # what ran on this machine before (another test's killed server); it is a JSON line like the rest.
    messages = [
        (o["level"], o["logger"], o["message"])
        for o in objects
        if o["logger"] not in ("kvservice.serve", "kvservice.shm")
    ]
    assert messages == [
        (
            "WARNING",
            "kvservice.server.settings",  # load_config warns (it lives beside the settings)
            "ignoring KVSERVICE_NO_SUCH_SETTING: no setting is called no_such_setting",
        ),
        ("INFO", "kvservice.server.reaper", "freed 1 request(s) idle for 1 s or more (request_idle_timeout_s): r1"),
    ]
    probes = next(o["message"] for o in objects if "probes" in o["message"])
    assert re.fullmatch(
        r"note: probes \(plain text, no token\): grpc\.health\.v1 on 127\.0\.0\.1:\d+, "
        r"HTTP /healthz /readyz on 127\.0\.0\.1:\d+",
        probes,
    ), probes
    layout = next(o for o in objects if o.get("event") == "layout")
    assert (layout["preset"], layout["num_blocks"], layout["max_model_len"]) == ("qwen-2.5-0.5b", 16, 60)
    stopping = next(o for o in objects if o.get("event") == "stopping")
    assert (stopping["drain_delay_s"], stopping["shutdown_grace_s"]) == (0.0, 5.0)


@pytest.mark.parametrize(
    ("args", "env", "code", "message"),
    [
        (("--num-blocks", "1"), {}, 1, "num_blocks must be >= 2 (block 0 is the null block); got 1"),
        (("--no-such-flag",), {}, 2, "No such option '--no-such-flag'."),
        (("--num-blocks", "1"), {"KVSERVICE_LOG_FORMAT": "json"}, 1, "num_blocks must be >= 2"),
    ],
    ids=["bad setting", "usage error", "json from the environment"],
)
def test_a_command_line_error_is_one_json_line(args, env, code, message):
    flags = () if env else ("--log-format", "json")
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "serve", *flags, "--port", "0", *SMALL, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == code
    assert result.stdout == ""
    (error,) = _objects(result.stderr.splitlines())
    assert (error["level"], error["logger"]) == ("ERROR", "kvservice.cli")
    assert error["message"].startswith(message)
    assert ("usage" in error) is (code == 2)


@pytest.mark.slow
def test_otel_console_exporter_prints_a_span_per_rpc_with_the_callers_trace_id():
    """``OTEL_TRACES_EXPORTER=console``: one span per RPC on stdout (a JSON object per line, as
    every other line with ``--log-format json``), its trace id the caller's when the call sent
    a ``traceparent``."""
    pytest.importorskip("opentelemetry.instrumentation.grpc")
    serve = _spawn(
        "serve", "--log-format", "json", "--otel-tracing", "--port", "0", *SMALL, OTEL_TRACES_EXPORTER="console"
    )
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        out = Lines(serve.stdout)
        address = json.loads(out.wait_for('"event": "listening"'))["address"]
        note = json.loads(out.wait_for("OpenTelemetry"))["message"]
        assert (
            note
            == "note: OpenTelemetry: a span per RPC to console (OTEL_TRACES_EXPORTER; OTEL_EXPORTER_* configure them)"
        )
        with KVCacheClient(address) as client:
            traced = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
            client.get_computed_blocks("r1", list(range(9)), metadata=traced)
            client.allocate_slots("r1", 9, metadata=traced)
            client.ping(b"x")  # no context: a trace of its own
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(TIMEOUT_S) == 0
        out.rest()
    finally:
        if serve.poll() is None:
            serve.kill()
    objects = [json.loads(line) for line in out.seen]
    spans = [o for o in objects if "context" in o and "kind" in o]
    assert [(s["name"], s["kind"], s["attributes"]["rpc.grpc.status_code"]) for s in spans] == [
        ("/kvservice.v1.KVCacheService/GetComputedBlocks", "SpanKind.SERVER", 0),
        ("/kvservice.v1.KVCacheService/AllocateSlots", "SpanKind.SERVER", 0),
        ("/kvservice.v1.KVCacheService/Ping", "SpanKind.SERVER", 0),
    ]
    assert [(s["context"]["trace_id"], s["parent_id"]) for s in spans[:2]] == [(f"0x{trace_id}", f"0x{parent_id}")] * 2
    assert spans[2]["context"]["trace_id"] != f"0x{trace_id}" and spans[2]["parent_id"] is None
    assert spans[0]["attributes"]["kvservice.request_id"] == "r1"
    assert spans[0]["resource"]["attributes"]["service.name"] == "kvservice"
    assert all({"time", "level", "logger", "message"} <= set(o) for o in objects if o not in spans)


@pytest.mark.slow
def test_otel_otlp_exporter_sends_the_spans_to_a_collector():
    """``OTEL_TRACES_EXPORTER=otlp`` (the otel extra's OTLP/gRPC exporter) with the standard
    ``OTEL_EXPORTER_OTLP_*`` variables: the spans reach a collector (one made here)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the generated name)
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    received.extend(span.name for span in scope_spans.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    serve = _spawn(
        "serve",
        "--otel-tracing",
        "--port",
        "0",
        *SMALL,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
    )
    try:
        out = Lines(serve.stdout)
        address = out.wait_for("kvservice listening on").split()[3]
        assert "OpenTelemetry: a span per RPC to otlp" in out.wait_for("OpenTelemetry")
        with KVCacheClient(address) as client:
            client.ping(b"x")
            client.get_computed_blocks("r1", list(range(9)))
        serve.send_signal(signal.SIGTERM)  # the stop flushes the batch of spans
        assert serve.wait(TIMEOUT_S) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
        collector.stop(0)
    assert received == ["/kvservice.v1.KVCacheService/Ping", "/kvservice.v1.KVCacheService/GetComputedBlocks"]
