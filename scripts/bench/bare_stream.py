"""A bare gRPC stream: serves ``kvservice.v1.KVCacheService/StreamEvents`` by writing prebuilt
message bytes from a file, nothing else. The baseline of the events benchmark.

Usage: python bare_stream.py MESSAGES_FILE   (prints "listening on HOST:PORT")
The file holds length-prefixed (4-byte big-endian) serialized EventBatch messages.
"""

from __future__ import annotations

import asyncio
import sys

import grpc


def load(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i : i + 4], "big")
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out


async def main(path: str) -> None:
    messages = load(path)

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for message in messages:
            await context.write(message)

    handler = grpc.method_handlers_generic_handler(
        "kvservice.v1.KVCacheService",
        {
            "StreamEvents": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=None, response_serializer=None
            )
        },
    )
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
