"""The core-ops sequence through vLLM's own KVCacheManager (the baseline of ``core_ops.py``).

Runs in a separate venv that has vLLM (BENCHMARKS.md, "The vLLM baseline", says how to make one); it imports nothing from
kvservice and prints one JSON object. Same workload: requests of ``prompt_len`` tokens built with
vLLM's request block hasher (sha256_cbor), looked up, allocated and freed once the pool is full.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from workloads import sequence as workload_sequence  # noqa: E402

SLIDING_WINDOW = 1024  # as core_ops.py
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
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["layer"], spec)]
    if hybrid:
        swa = SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=SLIDING_WINDOW
        )
        groups.append(KVCacheGroupSpec(["swa"], swa))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        config,
        max_model_len=131072,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=events,
    )
    hasher = get_request_block_hasher(block_size, sha256_cbor)
    params = SamplingParams(max_tokens=1)
    if workload == "mooncake":
        warm = MOONCAKE_WARM
    else:
        warm = num_blocks // (prompt_len // block_size) + 2
    sequence = workload_sequence(workload, warm + num_requests, prompt_len, shared_fraction)

    def one(i: int, tokens: list[int]) -> None:
        request = Request(f"r{i}", tokens, params, None, block_hasher=hasher)
        blocks, hit = manager.get_computed_blocks(request)[:2]
        new = manager.allocate_slots(request, len(tokens) - hit, hit, blocks)
        assert new is not None
        manager.free(request)
        if events:
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
    # A JSON list of keyword-argument dicts in, a JSON list of results out.
    print(json.dumps([run(**kwargs) for kwargs in json.loads(sys.argv[1])]))
