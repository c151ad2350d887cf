"""The blocks vLLM's workers store in place into the hosted pool are marked written by the
scheduler, once the step that computed their last token is back (``update_from_output``), on
the next round trip: before that a read by hash is FAILED_PRECONDITION, after it the read gets the
bytes written into the attached memory. Sync and async scheduling, preemption, the round trips
per step unchanged, and the gate (nothing is marked when the KV cache is not the pool).

The fake model: the test writes each block's bytes through the attached pool itself (as a
worker's forward would) and feeds vLLM's scheduler a made-up ``ModelRunnerOutput``.
"""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_none_hash_seed, get_request_block_hasher, init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

import kvservice_vllm
from kvservice_client import KVCacheClient, KVServiceError, StatusCode
from kvservice_client.data import read_blocks
from kvservice_client.torch_view import attach
from kvservice_vllm.drive import TraceItem, make_scheduler, model_runner_output, run_trace
from kvservice_vllm.embedded import EmbeddedServer
from kvservice_vllm.scheduler import kv_cache_on_pool

BLOCK = 16
POOL_WORKER = "kvservice_vllm.Worker"


class _Run:
    """A vLLM scheduler on a CPU kvservice server (port 0) whose pool the test writes through."""

    def __init__(self, *, num_blocks: int = 32, async_scheduling: bool = False, worker_cls: str = POOL_WORKER):
        init_none_hash(sha256)
        self.scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_model_len=512,
            max_num_batched_tokens=512,
            num_layers=2,
            async_scheduling=async_scheduling,
        )
        self.scheduler.vllm_config.parallel_config.worker_cls = worker_cls
        self.server = EmbeddedServer(
            self.scheduler.kv_cache_config,
            max_model_len=512,
            enable_prefix_caching=True,
            hash_algorithm=self.scheduler.cache_config.prefix_caching_hash_algo,
            hash_seed=get_none_hash_seed(),
            device="cpu",
        )
        self.manager = kvservice_vllm.install(self.scheduler, self.server.address)
        self.client = KVCacheClient(self.server.address)
        self.pool = attach(self.client)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.outputs: dict[str, list[int]] = {}

    def close(self) -> None:
        self.scheduler.shutdown()
        self.pool.close()
        self.client.close()
        self.server.stop()

    def add(self, request_id: str, prompt: list[int], num_output_tokens: int) -> Request:
        params = SamplingParams(max_tokens=num_output_tokens, ignore_eos=True)
        params.update_from_generation_config({}, None)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.outputs[request_id] = []
        self.scheduler.add_request(request)
        return request

    def forward(self, output) -> ModelRunnerOutput:
        """What the workers would do for ``output``: store every scheduled token's block (bytes
        named by its block id) and sample the next token where the prompt is done."""

        def sample(req_id: str, start: int, end: int) -> list[int]:
            ids = self.manager.get_block_ids(req_id)[0]
            for position in range(start // BLOCK, -(-end // BLOCK)):
                self.store(ids[position])
            return [7] if end >= self.scheduler.requests[req_id].num_prompt_tokens else []

        return model_runner_output(output, sample)

    def store(self, block_id: int) -> None:
        for view in self.pool.block_view(0, block_id):
            view.fill_(float(block_id))

    def read(self, block_hash: bytes) -> bytes | StatusCode:
        """The block's bytes read by hash, or the refusal's status."""
        try:
            (block,) = read_blocks(self.client, [(0, block_hash)])
        except KVServiceError as err:
            return err.code
        assert not block.evicted
        return block.data

    def expected(self, block_id: int) -> bytes:
        data = self.pool.block_bytes(0, block_id)
        assert data.count(0) < len(data)  # the test's bytes, not an empty block
        return data


@pytest.fixture
def run(request):
    runs: list[_Run] = []

    def make(**kwargs) -> _Run:
        runs.append(_Run(**kwargs))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def test_a_block_is_readable_by_hash_only_after_its_steps_output(run):
    r = run()
    request = r.add("a", list(range(1, 41)), 30)  # 40 tokens: blocks 0 and 1 full, block 2 holds 8
    step0 = r.scheduler.schedule()
    ids = r.manager.get_block_ids("a")[0]
    hashes = list(request.block_hashes)
    assert (len(ids), len(hashes)) == (3, 2)
    output = r.forward(step0)
    # The forward stored the bytes, its output is not back: the server cannot know.
    assert [r.read(h) for h in hashes] == [StatusCode.FAILED_PRECONDITION] * 2
    trips = r.manager.num_round_trips
    r.scheduler.update_from_output(step0, output)
    assert r.manager.num_round_trips == trips  # the marks wait for the next round trip
    assert [r.read(h) for h in hashes] == [StatusCode.FAILED_PRECONDITION] * 2
    step1 = r.scheduler.schedule()
    assert r.manager.num_round_trips == trips + 1  # the decode step's one round trip carried them
    assert [r.read(h) for h in hashes] == [r.expected(ids[0]), r.expected(ids[1])]
    assert (r.manager.num_blocks_reported_written, r.manager.num_blocks_written, r.manager.num_written_skipped) == (
        2,
        2,
        0,
    )
    # Block 2 fills at position 47: the 8th decode step computes it; readable after that step's output.
    step = step1
    for k in range(1, 9):
        r.scheduler.update_from_output(step, r.forward(step))
        step = r.scheduler.schedule()
        assert len(request.block_hashes) == (3 if k >= 7 else 2)
        third = r.read(request.block_hashes[2]) if k >= 7 else None
        assert third == (r.expected(ids[2]) if k == 8 else (StatusCode.FAILED_PRECONDITION if k == 7 else None)), k
    assert (r.manager.num_blocks_written, r.manager.num_written_skipped) == (3, 0)
    assert r.server.running.servicer.data_plane.num_blocks_marked_in_place == 3


def test_the_async_scheduler_marks_after_the_output_not_the_next_schedule(run):
    r = run(async_scheduling=True)
    request = r.add("a", list(range(1, 41)), 30)
    step0 = r.scheduler.schedule()
    out0 = r.forward(step0)
    ids = r.manager.get_block_ids("a")[0]
    hashes = list(request.block_hashes)
    step1 = r.scheduler.schedule()  # scheduled ahead: num_computed_tokens advanced, step 0 not back
    assert request.num_computed_tokens == 41
    assert [r.read(h) for h in hashes] == [StatusCode.FAILED_PRECONDITION] * 2
    r.scheduler.update_from_output(step0, out0)
    out1 = r.forward(step1)
    step2 = r.scheduler.schedule()
    assert [r.read(h) for h in hashes] == [r.expected(ids[0]), r.expected(ids[1])]
    assert (r.manager.num_blocks_written, r.manager.num_written_skipped) == (2, 0)
    # Block 2 (position 47) is computed by step 8: marked once step 8's output is in, which is
    # after step 9 was scheduled; the round trip of step 10's schedule carries it.
    in_flight = [(step1, out1), (step2, r.forward(step2))]
    for n in range(1, 10):
        done, out = in_flight.pop(0)
        r.scheduler.update_from_output(done, out)
        following = r.scheduler.schedule()  # step n + 2
        in_flight.append((following, r.forward(following)))
        assert r.manager.num_blocks_written == (3 if n >= 8 else 2), n
    assert r.read(request.block_hashes[2]) == r.expected(ids[2])
    assert r.manager.num_written_skipped == 0


def _preempting(r: _Run):
    """Two requests filling a 6-block pool (5 usable): at the next step "a" needs a block, so
    vLLM preempts "b" (the last admitted)."""
    a = r.add("a", list(range(1, 33)), 10)  # 32 tokens: 2 blocks, its first decode needs a third
    b = r.add("b", list(range(100, 140)), 10)  # 40 tokens: 3 blocks
    step0 = r.scheduler.schedule()
    assert sorted(step0.num_scheduled_tokens.items()) == [("a", 32), ("b", 40)]
    return a, b, step0


def test_a_request_preempted_after_its_output_keeps_what_it_computed(run):
    r = run(num_blocks=6)
    a, b, step0 = _preempting(r)
    b_ids = r.manager.get_block_ids("b")[0]
    a_ids = r.manager.get_block_ids("a")[0]
    r.scheduler.update_from_output(step0, r.forward(step0))
    step1 = r.scheduler.schedule()  # marks first, then b is preempted for a's block
    assert sorted(step1.preempted_req_ids) == ["b"]
    assert r.scheduler.requests["b"].num_computed_tokens == 0
    b_hashes = list(b.block_hashes)
    assert [r.read(h) for h in b_hashes] == [r.expected(b_ids[0]), r.expected(b_ids[1])]
    assert [r.read(h) for h in a.block_hashes] == [r.expected(a_ids[0]), r.expected(a_ids[1])]
    assert (r.manager.num_blocks_written, r.manager.num_written_skipped) == (4, 0)


def test_a_request_preempted_before_its_output_marks_nothing(run):
    r = run(num_blocks=6, async_scheduling=True)
    a, b, step0 = _preempting(r)
    out0 = r.forward(step0)
    a_ids = r.manager.get_block_ids("a")[0]
    step1 = r.scheduler.schedule()  # b preempted while step 0 runs: its blocks freed before the forward ended
    assert sorted(step1.preempted_req_ids) == ["b"]
    r.scheduler.update_from_output(step0, out0)
    r.scheduler.update_from_output(step1, r.forward(step1))
    r.scheduler.schedule()
    assert [r.read(h) for h in a.block_hashes[:2]] == [r.expected(a_ids[0]), r.expected(a_ids[1])]
    assert [r.read(h) for h in b.block_hashes] == [StatusCode.FAILED_PRECONDITION] * 2
    assert (r.manager.num_blocks_reported_written, r.manager.num_blocks_written, r.manager.num_written_skipped) == (
        2,
        2,
        0,
    )


ITEMS = [TraceItem(f"r{i}", list(range(i, i + 100)), [7] * 5, i) for i in range(6)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_round_trips_per_step_are_unchanged(run, async_scheduling):
    marking = run(num_blocks=256, async_scheduling=async_scheduling)
    plain = run(num_blocks=256, async_scheduling=async_scheduling, worker_cls="auto")
    assert (marking.manager.mark_blocks_written, plain.manager.mark_blocks_written) == (True, False)
    ours, theirs = run_trace(marking.scheduler, ITEMS), run_trace(plain.scheduler, ITEMS)
    assert ours.records == theirs.records
    assert ours.num_round_trips == theirs.num_round_trips
    # Every request computes 104 tokens (100 + 4 fed back): 6 full blocks each, no shared prefix;
    # the last output's marks go with the free at shutdown.
    marking.scheduler.shutdown()
    assert (marking.manager.num_blocks_written, marking.manager.num_written_skipped) == (36, 0)
    assert (
        plain.manager.num_blocks_reported_written,
        plain.server.running.servicer.data_plane.num_blocks_marked_in_place,
    ) == (0, 0)


def test_the_gate_follows_the_worker_class_and_the_setting():
    class Config:
        class parallel_config:  # noqa: N801  # vLLM's attribute name
            worker_cls = "auto"

    assert kv_cache_on_pool(Config, {}) is False
    Config.parallel_config.worker_cls = "kvservice_vllm.worker.Worker"
    assert kv_cache_on_pool(Config, {}) is True
    assert kv_cache_on_pool(Config, {"kv_cache_on_pool": "false"}) is False
    Config.parallel_config.worker_cls = "mypkg.Worker"
    assert kv_cache_on_pool(Config, {"kv_cache_on_pool": "true"}) is True
    with pytest.raises(ValueError, match="kv_cache_on_pool: 'maybe'; auto, true or false"):
        kv_cache_on_pool(Config, {"kv_cache_on_pool": "maybe"})
