"""KV events: the msgspec structs every producer and watcher of kvservice shares.

Field names, field order and msgpack layout follow vLLM's ``vllm.distributed.kv_events`` (0.33):
each event is a map tagged by ``"type"``; fields without a default are always written (None as
nil); optional fields are left out when they hold their default (``omit_defaults``), so an event
without kvservice's additions encodes to exactly the bytes vLLM writes, and bytes from an older or
newer writer decode here as long as the field types agree. A :class:`KVEventBatch` is the 3-element
array ``[ts, events, data_parallel_rank]``.

Hashes (``block_hashes``, ``parent_block_hash``) are unsigned 64-bit ints by default (the digest's
last 8 bytes, big-endian; see :func:`kvservice_client.hashing.block_hash_to_int`) or raw digest
bytes when the server is configured to publish full digests.

kvservice's additions (all optional, absent by default):

* ``BlockStored.reused``: True on a *reuse report*, a BlockStored that re-announces blocks a
  request in ``kv_cache_report_mode="full"`` took from the prefix cache. It changes no presence: a
  consumer that counts stores against removals skips it; a consumer that keeps a set may apply it.
* ``BlockRemoved.kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``: the removed block's group
  kind and window, so a consumer meeting a removal for a group it has not seen can place it.

``session_id``, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` on BlockStored are
vLLM field names.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockStored",
    "BlockRemoved",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_event_batch",
    "encode_event_batch",
]

ExternalBlockHash = Union[int, bytes]
"""A block hash as published: an unsigned 64-bit int (default) or the raw digest."""


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True, tag_field="type"):
    """Base class of the events (a msgspec tagged union keyed by ``"type"``)."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """Full blocks became present in a KV cache group (or, when ``reused``, were reused).

    Invariants (docs/ARCHITECTURE.md §3):
    ``len(token_ids) == len(block_hashes) * block_size``; the parent of ``block_hashes[i]`` is
    ``block_hashes[i - 1]`` and the first one's parent is ``parent_block_hash`` (None at block 0).

    Attributes:
        block_hashes: hashes of consecutive full blocks, parent first.
        parent_block_hash: hash of the block before ``block_hashes[0]``; None when that is block 0.
        token_ids: the blocks' token ids, ``block_size`` per hash.
        block_size: tokens per block, the granularity the hashes were computed at.
        lora_id: LoRA adapter id, or None.
        medium: the tier the KV lives in ("GPU" for the primary pool by default, as vLLM's,
            whatever the device; the server's ``kv_events_medium`` setting).
        lora_name: LoRA adapter name, or None.
        extra_keys: per block, the untagged extra keys vLLM publishes (LoRA name, salt,
            ``[mm_identifier, offset]``), None when no block has any.
        group_idx: the KV cache group.
        kv_cache_spec_kind: the group's kind (a ``KVCacheSpecKind`` value), e.g. "sliding_window".
        kv_cache_spec_sliding_window: the group's window in tokens, for windowed kinds only.
        locality, ownership: vLLM fields kvservice does not set.
        lookahead_token_ids: per block, the tokens after it that its hash also covers (vLLM 0.33's
            lookahead hashing for drafters; ``list[list[int]]``, one list per hash); kvservice does
            not set it but decodes it.
        session_id: the session of the request that triggered this store (names the trigger, not
            an owner).
        reused: True on a full-mode reuse report (kvservice addition).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    reused: bool = False

    def __hash__(self) -> int:
        return hash(
            (
                "BlockStored",
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                self.lora_name,
                _freeze(self.extra_keys),
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
                _freeze(self.locality),
                _freeze(self.ownership),
                self.session_id,
                _freeze(self.lookahead_token_ids),
                self.reused,
            )
        )


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """The last physical copy of each hash left a KV cache group (evicted or cleared one by one).

    Attributes:
        block_hashes: the hashes no longer present in the group.
        medium: as on BlockStored.
        group_idx: the KV cache group.
        locality, ownership: vLLM fields kvservice does not set.
        kv_cache_spec_kind, kv_cache_spec_sliding_window: the group's kind and window
            (kvservice addition).
    """

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def __hash__(self) -> int:
        return hash(
            (
                "BlockRemoved",
                tuple(self.block_hashes),
                self.medium,
                self.group_idx,
                _freeze(self.locality),
                _freeze(self.ownership),
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
            )
        )


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """Every cached block of every group was dropped (prefix cache reset)."""

    def __hash__(self) -> int:
        return hash("AllBlocksCleared")


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events of one mutating call, encoded as ``[ts, events, data_parallel_rank]``.

    Attributes:
        ts: wall-clock time of the call, seconds since the epoch.
        events: the events, in the order they happened.
        data_parallel_rank: the publishing engine's data-parallel rank, or None.
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch to msgpack bytes in vLLM's layout."""
    return _encoder.encode(batch)


def decode_event_batch(data: bytes) -> KVEventBatch:
    """Decode msgpack bytes in vLLM's layout.

    Raises:
        msgspec.ValidationError / msgspec.DecodeError: the bytes are not a valid batch.
    """
    return _decoder.decode(data)
