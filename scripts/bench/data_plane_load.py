#!/usr/bin/env python3
"""A scheduler beside heavy data-plane traffic: its GetUsage and Step latency, and the server's memory.

    python scripts/bench/data_plane_load.py [--streams 16] [--mib 64] [--idle-calls 400]

One server process (``kvservice serve --device cpu --preset qwen-2.5-0.5b``, blocks of 16 tokens,
196,608 bytes a block), a scheduler in this process (a blocking client calling ``GetUsage`` and a
small ``Step`` in turn: ``allocate_slots`` of one token for each of 8 running requests, freed and
admitted again when full), and a load process (an asyncio client) opening ``--streams``
``WriteBlocks`` and ``--streams`` ``ReadBlocks`` streams at once, each moving ``--mib`` MiB (the
writes into blocks allocated to one running request per stream, the reads by block id of as many
other blocks, written before anything is measured: a read of a block nobody wrote is refused).

The scheduler first makes ``--idle-calls`` calls of each kind with nothing else running (the idle
p99), then calls for as long as the load process runs (the loaded p99). The server's anonymous
resident memory (``RssAnon`` of /proc/PID/status; the KV memory itself is shared memory, not
counted there) is read every 5 ms during the load: its peak against the value just before it.

Targets (issue 24): loaded p99 within 3x of idle for both calls; RssAnon peak within 160 MiB of
before. ``--cpu-control S`` adds a control phase before the load: S seconds of one spinning
process per CPU and no data plane (the scheduler's p99 on a machine that is merely busy, the
floor no server change can go under; at the load process's priority, so ``--load-priority idle``
spins under ``SCHED_IDLE`` too). ``--bare-control`` adds another: the same streams, messages and
bytes between the load process and a bare gRPC server process that only counts and sends bytes
(``bare_data_stream.py``, no kvservice in the path), while the scheduler calls kvservice as before:
the p99 that moving these bytes on this machine at all gives the scheduler, whatever serves them.
``--load-priority idle`` runs the load process under
``SCHED_IDLE``: its own CPU (the client side of 32 streams: protobuf, checksums, gRPC) then comes
only from what the server and the scheduler leave, as with clients on other hosts, so the row
measures what the server's data plane costs its scheduler rather than what a co-located load
client does. The server's copy threads' priority is the server's ``--data-worker-priority``
(``--server-flag=--data-worker-priority=nice``). Prints one JSON line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_plane_bench import PeakSampler, rss_anon_bytes  # noqa: E402 (the same sampler as the data-plane bench)
from server_proc import serve  # noqa: E402

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb  # noqa: E402
from kvservice_client.client import KVCacheClient, StepBuilder, step_results  # noqa: E402

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 24 * 2 * BLOCK_SIZE * 2 * 64 * 2  # qwen-2.5-0.5b: 196,608 bytes
SCHEDULER_REQUESTS = 8
SCHEDULER_PROMPT = 4 * BLOCK_SIZE
SCHEDULER_MAX_TOKENS = 32 * BLOCK_SIZE


# -- the load process -------------------------------------------------------------------------------


async def _bare_load(address: str, plan: dict) -> dict:
    """``plan``'s streams against the bare server: as many uploads and downloads, as many messages
    of ``BYTES_PER_BLOCK``; answer bytes moved and seconds."""
    import grpc

    payload = bytes(range(256)) * (BYTES_PER_BLOCK // 256)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        upload = channel.stream_unary("/bare.Data/Upload")
        download = channel.unary_stream("/bare.Data/Download")

        async def write(num_messages: int) -> int:
            answer = await upload(iter([payload] * num_messages), timeout=600)
            return int.from_bytes(answer, "big")

        async def read() -> int:
            return sum([len(m) async for m in download(b"", timeout=600)])

        t0 = time.perf_counter()
        moved = await asyncio.gather(
            *(write(len(ids)) for _rid, ids in plan["writes"]), *(read() for _ in plan["reads"])
        )
        return {"bytes": sum(moved), "seconds": time.perf_counter() - t0}


async def _load(address: str, plan: dict) -> dict:
    """Open every stream of ``plan`` at once; answer bytes moved and seconds."""
    import grpc

    from kvservice_client._proto.kvservice.v1.kv_cache_service_pb2_grpc import KVCacheServiceStub
    from kvservice_client.data import block_checksum

    payload = bytes(range(256)) * (BYTES_PER_BLOCK // 256)
    checksum = block_checksum(payload)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = KVCacheServiceStub(channel)

        def chunks(request_id: str, block_ids: list[int]):
            for block_id in block_ids:
                yield pb.WriteBlocksChunk(
                    request_id=request_id, group_idx=0, block_id=block_id, data=payload, checksum=checksum
                )

        async def write(request_id: str, block_ids: list[int]) -> int:
            response = await stub.WriteBlocks(chunks(request_id, block_ids), timeout=600)
            return int(response.num_bytes_written)

        async def read(block_ids: list[int]) -> int:
            request = pb.ReadBlocksRequest(blocks=[pb.BlockRef(group_idx=0, block_id=b) for b in block_ids])
            n = 0
            async for chunk in stub.ReadBlocks(request, timeout=600):
                n += len(chunk.data)
            return n

        t0 = time.perf_counter()
        moved = await asyncio.gather(
            *(write(rid, ids) for rid, ids in plan["writes"]), *(read(ids) for ids in plan["reads"])
        )
        return {"bytes": sum(moved), "seconds": time.perf_counter() - t0}


def load_main(address: str, bare: bool = False) -> int:
    plan = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run((_bare_load if bare else _load)(address, plan))), flush=True)
    return 0


# -- the scheduler --------------------------------------------------------------------------------


class Scheduler:
    """8 running requests; a Step allocates one token for each (freed and admitted again when full)."""

    def __init__(self, client: KVCacheClient) -> None:
        self.client = client
        self.generation = 0
        self.tokens = 0
        self._admit()

    def _ids(self) -> list[str]:
        return [f"s{self.generation}-{i}" for i in range(SCHEDULER_REQUESTS)]

    def _admit(self) -> None:
        ops = StepBuilder()
        for i, rid in enumerate(self._ids()):
            prompt = [(self.generation * 131 + i * 17 + t) % 30000 + 1 for t in range(SCHEDULER_PROMPT)]
            ops.get_computed_blocks(rid, prompt).allocate_slots(rid, SCHEDULER_PROMPT)
        for result in step_results(self.client.step(ops)):
            assert not isinstance(result, Exception), result
        self.tokens = SCHEDULER_PROMPT

    def step(self) -> float:
        """One Step (timed, seconds); frees and admits the next generation when the requests are full."""
        if self.tokens >= SCHEDULER_MAX_TOKENS:
            ops = StepBuilder()
            for rid in self._ids():
                ops.free(rid)
            self.client.step(ops)
            self.generation += 1
            self._admit()
        ops = StepBuilder()
        for rid in self._ids():
            ops.allocate_slots(rid, 1, new_token_ids=(self.tokens % 30000 + 1,))
        t0 = time.perf_counter()
        results = step_results(self.client.step(ops))
        elapsed = time.perf_counter() - t0
        assert all(isinstance(r, pb.AllocateSlotsResponse) and r.allocated for r in results), results
        self.tokens += 1
        return elapsed

    def get_usage(self) -> float:
        t0 = time.perf_counter()
        self.client.get_usage()
        return time.perf_counter() - t0


def _run_load(address: str, plan: dict) -> dict:
    """Run ``plan`` in a load process and wait for it (the untimed pre-write)."""
    done = subprocess.run(
        [sys.executable, __file__, "--load-worker", address],
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def _idle_policy() -> None:
    """The load process's policy: ``SCHED_IDLE`` (in the child, before exec; its threads inherit it)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def run_once(args: argparse.Namespace) -> dict:
    blocks_per_stream = -(-(args.mib << 20) // BYTES_PER_BLOCK)
    scheduler_blocks = 2 * SCHEDULER_REQUESTS * (SCHEDULER_MAX_TOKENS // BLOCK_SIZE + 1)
    pool = 2 * args.streams * blocks_per_stream + scheduler_blocks + 2
    flags = ["--device", "cpu", "--preset", "qwen-2.5-0.5b", "--num-blocks", str(pool), *args.server_flag]
    with serve(*flags, with_pid=True) as (address, pid):
        client = KVCacheClient(address, timeout=600.0)

        def allocate(prefix: str, seed: int) -> list[tuple[str, list[int]]]:
            streams = []
            for i in range(args.streams):
                rid = f"{prefix}{i}"
                prompt = [(seed + i * 7919 + t) % 30000 + 1 for t in range(blocks_per_stream * BLOCK_SIZE)]
                client.get_computed_blocks(rid, prompt)
                response = client.allocate_slots(rid, len(prompt))
                assert response.allocated
                streams.append((rid, list(response.new_block_ids[0].block_ids)))
            return streams

        writes = allocate("w", 0)
        # A read by id of a block nobody wrote is refused (the byte state), so the reads take blocks
        # of their own, written before anything is measured.
        prewritten = allocate("r", 15013)
        prewrite = _run_load(address, {"writes": prewritten, "reads": []})
        assert prewrite["bytes"] == args.streams * blocks_per_stream * BYTES_PER_BLOCK, prewrite
        reads = [ids for _rid, ids in prewritten]
        scheduler = Scheduler(client)
        for _ in range(50):  # warm the channel and the handlers
            scheduler.get_usage()
            scheduler.step()
        idle_usage, idle_step = [], []
        for _ in range(args.idle_calls):
            idle_usage.append(scheduler.get_usage())
            idle_step.append(scheduler.step())
        control: dict = {}
        priority = _idle_policy if args.load_priority == "idle" else None
        if args.cpu_control:
            # The machine alone: as many processes spinning as there are CPUs (at the load's
            # priority), no data plane.
            spin = f"import time\nend = time.monotonic() + {args.cpu_control}\nwhile time.monotonic() < end: pass"
            spinners = [
                subprocess.Popen([sys.executable, "-c", spin], preexec_fn=priority) for _ in range(os.cpu_count() or 1)
            ]
            cpu_usage, cpu_step = [], []
            while any(p.poll() is None for p in spinners):
                cpu_usage.append(scheduler.get_usage())
                cpu_step.append(scheduler.step())
            control = {"get_usage_p99_cpu_bound_ms": p99(cpu_usage) * 1e3, "step_p99_cpu_bound_ms": p99(cpu_step) * 1e3}
        if args.bare_control:
            # The same bytes through a server that is not kvservice: the scheduler's p99 beside them.
            bare = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("bare_data_stream.py")),
                    str(BYTES_PER_BLOCK),
                    str(blocks_per_stream),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert bare.stdout is not None
            bare_address = bare.stdout.readline().split()[-1]
            load = subprocess.Popen(
                [sys.executable, __file__, "--load-worker", bare_address, "--bare"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=priority,
            )
            assert load.stdin is not None and load.stdout is not None
            load.stdin.write(json.dumps({"writes": writes, "reads": reads}))
            load.stdin.close()
            bare_usage, bare_step = [], []
            while load.poll() is None:
                bare_usage.append(scheduler.get_usage())
                bare_step.append(scheduler.step())
            moved = json.loads(load.stdout.read())
            bare.terminate()
            bare.wait(30)
            assert load.returncode == 0 and moved["bytes"] == 2 * args.streams * blocks_per_stream * BYTES_PER_BLOCK, (
                moved
            )
            control |= {
                "get_usage_p99_bare_ms": p99(bare_usage) * 1e3,
                "step_p99_bare_ms": p99(bare_step) * 1e3,
                "bare_seconds": round(moved["seconds"], 2),
            }
        before = rss_anon_bytes(pid)
        load = subprocess.Popen(
            [sys.executable, __file__, "--load-worker", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=priority,
        )
        assert load.stdin is not None and load.stdout is not None
        load_usage, load_step = [], []
        with PeakSampler(pid) as sampler:
            load.stdin.write(json.dumps({"writes": writes, "reads": reads}))
            load.stdin.close()
            while load.poll() is None:
                load_usage.append(scheduler.get_usage())
                load_step.append(scheduler.step())
        result = json.loads(load.stdout.read())
        assert load.returncode == 0
        expected = 2 * args.streams * blocks_per_stream * BYTES_PER_BLOCK
        assert result["bytes"] == expected, (result, expected)
        client.close()
        return {
            "streams": f"{args.streams} WriteBlocks + {args.streams} ReadBlocks of {args.mib} MiB",
            "server_flags": args.server_flag,
            "load_priority": args.load_priority,
            "idle_calls": args.idle_calls,
            "loaded_calls": len(load_usage),
            "load_seconds": round(result["seconds"], 2),
            "get_usage_p99_idle_ms": p99(idle_usage) * 1e3,
            "get_usage_p99_loaded_ms": p99(load_usage) * 1e3,
            "step_p99_idle_ms": p99(idle_step) * 1e3,
            "step_p99_loaded_ms": p99(load_step) * 1e3,
            "rss_anon_before_mib": before / 2**20,
            "rss_anon_peak_growth_mib": (sampler.peak - before) / 2**20,
            **control,
        }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--load-worker"]:
        return load_main(argv[1], bare=argv[2:] == ["--bare"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16, help="WriteBlocks streams, and as many ReadBlocks [16]")
    parser.add_argument("--mib", type=int, default=64, help="MiB each stream moves [64]")
    parser.add_argument("--idle-calls", type=int, default=400, help="idle calls of each kind [400]")
    parser.add_argument("--runs", type=int, default=1, help="runs, each with its own server [1]")
    parser.add_argument(
        "--cpu-control",
        type=float,
        default=0.0,
        help="seconds of a control phase before the load: one spinning process per CPU, no data plane [0: none]",
    )
    parser.add_argument(
        "--bare-control",
        action="store_true",
        help="a control phase: the same streams against a bare gRPC bytes server, not kvservice",
    )
    parser.add_argument("--server-flag", action="append", default=[], help="passed to kvservice serve (repeat)")
    parser.add_argument(
        "--load-priority",
        choices=("normal", "idle"),
        default="normal",
        help="the load process's CPU priority: normal, or idle (SCHED_IDLE: clients as if on other hosts) [normal]",
    )
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.runs):
        row = run_once(args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print()
    print(
        "| run | GetUsage p99 idle / loaded (ms) | ratio | Step p99 idle / loaded (ms) | ratio | RssAnon growth (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        u = r["get_usage_p99_loaded_ms"] / r["get_usage_p99_idle_ms"]
        s = r["step_p99_loaded_ms"] / r["step_p99_idle_ms"]
        print(
            f"| {i} | {r['get_usage_p99_idle_ms']:.2f} / {r['get_usage_p99_loaded_ms']:.2f} | {u:.1f}x "
            f"(target <= 3x) | {r['step_p99_idle_ms']:.2f} / {r['step_p99_loaded_ms']:.2f} | {s:.1f}x (target <= 3x) "
            f"| {r['rss_anon_peak_growth_mib']:.0f} (target <= 160) |"
        )
    if any("get_usage_p99_bare_ms" in r for r in rows):
        print()
        print(
            "| run | GetUsage p99 idle / bare bytes / loaded (ms) | Step p99 idle / bare bytes / loaded (ms) | loaded / bare |"
        )
        print("|---|---|---|---|")
        for i, r in enumerate(rows, 1):
            print(
                f"| {i} | {r['get_usage_p99_idle_ms']:.2f} / {r['get_usage_p99_bare_ms']:.2f} / "
                f"{r['get_usage_p99_loaded_ms']:.2f} | {r['step_p99_idle_ms']:.2f} / {r['step_p99_bare_ms']:.2f} / "
                f"{r['step_p99_loaded_ms']:.2f} | {r['get_usage_p99_loaded_ms'] / r['get_usage_p99_bare_ms']:.2f}x, "
                f"{r['step_p99_loaded_ms'] / r['step_p99_bare_ms']:.2f}x |"
            )
    if any("get_usage_p99_cpu_bound_ms" in r for r in rows):
        print()
        print("| run | GetUsage p99 idle / CPUs busy / loaded (ms) | Step p99 idle / CPUs busy / loaded (ms) |")
        print("|---|---|---|")
        for i, r in enumerate(rows, 1):
            print(
                f"| {i} | {r['get_usage_p99_idle_ms']:.2f} / {r['get_usage_p99_cpu_bound_ms']:.2f} / "
                f"{r['get_usage_p99_loaded_ms']:.2f} | {r['step_p99_idle_ms']:.2f} / {r['step_p99_cpu_bound_ms']:.2f} / "
                f"{r['step_p99_loaded_ms']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
