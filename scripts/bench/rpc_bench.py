"""RPC: unary round trips against a no-op RPC (Ping) on the same server, and Step batches against
the in-process engine running the same op sequence (:func:`in_process_step_rate`; the older
one-request-at-a-time rate, :func:`in_process_rate`, is kept beside it), with the server process's
CPU per request against the engine's.

The server runs in its own process (``kvservice serve --device meta``), so client and server each
have a core, as in a deployment; the baselines are measured in the same run.
"""

from __future__ import annotations

import functools
import os
import time
from array import array

from kvservice.core.engine import KVCacheEngine
from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.model_config import get_preset
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVCacheClient
from kvservice_client.request_builders import pack_token_ids

try:
    from server_proc import serve
    from workloads import prompts
except ImportError:
    from scripts.bench.server_proc import serve
    from scripts.bench.workloads import prompts

NUM_BLOCKS = 8192


@functools.lru_cache(maxsize=4)
def _prompts(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    """:func:`prompts` without shared prefixes, made once per run (the served and the in-process
    runs admit the same prompts; the engine copies what it keeps)."""
    return prompts(num_requests, prompt_len, 0.0, seed=seed)


def unary(client: KVCacheClient, n: int, prompt_len: int = 256) -> dict[str, float]:
    """Mean round trip (us) of Ping and of GetComputedBlocks / AllocateSlots / Free of one request."""
    payload = b""
    seq = prompts(n, prompt_len, 0.5, seed=2)
    requests = [pb.GetComputedBlocksRequest(request_id=f"u{i}", prompt_token_ids=seq[i]) for i in range(n)]
    allocs = [pb.AllocateSlotsRequest(request_id=f"u{i}", num_new_tokens=prompt_len) for i in range(n)]
    frees = [pb.FreeRequest(request_id=f"u{i}") for i in range(n)]
    stub = client.stub
    for i in range(50):  # warm up the connection and the server's first-use tables
        stub.Ping(pb.PingRequest(payload=payload))
        stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id=f"w{i}", prompt_token_ids=seq[i]))
        stub.Free(pb.FreeRequest(request_id=f"w{i}"))
    # Pings interleaved with the ops, so both see the same machine at the same moments.
    ping = gcb = alloc = free = 0.0
    ping_request = pb.PingRequest(payload=payload)
    for i in range(n):
        t0 = time.perf_counter()
        stub.Ping(ping_request)
        t1 = time.perf_counter()
        stub.GetComputedBlocks(requests[i])
        t2 = time.perf_counter()
        stub.Ping(ping_request)
        t3 = time.perf_counter()
        stub.AllocateSlots(allocs[i])
        t4 = time.perf_counter()
        stub.Ping(ping_request)
        t5 = time.perf_counter()
        stub.Free(frees[i])
        t6 = time.perf_counter()
        ping += (t1 - t0) + (t3 - t2) + (t5 - t4)
        gcb, alloc, free = gcb + t2 - t1, alloc + t4 - t3, free + t6 - t5
    out = {"ping_us": ping / (3 * n) * 1e6}
    out.update(
        {"get_computed_blocks_us": gcb / n * 1e6, "allocate_slots_us": alloc / n * 1e6, "free_us": free / n * 1e6}
    )
    return out


def in_process_rate(num_requests: int, prompt_len: int = 2048) -> float:
    """Requests admitted per second by the engine itself (lookup + allocate + free), no gRPC."""
    engine = KVCacheEngine(
        KVCacheManager(get_preset("llama-3-8b").kv_cache_config(NUM_BLOCKS), 131072, kv_events=KVEventsConfig())
    )
    seq = prompts(num_requests, prompt_len, 0.0, seed=3)
    start = time.perf_counter()
    for i, tokens in enumerate(seq):
        engine.get_computed_blocks(f"p{i}", tokens)
        engine.allocate_slots(f"p{i}", prompt_len)
        engine.free(f"p{i}")
        engine.take_events()
    return num_requests / (time.perf_counter() - start)


def step_sequence(ops_per_step: int, num_requests: int) -> list[tuple[range, range]]:
    """The op sequence of :func:`step_rate` (and of :func:`in_process_step_rate`): per step, the
    requests it frees (the previous step's) and the requests it admits."""
    return [
        (range(max(lo - ops_per_step, 0), lo), range(lo, min(lo + ops_per_step, num_requests)))
        for lo in range(0, num_requests, ops_per_step)
    ]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process_step_rate(ops_per_step: int, num_requests: int, prompt_len: int = 2048) -> tuple[float, float]:
    """Requests admitted per second by the engine itself running the same op sequence as a served
    Step of ``ops_per_step`` admissions (:func:`step_rate`): each step frees the previous step's
    requests, then looks up and allocates its own, then takes the events (a served Step publishes
    once). Events on, the same hashing as the server's default; no gRPC, protobuf, event log or
    snapshot mirror. The pool is filled first, so evictions start at once, as on the bench's
    server, which has served the other rows before.

    Returns:
        (requests/s, CPU seconds of this process per request).
    """
    engine = KVCacheEngine(
        KVCacheManager(get_preset("llama-3-8b").kv_cache_config(NUM_BLOCKS), 131072, kv_events=KVEventsConfig())
    )
    warm = _prompts(NUM_BLOCKS * 16 // prompt_len, prompt_len, 5)
    for i, tokens in enumerate(warm):
        engine.get_computed_blocks(f"w{i}", tokens)
        engine.allocate_slots(f"w{i}", prompt_len)
        engine.free(f"w{i}")
    engine.take_events()
    seq = _prompts(num_requests, prompt_len, 4)
    ids = [f"s{ops_per_step}-{j}" for j in range(num_requests)]
    start, cpu = time.perf_counter(), time.process_time()
    for frees, admits in step_sequence(ops_per_step, num_requests):
        for j in frees:
            engine.free(ids[j])
        for j in admits:
            engine.get_computed_blocks(ids[j], seq[j])
            engine.allocate_slots(ids[j], prompt_len)
        engine.take_events()
    return num_requests / (time.perf_counter() - start), (time.process_time() - cpu) / num_requests


def admission_steps(
    ops_per_step: int, num_requests: int, prompt_len: int = 2048, packed: bool = False, tag: str = "s"
) -> list[pb.StepRequest]:
    """The Steps of :func:`step_rate`: each ``ops_per_step`` admissions (lookup + allocate) of fresh
    prompts after the frees of the previous Step's requests; with ``packed``, each prompt as
    ``packed_prompt_token_ids`` (little-endian int32, as the client sends an ``array('i')``), else
    as ``prompt_token_ids`` (varints, as it sends a list)."""
    seq = _prompts(num_requests, prompt_len, 4)
    steps = []
    for lo in range(0, num_requests, ops_per_step):
        ops = [pb.StepOp(free=pb.FreeRequest(request_id=f"{tag}-{j}")) for j in range(lo - ops_per_step, lo) if j >= 0]
        for j in range(lo, min(lo + ops_per_step, num_requests)):
            rid = f"{tag}-{j}"
            if packed:
                lookup = pb.GetComputedBlocksRequest(
                    request_id=rid, packed_prompt_token_ids=pack_token_ids(array("i", seq[j]))
                )
            else:
                lookup = pb.GetComputedBlocksRequest(request_id=rid, prompt_token_ids=seq[j])
            ops.append(pb.StepOp(get_computed_blocks=lookup))
            ops.append(pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=prompt_len)))
        steps.append(pb.StepRequest(ops=ops))
    return steps


def step_rate(
    client: KVCacheClient, ops_per_step: int, num_requests: int, prompt_len: int = 2048, packed: bool = False
) -> float:
    """Requests admitted per second over :func:`admission_steps` (built before the clock starts:
    a list or an array, converted once)."""
    tag = f"s{ops_per_step}{'p' if packed else ''}"
    steps = admission_steps(ops_per_step, num_requests, prompt_len, packed, tag)
    start = time.perf_counter()
    for step in steps:
        response = client.step(step)
        assert all(r.WhichOneof("result") != "error" for r in response.results), response
    elapsed = time.perf_counter() - start
    last = [
        pb.StepOp(free=pb.FreeRequest(request_id=f"{tag}-{j}"))
        for j in range(num_requests - (num_requests % ops_per_step or ops_per_step), num_requests)
    ]
    client.step(pb.StepRequest(ops=last))
    return num_requests / elapsed


def served_step_rate(ops_per_step: int, num_requests: int, prompt_len: int, num_blocks: int) -> float:
    """:func:`step_rate` against a fresh server of ``num_blocks`` blocks."""
    with (
        serve("--device", "meta", "--num-blocks", str(num_blocks), "--max-step-tokens", str(1 << 20)) as address,
        KVCacheClient(address) as client,
    ):
        return step_rate(client, ops_per_step, num_requests, prompt_len)


def run(quick: bool = False) -> dict[str, float]:
    n_unary = 200 if quick else 2000
    n_step = 128 if quick else 1024
    out: dict[str, float] = {}
    before = in_process_rate(n_step // 2)
    same_before = {k: in_process_step_rate(k, max(n_step, k) if k > 1 else n_step // 4) for k in (1, 16, 64, 256)}
    # Steps of 256 admissions of 2,048 tokens: above the default max_step_tokens (262,144).
    with (
        serve(
            "--device", "meta", "--num-blocks", str(NUM_BLOCKS), "--max-step-tokens", str(1 << 20), with_pid=True
        ) as (address, pid),
        KVCacheClient(address) as client,
    ):
        out.update(unary(client, n_unary))
        for k in (1, 16, 64, 256):
            n = max(n_step, k) if k > 1 else n_step // 4
            cpu = process_cpu_s(pid)
            out[f"step_{k}_requests_per_s"] = step_rate(client, k, n)
            # The server's CPU per request (a shared machine slows the wall clock of two processes
            # handing off far more than one process's CPU time).
            out[f"step_{k}_server_cpu_us"] = (process_cpu_s(pid) - cpu) / n * 1e6
            if k == 64:  # the same Steps with packed prompts (what the replay and an array-holding scheduler send)
                cpu = process_cpu_s(pid)
                out["step_64_packed_requests_per_s"] = step_rate(client, k, n, packed=True)
                out["step_64_packed_server_cpu_us"] = (process_cpu_s(pid) - cpu) / n * 1e6
    # The baseline before and after the served runs, so a machine that slows down moves both.
    out["in_process_requests_per_s"] = (before + in_process_rate(n_step // 2)) / 2
    for k, (rate, cpu_s) in same_before.items():
        after, after_cpu_s = in_process_step_rate(k, max(n_step, k) if k > 1 else n_step // 4)
        out[f"in_process_step_{k}_requests_per_s"] = (rate + after) / 2
        out[f"in_process_step_{k}_cpu_us"] = (cpu_s + after_cpu_s) / 2 * 1e6
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
