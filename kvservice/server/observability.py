"""Logs and traces: ``--log-format text|json``, the RPC context on every log line, and an
OpenTelemetry span per RPC (``--otel-tracing``, kvservice's ``otel`` extra).

* **RPC context.** :class:`RpcContextInterceptor` puts the RPC (``KVCacheService/Step``) and,
  where the request has one, the ``request_id`` into context variables for the call's task; a
  log record made during the call carries them (``rpc``, ``request_id``), and at DEBUG each call
  ends with one line ``rpc done`` with its status ``code`` and ``duration_ms``.
* **JSON logs** (python-json-logger): one object per line with ``time``, ``level``, ``logger``,
  ``message``, and ``rpc`` / ``request_id`` where there is one (and ``code``, ``duration_ms`` on
  ``rpc done``).
* **Start-up and stop lines** (where the server listens, its layout, the notes, "stopping") go
  to stdout through the :data:`banner` logger, written at every ``--log-level``: as the plain
  text they always were, or with ``--log-format json`` as JSON objects with an ``event``
  ("listening", "layout", "note", "stopping", "stopped") and their own fields.
* **Traces** (opentelemetry-instrumentation-grpc, ``--otel-tracing``): :func:`tracing_interceptor`
  opens one SERVER span per RPC, named ``/kvservice.v1.KVCacheService/Method``, a child of the
  caller's span when the call carries its context (W3C ``traceparent`` metadata by default), with
  the library's ``rpc.system``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code`` and
  peer attributes, and kvservice's ``kvservice.request_id`` where the request has one and for
  Step ``kvservice.step.num_ops``, ``kvservice.step.ops.<op>`` (count per op kind) and
  ``kvservice.request_ids``. A server-side status (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED,
  INTERNAL, UNAVAILABLE, DATA_LOSS) marks the span as an error, as OpenTelemetry's gRPC
  conventions have it; the caller's (INVALID_ARGUMENT, NOT_FOUND ...) leaves it unset. :func:`configure_tracing`
  sends spans where the standard ``OTEL_*`` variables say (``OTEL_TRACES_EXPORTER=console``,
  ``otlp`` ...), unless the process set a tracer provider of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TextIO, cast

import grpc

__all__ = [
    "CallInterceptor",
    "RpcContextInterceptor",
    "announce",
    "banner",
    "configure_logging",
    "configure_tracing",
    "current_request_id",
    "current_rpc",
    "final_code",
    "json_line",
    "log_uncaught_exceptions_and_warnings",
    "note_request",
    "tracing_interceptor",
]

logger = logging.getLogger(__name__)

current_rpc: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvservice_rpc", default=None)
"""The RPC being handled in this task (``KVCacheService/Step``), or None."""
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvservice_request_id", default=None)
"""The request id of the RPC being handled (its ``request_id`` field), or None."""


def note_request(request: object) -> None:
    """Called by the servicer with each parsed request (the interceptors see only its bytes):
    records its request id for the log lines of the call and annotates the call's span."""
    request_id = _request_id(request)
    if request_id is not None:
        current_request_id.set(request_id)
    if _trace_api is not None:
        span = _trace_api.get_current_span()
        if span.is_recording():
            _annotate(span, request)


def _annotate(span: Any, request: Any) -> None:
    request_id = _request_id(request)
    if request_id is not None:
        span.set_attribute("kvservice.request_id", request_id)
    ops = getattr(request, "ops", None)
    if ops is not None and hasattr(request, "DESCRIPTOR") and request.DESCRIPTOR.name == "StepRequest":
        span.set_attribute("kvservice.step.num_ops", len(ops))
        kinds = [o.WhichOneof("op") for o in ops]
        for op, count in sorted(Counter(kinds).items()):
            span.set_attribute(f"kvservice.step.ops.{op}", count)
        ids = sorted({rid for o, kind in zip(ops, kinds) if kind and (rid := _request_id(getattr(o, kind)))})
        if ids:
            span.set_attribute("kvservice.request_ids", ids[:64])


_LOG_FORMAT_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _RpcContextFilter(logging.Filter):
    """Copies the RPC context variables onto each record (``rpc``, ``request_id``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rpc, request_id = current_rpc.get(), current_request_id.get()
        if rpc is not None and not hasattr(record, "rpc"):
            record.rpc = rpc
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


banner = logging.getLogger("kvservice.serve")
"""The start-up and stop lines of ``kvservice serve`` (see the module docstring): INFO records
that :func:`configure_logging` writes to stdout whatever the root logger's level."""


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


def _formatter(log_format: str, text: str) -> logging.Formatter:
    if log_format == "json":
        return _json_formatter()
    if log_format == "text":
        return logging.Formatter(text)
    raise ValueError(f"log_format must be 'text' or 'json'; got {log_format!r}")


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a record is written (a test's capture, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def configure_logging(
    level: str, log_format: str = "text", stream: TextIO | None = None, out: TextIO | None = None
) -> logging.Handler:
    """Set the root logger to ``level`` with one handler writing ``log_format`` to ``stream``
    (default stderr), replacing the handlers it had; and the :data:`banner` logger to write its
    lines (at any level) to ``out`` (default: stdout as it is at each line), as plain text or as
    JSON objects.

    Returns:
        The root logger's handler.

    Raises:
        ValueError: ``log_format`` is neither "text" nor "json".
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_formatter(log_format, _LOG_FORMAT_TEXT))
    handler.addFilter(_RpcContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    banner_handler = logging.StreamHandler(out) if out is not None else _StdoutHandler()
    banner_handler.setFormatter(_formatter(log_format, "%(message)s"))
    for old in list(banner.handlers):
        banner.removeHandler(old)
    banner.addHandler(banner_handler)
    banner.setLevel(logging.INFO)
    banner.propagate = False
    return handler


def announce(message: str, event: str, **fields: object) -> None:
    """Write one start-up or stop line through :data:`banner` (``event`` and ``fields`` are the
    JSON object's extra keys). Printed as it is where :func:`configure_logging` was not called."""
    if not banner.handlers:
        print(message, flush=True)
        return
    banner.info(message, extra={"event": event, **fields})
    for handler in banner.handlers:
        handler.flush()


def json_line(level: str, logger_name: str, message: str, **fields: object) -> str:
    """One JSON log line (as ``--log-format json`` writes them) for output that does not come
    from a logger (a command-line error)."""
    record = logging.makeLogRecord(
        {"name": logger_name, "levelname": level, "levelno": logging.getLevelName(level), "msg": message, **fields}
    )
    return _json_formatter().format(record)


def log_uncaught_exceptions_and_warnings() -> None:
    """Send what Python would print past the loggers into them: an uncaught exception (logged
    CRITICAL with its traceback in ``exc_info``) and ``warnings`` (logger ``py.warnings``)."""
    crash = logging.getLogger("kvservice")

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        crash.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    sys.excepthook = hook
    logging.captureWarnings(True)


def final_code(exc: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a client gets for a handler that returned (``exc`` None) or raised ``exc``:
    the context's code (OK when unset), the aborted code, CANCELLED (DEADLINE_EXCEEDED once the
    deadline passed) for a cancelled call, UNKNOWN for an unexpected exception."""
    if exc is None:
        return context.code() or grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class CallInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that sees each call begin and end (with its final status code, see
    :func:`final_code`); a streaming call ends when its stream does. Subclasses define
    :meth:`begin` and :meth:`end`. Wrapped handlers are cached per method path; past
    ``max_methods`` paths, calls are wrapped with path None (so made-up method names cannot grow
    a subclass's labels without bound)."""

    def __init__(self, *, max_methods: int = 256) -> None:
        self._max_methods = max_methods
        # method path -> (the handler it resolved to, that handler wrapped); handlers are reused.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """The next handler, wrapped (None, the RPC is not serviced here, passed on as None)."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        if cached is None and len(self._wrapped) >= self._max_methods:
            return self._wrap_handler(handler, None)
        wrapped = self._wrap_handler(handler, path.lstrip("/"))
        self._wrapped[path] = (handler, wrapped)
        return wrapped

    def begin(self, path: str | None, request: Any) -> Any:
        """Called as a call starts (``path``: ``package.Service/Method``); returns the state
        passed to :meth:`end`."""
        raise NotImplementedError

    def end(self, state: Any, code: grpc.StatusCode) -> None:
        """Called as the call ends, with its final status."""
        raise NotImplementedError

    def _wrap_handler(self, handler: grpc.RpcMethodHandler, path: str | None) -> grpc.RpcMethodHandler:
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrapped: grpc.RpcMethodHandler = handler._replace(**{kind: self._wrap(behavior, path)})  # type: ignore[attr-defined]  # grpc's handlers are namedtuples at runtime; the stub's ABC has no _replace
                return wrapped
        return handler

    def _wrap(self, behavior: Callable[..., Any], path: str | None) -> Callable[..., Any]:
        begin, end = self.begin, self.end
        if inspect.isasyncgenfunction(behavior):

            async def wrapped_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                state = begin(path, request)
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    end(state, final_code(exc, context))
                    raise
                end(state, final_code(None, context))

            return wrapped_stream

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            state = begin(path, request)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                end(state, final_code(exc, context))
                raise
            end(state, final_code(None, context))
            return response

        return wrapped


def _request_id(request: object) -> str | None:
    value = getattr(request, "request_id", None)
    return value if isinstance(value, str) and value else None


class RpcContextInterceptor(CallInterceptor):
    """Sets :data:`current_rpc` and :data:`current_request_id` for each call; at DEBUG logs
    ``rpc done`` with ``code`` and ``duration_ms`` as the call ends."""

    def begin(self, path: str | None, request: Any) -> Any:
        """Set the call's context variables."""
        rpc = (path or "other").rsplit(".", 1)[-1]  # KVCacheService/Step
        return (current_rpc.set(rpc), current_request_id.set(None), time.perf_counter())

    def end(self, state: Any, code: grpc.StatusCode) -> None:
        """Log ``rpc done`` (DEBUG) and reset the context variables."""
        rpc_token, request_token, start = state
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "rpc done", extra={"code": code.name, "duration_ms": round(1000 * (time.perf_counter() - start), 3)}
            )
        current_request_id.reset(request_token)
        current_rpc.reset(rpc_token)


_OTEL_INSTALL = (
    "pip install opentelemetry-sdk opentelemetry-instrumentation-grpc opentelemetry-exporter-otlp-proto-grpc "
    "(kvservice's otel extra)"
)
_trace_api: Any = None  # opentelemetry.trace once tracing_interceptor() was made: note_request annotates spans


def tracing_interceptor(tracer_provider: Any = None) -> grpc.aio.ServerInterceptor:
    """opentelemetry-instrumentation-grpc's aio server interceptor: one SERVER span per RPC (see
    the module docstring), its parent the caller's span when the call's metadata carries one (the
    propagators of ``OTEL_PROPAGATORS``, W3C ``traceparent`` by default). :func:`note_request`
    adds kvservice's attributes to it.

    The library's interceptor iterates a response-streaming handler as an async generator
    (open-telemetry/opentelemetry-python-contrib#3066); kvservice's stream with
    ``context.write`` and return None, so those go through its unary path, which awaits the
    handler under the same span.

    Args:
        tracer_provider: where spans go (default: OpenTelemetry's global provider).

    Raises:
        RuntimeError: the library is not installed (the message names the install line).
    """
    global _trace_api
    try:
        from opentelemetry import trace
        from opentelemetry.instrumentation.grpc import aio_server_interceptor
    except ImportError as e:
        raise RuntimeError(f"otel_tracing needs OpenTelemetry ({e}): {_OTEL_INSTALL}") from None
    interceptor: Any = aio_server_interceptor(tracer_provider=tracer_provider)  # the library is untyped
    as_stream = interceptor._intercept_aio_server_stream
    as_unary = interceptor._intercept_aio_server_unary

    def intercept_stream(behavior: Callable[..., Any], handler_call_details: grpc.HandlerCallDetails) -> Any:
        if inspect.isasyncgenfunction(behavior):
            return as_stream(behavior, handler_call_details)
        return as_unary(behavior, handler_call_details)

    interceptor._intercept_aio_server_stream = intercept_stream
    _trace_api = trace
    return cast(grpc.aio.ServerInterceptor, interceptor)


def _compact_console_exporter() -> Any:
    """The SDK's console exporter writing one JSON object per line (its default indents them)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")


def _span_exporters(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (comma-separated; default ``otlp``, as
    the OpenTelemetry SDK environment specification has it; ``none``: no exporter), made from
    their ``opentelemetry_traces_exporter`` entry points. ``otlp`` is OTLP over gRPC, or over
    HTTP when ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` is
    ``http/protobuf``; each exporter reads its own ``OTEL_EXPORTER_*`` variables.

    Raises:
        ValueError: a name no installed package provides (the message names the install line).
    """
    from importlib.metadata import entry_points

    names = [name.strip() for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()]
    if names == ["none"]:
        return []
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    exporters = []
    for name in names:
        if name == "console":
            exporters.append((name, _compact_console_exporter()))
            continue
        entry = name
        if name == "otlp":
            entry = "otlp_proto_http" if (protocol or "grpc").strip() == "http/protobuf" else "otlp_proto_grpc"
        found = entry_points(group="opentelemetry_traces_exporter", name=entry)
        if not found:
            raise ValueError(f"OTEL_TRACES_EXPORTER: no installed exporter is called {name!r} ({_OTEL_INSTALL})")
        exporters.append((name, next(iter(found)).load()()))
    return exporters


def configure_tracing(environ: Mapping[str, str] | None = None) -> tuple[str, Callable[[], Awaitable[None]] | None]:
    """Make spans go where the standard ``OTEL_*`` variables say. When the process already set
    OpenTelemetry's global tracer provider (an embedding program), spans go to it. Otherwise an
    SDK provider is set up: resource from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
    (``service.name`` kvservice when neither names one), sampler from ``OTEL_TRACES_SAMPLER``,
    a batch processor (``OTEL_BSP_*``) per exporter of ``OTEL_TRACES_EXPORTER`` (see
    :func:`_span_exporters`).

    Returns:
        (a line for the start banner saying where spans go, a coroutine function that flushes the
        provider's pending spans at stop, or None).

    Raises:
        RuntimeError: opentelemetry-sdk is missing where it is needed; ValueError: as
            :func:`_span_exporters`.
    """
    import os

    from opentelemetry import trace

    environ = os.environ if environ is None else environ
    provider = trace.get_tracer_provider()
    if type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return f"OpenTelemetry: a span per RPC to the process's {type(provider).__name__}", None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(f"otel_tracing needs opentelemetry-sdk ({e}): {_OTEL_INSTALL}") from None
    exporters = _span_exporters(environ)
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kvservice"}))
    sdk = TracerProvider(resource=resource)
    for _, exporter in exporters:
        sdk.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(sdk)
    if not exporters:
        return "OpenTelemetry: a span per RPC, OTEL_TRACES_EXPORTER=none: spans are dropped", None

    async def flush() -> None:
        await asyncio.to_thread(sdk.force_flush, 5000)

    names = ", ".join(name for name, _ in exporters)
    return f"OpenTelemetry: a span per RPC to {names} (OTEL_TRACES_EXPORTER; OTEL_EXPORTER_* configure them)", flush
