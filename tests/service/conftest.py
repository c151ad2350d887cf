"""Fixtures of the service tests: a real server on port 0 per test, and clients on their own channels.

Each test gets its own servers (function scope, started on the test's event loop) through the
``start_kv_server`` factory, and its own clients through ``connect``; both are stopped/closed when
the test ends. The default server is tiny: one full-attention group (``qwen-2.5-0.5b``), block size
4, 16 blocks, max_model_len 64, on the ``meta`` device (shapes only, no memory).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kvservice.server.app import RunningServer, start_server
from kvservice_client.client import AsyncKVCacheClient

SMALL_SERVER: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "device": "meta",
    "preset": "qwen-2.5-0.5b",
    "block_size": 4,
    "num_blocks": 16,
    "max_model_len": 64,
    "grace_seconds": 0.0,
}
"""The default test server; a test's overrides replace these keys."""

StartServer = Callable[..., Awaitable[RunningServer]]
Connect = Callable[..., Awaitable[AsyncKVCacheClient]]


@pytest.fixture
async def start_kv_server() -> AsyncIterator[StartServer]:
    """Factory: ``await start_kv_server(**overrides)`` starts a server (see :data:`SMALL_SERVER`)."""
    servers: list[RunningServer] = []

    async def start(**overrides: Any) -> RunningServer:
        running = await start_server(**{**SMALL_SERVER, **overrides})
        servers.append(running)
        return running

    yield start
    for running in reversed(servers):
        await running.stop(0)


@pytest.fixture
async def kv_server(start_kv_server: StartServer) -> RunningServer:
    """A default small server."""
    return await start_kv_server()


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Factory: ``await connect(running, options=...)`` opens an AsyncKVCacheClient on a channel of
    its own (a local subchannel pool, so two clients never share a connection)."""
    clients: list[AsyncKVCacheClient] = []

    async def open_client(
        running: RunningServer, *, options: list[tuple[str, Any]] | None = None, **kwargs: Any
    ) -> AsyncKVCacheClient:
        opts = [("grpc.use_local_subchannel_pool", 1), *(options or [])]
        client = AsyncKVCacheClient(running.address, options=opts, timeout=10.0, **kwargs)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        await client.close()


@pytest.fixture
async def client(kv_server: RunningServer, connect: Connect) -> AsyncKVCacheClient:
    """A client of ``kv_server``."""
    return await connect(kv_server)
