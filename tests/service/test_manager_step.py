"""ManagerStep on a real server (port 0, the generated client): vLLM's manager calls for
scheduler-owned requests in one round trip (docs/ARCHITECTURE.md §9).

The calls run in order and the first that fails ends the step: the calls after it do not run and
nothing of the failed one changes (the whole engine state compared). One scheduler owns the pool:
another owner's ManagerStep and the legacy mutating RPCs are FAILED_PRECONDITION naming the owner
while its claim is live. ``return_events`` answers the step's batch as vLLM's msgpack. Generated
ManagerCalls (valid and wild fields) are never INTERNAL, and each failed one changes nothing. A
watcher's ManagerStep is PERMISSION_DENIED. ``written_blocks`` are marked before the calls, once
each and only for the allocation that computes them (the rest skipped and counted); a bad one
refuses the whole step, naming the field and its bound, with nothing marked.

The server is the service tests' small one: block size 4, 16 blocks (15 usable), max_model_len 64,
the default hash rule (sha256_cbor, 32-byte digests).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice.server.app import RunningServer, start_server
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.client import AsyncKVCacheClient, KVServiceError, StatusCode, StepBuilder
from kvservice_client.data import aread_blocks, awrite_blocks
from kvservice_client.events import KVEventBatch
from kvservice_client.hashing import BlockHasher
from tests.service.conftest import SMALL_SERVER
from tests.service.helpers import H, events_of, hashes, stored
from tests.unit.core_helpers import engine_state, free_ids

pytestmark = pytest.mark.timeout(120)

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
FIELD_FIRST = re.compile(r"^[a-z_][a-z_0-9]*(\[\d+\])?(\.[a-z_][a-z_0-9]*(\[\d+\])?)*: ")
"""An INVALID_ARGUMENT message starts with the field it names."""

SCHEDULER_TOKEN = "sched-token-0123456789abcdef"
WATCHER_TOKEN = "watch-token-0123456789abcdef"


# -- calls ----------------------------------------------------------------------------------------


def digests(tokens: Sequence[int]) -> list[bytes]:
    return BlockHasher(4).hash_prompt(list(tokens))


def update(
    request_id: str,
    tokens: Sequence[int],
    *,
    kept: int = 0,
    hashes_kept: int = 0,
    block_hashes: Sequence[bytes] | None = None,
    num_prompt_tokens: int | None = None,
    **fields: Any,
) -> pb.ManagerCall:
    """UpdateRequest: registration by default (every token, their hashes, the prompt their count)."""
    if block_hashes is None:
        block_hashes = digests(tokens)[hashes_kept:] if not kept else []
    call = pb.ManagerCall.UpdateRequest(
        request_id=request_id,
        num_tokens_kept=kept,
        packed_token_ids=np.asarray(list(tokens), dtype="<i4").tobytes(),
        num_block_hashes_kept=hashes_kept,
        block_hashes=b"".join(block_hashes),
        num_prompt_tokens=len(tokens) if num_prompt_tokens is None and not kept else (num_prompt_tokens or 0),
        **fields,
    )
    return pb.ManagerCall(update_request=call)


def lookup(request_id: str, **fields: Any) -> pb.ManagerCall:
    return pb.ManagerCall(get_computed_blocks=pb.ManagerCall.GetComputedBlocks(request_id=request_id, **fields))


def allocate(request_id: str, hit: Sequence[Sequence[int]] = (), **fields: Any) -> pb.ManagerCall:
    call = pb.ManagerCall.AllocateSlots(request_id=request_id, **fields)
    for ids in hit:
        call.computed_block_ids.add(block_ids=ids)
    return pb.ManagerCall(allocate_slots=call)


def free(request_id: str, forget: bool = True) -> pb.ManagerCall:
    return pb.ManagerCall(free=pb.ManagerCall.Free(request_id=request_id, forget=forget))


def pop(request_id: str, forget: bool = True) -> pb.ManagerCall:
    return pb.ManagerCall(pop_blocks_for_free=pb.ManagerCall.PopBlocksForFree(request_id=request_id, forget=forget))


def free_blocks(block_ids: Sequence[int]) -> pb.ManagerCall:
    return pb.ManagerCall(free_blocks=pb.ManagerCall.FreeBlocks(block_ids=block_ids))


def cache(request_id: str, num_tokens: int) -> pb.ManagerCall:
    return pb.ManagerCall(cache_blocks=pb.ManagerCall.CacheBlocks(request_id=request_id, num_tokens=num_tokens))


def estimate(request_id: str) -> pb.ManagerCall:
    return pb.ManagerCall(estimate_cached_tokens=pb.ManagerCall.EstimateCachedTokens(request_id=request_id))


def ids(groups: Any) -> list[list[int]]:
    return [list(g.block_ids) for g in groups]


async def manager_step(
    client: AsyncKVCacheClient, calls: Sequence[pb.ManagerCall], *, owner: str = "sched-1", **fields: Any
) -> pb.ManagerStepResponse:
    return await client.manager_step(pb.ManagerStepRequest(owner=owner, calls=calls, **fields))


def state(running: RunningServer) -> dict[str, Any]:
    """The engine's whole state (engine_state) less the claim's expiry (each step renews it), and
    the event log's head."""
    snapshot = engine_state(running.engine)
    claim = snapshot.pop("claim")
    snapshot["owner"] = claim.owner if claim is not None else None
    snapshot["head_seq"] = running.event_log.head_seq
    return snapshot


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- order, answers, events -------------------------------------------------------------------------


async def test_calls_run_in_order_and_answer_each(kv_server, client):
    b_tokens = [*range(1, 9), 20, 21, 22]
    response = await manager_step(
        client,
        [
            update("A", range(1, 11)),
            allocate("A", num_new_tokens=10),
            update("B", b_tokens),
            lookup("B", free_queue_horizon=16),
            allocate("B", [[1, 2]], num_new_computed_tokens=8, num_new_tokens=3),
            estimate("A"),
            pb.ManagerCall(
                get_num_blocks_to_allocate=pb.ManagerCall.GetNumBlocksToAllocate(
                    request_id="B", num_tokens=17, num_computed_tokens=11
                )
            ),
        ],
        return_events=True,
    )
    results = response.results
    assert [r.WhichOneof("result") for r in results] == [
        "done",
        "allocated",
        "done",
        "computed_blocks",
        "allocated",
        "cached_tokens",
        "num_blocks",
    ]
    a = results[1].allocated
    assert (a.allocated, ids(a.new_block_ids), ids(a.block_ids), list(a.num_null_blocks), a.num_cached_tokens) == (
        True,
        [[1, 2, 3]],
        [[1, 2, 3]],
        [0],
        8,
    )
    # The lookup ran after A cached its blocks: a hit of 8 tokens, its blocks held (none free).
    hit = results[3].computed_blocks
    assert (hit.num_computed_tokens, ids(hit.block_ids), list(hit.num_free_hit_blocks), hit.num_free_blocks_ahead) == (
        8,
        [[1, 2]],
        [0],
        16,
    )
    b = results[4].allocated
    assert (ids(b.new_block_ids), ids(b.block_ids), b.num_cached_tokens) == ([[4]], [[1, 2, 4]], 8)
    assert results[5].cached_tokens.num_cached_tokens == 8
    assert results[6].num_blocks.num_blocks == 2  # 5 blocks for 17 tokens, 3 held
    assert response.num_free_blocks == 11
    assert (response.head_seq, response.epoch) == (1, kv_server.event_log.epoch)
    # The step's events are one batch, answered as vLLM's msgpack.
    batch = msgspec.msgpack.decode(response.events_msgpack, type=KVEventBatch)
    assert batch.events == [stored(H[:2], None, range(1, 9))]
    assert [e.block_hashes for e in batch.events] == [hashes(range(1, 9))]
    assert (await client.get_usage()).num_running_requests == 2
    kv_server.engine.check_invariants()


async def test_the_order_of_the_calls_is_the_order_they_run(client):
    """The same calls with the lookup before the allocation that caches A's blocks: no hit."""
    response = await manager_step(
        client,
        [update("A", range(1, 11)), update("B", [*range(1, 9), 20]), lookup("B"), allocate("A", num_new_tokens=10)],
    )
    assert response.results[2].computed_blocks.num_computed_tokens == 0
    assert response.results[3].allocated.allocated


async def test_without_return_events_the_answer_carries_none(kv_server, client):
    response = await manager_step(client, [update("A", range(1, 9)), allocate("A", num_new_tokens=8)])
    assert (response.events_msgpack, response.head_seq) == (b"", 1)
    taken = await client.take_events("c", start_seq=1)
    assert [(b.seq, events_of(b)) for b in taken.batches] == [(1, [stored(H[:2], None, range(1, 9))])]
    # A step that makes no events appends no batch.
    response = await manager_step(client, [estimate("A")], return_events=True)
    assert (response.events_msgpack, response.head_seq) == (b"", 1)


async def test_a_refused_allocation_is_an_answer_not_an_error(kv_server, client):
    response = await manager_step(
        client,
        [
            update("hog", range(100, 160)),
            allocate("hog", num_new_tokens=60),  # 15 blocks: the pool
            update("C", range(1, 9)),
            allocate("C", num_new_tokens=8, full_sequence_must_fit=True),
            allocate("C", num_new_tokens=8),
            estimate("C"),
        ],
    )
    results = response.results
    assert [r.WhichOneof("result") for r in results] == [
        "done",
        "allocated",
        "done",
        "allocated",
        "allocated",
        "cached_tokens",
    ]
    assert (results[3].allocated.allocated, results[3].allocated.refused_full_sequence) == (False, True)
    assert (results[4].allocated.allocated, results[4].allocated.refused_full_sequence) == (False, False)
    assert (ids(results[4].allocated.new_block_ids), ids(results[4].allocated.block_ids)) == ([], [])
    assert response.num_free_blocks == 0


# -- the first failing call ends the step ------------------------------------------------------------


async def _prepared(client: AsyncKVCacheClient) -> None:
    """A runs (1..10: blocks 1, 2 cached, 3), P's blocks (20..27: 4, 5) were popped, B waits (1..8, 20)."""
    response = await manager_step(
        client,
        [
            update("A", range(1, 11)),
            allocate("A", num_new_tokens=10),
            update("P", range(20, 28)),
            allocate("P", num_new_tokens=8),
            pop("P"),
            update("B", [*range(1, 9), 20]),
        ],
    )
    assert not any(r.WhichOneof("result") == "error" for r in response.results)
    assert list(response.results[4].popped_blocks.block_ids) == [4, 5]


FAILING_CALLS = {
    "a block not popped among popped ones": (free_blocks([5, 3, 4]), INVALID_ARGUMENT, "block_ids: block 3 was not"),
    "an unknown request": (allocate("N", num_new_tokens=1), NOT_FOUND, "request_id 'N' is not registered"),
    "a stale hit": (
        allocate("B", [[2, 1]], num_new_computed_tokens=8, num_new_tokens=1),
        FAILED_PRECONDITION,
        "computed_block_ids: group 0, block 2 at position 0 no longer holds",
    ),
    "a cached block's hash replaced": (
        update("A", [], kept=10, hashes_kept=1),
        INVALID_ARGUMENT,
        "num_block_hashes_kept: keeps 1 hashes",
    ),
    "cache_blocks of a waiting request": (cache("B", 8), INVALID_ARGUMENT, "request_id: request 'B' holds no blocks"),
    "a call not set": (pb.ManagerCall(), INVALID_ARGUMENT, "call: not set"),
    "packed tokens not int32": (
        pb.ManagerCall(update_request=pb.ManagerCall.UpdateRequest(request_id="N", packed_token_ids=b"abc")),
        INVALID_ARGUMENT,
        "packed_token_ids: 3 bytes, not a multiple of 4",
    ),
    "digests cut short": (
        pb.ManagerCall(update_request=pb.ManagerCall.UpdateRequest(request_id="N", block_hashes=b"x" * 33)),
        INVALID_ARGUMENT,
        "block_hashes: 33 bytes, not a multiple of the 32-byte digests",
    ),
    "evict a block outside the pool": (
        pb.ManagerCall(evict_blocks=pb.ManagerCall.EvictBlocks(block_ids=[1, 16])),
        INVALID_ARGUMENT,
        "block_ids: block id 16 outside 1..15",
    ),
}


@pytest.mark.parametrize("case", list(FAILING_CALLS))
async def test_the_first_failing_call_ends_the_step_and_changes_nothing(kv_server, client, case):
    await _prepared(client)
    call, code, message = FAILING_CALLS[case]
    before = state(kv_server)
    later = [free("A"), free_blocks([4, 5]), update("Z", range(1, 5))]
    response = await manager_step(client, [call, *later], return_events=True)
    assert len(response.results) == 1
    error = response.results[0].error
    assert (error.code, error.message[: len(message)]) == (code, message), error.message
    if code == INVALID_ARGUMENT:
        assert FIELD_FIRST.match(error.message)
    assert state(kv_server) == before  # the later calls did not run either
    assert (response.events_msgpack, response.num_free_blocks) == (b"", 10)
    kv_server.engine.check_invariants()


async def test_calls_before_the_failure_stay_done_and_their_events_go_out(kv_server, client):
    await _prepared(client)
    response = await manager_step(
        client,
        [update("C", range(40, 48)), allocate("C", num_new_tokens=8), free_blocks([4, 4]), free("C")],
        return_events=True,
    )
    assert [r.WhichOneof("result") for r in response.results] == ["done", "allocated", "error"]
    assert ids(response.results[1].allocated.new_block_ids) == [[6, 7]]
    assert "C" in kv_server.engine.running  # free("C") did not run
    batch = msgspec.msgpack.decode(response.events_msgpack, type=KVEventBatch)
    assert batch.events == [stored(hashes(range(40, 48)), None, range(40, 48))]
    assert response.head_seq == 2


async def test_a_server_checking_its_invariants_passes_a_step_of_every_call(start_kv_server, connect):
    running = await start_kv_server(check_invariants=True)
    client = await connect(running)
    await _prepared(client)  # pop_blocks_for_free among them: popped blocks count as held
    await manager_step(client, [free_blocks([5, 4]), cache("A", 10), estimate("A"), free("A", forget=False)])
    assert (running.servicer.num_invariant_checks, running.servicer.num_invariant_failures) == (2, 0)


async def test_evicting_a_shared_block_is_not_an_invariant_failure(start_kv_server, connect):
    running = await start_kv_server(check_invariants=True)
    client = await connect(running)
    response = await manager_step(
        client,
        [
            update("A", range(1, 11)),
            allocate("A", num_new_tokens=10),
            update("B", [*range(1, 9), 20]),
            allocate("B", [[1, 2]], num_new_computed_tokens=8, num_new_tokens=1),
            pb.ManagerCall(evict_blocks=pb.ManagerCall.EvictBlocks(block_ids=[1])),
        ],
    )
    assert response.results[4].done.num_blocks == 1
    assert running.servicer.invariant_failures == []


# -- who may write the blocks (docs/ARCHITECTURE.md §5.3) ---------------------------------------------


async def test_an_admitted_request_writes_its_new_and_external_blocks_never_its_hit(start_kv_server, connect):
    running = await start_kv_server(device="cpu")  # memory: the data plane answers
    client = await connect(running)
    block = bytes(running.engine.manager.metadata.groups[0].block_bytes)
    response = await manager_step(
        client,
        [
            update("A", range(1, 11)),
            allocate("A", num_new_tokens=10),
            free("A"),  # 1, 2 cached and free; 3 free
            update("B", range(1, 21)),
            allocate("B", [[1, 2]], num_new_computed_tokens=8, num_external_computed_tokens=8, num_new_tokens=4),
        ],
    )
    answer = response.results[4].allocated
    assert (ids(answer.block_ids), ids(answer.new_block_ids)) == ([[1, 2, 3, 4, 5]], [[5]])
    # A's admission was allocation 1, B's is 2 (its writes name it, with the step's epoch).
    assert (response.results[1].allocated.allocation_id, answer.allocation_id) == (1, 2)
    allocation = (answer.allocation_id, response.epoch)
    # The connector's blocks (3, 4) and the new one (5) are B's to write.
    written = await awrite_blocks(client, "B", [(0, 3, block), (0, 4, block), (0, 5, block)], allocation=allocation)
    assert written.num_blocks_written == 3
    # The hit's blocks hold what their hashes name: B alone holds them, but may not write them.
    for hit_block in (1, 2):
        with pytest.raises(KVServiceError) as err:
            await awrite_blocks(client, "B", [(0, hit_block, block)], allocation=allocation)
        assert err.value.code is StatusCode.FAILED_PRECONDITION
        assert err.value.message.startswith(f"block {hit_block} (group 0): it was not allocated to request 'B'")
    # A (freed) computed 1 and 2 but never wrote them: by hash and by id they are not readable.
    with pytest.raises(KVServiceError) as err:
        await aread_blocks(client, [(0, 1)])
    assert (err.value.code, err.value.message) == (
        StatusCode.FAILED_PRECONDITION,
        "blocks[0].block_id: block 1 is not written yet (nobody wrote it since it was allocated): its memory holds no "
        "bytes of its own",
    )
    # B written: 3 and 4 read back; the allocation of a stale admission of B is refused.
    assert [b.data == block for b in await aread_blocks(client, [(0, 3), (0, 4)])] == [True, True]
    with pytest.raises(KVServiceError) as err:
        await awrite_blocks(client, "B", [(0, 5, block)], allocation=(1, response.epoch))
    assert err.value.message.startswith("chunks[0].allocation_id: 1 is not request 'B''s current allocation")


# -- blocks written in place (written_blocks) ----------------------------------------------------------


def written(request_id: str, allocation_id: int, *groups: Sequence[int]) -> pb.WrittenBlocks:
    """One WrittenBlocks entry: ``groups[g]`` are group g's block ids."""
    return pb.WrittenBlocks(
        request_id=request_id, allocation_id=allocation_id, block_ids=[pb.GroupBlockIds(block_ids=g) for g in groups]
    )


def byte_states(running: RunningServer) -> list[int]:
    """Each block's byte state (0 not written, 1 partial, 2 written), block 0 first."""
    return list(running.servicer.data_plane.byte_state)


async def test_written_blocks_are_marked_before_the_calls_and_the_rest_skipped_and_counted(start_kv_server, connect):
    """A (allocation 1) holds blocks 1-3, B (allocation 2) blocks 4-5. A block is marked only for the
    request that computes it, in the allocation that gave it, once; everything else is skipped, the
    step goes on, and the answer counts both (in blocks)."""
    running = await start_kv_server(device="cpu")  # memory: the data plane answers
    client = await connect(running)
    response = await manager_step(
        client,
        [
            update("A", range(1, 13)),
            allocate("A", num_new_tokens=12),
            update("B", range(100, 108)),
            allocate("B", num_new_tokens=8),
        ],
    )
    a, b = response.results[1].allocated, response.results[3].allocated
    assert (a.allocation_id, ids(a.block_ids), b.allocation_id, ids(b.block_ids)) == (1, [[1, 2, 3]], 2, [[4, 5]])
    epoch = response.epoch
    response = await manager_step(
        client,
        [estimate("A")],
        written_blocks=[
            written("A", 1, [1, 2, 1]),  # the second 1: already written
            written("B", 2, [4, 1]),  # 1 is A's block
            written("ghost", 1, [3]),  # no such request
            written("A", 7, [3]),  # not A's allocation
        ],
        written_epoch=epoch,
    )
    assert (response.num_blocks_written, response.num_written_skipped) == (3, 4)
    assert response.results[0].cached_tokens.num_cached_tokens == 12
    assert byte_states(running) == [0, 2, 2, 0, 2, 0] + [0] * 10
    digest = digests(range(1, 13))[0]
    [block] = await aread_blocks(client, [(0, digest)])  # by hash: readable now
    assert (block.block_id, block.data) == (1, bytes(running.engine.manager.metadata.groups[0].block_bytes))
    # The marks run before the calls: A's block 3 is marked though the step frees A.
    response = await manager_step(
        client, [free("A"), free("B")], written_blocks=[written("A", 1, [3])], written_epoch=epoch
    )
    assert (response.num_blocks_written, response.num_written_skipped) == (1, 0)
    # B was freed before its block 5 was reported: skipped. B admitted again is allocation 3: a
    # report for its allocation 2 is skipped, for 3 marked.
    response = await manager_step(
        client,
        [update("B", range(200, 208)), allocate("B", num_new_tokens=8)],
        written_blocks=[written("B", 2, [5])],
        written_epoch=epoch,
    )
    assert (response.num_blocks_written, response.num_written_skipped) == (0, 1)
    again = response.results[1].allocated
    assert (again.allocation_id, ids(again.block_ids)) == (3, [[6, 7]])
    response = await manager_step(
        client, [], written_blocks=[written("B", 2, [6]), written("B", 3, [6, 7])], written_epoch=epoch
    )
    assert (response.num_blocks_written, response.num_written_skipped) == (2, 1)
    assert byte_states(running) == [0, 2, 2, 2, 2, 0, 2, 2] + [0] * 8
    plane = running.servicer.data_plane
    assert (plane.num_blocks_marked_in_place, plane.num_marks_skipped) == (6, 6)


WRITTEN_REFUSALS = [
    (
        {"written_epoch": ""},
        grpc.StatusCode.INVALID_ARGUMENT,
        "written_epoch: must be set with written_blocks (the epoch of their allocation ids: ManagerStepResponse.epoch)",
    ),
    (
        {"written_epoch": "an-old-epoch"},
        grpc.StatusCode.FAILED_PRECONDITION,
        "written_epoch: 'an-old-epoch' is not this server's epoch {epoch!r} (the server restarted: the allocations are "
        "gone); nothing was run",
    ),
    ({"written_epoch": "e" * 257}, grpc.StatusCode.INVALID_ARGUMENT, "written_epoch: longer than 256 bytes"),
    ({"entry": written("", 1, [2])}, grpc.StatusCode.INVALID_ARGUMENT, "written_blocks[1].request_id: must be set"),
    (
        {"entry": written("A", 0, [2])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "written_blocks[1].allocation_id: must be >= 1",
    ),
    (
        {"entry": written("A", 1, [2], [3])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "written_blocks[1].block_ids: 2 groups; the server has 1",
    ),
    (
        {"entry": written("A", 1, [2, 0])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "written_blocks[1].block_ids[0].block_ids[1]: 0 is out of range [1, 16) (0 is the null block)",
    ),
    (
        {"entry": written("A", 1, [16])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "written_blocks[1].block_ids[0].block_ids[0]: 16 is out of range [1, 16) (0 is the null block)",
    ),
    (
        {"owner": "sched-2"},
        grpc.StatusCode.FAILED_PRECONDITION,
        "owner: the pool is owned by scheduler 'sched-1' (its claim lapses in 20.0 s unless renewed); one "
        "scheduler owns a pool at a time",
    ),
]


@pytest.mark.parametrize(
    ("fault", "code", "message"),
    WRITTEN_REFUSALS,
    ids=[
        "no-epoch",
        "other-epoch",
        "long-epoch",
        "no-request-id",
        "allocation-0",
        "groups",
        "null-block",
        "block-16",
        "owner",
    ],
)
async def test_a_bad_written_blocks_refuses_the_whole_step_and_marks_nothing(
    start_kv_server, connect, fault, code, message
):
    """A valid report first, then the fault: nothing is marked (the valid one neither), no call runs,
    the claim is not taken or renewed; the status names the field and its bound."""
    running = await start_kv_server(device="cpu")
    running.engine.clock = clock = FakeClock()
    client = await connect(running)
    response = await manager_step(client, [update("A", range(1, 13)), allocate("A", num_new_tokens=12)])
    epoch = response.epoch
    clock.now = 10.0  # claimed at 0 for 30 s: a renewal now would make it lapse at 40
    before, states = state(running), byte_states(running)
    fields = {
        "owner": fault.get("owner", "sched-1"),
        "written_blocks": [written("A", 1, [1]), fault.get("entry", written("A", 1, [2]))],
        "written_epoch": fault.get("written_epoch", epoch),
    }
    with pytest.raises(KVServiceError) as err:
        await manager_step(client, [update("B", range(100, 108))], **fields)
    assert err.value.code is StatusCode[code.name]
    assert err.value.message == message.format(epoch=epoch)
    assert (state(running), byte_states(running), running.engine.claim.expires_at) == (before, states, 30.0)
    assert (running.servicer.data_plane.num_blocks_marked_in_place, running.servicer.data_plane.num_marks_skipped) == (
        0,
        0,
    )


# -- the claim ----------------------------------------------------------------------------------------


async def test_one_scheduler_owns_the_pool_across_clients(kv_server, connect):
    first, second = await connect(kv_server), await connect(kv_server)
    await _prepared(first)
    await second.get_usage()  # read-only calls pass
    before = state(kv_server)
    with pytest.raises(KVServiceError) as err:
        await manager_step(second, [update("X", range(1, 5))], owner="sched-2")
    assert err.value.code is StatusCode.FAILED_PRECONDITION
    assert err.value.message.startswith("owner: the pool is owned by scheduler 'sched-1'")
    legacy = {
        "GetComputedBlocks": second.get_computed_blocks("L", range(60, 68)),
        "AllocateSlots": second.allocate_slots("A", 1),
        "Free": second.free("A"),
        "ResetPrefixCache": second.reset_prefix_cache(),
    }
    for name, call in legacy.items():
        with pytest.raises(KVServiceError) as err:
            await call
        assert err.value.code is StatusCode.FAILED_PRECONDITION, name
        assert "scheduler 'sched-1'" in err.value.message, name
    step = await second.step(StepBuilder().free("A").get_computed_blocks("L", range(60, 68)).get_usage())
    assert [r.WhichOneof("result") for r in step.results] == ["error", "error", "get_usage"]
    assert {r.error.code for r in step.results[:2]} == {FAILED_PRECONDITION}
    assert state(kv_server) == before
    # The owner ends its claim: its requests and popped blocks are freed, and the pool is free to claim.
    response = await manager_step(first, [], release=True)
    assert (response.results, response.num_free_blocks) == ([], 15)
    assert kv_server.engine.requests == {} and kv_server.engine.claim is None
    assert free_ids(kv_server.engine.manager) == [3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1, 5, 4]
    await second.get_computed_blocks("L", range(60, 68))
    assert (await second.allocate_slots("L", 8)).allocated
    kv_server.engine.check_invariants()


async def test_a_lapsed_claim_is_taken_over(kv_server, connect):
    clock = FakeClock()
    kv_server.engine.clock = clock
    first, second = await connect(kv_server), await connect(kv_server)
    await _prepared(first)  # claimed at 0 for 30 s
    clock.now = 29.0
    response = await manager_step(first, [estimate("A")], claim_ttl_s=5.0)  # renewed: lapses at 34
    assert kv_server.engine.claim.expires_at == 34.0
    clock.now = 33.9
    with pytest.raises(KVServiceError) as err:
        await manager_step(second, [], owner="sched-2")
    assert err.value.code is StatusCode.FAILED_PRECONDITION
    assert "lapses in 0.1 s" in err.value.message
    clock.now = 34.0
    await second.get_usage()
    response = await manager_step(second, [update("X", range(1, 5)), lookup("X")], owner="sched-2")
    # sched-1's requests went with its claim; their cached blocks stay cached.
    assert sorted(kv_server.engine.requests) == ["X"]
    assert response.num_free_blocks == 15
    # The old owner is now the other one.
    with pytest.raises(KVServiceError) as err:
        await manager_step(first, [estimate("A")])
    assert err.value.code is StatusCode.FAILED_PRECONDITION and "'sched-2'" in err.value.message
    kv_server.engine.check_invariants()


async def test_the_reaper_releases_a_lapsed_claim(start_kv_server, connect):
    running = await start_kv_server(request_idle_timeout_s=3600.0)
    clock = FakeClock()
    running.engine.clock = clock
    client = await connect(running)
    await _prepared(client)  # claimed at 0 for 30 s: A holds 3 blocks, P's 2 popped
    clock.now = 31.0
    await client.get_usage()  # the claim lapsed: other callers pass
    running.reaper.reap()
    assert (running.engine.claim, running.engine.requests) == (None, {})
    assert (await client.get_usage()).num_free_blocks == 15


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"owner": ""}, "owner: must not be empty"),
        ({"owner": "o" * 257}, "owner: longer than 256 bytes"),
        ({"claim_ttl_s": -1.0}, "claim_ttl_s: -1.0 outside"),
        ({"claim_ttl_s": 3601.0}, "claim_ttl_s: 3601.0 outside"),
        ({"claim_ttl_s": float("nan")}, "claim_ttl_s: nan outside"),
    ],
)
async def test_a_bad_owner_or_ttl_refuses_the_whole_step(kv_server, client, fields, message):
    await _prepared(client)
    before = state(kv_server)
    request = pb.ManagerStepRequest(owner="sched-1", calls=[free("A")])
    for name, value in fields.items():
        setattr(request, name, value)
    with pytest.raises(KVServiceError) as err:
        await client.manager_step(request)
    assert err.value.code is StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(message)
    assert state(kv_server) == before


async def test_too_many_calls_refuse_the_whole_step(start_kv_server, connect):
    running = await start_kv_server(max_step_ops=3)
    client = await connect(running)
    before = state(running)
    with pytest.raises(KVServiceError) as err:
        await manager_step(client, [update("A", range(1, 5)), estimate("A"), estimate("A"), estimate("A")])
    assert (err.value.code, err.value.message) == (StatusCode.INVALID_ARGUMENT, "calls: 4 calls, above max_step_ops 3")
    assert state(running) == before and running.engine.claim is None


# -- roles --------------------------------------------------------------------------------------------


async def test_a_watcher_may_not_call_manager_step(start_kv_server, connect, tmp_path):
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\nname = "sched"\nrole = "scheduler"\ntoken = "{SCHEDULER_TOKEN}"\n\n'
        f'[[tokens]]\nname = "router"\nrole = "watcher"\ntoken = "{WATCHER_TOKEN}"\n'
    )
    running = await start_kv_server(auth_tokens_file=str(path))
    scheduler = await connect(running, token=SCHEDULER_TOKEN)
    watcher = await connect(running, token=WATCHER_TOKEN)
    await _prepared(scheduler)
    before = state(running)
    for owner, release in (("sched-1", False), ("sched-1", True), ("router", False)):
        with pytest.raises(KVServiceError) as err:
            await manager_step(watcher, [free("A")], owner=owner, release=release)
        assert err.value.code is StatusCode.PERMISSION_DENIED
        assert "ManagerStep" in err.value.message and "role 'watcher'" in err.value.message
    assert state(running) == before
    assert (await watcher.get_usage()).num_running_requests == 1


# -- generated calls ----------------------------------------------------------------------------------

REQUEST_IDS = ["r0", "r1", "r2"]
MAX_LEN = 64
small = st.integers(0, 20)
uint32s = st.one_of(st.integers(0, 70), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
counts = st.one_of(small, uint32s)
text = st.one_of(st.text(max_size=8), st.sampled_from(["", "x" * 257, "é" * 200, "\x00"]))
request_ids = st.one_of(st.sampled_from(REQUEST_IDS), text)
token_lists = st.lists(st.integers(0, 12), min_size=1, max_size=24)


def _packed(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


packed_tokens = st.one_of(
    token_lists.map(_packed),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70).map(_packed),
    st.binary(max_size=13),
)
digest_bytes = st.one_of(
    st.lists(st.sampled_from([bytes([i]) * 32 for i in range(4)]), max_size=6).map(b"".join),
    st.binary(max_size=70),
)
group_lists = st.lists(st.lists(st.one_of(st.integers(0, 16), uint32s), max_size=5), max_size=3)


def _maybe(message: Any, **fields: Any) -> Any:
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            getattr(message, name).extend(value)
        elif hasattr(value, "DESCRIPTOR"):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def _registration(rid: str, tokens: list[int], hashed: bool) -> pb.ManagerCall:
    """A well-formed registration (so the state moves on: requests, tables, cached blocks)."""
    return update(rid, tokens, block_hashes=digests(tokens) if hashed else [])


def _update(rid, kept, packed, hashes_kept, digests_, prompt, session, mode, lora, salt, mm) -> pb.ManagerCall:  # type: ignore[no-untyped-def]
    call = _maybe(
        pb.ManagerCall.UpdateRequest(),
        request_id=rid,
        num_tokens_kept=kept,
        packed_token_ids=packed,
        num_block_hashes_kept=hashes_kept,
        block_hashes=digests_,
        num_prompt_tokens=prompt,
        session_id=session,
        kv_cache_report_mode=mode,
        lora=lora,
        cache_salt=salt,
        mm_features=mm,
    )
    return pb.ManagerCall(update_request=call)


def _allocate(
    rid, computed, in_flight, new, hit, hit_ids, lookahead, external, delay, encoder, full, cap, reserved, watermark
) -> pb.ManagerCall:  # type: ignore[no-untyped-def]
    call = _maybe(
        pb.ManagerCall.AllocateSlots(),
        request_id=rid,
        num_computed_tokens=computed,
        num_in_flight_tokens=in_flight,
        num_new_tokens=new,
        num_new_computed_tokens=hit,
        num_lookahead_tokens=lookahead,
        num_external_computed_tokens=external,
        delay_cache_blocks=delay,
        num_encoder_tokens=encoder,
        full_sequence_must_fit=full,
        max_in_flight_tokens=cap,
        reserved_blocks=reserved,
        watermark_blocks=watermark,
    )
    for group in hit_ids:
        call.computed_block_ids.add(block_ids=group)
    return pb.ManagerCall(allocate_slots=call)


manager_calls = st.one_of(
    st.builds(_registration, st.sampled_from(REQUEST_IDS), token_lists, st.booleans()),
    st.builds(
        lambda rid, computed, new, full: allocate(
            rid, num_computed_tokens=computed, num_new_tokens=new, full_sequence_must_fit=full
        ),
        st.sampled_from(REQUEST_IDS),
        st.sampled_from([0, 4, 8, 12]),
        st.integers(1, 12),
        st.booleans(),
    ),
    st.builds(lookup, st.sampled_from(REQUEST_IDS)),
    st.builds(free, st.sampled_from(REQUEST_IDS), st.booleans()),
    st.builds(pop, st.sampled_from(REQUEST_IDS), st.booleans()),
    st.builds(
        _update,
        request_ids,
        counts,
        packed_tokens,
        counts,
        digest_bytes,
        _optional(counts),
        _optional(text),
        _optional(st.integers(-3, 3)),
        _optional(st.builds(lambda i, n: pb.LoRA(lora_id=i, lora_name=n), st.integers(-2, 3), text)),
        _optional(text),
        _optional(
            st.lists(
                st.builds(lambda i, o, n: pb.MultiModalFeature(identifier=i, offset=o, length=n), text, counts, counts),
                max_size=2,
            )
        ),
    ),
    st.builds(
        lambda rid, limit, horizon: pb.ManagerCall(
            get_computed_blocks=_maybe(
                pb.ManagerCall.GetComputedBlocks(),
                request_id=rid,
                max_cache_hit_length=limit,
                free_queue_horizon=horizon,
            )
        ),
        request_ids,
        _optional(counts),
        _optional(counts),
    ),
    st.builds(
        _allocate,
        request_ids,
        counts,
        _optional(counts),
        counts,
        _optional(st.sampled_from([0, 4, 8, 12])),
        group_lists,
        _optional(counts),
        _optional(counts),
        _optional(st.booleans()),
        _optional(counts),
        _optional(st.booleans()),
        _optional(counts),
        _optional(counts),
        _optional(counts),
    ),
    st.builds(cache, request_ids, counts),
    st.builds(
        lambda rid, n: pb.ManagerCall(
            remove_skipped_blocks=pb.ManagerCall.RemoveSkippedBlocks(request_id=rid, num_processed_tokens=n)
        ),
        request_ids,
        counts,
    ),
    st.builds(free, request_ids, st.booleans()),
    st.builds(pop, request_ids, st.booleans()),
    st.builds(free_blocks, st.lists(st.one_of(st.integers(0, 16), uint32s), max_size=5)),
    st.builds(
        lambda block_ids: pb.ManagerCall(evict_blocks=pb.ManagerCall.EvictBlocks(block_ids=block_ids)),
        st.lists(st.one_of(st.integers(0, 16), uint32s), max_size=4),
    ),
    st.just(pb.ManagerCall(reset_prefix_cache=pb.ResetPrefixCacheRequest())),
    st.builds(estimate, request_ids),
    st.builds(
        lambda rid, n, c, cap, m: pb.ManagerCall(
            get_num_blocks_to_allocate=_maybe(
                pb.ManagerCall.GetNumBlocksToAllocate(),
                request_id=rid,
                num_tokens=n,
                num_computed_tokens=c,
                apply_admission_cap=cap,
                max_in_flight_tokens=m,
            )
        ),
        request_ids,
        counts,
        counts,
        st.booleans(),
        _optional(counts),
    ),
    st.just(pb.ManagerCall()),
)
ALLOWED_CODES = {
    INVALID_ARGUMENT,
    NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS.value[0],
    FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
}
"""The statuses a failed call may answer (docs/VALIDATION.md); never INTERNAL or UNKNOWN."""


class LiveServer:
    """A server and a client on an event loop of their own (hypothesis runs the examples)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.running: RunningServer = self.run(start_server(**{**SMALL_SERVER, "max_num_requests": 4}))
        self.client: AsyncKVCacheClient = self.run(self._connect())
        self.codes: dict[str, set[int]] = {}

    async def _connect(self) -> AsyncKVCacheClient:
        return AsyncKVCacheClient(self.running.address, timeout=20.0)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.running.stop(0))
        self.loop.close()

    def call(self, call: pb.ManagerCall) -> None:
        """One call as its own step: an error is one the service documents, names its field when
        it is INVALID_ARGUMENT, and changed nothing."""
        running = self.running
        before = state(running)
        response = self.run(manager_step(self.client, [call], owner="fuzz"))
        (result,) = response.results
        which = result.WhichOneof("result")
        name = call.WhichOneof("call") or "unset"
        self.codes.setdefault(name, set()).add(result.error.code if which == "error" else 0)
        if which == "error":
            assert result.error.code in ALLOWED_CODES, (name, result.error)
            if result.error.code == INVALID_ARGUMENT:
                assert FIELD_FIRST.match(result.error.message), result.error.message
            assert state(running) == before, (name, result.error.message)
        running.engine.check_invariants()
        assert running.servicer.num_invariant_failures == 0


def test_generated_manager_calls_are_never_internal_and_a_failed_one_changes_nothing():
    server = LiveServer()
    try:

        @settings(
            max_examples=400,
            derandomize=True,  # the same examples every run: the coverage asserted below never depends on luck
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.lists(manager_calls, min_size=1, max_size=4))
        def run(calls: list[pb.ManagerCall]) -> None:
            for call in calls:
                server.call(call)

        run()
        # The examples reached the calls' answers and their errors, not only their refusals.
        codes = server.codes
        assert {0, INVALID_ARGUMENT, NOT_FOUND} <= codes["allocate_slots"], codes
        assert {0, INVALID_ARGUMENT} <= codes["update_request"], codes
        assert 0 in codes["free"] and 0 in codes["pop_blocks_for_free"], codes
        assert server.run(server.client.ping(b"p")).payload == b"p"
    finally:
        server.close()


async def test_malformed_bytes_are_invalid_argument_and_change_nothing(kv_server):
    channel = grpc.aio.insecure_channel(kv_server.address)
    method = channel.unary_unary("/kvservice.v1.KVCacheService/ManagerStep")
    valid = pb.ManagerStepRequest(owner="sched-1", calls=[update("A", range(1, 9))]).SerializeToString()
    before = state(kv_server)
    try:
        for data in (b"\xff", valid[:-3], b"\x0a\x02\xc3\x28", b"\x1a\x05\x0a\x03\x0a\x01\xff", valid[:5] + b"\x80"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await method(data, timeout=10.0)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, data
            assert FIELD_FIRST.match(err.value.details() or ""), err.value.details()
    finally:
        await channel.close()
    assert state(kv_server) == before
