"""The probe port: plaintext ``grpc.health.v1`` and HTTP ``/healthz`` ``/readyz``, no token.

Kubernetes' gRPC probe speaks plain text and sends no token, so it fails on a main port with TLS
or bearer tokens. ``health_port`` serves the same health state as the main port on a port of
its own, without TLS or auth (it says only SERVING or NOT_SERVING); ``health_http_port`` serves
it over HTTP for probes that speak HTTP:

* ``GET /healthz`` (liveness): 200 ``ok`` while the process serves, draining included (a
  draining pod must not be restarted);
* ``GET /readyz`` (readiness): 200 ``ready`` while SERVING, 503 ``draining`` from the moment a
  stop began (SIGTERM), so the Service stops sending traffic during the drain delay.

The HTTP port is bounded (issue 24): at most :data:`HTTP_MAX_CONNECTIONS` connections are served
at once (one more is closed at once, unanswered) and a connection that sends no whole request
within :data:`HTTP_READ_TIMEOUT_S` is closed, so idle connections (the port has no token) cost a
bounded number of threads and never starve the main port.

Both close last, after the main port stopped, so a probe during the drain sees NOT_SERVING rather
than a refused connection.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

__all__ = ["HTTP_MAX_CONNECTIONS", "HTTP_READ_TIMEOUT_S", "ProbePort"]

HTTP_MAX_CONNECTIONS = 32
"""HTTP probe connections served at once (a thread each); more are closed unanswered."""

HTTP_READ_TIMEOUT_S = 5.0
"""Seconds an HTTP probe connection may take to send its request (then it is closed)."""


class _BoundedHTTPServer(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` serving at most :data:`HTTP_MAX_CONNECTIONS` connections at once."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)
        self.num_refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.num_refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(http.server.BaseHTTPRequestHandler):
    probe: ProbePort
    timeout = HTTP_READ_TIMEOUT_S  # socketserver sets it on the connection: a silent client is closed

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            code, body = 200, b"ok\n"
        elif path == "/readyz":
            code, body = (200, b"ready\n") if self.probe.ready else (503, b"draining\n")
        else:
            code, body = 404, b"not found: /healthz (liveness) or /readyz (readiness)\n"
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        """Probes every few seconds are not worth a log line."""


class ProbePort:
    """The probe endpoints of one server (see the module docstring).

    Attributes:
        host: the host both ports bind (as given: ``health_host``, else ``host``).
        grpc_port: the bound plaintext gRPC health port (None: off).
        http_port: the bound HTTP port (None: off).
        ready: what ``/readyz`` answers (set False when a stop begins).
    """

    def __init__(self) -> None:
        self.host = ""
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.ready = True
        self._server: grpc.aio.Server | None = None
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    async def start(cls, health: Any, host: str, grpc_port: int | None, http_port: int | None) -> ProbePort:
        """Bind the probe ports (0 picks a free one) serving ``health`` (the main port's
        ``grpc_health`` servicer, so both answer the same).

        Raises:
            RuntimeError: a port cannot be bound (the message names the setting).
        """
        probe = cls()
        probe.host = host
        try:
            if grpc_port is not None:
                server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
                health_pb2_grpc.add_HealthServicer_to_server(health, server)
                address = f"[{host}]:{grpc_port}" if ":" in host and not host.startswith("[") else f"{host}:{grpc_port}"
                bound = server.add_insecure_port(address)
                if bound == 0:
                    raise RuntimeError(f"health_port: cannot bind {address}")
                await server.start()
                probe._server, probe.grpc_port = server, bound
            if http_port is not None:
                handler = type("ProbeHandler", (_Handler,), {"probe": probe})
                try:
                    httpd = _BoundedHTTPServer((host.strip("[]"), http_port), handler)
                except OSError as e:
                    raise RuntimeError(f"health_http_port: cannot bind {host}:{http_port}: {e}") from None
                httpd.daemon_threads = True
                probe._httpd, probe.http_port = httpd, httpd.server_address[1]
                probe._thread = threading.Thread(target=httpd.serve_forever, name="kvservice-probes", daemon=True)
                probe._thread.start()
        except BaseException:
            await probe.close()
            raise
        return probe

    def describe(self) -> str:
        """One line for the start banner."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        parts = []
        if self.grpc_port is not None:
            parts.append(f"grpc.health.v1 on {host}:{self.grpc_port}")
        if self.http_port is not None:
            parts.append(f"HTTP /healthz /readyz on {host}:{self.http_port}")
        return "probes (plain text, no token): " + ", ".join(parts)

    async def close(self) -> None:
        """Stop both endpoints (idempotent)."""
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        if self._httpd is not None:
            httpd, self._httpd = self._httpd, None
            await asyncio.to_thread(httpd.shutdown)  # waits for serve_forever's poll: off the loop
            httpd.server_close()
