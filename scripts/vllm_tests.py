#!/usr/bin/env python3
"""Run vLLM 0.33's own test suites against kvservice-vllm, and compare with vLLM's own manager.

Usage (with .venv-vllm from scripts/setup_vllm.sh)::

    .venv-vllm/bin/python scripts/vllm_tests.py            # fetch vLLM's tests, run the scheduler suite
    .venv-vllm/bin/python scripts/vllm_tests.py --suite scheduler --keep-going

vLLM's tests come with its source distribution (the wheel has none): ``pip download`` of the sdist
fails at its metadata step on a machine without CUDA, but with ``--no-clean`` and ``TMPDIR`` set the
unpacked tree stays, and its ``tests/`` is copied to ``.vllm-src/tests`` (ignored by git). The hub
models the suites name are read from an offline Hugging Face cache written here
(``clients/vllm/tests/vllm_suite/hf/``: each model's ``config.json``, facts from the model cards).

Each suite runs twice in the same run: with vLLM's own KV cache manager, and with every scheduler's
manager replaced by ``kvservice_vllm.install(scheduler, "embedded")`` (the pytest plugin
``clients/vllm/tests/vllm_suite/kvservice_embedded_plugin.py``). Every test that passes with vLLM's
manager must pass on kvservice, except those ``clients/vllm/tests/vllm_suite/expected.toml`` lists
with a reason; a listed test that passes on kvservice fails the run too (the list must stay true).
The exit status is 0 only then.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / ".vllm-src"
SUITE_DIR = ROOT / "clients" / "vllm" / "tests" / "vllm_suite"
VLLM_VERSION = "0.33.0"

SUITES = {
    "scheduler": ["tests/v1/core/test_scheduler.py"],
}


def fetch() -> Path:
    """vLLM's ``tests/`` at ``.vllm-src/tests`` (downloaded once) and the offline HF cache."""
    tests = SRC / "tests"
    if not (tests / "v1" / "core" / "test_scheduler.py").exists():
        SRC.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="vllm-sdist-", dir=SRC) as tmp:
            env = {**os.environ, "TMPDIR": tmp}
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--no-build-isolation",
                    "--no-clean",
                    f"vllm=={VLLM_VERSION}",
                    "-d",
                    tmp,
                ],
                env=env,
                check=False,  # fails at the metadata step, after unpacking: expected
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            unpacked = next(Path(tmp).glob("pip-download-*/vllm_*/tests"), None)
            if unpacked is None:
                raise SystemExit(f"vllm=={VLLM_VERSION}'s source distribution could not be unpacked under {tmp}")
            if tests.exists():
                shutil.rmtree(tests)
            shutil.copytree(unpacked, tests)
    hf = SRC / "hf"
    for config in sorted((SUITE_DIR / "hf").glob("*.json")):
        org, name = config.stem.split("--", 1)
        snapshot = hf / "hub" / f"models--{org}--{name}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, snapshot / "config.json")
        (hf / "hub" / f"models--{org}--{name}" / "refs").mkdir(exist_ok=True)
        (hf / "hub" / f"models--{org}--{name}" / "refs" / "main").write_text("0" * 40)
    return tests


def run_pytest(paths: list[str], report: Path, *, embedded: bool) -> dict[str, str]:
    """Run vLLM's tests from ``.vllm-src``; test id -> outcome ("passed", "failed", "skipped", ...)."""
    env = {
        **os.environ,
        "HF_HOME": str(SRC / "hf"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": str(SUITE_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    args = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-p", "outcome_plugin"]
    args += ["-p", "no:randomly"]
    if embedded:
        args += ["-p", "kvservice_embedded_plugin"]
    env["KVSERVICE_VLLM_OUTCOMES"] = str(report)
    subprocess.run(args, cwd=SRC, env=env, check=False)
    return json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), action="append", help="default: every suite")
    parser.add_argument("--out", default=str(ROOT / ".vllm-src" / "results"), help="where the outcomes go")
    args = parser.parse_args()
    fetch()
    expected = tomllib.loads((SUITE_DIR / "expected.toml").read_text(encoding="utf-8"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for suite in args.suite or sorted(SUITES):
        native = run_pytest(SUITES[suite], out / f"{suite}-native.json", embedded=False)
        remote = run_pytest(SUITES[suite], out / f"{suite}-kvservice.json", embedded=True)
        listed: dict[str, str] = expected.get(suite, {})
        passing = {t for t, o in native.items() if o == "passed"}
        lost = sorted(t for t in passing if remote.get(t) != "passed" and t not in listed)
        stale = sorted(t for t in listed if remote.get(t) == "passed" or t not in passing)
        num_remote = sum(1 for t in passing if remote.get(t) == "passed")
        print(
            f"{suite}: vLLM's manager passes {len(passing)} of {len(native)}; kvservice passes {num_remote} of "
            f"those, {len(listed)} listed in expected.toml"
        )
        for t in lost:
            print(f"  FAILS ON KVSERVICE (not listed): {t} ({remote.get(t)})")
        for t in stale:
            print(f"  LISTED BUT {'PASSES ON KVSERVICE' if remote.get(t) == 'passed' else 'NOT PASSING NATIVELY'}: {t}")
        if lost or stale:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
