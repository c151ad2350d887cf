"""The replay's one progress display: plain lines with --no-progress (periodic, and when a mode
ends), updates from worker processes through a queue."""

from __future__ import annotations

import io
import multiprocessing

from kvservice.replay.progress import Progress, QueueDrain, worker_reporter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_interval_and_when_a_mode_ends():
    out, clock = io.StringIO(), Clock()
    progress = Progress(["incremental", "full"], 10, bar=False, interval_s=10.0, stream=out, clock=clock)
    progress.update("incremental", 3)  # too soon for a line
    clock.now = 111.0
    progress.update("full", 2)
    progress.update("full", 2)  # no change: nothing
    clock.now = 112.0
    progress.update("incremental", 10)  # the mode ended: a line at once
    progress.update("full", 10)
    progress.close()  # nothing new since the last line
    assert out.getvalue().splitlines() == [
        "replay 11 s: incremental 3/10, full 2/10 requests",
        "replay 12 s: incremental 10/10, full 2/10 requests",
        "replay 12 s: incremental 10/10, full 10/10 requests",
    ]


def test_close_prints_the_last_state_once():
    out, clock = io.StringIO(), Clock()
    progress = Progress(["full"], 10, bar=False, stream=out, clock=clock)
    clock.now = 101.0
    progress.update("full", 9)  # one skipped request: the mode ends below its total
    progress.close()
    progress.close()
    assert out.getvalue().splitlines() == ["replay 1 s: full 9/10 requests"]


def test_worker_updates_reach_the_parents_display_through_the_queue():
    out, clock = io.StringIO(), Clock()
    progress = Progress(["incremental", "full"], 4, bar=False, stream=out, clock=clock)
    queue = multiprocessing.get_context("spawn").Queue()
    drain = QueueDrain(queue, progress)
    report = worker_reporter(queue)
    for n in (1, 1, 2, 4):
        report("full", n)
    drain.stop()
    assert progress.finished == {"incremental": 0, "full": 4}
    assert out.getvalue().splitlines() == ["replay 0 s: incremental 0/4, full 4/4 requests"]


def test_the_bar_is_one_bar_over_every_mode():
    out = io.StringIO()
    progress = Progress(["incremental", "full"], 5, bar=True, stream=out)
    progress.update("incremental", 5)
    progress.update("full", 2)
    progress.close()
    last = out.getvalue().split("\r")[-1]
    assert "7/10" in last and "incremental 5/5, full 2/5" in last


def _job(mode: str, finished: int) -> str:
    """A worker job: reports its progress to the parent, returns what it did."""
    from kvservice.replay.progress import worker_progress

    report = worker_progress()
    assert report is not None
    for n in range(1, finished + 1):
        report(mode, n)
    return f"{mode} done"


async def test_run_in_workers_returns_in_job_order_and_the_parent_draws_their_progress():
    from kvservice.replay.progress import run_in_workers, worker_progress

    out = io.StringIO()
    progress = Progress(["incremental", "full"], 3, bar=False, stream=out, clock=Clock())
    results = await run_in_workers(_job, [("incremental", 3), ("full", 2)], progress)
    assert results == ["incremental done", "full done"]
    assert progress.finished == {"incremental": 3, "full": 2}
    assert worker_progress() is None  # this process is no worker


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_by_default_a_bar_only_in_a_terminal():
    """``bar=None`` (the replay's default): tqdm's frames in a terminal; plain lines when the
    output is a file or a pipe, so ``kvservice replay > log.txt`` writes no frames."""
    for stream, bar in ((io.StringIO(), False), (Terminal(), True)):
        progress = Progress(["full"], 10, bar=None, stream=stream, clock=Clock())
        progress.update("full", 10)
        progress.close()
        if bar:
            assert "\r" in stream.getvalue() and "10/10" in stream.getvalue()
        else:
            assert stream.getvalue() == "replay 0 s: full 10/10 requests\n"
