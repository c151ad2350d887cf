"""kvservice benchmarks: every figure beside a baseline measured in the same run, and the ratio.

    python scripts/bench/run.py                 # everything (under 10 minutes on 2 cores)
    python scripts/bench/run.py --quick         # a smoke run of the harness (seconds)
    python scripts/bench/run.py --only core,rpc --json out.json

vLLM's KVCacheManager is the core-ops baseline when a Python with vLLM is found (``--vllm-python``,
default ``$KVSERVICE_VLLM_PYTHON`` or ``~/vllm-ref/bin/python``; BENCHMARKS.md, "The vLLM baseline", says how to make one);
without it that column is skipped with a message. Speed figures are medians of several rounds,
ours and the baseline's alternating, so a noisy machine moves both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import decode_bench  # noqa: E402
import events_bench  # noqa: E402
import fanout_bench  # noqa: E402
import hashing_bench  # noqa: E402
import memory_bench  # noqa: E402
import rpc_bench  # noqa: E402

BENCHES = ("core", "hashing", "rpc", "events", "memory", "scaling")


class Row(dict):
    """One line of the table: a figure (median over rounds), its baseline, the ratio and the target.

    ``ratios`` (one per round, each against its own round's baseline) gives the ratio as their
    median and its spread (lowest to highest); without it the ratio is ``value / baseline_value``.
    ``values`` (one per round) gives the spread of a figure that has no baseline.
    """

    def __init__(
        self,
        bench: str,
        figure: str,
        value: float | None,
        unit: str,
        baseline: str = "",
        baseline_value: float | None = None,
        target: str = "",
        met: bool | None = None,
        *,
        ratios: list[float] | None = None,
        values: list[float] | None = None,
    ) -> None:
        if ratios:
            ratio: float | None = statistics.median(ratios)
            spread = (min(ratios), max(ratios))
        else:
            ratio = value / baseline_value if value is not None and baseline_value else None
            spread = (min(values), max(values)) if values else None
        super().__init__(
            bench=bench,
            figure=figure,
            value=value,
            unit=unit,
            baseline=baseline,
            baseline_value=baseline_value,
            ratio=ratio,
            spread=spread,
            spread_of="ratio" if ratios else ("value" if values else None),
            rounds=len(ratios or values or ()) or None,
            target=target,
            met=met,
        )


def _subprocess_json(python: str, script: Path, args: object) -> object:
    out = subprocess.run(
        [python, str(script), json.dumps(args)], capture_output=True, text=True, check=True, cwd=str(HERE)
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _vllm_python(explicit: str | None) -> str | None:
    candidates = [explicit, os.environ.get("KVSERVICE_VLLM_PYTHON"), str(Path.home() / "vllm-ref/bin/python")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import vllm.v1.core.kv_cache_manager"], capture_output=True, cwd="/"
            )
            if probe.returncode == 0:
                return candidate
    return None


CORE_CONFIGS: tuple[tuple[str, dict, float | None], ...] = (
    ("events on, 0 % shared", dict(events=True, shared_fraction=0.0), 4.0),
    ("events on, 50 % shared", dict(events=True, shared_fraction=0.5), 4.0),
    ("events off, 0 % shared", dict(events=False, shared_fraction=0.0), None),
    ("events off, 50 % shared", dict(events=False, shared_fraction=0.5), None),
    ("hybrid: full + 1k sliding window, events on", dict(events=True, hybrid=True), 2.0),
    ("Mooncake sample, 32k-block pool, events on", dict(events=True, workload="mooncake", num_blocks=32768), 2.0),
)
"""(label, core_ops keyword arguments, target ratio against vLLM or None). Synthetic and hybrid
rows are 2,048-token prompts; the Mooncake row is the trace's first prompts in arrival order."""


def bench_core(quick: bool, vllm_python: str | None) -> list[Row]:
    """Core ops, kvservice vs vLLM: events on/off, 0 % and 50 % shared prefix, a hybrid pool (full
    attention + sliding window) and the Mooncake sample; ours and vLLM's runs alternate, and each
    round's ratio is against the same round's vLLM figure."""
    n = 60 if quick else 400
    configs = [dict(num_requests=(20 if quick else 120) if c.get("workload") else n, **c) for _, c, _ in CORE_CONFIGS]
    rounds = 1 if quick else 5
    ours: list[list[dict]] = []
    theirs: list[list[dict]] = []
    for _ in range(rounds):
        ours.append(_subprocess_json(sys.executable, HERE / "core_ops.py", configs))  # type: ignore[arg-type]
        if vllm_python:
            theirs.append(_subprocess_json(vllm_python, HERE / "vllm_core_ops.py", configs))  # type: ignore[arg-type]
    rows = []
    for i, (label, config, target) in enumerate(CORE_CONFIGS):
        figure = f"{'Mooncake' if config.get('workload') else '2048-token'} requests/s ({label})"
        rates = [r[i]["requests_per_s"] for r in ours]
        rate = statistics.median(rates)
        base = statistics.median(r[i]["requests_per_s"] for r in theirs) if theirs else None
        ratios = [o[i]["requests_per_s"] / t[i]["requests_per_s"] for o, t in zip(ours, theirs)] if theirs else None
        ratio = statistics.median(ratios) if ratios else None
        rows.append(
            Row(
                "core",
                figure,
                rate,
                "req/s",
                "vLLM KVCacheManager" if base else "vLLM not installed: skipped",
                base,
                f">= {target:g}x" if target else "",
                (ratio >= target) if ratio is not None and target else None,
                ratios=ratios,
                values=None if ratios else rates,
            )
        )
        us = [r[i]["us_per_block"] for r in ours]
        rows.append(Row("core", f"us per block ({label})", statistics.median(us), "us", values=us))
    return rows


def bench_hashing(quick: bool) -> list[Row]:
    """Block hashes/s per algorithm against the bare digest over the same bytes, per round."""
    rounds = [hashing_bench.run(num_tokens=32_768 if quick else 262_144) for _ in range(1 if quick else 3)]
    targets = {"sha256_cbor": 0.5, "sha256": 0.6}
    rows = []
    for i, r in enumerate(rounds[0]):
        algorithm = r["algorithm"]
        floor = "hashlib.sha256" if algorithm.startswith("sha256") else "xxhash.xxh3_128"
        ratios = [rr[i]["hashes_per_s"] / rr[i]["floor_hashes_per_s"] for rr in rounds]
        target = targets.get(algorithm)
        rows.append(
            Row(
                "hashing",
                f"{algorithm} block hashes/s",
                statistics.median(rr[i]["hashes_per_s"] for rr in rounds),
                "hash/s",
                f"{floor} over the same bytes",
                statistics.median(rr[i]["floor_hashes_per_s"] for rr in rounds),
                f">= {target}x" if target else "(floor)",
                statistics.median(ratios) >= target if target else None,
                ratios=ratios,
            )
        )
    return rows


def bench_rpc(quick: bool) -> list[Row]:
    """Unary calls against a Ping, Steps of admissions against the in-process engine on the same
    ops (and the server's CPU per request against the engine's), and decode
    steps (256 and 64 running requests, per-request ops and the decode op) against a Ping; each
    ratio is per round, against the same round's baseline."""
    rounds = [rpc_bench.run(quick) for _ in range(1 if quick else 3)]
    decode_rounds = {
        n: [decode_bench.run(n, 20 if quick else 100) for _ in range(1 if quick else 3)] for n in (256, 64)
    }

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratios(key: str, base: str) -> list[float]:
        return [r[key] / r[base] for r in rounds]

    pings = [r["ping_us"] for r in rounds]
    ping = med("ping_us")
    rows = [Row("rpc", "Ping (no-op) round trip", ping, "us", values=pings)]
    for name in ("get_computed_blocks", "allocate_slots", "free"):
        rs = ratios(f"{name}_us", "ping_us")
        rows.append(
            Row(
                "rpc",
                f"{name} round trip (256 tokens)",
                med(f"{name}_us"),
                "us",
                "Ping",
                ping,
                "<= 1.3x",
                statistics.median(rs) <= 1.3,
                ratios=rs,
            )
        )
    # Each Step-of-k row against the engine running the same op sequence in process (k admitted
    # requests alive at once, the previous step's freed first, events taken once per step); an
    # older checkout's rpc_bench has only the one-request-at-a-time baseline.
    same = "in_process_step_64_requests_per_s" in rounds[0]
    for k in (1, 16, 64, 256):
        base_key = f"in_process_step_{k}_requests_per_s" if same else "in_process_requests_per_s"
        rs = ratios(f"step_{k}_requests_per_s", base_key)
        rows.append(
            Row(
                "rpc",
                f"Step of {k} admissions: requests/s",
                med(f"step_{k}_requests_per_s"),
                "req/s",
                "in-process engine, same ops" if same else "in-process engine",
                med(base_key),
                ">= 0.7x" if k == 64 else "",
                (statistics.median(rs) >= 0.7) if k == 64 else None,
                ratios=rs,
            )
        )
    if "step_64_packed_requests_per_s" in rounds[0]:  # the same Steps, prompts packed
        rs = ratios("step_64_packed_requests_per_s", "in_process_step_64_requests_per_s")
        rows.append(
            Row(
                "rpc",
                "Step of 64 admissions, packed prompts: requests/s",
                med("step_64_packed_requests_per_s"),
                "req/s",
                "in-process engine, same ops",
                med("in_process_step_64_requests_per_s"),
                ">= 0.7x",
                statistics.median(rs) >= 0.7,
                ratios=rs,
            )
        )
        rs = [r["in_process_step_64_cpu_us"] / r["step_64_packed_server_cpu_us"] for r in rounds]
        rows.append(
            Row(
                "rpc",
                "Step of 64 admissions, packed prompts: server CPU per request",
                med("step_64_packed_server_cpu_us"),
                "us",
                "in-process engine CPU, same ops",
                med("in_process_step_64_cpu_us"),
                ratios=rs,
            )
        )
    if "step_64_server_cpu_us" in rounds[0]:  # CPU per request: what a loaded machine does not blur
        rs = [r["in_process_step_64_cpu_us"] / r["step_64_server_cpu_us"] for r in rounds]
        rows.append(
            Row(
                "rpc",
                "Step of 64 admissions: server CPU per request",
                med("step_64_server_cpu_us"),
                "us",
                "in-process engine CPU, same ops",
                med("in_process_step_64_cpu_us"),
                ratios=rs,
            )
        )
    if same:  # the earlier baseline, kept for comparison: one request admitted and freed at a time
        rs = ratios("step_64_requests_per_s", "in_process_requests_per_s")
        rows.append(
            Row(
                "rpc",
                "Step of 64 admissions: requests/s",
                med("step_64_requests_per_s"),
                "req/s",
                "in-process engine, one request at a time",
                med("in_process_requests_per_s"),
                ratios=rs,
            )
        )
    for n, target in ((256, 3.0), (64, 2.0)):
        dr = decode_rounds[n]
        for mode, label in (("per_request", "one allocate_slots op each"), ("decode", "one decode op")):
            if f"{mode}_ratio" not in dr[0]:
                continue  # an older checkout without the decode op
            rs = [r[f"{mode}_ratio"] for r in dr]
            rows.append(
                Row(
                    "rpc",
                    f"decode step, {n} running requests ({label}): p50",
                    statistics.median(r[f"{mode}_step_p50_us"] for r in dr),
                    "us",
                    "Ping",
                    statistics.median(r[f"{mode}_ping_p50_us"] for r in dr),
                    f"<= {target:g}x" if mode == "decode" else "",
                    statistics.median(rs) <= target if mode == "decode" else None,
                    ratios=rs,
                )
            )
        if "decode_step_p99_us" in dr[0]:
            rows.append(
                Row(
                    "rpc",
                    f"decode step, {n} running requests (one decode op): p99",
                    statistics.median(r["decode_step_p99_us"] for r in dr),
                    "us",
                    values=[r["decode_step_p99_us"] for r in dr],
                )
            )
    return rows


def bench_events(quick: bool) -> list[Row]:
    rounds = [{**events_bench.run(quick), **fanout_bench.run(quick)} for _ in range(1 if quick else 3)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratios(key: str, base: str) -> list[float]:
        return [r[key] / r[base] for r in rounds if r[base]]

    rows = []
    for fmt, unit in (("protobuf", "events"), ("msgpack", "batches")):
        rs = ratios(f"{fmt}_1w_{unit}_per_s", f"{fmt}_1w_bare_{unit}_per_s")
        rows.append(
            Row(
                "events",
                f"{fmt}: {unit}/s to 1 watcher",
                med(f"{fmt}_1w_{unit}_per_s"),
                f"{unit}/s",
                "bare gRPC stream",
                med(f"{fmt}_1w_bare_{unit}_per_s"),
                ">= 0.8x",
                statistics.median(rs) >= 0.8,
                ratios=rs,
            )
        )
        rs = ratios(f"{fmt}_8w_server_cpu_s", f"{fmt}_1w_server_cpu_s")
        rows.append(
            Row(
                "events",
                f"{fmt}: server CPU for 8 watchers",
                med(f"{fmt}_8w_server_cpu_s"),
                "s",
                "for 1 watcher",
                med(f"{fmt}_1w_server_cpu_s"),
                "<= 1.5x",
                statistics.median(rs) <= 1.5 if rs else None,
                ratios=rs,
            )
        )
        rows.append(
            Row(
                "events",
                f"{fmt}: bare stream's CPU for 8 watchers",
                med(f"{fmt}_8w_bare_server_cpu_s"),
                "s",
                "for 1 watcher",
                med(f"{fmt}_1w_bare_server_cpu_s"),
                ratios=ratios(f"{fmt}_8w_bare_server_cpu_s", f"{fmt}_1w_bare_server_cpu_s"),
            )
        )
        rows.append(
            Row(
                "events",
                f"{fmt}: {unit}/s to 8 watchers",
                med(f"{fmt}_8w_{unit}_per_s"),
                f"{unit}/s",
                "bare gRPC stream",
                med(f"{fmt}_8w_bare_{unit}_per_s"),
                ratios=ratios(f"{fmt}_8w_{unit}_per_s", f"{fmt}_8w_bare_{unit}_per_s"),
            )
        )
    for q in ("p50", "p99"):
        rows.append(
            Row(
                "events",
                f"mutation-to-watcher latency {q} (200 batches/s)",
                med(f"latency_{q}_ms"),
                "ms",
                values=[r[f"latency_{q}_ms"] for r in rounds],
            )
        )
    return rows + fanout_rows(rounds)


def fanout_rows(rounds: list[dict[str, float]]) -> list[Row]:
    """Live fan-out rows from rounds of :func:`fanout_bench.run`: server CPU for production plus
    delivery of the same live batches, 8 subscribers against 1 and ZMQ against gRPC, each ratio per
    round with its spread. Delivery alone is not shown by subtracting the 0-subscriber figure: that
    difference is smaller than production's own spread between runs (it came out negative); the
    ZMQ I/O threads' CPU, measured apart, is the delivery figure that can be read.

        python -c "import sys; sys.path.insert(0, 'scripts/bench'); import run, fanout_bench; \\
            print(run.render(run.fanout_rows([fanout_bench.run() for _ in range(3)])))"
    """

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratios(key: str, base: str) -> list[float]:
        return [r[key] / r[base] for r in rounds if r[base]]

    rows = [
        Row(
            "events",
            "live, 0 subscribers: server CPU (production alone)",
            med("live_0s_server_cpu_s"),
            "s",
            values=[r["live_0s_server_cpu_s"] for r in rounds],
        )
    ]
    for t, label in (("grpc", "gRPC live"), ("zmq", "ZMQ live")):
        rows.append(
            Row(
                "events",
                f"{label}: server CPU for 8 subscribers",
                med(f"live_{t}_8s_server_cpu_s"),
                "s",
                "for 1 subscriber",
                med(f"live_{t}_1s_server_cpu_s"),
                ratios=ratios(f"live_{t}_8s_server_cpu_s", f"live_{t}_1s_server_cpu_s"),
            )
        )
    rows.append(
        Row(
            "events",
            "ZMQ live: I/O-thread CPU for 8 subscribers",
            med("live_zmq_8s_zmq_io_cpu_s"),
            "s",
            "for 1 subscriber",
            med("live_zmq_1s_zmq_io_cpu_s"),
            ratios=ratios("live_zmq_8s_zmq_io_cpu_s", "live_zmq_1s_zmq_io_cpu_s"),
        )
    )
    for k in (8, 1):
        rows.append(
            Row(
                "events",
                f"ZMQ vs gRPC live: server CPU, {k} subscriber{'s' if k > 1 else ''}",
                med(f"live_zmq_{k}s_server_cpu_s"),
                "s",
                f"gRPC live StreamEvents, {k}",
                med(f"live_grpc_{k}s_server_cpu_s"),
                ratios=ratios(f"live_zmq_{k}s_server_cpu_s", f"live_grpc_{k}s_server_cpu_s"),
            )
        )
    return rows


def bench_memory(quick: bool) -> list[Row]:
    rows = []
    for n in (10_000,) if quick else (100_000, 1_000_000):
        r = memory_bench.run(n)
        rows.append(
            Row(
                "memory",
                f"bytes/block, empty pool of {n:,}",
                r["empty_bytes_per_block"],
                "B",
                "block ids alone (8 B ints)",
                r["ids_bytes_per_block"],
                "<= 150 B",
                r["empty_bytes_per_block"] <= 150,
            )
        )
        rows.append(
            Row(
                "memory",
                f"bytes/block, every block cached, {n:,}",
                r["cached_bytes_per_block"],
                "B",
                "block ids alone (8 B ints)",
                r["ids_bytes_per_block"],
            )
        )
    return rows


def bench_scaling(quick: bool, out_png: Path | None) -> list[Row]:
    """How the core, RPC (Step of 16 admissions) and event delivery figures grow with prompt
    length (512 to 32k tokens) and pool size (1k to 1M blocks)."""
    import core_ops

    lengths = (512, 2048) if quick else (512, 2048, 8192, 32768)
    pools = (1024, 8192) if quick else (1024, 10_000, 100_000, 1_000_000)
    rows: list[Row] = []
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}

    def add(figure: str, axis: str, x: int, value: float, unit: str) -> None:
        rows.append(Row("scaling", f"{figure}: {x:,} {'tokens' if axis == 'length' else 'blocks'}", value, unit))
        series.setdefault((figure, axis), []).append((x, value))

    for length in lengths:
        n = max(20, (200 if quick else 2000) * 2048 // length // 4)
        core = core_ops.run(n, prompt_len=length, num_blocks=max(4096, 4 * length // 16))
        add("core us/block", "length", length, core["us_per_block"], "us")
        k, num = 16, 32 if quick else 64
        rate = rpc_bench.served_step_rate(k, num, length, num_blocks=max(4096, 3 * k * length // 16))
        add("Step x16 us/block", "length", length, 1e6 / (rate * length / 16), "us")
        ev = events_bench.delivery_rate(50 if quick else 200, length, num_blocks=max(4096, 9 * length // 16))
        add("events delivered us/event", "length", length, 1e6 / ev, "us")
    for pool in pools:
        core = core_ops.run(60 if quick else 300, num_blocks=max(pool, 256))
        add("core us/block", "pool", pool, core["us_per_block"], "us")
        rate = rpc_bench.served_step_rate(16, 32 if quick else 128, 512, num_blocks=pool)
        add("Step x16 us/block", "pool", pool, 1e6 / (rate * 512 / 16), "us")
        ev = events_bench.delivery_rate(50 if quick else 300, 256, num_blocks=pool)
        add("events delivered us/event", "pool", pool, 1e6 / ev, "us")
    if out_png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figures = sorted({f for f, _ in series})
        fig, axes = plt.subplots(2, len(figures), figsize=(4 * len(figures), 7), squeeze=False)
        for col, figure in enumerate(figures):
            for row, axis in enumerate(("length", "pool")):
                ax = axes[row][col]
                xs, ys = zip(*series[(figure, axis)])
                ax.loglog(xs, ys, marker="o")
                ax.set_title(f"{figure} vs {'prompt length' if axis == 'length' else 'pool size'}", fontsize=9)
                ax.set_xlabel("tokens per request" if axis == "length" else "blocks in the pool")
                ax.set_ylabel("microseconds")
                ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_png)
        plt.close(fig)
    return rows


def render(rows: list[Row]) -> str:
    """The Markdown table: each figure a median over rounds, with its spread (lowest-highest over
    the rounds, of the ratio where there is a baseline, else of the value)."""
    lines = [
        f"| {'bench':<8} | {'figure':<66} | {'value':>16} | {'baseline':<34} | {'baseline value':>14} | "
        f"{'ratio':>7} | {'spread (rounds)':<22} | {'target':<8} | met |",
        f"|{'-' * 10}|{'-' * 68}|{'-' * 18}|{'-' * 36}|{'-' * 16}|{'-' * 9}|{'-' * 24}|{'-' * 10}|-----|",
    ]

    def num(v: float | None) -> str:
        return "" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.2f}")

    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        spread = ""
        if r.get("spread") and r.get("rounds", 0) and r["rounds"] > 1:
            lo, hi = r["spread"]
            spread = (
                f"{lo:.2f}-{hi:.2f}x" if r["spread_of"] == "ratio" else f"{num(lo)}-{num(hi)}"
            ) + f" ({r['rounds']})"
        lines.append(
            f"| {r['bench']:<8} | {r['figure']:<66} | {num(r['value']) + ' ' + r['unit']:>16} | "
            f"{r['baseline']:<34} | {num(r['baseline_value']):>14} | {ratio:>7} | {spread:<22} | "
            f"{r['target']:<8} | {met:<3} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every benchmark (seconds)")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    parser.add_argument("--json", type=Path, default=Path("bench-results.json"), help="where the results go")
    parser.add_argument("--png", type=Path, default=Path("bench-scaling.png"), help="the scaling plot")
    parser.add_argument("--vllm-python", help="a Python that has vLLM (the core-ops baseline)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline even when found")
    args = parser.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(only) - set(BENCHES)
    if unknown:
        parser.error(f"unknown bench {sorted(unknown)}; choose from {', '.join(BENCHES)}")
    vllm_python = _vllm_python(args.vllm_python) if "core" in only and not args.no_vllm else None
    if "core" in only and vllm_python is None:
        print(
            "vLLM not found (see BENCHMARKS.md, 'The vLLM baseline'): the core-ops baseline column is skipped",
            file=sys.stderr,
        )
    started = time.perf_counter()
    rows: list[Row] = []
    for bench in only:
        t0 = time.perf_counter()
        if bench == "core":
            rows += bench_core(args.quick, vllm_python)
        elif bench == "hashing":
            rows += bench_hashing(args.quick)
        elif bench == "rpc":
            rows += bench_rpc(args.quick)
        elif bench == "events":
            rows += bench_events(args.quick)
        elif bench == "memory":
            rows += bench_memory(args.quick)
        elif bench == "scaling":
            rows += bench_scaling(args.quick, args.png)
        print(f"# {bench}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    table = render(rows)
    print(table)
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"# {time.perf_counter() - started:.0f} s in all; wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
