"""Decode steps: one Step carrying every running request's one appended token, against a Ping.

A server process (``kvservice serve --device meta``) and this client process. ``num_running``
requests of ``prompt_len`` tokens are admitted first; then each decode step appends one token to
every running request and allocates its slot, either as one ``allocate_slots`` op per request
(``per_request``) or as one batched ``decode`` op (``decode``: packed arrays, answering only the
requests that got new blocks and the refusals). Each step is timed from building its request to
holding its unpacked answer, right after a Ping on the same channel, so both see the same moments
of a shared machine.
"""

from __future__ import annotations

import statistics
import time

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import KVCacheClient, StepBuilder, step_results

try:
    from server_proc import serve
    from workloads import prompts
except ImportError:
    from scripts.bench.server_proc import serve
    from scripts.bench.workloads import prompts

MODES = ("per_request", "decode")


def _admit(client: KVCacheClient, request_ids: list[str], prompt_len: int, seed: int) -> None:
    seqs = prompts(len(request_ids), prompt_len, 0.0, seed=seed)
    ops = StepBuilder()
    for rid, seq in zip(request_ids, seqs):
        ops.get_computed_blocks(rid, seq).allocate_slots(rid, prompt_len)
    for result in step_results(client.step(ops)):
        assert not isinstance(result, Exception), result


def _step_per_request(client: KVCacheClient, request_ids: list[str], tokens: list[int]) -> int:
    ops = StepBuilder()
    for rid, t in zip(request_ids, tokens):
        ops.allocate_slots(rid, 1, new_token_ids=(t,))
    changed = 0
    for result in step_results(client.step(ops)):
        assert isinstance(result, pb.AllocateSlotsResponse) and result.allocated, result
        changed += any(g.block_ids for g in result.new_block_ids)
    return changed


def _step_decode(client: KVCacheClient, request_ids: list[str], tokens: list[int]) -> int:
    result = step_results(client.step(StepBuilder().decode(request_ids, tokens)))[0]
    assert isinstance(result, pb.DecodeResponse) and not result.refused_indices and not result.error_indices, result
    return len(result.changed_indices)


def run(
    num_running: int = 256,
    num_steps: int = 100,
    *,
    modes: tuple[str, ...] = MODES,
    prompt_len: int = 512,
    num_blocks: int = 16384,
) -> dict[str, float]:
    """Per mode: p50 / p99 round trip of a decode step (us), the p50 Ping beside it (us), and the
    ratio of the p50s (``{mode}_step_p50_us``, ``{mode}_ping_p50_us``, ``{mode}_ratio``). The
    ``decode`` mode is left out when the client has no decode op."""
    out: dict[str, float] = {}
    # Code without the decode op (an older checkout measured with this harness) runs the rest.
    modes = tuple(m for m in modes if m != "decode" or hasattr(StepBuilder, "decode"))
    with serve("--device", "meta", "--num-blocks", str(num_blocks)) as address, KVCacheClient(address) as client:
        ping = pb.PingRequest()
        for _ in range(20):
            client.stub.Ping(ping)
        for m, mode in enumerate(modes):
            step = _step_per_request if mode == "per_request" else _step_decode
            request_ids = [f"d{m}-{i}" for i in range(num_running)]
            _admit(client, request_ids, prompt_len, seed=10 + m)
            pings, steps = [], []
            for s in range(num_steps + 5):
                tokens = [(s * 7919 + i) % 100256 for i in range(num_running)]
                t0 = time.perf_counter()
                client.stub.Ping(ping)
                t1 = time.perf_counter()
                step(client, request_ids, tokens)
                t2 = time.perf_counter()
                if s >= 5:  # warm-up steps
                    pings.append(t1 - t0)
                    steps.append(t2 - t1)
            frees = StepBuilder()
            for rid in request_ids:
                frees.free(rid)
            client.step(frees)
            steps.sort()
            p50, ping_p50 = statistics.median(steps), statistics.median(pings)
            out[f"{mode}_step_p50_us"] = p50 * 1e6
            out[f"{mode}_step_p99_us"] = steps[int(0.99 * (len(steps) - 1))] * 1e6
            out[f"{mode}_ping_p50_us"] = ping_p50 * 1e6
            out[f"{mode}_ratio"] = p50 / ping_p50
    return out


if __name__ == "__main__":
    import json
    import sys

    modes = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else MODES
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print(json.dumps(run(n, modes=modes), indent=1))
