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

import events_bench  # noqa: E402
import fanout_bench  # noqa: E402
import hashing_bench  # noqa: E402
import memory_bench  # noqa: E402
import rpc_bench  # noqa: E402

BENCHES = ("core", "hashing", "rpc", "events", "memory", "scaling")


class Row(dict):
    """One line of the table: a figure, its baseline, the ratio and the target."""

    def __init__(self, bench: str, figure: str, value: float | None, unit: str, baseline: str = "",
                 baseline_value: float | None = None, target: str = "", met: bool | None = None) -> None:
        ratio = value / baseline_value if value is not None and baseline_value else None
        super().__init__(bench=bench, figure=figure, value=value, unit=unit, baseline=baseline,
                         baseline_value=baseline_value, ratio=ratio, target=target, met=met)


def _subprocess_json(python: str, script: Path, args: object) -> object:
    out = subprocess.run([python, str(script), json.dumps(args)], capture_output=True, text=True, check=True,
                         cwd=str(HERE))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _vllm_python(explicit: str | None) -> str | None:
    candidates = [explicit, os.environ.get("KVSERVICE_VLLM_PYTHON"), str(Path.home() / "vllm-ref/bin/python")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run([candidate, "-c", "import vllm.v1.core.kv_cache_manager"], capture_output=True,
                                   cwd="/")
            if probe.returncode == 0:
                return candidate
    return None


def bench_core(quick: bool, vllm_python: str | None) -> list[Row]:
    """Core ops, kvservice vs vLLM, events on/off, 0 % and 50 % shared prefix."""
    n = 60 if quick else 600
    configs = [dict(num_requests=n, events=e, shared_fraction=f) for e in (True, False) for f in (0.0, 0.5)]
    rounds = 1 if quick else 3
    ours: list[list[dict]] = []
    theirs: list[list[dict]] = []
    for _ in range(rounds):
        ours.append(_subprocess_json(sys.executable, HERE / "core_ops.py", configs))  # type: ignore[arg-type]
        if vllm_python:
            theirs.append(_subprocess_json(vllm_python, HERE / "vllm_core_ops.py", configs))  # type: ignore[arg-type]
    rows = []
    for i, c in enumerate(configs):
        label = f"events {'on' if c['events'] else 'off'}, {int(c['shared_fraction'] * 100)} % shared"
        rate = statistics.median(r[i]["requests_per_s"] for r in ours)
        us_block = statistics.median(r[i]["us_per_block"] for r in ours)
        base = statistics.median(r[i]["requests_per_s"] for r in theirs) if theirs else None
        rows.append(Row("core", f"2048-token requests/s ({label})", rate, "req/s",
                        "vLLM KVCacheManager" if base else "vLLM not installed: skipped", base,
                        ">= 1.5x", (rate / base >= 1.5) if base else None))
        rows.append(Row("core", f"us per block ({label})", us_block, "us"))
    return rows


def bench_hashing(quick: bool) -> list[Row]:
    rows = []
    for r in hashing_bench.run(num_tokens=32_768 if quick else 262_144):
        floor = "hashlib.sha256" if r["algorithm"].startswith("sha256") else "xxhash.xxh3_128"
        rows.append(Row("hashing", f"{r['algorithm']} block hashes/s", r["hashes_per_s"], "hash/s",
                        f"{floor} over the same bytes", r["floor_hashes_per_s"], "(floor)"))
    return rows


def bench_rpc(quick: bool) -> list[Row]:
    rounds = [rpc_bench.run(quick) for _ in range(1 if quick else 3)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def med_ratio(key: str, base: str) -> float:
        return statistics.median(r[key] / r[base] for r in rounds)

    ping = med("ping_us")
    rows = [Row("rpc", "Ping (no-op) round trip", ping, "us")]
    for name in ("get_computed_blocks", "allocate_slots", "free"):
        ratio = med_ratio(f"{name}_us", "ping_us")
        rows.append(Row("rpc", f"{name} round trip (256 tokens)", ratio * ping, "us", "Ping", ping, "<= 1.3x",
                        ratio <= 1.3))
    base = med("in_process_requests_per_s")
    for k in (1, 16, 64, 256):
        ratio = med_ratio(f"step_{k}_requests_per_s", "in_process_requests_per_s")
        rows.append(Row("rpc", f"Step of {k} admissions: requests/s", ratio * base, "req/s", "in-process engine", base,
                        ">= 0.5x" if k == 64 else "", (ratio >= 0.5) if k == 64 else None))
    return rows


def bench_events(quick: bool) -> list[Row]:
    rounds = [{**events_bench.run(quick), **fanout_bench.run(quick)} for _ in range(1 if quick else 3)]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    rows = []
    for fmt, unit in (("protobuf", "events"), ("msgpack", "batches")):
        one, bare_one = med(f"{fmt}_1w_{unit}_per_s"), med(f"{fmt}_1w_bare_{unit}_per_s")
        rows.append(Row("events", f"{fmt}: {unit}/s to 1 watcher", one, f"{unit}/s", "bare gRPC stream", bare_one,
                        ">= 0.8x", one / bare_one >= 0.8))
        c1, c8 = med(f"{fmt}_1w_server_cpu_s"), med(f"{fmt}_8w_server_cpu_s")
        rows.append(Row("events", f"{fmt}: server CPU for 8 watchers", c8, "s", "for 1 watcher", c1, "<= 1.5x",
                        c8 / c1 <= 1.5 if c1 else None))
        b1, b8 = med(f"{fmt}_1w_bare_server_cpu_s"), med(f"{fmt}_8w_bare_server_cpu_s")
        rows.append(Row("events", f"{fmt}: bare stream's CPU for 8 watchers", b8, "s", "for 1 watcher", b1))
        rows.append(Row("events", f"{fmt}: {unit}/s to 8 watchers", med(f"{fmt}_8w_{unit}_per_s"), f"{unit}/s",
                        "bare gRPC stream", med(f"{fmt}_8w_bare_{unit}_per_s")))
    rows.append(Row("events", "mutation-to-watcher latency p50 (200 batches/s)", med("latency_p50_ms"), "ms"))
    rows.append(Row("events", "mutation-to-watcher latency p99 (200 batches/s)", med("latency_p99_ms"), "ms"))
    return rows + fanout_rows(rounds)


def fanout_rows(rounds: list[dict[str, float]]) -> list[Row]:
    """Live fan-out rows from rounds of :func:`fanout_bench.run`: server CPU for production plus
    delivery of the same live batches, 8 subscribers against 1 and ZMQ against gRPC; "delivery" rows
    subtract the same round's 0-subscriber figure (production alone). Medians over rounds.

        python -c "import sys; sys.path.insert(0, 'scripts/bench'); import run, fanout_bench; \\
            print(run.render(run.fanout_rows([fanout_bench.run() for _ in range(3)])))"
    """

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def med_less_production(key: str) -> float:
        """Median over rounds of a live figure less that round's 0-subscriber (production) figure."""
        return statistics.median(r[key] - r["live_0s_server_cpu_s"] for r in rounds)

    rows = []
    rows.append(Row("events", "live, 0 subscribers: server CPU (production alone)", med("live_0s_server_cpu_s"), "s"))
    delivery = {}
    for t, label in (("grpc", "gRPC live"), ("zmq", "ZMQ live")):
        rows.append(Row("events", f"{label}: server CPU for 8 subscribers", med(f"live_{t}_8s_server_cpu_s"), "s",
                        "for 1 subscriber", med(f"live_{t}_1s_server_cpu_s")))
        delivery[t] = {k: med_less_production(f"live_{t}_{k}s_server_cpu_s") for k in (1, 8)}
        rows.append(Row("events", f"{label}: delivery CPU for 8 (less 0 subscribers)", delivery[t][8], "s",
                        "for 1 subscriber", delivery[t][1]))
    rows.append(Row("events", "ZMQ live: I/O-thread CPU for 8 subscribers", med("live_zmq_8s_zmq_io_cpu_s"), "s",
                    "for 1 subscriber", med("live_zmq_1s_zmq_io_cpu_s")))
    for k in (8, 1):
        rows.append(Row("events", f"ZMQ vs gRPC live: server CPU, {k} subscriber{'s' if k > 1 else ''}",
                        med(f"live_zmq_{k}s_server_cpu_s"), "s", f"gRPC live StreamEvents, {k}",
                        med(f"live_grpc_{k}s_server_cpu_s")))
        rows.append(Row("events", f"ZMQ vs gRPC live: delivery CPU, {k} (less 0 subs)", delivery["zmq"][k], "s",
                        f"gRPC live, {k} (less 0 subscribers)", delivery["grpc"][k]))
    return rows


def bench_memory(quick: bool) -> list[Row]:
    rows = []
    for n in ((10_000,) if quick else (100_000, 1_000_000)):
        r = memory_bench.run(n)
        rows.append(Row("memory", f"bytes/block, empty pool of {n:,}", r["empty_bytes_per_block"], "B",
                        "block ids alone (8 B ints)", r["ids_bytes_per_block"], "<= 150 B",
                        r["empty_bytes_per_block"] <= 150))
        rows.append(Row("memory", f"bytes/block, every block cached, {n:,}", r["cached_bytes_per_block"], "B",
                        "block ids alone (8 B ints)", r["ids_bytes_per_block"]))
    return rows


def bench_scaling(quick: bool, out_png: Path | None) -> list[Row]:
    """How the core, RPC (Step of 16 admissions) and event delivery figures grow with prompt
    length (512 to 32k tokens) and pool size (1k to 1M blocks)."""
    import core_ops

    lengths = (512,) if quick else (512, 2048, 8192, 32768)
    pools = (1024,) if quick else (1024, 10_000, 100_000, 1_000_000)
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
    lines = [f"| {'bench':<8} | {'figure':<55} | {'value':>14} | {'baseline':<32} | {'baseline value':>14} | "
             f"{'ratio':>7} | {'target':<8} | met |",
             f"|{'-' * 10}|{'-' * 57}|{'-' * 16}|{'-' * 34}|{'-' * 16}|{'-' * 9}|{'-' * 10}|-----|"]

    def num(v: float | None) -> str:
        return "" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.2f}")

    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"| {r['bench']:<8} | {r['figure']:<55} | {num(r['value']) + ' ' + r['unit']:>14} | "
                     f"{r['baseline']:<32} | {num(r['baseline_value']):>14} | {ratio:>7} | {r['target']:<8} | {met:<3} |")
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
        print("vLLM not found (see BENCHMARKS.md, 'The vLLM baseline'): the core-ops baseline column is skipped", file=sys.stderr)
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
