"""Request builders: a client method's (or :class:`~kvservice_client.step.StepBuilder` method's)
arguments -> its ``kvservice.v1`` request message, shared by both clients and the StepBuilder.

Each builder takes either a whole request message (passed through unchanged; then no field
argument may be given, else TypeError) or the request's fields, and checks the values protobuf
would refuse (out of range, wrong type) before any call is made, raising ValueError naming the
field.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from google.protobuf.message import Message

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.convert import PayloadFormatLike, payload_format_value

if TYPE_CHECKING:
    from kvservice_client.hashing import LoRA as HashingLoRA
    from kvservice_client.hashing import MultiModalFeature as HashingMultiModalFeature

__all__ = [
    "ReportMode",
    "pack_token_ids",
    "allocate_slots_request",
    "decode_request",
    "free_request",
    "get_computed_blocks_request",
    "ping_request",
    "stream_events_request",
    "take_events_request",
]

ReportMode = Union[Literal["incremental", "full"], int, None]
"""``"incremental"``, ``"full"``, a ``KVCacheReportMode`` value, or None (the server's default,
incremental)."""

_REPORT_MODES: dict[str, int] = {
    "incremental": pb.KV_CACHE_REPORT_MODE_INCREMENTAL,
    "full": pb.KV_CACHE_REPORT_MODE_FULL,
}


def _require_no_fields(request: Message, **fields: Any) -> None:
    given = sorted(name for name, value in fields.items() if value not in (None, (), [], 0, b"", "", False))
    if given:
        raise TypeError(f"pass either a {type(request).__name__} or its fields, not both (got {', '.join(given)})")


def _report_mode_value(mode: ReportMode) -> int:
    if mode is None:
        return pb.KV_CACHE_REPORT_MODE_UNSPECIFIED
    if isinstance(mode, str):
        try:
            return _REPORT_MODES[mode]
        except KeyError:
            raise ValueError(f"kv_cache_report_mode must be 'incremental' or 'full'; got {mode!r}") from None
    return mode


def _lora_proto(lora: pb.LoRA | HashingLoRA) -> pb.LoRA:
    if isinstance(lora, pb.LoRA):
        return lora
    return pb.LoRA(lora_id=lora.lora_id, lora_name=lora.lora_name, lora_path=lora.lora_path or "")


def _mm_feature_proto(feature: pb.MultiModalFeature | HashingMultiModalFeature) -> pb.MultiModalFeature:
    if isinstance(feature, pb.MultiModalFeature):
        return feature
    return pb.MultiModalFeature(identifier=feature.identifier, offset=feature.offset, length=feature.length)


_Message = TypeVar("_Message", bound=Message)


def _build(message_type: type[_Message], **fields: object) -> _Message:
    """``message_type(**fields)``, but a value protobuf refuses (out of range, wrong type) raises
    ValueError naming the field, before any call is made."""
    message = message_type()
    for name, value in fields.items():
        try:
            if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") and not isinstance(value, (str, bytes)):
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except (TypeError, ValueError, AttributeError) as e:  # AttributeError: a str for a repeated field
            raise ValueError(f"{name}: {e}") from None
    return message


_INT32_FORMATS = frozenset({"i", "=i", "<i", "@i"} | ({"l", "=l", "<l", "@l"} if array("l").itemsize == 4 else set()))
"""Buffer formats of native 4-byte signed ints (array('i'), numpy int32; little-endian ones)."""


def pack_token_ids(token_ids: Any) -> bytes | None:
    """``token_ids`` as ``packed_prompt_token_ids`` (little-endian int32, 4 bytes a token id) when
    it is a buffer: ``bytes``/``bytearray``/a byte ``memoryview`` are taken as that encoding
    already (another buffer of unsigned bytes, ``array('B')`` or a numpy uint8 array, holds one
    token id per byte and goes as ``prompt_token_ids``); a buffer of 4-byte signed ints (``array('i')``, a numpy int32 array) is copied once
    (and byte-swapped on a big-endian host). None for anything else (a list, a range, an int64
    array): those go as ``prompt_token_ids``.

    Raises:
        ValueError: bytes whose length is not a multiple of 4.
    """
    if isinstance(token_ids, (list, tuple, range)):
        return None
    try:
        view = memoryview(token_ids)
    except TypeError:
        return None
    if view.format == "B" and view.ndim == 1 and isinstance(token_ids, (bytes, bytearray, memoryview)):
        if view.nbytes % 4:
            raise ValueError(
                f"prompt_token_ids: {view.nbytes} bytes, not a multiple of 4 (little-endian int32 token ids)"
            )
        return bytes(view)
    if view.itemsize != 4 or view.format not in _INT32_FORMATS or view.ndim != 1:
        return None
    if sys.byteorder == "little" or view.format == "<i" or view.format == "<l":
        return view.tobytes()
    swapped = array("i", view.tobytes())
    swapped.byteswap()
    return swapped.tobytes()


def get_computed_blocks_request(
    request_id: str | pb.GetComputedBlocksRequest,
    prompt_token_ids: Iterable[int],
    session_id: str | None,
    kv_cache_report_mode: ReportMode,
    lora: pb.LoRA | HashingLoRA | None,
    cache_salt: str | None,
    mm_features: Iterable[pb.MultiModalFeature | HashingMultiModalFeature],
) -> pb.GetComputedBlocksRequest:
    mm_features = tuple(mm_features)
    if isinstance(request_id, pb.GetComputedBlocksRequest):
        _require_no_fields(
            request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            session_id=session_id,
            kv_cache_report_mode=kv_cache_report_mode,
            lora=lora,
            cache_salt=cache_salt,
            mm_features=mm_features,
        )
        return request_id
    packed = pack_token_ids(prompt_token_ids)
    request = _build(
        pb.GetComputedBlocksRequest,
        request_id=request_id,
        **({"packed_prompt_token_ids": packed} if packed is not None else {"prompt_token_ids": prompt_token_ids}),
        kv_cache_report_mode=_report_mode_value(kv_cache_report_mode),
        mm_features=[_mm_feature_proto(f) for f in mm_features],
    )
    if session_id is not None:
        request.session_id = session_id
    if lora is not None:
        request.lora.CopyFrom(_lora_proto(lora))
    if cache_salt is not None:
        request.cache_salt = cache_salt
    return request


def allocate_slots_request(
    request_id: str | pb.AllocateSlotsRequest,
    num_new_tokens: int | None,
    num_lookahead_tokens: int,
    new_token_ids: Iterable[int],
) -> pb.AllocateSlotsRequest:
    new_token_ids = tuple(new_token_ids)
    if isinstance(request_id, pb.AllocateSlotsRequest):
        _require_no_fields(
            request_id,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            new_token_ids=new_token_ids,
        )
        return request_id
    if num_new_tokens is None:
        raise TypeError("allocate_slots() needs num_new_tokens (tokens to compute this step)")
    return _build(
        pb.AllocateSlotsRequest,
        request_id=request_id,
        num_new_tokens=num_new_tokens,
        num_lookahead_tokens=num_lookahead_tokens,
        new_token_ids=new_token_ids,
    )


def decode_request(
    request_ids: Sequence[str] | pb.DecodeRequest,
    new_token_ids: Iterable[int],
    num_new_token_ids: Iterable[int],
    num_new_tokens: Iterable[int],
    num_lookahead_tokens: Iterable[int],
) -> pb.DecodeRequest:
    """A ``DecodeRequest`` (packed arrays; see ``KVCacheClient.decode``), or the one given.
    ``new_token_ids`` may also be one sequence of token ids per request (``[[t0], [t1, t2]]``):
    it is flattened, and ``num_new_token_ids`` (when not given) is each one's length.

    Raises:
        TypeError: a request message together with field arguments, one string of ids, or token
            ids that are neither ints nor one sequence of ints per request.
        ValueError: per-request token lists whose count is not the number of requests, or whose
            lengths differ from ``num_new_token_ids``.
    """
    if isinstance(request_ids, pb.DecodeRequest):
        _require_no_fields(
            request_ids,
            new_token_ids=tuple(new_token_ids),
            num_new_token_ids=tuple(num_new_token_ids),
            num_new_tokens=tuple(num_new_tokens),
            num_lookahead_tokens=tuple(num_lookahead_tokens),
        )
        return request_ids
    if isinstance(request_ids, str):
        raise TypeError("decode() takes a sequence of request ids, not one string")
    if isinstance(new_token_ids, Sequence) and new_token_ids and _is_token_list(new_token_ids[0]):
        new_token_ids, num_new_token_ids = _flatten_per_request(request_ids, new_token_ids, num_new_token_ids)
    # Packed repeated fields take any sequence of ints in one C call: no per-request message.
    try:
        return pb.DecodeRequest(
            request_ids=request_ids,
            new_token_ids=new_token_ids,
            num_new_token_ids=num_new_token_ids,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
    except TypeError as e:
        raise TypeError(
            f"decode(): request_ids must be strings and the token counts ints ({e}); new_token_ids is one flat "
            "sequence of ints, request after request, or one sequence of ints per request"
        ) from None


def _is_token_list(value: Any) -> bool:
    """A list, tuple, ``array`` or 1-D numpy array (not a token id, numpy's int scalars included)."""
    return isinstance(value, (list, tuple, array)) or getattr(value, "ndim", 0) == 1


def _flatten_per_request(
    request_ids: Sequence[str], per_request: Sequence[Any], num_new_token_ids: Iterable[int]
) -> tuple[list[int], list[int]]:
    """One token-id list per request -> (the flat ids, the count per request)."""
    if not all(_is_token_list(ids) for ids in per_request):
        raise TypeError("decode(): new_token_ids must be ints, or one sequence of ints per request")
    if len(per_request) != len(request_ids):
        raise ValueError(
            f"decode(): new_token_ids has {len(per_request)} per-request lists for {len(request_ids)} request_ids"
        )
    counts = [len(ids) for ids in per_request]
    given = list(num_new_token_ids)
    if given and given != counts:
        raise ValueError(
            f"decode(): num_new_token_ids {given} differs from the lengths of new_token_ids' lists {counts}"
        )
    return [int(token) for ids in per_request for token in ids], counts


def free_request(request_id: str | pb.FreeRequest) -> pb.FreeRequest:
    if isinstance(request_id, pb.FreeRequest):
        return request_id
    return pb.FreeRequest(request_id=request_id)


def stream_events_request(
    request: pb.StreamEventsRequest | None,
    start_seq: int | None,
    epoch: str | None,
    snapshot: bool,
    group_idxs: Iterable[int],
    payload_format: PayloadFormatLike | None,
) -> pb.StreamEventsRequest:
    group_idxs = tuple(group_idxs)
    if request is not None:
        _require_no_fields(
            request,
            start_seq=start_seq,
            epoch=epoch,
            snapshot=snapshot,
            group_idxs=group_idxs,
            payload_format=payload_format,
        )
        return request
    if snapshot and start_seq is not None:
        raise ValueError("stream_events: pass start_seq or snapshot=True, not both")
    if snapshot:
        start = pb.EVENT_START_SNAPSHOT
    elif start_seq is not None:
        start = pb.EVENT_START_SEQ
    else:
        start = pb.EVENT_START_LIVE
    return _build(
        pb.StreamEventsRequest,
        start=start,
        start_seq=start_seq or 0,
        epoch=epoch or "",
        group_idxs=group_idxs,
        payload_format=payload_format_value(payload_format or pb.PAYLOAD_FORMAT_UNSPECIFIED),
    )


def take_events_request(
    consumer: str | pb.TakeEventsRequest,
    max_batches: int,
    snapshot: bool,
    start_seq: int,
    epoch: str | None,
    group_idxs: Iterable[int],
    payload_format: PayloadFormatLike | None,
) -> pb.TakeEventsRequest:
    group_idxs = tuple(group_idxs)
    if isinstance(consumer, pb.TakeEventsRequest):
        _require_no_fields(
            consumer,
            max_batches=max_batches,
            snapshot=snapshot,
            start_seq=start_seq,
            epoch=epoch,
            group_idxs=group_idxs,
            payload_format=payload_format,
        )
        return consumer
    return _build(
        pb.TakeEventsRequest,
        consumer=consumer,
        max_batches=max_batches,
        snapshot=snapshot,
        start_seq=start_seq,
        epoch=epoch or "",
        group_idxs=group_idxs,
        payload_format=payload_format_value(payload_format or pb.PAYLOAD_FORMAT_UNSPECIFIED),
    )


def ping_request(payload: bytes | pb.PingRequest) -> pb.PingRequest:
    if isinstance(payload, pb.PingRequest):
        return payload
    return pb.PingRequest(payload=payload)
