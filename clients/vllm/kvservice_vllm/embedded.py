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

__all__ = ["EmbeddedServer"]


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
