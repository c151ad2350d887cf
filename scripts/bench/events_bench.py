"""Events: events per second delivered to 1 and 8 watchers (protobuf and msgpack payloads), against
a bare gRPC stream of the same prebuilt messages; and mutation-to-watcher latency at a fixed load.

The server (``kvservice serve``) and the bare stream (``bare_stream.py``) each run in their own
process; the watchers are streams of one client process, in both cases, and count what arrives.
Delivery is measured by replaying retained batches from seq 1 (the log is filled first), so the
figure is the service's fan-out, not the producer's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient

try:
    from server_proc import serve
    from workloads import prompts
except ImportError:
    from scripts.bench.server_proc import serve
    from scripts.bench.workloads import prompts

HERE = Path(__file__).parent


def produce(
    client: KVCacheClient, num_batches: int, requests_per_batch: int = 4, prompt_len: int = 256, seed: int = 5
) -> None:
    """Fill the event log: each Step admits and frees requests (one batch of stores and removals).
    Prompts are random tokens from ``seed``: another seed gives prompts sharing no block."""
    seq = prompts(num_batches * requests_per_batch, prompt_len, 0.0, seed=seed)
    for b in range(num_batches):
        ops = []
        for j in range(b * requests_per_batch, (b + 1) * requests_per_batch):
            ops.append(
                pb.StepOp(get_computed_blocks=pb.GetComputedBlocksRequest(request_id=f"e{j}", prompt_token_ids=seq[j]))
            )
            ops.append(pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=f"e{j}", num_new_tokens=prompt_len)))
            ops.append(pb.StepOp(free=pb.FreeRequest(request_id=f"e{j}")))
        client.step(pb.StepRequest(ops=ops))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drain(address: str, num_watchers: int, num_batches: int, payload_format: int) -> tuple[float, int]:
    """Seconds until every watcher received ``num_batches`` batches from seq 1; events each."""
    request = pb.StreamEventsRequest(start=pb.EVENT_START_SEQ, start_seq=1, payload_format=payload_format)
    clients = [AsyncKVCacheClient(address) for _ in range(num_watchers)]
    counts = [0] * num_watchers

    async def watch(i: int) -> None:
        n = 0
        async for batch in clients[i].stub.StreamEvents(request):
            counts[i] += len(batch.events) if payload_format != pb.PAYLOAD_FORMAT_MSGPACK else 1
            n += 1
            if n == num_batches:
                return

    for c in clients:
        await c.channel.channel_ready()
    start = time.perf_counter()
    await asyncio.gather(*(watch(i) for i in range(num_watchers)))
    elapsed = time.perf_counter() - start
    for c in clients:
        await c.close()
    return elapsed, counts[0]


def _all_batches(client: KVCacheClient, consumer: str, payload_format: int) -> list[bytes]:
    """Every retained batch, serialized as the stream sends it (paged through TakeEvents)."""
    out: list[bytes] = []
    taken = client.take_events(consumer, start_seq=1, payload_format=payload_format)
    while taken.batches:
        out.extend(b.SerializeToString() for b in taken.batches)
        taken = client.take_events(consumer, payload_format=payload_format)
    return out


@contextlib.contextmanager
def bare_stream(messages: list[bytes]):
    with tempfile.NamedTemporaryFile(delete=False) as f:
        for m in messages:
            f.write(len(m).to_bytes(4, "big") + m)
        path = f.name
    proc = subprocess.Popen([sys.executable, str(HERE / "bare_stream.py"), path], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        yield line.split()[2], proc.pid
    finally:
        proc.kill()
        proc.wait()
        Path(path).unlink()


async def _latency(client: AsyncKVCacheClient, address: str, num_batches: int, rate_per_s: float) -> list[float]:
    """Milliseconds from sending a mutating Step to a watcher receiving its batch, at ``rate_per_s``."""
    sent: dict[int, float] = {}
    latencies: list[float] = []
    watcher = AsyncKVCacheClient(address)
    meta = await client.get_kv_cache_group_metadata()
    stream = watcher.stub.StreamEvents(pb.StreamEventsRequest(start=pb.EVENT_START_SEQ, start_seq=meta.head_seq + 1))
    done = asyncio.Event()

    async def watch() -> None:
        async for batch in stream:
            latencies.append((time.perf_counter() - sent.pop(batch.seq)) * 1e3)
            if len(latencies) == num_batches:
                done.set()
                return

    task = asyncio.create_task(watch())
    seq = prompts(num_batches, 256, 0.0, seed=6)
    interval = 1.0 / rate_per_s
    next_time = time.perf_counter()
    expected_seq = meta.head_seq + 1  # each Step publishes exactly one batch: the next seq
    for i in range(num_batches):
        ops = [
            pb.StepOp(get_computed_blocks=pb.GetComputedBlocksRequest(request_id=f"l{i}", prompt_token_ids=seq[i])),
            pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=f"l{i}", num_new_tokens=256)),
            pb.StepOp(free=pb.FreeRequest(request_id=f"l{i}")),
        ]
        sent[expected_seq] = time.perf_counter()  # before sending: the batch can arrive before the answer
        response = await client.step(pb.StepRequest(ops=ops))
        assert response.head_seq == expected_seq
        expected_seq += 1
        next_time += interval
        await asyncio.sleep(max(0.0, next_time - time.perf_counter()))
    await asyncio.wait_for(done.wait(), 60)
    await task
    await watcher.close()
    return latencies


def delivery_rate(num_batches: int, prompt_len: int, num_blocks: int) -> float:
    """Events per second to one watcher replaying ``num_batches`` batches (each 4 admissions of
    ``prompt_len`` tokens) from a server of ``num_blocks`` blocks, once every batch is encoded."""
    with serve(
        "--device", "meta", "--num-blocks", str(num_blocks), "--event-max-batches", str(num_batches + 10)
    ) as address:
        with KVCacheClient(address) as client:
            produce(client, num_batches, prompt_len=prompt_len)
        asyncio.run(_drain(address, 1, num_batches, pb.PAYLOAD_FORMAT_PROTOBUF))  # encode each batch once
        seconds, events = asyncio.run(_drain(address, 1, num_batches, pb.PAYLOAD_FORMAT_PROTOBUF))
    return events / seconds


def run(quick: bool = False) -> dict[str, float]:
    num_batches = 300 if quick else 3000
    out: dict[str, float] = {}
    with serve(
        "--device", "meta", "--num-blocks", "65536", "--event-max-batches", str(num_batches + 10), with_pid=True
    ) as (address, pid):
        with KVCacheClient(address) as client:
            produce(client, num_batches)
        for name, fmt in (("protobuf", pb.PAYLOAD_FORMAT_PROTOBUF), ("msgpack", pb.PAYLOAD_FORMAT_MSGPACK)):
            with KVCacheClient(address) as client:
                messages = _all_batches(client, name, fmt)
            assert len(messages) == num_batches
            with bare_stream(messages) as (bare, bare_pid):
                # A first pass encodes every batch once (as a live log would have, for its first
                # subscriber); the measured passes are the fan-out.
                asyncio.run(_drain(address, 1, num_batches, fmt))
                for watchers in (1, 8):
                    cpu0 = cpu_seconds(pid)
                    ours_s, events = asyncio.run(_drain(address, watchers, num_batches, fmt))
                    out[f"{name}_{watchers}w_server_cpu_s"] = cpu_seconds(pid) - cpu0
                    cpu0 = cpu_seconds(bare_pid)
                    bare_s, _ = asyncio.run(_drain(bare, watchers, num_batches, fmt))
                    out[f"{name}_{watchers}w_bare_server_cpu_s"] = cpu_seconds(bare_pid) - cpu0
                    unit = "events" if fmt == pb.PAYLOAD_FORMAT_PROTOBUF else "batches"
                    out[f"{name}_{watchers}w_{unit}_per_s"] = events * watchers / ours_s
                    out[f"{name}_{watchers}w_bare_{unit}_per_s"] = events * watchers / bare_s
                    out[f"{name}_{watchers}w_seconds"] = ours_s
                    out[f"{name}_{watchers}w_bare_seconds"] = bare_s

        async def latency() -> list[float]:
            async with AsyncKVCacheClient(address) as client:
                return await _latency(client, address, 200 if quick else 1000, rate_per_s=200.0)

        lat = sorted(asyncio.run(latency()))
        out["latency_p50_ms"] = statistics.median(lat)
        out["latency_p99_ms"] = lat[int(0.99 * (len(lat) - 1))]
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
