"""The longest time one call holds the server's event loop, in process (issue 15).

    python scripts/bench/loop_hold.py [--quick] [--json out.json]

Measured with the server's own handlers on its loop (no network, so the figure is the hold alone):

* a Step at ``max_step_tokens`` (default 262,144): 32 admissions of 8,192-token prompts
  (GetComputedBlocks + AllocateSlots each), block size 16 (``--step-tokens`` for another size);
* one 131,072-token prompt (GetComputedBlocks, then AllocateSlots), max_model_len 131,072;
* a snapshot of 1,048,576 cached blocks (16 tokens each) cut and encoded for a stream, part by part
  and in steps as StreamEvents does: the longest gap between two turns of a ticker task on the loop
  (wall clock), and the loop thread's CPU time between two turns (max and p99.9: what the server
  itself spent, without other processes' share of a loaded machine).

Each figure is the maximum over its rounds (a hold is a worst case), beside the time one GetUsage
takes on the same loop (the baseline), and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvservice.server.app import start_server  # noqa: E402
from kvservice.server.encoding import encoded_snapshot_part_in_steps  # noqa: E402
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb  # noqa: E402
from kvservice_client.events import BlockStored  # noqa: E402


class _Context:
    """The parts of a grpc.aio ServicerContext the unary handlers use."""

    def time_remaining(self) -> None:
        return None

    async def abort(self, code, message):  # pragma: no cover - a failed call is a bench bug
        raise RuntimeError(f"{code}: {message}")


def _prompt(r: int, n: int) -> list[int]:
    return list(range(r * n + 1, r * n + n + 1))


def _as_served() -> None:
    """What ``kvservice serve`` does after its start (``run_server``): freeze the start-time heap."""
    gc.collect()
    gc.freeze()


async def _timed(coro) -> float:
    t = time.perf_counter()
    await coro
    return time.perf_counter() - t


async def step_hold(rounds: int, num_requests: int, prompt_len: int) -> tuple[float, float]:
    running = await start_server(
        port=0,
        device="meta",
        preset="qwen-2.5-0.5b",
        block_size=16,
        num_blocks=num_requests * prompt_len // 16 + 16,
        max_model_len=prompt_len,
        grace_seconds=0,
    )
    _as_served()
    try:
        servicer, ctx = running.servicer, _Context()
        holds, usage = [], []
        for r in range(rounds):
            ops = []
            for i in range(num_requests):
                rid = f"r{r}-{i}"
                ops.append(
                    pb.StepOp(
                        get_computed_blocks=pb.GetComputedBlocksRequest(
                            request_id=rid, prompt_token_ids=_prompt(r * num_requests + i, prompt_len)
                        )
                    )
                )
                ops.append(pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=prompt_len)))
            request = pb.StepRequest.FromString(pb.StepRequest(ops=ops).SerializeToString())
            holds.append(await _timed(servicer.Step(request, ctx)))
            usage.append(await _timed(servicer.GetUsage(pb.GetUsageRequest(), ctx)))
            free = pb.StepRequest(
                ops=[pb.StepOp(free=pb.FreeRequest(request_id=f"r{r}-{i}")) for i in range(num_requests)]
            )
            await servicer.Step(free, ctx)
        return max(holds), statistics.median(usage)
    finally:
        await running.stop(0)


async def prompt_hold(rounds: int, prompt_len: int) -> tuple[float, float]:
    running = await start_server(
        port=0,
        device="meta",
        preset="qwen-2.5-0.5b",
        block_size=16,
        num_blocks=prompt_len // 16 + 16,
        max_model_len=prompt_len,
        grace_seconds=0,
    )
    _as_served()
    try:
        servicer, ctx = running.servicer, _Context()
        holds, usage = [], []
        for r in range(rounds):
            rid = f"long{r}"
            gcb = pb.GetComputedBlocksRequest(request_id=rid, prompt_token_ids=_prompt(r, prompt_len))
            holds.append(await _timed(servicer.GetComputedBlocks(gcb, ctx)))
            holds.append(
                await _timed(
                    servicer.AllocateSlots(pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=prompt_len), ctx)
                )
            )
            usage.append(await _timed(servicer.GetUsage(pb.GetUsageRequest(), ctx)))
            await servicer.Free(pb.FreeRequest(request_id=rid), ctx)
        return max(holds), statistics.median(usage)
    finally:
        await running.stop(0)


async def snapshot_hold(num_blocks: int, chain: int = 64) -> dict[str, float]:
    running = await start_server(
        port=0, device="meta", preset="qwen-2.5-0.5b", block_size=16, num_blocks=64, max_model_len=1024, grace_seconds=0
    )
    _as_served()
    try:
        log, source = running.event_log, running.snapshots
        for c in range(num_blocks // chain):  # the cached set as the mirror learns it: from batches
            hashes = [(c << 20) + i + 1 for i in range(chain)]
            source.on_batch(
                _Entry(
                    c + 1,
                    [
                        BlockStored(
                            block_hashes=hashes,
                            parent_block_hash=None,
                            token_ids=list(range(1000, 1000 + 16 * chain)),
                            block_size=16,
                            lora_id=None,
                            medium="CPU",
                            lora_name=None,
                            group_idx=0,
                            kv_cache_spec_kind="full_attention",
                        )
                    ],
                )
            )
        gaps: list[float] = []
        cpu_gaps: list[float] = []  # the loop thread's CPU time between turns: no other process's share
        done = False

        async def ticker() -> None:
            last, last_cpu = time.perf_counter(), time.thread_time()
            while not done:
                await asyncio.sleep(0)
                now, now_cpu = time.perf_counter(), time.thread_time()
                gaps.append(now - last)
                cpu_gaps.append(now_cpu - last_cpu)
                last, last_cpu = now, now_cpu

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        t = time.perf_counter()
        snap = await source.get()
        num_bytes = 0
        async for i, more in snap.iter_parts():
            num_bytes += len(
                await encoded_snapshot_part_in_steps(
                    snap,
                    i,
                    more=more,
                    payload_format=pb.PAYLOAD_FORMAT_PROTOBUF,
                    epoch=log.epoch,
                    data_parallel_rank=None,
                )
            )
            await asyncio.sleep(0)  # a stream's write
        total = time.perf_counter() - t
        done = True
        await task
        cpu_gaps.sort()
        return {
            "max_gap_s": max(gaps),
            "max_cpu_gap_s": cpu_gaps[-1],
            "p999_cpu_gap_s": cpu_gaps[int(0.999 * len(cpu_gaps))],
            "total_s": total,
            "num_parts": len(snap.parts),
            "num_bytes": num_bytes,
        }
    finally:
        await running.stop(0)


class _Entry:
    def __init__(self, seq: int, events: list) -> None:
        self.seq, self.events = seq, events


async def main(quick: bool, step_tokens: int = 1 << 18) -> list[dict]:
    rounds = 1 if quick else 3
    rows = []
    n = (16 * 8192 if quick else step_tokens) // 8192
    step_s, usage_s = await step_hold(rounds, n, 8192)
    rows.append(
        {
            "figure": f"Step of {n} x 8,192-token admissions ({n * 8192:,} tokens): loop held",
            "value_ms": step_s * 1e3,
            "baseline": "GetUsage",
            "baseline_ms": usage_s * 1e3,
        }
    )
    long_len = 16_384 if quick else 131_072
    prompt_s, usage_s = await prompt_hold(rounds, long_len)
    rows.append(
        {
            "figure": f"one {long_len:,}-token prompt (GetComputedBlocks or AllocateSlots): loop held",
            "value_ms": prompt_s * 1e3,
            "baseline": "GetUsage",
            "baseline_ms": usage_s * 1e3,
        }
    )
    num_blocks = 32_768 if quick else 1 << 20
    snap = await snapshot_hold(num_blocks)
    rows.append(
        {
            "figure": f"snapshot of {num_blocks:,} blocks cut + encoded: longest loop gap",
            "value_ms": snap["max_gap_s"] * 1e3,
            "baseline": "whole snapshot",
            "baseline_ms": snap["total_s"] * 1e3,
            "max_cpu_gap_ms": snap["max_cpu_gap_s"] * 1e3,
            "p999_cpu_gap_ms": snap["p999_cpu_gap_s"] * 1e3,
            "parts": snap["num_parts"],
            "bytes": snap["num_bytes"],
        }
    )
    for row in rows:
        row["ratio"] = row["value_ms"] / row["baseline_ms"] if row["baseline_ms"] else None
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--step-tokens", type=int, default=1 << 18)
    args = parser.parse_args()
    result = asyncio.run(main(args.quick, args.step_tokens))
    for row in result:
        cpu = (
            f"; loop thread CPU: max {row['max_cpu_gap_ms']:.1f} ms, p99.9 {row['p999_cpu_gap_ms']:.2f} ms"
            if "max_cpu_gap_ms" in row
            else ""
        )
        print(
            f"{row['figure']:<80} {row['value_ms']:>10.1f} ms   ({row['baseline']}: {row['baseline_ms']:.2f} ms{cpu})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
