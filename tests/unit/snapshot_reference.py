"""The snapshot cut as it was written block by block (before record segments), kept as the
reference the segment cut (:func:`kvservice.server.snapshot.snapshot_runs`) must equal, event for
event: ``tests/unit/test_snapshot_cut.py`` compares the two on random mirrors.

It reads a mirror's table as a Mapping (group_idx, hash) -> :data:`MirroredBlock`
(:class:`~kvservice.server.snapshot.BlockView`) and makes a tuple per block; its events are
lists of blocks, materialized by :func:`reference_materialize`. Not for production: a block's
tuple costs about a microsecond, which is what the segment cut removes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvservice.server.snapshot import YIELD_EVERY_TOKENS, MirroredBlock
from kvservice.server.snapshot.mirror import (
    BLOCK_SIZE,
    EXTRA_KEYS,
    HAS_EXTRA_KEYS,
    LORA_ID,
    LORA_NAME,
    MEDIUM,
    PARENT,
    TOKEN_IDS,
)
from kvservice_client.events import AllBlocksCleared, BlockStored, KVEvent

ReferenceRun = tuple[int, bool, list, list] | None
"""None (AllBlocksCleared) or (group_idx, reused, hashes, blocks), parent first."""


def _same_kind(a: MirroredBlock, b: MirroredBlock) -> bool:
    return bool(
        a[BLOCK_SIZE] == b[BLOCK_SIZE]
        and a[LORA_ID] == b[LORA_ID]
        and a[LORA_NAME] == b[LORA_NAME]
        and a[MEDIUM] == b[MEDIUM]
        and a[HAS_EXTRA_KEYS] == b[HAS_EXTRA_KEYS]
    )


def _runs(g: int, reused: bool, hashes: list, blocks: list) -> Iterator[ReferenceRun]:
    """A chain as events: split where the kind changes, then every ``YIELD_EVERY_TOKENS`` tokens."""
    start = 0
    for end in range(1, len(blocks) + 1):
        if end < len(blocks) and _same_kind(blocks[end - 1], blocks[end]):
            continue
        step = max(1, YIELD_EVERY_TOKENS // blocks[start][BLOCK_SIZE])
        for i in range(start, end, step):
            yield g, reused, hashes[i : min(i + step, end)], blocks[i : min(i + step, end)]
        start = end


def _continues(before: MirroredBlock, before_hash: Any, block: MirroredBlock) -> bool:
    return bool(
        block[PARENT] == before_hash
        and block[BLOCK_SIZE] == before[BLOCK_SIZE]
        and block[LORA_ID] == before[LORA_ID]
        and block[LORA_NAME] == before[LORA_NAME]
        and block[MEDIUM] == before[MEDIUM]
        and block[HAS_EXTRA_KEYS] == before[HAS_EXTRA_KEYS]
    )


def reference_snapshot_runs(table: Mapping, group_idxs: tuple[int, ...] | None) -> Iterator[ReferenceRun]:
    """AllBlocksCleared; half 1: each block not yet sent, in table order, with its ancestors up to
    one sent (or absent, or block 0), root first, consecutive chains of one kind in one run; half
    2: the table in order, runs of a chain listed child first, reversed."""
    yield None
    emitted: dict[int, dict[Any, None]] = {}
    run_g = -1
    run_hashes: list = []
    run_blocks: list = []
    for (g, h), block in table.items():
        if group_idxs is not None and g not in group_idxs:
            continue
        seen = emitted.setdefault(g, {})
        if h in seen:
            continue
        chain_hashes = [h]
        chain_blocks = [block]
        parent = block[PARENT]
        while parent is not None and parent not in seen:
            above = table.get((g, parent))
            if above is None:
                break
            chain_hashes.append(parent)
            chain_blocks.append(above)
            parent = above[PARENT]
        chain_hashes.reverse()
        chain_blocks.reverse()
        seen.update(dict.fromkeys(chain_hashes))
        if run_blocks and run_g == g and _continues(run_blocks[-1], run_hashes[-1], chain_blocks[0]):
            run_hashes.extend(chain_hashes)
            run_blocks.extend(chain_blocks)
        else:
            if run_blocks:
                yield from _runs(run_g, False, run_hashes, run_blocks)
            run_g, run_hashes, run_blocks = g, chain_hashes, chain_blocks
    if run_blocks:
        yield from _runs(run_g, False, run_hashes, run_blocks)
    run_hashes, run_blocks = [], []
    for (g, h), block in table.items():
        if group_idxs is not None and g not in group_idxs:
            continue
        if run_blocks and run_g == g and _continues(block, h, run_blocks[-1]):
            run_hashes.append(h)
            run_blocks.append(block)
        else:
            if run_blocks:
                yield from _runs(run_g, True, run_hashes[::-1], run_blocks[::-1])
            run_g, run_hashes, run_blocks = g, [h], [block]
    if run_blocks:
        yield from _runs(run_g, True, run_hashes[::-1], run_blocks[::-1])


def reference_materialize(
    item: ReferenceRun, group_kinds: Sequence[str | None], group_windows: Sequence[int | None]
) -> KVEvent:
    if item is None:
        return AllBlocksCleared()
    g, reused, hashes, blocks = item
    first = blocks[0]
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=first[PARENT],
        token_ids=memoryview(b"".join([block[TOKEN_IDS] for block in blocks])).cast("q").tolist(),
        block_size=first[BLOCK_SIZE],
        lora_id=first[LORA_ID],
        medium=first[MEDIUM],
        lora_name=first[LORA_NAME],
        extra_keys=[block[EXTRA_KEYS] for block in blocks] if first[HAS_EXTRA_KEYS] else None,
        group_idx=g,
        kv_cache_spec_kind=group_kinds[g],
        kv_cache_spec_sliding_window=group_windows[g],
        reused=reused,
    )


def reference_events(mirror: Any, group_idxs: tuple[int, ...] | None = None) -> list[KVEvent]:
    """The snapshot's events as the block-by-block cut gives them."""
    return [
        reference_materialize(item, mirror.group_kinds, mirror.group_windows)
        for item in reference_snapshot_runs(mirror.view(), group_idxs)
    ]
