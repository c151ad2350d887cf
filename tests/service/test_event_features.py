"""Each event feature end to end through the service, read through StreamEvents and TakeEvents.

The scenarios are the unit tests' block_size-4 ones (tests/unit/test_kv_cache_manager.py), run
over gRPC: exact block ids, hit lengths and event lists. Every scenario ends with a sentinel batch
so that "nothing was published" is shown by the next batch's seq, not by waiting.
"""

from __future__ import annotations

import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from tests.service.helpers import FULL_SLIDING, READERS, H, StreamReader, events_of, hashes, removed, stored

pytestmark = pytest.mark.timeout(30)

SENTINEL = list(range(200, 204))
"""A one-block prompt no scenario shares: its allocation publishes one BlockStored."""


def ids(groups) -> list[list[int]]:
    """Block ids per group of a repeated GroupBlockIds."""
    return [list(g.block_ids) for g in groups]


async def publish_sentinel(client, request_id: str = "sentinel") -> None:
    await client.get_computed_blocks(request_id, SENTINEL)
    assert (await client.allocate_slots(request_id, 4)).allocated


@pytest.mark.parametrize("reader_kind", READERS)
@pytest.mark.parametrize("mode", ["full", "incremental"])
async def test_reuse_report_once_on_admission(kv_server, client, reader_kind, mode):
    reader = await READERS[reader_kind].open(client, kv_server)

    hit = await client.get_computed_blocks("A", range(1, 13), kv_cache_report_mode=mode)
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (0, [[]])
    a = await client.allocate_slots("A", 12)
    assert (
        a.allocated,
        ids(a.new_block_ids),
        a.num_new_computed_tokens,
        a.num_scheduled_tokens,
        a.num_computed_tokens,
        a.num_tokens,
    ) == (True, [[1, 2, 3]], 0, 12, 12, 12)
    assert (await client.free("A")).num_freed_blocks == 3
    [batch] = await reader.batches(1)
    assert (batch.seq, batch.snapshot) == (1, False)
    assert events_of(batch) == [stored(H[:3], None, range(1, 13))]

    hit = await client.get_computed_blocks("B", [*range(1, 9), 99], kv_cache_report_mode=mode)
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (8, [[1, 2]])
    b = await client.allocate_slots("B", 9)
    assert (
        b.allocated,
        ids(b.new_block_ids),
        b.num_new_computed_tokens,
        ids(b.computed_block_ids),
        b.num_scheduled_tokens,
        b.num_computed_tokens,
        b.num_tokens,
    ) == (True, [[4]], 8, [[1, 2]], 1, 9, 9)
    # Decoding further never reports the hit again.
    decode = await client.allocate_slots("B", 1, new_token_ids=[100])
    assert (ids(decode.new_block_ids), decode.num_new_computed_tokens, decode.num_computed_tokens) == ([[]], 0, 10)
    # A lookup not followed by an allocation reports nothing.
    hit = await client.get_computed_blocks("D", [*range(1, 9), 5], kv_cache_report_mode=mode)
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (8, [[1, 2]])
    assert (await client.free("D")).num_freed_blocks == 0
    await publish_sentinel(client)

    sentinel = stored(hashes(SENTINEL), None, SENTINEL)
    if mode == "full":
        reuse, last = await reader.batches(2)
        assert (reuse.seq, last.seq) == (2, 3)
        assert events_of(reuse) == [stored(H[:2], None, range(1, 9), reused=True)]
    else:
        [last] = await reader.batches(1)
        assert last.seq == 2
    assert events_of(last) == [sentinel]
    assert kv_server.engine.manager.get_block_ids("B") == ([1, 2, 4],)
    kv_server.engine.check_invariants()


@pytest.mark.parametrize("reader_kind", READERS)
async def test_session_id_on_new_and_reused_stores(kv_server, client, reader_kind):
    reader = await READERS[reader_kind].open(client, kv_server)
    await client.get_computed_blocks("A", range(1, 13), session_id="sess-A")
    await client.allocate_slots("A", 12)
    await client.free("A")
    b_prompt = [*range(1, 9), 99, 100, 101, 102]
    hit = await client.get_computed_blocks("B", b_prompt, session_id="sess-B", kv_cache_report_mode="full")
    assert hit.num_computed_tokens == 8  # the session never enters a hash or a hit
    b = await client.allocate_slots("B", 12)
    assert (ids(b.new_block_ids), ids(b.computed_block_ids), b.num_scheduled_tokens) == ([[4]], [[1, 2]], 4)
    hit = await client.get_computed_blocks("C", range(1, 14), kv_cache_report_mode="full")
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (12, [[1, 2, 3]])
    await client.allocate_slots("C", 13)

    a_batch, b_batch, c_batch = await reader.batches(3)
    assert [a_batch.seq, b_batch.seq, c_batch.seq] == [1, 2, 3]
    assert events_of(a_batch) == [stored(H[:3], None, range(1, 13), session="sess-A")]
    assert events_of(b_batch) == [
        stored(H[:2], None, range(1, 9), session="sess-B", reused=True),
        stored(hashes(b_prompt)[2:], H[1], [99, 100, 101, 102], session="sess-B"),
    ]
    assert events_of(c_batch) == [stored(H[:3], None, range(1, 13), reused=True)]


async def test_msgpack_and_protobuf_payloads_carry_the_same_events(kv_server, connect):
    proto_client, msgpack_client = await connect(kv_server), await connect(kv_server)
    proto_reader = await StreamReader.open(proto_client, kv_server)
    msgpack_reader = await StreamReader.open(msgpack_client, kv_server, payload_format="msgpack")
    await proto_client.get_computed_blocks("A", range(1, 13), session_id="s")
    await proto_client.allocate_slots("A", 12)
    [p] = await proto_reader.batches(1)
    [m] = await msgpack_reader.batches(1)
    assert (m.seq, m.epoch, list(m.events)) == (p.seq, p.epoch, [])
    assert m.msgpack and not p.msgpack
    assert events_of(m) == events_of(p) == [stored(H[:3], None, range(1, 13), session="s")]


GEMMA = {**FULL_SLIDING, "num_blocks": 17, "max_model_len": 64}
FULL = {"group": 0, "kind": "full_attention", "window": None}
SLIDING = {"group": 1, "kind": "sliding_window", "window": 1024}


@pytest.mark.parametrize("reader_kind", READERS)
async def test_hybrid_groups_put_kind_and_window_on_every_event(start_kv_server, connect, reader_kind):
    running = await start_kv_server(**GEMMA)
    client = await connect(running)
    reader = await READERS[reader_kind].open(client, running)

    await client.get_computed_blocks("A", range(1, 13))
    a = await client.allocate_slots("A", 12)
    assert ids(a.new_block_ids) == [[1, 2, 3], [4, 5, 6]]
    assert (await client.free("A")).num_freed_blocks == 6
    hit = await client.get_computed_blocks("B", [*range(1, 9), 99], kv_cache_report_mode="full")
    assert (hit.num_computed_tokens, ids(hit.block_ids)) == (8, [[1, 2], [4, 5]])
    b = await client.allocate_slots("B", 9)
    assert (ids(b.new_block_ids), ids(b.computed_block_ids)) == ([[7], [8]], [[1, 2], [4, 5]])
    # Free queue now: 9..16, then A's cached tails 3 (group 0) and 6 (group 1): C evicts both.
    c_prompt = list(range(200, 220))
    await client.get_computed_blocks("C", c_prompt)
    c = await client.allocate_slots("C", 20)
    assert ids(c.new_block_ids) == [[9, 10, 11, 12, 13], [14, 15, 16, 3, 6]]

    a_batch, b_batch, c_batch = await reader.batches(3)
    assert events_of(a_batch) == [
        stored(H[:3], None, range(1, 13), **FULL),
        stored(H[:3], None, range(1, 13), **SLIDING),
    ]
    assert events_of(b_batch) == [
        stored(H[:2], None, range(1, 9), reused=True, **FULL),
        stored(H[:2], None, range(1, 9), reused=True, **SLIDING),
    ]
    assert events_of(c_batch) == [
        removed([H[2]], **FULL),
        removed([H[2]], **SLIDING),
        stored(hashes(c_prompt), None, c_prompt, **FULL),
        stored(hashes(c_prompt), None, c_prompt, **SLIDING),
    ]
    running.engine.check_invariants()


async def test_group_metadata_of_a_two_group_hybrid(start_kv_server, connect):
    running = await start_kv_server(**GEMMA)
    client = await connect(running)
    reader = await StreamReader.open(client, running)
    await publish_sentinel(client)
    [batch] = await reader.batches(1)

    meta = await client.get_kv_cache_group_metadata()
    page_size_bytes = 2 * 4 * 16 * 128 * 2  # K and V, block_size 4, 16 KV heads x 128, bf16
    assert list(meta.groups) == [
        pb.KVCacheGroupMetadata(
            group_idx=0,
            kind=pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
            block_size=4,
            num_blocks=17,
            dtype="bfloat16",
            bytes_per_block=10 * page_size_bytes,
            device="meta",
            num_layers=10,
            page_size_bytes=page_size_bytes,
            layer_names=[f"layers.{i}" for i in range(10)],
        ),
        pb.KVCacheGroupMetadata(
            group_idx=1,
            kind=pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
            block_size=4,
            sliding_window=1024,
            num_blocks=17,
            dtype="bfloat16",
            bytes_per_block=10 * page_size_bytes,
            device="meta",
            num_layers=10,
            page_size_bytes=page_size_bytes,
            layer_names=[f"layers.{i}" for i in range(10, 20)],
        ),
    ]
    assert (meta.groups[0].bytes_per_block, meta.groups[1].bytes_per_block) == (327680, 327680)
    assert not meta.groups[0].HasField("sliding_window")
    assert not any(g.HasField("attention_chunk_size") for g in meta.groups)
    assert (
        (meta.hash_algorithm, meta.hash_seed)
        == (DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED)
        == ("sha256_cbor", "vllm-none-hash")
    )
    assert meta.hash_block_size == 4
    assert meta.epoch == batch.epoch == running.event_log.epoch
    assert meta.block_hash_format == pb.BLOCK_HASH_FORMAT_INT64
    assert (meta.medium, meta.max_model_len, meta.preset, meta.head_seq) == ("GPU", 64, "full-sliding", 1)
    assert not meta.HasField("data_parallel_rank")


@pytest.mark.parametrize("payload_format", ["protobuf", "msgpack"])
async def test_digest_hash_format_publishes_full_digests(start_kv_server, connect, payload_format):
    from kvservice_client.hashing import BlockHasher

    running = await start_kv_server(block_hash_format="digest")
    client = await connect(running)
    meta = await client.get_kv_cache_group_metadata()
    assert meta.block_hash_format == pb.BLOCK_HASH_FORMAT_DIGEST
    reader = await StreamReader.open(client, running, payload_format=payload_format)
    await client.get_computed_blocks("A", range(1, 13))
    await client.allocate_slots("A", 12)
    [batch] = await reader.batches(1)
    digests = BlockHasher(4).hash_prompt(range(1, 13))
    [event] = events_of(batch)
    assert event.block_hashes == digests and all(len(h) == 32 for h in event.block_hashes)
    assert event.parent_block_hash is None and event.token_ids == list(range(1, 13))
    if payload_format == "protobuf":
        proto_event = batch.events[0].block_stored
        assert list(proto_event.block_hash_digests) == digests and not proto_event.block_hashes
