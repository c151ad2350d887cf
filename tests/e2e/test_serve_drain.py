"""``kvservice serve`` on SIGTERM, as Kubernetes sends it: /readyz turns 503 at once, the port
keeps serving through --drain-delay-s, then the process stops and exits 0."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request

from kvservice_client.client import KVCacheClient
from tests.e2e.test_cli import Lines, _spawn


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sigterm_goes_not_ready_keeps_serving_through_the_drain_then_exits():
    serve = _spawn(
        "serve",
        "--port",
        "0",
        "--device",
        "meta",
        "--preset",
        "qwen-2.5-0.5b",
        "--block-size",
        "4",
        "--num-blocks",
        "16",
        "--health-http-port",
        "0",
        "--drain-delay-s",
        "3",
        "--shutdown-grace-s",
        "1",
    )
    try:
        out = Lines(serve.stdout)
        address = out.wait_for("kvservice listening on").split()[3]
        http_port = int(out.wait_for("HTTP /healthz /readyz on 127.0.0.1:").rsplit(":", 1)[1])
        assert _readyz(http_port) == 200
        serve.send_signal(signal.SIGTERM)
        assert "stopping (graceful): NOT_SERVING, drain 3 s, then stop within 1 s" in out.wait_for("stopping")
        while _readyz(http_port) == 200:  # the signal handler runs on the server's loop: wait for it
            pass
        assert _readyz(http_port) == 503
        with KVCacheClient(address) as client:  # draining: the main port still answers
            assert client.ping(b"x").payload == b"x"
        assert serve.wait(timeout=60) == 0
    finally:
        serve.kill()
        serve.wait()
