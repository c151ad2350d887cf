"""The engine's calls for scheduler-owned requests (vLLM's scheduler keeps tokens, hashes and counts;
the engine answers with blocks; docs/ARCHITECTURE.md §9), on tiny configs: exact block ids,
free-queue order and event lists, every documented error (the field named, and nothing changed:
the whole engine state and the queued events compared before and after), the one-scheduler claim,
and the idle reaper leaving owned requests alone.

Unless a test says otherwise: block size 4, 11 blocks (the null block and 10 usable), max_model_len 64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvservice.core.engine import ComputedBlocksResult, EngineLimits, KVCacheEngine, OwnedAllocateResult, PoolClaim
from kvservice.core.errors import (
    CapacityExceededError,
    InvalidArgumentError,
    PreconditionFailedError,
    RequestAlreadyExistsError,
    RequestNotFoundError,
)
from kvservice.core.kv_cache_spec import CrossAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvservice_client.events import BlockRemoved, BlockStored
from kvservice_client.hashing import BlockHasher, LoRA, MultiModalFeature, block_hash_to_int
from tests.unit.core_helpers import engine_state, free_ids, full, make_manager

SW8 = SlidingWindowSpec(4, 1, 1, "float16", sliding_window=8)
"""A sliding window of 8 tokens at block size 4: 7 tokens before a position are kept, so a
hit needs 2 consecutive cached blocks and computed tokens ``n`` skip the first ``(n - 7) // 4`` blocks."""
CROSS = CrossAttentionSpec(4, 1, 1, "float16")


class FakeClock:
    """Seconds that move only when a test sets them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def digests(tokens: Sequence[int]) -> list[bytes]:
    """The block hashes a scheduler computes for ``tokens`` (vLLM's rule, block size 4)."""
    return BlockHasher(4).hash_prompt(list(tokens))


def ints(block_hashes: Sequence[bytes]) -> list[int]:
    return [block_hash_to_int(h) for h in block_hashes]


H = digests(range(1, 33))
"""Hashes of the blocks of tokens 1..32."""


REFUSED = OwnedAllocateResult(False, ([],), None, ())
REFUSED_FULL_SEQUENCE = OwnedAllocateResult(False, ([],), None, (), refused_full_sequence=True)


def hit_of(result: ComputedBlocksResult) -> tuple[int, tuple[list[int], ...]]:
    """A lookup's hit: (tokens, block ids per group)."""
    return result.num_computed_tokens, result.block_ids


def make_engine(
    num_blocks: int = 11,
    specs: Sequence[KVCacheSpec] | None = None,
    *,
    clock: Callable[[], float] | None = None,
    limits: EngineLimits | None = None,
    max_model_len: int = 64,
) -> KVCacheEngine:
    manager = make_manager(num_blocks, specs, max_model_len=max_model_len)
    return KVCacheEngine(manager, limits or EngineLimits(), clock=clock or FakeClock())


def register(
    engine: KVCacheEngine,
    request_id: str,
    tokens: Sequence[int],
    *,
    block_hashes: Sequence[bytes] | None = None,
    num_prompt_tokens: int | None = None,
    **options: Any,
) -> None:
    """Register a scheduler-owned request: its tokens and (by default) their real hashes."""
    tokens = list(tokens)
    engine.update_request(
        request_id,
        num_tokens_kept=0,
        token_ids=tokens,
        num_block_hashes_kept=0,
        block_hashes=digests(tokens) if block_hashes is None else list(block_hashes),
        num_prompt_tokens=len(tokens) if num_prompt_tokens is None else num_prompt_tokens,
        **options,
    )


def admit(engine: KVCacheEngine, request_id: str, num_new_tokens: int | None = None, **kwargs: Any):
    """vLLM's admission: the lookup, then allocate_slots taking its hit (the rest of the prompt by
    default); the lookup and the allocation's answer."""
    hit = engine.find_cache_hit(request_id)
    if num_new_tokens is None:
        num_new_tokens = engine.requests[request_id].num_tokens - hit.num_computed_tokens
    result = engine.allocate_owned(
        request_id,
        num_computed_tokens=0,
        num_new_tokens=num_new_tokens,
        num_new_computed_tokens=hit.num_computed_tokens,
        computed_block_ids=hit.block_ids if hit.num_computed_tokens else (),
        **kwargs,
    )
    return hit, result


def refused(engine: KVCacheEngine, call: Callable[[], object], error: type[Exception], field: str | None = None):
    """Assert ``call`` raises ``error`` (an InvalidArgumentError naming ``field``) and changes nothing."""
    before = engine_state(engine)
    with pytest.raises(error) as info:
        call()
    if field is not None:
        assert isinstance(info.value, InvalidArgumentError)
        assert info.value.field == field, str(info.value)
        assert str(info.value).startswith(f"{field}: ")
    assert engine_state(engine) == before
    engine.check_invariants()
    return info.value


def stored(hashes, parent, tokens, *, group=0, kind="full_attention", window=None, session=None, reused=False):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        session_id=session,
        reused=reused,
    )


def removed(hashes, group=0, kind="full_attention", window=None):
    return BlockRemoved(hashes, "GPU", group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def cached_and_freed(engine: KVCacheEngine) -> None:
    """Request "A" (tokens 1..10) admitted and finished: blocks 1, 2 cached (H[0], H[1]), block 3
    partial; freed tail first, so the free queue is 3 (uncached, at the head), 4..10, then 2, 1."""
    register(engine, "A", range(1, 11))
    assert admit(engine, "A")[1].new_block_ids == ([1, 2, 3],)
    assert engine.free_owned("A", forget=True) == 3
    assert free_ids(engine.manager) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert engine.take_events() == [stored(ints(H[:2]), None, range(1, 9))]


# -- update_request ---------------------------------------------------------------------------


def test_update_request_registers_a_waiting_request_and_keeps_the_callers_hashes():
    engine = make_engine()
    fake = [bytes([7]) * 32, bytes([8]) * 32]  # not the hashes of these tokens: never recomputed
    register(engine, "A", range(1, 11), block_hashes=fake, session_id="s-a")
    request = engine.requests["A"]
    assert (request.all_token_ids, request.block_hashes, request.num_prompt_tokens) == (list(range(1, 11)), fake, 10)
    assert (engine.owned, engine.running, engine.num_waiting_tokens) == ({"A": None}, set(), 10)
    assert engine.take_events() == []
    usage = engine.get_usage()
    assert (usage.num_waiting_requests, usage.num_running_requests, usage.num_free_blocks) == (1, 0, 10)
    # The events carry the scheduler's hashes, with the session set at registration.
    assert admit(engine, "A")[1].new_block_ids == ([1, 2, 3],)
    assert engine.take_events() == [stored(ints(fake), None, range(1, 9), session="s-a")]
    assert (engine.running, engine.num_waiting_tokens) == ({"A"}, 0)
    engine.check_invariants()


def test_update_request_appends_and_replaces_the_uncached_tail():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")  # blocks 1, 2 cached; 3 holds tokens 9, 10
    engine.take_events()
    # Decode: tokens 11, 12 complete block 2 (position 2); its hash comes with them.
    engine.update_request("A", num_tokens_kept=10, token_ids=[11, 12], num_block_hashes_kept=2, block_hashes=[H[2]])
    assert (engine.requests["A"].all_token_ids, engine.requests["A"].block_hashes) == (list(range(1, 13)), H[:3])
    # A spec-decode rejection: the scheduler keeps 10 tokens and 2 hashes, then sends other tokens.
    other = digests([*range(1, 11), 50, 51])[2]
    engine.update_request("A", num_tokens_kept=10, token_ids=[50, 51], num_block_hashes_kept=2, block_hashes=[other])
    assert engine.requests["A"].all_token_ids == [*range(1, 11), 50, 51]
    assert engine.requests["A"].block_hashes == [H[0], H[1], other]
    assert engine.requests["A"].num_prompt_tokens == 10
    assert engine.take_events() == [] and free_ids(engine.manager) == [4, 5, 6, 7, 8, 9, 10]
    # Caching the block now caches the replaced hash.
    result = engine.allocate_owned("A", num_computed_tokens=10, num_new_tokens=2)
    assert (result.allocated, result.new_block_ids, result.block_ids) == (True, ([],), None)
    assert engine.take_events() == [stored(ints([other]), ints([H[1]])[0], [9, 10, 50, 51])]
    engine.check_invariants()


def test_update_request_sent_whole_again_while_waiting_replaces_the_prompt():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    register(engine, "A", range(30, 36))  # num_tokens_kept 0 with num_prompt_tokens: a new request
    request = engine.requests["A"]
    assert (request.all_token_ids, request.block_hashes) == (list(range(30, 36)), digests(range(30, 36)))
    assert (request.num_prompt_tokens, engine.num_waiting_tokens) == (6, 6)
    engine.check_invariants()


def test_update_request_hashes_of_cached_blocks_cannot_be_replaced_until_the_blocks_go():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")  # blocks 1, 2 cached
    for kept_tokens, kept_hashes in ((10, 1), (7, 2), (0, 0)):
        refused(
            engine,
            lambda t=kept_tokens, h=kept_hashes: engine.update_request(
                "A", num_tokens_kept=t, token_ids=[99] * (10 - t), num_block_hashes_kept=h, block_hashes=[]
            ),
            InvalidArgumentError,
            "num_block_hashes_kept",
        )
    # Preempted (its blocks freed, the request kept): nothing of it is cached any more.
    # (A kept count inside the prompt is refused: the request is sent whole instead.)
    engine.free_owned("A", forget=False)
    other = digests([1, 2, 3, 4, 90, 91, 92, 93])
    engine.update_request(
        "A",
        num_tokens_kept=0,
        token_ids=[1, 2, 3, 4, 90, 91, 92, 93],
        num_block_hashes_kept=0,
        block_hashes=other,
        num_prompt_tokens=8,
    )
    assert engine.requests["A"].block_hashes == [H[0], other[1]]
    engine.check_invariants()


def test_update_request_hashes_of_delayed_blocks_can_be_replaced():
    """Blocks allocated with delay_cache_blocks are not cached: their hashes are still the scheduler's."""
    engine = make_engine()
    register(engine, "A", range(1, 11))
    assert engine.allocate_owned("A", num_computed_tokens=0, num_new_tokens=10, delay_cache_blocks=True).allocated
    assert engine.take_events() == []
    other = [bytes([1]) * 32, bytes([2]) * 32]
    engine.update_request("A", num_tokens_kept=10, token_ids=[], num_block_hashes_kept=0, block_hashes=other)
    engine.cache_blocks("A", 10)
    assert engine.take_events() == [stored(ints(other), None, range(1, 9))]
    engine.check_invariants()


def _update_setup() -> KVCacheEngine:
    """A running (tokens 1..10, blocks 1, 2 cached, 3 partial), B waiting (20..27), L registered by
    GetComputedBlocks, the events taken."""
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    register(engine, "B", range(20, 28))
    engine.get_computed_blocks("L", range(40, 48))
    engine.take_events()
    return engine


def _update(request_id: str, **overrides: Any) -> Callable[[KVCacheEngine], object]:
    """An update_request of ``request_id`` (registration fields by default, ``overrides`` replace)."""
    kwargs: dict[str, Any] = {
        "num_tokens_kept": 0,
        "token_ids": list(range(60, 66)),
        "num_block_hashes_kept": 0,
        "block_hashes": digests(range(60, 66)),
        "num_prompt_tokens": 6,
    }
    kwargs.update(overrides)
    return lambda engine: engine.update_request(request_id, **kwargs)


UPDATE_ERRORS = {
    "empty id": (_update(""), InvalidArgumentError, "request_id"),
    "id too long": (_update("x" * 257), InvalidArgumentError, "request_id"),
    "negative token id": (_update("N", token_ids=[1, -1, 2, 3, 4, 5]), InvalidArgumentError, "token_ids"),
    "token id above int32": (_update("N", token_ids=[2**31, 1, 2, 3, 4, 5]), InvalidArgumentError, "token_ids"),
    "digest of 16 bytes": (_update("N", block_hashes=[b"x" * 16]), InvalidArgumentError, "block_hashes"),
    "kept tokens of an unknown id": (_update("N", num_tokens_kept=4), RequestNotFoundError, None),
    "kept hashes of an unknown id": (_update("N", num_block_hashes_kept=1), RequestNotFoundError, None),
    "no prompt": (_update("N", num_prompt_tokens=0), InvalidArgumentError, "num_prompt_tokens"),
    "prompt above the tokens": (_update("N", num_prompt_tokens=7), InvalidArgumentError, "num_prompt_tokens"),
    "above max_model_len": (
        _update("N", token_ids=[1] * 65, block_hashes=[], num_prompt_tokens=65),
        InvalidArgumentError,
        "token_ids",
    ),
    "a hash beyond the full blocks": (
        _update("N", token_ids=[1] * 7, block_hashes=digests([1] * 8), num_prompt_tokens=7),
        InvalidArgumentError,
        "block_hashes",
    ),
    "session too long": (_update("N", session_id="s" * 1025), InvalidArgumentError, "session_id"),
    "salt too long": (_update("N", cache_salt="s" * 1025), InvalidArgumentError, "cache_salt"),
    "empty LoRA name": (_update("N", lora=LoRA(1, "")), InvalidArgumentError, "lora.lora_name"),
    "negative LoRA id": (_update("N", lora=LoRA(-1, "l")), InvalidArgumentError, "lora.lora_id"),
    "placeholder outside the prompt": (
        _update("N", mm_features=[MultiModalFeature("img", 4, 3)]),
        InvalidArgumentError,
        "mm_features[0]",
    ),
    "unknown report mode": (_update("N", kv_cache_report_mode="partial"), InvalidArgumentError, "kv_cache_report_mode"),
    "kept tokens above the held": (
        _update("A", num_tokens_kept=11, num_block_hashes_kept=2, token_ids=[], block_hashes=[], num_prompt_tokens=0),
        InvalidArgumentError,
        "num_tokens_kept",
    ),
    "kept hashes above the held": (
        _update("A", num_tokens_kept=10, num_block_hashes_kept=3, token_ids=[], block_hashes=[], num_prompt_tokens=0),
        InvalidArgumentError,
        "num_tokens_kept",
    ),
    "a cached block's hash cut": (
        _update("A", num_tokens_kept=10, num_block_hashes_kept=1, token_ids=[], block_hashes=[], num_prompt_tokens=0),
        InvalidArgumentError,
        "num_block_hashes_kept",
    ),
    "a cached block's tokens cut": (
        _update(
            "A", num_tokens_kept=6, num_block_hashes_kept=2, token_ids=[7, 8], block_hashes=[], num_prompt_tokens=0
        ),
        InvalidArgumentError,
        "num_block_hashes_kept",
    ),
    "a running request sent whole": (
        _update("A", block_hashes=[], token_ids=list(range(1, 11)), num_prompt_tokens=10),
        InvalidArgumentError,
        "num_block_hashes_kept",  # its cached blocks' hashes would go first
    ),
    "sent whole with the prompt above the tokens": (
        _update("B", num_prompt_tokens=7),
        InvalidArgumentError,
        "num_prompt_tokens",
    ),
    "appended above max_model_len": (
        _update(
            "B", num_tokens_kept=8, num_block_hashes_kept=2, token_ids=[1] * 57, block_hashes=[], num_prompt_tokens=0
        ),
        InvalidArgumentError,
        "token_ids",
    ),
    "appended hashes beyond the full blocks": (
        _update(
            "B", num_tokens_kept=8, num_block_hashes_kept=2, token_ids=[1, 2], block_hashes=[H[5]], num_prompt_tokens=0
        ),
        InvalidArgumentError,
        "block_hashes",
    ),
    "registered by GetComputedBlocks": (_update("L"), RequestAlreadyExistsError, None),
}


@pytest.mark.parametrize("case", list(UPDATE_ERRORS))
def test_update_request_errors_change_nothing(case):
    engine = _update_setup()
    call, error, field = UPDATE_ERRORS[case]
    refused(engine, lambda: call(engine), error, field)


def test_update_request_a_running_request_without_cached_blocks_cannot_be_sent_whole():
    engine = make_engine()
    register(engine, "A", range(1, 4))  # 3 tokens: no full block, nothing ever cached
    assert admit(engine, "A")[1].allocated
    refused(engine, lambda: register(engine, "A", range(5, 9)), InvalidArgumentError, "num_tokens_kept")


def test_update_request_refuses_to_cut_into_the_prompt():
    engine = _update_setup()
    refused(
        engine,
        lambda: engine.update_request("B", num_tokens_kept=4, token_ids=[], num_block_hashes_kept=1, block_hashes=[]),
        InvalidArgumentError,
        "num_tokens_kept",
    )


def test_update_request_capacity_bounds():
    engine = make_engine(limits=EngineLimits(max_num_requests=2, max_waiting_tokens=12))
    register(engine, "A", range(1, 9))
    error = refused(engine, lambda: register(engine, "B", range(20, 25)), CapacityExceededError)
    assert str(error).startswith("max_waiting_tokens: waiting requests hold 8 prompt tokens; 5 more")
    register(engine, "B", range(20, 24))  # 12 waiting tokens: at the bound
    error = refused(engine, lambda: register(engine, "C", range(30, 31)), CapacityExceededError)
    assert str(error).startswith("max_num_requests: 2 requests are registered")


# -- find_cache_hit ---------------------------------------------------------------------------


def test_find_cache_hit_answers_the_hit_and_where_its_free_blocks_sit():
    engine = make_engine()
    cached_and_freed(engine)
    register(engine, "B", [*range(1, 9), 20, 21, 22])
    assert engine.find_cache_hit("B") == ComputedBlocksResult(8, ([1, 2],), (2,), 0)
    # Block 2 (the hit's first free block in the queue) is 9th: 3, 4..10 are ahead of it.
    assert engine.find_cache_hit("B", free_queue_horizon=11).num_free_blocks_ahead == 8
    assert engine.find_cache_hit("B", free_queue_horizon=8).num_free_blocks_ahead == 8  # none within 8
    assert engine.find_cache_hit("B", free_queue_horizon=5).num_free_blocks_ahead == 5
    assert engine.find_cache_hit("B", 7) == ComputedBlocksResult(4, ([1],), (1,), 0)
    assert engine.find_cache_hit("B", 0) == ComputedBlocksResult(0, ([],), (), 0)
    # A prompt of exactly two cached blocks: its last token is computed, so one block is the hit.
    register(engine, "C", range(1, 9))
    assert hit_of(engine.find_cache_hit("C")) == (4, ([1],))
    assert hit_of(engine.find_cache_hit("C", 8)) == (8, ([1, 2],))
    # Lookups change nothing, and are not counted: the admission that takes the hit is.
    assert engine.manager.prefix_cache_stats.requests == 1
    before = engine_state(engine)
    engine.find_cache_hit("B", free_queue_horizon=11)
    assert engine_state(engine) == before


def test_find_cache_hit_counts_held_hit_blocks_as_not_free():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")  # A holds 1, 2, 3
    register(engine, "B", [*range(1, 9), 20])
    assert engine.find_cache_hit("B", free_queue_horizon=11) == ComputedBlocksResult(8, ([1, 2],), (0,), 11)


def test_find_cache_hit_of_a_sliding_window_has_null_positions():
    engine = make_engine(specs=[SW8])
    register(engine, "A", range(1, 17))
    assert admit(engine, "A")[1].new_block_ids == ([1, 2, 3, 4],)
    engine.free_owned("A", forget=True)
    register(engine, "B", [*range(1, 17), 90])
    # The last two blocks before the end cover the window: positions 0, 1 are null.
    assert engine.find_cache_hit("B") == ComputedBlocksResult(16, ([0, 0, 3, 4],), (2,), 0)
    hit, result = admit(engine, "B")
    assert (result.new_block_ids, result.block_ids, result.num_null_blocks) == (([5],), ([0, 0, 3, 4, 5],), (2,))
    engine.check_invariants()


FIND_ERRORS = {
    "unknown": (lambda e: e.find_cache_hit("N"), RequestNotFoundError, None),
    "registered by GetComputedBlocks": (lambda e: e.find_cache_hit("L"), InvalidArgumentError, "request_id"),
    "running": (lambda e: e.find_cache_hit("A"), InvalidArgumentError, "request_id"),
    "hit above the tokens": (lambda e: e.find_cache_hit("B", 9), InvalidArgumentError, "max_cache_hit_length"),
    "negative hit": (lambda e: e.find_cache_hit("B", -1), InvalidArgumentError, "max_cache_hit_length"),
    "horizon above the pool": (
        lambda e: e.find_cache_hit("B", free_queue_horizon=12),
        InvalidArgumentError,
        "free_queue_horizon",
    ),
}


@pytest.mark.parametrize("case", list(FIND_ERRORS))
def test_find_cache_hit_errors_change_nothing(case):
    engine = _update_setup()
    call, error, field = FIND_ERRORS[case]
    refused(engine, lambda: call(engine), error, field)


# -- allocate_owned ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_allocate_owned_admission_takes_the_hit(mode):
    engine = make_engine()
    cached_and_freed(engine)
    register(engine, "B", [*range(1, 9), 20, 21, 22], kv_cache_report_mode=mode, session_id="s-b")
    hit, result = admit(engine, "B")
    assert hit.num_computed_tokens == 8
    assert (result.allocated, result.new_block_ids, result.block_ids, result.num_null_blocks) == (
        True,
        ([3],),
        ([1, 2, 3],),
        (0,),
    )
    # The hit is reported at admission in full mode; block 3 holds 3 tokens: nothing new is cached.
    assert engine.take_events() == (
        [stored(ints(H[:2]), None, range(1, 9), session="s-b", reused=True)] if mode == "full" else []
    )
    assert free_ids(engine.manager) == [4, 5, 6, 7, 8, 9, 10]
    stats = engine.manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert (engine.running, engine.num_waiting_tokens) == ({"B"}, 0)
    # The next chunk: no hit, the table grows; block 3 becomes full and cached.
    engine.update_request(
        "B",
        num_tokens_kept=11,
        token_ids=[23],
        num_block_hashes_kept=2,
        block_hashes=[digests([*range(1, 9), 20, 21, 22, 23])[2]],
    )
    result = engine.allocate_owned("B", num_computed_tokens=11, num_new_tokens=1)
    assert (result.new_block_ids, result.block_ids, result.num_null_blocks) == (([],), None, (0,))
    assert [type(e) for e in engine.take_events()] == [BlockStored]
    assert engine.estimate_cached_tokens("B") == 12
    engine.check_invariants()


def test_allocate_owned_refusal_changes_nothing():
    engine = make_engine()
    cached_and_freed(engine)
    register(engine, "hog", range(100, 128))  # 7 blocks: 3, 4..9 (7 free remain after: 10, 2, 1)
    assert admit(engine, "hog")[1].new_block_ids == ([3, 4, 5, 6, 7, 8, 9],)
    engine.take_events()
    assert free_ids(engine.manager) == [10, 2, 1]
    register(engine, "B", [*range(1, 9), *range(50, 62)], kv_cache_report_mode="full")  # hit 8, 3 more blocks
    hit = engine.find_cache_hit("B")
    assert (hit.num_computed_tokens, hit.block_ids) == (8, ([1, 2],))
    before = engine_state(engine)
    result = engine.allocate_owned(
        "B", num_computed_tokens=0, num_new_tokens=12, num_new_computed_tokens=8, computed_block_ids=hit.block_ids
    )
    assert result == REFUSED
    assert engine_state(engine) == before  # no touch, no reuse report, no count, still waiting
    assert engine.num_failed_allocations == 1
    # One block fewer fits exactly: the two hit blocks leave the queue, block 10 is taken.
    result = engine.allocate_owned(
        "B", num_computed_tokens=0, num_new_tokens=4, num_new_computed_tokens=8, computed_block_ids=hit.block_ids
    )
    assert (result.allocated, result.block_ids, free_ids(engine.manager)) == (True, ([1, 2, 10],), [])
    engine.check_invariants()


def _hog(engine: KVCacheEngine, num_blocks: int) -> None:
    register(engine, "hog", range(100, 100 + 4 * num_blocks))
    assert admit(engine, "hog")[1].allocated
    engine.take_events()


def test_allocate_owned_full_sequence_gate():
    engine = make_engine()
    _hog(engine, 7)  # 3 blocks free
    register(engine, "C", range(1, 21))  # 5 blocks in all
    before = engine_state(engine)
    gated = dict(num_computed_tokens=0, num_new_tokens=4, full_sequence_must_fit=True)
    assert engine.allocate_owned("C", **gated) == REFUSED_FULL_SEQUENCE
    assert engine_state(engine) == before
    # The step's own blocks refused: the flag says so.
    assert engine.allocate_owned("C", num_computed_tokens=0, num_new_tokens=16) == REFUSED
    # Without the gate the first chunk fits (vLLM's chunked prefill without scheduler_reserve_full_isl).
    assert engine.allocate_owned("C", num_computed_tokens=0, num_new_tokens=4).new_block_ids == ([8],)
    # A running request's gate counts the blocks beyond its table: 4 more > 2 free.
    result = engine.allocate_owned("C", num_computed_tokens=4, num_new_tokens=4, full_sequence_must_fit=True)
    assert result == REFUSED_FULL_SEQUENCE
    engine.check_invariants()


def test_allocate_owned_full_sequence_gate_counts_the_watermark_not_the_reserve():
    engine = make_engine()
    _hog(engine, 5)  # 5 blocks free
    register(engine, "C", range(1, 13))  # 3 blocks
    kwargs = dict(num_computed_tokens=0, num_new_tokens=4, full_sequence_must_fit=True)
    assert engine.allocate_owned("C", watermark_blocks=3, **kwargs).refused_full_sequence  # 3 + 3 > 5
    # The reserve counts only against the step's own blocks (1 + 4 <= 5).
    result = engine.allocate_owned("C", watermark_blocks=2, reserved_blocks=2, **kwargs)
    assert (result.allocated, result.new_block_ids) == (True, ([6],))


@pytest.mark.parametrize("field", ["watermark_blocks", "reserved_blocks"])
def test_allocate_owned_watermark_and_reserved_blocks_are_kept_free(field):
    engine = make_engine()
    _hog(engine, 7)  # 3 free
    register(engine, "C", range(1, 9))  # 2 blocks
    before = engine_state(engine)
    assert engine.allocate_owned("C", num_computed_tokens=0, num_new_tokens=8, **{field: 2}) == REFUSED
    assert engine_state(engine) == before
    result = engine.allocate_owned("C", num_computed_tokens=0, num_new_tokens=8, **{field: 1})
    assert (result.allocated, result.new_block_ids, free_ids(engine.manager)) == (True, ([8, 9],), [10])


def test_allocate_owned_admission_cap_of_a_sliding_window():
    """vLLM's full-sequence gate counts a windowed group at most at its admission cap:
    ceil((sliding_window - 1 + max_in_flight_tokens) / block_size) + 1 blocks."""
    engine = make_engine(specs=[SW8])
    _hog(engine, 5)  # 5 free
    register(engine, "C", range(1, 41))  # 10 blocks
    kwargs = dict(num_computed_tokens=0, num_new_tokens=4, full_sequence_must_fit=True)
    # max_in_flight_tokens unset: max_model_len, so the cap (17 blocks) does not bite: 10 > 5.
    assert engine.allocate_owned("C", **kwargs).refused_full_sequence
    assert engine.allocate_owned("C", max_in_flight_tokens=10, **kwargs).refused_full_sequence  # cap 5 + 1 > 5
    result = engine.allocate_owned("C", max_in_flight_tokens=4, **kwargs)  # cap ceil(11/4) + 1 = 4 <= 5
    assert (result.allocated, result.new_block_ids) == (True, ([6],))


def test_get_num_blocks_to_allocate_of_a_sliding_window_with_the_cap():
    engine = make_engine(specs=[SW8])
    register(engine, "C", range(1, 41))
    assert engine.get_num_blocks_to_allocate("C", 40, 0) == 10
    assert engine.get_num_blocks_to_allocate("C", 40, 0, apply_admission_cap=True, max_in_flight_tokens=4) == 4
    assert engine.get_num_blocks_to_allocate("C", 40, 0, apply_admission_cap=True) == 10  # cap 17
    # Once computed tokens skip positions, an admission needs only the blocks after them.
    assert engine.get_num_blocks_to_allocate("C", 40, 24) == 6  # 24 - 7 = 17 tokens: 4 blocks skipped


@pytest.mark.parametrize("delay", [False, True])
def test_allocate_owned_external_tokens_come_after_the_hit(delay):
    engine = make_engine()
    cached_and_freed(engine)
    tokens = list(range(1, 20))  # 19 tokens: hit 8, a connector's 8, 3 to compute
    register(engine, "B", tokens)
    hit = engine.find_cache_hit("B")
    assert hit.num_computed_tokens == 8
    result = engine.allocate_owned(
        "B",
        num_computed_tokens=0,
        num_new_tokens=3,
        num_new_computed_tokens=8,
        computed_block_ids=hit.block_ids,
        num_external_computed_tokens=8,
        delay_cache_blocks=delay,
    )
    # External blocks 3, 4 after the hit, then block 5 for the new tokens (vLLM's result: new only).
    assert (result.new_block_ids, result.block_ids) == (([5],), ([1, 2, 3, 4, 5],))
    if delay:
        assert engine.take_events() == []
        assert engine.estimate_cached_tokens("B") == 8
        engine.cache_blocks("B", 16)  # the load arrived
    assert engine.take_events() == [stored(ints(H[2:4]), ints(H[1:2])[0], range(9, 17))]
    assert engine.estimate_cached_tokens("B") == 16
    engine.check_invariants()


def test_allocate_owned_external_tokens_only():
    """An asynchronous KV load: no token computed this step, only the connector's tokens adopted."""
    engine = make_engine()
    register(engine, "B", range(1, 13))
    result = engine.allocate_owned(
        "B", num_computed_tokens=0, num_new_tokens=0, num_external_computed_tokens=11, delay_cache_blocks=True
    )
    assert (result.new_block_ids, result.block_ids) == (([],), ([1, 2, 3],))
    assert engine.take_events() == []
    engine.cache_blocks("B", 11)
    assert engine.take_events() == [stored(ints(H[:2]), None, range(1, 9))]


def test_allocate_owned_encoder_tokens_fill_the_cross_attention_group_once():
    engine = make_engine(specs=[full(), CROSS])
    register(engine, "A", range(1, 9))
    result = engine.allocate_owned("A", num_computed_tokens=0, num_new_tokens=8, num_encoder_tokens=6)
    assert (result.new_block_ids, result.block_ids) == (([1, 2], [3, 4]), ([1, 2], [3, 4]))
    # Cross-attention blocks are never cached: the events are group 0's.
    assert engine.take_events() == [stored(ints(H[:2]), None, range(1, 9))]
    engine.update_request("A", num_tokens_kept=8, token_ids=[9], num_block_hashes_kept=2, block_hashes=[])
    result = engine.allocate_owned("A", num_computed_tokens=8, num_new_tokens=1, num_encoder_tokens=6)
    assert result.new_block_ids == ([5], [])
    assert engine.estimate_cached_tokens("A") == 8
    engine.free_owned("A", forget=True)
    # Group order, tail first in each: 5 (uncached) to the head, then 2, 1 at the tail; then the
    # cross group's 4, 3 (uncached) to the head, in that order.
    assert free_ids(engine.manager) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    engine.check_invariants()


def test_allocate_owned_frees_skipped_blocks_on_the_processed_token_basis():
    engine = make_engine(specs=[SW8])
    register(engine, "A", range(1, 17))
    assert admit(engine, "A")[1].new_block_ids == ([1, 2, 3, 4],)
    engine.take_events()
    engine.update_request("A", num_tokens_kept=16, token_ids=[17], num_block_hashes_kept=4, block_hashes=[])
    # Async scheduling: 4 of the 16 computed tokens are still in flight, so 12 are processed:
    # 12 - 7 = 5 tokens skipped, one block.
    result = engine.allocate_owned("A", num_computed_tokens=16, num_in_flight_tokens=4, num_new_tokens=1)
    assert (result.new_block_ids, result.num_null_blocks) == (([5],), (1,))
    assert engine.manager.get_block_ids("A") == ([0, 2, 3, 4, 5],)
    assert free_ids(engine.manager) == [6, 7, 8, 9, 10, 1]
    # Nothing in flight any more: 16 processed, 9 tokens skipped, two blocks.
    assert engine.remove_skipped_blocks("A", 16) == (2,)
    assert engine.manager.get_block_ids("A") == ([0, 0, 3, 4, 5],)
    assert free_ids(engine.manager) == [6, 7, 8, 9, 10, 1, 2]
    # The hashes stay cached while their blocks are free: nothing removed.
    assert engine.take_events() == []
    engine.check_invariants()


def test_allocate_owned_refused_for_capacity_does_not_free_skipped_blocks():
    """§3.9: vLLM frees the skipped blocks before its check; kvservice's refusal changes nothing, and
    the caller mirrors vLLM with remove_skipped_blocks."""
    engine = make_engine(7, specs=[SW8])  # 6 usable
    register(engine, "A", range(1, 17))
    admit(engine, "A")  # 1..4
    _hog(engine, 2)  # 5, 6: none free
    engine.update_request("A", num_tokens_kept=16, token_ids=[17], num_block_hashes_kept=4, block_hashes=[])
    before = engine_state(engine)
    # 2 skipped blocks would free 2, one is needed, but the lookahead asks for 3 more.
    result = engine.allocate_owned("A", num_computed_tokens=16, num_new_tokens=1, num_lookahead_tokens=12)
    assert result == REFUSED
    assert engine_state(engine) == before
    assert engine.remove_skipped_blocks("A", 16) == (2,)
    assert free_ids(engine.manager) == [2, 1]
    # Two more blocks: the two freed.
    result = engine.allocate_owned("A", num_computed_tokens=16, num_new_tokens=1, num_lookahead_tokens=4)
    assert (result.allocated, result.new_block_ids) == (True, ([2, 1],))
    engine.check_invariants()


def test_allocate_owned_counts_skipped_blocks_as_free_and_frees_them_when_it_goes_ahead():
    engine = make_engine(7, specs=[SW8])
    register(engine, "A", range(1, 17))
    admit(engine, "A")
    _hog(engine, 2)
    engine.update_request("A", num_tokens_kept=16, token_ids=[17], num_block_hashes_kept=4, block_hashes=[])
    result = engine.allocate_owned("A", num_computed_tokens=16, num_new_tokens=1)
    # The skipped blocks go first (walking back from the last skipped position: 2, then 1, both
    # cached, to the tail), then the queue's head is taken: block 2, whose hash goes.
    assert (result.allocated, result.new_block_ids, result.num_null_blocks) == (True, ([2],), (2,))
    assert engine.manager.get_block_ids("A") == ([0, 0, 3, 4, 2],)
    assert free_ids(engine.manager) == [1]
    assert engine.take_events() == [removed(ints(H[1:2]), kind="sliding_window", window=8)]
    engine.check_invariants()


def test_allocate_owned_lookahead_slots_are_not_cached():
    engine = make_engine()
    register(engine, "A", range(1, 9))
    result = engine.allocate_owned("A", num_computed_tokens=0, num_new_tokens=8, num_lookahead_tokens=4)
    assert result.new_block_ids == ([1, 2, 3],)
    assert engine.take_events() == [stored(ints(H[:2]), None, range(1, 9))]
    assert engine.estimate_cached_tokens("A") == 8


def _allocate_setup() -> KVCacheEngine:
    """A running (1..10, blocks 1, 2, 3; events taken), B waiting (1..8 then 20: hit 8 tokens, blocks 1,
    2, held by A), L registered by GetComputedBlocks."""
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    register(engine, "B", [*range(1, 9), 20])
    engine.get_computed_blocks("L", range(40, 48))
    engine.take_events()
    return engine


def _allocate(request_id: str, **overrides: Any) -> Callable[[KVCacheEngine], object]:
    kwargs: dict[str, Any] = {"num_computed_tokens": 0, "num_new_tokens": 1}
    kwargs.update(overrides)
    return lambda engine: engine.allocate_owned(request_id, **kwargs)


B_HIT = dict(num_new_computed_tokens=8, computed_block_ids=[[1, 2]])
ALLOCATE_ERRORS = {
    "unknown": (_allocate("N"), RequestNotFoundError, None),
    "registered by GetComputedBlocks": (_allocate("L"), InvalidArgumentError, "request_id"),
    **{
        f"{field} above max_model_len": (_allocate("B", **{field: 65}), InvalidArgumentError, field)
        for field in (
            "num_computed_tokens",
            "num_new_tokens",
            "num_new_computed_tokens",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "num_encoder_tokens",
        )
    },
    "negative num_new_tokens": (_allocate("B", num_new_tokens=-1), InvalidArgumentError, "num_new_tokens"),
    "in flight above computed": (
        _allocate("A", num_computed_tokens=4, num_in_flight_tokens=5),
        InvalidArgumentError,
        "num_in_flight_tokens",
    ),
    "reserved above the pool": (_allocate("B", reserved_blocks=12), InvalidArgumentError, "reserved_blocks"),
    "watermark above the pool": (_allocate("B", watermark_blocks=12), InvalidArgumentError, "watermark_blocks"),
    "no in-flight tokens": (_allocate("B", max_in_flight_tokens=0), InvalidArgumentError, "max_in_flight_tokens"),
    "nothing to allocate for": (_allocate("B", num_new_tokens=0), InvalidArgumentError, "num_new_tokens"),
    "a hit for a running request": (
        _allocate("A", num_computed_tokens=10, **B_HIT),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "external tokens for a running request": (
        _allocate("A", num_computed_tokens=10, num_external_computed_tokens=4),
        InvalidArgumentError,
        "num_external_computed_tokens",
    ),
    "a hit of two groups": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[1, 2], []]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit of too few blocks": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[1]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit not a multiple of the block size": (
        _allocate("B", num_new_computed_tokens=6, computed_block_ids=[[1]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "blocks without a hit length": (
        _allocate("B", computed_block_ids=[[1, 2]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit beyond the request's hashes": (
        _allocate("B", num_new_computed_tokens=12, computed_block_ids=[[1, 2, 3]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit naming the null block": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[0, 2]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit naming a block outside the pool": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[1, 11]]),
        InvalidArgumentError,
        "computed_block_ids",
    ),
    "a hit naming a block of another hash": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[2, 1]]),
        PreconditionFailedError,
        None,
    ),
    "a hit naming an uncached block": (
        _allocate("B", num_new_computed_tokens=8, computed_block_ids=[[1, 3]]),
        PreconditionFailedError,
        None,
    ),
}


@pytest.mark.parametrize("case", list(ALLOCATE_ERRORS))
def test_allocate_owned_errors_change_nothing(case):
    engine = _allocate_setup()
    call, error, field = ALLOCATE_ERRORS[case]
    refused(engine, lambda: call(engine), error, field)


def test_allocate_owned_a_hit_for_a_group_that_is_never_hit():
    engine = make_engine(specs=[full(), CROSS])
    register(engine, "A", range(1, 10))
    engine.allocate_owned("A", num_computed_tokens=0, num_new_tokens=9)
    engine.free_owned("A", forget=True)
    register(engine, "B", range(1, 10))
    assert hit_of(engine.find_cache_hit("B")) == (8, ([1, 2], []))
    refused(
        engine,
        lambda: engine.allocate_owned(
            "B", num_computed_tokens=0, num_new_tokens=1, num_new_computed_tokens=8, computed_block_ids=[[1, 2], [4, 5]]
        ),
        InvalidArgumentError,
        "computed_block_ids",
    )


@pytest.mark.parametrize("hit_ids", [[0, 2, 0, 4], [0, 0, 0, 4]], ids=["null after a block", "too many nulls"])
def test_allocate_owned_refuses_a_null_block_the_window_needs(hit_ids):
    engine = make_engine(specs=[SW8])
    register(engine, "A", range(1, 17))
    admit(engine, "A")
    engine.free_owned("A", forget=True)
    register(engine, "B", [*range(1, 17), 90])
    # The lookup's hit is [0, 0, 3, 4]: at 16 tokens a window of 8 skips the first two positions only.
    assert hit_of(engine.find_cache_hit("B")) == (16, ([0, 0, 3, 4],))
    refused(
        engine,
        lambda: engine.allocate_owned(
            "B", num_computed_tokens=0, num_new_tokens=1, num_new_computed_tokens=16, computed_block_ids=[hit_ids]
        ),
        InvalidArgumentError,
        "computed_block_ids",
    )


def test_a_stale_hit_is_refused_and_a_fresh_lookup_is_not():
    engine = make_engine()
    cached_and_freed(engine)
    register(engine, "B", [*range(1, 9), 20])
    stale = engine.find_cache_hit("B")
    assert hit_of(stale) == (8, ([1, 2],))
    # Another request takes every free block: 1 and 2 are evicted and reused for other content.
    _hog(engine, 10)
    engine.free_owned("hog", forget=True)
    assert engine.manager.block_pool.blocks[2].block_hash == digests(range(100, 140))[8]
    error = refused(
        engine,
        lambda: engine.allocate_owned(
            "B", num_computed_tokens=0, num_new_tokens=1, num_new_computed_tokens=8, computed_block_ids=stale.block_ids
        ),
        PreconditionFailedError,
    )
    assert str(error).startswith("computed_block_ids: group 0, block 1 at position 0 no longer holds")
    assert hit_of(engine.find_cache_hit("B")) == (0, ([],))
    assert admit(engine, "B")[1].allocated


# -- cache_blocks, remove_skipped_blocks, get_num_blocks_to_allocate, estimate_cached_tokens -----


def test_cache_blocks_caches_at_most_the_hashed_tokens():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    engine.allocate_owned("A", num_computed_tokens=0, num_new_tokens=10, delay_cache_blocks=True)
    engine.cache_blocks("A", 4)
    assert engine.take_events() == [stored(ints(H[:1]), None, range(1, 5))]
    engine.cache_blocks("A", 64)  # beyond the tokens: the two full (hashed) blocks
    assert engine.take_events() == [stored(ints(H[1:2]), ints(H[:1])[0], range(5, 9))]
    engine.cache_blocks("A", 8)  # already cached: nothing
    assert engine.take_events() == [] and engine.estimate_cached_tokens("A") == 8


CACHE_ERRORS = {
    "unknown": (lambda e: e.cache_blocks("N", 4), RequestNotFoundError, None),
    "registered by GetComputedBlocks": (lambda e: e.cache_blocks("L", 4), InvalidArgumentError, "request_id"),
    "negative": (lambda e: e.cache_blocks("A", -1), InvalidArgumentError, "num_tokens"),
    "holds no blocks": (lambda e: e.cache_blocks("B", 8), InvalidArgumentError, "request_id"),
    "skipped: unknown": (lambda e: e.remove_skipped_blocks("N", 4), RequestNotFoundError, None),
    "skipped: registered by GetComputedBlocks": (
        lambda e: e.remove_skipped_blocks("L", 4),
        InvalidArgumentError,
        "request_id",
    ),
    "skipped: above max_model_len": (
        lambda e: e.remove_skipped_blocks("A", 65),
        InvalidArgumentError,
        "num_processed_tokens",
    ),
    "skipped: negative": (lambda e: e.remove_skipped_blocks("A", -1), InvalidArgumentError, "num_processed_tokens"),
    "count: unknown": (lambda e: e.get_num_blocks_to_allocate("N", 4, 0), RequestNotFoundError, None),
    "count: registered by GetComputedBlocks": (
        lambda e: e.get_num_blocks_to_allocate("L", 4, 0),
        InvalidArgumentError,
        "request_id",
    ),
    "count: tokens above max_model_len": (
        lambda e: e.get_num_blocks_to_allocate("A", 65, 0),
        InvalidArgumentError,
        "num_tokens",
    ),
    "count: computed above max_model_len": (
        lambda e: e.get_num_blocks_to_allocate("A", 12, 65),
        InvalidArgumentError,
        "num_computed_tokens",
    ),
    "estimate: unknown": (lambda e: e.estimate_cached_tokens("N"), RequestNotFoundError, None),
    "estimate: empty id": (lambda e: e.estimate_cached_tokens(""), InvalidArgumentError, "request_id"),
}


@pytest.mark.parametrize("case", list(CACHE_ERRORS))
def test_table_call_errors_change_nothing(case):
    engine = _allocate_setup()
    call, error, field = CACHE_ERRORS[case]
    refused(engine, lambda: call(engine), error, field)


def test_remove_skipped_blocks_of_full_attention_frees_nothing():
    engine = _allocate_setup()
    before = engine_state(engine)
    assert engine.remove_skipped_blocks("A", 10) == (0,)
    assert engine_state(engine) == before


def test_remove_skipped_blocks_frees_tail_first_and_keeps_shared_blocks():
    engine = make_engine(specs=[SW8])
    register(engine, "A", range(1, 21))
    admit(engine, "A")  # 1..5
    register(engine, "B", [*range(1, 13), 90])  # hits 1..3 at 12 tokens: window of 2 blocks ahead
    hit, result = admit(engine, "B")
    assert (hit.block_ids, result.block_ids) == (([0, 2, 3],), ([0, 2, 3, 6],))
    engine.take_events()
    # A at 20 processed tokens: 13 skipped, 3 blocks; block 1 goes to the free queue, 2 and 3 are B's too.
    assert engine.remove_skipped_blocks("A", 20) == (3,)
    assert engine.manager.get_block_ids("A") == ([0, 0, 0, 4, 5],)
    assert free_ids(engine.manager) == [7, 8, 9, 10, 1]
    assert [b.ref_cnt for b in engine.manager.block_pool.blocks[1:4]] == [0, 1, 1]
    assert engine.remove_skipped_blocks("A", 20) == (3,)  # again: nothing more
    engine.check_invariants()


def test_get_num_blocks_to_allocate_counts_beyond_the_table_and_changes_nothing():
    engine = _allocate_setup()
    before = engine_state(engine)
    assert engine.get_num_blocks_to_allocate("A", 17, 10) == 2  # 5 blocks, 3 held
    assert engine.get_num_blocks_to_allocate("A", 8, 10) == 0
    assert engine.get_num_blocks_to_allocate("B", 9, 0) == 3  # no table, no hit: every block
    assert engine_state(engine) == before


def test_estimate_cached_tokens_is_the_end_of_the_deepest_cached_block():
    engine = _allocate_setup()
    assert [engine.estimate_cached_tokens(r) for r in ("A", "B", "L")] == [8, 0, 0]


# -- free_owned, pop_blocks_for_free, free_blocks ------------------------------------------------


def test_free_owned_preempted_keeps_the_request_waiting():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    engine.take_events()
    assert engine.free_owned("A", forget=False) == 3
    assert free_ids(engine.manager) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert (list(engine.requests), engine.owned, engine.running, engine.num_waiting_tokens) == (
        ["A"],
        {"A": None},
        set(),
        10,
    )
    assert engine.manager.get_block_ids("A") == ([],)
    assert engine.take_events() == []
    # Resumed: its own cached blocks are its hit.
    hit, result = admit(engine, "A")
    assert (hit.block_ids, result.block_ids) == (([1, 2],), ([1, 2, 3],))
    assert engine.free_owned("A", forget=True) == 3
    assert (engine.requests, engine.owned, engine.num_waiting_tokens) == ({}, {}, 0)
    engine.check_invariants()


@pytest.mark.parametrize("forget", [False, True])
def test_free_owned_errors_change_nothing(forget):
    engine = _allocate_setup()
    refused(engine, lambda: engine.free_owned("N", forget=forget), RequestNotFoundError)
    refused(engine, lambda: engine.free_owned("L", forget=forget), InvalidArgumentError, "request_id")
    refused(engine, lambda: engine.pop_blocks_for_free("N", forget=forget), RequestNotFoundError)
    refused(engine, lambda: engine.pop_blocks_for_free("L", forget=forget), InvalidArgumentError, "request_id")


def test_pop_blocks_for_free_keeps_the_blocks_held_until_free_blocks():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    engine.take_events()
    assert engine.pop_blocks_for_free("A", forget=False) == [1, 2, 3]
    assert [b.ref_cnt for b in engine.manager.block_pool.blocks[1:4]] == [1, 1, 1]
    assert free_ids(engine.manager) == [4, 5, 6, 7, 8, 9, 10]
    engine.check_invariants()  # popped blocks count as held
    assert (engine.running, engine.num_waiting_tokens, engine.manager.get_block_ids("A")) == (set(), 10, ([],))
    # A block popped is not A's: a refused free_blocks frees none of the list.
    for bad in ([3, 2, 1, 4], [3, 3], [0]):
        error = refused(engine, lambda b=bad: engine.free_blocks(b), InvalidArgumentError, "block_ids")
        assert "was not taken off a table by PopBlocksForFree" in str(error)
    assert engine.free_blocks([3, 2]) == 2
    assert free_ids(engine.manager) == [3, 4, 5, 6, 7, 8, 9, 10, 2]
    refused(engine, lambda: engine.free_blocks([2]), InvalidArgumentError, "block_ids")  # freed already
    assert engine.free_blocks([1]) == 1
    assert (engine._detached, free_ids(engine.manager)) == ({}, [3, 4, 5, 6, 7, 8, 9, 10, 2, 1])
    assert engine.take_events() == []
    engine.check_invariants()


def test_pop_blocks_for_free_of_a_shared_block_counts_each_reference():
    engine = make_engine()
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    register(engine, "B", [*range(1, 9), 20])
    admit(engine, "B")  # shares 1, 2
    assert engine.pop_blocks_for_free("A", forget=True) == [1, 2, 3]
    assert engine.pop_blocks_for_free("B", forget=True) == [1, 2, 4]
    assert engine._detached == {1: 2, 2: 2, 3: 1, 4: 1}
    assert (engine.requests, engine.owned) == ({}, {})
    engine.check_invariants()  # popped blocks count as held
    assert engine.free_blocks([4, 2, 1, 3, 2, 1]) == 6
    # 4 and 3 (uncached) to the head in that order; 2, 1 reach 0 at their second free.
    assert free_ids(engine.manager) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    engine.check_invariants()


def test_pop_blocks_for_free_leaves_out_a_window_s_null_head():
    engine = make_engine(specs=[SW8])
    register(engine, "A", range(1, 17))
    admit(engine, "A")
    engine.remove_skipped_blocks("A", 16)
    assert engine.pop_blocks_for_free("A", forget=True) == [3, 4]
    assert engine.free_blocks([4, 3]) == 2
    assert free_ids(engine.manager) == [5, 6, 7, 8, 9, 10, 2, 1, 4, 3]
    engine.check_invariants()


# -- the claim --------------------------------------------------------------------------------


def test_one_scheduler_owns_the_pool_and_others_are_refused_naming_it():
    clock = FakeClock()
    engine = make_engine(clock=clock)
    engine.claim_pool("sched-1", 30.0)
    error = refused(engine, lambda: engine.claim_pool("sched-2", 30.0), PreconditionFailedError)
    assert str(error) == (
        "owner: the pool is owned by scheduler 'sched-1' (its claim lapses in 30.0 s unless renewed); "
        "one scheduler owns a pool at a time"
    )
    error = refused(engine, lambda: engine.check_claim(None), PreconditionFailedError)
    assert "'sched-1'" in str(error)
    refused(engine, lambda: engine.check_claim("sched-2"), PreconditionFailedError)
    engine.check_claim("sched-1")
    clock.now = 20.0
    engine.claim_pool("sched-1", 30.0)  # renewed: lapses at 50
    assert engine.claim == PoolClaim("sched-1", 50.0)
    clock.now = 49.9
    refused(engine, lambda: engine.claim_pool("sched-2", 30.0), PreconditionFailedError)
    assert engine.expire_claim() == []


@pytest.mark.parametrize(
    "owner, ttl, field",
    [
        ("", 30.0, "owner"),
        ("o" * 257, 30.0, "owner"),
        ("s", 0.0, "claim_ttl_s"),
        ("s", -1.0, "claim_ttl_s"),
        ("s", 3600.5, "claim_ttl_s"),
        ("s", math.nan, "claim_ttl_s"),
        ("s", math.inf, "claim_ttl_s"),
    ],
)
def test_claim_pool_errors_change_nothing(owner, ttl, field):
    engine = make_engine()
    engine.claim_pool("sched-1", 30.0)
    refused(engine, lambda: engine.claim_pool(owner, ttl), InvalidArgumentError, field)


def _claimed_with_requests(clock: FakeClock) -> KVCacheEngine:
    """L (60..67: blocks 1, 2) is a legacy request, allocated before sched-1 claims at t=0 for 30 s.
    A (1..10: 3, 4, 5) runs, P (20..27: 6, 7) was popped and its blocks not freed yet, W (40..47)
    waits."""
    engine = make_engine(clock=clock)
    engine.get_computed_blocks("L", range(60, 68))
    assert engine.allocate_slots("L", 8).allocated
    engine.claim_pool("sched-1", 30.0)
    register(engine, "A", range(1, 11))
    admit(engine, "A")
    register(engine, "P", range(20, 28))
    admit(engine, "P")
    assert engine.pop_blocks_for_free("P", forget=True) == [6, 7]
    register(engine, "W", range(40, 48))
    engine.take_events()
    assert free_ids(engine.manager) == [8, 9, 10]
    return engine


def test_release_claim_frees_every_owned_request_and_every_popped_block():
    engine = _claimed_with_requests(FakeClock())
    assert engine.release_claim("sched-2") == []  # not the owner: nothing
    assert engine.claim is not None and free_ids(engine.manager) == [8, 9, 10]
    assert engine.release_claim("sched-1") == ["A", "W"]
    assert engine.claim is None
    # A freed tail first (5 uncached to the head, 4, 3 at the tail), then P's popped blocks, deepest
    # first as a request's blocks are (docs/ARCHITECTURE.md §2.3): 7, 6.
    assert free_ids(engine.manager) == [5, 8, 9, 10, 4, 3, 7, 6]
    assert (list(engine.requests), engine.owned, engine._detached) == (["L"], {}, {})
    assert engine.manager.get_block_ids("L") == ([1, 2],)
    assert engine.take_events() == []  # freed blocks stay cached
    engine.check_invariants()
    engine.claim_pool("sched-2", 30.0)  # the pool is free to claim


def test_a_lapsed_claim_is_released_when_another_scheduler_claims():
    clock = FakeClock()
    engine = _claimed_with_requests(clock)
    clock.now = 29.9
    assert engine.expire_claim() == []
    refused(engine, lambda: engine.claim_pool("sched-2", 30.0), PreconditionFailedError)
    clock.now = 30.0  # lapsed: other callers pass, and the next claim takes the pool
    engine.check_claim(None)
    engine.claim_pool("sched-2", 10.0)
    assert engine.claim == PoolClaim("sched-2", 40.0)
    assert (list(engine.requests), engine.owned, engine._detached) == (["L"], {}, {})
    assert free_ids(engine.manager) == [5, 8, 9, 10, 4, 3, 7, 6]
    engine.check_invariants()


def test_expire_claim_releases_a_lapsed_claim():
    clock = FakeClock()
    engine = _claimed_with_requests(clock)
    clock.now = 31.0
    assert engine.expire_claim() == ["A", "W"]
    assert engine.claim is None and free_ids(engine.manager) == [5, 8, 9, 10, 4, 3, 7, 6]


def test_the_idle_reaper_leaves_owned_requests_alone():
    clock = FakeClock()
    engine = _claimed_with_requests(clock)
    assert engine.idle_request_ids(5.0) == []
    clock.now = 100.0
    assert engine.idle_request_ids(5.0) == ["L"]
    assert engine.free_idle_requests(5.0) == ["L"]
    assert sorted(engine.requests) == ["A", "W"]
    # Only owned requests are left: they wait for their claim, which lapses at 30 s (the reaper's
    # next deadline; a lapsed claim is the reaper's to release).
    assert engine.next_idle_deadline(5.0) == engine.claim.expires_at == 30.0
    assert engine.manager.get_block_ids("A") == ([3, 4, 5],)
    engine.check_invariants()
