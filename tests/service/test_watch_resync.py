"""``kvservice watch`` reconnects: it resumes in the same epoch without a gap or a repeat, and after a
server restart it says so and, with --snapshot, resyncs from a snapshot of the new cached set.

``watch_events`` runs in-process against real servers on one port (the second started on the first
one's port after it stopped); its lines go to a queue the test waits on.
"""

from __future__ import annotations

import asyncio
import io

import pytest

from kvservice.watch import watch_events
from tests.service.helpers import wait_until
from tests.service.test_stream_resume import publish

pytestmark = pytest.mark.timeout(120)

LINE_TIMEOUT_S = 30


class Lines(io.TextIOBase):
    """A text sink whose complete lines the test awaits in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.seen: list[str] = []
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self.queue.put_nowait(line)
        return len(text)

    async def next(self) -> str:
        try:
            line = await asyncio.wait_for(self.queue.get(), LINE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise AssertionError(f"no line within {LINE_TIMEOUT_S} s after {self.seen}") from None
        self.seen.append(line)
        return line

    async def until(self, text: str) -> str:
        """The next line containing ``text`` (lines before it are kept in ``seen``)."""
        while True:
            line = await self.next()
            if text in line:
                return line


async def start_watch(running, **kwargs) -> tuple[Lines, asyncio.Task]:
    out = Lines()
    task = asyncio.create_task(watch_events(running.address, out=out, max_backoff_s=0.2, **kwargs))
    return out, task


async def stop_watch(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watch_resumes_in_the_same_epoch_after_its_stream_is_cut(start_kv_server, connect):
    running = await start_kv_server()
    scheduler = await connect(running)
    await publish(scheduler, 0)
    out, task = await start_watch(running, start_seq=1)
    try:
        assert (await out.until("seq=1 ")).startswith("seq=1 BlockStored")
        await wait_until(lambda: running.event_log.num_subscribers == 1)
        (sub,) = running.event_log._subscribers
        sub.write_timed_out()  # as if its write had taken over stalled_write_timeout_s
        await out.until("# stream ended: DEADLINE_EXCEEDED: stream cut")
        epoch = running.event_log.epoch
        assert await out.next() == f"# reconnected to {running.address}: epoch {epoch}, resuming from seq 2"
        await publish(scheduler, 1)
        line = await out.next()
        assert line.startswith("seq=2 BlockStored")  # not seq 1 again, not a gap
    finally:
        await stop_watch(task)


async def test_watch_with_snapshot_resyncs_after_a_restart_and_says_so(start_kv_server, connect):
    first = await start_kv_server()
    scheduler = await connect(first)
    await publish(scheduler, 0)
    out, task = await start_watch(first, snapshot=True)
    try:
        await out.until("seq=1* AllBlocksCleared")
        await publish(scheduler, 1)
        await out.until("seq=2 BlockStored")
        old_epoch = first.event_log.epoch
        await first.stop(0)
        await out.until("# stream ended: UNAVAILABLE")
        second = await start_kv_server(port=first.port)
        restarted = await connect(second)
        await publish(restarted, 5)
        await publish(restarted, 6)  # seq 2 of the new epoch: its stores evict seq 1's blocks
        line = await out.until("# epoch changed")
        assert line == (
            f"# epoch changed {old_epoch} -> {second.event_log.epoch} (the server restarted): resync from a snapshot"
        )
        # The snapshot's watermark is the new epoch's head when the watch came back, which races the
        # two publishes above: 0, 1 or 2. What follows it must be exact either way: the cached set
        # at the watermark, then every later seq live, in order, without a gap or a repeat.
        cleared = await out.next()
        assert cleared in ("seq=0* AllBlocksCleared", "seq=1* AllBlocksCleared", "seq=2* AllBlocksCleared")
        watermark = int(cleared[len("seq=") : cleared.index("*")])
        await publish(restarted, 7)  # seq 3, live after the snapshot
        lines = []
        while not (line := await out.next()).startswith("seq=3 "):
            lines.append(line)
        assert line.startswith("seq=3 BlockStored")
        snapshot = [x for x in lines if x.startswith(f"seq={watermark}* ")]
        live = lines[len(snapshot) :]
        assert all(x.startswith(f"seq={watermark}* BlockStored") for x in snapshot)
        assert bool(snapshot) == (watermark > 0)  # a non-empty cached set comes as stores
        live_seqs = [int(x[len("seq=") : x.index(" ")]) for x in live]
        assert sorted(set(live_seqs)) == list(range(watermark + 1, 3)) and live_seqs == sorted(live_seqs)
    finally:
        await stop_watch(task)


async def test_watch_without_snapshot_follows_the_new_epoch_live_after_a_restart_and_says_so(start_kv_server, connect):
    first = await start_kv_server()
    scheduler = await connect(first)
    out, task = await start_watch(first)
    try:
        await out.until("head seq 0")
        await wait_until(lambda: first.event_log.num_subscribers == 1)
        await publish(scheduler, 0)
        await out.until("seq=1 BlockStored")
        old_epoch = first.event_log.epoch
        await first.stop(0)
        second = await start_kv_server(port=first.port)
        restarted = await connect(second)
        await publish(restarted, 5)  # seq 1 of the new epoch, before the watch is back
        line = await out.until("# epoch changed")
        assert line == (
            f"# epoch changed {old_epoch} -> {second.event_log.epoch} (the server restarted): following live from "
            "seq 2; blocks announced before are not shown (--snapshot resyncs)"
        )
        await publish(restarted, 6)
        assert (await out.next()).startswith("seq=2 BlockStored")
    finally:
        await stop_watch(task)
