#!/usr/bin/env python3
"""The vLLM tier's costs (``kvservice_vllm.tier_client.TierClient``, what ``KVServiceTier``'s
threads call), each beside a baseline measured in the same run:

    .venv/bin/python scripts/bench/tier_bench.py [--chunk-bytes 1048576] [--num-chunks 256] [--rounds 3]

Rows:

- a ``LookupBlocks`` of 64 keys (half present), one round trip, against a ``Ping`` (the round trip
  itself): median latency of ``--calls`` calls each, alternating; target <= 1.5x.
- a store of ``--num-chunks`` chunks through shared memory (``ReserveBlocks``, a ``memcpy`` per
  chunk into the server's block, ``CommitBlocks``; 64 keys per call, as vLLM's cascade jobs of a
  long prompt are; fresh keys every round, so each round's stores evict the last round's) and a
  load of them (``LeaseBlocks``, a ``memcpy`` out, ``ReleaseLease``), against a plain torch copy of
  the same bytes row by row between two local tensors; target >= 0.8x.
- the same store and load through ``KVServiceTier`` itself, as vLLM's offloading manager drives
  it: the chunks in vLLM's own CPU primary tier (``tier_helpers.Instance``: vLLM 0.33's
  ``TieringOffloadingSpec`` with the kvservice tier), submitted as store (then load) jobs of
  ``--job-keys`` keys all at once (64; a step's job for a 2,048-token prefill chunk of 16-token
  chunks is 128), timed until every job has reported success; the tier's job threads overlap one
  job's round trips with another's copy. Against the same torch copy; target >= 0.8x. (The rows
  above time ``TierClient`` calls one after the other: each pays its round trips in full.)
- the same store and load across gRPC (``PutBlocks``, ``ReadBlocks`` by hash) against a bare gRPC
  client / server stream of the same bytes in messages of the same size (``bare_data_stream.py``:
  no parsing, no copy into memory); target >= 0.5x.

The server is a ``kvservice serve --device cpu --kv-cache-layout opaque:CHUNK_BYTES`` child
process; the bare server another. Each ratio is the median of the per-round ratios (ours and the
baseline back to back). ``torch.set_num_threads(1)`` on both sides (per-chunk copies; OpenMP's
barriers on a loaded 2-core machine would swamp them). ``--socket unix`` reaches the server over
a Unix socket (``kvservice serve --uds``; the tier's ``target: unix:PATH``), as a tier on the
server's host would: a shared-memory call is its copies plus two round trips, and a round trip
over a Unix socket costs less than over loopback TCP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "vllm" / "tests"))
import numpy as np  # noqa: E402
from data_plane_bench import BareServer  # noqa: E402
from server_proc import serve  # noqa: E402
from tier_helpers import Instance, chunk_key  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvservice_vllm.tier_client import TierClient  # noqa: E402

KEYS_PER_CALL = 64


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def median_latency(fn: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per chunk [1 MiB]")
    parser.add_argument("--num-chunks", type=int, default=256, help="chunks moved per round [256]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300, help="calls per latency sample [300]")
    parser.add_argument("--job-keys", type=int, default=KEYS_PER_CALL, help="keys per KVServiceTier job [64]")
    parser.add_argument(
        "--socket",
        choices=("tcp", "unix"),
        default="tcp",
        help="how the tier reaches the server: its TCP port, or a Unix socket (--uds; same host) [tcp]",
    )
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="passed to kvservice serve, e.g. --server-flag=--stream-window-bytes=64KiB (repeat)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, size = args.num_chunks, args.chunk_bytes
    rows_src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    rows_dst = torch.zeros((n, size), dtype=torch.uint8)
    chunk_ids = list(range(n))
    out = []
    flags = ("--device", "cpu", "--kv-cache-layout", f"opaque:{size}", "--block-size", "16")
    uds = os.path.join(tempfile.mkdtemp(prefix="kvservice-tier-bench-"), "kv.sock") if args.socket == "unix" else None
    with serve(
        *flags,
        "--num-blocks",
        str(n + 1),
        "--data-chunk-bytes",
        str(1 << 20),
        *(("--uds", uds) if uds else ()),
        *args.server_flag,
    ) as address:
        address = f"unix:{uds}" if uds else address
        shm = TierClient(address, chunk_bytes=size, transport="shm", timeout_s=600)
        shm.connect()
        grpc_ = TierClient(address, chunk_bytes=size, transport="grpc", timeout_s=600)
        grpc_.connect()

        # -- lookup of 64 keys against Ping --
        present = keys_of("lookup", 32)
        shm.store(0, present, [], rows_src, chunk_ids[:32])
        probe = [(0, h) for pair in zip(present, keys_of("absent", 32)) for h in pair]
        ping = shm.client.ping
        lookups, pings = [], []
        for _ in range(args.rounds):
            lookups.append(median_latency(lambda: shm.lookup(probe), args.calls))
            pings.append(median_latency(ping, args.calls))
        assert shm.lookup(probe) == [True, False] * 32
        out.append(
            (
                "LookupBlocks of 64 keys, median latency ms",
                statistics.median(lookups) * 1e3,
                "Ping",
                statistics.median(pings) * 1e3,
                statistics.median(a / b for a, b in zip(lookups, pings)),
                "<= 1.5x",
            )
        )

        def store(client: TierClient, keys: list[bytes]) -> float:
            t0 = time.perf_counter()
            for start in range(0, n, KEYS_PER_CALL):
                part = keys[start : start + KEYS_PER_CALL]
                result = client.store(0, part, [], rows_src, chunk_ids[start : start + KEYS_PER_CALL])
                assert all(result.written), "a store was refused"
            client.flush()  # the last call's commit (shared memory) answered: counted in the time
            return n * size / (time.perf_counter() - t0) / 1e9

        def load(client: TierClient, keys: list[bytes]) -> float:
            t0 = time.perf_counter()
            for start in range(0, n, KEYS_PER_CALL):
                part = keys[start : start + KEYS_PER_CALL]
                result = client.load(0, part, rows_dst, chunk_ids[start : start + KEYS_PER_CALL])
                assert all(result.loaded), "a load missed"
            client.flush()  # the last call's release answered: counted in the time
            return n * size / (time.perf_counter() - t0) / 1e9

        def memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
            t0 = time.perf_counter()
            for i in range(n):
                dst[i].copy_(src[i])
            return n * size / (time.perf_counter() - t0) / 1e9

        local = torch.zeros((n, size), dtype=torch.uint8)
        rates: dict[str, list[float]] = {k: [] for k in ("shm_store", "shm_load", "copy_in", "copy_out")}
        for r in range(args.rounds):
            keys = keys_of(f"shm-{r}", n)
            rates["shm_store"].append(store(shm, keys))
            rates["copy_in"].append(memcpy(rows_src, local))
            rows_dst.zero_()
            rates["shm_load"].append(load(shm, keys))
            rates["copy_out"].append(memcpy(local, rows_dst))
            assert torch.equal(rows_dst, rows_src), "a load did not reproduce the stored bytes"
        for ours, base, what in (("shm_store", "copy_in", "store"), ("shm_load", "copy_out", "load")):
            out.append(
                (
                    f"{what} of {n} chunks of {size >> 10} KiB through shared memory, GB/s",
                    statistics.median(rates[ours]),
                    "torch copy of the same rows between local tensors",
                    statistics.median(rates[base]),
                    statistics.median(a / b for a, b in zip(rates[ours], rates[base])),
                    ">= 0.8x",
                )
            )

        # -- the same through KVServiceTier: jobs of 64 keys, all submitted at once --
        instance = Instance(address, num_chunks=n, chunk_bytes=size, transport="shm")
        tier, primary = instance.tier, instance.rows
        job_ids = iter(range(1, 1 << 30))

        def run_jobs(keys: list, promote: bool) -> float:
            ctx = ReqContext(req_id=f"bench-{promote}")
            submit = tier.submit_load if promote else tier.submit_store
            t0 = time.perf_counter()
            for start in range(0, n, args.job_keys):
                end = min(n, start + args.job_keys)
                submit(TransferJob(next(job_ids), keys[start:end], np.arange(start, end), promote, ctx))
            tier.drain_jobs()
            elapsed = time.perf_counter() - t0
            results = list(tier.get_finished_jobs())
            assert len(results) == -(-n // args.job_keys) and all(r.success for r in results), results
            return n * size / elapsed / 1e9

        jrates: dict[str, list[float]] = {k: [] for k in ("store", "load", "copy_in", "copy_out")}
        for r in range(args.rounds):
            keys = [chunk_key(f"jobs-{r}/{i}") for i in range(n)]
            primary.copy_(rows_src)
            jrates["store"].append(run_jobs(keys, False))
            jrates["copy_in"].append(memcpy(rows_src, local))
            primary.zero_()
            jrates["load"].append(run_jobs(keys, True))
            jrates["copy_out"].append(memcpy(local, rows_dst))
            assert torch.equal(primary, rows_src), "a tier load did not reproduce the stored bytes"
        instance.shutdown()
        for ours, base, what in (("store", "copy_in", "store"), ("load", "copy_out", "load")):
            out.append(
                (
                    f"{what} of {n} chunks of {size >> 10} KiB through KVServiceTier (shared memory, jobs of "
                    f"{args.job_keys} keys in flight), GB/s",
                    statistics.median(jrates[ours]),
                    "torch copy of the same rows between local tensors",
                    statistics.median(jrates[base]),
                    statistics.median(a / b for a, b in zip(jrates[ours], jrates[base])),
                    ">= 0.8x",
                )
            )

        message = min(size, 1 << 20)
        bare = BareServer(message, n * size // message)
        grates: dict[str, list[float]] = {k: [] for k in ("put", "read", "up", "down")}
        for r in range(args.rounds):
            keys = keys_of(f"grpc-{r}", n)
            grates["put"].append(store(grpc_, keys))
            grates["up"].append(bare.upload())
            rows_dst.zero_()
            grates["read"].append(load(grpc_, keys))
            grates["down"].append(bare.download())
            assert torch.equal(rows_dst, rows_src), "a gRPC load did not reproduce the stored bytes"
        bare.close()
        for ours, base, what, stream in (
            ("put", "up", "PutBlocks store", "client"),
            ("read", "down", "ReadBlocks load", "server"),
        ):
            out.append(
                (
                    f"{what} of {n} chunks of {size >> 10} KiB across gRPC, GB/s",
                    statistics.median(grates[ours]),
                    f"bare gRPC {stream} stream of the same bytes",
                    statistics.median(grates[base]),
                    statistics.median(a / b for a, b in zip(grates[ours], grates[base])),
                    ">= 0.5x",
                )
            )
        shm.close()
        grpc_.close()
    for row in out:
        print(json.dumps(dict(zip(("figure", "value", "baseline", "baseline_value", "ratio", "target"), row))))
    print("\n| figure | value | baseline | baseline value | ratio | target |\n|---|---:|---|---:|---:|---|")
    for figure, value, baseline, baseline_value, ratio, target in out:
        print(f"| {figure} | {value:,.3f} | {baseline} | {baseline_value:,.3f} | {ratio:.2f}x | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
