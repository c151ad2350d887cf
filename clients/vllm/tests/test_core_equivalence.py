"""kvservice's engine against vLLM 0.33's own ``KVCacheManager``, side by side, in process.

Seeded random op sequences (prompts sharing prefixes; admissions taking hits, with a connector's
external tokens, an asynchronous load (delay_cache_blocks, then cache_blocks), the full-sequence
gate, the watermark and the reserve; chunked prefill, decodes with lookahead and speculative tokens
rolled back, tokens in flight; finishes, preemptions, deferred frees (pop_blocks_for_free, then
block_pool.free_blocks), evict_blocks, reset_prefix_cache) drive vLLM's manager with vLLM's
``Request`` objects and the engine with the scheduler-owned calls at the same counts, as
``kvservice_vllm``'s remote manager sends them (the tokens and vLLM's own hashes as deltas; after a
refusal that was not the full-sequence gate's, the skipped blocks vLLM frees before its check freed
with remove_skipped_blocks). After every op both must agree exactly: refusals, new block ids, hits,
every request's table, the free queue (order included), every block's ref count and hash, the
cached tokens per request and the blocks a request still needs.

Full attention, separately a sliding window (8 tokens), and the two as a hybrid, at block size 4;
pools of 4 to 19 usable blocks, so refusals, evictions and preemptions are common. Scripted tests
cover the paths random runs reach least (a refused decode whose skipped blocks vLLM frees, the
window's admission cap, a connector's tokens past the window). Runs only where vLLM imports
(``scripts/setup_vllm.sh`` makes ``.venv-vllm``):
``.venv-vllm/bin/python -m pytest clients/vllm/tests/test_core_equivalence.py``.

Evictions (a connector's invalid blocks) take blocks requests hold and free cached ones alike: both
leave a free block where it is in the free queue (``test_evicting_a_free_cached_block_leaves_it_in_place``
reproduces the one difference these runs found, fixed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402  (vLLM's specs take a torch dtype)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFull  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig as VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroup  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSliding  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvservice.core.engine import EngineLimits, KVCacheEngine  # noqa: E402
from kvservice.core.kv_cache_manager import KVCacheManager  # noqa: E402
from kvservice.core.kv_cache_spec import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4
WINDOW = 8
MAX_MODEL_LEN = 64
init_none_hash(sha256)  # vLLM's hashes (sha256 of its none-hash seed): 32-byte digests, as the engine's rule
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)
PREFIXES = [list(range(1000, 1000 + n)) for n in (0, 4, 8, 12, 16, 20)] + [list(range(2000, 2012))]
"""Prompts start with one of these, so hits are common; tails are drawn from 4 token ids."""


def _specs(kind: str) -> tuple[Any, Any]:
    if kind == "hybrid":
        full_pair, sliding_pair = _specs("full"), _specs("sliding_window")
        return (full_pair[0], sliding_pair[0]), (full_pair[1], sliding_pair[1])
    if kind == "full":
        return VllmFull(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float16), FullAttentionSpec(
            BLOCK_SIZE, 1, 1, "float16"
        )
    return (
        VllmSliding(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float16, sliding_window=WINDOW),
        SlidingWindowSpec(BLOCK_SIZE, 1, 1, "float16", sliding_window=WINDOW),
    )


class Divergence(AssertionError):
    """vLLM's manager and the engine disagree (the message holds the op log)."""


@dataclass
class Pair:
    """vLLM's manager and the engine over the same pool, and the requests both hold."""

    kind: str
    num_blocks: int
    watermark: float = 0.0
    max_in_flight_tokens: int | None = None
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        vllm_specs, specs = _specs(self.kind)
        if not isinstance(specs, tuple):
            vllm_specs, specs = (vllm_specs,), (specs,)
        self.vllm = VllmManager(
            VllmConfig(
                num_blocks=self.num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[VllmGroup([f"l{i}"], spec) for i, spec in enumerate(vllm_specs)],
            ),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            max_in_flight_tokens=self.max_in_flight_tokens,
            enable_caching=True,
            watermark=self.watermark,
        )
        groups = tuple(KVCacheGroupSpec((f"l{i}",), spec) for i, spec in enumerate(specs))
        manager = KVCacheManager(KVCacheConfig(self.num_blocks, groups), MAX_MODEL_LEN)
        self.engine = KVCacheEngine(manager, EngineLimits(max_num_requests=1024, max_waiting_tokens=None))
        self.requests: dict[str, Request] = {}
        self.synced: dict[str, tuple[int, int]] = {}
        self.popped: list[list[int]] = []
        """Blocks taken off tables by pop_blocks_for_free, not freed yet (ids, in table order)."""

    # -- the scheduler's view -----------------------------------------------------------------

    def new_request(self, request_id: str, prompt: Sequence[int]) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=64), None, block_hasher=HASHER)
        self.requests[request_id] = request
        self.note(f"new {request_id} {list(prompt)}")
        return request

    def sync(self, request: Request) -> None:
        """What the remote manager sends before a call: the tokens and hashes the engine lacks."""
        rid = request.request_id
        tokens, hashes = list(request.all_token_ids), list(request.block_hashes)
        held = self.synced.get(rid)
        if held is None:
            self.engine.update_request(
                rid,
                num_tokens_kept=0,
                token_ids=tokens,
                num_block_hashes_kept=0,
                block_hashes=hashes,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        elif held != (len(tokens), len(hashes)):
            self.engine.update_request(
                rid,
                num_tokens_kept=held[0],
                token_ids=tokens[held[0] :],
                num_block_hashes_kept=held[1],
                block_hashes=hashes[held[1] :],
            )
        self.synced[rid] = (len(tokens), len(hashes))

    def note(self, line: str) -> None:
        self.log.append(line)

    def fail(self, what: str, vllm_value: Any, kvservice_value: Any) -> None:
        raise Divergence(
            f"{self.kind}, {self.num_blocks} blocks, watermark {self.watermark}, max_in_flight_tokens "
            f"{self.max_in_flight_tokens}: {what}: vLLM {vllm_value!r}, kvservice {kvservice_value!r}\nops:\n  "
            + "\n  ".join(self.log)
        )

    def same(self, what: str, vllm_value: Any, kvservice_value: Any) -> None:
        if vllm_value != kvservice_value:
            self.fail(what, vllm_value, kvservice_value)

    # -- the manager calls, on both ----------------------------------------------------------------

    def lookup(self, request: Request) -> tuple[Any, int]:
        blocks, hit, _ = self.vllm.get_computed_blocks(request)
        self.sync(request)
        answer = self.engine.find_cache_hit(request.request_id)
        self.same(
            f"hit of {request.request_id}",
            (hit, blocks.get_block_ids()),
            (answer.num_computed_tokens, answer.block_ids),
        )
        return blocks, hit

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        *,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> list[int] | None:
        """vLLM's allocate_slots on both; the new block ids (None: refused by both)."""
        rid = request.request_id
        self.note(
            f"allocate {rid} computed={request.num_computed_tokens} in_flight={request.num_in_flight_tokens} "
            f"new={num_new_tokens} hit={num_new_computed_tokens} lookahead={num_lookahead_tokens} "
            f"external={num_external_computed_tokens} delay={delay_cache_blocks} full={full_sequence_must_fit} "
            f"reserved={reserved_blocks} scheduled={has_scheduled_reqs} status={request.status.name}"
        )
        vllm_blocks = self.vllm.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            0,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.vllm.watermark_blocks
        self.sync(request)
        hit_ids = (
            new_computed_blocks.get_block_ids() if new_computed_blocks is not None and num_new_computed_tokens else ()
        )
        result = self.engine.allocate_owned(
            rid,
            num_computed_tokens=request.num_computed_tokens,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            computed_block_ids=hit_ids,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
            max_in_flight_tokens=self.max_in_flight_tokens,
            reserved_blocks=reserved_blocks,
            watermark_blocks=watermark_blocks,
        )
        self.same(f"allocate_slots of {rid} answered", vllm_blocks is not None, result.allocated)
        if vllm_blocks is None:
            if not result.refused_full_sequence and rid in self.engine.running:
                # The remote manager's mirror of vLLM's freeing before its check (§3.9).
                total = min(
                    request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens, MAX_MODEL_LEN
                )
                self.engine.remove_skipped_blocks(rid, max(0, total - request.num_in_flight_tokens))
            self.note("  refused")
            return None
        new_ids = vllm_blocks.get_block_ids()
        self.same(f"new blocks of {rid}", new_ids, result.new_block_ids)
        self.note(f"  new {list(new_ids)}")
        return [i for ids in new_ids for i in ids]

    def free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.note(f"free {request.request_id} {status.name}")
        self.vllm.free(request)
        self.engine.free_owned(request.request_id, forget=request.is_finished())
        if request.is_finished():
            self.forget(request)

    def pop(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        blocks = self.vllm.pop_blocks_for_free(request)
        ids = self.engine.pop_blocks_for_free(request.request_id, forget=request.is_finished())
        self.note(f"pop {request.request_id} {status.name} -> {ids}")
        self.same(f"blocks popped of {request.request_id}", [b.block_id for b in blocks], ids)
        self.popped.append(ids)
        if request.is_finished():
            self.forget(request)

    def free_popped(self, index: int) -> None:
        """vLLM's deferred free: block_pool.free_blocks of the popped blocks, tail first."""
        ids = self.popped.pop(index)
        self.note(f"free_blocks {list(reversed(ids))}")
        pool = self.vllm.block_pool
        pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
        self.engine.free_blocks(list(reversed(ids)))

    def forget(self, request: Request) -> None:
        self.requests.pop(request.request_id)
        self.synced.pop(request.request_id, None)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        self.note(f"cache_blocks {request.request_id} {num_tokens}")
        self.vllm.cache_blocks(request, num_tokens)
        self.sync(request)
        self.engine.cache_blocks(request.request_id, num_tokens)

    def evict(self, block_ids: list[int]) -> None:
        self.note(f"evict_blocks {block_ids}")
        self.vllm.evict_blocks(set(block_ids))
        self.engine.manager.evict_blocks(block_ids)

    def reset(self) -> None:
        self.note("reset_prefix_cache")
        self.same("reset_prefix_cache", self.vllm.reset_prefix_cache(), self.engine.reset_prefix_cache())

    # -- everything the two can be compared on ----------------------------------------------------

    def check(self) -> None:
        vllm_pool, pool = self.vllm.block_pool, self.engine.manager.block_pool
        self.same("free blocks", vllm_pool.get_num_free_blocks(), pool.get_num_free_blocks())
        self.same(
            "free queue",
            [b.block_id for b in vllm_pool.free_block_queue.get_all_free_blocks()],
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        )
        self.same(
            "blocks (ref count, hash)",
            [
                (b.ref_cnt, get_block_hash(b.block_hash) if b.block_hash is not None else None)
                for b in vllm_pool.blocks[1:]
            ],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks[1:]],
        )
        for rid, request in self.requests.items():
            self.same(f"table of {rid}", self.vllm.get_block_ids(rid), self.engine.manager.get_block_ids(rid))
            if rid in self.engine.running:
                self.same(
                    f"cached tokens of {rid}",
                    self.vllm.estimate_cached_tokens(request),
                    self.engine.estimate_cached_tokens(rid),
                )
                num_tokens = min(request.num_tokens + 4, MAX_MODEL_LEN)
                for cap in (False, True):
                    vllm_count = self.vllm.coordinator.get_num_blocks_to_allocate(
                        rid, num_tokens, self.vllm.empty_kv_cache_blocks.blocks, 0, request.num_computed_tokens,
                        request.num_computed_tokens, num_tokens, apply_admission_cap=cap,
                    )  # fmt: skip
                    count = self.engine.get_num_blocks_to_allocate(
                        rid,
                        num_tokens,
                        min(request.num_computed_tokens, MAX_MODEL_LEN),
                        apply_admission_cap=cap,
                        max_in_flight_tokens=self.max_in_flight_tokens,
                    )
                    self.same(f"blocks to allocate for {rid} (cap {cap})", vllm_count, count)
        self.engine.check_invariants()


# -- the random scheduler ------------------------------------------------------------------------


@dataclass
class Running:
    """What the random scheduler keeps of an admitted request."""

    request: Request
    loading: int = 0
    """Tokens an asynchronous load brings (delay_cache_blocks), 0 when none is pending."""
    last_scheduled: int = 0


def run_sequence(seed: int, kind: str) -> Pair:
    """A seeded random sequence of scheduler steps on both managers; raises Divergence."""
    rng = random.Random(seed)
    pair = Pair(
        kind,
        num_blocks=rng.randint(5, 20),
        watermark=rng.choice([0.0, 0.0, 0.1, 0.25]),
        max_in_flight_tokens=rng.choice([None, 4, 8, 16]),
    )
    waiting: list[Request] = []
    running: dict[str, Running] = {}
    next_id = 0
    for _ in range(rng.randint(20, 70)):
        op = rng.choices(
            ["new", "admit", "step", "finish", "preempt", "pop", "free_popped", "evict", "reset", "load"],
            weights=[3, 4, 8, 1, 1, 1, 2, 1, 0.3, 2],
        )[0]
        if op == "new" and len(waiting) + len(running) < 8:
            prompt = rng.choice(PREFIXES) + [rng.randrange(4) for _ in range(rng.randint(0, 12))]
            if not prompt:
                prompt = [rng.randrange(4)]
            waiting.append(pair.new_request(f"r{next_id}", prompt))
            next_id += 1
        elif op == "admit" and waiting:
            request = waiting[rng.randrange(len(waiting))]
            blocks, hit = pair.lookup(request)
            remaining = request.num_tokens - hit
            external = 0
            if rng.random() < 0.25 and remaining > BLOCK_SIZE:
                external = rng.randrange(0, (remaining - 1) // BLOCK_SIZE + 1) * BLOCK_SIZE
            delay = external > 0 and rng.random() < 0.5
            num_new = 0 if delay else rng.randint(1, remaining - external)
            new_ids = pair.allocate(
                request,
                num_new,
                hit,
                blocks if hit else None,
                num_lookahead_tokens=rng.choice([0, 0, 0, 2, 4]),
                num_external_computed_tokens=external,
                delay_cache_blocks=delay,
                full_sequence_must_fit=rng.random() < 0.5,
                reserved_blocks=rng.choice([0, 0, 1, 2]),
                has_scheduled_reqs=rng.random() < 0.7,
            )
            if new_ids is not None:
                waiting.remove(request)
                request.status = RequestStatus.RUNNING
                entry = running[request.request_id] = Running(request)
                if delay:
                    entry.loading = hit + external
                else:
                    request.num_computed_tokens = hit + external + num_new
                    entry.last_scheduled = num_new
                    _sample(request, rng)
        elif op == "load" and any(e.loading for e in running.values()):
            entry = rng.choice([e for e in running.values() if e.loading])
            pair.cache_blocks(entry.request, entry.loading)
            entry.request.num_computed_tokens, entry.loading = entry.loading, 0
        elif op == "step" and running:
            entry = rng.choice(list(running.values()))
            request = entry.request
            if entry.loading or request.num_tokens >= MAX_MODEL_LEN - 8:
                continue
            # Async scheduling: the last step's tokens may still be in flight.
            request.num_in_flight_tokens = (
                min(entry.last_scheduled, request.num_computed_tokens) if rng.random() < 0.4 else 0
            )
            todo = request.num_tokens - request.num_computed_tokens
            drafts = rng.choice([0, 0, 1, 3]) if request.num_computed_tokens >= request.num_prompt_tokens else 0
            num_new = rng.randint(1, todo) + drafts if todo > 0 else 1 + drafts
            new_ids = pair.allocate(request, num_new, num_lookahead_tokens=rng.choice([0, 0, 0, 1, 4]))
            if new_ids is not None:
                before = request.num_computed_tokens
                request.num_computed_tokens += num_new
                entry.last_scheduled = num_new
                if drafts:  # speculative tokens: the rejected ones' computed count set back
                    accepted = rng.randint(0, drafts)
                    request.num_computed_tokens = before + num_new - drafts + accepted
                    for _ in range(accepted):
                        request.append_output_token_ids(rng.randrange(4))
                _sample(request, rng)
        elif op in ("finish", "preempt", "pop") and running:
            entry = running.pop(rng.choice(list(running)))
            request = entry.request
            request.num_in_flight_tokens = 0
            status = RequestStatus.FINISHED_STOPPED if op == "finish" or rng.random() < 0.5 else RequestStatus.PREEMPTED
            if op == "pop":
                pair.pop(request, status)
            else:
                pair.free(request, status)
            if status == RequestStatus.PREEMPTED:
                request.num_computed_tokens = 0
                request.num_preemptions += 1
                waiting.append(request)
        elif op == "free_popped" and pair.popped:
            pair.free_popped(rng.randrange(len(pair.popped)))
        elif op == "evict":
            # Blocks a request holds, and free cached ones.
            candidates = sorted(
                {
                    i
                    for e in running.values()
                    for ids in pair.engine.manager.get_block_ids(e.request.request_id)
                    for i in ids
                    if i
                }
                | {b.block_id for b in pair.engine.manager.block_pool.blocks if b.block_hash is not None}
            )
            if candidates:
                pair.evict(rng.sample(candidates, rng.randint(1, min(3, len(candidates)))))
        elif op == "reset":
            pair.reset()
        pair.check()
    return pair


def _sample(request: Request, rng: random.Random) -> None:
    """The model's output: a token for a request whose prompt is computed."""
    if request.num_computed_tokens >= request.num_tokens:
        request.append_output_token_ids(rng.randrange(4))


@pytest.mark.parametrize("seed", range(200))
def test_random_sequences_full_attention(seed):
    run_sequence(seed, "full")


@pytest.mark.parametrize("seed", range(200))
def test_random_sequences_sliding_window(seed):
    run_sequence(seed, "sliding_window")


@pytest.mark.parametrize("seed", range(100))
def test_random_sequences_hybrid(seed):
    run_sequence(seed, "hybrid")


# -- divergences, each in a few calls ------------------------------------------------------------


def _admitted(pair: Pair, request_id: str, prompt: Sequence[int]) -> Request:
    request = pair.new_request(request_id, prompt)
    blocks, hit = pair.lookup(request)
    assert pair.allocate(request, request.num_tokens - hit, hit, blocks if hit else None) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.RUNNING
    return request


def test_evicting_a_free_cached_block_leaves_it_in_place():
    pair = Pair("full", num_blocks=8)
    request = _admitted(pair, "a", range(1, 9))  # blocks 1, 2, cached
    pair.free(request, RequestStatus.FINISHED_STOPPED)  # free queue: 3..7, 2, 1
    pair.check()
    pair.evict([2])
    pair.check()


# -- scripted: the paths the random runs reach least -----------------------------------------------


def test_a_refused_decode_frees_the_skipped_blocks_in_both():
    """vLLM frees a window's skipped blocks before its check, also when it then refuses; the engine
    refuses changing nothing, and the remote manager's remove_skipped_blocks makes them equal."""
    pair = Pair("sliding_window", num_blocks=7)  # 6 usable
    a = _admitted(pair, "a", range(1, 17))  # 1..4
    _admitted(pair, "b", range(100, 108))  # 5, 6: none free
    a.append_output_token_ids(17)
    assert pair.allocate(a, 1, num_lookahead_tokens=12) is None  # 4 more blocks; skipping frees 2
    pair.check()
    assert pair.engine.manager.get_block_ids("a") == ([0, 0, 3, 4],)
    assert pair.allocate(a, 1) == [2]  # the freed blocks (2, then 1, at the tail): 2 taken
    pair.check()


def test_a_decode_fits_in_the_skipped_blocks_in_both():
    pair = Pair("sliding_window", num_blocks=7)
    a = _admitted(pair, "a", range(1, 17))
    _admitted(pair, "b", range(100, 108))
    a.append_output_token_ids(17)
    a.num_in_flight_tokens = 4  # 12 processed: one block skipped
    assert pair.allocate(a, 1) == [1]
    pair.check()
    a.num_in_flight_tokens = 0
    a.num_computed_tokens = 17
    a.append_output_token_ids(18)
    assert pair.allocate(a, 1, num_lookahead_tokens=3) == [2]  # 21 tokens: a sixth block
    pair.check()


@pytest.mark.parametrize("max_in_flight_tokens, admitted", [(None, False), (10, False), (4, True)])
def test_the_full_sequence_gate_counts_a_window_at_its_admission_cap_in_both(max_in_flight_tokens, admitted):
    pair = Pair("sliding_window", num_blocks=11, max_in_flight_tokens=max_in_flight_tokens)
    _admitted(pair, "hog", range(100, 120))  # 5 blocks: 5 free
    c = pair.new_request("c", range(1, 41))  # 10 blocks
    pair.lookup(c)
    assert (pair.allocate(c, 4, full_sequence_must_fit=True) is not None) is admitted
    pair.check()


def test_external_tokens_past_the_window_in_both():
    pair = Pair("sliding_window", num_blocks=11)
    c = pair.new_request("c", range(1, 25))
    pair.lookup(c)
    # A connector's 16 tokens: the first 9 are outside the window, so two positions are null.
    assert pair.allocate(c, 0, num_external_computed_tokens=16, delay_cache_blocks=True) == []
    assert pair.engine.manager.get_block_ids("c") == ([0, 0, 1, 2],)
    pair.check()
    pair.cache_blocks(c, 16)
    c.num_computed_tokens = 16
    c.status = RequestStatus.RUNNING
    assert pair.allocate(c, 8) == [3, 4]
    pair.check()
