"""The replay's agreement plot, rendered in a process of its own beside the replay.

Importing matplotlib and a first render cost about as much as a short replay itself (0.9 s of
``kvservice replay --limit 1``'s 3.3 s on an idle machine, before this module). So the CLI starts
:class:`PlotProcess` as the replay starts: the process imports matplotlib (0.35-0.45 s) while
the replay runs on another core, then waits. (A throwaway render first, to load fonts and the
layout engine, was tried: the real render took as long after it, 0.17-0.21 s, so it only cost CPU.) Once the report is written, :meth:`PlotProcess.submit` hands it the report's JSON
path (the CLI prints the table meanwhile) and :meth:`PlotProcess.result` waits for the PNG. The
process reads the report back (``read_json`` returns what ``write_json`` wrote, unchanged) and
calls the same :func:`~kvservice.replay.report.plot_agreement`, so the PNG is the one an
in-process render writes, byte for byte.

The protocol is one line each way: the parent writes ``{"report": json path, "png": png path}``
(JSON) to the process's stdin; the process answers ``ok <png path>`` on stdout and exits, or exits
non-zero with its traceback on stderr (a temporary file). When the replay fails,
:meth:`PlotProcess.close` kills it (it holds nothing).
When the process cannot start or fails, :meth:`PlotProcess.result` renders in this process
instead and says why on stderr, so the PNG is always written.

This module imports neither matplotlib nor torch in the parent.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["PlotProcess", "main"]

RENDER_TIMEOUT_S = 120.0
"""Longest wait for the process's answer before rendering here instead."""


class PlotProcess:
    """A process that renders the agreement plot once the report is ready.

    :meth:`submit` hands it the report and returns at once; :meth:`result` waits for the PNG
    (:meth:`render` does both).

    Args:
        enabled: start the process (False: the plot renders in this process; the CLI passes
            False on a machine with one core, where nothing would overlap).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None
        self._why_not: str | None = None
        self._request: tuple[Path, Path] | None = None
        if not enabled:
            return
        if not sys.executable:  # an embedded interpreter: no Python to start
            self._why_not = "no Python executable to start the plot process with"
            return
        try:
            self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8")  # a file: a full pipe cannot block it
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvservice.replay.plot_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            self._why_not = f"could not start the plot process ({exc})"

    def submit(self, report_json: str | Path, png: str | Path) -> None:
        """Hand the report at ``report_json`` (written by ``write_json``) to the process, to be
        drawn to ``png``; returns at once."""
        self._request = Path(report_json), Path(png)
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        stdin, proc.stdin = proc.stdin, None  # closed here, so communicate() leaves it alone
        try:
            stdin.write(json.dumps({"report": str(report_json), "png": str(png)}) + "\n")
            stdin.close()
        except OSError as exc:  # the process died before reading (a broken pipe)
            self._why_not = f"the plot process failed ({exc})"
            _close(stdin)

    def result(self) -> Path:
        """The PNG of the submitted report, once written (by the process, or here when it could
        not start or failed: then a line on stderr says why).

        Returns:
            The PNG's path.

        Raises:
            RuntimeError: nothing was submitted.
        """
        if self._request is None:
            raise RuntimeError("result() before submit()")
        report_json, png = self._request
        proc, self._proc = self._proc, None
        if proc is not None and self._why_not is None:
            try:
                stdout, _ = proc.communicate(timeout=RENDER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                stdout, self._why_not = "", f"the plot process gave no answer within {RENDER_TIMEOUT_S:.0f} s"
            if stdout.strip() == f"ok {png}":
                self._close_stderr()
                return png
            if self._why_not is None:
                error = self._read_stderr().strip()
                self._why_not = f"the plot process failed ({error.splitlines()[-1] if error else stdout.strip()})"
        elif proc is not None:
            proc.kill()
            proc.wait()
            _close(proc.stdout)
        self._close_stderr()
        if self._why_not is not None:
            print(f"kvservice replay: {self._why_not}; rendering the plot here", file=sys.stderr)
        from kvservice.replay.report import plot_agreement, read_json

        return plot_agreement(read_json(report_json), png)

    def render(self, report_json: str | Path, png: str | Path) -> Path:
        """:meth:`submit` then :meth:`result`."""
        self.submit(report_json, png)
        return self.result()

    def close(self) -> None:
        """End the process without rendering (when the replay failed): killed, since it holds
        nothing; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            _close(proc.stdin)
            _close(proc.stdout)
        self._close_stderr()

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()

    def _close_stderr(self) -> None:
        stderr, self._stderr = self._stderr, None
        _close(stderr)

    def __enter__(self) -> PlotProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


def _preload() -> None:
    """Import, now, what :func:`~kvservice.replay.report.plot_agreement` imports when it runs."""
    for name in ("kvservice.replay.report", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        importlib.import_module(name)


def main() -> int:
    """The process: import matplotlib, read one request line, render, answer (none when stdin
    ends first)."""
    _preload()
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
