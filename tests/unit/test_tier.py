"""The tier's calls over the block pool (kvservice.core.tier): exact block ids, free-queue order,
events and lease states (docs/tier.md)."""

from __future__ import annotations

import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.errors import CapacityExceededError, InvalidArgumentError
from kvservice.core.tier import PutStatus, TierLimits, TierStore
from kvservice_client.events import BlockRemoved, BlockStored

WRITE, PRESENT, IN_FLIGHT = PutStatus.WRITE, PutStatus.PRESENT, PutStatus.IN_FLIGHT
BLOCK_SIZE = 4


def h(i: int) -> bytes:
    """A 32-byte block hash whose published int (its last 8 bytes, big-endian) is ``i``."""
    return i.to_bytes(32, "big")


def store(num_blocks: int = 6, **limits: object) -> TierStore:
    pool = BlockPool(num_blocks, 1, enable_kv_cache_events=True)
    return TierStore(pool, [BLOCK_SIZE], digest_bytes=32, limits=TierLimits(**limits))  # type: ignore[arg-type]  # the keyword arguments are TierLimits' own, typed object here


def free_ids(tier: TierStore) -> list[int]:
    return [b.block_id for b in tier.pool.free_block_queue.get_all_free_blocks()]


def stored(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens or [],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def put(tier: TierStore, keys: list[int], now: float = 0.0, **kwargs: object) -> tuple[int, list[int]]:
    """Reserve and commit ``keys``; the reservation's lease and block ids."""
    reserved = tier.reserve(0, [h(k) for k in keys], now=now, **kwargs)  # type: ignore[arg-type]  # reserve's keyword arguments, typed object here
    assert reserved.reserved
    assert tier.commit(reserved.lease_id, now=now) == (True, reserved.status.count(WRITE))
    return reserved.lease_id, reserved.block_ids


def test_put_then_lookup_hits_and_blockstored_goes_out_only_at_commit():
    tier = store()
    reserved = tier.reserve(0, [h(1), h(2)], parent_block_hashes=[None, h(1)], now=0.0)
    assert (reserved.reserved, reserved.status, reserved.block_ids) == (True, [WRITE, WRITE], [1, 2])
    assert reserved.lease_id != 0 and reserved.ttl_s == 10.0
    # Reserved, not committed: invisible to lookups and leases, no event, not free.
    assert tier.lookup(0, [h(1), h(2)]).present == [False, False]
    assert tier.lease(0, [h(1)], now=0.0).block_ids == [0]
    assert tier.pool.take_events() == []
    assert free_ids(tier) == [3, 4, 5]
    assert tier.commit(reserved.lease_id, now=0.0) == (True, 2)
    assert tier.pool.take_events() == [stored([1, 2])]  # parent unknown (None), no token ids
    found = tier.lookup(0, [h(1), h(2), h(3)])
    assert (found.present, found.num_prefix_blocks) == ([True, True, False], 2)
    assert free_ids(tier) == [3, 4, 5, 1, 2]  # committed blocks at the LRU tail, in key order
    # A commit is once: the lease is gone.
    assert tier.commit(reserved.lease_id, now=0.0) == (False, 0)
    assert tier.num_leases == 0


def test_never_put_keys_miss_and_a_lookup_changes_nothing():
    tier = store()
    put(tier, [1, 2])
    tier.pool.take_events()
    before = free_ids(tier)
    found = tier.lookup(0, [h(9), h(1)])
    assert (found.present, found.num_prefix_blocks) == ([False, True], 0)
    assert free_ids(tier) == before and tier.pool.take_events() == []
    # touch: the present free block moves to the LRU tail, still no event.
    tier.lookup(0, [h(1)], touch=True)
    assert free_ids(tier) == [3, 4, 5, 2, 1] and tier.pool.take_events() == []


def test_a_put_again_is_idempotent_and_touches():
    tier = store()
    put(tier, [1, 2])
    tier.pool.take_events()
    again = tier.reserve(0, [h(2), h(1), h(3)], now=0.0)
    assert (again.status, again.block_ids) == ([PRESENT, PRESENT, WRITE], [0, 0, 3])
    assert tier.pool.take_events() == []
    assert free_ids(tier) == [4, 5, 2, 1]  # the present keys back at the tail, in key order
    all_present = tier.reserve(0, [h(1)], now=0.0)
    assert (all_present.reserved, all_present.lease_id, all_present.status) == (True, 0, [PRESENT])
    assert tier.num_leases == 1  # only the first reservation holds anything


def test_tokens_and_parents_make_one_event_per_chain():
    tier = store()
    tokens = list(range(100, 112))
    put(tier, [1, 2, 3], parent_block_hashes=[h(7), h(1), None], token_ids=tokens)
    assert tier.pool.take_events() == [
        stored([1, 2], parent=7, tokens=tokens[:8]),
        stored([3], tokens=tokens[8:]),
    ]


def test_an_aborted_or_expired_reservation_frees_its_blocks_with_no_event():
    tier = store()
    reserved = tier.reserve(0, [h(1), h(2)], ttl_s=5.0, now=0.0)
    assert tier.release(reserved.lease_id, now=1.0).valid
    assert tier.pool.take_events() == [] and free_ids(tier) == [1, 2, 3, 4, 5]
    late = tier.reserve(0, [h(3)], ttl_s=5.0, now=10.0)
    assert late.block_ids == [1]
    assert tier.commit(late.lease_id, now=15.0) == (False, 0)  # expired at 15: nothing stored
    assert tier.pool.take_events() == [] and tier.lookup(0, [h(3)]).present == [False]
    assert free_ids(tier) == [1, 2, 3, 4, 5] and tier.num_expired == 1
    assert tier.release(late.lease_id, now=16.0).valid is False


def test_a_key_reserved_by_another_live_lease_is_in_flight():
    tier = store()
    first = tier.reserve(0, [h(1)], now=0.0)
    second = tier.reserve(0, [h(1), h(2)], now=0.0)
    assert (second.status, second.block_ids) == ([IN_FLIGHT, WRITE], [0, 2])
    tier.release(first.lease_id, now=0.0)
    third = tier.reserve(0, [h(1)], now=0.0)  # the first lease gave it up: write it now
    assert (third.status, third.block_ids) == ([WRITE], [1])


def test_eviction_of_unpinned_blocks_makes_room_with_blockremoved():
    tier = store(num_blocks=4)
    put(tier, [1, 2, 3])
    tier.pool.take_events()
    reserved = tier.reserve(0, [h(4)], now=0.0)
    assert reserved.block_ids == [1]  # the least recently used: h1's block
    assert tier.pool.take_events() == [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)]
    assert tier.lookup(0, [h(1), h(2), h(3)]).present == [False, True, True]


def test_a_leased_block_is_never_reused_while_leased():
    tier = store(num_blocks=4)
    put(tier, [1, 2, 3])
    tier.pool.take_events()
    lease = tier.lease(0, [h(1), h(9)], now=0.0)
    assert (lease.block_ids, lease.num_leased) == ([1, 0], 1)
    assert free_ids(tier) == [2, 3]
    # A put racing the eviction takes the next unpinned block, never the leased one.
    racing = tier.reserve(0, [h(4), h(5)], now=0.0)
    assert racing.block_ids == [2, 3]
    assert tier.pool.take_events() == [BlockRemoved(block_hashes=[2, 3], medium="GPU", group_idx=0)]
    # The pool is all pinned now: a put is refused cleanly, changing nothing.
    before = (free_ids(tier), tier.num_leases, [b.ref_cnt for b in tier.pool.blocks])
    refused = tier.reserve(0, [h(6)], now=0.0)
    assert (refused.reserved, refused.lease_id, refused.status, refused.block_ids) == (False, 0, [], [])
    assert (free_ids(tier), tier.num_leases, [b.ref_cnt for b in tier.pool.blocks]) == before
    assert tier.pool.take_events() == [] and tier.lookup(0, [h(1)]).present == [True]
    # Released: block 1 is the read lease's only block, valid; it goes to the LRU tail.
    assert tier.release(lease.lease_id, now=1.0) == type(tier.release(0, now=1.0))(True, 1)
    assert free_ids(tier) == [1]


def test_a_refused_put_counts_present_free_blocks_as_taken():
    """Two free blocks, both carrying keys the put names PRESENT, the third leased: the new key has
    no room (the allocation would evict a key answered present); refused, nothing changed."""
    tier = store(num_blocks=4)
    put(tier, [1, 2, 3])
    tier.lease(0, [h(3)], now=0.0)
    tier.pool.take_events()
    refused = tier.reserve(0, [h(1), h(2), h(4)], now=0.0)
    assert refused.reserved is False
    assert free_ids(tier) == [1, 2] and tier.pool.take_events() == []


def test_a_put_the_whole_pool_could_never_hold_is_invalid_argument_not_refused():
    """Keys to write and present (pinned while the call allocates) beyond the pool's blocks: no
    wait would make room, so the call is named, not answered ``reserved = false``."""
    tier = store(num_blocks=3)
    put(tier, [1, 2])
    tier.pool.take_events()
    with pytest.raises(InvalidArgumentError) as err:
        tier.reserve(0, [h(1), h(2), h(3)], now=0.0)
    assert (
        str(err.value) == "block_hashes: 1 keys to write and 2 present, more than the pool's 2 blocks; split the call"
    )
    with pytest.raises(InvalidArgumentError, match=r"^block_hashes: 3 keys to write, more than the pool's 2 blocks"):
        tier.reserve(0, [h(3), h(4), h(5)], now=0.0)
    assert free_ids(tier) == [1, 2] and tier.pool.take_events() == [] and tier._leases == {}


def test_lease_expiry_unpins_and_the_late_release_is_invalid():
    tier = store(num_blocks=3)
    put(tier, [1, 2])
    lease = tier.lease(0, [h(1)], ttl_s=2.0, now=0.0)
    assert free_ids(tier) == [2]
    assert tier.next_deadline() == 2.0
    assert tier.expire(1.9) == 0 and free_ids(tier) == [2]
    assert tier.expire(2.0) == 1 and free_ids(tier) == [2, 1]
    assert tier.release(lease.lease_id, now=3.0).valid is False


def test_bounds_refuse_naming_the_field_and_change_nothing():
    tier = store(max_keys_per_call=2, max_leases=1, max_lease_ttl_s=60.0)
    cases = [
        (lambda: tier.lookup(0, [h(1)] * 3), "block_hashes: 3 keys, above tier_max_keys_per_call 2"),
        (lambda: tier.lookup(1, [h(1)]), "group_idx: 1 is out of range [0, 1)"),
        (lambda: tier.lookup(0, [h(1)], group_idxs=[0, 0]), "group_idxs: 2 groups for 1 keys"),
        (lambda: tier.lookup(0, [b"x" * 16]), "block_hashes[0]: 16 bytes; a block hash is the server's 32-byte"),
        (lambda: tier.reserve(0, [h(1), h(1)], now=0), "block_hashes[1]: " + h(1).hex() + " is named twice"),
        (lambda: tier.reserve(0, [h(1)], parent_block_hashes=[h(1), h(2)], now=0), "parent_block_hashes: 2 parents"),
        (lambda: tier.reserve(0, [h(1)], parent_block_hashes=[b"ab"], now=0), "parent_block_hashes[0]: 2 bytes"),
        (lambda: tier.reserve(0, [h(1)], token_ids=[1, 2], now=0), "packed_token_ids: 2 token ids for 1 keys of 4"),
        (lambda: tier.reserve(0, [h(1)], token_ids=[1, 2, 3, -1], now=0), "packed_token_ids: token id -1 at 3"),
        (lambda: tier.reserve(0, [h(1)], ttl_s=61.0, now=0), "ttl_s: 61.0; must be 0 (the default) .. 60.0"),
        (lambda: tier.lease(0, [h(1)], ttl_s=-1.0, now=0), "ttl_s: -1.0"),
        (lambda: tier.lease(0, [h(1)], ttl_s=float("nan"), now=0), "ttl_s: nan"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError) as err:
            call()
        assert str(err.value).startswith(message), (str(err.value), message)
    assert free_ids(tier) == [1, 2, 3, 4, 5] and tier.num_leases == 0 and tier.pool.take_events() == []
    tier.reserve(0, [h(1)], now=0)
    with pytest.raises(CapacityExceededError, match="leases: 1 live, at tier_max_leases 1"):
        tier.reserve(0, [h(2)], now=0)
    assert free_ids(tier) == [2, 3, 4, 5] and tier.num_leases == 1


def test_a_key_cached_meanwhile_by_another_copy_keeps_one_copy_and_no_second_event():
    tier = store()
    reserved = tier.reserve(0, [h(1)], now=0.0)
    other = tier.reserve(0, [h(2)], now=0.0)
    # Another caller (a scheduler's request, say) caches h1 meanwhile: here a second put lease
    # that took h1 after the first was released... simulated by indexing block 2 under h1.
    block = tier.pool.blocks[other.block_ids[0]]
    tier.pool.cache_blocks_by_hash(0, [block], [h(1)], [None], None, BLOCK_SIZE)
    tier.pool.take_events()
    assert tier.commit(reserved.lease_id, now=0.0) == (True, 1)
    assert tier.pool.take_events() == []  # h1 was present already: no second BlockStored
    assert tier.pool.blocks[1].block_hash is None and free_ids(tier)[0] == 1  # ours freed uncached, to the head


class RecordingBoard:
    """A lease board that records each write with the ref counts of the pool's blocks at that
    moment (a slot must be cleared while its lease's blocks are still held)."""

    def __init__(self, tier: TierStore) -> None:
        self.tier = tier
        self.slots: dict[int, int] = {}
        self.log: list[tuple[str, int, int, list[int]]] = []

    def _refs(self) -> list[int]:
        return [b.ref_cnt for b in self.tier.pool.blocks]

    def publish_lease(self, slot: int, lease_id: int) -> None:
        self.slots[slot] = lease_id
        self.log.append(("publish", slot, lease_id, self._refs()))

    def clear_lease(self, slot: int) -> None:
        self.log.append(("clear", slot, self.slots.pop(slot), self._refs()))


def test_leases_hold_a_board_slot_cleared_before_their_blocks_are_let_go():
    tier = store(num_blocks=5, max_leases=3)
    board = RecordingBoard(tier)
    put(tier, [1, 2])  # before the board: no slot, nothing published
    tier.lease_board = board
    read = tier.lease(0, [h(1), h(2)], now=0.0)
    reserved = tier.reserve(0, [h(3)], now=0.0)
    assert (read.slot, reserved.slot) == (1, 2)
    assert board.slots == {1: read.lease_id, 2: reserved.lease_id}
    # Released: slot 1 is cleared while blocks 1 and 2 are still pinned (ref 1), then unpinned.
    assert tier.release(read.lease_id, now=1.0).valid
    assert board.log[-1] == ("clear", 1, read.lease_id, [0, 1, 1, 1, 0])
    assert [b.ref_cnt for b in tier.pool.blocks] == [0, 0, 0, 1, 0]
    # Slot 1 is free again: the next lease takes it (the slot freed last is taken first).
    again = tier.lease(0, [h(2)], ttl_s=2.0, now=1.0)
    assert again.slot == 1
    # Committed: slot 2 cleared while block 3 is still reserved (ref 1), before it is cached.
    assert tier.commit(reserved.lease_id, now=1.0) == (True, 1)
    assert board.log[-1] == ("clear", 2, reserved.lease_id, [0, 0, 1, 1, 0])
    # Expired: slot 1 cleared while block 2 is still pinned.
    assert tier.expire(3.0) == 1
    assert board.log[-1] == ("clear", 1, again.lease_id, [0, 0, 1, 0, 0])
    assert board.slots == {} and [entry[:2] for entry in board.log] == [
        ("publish", 1),
        ("publish", 2),
        ("clear", 1),
        ("publish", 1),
        ("clear", 2),
        ("clear", 1),
    ]
    # A miss holds nothing and takes no slot; an aborted reservation clears its slot.
    assert tier.lease(0, [h(9)], now=3.0).slot == 0
    aborted = tier.reserve(0, [h(4)], now=3.0)
    assert aborted.slot == 1 and tier.release(aborted.lease_id, now=3.0).valid
    assert board.log[-1][:3] == ("clear", 1, aborted.lease_id) and board.slots == {}


def test_every_live_lease_has_its_own_slot_up_to_max_leases():
    tier = store(num_blocks=5, max_leases=3)
    put(tier, [1, 2, 3])
    tier.lease_board = board = RecordingBoard(tier)
    leases = [tier.lease(0, [h(k)], now=0.0) for k in (1, 2, 3)]
    assert [lease.slot for lease in leases] == [1, 2, 3]
    with pytest.raises(CapacityExceededError):
        tier.lease(0, [h(1)], now=0.0)
    assert board.slots == {1: leases[0].lease_id, 2: leases[1].lease_id, 3: leases[2].lease_id}
    tier.release(leases[1].lease_id, now=0.0)
    assert tier.lease(0, [h(2)], now=0.0).slot == 2
