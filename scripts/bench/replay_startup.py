"""The replay's fixed start-up cost, as a ratio to a bare ``import torch`` measured in the same run.

    python scripts/bench/replay_startup.py [--rounds 3]

Alternates ``python -c "import torch"`` and ``kvservice replay --limit 1 --no-progress`` (each a
fresh process, same interpreter), ``--rounds`` times each, and prints the medians, the ratio
(target: <= 1.5) and the replay's time to its first line of output (target: < 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time


def timed(args: list[str]) -> tuple[float, float]:
    """(seconds to exit, seconds to the first line of stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_s = time.perf_counter() - start if first else float("nan")
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(args)} failed")
    return time.perf_counter() - start, first_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    torch_s, replay_s, first_s = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            torch_s.append(timed([sys.executable, "-c", "import torch"])[0])
            total, first = timed(
                [sys.executable, "-m", "kvservice.cli", "replay", "--limit", "1", "--no-progress", "--out", out]
            )
            replay_s.append(total)
            first_s.append(first)
    t, r, f = statistics.median(torch_s), statistics.median(replay_s), statistics.median(first_s)
    print(f"import torch: median {t:.2f} s of {[round(x, 2) for x in torch_s]}")
    print(f"kvservice replay --limit 1: median {r:.2f} s of {[round(x, 2) for x in replay_s]}")
    print(f"ratio replay / import torch: {r / t:.2f} (target <= 1.5)")
    print(f"first line after: median {f:.2f} s of {[round(x, 2) for x in first_s]} (target < 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
