"""A ``meta`` server (the replay's default: shapes only, no memory) never imports torch: its
pool's shapes, dtypes and sizes come from the config, and the data plane refuses every call
before it would touch memory."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    from kvservice.server.app import start_server
    from kvservice_client import AsyncKVCacheClient, KVServiceError, StepBuilder
    from kvservice_client.data import aattach_kv_cache

    async def main():
        server = await start_server(port=0, preset="llama-3-8b", num_blocks=64, device="meta", grace_seconds=1.0)
        try:
            async with AsyncKVCacheClient(server.address) as client:
                meta = await client.get_kv_cache_group_metadata()
                prompt = list(range(1, 41))
                step = await client.step(StepBuilder().get_computed_blocks("r1", prompt).allocate_slots("r1", 40))
                try:
                    await aattach_kv_cache(client)
                    attach = "attached"
                except KVServiceError as exc:
                    attach = f"{exc.code.name}: {exc.message}"
                pong = await client.ping(b"x")
            describe = [server.tensors.describe(), server.tensors.describe() in server.describe()]
        finally:
            await server.stop(0)
        print(json.dumps({
            "torch": "torch" in sys.modules,
            "device": meta.groups[0].device,
            "dtype": meta.groups[0].dtype,
            "num_computed_tokens": step.results[1].allocate_slots.num_computed_tokens,
            "attach": attach,
            "torch_version": pong.build_info.torch_version,
            "describe": describe,
        }))

    asyncio.run(main())
    """
)


def test_a_meta_server_starts_serves_a_step_and_stops_without_importing_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "torch": False,
        "device": "meta",
        "dtype": "bfloat16",
        "num_computed_tokens": 40,
        "attach": "FAILED_PRECONDITION: no memory behind a meta device",
        "torch_version": importlib.metadata.version("torch"),
        "describe": [
            "KV cache on meta (meta: shapes only, nothing allocated): one pool of 64 blocks x "
            "2097152 bytes (2.0 MiB) = 134217728 bytes (128.0 MiB), 1 groups viewing it\n"
            "  group 0 full_attention (32 layers): [32, 64, 16, 8, 256] bfloat16; 2097152 bytes (2.0 MiB)/block",
            True,  # in the serve banner
        ],
    }
