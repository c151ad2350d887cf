"""kvservice_vllm.tier.KVServiceTier: two vLLM instances share prefix chunks through one kvservice.

Each instance is vLLM 0.33's own ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` (CPU
primary tier in vLLM's shared region) with the kvservice tier loaded by ``module_path``, as
``kv_connector_extra_config`` loads it; the server is a real ``kvservice serve --device cpu
--kv-cache-layout opaque:4096`` (kvservice_vllm.embedded.EmbeddedTierServer). Bytes are compared exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tier_helpers import CHUNK_BYTES, Instance, chunk_bytes_of, chunk_key, offloading_config, tier_server
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import kvservice_vllm.tier_client as tier_client
from kvservice_client import KVCacheClient
from kvservice_vllm.embedded import EmbeddedTierServer
from kvservice_vllm.tier import KVServiceTier, TierLayoutError

pytestmark = pytest.mark.timeout(120)

KEYS = [chunk_key(f"prompt-a/{i}") for i in range(8)]


@pytest.fixture
def server() -> Iterator[EmbeddedTierServer]:
    running = tier_server(num_blocks=33)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def instances(request: pytest.FixtureRequest, server: EmbeddedTierServer) -> Iterator[tuple[Instance, Instance]]:
    transport_a, transport_b = getattr(request, "param", ("shm", "shm"))
    a = Instance(server.target, transport=transport_a)
    b = Instance(server.address, transport=transport_b)
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize(
    "instances", [("shm", "shm"), ("grpc", "grpc"), ("shm", "grpc"), ("grpc", "shm")], indirect=True
)
def test_chunks_a_stores_are_hits_for_b_with_a_s_bytes(instances: tuple[Instance, Instance]) -> None:
    a, b = instances
    a.store(KEYS)
    found = b.fetch(KEYS)
    assert found == {key: chunk_bytes_of(key) for key in KEYS}
    assert b.tier.transport in ("shm", "grpc")


def test_transport_auto_takes_shared_memory_on_the_same_host(server: EmbeddedTierServer) -> None:
    a = Instance(server.target)
    try:
        assert a.tier.transport == "shm"
        assert a.tier.locality is not None and a.tier.locality.value == "LOCAL"
    finally:
        a.shutdown()


def test_never_stored_keys_miss(instances: tuple[Instance, Instance]) -> None:
    a, b = instances
    a.store(KEYS[:4])
    unknown = [chunk_key(f"never-stored/{i}") for i in range(3)]
    found = b.fetch(KEYS[:4] + unknown)
    assert [found[k] is not None for k in KEYS[:4] + unknown] == [True] * 4 + [False] * 3
    assert all(found[k] == chunk_bytes_of(k) for k in KEYS[:4])


def test_a_lookup_answers_retry_until_its_step_s_batch_returns(instances: tuple[Instance, Instance]) -> None:
    a, b = instances
    a.store(KEYS[:2])
    ctx = ReqContext(req_id="r")
    b.tier.on_new_request(ctx)
    assert [b.tier.lookup(k, ctx) for k in KEYS[:3]] == [LookupResult.RETRY] * 3
    b.tier.on_schedule_end(None)  # the tier reads nothing of it
    b.tier.wait_lookups()
    assert [b.tier.lookup(k, ctx) for k in KEYS[:3]] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    b.tier.on_request_finished(ctx)
    assert not b.tier._verdicts


def test_one_lookup_rpc_per_step(instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = instances
    calls: list[int] = []
    real = KVCacheClient.lookup_blocks

    def counting(self: KVCacheClient, *args: object, **kwargs: object) -> object:
        request = args[0]
        calls.append(len(request.block_hashes))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheClient, "lookup_blocks", counting)
    contexts = [ReqContext(req_id=f"r{i}") for i in range(4)]
    for i, ctx in enumerate(contexts):  # four requests, two keys each, one step
        b.tier.on_new_request(ctx)
        for key in KEYS[2 * i : 2 * i + 2]:
            assert b.tier.lookup(key, ctx) is LookupResult.RETRY
    b.tier.on_schedule_end(None)
    b.tier.wait_lookups()
    assert calls == [8]


@pytest.mark.parametrize("instances", [("shm", "shm"), ("grpc", "grpc")], indirect=True)
def test_store_jobs_queued_meanwhile_go_as_one_call_and_report_each(
    instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = instances
    calls: list[int] = []
    real = tier_client.TierClient.store

    def counting(self: tier_client.TierClient, group_idx: int, block_hashes: list[bytes], *args: object) -> object:
        calls.append(len(block_hashes))
        return real(self, group_idx, block_hashes, *args)

    monkeypatch.setattr(tier_client.TierClient, "store", counting)
    for i, key in enumerate(KEYS[:5]):
        a.rows[i].copy_(torch.frombuffer(bytearray(chunk_bytes_of(key, a.rows.shape[1])), dtype=torch.uint8))
    busy = threading.Event()
    for _ in range(a.tier._store_pool._max_workers):
        a.tier._store_pool.submit(busy.wait)  # every store thread copying: the three jobs queue
    ctx = ReqContext(req_id="jobs")
    for job_id, keys, rows in ((1, KEYS[:2], [0, 1]), (2, KEYS[2:4], [2, 3]), (3, [KEYS[1], KEYS[4]], [1, 4])):
        a.tier.submit_store(TransferJob(job_id, keys, np.array(rows), is_promotion=False, req_context=ctx))
    busy.set()
    a.tier.drain_jobs()
    results = sorted(a.tier.get_finished_jobs(), key=lambda r: r.job_id)
    assert calls == [5]  # one store of the five distinct keys (KEYS[1] is in jobs 1 and 3)
    size = a.rows.shape[1]
    assert [(r.job_id, r.success, r.transfer_bytes) for r in results] == [
        (1, True, 2 * size),
        (2, True, 2 * size),
        (3, True, size),  # KEYS[1] was job 1's to copy
    ]
    assert b.fetch(KEYS[:5]) == {key: chunk_bytes_of(key) for key in KEYS[:5]}


def test_two_store_jobs_overlap_round_trips_and_take_turns_copying(
    instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Job 1's copy is held until job 2's reservation has answered and job 2 waits for the copy
    # lock: one job's round trip runs while the other copies, and job 2's copy waits for job 1's
    # (one copier per direction).
    a, b = instances
    assert a.tier._store_pool._max_workers == 2
    trace: list[str] = []
    reserved = {"1": threading.Event(), "2": threading.Event()}
    wants_copy = {"1": threading.Event(), "2": threading.Event()}
    job_of_thread: dict[int, str] = {}
    real_reserve = KVCacheClient.reserve_blocks
    real_copy = tier_client._copy_into_block
    real_lock = a.tier.client._store_copy

    def reserve(self: KVCacheClient, request: object, *args: object, **kwargs: object) -> object:
        answer = real_reserve(self, request, *args, **kwargs)
        job = "1" if request.block_hashes[0] == KEYS[0][:-4] else "2"  # type: ignore[attr-defined]
        job_of_thread[threading.get_ident()] = job
        trace.append(f"reserved {job}")
        reserved[job].set()
        return answer

    class TracedLock:
        def __enter__(self) -> None:
            job = job_of_thread[threading.get_ident()]
            trace.append(f"wants to copy {job}")
            wants_copy[job].set()
            real_lock.acquire()

        def __exit__(self, *exc: object) -> None:
            real_lock.release()

    def copy(blocks: object, block_id: int, row: np.ndarray) -> None:
        job = job_of_thread[threading.get_ident()]
        if job == "1":
            assert wants_copy["2"].wait(30), "job 2 did not reserve and wait for the copy while job 1 copied"
        trace.append(f"copy {job}")
        real_copy(blocks, block_id, row)

    monkeypatch.setattr(KVCacheClient, "reserve_blocks", reserve)
    monkeypatch.setattr(tier_client, "_copy_into_block", copy)
    monkeypatch.setattr(a.tier.client, "_store_copy", TracedLock())
    for i, key in enumerate(KEYS[:4]):
        a.rows[i].copy_(torch.frombuffer(bytearray(chunk_bytes_of(key, a.rows.shape[1])), dtype=torch.uint8))
    ctx = ReqContext(req_id="overlap")
    a.tier.submit_store(TransferJob(1, KEYS[:2], np.array([0, 1]), is_promotion=False, req_context=ctx))
    assert wants_copy["1"].wait(30)
    a.tier.submit_store(TransferJob(2, KEYS[2:4], np.array([2, 3]), is_promotion=False, req_context=ctx))
    a.tier.drain_jobs()
    assert trace == [
        "reserved 1",
        "wants to copy 1",
        "reserved 2",
        "wants to copy 2",
        "copy 1",
        "copy 1",
        "copy 2",
        "copy 2",
    ]
    assert sorted((r.job_id, r.success) for r in a.tier.get_finished_jobs()) == [(1, True), (2, True)]
    assert b.fetch(KEYS[:4]) == {key: chunk_bytes_of(key) for key in KEYS[:4]}


@pytest.mark.parametrize("job_threads", [0, -1, True, 1.5, "2"])
def test_job_threads_below_one_or_not_an_integer_is_refused(server: EmbeddedTierServer, job_threads: object) -> None:
    with pytest.raises(ValueError, match=rf"job_threads must be an integer >= 1; got {job_threads!r}"):
        Instance(server.target, job_threads=job_threads)


def test_one_job_thread_runs_a_direction_s_jobs_one_after_the_other(server: EmbeddedTierServer) -> None:
    a, b = Instance(server.target, job_threads=1), Instance(server.target)
    try:
        assert (a.tier._store_pool._max_workers, a.tier._load_pool._max_workers) == (1, 1)
        a.store(KEYS[:3])
        assert b.fetch(KEYS[:3]) == {key: chunk_bytes_of(key) for key in KEYS[:3]}
    finally:
        a.shutdown()
        b.shutdown()


def test_evicted_keys_miss_and_present_ones_keep_their_bytes(server: EmbeddedTierServer) -> None:
    # 32 usable blocks: the second 32 stores evict the first 32 (least recently used first).
    first = [chunk_key(f"old/{i}") for i in range(32)]
    second = [chunk_key(f"new/{i}") for i in range(32)]
    a, b = Instance(server.target), Instance(server.target)
    try:
        a.store(first)
        a.store(second[:16])
        found = b.fetch(first + second[:16])
        assert [found[k] is not None for k in first] == [False] * 16 + [True] * 16
        assert all(found[k] == chunk_bytes_of(k) for k in first[16:] + second[:16])
    finally:
        a.shutdown()
        b.shutdown()


def test_a_copy_racing_an_eviction_copies_the_leased_block(
    instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = instances
    a.store(KEYS[:1])
    filler = [chunk_key(f"filler/{i}") for i in range(40)]
    real_copy = tier_client._copy_from_block
    raced: list[int] = []

    def copy_after_an_eviction(*args: object) -> None:
        if not raced:
            # While B's copy holds its lease, A's puts fill the pool: every unpinned block is
            # evicted and reused, the leased one never.
            for start in range(0, len(filler), 8):
                result = a.tier.client.store(
                    0,
                    [k[:-4] for k in filler[start : start + 8]],
                    [],
                    a.rows,
                    list(range(8)),
                )
                raced.append(sum(result.written))
        real_copy(*args)

    monkeypatch.setattr(tier_client, "_copy_from_block", copy_after_an_eviction)
    found = b.fetch(KEYS[:1])
    assert sum(raced) == 40  # the 32 unpinned blocks were reused (some twice)
    assert found[KEYS[0]] == chunk_bytes_of(KEYS[0])
    # The leased block outlived 40 puts into a 32-block pool; the fillers' oldest were evicted.
    assert b.tier.client.lookup([(0, KEYS[0][:-4]), (0, filler[0][:-4]), (0, filler[-1][:-4])]) == [True, False, True]


def test_a_copy_that_lost_its_lease_fails_never_wrong_bytes(
    instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = instances
    a.store(KEYS[:2])
    real_copy = tier_client._copy_from_block
    real_lease = KVCacheClient.lease_blocks
    leases: list[int] = []

    def recording_lease(self: KVCacheClient, *args: object, **kwargs: object) -> object:
        answer = real_lease(self, *args, **kwargs)
        leases.append(answer.lease_id)
        return answer

    def copy_after_losing_the_lease(*args: object) -> None:
        if leases:
            # The lease ends under the copy (as an expiry would), and its blocks are reused.
            with KVCacheClient(a.tier.client.target) as other:
                assert other.release_lease(leases.pop()).valid
            a.tier.client.store(0, [chunk_key(f"reuse/{i}")[:-4] for i in range(32)], [], a.rows, list(range(32)))
        real_copy(*args)

    monkeypatch.setattr(KVCacheClient, "lease_blocks", recording_lease)
    monkeypatch.setattr(tier_client, "_copy_from_block", copy_after_losing_the_lease)
    found = b.fetch(KEYS[:2])
    assert found == {KEYS[0]: None, KEYS[1]: None}  # a failed load: the keys miss, recomputed


def _rows_of(keys: list[bytes]) -> torch.Tensor:
    rows = torch.zeros((len(keys), CHUNK_BYTES), dtype=torch.uint8)
    for i, key in enumerate(keys):
        rows[i].copy_(torch.frombuffer(bytearray(chunk_bytes_of(key)), dtype=torch.uint8))
    return rows


@pytest.fixture
def tier_client_pair(server: EmbeddedTierServer) -> Iterator[tuple[tier_client.TierClient, tier_client.TierClient]]:
    """Two TierClients over shared memory (the calls KVServiceTier's job threads make)."""
    a = tier_client.TierClient(server.target, chunk_bytes=CHUNK_BYTES, transport="shm")
    b = tier_client.TierClient(server.target, chunk_bytes=CHUNK_BYTES, transport="shm")
    a.connect()
    b.connect()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _calls_on_threads(monkeypatch: pytest.MonkeyPatch, name: str, gate: threading.Event | None = None) -> list[str]:
    """Record the thread of every ``KVCacheClient.<name>`` call (held at ``gate`` when given)."""
    real = getattr(KVCacheClient, name)
    threads: list[str] = []

    def call(self: KVCacheClient, *args: object, **kwargs: object) -> object:
        if gate is not None:
            assert gate.wait(30), f"{name} was never let go"
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheClient, name, call)
    return threads


def test_a_load_checks_its_lease_slot_and_leaves_the_release_to_the_background(
    server: EmbeddedTierServer,
    tier_client_pair: tuple[tier_client.TierClient, tier_client.TierClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = tier_client_pair
    hashes = [key[:-4] for key in KEYS[:3]]
    assert all(a.store(0, hashes, [], _rows_of(KEYS[:3]), [0, 1, 2]).written)
    a.flush()
    entered, gate = threading.Event(), threading.Event()
    real_release_many = tier_client.TierClient._release_many
    releases: list[tuple[str, list[int]]] = []

    def release_many(self: tier_client.TierClient, lease_ids: list[int]) -> None:
        if lease_ids:
            releases.append((threading.current_thread().name, list(lease_ids)))
            entered.set()
            assert gate.wait(30)
        real_release_many(self, lease_ids)

    monkeypatch.setattr(tier_client.TierClient, "_release_many", release_many)
    real_lease = KVCacheClient.lease_blocks
    leases: list[Any] = []

    def lease_blocks(self: KVCacheClient, request: Any, **kwargs: Any) -> Any:
        leases.append((list(request.release_lease_ids), real_lease(self, request, **kwargs)))
        return leases[-1][1]

    monkeypatch.setattr(KVCacheClient, "lease_blocks", lease_blocks)
    rows = torch.zeros((3, CHUNK_BYTES), dtype=torch.uint8)
    # The load returns, its bytes good by its slot, its lease not ended yet: a release pending.
    monkeypatch.setattr(tier_client, "RELEASE_GRACE_S", 60.0)
    assert b.load(0, hashes, rows, [2, 1, 0]).loaded == [True, True, True]
    assert [bytes(rows[i].numpy()) for i in (2, 1, 0)] == [chunk_bytes_of(k) for k in KEYS[:3]]
    assert server.running.engine.tier.num_leases == 1
    # The next load carries it: ended on the server first, no call of its own.
    assert b.load(0, hashes[:1], rows, [0]).loaded == [True]
    first = leases[0][1].lease_id
    assert [ids for ids, _answer in leases] == [[], [first]] and releases == []
    assert server.running.engine.tier.num_leases == 1  # the second load's lease, pending in turn
    # Not taken by a load within RELEASE_GRACE_S: the releaser thread sends what is pending.
    monkeypatch.setattr(tier_client, "RELEASE_GRACE_S", 0.0)
    with b._releases:
        b._releases.notify_all()
    assert entered.wait(30)
    assert releases == [("kvservice_tier_releaser", [leases[1][1].lease_id])]
    gate.set()
    b.flush()
    assert server.running.engine.tier.num_leases == 0


def test_a_store_reports_once_copied_under_its_reservation_and_commits_in_the_background(
    server: EmbeddedTierServer,
    tier_client_pair: tuple[tier_client.TierClient, tier_client.TierClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = tier_client_pair
    hashes = [key[:-4] for key in KEYS[:2]]
    gate = threading.Event()
    commits = _calls_on_threads(monkeypatch, "commit_blocks", gate)
    result = a.store(0, hashes, [], _rows_of(KEYS[:2]), [0, 1])
    assert (result.stored, result.written, result.num_bytes) == ([True, True], [True, True], 2 * CHUNK_BYTES)
    # Copied, not yet committed: not published, not found (BlockStored goes out at the commit).
    assert b.lookup([(0, h) for h in hashes]) == [False, False]
    gate.set()
    a.flush()
    assert commits == ["kvservice_tier_background_0"] and a.num_commits_lost == 0
    assert b.lookup([(0, h) for h in hashes]) == [True, True]
    rows = torch.zeros((2, CHUNK_BYTES), dtype=torch.uint8)
    assert b.load(0, hashes, rows, [0, 1]).loaded == [True, True]
    assert bytes(rows[1].numpy()) == chunk_bytes_of(KEYS[1])


def test_a_background_commit_whose_reservation_ended_meanwhile_is_counted_and_stores_nothing(
    server: EmbeddedTierServer,
    tier_client_pair: tuple[tier_client.TierClient, tier_client.TierClient],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = tier_client_pair
    real_commit = KVCacheClient.commit_blocks

    def commit_after_the_lease_ended(self: KVCacheClient, lease_id: int, *args: object, **kwargs: object) -> object:
        # Between the slot check and the commit the reservation ends (as a restart would end it).
        assert b.client.release_lease(lease_id).valid
        return real_commit(self, lease_id, *args, **kwargs)

    monkeypatch.setattr(KVCacheClient, "commit_blocks", commit_after_the_lease_ended)
    hashes = [key[:-4] for key in KEYS[:2]]
    assert a.store(0, hashes, [], _rows_of(KEYS[:2]), [0, 1]).stored == [True, True]
    a.flush()
    assert a.num_commits_lost == 1
    assert "sent after its copy did not commit: the lease had ended" in caplog.text
    assert b.lookup([(0, h) for h in hashes]) == [False, False]  # a miss, never published


def test_without_lease_slots_or_with_little_lease_time_left_the_answers_are_waited_for(
    server: EmbeddedTierServer,
    tier_client_pair: tuple[tier_client.TierClient, tier_client.TierClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, _b = tier_client_pair
    commits = _calls_on_threads(monkeypatch, "commit_blocks")
    releases = _calls_on_threads(monkeypatch, "release_lease")
    me = threading.current_thread().name
    rows = _rows_of(KEYS[:4])
    # Less than half of the put lease's time left after the copy: the commit's answer is waited for.
    monkeypatch.setattr(tier_client, "_commit_margin_s", lambda ttl_s: ttl_s)
    assert a.store(0, [KEYS[0][:-4]], [], rows, [0]).stored == [True]
    assert commits == [me]
    # A server that publishes no lease slots (lease_slot 0): both answers are waited for.
    monkeypatch.setattr(tier_client, "_commit_margin_s", lambda ttl_s: 0.0)
    server.running.engine.tier.lease_board = None
    assert a.store(0, [KEYS[1][:-4]], [], rows, [1]).stored == [True]
    assert a.load(0, [KEYS[1][:-4]], rows, [3]).loaded == [True]
    assert (commits, releases) == ([me, me], [me])
    assert bytes(rows[3].numpy()) == chunk_bytes_of(KEYS[1])


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_load_with_a_key_gone_since_its_lookup_loads_the_others(
    server: EmbeddedTierServer, tier_client_pair: tuple[tier_client.TierClient, tier_client.TierClient], transport: str
) -> None:
    a, _b = tier_client_pair
    b = tier_client.TierClient(server.target, chunk_bytes=CHUNK_BYTES, transport=transport)
    b.connect()
    try:
        hashes = [key[:-4] for key in KEYS[:3]]
        assert all(a.store(0, hashes, [], _rows_of(KEYS[:3]), [0, 1, 2]).written)
        a.flush()
        gone = chunk_key("never-stored")[:-4]
        rows = torch.zeros((4, CHUNK_BYTES), dtype=torch.uint8)
        result = b.load(0, [hashes[0], gone, hashes[1], hashes[2]], rows, [0, 1, 2, 3])
        assert (result.loaded, result.num_bytes) == ([True, False, True, True], 3 * CHUNK_BYTES)
        assert [bytes(rows[i].numpy()) for i in (0, 2, 3)] == [chunk_bytes_of(k) for k in KEYS[:3]]
    finally:
        b.close()


def test_a_token_missing_or_of_another_role_is_refused_at_connect_naming_the_tier_token(tmp_path: object) -> None:
    from pathlib import Path

    tokens = Path(str(tmp_path)) / "tokens.toml"
    tokens.write_text(
        '[[tokens]]\nname = "router"\nrole = "watcher"\ntoken = "watcher-token-0123456789"\n'
        '[[tokens]]\nname = "shared-tier"\nrole = "tier"\ntoken = "tier-token-0123456789abc"\n'
    )
    running = tier_server(num_blocks=8, auth_tokens_file=str(tokens))
    hint = (
        "; the kvservice tier needs a token of role 'tier' from the server's token file (the 'token' key of its "
        "secondary_tiers entry)"
    )
    try:
        for token, code, cause in (
            (None, "UNAUTHENTICATED", "missing authorization metadata: send 'authorization: Bearer <token>'"),
            ("watcher-token-0123456789", "PERMISSION_DENIED", "/kvservice.v1.KVCacheService/ReleaseLease: token"),
        ):
            client = tier_client.TierClient(running.target, chunk_bytes=CHUNK_BYTES, token=token)
            with pytest.raises(tier_client.KVServiceError) as caught:
                client.connect()
            client.close()
            assert caught.value.code.name == code
            assert caught.value.message.startswith(cause) and caught.value.message.endswith(hint), caught.value.message
        ok = tier_client.TierClient(running.target, chunk_bytes=CHUNK_BYTES, token="tier-token-0123456789abc")
        ok.connect()
        assert ok.transport == "shm"
        ok.close()
    finally:
        running.close()


def test_a_target_that_is_a_bare_path_is_refused_naming_the_unix_form(server: EmbeddedTierServer) -> None:
    with pytest.raises(
        ValueError, match=rf"target '{server.uds}' is a path: a Unix socket's target is 'unix:{server.uds}'"
    ):
        tier_client.TierClient(server.uds, chunk_bytes=CHUNK_BYTES)


def test_the_readme_s_tier_client_example_prints_what_it_says() -> None:
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("**Without an engine**")[1].split("```python\n")[1].split("```")[0]
    expected = [line.split("# ")[1].split(":")[0] for line in code.splitlines() if line.startswith("print(")]
    running = tier_server(num_blocks=8, chunk_bytes=2097152)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code.replace("unix:/run/kvservice.sock", running.target)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        running.close()
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.splitlines()
        == expected
        == [
            "[True, True, True, True]",
            "[True, True, True, True, False]",
            "True",
        ]
    )


def test_a_restart_turns_hits_into_misses_then_sharing_resumes(server: EmbeddedTierServer) -> None:
    a, b = Instance(server.target), Instance(server.target)
    try:
        a.store(KEYS[:4])
        assert all(v is not None for v in b.fetch(KEYS[:2]).values())

        # A request whose hits were found before the restart: its promotion fails after it.
        ctx = ReqContext(req_id="across-restart")
        b.manager.on_new_request(ctx)
        assert b.lookup(KEYS[2:4], ctx) == [LookupResult.RETRY] * 2
        b.step()
        b.tier.wait_lookups()
        assert b.lookup(KEYS[2:4], ctx) == [LookupResult.HIT_PENDING] * 2
        server.restart()
        b.settle()
        assert b.lookup(KEYS[2:4], ctx) == [LookupResult.MISS] * 2
        b.manager.on_request_finished(ctx)

        # The new server is empty: what B promoted before stays in B's own CPU tier, nothing else.
        found = b.fetch(KEYS[:4])
        assert found == {**{k: chunk_bytes_of(k) for k in KEYS[:2]}, **dict.fromkeys(KEYS[2:4])}
        a.store(KEYS[4:8])  # A's tier attaches to the new server's memory
        assert b.fetch(KEYS[4:8]) == {k: chunk_bytes_of(k) for k in KEYS[4:8]}
    finally:
        a.shutdown()
        b.shutdown()


def test_a_server_down_is_misses_and_failed_stores(server: EmbeddedTierServer) -> None:
    a = Instance(server.target)
    try:
        server.stop()
        a.store(KEYS[:2])  # the cascade fails: vLLM releases its chunks, nothing raises
        ctx = ReqContext(req_id="down")
        a.tier.on_new_request(ctx)
        assert a.tier.lookup(KEYS[5], ctx) is LookupResult.RETRY
        a.tier.on_schedule_end(None)
        a.tier.wait_lookups()
        assert a.tier.lookup(KEYS[5], ctx) is LookupResult.MISS
    finally:
        a.shutdown()


def test_a_server_whose_blocks_are_not_the_chunk_is_refused_by_name() -> None:
    # A model layout (qwen-2.5-0.5b: 196,608-byte blocks) is not a 4096-byte chunk.
    other = tier_server(num_blocks=8, kv_cache_layout=None, preset="qwen-2.5-0.5b")
    try:
        with pytest.raises(TierLayoutError) as refused:
            Instance(other.target)
        message = str(refused.value)
        assert "group 0: the server's block holds 196608 bytes" in message
        assert "--kv-cache-layout opaque:4096" in message
        assert "4096 bytes per block per worker x 1 worker copy" in message
    finally:
        other.close()


def test_a_meta_server_is_refused() -> None:
    other = tier_server(num_blocks=8, kv_cache_layout=None, preset="qwen-2.5-0.5b", device="meta")
    try:
        with pytest.raises(
            TierLayoutError,
            match=r"^the server has no memory \(--device meta\): start it with --device cpu --kv-cache-layout "
            r"opaque:4096\. vLLM's chunk: 4096 bytes",
        ):
            Instance(other.target)
    finally:
        other.close()


def test_two_tp_ranks_are_one_chunk_and_a_per_rank_server_is_refused(server: EmbeddedTierServer) -> None:
    config = offloading_config(
        num_chunks=8,
        chunk_bytes=CHUNK_BYTES,
        world_size=2,
        secondary_tiers=[{"type": "KVServiceTier", "module_path": "kvservice_vllm.tier", "target": server.target}],
    )
    spec = TieringOffloadingSpec(config)
    manager = spec.get_manager()  # rows hold both ranks' 2048 bytes: one 4096-byte server block
    try:
        assert isinstance(manager.secondary_tiers[0], KVServiceTier)
    finally:
        manager.shutdown()
    half = tier_server(num_blocks=8, chunk_bytes=CHUNK_BYTES // 2)
    try:
        with pytest.raises(TierLayoutError, match="x 2 worker copies"):
            TieringOffloadingSpec(
                offloading_config(
                    num_chunks=8,
                    chunk_bytes=CHUNK_BYTES,
                    world_size=2,
                    secondary_tiers=[
                        {"type": "KVServiceTier", "module_path": "kvservice_vllm.tier", "target": half.target}
                    ],
                )
            ).get_manager()
    finally:
        half.close()


def test_unknown_tier_option_is_refused_by_vllm_s_factory(server: EmbeddedTierServer) -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        Instance(server.target, no_such_option=1)


def test_rows_of_is_vllm_s_primary_memory() -> None:
    buffer = torch.zeros((4, 16), dtype=torch.int8)
    rows = tier_client.rows_of(memoryview(buffer.numpy()))
    rows[2, 3] = 200
    assert rows.shape == (4, 16) and buffer[2, 3].item() == -56


def test_a_grpc_store_whose_put_lease_expires_mid_stream_reports_not_stored_and_says_why(
    server: EmbeddedTierServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PutBlocks answers ``lease_expired`` when its put lease ran out while the bytes streamed
    (a helper's trial saw only UNSPECIFIED statuses, which read as "bytes not sent"): the store
    reports the keys not stored and logs why."""
    import kvservice_client.tier as client_tier

    engine = server.running.engine
    now = [engine.clock()]
    engine.clock = lambda: now[0]
    real_stream = client_tier._put_serialized

    def stream_past_the_lease(*args: Any) -> Iterator[bytes]:
        messages = real_stream(*args)
        yield next(messages)  # the header: the server reserves under a put lease
        pause = threading.Event()  # never set: a bounded wait between two looks
        for _ in range(2000):  # the server's reservation, seen from here (it runs on its own thread)
            if engine.tier.num_leases:
                break
            pause.wait(0.005)
        assert engine.tier.num_leases == 1
        now[0] += 3600.0  # past any ttl: the lease lapses before the first block is written
        yield from messages

    monkeypatch.setattr(client_tier, "_put_serialized", stream_past_the_lease)
    a = tier_client.TierClient(server.target, chunk_bytes=CHUNK_BYTES, transport="grpc")
    a.connect()
    try:
        hashes = [key[:-4] for key in KEYS[:2]]
        result = a.store(0, hashes, [], _rows_of(KEYS[:2]), [0, 1])
        assert (result.stored, result.written, result.num_bytes) == ([False, False], [False, False], 0)
        assert "a PutBlocks of 2 blocks outlived its put lease (lease_ttl_s 0.0): nothing stored" in caplog.text
        assert a.lookup([(0, h) for h in hashes]) == [False, False]
    finally:
        a.close()
