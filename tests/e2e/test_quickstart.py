"""The README's quickstart, run as written: its three shell commands (serve, watch, the client's
calls) in the repository root, and what it says they print."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from tests.e2e.test_cli import TIMEOUT_S, Lines
from tests.tooling.tools import ROOT

README_PORT = "50051"


def _quickstart() -> tuple[list[str], list[str]]:
    """The quickstart's ```bash blocks and its plain (output) blocks, in order."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quickstart.*?\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no ## Quickstart section"
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", section.group(1), re.S | re.M)
    return [b for lang, b in blocks if lang == "bash"], [b for lang, b in blocks if lang == ""]


def test_the_quickstart_is_three_commands_and_their_output():
    commands, outputs = _quickstart()
    assert [c.split()[0] for c in commands] == [".venv/bin/kvservice", ".venv/bin/kvservice", ".venv/bin/python"]
    assert len(outputs) == 2  # what the client prints, what the watcher prints


@pytest.mark.slow
def test_the_quickstart_runs_as_written():
    """The server gets a free port (``KVSERVICE_PORT=0``: other servers share this machine); the
    other two commands are run with the README's 50051 replaced by it, nothing else changed."""
    if not (ROOT / ".venv/bin/kvservice").exists():
        pytest.skip("the quickstart runs .venv/bin/kvservice: make it with scripts/setup.sh")
    (serve_cmd, watch_cmd, client_cmd), (client_out, watch_out) = _quickstart()

    def shell(command: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", "-c", f"exec {command}" if "<<" not in command else command],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )

    serve = shell(serve_cmd.strip(), KVSERVICE_PORT="0")
    watch = None
    try:
        serve_lines = Lines(serve.stdout)
        listening = serve_lines.wait_for("kvservice listening on")
        port = re.search(r"127\.0\.0\.1:(\d+) ", listening).group(1)
        watch = shell(watch_cmd.strip().replace(README_PORT, port))
        watch_lines = Lines(watch.stdout)
        watch_lines.wait_for("# 127.0.0.1:")  # the header
        expected_events = watch_out.splitlines()
        assert watch_lines.wait_for(expected_events[0]) == expected_events[0]  # subscribed: the rest is live

        client = subprocess.run(
            ["bash", "-c", client_cmd.replace(README_PORT, port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout == client_out
        assert watch_lines.wait_for("seq=1 ") == expected_events[1]

        watch.send_signal(signal.SIGINT)  # Ctrl-C
        assert watch.wait(TIMEOUT_S) == 0
        serve.send_signal(signal.SIGTERM)
        serve_lines.wait_for("stopping (graceful)")
        assert serve.wait(TIMEOUT_S) == 0
    finally:
        for proc in (serve, watch):
            if proc is not None and proc.poll() is None:
                proc.kill()
