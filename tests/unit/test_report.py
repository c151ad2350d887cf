"""The replay report model and its renderings (kvservice.replay.report)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvservice.replay.report import (
    REPORT_SCHEMA,
    AgreementStats,
    LatencySummary,
    ModeReport,
    ReplayReport,
    latency_percentiles,
    plot_agreement,
    read_json,
    render_table,
    rolling_exact_match_pct,
    write_json,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _mode(name: str, series: list[tuple[int, int, int]], **overrides: object) -> ModeReport:
    fields: dict[str, object] = dict(
        mode=name,
        num_requests=len(series),
        num_prompt_tokens=12_000,
        num_hit_tokens=3_000,
        num_prompt_blocks=750,
        num_hit_blocks=180,
        num_first_admission_prompt_tokens=10_000,
        num_first_admission_hit_tokens=1_500,
        num_prefill_tokens=9_250,
        agreement=AgreementStats.from_series(series),
        num_events=4_321,
        num_batches=987,
        num_preemptions=2,
        rpc_latency=LatencySummary.from_samples([0.25, 0.5, 0.75, 1.0, 4.0]),
        wall_time_s=3.5,
        mirror_capacity_blocks=1_023,
        pool_size_blocks=2_047,  # num_blocks 2,048 less the null block
        num_readmission_max_hit_tokens=1_904,
        num_ideal_hit_tokens=4_400,
        series=series,
    )
    fields.update(overrides)
    return ModeReport(**fields)  # type: ignore[arg-type]


SERIES_INC = [(0, 0, 0), (1, 2, 2), (2, 3, 5), (3, 4, 4), (4, 1, 0)]
SERIES_FULL = [(0, 0, 0), (1, 2, 2), (2, 5, 5), (3, 4, 4), (4, 0, 0)]


def _report(**overrides: object) -> ReplayReport:
    fields: dict[str, object] = dict(
        trace_path="/tmp/traces/mooncake_conversation_sample.jsonl",
        num_trace_lines=5,
        preset="llama3-8b",
        block_size=16,
        num_blocks=2_048,
        modes=[
            _mode("incremental", SERIES_INC),
            _mode(
                "full",
                SERIES_FULL,
                late_watcher=AgreementStats.from_pairs([3, 3], [3, 4]),
                first_watcher_since_late_join=AgreementStats.from_pairs([3, 4], [3, 4]),
            ),
        ],
        ideal_hit_rate_tokens_pct=25.0,
        metadata={"hash_algorithm": "sha256_cbor", "kvservice": "0.1.0", "seed": None},
    )
    fields.update(overrides)
    return ReplayReport(**fields)  # type: ignore[arg-type]


def test_agreement_stats_exact() -> None:
    a = AgreementStats.from_series(SERIES_INC)
    # |0-0| + |2-2| + |3-5| + |4-4| + |1-0| = 3 over 5 requests.
    assert a == AgreementStats(
        num_compared=5,
        num_exact=3,
        mean_abs_error_blocks=0.6,
        mean_predicted_blocks=2.0,
        mean_actual_blocks=2.2,
    )
    assert a.exact_match_pct == 60.0
    empty = AgreementStats.from_pairs([], [])
    assert (empty.num_compared, empty.exact_match_pct) == (0, None)
    with pytest.raises(ValueError, match="2 predictions but 1 actual"):
        AgreementStats.from_pairs([1, 2], [1])


def test_latency_percentiles_and_summary() -> None:
    assert latency_percentiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 3.97), abs=1e-12)
    assert latency_percentiles([5.0], (0, 50, 100)) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="no latency samples"):
        latency_percentiles([])
    with pytest.raises(ValueError, match="0..100"):
        latency_percentiles([1.0], (101,))
    summary = LatencySummary.from_samples([0.25, 0.5, 0.75, 1.0, 4.0])
    assert summary.num_samples == 5
    assert summary.p50_ms == 0.75 and summary.max_ms == 4.0
    assert summary.p99_ms == pytest.approx(3.88)
    assert LatencySummary.from_samples([]) == LatencySummary(0, None, None, None)


def test_mode_hit_rates() -> None:
    m = _mode("incremental", SERIES_INC)
    assert (m.hit_rate_tokens_pct, m.hit_rate_blocks_pct) == (25.0, 24.0)
    zero = _mode("full", [], num_prompt_tokens=0, num_prompt_blocks=0, num_hit_tokens=0)
    assert (zero.hit_rate_tokens_pct, zero.hit_rate_blocks_pct) == (None, None)


def test_summarise_counts_first_admissions_apart_from_readmissions() -> None:
    """Three admissions at block size 4: request 0 (16 tokens, no hit), request 1 (24 tokens, an
    8-token hit), then request 0 again after a recompute preemption (40 tokens: its prompt and 24
    outputs, a 36-token hit on its own just-computed blocks). The per-admission rate counts the
    readmission's hit; the first-admission rate counts the two prompts only."""
    from types import SimpleNamespace

    from kvservice.replay.runner import ModeRun, summarise
    from kvservice.replay.scheduler import Admission, SchedulerStats
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

    stats = SchedulerStats(
        admissions=[
            Admission(0, "r0", 16, 0, 0, False, (0,)),
            Admission(1, "r1", 24, 8, 8, False, (8,)),
            Admission(0, "r0", 40, 32, 36, True, (32,)),
        ],
        num_preemptions=1,
        num_prefill_tokens=16 + 16 + 4,
        num_finished=2,
        rpc_latency_ms=[1.0, 3.0],
    )
    watcher = SimpleNamespace(num_events=7, num_batches=5)
    run = ModeRun(
        "full",
        stats,
        [watcher],
        None,
        0,
        pool_blocks=15,
        block_size=4,  # type: ignore[list-item]
        usage=pb.GetUsageResponse(),
        mirror_capacity=0,
    )
    m = summarise(run, wall_time_s=0.5)
    assert (m.num_prompt_tokens, m.num_hit_tokens) == (16 + 24 + 40, 0 + 8 + 36) == (80, 44)
    assert (m.num_prompt_blocks, m.num_hit_blocks) == (4 + 6 + 10, 0 + 2 + 9) == (20, 11)
    assert m.hit_rate_tokens_pct == 55.0 and m.hit_rate_blocks_pct == 55.0
    assert (m.num_first_admission_prompt_tokens, m.num_first_admission_hit_tokens) == (40, 8)
    assert m.first_admission_hit_rate_tokens_pct == 20.0
    assert m.num_prefill_tokens == 36
    assert (m.num_requests, m.num_preemptions, m.num_events, m.num_batches) == (2, 1, 7, 5)
    assert m.series == [(0, 0, 0), (1, 2, 2), (2, 8, 9)]
    none = _mode("full", [], num_first_admission_prompt_tokens=0, num_first_admission_hit_tokens=0)
    assert none.first_admission_hit_rate_tokens_pct is None


def test_report_validates_modes() -> None:
    with pytest.raises(ValueError, match="one or two modes; got 0"):
        _report(modes=[])
    with pytest.raises(ValueError, match="one or two modes; got 3"):
        _report(modes=[_mode(n, []) for n in ("a", "b", "c")])
    with pytest.raises(ValueError, match="mode named twice"):
        _report(modes=[_mode("full", []), _mode("full", [])])
    report = _report()
    assert report.mode("full").series == SERIES_FULL
    with pytest.raises(KeyError):
        report.mode("partial")


def test_rolling_exact_match_exact_values() -> None:
    x, rate = rolling_exact_match_pct(SERIES_INC, 2)
    assert x.tolist() == [0, 1, 2, 3, 4]
    # exact: 1 1 0 1 0 -> windows of 2 (the first over 1 request).
    assert rate.tolist() == [100.0, 100.0, 50.0, 50.0, 50.0]
    _, rate = rolling_exact_match_pct(SERIES_INC, 10)
    assert np.allclose(rate, [100.0, 100.0, 200 / 3, 75.0, 60.0])
    x, rate = rolling_exact_match_pct([], 5)
    assert len(x) == len(rate) == 0
    with pytest.raises(ValueError):
        rolling_exact_match_pct(SERIES_INC, 0)


def test_json_round_trip(tmp_path: Path) -> None:
    report = _report()
    path = write_json(report, tmp_path / "out" / "report.json")
    assert path == tmp_path / "out" / "report.json"
    assert read_json(path) == report
    data = json.loads(path.read_text())
    assert data["schema"] == REPORT_SCHEMA
    assert [m["mode"] for m in data["modes"]] == ["incremental", "full"]
    inc = data["modes"][0]
    assert inc["hit_rate_tokens_pct"] == 25.0 and inc["agreement"]["exact_match_pct"] == 60.0
    assert inc["first_admission_hit_rate_tokens_pct"] == 15.0
    assert (inc["num_first_admission_prompt_tokens"], inc["num_first_admission_hit_tokens"]) == (10_000, 1_500)
    assert inc["num_prefill_tokens"] == 9_250
    assert inc["series"] == [[0, 0, 0], [1, 2, 2], [2, 3, 5], [3, 4, 4], [4, 1, 0]]
    assert data["modes"][1]["late_watcher"]["num_exact"] == 1
    assert data["modes"][0]["late_watcher"] is None
    # The series is written on one line.
    assert '"series": [[0,0,0],[1,2,2],[2,3,5],[3,4,4],[4,1,0]]' in path.read_text()
    # One mode, no late watcher, empty series, no latency samples.
    single = _report(
        modes=[_mode("full", [], rpc_latency=LatencySummary.from_samples([]))],
        ideal_hit_rate_tokens_pct=None,
        metadata={},
    )
    assert read_json(write_json(single, tmp_path / "single.json")) == single


def test_read_json_rejects_unknown_schema(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"schema": "something/v9"}))
    with pytest.raises(ValueError, match="unknown report schema"):
        read_json(path)


def test_render_table_both_modes_side_by_side() -> None:
    text = render_table(_report())
    lines = text.splitlines()
    assert lines[0] == "kvservice replay: mooncake_conversation_sample.jsonl (5 lines)"
    assert lines[1] == "preset llama3-8b, block_size 16 tokens, num_blocks 2,048"
    header = next(line for line in lines if "metric" in line)
    assert header.index("incremental") < header.index("full")

    def row(label: str) -> list[str]:
        line = next(line for line in lines if line.startswith(f"│ {label}"))
        return [cell.strip() for cell in line.strip("│").split("│")][1:]

    assert row("prefix hit rate (tokens)") == ["25.00 %", "25.00 %"]
    assert row("prefix hit rate (blocks)") == ["24.00 %", "24.00 %"]
    assert row("prefix hit rate, first admissions (tokens)") == ["15.00 %", "15.00 %"]
    assert row("tokens prefilled (recompute included)") == ["9,250", "9,250"]
    assert row("exact match") == ["60.00 % of 5", "100.00 % of 5"]
    assert row("mean abs error (blocks)") == ["0.600", "0.000"]
    assert row("mean depth predicted / actual") == ["2.00 / 2.20", "2.20 / 2.20"]
    assert row("events / batches") == ["4,321 / 987", "4,321 / 987"]
    assert row("RPC latency p50 / p99 (ms)") == ["0.750 / 3.880", "0.750 / 3.880"]
    assert row("ideal, infinite cache, same admissions (tokens)") == ["36.67 %", "36.67 %"]  # 4,400 / 12,000
    assert row("mirror capacity / num_blocks") == ["1,023 / 2,048", "1,023 / 2,048"]  # one count, as the title's
    assert (
        "ideal prefix hit rate, infinite cache, each request once (tokens; bounds the first-admission rate): 25.00 %"
        in text
    )
    assert row("late watcher since it joined") == ["-", "50.00 % of 2, MAE 0.500"]
    assert row("first watcher, same requests") == ["-", "100.00 % of 2, MAE 0.000"]
    assert all(line == line.rstrip() for line in lines)


def test_render_table_single_mode_and_markup_safe() -> None:
    report = _report(
        trace_path="/x/[bold]trace.jsonl",
        modes=[_mode("full", SERIES_FULL, num_ideal_hit_tokens=None)],
        ideal_hit_rate_tokens_pct=None,
    )
    text = render_table(report)
    assert "[bold]trace.jsonl" in text
    header = next(line for line in text.splitlines() if "metric" in line)
    assert "full" in header and "incremental" not in header
    assert "late watcher" not in text and "ideal" not in text


def test_plot_agreement_writes_png(tmp_path: Path) -> None:
    series = [(i, i % 5, i % 5 + (i % 7 == 0)) for i in range(200)]
    report = _report(modes=[_mode("incremental", series), _mode("full", SERIES_FULL)])
    path = plot_agreement(report, tmp_path / "plots" / "agreement.png", window=20)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000
    # A mode without a series still plots (labelled "no data").
    empty = _report(modes=[_mode("full", [])])
    assert plot_agreement(empty, tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError):
        plot_agreement(report, tmp_path / "bad.png", window=0)


def test_plot_title_names_the_pool_and_mirror_capacity() -> None:
    from kvservice.replay.report import agreement_title

    report = _report(modes=[_mode("incremental", SERIES_FULL), _mode("full", SERIES_FULL)])
    pool, mirror = report.modes[0].pool_size_blocks, report.modes[0].mirror_capacity_blocks
    title = agreement_title(report)
    assert title.splitlines()[1].endswith(f"pool {pool:,} blocks, mirror capacity {mirror:,} blocks")


def test_the_error_panel_clips_outliers_beyond_the_bulk() -> None:
    import numpy as np

    from kvservice.replay.report import error_axis_bound

    assert error_axis_bound(np.array([1, -1] * 100 + [500])) == 2  # one outlier: drawn at the edge, counted
    assert error_axis_bound(np.array([], dtype=np.int64)) == 2
    assert error_axis_bound(np.array([-32] * 96 + [-455] * 4)) == 48  # the replay's incremental mode, in short
    assert error_axis_bound(np.arange(-50, 51)) >= 50  # evenly spread: nothing clipped


def test_a_report_written_before_the_first_admission_fields_still_reads(tmp_path):
    """report.json files from before the first-admission and prefill counts load, with those
    counts 0 and their rate unknown."""
    path = write_json(_report(), tmp_path / "report.json")
    data = json.loads(path.read_text())
    for mode in data["modes"]:
        for key in (
            "num_first_admission_prompt_tokens",
            "num_first_admission_hit_tokens",
            "num_prefill_tokens",
            "first_admission_hit_rate_tokens_pct",
        ):
            mode.pop(key)
    path.write_text(json.dumps(data))
    [mode] = read_json(path).modes[:1]
    assert (mode.num_first_admission_prompt_tokens, mode.num_prefill_tokens) == (0, 0)
    assert mode.first_admission_hit_rate_tokens_pct is None
