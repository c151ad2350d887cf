"""Authentication and transport security: bearer tokens with roles, TLS and mutual TLS.

Two independent layers, both off by default (the server then binds loopback only):

* **TLS** (:func:`server_credentials`): the server's certificate chain and private key (PEM
  files); with a client CA file, mutual TLS: every client must present a certificate signed by
  that CA, or its handshake fails (the client sees UNAVAILABLE).
* **Bearer tokens** (:class:`TokenTable`, :class:`AuthInterceptor`): every call carries
  ``authorization: Bearer <token>`` metadata; the token names a *role*:

  - ``scheduler``: every RPC.
  - ``watcher``: the read-only RPCs (:data:`WATCHER_METHODS`: StreamEvents, TakeEvents,
    GetKVCacheGroupMetadata, GetUsage, Ping) and server reflection.
  - ``worker``: the data plane and what it needs (:data:`WORKER_METHODS`: AttachKVCache,
    ReadBlocks, WriteBlocks, GetKVCacheGroupMetadata, GetUsage, Ping) and server reflection; no
    call that changes the cache or the request table, no events.
  - ``tier``: a shared tier's calls (:data:`TIER_METHODS`: the blocks named by hash alone,
    LookupBlocks, ReserveBlocks, CommitBlocks, PutBlocks, LeaseBlocks, ReleaseLease; AttachKVCache,
    ReadBlocks, GetKVCacheGroupMetadata, GetUsage, Ping) and server reflection; no scheduler call,
    no WriteBlocks into a request's block, no ResetPrefixCache, no events (docs/tier.md).

  Who may call an RPC is said beside it in the proto (its ``(kvservice.v1.roles)`` option: the
  roles besides ``scheduler``; none: scheduler only); the sets here are read from the RPC table
  (:data:`kvservice_client.rpc_table.KV_CACHE_SERVICE`), never listed by hand.

  ``grpc.health.v1.Health/Check`` and ``/Watch`` need no token (load balancer and orchestrator
  probes). A call without usable credentials is answered UNAUTHENTICATED; a watcher or worker calling
  an RPC outside its set is answered PERMISSION_DENIED; either way the call never reaches the servicer, so
  it changes nothing.

The token file is TOML; each entry names a client, its role, and either the token itself or its
SHA-256 (so the file need not hold secrets)::

    [[tokens]]
    name = "sched-a"
    role = "scheduler"
    token = "3f6c...a long random string"

    [[tokens]]
    name = "router"
    role = "watcher"
    token_sha256 = "9b1d...64 hex digits"   # hashlib.sha256(token.encode()).hexdigest()

Tokens are compared by their SHA-256 digests with :func:`hmac.compare_digest`, against every
entry (no early exit); no message or log line ever contains a token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import ssl
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvservice.server.endpoints import is_loopback_host
from kvservice_client.rpc_table import KV_CACHE_SERVICE, ROLES, Role, ServiceTable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from kvservice.server.settings import AuthSettings

logger = logging.getLogger(__name__)

__all__ = [
    "AuthSetup",
    "MIN_TOKEN_CHARS",
    "MUTATING_METHODS",
    "PUBLIC_METHODS",
    "ROLES",
    "AuthInterceptor",
    "Role",
    "TokenEntry",
    "TokenTable",
    "WATCHER_METHODS",
    "WORKER_METHODS",
    "TIER_METHODS",
    "build_auth",
    "is_loopback_host",
    "server_credentials",
]

MIN_TOKEN_CHARS = 16
"""Shortest plain token a token file may hold, in characters (a guessable token is no secret)."""

MUTATING_METHODS = frozenset(rpc.method for rpc in KV_CACHE_SERVICE if rpc.roles == {"scheduler"})
"""Full method names of the RPCs only a scheduler may call: those that change the cache or the
request table (GetComputedBlocks, AllocateSlots, Free, ResetPrefixCache, Step, ManagerStep); the
tier's puts and leases are the ``tier`` role's (:data:`TIER_METHODS`)."""

WATCHER_METHODS = KV_CACHE_SERVICE.methods_of("watcher")
"""Full method names of the kvservice RPCs a ``watcher`` token may call."""

WORKER_METHODS = KV_CACHE_SERVICE.methods_of("worker")
"""Full method names of the kvservice RPCs a ``worker`` token may call (block contents, no cache
mutation: a write goes only into a block a running request computes, see
``kvservice.server.data_plane``)."""

TIER_METHODS = KV_CACHE_SERVICE.methods_of("tier")
"""Full method names of the kvservice RPCs a ``tier`` token may call (blocks named by hash alone,
the shared memory and block reads; see docs/tier.md)."""

_REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

PUBLIC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
"""Full method names callable without a token (health probes)."""

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: what a metadata value can carry
_BEARER = re.compile(r"Bearer +(\S+)", re.IGNORECASE)  # RFC 6750: the scheme is case-insensitive
_ENTRY_KEYS = frozenset({"name", "role", "token", "token_sha256"})


# -- tokens ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenEntry:
    """One client's token, as the server keeps it.

    Attributes:
        name: the client's name (in PERMISSION_DENIED messages and logs; never the token).
        role: ``"scheduler"`` or ``"watcher"``.
        digest: SHA-256 of the token's UTF-8 bytes (32 bytes).
    """

    name: str
    role: Role
    digest: bytes

    def __repr__(self) -> str:
        return f"TokenEntry(name={self.name!r}, role={self.role!r})"


class TokenTable:
    """The bearer tokens a server accepts, each with a name and a role.

    Args:
        entries: the tokens (names unique, digests unique).

    Raises:
        ValueError: no entries, a duplicate name, or two entries with the same token.
    """

    def __init__(self, entries: Iterable[TokenEntry]) -> None:
        self.entries: tuple[TokenEntry, ...] = tuple(entries)
        if not self.entries:
            raise ValueError("no tokens")
        names: set[str] = set()
        digests: set[bytes] = set()
        for entry in self.entries:
            if entry.name in names:
                raise ValueError(f"token name {entry.name!r} appears twice")
            if entry.digest in digests:
                raise ValueError(f"token {entry.name!r} repeats an earlier entry's token")
            names.add(entry.name)
            digests.add(entry.digest)

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        """Read a TOML token file (see the module docstring for its layout).

        Each ``[[tokens]]`` entry has ``name`` (non-empty, unique), ``role`` (one of
        :data:`ROLES`) and exactly one of ``token`` (at least :data:`MIN_TOKEN_CHARS` printable
        ASCII characters, no spaces) or ``token_sha256`` (64 hex digits); no other keys.

        Raises:
            ValueError: the file cannot be read, is not TOML, or an entry is malformed; the message
                names the file, the entry and the problem (never a token).
        """
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"{path}: cannot read the token file: {e.strerror or e}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: the token file is not valid TOML: {e}") from None
        unknown = sorted(set(data) - {"tokens"})
        if unknown:
            raise ValueError(f"{path}: unknown key {unknown[0]!r} (a token file holds only [[tokens]] entries)")
        raw = data.get("tokens")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{path}: no [[tokens]] entries (each: name, role, token or token_sha256)")
        entries = [_parse_entry(path, idx, item) for idx, item in enumerate(raw)]
        try:
            return cls(entries)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def authenticate(self, token: str) -> TokenEntry | None:
        """The entry whose token is ``token``, or None.

        Compares SHA-256 digests with :func:`hmac.compare_digest` against every entry, so the time
        taken does not depend on which entry (if any) matches.
        """
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def describe(self) -> str:
        """How many tokens per role, e.g. ``"3 bearer tokens (2 scheduler, 1 watcher)"``."""
        counts = ", ".join(
            f"{sum(e.role == role for e in self.entries)} {role}"
            for role in ROLES
            if any(e.role == role for e in self.entries)
        )
        return f"{len(self.entries)} bearer token{'s' if len(self.entries) != 1 else ''} ({counts})"


def _parse_entry(path: str | Path, idx: int, item: Any) -> TokenEntry:
    """One ``[[tokens]]`` table as a :class:`TokenEntry` (ValueError naming file and entry)."""
    where = f"{path}: tokens[{idx}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: not a table (use [[tokens]] entries)")
    name = item.get("name")
    if isinstance(name, str) and name:
        where = f"{where} ({name!r})"
    unknown = sorted(set(item) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected name, role, token or token_sha256)")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name must be a non-empty string")
    role = item.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}; got {role!r}")
    has_token, has_digest = "token" in item, "token_sha256" in item
    if has_token == has_digest:
        raise ValueError(f"{where}: give exactly one of token or token_sha256")
    if has_token:
        token = item["token"]
        if not isinstance(token, str) or not _TOKEN_CHARS.fullmatch(token):
            raise ValueError(f"{where}: token must be printable ASCII without spaces")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: token must be at least {MIN_TOKEN_CHARS} characters; got {len(token)}")
        digest = hashlib.sha256(token.encode()).digest()
    else:
        hex_digest = item["token_sha256"]
        if not isinstance(hex_digest, str) or not _SHA256_HEX.fullmatch(hex_digest):
            raise ValueError(f"{where}: token_sha256 must be 64 hex digits (hashlib.sha256(token).hexdigest())")
        digest = bytes.fromhex(hex_digest)
    return TokenEntry(name=name, role=role, digest=digest)


# -- the interceptor ---------------------------------------------------------------------------


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every call before it reaches its handler.

    * Health ``Check``/``Watch`` (:data:`PUBLIC_METHODS`) pass without a token.
    * No ``authorization`` metadata, one not of the form ``Bearer <token>``, several of them, or
      a token not in the table: UNAUTHENTICATED (the message says which; never the token).
    * A ``watcher`` token on a method outside :data:`WATCHER_METHODS` and reflection, or a
      ``worker`` token outside :data:`WORKER_METHODS` and reflection: PERMISSION_DENIED naming the
      method, the token's name and its role.

    A refused call is answered by a handler of the same kind (unary or streaming, either side) that
    aborts without reading the request, so the servicer never runs and nothing changes. An unknown
    method with a valid token stays UNIMPLEMENTED; without one it is UNAUTHENTICATED.

    Args:
        tokens: the accepted tokens.
        service: the RPCs and who may call each (default: kvservice.v1's own table).
    """

    def __init__(self, tokens: TokenTable, service: ServiceTable = KV_CACHE_SERVICE) -> None:
        self.tokens = tokens
        self._methods_by_role: dict[Role, frozenset[str]] = {role: service.methods_of(role) for role in ROLES}

    def _may_call(self, role: Role, method: str) -> bool:
        # A scheduler passes on every method (one the server does not have is UNIMPLEMENTED).
        return role == "scheduler" or method in self._methods_by_role[role] or method.startswith(_REFLECTION_PREFIXES)

    def check(
        self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> tuple[grpc.StatusCode, str] | None:
        """The status refusing a call of ``method`` with ``metadata``, or None to let it through.

        Args:
            method: the full method name (``/package.Service/Method``).
            metadata: the call's invocation metadata (``(key, value)`` pairs).
        """
        if method in PUBLIC_METHODS:
            return None
        values = [value for key, value in (metadata or ()) if key == "authorization"]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, (
                "missing authorization metadata: send 'authorization: Bearer <token>'"
            )
        if len(values) > 1:
            return grpc.StatusCode.UNAUTHENTICATED, f"{len(values)} authorization metadata entries; send exactly one"
        value = values[0]
        match = _BEARER.fullmatch(value.strip()) if isinstance(value, str) else None
        if match is None:
            return grpc.StatusCode.UNAUTHENTICATED, ("malformed authorization metadata: expected 'Bearer <token>'")
        entry = self.tokens.authenticate(match.group(1))
        if entry is None:
            return grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"
        if self._may_call(entry.role, method):
            return None
        return grpc.StatusCode.PERMISSION_DENIED, (
            f"{method}: token {entry.name!r} has role {entry.role!r}, which may call only "
            f"{', '.join(sorted(m.rsplit('/', 1)[1] for m in self._methods_by_role[entry.role]))} and reflection"
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """The method's handler, or one that aborts with :meth:`check`'s status."""
        method = handler_call_details.method
        refusal = self.check(method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if refusal is None:
            return handler
        logger.info("refused %s: %s", method, refusal[1])
        return _refusing_handler(handler, *refusal)


def _refusing_handler(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary_unary when None) that aborts with ``code``.

    It takes the request undeserialized (no deserializer) and never reads a request stream.
    """

    async def abort(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.unary_stream_rpc_method_handler(abort)


# -- TLS ---------------------------------------------------------------------------------------


def _read(path: str | Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path}: the {what} is not PEM (no '-----BEGIN' line)")
    return data


def server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS server credentials from PEM files; with ``client_ca_file``, mutual TLS.

    The files are checked when read (with :mod:`ssl`): the certificate chain and the private key
    must parse and belong together, and the CA file must hold at least one certificate. With a
    client CA, every client must present a certificate that chains to it; a client that does not
    fails its handshake (its calls end UNAVAILABLE).

    Args:
        cert_file: the server's certificate chain, PEM (leaf first).
        key_file: the leaf's private key, PEM, unencrypted.
        client_ca_file: CA certificates, PEM, that client certificates must chain to.

    Raises:
        ValueError: a file is missing, unreadable, not PEM, an encrypted key, a key that does not
            match the certificate, or a CA file without a certificate; the message names the file.
    """
    cert = _read(cert_file, "TLS certificate file")
    key = _read(key_file, "TLS key file")
    if b"ENCRYPTED" in key:
        raise ValueError(f"{key_file}: the TLS key is encrypted; give an unencrypted PEM key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise ValueError(
            f"{cert_file}, {key_file}: not a PEM certificate chain and the private key of its first "
            f"certificate ({e.reason or e})"
        ) from None
    client_ca = None
    if client_ca_file is not None:
        client_ca = _read(client_ca_file, "TLS client CA file")
        try:
            context.load_verify_locations(cafile=str(client_ca_file))
        except ssl.SSLError as e:
            raise ValueError(f"{client_ca_file}: not PEM CA certificates ({e.reason or e})") from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


# -- server setup ------------------------------------------------------------------------------


@dataclass
class AuthSetup:
    """What :func:`build_auth` gives the server.

    Attributes:
        interceptor: the token check, or None without a token file.
        credentials: TLS server credentials, or None for a plain-text port.
        notes: lines for the start banner (what is on, and warnings).
    """

    interceptor: AuthInterceptor | None
    credentials: grpc.ServerCredentials | None
    notes: list[str]


def build_auth(host: str, settings: AuthSettings) -> AuthSetup:
    """Read the TLS and token files and apply the bind rules.

    Rules: unless clients are authenticated (bearer tokens, or client certificates with mutual
    TLS; server-only TLS authenticates nobody) the server must bind a loopback address (see
    :func:`is_loopback_host`) or be given ``allow_insecure_bind``; tokens without TLS on a
    non-loopback address are allowed, with a note that they travel in clear text.

    Args:
        host: the bind address.
        settings: the auth section (its TLS files already checked to go together; the token
            file format is :meth:`TokenTable.from_file`).

    Raises:
        ValueError: a bad or missing file (named), or a non-loopback
            host without tokens, client certificates or ``allow_insecure_bind`` (the message names
            the flag).
    """
    tls_cert_file, tls_key_file = settings.tls_cert_file, settings.tls_key_file
    tls_client_ca_file, auth_tokens_file = settings.tls_client_ca_file, settings.auth_tokens_file
    allow_insecure_bind = settings.allow_insecure_bind
    loopback = is_loopback_host(host)
    # Server-only TLS encrypts but authenticates no client: it does not count as auth here.
    authenticates = auth_tokens_file is not None or tls_client_ca_file is not None
    if not (authenticates or loopback or allow_insecure_bind):
        raise ValueError(
            f"host {host!r} is not a loopback address and no client is authenticated (neither bearer tokens, "
            "auth_tokens_file, nor client certificates, tls_client_ca_file; server-only TLS authenticates nobody): "
            "anyone who reaches it could change the cache; set them, or set allow_insecure_bind "
            "(--allow-insecure-bind) to bind anyway"
        )
    credentials = None
    if tls_cert_file is not None and tls_key_file is not None:
        credentials = server_credentials(tls_cert_file, tls_key_file, tls_client_ca_file)
    tokens = TokenTable.from_file(auth_tokens_file) if auth_tokens_file is not None else None
    notes = []
    if credentials is None and tokens is None:
        if loopback:
            notes.append("auth off: no TLS, no tokens (loopback only)")
        else:
            notes.append(
                f"auth off on non-loopback {host} (allow_insecure_bind): no TLS, no tokens; anyone who reaches it "
                "can change the cache"
            )
    else:
        transport = "no TLS"
        if credentials is not None:
            transport = "mutual TLS (client certificates required)" if tls_client_ca_file else "TLS"
        notes.append(f"auth: {transport}, {tokens.describe() if tokens else 'no tokens'}")
        if tokens is None and not tls_client_ca_file and not loopback:
            notes.append(
                f"TLS without client certificates or tokens on non-loopback {host} (allow_insecure_bind): traffic is "
                "encrypted but anyone who reaches it can change the cache"
            )
        if tokens is not None and credentials is None and not loopback:
            notes.append(
                f"bearer tokens travel in clear text: no TLS on non-loopback {host} (set tls_cert_file and tls_key_file)"
            )
    return AuthSetup(AuthInterceptor(tokens) if tokens is not None else None, credentials, notes)
