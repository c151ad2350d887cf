"""The soak (tests/soak.py): 8 schedulers, 8 watchers killed and reconnected, a drain + reset and a
server restart; nothing lost, every invariant check passes. Plus the applied-sequence checker it
relies on, on hand-made histories.

The soak is bounded by op counts (2,500 RPCs per scheduler, about 35-60 s on a loaded 2-core
machine); its figures are asserted only where they do not depend on timing.
"""

from __future__ import annotations

import pytest

from tests.soak import AppliedRecord, KillMode, RecordKind, SoakConfig, check_applied_sequence, run_soak

S, R, B, START = RecordKind.SNAPSHOT, RecordKind.RESUME, RecordKind.BATCH, RecordKind.START_SNAPSHOT


def rec(kind: RecordKind, epoch: str | None = None, seq: int = 0, more: bool = False) -> AppliedRecord:
    return AppliedRecord(kind, epoch, seq, more)


def test_a_clean_history_across_kills_resyncs_and_a_restart_passes() -> None:
    history = [
        rec(START),
        rec(S, "A", 3),
        rec(B, "A", 4),
        rec(B, "A", 5),
        rec(R, "A", 5),
        rec(B, "A", 6),  # killed, resumed after 5
        rec(S, "A", 9, more=True),
        rec(S, "A", 9),
        rec(B, "A", 10),  # a resync (fell behind), in two parts
        rec(R, "A", 10),
        rec(S, "B", 0),
        rec(B, "B", 1),  # a resume into a restarted server: its snapshot
        rec(START),
        rec(S, "B", 1),
        rec(B, "B", 2),
    ]
    assert check_applied_sequence(history) == (11, [])


@pytest.mark.parametrize(
    ("history", "problem"),
    [
        ([rec(START), rec(S, "A", 3), rec(B, "A", 5)], "record 2 (batch epoch A seq 5): skipped: expected seq 4"),
        ([rec(START), rec(S, "A", 3), rec(B, "A", 4), rec(B, "A", 4)], "record 3 (batch epoch A seq 4): repeated"),
        ([rec(START), rec(S, "A", 3), rec(R, "A", 3), rec(B, "A", 5)], "record 3 (batch epoch A seq 5): skipped"),
        ([rec(START), rec(S, "A", 3), rec(B, "B", 4)], "a live batch of a new epoch without its snapshot"),
        ([rec(START), rec(S, "A", 3), rec(R, "A", 2)], "resumes from a position the lineage is not at"),
        ([rec(START), rec(S, "A", 3), rec(B, "A", 4), rec(S, "A", 2)], "a snapshot rewinds epoch to seq 2"),
        ([rec(START), rec(S, "A", 3, more=True), rec(B, "A", 4)], "a live batch inside snapshot ('A', 3)"),
        ([rec(START), rec(S, "A", 3, more=True), rec(S, "A", 4)], "a snapshot part of another position"),
        ([rec(START), rec(B, "A", 1)], "a live batch where a snapshot was asked for"),
    ],
)
def test_the_sequence_check_names_each_violation(history: list[AppliedRecord], problem: str) -> None:
    num_checked, problems = check_applied_sequence(history)
    assert num_checked == len([r for r in history if r.kind in (S, B)])
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_soak_nothing_lost() -> None:
    config = SoakConfig(
        num_schedulers=8,
        num_watchers=8,
        seed=6,
        ops_per_scheduler=2500,
        num_restarts=1,
        num_drain_resets=1,
        num_kills=16,
    )
    report = await run_soak(config)
    print(report.render())
    assert report.problems == []
    assert report.num_invariant_checks > 0 and report.num_invariant_failures == 0
    assert report.num_restarts == 1 and len(report.epochs) == 2 and report.num_drain_resets == 1
    # Each scheduler ran its 2,500 ops (plus the frees of preemptions, drains and recoveries).
    assert sum(n for op, n in report.ops.items() if op != "step_ops") >= 8 * 2500
    assert report.ops["step"] > 0 and report.ops["free"] > 0 and report.ops["get_computed_blocks"] > 0
    # Kills: every mode, as planned (16 kills over 4 modes, each lineage alive when chosen).
    assert {mode: report.watcher[f"kills_{mode.value}"] for mode in KillMode} == dict.fromkeys(KillMode, 4)
    # The watchers found the new epoch by themselves; the schedulers restarted their requests.
    assert report.watcher["resync_epoch_changed"] + report.watcher["resync_epoch_mismatch"] >= 1
    assert report.scheduler["epoch_changes_seen"] >= 1
    # The checks really ran: every lineage's history, every final mirror.
    assert report.num_sequence_checks == report.watcher["batches_applied"] > 0
    assert report.num_final_mirrors_checked == 8
    # The pool was small enough to evict and refuse.
    assert report.scheduler["allocations_refused"] > 0
