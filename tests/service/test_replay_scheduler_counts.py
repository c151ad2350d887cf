"""The replay scheduler's hit and prefill counts on a tiny pool with one recompute preemption.

A real server on port 0 (the default small server: block size 4, 16 blocks, so 15 usable) and
two requests of 20 prompt tokens (5 blocks each, no shared prefix) and 12 output tokens each,
both arriving at 0, budget 64 tokens per step:

* step 1 admits A and B (prefill 20 + 20 tokens, 10 blocks);
* their decodes grow them to 7 blocks each (step 6: 25 tokens); at step 10 (29 tokens) A takes its
  8th block (15 in use) and B's 8th does not fit: B, the newest, is preempted (its 28 computed
  tokens stay cached in 7 full blocks) and waits with 29 tokens (its prompt and 9 outputs);
* B's readmission hits its 28 cached tokens but needs one more block, which only A's free after
  A finishes (step 12) gives: at step 13 B is readmitted and prefills 1 token.

So the per-admission rate counts B's 28-token hit on its own recomputed prefix (28 of 69
admitted tokens), the first-admission rate counts 0 of the 40 prompt tokens, and 41 tokens were
prefilled.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

from kvservice.replay.runner import ModeRun, summarise
from kvservice.replay.scheduler import Admission, ReplayScheduler, SchedulerConfig
from kvservice.replay.traces import TraceRequest
from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb


async def test_a_readmission_hit_counts_per_admission_only(kv_server, client):
    requests = [
        TraceRequest("A", 0.0, array("i", range(1, 21)), 12),
        TraceRequest("B", 0.0, array("i", range(101, 121)), 12),
    ]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_report_mode="full")

    async def predict_no_hit(request, head_seq):  # summarise reports a watcher's agreement
        return (0,)

    stats = await ReplayScheduler(client, requests, config, predictor=predict_no_hit, max_model_len=64).run()
    assert stats.admissions == [
        Admission(0, "A", 20, 0, 0, False, (0,)),
        Admission(1, "B", 20, 0, 0, False, (0,)),
        Admission(1, "B", 29, 0, 28, True, (0,)),
    ]
    assert (stats.num_preemptions, stats.num_finished, stats.num_steps) == (1, 2, 16)
    assert stats.num_prefill_tokens == 20 + 20 + 1

    run = ModeRun(
        "full",
        stats,
        [SimpleNamespace(num_events=0, num_batches=0)],
        None,
        0,  # type: ignore[list-item]
        pool_blocks=15,
        block_size=4,
        usage=pb.GetUsageResponse(),
    )
    m = summarise(run, wall_time_s=stats.wall_time_s)
    assert (m.num_prompt_tokens, m.num_hit_tokens) == (69, 28)
    assert (m.num_first_admission_prompt_tokens, m.num_first_admission_hit_tokens) == (40, 0)
    assert m.first_admission_hit_rate_tokens_pct == 0.0
    assert m.hit_rate_tokens_pct == 100.0 * 28 / 69
    assert m.num_prefill_tokens == 41
    assert m.series == [(0, 0, 0), (1, 0, 0), (2, 0, 7)]
