"""Authentication and transport security: TLS, mutual TLS, bearer tokens with roles, bind rules.

Certificates are made here (``cryptography``, EC P-256): a CA, a server certificate for
``localhost`` and 127.0.0.1, a client certificate from the CA and one from an unknown CA. Token
checks run over every RPC of the service for each role: an allowed call never fails for an auth
reason, a refused one is PERMISSION_DENIED and changes nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes as crypto_hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvservice.server.app import ServerConfig
from kvservice.server.servicer import SERVICE_NAME
from kvservice.watch import watch_events
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVCacheClient, KVServiceError, StepBuilder
from kvservice_client.data import aattach_kv_cache, aread_blocks, awrite_blocks, block_ref
from kvservice_client.tls import TLSConfig
from kvservice_client.watcher import EventWatcher
from tests.service.helpers import READ_TIMEOUT_S, events_of, hashes, next_batch, observed_state, stored

pytestmark = pytest.mark.timeout(60)

SCHEDULER_TOKEN = "sched-token-0123456789abcdef"
WATCHER_TOKEN = "watch-token-0123456789abcdef"
HASHED_TOKEN = "hashed-token-0123456789abcdef"
WORKER_TOKEN = "worker-token-0123456789abcdef"
TIER_TOKEN = "tier-token-0123456789abcdef01"
WRONG_TOKEN = "wrong-token-0123456789abcdef"

PROMPT = list(range(1, 9))
"""Two blocks of 4 tokens."""

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# -- certificates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    """PEM files and bytes of the test certificates."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    ca_pem: bytes
    client_cert_pem: bytes
    client_key_pem: bytes
    rogue_cert_pem: bytes
    rogue_key_pem: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    """A certificate for ``subject`` (self-signed when ``issuer`` is None), valid for a day."""
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer is not None else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    elif server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, crypto_hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """A CA, a server certificate (localhost, 127.0.0.1) and client certificates from the CA and
    from an unknown CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def make_pki(out: Path) -> PKI:
    """The certificates of :func:`pki`, written to ``out``."""
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("kvservice test CA", ca_key, None, ca_key, ca=True)
    rogue_ca = _cert("unknown CA", rogue_ca_key, None, rogue_ca_key, ca=True)
    server_key, client_key, rogue_key = _key(), _key(), _key()
    server = _cert("localhost", server_key, ca, ca_key, server=True)
    client = _cert("scheduler-a", client_key, ca, ca_key)
    rogue = _cert("intruder", rogue_key, rogue_ca, rogue_ca_key)
    files = {"ca.pem": _pem(ca), "server.pem": _pem(server), "server.key": _key_pem(server_key)}
    for name, data in files.items():
        (out / name).write_bytes(data)
    return PKI(
        ca_file=out / "ca.pem",
        server_cert_file=out / "server.pem",
        server_key_file=out / "server.key",
        ca_pem=_pem(ca),
        client_cert_pem=_pem(client),
        client_key_pem=_key_pem(client_key),
        rogue_cert_pem=_pem(rogue),
        rogue_key_pem=_key_pem(rogue_key),
    )


def tls_settings(pki: PKI, *, mutual: bool = False) -> dict[str, Any]:
    """Server settings for TLS (and mutual TLS)."""
    settings = {"tls_cert_file": str(pki.server_cert_file), "tls_key_file": str(pki.server_key_file)}
    if mutual:
        settings["tls_client_ca_file"] = str(pki.ca_file)
    return settings


# -- tokens -------------------------------------------------------------------------------------


def write_tokens(path: Path, text: str | None = None) -> str:
    """Write a token file (default: one scheduler, one watcher and one hashed scheduler token)."""
    if text is None:
        text = (
            f'[[tokens]]\nname = "sched-a"\nrole = "scheduler"\ntoken = "{SCHEDULER_TOKEN}"\n\n'
            f'[[tokens]]\nname = "router"\nrole = "watcher"\ntoken = "{WATCHER_TOKEN}"\n\n'
            f'[[tokens]]\nname = "sched-b"\nrole = "scheduler"\n'
            f'token_sha256 = "{hashlib.sha256(HASHED_TOKEN.encode()).hexdigest()}"\n'
        )
    path.write_text(text)
    return str(path)


@pytest.fixture
async def token_server(start_kv_server, tmp_path):
    """A server asking for tokens (plain text, loopback), the default three plus a worker token,
    with its KV memory on the CPU (in shared memory) so the data-plane RPCs have memory to reach."""
    path = tmp_path / "tokens.toml"
    write_tokens(path)
    with path.open("a") as f:
        f.write(f'\n[[tokens]]\nname = "gpu-worker"\nrole = "worker"\ntoken = "{WORKER_TOKEN}"\n')
        f.write(f'\n[[tokens]]\nname = "shared-tier"\nrole = "tier"\ntoken = "{TIER_TOKEN}"\n')
    return await start_kv_server(auth_tokens_file=str(path), device="cpu")


async def code_of(call: Awaitable[Any]) -> grpc.StatusCode:
    """OK, or the status code the call failed with."""
    try:
        await call
    except KVServiceError as e:
        return e.code
    return OK


async def first_batch(client: AsyncKVCacheClient, **kwargs: Any) -> pb.EventBatch:
    """The first batch of a new StreamEvents call (then the call is cancelled)."""
    stream = client.stream_events(**kwargs)
    try:
        return await next_batch(stream)
    finally:
        await stream.aclose()


# -- TLS ----------------------------------------------------------------------------------------


async def test_tls_end_to_end_with_tokens(start_kv_server, connect, pki, tmp_path):
    running = await start_kv_server(**tls_settings(pki), auth_tokens_file=write_tokens(tmp_path / "t.toml"))
    assert running.notes[-1] == "auth: TLS, 3 bearer tokens (2 scheduler, 1 watcher)"
    scheduler = await connect(running, root_certificates=pki.ca_pem, token=SCHEDULER_TOKEN)
    watcher = await connect(running, root_certificates=pki.ca_pem, token=WATCHER_TOKEN)
    stream = watcher.stream_events(start_seq=running.event_log.head_seq + 1)
    hit = await scheduler.get_computed_blocks("r1", PROMPT)
    assert (hit.num_computed_tokens, [list(g.block_ids) for g in hit.block_ids]) == (0, [[]])
    assert (await scheduler.allocate_slots("r1", len(PROMPT))).allocated
    batch = await next_batch(stream)
    await stream.aclose()
    assert (batch.seq, events_of(batch)) == (1, [stored(hashes(PROMPT), None, PROMPT)])


async def test_plain_text_client_cannot_call_a_tls_server(start_kv_server, connect, pki):
    running = await start_kv_server(**tls_settings(pki))
    plain = await connect(running)
    assert await code_of(plain.ping(b"x")) == UNAVAILABLE
    untrusting = await connect(running, tls=True)  # the system's roots do not know the test CA
    assert await code_of(untrusting.ping(b"x")) == UNAVAILABLE
    trusting = await connect(running, root_certificates=pki.ca_pem)
    assert (await trusting.ping(b"x")).payload == b"x"


async def test_mutual_tls_accepts_known_clients_only(start_kv_server, connect, pki):
    running = await start_kv_server(**tls_settings(pki, mutual=True))
    assert running.notes[-1] == "auth: mutual TLS (client certificates required), no tokens"
    known = await connect(
        running, root_certificates=pki.ca_pem, private_key=pki.client_key_pem, certificate_chain=pki.client_cert_pem
    )
    assert (await known.ping(b"hi")).payload == b"hi"
    assert (await first_batch(known, snapshot=True)).snapshot
    unknown = await connect(
        running, root_certificates=pki.ca_pem, private_key=pki.rogue_key_pem, certificate_chain=pki.rogue_cert_pem
    )
    assert await code_of(unknown.ping(b"hi")) == UNAVAILABLE
    anonymous = await connect(running, root_certificates=pki.ca_pem)
    assert await code_of(anonymous.ping(b"hi")) == UNAVAILABLE


async def test_ready_channel_credentials(start_kv_server, connect, pki):
    running = await start_kv_server(**tls_settings(pki))
    client = await connect(running, credentials=grpc.ssl_channel_credentials(pki.ca_pem))
    assert (await client.ping(b"c")).payload == b"c"


async def test_watch_and_event_watcher_over_mutual_tls_with_a_token(start_kv_server, pki, tmp_path):
    running = await start_kv_server(
        **tls_settings(pki, mutual=True), auth_tokens_file=write_tokens(tmp_path / "t.toml")
    )
    tls = {"root_certificates": pki.ca_pem, "private_key": pki.client_key_pem, "certificate_chain": pki.client_cert_pem}
    out = io.StringIO()
    credentials = grpc.ssl_channel_credentials(**tls)
    assert (
        await watch_events(
            running.address, snapshot=True, token=WATCHER_TOKEN, credentials=credentials, out=out, max_batches=1
        )
        == 1
    )
    assert out.getvalue().splitlines()[1:] == ["seq=0* AllBlocksCleared"]
    async with EventWatcher(running.address, client_kwargs={"token": WATCHER_TOKEN, **tls}) as watcher:
        watched = await asyncio.wait_for(anext(watcher), READ_TIMEOUT_S)
    assert (watched.seq, watched.snapshot, watched.epoch) == (0, True, running.event_log.epoch)


async def test_blocking_client_over_mutual_tls(start_kv_server, pki):
    running = await start_kv_server(**tls_settings(pki, mutual=True))

    def ping() -> bytes:
        with KVCacheClient(
            running.address,
            root_certificates=pki.ca_pem,
            private_key=pki.client_key_pem,
            certificate_chain=pki.client_cert_pem,
            timeout=READ_TIMEOUT_S,
        ) as client:
            return client.ping(b"sync").payload

    assert await asyncio.to_thread(ping) == b"sync"  # the server runs on this loop: call from a thread


async def test_tls_config_gives_mutual_tls_to_both_clients(start_kv_server, connect, pki):
    running = await start_kv_server(**tls_settings(pki, mutual=True))
    tls = TLSConfig(root_certificates=pki.ca_pem, private_key=pki.client_key_pem, certificate_chain=pki.client_cert_pem)
    client = await connect(running, tls=tls)
    assert (await client.ping(b"tls")).payload == b"tls"

    def ping() -> bytes:
        with KVCacheClient(running.address, tls=tls, timeout=READ_TIMEOUT_S) as sync_client:
            return sync_client.ping(b"sync").payload

    assert await asyncio.to_thread(ping) == b"sync"


async def test_tls_config_target_name_override_checks_the_certificate_against_that_name(start_kv_server, connect, pki):
    """The server's certificate names localhost and 127.0.0.1: the override decides which name is checked."""
    running = await start_kv_server(**tls_settings(pki))
    named = await connect(running, tls=TLSConfig(root_certificates=pki.ca_pem, target_name_override="localhost"))
    assert (await named.ping(b"n")).payload == b"n"
    wrong = await connect(running, tls=TLSConfig(root_certificates=pki.ca_pem, target_name_override="kv.example"))
    assert await code_of(wrong.ping(b"n")) == UNAVAILABLE


async def test_client_tls_arguments_are_checked(pki):
    with pytest.raises(TypeError, match="either credentials or tls/PEM bytes"):
        AsyncKVCacheClient("127.0.0.1:1", credentials=grpc.ssl_channel_credentials(), root_certificates=pki.ca_pem)
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        AsyncKVCacheClient("127.0.0.1:1", private_key=pki.client_key_pem)
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        with pytest.raises(TypeError, match="apply only when target is an address"):
            AsyncKVCacheClient(channel, tls=True)


# -- tokens -------------------------------------------------------------------------------------


def _reflection_call(client: AsyncKVCacheClient) -> Awaitable[None]:
    """A ServerReflectionInfo (stream-stream) call listing the services, as an awaitable."""

    async def run() -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        call = stub.ServerReflectionInfo(metadata=client._metadata or None, timeout=READ_TIMEOUT_S)
        try:
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            response = await call.read()
            await call.done_writing()
            assert SERVICE_NAME in {s.name for s in response.list_services_response.service}
        except grpc.aio.AioRpcError as e:
            raise KVServiceError.from_rpc_error(e) from e

    return run()


RPCS: dict[str, Callable[[AsyncKVCacheClient], Awaitable[Any]]] = {
    # First, while "held" still runs (Free and Step free it). Block 1 is the first block "held" was
    # allocated (a fresh pool hands out ids from 1).
    "AttachKVCache": lambda c: aattach_kv_cache(c),
    "WriteBlocks": lambda c: awrite_blocks(c, "held", [(0, 1, bytes(BLOCK_BYTES))]),
    "ReadBlocks": lambda c: aread_blocks(c, [block_ref(0, block_id=1)]),
    "GetComputedBlocks": lambda c: c.get_computed_blocks("probe", range(40, 48)),
    "AllocateSlots": lambda c: c.allocate_slots("pending", len(PROMPT)),
    "Free": lambda c: c.free("held"),
    "ResetPrefixCache": lambda c: c.reset_prefix_cache(),
    "GetUsage": lambda c: c.get_usage(),
    "Step": lambda c: c.step(StepBuilder().free("held").get_usage()),
    "StreamEvents": lambda c: first_batch(c, snapshot=True),
    "TakeEvents": lambda c: c.take_events("probe-consumer"),
    "GetKVCacheGroupMetadata": lambda c: c.get_kv_cache_group_metadata(),
    "Ping": lambda c: c.ping(b"p"),
    "ManagerStep": lambda c: c.manager_step(pb.ManagerStepRequest(owner="auth-test")),
    # The tier's calls (docs/tier.md): a miss, a put of nothing, a lease of nothing, unknown leases.
    "LookupBlocks": lambda c: c.lookup_blocks(0, [bytes(32)]),
    "ReserveBlocks": lambda c: c.reserve_blocks(0, []),
    "CommitBlocks": lambda c: c.commit_blocks(1),
    "PutBlocks": lambda c: c.put_blocks(0, []),
    "LeaseBlocks": lambda c: c.lease_blocks(0, [bytes(32)]),
    "ReleaseLease": lambda c: c.release_lease(1),
}
"""One call per RPC of the service; each succeeds on a server prepared by :func:`prepare`."""

BLOCK_BYTES = 24 * 2 * 4 * 2 * 64 * 2
"""Bytes of one block of the test server (qwen-2.5-0.5b at block size 4: 24 layers, K and V, 4 tokens,
2 KV heads, head size 64, bfloat16)."""

ALLOWED = {
    "scheduler": set(RPCS),
    "watcher": {"StreamEvents", "TakeEvents", "GetKVCacheGroupMetadata", "GetUsage", "Ping", "LookupBlocks"},
    "worker": {
        "AttachKVCache",
        "WriteBlocks",
        "ReadBlocks",
        "GetKVCacheGroupMetadata",
        "GetUsage",
        "Ping",
        "LookupBlocks",
    },
    # A tier: blocks by hash, the memory, block reads; refused every scheduler call and reset.
    "tier": {
        "LookupBlocks",
        "ReserveBlocks",
        "CommitBlocks",
        "PutBlocks",
        "LeaseBlocks",
        "ReleaseLease",
        "AttachKVCache",
        "ReadBlocks",
        "GetKVCacheGroupMetadata",
        "GetUsage",
        "Ping",
    },
}


def test_the_table_covers_every_rpc():
    service = pb.DESCRIPTOR.services_by_name["KVCacheService"]
    assert set(RPCS) == {m.name for m in service.methods}


async def prepare(running, connect) -> AsyncKVCacheClient:
    """Hold request "held" (PROMPT allocated) and register "pending" (not allocated yet); returns a
    scheduler client."""
    admin = await connect(running, token=SCHEDULER_TOKEN)
    await admin.get_computed_blocks("held", PROMPT)
    assert (await admin.allocate_slots("held", len(PROMPT))).allocated
    await admin.get_computed_blocks("pending", range(20, 28))
    return admin


@pytest.mark.parametrize(
    "role, token",
    [
        ("scheduler", SCHEDULER_TOKEN),
        ("watcher", WATCHER_TOKEN),
        ("worker", WORKER_TOKEN),
        ("tier", TIER_TOKEN),
        ("scheduler", HASHED_TOKEN),
    ],
    ids=["scheduler", "watcher", "worker", "tier", "token_sha256"],
)
async def test_each_role_calls_exactly_its_rpcs(token_server, connect, role, token):
    admin = await prepare(token_server, connect)
    client = await connect(token_server, token=token)
    codes = {}
    for method, call in RPCS.items():
        if method == "ReadBlocks" and "WriteBlocks" not in ALLOWED[role]:
            # Block 1 gets its bytes from a role that may write them (a block nobody wrote is
            # refused to every reader: its byte state).
            await awrite_blocks(admin, "held", [(0, 1, bytes(BLOCK_BYTES))])
        if method in ALLOWED[role]:
            codes[method] = await code_of(call(client))
            continue
        before = await observed_state(token_server, admin)
        with pytest.raises(KVServiceError) as err:
            await call(client)
        codes[method] = err.value.code
        assert f"/{SERVICE_NAME}/{method}" in err.value.message and f"role {role!r}" in err.value.message
        assert await observed_state(token_server, admin) == before, method
    assert codes == {m: OK if m in ALLOWED[role] else PERMISSION_DENIED for m in RPCS}
    assert await code_of(_reflection_call(client)) == OK


async def test_a_denied_message_names_method_role_and_token_name(token_server, connect):
    watcher = await connect(token_server, token=WATCHER_TOKEN)
    with pytest.raises(KVServiceError) as err:
        await watcher.free("x")
    assert err.value.code == PERMISSION_DENIED
    assert err.value.message == (
        f"/{SERVICE_NAME}/Free: token 'router' has role 'watcher', which may call only "
        "GetKVCacheGroupMetadata, GetUsage, LookupBlocks, Ping, StreamEvents, TakeEvents and reflection"
    )


TIER_MAY_CALL = (
    "AttachKVCache, CommitBlocks, GetKVCacheGroupMetadata, GetUsage, LeaseBlocks, LookupBlocks, Ping, "
    "PutBlocks, ReadBlocks, ReleaseLease, ReserveBlocks and reflection"
)
"""What a denied ``tier`` token is told it may call (docs/tier.md, Roles)."""


async def test_a_tier_token_puts_looks_up_and_leases_by_hash_and_is_denied_the_rest_naming_its_role(
    token_server, connect
):
    """The least-privilege tier token (docs/tier.md, Roles) over a whole put/lookup/lease cycle,
    the scheduler seeing its BlockStored; the scheduler's, the reset, WriteBlocks and the event
    RPCs are PERMISSION_DENIED naming the role, with the cache unchanged. A scheduler token may
    put too (scheduler: every RPC); a watcher's or worker's put or lease is denied."""
    from kvservice_client.torch_view import aattach

    admin = await connect(token_server, token=SCHEDULER_TOKEN)
    tier = await connect(token_server, token=TIER_TOKEN)
    await admin.take_events("audit")
    key = [i.to_bytes(32, "big") for i in (1, 2, 3)]
    data = [bytes([i]) * BLOCK_BYTES for i in (1, 2, 3)]
    put = await tier.put_blocks(0, [(key[0], data[0]), (key[1], data[1])], parent_block_hashes=[None, key[0]])
    assert (put.reserved, list(put.block_ids), put.num_blocks_written) == (True, [1, 2], 2)
    await aattach(tier)
    reserved = await tier.reserve_blocks(0, [key[2]], parent_block_hashes=[key[1]])
    assert list(reserved.block_ids) == [3]
    assert (await tier.commit_blocks(reserved.lease_id)).committed
    found = await tier.lookup_blocks(0, [*key, bytes(32)])
    assert (list(found.present), found.num_prefix_blocks) == ([True, True, True, False], 3)
    lease = await tier.lease_blocks(0, key)
    assert (list(lease.block_ids), lease.num_leased) == ([1, 2, 3], 3)
    assert (await tier.release_lease(lease.lease_id)).valid
    assert [b.data for b in await aread_blocks(tier, [block_ref(0, block_hash=k) for k in key[:2]])] == data[:2]
    events = [e for b in (await admin.take_events("audit")).batches for e in events_of(b)]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [([1, 2], None, []), ([3], 2, [])]

    denied: dict[str, Callable[[AsyncKVCacheClient], Awaitable[Any]]] = {
        "GetComputedBlocks": lambda c: c.get_computed_blocks("t", range(8)),
        "AllocateSlots": lambda c: c.allocate_slots("t", 8),
        "Free": lambda c: c.free("t"),
        "Step": lambda c: c.step(StepBuilder().get_usage()),
        "ManagerStep": lambda c: c.manager_step(pb.ManagerStepRequest(owner="tier")),
        "ResetPrefixCache": lambda c: c.reset_prefix_cache(),
        "WriteBlocks": lambda c: awrite_blocks(c, "t", [(0, 1, data[0])]),
        "TakeEvents": lambda c: c.take_events("tier"),
        "StreamEvents": lambda c: first_batch(c),
    }
    before = await observed_state(token_server, admin)
    for method, call in denied.items():
        with pytest.raises(KVServiceError) as err:
            await call(tier)
        assert (err.value.code, err.value.message) == (
            PERMISSION_DENIED,
            f"/{SERVICE_NAME}/{method}: token 'shared-tier' has role 'tier', which may call only {TIER_MAY_CALL}",
        )
        assert await observed_state(token_server, admin) == before, method
    assert list((await tier.lookup_blocks(0, key)).present) == [True, True, True]

    # The scheduler may call every RPC, the tier's puts included; watchers and workers may not put.
    by_scheduler = await admin.put_blocks(0, [(bytes(31) + b"\x09", data[0])])
    assert (by_scheduler.reserved, list(by_scheduler.block_ids)) == (True, [4])
    before = await observed_state(token_server, admin)
    for token, name, role in [(WATCHER_TOKEN, "router", "watcher"), (WORKER_TOKEN, "gpu-worker", "worker")]:
        other = await connect(token_server, token=token)
        for method, call in [
            ("ReserveBlocks", lambda c: c.reserve_blocks(0, [bytes(32)])),
            ("PutBlocks", lambda c: c.put_blocks(0, [(bytes(32), data[0])])),
            ("LeaseBlocks", lambda c: c.lease_blocks(0, key)),
        ]:
            with pytest.raises(KVServiceError) as err:
                await call(other)
            assert err.value.code == PERMISSION_DENIED
            assert err.value.message.startswith(f"/{SERVICE_NAME}/{method}: token {name!r} has role {role!r}")
        assert list((await other.lookup_blocks(0, key)).present) == [True, True, True]  # a read-only lookup
    assert await observed_state(token_server, admin) == before


@pytest.mark.parametrize(
    "metadata, message",
    [
        (None, "missing authorization metadata: send 'authorization: Bearer <token>'"),
        ((("authorization", f"Bearer {WRONG_TOKEN}"),), "unknown bearer token"),
        (
            (("authorization", f"Basic {SCHEDULER_TOKEN}"),),
            "malformed authorization metadata: expected 'Bearer <token>'",
        ),
        ((("authorization", "Bearer"),), "malformed authorization metadata: expected 'Bearer <token>'"),
        (
            (("authorization", f"Bearer {SCHEDULER_TOKEN}"), ("authorization", f"Bearer {SCHEDULER_TOKEN}")),
            "2 authorization metadata entries; send exactly one",
        ),
    ],
    ids=["missing", "wrong", "not-bearer", "empty", "twice"],
)
async def test_calls_without_a_valid_token_are_unauthenticated(token_server, connect, metadata, message):
    admin = await prepare(token_server, connect)
    client = await connect(token_server, metadata=metadata)
    before = await observed_state(token_server, admin)
    for method, call in [*RPCS.items(), ("reflection", _reflection_call)]:
        with pytest.raises(KVServiceError) as err:
            await call(client)
        assert (err.value.code, err.value.message) == (UNAUTHENTICATED, message), method
        assert SCHEDULER_TOKEN not in err.value.message and WRONG_TOKEN not in err.value.message
    assert await observed_state(token_server, admin) == before


async def test_the_bearer_scheme_is_case_insensitive(token_server, connect):
    client = await connect(token_server, metadata={"authorization": f"bearer {SCHEDULER_TOKEN}"})
    assert (await client.ping(b"x")).payload == b"x"


async def test_health_needs_no_token(token_server, connect):
    client = await connect(token_server)
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", SERVICE_NAME):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=READ_TIMEOUT_S)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=READ_TIMEOUT_S)
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


async def test_unknown_method_is_unimplemented_with_a_token_and_unauthenticated_without(token_server, connect):
    for token, code in ((SCHEDULER_TOKEN, grpc.StatusCode.UNIMPLEMENTED), (None, UNAUTHENTICATED)):
        client = await connect(token_server, token=token)
        call = client.channel.unary_unary(f"/{SERVICE_NAME}/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(b"", metadata=client._metadata or None, timeout=READ_TIMEOUT_S)
        assert err.value.code() == code


# -- bind rules and notes -----------------------------------------------------------------------


async def test_loopback_without_auth_says_so(kv_server):
    assert "auth off: no TLS, no tokens (loopback only)" in kv_server.notes
    assert "note: auth off: no TLS, no tokens (loopback only)" in kv_server.describe()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10"])
async def test_non_loopback_bind_without_auth_is_refused(start_kv_server, host):
    with pytest.raises(ValueError, match=r"not a loopback address.*set allow_insecure_bind \(--allow-insecure-bind\)"):
        await start_kv_server(host=host)


async def test_server_only_tls_authenticates_nobody_so_a_non_loopback_bind_needs_the_flag(start_kv_server, pki):
    with pytest.raises(ValueError, match=r"server-only TLS authenticates nobody.*--allow-insecure-bind"):
        await start_kv_server(host="0.0.0.0", **tls_settings(pki))
    running = await start_kv_server(host="0.0.0.0", allow_insecure_bind=True, **tls_settings(pki))
    assert running.notes[-2:] == [
        "auth: TLS, no tokens",
        "TLS without client certificates or tokens on non-loopback 0.0.0.0 (allow_insecure_bind): traffic is "
        "encrypted but anyone who reaches it can change the cache",
    ]
    mutual = await start_kv_server(host="0.0.0.0", **tls_settings(pki, mutual=True))
    assert mutual.notes[-1] == "auth: mutual TLS (client certificates required), no tokens"


async def test_non_loopback_bind_notes(start_kv_server, tmp_path):
    insecure = await start_kv_server(host="0.0.0.0", allow_insecure_bind=True)
    assert insecure.notes[-1] == (
        "auth off on non-loopback 0.0.0.0 (allow_insecure_bind): no TLS, no tokens; anyone who reaches it can "
        "change the cache"
    )
    tokens = await start_kv_server(host="0.0.0.0", auth_tokens_file=write_tokens(tmp_path / "t.toml"))
    assert tokens.notes[-2:] == [
        "auth: no TLS, 3 bearer tokens (2 scheduler, 1 watcher)",
        "bearer tokens travel in clear text: no TLS on non-loopback 0.0.0.0 (set tls_cert_file and tls_key_file)",
    ]


# -- bad files ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        (None, "cannot read the token file: No such file or directory"),
        ("tokens = [\n", "the token file is not valid TOML"),
        ("", r"no \[\[tokens\]\] entries"),
        ('tokens = "x"\n', r"no \[\[tokens\]\] entries"),
        (
            'colour = 1\n[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\n',
            "unknown key 'colour'",
        ),
        (
            '[[tokens]]\nname = "a"\nrole = "admin"\ntoken = "SECRET-0123456789abc"\n',
            r"tokens\[0\] \('a'\): role must be one of scheduler, watcher, worker, tier; got 'admin'",
        ),
        (
            '[[tokens]]\nname = "a"\nrole = "watcher"\n',
            r"tokens\[0\] \('a'\): give exactly one of token or token_sha256",
        ),
        (
            f'[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\ntoken_sha256 = "{"0" * 64}"\n',
            "give exactly one of token or token_sha256",
        ),
        ('[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET"\n', "token must be at least 16 characters; got 6"),
        (
            '[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET 0123456789abc"\n',
            "token must be printable ASCII without spaces",
        ),
        ('[[tokens]]\nname = "a"\nrole = "watcher"\ntoken_sha256 = "SECRET"\n', "token_sha256 must be 64 hex digits"),
        (
            '[[tokens]]\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\n',
            r"tokens\[0\]: name must be a non-empty string",
        ),
        (
            '[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\nscope = "x"\n',
            "unknown key 'scope'",
        ),
        (
            '[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\n'
            '[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789xyz"\n',
            "token name 'a' appears twice",
        ),
        (
            '[[tokens]]\nname = "a"\nrole = "watcher"\ntoken = "SECRET-0123456789abc"\n'
            '[[tokens]]\nname = "b"\nrole = "scheduler"\ntoken = "SECRET-0123456789abc"\n',
            "token 'b' repeats an earlier entry's token",
        ),
    ],
    ids=[
        "missing",
        "not-toml",
        "empty",
        "not-a-list",
        "unknown-top-key",
        "bad-role",
        "no-token",
        "both",
        "short",
        "spaces",
        "bad-sha256",
        "no-name",
        "unknown-key",
        "duplicate-name",
        "duplicate-token",
    ],
)
async def test_a_bad_token_file_is_named(start_kv_server, tmp_path, text, problem):
    path = tmp_path / "tokens.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path}: .*{problem}") as err:
        await start_kv_server(auth_tokens_file=str(path))
    assert "SECRET" not in str(err.value)


async def test_bad_tls_files_are_named(start_kv_server, pki, tmp_path):
    missing = tmp_path / "missing.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    other_key = tmp_path / "other.key"
    other_key.write_bytes(pki.client_key_pem)
    cases = [
        (
            {"tls_cert_file": str(missing), "tls_key_file": str(pki.server_key_file)},
            rf"^{missing}: cannot read the TLS certificate file: No such file or directory",
        ),
        (
            {"tls_cert_file": str(garbage), "tls_key_file": str(pki.server_key_file)},
            rf"^{garbage}: the TLS certificate file is not PEM",
        ),
        (
            {"tls_cert_file": str(pki.server_cert_file), "tls_key_file": str(other_key)},
            rf"^{pki.server_cert_file}, {other_key}: not a PEM certificate chain and the private key of its first",
        ),
        ({**tls_settings(pki), "tls_client_ca_file": str(garbage)}, rf"^{garbage}: the TLS client CA file is not PEM"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            await start_kv_server(**settings)


def test_tls_settings_go_together(pki):
    with pytest.raises(ValueError, match="tls_cert_file needs tls_key_file"):
        ServerConfig(tls_cert_file=str(pki.server_cert_file))
    with pytest.raises(ValueError, match="tls_key_file needs tls_cert_file"):
        ServerConfig(tls_key_file=str(pki.server_key_file))
    with pytest.raises(ValueError, match=r"tls_client_ca_file \(mutual TLS\) needs tls_cert_file and tls_key_file"):
        ServerConfig(tls_client_ca_file=str(pki.ca_file))


def test_watch_cli_tls_flags(pki, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import kvservice.watch
    from kvservice.cli import main

    key_file, cert_file = tmp_path / "client.key", tmp_path / "client.pem"
    key_file.write_bytes(pki.client_key_pem)
    cert_file.write_bytes(pki.client_cert_pem)
    seen: list[dict[str, Any]] = []

    async def fake_watch_events(target: str, **kwargs: Any) -> int:
        seen.append({"target": target, **kwargs})
        return 0

    monkeypatch.setattr(kvservice.watch, "watch_events", fake_watch_events)
    runner = CliRunner(env={"KVSERVICE_TOKEN": None})
    args = [
        "watch",
        "h:1",
        "--token",
        "T",
        "--tls-ca",
        str(pki.ca_file),
        "--tls-cert",
        str(cert_file),
        "--tls-key",
        str(key_file),
    ]
    assert runner.invoke(main, args).exit_code == 0
    assert runner.invoke(main, ["watch", "h:2"]).exit_code == 0
    assert runner.invoke(main, ["watch", "h:3", "--tls"]).exit_code == 0
    assert [(s["target"], s["token"], type(s["credentials"])) for s in seen] == [
        ("h:1", "T", grpc.ChannelCredentials),
        ("h:2", None, type(None)),
        ("h:3", None, grpc.ChannelCredentials),
    ]
    result = runner.invoke(main, ["watch", "h:4", "--tls-cert", str(cert_file)])
    assert (result.exit_code, "--tls-cert and --tls-key go together" in result.output) == (2, True)
