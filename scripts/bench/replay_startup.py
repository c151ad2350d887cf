"""The replay's fixed start-up cost, as a ratio to a bare ``import torch`` measured in the same run.

    python scripts/bench/replay_startup.py [--rounds 5] [--cold-bytecode] [--baseline-src DIR]

Alternates ``python -c "import torch"`` and ``kvservice replay --limit 1 --no-progress`` (each a
fresh process, same interpreter), ``--rounds`` times each, and prints per command the median, the
spread (min, max) and every sample, the ratio of the medians (target: <= 1.5) and the replay's
time to its first line of output (target: < 1 s), with the load average before and after.
``--baseline-src DIR`` adds, in each round, the replay of another checkout (e.g. ``git archive``
of main unpacked in DIR, run through ``PYTHONPATH``), so before and after share one run's load.

Bytecode: by default both commands run with Python's bytecode cache in a temporary folder
(``PYTHONPYCACHEPREFIX``, ``PYTHONDONTWRITEBYTECODE`` unset) after one untimed run of each fills
it, as an installed wheel or any checkout runs after its first start. ``--cold-bytecode`` keeps
the environment as it is instead; where it sets ``PYTHONDONTWRITEBYTECODE=1`` on an editable
install, every replay compiles kvservice's sources again (torch's ship compiled).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

TORCH = [sys.executable, "-c", "import torch"]


def replay_command(out: str) -> list[str]:
    return [sys.executable, "-m", "kvservice.cli", "replay", "--limit", "1", "--no-progress", "--out", out]


def baseline_env(env: dict[str, str], src: str) -> dict[str, str]:
    """``env`` with the checkout at ``src`` (server and client packages) ahead of the installed one
    (run in ``src`` too: ``python -m`` puts the working folder first on ``sys.path``)."""
    paths = [src, os.path.join(src, "clients", "python"), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


CPU: dict[str, list[float]] = {}
"""CPU seconds (user + system, the processes it waited for included) per command name."""


def timed(args: list[str], env: dict[str, str], cwd: str | None = None, *, name: str = "") -> tuple[float, float]:
    """(seconds to exit, seconds to the first line of stdout), run in ``cwd``; its CPU seconds go
    to ``CPU[name]``."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_s = time.perf_counter() - start if first else float("nan")
    rest = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{first}{rest}")
    if name:
        CPU.setdefault(name, []).append(usage.ru_utime + usage.ru_stime)
    return time.perf_counter() - start, first_s


def describe(name: str, samples: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(samples):.2f} s, min {min(samples):.2f}, max {max(samples):.2f} "
        f"of {[round(x, 2) for x in samples]}"
    )


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cold-bytecode", action="store_true", help="keep the environment's bytecode settings (see the docstring)"
    )
    parser.add_argument("--baseline-src", help="also time the replay of the checkout in this folder, each round")
    options = parser.parse_args()
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
    torch_s, replay_s, first_s, base_s, base_first_s = [], [], [], [], []
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as pycache:
        env = dict(os.environ)
        if not options.cold_bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = pycache
            timed(TORCH, env)  # fill the cache, untimed
            timed(replay_command(out), env)
            if options.baseline_src:
                timed(replay_command(out), baseline_env(env, options.baseline_src), cwd=options.baseline_src)
        for _ in range(options.rounds):
            torch_s.append(timed(TORCH, env, name="import torch")[0])
            total, first = timed(replay_command(out), env, name="replay")
            replay_s.append(total)
            first_s.append(first)
            if options.baseline_src:
                total, first = timed(
                    replay_command(out),
                    baseline_env(env, options.baseline_src),
                    cwd=options.baseline_src,
                    name="baseline",
                )
                base_s.append(total)
                base_first_s.append(first)
    t, r = statistics.median(torch_s), statistics.median(replay_s)
    print(f"bytecode: {'as the environment has it' if options.cold_bytecode else 'cached (filled by one untimed run)'}")
    print(describe("import torch", torch_s))
    print(describe("kvservice replay --limit 1", replay_s))
    print(f"ratio replay / import torch (medians): {r / t:.2f} (target <= 1.5)")
    print(describe("first line after", first_s) + " (target < 1)")
    if base_s:
        b = statistics.median(base_s)
        print(describe(f"baseline {options.baseline_src}: kvservice replay --limit 1", base_s))
        print(f"baseline ratio replay / import torch (medians): {b / t:.2f}")
        print(describe("baseline first line after", base_first_s))
    cpu = ", ".join(f"{name} {statistics.median(xs):.2f}" for name, xs in CPU.items())
    print(f"CPU seconds, medians (user + system, the plot process included): {cpu}")
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
