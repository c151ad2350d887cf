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

TLS: pass ``tls=True`` (the system's root certificates) or ``tls=TLSConfig(...)`` (a private CA,
mutual TLS, a target name override), or ready ``credentials``; the client then opens a secure
channel. Without any of them the channel is plain text. The loose ``root_certificates``,
``private_key`` and ``certificate_chain`` arguments are still accepted.

The two clients have the same public methods, with the same signatures and docstrings: one per RPC
of the proto, each an entry of one table (see :mod:`kvservice_client._facade`). By default an RPC's
method is its generated one (``_proto/kvservice/v1/kv_cache_service_rpcs.py``, made from the proto by
``scripts/gen_protos.py``: it takes the request message; its docstring is the RPC's comment); this
module replaces some with friendlier builders (``_KVCacheServiceRPCs``: keyword arguments for the
common fields), taking the RPC's name, kind and response type from the default. Each client gets an
ordinary function per entry, blocking in :class:`KVCacheClient`, a coroutine in
:class:`AsyncKVCacheClient` (a server-streaming RPC's returns an async iterator); a test pins the
parity. The request messages are built by :mod:`kvservice_client.request_builders`; the RPCs
themselves come from :data:`kvservice_client.rpc_table.KV_CACHE_SERVICE`.

Units: token counts in tokens, block ids as pool indices, timeouts in seconds.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import (
    AsyncGenerator,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import grpc
import grpc.aio

from kvservice_client._facade import (
    _RPC,
    AsyncClientBase,
    Metadata,
    SyncClientBase,
    Timeout,
    _PlanMethod,
    facade,
    request_message,
)
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2_grpc as pb_grpc
from kvservice_client._proto.kvservice.v1 import kv_cache_service_rpcs as rpcs
from kvservice_client.convert import PayloadFormatLike
from kvservice_client.data import AsyncDataPlaneMethods, BlockingDataPlaneMethods, DataPlaneRPCs, _read_chunk
from kvservice_client.errors import KVServiceError, StatusCode
from kvservice_client.request_builders import (  # noqa: F401 (their old names here: see _get_computed_blocks_request)
    ReportMode,
    _build,
    _lora_proto,
    _mm_feature_proto,
    _report_mode_value,
    _require_no_fields,
    allocate_slots_request,
    free_request,
    get_computed_blocks_request,
    ping_request,
    stream_events_request,
    take_events_request,
)
from kvservice_client.rpc_table import KV_CACHE_SERVICE, ServiceTable
from kvservice_client.step import (
    StepBuilder,
    StepOpResponse,
    decode_new_block_ids,
    decode_result,
    step_request,
    step_results,
)
from kvservice_client.tier import TierRPCs
from kvservice_client.tls import TLSConfig, resolve_channel_security

if TYPE_CHECKING:
    from kvservice_client.hashing import LoRA as HashingLoRA
    from kvservice_client.hashing import MultiModalFeature as HashingMultiModalFeature

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_RETRY_POLICY",
    "IDEMPOTENT_METHODS",
    "AsyncKVCacheClient",
    "KVCacheClient",
    "KVServiceError",
    "Metadata",
    "ReportMode",
    "StatusCode",
    "StepBuilder",
    "StepOpResponse",
    "TLSConfig",
    "Timeout",
    "decode_new_block_ids",
    "step_results",
]


# The builders under their names from before they moved to request_builders, for code written
# against them while the move was in flight (methods added on other branches); new code imports
# from kvservice_client.request_builders. (_build, _require_no_fields ... are imported above.)
_get_computed_blocks_request = get_computed_blocks_request
_allocate_slots_request = allocate_slots_request
_free_request = free_request
_stream_events_request = stream_events_request
_take_events_request = take_events_request
_ping_request = ping_request
_step_request = step_request


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


IDEMPOTENT_METHODS = ("Ping", "GetUsage", "GetKVCacheGroupMetadata", "GetComputedBlocks", "AttachKVCache", "ReadBlocks")
"""The RPCs a client may send again without changing what the server does: reads, and
``GetComputedBlocks`` (a second lookup of a request registered with the same prompt answers its
hit and registers nothing). AllocateSlots, Free, Step, ResetPrefixCache, TakeEvents (it moves its
consumer's cursor), WriteBlocks and StreamEvents (an :class:`EventWatcher` resumes it itself) are
not retried."""

DEFAULT_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
"""gRPC's own retry policy (its service config, ``grpc.service_config``) for
:data:`IDEMPOTENT_METHODS` on a channel a client opens: a call that ends UNAVAILABLE (the server
restarting or draining, a connection lost) is sent again up to 3 times, after about 0.1, 0.2 and
0.4 s (gRPC randomizes each backoff), within the call's deadline. A channel whose ``options`` set
``grpc.service_config`` keeps its own; ``("grpc.enable_retries", 0)`` turns retries off."""


def _service_config() -> str:
    import json

    names = [{"service": "kvservice.v1.KVCacheService", "method": method} for method in IDEMPOTENT_METHODS]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": DEFAULT_RETRY_POLICY}]})


def _channel_options(
    options: Sequence[tuple[str, Any]] | None, extra: Sequence[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """``options`` plus ``extra`` (the TLS settings') plus the default receive limit, keepalive and
    retry policy (:data:`DEFAULT_RETRY_POLICY`), where they set none."""
    out = [*extra, *(options or ())]
    names = {name for name, _ in out}
    if "grpc.max_receive_message_length" not in names:
        out.append(("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES))
    out.extend((name, value) for name, value in DEFAULT_KEEPALIVE_OPTIONS if name not in names)
    if "grpc.service_config" not in names:
        out.append(("grpc.service_config", _service_config()))
    return out


def _open_channel(
    target: Any,
    channel_module: Any,
    options: Sequence[tuple[str, Any]] | None,
    tls: bool | TLSConfig,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
    credentials: grpc.ChannelCredentials | None,
) -> tuple[Any, bool]:
    """The client's channel and whether the client owns it (opened it from an address).

    ``channel_module`` is ``grpc`` or ``grpc.aio`` (their ``insecure_channel`` / ``secure_channel``).

    Raises:
        TypeError: channel settings (``options``, TLS) together with a ready channel; and as
            :func:`~kvservice_client.tls.resolve_channel_security`.
        ValueError: a target that is a bare path (a Unix socket is ``unix:PATH``); and as
            :func:`~kvservice_client.tls.resolve_channel_security`.
    """
    if isinstance(target, str) and target.startswith(("/", "./", "../", "~")):
        # gRPC would look it up as a host name ("Domain name not found"), never as a socket.
        path = os.path.expanduser(target)  # gRPC expands no "~"
        raise ValueError(f"target {target!r} is a path: a Unix socket's target is 'unix:{path}'")
    creds, tls_options = resolve_channel_security(tls, root_certificates, private_key, certificate_chain, credentials)
    if not isinstance(target, str):
        if options is not None:
            raise TypeError("options apply only when target is an address")
        if creds is not None:
            raise TypeError(
                "TLS settings (tls, root_certificates, private_key, certificate_chain, credentials) "
                "apply only when target is an address"
            )
        return target, False
    if creds is None:
        return channel_module.insecure_channel(target, options=_channel_options(options)), True
    return channel_module.secure_channel(target, creds, options=_channel_options(options, tls_options)), True


# Call options and error translation (used only by the clients' _rpc).


def _timeout_seconds(timeout: Timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


_METADATA_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _metadata_pairs(metadata: Metadata) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata`` as pairs, checked as gRPC checks it before sending (else the blocking client's
    call fails with INTERNAL "Invalid metadata" and the async one with grpc's ExecuteBatchError).

    Raises:
        ValueError: a key that is not lower-case ASCII letters, digits, ``-``, ``_``, ``.``, or
            a value of a key not ending in ``-bin`` that is not printable ASCII.
    """
    if metadata is None:
        return ()
    pairs = tuple(metadata.items()) if isinstance(metadata, Mapping) else tuple((key, value) for key, value in metadata)
    for key, value in pairs:
        if not isinstance(key, str) or not key or not _METADATA_KEY_CHARS.issuperset(key):
            raise ValueError(f"metadata: key {key!r} must be lower-case ASCII letters, digits, '-', '_' or '.'")
        if not key.endswith("-bin"):
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if not isinstance(text, str) or not (text.isascii() and text.isprintable()):
                raise ValueError(f"metadata: the value of {key!r} must be printable ASCII (or the key end in '-bin')")
    return pairs


def _base_metadata(token: str | None, metadata: Metadata) -> tuple[tuple[str, str | bytes], ...]:
    pairs = _metadata_pairs(metadata)
    if token is not None:
        # gRPC metadata values are printable ASCII; anything else fails every call with INTERNAL.
        if not token or not token.isascii() or not token.isprintable() or " " in token:
            raise ValueError("token: must be non-empty printable ASCII without spaces")
        pairs = (("authorization", f"Bearer {token}"), *pairs)
    return pairs


def _serialized_or(message_type: Any) -> Callable[[Any], bytes]:
    """A client stream's request serializer: a message of ``message_type`` serialized, or bytes
    (a message the caller serialized already, e.g. PutBlocks chunks made with one copy of their
    data) as they are."""
    serialize = message_type.SerializeToString

    def serializer(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


def _iterate_stream(call: Any) -> Generator[Any, None, None]:
    try:
        yield from call
    except grpc.RpcError as err:
        raise KVServiceError.from_rpc_error(err) from err
    finally:
        call.cancel()


async def _aiterate_stream(call: Any) -> AsyncGenerator[Any, None]:
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


_CLIENT_ARGS_DOC = """
    Args:
        target: a ``host:port`` address (the client opens a channel to it, plain text unless a TLS
            argument is given, and closes it in ``close()``), or a ready channel (left open by
            ``close()``).
        token: a bearer token, sent on every call as ``authorization: Bearer <token>`` (printable
            ASCII without spaces, else ValueError).
        metadata: metadata sent on every call, before the call's own (see :data:`Metadata`; bad
            keys or values are a ValueError).
        timeout: the default deadline of unary calls, in seconds or as a ``timedelta`` (None: no
            deadline). ``stream_events`` gets a deadline only when the call passes one.
        options: channel options, when ``target`` is an address (the receive limit defaults to
            :data:`DEFAULT_MAX_MESSAGE_BYTES`).
        tls: ``True`` opens a TLS channel verifying the server against the system's root
            certificates; a :class:`~kvservice_client.tls.TLSConfig` sets the CA, the client's key
            and certificate (mutual TLS) and the name the server's certificate is checked against.
        root_certificates, private_key, certificate_chain: the PEM bytes of a ``TLSConfig``, as
            loose arguments (still accepted; not together with a ``TLSConfig``).
        credentials: ready ``grpc.ChannelCredentials`` (e.g. ``grpc.composite_channel_credentials``),
            instead of ``tls`` and the PEM arguments.

    Raises:
        TypeError: ``options`` or TLS arguments with a channel; ``credentials`` with ``tls`` or PEM
            bytes; a ``TLSConfig`` with PEM bytes.
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse; a token that
            cannot be sent.

    A server that refuses the TLS handshake (wrong CA, no or unknown client certificate, a plain
    text client on a TLS port) ends calls with UNAVAILABLE. Every method raises
    :class:`KVServiceError` when the call fails; its ``code`` is a :class:`StatusCode`
    (INVALID_ARGUMENT naming the field, NOT_FOUND, ALREADY_EXISTS, UNAUTHENTICATED,
    PERMISSION_DENIED, DEADLINE_EXCEEDED, UNAVAILABLE ...).
"""


# --- The RPC table ----------------------------------------------------------------------------
#
# Each RPC method of the two clients is an entry (see kvservice_client._facade): by default the
# generated one of kv_cache_service_rpcs (the method takes the request message), replaced below by a
# friendlier builder where there is one (@facade(rpcs.<method>): same RPC, kind and response).
# _install_rpcs gives each client its own plain function per entry.

_ChannelT = TypeVar("_ChannelT", grpc.Channel, grpc.aio.Channel)
# KVCacheServiceAsyncStub exists only in the generated .pyi (the runtime has one stub class).
_StubT = TypeVar("_StubT", "pb_grpc.KVCacheServiceStub", "pb_grpc.KVCacheServiceAsyncStub")


class _KVCacheServiceRPCs:
    """The hand-written RPC methods both clients have, each in place of its RPC's generated default
    (see the comment above)."""

    @facade(rpcs.get_computed_blocks)
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
    ) -> pb.GetComputedBlocksRequest:
        """Look up a prompt's prefix-cache hit; registers the request on first sight.

        Args:
            request_id: the request's unique id (1..256 bytes of UTF-8), or a whole
                ``GetComputedBlocksRequest`` (then pass no other field).
            prompt_token_ids: the prompt's token ids (tokens). A buffer of int32 (``array('i')``,
                a numpy int32 array) or little-endian int32 ``bytes`` goes as
                ``packed_prompt_token_ids``: copied once, parsed without a per-id step (a server
                older than that field refuses it: INVALID_ARGUMENT, empty prompt); anything else
                (a list, an int64 array) as ``prompt_token_ids``.
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
        return get_computed_blocks_request(
            request_id, prompt_token_ids, session_id, kv_cache_report_mode, lora, cache_salt, mm_features
        )

    @facade(rpcs.allocate_slots)
    def allocate_slots(
        self,
        request_id: str | pb.AllocateSlotsRequest,
        num_new_tokens: int | None = None,
        *,
        num_lookahead_tokens: int = 0,
        new_token_ids: Iterable[int] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.AllocateSlotsRequest:
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
        return allocate_slots_request(request_id, num_new_tokens, num_lookahead_tokens, new_token_ids)

    @facade(rpcs.free)
    def free(
        self,
        request_id: str | pb.FreeRequest,
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.FreeRequest:
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
        return free_request(request_id)

    reset_prefix_cache = facade(rpcs.reset_prefix_cache)(
        request_message(
            pb.ResetPrefixCacheRequest,
            """Drop every cached block: no prefix-cache hit is left (one AllBlocksCleared event).

            Refused while any request holds a block: ``reset`` is then False and nothing changed
            (vLLM's ``BlockPool.reset_prefix_cache`` refuses likewise).

            Args:
                request: a ``ResetPrefixCacheRequest`` (it has no fields; None: an empty one).
                timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
                metadata: extra metadata for this call.

            Returns:
                ``reset``: True when the cache was cleared.

            Raises:
                KVServiceError: PERMISSION_DENIED (a watcher's or a worker's token: only a
                    scheduler's may change the cache), UNAUTHENTICATED, UNAVAILABLE, ...
            """,
        )
    )

    get_usage = facade(rpcs.get_usage)(
        request_message(
            pb.GetUsageRequest,
            """Pool usage and prefix-cache counters.

            Args:
                request: a ``GetUsageRequest`` (it has no fields; None: an empty one).
                timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
                metadata: extra metadata for this call.

            Returns:
                ``usage`` (the fraction of the pool's blocks in use, 0..1, the null block
                excluded); ``num_free_blocks``, ``num_total_blocks`` and ``num_cached_blocks``
                (blocks); ``num_running_requests`` and ``num_waiting_requests``; the counters of
                vLLM's ``PrefixCacheStats``: ``prefix_cache_requests`` (requests),
                ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens).

            Raises:
                KVServiceError: UNAUTHENTICATED (a token is required and none or an unknown one
                    came; every role may call it), UNAVAILABLE, DEADLINE_EXCEEDED, ...
            """,
        )
    )

    @facade(rpcs.step)
    def step(
        self,
        ops: pb.StepRequest | StepBuilder | Iterable[pb.StepOp],
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.StepRequest:
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
        return step_request(ops)

    @facade(rpcs.step, returns=pb.DecodeResponse, convert=decode_result)
    def decode(
        self,
        request_ids: Sequence[str] | pb.DecodeRequest,
        new_token_ids: Iterable[int] = (),
        *,
        num_new_token_ids: Iterable[int] = (),
        num_new_tokens: Iterable[int] = (),
        num_lookahead_tokens: Iterable[int] = (),
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.StepRequest:
        """A decode step of many running requests in one Step op (one round trip).

        For each request ``i`` in order, exactly ``allocate_slots(request_ids[i],
        num_new_tokens[i], num_lookahead_tokens=num_lookahead_tokens[i], new_token_ids=<its
        slice>)``: same results, refusals, errors and events; only what changed comes back.

        Args:
            request_ids: running (admitted) requests.
            new_token_ids: tokens appended since the last call, request after request (request
                ``i`` owns the next ``num_new_token_ids[i]``; one each when that is empty).
            num_new_token_ids: tokens each request appends (empty: 1 each).
            num_new_tokens: most tokens each computes this step (empty: its appended count).
            num_lookahead_tokens: extra slots per request, in tokens (empty: 0 each).
            timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
            metadata: extra metadata for this call.

        Returns:
            ``changed_indices`` (requests that got new blocks; unpack their ids with
            :func:`decode_new_block_ids`), ``refused_indices`` (too few free blocks: nothing
            changed for them) and per failed item its index and ``OpStatus`` (NOT_FOUND for an
            unknown id, INVALID_ARGUMENT for one not running or a bad field).

        Raises:
            KVServiceError: the whole op failed (INVALID_ARGUMENT: lists that do not fit
                together, naming the field) or the call did.
            TypeError: a request message together with field arguments, or one string of ids.
        """
        ops = StepBuilder().decode(
            request_ids,
            new_token_ids,
            num_new_token_ids=num_new_token_ids,
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        return ops.build()

    @facade(rpcs.stream_events)
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
    ) -> pb.StreamEventsRequest:
        """Subscribe to the KV event stream.

        Starts from ``start_seq`` (replaying retained batches), from a snapshot, or (neither) from
        the live head. Leaving the loop (``for``, or ``async for`` on the async client) or closing
        the iterator cancels the call.

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
            An iterator of ``EventBatch`` messages, in seq order (an async iterator from the async
            client).

        Raises:
            KVServiceError: while iterating: OUT_OF_RANGE (start below retention; the message names
                the oldest seq held), FAILED_PRECONDITION (another epoch), RESOURCE_EXHAUSTED (fell
                behind; names its last seq), ...
            ValueError: both ``start_seq`` and ``snapshot``.
        """
        return stream_events_request(request, start_seq, epoch, snapshot, group_idxs, payload_format)

    @facade(rpcs.take_events)
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
    ) -> pb.TakeEventsRequest:
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
        return take_events_request(consumer, max_batches, snapshot, start_seq, epoch, group_idxs, payload_format)

    get_kv_cache_group_metadata = facade(rpcs.get_kv_cache_group_metadata)(
        request_message(
            pb.GetKVCacheGroupMetadataRequest,
            """The layout and the rules a client needs to hash prompts and read events and blocks.

            Args:
                request: a ``GetKVCacheGroupMetadataRequest`` (no fields; None: an empty one).
                timeout: deadline in seconds or as a ``timedelta`` (None: the client's default).
                metadata: extra metadata for this call.

            Returns:
                Per KV cache group, in group_idx order: its kind, block size (tokens), sliding
                window, layers and bytes per block; the block hash rule (``hash_algorithm``,
                ``hash_seed``, ``hash_block_size`` in tokens); the ``epoch`` and the event log's
                ``head_seq``; ``max_data_chunk_bytes`` (0 on a meta device); the KV cache tensors
                and the server's build.

            Raises:
                KVServiceError: UNAUTHENTICATED (every role may call it), UNAVAILABLE,
                    DEADLINE_EXCEEDED, ...
            """,
        )
    )

    @facade(rpcs.ping)
    def ping(
        self,
        payload: bytes | pb.PingRequest = b"",
        *,
        timeout: Timeout = None,
        metadata: Metadata = None,
    ) -> pb.PingRequest:
        """Echo ``payload`` (latency baseline, liveness).

        Raises:
            KVServiceError: the call failed (UNAVAILABLE when the server cannot be reached).
        """
        return ping_request(payload)


# --- The two clients --------------------------------------------------------------------------


# Some of the generated defaults' names are in _KVCacheServiceRPCs too, with the friendlier
# signatures that replace them: the first base's wins, at runtime (_install_rpcs) and for mypy alike.
# mypy reports each such pair where a client class binds them (the two ignores below).
class _ClientBase(_KVCacheServiceRPCs, TierRPCs, DataPlaneRPCs, rpcs.KVCacheServiceMethods, Generic[_ChannelT, _StubT]):
    """What both clients share: the channel, the calls of each RPC of ``_service``, the default
    deadline and metadata, and the RPC methods of the table. ``_channel_module`` is ``grpc`` or
    ``grpc.aio``."""

    _channel_module: ClassVar[Any]
    _service: ClassVar[ServiceTable] = KV_CACHE_SERVICE
    """The RPCs the client calls (a test gives a subclass a table with one more)."""

    def __init__(
        self,
        target: str | _ChannelT,
        *,
        token: str | None = None,
        metadata: Metadata = None,
        timeout: Timeout = None,
        options: Sequence[tuple[str, Any]] | None = None,
        tls: bool | TLSConfig = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        # Checked before the channel opens, so a bad token or metadata leaves no channel behind.
        self._metadata = _base_metadata(token, metadata)
        self._default_timeout = _timeout_seconds(timeout)
        channel, self._owns_channel = _open_channel(
            target, self._channel_module, options, tls, root_certificates, private_key, certificate_chain, credentials
        )
        self._channel: _ChannelT = channel
        self._stub: _StubT = pb_grpc.KVCacheServiceStub(channel)
        # One multicallable per RPC of the table, made as the generated stub makes its own.
        self._calls: dict[str, tuple[Any, bool]] = {
            rpc.name: (
                getattr(channel, rpc.kind)(
                    rpc.method,
                    request_serializer=_serialized_or(rpc.request)
                    if rpc.request_streaming
                    else rpc.request.SerializeToString,
                    response_deserializer=_read_chunk if rpc.name == "ReadBlocks" else rpc.response.FromString,
                    _registered_method=True,
                ),
                rpc.response_streaming,
            )
            for rpc in self._service
        }
        self._client_streaming = frozenset(rpc.name for rpc in self._service if rpc.request_streaming)

    @property
    def channel(self) -> _ChannelT:
        """The underlying channel."""
        return self._channel

    @property
    def stub(self) -> _StubT:
        """The generated stub (no deadline, metadata or error translation applied)."""
        return self._stub

    def _call_options(self, streaming: bool, timeout: Timeout, metadata: Metadata) -> dict[str, Any]:
        seconds = _timeout_seconds(timeout)
        if seconds is None and not streaming:
            seconds = self._default_timeout
        pairs = self._metadata + _metadata_pairs(metadata)
        return {"timeout": seconds, "metadata": pairs or None}


class KVCacheClient(  # type: ignore[misc]  # a hand-written method replaces the generated default of its RPC, with another signature
    BlockingDataPlaneMethods, _ClientBase[grpc.Channel, pb_grpc.KVCacheServiceStub], SyncClientBase
):
    __doc__ = "Blocking client of ``kvservice.v1.KVCacheService`` (over a ``grpc.Channel``).\n" + _CLIENT_ARGS_DOC

    _channel_module: ClassVar[Any] = grpc

    def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _rpc(self, method: str, request: object, timeout: Timeout, metadata: Metadata) -> Any:
        """The one call path: deadline and metadata in, ``grpc.RpcError`` out as KVServiceError.

        ``method`` is the RPC's proto name; ``request`` its message, or an iterable of them when the
        client streams.
        """
        multicallable, streaming = self._calls[method]
        options = self._call_options(streaming, timeout, metadata)
        if streaming:
            return _iterate_stream(multicallable(request, **options))
        try:
            if method in self._client_streaming:  # PutBlocks, WriteBlocks
                # grpcio's blocking stream-unary call (1.85) returns only once its request
                # thread's pending send completes: against a server that stopped reading, long
                # after the deadline (a 2 s deadline came back at 20 s, when a SIGSTOPped server
                # resumed). Its future ends at the deadline.
                return multicallable.future(request, **options).result()
            return multicallable(request, **options)
        except grpc.RpcError as err:
            raise KVServiceError.from_rpc_error(err) from err


class AsyncKVCacheClient(  # type: ignore[misc]  # a hand-written method replaces the generated default of its RPC, with another signature
    AsyncDataPlaneMethods,
    _ClientBase[grpc.aio.Channel, "pb_grpc.KVCacheServiceAsyncStub"],
    AsyncClientBase,
):
    __doc__ = (
        "``grpc.aio`` client of ``kvservice.v1.KVCacheService``; the async twin of :class:`KVCacheClient`\n"
        "(same methods, as coroutines; ``stream_events`` returns an async iterator).\n" + _CLIENT_ARGS_DOC
    )

    _channel_module: ClassVar[Any] = grpc.aio

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _rpc(self, method: str, request: object, timeout: Timeout, metadata: Metadata) -> Any:
        """The one call path: deadline and metadata in, ``AioRpcError`` out as KVServiceError.

        Returns an awaitable for unary-response RPCs and an async iterator for server-streaming ones.
        """
        multicallable, streaming = self._calls[method]
        call = multicallable(request, **self._call_options(streaming, timeout, metadata))
        if streaming:
            return _aiterate_stream(call)
        return _await_unary(call)


def _install_rpcs(cls: type[_ClientBase[Any, Any]], asynchronous: bool) -> None:
    """Gives ``cls`` a plain function per entry of its bases' tables (an RPC's, or a plan's that
    makes several calls), under the entry's name (an entry of an earlier base replaces a later
    one's: the hand-written over the generated default; a plain method of an earlier base, as the
    data-plane helpers, replaces both).

    Raises:
        TypeError: an entry of an RPC that ``cls._service`` does not have, or an RPC of it that no
            entry calls (the generated entries are stale: rerun ``scripts/gen_protos.py``).
    """
    entries: dict[str, _RPC | _PlanMethod[..., Any]] = {}
    for base in reversed(cls.__mro__):
        entries.update((name, entry) for name, entry in vars(base).items() if isinstance(entry, (_RPC, _PlanMethod)))
    service = cls._service
    unknown = sorted(
        f"{name} ({method})" for name, entry in entries.items() for method in entry.calls if method not in service.rpcs
    )
    if unknown:
        raise TypeError(f"{cls.__qualname__}: methods of RPCs {service.name} does not have: {', '.join(unknown)}")
    called = {method for entry in entries.values() for method in entry.calls}
    uncalled = [rpc.name for rpc in service if rpc.name not in called]
    if uncalled:
        raise TypeError(
            f"{cls.__qualname__}: no method calls {', '.join(uncalled)} of {service.name} "
            "(rerun scripts/gen_protos.py: its generated entries are stale)"
        )
    for name, entry in entries.items():
        first = next(vars(base)[name] for base in cls.__mro__ if name in vars(base))
        if not isinstance(first, (_RPC, _PlanMethod)):
            continue  # a plain method of an earlier base (the data-plane helpers) over the entry
        function = entry.function(asynchronous)
        function.__name__ = name
        function.__module__ = cls.__module__
        function.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, function)


_install_rpcs(KVCacheClient, asynchronous=False)
_install_rpcs(AsyncKVCacheClient, asynchronous=True)
