"""The snapshot cut over record segments against the block-by-block cut it replaced
(``tests/unit/snapshot_reference.py``), event for event, on random mirrors; and exact values of the
fast shape (records announced in one BlockStored and left alone: one segment per event)."""

from __future__ import annotations

import random

import pytest

from kvservice.server.snapshot import (
    YIELD_EVERY_TOKENS,
    CachedSetMirror,
    cut,
    materialize,
    run_tokens,
    snapshot_events,
    snapshot_runs,
)
from kvservice.server.snapshot.mirror import UNPACKED_TOKENS
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tests.unit.snapshot_reference import reference_events

BLOCK_SIZES = (2, 16, 100)  # per group: 512, 64 and 10 blocks per snapshot event


class RandomMirror:
    """Seeded random batches for a mirror: chains (often continuing a stored block: chains
    crossing records), stores of hashes already present, hashes named twice in one event, reuse
    reports of stored chains, removals (whole tails, deepest first, and random ones, so records
    are partial and compacted), now and then AllBlocksCleared; extra_keys, lora, media and block
    sizes varied so runs merge across records and break.

    A block's parent hash is always below its own (or None), as a chained hash's parent is never
    its descendant: the block-by-block walk (the reference) loops forever on a cycle."""

    def __init__(self, rng: random.Random, num_groups: int, digests: bool) -> None:
        self.rng = rng
        self.num_groups = num_groups
        self.digests = digests
        self.stored: list[list[list[int]]] = [[] for _ in range(num_groups)]  # per group, chains stored

    def _h(self, h: int):
        return h.to_bytes(8, "big") if self.digests else h

    def _hashes(self, hashes: list[int]) -> list:
        return [self._h(h) for h in hashes]

    def event(self) -> KVEvent:
        rng = self.rng
        g = rng.randrange(self.num_groups)
        chains = self.stored[g]
        kind = rng.random()
        if kind < 0.03:
            for chains_g in self.stored:
                chains_g.clear()
            return AllBlocksCleared()
        if kind < 0.25 and chains:  # a removal
            chain = rng.choice(chains)
            if rng.random() < 0.6:  # a tail, deepest first
                k = rng.randrange(1, len(chain) + 1)
                hashes = chain[-k:][::-1]
            else:
                hashes = rng.sample(chain, rng.randrange(1, len(chain) + 1))
            return BlockRemoved(block_hashes=self._hashes(hashes), medium="GPU", group_idx=g)
        bs = BLOCK_SIZES[g] if rng.random() < 0.9 else rng.choice(BLOCK_SIZES)
        if kind < 0.4 and chains:  # a reuse report: a stored chain's prefix, or random hashes
            chain = rng.choice(chains)
            hashes = chain[: rng.randrange(1, len(chain) + 1)]
            if rng.random() < 0.2:
                hashes = [rng.randrange(6000) for _ in range(rng.randrange(1, 8))]
            return self._stored(g, hashes, None, bs, reused=True)
        if chains and rng.random() < 0.15:  # stored again, as it is or in part
            chain = rng.choice(chains)
            a = rng.randrange(len(chain))
            hashes = chain[a : rng.randrange(a + 1, len(chain) + 1)]
            parent = chain[a - 1] if a else None
        else:
            n = rng.choice([1, 2, 3, 63, 64, 65, 130, 600]) if rng.random() < 0.4 else rng.randrange(1, 20)
            if chains and rng.random() < 0.5:  # continues a stored block
                parent = rng.choice(rng.choice(chains))
            else:
                parent = rng.choice([None, None, rng.randrange(1000)])
            start = (parent + 1 if parent is not None else 0) + rng.randrange(0, 4000)
            if rng.random() < 0.1:  # one hash twice (or more): non-decreasing
                hashes = sorted(rng.randrange(start, start + n) for _ in range(n))
            else:
                hashes = list(range(start, start + n))
        if bs == BLOCK_SIZES[0] and rng.random() < 0.05:  # above YIELD_EVERY_TOKENS: one block per event
            bs, hashes = 1500, hashes[:3]
        if parent is not None and parent >= hashes[0]:
            parent = None
        chains.append(hashes)
        if len(chains) > 40:
            del chains[0]
        return self._stored(g, hashes, parent, bs)

    def _stored(self, g: int, hashes: list[int], parent: int | None, bs: int, reused: bool = False) -> BlockStored:
        rng = self.rng
        n = len(hashes)
        extra = None
        if rng.random() < 0.25:
            extra = [rng.choice([None, ("lora-a",), (b"salt", 3), ["mm", 1]]) for _ in range(n)]
        lora = rng.random() < 0.1
        return BlockStored(
            block_hashes=self._hashes(hashes),
            parent_block_hash=self._h(parent) if parent is not None else None,
            token_ids=[rng.randrange(-(1 << 40), 1 << 40) for _ in range(n * bs)],
            block_size=bs,
            lora_id=7 if lora else None,
            medium="GPU" if rng.random() < 0.9 else "CPU",
            lora_name="lora-a" if lora else None,
            extra_keys=extra,
            group_idx=g,
            reused=reused,
        )


def _filters(num_groups: int) -> list:
    return [None, (0,)] if num_groups == 1 else [None, (0,), (1,), (0, 1), (2,)]


@pytest.mark.parametrize(
    ("unpacked_tokens", "num_groups", "digests", "window"),
    [
        (0, 1, False, 7),
        (0, 2, True, cut._WINDOW),
        (3000, 1, True, 7),
        (3000, 1, False, cut._WINDOW),
        (3000, 2, False, 7),
        (3000, 2, False, cut._WINDOW),
        (UNPACKED_TOKENS, 1, False, cut._WINDOW),
        (UNPACKED_TOKENS, 2, True, 7),
    ],
)
def test_the_segment_cut_gives_exactly_the_events_of_the_block_by_block_cut(
    monkeypatch, unpacked_tokens, num_groups, digests, window
):
    """On random mirrors (every kind of batch, one and two groups, every group filter, records
    packed at once, soon or never, compacted or not, int and digest hashes, the table read in
    windows of 7 entries or the default), after every batch: each value of each axis meets
    several of the others (the whole product takes three times as long, and passes too)."""
    monkeypatch.setattr(cut, "_WINDOW", window)
    rng = random.Random(f"{unpacked_tokens}-{num_groups}-{digests}-{window}")
    kinds = ["full_attention", "sliding_window"][:num_groups]
    windows = [None, 8][:num_groups]
    for trial in range(6):
        mirror = CachedSetMirror(num_groups, kinds, windows, unpacked_tokens=unpacked_tokens)
        source = RandomMirror(rng, num_groups, digests)
        for seq in range(1, 31):
            mirror.apply(seq, [source.event() for _ in range(rng.randrange(1, 6))])
            for group_idxs in _filters(num_groups):
                assert snapshot_events(mirror, group_idxs) == reference_events(mirror, group_idxs), (
                    trial,
                    seq,
                    group_idxs,
                )


@pytest.mark.parametrize("num_groups", [1, 2])
def test_a_cut_s_runs_read_the_same_events_after_the_mirror_moved_on(num_groups):
    """A part keeps record segments, not copies: materialized after later batches packed,
    compacted, removed and cleared the records it refers to, its events are those of its
    watermark; and each run's token count is its event's."""
    rng = random.Random(15 + num_groups)
    kinds = ["full_attention", "sliding_window"][:num_groups]
    windows = [None, 8][:num_groups]
    for trial in range(10):
        mirror = CachedSetMirror(num_groups, kinds, windows, unpacked_tokens=2000)
        source = RandomMirror(rng, num_groups, digests=False)
        for seq in range(1, 21):
            mirror.apply(seq, [source.event() for _ in range(rng.randrange(1, 6))])
            runs = list(snapshot_runs(mirror.table, None))
            expected = reference_events(mirror)
            mirror.apply(100 + seq, [source.event() for _ in range(rng.randrange(1, 6))])
            events = [materialize(run, kinds, windows) for run in runs]
            assert events == expected, (trial, seq)
            assert [run_tokens(run) for run in runs] == [
                len(e.token_ids) if isinstance(e, BlockStored) else 0 for e in events
            ]
        mirror.apply(1000, [AllBlocksCleared()])
        assert [materialize(run, kinds, windows) for run in runs] == expected


def prompt(first_hash: int, num_blocks: int, block_size: int = 16, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + num_blocks)),
        parent_block_hash=parent,
        token_ids=list(range(first_hash * block_size, (first_hash + num_blocks) * block_size)),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


def reuse_report(block_hashes: list[int], block_size: int = 16) -> BlockStored:
    """A reuse report (``reused``) of held blocks of group 0: it refreshes them, stores nothing."""
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        reused=True,
    )


def test_records_announced_in_one_go_are_cut_one_segment_per_event_with_no_lookup_per_block(monkeypatch):
    """The stall bench's shape: distinct prompts, each one record. Each event is one slice of one
    record (64 blocks of 16 tokens: ``YIELD_EVERY_TOKENS``), the second half the same slices
    re-announced; no block is looked up on its own (the cut never asks a record's positions)."""

    def no(*args):
        raise AssertionError("a per-block lookup in the fast shape")

    monkeypatch.setattr(cut._Records, "position", no)
    monkeypatch.setattr(cut._Records, "distinct", no)
    mirror = CachedSetMirror(1, ["full_attention"], [None], unpacked_tokens=16 * 130)
    mirror.apply(1, [prompt(1000, 130), prompt(2000, 130), prompt(3000, 3)])
    first, second, third = mirror.table.records[1000], mirror.table.records[2000], mirror.table.records[3000]
    assert type(first.tokens) is bytes and type(third.tokens) is list  # packed, and not
    runs = list(snapshot_runs(mirror.table, None))
    assert YIELD_EVERY_TOKENS // 16 == 64
    slices = [(0, 64), (64, 128), (128, 130)]
    half = [
        *[(0, False, ((first, a, b),), 16 * (b - a)) for a, b in slices],
        *[(0, False, ((second, a, b),), 16 * (b - a)) for a, b in slices],
        (0, False, ((third, 0, 3),), 48),
    ]
    assert runs == [None, *half, *[(g, True, segments, n) for g, _, segments, n in half]]
    events = snapshot_events(mirror)
    assert events[2] == BlockStored(
        block_hashes=list(range(1064, 1128)),
        parent_block_hash=1063,
        token_ids=list(range(1064 * 16, 1128 * 16)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert events[7] == BlockStored(
        block_hashes=[3000, 3001, 3002],
        parent_block_hash=None,
        token_ids=list(range(3000 * 16, 3003 * 16)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert events[8:] == [
        BlockStored(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "reused": True}) for e in events[1:8]
    ]


def test_a_chain_across_records_is_one_run_in_both_halves():
    """A prompt extended by a later request (its BlockStored's parent is the earlier record's last
    block), its prefix refreshed by a reuse report: half 1 walks from the refreshed prefix (met
    first) and sends the extension after it in the same events; half 2 reads the extension, then
    the prefix, as one chain."""
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    reuse = reuse_report([10, 11, 12], block_size=4)
    mirror.apply(1, [prompt(10, 3, block_size=4), prompt(50, 1, block_size=4), reuse, prompt(13, 2, 4, parent=12)])
    assert list(mirror.table.records) == [50, 12, 11, 10, 14, 13]
    first, fresh, extension = (mirror.table.records[h] for h in (10, 50, 13))
    runs = list(snapshot_runs(mirror.table, None))
    assert runs == [
        None,
        (0, False, ((fresh, 0, 1),), 4),
        (0, False, ((first, 0, 3), (extension, 0, 2)), 20),
        (0, True, ((fresh, 0, 1),), 4),
        (0, True, ((first, 0, 3),), 12),  # the extension (older than the refresh) is met before it
        (0, True, ((extension, 0, 2),), 8),
    ]
    assert snapshot_events(mirror)[2] == BlockStored(
        block_hashes=[10, 11, 12, 13, 14],
        parent_block_hash=None,
        token_ids=list(range(40, 60)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def test_two_requests_branching_off_one_prompt_at_different_depths_send_each_ancestor_once():
    """A prompt of 10 blocks, two later requests continuing it from block 5 and from block 9, then
    the prompt refreshed by a reuse report (so both branches are met before it): the first branch
    is sent with blocks 0-5, the second with blocks 6-9 only (block 5 is sent: the walk stops
    there); the second half reads the second branch with the whole prompt as one chain."""
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    reuse = reuse_report(list(range(10)), block_size=4)
    mirror.apply(1, [prompt(0, 10, 4), prompt(100, 2, 4, parent=5), prompt(200, 2, 4, parent=9), reuse])
    records = mirror.table.records
    assert list(records) == [101, 100, 201, 200, *range(9, -1, -1)]
    base, first, second = records[0], records[100], records[200]
    runs = list(snapshot_runs(mirror.table, None))
    assert runs == [
        None,
        (0, False, ((base, 0, 6), (first, 0, 2)), 32),
        (0, False, ((base, 6, 10), (second, 0, 2)), 24),
        (0, True, ((first, 0, 2),), 8),
        (0, True, ((base, 0, 10), (second, 0, 2)), 48),
    ]
    events = snapshot_events(mirror)
    assert events == reference_events(mirror)
    assert (events[2].block_hashes, events[2].parent_block_hash) == ([6, 7, 8, 9, 200, 201], 5)
    assert events[2].token_ids == [*range(24, 40), *range(800, 808)]


def test_a_walked_chain_whose_kind_changes_is_split_and_keeps_the_child_s_extra_keys():
    """A text-only prompt, then a request extending it with an image in its new block (extra
    keys), then a reuse report refreshing the prefix: half 1 meets the extension first and walks
    up into the prefix, and the chain goes as two BlockStored (the prefix without extra keys, the
    extension with its own, naming the prefix's last block as parent), not one event that took
    the prefix's metadata and dropped the image's extra keys."""
    mirror = CachedSetMirror(1, ["full_attention"], [None])
    text = prompt(10, 2, block_size=4)
    image = BlockStored(
        block_hashes=[12],
        parent_block_hash=11,
        token_ids=[48, 49, 50, 51],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("img-hash",)],
        group_idx=0,
    )
    reuse = reuse_report([10, 11], block_size=4)
    mirror.apply(1, [text, image, reuse])
    assert list(mirror.table.records) == [12, 11, 10]  # the extension is met before its prefix
    prefix, extension = mirror.table.records[10], mirror.table.records[12]
    assert list(snapshot_runs(mirror.table, None))[:3] == [
        None,
        (0, False, ((prefix, 0, 2),), 8),
        (0, False, ((extension, 0, 1),), 4),
    ]
    common = {"block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    kind = {"kv_cache_spec_kind": "full_attention"}
    assert snapshot_events(mirror)[1:3] == [
        BlockStored(block_hashes=[10, 11], parent_block_hash=None, token_ids=list(range(40, 48)), **common, **kind),
        BlockStored(
            block_hashes=[12],
            parent_block_hash=11,
            token_ids=[48, 49, 50, 51],
            extra_keys=[("img-hash",)],
            **common,
            **kind,
        ),
    ]
    assert reference_events(mirror) == snapshot_events(mirror)
