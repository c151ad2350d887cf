"""The snapshot module alone: a compact mirror, cuts in parts that yield, shared and bounded cuts."""

from __future__ import annotations

import asyncio
import gc
import sys
from array import array

import pytest

from kvservice.server.event_log import EventLog
from kvservice.server.snapshot import (
    YIELD_EVERY_TOKENS,
    ByteBudget,
    CachedSetMirror,
    SnapshotSource,
    snapshot_events,
)
from kvservice.server.snapshot.mirror import PARENT, TOKEN_IDS
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored


def stored(hashes: list[int], parent: int | None, first_token: int, block_size: int = 4) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(first_token, first_token + block_size * len(hashes))),
        block_size=block_size,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


def test_the_mirror_keeps_each_block_s_own_tokens_not_the_announcing_event():
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    event = stored([11, 12, 13], None, 1000)
    mirror.apply(1, [event])
    mirror.apply(2, [BlockRemoved(block_hashes=[12, 13], medium="CPU", group_idx=0)])
    (block,) = mirror.view().values()
    assert block[TOKEN_IDS] == array("q", [1000, 1001, 1002, 1003]).tobytes()
    assert block[PARENT] is None and mirror.num_tokens_per_group == [4] and mirror.seq == 2
    gc.collect()
    assert not gc.is_tracked(block)  # a million cached blocks cost a GC pause nothing
    refs_before = sys.getrefcount(event.token_ids)
    del event  # nothing in the mirror refers to the event or its token list
    assert refs_before == 2  # the local name and getrefcount's argument
    assert snapshot_events(mirror) == [
        AllBlocksCleared(),
        BlockStored(
            block_hashes=[11],
            parent_block_hash=None,
            token_ids=[1000, 1001, 1002, 1003],
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=[11],
            parent_block_hash=None,
            token_ids=[1000, 1001, 1002, 1003],
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            reused=True,
        ),
    ]


def log_with_source(**kwargs) -> tuple[EventLog, SnapshotSource]:
    log = EventLog(1, ["full_attention"], [None])
    return log, SnapshotSource.attach(log, **kwargs)


async def test_a_cut_is_produced_in_parts_that_yield_to_the_loop():
    log, source = log_with_source(part_tokens=4 * 256)
    num_chains = 2000
    log.append([stored([10 * c, 10 * c + 1], None, 8 * c) for c in range(num_chains)])  # 16,000 tokens
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    snap = await source.get()
    await snap.wait_done()
    done = True
    await task
    num_tokens = 2 * 8 * num_chains  # both halves
    assert snap.num_tokens == num_tokens and snap.seq == 1
    # A yield at every part boundary (parts of 1,024 tokens) and every YIELD_EVERY_TOKENS.
    assert len(snap.parts) >= num_tokens // 1024
    assert ticks >= len(snap.parts) - 1 >= num_tokens // YIELD_EVERY_TOKENS


async def test_callers_share_a_cut_and_the_bound_makes_later_ones_join_the_one_in_production():
    log, source = log_with_source(part_tokens=64, max_concurrent_cuts=1)
    log.append([stored([c], None, 4 * c) for c in range(500)])
    first = await source.get()
    assert await source.get() is first and source.num_cuts == 1  # same head: shared
    log.append([stored([9999], None, 0)])  # head 2; the cut at 1 is still in production
    assert not first.done
    assert await source.get() is first and source.num_cuts == 1  # at the bound: join it
    await first.wait_done()
    second = await source.get()
    assert second is not first and second.seq == 2 and source.num_cuts == 2
    await second.wait_done()
    assert await source.get() is second  # done, same head: still shared
    log.append([AllBlocksCleared()])
    assert source.min_bytes(None) == 0
    assert (await source.get()).seq == 3 and source.num_cuts == 3


async def test_min_bytes_is_a_lower_bound_known_before_the_cut():
    log, source = log_with_source()
    log.append([stored([1, 2, 3], None, 100)])
    assert source.min_bytes(None) == 2 * 12 and source.min_bytes((0,)) == 24 and source.num_cuts == 0


async def test_batches_appended_while_a_cut_is_produced_are_held_back_then_applied_in_order():
    log, source = log_with_source(part_tokens=64)
    log.append([stored([c], None, 4 * c) for c in range(400)])  # 1,600 tokens
    log.settle()  # on a running loop the batch reaches the mirror after this callback, or now
    expected = snapshot_events(source.mirror)
    snap = await source.get()
    assert not snap.done
    log.append([BlockRemoved(block_hashes=list(range(200)), medium="CPU", group_idx=0)])  # seq 2
    log.append([stored([5000, 5001], None, 7)])  # seq 3
    assert source.head_seq == 3  # settles the log: the newest batch reaches the source
    assert source.mirror.seq == 1 and [e.seq for e in source.pending] == [2, 3]
    assert source.cached_hashes() == [set(range(200, 400)) | {5000, 5001}]  # the held batches on top
    assert await source.get() is snap  # joins the cut in production, at the mirror's seq
    await snap.wait_done()
    assert [e for i in range(len(snap.parts)) for e in snap.part_events(i)] == expected  # exact at seq 1
    after = await source.get()  # waits for the mirror to catch up, then cuts at the head
    assert after.seq == 3 and not source.pending and source.num_cuts == 2
    assert source.mirror.cached_hashes() == [set(range(200, 400)) | {5000, 5001}]
    # The first cut's parts still read as at seq 1, though the mirror moved on.
    assert [e for i in range(len(snap.parts)) for e in snap.part_events(i)] == expected


async def test_the_byte_budget_lets_one_writer_in_per_loop_turn_within_its_bytes():
    budget = ByteBudget(100)
    held: list[int] = []

    async def writer(n: int) -> None:
        for _ in range(5):
            await budget.acquire(n)
            held.append(budget.in_flight)
            await asyncio.sleep(0)  # the write
            budget.release(n)

    await asyncio.gather(writer(40), writer(40), writer(40), writer(150))
    assert budget.in_flight == 0 and budget.num_waits > 0
    assert max(held) == 150 and budget.peak == 150  # the 150-byte part went alone
    assert all(h <= 100 for h in held if h != 150) and 80 in held  # two 40-byte parts at once


async def test_the_byte_budget_s_rate_makes_a_writer_wait_while_its_bucket_is_in_debt():
    budget = ByteBudget(100, bytes_per_s=1)  # a 100-byte bucket, refilled at 1 byte a second
    await budget.acquire(100)  # the full bucket, down to 0
    budget.release(100)
    await asyncio.sleep(0)  # the next turn
    await budget.acquire(1000)  # a bucket at 0 lets one more in, into debt (1,000 s of refill)
    budget.release(1000)
    waiting = asyncio.ensure_future(budget.acquire(1))  # in debt: waits for the refill
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done() and budget.num_waits == 1 and budget.in_flight == 0
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not budget._waiters and budget.num_bytes == 1100


async def test_a_write_above_the_budget_is_charged_for_its_one_long_hold():
    """A write of 3x ``max_bytes`` (one write start: a whole TakeEvents answer) costs the rate 3x its
    size; writes within the budget cost their size."""
    budget = ByteBudget(100, bytes_per_s=1)  # 1 byte a second: a refill of a few bytes at most meanwhile
    await budget.acquire(60)
    budget.release(60)
    assert budget._credit == pytest.approx(40, abs=5)
    await asyncio.sleep(0)  # the next turn
    await budget.acquire(300)  # goes alone (nothing in flight), into debt by 3 x 300
    budget.release(300)
    assert budget._credit == pytest.approx(40 - 900, abs=10) and budget.num_bytes == 360  # not 40 - 300


async def test_a_write_that_does_not_complete_stops_holding_the_budget_after_hold_s():
    # A client that stops reading mid-snapshot: its write never completes. Its bytes count for
    # hold_s, then the next stream's part gets in; the stalled write still ends in its own time.
    budget = ByteBudget(100, hold_s=0.05)
    stalled_write = asyncio.get_running_loop().create_future()  # never set by a reader
    entered = asyncio.Event()

    async def stalled() -> None:
        async with budget.held(80):
            entered.set()
            await stalled_write

    stalled_task = asyncio.ensure_future(stalled())
    await entered.wait()
    assert budget.in_flight == 80 and budget.num_let_go == 0
    async with budget.held(80):  # waits for the stalled write's hold_s, not for the write
        assert budget.in_flight == 80 and budget.num_let_go == 1 and budget.num_waits == 1
    assert budget.in_flight == 0
    stalled_write.set_result(None)  # the slow client reads at last: nothing is released twice
    await stalled_task
    assert budget.in_flight == 0 and budget.num_bytes == 160 and budget.num_let_go == 1


async def test_a_write_that_completes_within_hold_s_is_released_once_when_it_completes():
    budget = ByteBudget(100, hold_s=3600)
    async with budget.held(60):
        assert budget.in_flight == 60
    assert budget.in_flight == 0 and budget.num_let_go == 0
    with pytest.raises(RuntimeError):  # a failed write releases its bytes too
        async with budget.held(70):
            raise RuntimeError("stream ended")
    assert budget.in_flight == 0 and budget.num_bytes == 130


def test_the_byte_budget_names_a_bad_hold_s():
    with pytest.raises(ValueError, match="hold_s must be > 0; got 0"):
        ByteBudget(100, hold_s=0)


async def test_writes_let_go_stay_within_max_let_go_bytes_then_the_next_keeps_counting():
    # Parts held in gRPC for clients that stopped reading are bounded: the second stalled write
    # does not fit beside the first one let go, so it keeps counting (and holds the budget) until
    # the first completes and frees room; then it is let go at its next hold_s.
    budget = ByteBudget(100, hold_s=0.02, max_let_go_bytes=100)
    writes = [asyncio.get_running_loop().create_future() for _ in range(2)]
    let_in = [asyncio.Event(), asyncio.Event()]

    async def stalled(i: int) -> None:
        async with budget.held(80):
            let_in[i].set()
            await writes[i]

    first = asyncio.ensure_future(stalled(0))
    await let_in[0].wait()
    second = asyncio.ensure_future(stalled(1))
    await let_in[1].wait()  # the first was let go at hold_s: the second got in
    assert (budget.num_let_go, budget.let_go_bytes, budget.in_flight) == (1, 80, 80)
    third = asyncio.ensure_future(budget.acquire(30))  # the second keeps counting: 30 do not fit beside it
    writes[0].set_result(None)  # the first client reads at last
    await first
    assert budget.let_go_bytes == 0
    await third  # the second was let go at its next hold_s, which let the third in
    assert (budget.num_let_go, budget.let_go_bytes, budget.in_flight, budget.num_waits) == (2, 80, 30, 2)
    writes[1].set_result(None)
    await second
    budget.release(30)
    assert (budget.let_go_bytes, budget.in_flight, budget.num_bytes) == (0, 0, 190)


def test_the_byte_budget_names_a_bad_max_let_go_bytes():
    with pytest.raises(ValueError, match="max_let_go_bytes must be >= 0; got -1"):
        ByteBudget(100, max_let_go_bytes=-1)
