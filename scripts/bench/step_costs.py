"""Where a served Step of admissions spends its time beyond the engine, measured in process.

    python scripts/bench/step_costs.py

Runs the op sequence of ``rpc_bench.step_rate`` (Steps of 64 admissions of 2,048 tokens on an
8,192-block pool, the previous Step's requests freed first) through the engine, and after each
Step does what the server does with its events, timing each part per request (microseconds):

* ``engine``: the ops themselves (what ``rpc_bench.in_process_step_rate`` measures);
* ``msgpack``: the event log's encoding of the batch (``LogEntry``: vLLM's msgpack layout);
* ``mirror``: the snapshot mirror applying it (``CachedSetMirror.apply``).

And the prompt's wire encoding for one such Step, per Step (microseconds): serializing and
parsing the StepRequest with the prompts as ``prompt_token_ids`` (a varint per token id) and as
``packed_prompt_token_ids`` (little-endian int32).

The parts run interleaved as in the server (the engine's work between two applies evicts the
mirror's table from the CPU caches, which is most of its cost: applied back to back the same
batches cost about half).
"""

from __future__ import annotations

import json
import time

from kvservice.core.engine import KVCacheEngine
from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.model_config import get_preset
from kvservice.server.snapshot import CachedSetMirror
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.events import KVEventBatch, encode_event_batch

try:
    from rpc_bench import NUM_BLOCKS, _prompts, admission_steps, step_sequence
except ImportError:
    from scripts.bench.rpc_bench import NUM_BLOCKS, _prompts, admission_steps, step_sequence


def publish_costs(num_requests: int = 2048, ops_per_step: int = 64, prompt_len: int = 2048) -> dict[str, float]:
    """Per request, microseconds: the engine's ops, the batch's msgpack encoding, the mirror's apply."""
    engine = KVCacheEngine(
        KVCacheManager(get_preset("llama-3-8b").kv_cache_config(NUM_BLOCKS), 131072, kv_events=KVEventsConfig())
    )
    mirror = CachedSetMirror(1, [None], [None])
    for i, tokens in enumerate(_prompts(NUM_BLOCKS * 16 // prompt_len, prompt_len, 5)):  # a full pool first
        engine.get_computed_blocks(f"w{i}", tokens)
        engine.allocate_slots(f"w{i}", prompt_len)
        engine.free(f"w{i}")
    mirror.apply(1, engine.take_events())
    seq = _prompts(num_requests, prompt_len, 4)
    ids = [f"s-{j}" for j in range(num_requests)]
    spent = {"engine": 0.0, "msgpack": 0.0, "mirror": 0.0}
    clock = time.perf_counter
    for n, (frees, admits) in enumerate(step_sequence(ops_per_step, num_requests), start=2):
        t0 = clock()
        for j in frees:
            engine.free(ids[j])
        for j in admits:
            engine.get_computed_blocks(ids[j], seq[j])
            engine.allocate_slots(ids[j], prompt_len)
        events = engine.take_events()
        t1 = clock()
        encode_event_batch(KVEventBatch(time.time(), events, None))
        t2 = clock()
        mirror.apply(n, events)
        t3 = clock()
        spent["engine"] += t1 - t0
        spent["msgpack"] += t2 - t1
        spent["mirror"] += t3 - t2
    return {f"{k}_us_per_request": v / num_requests * 1e6 for k, v in spent.items()}


def prompt_encoding_costs(ops_per_step: int = 64, prompt_len: int = 2048, repeat: int = 50) -> dict[str, float]:
    """Per Step of ``ops_per_step`` admissions, microseconds: serialize and parse, varint and packed."""
    out: dict[str, float] = {}
    for packed in (False, True):
        step = admission_steps(ops_per_step, ops_per_step, prompt_len, packed)[0]
        name = "packed" if packed else "varint"
        t = time.perf_counter()
        for _ in range(repeat):
            data = step.SerializeToString()
        out[f"{name}_serialize_us"] = (time.perf_counter() - t) / repeat * 1e6
        t = time.perf_counter()
        for _ in range(repeat):
            pb.StepRequest.FromString(data)
        out[f"{name}_parse_us"] = (time.perf_counter() - t) / repeat * 1e6
        out[f"{name}_bytes"] = len(data)
    return out


if __name__ == "__main__":
    print(json.dumps({**publish_costs(), **prompt_encoding_costs()}, indent=1))
