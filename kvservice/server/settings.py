"""The server's settings: one typed section per concern, and one table of flat names over them.

Sections (each a frozen dataclass that checks its own values once, in ``__post_init__``):

========================  ===================================================================
``BindSettings``          where the gRPC port listens and how it stops
``CacheSettings``         the model KV layout, the pool, the KV tensors, the block-hash rule
``LimitsSettings``        bounds on requests, Steps and messages
``TierSettings``          bounds on the tier's calls (keys per call, leases)
``EventsSettings``        the event log's retention, subscribers and consumers
``AuthSettings``          TLS and bearer tokens
``ZmqSettings``           the ZMQ event sink (vLLM's wire)
``NatsSettings``          the NATS JetStream event sink
``MetricsSettings``       the Prometheus endpoint
``LoggingSettings``       log level
========================  ===================================================================

:class:`ServerConfig` (at the end of this module) holds one of each. Every setting has a **flat name**,
unique over all sections (``port``, ``zmq_endpoint``, ``event_max_batches``): the one name the
CLI option (``--zmq-endpoint``), the environment variable (``KVSERVICE_ZMQ_ENDPOINT``), the TOML
key (``zmq_endpoint`` or ``zmq-endpoint``, at the top level or under ``[kvservice]``) and the
keyword of ``ServerConfig(...)`` / ``start_server(**flat)`` all use. :func:`settings_table` lists
them; ``kvservice serve``'s options are generated from it, so no default is written twice.

**Adding a setting** is a one-place change: add a field to the section it belongs to::

    keepalive_time_s: float | None = setting(
        None, "Send HTTP/2 keepalive pings this often, seconds [off].", check=positive("seconds"))

* the field's type annotation decides the parsing (``int``, ``float``, ``bool``, ``str``, with
  ``| None`` when unset is allowed: an empty string or flag then means None);
* ``help`` is the option's help text; the default is appended unless ``default_text`` says it
  better (``"the preset's"``);
* ``flat`` is needed only when the field's name is not already the flat name
  (``ZmqSettings.endpoint`` is ``zmq_endpoint``);
* ``check`` is one of the checks below (``at_least(1)``, ``positive("seconds")``,
  ``in_range(0, 65535)``, ``fraction()``, ``one_of(...)``) or any callable returning an error
  phrase or None; it is not run on None;
* ``parse="bytes"`` accepts ``"512MiB"``; ``path=True`` makes the CLI check the file exists;
  ``choices`` gives the CLI a choice list (``one_of`` checks it everywhere else); ``secret=True``
  keeps it out of ``repr``;
* a check that spans fields of one section goes in that section's ``_check``; one that spans
  sections in ``ServerConfig.__init__``.

Nothing else changes: the option, the variable, the TOML key and the keyword all appear, and
``tests/unit/test_settings_table.py`` checks them against this table. Read it through its
section (``config.cache.block_size``: typed); each component is handed its own section, not the
whole configuration. Flat names build a configuration and replace values in it, never read one.

Layering (defaults < TOML file < ``KVSERVICE_*`` < flags) is :func:`load_config`.
Chosen over pydantic-settings: that would bring pydantic and pydantic-core into a server whose
settings are a few dozen scalars with bounds, add their import to every start, and its sources
cover neither click (which every other subcommand uses) nor paths relative to the config file;
the table here is stdlib ``dataclasses.field(metadata=...)``, the layering about 40 lines.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvservice.core.model_config import PRESETS
from kvservice.core.tier import TierLimits
from kvservice.server.endpoints import check_endpoint_exposure
from kvservice.server.vllm_flags import KV_CACHE_DTYPES, kv_events_config_settings
from kvservice_client.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED, HASH_ALGORITHMS
from kvservice_client.jetstream import redact_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_REQUEST_IDLE_TIMEOUT_S",
    "AuthSettings",
    "BindSettings",
    "CacheSettings",
    "EventsSettings",
    "LimitsSettings",
    "LoggingSettings",
    "MetricsSettings",
    "NatsSettings",
    "OTHER_ENV_VARS",
    "SECTIONS",
    "ServerConfig",
    "Setting",
    "SettingInfo",
    "TierSettings",
    "ZmqSettings",
    "at_least",
    "check_fields",
    "check_name",
    "check_retention",
    "check_subject_prefix",
    "fraction",
    "in_range",
    "load_config",
    "one_of",
    "parse_bytes",
    "positive",
    "setting",
    "setting_aliases",
    "settings_table",
]

Check = Callable[[Any], "str | None"]
"""A value check: returns what is wrong (``"must be >= 1"``) or None."""


@dataclass(frozen=True)
class Setting:
    """What a section field's metadata says about it (see the module docstring)."""

    help: str
    flat: str | None = None
    check: Check | None = None
    parse: str | None = None
    path: bool = False
    choices: Sequence[str] | None = None
    default_text: str | None = None
    aliases: tuple[str, ...] = ()


def setting(
    default: Any,
    help: str = "",
    *,
    flat: str | None = None,
    check: Check | None = None,
    parse: str | None = None,
    path: bool = False,
    choices: Sequence[str] | None = None,
    default_text: str | None = None,
    secret: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A section field carrying its :class:`Setting` (a ``dataclasses.field``)."""
    meta = Setting(help, flat, check, parse, path, choices, default_text, aliases)
    return field(default=default, repr=not secret, metadata={"setting": meta})


# -- checks -----------------------------------------------------------------------------------


def at_least(bound: float, unit: str = "") -> Check:
    """``value >= bound``."""
    text = f"must be >= {bound}" + (f" {unit}" if unit else "")
    return lambda v: None if v >= bound else text


def positive(unit: str = "") -> Check:
    """``value > 0``."""
    text = "must be > 0" + (f" {unit}" if unit else "")
    return lambda v: None if v > 0 else text


def in_range(low: int, high: int) -> Check:
    """``low <= value <= high``."""
    return lambda v: None if low <= v <= high else f"must be in {low}..{high}"


def fraction() -> Check:
    """``0 < value <= 1``."""
    return lambda v: None if 0 < v <= 1 else "must be in (0, 1]"


def one_of(choices: Sequence[str]) -> Check:
    """``value in choices``."""
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_fields(obj: Any) -> None:
    """Run every field's ``check`` on ``obj`` (a dataclass whose fields come from :func:`setting`).

    Raises:
        ValueError: ``"<flat name> <what is wrong>; got <value>"``.
    """
    for f in dataclasses.fields(obj):
        meta = f.metadata.get("setting")
        if meta is None or meta.check is None:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        problem = meta.check(value)
        if problem:
            shown = _shown(value) if f.repr else repr(redact_url(value))  # a secret: its credentials as ***
            raise ValueError(f"{meta.flat or f.name} {problem}; got {shown}")


class _Section:
    """Base of the sections: checks the fields, then the section's own cross-field rules."""

    name: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every section is a dataclass

    def __post_init__(self) -> None:
        check_fields(self)
        self._check()

    def _check(self) -> None:
        """Rules spanning several fields of the section (none by default)."""


# -- sections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BindSettings(_Section):
    """Where the gRPC port and the probes listen, and how a graceful stop goes.

    Attributes:
        host: address to bind ("0.0.0.0" or "[::]" for all interfaces; off loopback see auth).
        port: port to bind; 0 picks a free one (the bound one is printed).
        shutdown_grace_s: how long a graceful stop lets calls in flight finish, seconds (open
            streams get at least 1 s to end with their status); also ``grace_seconds``.
        drain_delay_s: on SIGTERM, seconds between NOT_SERVING (probes and health say so) and the
            stop, while the port still serves: time for load balancers to take the pod out.
        health_port: plaintext ``grpc.health.v1`` port without auth (None: off; 0 picks one).
        health_http_port: HTTP ``/healthz`` ``/readyz`` port without auth (None: off; 0 picks one).
        health_host: address the probe ports bind (None: ``host``).
        uds: also listen on this Unix-domain socket path (None: off), with the TCP port's
            credentials; the socket file is made mode 0600 (only this user connects) and removed
            at stop. With auth off, AttachKVCache is allowed over it or over loopback only.
        keepalive_time_s: seconds between HTTP/2 keepalive pings the server sends on a connection,
            so a client that vanished without closing (a dead host, a NAT or a load balancer that
            dropped the flow) is found and its streams end.
        keepalive_timeout_s: seconds a ping may go unanswered before the connection is closed.
        keepalive_min_client_interval_s: the most often (seconds) a client may ping on a quiet
            connection before it is told "too many pings" (below the client's default of 30 s).
    """

    name: ClassVar[str] = "bind"
    host: str = setting("127.0.0.1", "Address to bind.")
    port: int = setting(50051, "Port to bind; 0 picks a free one.", check=in_range(0, 65535))
    shutdown_grace_s: float = setting(
        5.0,
        "Seconds a graceful stop lets calls in flight finish.",
        check=at_least(0, "seconds"),
        aliases=("grace_seconds",),
    )
    drain_delay_s: float = setting(
        0.0,
        "On SIGTERM, seconds between NOT_SERVING and the stop (the port still serves meanwhile).",
        check=at_least(0, "seconds"),
    )
    health_port: int | None = setting(
        None,
        "Plaintext grpc.health.v1 port, no token (for probes); 0 picks one.",
        check=in_range(0, 65535),
        default_text="off",
    )
    health_http_port: int | None = setting(
        None,
        "HTTP /healthz /readyz port, no token (for probes); 0 picks one.",
        check=in_range(0, 65535),
        default_text="off",
    )
    health_host: str | None = setting(None, "Address the probe ports bind.", default_text="--host")
    uds: str | None = setting(
        None,
        "Also listen on this Unix-domain socket path (mode 0600, removed at stop).",
        check=lambda v: None if v.strip() else "must be a socket path (or unset: no Unix-domain listener)",
        default_text="off",
    )
    keepalive_time_s: float = setting(
        30.0,
        "Seconds between the server's HTTP/2 keepalive pings on a connection.",
        check=lambda v: None if 0 < v < float("inf") else "must be a finite number > 0 seconds",
    )
    keepalive_timeout_s: float = setting(
        10.0,
        "Seconds a keepalive ping may go unanswered before the connection closes.",
        check=lambda v: None if 0 < v < float("inf") else "must be a finite number > 0 seconds",
    )
    keepalive_min_client_interval_s: float = setting(
        5.0,
        "The most often, in seconds, a client may ping on a quiet connection.",
        check=lambda v: None if 0 < v < float("inf") else "must be a finite number > 0 seconds",
    )


@dataclass(frozen=True)
class CacheSettings(_Section):
    """The model KV layout, the pool, the KV tensors and the block-hash rule.

    Attributes:
        preset: model KV layout (``kvservice.core.model_config.PRESETS``).
        block_size: tokens per block (None: the preset's).
        num_blocks: blocks in the pool, null block included (None: from the memory budget); vLLM's
            ``--num-gpu-blocks-override``.
        kv_cache_memory: KV tensor budget, bytes (None: 1 GiB on CPU/meta).
        gpu_memory_utilization: fraction of free CUDA memory for KV tensors (None: 0.9 on CUDA).
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:N" or "meta" (shapes only).
        max_model_len: longest request, tokens (None: the preset's, lowered to what the pool holds).
        hash_algorithm, hash_seed: the block-hash rule (``hash_algorithm`` is vLLM's
            ``--prefix-caching-hash-algo``).
        kv_cache_dtype: KV tensor dtype, vLLM's ``--kv-cache-dtype`` ("auto": the preset's; see
            ``kvservice.server.vllm_flags``).
        block_hash_format: "int64" (vLLM's published form) or "digest", on events.
        check_invariants: debug: check the cache's invariants after every mutating call (slow).
        enable_prefix_caching: keep full blocks indexed by hash for prefix-cache hits (off: no
            hashes are kept, no hits, freed blocks reused newest first, as vLLM without
            ``--enable-prefix-caching``).
        model_config: a Hugging Face ``config.json`` (or its folder), read locally: the KV layout
            is derived from it as vLLM 0.33 does (``kvservice.core.model_config``) instead of
            ``preset`` (None: use ``preset``).
        kv_cache_layout: a TOML layout file (per layer or run of layers: kind and parameters;
            ``kvservice.core.model_config.load_kv_cache_layout``) instead of ``preset`` (None: off).
    """

    name: ClassVar[str] = "cache"
    preset: str = setting("llama-3-8b", "Model KV layout.", check=one_of(tuple(PRESETS)), choices=sorted(PRESETS))
    block_size: int | None = setting(None, "Tokens per block.", check=at_least(1), default_text="the preset's")
    num_blocks: int | None = setting(
        None,
        "Blocks in the pool, null block included (vLLM: --num-gpu-blocks-override).",
        check=at_least(1),
        default_text="from the memory budget",
        aliases=("num_gpu_blocks_override",),
    )
    kv_cache_memory: int | None = setting(
        None, "KV tensor budget in bytes, e.g. 512MiB.", parse="bytes", check=at_least(1), default_text="1GiB on CPU"
    )
    gpu_memory_utilization: float | None = setting(
        None, "Fraction of free CUDA memory for KV tensors.", check=fraction(), default_text="0.9 on CUDA"
    )
    device: str = setting("auto", "auto | cpu | cuda[:N] | meta (shapes only).")
    max_model_len: int | None = setting(
        None, "Longest request in tokens.", check=at_least(1), default_text="the preset's"
    )
    hash_algorithm: str = setting(
        DEFAULT_HASH_ALGORITHM,
        "Block-hash rule (vLLM: --prefix-caching-hash-algo).",
        check=one_of(HASH_ALGORITHMS),
        choices=HASH_ALGORITHMS,
        aliases=("prefix_caching_hash_algo",),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV tensor dtype, as vLLM's --kv-cache-dtype (auto: the model's).",
        check=one_of(tuple(KV_CACHE_DTYPES)),
        choices=tuple(KV_CACHE_DTYPES),
    )
    hash_seed: str = setting(DEFAULT_HASH_SEED, "Root seed of the block hashes.")
    block_hash_format: str = setting(
        "int64",
        "Block hashes on events: int64 (vLLM's) or digest.",
        check=lambda v: None if v in ("int64", "digest") else "must be 'int64' or 'digest'",
        choices=("int64", "digest"),
    )
    check_invariants: bool = setting(False, "Debug: check the cache's invariants after every mutating call (slow).")
    enable_prefix_caching: bool = setting(
        True, "Prefix caching: full blocks kept by hash for hits (vLLM: --enable-prefix-caching)."
    )
    model_config: str | None = setting(
        None,
        "A model's config.json (or its folder), read locally: the KV layout as vLLM derives it.",
        default_text="the preset",
    )
    kv_cache_layout: str | None = setting(
        None,
        "A TOML KV layout file (per layer or run of layers) instead of the preset, or opaque:BYTES[xGROUPS]: "
        "blocks of exactly BYTES (a vLLM offload chunk, for the shared tier: docs/tier.md).",
        default_text="off",
    )

    def _check(self) -> None:
        if self.model_config is not None and self.kv_cache_layout is not None:
            raise ValueError("give model_config or kv_cache_layout, not both")


DEFAULT_REQUEST_IDLE_TIMEOUT_S = 600.0
"""Seconds without a call after which the server frees a request (``request_idle_timeout_s``): ten
minutes, far beyond a scheduler step (a scheduler calls every running request each step), so only
the requests of a scheduler that stopped calling are freed."""


DATA_WORKER_PRIORITIES = ("idle", "nice")
"""The ``data_worker_priority`` values (``kvservice.server.data_plane._lower_priority``)."""


@dataclass(frozen=True)
class LimitsSettings(_Section):
    """Bounds on requests, Steps and messages; each refusal names its bound.

    Attributes:
        max_num_requests: registered requests at once.
        max_step_ops: ops per Step.
        max_step_tokens: tokens per Step (prompt token ids, packed or not, + new_token_ids over its ops); bounds how
            long one Step holds the event loop (262,144: about 0.1 s here; a Step runs whole, without
            yielding, so its events are one batch).
        max_message_bytes: largest gRPC message accepted or sent, bytes.
        request_idle_timeout_s: a request not called for this long is freed as by Free, seconds
            (:data:`DEFAULT_REQUEST_IDLE_TIMEOUT_S`, so the requests of a scheduler that crashed
            do not hold their blocks for ever; 0 or None: never).
        max_waiting_tokens: prompt tokens held by waiting requests (registered, not yet admitted)
            at once (8,388,608, about 370 MiB of server memory; 0: no bound); one more is refused
            with RESOURCE_EXHAUSTED naming max_waiting_tokens.
        data_chunk_bytes: largest ``data`` of one WriteBlocks / ReadBlocks chunk, bytes (4 KiB ..
            max_message_bytes - 64 KiB; None: 1 MiB, or half of max_message_bytes when that is
            smaller: :attr:`chunk_bytes`). A read or write holds about one chunk (and one block
            being written) per call in server memory. A chunk never spans two blocks, so with
            blocks of at most this many bytes every block is one message whatever the value
            (qwen-2.5-0.5b at 16 tokens: 196,608 bytes a block, so raising it above 1 MiB changes
            nothing there).
        max_data_streams: WriteBlocks and ReadBlocks streams open at once; one more is
            RESOURCE_EXHAUSTED naming max_data_streams. Each holds at most about two chunks (a read:
            one being copied, one being written; a write: one block being assembled and one chunk)
            in server memory, so the data plane holds at most about ``2 * max_data_streams *
            chunk_bytes`` (128 MiB at the defaults) beyond what gRPC queues in each stream's
            receive window (``stream_window_bytes``).
        stream_window_bytes: HTTP/2 receive window of each stream the server reads (a
            WriteBlocks or PutBlocks client stream): bytes a client may send ahead of what the
            server has taken (gRPC's ``grpc.http2.lookahead_bytes``; BDP probing, which would grow
            it to many MiB, is off). None: two data chunks, at least 64 KiB (:attr:`window_bytes`;
            2 MiB at the defaults), so a client sends the next chunk while the server copies one; HTTP/2's
            own 64 KiB made a 1 MiB chunk 16 window round trips (BENCHMARKS.md, "The stream
            window"). gRPC queues at most this much per stream, whatever the client sends (the
            issue-24 load of 16 + 16 streams of 64 MiB: +74-79 MiB of server memory at 2 MiB,
            +28-29 MiB at 64 KiB).
        data_worker_priority: CPU priority of the data plane's copy threads (checksums, copies,
            serialization): ``idle`` (Linux ``SCHED_IDLE``: they run on CPU time no other thread
            wants, so a scheduler's calls beside heavy data traffic wait least; the streams get
            almost nothing while every core is busy with other work) or ``nice`` (nice +10 above
            the server's threads: the streams keep about a tenth of a contended core).
            ``kvservice.server.data_plane._lower_priority``; BENCHMARKS.md (issue 24).
    """

    name: ClassVar[str] = "limits"
    max_num_requests: int = setting(65536, "Registered requests at once.", check=at_least(1))
    max_step_ops: int = setting(4096, "Ops per Step.", check=at_least(1))
    max_step_tokens: int = setting(
        1 << 18,
        "Tokens per Step, prompt + new over all ops (bounds how long one Step holds the loop).",
        check=at_least(1),
    )
    max_message_bytes: int = setting(
        64 * 1024 * 1024,
        "Largest gRPC message, e.g. 64MiB.",
        parse="bytes",
        check=at_least(4096, "bytes"),
        default_text="64MiB",
    )
    request_idle_timeout_s: float | None = setting(
        DEFAULT_REQUEST_IDLE_TIMEOUT_S,
        "Free a request not called (GetComputedBlocks, AllocateSlots) for this long, seconds; 0: never.",
        check=lambda v: None if 0 <= v < float("inf") else "must be a finite number >= 0 seconds (0: off)",
    )
    max_waiting_tokens: int = setting(
        8 * 1024 * 1024,
        "Prompt tokens held by waiting (registered, not yet admitted) requests at once; 0: no bound.",
        check=at_least(0, "tokens"),
    )
    data_chunk_bytes: int | None = setting(
        None,
        "Largest data chunk of WriteBlocks/ReadBlocks, e.g. 1MiB (a chunk never spans two blocks).",
        parse="bytes",
        default_text="1MiB, at most half of --max-message-bytes",
    )
    max_data_streams: int = setting(
        64, "WriteBlocks and ReadBlocks streams open at once (one more: RESOURCE_EXHAUSTED).", check=at_least(1)
    )
    stream_window_bytes: int | None = setting(
        None,
        "HTTP/2 receive window of each client stream the server reads, e.g. 2MiB (bytes sent ahead of the server).",
        parse="bytes",
        check=in_range(65536, (1 << 31) - 1),
        default_text="two data chunks",
    )
    data_worker_priority: str = setting(
        "idle",
        "CPU priority of the data plane's copy threads: idle (SCHED_IDLE: scheduler calls first) or nice (+10).",
        check=one_of(DATA_WORKER_PRIORITIES),
        choices=DATA_WORKER_PRIORITIES,
    )

    @property
    def chunk_bytes(self) -> int:
        """The data chunk bound in force: ``data_chunk_bytes``, or its default."""
        if self.data_chunk_bytes is not None:
            return self.data_chunk_bytes
        return min(1 << 20, self.max_message_bytes // 2)

    @property
    def window_bytes(self) -> int:
        """The stream receive window in force, bytes: ``stream_window_bytes``, or two data chunks
        and at least HTTP/2's own 64 KiB."""
        if self.stream_window_bytes is not None:
            return self.stream_window_bytes
        return min(max(2 * self.chunk_bytes, 65536), (1 << 31) - 1)

    def _check(self) -> None:
        if self.data_chunk_bytes is not None and not 4096 <= self.data_chunk_bytes <= self.max_message_bytes - 65536:
            raise ValueError(
                f"data_chunk_bytes must be in 4096..max_message_bytes - 65536 ({self.max_message_bytes - 65536}) "
                f"bytes; got {self.data_chunk_bytes}"
            )


def _finite_seconds(v: float) -> str | None:
    return None if 0 < v < float("inf") else "must be a finite number > 0 seconds"


@dataclass(frozen=True)
class TierSettings(_Section):
    """Bounds on the tier's calls (``kvservice.core.tier``, docs/tier.md); each refusal names its
    setting. The defaults are :class:`kvservice.core.tier.TierLimits`'s (written there once).

    Attributes:
        max_keys_per_call: most keys one LookupBlocks, ReserveBlocks, PutBlocks or LeaseBlocks
            names (``tier_max_keys_per_call``); one more is INVALID_ARGUMENT naming it.
        default_lease_ttl_s: seconds a lease lasts when the call asks 0
            (``tier_default_lease_ttl_s``); at most ``max_lease_ttl_s``.
        max_lease_ttl_s: the longest lease a call may ask for, seconds (``tier_max_lease_ttl_s``);
            a longer ``ttl_s`` is INVALID_ARGUMENT naming it.
        max_leases: leases (read and put) live at once (``tier_max_leases``); a call that would
            take one more is RESOURCE_EXHAUSTED naming it, nothing changed.
    """

    name: ClassVar[str] = "tier"
    max_keys_per_call: int = setting(
        TierLimits.max_keys_per_call,
        "Most keys one tier call (LookupBlocks, ReserveBlocks, PutBlocks, LeaseBlocks) names.",
        flat="tier_max_keys_per_call",
        check=at_least(1, "keys"),
    )
    default_lease_ttl_s: float = setting(
        TierLimits.default_lease_ttl_s,
        "Seconds a tier lease lasts when the call asks 0 (at most --tier-max-lease-ttl-s).",
        flat="tier_default_lease_ttl_s",
        check=_finite_seconds,
    )
    max_lease_ttl_s: float = setting(
        TierLimits.max_lease_ttl_s,
        "The longest tier lease a call may ask for, seconds.",
        flat="tier_max_lease_ttl_s",
        check=_finite_seconds,
    )
    max_leases: int = setting(
        TierLimits.max_leases,
        "Tier leases (read and put) live at once (one more: RESOURCE_EXHAUSTED).",
        flat="tier_max_leases",
        check=at_least(1, "leases"),
    )

    def _check(self) -> None:
        if self.default_lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError(
                f"tier_default_lease_ttl_s ({self.default_lease_ttl_s}) must be <= tier_max_lease_ttl_s "
                f"({self.max_lease_ttl_s}) seconds"
            )

    @property
    def limits(self) -> TierLimits:
        """These bounds as the core's :class:`~kvservice.core.tier.TierLimits`."""
        return TierLimits(self.max_keys_per_call, self.default_lease_ttl_s, self.max_lease_ttl_s, self.max_leases)


@dataclass(frozen=True)
class EventsSettings(_Section):
    """The event log: retention, subscribers, consumers (``kvservice.server.event_log``).

    Attributes:
        data_parallel_rank: copied onto every event batch (None: not set).
        max_batches: batches retained for replay.
        max_bytes: bytes retained for replay: each batch's msgpack bytes, the wire encodings cached
            on it (each plus ``ENCODING_OVERHEAD_BYTES``) and ``ENTRY_OVERHEAD_BYTES`` (within 1.5x
            of the Python memory the log takes); the newest batch is always kept.
        max_subscriber_lag: batches a stream subscriber may fall behind the head before it is
            ended with RESOURCE_EXHAUSTED.
        max_consumers: named TakeEvents consumers tracked at once.
        snapshot_part_tokens: token ids per snapshot message, about (a snapshot goes in parts; a
            protobuf part is encoded in steps of about 1,024 token ids that yield to the loop).
        stalled_write_timeout_s: the longest one stream write may take, seconds (the client stopped
            reading, or its connection died silently), behind or not: then the stream is ended with
            DEADLINE_EXCEEDED naming the bound; also how long an ended subscriber's handler may stay
            blocked in a write. The data plane's streams use it too: a ReadBlocks chunk not taken,
            or a WriteBlocks next chunk not sent, within it cuts the stream (DEADLINE_EXCEEDED).
        consumer_idle_timeout_s: a named consumer that has not taken for this long is dropped
            (lazily, at the next take or cursor lookup), seconds.
        max_streams: open StreamEvents subscriptions at once; one more is RESOURCE_EXHAUSTED.
        max_snapshot_cuts: snapshots cut at once. Callers asking at the same head share one cut;
            at the bound a caller joins the newest cut of its group filter in production, or waits.
        max_snapshot_bytes_in_flight: snapshot part bytes being written at once, over all
            StreamEvents snapshot streams (a stream waits its turn beyond it; a part bigger than
            it goes alone), bytes: bounds how much of the loop snapshot writing takes from other
            calls however many clients ask for snapshots at once. A part counts until its write
            completes or for 0.5 s, whichever is first, so clients that stop reading mid-snapshot
            delay the other snapshot streams by 0.5 s per wave of their blocked parts that fills
            this budget (about this / part size of them), not until their streams are cut by
            ``stalled_write_timeout_s`` (each holding at most one part in the server meanwhile).
        max_snapshot_bytes_stalled: snapshot part bytes written to streams whose clients stopped
            reading (a part not taken 0.5 s after its write started stops counting in
            ``max_snapshot_bytes_in_flight`` and counts here until it is taken or its stream is
            cut), at most, bytes: bounds the memory such clients hold in the server however many
            there are; beyond it a stalled part keeps counting in ``max_snapshot_bytes_in_flight``
            (the other snapshot streams then wait for it, up to ``stalled_write_timeout_s``).
        max_snapshot_bytes_per_s: the rate of that budget, bytes per second on average (bursts up
            to ``max_snapshot_bytes_in_flight``): bounds what snapshot traffic takes from other
            calls and from clients sharing the machine (a million 16-token blocks, about 100 MB,
            stream in under 2 s at the default).
        kv_events_medium: the ``medium`` of every event ("GPU", as vLLM's primary pool always
            says, whatever the device: consumers such as Dynamo's indexer file other media in
            their host/offload tiers); "CPU" or another tier name for a deployment that wants the
            tier named otherwise. A non-empty string of at most 64 characters.
        max_take_batches: most batches one TakeEvents returns (not a setting).
        max_take_bytes: most bytes of batches one TakeEvents answer carries (not a setting: the
            server derives it from ``max_message_bytes``; 4 MiB, gRPC's default receive limit).
    """

    name: ClassVar[str] = "events"
    data_parallel_rank: int | None = setting(None, "Rank copied onto every event batch.", default_text="unset")
    max_batches: int = setting(
        100_000, "Event batches retained for replay.", flat="event_max_batches", check=at_least(1)
    )
    max_bytes: int = setting(
        256 * 1024 * 1024,
        "Event bytes retained for replay, e.g. 256MiB.",
        flat="event_max_bytes",
        parse="bytes",
        check=at_least(1),
        default_text="256MiB",
    )
    max_subscriber_lag: int = setting(10_000, "Batches a stream subscriber may fall behind.", check=at_least(1))
    max_consumers: int = setting(1024, "Named TakeEvents consumers.", check=at_least(1))
    snapshot_part_tokens: int = setting(32_768, "Token ids per snapshot message, about.", check=at_least(1))
    stalled_write_timeout_s: float = setting(
        30.0,
        "The longest one stream write may take, seconds (a client that stopped reading is cut off); "
        "also how long a WriteBlocks may wait for its next chunk.",
        check=positive("seconds"),
    )
    consumer_idle_timeout_s: float = setting(
        3600.0, "Drop a TakeEvents consumer that has not taken for this long, seconds.", check=positive("seconds")
    )
    max_streams: int = setting(1024, "Open StreamEvents subscriptions.", check=at_least(1))
    max_snapshot_cuts: int = setting(
        2, "Snapshots cut at once (callers at the same head share one cut).", check=at_least(1)
    )
    max_snapshot_bytes_in_flight: int = setting(
        1024 * 1024,
        "Snapshot part bytes being written at once over all streams, e.g. 1MiB.",
        parse="bytes",
        check=at_least(1),
        default_text="1MiB",
    )
    max_snapshot_bytes_stalled: int = setting(
        16 * 1024 * 1024,
        "Snapshot part bytes held for streams whose clients stopped reading, e.g. 16MiB.",
        parse="bytes",
        check=at_least(0),
        default_text="16MiB",
    )
    max_snapshot_bytes_per_s: int = setting(
        64 * 1024 * 1024,
        "Snapshot part bytes written per second over all streams, on average, e.g. 64MiB.",
        parse="bytes",
        check=at_least(1),
        default_text="64MiB",
    )
    kv_events_medium: str = setting(
        "GPU",
        "The medium every KV event names (vLLM's primary pool says GPU).",
        check=lambda v: None if 1 <= len(v) <= 64 else "must be a non-empty string of at most 64 characters",
    )
    kv_events_locality: str | None = setting(
        None,
        "vLLM 0.33's locality on every BlockStored/BlockRemoved (LOCAL or REMOTE).",
        check=lambda v: None if v in ("LOCAL", "REMOTE") else "must be LOCAL or REMOTE",
        default_text="unset",
    )
    kv_events_ownership: str | None = setting(
        None,
        "vLLM 0.33's ownership on every BlockStored/BlockRemoved (a tier's name, e.g. kvservice).",
        check=lambda v: None if 1 <= len(v) <= 64 else "must be a non-empty string of at most 64 characters",
        default_text="unset",
    )
    max_take_batches: int = 1000
    max_take_bytes: int = 4 * 1024 * 1024

    def _check(self) -> None:
        for name in ("max_take_batches", "max_take_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")


@dataclass(frozen=True)
class AuthSettings(_Section):
    """TLS and bearer tokens (``kvservice.server.auth``).

    Attributes:
        tls_cert_file, tls_key_file: the server's certificate chain and private key (PEM; both
            or neither). Without them the port is plain text.
        tls_client_ca_file: CA (PEM) client certificates must chain to: mutual TLS.
        auth_tokens_file: TOML file of bearer tokens with roles (scheduler, watcher, worker).
        allow_insecure_bind: bind a non-loopback host with neither TLS nor tokens, or a ZMQ
            socket off loopback (no authentication there at all); refused otherwise.
    """

    name: ClassVar[str] = "auth"
    tls_cert_file: str | None = setting(
        None, "Server TLS certificate chain, PEM (with --tls-key-file).", path=True, default_text="plain text"
    )
    tls_key_file: str | None = setting(
        None, "Server TLS private key, PEM, unencrypted.", path=True, default_text="none"
    )
    tls_client_ca_file: str | None = setting(
        None,
        "CA certificates, PEM: require client certificates signed by them (mutual TLS).",
        path=True,
        default_text="none",
    )
    auth_tokens_file: str | None = setting(
        None,
        "TOML file of bearer tokens ([[tokens]] name, role, token or token_sha256) with roles "
        "scheduler (every RPC), watcher (events and reads), worker (the data plane and reads) or tier (blocks by hash, "
        "the memory and reads).",
        path=True,
        default_text="no tokens",
    )
    allow_insecure_bind: bool = setting(
        False,
        "Bind a non-loopback host with neither TLS nor tokens, or a ZMQ endpoint off loopback (no auth "
        "there at all; refused otherwise).",
    )

    def _check(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_key_file is None else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(f"{given} needs {missing} (TLS takes the certificate chain and its private key)")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


def _zmq_endpoint(value: str) -> str | None:
    return None if "://" in value else "must be a ZMQ endpoint such as tcp://*:5557 or ipc:///path"


@dataclass(frozen=True)
class ZmqSettings(_Section):
    """The ZMQ event sink, vLLM's wire (``kvservice.server.zmq_publisher``).

    Attributes:
        endpoint: PUB endpoint, e.g. "tcp://*:5557" (None: off). Bound when it has a wildcard
            or is ipc://, connected otherwise (vLLM's rule); off loopback it needs
            allow_insecure_bind.
        replay_endpoint: ROUTER endpoint (bound) answering vLLM replay requests (needs endpoint).
        topic: topic frame of every message ("" is vLLM's default; None is "" too).
        hwm: PUB send high-water mark, messages queued per subscriber before ZMQ drops.
        kv_events_config: vLLM's ``--kv-events-config`` JSON as given (None: not given); applied
            by ``ServerConfig`` onto the settings above and ``event_max_batches`` (see
            ``kvservice.server.vllm_flags``).
    """

    name: ClassVar[str] = "zmq"
    endpoint: str | None = setting(
        None,
        "Publish KV events vLLM-style on this ZMQ PUB endpoint, e.g. tcp://*:5557 (bound; off loopback "
        "needs --allow-insecure-bind; tcp://host:port connects).",
        flat="zmq_endpoint",
        check=_zmq_endpoint,
        default_text="off",
    )
    replay_endpoint: str | None = setting(
        None,
        "ZMQ ROUTER endpoint answering vLLM replay requests, always bound, e.g. tcp://*:5558.",
        flat="zmq_replay_endpoint",
        check=_zmq_endpoint,
        default_text="off",
    )
    topic: str | None = setting("", "Topic frame of every ZMQ message.", flat="zmq_topic", default_text='""')
    hwm: int = setting(
        100_000, "ZMQ PUB high-water mark, messages per subscriber.", flat="zmq_hwm", check=at_least(1, "messages")
    )
    kv_events_config: str | None = setting(
        None,
        "vLLM's --kv-events-config JSON, mapped onto the zmq_* settings and event_max_batches.",
        default_text="unset",
    )

    def _check(self) -> None:
        if self.kv_events_config is not None:
            kv_events_config_settings(self.kv_events_config)  # raises naming the key
        object.__setattr__(self, "topic", self.topic or "")  # an empty flag or variable gives None: ""
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("zmq_replay_endpoint needs zmq_endpoint (replays answer what the PUB socket published)")


_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_SUBJECT_TOKEN = re.compile(r"[^\s.*>]+")


def check_name(setting: str, value: str) -> None:
    """Check a NATS instance or stream name: one or more of ``[A-Za-z0-9_-]`` (a single subject
    token, and a valid stream name).

    Raises:
        ValueError: it is not (the message names ``setting``).
    """
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{setting} must be one or more of A-Z a-z 0-9 _ -; got {value!r}")


def check_subject_prefix(value: str) -> None:
    """Check a subject prefix: dot-separated, non-empty tokens without wildcards or whitespace.

    Raises:
        ValueError: it is not (the message names ``nats_subject_prefix``).
    """
    if not all(_SUBJECT_TOKEN.fullmatch(token) for token in value.split(".")):
        raise ValueError(
            f"nats_subject_prefix must be dot-separated non-empty tokens without '*', '>' or whitespace; got {value!r}"
        )


def check_retention(max_age_s: float, duplicate_window_s: float) -> None:
    """The dedup window fits the retention by age (the names are the flat settings).

    Raises:
        ValueError: a window above a set ``max_age_s``.
    """
    if max_age_s and duplicate_window_s > max_age_s:
        raise ValueError(
            f"nats_duplicate_window_s ({duplicate_window_s}) must be <= nats_max_age_s ({max_age_s}) seconds"
        )


def split_servers(url: str) -> tuple[str, ...]:
    """The comma-separated server URLs of ``nats_url``, stripped, empty ones dropped."""
    return tuple(part.strip() for part in url.split(",") if part.strip())


def _nats_url(value: str) -> str | None:
    return None if split_servers(value) else "must name at least one server, e.g. nats://127.0.0.1:4222"


def _token_name(value: str) -> str | None:
    return None if _TOKEN.fullmatch(value) else "must be one or more of A-Z a-z 0-9 _ -"


def _no_limit(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0 (0 = no limit)"


@dataclass(frozen=True)
class NatsSettings(_Section):
    """The NATS JetStream event sink (``kvservice.server.nats_sink``).

    Attributes:
        url: NATS URL(s), comma-separated (None: off). Credentials go in the userinfo and are
            shown as ``***`` everywhere (kept out of ``repr``).
        subject_prefix: batches go to ``<prefix>.<instance>``; the stream captures ``<prefix>.>``.
        stream: the JetStream stream, created or updated to the retention below at start.
        instance: this server's subject token, ``[A-Za-z0-9_-]+`` (None: ``<hostname>-<port>``).
        max_age_s, max_msgs, max_bytes: stream retention, seconds, messages, bytes (0 = no limit).
        duplicate_window_s: seconds the stream drops a re-published batch (same ``Nats-Msg-Id``);
            > 0 and <= max_age_s when that is set.
        max_pending_batches: batches queued while NATS is slow or away before new ones are dropped.
    """

    name: ClassVar[str] = "nats"
    url: str | None = setting(
        None,
        "Publish KV events to NATS JetStream at this URL, e.g. nats://nats:4222 (comma-separated for several).",
        flat="nats_url",
        check=_nats_url,
        default_text="off",
        secret=True,
    )
    subject_prefix: str = setting(
        "kvservice.events", "Subjects are <prefix>.<instance>; the stream takes <prefix>.>.", flat="nats_subject_prefix"
    )
    stream: str = setting(
        "KVSERVICE_EVENTS", "JetStream stream, created or updated at start.", flat="nats_stream", check=_token_name
    )
    instance: str | None = setting(
        None,
        "This server's subject token, [A-Za-z0-9_-]+.",
        flat="nats_instance",
        check=_token_name,
        default_text="<hostname>-<port>",
    )
    max_age_s: float = setting(
        3600.0, "Stream retention by age, seconds; 0 = no limit.", flat="nats_max_age_s", check=_no_limit
    )
    max_msgs: int = setting(
        0, "Stream retention by count, messages; 0 = no limit.", flat="nats_max_msgs", check=_no_limit
    )
    max_bytes: int = setting(
        1 << 30,
        "Stream retention by size, e.g. 1GiB; 0 = no limit.",
        flat="nats_max_bytes",
        parse="bytes",
        check=_no_limit,
        default_text="1GiB",
    )
    duplicate_window_s: float = setting(
        120.0,
        "Seconds a re-published batch (same Nats-Msg-Id) is dropped.",
        flat="nats_duplicate_window_s",
        check=positive("seconds"),
    )
    max_pending_batches: int = setting(
        10_000,
        "Batches queued while NATS is away before new ones are dropped.",
        flat="nats_max_pending_batches",
        check=at_least(1),
    )

    def _check(self) -> None:
        check_subject_prefix(self.subject_prefix)
        check_retention(self.max_age_s, self.duplicate_window_s)


@dataclass(frozen=True)
class MetricsSettings(_Section):
    """The Prometheus endpoint (``kvservice.server.metrics``).

    Attributes:
        port: HTTP port (None: off; 0 picks a free one, and the running server's config holds the
            bound one).
        host: address it binds.
    """

    name: ClassVar[str] = "metrics"
    port: int | None = setting(
        None,
        "Prometheus metrics HTTP port; 0 picks a free one.",
        flat="metrics_port",
        check=in_range(0, 65535),
        default_text="off",
    )
    host: str = setting("127.0.0.1", "Address the metrics endpoint binds.", flat="metrics_host")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class LoggingSettings(_Section):
    """Logs and traces (``kvservice.server.observability``).

    Attributes:
        log_level: Python logging level of the server's loggers.
        log_format: "text" or "json" (every line ``kvservice serve`` writes one object: time,
            level, logger, message, and the rpc / request_id of the call a line was logged in).
        otel_tracing: an OpenTelemetry span per RPC, exported as the ``OTEL_*`` variables say
            (needs kvservice's ``otel`` extra).
    """

    name: ClassVar[str] = "logging"
    log_level: str = setting(
        "WARNING",
        "Python logging level.",
        choices=LOG_LEVELS,
        check=lambda v: None if v.upper() in LOG_LEVELS else f"must be one of {', '.join(LOG_LEVELS)}",
    )
    log_format: str = setting(
        "text",
        "Log lines as text or JSON (every line one object, the start-up lines and errors too).",
        choices=("text", "json"),
        check=one_of(("text", "json")),
    )
    otel_tracing: bool = setting(
        False,
        "An OpenTelemetry span per RPC, exported as the OTEL_* variables say (OTEL_TRACES_EXPORTER=console|otlp); "
        "needs the otel extra (pip install ./clients/python '.[otel]' in the checkout).",
    )


SECTIONS: tuple[type[_Section], ...] = (
    BindSettings,
    CacheSettings,
    LimitsSettings,
    TierSettings,
    EventsSettings,
    AuthSettings,
    ZmqSettings,
    NatsSettings,
    MetricsSettings,
    LoggingSettings,
)
"""The sections, in the order of ``ServerConfig``'s fields and of ``kvservice serve --help``."""


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SettingInfo:
    """One row of :func:`settings_table`.

    Attributes:
        flat: the flat name (keyword, TOML key; ``--flat-name``, ``KVSERVICE_FLAT_NAME``).
        section: the section's name on ``ServerConfig`` (``"zmq"``).
        attr: the field's name in its section (``"endpoint"``).
        default: the default value.
        type: the parse type: ``"int"``, ``"float"``, ``"bool"``, ``"str"`` or ``"bytes"``.
        optional: None is a value (unset).
        meta: the field's :class:`Setting`.
    """

    flat: str
    section: str
    attr: str
    default: Any
    type: str
    optional: bool
    meta: Setting

    @property
    def option(self) -> str:
        """The CLI option, ``--flat-name``."""
        return "--" + self.flat.replace("_", "-")

    @property
    def alias_options(self) -> list[str]:
        """The CLI options of its aliases (an older name still accepted)."""
        return ["--" + alias.replace("_", "-") for alias in self.meta.aliases]

    @property
    def env(self) -> str:
        """The environment variable, ``KVSERVICE_FLAT_NAME``."""
        return "KVSERVICE_" + self.flat.upper()

    @property
    def help(self) -> str:
        """The option's help with its default, ``"Port to bind [50051]."``."""
        shown = self.meta.default_text
        if shown is None:
            if isinstance(self.default, bool):
                shown = "on" if self.default else "off"
            else:
                shown = str(self.default) if self.default != "" else '""'
        text = self.meta.help.rstrip(".")
        return f"{text} [{shown}]."

    def parse(self, value: Any) -> Any:
        """``value`` (from TOML, the environment or a flag) as this setting's type.

        Raises:
            ValueError: it is not one (the message names the expected type).
        """
        if value is None or value == "":
            if self.optional:
                return None
            raise ValueError("must be set")
        if self.type == "bytes":
            return parse_bytes(value)
        if self.type == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r} (true/false, 1/0, yes/no, on/off)")
        if self.type == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"not an integer: {value!r}")
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"not an integer: {value!r}") from None
        if self.type == "float":
            if isinstance(value, bool):
                raise ValueError(f"not a number: {value!r}")
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"not a number: {value!r}") from None
        return str(value)


def _type_of(hints: dict[str, Any], f: dataclasses.Field[Any]) -> tuple[str, bool]:
    hint = hints[f.name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    return base.__name__, optional


def _rows() -> Iterator[SettingInfo]:
    for section in SECTIONS:
        hints = typing.get_type_hints(section)  # once per section: it evaluates every annotation
        for f in dataclasses.fields(section):
            meta = f.metadata.get("setting")
            if meta is None:
                continue
            type_name, optional = _type_of(hints, f)
            if meta.parse == "bytes":
                type_name = "bytes"
            yield SettingInfo(meta.flat or f.name, section.name, f.name, f.default, type_name, optional, meta)


_TABLE: dict[str, SettingInfo] | None = None
_ALIASES: dict[str, str] | None = None


def setting_aliases() -> dict[str, str]:
    """Older names still accepted (keyword, TOML key, variable, option), each to its flat name."""
    global _ALIASES
    if _ALIASES is None:
        _ALIASES = {alias: row.flat for row in settings_table().values() for alias in row.meta.aliases}
    return _ALIASES


def settings_table() -> dict[str, SettingInfo]:
    """Every setting by flat name, in section order.

    Raises:
        RuntimeError: two fields share a flat name (a programming error caught at import by the tests).
    """
    global _TABLE
    if _TABLE is None:
        table: dict[str, SettingInfo] = {}
        for row in _rows():
            if row.flat in table:
                raise RuntimeError(f"setting {row.flat!r} is defined twice")
            table[row.flat] = row
        _TABLE = table
    return _TABLE


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 10**12,
    "tb": 10**12,
}


def parse_bytes(value: str | int) -> int:
    """Parse a byte count: an int, or a number with a unit ("512MiB", "1.5GB", "1g").

    Raises:
        ValueError: not a byte count.
    """
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte count: {value!r} (e.g. 1073741824, 512MiB, 1GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# -- the configuration ------------------------------------------------------------------------


OTHER_ENV_VARS = frozenset({"KVSERVICE_TOKEN", "KVSERVICE_PROFILE"})
"""``KVSERVICE_*`` variables that are not server settings (the watch token, the bench profiler):
not warned about by :func:`load_config`."""


@dataclass(frozen=True, init=False)
class ServerConfig:
    """Everything ``kvservice serve`` can be told: one section per concern.

    Build it from sections, from flat settings, or both (flat names are listed by
    :func:`kvservice.server.settings.settings_table`; each section's docstring says what its
    settings mean, their units and bounds)::

        ServerConfig(port=0, zmq_endpoint="tcp://127.0.0.1:*")
        ServerConfig(cache=CacheSettings(preset="qwen-2.5-0.5b"), port=0)

    Flat names build and replace (:meth:`replace`); a value is read through its section, typed
    (``config.zmq.endpoint``; :meth:`flat` gives every value by flat name).

    Attributes:
        bind, cache, limits, tier, events, auth, zmq, nats, metrics, logging: the sections (above).

    Raises:
        ValueError: a bad setting (each section checks its own; the message names the flat
            setting and the bound), or a rule across sections (a ZMQ bind off loopback without
            allow_insecure_bind).
        TypeError: an unknown setting name.
    """

    bind: BindSettings
    cache: CacheSettings
    limits: LimitsSettings
    tier: TierSettings
    events: EventsSettings
    auth: AuthSettings
    zmq: ZmqSettings
    nats: NatsSettings
    metrics: MetricsSettings
    logging: LoggingSettings

    def __init__(self, **values: Any) -> None:
        table, aliases = settings_table(), setting_aliases()
        given = {section.name: values.pop(section.name, None) for section in SECTIONS}
        values = {aliases.get(name, name): value for name, value in values.items()}
        if values.get("kv_events_config") is not None:  # vLLM's JSON; a setting given by name wins
            values = {**kv_events_config_settings(values["kv_events_config"]), **values}
        changes: dict[str, dict[str, Any]] = {}
        for flat, value in values.items():
            row = table.get(aliases.get(flat, flat))
            if row is None:
                raise TypeError(f"ServerConfig got an unknown setting {flat!r}")
            changes.setdefault(row.section, {})[row.attr] = value
        for section in SECTIONS:
            base, change = given[section.name], changes.get(section.name, {})
            if base is None:
                value = section(**change)
            else:
                value = dataclasses.replace(base, **change) if change else base
            object.__setattr__(self, section.name, value)
        # The one rule across sections: ZMQ has no authentication, so a bind off loopback needs
        # allow_insecure_bind (refused here, before anything is allocated).
        check_endpoint_exposure(
            self.zmq.endpoint, self.zmq.replay_endpoint, allow_insecure_bind=self.auth.allow_insecure_bind
        )

    def replace(self, **flat: Any) -> ServerConfig:
        """A copy with flat settings (or whole sections) replaced, checked again."""
        return ServerConfig(**{section.name: getattr(self, section.name) for section in SECTIONS}, **flat)

    def flat(self) -> dict[str, Any]:
        """Every setting by flat name (what ``ServerConfig(**config.flat())`` rebuilds)."""
        return {name: getattr(getattr(self, row.section), row.attr) for name, row in settings_table().items()}


def load_config(
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerConfig:
    """Build a :class:`ServerConfig` from a TOML file, ``KVSERVICE_*`` variables and overrides.

    Every name is a flat setting name (:func:`~kvservice.server.settings.settings_table`): the
    TOML key (``-`` or ``_``; at the top level or under ``[kvservice]``), the variable
    ``KVSERVICE_<NAME>``, the override keyword. Overrides whose value is None are ignored (flags
    not given). Precedence: overrides > environment > file > defaults. A relative path in the file
    (``*_file`` settings) is relative to the file's directory; in the environment and overrides,
    to the working directory. A ``KVSERVICE_*`` variable that names no setting is logged as a
    WARNING (with the nearest setting's variable) and ignored.

    Raises:
        ValueError: an unknown key (file or override) or a bad value, naming its source and the
            setting.
    """
    table, aliases = settings_table(), setting_aliases()
    values: dict[str, Any] = {}

    def put(key: str, value: Any, source: str) -> None:
        key = aliases.get(key, key)
        try:
            values[key] = table[key].parse(value)
        except ValueError as e:
            raise ValueError(f"{source}: {key}: {e}") from None

    if config_file is not None:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{config_file}: not valid TOML: {e}") from None
        data = data.get("kvservice", data)
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in table and key not in aliases:
                raise ValueError(f"{config_file}: unknown key {key!r}")
            put(key, value, str(config_file))
            key = aliases.get(key, key)
            if (
                (key.endswith("_file") or key in ("model_config", "kv_cache_layout"))
                and isinstance(values[key], str)
                and not values[key].startswith("opaque:")
                and not os.path.isabs(values[key])
            ):
                # A path in a config file is relative to that file, not to where the server starts.
                values[key] = str(Path(config_file).resolve().parent / values[key])
    environ = os.environ if environ is None else environ
    for env_key, value in environ.items():
        if not env_key.startswith("KVSERVICE_"):
            continue
        key = env_key[len("KVSERVICE_") :].lower()
        if key in table or key in aliases:
            put(key, value, env_key)
        elif env_key not in OTHER_ENV_VARS:
            near = difflib.get_close_matches(key, list(table), n=1)
            hint = f" (did you mean KVSERVICE_{near[0].upper()}?)" if near else ""
            logger.warning("ignoring %s: no setting is called %s%s", env_key, key, hint)
    for key, value in overrides.items():
        if key not in table and key not in aliases:
            raise ValueError(f"unknown setting {key!r}")
        if value is not None:
            put(key, value, f"--{key.replace('_', '-')}")
    return ServerConfig(**values)
