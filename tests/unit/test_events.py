"""KV event structs: vLLM's wire bytes both ways, compatibility with readers without our fields."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvservice_client.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
)
from tests.conftest import VECTORS_DIR

LINES = (VECTORS_DIR / "vllm_kv_event_batches.jsonl").read_text().splitlines()
LAYOUT = json.loads(LINES[0])
BATCHES = [json.loads(line) for line in LINES[1:]]


def test_field_order_is_vllms_then_ours():
    ours_stored = list(BlockStored.__struct_fields__)
    assert ours_stored[: len(LAYOUT["struct_fields"]["BlockStored"])] == LAYOUT["struct_fields"]["BlockStored"]
    assert ours_stored[len(LAYOUT["struct_fields"]["BlockStored"]) :] == ["reused"]
    ours_removed = list(BlockRemoved.__struct_fields__)
    assert ours_removed[:5] == LAYOUT["struct_fields"]["BlockRemoved"]
    assert list(KVEventBatch.__struct_fields__) == LAYOUT["struct_fields"]["KVEventBatch"]
    assert BlockStored.__struct_config__.tag == "BlockStored" and BlockStored.__struct_config__.tag_field == "type"
    assert KVEventBatch.__struct_config__.array_like


@pytest.mark.parametrize("vector", BATCHES, ids=lambda v: v["name"])
def test_vllm_bytes_decode_and_reencode_identically(vector):
    data = bytes.fromhex(vector["msgpack_hex"])
    batch = decode_event_batch(data)
    assert encode_event_batch(batch) == data
    # The decoded form equals the vector's JSON view.
    assert msgspec.to_builtins(batch) == vector["decoded"]


def test_our_batch_encodes_to_vllm_bytes():
    batch = KVEventBatch(
        ts=2.5,
        events=[
            BlockStored(
                block_hashes=[16642949654738151050],
                parent_block_hash=15292913576410714033,
                token_ids=[9, 10, 11, 12],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name="adapter-a",
                extra_keys=[["adapter-a"]],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=1024,
                session_id="session-7",
            )
        ],
        data_parallel_rank=1,
    )
    expected = next(v for v in BATCHES if v["name"] == "stored_full_fields")
    assert encode_event_batch(batch).hex() == expected["msgpack_hex"]


# A reader that predates kvservice's additions: vLLM 0.33's structs exactly (field lists from the
# vectors' first line), without `reused` and without BlockRemoved's kind/window.
class _OldStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class _OldRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


def test_old_reader_layout_is_the_vectors():
    assert list(_OldStored.__struct_fields__) == LAYOUT["struct_fields"]["BlockStored"]
    assert list(_OldRemoved.__struct_fields__) == LAYOUT["struct_fields"]["BlockRemoved"]


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_OldStored | _OldRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def test_wire_compatible_both_ways_with_reader_without_new_fields():
    stored = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None, group_idx=0)
    reused = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None, group_idx=0, reused=True)
    removed = BlockRemoved([1], "GPU", group_idx=0, kv_cache_spec_kind="full_attention")
    ours = encode_event_batch(KVEventBatch(1.0, [stored, reused, removed]))
    old = msgspec.msgpack.decode(ours, type=_OldBatch)  # unknown fields are ignored by the old reader
    assert old.events[0] == old.events[1] == _OldStored([1, 2], None, list(range(8)), 4, None, "GPU", None, group_idx=0)
    assert old.events[2] == _OldRemoved([1], "GPU", group_idx=0)
    # An event without the new fields is byte-identical to the old struct's encoding.
    assert encode_event_batch(KVEventBatch(1.0, [stored])) == msgspec.msgpack.encode(
        _OldBatch(1.0, [_OldStored([1, 2], None, list(range(8)), 4, None, "GPU", None, group_idx=0)])
    )
    # And old bytes decode here with defaults for the new fields.
    back = decode_event_batch(msgspec.msgpack.encode(old))
    assert back.events[0] == stored and back.events[1] == stored and not back.events[1].reused
    assert back.events[2] == BlockRemoved([1], "GPU", group_idx=0)


def test_equality_and_hash_cover_every_field():
    base = BlockStored(
        [1],
        None,
        [1, 2, 3, 4],
        4,
        None,
        "GPU",
        None,
        group_idx=0,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=8,
        session_id="s1",
    )
    same = BlockStored(
        [1],
        None,
        [1, 2, 3, 4],
        4,
        None,
        "GPU",
        None,
        group_idx=0,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=8,
        session_id="s1",
    )
    assert base == same and hash(base) == hash(same)
    for change in (
        {"session_id": "s2"},
        {"kv_cache_spec_sliding_window": 16},
        {"kv_cache_spec_kind": "full_attention"},
        {"reused": True},
        {"group_idx": 1},
        {"extra_keys": [["a"]]},
    ):
        other = msgspec.structs.replace(base, **change)
        assert other != base and hash(other) != hash(base), change
    assert len({base, same, msgspec.structs.replace(base, session_id=None)}) == 2
    removed = BlockRemoved([1], "GPU", group_idx=0)
    assert hash(removed) != hash(msgspec.structs.replace(removed, kv_cache_spec_sliding_window=4))
    assert AllBlocksCleared() == AllBlocksCleared() and hash(AllBlocksCleared()) == hash(AllBlocksCleared())


def test_digest_hashes_round_trip():
    digest = bytes(range(32))
    batch = KVEventBatch(1.0, [BlockStored([digest], digest, [1, 2], 2, None, "CPU", None)])
    assert decode_event_batch(encode_event_batch(batch)) == batch
