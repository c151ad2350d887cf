"""Core ops: 2,048-token requests (block size 16) through get_computed_blocks + allocate_slots + free.

Each request is built (hashing its prompt), looked up, allocated in full and freed, once the pool is
full so that every allocation also evicts, as a scheduler under load does. Run here with kvservice's
manager, and (``vllm_core_ops.py``) with vLLM's in its own venv on the same sequence.

``hybrid=True`` gives the pool two groups (full attention and a 1,024-token sliding window, block
size 16 both); ``workload="mooncake"`` replaces the synthetic prompts by the first
``num_requests`` prompts of the Mooncake conversation sample (in arrival order, the first
:data:`MOONCAKE_WARM` untimed), each admitted and freed in turn.
"""

from __future__ import annotations

import time

from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

try:
    from workloads import sequence as workload_sequence
except ImportError:  # imported as scripts.bench.core_ops
    from scripts.bench.workloads import sequence as workload_sequence

SLIDING_WINDOW = 1024
MOONCAKE_WARM = 20


def run(
    num_requests: int,
    *,
    prompt_len: int = 2048,
    block_size: int = 16,
    num_blocks: int = 4096,
    events: bool = True,
    shared_fraction: float = 0.0,
    hybrid: bool = False,
    workload: str = "synthetic",
) -> dict[str, float]:
    """Requests per CPU second of this process and CPU microseconds per block of the sequence
    (after a warm-up that fills the pool)."""
    groups = [KVCacheGroupSpec(("layer",), FullAttentionSpec(block_size, 1, 64, "float16"))]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size, 1, 64, "float16", sliding_window=SLIDING_WINDOW))
        )
    manager = KVCacheManager(
        KVCacheConfig(num_blocks, tuple(groups)), 131072, kv_events=KVEventsConfig() if events else None
    )
    if workload == "mooncake":
        warm = MOONCAKE_WARM
        sequence = workload_sequence(workload, warm + num_requests, prompt_len, shared_fraction)
    else:
        warm = num_blocks // (prompt_len // block_size) + 2
        sequence = workload_sequence(workload, warm + num_requests, prompt_len, shared_fraction)

    def one(i: int, tokens: list[int]) -> None:
        request = manager.new_request(f"r{i}", tokens)
        blocks, hit = manager.get_computed_blocks(request)
        new = manager.allocate_slots(request, len(tokens) - hit, hit, blocks)
        assert new is not None
        manager.free(request)
        manager.take_events()

    for i in range(warm):
        one(i, sequence[i])
    start = time.process_time()  # CPU seconds: other processes on a shared machine barely move it
    for i in range(warm, warm + num_requests):
        one(i, sequence[i])
    elapsed = time.process_time() - start
    blocks = sum(len(tokens) // block_size for tokens in sequence[warm:])
    return {"requests_per_s": num_requests / elapsed, "us_per_block": elapsed / blocks * 1e6}


if __name__ == "__main__":
    import json
    import sys

    # A JSON list of keyword-argument dicts in, a JSON list of results out (one process, several runs).
    print(json.dumps([run(**kwargs) for kwargs in json.loads(sys.argv[1])]))
