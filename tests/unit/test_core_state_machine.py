"""Random scheduler sequences against the manager, checking its invariants after every step.

After every rule: the pool's own consistency check; ref count == number of holders; free + held
+ null == total; a block in two tables is a cached (shared) block; a mirror built only from the
taken events equals the cached hashes per group, and every BlockStored's hashes chain and match its
tokens (recomputed from the event alone).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvservice.core.kv_cache_manager import KVCacheManager, KVEventsConfig
from kvservice.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvservice_client.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice_client.hashing import BlockHasher

PREFIXES = [list(range(100, 100 + n)) for n in (0, 4, 8, 12, 16)] + [list(range(200, 212))]


def _config(kind: str) -> KVCacheConfig:
    full4 = FullAttentionSpec(4, 1, 1, "float16")
    specs = {
        "full": [full4],
        "full+sliding_window": [full4, SlidingWindowSpec(4, 1, 1, "float16", sliding_window=8)],
        "full+chunked_local": [full4, ChunkedLocalAttentionSpec(4, 1, 1, "float16", attention_chunk_size=8)],
        "full4+full8": [full4, FullAttentionSpec(8, 1, 1, "float16")],
    }[kind]
    return KVCacheConfig(24, tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


class ManagerMachine(RuleBasedStateMachine):
    kind = "full"

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(_config(self.kind), 256, kv_events=KVEventsConfig(block_hash_format="digest"))
        self.waiting: dict = {}
        self.running: dict = {}
        self.mirror: list[set[bytes]] = [set() for _ in range(self.manager.num_groups)]
        self.next_id = 0
        self.evicted_while_held: set[int] = set()
        self.hashers = {bs: BlockHasher(bs) for bs in self.manager.coordinator.block_sizes}

    # -- rules ------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 5), max_size=10),
        mode=st.sampled_from(["incremental", "full"]),
    )
    def new_request(self, prefix, tail, mode):
        tokens = prefix + tail
        if not tokens:
            tokens = [1]
        request = self.manager.new_request(
            f"r{self.next_id}", tokens, kv_cache_report_mode=mode, session_id=f"s{self.next_id % 3}"
        )
        self.next_id += 1
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def admit(self, data, chunk):
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        blocks, hit = self.manager.get_computed_blocks(request)
        num_new = min(chunk, request.num_tokens - hit)
        before = self._state()
        if self.manager.allocate_slots(request, num_new, hit, blocks) is not None:
            request.num_computed_tokens = hit + num_new
            self.running[request.request_id] = self.waiting.pop(request.request_id)
        else:
            assert self._state() == before, "a refused allocation changed something"
        self._apply_events()

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 5), min_size=1, max_size=3), chunk=st.integers(1, 20))
    def step(self, data, new_tokens, chunk):
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(new_tokens)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        before = self._state()
        if self.manager.allocate_slots(request, num_new) is not None:
            request.num_computed_tokens += num_new
        else:
            assert self._state() == before, "a refused allocation changed something"
        self._apply_events()

    def _state(self):
        m = self.manager
        tables = {rid: m.get_block_ids(rid) for rid in list(self.running) + list(self.waiting)}
        free = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
        return tables, free, len(m.block_pool.kv_event_queue)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def free(self, data):
        pool = {**self.running, **self.waiting}
        request_id = data.draw(st.sampled_from(sorted(pool)))
        self.manager.free(request_id)
        self.running.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self._apply_events()

    @rule(block_ids=st.sets(st.integers(1, 23), max_size=4), go=st.integers(0, 3))
    def evict(self, block_ids, go):
        if go:  # rarer than the scheduler's own calls
            return
        self.manager.evict_blocks(block_ids)
        # A held block whose hash is dropped stays shared by its holders.
        self.evicted_while_held |= {i for i in block_ids if self.manager.block_pool.blocks[i].ref_cnt > 0}
        self._apply_events()

    @rule(go=st.integers(0, 7))
    def reset(self, go):
        if go:  # rarer than the scheduler's own calls
            return
        held = any(b.ref_cnt for b in self.manager.block_pool.blocks if not b.is_null)
        assert self.manager.reset_prefix_cache() is (not held)
        self._apply_events()

    # -- the mirror -------------------------------------------------------------------------

    def _apply_events(self) -> None:
        for event in self.manager.take_events():
            if isinstance(event, AllBlocksCleared):
                for group in self.mirror:
                    group.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.mirror[event.group_idx], "BlockRemoved for an absent hash"
                    self.mirror[event.group_idx].remove(h)
            else:
                assert isinstance(event, BlockStored)
                self._check_chain(event)
                for h in event.block_hashes:
                    if event.reused:
                        assert h in self.mirror[event.group_idx], "reuse report of an absent hash"
                    else:
                        assert h not in self.mirror[event.group_idx], "BlockStored for a present hash"
                        self.mirror[event.group_idx].add(h)

    def _check_chain(self, event: BlockStored) -> None:
        bs = event.block_size
        assert len(event.token_ids) == len(event.block_hashes) * bs
        assert event.kv_cache_spec_kind is not None and event.session_id is not None
        hash_bs = self.manager.hash_block_size
        hasher = self.hashers[hash_bs]
        scale = bs // hash_bs
        parent = event.parent_block_hash[-32:] if event.parent_block_hash is not None else None
        for i, h in enumerate(event.block_hashes):
            parts = []
            for j in range(scale):
                lo = i * bs + j * hash_bs
                parent = hasher.hash_block(parent, event.token_ids[lo : lo + hash_bs], None)
                parts.append(parent)
            assert h == b"".join(parts), "hash does not chain from its parent and tokens"

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def manager_invariants(self):
        m = self.manager
        m.check_invariants()
        pool = m.block_pool
        held = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + held + 1 == pool.num_blocks
        owners: dict[int, set] = {}
        for manager in m.coordinator.managers:
            for request_id, blocks in manager.req_to_blocks.items():
                for b in blocks:
                    if not b.is_null:
                        owners.setdefault(b.block_id, set()).add(request_id)
        self.evicted_while_held &= set(owners)
        for block_id, requests in owners.items():
            if len(requests) > 1 and block_id not in self.evicted_while_held:
                assert pool.blocks[block_id].block_hash is not None, f"block {block_id} shared but not cached"
        for g, hash_map in enumerate(pool.cached_block_hash_to_block):
            assert set(hash_map.hashes()) == self.mirror[g], f"mirror of group {g} != cached set"


SETTINGS = settings(
    max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _machine(kind: str):
    cls = type(f"Machine_{kind}", (ManagerMachine,), {"kind": kind})
    cls.TestCase.settings = SETTINGS
    return cls.TestCase


TestFullAttention = _machine("full")
TestFullPlusSlidingWindow = _machine("full+sliding_window")
TestFullPlusChunkedLocal = _machine("full+chunked_local")
TestMixedBlockSizes = _machine("full4+full8")
