#!/usr/bin/env python3
"""Data-plane benchmark: WriteBlocks / ReadBlocks against a bare gRPC bytes stream, a worker
writing through the attached view against a torch copy, and the server's memory during a transfer.

    python scripts/bench/data_plane_bench.py [--gib 1.0] [--chunk-bytes 1048576] [--rounds 3]

Rows (each beside a baseline from the same run):

- ``WriteBlocks`` GB/s, 1 GiB of blocks in chunks of ``--chunk-bytes`` (a block smaller than a
  chunk is one message), against a bare gRPC client stream of ``bytes`` messages of the same size to a server that only counts them
  (``bare_data_stream.py``, no parsing, no copy into memory); ``ReadBlocks`` GB/s against a bare
  server stream of prebuilt messages of the same size. Both servers are separate processes.
- a worker writing N blocks through the attached view (``kvservice_client.torch_view``, shared
  memory mapped from the server) against ``torch`` copying the same blocks into a local tensor of
  the same layout.
- the server's anonymous memory (``RssAnon``; the KV memory itself is shared memory, counted apart)
  sampled every 5 ms during the 1 GiB write and read, its peak growth over the idle server, in
  chunks.

Prints the rows as JSON lines and a markdown table. Speed figures are medians over ``--rounds``
(the view row over ``2 * rounds + 1``), ours and the baseline alternating; each ratio is the median
of the per-round ratios, so a noisy machine moves both sides of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_proc import serve  # noqa: E402

from kvservice_client.client import KVCacheClient  # noqa: E402
from kvservice_client.data import block_ref, iter_read_blocks, write_blocks  # noqa: E402
from kvservice_client.torch_view import attach  # noqa: E402

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 24 * 2 * BLOCK_SIZE * 2 * 64 * 2  # qwen-2.5-0.5b: 196,608 bytes
BLOCKS_PER_REQUEST = 1000


def rss_anon_bytes(pid: int) -> int:
    """A process's anonymous resident memory (heap, stacks), from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class PeakSampler:
    """Samples a process's RssAnon every 5 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_anon_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_anon_bytes(self.pid))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class BareServer:
    """The bare gRPC bytes server (``bare_data_stream.py``) in a child process."""

    def __init__(self, message_bytes: int, num_messages: int) -> None:
        import grpc

        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("bare_data_stream.py")),
                str(message_bytes),
                str(num_messages),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        address = self.proc.stdout.readline().split()[-1]
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._upload = self.channel.stream_unary("/bare.Data/Upload")
        self._download = self.channel.unary_stream("/bare.Data/Download")
        self.payload = bytes(message_bytes)
        self.num_messages = num_messages

    def upload(self) -> float:
        """GB/s of one client stream of N messages."""
        t0 = time.perf_counter()
        self._upload(iter([self.payload] * self.num_messages))
        return self.num_messages * len(self.payload) / (time.perf_counter() - t0) / 1e9

    def download(self) -> float:
        """GB/s of one server stream of N messages."""
        t0 = time.perf_counter()
        n = sum(len(m) for m in self._download(b""))
        return n / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per transfer, GiB [1]")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help="data chunk size [1 MiB]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--view-blocks", type=int, default=2000, help="blocks the attached-view row writes [2000]")
    args = parser.parse_args(argv)
    num_blocks_moved = int(args.gib * (1 << 30)) // BYTES_PER_BLOCK
    num_requests = -(-num_blocks_moved // BLOCKS_PER_REQUEST)
    pool = num_requests * BLOCKS_PER_REQUEST + 2
    rows = []
    with serve(
        "--device",
        "cpu",
        "--preset",
        "qwen-2.5-0.5b",
        "--num-blocks",
        str(pool),
        "--data-chunk-bytes",
        str(args.chunk_bytes),
        with_pid=True,
    ) as (address, pid):
        client = KVCacheClient(address, timeout=600.0, options=[("grpc.max_receive_message_length", 64 << 20)])
        tables = []
        for i in range(num_requests):
            prompt = [(i * 7919 + t) % 30000 + 1 for t in range(BLOCKS_PER_REQUEST * BLOCK_SIZE)]
            client.get_computed_blocks(f"r{i}", prompt)
            response = client.allocate_slots(f"r{i}", len(prompt))
            assert response.allocated
            tables.append(list(response.new_block_ids[0].block_ids))
        moved = [(f"r{i}", b) for i, table in enumerate(tables) for b in table][:num_blocks_moved]
        payload = bytes(range(256)) * (BYTES_PER_BLOCK // 256)
        total = len(moved) * BYTES_PER_BLOCK
        message_bytes = min(args.chunk_bytes, BYTES_PER_BLOCK)  # what our streams carry per message
        bare = BareServer(message_bytes, total // message_bytes)
        idle, bare_idle = rss_anon_bytes(pid), rss_anon_bytes(bare.proc.pid)
        write_rates, read_rates, bare_up, bare_down = [], [], [], []
        # Ours and the baseline alternate, so a noisy machine moves both.
        with PeakSampler(pid) as sampler, PeakSampler(bare.proc.pid) as bare_sampler:
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for i in range(num_requests):
                    blocks = [(0, b, payload) for r, b in moved if r == f"r{i}"]
                    write_blocks(client, f"r{i}", blocks, chunk_bytes=args.chunk_bytes)
                write_rates.append(total / (time.perf_counter() - t0) / 1e9)
                bare_up.append(bare.upload())
                t0 = time.perf_counter()
                n = 0
                for block in iter_read_blocks(client, [block_ref(0, block_id=b) for _r, b in moved]):
                    n += len(block.data or b"")
                read_rates.append(n / (time.perf_counter() - t0) / 1e9)
                assert n == total
                bare_down.append(bare.download())
        bare.close()
        write, read = statistics.median(write_rates), statistics.median(read_rates)
        up, down = statistics.median(bare_up), statistics.median(bare_down)
        chunk_kib = args.chunk_bytes >> 10
        # The ratio is the median of the per-round ratios (each pair ran back to back).
        write_ratio = statistics.median(o / b for o, b in zip(write_rates, bare_up))
        read_ratio = statistics.median(o / b for o, b in zip(read_rates, bare_down))
        rows.append(
            (
                f"WriteBlocks GB/s (1 GiB, {chunk_kib} KiB chunks)",
                write,
                "bare gRPC client stream of bytes",
                up,
                write_ratio,
                ">= 0.5x",
            )
        )
        rows.append(
            (
                f"ReadBlocks GB/s (1 GiB, {chunk_kib} KiB chunks)",
                read,
                "bare gRPC server stream of bytes",
                down,
                read_ratio,
                ">= 0.5x",
            )
        )
        growth, bare_growth = sampler.peak - idle, bare_sampler.peak - bare_idle
        rows.append(
            (
                f"server RssAnon peak growth during the {total / 2**30:.2f} GiB transfers, MiB",
                growth / 2**20,
                "bare gRPC server, same transfers",
                bare_growth / 2**20,
                growth / max(bare_growth, 1),
                f"a few chunks ({growth / args.chunk_bytes:.1f} chunks)",
            )
        )
        # -- a worker through the attached view --
        torch.set_num_threads(1)  # per-block copies are small; OpenMP barriers on a loaded machine swamp them
        view = attach(client)
        blocks = [b for _r, b in moved][: args.view_blocks]
        src = torch.randn(view.block_view(0, 1)[0].shape).to(torch.bfloat16)
        local = torch.zeros(view.tensors(0)[0].shape, dtype=torch.bfloat16)
        ours, base = [], []
        for _ in range(2 * args.rounds + 1):
            t0 = time.perf_counter()
            for b in blocks:
                view.block_view(0, b)[0].copy_(src)
            ours.append(len(blocks) * BYTES_PER_BLOCK / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for b in blocks:
                local.select(2, b).copy_(src)
            base.append(len(blocks) * BYTES_PER_BLOCK / (time.perf_counter() - t0) / 1e9)
        o, b_ = statistics.median(ours), statistics.median(base)
        rows.append(
            (
                f"worker writes {len(blocks)} blocks via the attached view, GB/s",
                o,
                "torch copy into a local tensor",
                b_,
                statistics.median(x / y for x, y in zip(ours, base)),
                ">= 0.8x",
            )
        )
        client.close()
    for row in rows:
        print(json.dumps(dict(zip(("figure", "value", "baseline", "baseline_value", "ratio", "target"), row))))
    print("\n| figure | value | baseline | baseline value | ratio | target |\n|---|---:|---|---:|---:|---|")
    for figure, value, baseline, baseline_value, ratio, target in rows:
        print(f"| {figure} | {value:,.3f} | {baseline} | {baseline_value:,.3f} | {ratio:.2f}x | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
