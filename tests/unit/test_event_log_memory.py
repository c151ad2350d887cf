"""The event log's byte count is what it really holds: Python memory (tracemalloc) over
``retained_bytes`` within 1.5x either way, with and without cached encodings, small and large
batches; trimming to ``max_bytes`` gives the memory back."""

from __future__ import annotations

import tracemalloc

import pytest

from kvservice.server.encoding import encoded_batch
from kvservice.server.event_log import EventLog, EventLogConfig
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.events import BlockRemoved, BlockStored


def batch(i: int, num_tokens: int) -> list:
    num_blocks = num_tokens // 16
    return [
        BlockStored(
            block_hashes=[(i << 20) + b + 2**62 for b in range(num_blocks)],
            parent_block_hash=None,
            token_ids=list(range(60_000 + i, 60_000 + i + num_tokens)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=[(i << 20) + 2**62 + 7], medium="GPU", group_idx=0),
    ]


@pytest.mark.parametrize("num_tokens", [16, 256, 4096])
@pytest.mark.parametrize("encode", [False, True])
def test_retained_bytes_match_the_memory_the_log_holds(num_tokens, encode):
    batches = [batch(i, num_tokens) for i in range(50)]
    log = EventLog(1, ["full_attention"], [None], EventLogConfig(max_bytes=1 << 40, max_batches=10**7))
    tracemalloc.start()
    try:
        for i in range(2000):
            entry = log.append(batches[i % 50])
            if encode:
                encoded_batch(log, entry, pb.PAYLOAD_FORMAT_PROTOBUF, None)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 1 / 1.5 <= held / log.retained_bytes <= 1.5, (held, log.retained_bytes)


def test_trimming_to_max_bytes_bounds_the_memory():
    batches = [batch(i, 256) for i in range(50)]
    log = EventLog(1, ["full_attention"], [None], EventLogConfig(max_bytes=1 << 20))
    tracemalloc.start()
    try:
        for i in range(5000):
            encoded_batch(log, log.append(batches[i % 50]), pb.PAYLOAD_FORMAT_PROTOBUF, None)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Retention is applied at each append; the newest batch's encoding is counted after it.
    newest = log.entries_from(log.head_seq)[0]
    assert log.retained_bytes - (newest.num_bytes - len(newest.msgpack)) <= 1 << 20 and log.oldest_seq > 1
    assert held <= 1.5 * (1 << 20) + 200_000, held  # + the window's list of slots
