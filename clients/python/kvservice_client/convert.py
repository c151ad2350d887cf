"""Conversion between the msgspec KV events (:mod:`kvservice_client.events`) and kvservice.v1 protos.

Both directions are exact for every event the proto can carry: ``proto_to_event(event_to_proto(e))
== e``. What the proto cannot carry is refused with ``ValueError``, never silently dropped (the
msgpack payload of :func:`batch_to_proto` carries any event as is).

The mapping, field by field:

* Hashes: int hashes go to ``block_hashes`` / ``parent_block_hash`` (uint64), bytes digests to
  ``block_hash_digests`` / ``parent_block_hash_digest``. An event's ``block_hashes`` are all ints or
  all bytes (a list mixing both is refused); the parent maps on its own, by its type. A proto with
  both ``block_hashes`` and ``block_hash_digests`` set (or both parent fields) is refused.
* ``kv_cache_spec_kind``: the strings of ``kvservice.core.kv_cache_spec.KVCacheSpecKind``
  (``"sliding_window"``) <-> the ``KVCacheSpecKind`` enum (:data:`KV_CACHE_SPEC_KIND_TO_PROTO`);
  None <-> UNSPECIFIED. An unknown string is refused; an enum number this client does not know (a
  newer server's kind) reads as ``"unknown"``.
* ``medium``, ``group_idx``, ``lora_id``, ``lora_name``, ``session_id``,
  ``kv_cache_spec_sliding_window``, ``data_parallel_rank``: None <-> the optional field unset.
* ``extra_keys``: None <-> an empty ``repeated BlockExtraKeys``; per block, None <-> a
  ``BlockExtraKeys`` with no keys; a multimodal key ``[identifier, offset]`` (list or tuple; read
  back as a list, as msgpack decodes it; ``offset`` relative to the block's first token, negative
  when the input began in an earlier block, as vLLM 0.33's) <-> ``ExtraKey.mm``. vLLM publishes the LoRA name and the
  cache salt as bare strings; the proto tags them. A block's *first* key is the LoRA name when it
  equals the event's ``lora_name`` (vLLM puts the LoRA name first on every block of a LoRA request
  and the salt last, on block 0 only), so it becomes ``ExtraKey.lora_name``; every other string
  becomes ``ExtraKey.cache_salt``. The tag only adds meaning: both tags read back as the bare
  string, so the round trip is exact whatever the strings are. An empty ``extra_keys`` list, or an
  empty key list for a block, is refused (the proto spells "none" one way only: use None).
* ``locality``, ``ownership`` (vLLM 0.33's strings: "LOCAL"/"REMOTE", a secondary tier's name):
  None <-> the optional field unset; a value that is not a string is refused.
* ``lookahead_token_ids`` (a vLLM field kvservice never sets) has no proto field: an event with it
  set is refused by :func:`event_to_proto`.

This module imports gRPC's protobuf stubs but not ``grpc`` itself, and never the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Union, cast

from kvservice_client import events as ev
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

__all__ = [
    "KV_CACHE_SPEC_KIND_FROM_PROTO",
    "KV_CACHE_SPEC_KIND_TO_PROTO",
    "PayloadFormatLike",
    "batch_to_proto",
    "event_to_proto",
    "kv_cache_spec_kind_from_proto",
    "kv_cache_spec_kind_to_proto",
    "payload_format_value",
    "proto_to_batch",
    "proto_to_event",
]

KV_CACHE_SPEC_KIND_TO_PROTO: dict[str, pb.KVCacheSpecKind.ValueType] = {
    "full_attention": pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
    "mla_attention": pb.KV_CACHE_SPEC_KIND_MLA_ATTENTION,
    "sliding_window": pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
    "sliding_window_mla": pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW_MLA,
    "mamba": pb.KV_CACHE_SPEC_KIND_MAMBA,
    "chunked_local_attention": pb.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION,
    "sink_full_attention": pb.KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION,
    "encoder_only_attention": pb.KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION,
    "cross_attention": pb.KV_CACHE_SPEC_KIND_CROSS_ATTENTION,
    "unknown": pb.KV_CACHE_SPEC_KIND_UNKNOWN,
}
"""Event kind string (a ``KVCacheSpecKind`` value, kept here so the client never imports the server)
-> proto ``KVCacheSpecKind`` number."""

KV_CACHE_SPEC_KIND_FROM_PROTO: dict[int, str] = {v: k for k, v in KV_CACHE_SPEC_KIND_TO_PROTO.items()}
"""Proto ``KVCacheSpecKind`` number -> event kind string (UNSPECIFIED is absent: it means None)."""

PayloadFormatLike = Union[Literal["protobuf", "msgpack"], int]
"""A payload format: ``"protobuf"``, ``"msgpack"`` or a ``PayloadFormat`` enum value."""

_PAYLOAD_FORMATS: dict[str, pb.PayloadFormat.ValueType] = {
    "protobuf": pb.PAYLOAD_FORMAT_PROTOBUF,
    "msgpack": pb.PAYLOAD_FORMAT_MSGPACK,
}


def payload_format_value(payload_format: PayloadFormatLike) -> pb.PayloadFormat.ValueType:
    """The ``PayloadFormat`` enum value of ``payload_format``.

    Raises:
        ValueError: an unknown name or number.
    """
    if isinstance(payload_format, str):
        try:
            return _PAYLOAD_FORMATS[payload_format]
        except KeyError:
            raise ValueError(f"payload_format must be 'protobuf' or 'msgpack'; got {payload_format!r}") from None
    if payload_format not in pb.PayloadFormat.values():
        raise ValueError(f"payload_format: unknown PayloadFormat value {payload_format!r}")
    return pb.PayloadFormat.ValueType(payload_format)


def kv_cache_spec_kind_to_proto(kind: str | None) -> pb.KVCacheSpecKind.ValueType:
    """The proto ``KVCacheSpecKind`` of an event's kind string (None -> UNSPECIFIED).

    Raises:
        ValueError: ``kind`` is not a known kind string.
    """
    if kind is None:
        return pb.KV_CACHE_SPEC_KIND_UNSPECIFIED
    try:
        return KV_CACHE_SPEC_KIND_TO_PROTO[kind]
    except KeyError:
        raise ValueError(
            f"kv_cache_spec_kind must be one of {', '.join(KV_CACHE_SPEC_KIND_TO_PROTO)} or None; got {kind!r}"
        ) from None


def kv_cache_spec_kind_from_proto(kind: int) -> str | None:
    """The event kind string of a proto ``KVCacheSpecKind`` (UNSPECIFIED -> None; a number this
    client does not know -> ``"unknown"``)."""
    if kind == pb.KV_CACHE_SPEC_KIND_UNSPECIFIED:
        return None
    return KV_CACHE_SPEC_KIND_FROM_PROTO.get(kind, "unknown")


def event_to_proto(event: ev.KVCacheEvent) -> pb.KVEvent:
    """Convert a msgspec event to a ``kvservice.v1.KVEvent``.

    Args:
        event: a :class:`~kvservice_client.events.BlockStored`,
            :class:`~kvservice_client.events.BlockRemoved` or
            :class:`~kvservice_client.events.AllBlocksCleared`.

    Returns:
        The ``KVEvent`` with the matching oneof member set.

    Raises:
        ValueError: the event holds something the proto cannot carry (see the module docstring:
            mixed hash types, an unknown kind, ``locality``/``ownership``/``lookahead_token_ids``,
            an empty ``extra_keys`` list, a malformed extra key) or a value out of its field's range
            (a hash >= 2**64, a negative block size ...).
        TypeError: ``event`` is not one of the three event types.
    """
    msg = pb.KVEvent()
    _fill_kv_event(msg, event)
    return msg


def proto_to_event(
    msg: pb.KVEvent | pb.BlockStored | pb.BlockRemoved | pb.AllBlocksCleared,
) -> ev.KVEvent:
    """Convert a ``kvservice.v1`` event message (the ``KVEvent`` wrapper or one of its members).

    Returns:
        The msgspec event.

    Raises:
        ValueError: a ``KVEvent`` with no member set, or an event with both hash forms set.
        TypeError: ``msg`` is not one of the four message types.
    """
    if isinstance(msg, pb.KVEvent):
        which = msg.WhichOneof("event")
        if which is None:
            raise ValueError("KVEvent: no event set")
        msg = getattr(msg, which)
    if isinstance(msg, pb.BlockStored):
        return _block_stored_from_proto(msg)
    if isinstance(msg, pb.BlockRemoved):
        return _block_removed_from_proto(msg)
    if isinstance(msg, pb.AllBlocksCleared):
        return ev.AllBlocksCleared()
    raise TypeError(f"expected a kvservice.v1 event message; got {type(msg).__name__}")


def batch_to_proto(
    batch: ev.KVEventBatch,
    *,
    seq: int,
    epoch: str,
    snapshot: bool = False,
    payload_format: PayloadFormatLike = pb.PAYLOAD_FORMAT_PROTOBUF,
) -> pb.EventBatch:
    """Convert a :class:`~kvservice_client.events.KVEventBatch` to a ``kvservice.v1.EventBatch``.

    ``ts`` and ``data_parallel_rank`` are copied to the proto in both formats.

    Args:
        batch: the events of one mutating call (or a snapshot).
        seq: the batch's sequence number in its epoch (>= 0).
        epoch: the server epoch.
        snapshot: True for a snapshot batch.
        payload_format: ``"protobuf"`` (or UNSPECIFIED / PROTOBUF) fills ``events``;
            ``"msgpack"`` fills ``msgpack`` with :func:`~kvservice_client.events.encode_event_batch`
            bytes (vLLM's layout) and leaves ``events`` empty.

    Returns:
        The ``EventBatch``.

    Raises:
        ValueError: an unknown payload format, or (protobuf format) an event the proto cannot
            carry (see :func:`event_to_proto`).
    """
    fmt = payload_format_value(payload_format)
    msg = pb.EventBatch(seq=seq, epoch=epoch, ts=batch.ts, snapshot=snapshot)
    if batch.data_parallel_rank is not None:
        msg.data_parallel_rank = batch.data_parallel_rank
    if fmt == pb.PAYLOAD_FORMAT_MSGPACK:
        msg.msgpack = ev.encode_event_batch(batch)
    else:
        events = msg.events
        for event in batch.events:
            _fill_kv_event(events.add(), event)
    return msg


def proto_to_batch(msg: pb.EventBatch) -> ev.KVEventBatch:
    """Convert a ``kvservice.v1.EventBatch`` to a :class:`~kvservice_client.events.KVEventBatch`.

    Decodes whichever payload is present: the ``msgpack`` bytes when set (then ``ts`` and
    ``data_parallel_rank`` come from them), else the typed ``events``. ``seq``, ``epoch`` and
    ``snapshot`` have no place in a KVEventBatch; read them from ``msg``.

    Raises:
        ValueError: both payloads are set, or an event is malformed (see :func:`proto_to_event`).
        msgspec.DecodeError / msgspec.ValidationError: the msgpack bytes are not a valid batch.
    """
    if msg.msgpack:
        if msg.events:
            raise ValueError("EventBatch: both events and msgpack are set")
        return ev.decode_event_batch(msg.msgpack)
    return ev.KVEventBatch(
        ts=msg.ts,
        events=[proto_to_event(event) for event in msg.events],
        data_parallel_rank=msg.data_parallel_rank if msg.HasField("data_parallel_rank") else None,
    )


def _fill_kv_event(out: pb.KVEvent, event: ev.KVCacheEvent) -> None:
    try:
        if isinstance(event, ev.BlockStored):
            _fill_block_stored(out.block_stored, event)
        elif isinstance(event, ev.BlockRemoved):
            _fill_block_removed(out.block_removed, event)
        elif isinstance(event, ev.AllBlocksCleared):
            out.all_blocks_cleared.SetInParent()
        else:
            raise TypeError(f"expected a BlockStored, BlockRemoved or AllBlocksCleared; got {type(event).__name__}")
    except ValueError as err:
        raise ValueError(f"{type(event).__name__}: {err}") from err


def _fill_block_stored(out: pb.BlockStored, event: ev.BlockStored) -> None:
    _refuse_unrepresentable(event, ("lookahead_token_ids",))
    _fill_hashes(out, event.block_hashes)
    parent = event.parent_block_hash
    if isinstance(parent, bytes):
        out.parent_block_hash_digest = parent
    elif parent is not None:
        out.parent_block_hash = _checked_uint64(parent, "parent_block_hash")
    out.token_ids.extend(event.token_ids)
    out.block_size = event.block_size
    if event.lora_id is not None:
        out.lora_id = event.lora_id
    if event.medium is not None:
        out.medium = event.medium
    if event.lora_name is not None:
        out.lora_name = event.lora_name
    if event.extra_keys is not None:
        _fill_extra_keys(out.extra_keys, event.extra_keys, event.lora_name)
    if event.group_idx is not None:
        out.group_idx = event.group_idx
    out.kv_cache_spec_kind = kv_cache_spec_kind_to_proto(event.kv_cache_spec_kind)
    if event.kv_cache_spec_sliding_window is not None:
        out.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
    if event.session_id is not None:
        out.session_id = event.session_id
    out.reused = event.reused
    _fill_locality(out, event)


def _fill_locality(out: pb.BlockStored | pb.BlockRemoved, event: ev.BlockStored | ev.BlockRemoved) -> None:
    """vLLM 0.33's ``locality`` and ``ownership`` (strings, or None: unset)."""
    for name in ("locality", "ownership"):
        value = getattr(event, name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{name}: {value!r} is not a string (vLLM 0.33's {name} is)")
        setattr(out, name, value)


def _fill_block_removed(out: pb.BlockRemoved, event: ev.BlockRemoved) -> None:
    _fill_hashes(out, event.block_hashes)
    if event.medium is not None:
        out.medium = event.medium
    if event.group_idx is not None:
        out.group_idx = event.group_idx
    out.kv_cache_spec_kind = kv_cache_spec_kind_to_proto(event.kv_cache_spec_kind)
    if event.kv_cache_spec_sliding_window is not None:
        out.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
    _fill_locality(out, event)


def _refuse_unrepresentable(event: ev.KVCacheEvent, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(event, name) is not None:
            raise ValueError(
                f"{name} has no kvservice.v1 field (it is carried by the msgpack payload only); got "
                f"{getattr(event, name)!r}"
            )


def _checked_uint64(value: int, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise ValueError(f"{field}: {value} is not an unsigned 64-bit int")
    return value


def _fill_hashes(out: pb.BlockStored | pb.BlockRemoved, hashes: Sequence[ev.ExternalBlockHash]) -> None:
    if not hashes:
        return
    # protobuf's repeated fields check every element's type and range in C; a failure leaves the
    # message half-filled, which is fine since the caller discards it with the error.
    try:
        if isinstance(hashes[0], bytes):
            out.block_hash_digests.extend(cast("Sequence[bytes]", hashes))  # all bytes, or protobuf refuses one (below)
        else:
            if any(type(h) is bool for h in hashes):
                raise TypeError("bool")
            out.block_hashes.extend(cast("Sequence[int]", hashes))  # all ints, or protobuf refuses one (below)
    except (TypeError, ValueError):
        bad = next((h for h in hashes if not _is_hash_like(h, hashes[0])), hashes[0])
        if isinstance(hashes[0], bytes):
            raise ValueError(f"block_hashes mixes bytes digests and int hashes ({bad!r})") from None
        if isinstance(bad, bytes):
            raise ValueError(f"block_hashes mixes int hashes and bytes digests ({bad!r})") from None
        raise ValueError(f"block_hashes: {bad} is not an unsigned 64-bit int") from None


def _is_hash_like(value: object, first: object) -> bool:
    if isinstance(first, bytes):
        return isinstance(value, bytes)
    return type(value) is int and 0 <= value < 1 << 64


def _fill_extra_keys(
    out: RepeatedCompositeFieldContainer[pb.BlockExtraKeys], extra_keys: list[Any], lora_name: str | None
) -> None:
    if not extra_keys:
        raise ValueError("extra_keys: an empty list cannot be told from None on the wire; use None")
    for block_idx, block_keys in enumerate(extra_keys):
        block = out.add()
        if block_keys is None:
            continue
        if not isinstance(block_keys, (list, tuple)) or not block_keys:
            raise ValueError(f"extra_keys[{block_idx}]: expected None or a non-empty list of keys; got {block_keys!r}")
        for key_idx, key in enumerate(block_keys):
            extra_key = block.keys.add()
            if isinstance(key, str):
                if key_idx == 0 and lora_name is not None and key == lora_name:
                    extra_key.lora_name = key
                else:
                    extra_key.cache_salt = key
            elif (
                isinstance(key, (list, tuple))
                and len(key) == 2
                and isinstance(key[0], str)
                and isinstance(key[1], int)
                and not isinstance(key[1], bool)
                and -(1 << 31) <= key[1] < 1 << 31
            ):
                extra_key.mm.SetInParent()
                extra_key.mm.identifier = key[0]
                extra_key.mm.offset = key[1]
            else:
                raise ValueError(
                    f"extra_keys[{block_idx}][{key_idx}]: expected a str (LoRA name or cache salt) or "
                    f"[identifier: str, offset: int32]; got {key!r}"
                )


def _hashes_from_proto(msg: pb.BlockStored | pb.BlockRemoved) -> list[ev.ExternalBlockHash]:
    if msg.block_hash_digests:
        if msg.block_hashes:
            raise ValueError("both block_hashes and block_hash_digests are set")
        return list(msg.block_hash_digests)
    return list(msg.block_hashes)


def _extra_keys_from_proto(blocks: Sequence[pb.BlockExtraKeys]) -> list[Any] | None:
    if not blocks:
        return None
    extra_keys: list[Any] = []
    for block_idx, block in enumerate(blocks):
        if not block.keys:
            extra_keys.append(None)
            continue
        keys: list[Any] = []
        for key_idx, key in enumerate(block.keys):
            which = key.WhichOneof("key")
            if which == "lora_name":
                keys.append(key.lora_name)
            elif which == "cache_salt":
                keys.append(key.cache_salt)
            elif which == "mm":
                keys.append([key.mm.identifier, key.mm.offset])
            else:
                raise ValueError(f"BlockStored.extra_keys[{block_idx}].keys[{key_idx}]: no key set")
        extra_keys.append(keys)
    return extra_keys


def _block_stored_from_proto(msg: pb.BlockStored) -> ev.BlockStored:
    if msg.HasField("parent_block_hash_digest"):
        if msg.HasField("parent_block_hash"):
            raise ValueError("BlockStored: both parent_block_hash and parent_block_hash_digest are set")
        parent: ev.ExternalBlockHash | None = msg.parent_block_hash_digest
    elif msg.HasField("parent_block_hash"):
        parent = msg.parent_block_hash
    else:
        parent = None
    try:
        block_hashes = _hashes_from_proto(msg)
    except ValueError as err:
        raise ValueError(f"BlockStored: {err}") from None
    return ev.BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=list(msg.token_ids),
        block_size=msg.block_size,
        lora_id=msg.lora_id if msg.HasField("lora_id") else None,
        medium=msg.medium if msg.HasField("medium") else None,
        lora_name=msg.lora_name if msg.HasField("lora_name") else None,
        extra_keys=_extra_keys_from_proto(msg.extra_keys),
        group_idx=msg.group_idx if msg.HasField("group_idx") else None,
        kv_cache_spec_kind=kv_cache_spec_kind_from_proto(msg.kv_cache_spec_kind),
        kv_cache_spec_sliding_window=(
            msg.kv_cache_spec_sliding_window if msg.HasField("kv_cache_spec_sliding_window") else None
        ),
        locality=msg.locality if msg.HasField("locality") else None,
        ownership=msg.ownership if msg.HasField("ownership") else None,
        session_id=msg.session_id if msg.HasField("session_id") else None,
        reused=msg.reused,
    )


def _block_removed_from_proto(msg: pb.BlockRemoved) -> ev.BlockRemoved:
    try:
        block_hashes = _hashes_from_proto(msg)
    except ValueError as err:
        raise ValueError(f"BlockRemoved: {err}") from None
    return ev.BlockRemoved(
        block_hashes=block_hashes,
        medium=msg.medium if msg.HasField("medium") else None,
        group_idx=msg.group_idx if msg.HasField("group_idx") else None,
        kv_cache_spec_kind=kv_cache_spec_kind_from_proto(msg.kv_cache_spec_kind),
        kv_cache_spec_sliding_window=(
            msg.kv_cache_spec_sliding_window if msg.HasField("kv_cache_spec_sliding_window") else None
        ),
        locality=msg.locality if msg.HasField("locality") else None,
        ownership=msg.ownership if msg.HasField("ownership") else None,
    )
