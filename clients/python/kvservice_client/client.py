"""Typed snake_case facade over the ``kvservice.v1.KVCacheService`` stubs.

:class:`KVCacheClient` (blocking, over a ``grpc.Channel``) and :class:`AsyncKVCacheClient`
(``grpc.aio``) have one method per RPC. Each method takes the proto request, or keyword arguments
for its common fields, plus keyword-only ``timeout`` (seconds as a float, or a ``timedelta``) and
``metadata``. Every call goes through one private function per client (``_rpc``) that applies the
deadline and metadata (the client's bearer token and default metadata first, then the call's) and
turns any gRPC failure into one typed exception, :class:`KVServiceError`, which keeps the status
code and the server's message.

Example::

    with KVCacheClient("127.0.0.1:50051", token="...") as client:
        hit = client.get_computed_blocks("req-1", prompt, kv_cache_report_mode="full", timeout=1.0)
        step = StepBuilder().allocate_slots("req-1", num_new_tokens=len(prompt)).get_usage()
        results = step_results(client.step(step))

TLS: pass ``tls=True`` (the system's root certificates), ``root_certificates`` (a private CA),
``private_key`` with ``certificate_chain`` (mutual TLS), or ready ``credentials``; the client then
opens a secure channel. Without any of them the channel is plain text.

Units: token counts in tokens, block ids as pool indices, timeouts in seconds.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2_grpc as pb_grpc
from kvservice_client.convert import PayloadFormatLike, payload_format_value

if TYPE_CHECKING:
    from kvservice_client.hashing import LoRA as HashingLoRA
    from kvservice_client.hashing import MultiModalFeature as HashingMultiModalFeature

__all__ = [
    "AsyncKVCacheClient",
    "KVCacheClient",
    "KVServiceError",
    "Metadata",
    "StepBuilder",
    "StepOpResponse",
    "Timeout",
    "step_results",
]

Timeout = Union[float, datetime.timedelta, None]
"""A call deadline: seconds from now (float) or a ``timedelta``; None for the client's default."""

Metadata = Union[Mapping[str, Union[str, bytes]], Sequence[tuple[str, Union[str, bytes]]], None]
"""gRPC metadata: a mapping or a sequence of ``(key, value)`` pairs. Keys are lower case; keys
ending in ``-bin`` take bytes."""

ReportMode = Union[Literal["incremental", "full"], int, None]
"""``"incremental"``, ``"full"``, a ``KVCacheReportMode`` value, or None (the server's default,
incremental)."""

StepOpResponse = Union[
    pb.GetComputedBlocksResponse,
    pb.AllocateSlotsResponse,
    pb.FreeResponse,
    pb.ResetPrefixCacheResponse,
    pb.GetUsageResponse,
]

_STREAMING_METHODS = frozenset({"StreamEvents"})
_REPORT_MODES: dict[str, int] = {
    "incremental": pb.KV_CACHE_REPORT_MODE_INCREMENTAL,
    "full": pb.KV_CACHE_REPORT_MODE_FULL,
}
_STATUS_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class KVServiceError(Exception):
    """A kvservice call failed (any gRPC status other than OK, or a failed Step op).

    Args:
        code: the gRPC status code (``grpc.StatusCode.NOT_FOUND`` ...).
        message: the server's message (names the field and bound for INVALID_ARGUMENT).
        trailing_metadata: the call's trailing metadata (``grpc-status-details-bin`` carries rich
            ``google.rpc.Status`` details when the server sends them); empty for a Step op.

    Attributes:
        code: as above.
        message: as above.
        trailing_metadata: as above.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> KVServiceError:
        """Build from a ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError`` (async)."""
        code_fn = getattr(err, "code", None)
        code = code_fn() if callable(code_fn) else None
        details_fn = getattr(err, "details", None)
        details = details_fn() if callable(details_fn) else None
        trailing_fn = getattr(err, "trailing_metadata", None)
        trailing = trailing_fn() if callable(trailing_fn) else None
        return cls(
            code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
            details if details is not None else str(err),
            trailing_metadata=tuple(trailing or ()),
        )

    @classmethod
    def from_op_status(cls, status: pb.OpStatus) -> KVServiceError:
        """Build from the ``OpStatus`` of a failed Step op (an unknown code number -> UNKNOWN)."""
        return cls(_STATUS_CODE_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN), status.message)


def step_results(response: pb.StepResponse) -> list[StepOpResponse | KVServiceError]:
    """Unpack a Step's results: per op, in order, its response message or its error.

    A failed op is a :class:`KVServiceError` *value* in the list (not raised): a failed op fails
    only itself.

    Raises:
        ValueError: a result with nothing set.
    """
    results: list[StepOpResponse | KVServiceError] = []
    for idx, result in enumerate(response.results):
        which = result.WhichOneof("result")
        if which is None:
            raise ValueError(f"StepResponse.results[{idx}]: no result set")
        if which == "error":
            results.append(KVServiceError.from_op_status(result.error))
        else:
            results.append(getattr(result, which))
    return results


# ---------------------------------------------------------------------------------------------
# Request builders, shared by both clients and StepBuilder.


def _require_no_fields(request: Message, **fields: Any) -> None:
    given = sorted(name for name, value in fields.items() if value not in (None, (), [], 0, b"", "", False))
    if given:
        raise TypeError(
            f"pass either a {type(request).__name__} or its fields, not both (got {', '.join(given)})"
        )


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


def _build(message_type: Any, **fields: Any) -> Any:
    """``message_type(**fields)``, but a value protobuf refuses (out of range, wrong type) raises
    ValueError naming the field, before any call is made."""
    message = message_type()
    for name, value in fields.items():
        try:
            if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") and not isinstance(value, (str, bytes)):
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: {e}") from None
    return message


def _get_computed_blocks_request(
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
    request = _build(
        pb.GetComputedBlocksRequest,
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
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


def _allocate_slots_request(
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


def _free_request(request_id: str | pb.FreeRequest) -> pb.FreeRequest:
    if isinstance(request_id, pb.FreeRequest):
        return request_id
    return pb.FreeRequest(request_id=request_id)


def _stream_events_request(
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
    return pb.StreamEventsRequest(
        start=start,
        start_seq=start_seq or 0,
        epoch=epoch or "",
        group_idxs=group_idxs,
        payload_format=payload_format_value(payload_format or pb.PAYLOAD_FORMAT_UNSPECIFIED),  # type: ignore[arg-type]
    )


def _take_events_request(
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
    return pb.TakeEventsRequest(
        consumer=consumer,
        max_batches=max_batches,
        snapshot=snapshot,
        start_seq=start_seq,
        epoch=epoch or "",
        group_idxs=group_idxs,
        payload_format=payload_format_value(payload_format or pb.PAYLOAD_FORMAT_UNSPECIFIED),  # type: ignore[arg-type]
    )


def _step_request(ops: pb.StepRequest | StepBuilder | Iterable[pb.StepOp]) -> pb.StepRequest:
    if isinstance(ops, pb.StepRequest):
        return ops
    if isinstance(ops, StepBuilder):
        return ops.build()
    return pb.StepRequest(ops=ops)


def _ping_request(payload: bytes | pb.PingRequest) -> pb.PingRequest:
    if isinstance(payload, pb.PingRequest):
        return payload
    return pb.PingRequest(payload=payload)


class StepBuilder:
    """Composes the ops of one Step (a scheduler step's worth of calls in one round trip).

    Methods take the same arguments as the client methods of the same name (without timeout and
    metadata) and return the builder, so calls chain. The server runs the ops in order, answers in
    order, and a failed op fails only itself (see :func:`step_results`).

    Example::

        ops = (
            StepBuilder()
            .get_computed_blocks("r1", prompt_token_ids)
            .allocate_slots("r1", num_new_tokens=len(prompt_token_ids))
            .free("r0")
        )
        results = step_results(client.step(ops))
    """

    __slots__ = ("_ops",)

    def __init__(self) -> None:
        self._ops: list[pb.StepOp] = []

    def __len__(self) -> int:
        """Number of ops so far."""
        return len(self._ops)

    def get_computed_blocks(
        self,
        request_id: str | pb.GetComputedBlocksRequest,
        prompt_token_ids: Iterable[int] = (),
        *,
        session_id: str | None = None,
        kv_cache_report_mode: ReportMode = None,
        lora: pb.LoRA | HashingLoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[pb.MultiModalFeature | HashingMultiModalFeature] = (),
    ) -> StepBuilder:
        """Add a GetComputedBlocks op (see :meth:`KVCacheClient.get_computed_blocks`)."""
        request = _get_computed_blocks_request(
            request_id, prompt_token_ids, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
        )
        self._ops.append(pb.StepOp(get_computed_blocks=request))
        return self

    def allocate_slots(
        self,
        request_id: str | pb.AllocateSlotsRequest,
        num_new_tokens: int | None = None,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Iterable[int] = (),
    ) -> StepBuilder:
        """Add an AllocateSlots op (see :meth:`KVCacheClient.allocate_slots`)."""
        request = _allocate_slots_request(request_id, num_new_tokens, num_lookahead_tokens, new_token_ids)
        self._ops.append(pb.StepOp(allocate_slots=request))
        return self

    def free(self, request_id: str | pb.FreeRequest) -> StepBuilder:
        """Add a Free op (see :meth:`KVCacheClient.free`)."""
        self._ops.append(pb.StepOp(free=_free_request(request_id)))
        return self

    def reset_prefix_cache(self) -> StepBuilder:
        """Add a ResetPrefixCache op."""
        self._ops.append(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
        return self

    def get_usage(self) -> StepBuilder:
        """Add a GetUsage op."""
        self._ops.append(pb.StepOp(get_usage=pb.GetUsageRequest()))
        return self

    def build(self) -> pb.StepRequest:
        """The ``StepRequest`` holding the ops added so far, in order (the builder stays usable)."""
        return pb.StepRequest(ops=self._ops)


# ---------------------------------------------------------------------------------------------
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message a client channel accepts by default (the server's default send limit); gRPC's
own default (4 MiB) is below one TakeEvents answer of many batches."""


DEFAULT_KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # grpcio 1.85 times a ping out by this one (default 60 s)
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 0),
)
"""HTTP/2 keepalive of a channel a client opens, unless its ``options`` set the same names: while a
call is open (a quiet ``StreamEvents`` included) the client pings every 30 s and closes the
connection when a ping goes unanswered for 10 s, so a stream whose server or network path died
silently ends with UNAVAILABLE within about 40 s and an :class:`EventWatcher` resyncs. The server
accepts pings this often (its ``keepalive_min_client_interval_s`` defaults to 5 s)."""


def _channel_options(options: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """``options`` plus the default receive limit and keepalive, where they set none."""
    out = list(options or ())
    names = {name for name, _ in out}
    if "grpc.max_receive_message_length" not in names:
        out.append(("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES))
    out.extend((name, value) for name, value in DEFAULT_KEEPALIVE_OPTIONS if name not in names)
    return out


def _channel_credentials(
    tls: bool,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
    credentials: grpc.ChannelCredentials | None,
) -> grpc.ChannelCredentials | None:
    """The credentials of the channel a client opens: None for plain text.

    Raises:
        TypeError: ``credentials`` together with ``tls`` or PEM bytes.
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse.
    """
    pem = {"root_certificates": root_certificates, "private_key": private_key, "certificate_chain": certificate_chain}
    given = sorted(name for name, value in pem.items() if value is not None)
    if credentials is not None:
        if tls or given:
            raise TypeError(f"pass either credentials or tls/PEM bytes, not both (got {', '.join(given) or 'tls'})")
        return credentials
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain go together (the client's key and certificate)")
    if not (tls or given):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def _check_no_channel_settings(options: Any, credentials: grpc.ChannelCredentials | None) -> None:
    """Refuse channel settings when the caller passed a channel (they would be ignored)."""
    if options is not None:
        raise TypeError("options apply only when target is an address")
    if credentials is not None:
        raise TypeError("TLS settings (tls, root_certificates, private_key, certificate_chain, credentials) "
                        "apply only when target is an address")


# Call options and error translation (used only by the clients' _rpc).


def _timeout_seconds(timeout: Timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _metadata_pairs(metadata: Metadata) -> tuple[tuple[str, str | bytes], ...]:
    if metadata is None:
        return ()
    if isinstance(metadata, Mapping):
        return tuple(metadata.items())
    return tuple((key, value) for key, value in metadata)


def _base_metadata(token: str | None, metadata: Metadata) -> tuple[tuple[str, str | bytes], ...]:
    pairs = _metadata_pairs(metadata)
    if token is not None:
        # gRPC metadata values are printable ASCII; anything else fails every call with INTERNAL.
        if not token or not token.isascii() or not token.isprintable() or " " in token:
            raise ValueError("token: must be non-empty printable ASCII without spaces")
        pairs = (("authorization", f"Bearer {token}"), *pairs)
    return pairs


def _iterate_stream(call: Any) -> Iterator[Any]:
    try:
        yield from call
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


async def _aiterate_stream(call: Any) -> AsyncIterator[Any]:
    try:
        async for item in call:
            yield item
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


async def _await_unary(call: Any) -> Any:
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise KVServiceError.from_rpc_error(err) from err


class _ClientBase:
    """What both clients share: the stub, the default deadline and metadata."""

    def __init__(self, stub: Any, *, token: str | None, metadata: Metadata, timeout: Timeout) -> None:
        self._stub = stub
        self._metadata = _base_metadata(token, metadata)
        self._default_timeout = _timeout_seconds(timeout)

    def _call_options(self, method: str, timeout: Timeout, metadata: Metadata) -> dict[str, Any]:
        seconds = _timeout_seconds(timeout)
        if seconds is None and method not in _STREAMING_METHODS:
            seconds = self._default_timeout
        pairs = self._metadata + _metadata_pairs(metadata)
        return {"timeout": seconds, "metadata": pairs or None}


class KVCacheClient(_ClientBase):
    """Blocking client of ``kvservice.v1.KVCacheService``.

    Args:
        target: a ``host:port`` address (the client opens a channel to it, plain text unless a TLS
            argument is given, and closes it in :meth:`close`), or a ``grpc.Channel`` (left open
            by :meth:`close`).
        token: a bearer token, sent on every call as ``authorization: Bearer <token>`` (printable
            ASCII without spaces, else ValueError).
        metadata: metadata sent on every call, before the call's own.
        timeout: the default deadline of unary calls, in seconds or as a ``timedelta`` (None: no
            deadline). ``stream_events`` gets a deadline only when the call passes one.
        options: channel options, when ``target`` is an address (the receive limit defaults to
            :data:`DEFAULT_MAX_MESSAGE_BYTES`; ``grpc.ssl_target_name_override`` checks the
            server's certificate against another name).
        tls: open a TLS channel, verifying the server against the system's root certificates
            (implied by the PEM arguments).
        root_certificates: PEM CA certificates the server's certificate must chain to (bytes).
        private_key: the client's PEM private key, for mutual TLS (bytes; with
            ``certificate_chain``).
        certificate_chain: the client's PEM certificate chain, for mutual TLS (bytes).
        credentials: ready ``grpc.ChannelCredentials`` (e.g. ``grpc.composite_channel_credentials``),
            instead of ``tls`` and the PEM arguments.

    Raises:
        TypeError: ``options`` or TLS arguments with a channel; ``credentials`` with ``tls`` or PEM
            bytes.
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse.

    A server that refuses the TLS handshake (wrong CA, no or unknown client certificate, a plain
    text client on a TLS port) ends calls with UNAVAILABLE.

    Every method raises :class:`KVServiceError` when the call fails; its ``code`` is the gRPC status
    (INVALID_ARGUMENT naming the field, NOT_FOUND, ALREADY_EXISTS, UNAUTHENTICATED,
    PERMISSION_DENIED, DEADLINE_EXCEEDED, UNAVAILABLE ...).
    """

    def __init__(
        self,
        target: str | grpc.Channel,
        *,
        token: str | None = None,
        metadata: Metadata = None,
        timeout: Timeout = None,
        options: Sequence[tuple[str, Any]] | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        creds = _channel_credentials(tls, root_certificates, private_key, certificate_chain, credentials)
        if isinstance(target, str):
            if creds is None:
                channel = grpc.insecure_channel(target, options=_channel_options(options))
            else:
                channel = grpc.secure_channel(target, creds, options=_channel_options(options))
            self._owns_channel = True
        else:
            _check_no_channel_settings(options, creds)
            channel = target
            self._owns_channel = False
        self._channel = channel
        super().__init__(pb_grpc.KVCacheServiceStub(channel), token=token, metadata=metadata, timeout=timeout)

    @property
    def channel(self) -> grpc.Channel:
        """The underlying channel."""
        return self._channel

    @property
    def stub(self) -> pb_grpc.KVCacheServiceStub:
        """The generated stub (no deadline, metadata or error translation applied)."""
        return self._stub  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _rpc(self, method: str, request: Message, timeout: Timeout, metadata: Metadata) -> Any:
        """The one call path: deadline and metadata in, ``grpc.RpcError`` out as KVServiceError."""
        multicallable = getattr(self._stub, method)
        options = self._call_options(method, timeout, metadata)
        if method in _STREAMING_METHODS:
            return _iterate_stream(multicallable(request, **options))
        try:
            return multicallable(request, **options)
        except grpc.RpcError as err:
            raise KVServiceError.from_rpc_error(err) from err

    def get_computed_blocks(
        self,
        request_id: str | pb.GetComputedBlocksRequest,
        prompt_token_ids: Iterable[int] = (),
        *,
        session_id: str | None = None,
        kv_cache_report_mode: ReportMode = None,
        lora: pb.LoRA | HashingLoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[pb.MultiModalFeature | HashingMultiModalFeature] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetComputedBlocksResponse:
        """Look up a prompt's prefix-cache hit; registers the request on first sight.

        Args:
            request_id: the request's unique id (1..256 bytes of UTF-8), or a whole
                ``GetComputedBlocksRequest`` (then pass no other field).
            prompt_token_ids: the prompt's token ids (tokens).
            session_id: echoed on the BlockStored events the request triggers.
            kv_cache_report_mode: ``"incremental"`` or ``"full"`` (None: the server's default,
                incremental).
            lora: the LoRA adapter (a proto ``LoRA`` or a :class:`kvservice_client.hashing.LoRA`).
            cache_salt: isolates the request's prefix cache.
            mm_features: multimodal placeholders (proto or :mod:`kvservice_client.hashing` ones).
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            The hit: ``num_computed_tokens`` (tokens, a multiple of the block size) and per group
            the hit's block ids.

        Raises:
            KVServiceError: INVALID_ARGUMENT (a malformed field, named), ALREADY_EXISTS, ...
            TypeError: a request message together with field arguments.
        """
        request = _get_computed_blocks_request(
            request_id, prompt_token_ids, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
        )
        return self._rpc("GetComputedBlocks", request, timeout, metadata)  # type: ignore[no-any-return]

    def allocate_slots(
        self,
        request_id: str | pb.AllocateSlotsRequest,
        num_new_tokens: int | None = None,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Iterable[int] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.AllocateSlotsResponse:
        """Allocate KV slots for the tokens a request computes this step.

        Args:
            request_id: the request (registered by :meth:`get_computed_blocks`), or a whole
                ``AllocateSlotsRequest``.
            num_new_tokens: most tokens to compute this step (tokens, >= 1).
            num_lookahead_tokens: extra slots to reserve (tokens; speculative decoding).
            new_token_ids: token ids appended since the last call (decode outputs).
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            ``allocated`` (False when too few blocks are free: a normal answer, nothing changed),
            the new block ids per group, and the token counts.

        Raises:
            KVServiceError: NOT_FOUND (unknown request), INVALID_ARGUMENT, ...
            TypeError: neither a request nor ``num_new_tokens``; or both a request and fields.
        """
        request = _allocate_slots_request(request_id, num_new_tokens, num_lookahead_tokens, new_token_ids)
        return self._rpc("AllocateSlots", request, timeout, metadata)  # type: ignore[no-any-return]

    def free(
        self,
        request_id: str | pb.FreeRequest,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.FreeResponse:
        """Free every block a request holds and forget the request.

        Args:
            request_id: the request, or a ``FreeRequest``.
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            ``num_freed_blocks`` (blocks, over all groups).

        Raises:
            KVServiceError: NOT_FOUND (unknown request), ...
        """
        return self._rpc("Free", _free_request(request_id), timeout, metadata)  # type: ignore[no-any-return]

    def reset_prefix_cache(
        self,
        request: pb.ResetPrefixCacheRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.ResetPrefixCacheResponse:
        """Drop every cached block (refused, ``reset = False``, while any block is held).

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.ResetPrefixCacheRequest()
        return self._rpc("ResetPrefixCache", request, timeout, metadata)  # type: ignore[no-any-return]

    def get_usage(
        self,
        request: pb.GetUsageRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetUsageResponse:
        """Pool usage (fraction 0..1, blocks) and prefix-cache counters (tokens, requests).

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.GetUsageRequest()
        return self._rpc("GetUsage", request, timeout, metadata)  # type: ignore[no-any-return]

    def step(
        self,
        ops: pb.StepRequest | StepBuilder | Iterable[pb.StepOp],
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.StepResponse:
        """Run a scheduler step's worth of ops in one round trip, in order.

        Args:
            ops: a ``StepRequest``, a :class:`StepBuilder`, or ``StepOp`` messages.
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            One result per op, in order; unpack with :func:`step_results`. A failed op is an
            ``error`` result, not an exception.

        Raises:
            KVServiceError: the whole call failed (e.g. INVALID_ARGUMENT for too many ops).
        """
        return self._rpc("Step", _step_request(ops), timeout, metadata)  # type: ignore[no-any-return]

    def stream_events(
        self,
        request: pb.StreamEventsRequest | None = None,
        *,
        start_seq: int | None = None,
        epoch: str | None = None,
        snapshot: bool = False,
        group_idxs: Iterable[int] = (),
        payload_format: PayloadFormatLike | None = None,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> Iterator[pb.EventBatch]:
        """Subscribe to the KV event stream.

        Starts from ``start_seq`` (replaying retained batches), from a snapshot, or (neither) from
        the live head. Breaking out of the loop (or closing the iterator) cancels the call.

        Args:
            request: a whole ``StreamEventsRequest`` (then pass no other field).
            start_seq: the first seq to deliver (>= 1).
            epoch: the epoch ``start_seq`` belongs to (None: the current one).
            snapshot: start with a snapshot batch, then follow live.
            group_idxs: only these groups' events (empty: all).
            payload_format: ``"protobuf"`` (default) or ``"msgpack"``; decode either with
                :func:`kvservice_client.convert.proto_to_batch`.
            timeout: deadline for the whole stream (None: none, whatever the client's default).
            metadata: extra metadata for this call.

        Returns:
            An iterator of ``EventBatch`` messages, in seq order.

        Raises:
            KVServiceError: while iterating: OUT_OF_RANGE (start below retention; the message names
                the oldest seq held), FAILED_PRECONDITION (another epoch), RESOURCE_EXHAUSTED (fell
                behind; names its last seq), ...
            ValueError: both ``start_seq`` and ``snapshot``.
        """
        request = _stream_events_request(request, start_seq, epoch, snapshot, group_idxs, payload_format)
        return self._rpc("StreamEvents", request, timeout, metadata)  # type: ignore[no-any-return]

    def take_events(
        self,
        consumer: str | pb.TakeEventsRequest,
        *,
        max_batches: int = 0,
        snapshot: bool = False,
        start_seq: int = 0,
        epoch: str | None = None,
        group_idxs: Iterable[int] = (),
        payload_format: PayloadFormatLike | None = None,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.TakeEventsResponse:
        """Pull the batches since a named consumer's cursor.

        Args:
            consumer: the consumer's name (1..256 bytes), or a whole ``TakeEventsRequest``.
            max_batches: most batches to return (0: the server's limit).
            snapshot: restart this consumer from a snapshot batch.
            start_seq: reposition the consumer at this seq first (0: keep its cursor).
            epoch: the epoch ``start_seq`` belongs to (None: the current one).
            group_idxs: only these groups' events (empty: all).
            payload_format: ``"protobuf"`` (default) or ``"msgpack"``.
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            The batches in seq order, the consumer's next seq, and the epoch.

        Raises:
            KVServiceError: OUT_OF_RANGE, FAILED_PRECONDITION, INVALID_ARGUMENT, ...
        """
        request = _take_events_request(
            consumer, max_batches, snapshot, start_seq, epoch, group_idxs, payload_format
        )
        return self._rpc("TakeEvents", request, timeout, metadata)  # type: ignore[no-any-return]

    def get_kv_cache_group_metadata(
        self,
        request: pb.GetKVCacheGroupMetadataRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetKVCacheGroupMetadataResponse:
        """Per-group layout (block size in tokens, bytes per block ...), the hash rule, the epoch.

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.GetKVCacheGroupMetadataRequest()
        return self._rpc("GetKVCacheGroupMetadata", request, timeout, metadata)  # type: ignore[no-any-return]

    def ping(
        self,
        payload: bytes | pb.PingRequest = b"",
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.PingResponse:
        """Echo ``payload`` (latency baseline, liveness).

        Raises:
            KVServiceError: the call failed (UNAVAILABLE when the server cannot be reached).
        """
        return self._rpc("Ping", _ping_request(payload), timeout, metadata)  # type: ignore[no-any-return]


class AsyncKVCacheClient(_ClientBase):
    """``grpc.aio`` client of ``kvservice.v1.KVCacheService``; the async twin of :class:`KVCacheClient`.

    Args:
        target: a ``host:port`` address (the client opens a ``grpc.aio`` channel, plain text unless
            a TLS argument is given, and closes it in :meth:`close`), or a ``grpc.aio.Channel``
            (left open by :meth:`close`).
        token: a bearer token, sent on every call as ``authorization: Bearer <token>`` (printable
            ASCII without spaces, else ValueError).
        metadata: metadata sent on every call, before the call's own.
        timeout: the default deadline of unary calls, in seconds or as a ``timedelta``.
        options: channel options, when ``target`` is an address.
        tls, root_certificates, private_key, certificate_chain, credentials: TLS and mutual TLS,
            as for :class:`KVCacheClient`.

    Raises:
        TypeError: ``options`` or TLS arguments with a channel; ``credentials`` with ``tls`` or PEM
            bytes.
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse.

    Methods are coroutines, except :meth:`stream_events`, which returns an async iterator. Every
    failure is raised as :class:`KVServiceError`.
    """

    def __init__(
        self,
        target: str | grpc.aio.Channel,
        *,
        token: str | None = None,
        metadata: Metadata = None,
        timeout: Timeout = None,
        options: Sequence[tuple[str, Any]] | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        creds = _channel_credentials(tls, root_certificates, private_key, certificate_chain, credentials)
        if isinstance(target, str):
            if creds is None:
                channel = grpc.aio.insecure_channel(target, options=_channel_options(options))
            else:
                channel = grpc.aio.secure_channel(target, creds, options=_channel_options(options))
            self._owns_channel = True
        else:
            _check_no_channel_settings(options, creds)
            channel = target
            self._owns_channel = False
        self._channel = channel
        super().__init__(pb_grpc.KVCacheServiceStub(channel), token=token, metadata=metadata, timeout=timeout)

    @property
    def channel(self) -> grpc.aio.Channel:
        """The underlying channel."""
        return self._channel

    @property
    def stub(self) -> pb_grpc.KVCacheServiceAsyncStub:
        """The generated stub (no deadline, metadata or error translation applied)."""
        return self._stub  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _rpc(self, method: str, request: Message, timeout: Timeout, metadata: Metadata) -> Any:
        """The one call path: deadline and metadata in, ``AioRpcError`` out as KVServiceError.

        Returns an awaitable for unary methods and an async iterator for streaming ones.
        """
        multicallable = getattr(self._stub, method)
        call = multicallable(request, **self._call_options(method, timeout, metadata))
        if method in _STREAMING_METHODS:
            return _aiterate_stream(call)
        return _await_unary(call)

    async def get_computed_blocks(
        self,
        request_id: str | pb.GetComputedBlocksRequest,
        prompt_token_ids: Iterable[int] = (),
        *,
        session_id: str | None = None,
        kv_cache_report_mode: ReportMode = None,
        lora: pb.LoRA | HashingLoRA | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[pb.MultiModalFeature | HashingMultiModalFeature] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetComputedBlocksResponse:
        """Look up a prompt's prefix-cache hit (see :meth:`KVCacheClient.get_computed_blocks`).

        Raises:
            KVServiceError: INVALID_ARGUMENT (a malformed field, named), ALREADY_EXISTS, ...
            TypeError: a request message together with field arguments.
        """
        request = _get_computed_blocks_request(
            request_id, prompt_token_ids, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
        )
        return await self._rpc("GetComputedBlocks", request, timeout, metadata)  # type: ignore[no-any-return]

    async def allocate_slots(
        self,
        request_id: str | pb.AllocateSlotsRequest,
        num_new_tokens: int | None = None,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Iterable[int] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.AllocateSlotsResponse:
        """Allocate KV slots for a step (see :meth:`KVCacheClient.allocate_slots`).

        Raises:
            KVServiceError: NOT_FOUND (unknown request), INVALID_ARGUMENT, ...
            TypeError: neither a request nor ``num_new_tokens``; or both a request and fields.
        """
        request = _allocate_slots_request(request_id, num_new_tokens, num_lookahead_tokens, new_token_ids)
        return await self._rpc("AllocateSlots", request, timeout, metadata)  # type: ignore[no-any-return]

    async def free(
        self,
        request_id: str | pb.FreeRequest,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.FreeResponse:
        """Free a request's blocks and forget it (see :meth:`KVCacheClient.free`).

        Raises:
            KVServiceError: NOT_FOUND (unknown request), ...
        """
        return await self._rpc("Free", _free_request(request_id), timeout, metadata)  # type: ignore[no-any-return]

    async def reset_prefix_cache(
        self,
        request: pb.ResetPrefixCacheRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.ResetPrefixCacheResponse:
        """Drop every cached block (see :meth:`KVCacheClient.reset_prefix_cache`).

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.ResetPrefixCacheRequest()
        return await self._rpc("ResetPrefixCache", request, timeout, metadata)  # type: ignore[no-any-return]

    async def get_usage(
        self,
        request: pb.GetUsageRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetUsageResponse:
        """Pool usage and prefix-cache counters (see :meth:`KVCacheClient.get_usage`).

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.GetUsageRequest()
        return await self._rpc("GetUsage", request, timeout, metadata)  # type: ignore[no-any-return]

    async def step(
        self,
        ops: pb.StepRequest | StepBuilder | Iterable[pb.StepOp],
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.StepResponse:
        """Run a step's ops in one round trip (see :meth:`KVCacheClient.step`).

        Raises:
            KVServiceError: the whole call failed (a failed op is an ``error`` result instead).
        """
        return await self._rpc("Step", _step_request(ops), timeout, metadata)  # type: ignore[no-any-return]

    def stream_events(
        self,
        request: pb.StreamEventsRequest | None = None,
        *,
        start_seq: int | None = None,
        epoch: str | None = None,
        snapshot: bool = False,
        group_idxs: Iterable[int] = (),
        payload_format: PayloadFormatLike | None = None,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> AsyncIterator[pb.EventBatch]:
        """Subscribe to the KV event stream (see :meth:`KVCacheClient.stream_events`).

        Use as ``async for batch in client.stream_events(...)``; leaving the loop cancels the call.

        Raises:
            KVServiceError: while iterating: OUT_OF_RANGE, FAILED_PRECONDITION, RESOURCE_EXHAUSTED ...
            ValueError: both ``start_seq`` and ``snapshot``.
        """
        request = _stream_events_request(request, start_seq, epoch, snapshot, group_idxs, payload_format)
        return self._rpc("StreamEvents", request, timeout, metadata)  # type: ignore[no-any-return]

    async def take_events(
        self,
        consumer: str | pb.TakeEventsRequest,
        *,
        max_batches: int = 0,
        snapshot: bool = False,
        start_seq: int = 0,
        epoch: str | None = None,
        group_idxs: Iterable[int] = (),
        payload_format: PayloadFormatLike | None = None,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.TakeEventsResponse:
        """Pull a named consumer's batches (see :meth:`KVCacheClient.take_events`).

        Raises:
            KVServiceError: OUT_OF_RANGE, FAILED_PRECONDITION, INVALID_ARGUMENT, ...
        """
        request = _take_events_request(
            consumer, max_batches, snapshot, start_seq, epoch, group_idxs, payload_format
        )
        return await self._rpc("TakeEvents", request, timeout, metadata)  # type: ignore[no-any-return]

    async def get_kv_cache_group_metadata(
        self,
        request: pb.GetKVCacheGroupMetadataRequest | None = None,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.GetKVCacheGroupMetadataResponse:
        """Per-group layout, the hash rule, the epoch (see :meth:`KVCacheClient.get_kv_cache_group_metadata`).

        Raises:
            KVServiceError: the call failed.
        """
        request = request if request is not None else pb.GetKVCacheGroupMetadataRequest()
        return await self._rpc("GetKVCacheGroupMetadata", request, timeout, metadata)  # type: ignore[no-any-return]

    async def ping(
        self,
        payload: bytes | pb.PingRequest = b"",
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.PingResponse:
        """Echo ``payload`` (latency baseline, liveness).

        Raises:
            KVServiceError: the call failed (UNAVAILABLE when the server cannot be reached).
        """
        return await self._rpc("Ping", _ping_request(payload), timeout, metadata)  # type: ignore[no-any-return]
