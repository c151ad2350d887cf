"""A replay whose server refuses a Step in the middle of the run fails once, with the refusal.

The server is real (port 0) and holds at most 4 registered requests (``max_num_requests=4``). The
trace (token JSONL) opens with 8 short requests (1 output token) one step apart, which all
finish, then sends 10 long ones (40 output tokens) one step apart, so they pile up: the 5th
registered at once on a server (in the routing replay, round-robin over 2 servers: the 9th long
one) is refused with RESOURCE_EXHAUSTED. By then the watchers follow the event stream (in the
single replay the late one too, which joins once half the trace was admitted). The refusal must come out of the replay as the one
error, and the replay must leave nothing behind: no watcher task still running, and no task whose
error nobody retrieved (asyncio's "Task exception was never retrieved", logged when the task is
collected). The same holds when the end itself fails: a routing replay whose feeds raise as they
close still closes every client and stops every server.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from pathlib import Path
from typing import Any

import pytest

import kvservice.server.app as server_app
from kvservice.replay.multi import MultiReplayConfig, replay_policy
from kvservice.replay.routing import Instance, grpc_stream_feed
from kvservice.replay.runner import MirrorWatcher, ReplayConfig, replay_mode
from kvservice.replay.scheduler import SchedulerConfig
from kvservice_client import AsyncKVCacheClient, KVServiceError, StatusCode

MAX_NUM_REQUESTS = 4
REFUSAL = f"max_num_requests: {MAX_NUM_REQUESTS} requests are registered; free some first"
SERVER = dict(port=0, preset="llama-3-8b", num_blocks=512, device="meta", grace_seconds=1.0)
SCHEDULER = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)


def write_trace(path: Path) -> Path:
    """8 requests at 0, 20, ... 140 ms with 1 output token, then 10 at 200, 220, ... 380 ms with 40
    (each a distinct 2-block prompt, so no request hits another's blocks)."""
    lines = [
        {"token_ids": [1000 * k + t for t in range(32)], "timestamp": 20 * k if k < 8 else 200 + 20 * (k - 8)}
        | {"output_length": 1 if k < 8 else 40}
        for k in range(18)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _watcher_tasks() -> list[asyncio.Task[Any]]:
    """The replay's watcher tasks still running (its MirrorWatcher's and the EventWatcher's)."""
    return [
        t
        for t in asyncio.all_tasks()
        if t.get_name() == "kvservice-event-watcher" or "MirrorWatcher" in t.get_coro().__qualname__  # type: ignore[union-attr]  # every task here runs a coroutine
    ]


def _run_and_collect(replay: Any) -> tuple[tuple[Any, str] | None, list[int], list[str], list[str]]:
    """Run ``replay(progress)`` on a fresh event loop that records what asyncio reports.

    Returns:
        ((code, message) of the KVServiceError raised, or None), the finished counts progress was
        told, the watcher tasks still running once the replay raised, and the messages asyncio's
        exception handler got (during the run, at shutdown, and when the loop's tasks are
        collected after it).
    """
    reported: list[str] = []
    finished: list[int] = []

    async def main() -> tuple[tuple[Any, str] | None, list[str]]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        error = None
        try:
            await replay(lambda _name, num_finished: finished.append(num_finished))
        except KVServiceError as e:
            error = (e.code, e.message)  # not the exception: its traceback would keep the tasks alive
        left = [repr(t) for t in _watcher_tasks()]
        return error, left

    error, left = asyncio.run(main())
    gc.collect()
    return error, finished, left, reported


@pytest.fixture
def trace(tmp_path) -> Path:
    return write_trace(tmp_path / "trace.jsonl")


def test_single_replay_refused_mid_run_raises_the_refusal_and_leaves_nothing_behind(trace, caplog):
    async def replay(progress):
        server = await server_app.start_server(**SERVER, max_num_requests=MAX_NUM_REQUESTS)
        try:
            config = ReplayConfig(
                trace=str(trace),
                target=server.address,
                report_modes=("full",),
                late_watcher=True,
                show_progress=False,
                scheduler=SCHEDULER,
            )
            await replay_mode("full", config, progress=progress)
        finally:
            await server.stop(0)

    caplog.set_level(logging.WARNING)
    error, finished, left, reported = _run_and_collect(replay)
    assert error == (StatusCode.RESOURCE_EXHAUSTED, REFUSAL)
    assert max(finished) == 8  # mid-run: the short requests had finished
    assert left == []
    assert reported == []
    assert [r.getMessage() for r in caplog.records] == []


def test_routing_replay_refused_mid_run_raises_the_refusal_and_leaves_nothing_behind(trace, caplog, monkeypatch):
    real_start_server = server_app.start_server

    async def refusing_start_server(**settings):
        return await real_start_server(**settings, max_num_requests=MAX_NUM_REQUESTS)

    monkeypatch.setattr(server_app, "start_server", refusing_start_server)
    config = MultiReplayConfig(
        trace=str(trace),
        instances=2,
        num_blocks=SERVER["num_blocks"],
        rate_scale=1.0,
        show_progress=False,
        scheduler=SCHEDULER,
        policies=("round-robin",),
    )

    async def replay(progress):
        await replay_policy("round-robin", config, progress=progress)

    caplog.set_level(logging.WARNING)
    error, finished, left, reported = _run_and_collect(replay)
    assert error == (StatusCode.RESOURCE_EXHAUSTED, REFUSAL)
    assert max(finished) == 8
    assert left == []
    assert reported == []
    assert [r.getMessage() for r in caplog.records] == []


def test_a_mirror_whose_stream_fails_raises_from_wait_applied_and_leaves_no_waiter():
    """The stream dies under a watcher (its client's channel closed) while the replay waits for a
    seq: the wait raises the stream's error, and its helper waiting on the watcher's progress is
    not left pending ("Task was destroyed but it is pending!" when collected)."""
    reported: list[str] = []

    async def main() -> tuple[tuple[Any, str] | None, list[str]]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        server = await server_app.start_server(**SERVER)
        try:
            client = AsyncKVCacheClient(server.address)
            mirror = MirrorWatcher(client, await client.get_kv_cache_group_metadata(), None)
            await mirror.start()
            await client.close()
            error = None
            try:
                await mirror.wait_applied(1)
            except KVServiceError as e:
                error = (e.code, e.message)
            left = [repr(t) for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Event.wait"]  # type: ignore[union-attr]  # every task here runs a coroutine
            await mirror.close()
        finally:
            await server.stop(0)
        return error, left

    error, left = asyncio.run(main())
    gc.collect()
    assert error == (StatusCode.CANCELLED, "event stream: the call was cancelled under the watcher (channel closed)")
    assert left == []
    assert reported == []


class _FeedFailingToClose:
    """The gRPC feed of one instance, whose ``close`` closes it and then raises."""

    def __init__(self, instance: Instance) -> None:
        self.idx = instance.idx
        self.inner = grpc_stream_feed(instance)
        self.index = self.inner.index

    @property
    def num_events(self) -> int:
        return self.inner.num_events

    @property
    def num_batches(self) -> int:
        return self.inner.num_batches

    async def start(self) -> None:
        await self.inner.start()

    async def wait_applied(self, seq: int) -> None:
        await self.inner.wait_applied(seq)

    async def close(self) -> None:
        await self.inner.close()
        raise RuntimeError(f"the feed of instance {self.idx} failed to close")


def test_a_routing_replay_whose_feeds_fail_to_close_still_closes_and_stops_everything(trace, monkeypatch):
    """Each step of the end runs even when one before it raised: every feed and client closed,
    every server stopped; the error raised is the last one met (instance 0's feed, closed last)."""
    real_start_server = server_app.start_server
    servers = []

    async def recording_start_server(**settings):
        servers.append(await real_start_server(**settings))
        return servers[-1]

    monkeypatch.setattr(server_app, "start_server", recording_start_server)
    config = MultiReplayConfig(
        trace=str(trace),
        instances=2,
        num_blocks=SERVER["num_blocks"],
        rate_scale=1.0,
        show_progress=False,
        scheduler=SCHEDULER,
        policies=("round-robin",),
    )
    reported: list[str] = []

    async def main() -> tuple[str, list[str]]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        with pytest.raises(RuntimeError) as caught:
            await replay_policy("round-robin", config, feed_factory=_FeedFailingToClose)
        error = str(caught.value)
        del caught  # its traceback would keep the tasks alive
        return error, [repr(t) for t in _watcher_tasks()]

    error, left = asyncio.run(main())
    gc.collect()
    assert error == "the feed of instance 0 failed to close"
    steps = ["not_serving", "drained", "streams_ended", "stopped", "probes_closed"]
    assert [[step for step, _ in s.stop_timeline] for s in servers] == [steps, steps]
    assert left == []
    assert reported == []
