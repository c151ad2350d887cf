"""pytest plugin for vLLM's own tiering suites: the kvservice tier added wherever they build tiers.

Load it with ``-p kvservice_tier_plugin`` (its folder on ``PYTHONPATH``), from a folder holding vLLM's
``tests/`` (``scripts/vllm_tests.py`` does both). Two additions, each a place where vLLM takes an
out-of-tree tier without a change:

* ``SecondaryTierFactory`` gets the tier type ``kvservice`` (``kvservice_vllm.tier.KVServiceTier``), so
  the suites' checks over every registered tier (``test_pre_registered_tiers_can_be_imported``: it
  imports, it is a ``SecondaryTierManager``, its ``cache_hit_source``) cover it;
* every ``TieringOffloadingSpec`` a test builds gets a kvservice tier appended to its
  ``secondary_tiers`` (after the test's own), on a private server laid out for that spec's chunk
  (``kvservice_vllm.embedded.EmbeddedTierServer``, one per chunk size per test, stopped after it):
  the test's engine, connector and tiering manager then run with kvservice as their last tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvservice_vllm.embedded import EmbeddedTierServer

SecondaryTierFactory.register_tier("kvservice", "kvservice_vllm.tier", "KVServiceTier")

_servers: dict[int, EmbeddedTierServer] = {}
_get_manager = TieringOffloadingSpec.get_manager


def _server_for(chunk_bytes: int) -> EmbeddedTierServer:
    server = _servers.get(chunk_bytes)
    if server is None:
        server = _servers[chunk_bytes] = EmbeddedTierServer(chunk_bytes, num_blocks=256)
    return server


def _get_manager_with_kvservice(self: Any) -> Any:
    if self._manager is None and self.num_chunks > 0:
        configs = self.secondary_tier_configs
        if not any(c.get("type") == "kvservice" for c in configs):
            target = _server_for(self.kv_bytes_per_chunk).target
            configs.append({"type": "kvservice", "target": target})
    return _get_manager(self)


TieringOffloadingSpec.get_manager = _get_manager_with_kvservice


@pytest.fixture(autouse=True)
def _kvservice_tier_servers() -> Iterator[None]:
    """A fresh pool per test: what one test stored never hits in another."""
    yield
    while _servers:
        _servers.popitem()[1].close()
