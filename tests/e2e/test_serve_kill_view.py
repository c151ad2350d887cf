"""A worker's attached view after a kill -9 of ``kvservice serve --device cpu`` (issue 24): closed
as soon as the process is gone, with no restart to mark it.

A stop marks the control segment closed; a kill marks nothing (the state byte still says open, the
segments are still there). The view tells by the lock: the live server holds an exclusive flock on
its control segment, which the kernel drops with the process, and the view's non-blocking shared
flock succeeds once nobody holds it.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvservice_client.client import KVCacheClient
from kvservice_client.data import mark_blocks_written
from tests.e2e.test_cli import Lines, _spawn

torch_view = pytest.importorskip("kvservice_client.torch_view")

BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2  # qwen-2.5-0.5b, block size 4
PROMPT = list(range(1, 13))  # 12 tokens: 3 full blocks of 4


def test_a_view_reports_closed_right_after_its_server_is_killed(tmp_path):
    serve = _spawn(
        "serve",
        "--port",
        "0",
        "--device",
        "cpu",
        "--preset",
        "qwen-2.5-0.5b",
        "--block-size",
        "4",
        "--num-blocks",
        "16",
    )
    names: list[str] = []
    try:
        address = Lines(serve.stdout).wait_for("kvservice listening on").split()[3]
        with KVCacheClient(address) as client:
            view = torch_view.attach(client)
            names = [view.description.control_shm_name, *(s.shm_name for s in view.description.storages)]
            client.get_computed_blocks("w", PROMPT)
            slots = client.allocate_slots("w", len(PROMPT))
            [block_id, *_] = slots.new_block_ids[0].block_ids
            for tensor in view.block_view(0, block_id):
                tensor.view(torch_view.torch.uint8).fill_(7)
            mark_blocks_written(client, "w", [(0, block_id)], allocation=slots)
            [block] = client.read_blocks([(0, block_id)])
            assert (block.data, view.closed) == (b"\7" * BLOCK_BYTES, False)
            view.check()  # open: nothing raised
        serve.send_signal(signal.SIGKILL)
        assert serve.wait(timeout=60) == -signal.SIGKILL
        # Nothing marked the segments: they are all still there, the state byte still open.
        assert [os.path.exists(f"/dev/shm/{name}") for name in names] == [True] * len(names)
        with open(f"/dev/shm/{names[0]}", "rb") as control:
            assert control.read(2) == b"\x01\x01"  # state open, format "its owner holds the flock"
        assert view.closed is True
        with pytest.raises(torch_view.KVCacheViewClosedError, match="has stopped or restarted"):
            view.block_view(0, block_id)
        with pytest.raises(torch_view.KVCacheViewClosedError):
            view.check()
        assert view.closed is True  # and stays so
        view.close()
    finally:
        serve.kill()
        serve.wait()
        for name in names:  # a kill leaves them to the next start; this test starts none
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
