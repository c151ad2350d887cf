"""The PNG of ``kvservice replay --instances N``: hit rate per policy over the replay, and each
instance's load per policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvservice.replay.multi_report import MultiReport

__all__ = ["plot_routing", "rolling_hit_rate_pct", "routing_title"]


def rolling_hit_rate_pct(series: list[tuple[int, int, int]], window: int) -> tuple[np.ndarray, np.ndarray]:
    """(admission number, hit rate in tokens over the last ``window`` first admissions, percent)
    of a policy's ``hit_series`` (trace order); empty arrays for an empty series.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    if not series:
        return np.zeros(0), np.zeros(0)
    points = np.asarray(series, dtype=np.int64).reshape(-1, 3)
    prompt, hit = np.cumsum(points[:, 1]), np.cumsum(points[:, 2])
    start = np.maximum(np.arange(len(points)) - window, -1)
    prompt_before = np.where(start >= 0, prompt[np.clip(start, 0, None)], 0)
    hit_before = np.where(start >= 0, hit[np.clip(start, 0, None)], 0)
    tokens = prompt - prompt_before
    rate = np.where(tokens > 0, 100.0 * (hit - hit_before) / np.maximum(tokens, 1), 0.0)
    return np.arange(1, len(points) + 1), rate


def routing_title(report: MultiReport) -> str:
    """The plot's title: the trace, the instances and their pools, the mirror capacity."""
    mirrors = sorted({p.mirror_capacity_blocks for p in report.policies})
    mirror = ", ".join("unbounded" if c == 0 else f"{c:,} blocks" for c in mirrors) or "?"
    return (
        f"Routed by predicted hit vs round-robin: {Path(report.trace_path).name}\n"
        f"{report.instances} instances of {report.num_blocks_per_instance:,} blocks (preset {report.preset}, "
        f"block_size {report.block_size}), mirror capacity {mirror}, report mode {report.report_mode}"
    )


def plot_routing(report: MultiReport, path: str | Path, *, window: int = 50) -> Path:
    """Write the routing PNG: top, each policy's prefix hit rate (tokens) over the last
    ``window`` first admissions; bottom, requests routed to each instance, per policy.

    Returns:
        The path written (parent folders are created).

    Raises:
        ValueError: ``window < 1``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_rate, ax_load = fig.subplots(2, 1, height_ratios=(3, 2))
    colours = {"routed": "tab:green", "round-robin": "tab:gray"}
    for policy in report.policies:
        x, rate = rolling_hit_rate_pct(policy.hit_series, window)
        overall = policy.hit_rate_tokens_pct
        label = f"{policy.policy} (overall {overall:.1f} %)" if overall is not None else f"{policy.policy} (no data)"
        ax_rate.plot(x, rate, color=colours.get(policy.policy), linewidth=1.5, label=label)
    ax_rate.set_ylim(-2, 102)
    ax_rate.set_xlabel("first admission (trace order)")
    ax_rate.set_ylabel(f"prefix hit rate, rolling {window} admissions (% tokens)")
    ax_rate.grid(True, alpha=0.3)
    ax_rate.legend(loc="lower right")
    width = 0.8 / max(len(report.policies), 1)
    instances = np.arange(report.instances)
    for k, policy in enumerate(report.policies):
        ax_load.bar(
            instances + (k - (len(report.policies) - 1) / 2) * width,
            policy.num_requests_per_instance,
            width=width,
            color=colours.get(policy.policy),
            label=policy.policy,
        )
    ax_load.set_xticks(instances, [str(i) for i in instances])
    ax_load.set_xlabel("instance")
    ax_load.set_ylabel("requests routed")
    ax_load.grid(True, axis="y", alpha=0.3)
    ax_load.legend(loc="best")
    fig.suptitle(routing_title(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path
