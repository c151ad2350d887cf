"""The mirror's bulk apply (C-level passes per event) against the plain rule, one block at a time."""

from __future__ import annotations

import random
from array import array

from kvservice.server.snapshot import BLOCK_SIZE, CachedSetMirror
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


def random_events(rng: random.Random, num_events: int) -> list[KVEvent]:
    """Events over a small hash space (so stores of present hashes, reuses of absent ones and
    removals of unknown ones all happen), two groups, blocks of 2 and 3 tokens, runs of 1 to 150
    blocks (across the 64-block split), with and without extra keys, and now and then an event
    naming one hash twice."""
    events: list[KVEvent] = []
    for _ in range(num_events):
        kind = rng.random()
        g = rng.randrange(2)
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


def test_the_bulk_apply_keeps_exactly_what_the_per_block_rule_keeps_in_the_same_order():
    rng = random.Random(17)
    for trial in range(30):
        mirror = CachedSetMirror(2, ["full_attention", "sliding_window"], [None, 8])
        blocks: dict = {}
        tokens = [0, 0]
        for seq in range(1, 21):
            batch = random_events(rng, rng.randrange(1, 8))
            mirror.apply(seq, batch)
            reference_apply(blocks, tokens, batch)
            assert list(mirror.view().items()) == list(blocks.items()), (trial, seq)
            assert mirror.num_tokens_per_group == tokens, (trial, seq)
            assert mirror.seq == seq


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
