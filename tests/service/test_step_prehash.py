"""A Step's prompts hashed beside the loop (``KVCacheServicer._prehash``) change nothing a caller
can see: a Step of many lookups (packed and varint prompts, good ones among bad ones: a negative
id, 2^31, a bad length, both fields, empty, too long; LoRA, a cache salt, an empty salt; repeats)
with admissions between them answers, ends in the state and publishes the events of the same ops
sent one unary call at a time; on the hybrid whose hash block size is below a group's block size
too, and under every hash rule (compiled or not). Concurrent clients' Steps, snapshots, takes and
resets keep every watcher's mirror equal to the server's cached set, and a snapshot asked for
after a Step's answer is at or past that Step's head. Stopping a server while Steps of many
prompts are in flight ends them and the hashing thread."""

from __future__ import annotations

import asyncio
import random
import struct
import threading

import grpc
import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb
from kvservice_client.hashing import DEFAULT_HASH_SEED, BlockHasher
from tests.service.helpers import Mirror, flat_events, next_batch, pool_hashes, without_epoch
from tests.service.test_step_equivalence import run_one, server_state

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 64


def packed(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def lookup(rid: str, ids: list[int] | None = None, data: bytes | None = None, **fields) -> pb.StepOp:
    request = pb.GetComputedBlocksRequest(request_id=rid, **fields)
    if ids is not None:
        request.prompt_token_ids.extend(ids)
    if data is not None:
        request.packed_prompt_token_ids = data
    return pb.StepOp(get_computed_blocks=request)


def admit(rid: str, n: int) -> pb.StepOp:
    return pb.StepOp(allocate_slots=pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=n))


def mixed_ops(seed: int) -> tuple[list[pb.StepOp], dict[str, list[int]]]:
    """Lookups of shared-prefix prompts (half packed), admissions that make later lookups hit,
    and lookups that must fail (each names the field its caller set); the good prompts by id."""
    rng = random.Random(seed)
    families = [[700 * f + t for t in range(16)] for f in range(1, 4)]
    waiter = families[1][:8] + [5, 6]  # looked up, never admitted
    ops: list[pb.StepOp] = [lookup("waiter", data=packed(waiter))]
    good: dict[str, list[int]] = {"waiter": waiter}
    for i in range(60):
        rid = f"r{i}"
        ids = rng.choice(families)[: rng.choice([0, 4, 8, 12, 16])] + [
            rng.randrange(1, 99) for _ in range(rng.randint(1, 20))
        ]
        if rng.random() < 0.5:
            ops.append(lookup(rid, data=packed(ids)))
        else:
            ops.append(lookup(rid, ids))
        good[rid] = ids
        if rng.random() < 0.4:
            ops.append(admit(rid, len(ids)))
    shared = families[0][:12]
    bad = [
        lookup("neg-varint", shared[:5] + [-3] + shared[6:]),
        lookup("neg-packed", data=packed(shared[:5] + [-3] + shared[6:])),
        lookup("neg-tail-packed", data=packed(shared + [5, -1])),  # past the last full block: not hashed
        lookup("big-varint", shared + [2**31]),
        lookup("huge-varint", shared + [2**63 - 1]),
        lookup("min-varint", [-(2**63)] + shared),
        lookup("odd-packed", data=packed(shared) + b"\1"),
        lookup("both", shared, data=packed(shared)),
        lookup("empty"),
        lookup("long-varint", list(range(MAX_MODEL_LEN + 1))),
        lookup("long-packed", data=packed(list(range(MAX_MODEL_LEN + 1)))),
        lookup("bad-mode", shared, kv_cache_report_mode=99),
        lookup("waiter", [1, 2, 3]),  # registered with another prompt
    ]
    extra = [
        lookup("lora", shared + [9], lora=pb.LoRA(lora_id=3, lora_name="x")),
        lookup("salted", data=packed(shared + [9]), cache_salt="s"),
        lookup("empty-salt", data=packed(shared + [9]), cache_salt=""),  # an empty salt is no salt
        lookup("zero-max", [0, 2**31 - 1, 0, 2**31 - 1, 7]),
    ]
    good.update({"empty-salt": shared + [9], "zero-max": [0, 2**31 - 1, 0, 2**31 - 1, 7]})
    for op in bad + extra:  # spread among the good ones
        ops.insert(rng.randrange(len(ops) + 1), op)
    ops.append(lookup("waiter", waiter))  # a waiting request again, the same prompt (as varints)
    return ops, good


@pytest.mark.parametrize(
    ("layout", "hash_algorithm", "hash_seed"),
    [
        ("single", "sha256_cbor", DEFAULT_HASH_SEED),
        ("single", "sha256_cbor", "another seed"),
        ("single", "sha256", DEFAULT_HASH_SEED),
        ("single", "xxhash", DEFAULT_HASH_SEED),
        ("gcd", "sha256_cbor", DEFAULT_HASH_SEED),
    ],
)
async def test_a_step_of_many_mixed_lookups_equals_them_one_unary_call_at_a_time(
    start_kv_server, connect, tmp_path, layout, hash_algorithm, hash_seed
):
    settings: dict = {
        "num_blocks": 80,
        "max_model_len": MAX_MODEL_LEN,
        "hash_algorithm": hash_algorithm,
        "hash_seed": hash_seed,
    }
    if layout == "gcd":
        # Full attention at 8 KV heads beside a sliding window at 16: the full group's page is
        # half the window's, so its blocks hold twice the tokens (8) and blocks are hashed at 4.
        path = tmp_path / "gcd.toml"
        path.write_text(
            'max_model_len = 64\nblock_size = 4\n[[layers]]\nkind = "full_attention"\ncount = 2\n'
            'num_kv_heads = 8\nhead_size = 128\n[[layers]]\nkind = "sliding_window"\ncount = 2\n'
            "num_kv_heads = 16\nhead_size = 128\nsliding_window = 16\n"
        )
        settings["kv_cache_layout"] = str(path)
    stepped, single = await start_kv_server(**settings), await start_kv_server(**settings)
    if layout == "gcd":
        sizes = list(stepped.engine.manager.coordinator.block_sizes)
        assert sorted(sizes) == [4, 8] and stepped.engine.manager.hash_block_size == 4
    step_client, single_client = await connect(stepped), await connect(single)
    ops, good = mixed_ops(seed=5)
    step_results = list((await step_client.step(ops)).results)
    one_by_one = [await run_one(single_client, op) for op in ops]
    assert len(step_results) == len(ops)
    pairs = zip(without_epoch(step_results, stepped.event_log.epoch), without_epoch(one_by_one, single.event_log.epoch))
    for i, (a, b) in enumerate(pairs):
        assert a == b, f"op {i} ({ops[i]}): {a} != {b}"
    errors = {
        op.get_computed_blocks.request_id: r.error.message
        for op, r in zip(ops, step_results)
        if r.HasField("error") and op.WhichOneof("op") == "get_computed_blocks"
    }
    limit = "outside 0..2147483647"
    assert errors == {
        "neg-varint": f"prompt_token_ids: token id -3 {limit}",
        "neg-packed": f"packed_prompt_token_ids: token id -3 {limit}",
        "neg-tail-packed": f"packed_prompt_token_ids: token id -1 {limit}",
        "big-varint": f"prompt_token_ids: token id 2147483648 {limit}",
        "huge-varint": f"prompt_token_ids: token id {2**63 - 1} {limit}",
        "min-varint": f"prompt_token_ids: token id {-(2**63)} {limit}",
        "odd-packed": errors["odd-packed"],
        "both": errors["both"],
        "empty": f"prompt_token_ids: length 0 outside 1..{MAX_MODEL_LEN} (max_model_len)",
        "long-varint": f"prompt_token_ids: length {MAX_MODEL_LEN + 1} outside 1..{MAX_MODEL_LEN} (max_model_len)",
        "long-packed": f"packed_prompt_token_ids: length {MAX_MODEL_LEN + 1} outside 1..{MAX_MODEL_LEN} (max_model_len)",
        "bad-mode": "kv_cache_report_mode: unknown value 99",
        "waiter": "request_id 'waiter' is already registered with another prompt or options",
    }
    assert (
        errors["odd-packed"] == "packed_prompt_token_ids: 49 bytes, not a multiple of 4 (little-endian int32 token ids)"
    )
    assert errors["both"] == "packed_prompt_token_ids: set with 12 prompt_token_ids: set one of the two"
    assert await server_state(stepped, step_client) == await server_state(single, single_client)
    hasher = BlockHasher(stepped.engine.manager.hash_block_size, hash_algorithm, hash_seed)
    assert hasher.root_hash != BlockHasher(4, hash_algorithm).root_hash or hash_seed == DEFAULT_HASH_SEED
    for rid, ids in good.items():
        assert stepped.engine.requests[rid].block_hashes == hasher.hash_prompt(ids), rid
        assert stepped.engine.requests[rid].block_hashes == single.engine.requests[rid].block_hashes, rid
    for rid in ("lora", "salted"):
        assert stepped.engine.requests[rid].block_hashes == single.engine.requests[rid].block_hashes, rid
    step_events = flat_events((await step_client.take_events("all", start_seq=1)).batches)
    assert step_events == flat_events((await single_client.take_events("all", start_seq=1)).batches)
    assert len(step_events) > 10

    # Hashed ahead: every lookup with no LoRA and no non-empty salt, a known report mode and a
    # prompt within max_model_len, packed or varints all in range; none under a rule the compiled
    # chain does not cover.
    def hashed_ahead(op: pb.StepOp) -> bool:
        request = op.get_computed_blocks
        if op.WhichOneof("op") != "get_computed_blocks" or request.HasField("lora") or request.cache_salt:
            return False
        modes = (pb.KV_CACHE_REPORT_MODE_UNSPECIFIED, pb.KV_CACHE_REPORT_MODE_INCREMENTAL, pb.KV_CACHE_REPORT_MODE_FULL)
        if request.kv_cache_report_mode not in modes:  # refused before its prompt is read
            return False
        data, ids = request.packed_prompt_token_ids, list(request.prompt_token_ids)
        if len(data) > 4 * MAX_MODEL_LEN or len(ids) > MAX_MODEL_LEN:  # refused whatever its ids
            return False
        return bool(data) != bool(ids) and all(0 <= t < 2**31 for t in ids)

    num_ahead = sum(map(hashed_ahead, ops))
    expected = 0 if hash_algorithm == "xxhash" else num_ahead
    assert stepped.servicer.num_prompts_hashed_ahead == expected and single.servicer.num_prompts_hashed_ahead == 0
    stepped.engine.check_invariants()


class Scheduler:
    """One client's seeded Steps: many lookups (packed or varint) with admissions, frees and now
    and then a reset; after every answer, a snapshot asked for (a stream's or a take's) is at or
    past the answer's head."""

    def __init__(self, name: str, client, running, seed: int) -> None:
        self.name, self.client, self.running = name, client, running
        self.rng = random.Random(seed)
        self.families = [[900 * f + t for t in range(16)] for f in range(1, 5)]
        self.live: list[tuple[str, int]] = []  # (request id, prompt tokens) this scheduler holds
        self.next_id = 0
        self.num_snapshots = 0

    def _prompt(self) -> list[int]:
        rng = self.rng
        return rng.choice(self.families)[: rng.choice([0, 4, 8, 16])] + [
            rng.randrange(1, 60) for _ in range(rng.randint(1, 12))
        ]

    async def run(self, num_steps: int) -> None:
        rng, client = self.rng, self.client
        for _ in range(num_steps):
            ops: list[pb.StepOp] = []
            for rid, _ in self.live[: rng.randint(0, len(self.live))]:
                ops.append(pb.StepOp(free=pb.FreeRequest(request_id=rid)))
            self.live = self.live[len(ops) :]
            for _ in range(rng.randint(2, 24)):
                rid = f"{self.name}-{self.next_id}"
                self.next_id += 1
                ids = self._prompt()
                ops.append(lookup(rid, data=packed(ids)) if rng.random() < 0.5 else lookup(rid, ids))
                if rng.random() < 0.5:
                    ops.append(admit(rid, len(ids)))
                self.live.append((rid, len(ids)))
            if rng.random() < 0.05:
                ops.append(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
            response = await client.step(ops)
            errors = [r.error for r in response.results if r.HasField("error")]
            assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for e in errors), errors
            roll = rng.random()
            if roll < 0.15:  # a snapshot asked for after the answer is cut at or past its head
                taken = await client.take_events(f"{self.name}-t{self.num_snapshots}", snapshot=True)
                assert taken.batches[0].snapshot and taken.batches[0].seq >= response.head_seq
                self.num_snapshots += 1
            elif roll < 0.3:
                stream = client.stream_events(snapshot=True)
                first = await next_batch(stream)
                assert first.snapshot and first.seq >= response.head_seq
                await stream.aclose()
                self.num_snapshots += 1
        for rid, _ in self.live:
            await client.free(rid)
        self.live = []


async def catch_up(stream, mirror: Mirror, head_seq: int) -> None:
    while mirror.last_seq != head_seq:
        mirror.apply(await next_batch(stream))


async def test_concurrent_steps_of_many_prompts_keep_every_watcher_equal_to_the_cached_set(start_kv_server, connect):
    running = await start_kv_server(num_blocks=48, max_model_len=MAX_MODEL_LEN, max_num_requests=4096)
    num_groups = running.engine.manager.num_groups
    clients = [await connect(running) for _ in range(4)]
    watcher_client, late_client, taker = [await connect(running) for _ in range(3)]
    early = watcher_client.stream_events(snapshot=True)
    early_mirror = Mirror(num_groups)
    early_mirror.apply(await next_batch(early))
    schedulers = [Scheduler(f"c{i}", c, running, seed=i) for i, c in enumerate(clients)]
    await asyncio.gather(*(s.run(25) for s in schedulers))
    late = late_client.stream_events(snapshot=True)
    late_mirror = Mirror(num_groups)
    snap = await next_batch(late)
    assert snap.snapshot and snap.seq == running.event_log.head_seq
    late_mirror.apply(snap)
    taken = await taker.take_events("take", snapshot=True)
    take_mirror = Mirror(num_groups)
    for batch in taken.batches:
        take_mirror.apply(batch)
    await asyncio.gather(*(s.run(15) for s in schedulers))
    head = running.event_log.head_seq
    for stream, mirror in ((early, early_mirror), (late, late_mirror)):
        await catch_up(stream, mirror, head)
    while take_mirror.last_seq != head:
        for batch in (await taker.take_events("take")).batches:
            take_mirror.apply(batch)
    expected = pool_hashes(running)
    assert running.snapshots.cached_hashes() == running.snapshots.mirror.cached_hashes() == expected
    for mirror in (early_mirror, late_mirror, take_mirror):
        assert mirror.groups == expected
    assert sum(s.num_snapshots for s in schedulers) > 10
    assert running.servicer.num_prompts_hashed_ahead > 500
    assert running.engine.requests == {}
    running.engine.check_invariants()


def hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvservice-hash")]


async def test_stopping_with_steps_of_thousands_of_prompts_in_flight_ends_them_and_the_hash_thread(
    start_kv_server, connect
):
    before = hash_threads()
    running = await start_kv_server(num_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_requests=1 << 16)
    clients = [await connect(running) for _ in range(4)]
    rng = random.Random(11)

    def big_step(k: int) -> list[pb.StepOp]:  # 2000 prompts of 60 tokens: 120,000 tokens, under max_step_tokens
        ops = []
        for i in range(2000):
            ids = [rng.randrange(0, 2**31) for _ in range(60)]
            ops.append(lookup(f"s{k}-{i}", data=packed(ids)) if i % 2 else lookup(f"s{k}-{i}", ids))
        return ops

    steps = [big_step(k) for k in range(8)]
    first = await clients[0].step(steps[0])  # the hash thread exists and has hashed
    assert len(first.results) == 2000 and not any(r.HasField("error") for r in first.results)
    assert running.servicer.num_prompts_hashed_ahead == 2000 and len(hash_threads()) == len(before) + 1
    calls = [asyncio.ensure_future(clients[k % 4].step(steps[k])) for k in range(1, 8)]
    await asyncio.wait_for(running.stop(0.0), 30)  # a hang fails here
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:  # each answered whole, or ended by the stop
        if isinstance(outcome, BaseException):
            assert getattr(outcome, "code", None) in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), outcome
        else:
            assert len(outcome.results) == 2000 and not any(r.HasField("error") for r in outcome.results)
    assert running.servicer._hash_thread is None
    assert hash_threads() == before  # the hashing thread ended with the server


async def test_lookups_that_fail_before_their_prompt_is_read_are_not_hashed_ahead(start_kv_server, connect):
    """A lookup with an unknown kv_cache_report_mode (refused before its prompt is read) or a
    prompt above max_model_len (refused whatever its ids) is not hashed beside the loop: no
    thread work that nothing waits for is left behind a Step's answer (the next Step's lookups
    would wait behind it, and its prompts' bytes stay held until it is done), and the loop does
    not wait for a hash it throws away. The answers are those of the same ops one at a time."""
    stepped, single = [await start_kv_server(max_model_len=MAX_MODEL_LEN) for _ in range(2)]
    step_client, single_client = await connect(stepped), await connect(single)
    long_ids = list(range(MAX_MODEL_LEN + 1))
    ops = [lookup(f"mode{i}", data=packed(long_ids[:40]), kv_cache_report_mode=7) for i in range(3)]
    ops += [lookup(f"long{i}", data=packed(long_ids)) for i in range(2)]
    ops += [lookup(f"long-varint{i}", long_ids) for i in range(2)]
    step_results = list((await step_client.step(ops)).results)
    assert step_results == [await run_one(single_client, op) for op in ops]
    assert [r.error.message for r in step_results] == ["kv_cache_report_mode: unknown value 7"] * 3 + [
        f"packed_prompt_token_ids: length {MAX_MODEL_LEN + 1} outside 1..{MAX_MODEL_LEN} (max_model_len)"
    ] * 2 + [f"prompt_token_ids: length {MAX_MODEL_LEN + 1} outside 1..{MAX_MODEL_LEN} (max_model_len)"] * 2
    assert stepped.servicer.num_prompts_hashed_ahead == 0
    # Beside two good lookups, the two good ones alone are hashed ahead.
    good = [lookup("a", data=packed([1, 2, 3, 4, 5])), lookup("b", [1, 2, 3, 4, 6])]
    results = (await step_client.step(ops[:1] + good[:1] + ops[3:4] + good[1:])).results
    assert [r.HasField("error") for r in results] == [True, False, True, False]
    assert stepped.servicer.num_prompts_hashed_ahead == 2


async def test_a_step_of_4096_prompts_at_max_step_tokens_hashes_each_as_the_rule(start_kv_server, connect):
    running = await start_kv_server(num_blocks=20, max_model_len=MAX_MODEL_LEN, max_num_requests=8192)
    client = await connect(running)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 2**31) for _ in range(MAX_MODEL_LEN)] for _ in range(4096)]  # 2^18 tokens
    ops = [lookup(f"p{i}", data=packed(ids)) if i % 2 else lookup(f"p{i}", ids) for i, ids in enumerate(prompts)]
    assert running.servicer.max_step_tokens == 1 << 18 == sum(map(len, prompts))
    results = (await client.step(ops)).results
    assert [r.get_computed_blocks.num_computed_tokens for r in results] == [0] * 4096
    assert running.servicer.num_prompts_hashed_ahead == 4096
    hasher = BlockHasher(4)
    for i, ids in enumerate(prompts):
        assert running.engine.requests[f"p{i}"].block_hashes == hasher.hash_prompt(ids)
    over = ops[:4095] + [lookup("one-more", data=packed(prompts[0] + [1]))]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.Step(pb.StepRequest(ops=over))
    assert err.value.details() == (
        "ops: 262145 tokens (prompt_token_ids, packed_prompt_token_ids and new_token_ids over all ops), above "
        "max_step_tokens 262144"
    )
    assert running.servicer.num_prompts_hashed_ahead == 4096 and len(running.engine.requests) == 4096


@pytest.mark.parametrize("layout", ["single", "full-sliding"])
async def test_steps_with_prompts_hashed_ahead_equal_the_same_steps_hashed_on_the_loop(
    start_kv_server, connect, layout
):
    """Many seeded Steps (lookups packed and varint, good and bad, admissions, decode ops that
    complete blocks and ones that do not, frees, resets) on a server that hashes prompts beside
    the loop and on a twin whose Steps hash every prompt on the loop: the same answers, state and
    events, Step after Step; every request's block hashes are the rule's over all its tokens."""
    from tests.service.helpers import FULL_SLIDING

    settings = {"num_blocks": 48, "max_model_len": MAX_MODEL_LEN, "max_num_requests": 4096}
    if layout == "full-sliding":
        settings |= FULL_SLIDING
    ahead, on_loop = await start_kv_server(**settings), await start_kv_server(**settings)
    on_loop.servicer._prehash = lambda kinds, subs: None  # the twin: no Step hashes ahead
    ahead_client, loop_client = await connect(ahead), await connect(on_loop)
    rng = random.Random(17)
    families = [[800 * f + t for t in range(16)] for f in range(1, 4)]
    registered: dict[str, int] = {}  # request id -> tokens so far (as the twin would track)
    running: list[str] = []
    next_id = 0
    kinds: set[str | None] = set()
    num_decoded = 0
    for step in range(40):
        ops: list[pb.StepOp] = []
        if running and rng.random() < 0.6:  # a decode op over the running requests
            ids = rng.sample(running, rng.randint(1, len(running)))
            counts = [rng.choice([1, 1, 2, 4]) for _ in ids]
            ids = [rid for rid, n in zip(ids, counts) if registered[rid] + n + 4 <= MAX_MODEL_LEN]
            counts = [n for rid, n in zip(ids, counts) if registered[rid] + n + 4 <= MAX_MODEL_LEN] if ids else []
            if ids:
                new = [rng.randrange(1, 60) for _ in range(sum(counts))]
                if step == 7:
                    new[0] = 2**31  # its request fails alone
                ops.append(
                    pb.StepOp(decode=pb.DecodeRequest(request_ids=ids, new_token_ids=new, num_new_token_ids=counts))
                )
        for _ in range(rng.randint(0, 12)):
            rid = f"q{next_id}"
            next_id += 1
            ids = rng.choice(families)[: rng.choice([0, 4, 8, 16])] + [
                rng.randrange(1, 60) for _ in range(rng.randint(1, 14))
            ]
            as_packed = rng.random() < 0.5
            if rng.random() < 0.1:  # a bad id (2^31 cannot be packed)
                ids[rng.randrange(len(ids))] = -1 if as_packed else rng.choice([-1, 2**31])
            ops.append(lookup(rid, data=packed(ids)) if as_packed else lookup(rid, ids))
            if rng.random() < 0.6:
                ops.append(admit(rid, len(ids)))
        for rid in rng.sample(running, min(len(running), rng.randint(0, 3))):
            ops.append(pb.StepOp(free=pb.FreeRequest(request_id=rid)))
        if rng.random() < 0.05:
            ops.append(pb.StepOp(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
        if rng.random() < 0.2:
            rng.shuffle(ops)
        a = await ahead_client.step(ops)
        b = await loop_client.step(ops)
        assert without_epoch(a.results, ahead.event_log.epoch) == without_epoch(b.results, on_loop.event_log.epoch), (
            f"step {step}"
        )
        kinds.update(r.WhichOneof("result") for r in a.results)
        num_decoded += sum(len(op.decode.request_ids) for op in ops if op.WhichOneof("op") == "decode")
        assert await server_state(ahead, ahead_client) == await server_state(on_loop, loop_client), f"step {step}"
        engine = ahead.engine
        registered = {rid: r.num_tokens for rid, r in engine.requests.items()}
        running = sorted(engine.running)
    assert ahead.servicer.num_prompts_hashed_ahead > 100 and on_loop.servicer.num_prompts_hashed_ahead == 0
    assert kinds >= {"get_computed_blocks", "allocate_slots", "decode", "free", "error"} and num_decoded > 50, (
        kinds,
        num_decoded,
    )
    events = flat_events((await ahead_client.take_events("all", start_seq=1)).batches)
    assert events == flat_events((await loop_client.take_events("all", start_seq=1)).batches) and len(events) > 50
    hasher = BlockHasher(ahead.engine.manager.hash_block_size)
    for rid, request in ahead.engine.requests.items():
        assert request.block_hashes == hasher.hash_prompt(request.all_token_ids), rid
