"""Memory: bytes of bookkeeping per block (Python heap, tracemalloc), empty and fully cached.

Baseline: the block ids alone, as one 8-byte integer each (``array('q')``), the least any pool
that names its blocks must hold.
"""

from __future__ import annotations

import gc
import tracemalloc
from array import array

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


def _measure(fn):
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = fn()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return result, after - before


def run(num_blocks: int, block_size: int = 16) -> dict[str, float]:
    """Bytes per block: the empty pool, the pool with every block cached, and the ids baseline."""
    config = KVCacheConfig(num_blocks, (KVCacheGroupSpec(("layer",), FullAttentionSpec(block_size, 1, 64, "float16")),))
    manager, empty_bytes = _measure(lambda: KVCacheManager(config, 1 << 30, kv_events=None))
    # Cache every block: requests of 4096 blocks each, allocated and freed (hashes computed before).
    per_request = 4096
    requests = []
    for i in range(0, num_blocks - 1, per_request):
        n = min(per_request, num_blocks - 1 - i)
        requests.append(manager.new_request(f"r{i}", range(i * block_size, (i + n) * block_size)))

    def fill():
        for request in requests:
            blocks, hit = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
            manager.free(request)
            request.block_hashes = []  # the request's own copy of the hashes is not the pool's

    _, cached_bytes = _measure(fill)
    _, ids_bytes = _measure(lambda: array("q", range(num_blocks)))
    assert manager.block_pool.get_num_cached_blocks() == num_blocks - 1
    return {
        "empty_bytes_per_block": empty_bytes / num_blocks,
        "cached_bytes_per_block": (empty_bytes + cached_bytes) / num_blocks,
        "ids_bytes_per_block": ids_bytes / num_blocks,
    }


if __name__ == "__main__":
    import json

    print(json.dumps({n: run(n) for n in (100_000,)}))
