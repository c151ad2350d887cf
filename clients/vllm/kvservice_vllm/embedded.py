"""A private kvservice server in the scheduler's process (``target="embedded"``).

The server runs on its own event-loop thread and listens on loopback (port 0); the scheduler's
remote manager reaches it over gRPC like any other server: no call takes an in-process shortcut.
It is laid out from vLLM's ``KVCacheConfig`` as given: one layout file run per KV cache group, with
vLLM's layer names and the group index (``group`` in the layout file: vLLM's grouping is not
redone), ``num_blocks`` blocks, and vLLM's hash algorithm and none-hash seed. A config with no KV
cache tensors (vLLM's scheduler tests) gets a ``meta`` pool: shapes only, no memory.

Needs the ``kvservice`` package (``pip install 'kvservice-vllm[embedded]'``).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvservice_vllm.layout import layout_toml

__all__ = ["EmbeddedServer", "EmbeddedTierServer"]


class EmbeddedServer:
    """A kvservice server on a background event-loop thread.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` (its groups and ``num_blocks``).
        max_model_len: the longest request, in tokens.
        enable_prefix_caching: vLLM's ``cache_config.enable_prefix_caching``.
        hash_algorithm: vLLM's ``prefix_caching_hash_algo``.
        hash_seed: vLLM's none-hash seed (``kv_cache_utils.get_none_hash_seed()``).
        device: where the KV memory lives (default ``meta`` when the config has no KV cache
            tensors, else ``cpu``).

    Attributes:
        address: ``127.0.0.1:PORT``, for a plain gRPC channel.
        running: the server (``kvservice.server.app.RunningServer``).

    Raises:
        ImportError: the ``kvservice`` package is not installed.
        ValueError: a layout kvservice cannot hold (the message names the group and the field).
    """

    def __init__(
        self,
        kv_cache_config: Any,
        *,
        max_model_len: int,
        enable_prefix_caching: bool,
        hash_algorithm: str,
        hash_seed: str,
        device: str | None = None,
    ) -> None:
        from kvservice.server.app import start_server  # the extra: kvservice-vllm[embedded]

        self._dir = tempfile.TemporaryDirectory(prefix="kvservice-vllm-")
        layout = Path(self._dir.name) / "layout.toml"
        layout.write_text(layout_toml(kv_cache_config, max_model_len=max_model_len), encoding="utf-8")
        if device is None:
            device = "cpu" if kv_cache_config.kv_cache_tensors else "meta"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvservice-embedded", daemon=True)
        self._thread.start()
        self._stopped = False
        try:
            self.running = asyncio.run_coroutine_threadsafe(
                start_server(
                    host="127.0.0.1",
                    port=0,
                    kv_cache_layout=str(layout),
                    num_blocks=kv_cache_config.num_blocks,
                    max_model_len=max_model_len,
                    device=device,
                    enable_prefix_caching=enable_prefix_caching,
                    hash_algorithm=hash_algorithm,
                    hash_seed=hash_seed,
                    grace_seconds=0.0,
                ),
                self._loop,
            ).result()
        except BaseException:
            self._shutdown_loop()
            raise
        self.address: str = self.running.address

    def stop(self) -> None:
        """Stop the server and its thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self.running.stop(0), self._loop).result(timeout=30)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._dir.cleanup()


class EmbeddedTierServer:
    """A kvservice server laid out for a tier (``--device cpu --kv-cache-layout opaque:BYTES``) on a
    background event-loop thread: loopback TCP (port 0) and a Unix socket in a private folder.
    For tests, benchmarks and single-process examples of :class:`kvservice_vllm.tier.KVServiceTier`
    (a deployment runs ``kvservice serve``). :meth:`restart` starts a new server (a new epoch, an
    empty pool) on the same socket.

    Args:
        chunk_bytes: bytes per block: vLLM's offload chunk (``primary_kv_view.strides[0]``).
        num_blocks: blocks in the pool (block 0 is the null block: ``num_blocks - 1`` hold chunks).
        block_size: tokens per block (vLLM's offloaded block size; the events' ``block_size``).
        **settings: further server settings (``ServerConfig`` field names).

    Attributes:
        uds: the Unix socket's path; ``target`` is ``unix:`` + it.

    Raises:
        ImportError: the ``kvservice`` package is not installed.
        ValueError: a bad setting (named).
    """

    def __init__(self, chunk_bytes: int, *, num_blocks: int = 1024, block_size: int = 16, **settings: Any) -> None:
        from kvservice.server.app import start_server  # the extra: kvservice-vllm[embedded]

        self._start_server = start_server
        self._dir = tempfile.TemporaryDirectory(prefix="kvservice-tier-")
        self.uds = str(Path(self._dir.name) / "kvservice.sock")
        self.settings: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "uds": self.uds,
            "kv_cache_layout": f"opaque:{chunk_bytes}",
            "block_size": block_size,
            "num_blocks": num_blocks,
            "device": "cpu",
            "grace_seconds": 0.0,
            **settings,
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvservice-tier", daemon=True)
        self._thread.start()
        self.running: Any = None
        try:
            self.start()
        except BaseException:
            self._close_loop()
            raise

    @property
    def target(self) -> str:
        """``unix:PATH`` (the same across restarts)."""
        return f"unix:{self.uds}"

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` of the running server (a new port after a restart)."""
        return str(self.running.address)

    def start(self) -> None:
        """Start a server (after :meth:`stop`)."""
        self.running = asyncio.run_coroutine_threadsafe(self._start_server(**self.settings), self._loop).result(60)

    def stop(self) -> None:
        """Stop the running server (idempotent); the socket path stays for :meth:`start`."""
        if self.running is not None:
            running, self.running = self.running, None
            asyncio.run_coroutine_threadsafe(running.stop(0), self._loop).result(60)

    def restart(self) -> None:
        """Stop, then start a new server: an empty pool, a new epoch."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and its thread."""
        try:
            self.stop()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._dir.cleanup()
