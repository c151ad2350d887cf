"""``kvservice replay``'s start-up path: the default replay (a ``meta`` pool) imports neither torch
nor matplotlib in its own process, and freezes its objects at exit (the interpreter's teardown
then skips traversing them); the agreement plot is rendered by a process of its own
(``kvservice.replay.plot_process``) and is the PNG an in-process render writes, byte for byte.
Its speed is measured by ``scripts/bench/replay_startup.py``, not here."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvservice.replay.plot_process import PlotProcess
from kvservice.replay.report import plot_agreement, read_json
from kvservice.replay.runner import ReplayConfig

SCRIPT = textwrap.dedent(
    """
    import atexit, gc, json, sys

    from kvservice.cli import main

    # Runs after the replay's own atexit handler (last registered, first run).
    atexit.register(lambda: print(json.dumps({"frozen at exit": gc.get_freeze_count() > 0}), flush=True))

    try:
        main(["replay", "--limit", "1", "--no-progress", "--out", sys.argv[1]])
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"exit": code, "torch": "torch" in sys.modules, "matplotlib": "matplotlib" in sys.modules}))
    """
)


def test_the_default_replay_imports_neither_torch_nor_matplotlib_and_writes_the_plot(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == {"exit": 0, "torch": False, "matplotlib": False}
    assert json.loads(lines[-1]) == {"frozen at exit": True}  # the teardown skips a last traversal
    assert lines[0].startswith("replay: the embedded Mooncake sample, first 1 requests; preset llama-3-8b")
    assert lines[-3] == f"wrote {tmp_path / 'report.json'} and {tmp_path / 'agreement.png'}"
    assert "rendering the plot here" not in out.stderr  # the plot process rendered it
    in_process = plot_agreement(read_json(tmp_path / "report.json"), tmp_path / "in-process.png")
    assert (tmp_path / "agreement.png").read_bytes() == in_process.read_bytes()


def _report_json(tmp_path: Path) -> Path:
    """A small two-mode report, written as the replay writes it."""
    from kvservice.replay.report import write_json
    from tests.unit.test_report import SERIES_FULL, _mode, _report

    series = [(i, i % 5, i % 5 + (i % 7 == 0)) for i in range(200)]
    return write_json(_report(modes=[_mode("incremental", series), _mode("full", SERIES_FULL)]), tmp_path / "r.json")


def test_the_plot_process_writes_what_an_in_process_render_writes(tmp_path, capfd):
    report = _report_json(tmp_path)
    with PlotProcess() as plots:
        assert plots.render(report, tmp_path / "by-process.png") == tmp_path / "by-process.png"
    assert "rendering the plot here" not in capfd.readouterr().err
    in_process = plot_agreement(read_json(report), tmp_path / "in-process.png")
    assert (tmp_path / "by-process.png").read_bytes() == in_process.read_bytes()


def test_a_plot_process_that_died_leaves_the_render_to_this_process(tmp_path, capfd):
    report = _report_json(tmp_path)
    plots = PlotProcess()
    assert plots._proc is not None
    plots._proc.kill()
    plots._proc.wait()
    png = plots.render(report, tmp_path / "here.png")
    assert "kvservice replay: the plot process failed" in capfd.readouterr().err
    assert png.read_bytes() == plot_agreement(read_json(report), tmp_path / "in-process.png").read_bytes()


def test_closing_without_a_report_ends_the_plot_process():
    plots = PlotProcess()
    proc = plots._proc
    assert proc is not None
    plots.close()
    assert proc.poll() is not None
    plots.close()  # idempotent


def test_without_the_process_the_plot_renders_here(tmp_path, capfd):
    report = _report_json(tmp_path)
    plots = PlotProcess(enabled=False)
    png = plots.render(report, tmp_path / "here.png")
    assert capfd.readouterr().err == ""
    assert png.read_bytes() == plot_agreement(read_json(report), tmp_path / "in-process.png").read_bytes()


def _mode_in_worker(mode: str, config: ReplayConfig) -> tuple[str, int, bool, bool]:
    """A mode worker's entry (``runner._replay_mode_in_process``), then what the worker imported."""
    from kvservice.replay.runner import _replay_mode_in_process

    result = _replay_mode_in_process(mode, config)
    return result.report.mode, result.report.num_requests, "torch" in sys.modules, "matplotlib" in sys.modules


async def test_the_mode_workers_import_neither_torch_nor_matplotlib():
    from kvservice.replay.progress import Progress, run_in_workers

    config = ReplayConfig(limit=1, show_progress=False)
    progress = Progress(["incremental", "full"], 1, bar=False, stream=io.StringIO())
    results = await run_in_workers(_mode_in_worker, [("incremental", config), ("full", config)], progress)
    assert results == [("incremental", 1, False, False), ("full", 1, False, False)]


def test_the_result_comes_after_a_submit(tmp_path):
    report = _report_json(tmp_path)
    with PlotProcess() as plots:
        with pytest.raises(RuntimeError, match=r"result\(\) before submit\(\)"):
            plots.result()
        plots.submit(report, tmp_path / "submitted.png")
        assert plots.result() == tmp_path / "submitted.png"
    assert (tmp_path / "submitted.png").read_bytes() == plot_agreement(
        read_json(report), tmp_path / "in-process.png"
    ).read_bytes()
