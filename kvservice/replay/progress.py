"""The replay's one progress display, drawn by the parent process only.

Worker processes (one per report mode) never draw: they send ``(mode, finished)`` through a
queue (:func:`worker_reporter`), and the parent's :class:`Progress` draws one bar over all modes
(tqdm) when its stream is a terminal, or else (output piped or sent to a file, or
``--no-progress``) prints a plain line every ``interval_s`` seconds and when a mode ends, so a log
shows the run is alive without a bar's control codes (``--progress`` draws the bar anyway).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = ["Progress", "ProgressCallback", "QueueDrain", "run_in_workers", "worker_progress", "worker_reporter"]

ProgressCallback = Callable[[str, int], None]
"""``(mode, requests finished so far)``."""


class Progress:
    """One display for every mode's progress.

    Args:
        modes: the modes (or policies), in display order.
        total: requests per mode.
        bar: draw a tqdm bar (True), plain lines (False), or a bar only when ``stream`` is a
            terminal (None).
        interval_s: seconds between plain lines.
        stream: where plain lines go (default stdout).
        clock: seconds (monotonic).
    """

    def __init__(
        self,
        modes: Sequence[str],
        total: int,
        *,
        bar: bool | None,
        interval_s: float = 10.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.finished = dict.fromkeys(modes, 0)
        self._interval_s = interval_s
        self._stream = stream or sys.stdout
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._last_printed: dict[str, int] | None = None
        self._lock = threading.Lock()
        self._bar: Any = None
        if bar is None:
            isatty = getattr(self._stream, "isatty", None)
            bar = bool(isatty is not None and isatty())
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total * len(modes), desc="replay", unit="req", dynamic_ncols=True, leave=True, file=self._stream
            )
            self._bar.set_postfix_str(self._postfix(), refresh=False)

    def _postfix(self) -> str:
        return ", ".join(f"{mode} {n}/{self.total}" for mode, n in self.finished.items())

    def line(self) -> str:
        """The plain line: ``replay 12 s: incremental 120/991, full 118/991 requests``."""
        return f"replay {self._clock() - self._started:.0f} s: {self._postfix()} requests"

    def update(self, mode: str, finished: int) -> None:
        """``mode`` has finished ``finished`` requests (thread-safe)."""
        with self._lock:
            before = self.finished.get(mode, 0)
            if finished == before:
                return
            self.finished[mode] = finished
            if self._bar is not None:
                self._bar.update(finished - before)
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                return
            now = self._clock()
            if finished == self.total or now - self._last_line >= self._interval_s:
                self._last_line = now
                self._print()

    def close(self) -> None:
        """Finish: the bar's last state (the last screen keeps one line), or a last plain line."""
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.close()
                self._bar = None
            elif self._last_printed != self.finished:
                self._print()

    def _print(self) -> None:
        self._last_printed = dict(self.finished)
        print(self.line(), file=self._stream, flush=True)


def worker_reporter(queue: Any) -> ProgressCallback:
    """The callback of a worker process: sends each change through ``queue``."""
    last: dict[str, int] = {}

    def report(mode: str, finished: int) -> None:
        if last.get(mode) != finished:
            last[mode] = finished
            queue.put((mode, finished))

    return report


class QueueDrain:
    """A thread in the parent applying a queue's ``(mode, finished)`` to a :class:`Progress`
    until :meth:`stop`."""

    def __init__(self, queue: Any, progress: Progress) -> None:
        self._queue = queue
        self._thread = threading.Thread(target=self._run, args=(progress,), name="replay-progress", daemon=True)
        self._thread.start()

    def _run(self, progress: Progress) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            progress.update(*item)

    def stop(self) -> None:
        """Apply what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout=10)


_WORKER_QUEUE: Any = None


def _init_worker(queue: Any) -> None:
    global _WORKER_QUEUE
    _WORKER_QUEUE = queue


def worker_progress() -> ProgressCallback | None:
    """In a worker of :func:`run_in_workers`: the callback that reports to the parent's display
    (None elsewhere)."""
    return worker_reporter(_WORKER_QUEUE) if _WORKER_QUEUE is not None else None


async def run_in_workers(entry: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], progress: Progress) -> list[Any]:
    """``entry(*job)`` for each job, each in its own spawned worker process, in parallel; what
    the workers report through :func:`worker_progress` goes to ``progress``.

    Returns:
        The results, in job order.
    """
    import multiprocessing  # here, not at the top: a replay of a few requests never starts workers
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    # Ctrl-C reaches every worker at its default: a worker ignoring it until its job runs (or this
    # process ignoring it while they spawn) kept a Ctrl-C from ending the run (CI caught both).
    queue = context.Queue()
    pool = ProcessPoolExecutor(len(jobs), mp_context=context, initializer=_init_worker, initargs=(queue,))
    futures = [loop.run_in_executor(pool, entry, *job) for job in jobs]  # submit() starts them
    drain = QueueDrain(queue, progress)
    try:
        with pool:
            return list(await asyncio.gather(*futures))
    finally:
        drain.stop()
