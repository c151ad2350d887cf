"""The report of ``kvservice replay --instances N``: one :class:`PolicyReport` per routing policy
in a :class:`MultiReport`, its JSON (``routing.json``) and its terminal table.

A report holds plain figures only (it is built by :func:`kvservice.replay.multi.summarise_policy`
from a run, or read back from JSON), so it can come back from a worker process and be plotted
(:mod:`kvservice.replay.routing_plot`) without the run's servers, clients or mirrors.

**Hit rates** are counted over each request's first admission, i.e. over the trace's prompts (the
same tokens for both policies); a recompute after a preemption hits its own blocks, which says
nothing about routing, and is reported apart. The router predicts at arrival and the request may
wait before it is admitted, so a report gives both the routing prediction against the hit the
server used at the request's first admission, and each instance mirror's prediction at admission
(as the single-server replay reports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvservice.replay.report import (
    _LATENCY_FIELDS,
    AgreementStats,
    LatencySummary,
    _agreement_from_dict,
    _agreement_to_dict,
    _fmt_pct,
    _pct,
    render_rows,
    write_json_with_compact_lists,
)

__all__ = [
    "MULTI_REPORT_SCHEMA",
    "MultiReport",
    "PolicyReport",
    "read_multi_json",
    "render_multi_table",
    "write_multi_json",
]

MULTI_REPORT_SCHEMA = "kvservice.replay.multi/v1"
"""The ``schema`` value of a report written by :func:`write_multi_json` (the name the format was
first written under; it stays, so every report written since reads back)."""


@dataclass(slots=True)
class PolicyReport:
    """The figures of one policy (sums over its instances).

    Attributes:
        policy: "routed" or "round-robin".
        num_requests: requests that finished.
        num_skipped: trace requests not routed (prompt of ``max_model_len`` tokens or more).
        num_prompt_tokens, num_hit_tokens: the trace's prompt tokens and those the servers hit, at
            each request's first admission.
        num_prompt_blocks, num_hit_blocks: the same in full blocks.
        num_admitted_tokens, num_admitted_hit_tokens: tokens and hits over every admission,
            recomputes after a preemption included (a recompute hits its own blocks).
        num_requests_per_instance: requests routed to each instance (index = instance).
        num_prompt_tokens_per_instance, num_hit_tokens_per_instance: per instance, as the totals.
        num_decisions_by_reason: routing decisions by what decided them ("hit", "load",
            "round-robin").
        routing_agreement: the router's predicted hit on the chosen instance at arrival against
            the hit the server used at the request's first admission (None for round-robin).
        admission_agreement: each instance mirror's prediction just before each admission against
            the hit used (every admission).
        num_preemptions: preemptions over all instances.
        num_steps: scheduler steps over all instances (one Step RPC each, at least).
        num_events, num_batches: events and batches the mirrors received.
        rpc_latency: every Step RPC's round trip.
        wall_time_s: the policy's wall-clock time (servers started and stopped), in seconds.
        mirror_capacity_blocks: each mirror's capacity (0 = unbounded).
        block_size: the servers' block size (group 0), in tokens.
        max_model_len: the servers' longest request, in tokens.
        assignments: per routed request, (trace index, instance), in arrival order.
        hit_series: per request, (trace index, prompt tokens, hit tokens) at its first admission,
            in trace order (the routing plot's hit rate over time).
    """

    policy: str
    num_requests: int
    num_skipped: int
    num_prompt_tokens: int
    num_hit_tokens: int
    num_prompt_blocks: int
    num_hit_blocks: int
    num_admitted_tokens: int
    num_admitted_hit_tokens: int
    num_requests_per_instance: list[int]
    num_prompt_tokens_per_instance: list[int]
    num_hit_tokens_per_instance: list[int]
    num_decisions_by_reason: dict[str, int]
    routing_agreement: AgreementStats | None
    admission_agreement: AgreementStats
    num_preemptions: int
    num_steps: int
    num_events: int
    num_batches: int
    rpc_latency: LatencySummary
    wall_time_s: float
    mirror_capacity_blocks: int
    block_size: int
    max_model_len: int
    assignments: list[tuple[int, int]] = field(default_factory=list)
    hit_series: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def hit_rate_tokens_pct(self) -> float | None:
        """Prefix-cache hit rate in tokens, percent (None without prompt tokens)."""
        return _pct(self.num_hit_tokens, self.num_prompt_tokens)

    @property
    def hit_rate_blocks_pct(self) -> float | None:
        """Prefix-cache hit rate in blocks, percent (None without prompt blocks)."""
        return _pct(self.num_hit_blocks, self.num_prompt_blocks)

    _SCALARS = (
        "policy",
        "num_requests",
        "num_skipped",
        "num_prompt_tokens",
        "num_hit_tokens",
        "num_prompt_blocks",
        "num_hit_blocks",
        "num_admitted_tokens",
        "num_admitted_hit_tokens",
        "num_requests_per_instance",
        "num_prompt_tokens_per_instance",
        "num_hit_tokens_per_instance",
        "num_decisions_by_reason",
        "num_preemptions",
        "num_steps",
        "num_events",
        "num_batches",
        "wall_time_s",
        "mirror_capacity_blocks",
        "block_size",
        "max_model_len",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data (derived percentages included for readers)."""
        d: dict[str, Any] = {k: getattr(self, k) for k in self._SCALARS}
        d["hit_rate_tokens_pct"] = self.hit_rate_tokens_pct
        d["hit_rate_blocks_pct"] = self.hit_rate_blocks_pct
        d["routing_agreement"] = _agreement_to_dict(self.routing_agreement)
        d["admission_agreement"] = _agreement_to_dict(self.admission_agreement)
        d["rpc_latency"] = {k: getattr(self.rpc_latency, k) for k in _LATENCY_FIELDS}
        d["assignments"] = [list(p) for p in self.assignments]
        d["hit_series"] = [list(p) for p in self.hit_series]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyReport:
        """Rebuilds from :meth:`to_dict` output (derived fields are ignored).

        Raises:
            KeyError: a required field is missing.
        """
        routing = d.get("routing_agreement")
        return cls(
            **{k: d[k] for k in cls._SCALARS},
            routing_agreement=_agreement_from_dict(routing) if routing else None,
            admission_agreement=_agreement_from_dict(d["admission_agreement"]),
            rpc_latency=LatencySummary(**{k: d["rpc_latency"][k] for k in _LATENCY_FIELDS}),
            assignments=[(int(i), int(j)) for i, j in d.get("assignments", [])],
            hit_series=[(int(i), int(n), int(h)) for i, n, h in d.get("hit_series", [])],
        )


@dataclass(slots=True)
class MultiReport:
    """A multi-instance replay: its setting and one :class:`PolicyReport` per policy.

    Attributes:
        trace_path, num_trace_lines: the trace and the lines (requests) replayed.
        preset, block_size: every server's layout (block size in tokens).
        instances: servers per policy.
        num_blocks_per_instance: each instance's pool, in blocks.
        arrival_rate_scale: the trace's arrival times were divided by this.
        report_mode: the ``kv_cache_report_mode`` of every request.
        policies: per policy, in run order.
        ideal_hit_rate_tokens_pct: the infinite-cache prefix hit rate of the trace at ``block_size``.
        metadata: other run facts, JSON scalars only.
    """

    trace_path: str
    num_trace_lines: int
    preset: str
    block_size: int
    instances: int
    num_blocks_per_instance: int
    arrival_rate_scale: float
    report_mode: str
    policies: list[PolicyReport]
    ideal_hit_rate_tokens_pct: float | None = None
    metadata: dict[str, str | int | float | bool | None] = field(default_factory=dict)

    def policy(self, name: str) -> PolicyReport:
        """The report of policy ``name``.

        Raises:
            KeyError: that policy did not run.
        """
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(name)

    def gain(self) -> tuple[float, float | None] | None:
        """(routed - round-robin hit rate in percentage points, routed / round-robin), in tokens;
        None unless both ran with prompt tokens (the ratio is None when round-robin hit nothing)."""
        try:
            routed, rr = self.policy("routed").hit_rate_tokens_pct, self.policy("round-robin").hit_rate_tokens_pct
        except KeyError:
            return None
        if routed is None or rr is None:
            return None
        return routed - rr, (routed / rr if rr else None)

    _SCALARS = (
        "trace_path",
        "num_trace_lines",
        "preset",
        "block_size",
        "instances",
        "num_blocks_per_instance",
        "arrival_rate_scale",
        "report_mode",
        "ideal_hit_rate_tokens_pct",
    )

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready plain data (the gain included for readers)."""
        gain = self.gain()
        return {
            "schema": MULTI_REPORT_SCHEMA,
            **{k: getattr(self, k) for k in self._SCALARS},
            "gain_hit_rate_tokens_points": gain[0] if gain else None,
            "gain_hit_rate_tokens_ratio": gain[1] if gain else None,
            "metadata": dict(self.metadata),
            "policies": [p.to_dict() for p in self.policies],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MultiReport:
        """Rebuilds a report from :meth:`to_dict` output (derived fields are ignored).

        Raises:
            ValueError: an unknown ``schema``.
            KeyError: a required field is missing.
        """
        if data.get("schema") != MULTI_REPORT_SCHEMA:
            raise ValueError(f"unknown report schema {data.get('schema')!r}; expected {MULTI_REPORT_SCHEMA!r}")
        return cls(
            **{k: data[k] for k in cls._SCALARS},
            policies=[PolicyReport.from_dict(p) for p in data["policies"]],
            metadata=dict(data.get("metadata", {})),
        )


def write_multi_json(report: MultiReport, path: str | Path) -> Path:
    """Writes ``report`` as JSON (indented; each assignment list on one line), creating parent
    folders. Returns the path written."""
    data = report.to_dict()
    return write_json_with_compact_lists(
        data, path, [(p, key) for p in data["policies"] for key in ("assignments", "hit_series")]
    )


def read_multi_json(path: str | Path) -> MultiReport:
    """Reads a report written by :func:`write_multi_json`.

    Raises:
        ValueError: not JSON, or an unknown schema.
        KeyError: a required field is missing.
    """
    return MultiReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _fmt_capacity(blocks: int) -> str:
    return f"{blocks:,} blocks" if blocks else "unbounded"


def _fmt_agreement(a: AgreementStats | None) -> str:
    if a is None:
        return "-"
    return f"{_fmt_pct(a.exact_match_pct)} of {a.num_compared:,}, MAE {a.mean_abs_error_blocks:.3f}"


def _policy_rows(p: PolicyReport) -> list[tuple[str, str]]:
    lat = p.rpc_latency
    reasons = p.num_decisions_by_reason
    per_instance_hit = " / ".join(
        f"{100.0 * h / t:.1f}" if t else "-"
        for h, t in zip(p.num_hit_tokens_per_instance, p.num_prompt_tokens_per_instance, strict=True)
    )
    return [
        ("requests", f"{p.num_requests:,}"),
        ("prompt tokens", f"{p.num_prompt_tokens:,}"),
        ("prefix hit rate (tokens)", _fmt_pct(p.hit_rate_tokens_pct)),
        ("prefix hit rate (blocks)", _fmt_pct(p.hit_rate_blocks_pct)),
        ("with recomputes after preemption (tokens)", _fmt_pct(_pct(p.num_admitted_hit_tokens, p.num_admitted_tokens))),
        ("requests per instance", " / ".join(f"{n:,}" for n in p.num_requests_per_instance)),
        ("hit rate per instance (tokens, %)", per_instance_hit),
        (
            "decided by hit / load / round-robin",
            f"{reasons.get('hit', 0):,} / {reasons.get('load', 0):,} / {reasons.get('round-robin', 0):,}",
        ),
        ("routing prediction vs hit: exact, MAE", _fmt_agreement(p.routing_agreement)),
        ("mirror at admission: exact, MAE", _fmt_agreement(p.admission_agreement)),
        ("preemptions", f"{p.num_preemptions:,}"),
        ("scheduler steps", f"{p.num_steps:,}"),
        ("RPC latency p50 / p99 (ms)", "-" if lat.p50_ms is None else f"{lat.p50_ms:.3f} / {lat.p99_ms:.3f}"),
        ("events / batches received", f"{p.num_events:,} / {p.num_batches:,}"),
        ("wall time (s)", f"{p.wall_time_s:.2f}"),
    ]


def render_multi_table(report: MultiReport, *, width: int = 120) -> str:
    """The report as a plain-text terminal table (rich, no colour codes), policies side by side,
    then the gain and the ideal hit rate."""
    title = (
        f"kvservice replay --instances {report.instances}: {Path(report.trace_path).name} "
        f"({report.num_trace_lines:,} lines), report mode {report.report_mode}\n"
        f"preset {report.preset}, block_size {report.block_size} tokens; per instance: {report.num_blocks_per_instance:,} "
        f"blocks, mirror {_fmt_capacity(report.policies[0].mirror_capacity_blocks)}; arrivals "
        f"{report.arrival_rate_scale:g}x the trace's rate"
        + (f"\nmirrors fed by {report.metadata['feed']}" if report.metadata.get("feed") else "")
    )
    notes = []
    gain = report.gain()
    if gain is not None:
        ratio = "-" if gain[1] is None else f"{gain[1]:.2f}x"
        notes.append(f"gain, routed over round-robin: {gain[0]:+.2f} points of prefix hit rate (tokens), ratio {ratio}")
    skipped = max(p.num_skipped for p in report.policies)
    if skipped:
        notes.append(f"skipped {skipped:,} trace requests whose prompt is max_model_len tokens or longer")
    if report.ideal_hit_rate_tokens_pct is not None:
        notes.append(f"ideal prefix hit rate, infinite cache (tokens): {_fmt_pct(report.ideal_hit_rate_tokens_pct)}")
    rows = [_policy_rows(p) for p in report.policies]
    return render_rows(title, [p.policy for p in report.policies], rows, notes=notes, width=width)
