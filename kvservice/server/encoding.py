"""The servicer edge of the event log: log entries and snapshot parts as ``kvservice.v1.EventBatch``.

The event log (``kvservice.server.event_log``) and the snapshots (``kvservice.server.snapshot``)
hold events and msgpack bytes only; protobuf starts here. An entry's serialized ``EventBatch`` is
made once per payload format and group filter and cached on the entry through the log (so the
log's byte budget counts it); a snapshot part's, once per payload format on the snapshot. Every
subscriber gets the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.core.errors import InvalidArgumentError
from kvservice.server.event_log import EventLog, LogEntry, filter_events
from kvservice.server.snapshot import YIELD_EVERY_TOKENS, HalfShare, Snapshot, materialize, run_tokens
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._wire import varint
from kvservice_client.convert import batch_to_proto
from kvservice_client.events import KVEventBatch

__all__ = [
    "batch_message",
    "check_format",
    "encoded_batch",
    "encoded_snapshot_part",
    "encoded_snapshot_part_in_steps",
    "snapshot_part_message",
    "take_response",
]

_FORMATS = (pb.PAYLOAD_FORMAT_UNSPECIFIED, pb.PAYLOAD_FORMAT_PROTOBUF, pb.PAYLOAD_FORMAT_MSGPACK)

_BATCHES_KEY = bytes([pb.TakeEventsResponse.DESCRIPTOR.fields_by_name["batches"].number << 3 | 2])
"""The key of ``TakeEventsResponse.batches`` on the wire (field 1, length-delimited)."""


def check_format(payload_format: int) -> int:
    """Validate a payload format; UNSPECIFIED is PROTOBUF.

    Raises:
        InvalidArgumentError: unknown value (field ``payload_format``).
    """
    if payload_format not in _FORMATS:
        raise InvalidArgumentError("payload_format", f"unknown value {payload_format}")
    return pb.PAYLOAD_FORMAT_MSGPACK if payload_format == pb.PAYLOAD_FORMAT_MSGPACK else pb.PAYLOAD_FORMAT_PROTOBUF


def batch_message(entry: LogEntry, payload_format: int, group_idxs: tuple[int, ...] | None) -> pb.EventBatch:
    """The ``EventBatch`` of one log entry for a payload format and group filter."""
    if payload_format == pb.PAYLOAD_FORMAT_MSGPACK and group_idxs is None:
        msg = pb.EventBatch(seq=entry.seq, epoch=entry.epoch, ts=entry.ts, msgpack=entry.msgpack)
        if entry.data_parallel_rank is not None:
            msg.data_parallel_rank = entry.data_parallel_rank
        return msg
    return batch_to_proto(
        KVEventBatch(entry.ts, filter_events(entry.events, group_idxs), entry.data_parallel_rank),
        seq=entry.seq,
        epoch=entry.epoch,
        payload_format=payload_format,
    )


def encoded_batch(log: EventLog, entry: LogEntry, payload_format: int, group_idxs: tuple[int, ...] | None) -> bytes:
    """The serialized ``EventBatch`` of ``entry`` (made once, cached on it and counted by ``log``)."""
    key = (payload_format, group_idxs)
    data = entry.encodings.get(key)
    if data is None:
        data = log.cache_encoding(entry, key, batch_message(entry, payload_format, group_idxs).SerializeToString())
    return data


def snapshot_part_message(
    snap: Snapshot, i: int, *, more: bool, payload_format: int, epoch: str, data_parallel_rank: int | None
) -> pb.EventBatch:
    """Part ``i`` of a snapshot as an ``EventBatch``: ``seq`` the watermark, ``snapshot`` set,
    ``snapshot_more`` on every part but the last."""
    msg = batch_to_proto(
        KVEventBatch(snap.ts, snap.part_events(i), data_parallel_rank),
        seq=snap.seq,
        epoch=epoch,
        snapshot=True,
        payload_format=payload_format,
    )
    msg.snapshot_more = more
    return msg


def encoded_snapshot_part(
    snap: Snapshot, i: int, *, more: bool, payload_format: int, epoch: str, data_parallel_rank: int | None
) -> bytes:
    """:func:`snapshot_part_message` serialized, made once per payload format and shared."""
    return snap.encoded(
        i,
        ("EventBatch", payload_format),
        lambda s, j: snapshot_part_message(
            s, j, more=more, payload_format=payload_format, epoch=epoch, data_parallel_rank=data_parallel_rank
        ).SerializeToString(),
    )


async def _serialize_part_in_steps(
    snap: Snapshot, i: int, *, more: bool, payload_format: int, epoch: str, data_parallel_rank: int | None
) -> bytes:
    """:func:`snapshot_part_message` serialized in steps of about ``YIELD_EVERY_TOKENS`` token ids,
    yielding to the loop between steps (:class:`~kvservice.server.snapshot.HalfShare`: at most about half the loop) (protobuf format; a msgpack part is one ``bytes`` field, made
    in one go).

    The parsed message is the same: concatenated serialized messages parse as their merge
    (repeated ``events`` appended in order, a scalar set by a later piece wins), so each step
    serializes an ``EventBatch`` holding only its events (``ts`` 0, which proto3 leaves out), and
    one holding every scalar field and no event comes last: the same length as serializing the
    whole message at once.
    """
    if payload_format == pb.PAYLOAD_FORMAT_MSGPACK:
        return snapshot_part_message(
            snap, i, more=more, payload_format=payload_format, epoch=epoch, data_parallel_rank=data_parallel_rank
        ).SerializeToString()
    kinds, windows = snap.group_kinds, snap.group_windows
    pieces: list[bytes] = []
    events = []
    num_tokens = 0
    share = HalfShare()
    for item in snap.parts[i]:
        events.append(materialize(item, kinds, windows))
        num_tokens += run_tokens(item)
        if num_tokens >= YIELD_EVERY_TOKENS:
            pieces.append(batch_to_proto(KVEventBatch(0.0, events, None), seq=0, epoch="").SerializeToString())
            events, num_tokens = [], 0
            await share.step()
    if events:
        pieces.append(batch_to_proto(KVEventBatch(0.0, events, None), seq=0, epoch="").SerializeToString())
    scalars = batch_to_proto(KVEventBatch(snap.ts, [], data_parallel_rank), seq=snap.seq, epoch=epoch, snapshot=True)
    scalars.snapshot_more = more
    pieces.append(scalars.SerializeToString())
    return b"".join(pieces)


async def encoded_snapshot_part_in_steps(
    snap: Snapshot, i: int, *, more: bool, payload_format: int, epoch: str, data_parallel_rank: int | None
) -> bytes:
    """:func:`encoded_snapshot_part`, the same bytes' meaning, made in steps that yield to the loop
    (so encoding a part holds the loop for about ``YIELD_EVERY_TOKENS`` token ids at a time), once
    per payload format and shared (callers meanwhile wait for the one encoding)."""
    return await snap.encoded_in_steps(
        i,
        ("EventBatch", payload_format),
        lambda s, j: _serialize_part_in_steps(
            s, j, more=more, payload_format=payload_format, epoch=epoch, data_parallel_rank=data_parallel_rank
        ),
    )


def take_response(snapshot_parts: Sequence[bytes], rest: pb.TakeEventsResponse) -> bytes:
    """A serialized ``TakeEventsResponse`` whose ``batches`` are ``snapshot_parts`` (each a
    serialized ``EventBatch``, as :func:`encoded_snapshot_part_in_steps` makes them, shared with the
    streams), then ``rest``'s batches, with ``rest``'s ``next_seq`` and ``epoch``.

    Concatenated serialized messages parse as their merge (repeated fields appended in order), so
    each part is framed as one ``batches`` entry (its key and length) and ``rest`` serialized after
    them: no part is parsed or serialized again, and the only work is one join of the bytes.
    """
    pieces: list[bytes] = []
    for data in snapshot_parts:
        pieces += (_BATCHES_KEY, varint(len(data)), data)
    pieces.append(rest.SerializeToString())
    return b"".join(pieces)
