"""``kvservice replay --scheduler vllm``: vLLM's real scheduler over the trace, twice; and
``--scheduler vllm-tier``: two vLLM schedulers sharing prefix chunks through one kvservice tier.

Once with vLLM's in-process KV cache manager, once with its manager on an embedded kvservice
(``kvservice_vllm.install(scheduler, "embedded")``); the model is never run
(``kvservice_vllm.drive``). The report says whether the two made the same decisions step by step,
the hit tokens of each, the round trips per step on kvservice and each one's time per step.

``vllm-tier`` (:func:`run_vllm_tier_replay`) runs ``kvservice_vllm.tier_replay``: two vLLM
schedulers, each with its own ``OffloadingConnector`` and the kvservice tier, on one embedded
server, the trace split round robin; the report is each instance's hits by source (its GPU prefix
cache, its CPU tier, kvservice: its own chunks or the other instance's) and the bytes checked.

Needs the ``kvservice-vllm`` package and vLLM 0.33 (``bash scripts/setup_vllm.sh``; then
``.venv-vllm/bin/kvservice replay --scheduler vllm``). Nothing else of the replay imports it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["TIER_DEFAULT_LIMIT", "VllmReplayReport", "render_tier", "run_vllm_replay", "run_vllm_tier_replay"]


@dataclass(frozen=True)
class VllmReplayReport:
    """What the two runs did (units in the names).

    Attributes:
        scheduler: ``Scheduler`` or ``AsyncScheduler``.
        num_requests: requests replayed (those longer than the pool are left out).
        max_model_len: the schedulers' max_model_len, in tokens (at most what the pool holds).
        num_steps_in_process, num_steps_kvservice: scheduler steps of each run.
        same_decisions: every step's ``SchedulerOutput`` equal (scheduled tokens, block ids,
            preemptions, finished requests).
        first_difference_step: the first step that differs (None when none does).
        hit_tokens_in_process, hit_tokens_kvservice: prefix-cache hit tokens at admission.
        num_preemptions: preemptions (of the kvservice run).
        rpcs_per_step: round trips per step on kvservice, over all steps and by kind (decode-only,
            with admissions, with preemptions).
        step_ms_in_process, step_ms_kvservice: median time of a step (schedule + update), ms.
        step_time_ratio: kvservice over in process.
    """

    scheduler: str
    num_requests: int
    max_model_len: int
    num_steps_in_process: int
    num_steps_kvservice: int
    same_decisions: bool
    first_difference_step: int | None
    hit_tokens_in_process: int
    hit_tokens_kvservice: int
    num_preemptions: int
    rpcs_per_step: dict[str, float]
    step_ms_in_process: float
    step_ms_kvservice: float
    step_time_ratio: float


@contextlib.contextmanager
def _needs_kvservice_vllm(mode: str) -> Iterator[None]:
    """Imports of ``replay --scheduler MODE`` inside; a missing module becomes a
    ModuleNotFoundError that says how to install it."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"replay --scheduler {mode} needs vLLM 0.33 and kvservice-vllm ({exc.name} is missing): "
            f"bash scripts/setup_vllm.sh, then .venv-vllm/bin/kvservice replay --scheduler {mode}"
        ) from exc


def run_vllm_replay(
    *,
    trace: str | None,
    limit: int | None,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    async_scheduling: bool,
    out_dir: str | None = None,
) -> VllmReplayReport:
    """Run the trace through vLLM's scheduler in process and on kvservice; the report (also
    ``vllm-report.json`` in ``out_dir``).

    Raises:
        ModuleNotFoundError: vLLM or kvservice-vllm is not installed (the message says how).
    """
    with _needs_kvservice_vllm("vllm"):
        import kvservice_vllm
        from kvservice_vllm.drive import make_scheduler, mooncake_items, run_trace
    # A request longer than the pool could never be admitted (vLLM would wait for it for ever).
    max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
    items = [
        item
        for item in mooncake_items(trace, limit=limit)
        if len(item.prompt_token_ids) + len(item.output_token_ids) <= max_model_len
    ]
    kw = dict(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, async_scheduling=async_scheduling
    )
    native = make_scheduler(**kw)
    remote = make_scheduler(**kw)
    kvservice_vllm.install(remote, "embedded")
    try:
        a = run_trace(native, items)
        b = run_trace(remote, items)
    finally:
        remote.shutdown()
    first = next((k for k, (x, y) in enumerate(zip(a.records, b.records)) if x != y), None)
    if first is None and a.num_steps != b.num_steps:
        first = min(a.num_steps, b.num_steps)
    kinds: dict[str, list[int]] = collections.defaultdict(list)
    for record, trips in zip(b.records, b.num_round_trips):
        new, *_, scheduled, preempted, _ = record
        kind = (
            "with preemptions" if preempted else "with admissions" if new else "decode only" if scheduled else "empty"
        )
        kinds[kind].append(trips)
    rpcs = {"all": sum(b.num_round_trips) / max(1, b.num_steps)}
    rpcs.update({k: sum(v) / len(v) for k, v in sorted(kinds.items())})
    ms_a = statistics.median(a.step_seconds) * 1e3
    ms_b = statistics.median(b.step_seconds) * 1e3
    report = VllmReplayReport(
        scheduler="AsyncScheduler" if async_scheduling else "Scheduler",
        num_requests=len(items),
        max_model_len=max_model_len,
        num_steps_in_process=a.num_steps,
        num_steps_kvservice=b.num_steps,
        same_decisions=first is None,
        first_difference_step=first,
        hit_tokens_in_process=a.num_hit_tokens,
        hit_tokens_kvservice=b.num_hit_tokens,
        num_preemptions=b.num_preemptions,
        rpcs_per_step=rpcs,
        step_ms_in_process=ms_a,
        step_ms_kvservice=ms_b,
        step_time_ratio=ms_b / ms_a if ms_a else float("nan"),
    )
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "vllm-report.json").write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return report


def render(report: VllmReplayReport) -> Any:
    """The report as a rich table."""
    from rich.table import Table

    table = Table(
        title=f"vLLM's {report.scheduler} over {report.num_requests:,} requests (max_model_len {report.max_model_len:,})"
    )
    table.add_column("metric")
    table.add_column("in process", justify="right")
    table.add_column("on kvservice", justify="right")
    table.add_row("steps", f"{report.num_steps_in_process:,}", f"{report.num_steps_kvservice:,}")
    same = "yes" if report.same_decisions else f"no: first at step {report.first_difference_step}"
    table.add_row("same SchedulerOutput every step", "", same)
    table.add_row("hit tokens at admission", f"{report.hit_tokens_in_process:,}", f"{report.hit_tokens_kvservice:,}")
    table.add_row("preemptions", "", f"{report.num_preemptions:,}")
    for kind, value in report.rpcs_per_step.items():
        table.add_row(f"round trips per step ({kind})", "0", f"{value:.2f}")
    table.add_row("time per step (median)", f"{report.step_ms_in_process:.2f} ms", f"{report.step_ms_kvservice:.2f} ms")
    table.add_row("time per step, kvservice / in process", "", f"{report.step_time_ratio:.2f}x")
    return table


TIER_DEFAULT_LIMIT = 400
"""Requests ``--scheduler vllm-tier`` replays without ``--limit``: cross-instance hits start after
about request 100, and 400 take 57 s on 2 cores; the whole sample (991) takes 132 s and stores
twice what the default pool holds."""

TIER_DEFAULT_SERVER_BLOCKS = 262144
"""kvservice's pool for ``--scheduler vllm-tier`` without ``--num-blocks``: 262,144 chunks of
4,096 bytes (1 GiB), more than the first 400 requests store (229,372 chunks written): no chunk is
evicted, so no load fails. With 131,072 (fewer than they store) 8,585 chunk loads failed, every
one a chunk evicted after the lookup that found it, never wrong bytes."""


def run_vllm_tier_replay(
    *,
    trace: str | None,
    limit: int | None,
    num_server_blocks: int = TIER_DEFAULT_SERVER_BLOCKS,
    step_ms: float = 25.0,
    max_num_batched_tokens: int = 8192,
    out_dir: str | None = None,
) -> Any:
    """Serve the trace (Mooncake format) with two vLLM schedulers sharing one kvservice tier
    (``kvservice_vllm.tier_replay.run_tier_replay``); the result (also ``tier-report.json`` in
    ``out_dir``).

    Args:
        trace: a Mooncake trace (None: the embedded sample).
        limit: at most this many requests (None: all).
        num_server_blocks: kvservice's pool, in 4,096-byte chunks.
        step_ms: simulated milliseconds per scheduler step (arrivals land on steps).
        max_num_batched_tokens: each scheduler's token budget per step.
        out_dir: where ``tier-report.json`` goes (None: not written).

    Returns:
        A ``kvservice_vllm.tier_replay.TierReplayResult``.

    Raises:
        ModuleNotFoundError: vLLM or kvservice-vllm is not installed (the message says how).
    """
    with _needs_kvservice_vllm("vllm-tier"):
        from kvservice_vllm.drive import mooncake_items
        from kvservice_vllm.tier_replay import run_tier_replay
    items = mooncake_items(trace, limit=limit, step_ms=step_ms)
    result = run_tier_replay(items, num_server_blocks=num_server_blocks, max_num_batched_tokens=max_num_batched_tokens)
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tier-report.json").write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    return result


def _tier_rows(stats: Any) -> list[tuple[str, str]]:
    def blocks_tokens(blocks: int, tokens: int) -> str:
        return f"{blocks:,} / {tokens:,}"

    return [
        ("requests", f"{stats.num_requests:,}"),
        ("hit tokens at admission", f"{stats.hit_tokens:,}"),
        ("  from its GPU prefix cache (tokens)", f"{stats.hit_tokens_gpu:,}"),
        ("  from its CPU tier (blocks / tokens)", blocks_tokens(stats.hit_blocks_cpu, stats.hit_tokens_cpu)),
        (
            "  from kvservice, its own chunks (blocks / tokens)",
            blocks_tokens(stats.hit_blocks_kvservice_own, stats.hit_tokens_kvservice_own),
        ),
        (
            "  from kvservice, the other's chunks (blocks / tokens)",
            blocks_tokens(stats.hit_blocks_cross, stats.hit_tokens_cross),
        ),
        ("blocks computed", f"{stats.blocks_computed:,}"),
        ("chunks stored in kvservice / written", f"{stats.chunks_stored:,} / {stats.chunks_written:,}"),
        ("chunks loaded from kvservice / load failures", f"{stats.chunks_loaded:,} / {stats.load_failures:,}"),
        ("store failures", f"{stats.store_failures:,}"),
        ("chunks verified from kvservice / mismatches", f"{stats.chunks_verified:,} / {stats.mismatches:,}"),
        ("GPU loads verified / mismatches", f"{stats.gpu_loads_verified:,} / {stats.gpu_load_mismatches:,}"),
        ("preemptions", f"{stats.num_preemptions:,}"),
        ("scheduler steps", f"{stats.num_steps:,}"),
    ]


def render_tier(result: Any, *, width: int = 120) -> str:
    """A ``TierReplayResult`` as a plain-text table, instances side by side
    (:func:`kvservice.replay.report.render_rows`)."""
    from kvservice.replay.report import render_rows

    title = (
        f"kvservice replay --scheduler vllm-tier: {result.num_requests:,} requests, {len(result.instances)} vLLM "
        f"schedulers (round robin)\nper instance {result.num_gpu_blocks:,} GPU blocks, {result.num_cpu_chunks:,} CPU "
        f"chunks; kvservice {result.num_server_blocks:,} chunks of {result.chunk_bytes:,} bytes"
    )
    notes = [f"wall time {result.wall_s:.1f} s, {result.num_steps:,} lockstep steps"]
    return render_rows(
        title, [s.name for s in result.instances], [_tier_rows(s) for s in result.instances], notes=notes, width=width
    )
