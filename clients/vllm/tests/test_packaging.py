"""kvservice-vllm's install and its vLLM check (issue 25: installing it never changes the
installed torch or vLLM; the version it needs is checked at import instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvservice_vllm._vllm_version import check_vllm_version

PACKAGE = Path(__file__).resolve().parents[1]


def test_the_dependencies_are_static_and_name_no_vllm_or_torch():
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert "dependencies" not in project.get("dynamic", [])
    assert project["dependencies"] == ["kvservice-client"]
    assert project["optional-dependencies"]["vllm"] == ["vllm==0.33.*"]


def test_pip_would_install_this_package_and_nothing_else():
    """Into this venv (vLLM 0.33 installed without its dependency tree, torch 2.13.0): pip's plan,
    offline, is the package alone; with vllm==0.33.* as a dependency it was torch 2.14.0 and ~130
    more."""
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "--report",
            "-",
            str(PACKAGE),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    installs = [(item["metadata"]["name"], item["metadata"]["version"]) for item in json.loads(plan.stdout)["install"]]
    assert installs == [("kvservice-vllm", "0.1.0")]


@pytest.mark.parametrize("version", ["0.33.0", "0.33.1", "0.33.0+cpu", "0.33.2rc1"])
def test_every_033_release_is_accepted(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.9", "0.34.0", "1.33.0", "0.3.3", "0.330.0"])
def test_another_vllm_is_refused_by_name(version):
    with pytest.raises(ImportError) as raised:
        check_vllm_version(version)
    assert str(raised.value) == (
        f"kvservice_vllm supports vLLM 0.33.x; the installed vllm is {version} "
        "(pip install 'vllm==0.33.*', or 'kvservice-vllm[vllm]')"
    )


def test_importing_beside_another_vllm_fails_with_the_message():
    code = (
        "import vllm; vllm.__version__ = '0.34.0'\n"
        "try:\n    import kvservice_vllm\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert (
        out
        == "kvservice_vllm supports vLLM 0.33.x; the installed vllm is 0.34.0 (pip install 'vllm==0.33.*', or 'kvservice-vllm[vllm]')\n"
    )
