"""Logs and traces: ``--log-format text|json``, the RPC context on every log line, and an
OpenTelemetry span per RPC (``--otel-tracing``, ``pip install 'kvservice[otel]'``).

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
* **Traces**: :class:`TracingInterceptor` opens one SERVER span per RPC, named
  ``kvservice.v1.KVCacheService/Method``, with ``rpc.system`` "grpc", ``rpc.service``,
  ``rpc.method``, ``rpc.grpc.status_code``, ``kvservice.request_id`` where the request has one,
  and for Step ``kvservice.step.num_ops`` and ``kvservice.step.ops.<op>`` (count per op kind). A
  non-OK status marks the span as an error. Spans go to OpenTelemetry's global tracer provider:
  configure it (an exporter) in the process that starts the server, or let
  :func:`default_tracer_provider` set up the SDK with the OTLP exporter when
  ``opentelemetry-exporter-otlp`` is installed (its ``OTEL_EXPORTER_OTLP_*`` variables apply).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = [
    "CallInterceptor",
    "RpcContextInterceptor",
    "TracingInterceptor",
    "announce",
    "banner",
    "configure_logging",
    "current_request_id",
    "current_rpc",
    "default_tracer_provider",
    "final_code",
    "json_line",
    "log_uncaught_exceptions_and_warnings",
    "note_request",
]

logger = logging.getLogger(__name__)

current_rpc: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvservice_rpc", default=None)
"""The RPC being handled in this task (``KVCacheService/Step``), or None."""
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvservice_request_id", default=None)
"""The request id of the RPC being handled (its ``request_id`` field), or None."""
_current_span: contextvars.ContextVar[Any] = contextvars.ContextVar("kvservice_span", default=None)


def note_request(request: Any) -> None:
    """Called by the servicer with each parsed request (the interceptors see only its bytes):
    records its request id for the log lines of the call and annotates the call's span."""
    request_id = _request_id(request)
    if request_id is not None:
        current_request_id.set(request_id)
    span = _current_span.get()
    if span is not None:
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


def configure_logging(level: str, log_format: str = "text", stream: Any = None, out: Any = None) -> logging.Handler:
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


def announce(message: str, event: str, **fields: Any) -> None:
    """Write one start-up or stop line through :data:`banner` (``event`` and ``fields`` are the
    JSON object's extra keys). Printed as it is where :func:`configure_logging` was not called."""
    if not banner.handlers:
        print(message, flush=True)
        return
    banner.info(message, extra={"event": event, **fields})
    for handler in banner.handlers:
        handler.flush()


def json_line(level: str, logger_name: str, message: str, **fields: Any) -> str:
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

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
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


def _request_id(request: Any) -> str | None:
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


class TracingInterceptor(CallInterceptor):
    """One OpenTelemetry SERVER span per RPC (see the module docstring).

    Args:
        tracer_provider: where spans go (default: OpenTelemetry's global provider).

    Raises:
        RuntimeError: opentelemetry-api is not installed (names ``pip install 'kvservice[otel]'``).
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        super().__init__()
        try:
            from opentelemetry import trace
        except ImportError as e:
            raise RuntimeError(f"otel_tracing needs opentelemetry-api ({e}): pip install 'kvservice[otel]'") from None
        self._trace = trace
        self._tracer = trace.get_tracer("kvservice", tracer_provider=tracer_provider)

    def begin(self, path: str | None, request: Any) -> Any:
        """Open the call's span."""
        path = path or "other"
        service, _, method = path.rpartition("/")
        span = self._tracer.start_span(path, kind=self._trace.SpanKind.SERVER)
        span.set_attribute("rpc.system", "grpc")
        span.set_attribute("rpc.service", service)
        span.set_attribute("rpc.method", method)
        if not isinstance(request, bytes):  # a handler with its own deserializer (health, reflection)
            _annotate(span, request)
        return span, _current_span.set(span)

    def end(self, state: Any, code: grpc.StatusCode) -> None:
        """End the call's span with its status."""
        span, token = state
        _current_span.reset(token)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, code.name))
        span.end()


def default_tracer_provider() -> str:
    """Make sure spans go somewhere: when OpenTelemetry's global provider is still the default
    (no-op) one and the SDK and the OTLP exporter are installed, install an SDK provider
    exporting OTLP (configured by the ``OTEL_EXPORTER_OTLP_*`` variables).

    Returns:
        A line for the start banner saying where spans go.
    """
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return f"OpenTelemetry: a span per RPC to the configured {type(provider).__name__}"
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return (
            "OpenTelemetry: a span per RPC, but no tracer provider is configured and "
            "opentelemetry-exporter-otlp is not installed: spans are dropped"
        )
    sdk = TracerProvider()
    sdk.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(sdk)
    return "OpenTelemetry: a span per RPC, exported over OTLP (OTEL_EXPORTER_OTLP_* variables)"
