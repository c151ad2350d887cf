"""The protobuf wire format, where kvservice writes or reads a data chunk by hand (one copy of its
bytes instead of protobuf's several; ``docs/data-plane.md``, "Copies"): the varint, and a reader
of a flat message of varint fields and one bytes field.

Used by the client (PutBlocks chunks written, ReadBlocks chunks read) and the server (PutBlocks
chunks read: ``kvservice.server.wire``; ReadBlocks chunks and event batches written). Whatever
these readers do not take is parsed by protobuf instead, so the two readings never differ.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["flat_fields", "read_varint", "varint"]


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint: 7 bits a byte, least significant first."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(data: bytes | memoryview, pos: int, end: int | None = None) -> tuple[int, int] | None:
    """(value, position after it) of the varint at ``pos`` of ``data[:end]``; None when it runs
    past ``end`` or over 10 bytes."""
    end = len(data) if end is None else end
    value = 0
    for shift in range(0, 70, 7):
        if pos >= end:
            return None
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    return None


def flat_fields(
    data: bytes, pos: int, end: int, varint_bits: Mapping[int, int], data_tag: int
) -> tuple[dict[int, int], memoryview] | None:
    """``data[pos:end]`` read as a message of at most one of each field, each a varint field whose
    tag byte (``field << 3 | wire type``) is in ``varint_bits`` and whose value fits its bits, or
    the bytes field ``data_tag``, and nothing else: (tag -> value, the bytes field as a view of
    ``data``, empty when absent); None for anything else (a field twice, an unknown field, a value
    past its type, bytes past ``end``)."""
    values: dict[int, int] = {}
    payload = memoryview(b"")
    while pos < end:
        tag = data[pos]
        if tag in values or (tag != data_tag and tag not in varint_bits):
            return None
        read = read_varint(data, pos + 1, end)
        if read is None:
            return None
        value, pos = read
        if tag == data_tag:
            if pos + value > end:
                return None
            payload = memoryview(data)[pos : pos + value]
            pos += value
        elif value >> varint_bits[tag]:
            return None
        values[tag] = value
    return values, payload
