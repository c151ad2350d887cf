"""``kvservice replay --instances N``: KV-aware routing over N embedded servers against round-robin.

A small synthetic token trace (:func:`write_conversation_trace`): 12 conversations of 10 turns,
every prompt starting with the same 2-block system prompt, each turn the previous turn's prompt
plus 3 blocks; the first turns of three conversations open together, the other turns follow in a
fixed shuffled order. A router that follows the mirrors sends every turn after the first to the
instance holding its history; round-robin scatters them. The replay is deterministic (one simulated clock, each routing decision
made once every mirror applied its instance's latest Step), so the figures are exact.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice.replay.multi import MultiReplayConfig, PolicyRun, load_scaled_requests, run_multi_replay
from kvservice.replay.multi_report import read_multi_json, render_multi_table, write_multi_json
from kvservice.replay.routing import grpc_stream_feed
from kvservice.replay.scheduler import SchedulerConfig

NUM_CONVERSATIONS = 12
NUM_TURNS = 10
NUM_REQUESTS = NUM_CONVERSATIONS * NUM_TURNS
BLOCK = 16  # llama-3-8b's block size, tokens


def write_conversation_trace(path: Path) -> Path:
    """The synthetic trace as token JSONL: requests 0-2 (first turns of conversations 0-2) arrive
    at 0 ms, request k > 2 at (k - 2) * 20 ms (one scheduler step apart)."""
    rng = random.Random(20240611)
    system = [rng.randrange(100_000) for _ in range(2 * BLOCK)]
    histories = [list(system) for _ in range(NUM_CONVERSATIONS)]
    rest = [c for c in range(NUM_CONVERSATIONS) for _ in range(NUM_TURNS - (c < 3))]
    rng.shuffle(rest)
    order = [0, 1, 2, *rest]
    lines = []
    for k, c in enumerate(order):
        histories[c] += [rng.randrange(100_000) for _ in range(3 * BLOCK)]
        lines.append(
            json.dumps(
                {
                    "token_ids": histories[c],
                    "timestamp": 20 * max(k - 2, 0),
                    "output_length": 4,
                    "session_id": f"conversation-{c}",
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return write_conversation_trace(tmp_path_factory.mktemp("trace") / "conversations.jsonl")


def config(trace: Path, **overrides) -> MultiReplayConfig:
    settings = dict(
        trace=str(trace),
        instances=3,
        num_blocks=400,
        rate_scale=1.0,
        mirror_capacity=0,
        show_progress=False,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    )
    settings.update(overrides)
    return MultiReplayConfig(**settings)


FEEDS_BUILT: list[tuple[int, object]] = []


def recording_feed(instance):
    """The gRPC feed, through the FeedFactory seam, noting what it built."""
    feed = grpc_stream_feed(instance)
    FEEDS_BUILT.append((instance.idx, feed))
    return feed


@pytest.fixture(scope="module")
def replayed(trace):
    """Both policies, in this process (the raw runs kept), on 3 instances of 400 blocks."""
    runs: list[PolicyRun] = []
    report = asyncio.run(run_multi_replay(config(trace), runs=runs, feed_factory=recording_feed))
    return report, {run.policy: run for run in runs}


def test_every_request_is_routed_once_and_served_once(replayed):
    report, runs = replayed
    for name, run in runs.items():
        assert sorted(d.index for d in run.decisions) == list(range(NUM_REQUESTS)), name
        first = [a.index for inst in run.instances for a in inst.scheduler.stats.admissions if not a.readmission]
        assert sorted(first) == list(range(NUM_REQUESTS)), name
        # Each request was admitted on the instance it was routed to.
        routed_to = {d.index: d.instance for d in run.decisions}
        for inst in run.instances:
            assert all(routed_to[a.index] == inst.idx for a in inst.scheduler.stats.admissions), name
        assert report.policy(name).num_requests == NUM_REQUESTS
        assert sum(report.policy(name).num_requests_per_instance) == NUM_REQUESTS
        assert run.num_skipped == 0 and report.policy(name).num_preemptions == 0


def test_round_robin_sends_request_i_to_instance_i_mod_n(replayed):
    _, runs = replayed
    decisions = runs["round-robin"].decisions
    assert [(d.index, d.instance) for d in decisions] == [(i, i % 3) for i in range(NUM_REQUESTS)]
    assert all(d.predicted_hit_tokens == () and d.reason == "round-robin" for d in decisions)


def test_routed_requests_go_to_an_instance_with_the_longest_predicted_hit(replayed, trace):
    _, runs = replayed
    decisions = runs["routed"].decisions
    for d in decisions:
        assert len(d.predicted_hit_tokens) == 3
        best = max(d.predicted_hit_tokens)
        assert d.predicted_hit_tokens[d.instance] == best, d
        if d.reason == "hit":
            assert d.predicted_hit_tokens.count(best) == 1, d
        else:
            assert d.predicted_hit_tokens.count(best) > 1, d
    # The opening burst meets three empty instances: a round-robin tie, then a load tie (instance 0
    # holds one request), then the least loaded. Every later turn of a conversation follows its
    # history, so it is decided by the hit.
    assert [(d.instance, d.reason) for d in decisions[:3]] == [(0, "round-robin"), (1, "round-robin"), (2, "load")]
    seen: set[int] = set()
    session = [json.loads(line)["session_id"] for line in trace.read_text().splitlines()]
    for d in decisions:
        if session[d.index] in seen:
            assert d.reason == "hit", d
        seen.add(session[d.index])


def test_routed_hit_rate_beats_round_robin_exactly(replayed):
    report, runs = replayed
    routed, rr = report.policy("routed"), report.policy("round-robin")
    assert (
        routed.num_prompt_tokens
        == rr.num_prompt_tokens
        == sum((2 + 3 * t) * BLOCK * NUM_CONVERSATIONS for t in range(1, NUM_TURNS + 1))
    )
    # Routed: every turn after the first hits its whole history (the previous turn's prompt);
    # a first turn hits the system prompt once its instance holds it.
    # Routed: every turn after the first hits its whole history (the previous turn's prompt), and
    # the 9 first turns after the opening burst hit the system prompt: the ideal but for the two
    # burst requests that arrived with the first one.
    history = sum((2 + 3 * (t - 1)) * BLOCK * NUM_CONVERSATIONS for t in range(2, NUM_TURNS + 1))
    assert routed.num_hit_tokens == history + 9 * 2 * BLOCK == 29_664
    assert (
        routed.num_hit_tokens
        == round(report.ideal_hit_rate_tokens_pct * routed.num_prompt_tokens / 100) - 2 * 2 * BLOCK
    )
    assert rr.num_hit_tokens == 21_504
    assert routed.num_requests_per_instance == rr.num_requests_per_instance == [40, 40, 40]
    assert routed.num_decisions_by_reason == {"hit": 108, "load": 6, "round-robin": 6}
    # Unbounded mirrors and no eviction: the router foresaw every hit and each mirror ends equal
    # to its server's cached set.
    assert routed.routing_agreement.num_exact == routed.routing_agreement.num_compared == NUM_REQUESTS
    for run in runs.values():
        for inst, cached in zip(run.instances, run.server_cached, strict=True):
            assert inst.feed.index.snapshot().get(0, set()) == cached[0]
    gain_points, ratio = report.gain()
    assert gain_points == pytest.approx(routed.hit_rate_tokens_pct - rr.hit_rate_tokens_pct)
    assert ratio == pytest.approx(routed.num_hit_tokens / rr.num_hit_tokens)


def test_mirrors_come_through_the_feed_factory(replayed):
    _, runs = replayed
    built = [(run.policy, inst.idx, inst.feed) for run in runs.values() for inst in run.instances]
    assert [(idx, feed) for _, idx, feed in built] == FEEDS_BUILT
    assert all(feed.num_batches > 0 for _, _, feed in built)


def test_report_json_round_trips_and_table_names_both_policies(replayed, tmp_path):
    report, _ = replayed
    path = write_multi_json(report, tmp_path / "routing.json")
    assert read_multi_json(path) == report
    data = json.loads(path.read_text())
    assert data["schema"] == "kvservice.replay.multi/v1"
    assert [p["policy"] for p in data["policies"]] == ["routed", "round-robin"]
    assert data["num_blocks_per_instance"] == 400 and data["instances"] == 3 and data["arrival_rate_scale"] == 1.0
    table = render_multi_table(report)
    assert "routed" in table and "round-robin" in table and "gain, routed over round-robin" in table
    for policy in report.policies:  # the hit series: every routed request once, in trace order
        assert [i for i, _, _ in policy.hit_series] == sorted(i for i, _ in policy.assignments)
        assert sum(h for _, _, h in policy.hit_series) == policy.num_hit_tokens


def test_the_routing_plot_and_its_rolling_hit_rate(replayed, tmp_path):
    from kvservice.replay.routing_plot import plot_routing, rolling_hit_rate_pct, routing_title

    report, _ = replayed
    assert plot_routing(report, tmp_path / "p" / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 instances of 400 blocks" in routing_title(report)
    x, rate = rolling_hit_rate_pct([(0, 10, 0), (1, 10, 10), (2, 20, 20)], window=2)
    assert x.tolist() == [1, 2, 3] and rate.tolist() == [0.0, 50.0, 100.0]


def test_config_bounds():
    with pytest.raises(ValueError, match="instances must be >= 2"):
        MultiReplayConfig(instances=1)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        MultiReplayConfig(instances=4, num_blocks=1)
    with pytest.raises(ValueError, match="rate_scale must be a finite number > 0; got 0"):
        MultiReplayConfig(rate_scale=0)
    with pytest.raises(ValueError, match="report_mode must be"):
        MultiReplayConfig(report_mode="both")


def test_arrivals_are_scaled_by_the_number_of_instances_by_default(trace):
    assert [r.arrival_ms for r in load_scaled_requests(config(trace, rate_scale=None, instances=4))][2:5] == [0, 5, 10]
    assert [r.arrival_ms for r in load_scaled_requests(config(trace))][2:5] == [0, 20, 40]


def test_cli_replay_instances_prints_the_comparison(trace, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvservice.cli",
            "replay",
            "--trace",
            str(trace),
            "--instances",
            "2",
            "--num-blocks",
            "400",
            "--rate-scale",
            "1",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "routed" in result.stdout and "round-robin" in result.stdout
    assert "gain, routed over round-robin" in result.stdout
    data = json.loads((out / "routing.json").read_text())
    assert [p["num_requests"] for p in data["policies"]] == [NUM_REQUESTS, NUM_REQUESTS]
    assert data["report_mode"] == "full" and data["num_blocks_per_instance"] == 400
    assert (out / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        result.stdout.splitlines()[0].startswith("replay: ") and "2 instances, routed vs round-robin" in result.stdout
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target", "127.0.0.1:1"], "--instances runs its own servers"),
        (["--report-mode", "both"], "--instances compares routing in one report mode"),
    ],
)
def test_cli_replay_instances_refuses_what_it_cannot_do(trace, extra, message):
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "replay", "--trace", str(trace), "--instances", "2", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
