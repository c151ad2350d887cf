"""kvservice_client.convert: msgspec events <-> kvservice.v1 protos, exact both ways."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice_client import convert
from kvservice_client import events as ev
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

UINT64_MAX = (1 << 64) - 1


def _wire(msg):  # type: ignore[no-untyped-def]
    """Serialize and parse back, so every test also crosses the wire."""
    return type(msg).FromString(msg.SerializeToString())


def _stored(**overrides):  # type: ignore[no-untyped-def]
    fields = dict(
        block_hashes=[11, 12],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    fields.update(overrides)
    return ev.BlockStored(**fields)


# --- exact values -------------------------------------------------------------------------------


def test_block_stored_with_every_field_maps_field_by_field() -> None:
    event = ev.BlockStored(
        block_hashes=[UINT64_MAX, 7],
        parent_block_hash=5,
        token_ids=[10, 11, 12, 13],
        block_size=2,
        lora_id=3,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[["adapter", ["img-1", 0], "salt"], ["adapter", ["img-1", -2]]],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        session_id="sess-9",
        reused=True,
    )
    expected = pb.KVEvent(
        block_stored=pb.BlockStored(
            block_hashes=[UINT64_MAX, 7],
            parent_block_hash=5,
            token_ids=[10, 11, 12, 13],
            block_size=2,
            lora_id=3,
            medium="GPU",
            lora_name="adapter",
            extra_keys=[
                pb.BlockExtraKeys(
                    keys=[
                        pb.ExtraKey(lora_name="adapter"),
                        pb.ExtraKey(mm=pb.MultiModalKey(identifier="img-1", offset=0)),
                        pb.ExtraKey(cache_salt="salt"),
                    ]
                ),
                pb.BlockExtraKeys(
                    keys=[
                        pb.ExtraKey(lora_name="adapter"),
                        pb.ExtraKey(mm=pb.MultiModalKey(identifier="img-1", offset=-2)),
                    ]
                ),
            ],
            group_idx=1,
            kv_cache_spec_kind=pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
            kv_cache_spec_sliding_window=128,
            session_id="sess-9",
            reused=True,
        )
    )
    msg = convert.event_to_proto(event)
    assert msg == expected
    assert convert.proto_to_event(_wire(msg)) == event
    assert convert.proto_to_event(msg.block_stored) == event


def test_block_stored_minimal_leaves_optional_fields_unset() -> None:
    event = _stored(medium=None)
    msg = convert.event_to_proto(event).block_stored
    for field in (
        "parent_block_hash",
        "parent_block_hash_digest",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_sliding_window",
        "session_id",
    ):
        assert not msg.HasField(field), field
    assert msg.kv_cache_spec_kind == pb.KV_CACHE_SPEC_KIND_UNSPECIFIED
    assert list(msg.extra_keys) == []
    assert list(msg.block_hash_digests) == []
    back = convert.proto_to_event(_wire(convert.event_to_proto(event)))
    assert back == event
    assert back.medium is None and back.group_idx is None and back.kv_cache_spec_kind is None


def test_group_zero_and_empty_medium_are_kept_apart_from_none() -> None:
    event = _stored(group_idx=0, medium="")
    msg = convert.event_to_proto(event).block_stored
    assert msg.HasField("group_idx") and msg.group_idx == 0
    assert msg.HasField("medium") and msg.medium == ""
    back = convert.proto_to_event(_wire(convert.event_to_proto(event)))
    assert back.group_idx == 0 and back.medium == ""


def test_digest_hashes_and_digest_parent_use_the_digest_fields() -> None:
    digests = [bytes(range(32)), b"\xff" * 32]
    event = _stored(block_hashes=digests, parent_block_hash=b"\x01" * 32)
    msg = convert.event_to_proto(event).block_stored
    assert list(msg.block_hash_digests) == digests
    assert list(msg.block_hashes) == []
    assert msg.parent_block_hash_digest == b"\x01" * 32
    assert not msg.HasField("parent_block_hash")
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))) == event


def test_parent_zero_int_is_not_none() -> None:
    event = _stored(parent_block_hash=0)
    msg = convert.event_to_proto(event).block_stored
    assert msg.HasField("parent_block_hash") and msg.parent_block_hash == 0
    assert convert.proto_to_event(msg).parent_block_hash == 0


def test_salt_equal_to_lora_name_is_tagged_by_position() -> None:
    # vLLM: the LoRA name first on every block, the salt last on block 0. A salt spelled like the
    # LoRA name is still a salt.
    event = _stored(lora_id=1, lora_name="x", extra_keys=[["x", "x"], ["x"]])
    blocks = convert.event_to_proto(event).block_stored.extra_keys
    assert [[k.WhichOneof("key") for k in b.keys] for b in blocks] == [["lora_name", "cache_salt"], ["lora_name"]]
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))) == event


def test_strings_without_a_lora_are_salts_and_none_blocks_are_empty() -> None:
    event = _stored(extra_keys=[["salt"], None])
    blocks = convert.event_to_proto(event).block_stored.extra_keys
    assert blocks[0] == pb.BlockExtraKeys(keys=[pb.ExtraKey(cache_salt="salt")])
    assert blocks[1] == pb.BlockExtraKeys()
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))).extra_keys == [["salt"], None]


def test_extra_keys_all_none_blocks_round_trip() -> None:
    event = _stored(extra_keys=[None, None])
    assert len(convert.event_to_proto(event).block_stored.extra_keys) == 2
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))).extra_keys == [None, None]


def test_mm_key_given_as_tuple_reads_back_as_list() -> None:
    event = _stored(extra_keys=[[("img", 4)], None])
    back = convert.proto_to_event(convert.event_to_proto(event))
    assert back.extra_keys == [[["img", 4]], None]


def test_block_removed_maps_field_by_field() -> None:
    event = ev.BlockRemoved(
        block_hashes=[1, 2, 3],
        medium="CPU",
        group_idx=2,
        kv_cache_spec_kind="chunked_local_attention",
        kv_cache_spec_sliding_window=None,
    )
    msg = convert.event_to_proto(event)
    assert msg == pb.KVEvent(
        block_removed=pb.BlockRemoved(
            block_hashes=[1, 2, 3],
            medium="CPU",
            group_idx=2,
            kv_cache_spec_kind=pb.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION,
        )
    )
    assert convert.proto_to_event(_wire(msg)) == event


def test_block_removed_minimal_and_with_digests() -> None:
    event = ev.BlockRemoved(block_hashes=[b"ab"], medium=None)
    msg = convert.event_to_proto(event).block_removed
    assert list(msg.block_hash_digests) == [b"ab"]
    assert not msg.HasField("medium") and not msg.HasField("group_idx")
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))) == event
    windowed = ev.BlockRemoved(
        block_hashes=[9],
        medium="GPU",
        group_idx=0,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )
    assert convert.proto_to_event(_wire(convert.event_to_proto(windowed))) == windowed


def test_all_blocks_cleared() -> None:
    msg = convert.event_to_proto(ev.AllBlocksCleared())
    assert msg.WhichOneof("event") == "all_blocks_cleared"
    assert msg.SerializeToString() == b"\x1a\x00"
    assert convert.proto_to_event(_wire(msg)) == ev.AllBlocksCleared()
    assert convert.proto_to_event(pb.AllBlocksCleared()) == ev.AllBlocksCleared()


# --- kinds --------------------------------------------------------------------------------------


def test_kind_table_covers_every_proto_kind_and_the_server_enum() -> None:
    proto_kinds = {v.number for v in pb.KVCacheSpecKind.DESCRIPTOR.values} - {pb.KV_CACHE_SPEC_KIND_UNSPECIFIED}
    assert set(convert.KV_CACHE_SPEC_KIND_FROM_PROTO) == proto_kinds
    for kind, number in convert.KV_CACHE_SPEC_KIND_TO_PROTO.items():
        assert pb.KVCacheSpecKind.Name(number) == "KV_CACHE_SPEC_KIND_" + kind.upper()
    kv_cache_spec = pytest.importorskip("kvservice.core.kv_cache_spec")
    assert set(convert.KV_CACHE_SPEC_KIND_TO_PROTO) == {k.value for k in kv_cache_spec.KVCacheSpecKind}


def test_kind_edges() -> None:
    assert convert.kv_cache_spec_kind_to_proto(None) == pb.KV_CACHE_SPEC_KIND_UNSPECIFIED
    assert convert.kv_cache_spec_kind_from_proto(pb.KV_CACHE_SPEC_KIND_UNSPECIFIED) is None
    assert convert.kv_cache_spec_kind_from_proto(999) == "unknown"  # a newer server's kind
    with pytest.raises(ValueError, match="kv_cache_spec_kind must be one of .*; got 'attention'"):
        convert.event_to_proto(_stored(kv_cache_spec_kind="attention"))


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "match"),
    [
        (_stored(block_hashes=[1, b"x"]), "mixes int hashes and bytes digests"),
        (_stored(block_hashes=[b"x", 1]), "mixes bytes digests and int hashes"),
        (_stored(block_hashes=[1 << 64]), "block_hashes: 18446744073709551616 is not an unsigned 64-bit int"),
        (_stored(block_hashes=[-1]), "not an unsigned 64-bit int"),
        (_stored(parent_block_hash=-5), "parent_block_hash: -5 is not an unsigned 64-bit int"),
        (_stored(locality=7), "locality: 7 is not a string"),
        (_stored(ownership={"a": 1}), r"ownership: \{'a': 1\} is not a string"),
        (_stored(lookahead_token_ids=[[1]]), "lookahead_token_ids has no kvservice.v1 field"),
        (_stored(extra_keys=[]), "extra_keys: an empty list cannot be told from None"),
        (_stored(extra_keys=[[]]), r"extra_keys\[0\]: expected None or a non-empty list"),
        (_stored(extra_keys=[[3]]), r"extra_keys\[0\]\[0\]: expected a str"),
        (_stored(extra_keys=[None, [["img"]]]), r"extra_keys\[1\]\[0\]"),
        (_stored(extra_keys=[[["img", 1 << 31]]]), r"extra_keys\[0\]\[0\]"),
        (_stored(extra_keys=[[["img", True]]]), r"extra_keys\[0\]\[0\]"),
        (ev.BlockRemoved(block_hashes=[1], medium=None, locality=1), "BlockRemoved: locality: 1 is not a string"),
    ],
)
def test_event_to_proto_refuses_what_the_proto_cannot_carry(event: ev.KVCacheEvent, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        convert.event_to_proto(event)


def test_event_to_proto_refuses_a_non_event() -> None:
    with pytest.raises(TypeError, match="got KVEventBatch"):
        convert.event_to_proto(ev.KVEventBatch(ts=0.0, events=[]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (pb.KVEvent(), "KVEvent: no event set"),
        (
            pb.BlockStored(block_hashes=[1], block_hash_digests=[b"x"]),
            "BlockStored: both block_hashes and block_hash_digests",
        ),
        (pb.BlockRemoved(block_hashes=[1], block_hash_digests=[b"x"]), "BlockRemoved: both block_hashes"),
        (
            pb.BlockStored(parent_block_hash=1, parent_block_hash_digest=b"x"),
            "both parent_block_hash and parent_block_hash_digest",
        ),
        (
            pb.BlockStored(extra_keys=[pb.BlockExtraKeys(keys=[pb.ExtraKey()])]),
            r"extra_keys\[0\]\.keys\[0\]: no key set",
        ),
    ],
)
def test_proto_to_event_refuses_malformed_messages(msg: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        convert.proto_to_event(msg)  # type: ignore[arg-type]


def test_proto_to_event_refuses_other_messages() -> None:
    with pytest.raises(TypeError, match="got PingRequest"):
        convert.proto_to_event(pb.PingRequest())  # type: ignore[arg-type]


# --- batches ------------------------------------------------------------------------------------

BATCH = ev.KVEventBatch(
    ts=1700000000.25,
    events=[
        _stored(group_idx=0, kv_cache_spec_kind="full_attention"),
        ev.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
        ev.AllBlocksCleared(),
    ],
    data_parallel_rank=3,
)


@pytest.mark.parametrize("payload_format", ["protobuf", pb.PAYLOAD_FORMAT_PROTOBUF, pb.PAYLOAD_FORMAT_UNSPECIFIED])
def test_batch_protobuf_payload_fills_events(payload_format: convert.PayloadFormatLike) -> None:
    msg = convert.batch_to_proto(BATCH, seq=7, epoch="ep-1", payload_format=payload_format)
    assert msg == pb.EventBatch(
        seq=7,
        epoch="ep-1",
        ts=1700000000.25,
        events=[convert.event_to_proto(e) for e in BATCH.events],
        data_parallel_rank=3,
    )
    assert msg.msgpack == b"" and not msg.snapshot
    assert convert.proto_to_batch(_wire(msg)) == BATCH


@pytest.mark.parametrize("payload_format", ["msgpack", pb.PAYLOAD_FORMAT_MSGPACK])
def test_batch_msgpack_payload_fills_msgpack_only(payload_format: convert.PayloadFormatLike) -> None:
    msg = convert.batch_to_proto(BATCH, seq=8, epoch="ep-1", snapshot=True, payload_format=payload_format)
    assert msg.msgpack == ev.encode_event_batch(BATCH)
    assert len(msg.events) == 0
    assert (msg.seq, msg.epoch, msg.ts, msg.data_parallel_rank, msg.snapshot) == (8, "ep-1", BATCH.ts, 3, True)
    assert convert.proto_to_batch(_wire(msg)) == BATCH


def test_msgpack_payload_carries_fields_the_proto_has_not() -> None:
    batch = ev.KVEventBatch(ts=2.0, events=[_stored(locality="rack-1", lookahead_token_ids=[[5]])])
    msg = convert.batch_to_proto(batch, seq=1, epoch="e", payload_format="msgpack")
    assert not msg.HasField("data_parallel_rank")
    assert convert.proto_to_batch(_wire(msg)) == batch
    with pytest.raises(ValueError, match="lookahead_token_ids"):
        convert.batch_to_proto(batch, seq=1, epoch="e")


def test_locality_and_ownership_round_trip_through_the_proto() -> None:
    """vLLM 0.33's locality / ownership strings (a tier's server publishes them: docs/tier.md)."""
    batch = ev.KVEventBatch(
        ts=2.0,
        events=[
            _stored(locality="LOCAL", ownership="kvservice"),
            ev.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0, locality="LOCAL", ownership="kvservice"),
        ],
    )
    msg = convert.batch_to_proto(batch, seq=1, epoch="e")
    assert (msg.events[0].block_stored.locality, msg.events[1].block_removed.ownership) == ("LOCAL", "kvservice")
    assert convert.proto_to_batch(_wire(msg)) == batch


def test_empty_batch_and_no_rank() -> None:
    batch = ev.KVEventBatch(ts=0.0, events=[])
    for payload_format in ("protobuf", "msgpack"):
        msg = convert.batch_to_proto(batch, seq=0, epoch="", payload_format=payload_format)  # type: ignore[arg-type]
        assert not msg.HasField("data_parallel_rank")
        assert convert.proto_to_batch(_wire(msg)) == batch


def test_batch_edges() -> None:
    with pytest.raises(ValueError, match="payload_format must be 'protobuf' or 'msgpack'; got 'json'"):
        convert.batch_to_proto(BATCH, seq=1, epoch="e", payload_format="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown PayloadFormat value 9"):
        convert.batch_to_proto(BATCH, seq=1, epoch="e", payload_format=9)
    both = convert.batch_to_proto(BATCH, seq=1, epoch="e")
    both.msgpack = ev.encode_event_batch(BATCH)
    with pytest.raises(ValueError, match="both events and msgpack"):
        convert.proto_to_batch(both)


# --- hypothesis round trips ---------------------------------------------------------------------

_texts = st.text(st.characters(codec="utf-8"), max_size=6)
_names = st.one_of(st.text("ab", max_size=2), _texts)  # small alphabet: LoRA names collide with salts
_uint32 = st.integers(0, (1 << 32) - 1)
_int32 = st.integers(-(1 << 31), (1 << 31) - 1)
_int64 = st.integers(-(1 << 63), (1 << 63) - 1)
_uint64 = st.integers(0, UINT64_MAX)
_digest = st.binary(max_size=33)
_hash_lists = st.one_of(st.lists(_uint64, max_size=4), st.lists(_digest, min_size=1, max_size=4))
_parents = st.one_of(st.none(), _uint64, _digest)
_kinds = st.one_of(st.none(), st.sampled_from(sorted(convert.KV_CACHE_SPEC_KIND_TO_PROTO)))
_keys = st.one_of(_names, st.tuples(_texts, _int32).map(list))
_extra_keys = st.one_of(
    st.none(), st.lists(st.one_of(st.none(), st.lists(_keys, min_size=1, max_size=3)), min_size=1, max_size=4)
)

block_stored_events = st.builds(
    ev.BlockStored,
    block_hashes=_hash_lists,
    parent_block_hash=_parents,
    token_ids=st.lists(_int64, max_size=8),
    block_size=_uint32,
    lora_id=st.one_of(st.none(), _int64),
    medium=st.one_of(st.none(), _texts),
    lora_name=st.one_of(st.none(), _names),
    extra_keys=_extra_keys,
    group_idx=st.one_of(st.none(), _uint32),
    kv_cache_spec_kind=_kinds,
    kv_cache_spec_sliding_window=st.one_of(st.none(), _uint32),
    session_id=st.one_of(st.none(), _texts),
    reused=st.booleans(),
)
block_removed_events = st.builds(
    ev.BlockRemoved,
    block_hashes=_hash_lists,
    medium=st.one_of(st.none(), _texts),
    group_idx=st.one_of(st.none(), _uint32),
    kv_cache_spec_kind=_kinds,
    kv_cache_spec_sliding_window=st.one_of(st.none(), _uint32),
)
kv_events = st.one_of(block_stored_events, block_removed_events, st.just(ev.AllBlocksCleared()))
batches = st.builds(
    ev.KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(kv_events, max_size=4),
    data_parallel_rank=st.one_of(st.none(), _int32),
)


@settings(max_examples=300, deadline=None)
@given(kv_events)
def test_event_round_trip_is_exact(event: ev.KVCacheEvent) -> None:
    assert convert.proto_to_event(_wire(convert.event_to_proto(event))) == event


@settings(max_examples=150, deadline=None)
@given(batches, st.sampled_from(["protobuf", "msgpack"]), _uint64, _texts, st.booleans())
def test_batch_round_trip_is_exact(
    batch: ev.KVEventBatch, payload_format: str, seq: int, epoch: str, snapshot: bool
) -> None:
    msg = _wire(convert.batch_to_proto(batch, seq=seq, epoch=epoch, snapshot=snapshot, payload_format=payload_format))  # type: ignore[arg-type]
    assert (msg.seq, msg.epoch, msg.snapshot) == (seq, epoch, snapshot)
    assert convert.proto_to_batch(msg) == batch
