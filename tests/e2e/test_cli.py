"""``kvservice serve`` and ``kvservice watch`` as a user runs them: real processes, real signals."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading

import pytest

from kvservice_client.client import KVCacheClient

TIMEOUT_S = 60


class Lines:
    """A process's output lines, read by a thread so the test can wait on the next one."""

    def __init__(self, stream) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, text: str) -> str:
        while True:
            line = self._queue.get(timeout=TIMEOUT_S)
            if line is None:
                raise AssertionError(f"output ended before {text!r}; saw {self.seen}")
            self.seen.append(line)
            if text in line:
                return line

    def rest(self) -> list[str]:
        """The lines not read yet, to the end of the output (call once the process has exited)."""
        more = []
        while (line := self._queue.get(timeout=TIMEOUT_S)) is not None:
            self.seen.append(line)
            more.append(line)
        return more


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


@pytest.mark.slow
def test_serve_with_defaults_then_watch_shows_events_and_sigterm_ends_both():
    serve = _spawn("serve", "--port", "0")  # every other setting is the default
    try:
        serve_out = Lines(serve.stdout)
        address = serve_out.wait_for("kvservice listening on").split()[3]
        serve_out.wait_for("preset llama-3-8b")
        watch = _spawn("watch", address, "--snapshot", "--no-reconnect")
        watch_out = Lines(watch.stdout)
        watch_out.wait_for("seq=0* AllBlocksCleared")  # subscribed: everything after this is live
        with KVCacheClient(address) as client:
            assert client.get_computed_blocks("r1", list(range(40)), session_id="chat-1").num_computed_tokens == 0
            assert client.allocate_slots("r1", 40).allocated
            client.free("r1")
            assert (
                client.get_computed_blocks(
                    "r2", list(range(40)), session_id="chat-2", kv_cache_report_mode="full"
                ).num_computed_tokens
                == 32
            )
            assert client.allocate_slots("r2", 40).num_new_computed_tokens == 32
        first = watch_out.wait_for("seq=1 BlockStored")
        assert "group=0 kind=full_attention window=- session=chat-1 parent=- blocks=2" in first
        assert "tokens[0:32)" in first
        reused = watch_out.wait_for("seq=2 BlockStored")
        assert "session=chat-2" in reused and reused.endswith("tokens[0:32) reused")

        serve.send_signal(signal.SIGTERM)
        serve_out.wait_for("stopping (graceful)")
        assert serve.wait(TIMEOUT_S) == 0
        watch_out.wait_for("# stream ended: UNAVAILABLE: server shutting down; last seq delivered 2")
        assert watch.wait(TIMEOUT_S) == 1
    finally:
        for proc in (serve, locals().get("watch")):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_serve_rejects_a_bad_setting_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "serve", "--port", "0", "--num-blocks", "1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 1
    assert "num_blocks must be >= 2" in result.stderr


def test_replay_sizes_the_embedded_pool_from_a_memory_budget(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvservice.cli",
            "replay",
            "--limit",
            "3",
            "--no-progress",
            "--report-mode",
            "full",
            "--no-late-watcher",
            "--kv-cache-memory",
            "64GiB",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "preset llama-3-8b, block_size 16 tokens, num_blocks 32,768" in result.stdout  # 64 GiB // 2 MiB


def test_replay_into_a_file_writes_plain_lines_not_bar_frames(tmp_path):
    """``kvservice replay > log.txt``: stdout is not a terminal, so no progress bar (its frames
    would fill the log); the plain progress line, the table and the last line are there."""
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        result = subprocess.run(
            [sys.executable, "-m", "kvservice.cli", "replay", "--limit", "3", "--out", str(tmp_path / "out")],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT_S,
        )
    assert result.returncode == 0, result.stderr
    text = log.read_text()
    assert "\r" not in text and "\x1b" not in text and "req/s" not in text and "it/s" not in text
    progress = [line for line in text.splitlines() if re.fullmatch(r"replay \d+ s: .* requests", line)]
    assert progress and progress[-1].endswith(" s: incremental 3/3, full 3/3 requests"), text
    assert text.splitlines()[-1].startswith("wrote ")
    assert "\r" not in result.stderr


@pytest.mark.slow
def test_replay_against_a_target_names_the_targets_layout_first(tmp_path):
    """``--target``: the first line is what the server holds (its GetKVCacheGroupMetadata), not
    the --preset default the replay would have used for an embedded server."""
    serve = _spawn("serve", "--port", "0", "--preset", "qwen-2.5-0.5b", "--num-blocks", "4096", "--device", "meta")
    try:
        address = Lines(serve.stdout).wait_for("kvservice listening on").split()[3]
        result = subprocess.run(
            [sys.executable, "-m", "kvservice.cli", "replay", "--target", address, "--limit", "2"]
            + ["--report-mode", "full", "--no-late-watcher", "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0] == (
            f"replay: the embedded Mooncake sample, first 2 requests; server {address} (preset qwen-2.5-0.5b, "
            "4,096 blocks of 16 tokens), mirror half the server's pool; report mode full; 1 watcher(s)"
        )
        assert "preset qwen-2.5-0.5b, block_size 16 tokens, num_blocks 4,096" in result.stdout  # the table's
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(TIMEOUT_S)


def test_replay_takes_a_model_config(tmp_path):
    from tests.tooling.tools import ROOT

    config = ROOT / "tests/data/model_configs/qwen2.5-0.5b"
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "replay", "--model-config", str(config), "--limit", "2"]
        + ["--num-blocks", "4096", "--report-mode", "full", "--no-late-watcher", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        f"replay: the embedded Mooncake sample, first 2 requests; model config {config}, pool 4,096 blocks of 16 "
        "tokens, mirror 2,047 blocks; report mode full; 1 watcher(s)"
    )
    assert f"layout {config}, block_size 16 tokens, num_blocks 4,096" in " ".join(result.stdout.split())
    assert "│ mirror capacity / num_blocks (blocks)" in result.stdout and "2,047 / 4,096" in result.stdout
