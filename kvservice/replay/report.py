"""The replay report: a plain data model and its renderings (terminal table, JSON, PNG).

Nothing here knows how the figures are produced: the replay driver measures, fills a
:class:`ReplayReport` (one :class:`ModeReport` per ``kv_cache_report_mode`` that ran) and hands it
to :func:`render_table`, :func:`write_json` and :func:`plot_agreement`. :func:`read_json` reads a
written report back unchanged.

Units are in the names: ``*_tokens``, ``*_blocks`` (the service's ``block_size``), ``*_ms``,
``*_s``, ``*_pct`` (0..100).

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch), so rendering is
safe in threads and headless runs. This module imports neither gRPC nor torch.
"""

from __future__ import annotations

import io
import json
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "REPORT_SCHEMA",
    "AgreementPoint",
    "AgreementStats",
    "LatencySummary",
    "ModeReport",
    "ReplayReport",
    "agreement_title",
    "error_axis_bound",
    "latency_percentiles",
    "plot_agreement",
    "read_json",
    "render_rows",
    "render_table",
    "rolling_exact_match_pct",
    "write_json",
]

REPORT_SCHEMA = "kvservice.replay.report/v1"
"""The ``schema`` value of a report written by :func:`write_json`."""

AgreementPoint = tuple[int, int, int]
"""One request of the agreement series: (request index, predicted hit blocks, actual hit blocks)."""


def _pct(numerator: float, denominator: float) -> float | None:
    return 100.0 * numerator / denominator if denominator else None


# --------------------------------------------------------------------------------------------
# Model


@dataclass(slots=True)
class AgreementStats:
    """How well a watcher's predicted prefix hits matched the server's actual hits.

    Attributes:
        num_compared: requests compared.
        num_exact: requests whose predicted hit equals the actual hit (in blocks).
        mean_abs_error_blocks: mean of ``|predicted - actual|``, in blocks.
        mean_predicted_blocks: mean predicted hit depth, in blocks.
        mean_actual_blocks: mean actual hit depth, in blocks.
    """

    num_compared: int
    num_exact: int
    mean_abs_error_blocks: float
    mean_predicted_blocks: float
    mean_actual_blocks: float

    @property
    def exact_match_pct(self) -> float | None:
        """Exact matches in percent of the requests compared (None when none were)."""
        return _pct(self.num_exact, self.num_compared)

    @classmethod
    def from_pairs(cls, predicted_blocks: Sequence[int], actual_blocks: Sequence[int]) -> AgreementStats:
        """Summarises per-request predicted and actual hits (blocks), paired by position.

        Raises:
            ValueError: the sequences differ in length.
        """
        if len(predicted_blocks) != len(actual_blocks):
            raise ValueError(f"{len(predicted_blocks)} predictions but {len(actual_blocks)} actual hits")
        if not predicted_blocks:
            return cls(0, 0, 0.0, 0.0, 0.0)
        predicted = np.asarray(predicted_blocks, dtype=np.int64)
        actual = np.asarray(actual_blocks, dtype=np.int64)
        return cls(
            num_compared=len(predicted),
            num_exact=int(np.count_nonzero(predicted == actual)),
            mean_abs_error_blocks=float(np.abs(predicted - actual).mean()),
            mean_predicted_blocks=float(predicted.mean()),
            mean_actual_blocks=float(actual.mean()),
        )

    @classmethod
    def from_series(cls, series: Iterable[AgreementPoint]) -> AgreementStats:
        """Summarises an agreement series of (request index, predicted, actual) points."""
        points = list(series)
        return cls.from_pairs([p for _, p, _ in points], [a for _, _, a in points])


def latency_percentiles(samples_ms: Sequence[float], percentiles: Sequence[float] = (50.0, 99.0)) -> tuple[float, ...]:
    """Percentiles of latency samples (NumPy's default linear interpolation).

    Args:
        samples_ms: latencies in milliseconds.
        percentiles: the percentiles wanted, each in 0..100.

    Returns:
        One value per percentile, in milliseconds.

    Raises:
        ValueError: no samples, or a percentile outside 0..100.
    """
    if len(samples_ms) == 0:
        raise ValueError("no latency samples")
    if any(not 0 <= q <= 100 for q in percentiles):
        raise ValueError(f"percentiles must lie in 0..100; got {list(percentiles)}")
    values = np.percentile(np.asarray(samples_ms, dtype=np.float64), list(percentiles))
    return tuple(float(v) for v in values)


@dataclass(slots=True)
class LatencySummary:
    """RPC latency, in milliseconds (percentile fields are None when there were no samples).

    Attributes:
        num_samples: RPCs measured.
        p50_ms: median.
        p99_ms: 99th percentile.
        max_ms: slowest.
    """

    num_samples: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> LatencySummary:
        """Summarises latency samples given in milliseconds."""
        if len(samples_ms) == 0:
            return cls(0, None, None, None)
        p50, p99, p100 = latency_percentiles(samples_ms, (50.0, 99.0, 100.0))
        return cls(len(samples_ms), p50, p99, p100)


@dataclass(slots=True)
class ModeReport:
    """The figures of one replay in one ``kv_cache_report_mode``.

    Attributes:
        mode: the report mode (``"incremental"`` or ``"full"``).
        num_requests: requests replayed.
        num_prompt_tokens: tokens over every admission (a request readmitted after a recompute
            preemption counts again, with its outputs so far).
        num_hit_tokens: tokens the server reported as prefix-cache hits, over every admission.
        num_prompt_blocks: blocks over every admission (as the producer counts them, e.g.
            full blocks per prompt).
        num_hit_blocks: blocks the server reported as prefix-cache hits, over every admission.
        num_first_admission_prompt_tokens: prompt tokens of the requests admitted, each counted at
            its first admission only (the trace's prompts, as ``replay.multi`` counts them).
        num_first_admission_hit_tokens: the prefix-cache hit of each request's first admission,
            in tokens, summed. A readmission's hit on its own just-computed prefix does not count,
            so, unlike ``num_hit_tokens``, this rate does not rise when a small pool thrashes.
        num_prefill_tokens: tokens actually computed by prefill, in tokens (every admission's and
            prefill chunk's scheduled tokens, recomputation after preemption included; hits and
            decode tokens excluded; ``SchedulerStats.num_prefill_tokens``).
        num_readmission_max_hit_tokens: over the readmissions, the most each could hit (all but
            its last token, in whole blocks), in tokens.
        num_ideal_hit_tokens: what an infinite cache would have hit over these same admissions, in
            tokens: each request's first admission as ``traces.ideal_prefix_hits`` has it, each
            readmission its most (``num_ideal_hit_tokens`` >= ``num_hit_tokens`` on every run;
            None when not computed).
        agreement: the watcher's predicted hits against the server's actual hits.
        num_events: KV events the watcher received.
        num_batches: event batches the watcher received.
        num_preemptions: requests preempted (each readmission is counted once).
        rpc_latency: the scheduler's RPC round trips.
        wall_time_s: the replay's wall-clock time, in seconds.
        mirror_capacity_blocks: blocks the watcher's mirror is sized for.
        pool_size_blocks: blocks in the server's pool.
        series: per request, (request index, predicted hit blocks, actual hit blocks), in replay
            order; may be empty.
        late_watcher: the agreement of a watcher that joined halfway through from a snapshot,
            over the admissions after it joined (None when none ran).
        first_watcher_since_late_join: the first watcher's agreement over those same admissions.
        kv_data: what the ``--kv-data`` worker moved and checked (``mode``, ``bytes_written``,
            ``bytes_read``, ``write_gbps``, ``read_gbps``, ``blocks_written``, ``blocks_checked``,
            ``mismatches``, ``sample``; see ``kvservice.replay.kv_data``), None when off.
    """

    mode: str
    num_requests: int
    num_prompt_tokens: int
    num_hit_tokens: int
    num_prompt_blocks: int
    num_hit_blocks: int
    num_first_admission_prompt_tokens: int
    num_first_admission_hit_tokens: int
    num_prefill_tokens: int
    agreement: AgreementStats
    num_events: int
    num_batches: int
    num_preemptions: int
    rpc_latency: LatencySummary
    wall_time_s: float
    mirror_capacity_blocks: int
    pool_size_blocks: int
    num_readmission_max_hit_tokens: int = 0
    num_ideal_hit_tokens: int | None = None
    series: list[AgreementPoint] = field(default_factory=list)
    late_watcher: AgreementStats | None = None
    first_watcher_since_late_join: AgreementStats | None = None
    kv_data: dict[str, Any] | None = None

    @property
    def hit_rate_tokens_pct(self) -> float | None:
        """Prefix-cache hit rate in tokens over every admission, percent (None without prompt
        tokens)."""
        return _pct(self.num_hit_tokens, self.num_prompt_tokens)

    @property
    def first_admission_hit_rate_tokens_pct(self) -> float | None:
        """Prefix-cache hit rate in tokens over each request's first admission, percent (None
        without prompt tokens)."""
        return _pct(self.num_first_admission_hit_tokens, self.num_first_admission_prompt_tokens)

    @property
    def ideal_hit_rate_tokens_pct(self) -> float | None:
        """What an infinite cache would hit over these admissions, percent of their tokens (the
        bound of :attr:`hit_rate_tokens_pct`; None when not computed)."""
        if self.num_ideal_hit_tokens is None:
            return None
        return _pct(self.num_ideal_hit_tokens, self.num_prompt_tokens)

    @property
    def hit_rate_blocks_pct(self) -> float | None:
        """Prefix-cache hit rate in blocks, percent (None without prompt blocks)."""
        return _pct(self.num_hit_blocks, self.num_prompt_blocks)


@dataclass(slots=True)
class ReplayReport:
    """A replay: its run metadata and one or two :class:`ModeReport`.

    Attributes:
        trace_path: the trace replayed.
        num_trace_lines: trace lines (requests) replayed.
        preset: the KV cache preset the server ran.
        block_size: the service's block size, in tokens.
        num_blocks: blocks in the server's pool.
        modes: one report per mode that ran, in run order (one or two, distinct modes).
        ideal_hit_rate_tokens_pct: the infinite-cache prefix hit rate of the replayed requests at
            ``block_size``, each once (``traces.ideal_prefix_hits``: the bound of every mode's
            first-admission rate), if computed.
        metadata: other run facts (versions, hash algorithm, start time ...), JSON scalars only.

    Raises:
        ValueError: no mode, more than two, or a mode named twice.
    """

    trace_path: str
    num_trace_lines: int
    preset: str
    block_size: int
    num_blocks: int
    modes: list[ModeReport]
    ideal_hit_rate_tokens_pct: float | None = None
    metadata: dict[str, str | int | float | bool | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= len(self.modes) <= 2:
            raise ValueError(f"a report holds one or two modes; got {len(self.modes)}")
        names = [m.mode for m in self.modes]
        if len(set(names)) != len(names):
            raise ValueError(f"mode named twice: {names}")

    def mode(self, name: str) -> ModeReport:
        """The report of mode ``name``.

        Raises:
            KeyError: that mode did not run.
        """
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready plain data (derived percentages included for readers)."""
        return {
            "schema": REPORT_SCHEMA,
            "trace_path": self.trace_path,
            "num_trace_lines": self.num_trace_lines,
            "preset": self.preset,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "ideal_hit_rate_tokens_pct": self.ideal_hit_rate_tokens_pct,
            "metadata": dict(self.metadata),
            "modes": [_mode_to_dict(m) for m in self.modes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayReport:
        """Rebuilds a report from :meth:`to_dict` output (derived fields are ignored).

        Raises:
            ValueError: an unknown ``schema``.
            KeyError: a required field is missing.
        """
        schema = data.get("schema")
        if schema != REPORT_SCHEMA:
            raise ValueError(f"unknown report schema {schema!r}; expected {REPORT_SCHEMA!r}")
        return cls(
            trace_path=data["trace_path"],
            num_trace_lines=data["num_trace_lines"],
            preset=data["preset"],
            block_size=data["block_size"],
            num_blocks=data["num_blocks"],
            modes=[_mode_from_dict(m) for m in data["modes"]],
            ideal_hit_rate_tokens_pct=data.get("ideal_hit_rate_tokens_pct"),
            metadata=dict(data.get("metadata", {})),
        )


_AGREEMENT_FIELDS = (
    "num_compared",
    "num_exact",
    "mean_abs_error_blocks",
    "mean_predicted_blocks",
    "mean_actual_blocks",
)
_LATENCY_FIELDS = ("num_samples", "p50_ms", "p99_ms", "max_ms")
_MODE_SCALAR_FIELDS = (
    "mode",
    "num_requests",
    "num_prompt_tokens",
    "num_hit_tokens",
    "num_prompt_blocks",
    "num_hit_blocks",
    "num_first_admission_prompt_tokens",
    "num_first_admission_hit_tokens",
    "num_prefill_tokens",
    "num_events",
    "num_batches",
    "num_preemptions",
    "wall_time_s",
    "mirror_capacity_blocks",
    "pool_size_blocks",
    "num_readmission_max_hit_tokens",
    "num_ideal_hit_tokens",
)


def _agreement_to_dict(a: AgreementStats | None) -> dict[str, Any] | None:
    if a is None:
        return None
    d: dict[str, Any] = {k: getattr(a, k) for k in _AGREEMENT_FIELDS}
    d["exact_match_pct"] = a.exact_match_pct
    return d


def _agreement_from_dict(d: dict[str, Any]) -> AgreementStats:
    return AgreementStats(**{k: d[k] for k in _AGREEMENT_FIELDS})


def _mode_to_dict(m: ModeReport) -> dict[str, Any]:
    d: dict[str, Any] = {k: getattr(m, k) for k in _MODE_SCALAR_FIELDS}
    d["hit_rate_tokens_pct"] = m.hit_rate_tokens_pct
    d["hit_rate_blocks_pct"] = m.hit_rate_blocks_pct
    d["first_admission_hit_rate_tokens_pct"] = m.first_admission_hit_rate_tokens_pct
    d["ideal_hit_rate_tokens_pct"] = m.ideal_hit_rate_tokens_pct
    d["agreement"] = _agreement_to_dict(m.agreement)
    d["rpc_latency"] = {k: getattr(m.rpc_latency, k) for k in _LATENCY_FIELDS}
    d["series"] = [list(p) for p in m.series]
    d["late_watcher"] = _agreement_to_dict(m.late_watcher)
    d["first_watcher_since_late_join"] = _agreement_to_dict(m.first_watcher_since_late_join)
    d["kv_data"] = dict(m.kv_data) if m.kv_data is not None else None
    return d


_FIELDS_ADDED_LATER: dict[str, Any] = {
    "num_first_admission_prompt_tokens": 0,
    "num_first_admission_hit_tokens": 0,
    "num_prefill_tokens": 0,
    "num_readmission_max_hit_tokens": 0,
    "num_ideal_hit_tokens": None,
}
"""Absent from reports written before they existed: read as these (their rates as unknown)."""


def _mode_from_dict(d: dict[str, Any]) -> ModeReport:
    return ModeReport(
        **{k: d.get(k, _FIELDS_ADDED_LATER[k]) if k in _FIELDS_ADDED_LATER else d[k] for k in _MODE_SCALAR_FIELDS},
        agreement=_agreement_from_dict(d["agreement"]),
        rpc_latency=LatencySummary(**{k: d["rpc_latency"][k] for k in _LATENCY_FIELDS}),
        series=[(int(i), int(p), int(a)) for i, p, a in d.get("series", [])],
        late_watcher=_agreement_from_dict(d["late_watcher"]) if d.get("late_watcher") else None,
        first_watcher_since_late_join=(
            _agreement_from_dict(d["first_watcher_since_late_join"]) if d.get("first_watcher_since_late_join") else None
        ),
        kv_data=dict(d["kv_data"]) if d.get("kv_data") else None,
    )


# --------------------------------------------------------------------------------------------
# JSON


def write_json(report: ReplayReport, path: str | Path) -> Path:
    """Writes ``report`` as JSON (indented; each series on one line), creating parent folders.

    Returns:
        The path written.
    """
    data = report.to_dict()
    # Keep the long per-request series compact: one line each instead of five lines a point.
    return write_json_with_compact_lists(data, path, [(mode, "series") for mode in data["modes"]])


def write_json_with_compact_lists(data: dict[str, Any], path: str | Path, compact: list[tuple[dict, str]]) -> Path:
    """Writes ``data`` as indented JSON, except that each ``container[key]`` named in ``compact``
    (a long list) goes on one line; creates parent folders. Returns the path written."""
    path = Path(path)
    placeholders: dict[str, str] = {}
    for container, key in compact:
        token = f"@{key}-{uuid.uuid4().hex}@"
        placeholders[json.dumps(token)] = json.dumps(container[key], separators=(",", ":"))
        container[key] = token
    text = json.dumps(data, indent=2, allow_nan=False)
    for token, value in placeholders.items():
        text = text.replace(token, value, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def read_json(path: str | Path) -> ReplayReport:
    """Reads a report written by :func:`write_json`.

    Raises:
        ValueError: not JSON, or an unknown schema.
        KeyError: a required field is missing.
    """
    return ReplayReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# --------------------------------------------------------------------------------------------
# Terminal table


def _fmt_int(v: int) -> str:
    return f"{v:,}"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} %"


def _fmt_float(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.{digits}f}"


def _fmt_agreement(a: AgreementStats) -> list[tuple[str, str]]:
    return [
        ("exact match (requests)", f"{_fmt_pct(a.exact_match_pct)} of {_fmt_int(a.num_compared)}"),
        ("mean abs error (blocks)", _fmt_float(a.mean_abs_error_blocks, 3)),
        (
            "mean depth predicted / actual (blocks)",
            f"{_fmt_float(a.mean_predicted_blocks)} / {_fmt_float(a.mean_actual_blocks)}",
        ),
    ]


def _fmt_short_agreement(a: AgreementStats | None) -> str:
    if a is None:
        return "-"
    return f"{_fmt_pct(a.exact_match_pct)} of {_fmt_int(a.num_compared)}, MAE {_fmt_float(a.mean_abs_error_blocks, 3)}"


def _kv_data_rows(kv: dict[str, Any] | None) -> list[tuple[str, str]]:
    kv = kv or {}
    sample = f" (1 in {kv['sample']} by hash)" if kv.get("sample", 1) != 1 else ""
    return [
        (f"kv data: mode{sample}", str(kv.get("mode", "off"))),
        (
            "kv data: written / read (MB)",
            f"{_fmt_float(kv.get('bytes_written', 0) / 1e6, 1)} / {_fmt_float(kv.get('bytes_read', 0) / 1e6, 1)}",
        ),
        (
            "kv data: write / read (GB/s)",
            f"{_fmt_float(kv.get('write_gbps'), 2)} / {_fmt_float(kv.get('read_gbps'), 2)}",
        ),
        (
            "kv data: hit blocks checked / mismatches",
            f"{_fmt_int(kv.get('blocks_checked', 0))} / {_fmt_int(kv.get('mismatches', 0))}",
        ),
        (
            "kv data: hits before written / never written / writes after free",
            f"{_fmt_int(kv.get('reads_before_written', 0))} / {_fmt_int(kv.get('reads_never_written', 0))} / "
            f"{_fmt_int(kv.get('writes_after_free', 0))}",
        ),
    ]


def _mode_rows(m: ModeReport, *, late: bool, kv_data: bool = False, ideal: bool = False) -> list[tuple[str, str]]:
    lat = m.rpc_latency
    late_rows = (
        [
            ("late watcher since it joined: exact, MAE", _fmt_short_agreement(m.late_watcher)),
            ("first watcher, same requests: exact, MAE", _fmt_short_agreement(m.first_watcher_since_late_join)),
        ]
        if late
        else []
    )
    return [
        ("requests", _fmt_int(m.num_requests)),
        ("prompt tokens", _fmt_int(m.num_prompt_tokens)),
        ("prefix hit rate (tokens)", _fmt_pct(m.hit_rate_tokens_pct)),
        ("prefix hit rate (blocks)", _fmt_pct(m.hit_rate_blocks_pct)),
        ("prefix hit rate, first admissions (tokens)", _fmt_pct(m.first_admission_hit_rate_tokens_pct)),
        *(
            [("ideal, infinite cache, same admissions (tokens)", _fmt_pct(m.ideal_hit_rate_tokens_pct))]
            if ideal
            else []
        ),
        ("tokens prefilled (recompute included)", _fmt_int(m.num_prefill_tokens)),
        *_fmt_agreement(m.agreement),
        *late_rows,
        ("events / batches received", f"{_fmt_int(m.num_events)} / {_fmt_int(m.num_batches)}"),
        ("preemptions", _fmt_int(m.num_preemptions)),
        ("RPC calls timed", _fmt_int(lat.num_samples)),
        (
            "RPC latency p50 / p99 (ms)",
            f"{_fmt_float(lat.p50_ms, 3)} / {_fmt_float(lat.p99_ms, 3)}",
        ),
        ("wall time (s)", _fmt_float(m.wall_time_s)),
        (  # num_blocks as everywhere else (block 0, the null block, included)
            "mirror capacity / num_blocks (blocks)",
            f"{_fmt_int(m.mirror_capacity_blocks)} / {_fmt_int(m.pool_size_blocks + 1)}",
        ),
        *(_kv_data_rows(m.kv_data) if kv_data else []),
    ]


def _is_path(layout: str) -> bool:
    """Whether the server's layout name is a file (``--model-config``, ``--kv-cache-layout``), not
    a preset's name."""
    return "/" in layout or layout.endswith((".json", ".toml"))


def render_rows(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[tuple[str, str]]],
    *,
    notes: Sequence[str] = (),
    width: int = 120,
) -> str:
    """A metric table as plain text (rich, no colour codes): one column per run side by side, the
    replay's reports' shape (``render_table``, ``render_multi_table``, the vLLM tier replay's).

    Args:
        title: above the table, left-justified (may span lines).
        columns: the runs' names, one per value column.
        rows: per column, its ``(label, value)`` rows, the same labels in the same order in each
            (the first column's labels are printed).
        notes: lines printed under the table.
        width: the console width in characters.

    Returns:
        The rendered table, lines joined by newlines, trailing spaces stripped.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for i, (label, _) in enumerate(rows[0]):
        table.add_row(label, *(column[i][1] for column in rows))
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False, markup=False)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def render_table(report: ReplayReport, *, width: int = 120) -> str:
    """The report as a plain-text terminal table (rich, no colour codes), modes side by side.

    Args:
        report: the report.
        width: the console width in characters.

    Returns:
        The rendered table, lines joined by newlines.
    """
    title = (
        f"kvservice replay: {Path(report.trace_path).name} ({report.num_trace_lines:,} lines)"
        f"\n{'layout' if _is_path(report.preset) else 'preset'} {report.preset}, block_size {report.block_size} tokens, "
        f"num_blocks {report.num_blocks:,}"
    )
    late = any(m.late_watcher is not None for m in report.modes)
    kv_data = any(m.kv_data is not None for m in report.modes)
    ideal = any(m.num_ideal_hit_tokens is not None for m in report.modes)
    per_mode = [_mode_rows(m, late=late, kv_data=kv_data, ideal=ideal) for m in report.modes]
    notes = []
    skipped = {k: v for k, v in report.metadata.items() if k.startswith("requests_skipped") and v}
    if skipped:
        notes.append(f"skipped {max(skipped.values()):,} trace requests whose prompt is max_model_len tokens or longer")
    if report.ideal_hit_rate_tokens_pct is not None:
        notes.append(
            "ideal prefix hit rate, infinite cache, each request once (tokens; bounds the first-admission rate): "
            f"{_fmt_pct(report.ideal_hit_rate_tokens_pct)}"
        )
    return render_rows(title, [m.mode for m in report.modes], per_mode, notes=notes, width=width)


# --------------------------------------------------------------------------------------------
# Plot


def rolling_exact_match_pct(series: Sequence[AgreementPoint], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Rolling exact-match rate over the last ``window`` requests of an agreement series.

    The first ``window - 1`` points average over the requests so far.

    Args:
        series: (request index, predicted, actual) points in replay order.
        window: requests per window (>= 1).

    Returns:
        (request indices, exact-match percent per point), both of length ``len(series)``.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    if not series:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    points = np.asarray(series, dtype=np.int64).reshape(-1, 3)
    exact = (points[:, 1] == points[:, 2]).astype(np.float64)
    csum = np.concatenate(([0.0], np.cumsum(exact)))
    ends = np.arange(1, len(exact) + 1)
    starts = np.maximum(ends - window, 0)
    return points[:, 0], 100.0 * (csum[ends] - csum[starts]) / (ends - starts)


def agreement_title(report: ReplayReport) -> str:
    """The agreement plot's title: the trace, the layout, and the pool and mirror capacity that
    decide the result."""
    mirrors = sorted({m.mirror_capacity_blocks for m in report.modes})
    mirror = ", ".join("unbounded" if c == 0 else f"{c:,} blocks" for c in mirrors) or "?"
    pool = report.modes[0].pool_size_blocks if report.modes else report.num_blocks - 1
    return (
        f"Watcher-predicted vs server prefix-cache hits: {Path(report.trace_path).name}\n"
        f"preset {report.preset}, block_size {report.block_size} tokens; pool {pool:,} blocks, "
        f"mirror capacity {mirror}"
    )


def error_axis_bound(errors: np.ndarray) -> int:
    """The error panel's half-height, in blocks: 1.5 x the 95th percentile of ``|error|`` (at
    least 2), so a few outliers do not flatten every other point (those beyond are drawn at the
    edge and counted in the panel's title); evenly spread errors are not clipped."""
    if errors.size == 0:
        return 2
    return max(2, int(np.ceil(1.5 * np.percentile(np.abs(errors), 95))))


def plot_agreement(report: ReplayReport, path: str | Path, *, window: int = 50) -> Path:
    """Plots predicted-vs-actual agreement over the replay as a PNG.

    Top: the rolling exact-match percent over ``window`` requests, one line per mode (overlaid).
    Bottom: each request's error, predicted minus actual hit depth in blocks, per mode.

    Args:
        report: the report (modes with an empty series are labelled "no data").
        path: the PNG to write (parent folders are created).
        window: requests per rolling window (>= 1).

    Returns:
        The path written.

    Raises:
        ValueError: ``window < 1``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    path = Path(path)
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_err = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    colours = {"incremental": "tab:blue", "full": "tab:orange"}
    errors = [np.asarray(m.series, dtype=np.int64).reshape(-1, 3) for m in report.modes]
    every_error = np.concatenate([p[:, 1] - p[:, 2] for p in errors]) if errors else np.zeros(0, np.int64)
    bound = error_axis_bound(every_error)
    num_clipped = int(np.count_nonzero(np.abs(every_error) > bound))
    for m, points in zip(report.modes, errors):
        colour = colours.get(m.mode)
        x, rate = rolling_exact_match_pct(m.series, window)
        exact = _fmt_pct(m.agreement.exact_match_pct)
        if len(x) == 0:
            ax_rate.plot([], [], color=colour, label=f"{m.mode} (no data)")
            continue
        ax_rate.plot(x, rate, color=colour, linewidth=1.5, label=f"{m.mode} (overall {exact})")
        ax_err.scatter(
            points[:, 0],
            np.clip(points[:, 1] - points[:, 2], -bound, bound),
            s=6,
            alpha=0.6,
            color=colour,
            label=m.mode,
        )
    ax_rate.set_ylim(-2, 102)
    ax_rate.set_ylabel(f"exact match, rolling {window} admissions (%)")
    ax_rate.grid(True, alpha=0.3)
    ax_rate.legend(loc="lower left")
    ax_err.axhline(0, color="0.4", linewidth=0.8)
    ax_err.set_ylim(-1.08 * bound, 1.08 * bound)
    clipped = f"; {num_clipped} beyond ±{bound} drawn at the edge" if num_clipped else ""
    ax_err.set_ylabel("predicted − actual hit (blocks)")
    ax_err.set_title(f"error per admission{clipped}", fontsize=9, loc="left")
    ax_err.set_xlabel("admission (replay order)")
    ax_err.grid(True, alpha=0.3)
    if any(m.series for m in report.modes):
        ax_err.legend(loc="best")
    fig.suptitle(agreement_title(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path
