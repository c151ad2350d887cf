"""A bare ``grpc.aio`` unary echo server's CPU per call, beside this project's Ping: what a gRPC
call costs on this machine before any kvservice code runs.

    python scripts/bench/bare_unary.py [--calls 400]

Starts the echo server in a child process (no interceptors, no service code), calls it with
payloads of 0 B, 18 KB (a Step of 64 admissions' answer) and 526 KB (its packed request) from a
blocking channel, and prints per payload the round trip and the server process's CPU per call
(user + system, all its threads), in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import grpc


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve() -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    limit = 64 * 1024 * 1024
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )
    handler = grpc.method_handlers_generic_handler("bare.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve())
        return
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        limit = 64 * 1024 * 1024
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        call = channel.unary_unary("/bare.Echo/Echo")
        for size in (0, 18_000, 526_000):
            payload = b"x" * size
            for _ in range(50):
                call(payload)
            cpu, start = _cpu_s(proc.pid), time.perf_counter()
            for _ in range(args.calls):
                call(payload)
            elapsed, cpu = time.perf_counter() - start, _cpu_s(proc.pid) - cpu
            print(
                f"{size:>7} B: round trip {elapsed / args.calls * 1e6:,.0f} us, "
                f"server CPU {cpu / args.calls * 1e6:,.0f} us per call"
            )
        channel.close()
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
