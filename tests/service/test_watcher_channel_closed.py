"""An EventWatcher whose client channel is closed under it ends its iteration with CANCELLED instead
of waiting forever (grpc.aio cancels the call in the watcher's reading task; found by the soak)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice_client.client import AsyncKVCacheClient, KVServiceError
from kvservice_client.watcher import EventWatcher, RetryPolicy

pytestmark = pytest.mark.timeout(60)


async def test_closing_the_channel_under_a_watcher_ends_its_iteration(kv_server) -> None:
    client = AsyncKVCacheClient(kv_server.address)
    watcher = EventWatcher(client, retry=RetryPolicy(max_retries=None))
    try:
        first = await asyncio.wait_for(watcher.__anext__(), 10)
        assert (first.seq, first.snapshot) == (0, True)
        pending = asyncio.ensure_future(watcher.__anext__())  # waits for the next batch
        await client.close()
        with pytest.raises(KVServiceError) as err:
            await asyncio.wait_for(pending, 10)
        assert err.value.code == grpc.StatusCode.CANCELLED
        assert "cancelled under the watcher" in err.value.message
        with pytest.raises(KVServiceError):  # raised again by every later call
            await watcher.__anext__()
    finally:
        await watcher.close()


async def test_closing_the_watcher_still_just_stops_it(kv_server, client) -> None:
    watcher = EventWatcher(client)
    await asyncio.wait_for(watcher.__anext__(), 10)
    pending = asyncio.ensure_future(watcher.__anext__())
    await watcher.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 10)
