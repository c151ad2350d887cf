"""Request and consumer lifetime with an injected clock: the engine's idle requests (freed exactly
as explicit frees would free them), the reaper's pass, and TakeEvents consumer expiry; the limit
settings (validation, sources, flags)."""

from __future__ import annotations

import asyncio
import re

import pytest
from click.testing import CliRunner

from kvservice.cli import main
from kvservice.core.engine import KVCacheEngine
from kvservice.core.errors import CapacityExceededError, InvalidArgumentError
from kvservice.server.app import ServerConfig, load_config
from kvservice.server.event_log import EventLog, EventLogConfig
from kvservice.server.reaper import RequestReaper
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice_client.hashing import BlockHasher, block_hash_to_int
from tests.unit.core_helpers import free_ids, make_manager


class FakeClock:
    """Seconds that move only when a test sets them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hashes(tokens) -> list[int]:
    return [block_hash_to_int(h) for h in BlockHasher(4).hash_prompt(list(tokens))]


def engine_with_requests() -> tuple[KVCacheEngine, FakeClock]:
    """10 usable blocks of 4 tokens. Last calls, least recent first: C (waiting) at t=2, A (running,
    blocks 1, 2, 6; 6 partial) at t=3 (a decode step), B (running, blocks 3-5; 5 partial) at t=4 (an
    allocation answered allocated=False counts; a call that raised does not)."""
    clock = FakeClock()
    engine = KVCacheEngine(make_manager(11, max_model_len=64), clock=clock)
    engine.get_computed_blocks("A", range(1, 9))
    assert engine.allocate_slots("A", 8).allocated
    clock.now = 1.0
    engine.get_computed_blocks("B", range(20, 31))
    assert engine.allocate_slots("B", 11).allocated
    clock.now = 2.0
    engine.get_computed_blocks("C", range(40, 44))
    clock.now = 3.0
    assert engine.allocate_slots("A", 1, new_token_ids=[9]).allocated
    with pytest.raises(InvalidArgumentError):
        engine.allocate_slots("B", 0)
    clock.now = 4.0
    assert engine.allocate_slots("B", 4, new_token_ids=[31], num_lookahead_tokens=64).allocated is False
    engine.take_events()
    return engine, clock


def test_idle_requests_are_freed_as_explicit_frees_would_free_them():
    reaped, clock = engine_with_requests()
    twin, _ = engine_with_requests()
    assert {r: reaped.manager.get_block_ids(r) for r in reaped.requests} == {
        "A": ([1, 2, 6],),
        "B": ([3, 4, 5],),
        "C": ([],),
    }
    assert free_ids(reaped.manager) == [7, 8, 9, 10]

    clock.now = 4.9
    assert reaped.idle_request_ids(3.0) == [] and reaped.next_idle_deadline(3.0) == 5.0
    clock.now = 6.5  # C idle 4.5 s, A 3.5 s, B 2.5 s
    assert reaped.idle_request_ids(3.0) == ["C", "A"]
    assert reaped.free_idle_requests(3.0) == ["C", "A"]
    assert [twin.free("C"), twin.free("A")] == [0, 3]
    assert free_ids(reaped.manager) == free_ids(twin.manager) == [6, 7, 8, 9, 10, 2, 1]
    assert reaped.take_events() == twin.take_events() == []
    assert (reaped.requests.keys(), reaped.running) == (twin.requests.keys(), twin.running) == ({"B"}, {"B"})
    assert reaped.get_usage() == twin.get_usage()
    assert reaped.next_idle_deadline(3.0) == 7.0 and reaped.free_idle_requests(3.0) == []
    clock.now = 7.0
    assert reaped.free_idle_requests(3.0) == ["B"]
    twin.free("B")
    assert free_ids(reaped.manager) == free_ids(twin.manager) == [5, 6, 7, 8, 9, 10, 2, 1, 4, 3]
    assert reaped.next_idle_deadline(3.0) is None and reaped.free_idle_requests(3.0) == []

    # What the frees left behind is evicted in the same order on both engines.
    for engine in (reaped, twin):
        engine.get_computed_blocks("D", range(100, 140))
        assert engine.allocate_slots("D", 40).allocated
        engine.check_invariants()
    a, b = hashes(range(1, 9)), hashes(range(20, 28))
    events = reaped.take_events()
    assert events == twin.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[0] == BlockRemoved([a[1], a[0], b[1], b[0]], "GPU", group_idx=0, kv_cache_spec_kind="full_attention")
    assert reaped.manager.get_block_ids("D") == twin.manager.get_block_ids("D") == ([5, 6, 7, 8, 9, 10, 2, 1, 4, 3],)


def test_a_freed_request_is_forgotten_and_a_new_one_starts_fresh():
    engine, clock = engine_with_requests()
    engine.free("A")
    clock.now = 100.0
    engine.get_computed_blocks("A", range(1, 9))  # registered again at t=100
    assert engine.idle_request_ids(3.0) == ["C", "B"]
    assert engine.free_idle_requests(3.0) == ["C", "B"]
    assert engine.requests.keys() == {"A"} and engine.next_idle_deadline(3.0) == 103.0


async def test_the_reaper_pass_publishes_one_batch_and_wakes_waiters():
    engine, clock = engine_with_requests()
    published: list[list] = []
    reaper = RequestReaper(engine, lambda: published.append(engine.take_events()), 3.0)
    waiter = asyncio.ensure_future(reaper.wait_reaped(3))
    clock.now = 6.5
    assert reaper.reap() == ["C", "A"]
    await asyncio.sleep(0)  # let the waiter see the first pass: it needs 3 and waits again
    assert not waiter.done() and reaper.num_reaped_requests == 2
    clock.now = 7.0
    assert reaper.reap() == ["B"]
    await asyncio.wait_for(waiter, 5.0)
    assert reaper.reap() == []
    assert published == [[], []]  # one publish per pass that freed something; frees store nothing
    assert (reaper.num_reaped_requests, list(reaper.reaped_request_ids)) == (3, ["C", "A", "B"])
    assert engine.requests == {} and engine.get_usage().num_free_blocks == 10


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_the_reaper_refuses_a_bad_timeout(bad):
    engine, _ = engine_with_requests()
    with pytest.raises(ValueError, match="request_idle_timeout_s must be a finite number > 0 seconds"):
        RequestReaper(engine, lambda: None, bad)


def take(log: EventLog, consumer: str, **kwargs) -> tuple[list[int], int]:
    options = {"max_batches": 0, "start_seq": 0, "epoch": "", **kwargs}
    entries, next_seq = log.take(consumer, **options)
    return [e.seq for e in entries], next_seq


def test_consumers_expire_after_their_idle_timeout():
    clock = FakeClock()
    log = EventLog(
        1, ["full_attention"], [None], EventLogConfig(max_consumers=2, consumer_idle_timeout_s=10.0), clock=clock
    )
    assert take(log, "a") == ([], 1) and take(log, "b") == ([], 1)
    log.append([AllBlocksCleared()])
    log.append([AllBlocksCleared()])
    clock.now = 5.0
    assert take(log, "a") == ([1, 2], 3)
    clock.now = 9.9
    with pytest.raises(CapacityExceededError, match="max_consumers: 2 consumers exist already"):
        take(log, "c")
    assert log.consumer_cursor("b") == 1
    clock.now = 10.0  # b has not taken for 10 s: dropped, its slot is free
    assert log.consumer_cursor("b") is None
    assert take(log, "c") == ([], 3)
    log.append([AllBlocksCleared()])
    with pytest.raises(CapacityExceededError, match="max_consumers: 2"):  # a (t=5) and c (t=10) hold both
        take(log, "b")
    clock.now = 15.0  # a expires; b starts like a new consumer, at the live head
    assert take(log, "b") == ([], 4)
    assert log.consumer_cursor("a") is None and log._consumers == {"c": 3, "b": 4}
    assert take(log, "c") == ([3], 4)
    # A take refreshes the time; a restore (answer lost) of a new consumer forgets it entirely.
    clock.now = 24.9
    assert take(log, "b") == ([], 4)
    clock.now = 25.0
    assert take(log, "d", start_seq=1) == ([1, 2, 3], 4)  # c (t=15) expired: d gets its slot
    assert log._consumers == {"b": 4, "d": 4}
    log.restore_consumer("d", None, 4)
    assert log._consumers == {"b": 4}
    clock.now = 34.8  # expiry is lazy: nothing changes until a take or a cursor lookup
    assert log._consumers == {"b": 4}
    assert log.consumer_cursor("b") == 4
    clock.now = 35.0
    assert log.consumer_cursor("b") is None and log._consumers == {}


def test_consumer_idle_timeout_must_be_positive():
    with pytest.raises(ValueError, match="consumer_idle_timeout_s must be > 0 seconds; got 0"):
        EventLogConfig(consumer_idle_timeout_s=0)
    with pytest.raises(ValueError, match="max_streams must be >= 1; got 0"):
        EventLogConfig(max_streams=0)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"max_step_tokens": 0}, "max_step_tokens must be >= 1; got 0"),
        ({"max_streams": 0}, "max_streams must be >= 1; got 0"),
        ({"request_idle_timeout_s": -1.0}, "request_idle_timeout_s must be a finite number >= 0 seconds (0: off)"),
        ({"request_idle_timeout_s": float("inf")}, "request_idle_timeout_s must be a finite number >= 0 seconds"),
        ({"consumer_idle_timeout_s": -1.0}, "consumer_idle_timeout_s must be > 0 seconds; got -1.0"),
    ],
)
def test_bad_limit_settings_are_named(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig(**setting)


def test_limit_settings_come_from_flags_env_and_files(tmp_path):
    path = tmp_path / "kvservice.toml"
    path.write_text("max_streams = 8\nconsumer_idle_timeout_s = 60\n")
    env = {"KVSERVICE_REQUEST_IDLE_TIMEOUT_S": "30", "KVSERVICE_MAX_STEP_TOKENS": "4096"}
    config = load_config(path, env, max_streams=16)
    assert (
        config.events.max_streams,
        config.events.consumer_idle_timeout_s,
        config.limits.request_idle_timeout_s,
        config.limits.max_step_tokens,
    ) == (16, 60.0, 30.0, 4096)
    assert (
        ServerConfig().limits.request_idle_timeout_s,
        ServerConfig().events.consumer_idle_timeout_s,
        ServerConfig().events.max_streams,
        ServerConfig().limits.max_step_tokens,
    ) == (600.0, 3600.0, 1024, 1 << 18)  # the requests of a scheduler that stopped are freed by default
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for flag in (
        "--request-idle-timeout-s",
        "--consumer-idle-timeout-s",
        "--max-streams",
        "--max-step-tokens",
        "--max-num-requests",
        "--max-step-ops",
        "--max-consumers",
        "--max-message-bytes",
    ):
        assert flag in help_text, flag


def test_each_admission_gets_the_next_allocation_id_and_keeps_it_while_running():
    """Request.allocation_id: 0 until admitted; the next id at each admission (a request id freed
    and registered again is a new admission); unchanged by its later allocations; a refused
    admission issues none."""
    engine = KVCacheEngine(make_manager(8))
    engine.get_computed_blocks("A", range(1, 9))
    assert engine.requests["A"].allocation_id == 0
    assert engine.allocate_slots("A", 8).allocated
    engine.get_computed_blocks("B", range(20, 24))
    assert engine.allocate_slots("B", 4).allocated
    assert (engine.requests["A"].allocation_id, engine.requests["B"].allocation_id) == (1, 2)
    assert engine.allocate_slots("A", 1, new_token_ids=[9]).allocated  # a decode: the same admission
    assert engine.requests["A"].allocation_id == 1
    engine.get_computed_blocks("C", range(100, 128))  # 7 blocks: more than are free
    assert not engine.allocate_slots("C", 28).allocated
    assert engine.requests["C"].allocation_id == 0
    engine.free("A")
    engine.get_computed_blocks("A", range(1, 9))
    assert engine.allocate_slots("A", 8).allocated
    assert engine.requests["A"].allocation_id == 3
