"""The mirror's bulk apply (C-level passes per event) against the plain rule, one block at a time."""

from __future__ import annotations

import random
import sys
from array import array

import pytest

from kvservice.server.snapshot import CachedSetMirror
from kvservice.server.snapshot.mirror import BLOCK_SIZE, UNPACKED_TOKENS
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def reference_apply(blocks: dict, tokens: list[int], events: list[KVEvent]) -> list[int]:
    """The rule the mirror implements, written per block: hashes applied last to first (the first
    block of an event is the most recent), a stored hash already present moves to the most recent
    end, a reuse report moves present blocks there, a removal drops them, a clear drops all."""
    for event in events:
        if isinstance(event, BlockStored):
            g = event.group_idx
            hashes = event.block_hashes
            if event.reused:
                for h in reversed(hashes):
                    block = blocks.pop((g, h), None)
                    if block is not None:
                        blocks[(g, h)] = block
                continue
            bs = event.block_size
            for i in range(len(hashes) - 1, -1, -1):
                old = blocks.pop((g, hashes[i]), None)
                if old is not None:
                    tokens[g] -= old[BLOCK_SIZE]
                blocks[(g, hashes[i])] = (
                    hashes[i - 1] if i else event.parent_block_hash,
                    array("q", event.token_ids[i * bs : (i + 1) * bs]).tobytes(),
                    bs,
                    event.lora_id,
                    event.lora_name,
                    event.medium,
                    event.extra_keys is not None,
                    event.extra_keys[i] if event.extra_keys is not None else None,
                )
                tokens[g] += bs
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                old = blocks.pop((event.group_idx, h), None)
                if old is not None:
                    tokens[event.group_idx] -= old[BLOCK_SIZE]
        else:
            blocks.clear()
            tokens[:] = [0] * len(tokens)
    return tokens


def random_events(rng: random.Random, num_events: int, num_groups: int = 2) -> list[KVEvent]:
    """Events over a small hash space (so stores of present hashes, reuses of absent ones and
    removals of unknown ones all happen), two groups, blocks of 2 and 3 tokens, runs of 1 to 150
    blocks (across the 64-block split), with and without extra keys, and now and then an event
    naming one hash twice."""
    events: list[KVEvent] = []
    for _ in range(num_events):
        kind = rng.random()
        g = rng.randrange(num_groups)
        n = rng.choice([1, 2, 63, 64, 65, 150]) if rng.random() < 0.3 else rng.randrange(1, 20)
        # Mostly distinct hashes, as one chain's are; sometimes one hash twice (applied block by block).
        hashes = rng.sample(range(400), n) if rng.random() < 0.8 else [rng.randrange(400) for _ in range(n)]
        if kind < 0.55:
            bs = 2 + g
            extra = [rng.choice([None, ("lora-a",), (b"salt", 3)]) for _ in range(n)] if rng.random() < 0.3 else None
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=rng.choice([None, rng.randrange(400)]),
                    token_ids=[rng.randrange(1 << 31) for _ in range(n * bs)],
                    block_size=bs,
                    lora_id=rng.choice([None, 7]),
                    medium=rng.choice(["GPU", "CPU"]),
                    lora_name=rng.choice([None, "lora-a"]),
                    extra_keys=extra,
                    group_idx=g,
                    reused=rng.random() < 0.15,
                )
            )
        elif kind < 0.97:
            events.append(BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=g))
        else:
            events.append(AllBlocksCleared())
    return events


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("unpacked_tokens", [0, 300, UNPACKED_TOKENS])
def test_the_bulk_apply_keeps_exactly_what_the_per_block_rule_keeps_in_the_same_order(unpacked_tokens, num_groups):
    """Whether records are packed at once, soon or late, and however often they are compacted;
    one group (a table keyed by hash) or two."""
    rng = random.Random(17)
    for trial in range(30):
        mirror = CachedSetMirror(
            num_groups,
            ["full_attention", "sliding_window"][:num_groups],
            [None, 8][:num_groups],
            unpacked_tokens=unpacked_tokens,
        )
        blocks: dict = {}
        tokens = [0] * num_groups
        for seq in range(1, 21):
            batch = random_events(rng, rng.randrange(1, 8), num_groups)
            mirror.apply(seq, batch)
            reference_apply(blocks, tokens, batch)
            assert list(mirror.view().items()) == list(blocks.items()), (trial, seq)
            assert list(mirror.table.items()) == list(blocks.items()), (trial, seq)  # as a cut reads it
            assert mirror.pinned_token_ids() <= 2 * sum(tokens), (trial, seq)
            assert mirror.num_tokens_per_group == tokens, (trial, seq)
            assert mirror.seq == seq
            assert mirror.num_unpacked_tokens <= unpacked_tokens + 150 * 3, (trial, seq)  # one event above, at most


def test_a_stored_hash_already_present_moves_to_the_most_recent_end_and_is_counted_once():
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    first = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=[10, 11, 12, 13],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    again = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[10, 11],
        block_size=2,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )
    mirror.apply(1, [first, again])
    assert list(mirror.view()) == [(0, 2), (0, 1)]
    assert mirror.view()[(0, 1)][5] == "CPU"
    assert mirror.num_tokens_per_group == [4]


def chain_event(first_hash: int, num_blocks: int, block_size: int = 4) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + num_blocks)),
        parent_block_hash=None,
        token_ids=list(range(10_000 + first_hash * block_size, 10_000 + (first_hash + num_blocks) * block_size)),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def test_surviving_blocks_of_a_long_prompt_do_not_pin_it():
    """Issue 15 item 2: the record of a 100-block prompt is compacted once fewer than half of its
    blocks are live; the survivors keep their parents, tokens and places, and the event's token
    list is let go."""
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    event = chain_event(0, 100)
    mirror.apply(1, [event, chain_event(1000, 2)])
    before = mirror.view()
    expected = {key: before[key] for key in before}
    assert mirror.pinned_token_ids() == 102 * 4 and mirror.num_unpacked_tokens == 102 * 4
    mirror.apply(2, [BlockRemoved(block_hashes=list(range(50)), medium="GPU", group_idx=0)])
    assert mirror.pinned_token_ids() == 102 * 4  # half live: not yet
    mirror.apply(3, [BlockRemoved(block_hashes=[50, 52, 99], medium="GPU", group_idx=0)])
    assert mirror.pinned_token_ids() == 49 * 4  # 47 of 100 live (and 2 more): only they stay
    assert mirror.num_unpacked_tokens == 2 * 4 and mirror.num_tokens_per_group == [49 * 4]
    # The view taken before still reads the blocks as they were then (it holds the old record:
    # a view never changes a record, so that one still has the event's list).
    assert {key: before[key] for key in before} == expected
    del before
    refs = sys.getrefcount(event.token_ids)
    del event
    assert refs == 2  # the local name and getrefcount's argument: the mirror let the list go
    after = mirror.view()
    live = [key for key in expected if key[1] not in {*range(51), 52, 99}]
    assert list(after) == live
    assert {key: after[key] for key in after} == {key: expected[key] for key in live}
    assert after[(0, 51)][0] == 50 and after[(0, 53)][0] == 52  # parents written out


def test_token_lists_beyond_the_budget_are_packed_oldest_first():
    mirror = CachedSetMirror(1, ["full_attention"], [None], unpacked_tokens=10 * 4)
    events = [chain_event(100 * r, 4) for r in range(5)]  # 16 tokens each
    mirror.apply(1, events)
    assert mirror.num_unpacked_tokens == 32  # the two newest
    records = [mirror._blocks[100 * r] for r in range(5)]  # one group: keyed by hash
    assert [type(r.tokens) for r in records] == [bytes, bytes, bytes, list, list]
    assert records[0].tokens == array("q", events[0].token_ids).tobytes()
    mirror.apply(2, [BlockRemoved(block_hashes=[400, 401, 402, 403], medium="GPU", group_idx=0)])
    assert mirror.num_unpacked_tokens == 16  # a record gone leaves the budget
    mirror.apply(3, [AllBlocksCleared()])
    assert mirror.num_unpacked_tokens == 0 and mirror.num_blocks == 0


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="unpacked_tokens must be >= 0; got -1"):
        CachedSetMirror(1, ["full_attention"], [None], unpacked_tokens=-1)


def test_the_view_of_a_one_group_mirror_reads_keys_as_group_and_hash():
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    mirror.apply(1, [chain_event(5, 2)])
    view = mirror.view()
    assert list(view) == [(0, 6), (0, 5)] and len(view) == 2
    assert (0, 5) in view and (1, 5) not in view and 5 not in view
    assert view.get((1, 5)) is None and view[(0, 6)][0] == 5
    with pytest.raises(KeyError):
        view[(1, 5)]
    assert mirror.cached_hashes() == [{5, 6}]
