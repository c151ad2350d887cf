"""TierClient's releases riding LeaseBlocks (``release_lease_ids``), its retry at tier_max_leases
(``_with_room``), close() and loads on several threads: written by a second attack on the lease
table. The problems it found are fixed, each pinned by a test whose first comment states the rule;
the other tests pin behaviour not covered elsewhere.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tier_helpers import CHUNK_BYTES, WAIT_S, data_of, hash_of, named_rows, row_bytes, tier_server

import kvservice_vllm.tier_client as tier_client
from kvservice_client import KVCacheClient
from kvservice_vllm.embedded import EmbeddedTierServer
from kvservice_vllm.tier_client import TierClient

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def one_lease_server() -> Iterator[EmbeddedTierServer]:
    running = tier_server(num_blocks=17, tier_max_leases=1)
    try:
        yield running
    finally:
        running.close()


def hold_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The releaser thread waits an hour before it sends (not 5 ms): a release stays pending until
    a LeaseBlocks carries it, flush() or close() (a loaded machine's releaser, not yet run)."""
    monkeypatch.setattr(tier_client, "RELEASE_GRACE_S", 3600.0)


def test_a_store_after_a_load_at_tier_max_leases_flushes_the_load_s_pending_release_and_goes_through(
    one_lease_server: EmbeddedTierServer, connect_client: Callable[..., TierClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A load's release still pending holds a lease: at tier_max_leases the next call flushes it and
    # asks once more.
    hold_releases(monkeypatch)
    a = connect_client(one_lease_server.target)
    b = connect_client(one_lease_server.target)
    assert a.store(0, [hash_of("k")], [], named_rows("k"), [0]).written == [True]
    a.flush()
    rows = torch.zeros((1, CHUNK_BYTES), dtype=torch.uint8)
    assert b.load(0, [hash_of("k")], rows, [0]).loaded == [True]
    assert row_bytes(rows, 0) == data_of("k")
    assert (len(b._pending_releases), b._background) == (1, None)
    result = b.store(0, [hash_of("x")], [], named_rows("x"), [0])
    b.flush()
    assert result.written == [True], "B's store was refused for a lease room its own finished load held"


def test_a_load_racing_the_releaser_s_send_at_tier_max_leases_waits_for_it_and_goes_through(
    one_lease_server: EmbeddedTierServer, connect_client: Callable[..., TierClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A load refused at tier_max_leases while the releaser thread sends this client's releases
    # waits for that send (flush) and asks once more.
    a = connect_client(one_lease_server.target)
    b = connect_client(one_lease_server.target)
    assert a.store(0, [hash_of("k")], [], named_rows("k"), [0]).written == [True]
    a.flush()
    sending = threading.Event()
    go = threading.Event()
    real_release_many = TierClient._release_many

    def release_many(self: TierClient, lease_ids: list[int]) -> None:
        if lease_ids and threading.current_thread().name == "kvservice_tier_releaser":
            sending.set()
            assert go.wait(WAIT_S), "the releaser was never let go"
        real_release_many(self, lease_ids)

    monkeypatch.setattr(TierClient, "_release_many", release_many)
    real_flush = b.flush

    def flush() -> None:
        go.set()  # a flush waits for the releaser's send: let it go
        real_flush()

    b.flush = flush  # type: ignore[method-assign]
    rows = torch.zeros((2, CHUNK_BYTES), dtype=torch.uint8)
    assert b.load(0, [hash_of("k")], rows, [0]).loaded == [True]
    assert sending.wait(WAIT_S)  # the releaser has taken the release and is sending it
    loaded = b.load(0, [hash_of("k")], rows, [1]).loaded
    go.set()
    b.flush()
    assert loaded == [True], "B's load was refused for a lease room its own finished load held"
    assert row_bytes(rows, 1) == data_of("k")


def test_a_release_carried_by_a_load_racing_close_is_sent_before_the_channel_closes(
    one_lease_server: EmbeddedTierServer, connect_client: Callable[..., TierClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # close() waits for the LeaseBlocks calls that carry releases before its last send and the
    # channel's close, so no release taken by a racing load is lost.
    hold_releases(monkeypatch)
    a = connect_client(one_lease_server.target)
    b = connect_client(one_lease_server.target)
    assert a.store(0, [hash_of("k")], [], named_rows("k"), [0]).written == [True]
    a.store(0, [hash_of("j")], [], named_rows("j"), [0])
    a.flush()
    rows = torch.zeros((2, CHUNK_BYTES), dtype=torch.uint8)
    assert b.load(0, [hash_of("k")], rows, [0]).loaded == [True]
    [first] = list(b._pending_releases)
    channel_closing = threading.Event()
    real_channel_close = b.client.close

    def channel_close() -> None:
        channel_closing.set()
        real_channel_close()

    b.client.close = channel_close  # type: ignore[method-assign]
    real_lease = KVCacheClient.lease_blocks
    closer = threading.Thread(target=b.close)

    def lease_blocks(self: KVCacheClient, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self is b.client and list(getattr(request, "release_lease_ids", ())) == [first]:
            closer.start()  # close() runs while this LeaseBlocks, carrying the release, is sent
            channel_closing.wait(5)  # (a close that waits for this call would never get there)
        return real_lease(self, request, *args, **kwargs)

    monkeypatch.setattr(KVCacheClient, "lease_blocks", lease_blocks)
    b.load(0, [hash_of("j")], rows, [1])
    closer.join(WAIT_S)
    assert not closer.is_alive()
    tier = one_lease_server.running.engine.tier
    assert first not in tier._leases, f"read lease {first} still live after close(); {b._pending_releases} left queued"


def test_releases_of_loads_on_several_threads_each_go_exactly_once(
    connect_client: Callable[..., TierClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every read lease of loads on 4 threads at once is released exactly once (riding another
    # load's LeaseBlocks, the releaser's batch or a flush), never twice, none left.
    running = tier_server(num_blocks=17)
    try:
        a = connect_client(running.target)
        names = [f"k{i}" for i in range(4)]
        assert a.store(0, [hash_of(n) for n in names], [], named_rows(*names), [0, 1, 2, 3]).written == [True] * 4
        a.flush()
        b = connect_client(running.target)
        leased: list[int] = []
        released: list[int] = []
        lock = threading.Lock()
        real_lease = KVCacheClient.lease_blocks

        def lease_blocks(self: KVCacheClient, request: Any, *args: Any, **kwargs: Any) -> Any:
            answer = real_lease(self, request, *args, **kwargs)
            if self is b.client:
                with lock:
                    released.extend(request.release_lease_ids)
                    if answer.lease_id:
                        leased.append(answer.lease_id)
            return answer

        monkeypatch.setattr(KVCacheClient, "lease_blocks", lease_blocks)
        start = threading.Barrier(4)
        errors: list[str] = []

        def loads(t: int) -> None:
            rows = torch.zeros((1, CHUNK_BYTES), dtype=torch.uint8)
            start.wait(WAIT_S)
            for j in range(25):
                name = names[(t + j) % 4]
                if b.load(0, [hash_of(name)], rows, [0]).loaded != [True] or row_bytes(rows, 0) != data_of(name):
                    errors.append(f"thread {t} load {j} of {name}")
                if j % 10 == 9:
                    b.flush()

        threads = [threading.Thread(target=loads, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S * 2)
        assert not any(thread.is_alive() for thread in threads)
        b.flush()
        assert errors == []
        counts = Counter(released)
        assert len(leased) == 100 and sorted(counts) == sorted(leased)
        assert [lease_id for lease_id, n in counts.items() if n != 1] == []
        tier = running.running.engine.tier
        assert (tier.num_leases, tier.num_leased_blocks, b._pending_releases) == (0, 0, [])
    finally:
        running.close()


def test_a_lease_blocks_carrying_releases_that_fails_unavailable_leaves_them_queued_for_the_next_server(
    one_lease_server: EmbeddedTierServer, connect_client: Callable[..., TierClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server is down: the load fails its keys and its releases go back on the queue; once
    # the server is back (a new one: those leases unknown there, skipped) loads go through.
    hold_releases(monkeypatch)
    a = connect_client(one_lease_server.target)
    assert a.store(0, [hash_of("k")], [], named_rows("k"), [0]).written == [True]
    a.flush()
    rows = torch.zeros((2, CHUNK_BYTES), dtype=torch.uint8)
    assert a.load(0, [hash_of("k")], rows, [0]).loaded == [True]
    [first] = list(a._pending_releases)
    one_lease_server.stop()
    assert a.load(0, [hash_of("k")], rows, [1]).loaded == [False]
    assert a._pending_releases == [first]
    one_lease_server.start()
    assert a.store(0, [hash_of("k")], [], named_rows("k"), [0]).written == [True]
    a.flush()
    assert a._pending_releases == []
    assert a.load(0, [hash_of("k")], rows, [1]).loaded == [True]
    assert row_bytes(rows, 1) == data_of("k")
    a.flush()
    assert one_lease_server.running.engine.tier.num_leases == 0
