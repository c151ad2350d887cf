#!/usr/bin/env python3
"""vLLM's scheduler on kvservice against vLLM's in-process KV cache manager, in the same run.

Usage (with .venv-vllm from scripts/setup_vllm.sh)::

    .venv-vllm/bin/python scripts/bench/vllm_scheduler_bench.py               # 16, 64, 256 running
    .venv-vllm/bin/python scripts/bench/vllm_scheduler_bench.py --running 64 --steps 300
    .venv-vllm/bin/python scripts/bench/vllm_scheduler_bench.py --mooncake 200  # RPCs per step on the trace

Two figures:

* **A scheduler step's time** (``schedule()`` + ``update_from_output()``) at N running requests in
  steady decode, on kvservice (``kvservice_vllm.install(scheduler, "embedded")``: a server on a
  thread of this process, reached over gRPC on loopback) over vLLM's own manager: the median of
  the measured steps, each scheduler stepping the same trace in turn (in process, on kvservice, in
  process again: the machine's drift falls on both sides). Both share this process's
  cores with the server, as a scheduler beside a kvservice on one host would.
* **Round trips per step** (``ManagerStep`` RPCs from a step's ``add_request`` calls through the
  ``update_from_output`` after it), by kind of step: decode only, with admissions, with
  preemptions; on the Mooncake sample (``--mooncake``) with a pool small enough to evict.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import kvservice_vllm
from kvservice_vllm.drive import TraceItem, make_scheduler, mooncake_items, run_trace


def step_times(num_running: int, num_steps: int, warmup: int) -> dict[str, float]:
    """Median step seconds of each manager and their ratio, N requests decoding."""
    prompt, output = 256, warmup + num_steps + 8
    items = [
        TraceItem(f"r{i}", [(i * 7919 + t) % 32000 for t in range(prompt)], [(i + t) % 32000 for t in range(output)])
        for i in range(num_running)
    ]
    blocks = num_running * ((prompt + output) // 16 + 2) + 64
    kw = dict(num_blocks=blocks, max_num_seqs=num_running, max_num_batched_tokens=8192, max_model_len=4096)
    native, remote, native2 = make_scheduler(**kw), make_scheduler(**kw), make_scheduler(**kw)
    kvservice_vllm.install(remote, "embedded")
    try:
        limit = warmup + num_steps
        # In process, on kvservice, in process again: the machine's drift over the run falls on both.
        a = run_trace(native, items, max_steps=limit, stop_at_max_steps=True)
        b = run_trace(remote, items, max_steps=limit, stop_at_max_steps=True)
        a2 = run_trace(native2, items, max_steps=limit, stop_at_max_steps=True)
        assert a.records == b.records == a2.records, "the runs decided differently"
        decode = [k for k in range(warmup, limit) if not a.records[k][0]]  # steps admitting nothing
        na = statistics.median([a.step_seconds[k] for k in decode] + [a2.step_seconds[k] for k in decode])
        nb = statistics.median(b.step_seconds[k] for k in decode)
        return {
            "running": num_running,
            "in_process_ms": na * 1e3,
            "kvservice_ms": nb * 1e3,
            "ratio": nb / na,
            "rpcs_per_step": sum(b.num_round_trips[k] for k in decode) / len(decode),
        }
    finally:
        remote.shutdown()


def round_trips(limit: int, num_blocks: int) -> dict[str, dict[str, float]]:
    """Round trips per step by kind on the Mooncake sample, both schedulers."""
    items = mooncake_items(limit=limit, max_prompt_tokens=32768)
    out = {}
    for cls in (kvservice_vllm.Scheduler, kvservice_vllm.AsyncScheduler):
        is_async = cls is kvservice_vllm.AsyncScheduler
        kw = dict(num_blocks=num_blocks, max_num_batched_tokens=8192, max_model_len=32768, async_scheduling=is_async)
        native = make_scheduler(**kw)
        remote = make_scheduler(**kw)
        kvservice_vllm.install(remote, "embedded")
        a, b = run_trace(native, items), run_trace(remote, items)
        remote.shutdown()
        assert a.records == b.records, "the two runs decided differently"
        kinds = collections.defaultdict(list)
        for record, trips in zip(b.records, b.num_round_trips):
            new, *_, scheduled, preempted, _ = record
            kind = "preempt" if preempted else "admit" if new else "decode" if scheduled else "empty"
            kinds[kind].append(trips)
        out["async" if is_async else "sync"] = {
            "steps": b.num_steps,
            "preemptions": b.num_preemptions,
            "hit_tokens": b.num_hit_tokens,
            **{f"{k}_steps": len(v) for k, v in kinds.items()},
            **{f"{k}_rpcs": sum(v) / len(v) for k, v in kinds.items()},
            "all_rpcs": sum(b.num_round_trips) / b.num_steps,
            "in_process_s": sum(a.step_seconds),
            "kvservice_s": sum(b.step_seconds),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, action="append", help="running requests (default 16, 64, 256)")
    parser.add_argument("--steps", type=int, default=200, help="measured decode steps")
    parser.add_argument("--warmup", type=int, default=40, help="steps before measuring (prefill)")
    parser.add_argument("--mooncake", type=int, default=0, help="also the trace's first N requests")
    parser.add_argument("--num-blocks", type=int, default=4096, help="pool for --mooncake")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures: dict[str, object] = {"when": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = [step_times(n, args.steps, args.warmup) for n in args.running or (16, 64, 256)]
    figures["step_time"] = rows
    print(f"{'running':>8} {'in process ms':>14} {'kvservice ms':>13} {'ratio':>6} {'RPCs/step':>9}")
    for r in rows:
        print(
            f"{r['running']:>8} {r['in_process_ms']:>14.2f} {r['kvservice_ms']:>13.2f} {r['ratio']:>6.2f} {r['rpcs_per_step']:>9.2f}"
        )
    if args.mooncake:
        trips = round_trips(args.mooncake, args.num_blocks)
        figures["mooncake"] = trips
        for mode, t in trips.items():
            print(mode, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
