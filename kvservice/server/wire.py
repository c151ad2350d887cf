"""What is wrong with request bytes that do not parse: the string field that is not UTF-8.

protobuf refuses a message whose string field holds bytes that are not valid UTF-8 without saying
which field; a status must name it. :func:`invalid_utf8_field` walks the wire format along the
message's descriptor and returns that field's path.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvservice_client._wire import flat_fields, read_varint

__all__ = ["WireChunk", "invalid_utf8_field", "put_chunk"]

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH_DELIMITED, _WIRE_FIXED32 = 0, 1, 2, 5


class _Corrupt(Exception):
    """The bytes are not a wire-format message (the walk stops: nothing to name)."""


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``.

    Raises:
        _Corrupt: the varint runs past the end or over 10 bytes.
    """
    read = read_varint(data, pos)
    if read is None:
        raise _Corrupt
    return read


def _walk(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    counts: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            _, pos = _read_varint(data, pos)
            continue
        if wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
            pos += 8 if wire_type == _WIRE_FIXED64 else 4
            continue
        if wire_type != _WIRE_LENGTH_DELIMITED:
            raise _Corrupt  # groups are not used by kvservice.v1
        size, pos = _read_varint(data, pos)
        if pos + size > len(data):
            raise _Corrupt
        chunk = data[pos : pos + size]
        pos += size
        field = descriptor.fields_by_number.get(number)
        if field is None or field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
            continue
        name = prefix + field.name
        if field.is_repeated:
            index = counts.get(number, 0)
            counts[number] = index + 1
            name += f"[{index}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return name
        else:
            assert field.message_type is not None, f"{name}: the walk enters message fields only"
            found = _walk(field.message_type, chunk, name + ".")
            if found is not None:
                return found
    return None


def invalid_utf8_field(descriptor: Descriptor, data: bytes) -> str | None:
    """The path of the first string field of ``data`` (a serialized ``descriptor`` message) whose
    bytes are not valid UTF-8, e.g. ``request_id`` or ``ops[2].free.request_id`` (repeated fields
    carry their index); None when there is none or the bytes are not a wire-format message.

    Nesting is bounded by the descriptor (kvservice.v1 requests are not recursive).
    """
    try:
        return _walk(descriptor, data, "")
    except _Corrupt:
        return None


class WireChunk:
    """A ``PutBlocksChunk`` read from a ``PutBlocksMessage``'s bytes without parsing them into a
    message: ``data`` is a view of the received bytes (protobuf's parse copies them into the message,
    then ``chunk.data`` copies them again into a ``bytes``; here the block's write is the one copy).

    Attributes:
        block_index: the key's index in the header. offset_bytes: the chunk's offset in its block.
        data: the chunk's bytes (a view; empty when absent). checksum: the xxh3_64 of the block's
            bytes, or None when the field is absent.
    """

    __slots__ = ("block_index", "checksum", "data", "offset_bytes")

    def __init__(self, block_index: int, offset_bytes: int, data: memoryview, checksum: int | None) -> None:
        self.block_index = block_index
        self.offset_bytes = offset_bytes
        self.data = data
        self.checksum = checksum


# PutBlocksMessage.chunk (field 2) and PutBlocksChunk's fields: their tag bytes (field << 3 | wire type).
_CHUNK_TAG = 2 << 3 | _WIRE_LENGTH_DELIMITED
_BLOCK_INDEX_TAG, _OFFSET_TAG = 1 << 3 | _WIRE_VARINT, 2 << 3 | _WIRE_VARINT
_DATA_TAG, _CHECKSUM_TAG = 3 << 3 | _WIRE_LENGTH_DELIMITED, 4 << 3 | _WIRE_VARINT
_PUT_CHUNK_VARINT_BITS = {_BLOCK_INDEX_TAG: 32, _OFFSET_TAG: 64, _CHECKSUM_TAG: 64}


def put_chunk(data: bytes) -> WireChunk | None:
    """The chunk of a serialized ``PutBlocksMessage`` that is exactly one ``chunk`` field holding
    at most one of each ``PutBlocksChunk`` field, in range, and nothing else (what kvservice's
    clients send); None for any other bytes (a header, a field twice, an unknown field, a value
    past its type, corrupt bytes: the caller parses those with protobuf, which decides what they
    are, so the two readings never differ)."""
    if not data or data[0] != _CHUNK_TAG:
        return None
    size = read_varint(data, 1)
    if size is None or size[1] + size[0] != len(data):
        return None
    fields = flat_fields(data, size[1], len(data), _PUT_CHUNK_VARINT_BITS, _DATA_TAG)
    if fields is None:
        return None
    values, payload = fields
    return WireChunk(values.get(_BLOCK_INDEX_TAG, 0), values.get(_OFFSET_TAG, 0), payload, values.get(_CHECKSUM_TAG))
