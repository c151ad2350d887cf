"""A server restart under a watcher: the same address, a new epoch, other contents.

The client's EventWatcher must notice by itself (its resume from the old epoch is refused with
FAILED_PRECONDITION), restart from a snapshot of the new server, and from then on hold exactly the
new server's cached set: nothing of the old epoch survives in its mirror. The test waits on the
watcher's own progress (each applied batch sets an event), never on a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvservice.server.app import RunningServer
from kvservice_client.client import AsyncKVCacheClient
from kvservice_client.watcher import EventWatcher, PrefixIndex, ResyncReason, RetryPolicy, WatchedBatch
from tests.service.helpers import hashes

pytestmark = pytest.mark.timeout(60)

WAIT_S = 20.0
"""Deadline of one wait on the watcher (a hang becomes a failure, not a stuck suite)."""
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
RETRY = RetryPolicy(max_retries=None, initial_backoff_s=0.01, max_backoff_s=0.2, connect_timeout_s=2.0)


class FollowedMirror:
    """A PrefixIndex fed by an EventWatcher in a task of its own; ``changed`` is set after every
    applied batch, so a test can wait for a state of the mirror without sleeping."""

    def __init__(self, watcher: EventWatcher) -> None:
        self.watcher = watcher
        self.index = PrefixIndex()
        self.seen: list[WatchedBatch] = []
        self.changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        async for watched in self.watcher:
            self.index.apply_batch(watched)
            self.seen.append(watched)
            self.changed.set()

    def hashes(self) -> set[int]:
        """The hashes the mirror holds (one group)."""
        return set(self.index.snapshot().get(0, set()))

    async def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Return once ``predicate()`` holds, re-checking after every applied batch."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not predicate():
            if self.task.done():
                self.task.result()  # the watcher failed: raise its error
                raise AssertionError(f"the watcher stopped before {what}")
            self.changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(
                    f"timed out waiting for {what}: watcher at seq {self.watcher.last_seq} of "
                    f"epoch {self.watcher.epoch}, stats {self.watcher.stats}"
                )
            changed = loop.create_task(self.changed.wait())
            await asyncio.wait({self.task, changed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()

    async def close(self) -> None:
        await self.watcher.close()
        await asyncio.wait([self.task])


def server_hashes(running: RunningServer) -> set[int]:
    """The server's cached set (its event log's mirror, which the service tests check equals the pool)."""
    (cached,) = running.snapshots.mirror.cached_hashes()
    return set(cached)


async def cache_prompt(client: AsyncKVCacheClient, request_id: str, prompt: list[int], *, free: bool = True) -> None:
    """Register, compute and (by default) free a request: its full blocks stay cached."""
    await client.get_computed_blocks(request_id, prompt)
    assert (await client.allocate_slots(request_id, len(prompt))).allocated
    if free:
        await client.free(request_id)


@pytest.mark.parametrize("stop", ["graceful", "abrupt"])
async def test_a_watcher_follows_a_restart_on_the_same_address(start_kv_server, connect, stop):
    old = await start_kv_server()
    old_prompt, new_prompt, other_prompt = list(range(1, 13)), list(range(500, 509)), list(range(900, 908))
    old_client = await connect(old)
    await cache_prompt(old_client, "a", old_prompt)
    watched_client = await connect(old, options=RECONNECT_OPTIONS)
    mirror = FollowedMirror(EventWatcher(watched_client, retry=RETRY))
    try:
        await cache_prompt(old_client, "b", other_prompt)
        old_epoch = old.event_log.epoch
        await mirror.wait_until(
            lambda: mirror.hashes() == server_hashes(old) and mirror.watcher.last_seq == old.event_log.head_seq,
            "the mirror of the first server",
        )
        assert mirror.hashes() == set(hashes(old_prompt) + hashes(other_prompt))
        assert mirror.watcher.epoch == old_epoch

        if stop == "graceful":
            await old.stop(0)  # open streams end with UNAVAILABLE naming their last seq
        else:
            await old.server.stop(None)  # calls cancelled, connections dropped: no status of ours
        new = await start_kv_server(port=old.port)
        assert new.address == old.address and new.event_log.epoch != old_epoch
        new_client = await connect(new)
        await cache_prompt(new_client, "c", new_prompt, free=False)  # held, and cached
        await cache_prompt(new_client, "d", other_prompt[:4] + [7, 7, 7, 7])

        await mirror.wait_until(
            lambda: mirror.watcher.epoch == new.event_log.epoch and mirror.hashes() == server_hashes(new),
            "the mirror of the restarted server",
        )
        assert mirror.hashes() == set(hashes(new_prompt) + hashes(other_prompt[:4] + [7, 7, 7, 7]))
        assert not mirror.hashes() & set(hashes(old_prompt)), "a hash of the old epoch survived"
        assert not mirror.hashes() & (set(hashes(other_prompt)) - set(hashes(other_prompt[:4])))
        epochs = [w.epoch for w in mirror.seen]
        first_new = epochs.index(new.event_log.epoch)
        assert set(epochs[:first_new]) == {old_epoch} and set(epochs[first_new:]) == {new.event_log.epoch}
        assert mirror.seen[first_new].snapshot, "a batch of the new epoch was applied before its snapshot"
        assert mirror.watcher.stats.resyncs.get(ResyncReason.EPOCH_CHANGED) == 1
        assert mirror.watcher.stats.num_reconnects >= 1

        # And it keeps following the new server live.
        await new_client.free("c")
        await cache_prompt(new_client, "e", [42] * 8)
        await mirror.wait_until(
            lambda: mirror.watcher.last_seq == new.event_log.head_seq and mirror.hashes() == server_hashes(new),
            "the live batches of the restarted server",
        )
    finally:
        await mirror.close()
