"""A user's mistake on the command line (bad flags, values, targets, a port in use) ends with one
'Error: ...' line, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

TIMEOUT_S = 60


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "kvservice.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, out


def test_replay_against_an_unreachable_target_is_a_clean_error(tmp_path):
    port = _closed_port()
    proc = _run("replay", "--target", f"127.0.0.1:{port}", "--limit", "1", "--no-progress", "--out", str(tmp_path))
    _assert_clean_error(proc, f"127.0.0.1:{port}")


def test_serve_on_a_port_in_use_is_a_clean_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _run("serve", "--device", "meta", "--num-blocks", "16", "--port", str(port))
    _assert_clean_error(proc, str(port))
    assert (proc.stdout, proc.stderr) == (  # one line: not gRPC's internal add_port.cc line before it
        "",
        f"Error: cannot bind 127.0.0.1:{port}: Address already in use (another kvservice or another program "
        f"listens on port {port}): choose another --port, or --port 0 for a free one\n",
    )


@pytest.fixture(scope="module")
def served_address():
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "serve", "--device", "meta", "--num-blocks", "16", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    try:
        line = serve.stdout.readline()  # "kvservice listening on HOST:PORT (epoch ...)"
        assert "kvservice listening on" in line, line
        yield line.split()[3]
    finally:
        serve.terminate()
        serve.wait(TIMEOUT_S)


@pytest.mark.parametrize(
    "args", [["--group", "-1"], ["--snapshot", "--from-seq", "1"], ["--from-seq", "-1"], ["--from-seq", "0"]]
)
def test_watch_bad_flags_are_clean_errors(served_address, args):
    proc = _run("watch", served_address, *args)
    _assert_clean_error(proc)


def test_bad_environment_value_names_the_variable():
    proc = _run("serve", "--device", "meta", "--port", "0", env={"KVSERVICE_NUM_BLOCKS": "abc"})
    _assert_clean_error(proc, "num_blocks")


def test_bad_log_level_is_a_clean_error():
    proc = _run("--log-level", "bogus", "serve", "--device", "meta", "--port", "0")
    _assert_clean_error(proc)


@pytest.mark.parametrize(
    "args",
    [
        ["--watchers", "0"],
        ["--watchers", "-1"],
        ["--max-num-seqs", "0"],
        ["--max-num-batched-tokens", "0"],
        ["--step-ms", "nan"],
        ["--step-ms", "-1"],
        ["--limit", "0"],
        ["--instances", "65"],
    ],
)
def test_replay_rejects_out_of_range_options_quickly(tmp_path, args):
    """Today: --watchers 0/-1 end in an IndexError traceback, --max-num-seqs 0 and
    --max-num-batched-tokens 0 hang forever, --step-ms nan fails with a traceback after the whole
    run (writing report.json), --step-ms -1 is accepted."""
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvservice.cli",
                "replay",
                "--limit",
                "3",
                "--no-progress",
                "--out",
                str(tmp_path),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"replay {' '.join(args)} hung")
    _assert_clean_error(proc, args[0].removeprefix("--").replace("-", "_").split("_")[0])


def test_serve_with_a_bad_model_config_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4}')
    proc = _run("serve", "--port", "0", "--device", "meta", "--model-config", str(tmp_path))
    _assert_clean_error(proc, "missing field 'num_attention_heads'")


def test_serve_with_an_unknown_architecture_points_to_the_layout_file(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"], "num_hidden_layers": 4}')
    proc = _run("serve", "--port", "0", "--device", "meta", "--model-config", str(tmp_path))
    _assert_clean_error(
        proc,
        "unknown architecture 'FalconForCausalLM'; known: ",
        "describe its layers in a layout file for --kv-cache-layout",
    )
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-cache-memory", "lots"], "not a byte count: 'lots'"),
        (["--kv-cache-memory", "1MiB", "--preset", "gemma-3-27b"], "holds 0 blocks"),
        (["--kv-cache-memory", "1GiB", "--instances", "2"], "--kv-cache-memory sizes the one embedded server"),
    ],
)
def test_replay_kv_cache_memory_errors_are_clean(tmp_path, args, needle):
    proc = _run("replay", "--limit", "3", "--no-progress", "--out", str(tmp_path), *args)
    _assert_clean_error(proc, needle)


@pytest.mark.parametrize(
    ("args", "blocked"),
    [([], "report.json"), ([], "agreement.png"), (["--instances", "2", "--report-mode", "full"], "routing.json")],
)
def test_replay_with_an_unwritable_output_is_a_clean_error_before_the_run(tmp_path, args, blocked):
    """An output path the replay cannot write (here a directory in its place) is refused at once,
    naming --out and the path, not with a traceback after the whole run (report.json,
    routing.json) or after the report (agreement.png: the plot process and the fallback both
    failed)."""
    (tmp_path / blocked).mkdir()
    proc = _run("replay", "--limit", "2", "--no-progress", "--out", str(tmp_path), *args)
    _assert_clean_error(proc, "--out", str(tmp_path / blocked))
    assert "requests" not in proc.stdout  # refused before the run: no table


def test_replay_out_under_a_file_is_a_clean_error(tmp_path):
    (tmp_path / "file").write_text("x")
    proc = _run("replay", "--limit", "2", "--no-progress", "--out", str(tmp_path / "file" / "out"))
    _assert_clean_error(proc, "--out")
