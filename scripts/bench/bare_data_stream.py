"""A bare gRPC bytes server, the baseline of the data-plane benchmark: ``/bare.Data/Upload``
(client streaming) counts the bytes it receives and answers their count; ``/bare.Data/Download``
(server streaming) sends N prebuilt messages of the chunk size. No parsing, no copy into memory.

Usage: python bare_data_stream.py CHUNK_BYTES N   (prints "listening on HOST:PORT")
"""

from __future__ import annotations

import asyncio
import sys

import grpc


async def main(chunk_bytes: int, num_messages: int) -> None:
    message = bytes(chunk_bytes)

    async def upload(request_iterator, context: grpc.aio.ServicerContext) -> bytes:
        n = 0
        async for data in request_iterator:
            n += len(data)
        return n.to_bytes(8, "big")

    async def download(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for _ in range(num_messages):
            await context.write(message)

    handler = grpc.method_handlers_generic_handler(
        "bare.Data",
        {
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
            "Download": grpc.unary_stream_rpc_method_handler(download),
        },
    )
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
