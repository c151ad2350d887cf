"""Tests of kvservice-vllm: they need vLLM 0.33 (.venv-vllm, scripts/setup_vllm.sh) and kvservice."""

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm")

from tier_helpers import CHUNK_BYTES  # noqa: E402 (after the skip: it imports vLLM)

from kvservice_vllm.tier_client import TierClient  # noqa: E402


@pytest.fixture
def connect_client() -> Iterator[Callable[..., TierClient]]:
    """Factory of connected shared-memory TierClients, each closed at the end."""
    clients: list[TierClient] = []

    def make(target: str, **options: Any) -> TierClient:
        client = TierClient(target, chunk_bytes=CHUNK_BYTES, transport="shm", **options)
        client.connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
