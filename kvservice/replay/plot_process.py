"""The replay's agreement plot, rendered in a process of its own beside the replay.

Importing matplotlib and a first render cost about as much as a short replay itself (0.9 s of
``kvservice replay --limit 1``'s 3.3 s on an idle machine, before this module). So the CLI starts
:class:`PlotProcess` as the replay starts: the process imports matplotlib and renders a throwaway
figure (fonts, text layout and the layout engine loaded) while the replay runs on another core,
then waits. Once the report is written, :meth:`PlotProcess.render` hands it the report's JSON path;
it reads the report back (``read_json`` returns what ``write_json`` wrote, unchanged) and calls the
same :func:`~kvservice.replay.report.plot_agreement`, so the PNG is the one an in-process render
writes, byte for byte.

The protocol is one line each way: the parent writes ``{"report": json path, "png": png path}``
(JSON) to the process's stdin; the process answers ``ok <png path>`` on stdout and exits, or exits
non-zero with its traceback on stderr. When the replay fails, :meth:`PlotProcess.close` kills it
(it holds nothing: its warm-up render goes to ``os.devnull``). When the process cannot start or fails, :meth:`PlotProcess.render` renders in
this process instead and says why on stderr, so the PNG is always written.

This module imports neither matplotlib nor torch in the parent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

__all__ = ["PlotProcess", "main"]

RENDER_TIMEOUT_S = 120.0
"""Longest wait for the process's answer before rendering here instead."""


class PlotProcess:
    """A process that renders the agreement plot once the report is ready.

    Args:
        enabled: start the process (False: :meth:`render` renders in this process; the CLI
            passes False on a machine with one core, where nothing would overlap).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._why_not: str | None = None
        if not enabled:
            return
        if not sys.executable:  # an embedded interpreter: no Python to start
            self._why_not = "no Python executable to start the plot process with"
            return
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvservice.replay.plot_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            self._why_not = f"could not start the plot process ({exc})"

    def render(self, report_json: str | Path, png: str | Path) -> Path:
        """Writes the agreement plot of the report at ``report_json`` to ``png`` (in the process
        when it runs, else here).

        Returns:
            The PNG's path.
        """
        png = Path(png)
        proc, self._proc = self._proc, None
        if proc is not None:
            answer, error = _ask(proc, json.dumps({"report": str(report_json), "png": str(png)}))
            if answer == f"ok {png}":
                return png
            self._why_not = f"the plot process failed ({error.strip().splitlines()[-1] if error.strip() else answer})"
        if self._why_not is not None:
            print(f"kvservice replay: {self._why_not}; rendering the plot here", file=sys.stderr)
        from kvservice.replay.report import plot_agreement, read_json

        return plot_agreement(read_json(report_json), png)

    def close(self) -> None:
        """End the process without rendering (when the replay failed): killed, since it holds
        nothing; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        _close(proc.stdin)
        _close(proc.stdout)
        _close(proc.stderr)

    def __enter__(self) -> PlotProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ask(proc: subprocess.Popen[str], line: str) -> tuple[str, str]:
    """Send ``line``, wait for the process to end; (its answer line, its stderr)."""
    try:
        stdout, stderr = proc.communicate(line + "\n", timeout=RENDER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "", f"no answer within {RENDER_TIMEOUT_S:.0f} s"
    except OSError as exc:  # the process died before reading (a broken pipe)
        proc.kill()
        proc.wait()
        return "", str(exc)
    return stdout.strip(), stderr


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


def _warm_up() -> None:
    """Render a small two-mode report to nowhere, so the real render finds matplotlib's fonts,
    text layout and layout engine loaded."""
    from kvservice.replay.report import AgreementStats, LatencySummary, ModeReport, ReplayReport, plot_agreement

    series = [(i, i % 3, i % 2) for i in range(60)]
    modes = [
        ModeReport(
            mode=mode,
            num_requests=60,
            num_prompt_tokens=0,
            num_hit_tokens=0,
            num_prompt_blocks=0,
            num_hit_blocks=0,
            num_first_admission_prompt_tokens=0,
            num_first_admission_hit_tokens=0,
            num_prefill_tokens=0,
            agreement=AgreementStats.from_series(series),
            num_events=0,
            num_batches=0,
            num_preemptions=0,
            rpc_latency=LatencySummary.from_samples([1.0]),
            wall_time_s=0.0,
            mirror_capacity_blocks=32,
            pool_size_blocks=63,
            series=series,
        )
        for mode in ("incremental", "full")
    ]
    report = ReplayReport(
        trace_path="warm-up", num_trace_lines=60, preset="warm-up", block_size=16, num_blocks=64, modes=modes
    )
    plot_agreement(report, os.devnull)


def main() -> int:
    """The process: warm up, read one request line, render, answer (none when stdin ends first)."""
    _warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the replay ended without a report
    from kvservice.replay.report import plot_agreement, read_json

    request = json.loads(line)
    png = plot_agreement(read_json(request["report"]), request["png"])
    print(f"ok {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
