"""Run the client package's tests on every Python 3.10-3.13 found on this machine.

For each version (``python3.N`` on PATH, or a pyenv install), make a venv under
``.venv-clients/py3N`` (kept between runs), install ``clients/python`` (no torch, no server) with
the test tools, and run the client-only test files with it; on the oldest version also in
``.venv-clients/py310-floor`` with grpcio and protobuf at exactly the client's floors. A version
that is not installed is reported as skipped, with the reason; the server stays on the venv
``scripts/setup.sh`` makes.

    python scripts/check_client_pythons.py            # every version found
    python scripts/check_client_pythons.py 3.10 3.13  # just these

Exit status: 0 when every version found passed, 1 otherwise. The last line is
``N passed, N failed, N skipped`` (versions).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("3.10", "3.11", "3.12", "3.13")
CLIENT_TESTS = (
    "tests/unit/test_client_surface.py",
    "tests/unit/test_request_builders.py",
    "tests/unit/test_events.py",
    "tests/unit/test_hashing.py",
    "tests/unit/test_hashing_compiled.py",
    "tests/unit/test_convert.py",
)
"""Test files that import only ``kvservice_client`` (and test tools): they run without torch."""
TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3", "hypothesis>=6.100")
FLOOR_PINNED = ("grpcio", "protobuf")
"""Dependencies whose floor (``clients/python/pyproject.toml``) the floor run installs exactly."""


def floor_pins() -> list[str]:
    """``name==floor`` of each :data:`FLOOR_PINNED` dependency of the client package."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    dependencies = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    pins = []
    for name in FLOOR_PINNED:
        (floor,) = [m.group(1) for d in dependencies if (m := re.fullmatch(rf"{name}>=([\w.]+)", d))]
        pins.append(f"{name}=={floor}")
    return pins


def find_python(version: str) -> str | None:
    """The interpreter of ``version`` ("3.10"), or None when none is installed."""
    on_path = shutil.which(f"python{version}")
    candidates = [on_path] if on_path else []
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv_root.is_dir():
        candidates += [str(p / "bin" / "python") for p in sorted(pyenv_root.glob(f"{version}.*"), reverse=True)]
    for candidate in candidates:
        try:
            out = subprocess.run(
                [candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return candidate
    return None


def check(version: str, python: str, pins: Sequence[str] = ()) -> tuple[bool, str]:
    """Make (or reuse) the venv of ``version``, install the client (with ``pins``: those exact
    dependency versions), run its tests."""
    venv = ROOT / ".venv-clients" / (f"py{version.replace('.', '')}" + ("-floor" if pins else ""))
    vpython = venv / "bin" / "python"
    if not vpython.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    install = subprocess.run(
        [str(vpython), "-m", "pip", "install", "-q", *pins, str(ROOT / "clients" / "python"), *TEST_TOOLS],
        capture_output=True,
        text=True,
    )
    if install.returncode != 0:
        return False, f"pip install failed: {install.stderr.strip().splitlines()[-1:]}"
    torch_free = subprocess.run(
        [str(vpython), "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
        capture_output=True,
        text=True,
    )
    if torch_free.stdout.strip() != "True":
        return False, "torch is installed in the client venv; it must not be needed"
    run = subprocess.run(
        [str(vpython), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *CLIENT_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    tail = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    return run.returncode == 0, tail if run.returncode == 0 else run.stdout[-3000:] + run.stderr[-2000:]


def main(argv: list[str]) -> int:
    versions = argv or list(VERSIONS)
    passed = failed = skipped = 0
    for version in versions:
        python = find_python(version)
        if python is None:
            print(f"python {version}: skipped (not installed: no python{version} on PATH or in pyenv)", flush=True)
            skipped += 1
            continue
        ok, detail = check(version, python)
        print(f"python {version} ({python}): {'ok' if ok else 'FAILED'}: {detail}", flush=True)
        passed, failed = passed + ok, failed + (not ok)
        if version == VERSIONS[0]:  # the oldest Python, with the oldest grpcio and protobuf allowed
            pins = floor_pins()
            ok, detail = check(version, python, pins)
            print(
                f"python {version} at the floors ({', '.join(pins)}): {'ok' if ok else 'FAILED'}: {detail}", flush=True
            )
            passed, failed = passed + ok, failed + (not ok)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
