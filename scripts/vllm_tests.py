#!/usr/bin/env python3
"""Run vLLM 0.33's own test suites against kvservice-vllm, and compare with vLLM's own manager.

Usage (with .venv-vllm from scripts/setup_vllm.sh)::

    .venv-vllm/bin/python scripts/vllm_tests.py                    # fetch vLLM's tests, run every suite (CI)
    .venv-vllm/bin/python scripts/vllm_tests.py --suite tiering    # one suite: vLLM's tiering suites

vLLM's tests come with its source distribution (the wheel has none): ``pip download`` of the sdist
fails at its metadata step on a machine without CUDA, but with ``--no-clean`` and ``TMPDIR`` set the
unpacked tree stays, and its ``tests/`` is copied to ``.vllm-src/tests`` (ignored by git). The hub
models the suites name are read from an offline Hugging Face cache written here
(``clients/vllm/tests/vllm_suite/hf/``: each model's ``config.json``, facts from the model cards).

Each suite runs twice in the same run: natively (vLLM as installed, kvservice-vllm beside it), then
with kvservice plugged in by a pytest plugin (``clients/vllm/tests/vllm_suite/``):

* ``scheduler`` (``tests/v1/core/test_scheduler.py``): every scheduler's manager replaced by
  ``kvservice_vllm.install(scheduler, "embedded")`` (``kvservice_embedded_plugin``);
* ``tiering`` (``tests/v1/kv_offload/tiering/`` and the offloading connector's
  ``test_scheduler.py``): natively all of them; then, where the suites take an out-of-tree tier
  (the tier registry, every ``TieringOffloadingSpec`` a test builds), with the kvservice tier added
  (``kvservice_tier_plugin``), over the files that build tiers (``test_factory.py``,
  ``test_tiering_offloading.py``, the connector's ``test_scheduler.py``).

In ``tiering`` every test must pass natively, except those ``expected.toml``'s ``[native]`` table
lists with why (what may fail on a CI machine: timing-bound tests of vLLM's own p2p tier); every test that passes natively must pass with kvservice, except
those ``clients/vllm/tests/vllm_suite/expected.toml`` lists under the suite's name with a reason. A
listed test that passes fails the run too (the lists must stay true). The exit status is 0 only
then.

Every run is bounded, so a stall fails CI instead of hanging it: one test by pytest-timeout
(``TEST_TIMEOUT_S``: the test fails, its threads' stacks are printed, the run goes on), one pytest
run by ``RUN_TIMEOUT_S`` (its process group killed; the tests it had not finished count as failed,
the one it was in is named).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / ".vllm-src"
SUITE_DIR = ROOT / "clients" / "vllm" / "tests" / "vllm_suite"
VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class Suite:
    """vLLM's tests run natively (``paths``), then ``kvservice_paths`` (default: the same) with the
    pytest plugin ``plugin`` (a module of ``clients/vllm/tests/vllm_suite/``)."""

    paths: tuple[str, ...]
    plugin: str
    kvservice_paths: tuple[str, ...] | None = None
    native_must_pass: bool = False
    """Fail the run when a test fails natively (unless ``[native]`` lists it): kvservice-vllm installed
    beside vLLM must break none of them."""


SUITES = {
    "scheduler": Suite(("tests/v1/core/test_scheduler.py",), "kvservice_embedded_plugin"),
    "tiering": Suite(
        ("tests/v1/kv_offload/tiering", "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py"),
        "kvservice_tier_plugin",
        (
            "tests/v1/kv_offload/tiering/test_factory.py",
            "tests/v1/kv_offload/tiering/test_tiering_offloading.py",
            "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
        ),
        native_must_pass=True,
    ),
}

DEFAULT_SUITES = ["scheduler", "tiering"]
"""What a plain run (CI) runs: every suite. ``tiering`` took 755 s wall here (2 cores under other jobs'
load, 2026-12-02): 518 s natively (1042 tests), 214 s with the kvservice tier (528 tests)."""


def fetch() -> Path:
    """vLLM's ``tests/`` at ``.vllm-src/tests`` (downloaded once) and the offline HF cache."""
    tests = SRC / "tests"
    if not (tests / "v1" / "kv_offload" / "tiering").exists() or not (SRC / "pyproject.toml").exists():
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
            # vLLM's own pytest settings (its markers), so the run does not take kvservice's.
            shutil.copyfile(unpacked.parent / "pyproject.toml", SRC / "pyproject.toml")
    hf = SRC / "hf"
    for config in sorted((SUITE_DIR / "hf").glob("*.json")):
        org, name = config.stem.split("--", 1)
        snapshot = hf / "hub" / f"models--{org}--{name}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, snapshot / "config.json")
        (hf / "hub" / f"models--{org}--{name}" / "refs").mkdir(exist_ok=True)
        (hf / "hub" / f"models--{org}--{name}" / "refs" / "main").write_text("0" * 40)
    return tests


TEST_TIMEOUT_S = 300
"""pytest-timeout's bound on one test (setup, call and teardown), in seconds: a test that runs past
it fails (its threads' stacks printed), and the run goes on."""

RUN_TIMEOUT_S = 2400
"""The bound on one pytest run, in seconds (a stall outside a test: collection, interpreter exit):
past it the run's process group is killed, and every test it had not finished counts as failed."""


def run_pytest(paths: tuple[str, ...], report: Path, *, plugin: str | None) -> tuple[dict[str, str], bool]:
    """Run vLLM's tests from ``.vllm-src``: (test id -> outcome ("passed", "failed", "skipped",
    "error"; "started" for the test a killed run was in), whether the run ended within
    :data:`RUN_TIMEOUT_S`)."""
    env = {
        **os.environ,
        "HF_HOME": str(SRC / "hf"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": str(SUITE_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    args = [sys.executable, "-m", "pytest", *paths, "-q", "--rootdir", str(SRC), "-c", str(SRC / "pyproject.toml")]
    args += ["-p", "no:cacheprovider", "-p", "outcome_plugin"]
    args += ["-p", "no:randomly"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # requirements-vllm.txt; else RUN_TIMEOUT_S alone
        args += [f"--timeout={TEST_TIMEOUT_S}", "--timeout-method=signal"]
    if plugin is not None:
        args += ["-p", plugin]
    env["KVSERVICE_VLLM_OUTCOMES"] = str(report)
    report.unlink(missing_ok=True)
    process = subprocess.Popen(args, cwd=SRC, env=env, start_new_session=True)
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
        ended = True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        ended = False
    outcomes: dict[str, str] = {}
    if report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            outcomes[entry["nodeid"]] = entry["outcome"]
    return outcomes, ended


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        choices=sorted(SUITES),
        action="append",
        help="default: every suite (DEFAULT_SUITES)",
    )
    parser.add_argument("--out", default=str(ROOT / ".vllm-src" / "results"), help="where the outcomes go")
    args = parser.parse_args()
    fetch()
    expected = tomllib.loads((SUITE_DIR / "expected.toml").read_text(encoding="utf-8"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for suite in args.suite or DEFAULT_SUITES:
        spec = SUITES[suite]
        native, native_ended = run_pytest(spec.paths, out / f"{suite}-native.jsonl", plugin=None)
        remote, remote_ended = run_pytest(
            spec.kvservice_paths or spec.paths, out / f"{suite}-kvservice.jsonl", plugin=spec.plugin
        )
        for ended, outcomes, how in ((native_ended, native, "natively"), (remote_ended, remote, "with kvservice")):
            if not ended:
                status = 1
                stalled = [t for t, o in outcomes.items() if o == "started"]
                print(
                    f"{suite}: the run {how} did not end within {RUN_TIMEOUT_S} s (killed); in: {stalled or 'no test'}"
                )
        listed: dict[str, str] = expected.get(suite, {})
        kvservice_paths = spec.kvservice_paths or spec.paths
        passing = {t for t, o in native.items() if o == "passed" and t.startswith(kvservice_paths)}
        not_passing = sorted(t for t, o in native.items() if o not in ("passed", "skipped"))
        native_listed: dict[str, str] = {t: why for t, why in expected.get("native", {}).items() if t in native}
        native_lost = [t for t in not_passing if t not in native_listed] if spec.native_must_pass else []
        lost = sorted(t for t in passing if remote.get(t) != "passed" and t not in listed)
        stale = sorted(t for t in listed if remote.get(t) == "passed" or t not in passing)
        num_remote = sum(1 for t in passing if remote.get(t) == "passed")
        print(
            f"{suite}: natively {sum(1 for o in native.values() if o == 'passed')} of {len(native)} pass "
            f"({len(not_passing)} fail or error here); with kvservice ({spec.plugin}) {num_remote} of the "
            f"{len(passing)} it ran pass, {len(listed)} listed in expected.toml"
        )
        for t in native_lost:
            print(f"  FAILS NATIVELY (not listed in [native]): {t} ({native[t]})")
        for t in lost:
            print(f"  FAILS ON KVSERVICE (not listed): {t} ({remote.get(t)})")
        for t in stale:
            print(f"  LISTED BUT {'PASSES ON KVSERVICE' if remote.get(t) == 'passed' else 'NOT PASSING NATIVELY'}: {t}")
        if lost or stale or native_lost:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
