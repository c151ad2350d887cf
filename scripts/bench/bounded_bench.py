"""Bounded cost (issue 15): what snapshot watchers cost other clients, and memory against settings.

    python scripts/bench/bounded_bench.py stall  [--blocks 32768] [--clients 1,100] [--seconds 10] [--rpc stream|take]
    python scripts/bench/bounded_bench.py memory
    python scripts/bench/bounded_bench.py cut    --blocks 1048576 [--shape fresh|shared] [--repeat 3]
    ... --server-src DIR    # run the server from another source tree (e.g. main, for "before")

stall: a server (meta device, block size 16) holding ``--blocks`` cached blocks; one client's
GetUsage latency (p50/p99, sync client, this process) while idle, then while N other clients (a
separate process) loop StreamEvents(SNAPSHOT) to the end of each snapshot (until the deadline, then
they stop mid-snapshot: "snapshots done" counts whole ones); the figure is the loaded
p99 as a ratio to the idle p99 of the same run (target <= 3x). ``--rpc take`` is the unary row
(issue 26): the N clients loop ``TakeEvents(snapshot=true)`` instead (each its own consumer; a
whole snapshot per answer, refused above ``max_take_bytes``: a refusal counts in "takes refused").

memory: server RSS growth (VmRSS) in two workloads, each on a fresh server:
* pinning: 400 requests of 4,096 tokens on a 2,048-block pool, admitted and freed one by one, with
  a 1 MiB event log (so the growth is what the snapshot mirror keeps, not retention);
  "chain": request i starts with the first min(i, 255) blocks of one long chain (each chain block
  first announced by a different request's BlockStored, and kept cached by reuse), the rest fresh;
  "fresh": no reuse at all. Target: chain within 1.5x of fresh.
* event log: ``--event-max-bytes 12MiB``, a protobuf StreamEvents watcher reading every batch, 3,000
  batches of fresh 2,048-token requests (retention trims the log many times over). Target: RSS
  growth within 1.5x of the 12 MiB budget; the retained-bytes metric beside it.

cut: in this process, no server: a ``CachedSetMirror`` (one group, block size 16) fed ``--blocks``
blocks, then ``--repeat`` times a whole snapshot cut (``snapshot_runs`` over the mirror's table,
no yields: the CPU a cut costs, which ``HalfShare`` spreads over the loop) and the materializing of
its events (``materialize``, each made and dropped, as encoding a part does), in seconds and microseconds per
block, with a digest of the events (msgpack, so two source trees can be checked to give the same
events: run it with ``PYTHONPATH=DIR:DIR/clients/python`` for the other tree).
``--shape fresh`` is the stall row's table: distinct 8,192-token prompts, one record of 512 blocks
each; ``shared`` is a table a serving trace leaves: 1,024 conversations whose turns (32 to 96 blocks)
each extend the turn before (a reuse report of the conversation's blocks, then a BlockStored whose
parent is the previous turn's last block), with a tenth of the blocks evicted deepest first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(server_src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if server_src:
        env["PYTHONPATH"] = f"{server_src}:{server_src}/clients/python"
    return env


class Server:
    """``kvservice serve`` in a child process on a free port."""

    def __init__(self, *flags: str, server_src: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvservice.cli", "serve", "--port", "0", "--device", "meta", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(server_src),
            cwd="/tmp",
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("kvservice listening on"):
                self.address = line.split()[3]
                break
        else:
            raise RuntimeError(f"server did not start (exit {self.proc.wait()})")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _fill(client, num_blocks: int, prompt_len: int = 8192, per_step: int = 32) -> None:
    """Leave ``num_blocks`` blocks cached: fresh prompts admitted and freed, in Steps."""
    from kvservice_client.client import StepBuilder

    num_requests = num_blocks * 16 // prompt_len
    for start in range(0, num_requests, per_step):
        step = StepBuilder()
        ids = range(start, min(num_requests, start + per_step))
        for r in ids:
            base = 1 + r * prompt_len
            step.get_computed_blocks(f"f{r}", list(range(base, base + prompt_len))).allocate_slots(f"f{r}", prompt_len)
        for r in ids:
            step.free(f"f{r}")
        client.step(step, timeout=600)


def _latencies(client, seconds: float) -> list[float]:
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        client.get_usage(timeout=600)
        out.append(time.perf_counter() - t)
        time.sleep(0.002)
    return out


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _snapshot_more(data: bytes) -> bool:
    """``EventBatch.snapshot_more`` (field 8) read from the message's bytes without parsing the rest:
    only the top-level fields are walked (a part has a few dozen), lengths skipped."""
    more = False
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire_type = key & 7
        if wire_type == 0:
            value, i = _varint(data, i)
            if key >> 3 == 8:
                more = bool(value)
        elif wire_type == 2:
            n, i = _varint(data, i)
            i += n
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire_type}")
    return more


async def _snapshot_load(
    address: str, num_clients: int, seconds: float, readers: str = "parse", rpc: str = "stream"
) -> tuple[int, int]:
    """N snapshot clients; ``readers="raw"`` takes each message's bytes as they come and reads only
    ``snapshot_more`` from them (the server's work is the same; the readers' parsing, which on a
    real deployment runs on the routers' own machines, then takes little of this machine's CPU).
    ``rpc="take"``: each loops ``TakeEvents(snapshot=true)`` (raw: the answer's bytes unparsed).
    Returns (whole snapshots taken, refusals)."""
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
    from kvservice_client.client import AsyncKVCacheClient
    from kvservice_client.errors import KVServiceError
    from kvservice_client.request_builders import stream_events_request

    done = refused = 0
    end = time.monotonic() + seconds
    clients = [
        AsyncKVCacheClient(address, options=[("grpc.use_local_subchannel_pool", 1)], timeout=None)
        for _ in range(min(num_clients, 8))
    ]

    async def take_loop(client, consumer: str) -> None:
        nonlocal done, refused
        raw = client.channel.unary_unary(
            "/kvservice.v1.KVCacheService/TakeEvents",
            request_serializer=pb.TakeEventsRequest.SerializeToString,
            response_deserializer=None,
        )
        while time.monotonic() < end:
            try:
                if readers == "raw":
                    await raw(pb.TakeEventsRequest(consumer=consumer, snapshot=True))
                else:
                    await client.take_events(consumer, snapshot=True)
            except KVServiceError:  # refused (above max_take_bytes): counted, asked again
                refused += 1
                continue
            except Exception:  # the raw call's error
                refused += 1
                continue
            done += 1

    async def loop(client) -> None:
        nonlocal done
        while time.monotonic() < end:
            try:
                if readers == "raw":
                    raw = client.channel.unary_stream(
                        "/kvservice.v1.KVCacheService/StreamEvents",
                        request_serializer=pb.StreamEventsRequest.SerializeToString,
                        response_deserializer=None,
                    )
                    async for data in raw(stream_events_request(None, None, None, True, (), None)):
                        if not _snapshot_more(data):
                            break
                else:
                    async for batch in client.stream_events(snapshot=True):
                        if not batch.snapshot_more:
                            break
            except Exception:  # a stream the server ended (fell behind ...): ask again
                continue
            done += 1

    try:  # stop at the deadline, mid-snapshot if need be (a rate-bounded 1M-block snapshot takes seconds)
        loops = (
            take_loop(clients[i % len(clients)], f"bench-{i}") if rpc == "take" else loop(clients[i % len(clients)])
            for i in range(num_clients)
        )
        await asyncio.wait_for(asyncio.gather(*loops), seconds + 1)
    except asyncio.TimeoutError:
        pass
    for client in clients:
        await client.close()
    return done, refused


def stall(
    blocks: int,
    clients: list[int],
    seconds: float,
    server_src: str | None,
    readers: str = "parse",
    rpc: str = "stream",
) -> list[dict]:
    from kvservice_client.client import KVCacheClient

    server = Server(
        "--preset",
        "qwen-2.5-0.5b",
        "--block-size",
        "16",
        "--num-blocks",
        str(blocks + 64),
        "--max-model-len",
        "8192",
        server_src=server_src,
    )
    rows = []
    try:
        with KVCacheClient(server.address, timeout=600) as client:
            t = time.perf_counter()
            _fill(client, blocks)
            fill_s = time.perf_counter() - t
            cached = client.get_usage().num_cached_blocks
            idle = _latencies(client, seconds)
            for n in clients:
                load = subprocess.Popen(
                    [sys.executable, __file__, "_load", server.address, str(n), str(seconds + 2), readers, rpc],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=_env(None),
                    cwd=str(ROOT),
                )
                time.sleep(1.0)  # let the load start
                loaded = _latencies(client, seconds)
                out, _ = load.communicate(timeout=3600)
                done, refused = (int(x) for x in out.strip().splitlines()[-1].split()) if out.strip() else (None, None)
                rows.append(
                    {
                        "blocks": cached,
                        "clients": n,
                        "rpc": "TakeEvents" if rpc == "take" else "StreamEvents",
                        "readers": readers,
                        "fill_s": fill_s,
                        "idle_p50_ms": _p(idle, 0.5) * 1e3,
                        "idle_p99_ms": _p(idle, 0.99) * 1e3,
                        "loaded_p50_ms": _p(loaded, 0.5) * 1e3,
                        "loaded_p99_ms": _p(loaded, 0.99) * 1e3,
                        "loaded_max_ms": max(loaded) * 1e3,
                        "ratio_p99": _p(loaded, 0.99) / _p(idle, 0.99),
                        "snapshots_done": done,
                        "takes_refused": refused,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def _chain_prompts(num_requests: int, prompt_len: int, chain: bool) -> list[list[int]]:
    master = list(range(1, 1 + 255 * 16))
    prompts = []
    for i in range(num_requests):
        reuse = min(i, 255) * 16 if chain else 0
        fresh_start = 10_000_000 + i * prompt_len
        prompts.append(master[:reuse] + list(range(fresh_start, fresh_start + prompt_len - reuse)))
    return prompts


def memory(server_src: str | None) -> list[dict]:
    from kvservice_client.client import KVCacheClient, StepBuilder

    rows = []
    for workload in ("fresh", "chain"):
        # A small event log (1 MiB), so what stays is what the snapshot mirror holds.
        server = Server(
            "--preset",
            "qwen-2.5-0.5b",
            "--block-size",
            "16",
            "--num-blocks",
            "2049",
            "--max-model-len",
            "4096",
            "--event-max-bytes",
            "1MiB",
            server_src=server_src,
        )
        try:
            with KVCacheClient(server.address, timeout=600) as client:
                client.get_usage()
                before = server.rss_bytes()
                for i, prompt in enumerate(_chain_prompts(400, 4096, workload == "chain")):
                    client.step(
                        StepBuilder().get_computed_blocks(f"r{i}", prompt).allocate_slots(f"r{i}", 4096).free(f"r{i}")
                    )
                after = server.rss_bytes()
            rows.append({"workload": f"pinning, {workload}", "rss_growth_mib": (after - before) / 2**20})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    budget = 12 * 2**20
    server = Server(
        "--preset",
        "qwen-2.5-0.5b",
        "--block-size",
        "16",
        "--num-blocks",
        "2049",
        "--max-model-len",
        "4096",
        "--event-max-bytes",
        "12MiB",
        "--metrics-port",
        "0",
        server_src=server_src,
    )
    try:
        from kvservice_client.client import AsyncKVCacheClient  # noqa: F401

        with KVCacheClient(server.address, timeout=600) as client:
            client.get_usage()
            before = server.rss_bytes()
            stream = client.stream_events(start_seq=1)
            reader_done = []

            import threading

            def read() -> None:
                n = 0
                for _ in stream:
                    n += 1
                    if n == 3000:
                        break
                reader_done.append(n)

            thread = threading.Thread(target=read)
            thread.start()
            for i in range(3000):
                base = 20_000_000 + i * 2048
                client.step(
                    StepBuilder()
                    .get_computed_blocks(f"e{i}", list(range(base, base + 2048)))
                    .allocate_slots(f"e{i}", 2048)
                    .free(f"e{i}")
                )
            thread.join(600)
            after = server.rss_bytes()
            meta = client.get_kv_cache_group_metadata()
        rows.append(
            {
                "workload": "event log, 12 MiB budget",
                "rss_growth_mib": (after - before) / 2**20,
                "ratio_to_budget": (after - before) / budget,
                "head_seq": meta.head_seq,
                "batches_read": reader_done[0] if reader_done else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def _cut_mirror(num_blocks: int, shape: str):
    import random

    from kvservice.server.snapshot import CachedSetMirror
    from kvservice_client.events import BlockRemoved, BlockStored

    mirror = CachedSetMirror(1, ["full_attention"], [None])
    seq = 0

    def stored(hashes: list[int], parent: int | None, reused: bool = False) -> BlockStored:
        first = hashes[0] if not reused else 0
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[] if reused else list(range(first * 16, (first + len(hashes)) * 16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            reused=reused,
        )

    if shape == "fresh":
        for r in range(num_blocks // 512):
            seq += 1
            mirror.apply(seq, [stored(list(range(r * 512 + 1, r * 512 + 513)), None)])
        return mirror
    rng = random.Random(15)
    chains: list[list[int]] = [[] for _ in range(1024)]
    next_hash = 1
    while mirror.num_blocks < num_blocks:
        chain = chains[rng.randrange(1024)]
        n = rng.randrange(32, 97)
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        events = [stored(chain, None, reused=True)] if chain else []
        events.append(stored(hashes, chain[-1] if chain else None))
        if rng.random() < 0.1 and len(chain) > 8:  # evicted deepest first
            k = rng.randrange(1, len(chain) // 4 + 1)
            events.append(BlockRemoved(block_hashes=chain[-k:][::-1], medium="GPU", group_idx=0))
            del chain[-k:]
        chain.extend(hashes)
        seq += 1
        mirror.apply(seq, events)
    return mirror


def cut(num_blocks: int, shape: str, repeat: int) -> list[dict]:
    import gc
    import hashlib

    from kvservice.server.snapshot import materialize, snapshot_runs
    from kvservice_client.events import KVEventBatch, encode_event_batch

    t = time.perf_counter()
    mirror = _cut_mirror(num_blocks, shape)
    fill_s = time.perf_counter() - t
    rows = []
    for i in range(repeat):
        gc.collect()
        t = time.perf_counter()
        runs = list(snapshot_runs(mirror.table, None))
        cut_s = time.perf_counter() - t
        kinds, windows = mirror.group_kinds, mirror.group_windows
        t = time.perf_counter()
        for run in runs:  # each event made and dropped, as encoding a part does
            materialize(run, kinds, windows)
        materialize_s = time.perf_counter() - t
        digest = hashlib.sha256()
        for j in range(0, len(runs), 1024):
            events = [materialize(run, kinds, windows) for run in runs[j : j + 1024]]
            digest.update(encode_event_batch(KVEventBatch(0.0, events, None)))
        rows.append(
            {
                "shape": shape,
                "blocks": mirror.num_blocks,
                "repeat": i,
                "fill_s": round(fill_s, 2),
                "events": len(runs),
                "cut_s": round(cut_s, 3),
                "cut_us_per_block": round(cut_s / mirror.num_blocks * 1e6, 3),
                "materialize_s": round(materialize_s, 3),
                "materialize_us_per_block": round(materialize_s / mirror.num_blocks * 1e6, 3),
                "digest": digest.hexdigest()[:16],
                "load_avg_1m": os.getloadavg()[0],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del runs, events
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        print(*asyncio.run(_snapshot_load(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:7])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["stall", "memory", "cut"])
    parser.add_argument("--blocks", type=int, default=32768)
    parser.add_argument("--clients", default="1,100")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--server-src")
    parser.add_argument("--shape", choices=["fresh", "shared"], default="fresh", help="cut: the table's shape")
    parser.add_argument("--repeat", type=int, default=3, help="cut: cuts measured")
    parser.add_argument(
        "--readers",
        choices=["parse", "raw"],
        default="parse",
        help="snapshot clients parse every message (parse) or read only snapshot_more from its bytes (raw)",
    )
    parser.add_argument(
        "--rpc",
        choices=["stream", "take"],
        default="stream",
        help="stall: the load clients loop StreamEvents(SNAPSHOT) (stream) or TakeEvents(snapshot=true) (take)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.what == "stall":
        result = stall(
            args.blocks,
            [int(n) for n in args.clients.split(",")],
            args.seconds,
            args.server_src,
            args.readers,
            args.rpc,
        )
    elif args.what == "cut":
        result = cut(args.blocks, args.shape, args.repeat)
    else:
        result = memory(args.server_src)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
