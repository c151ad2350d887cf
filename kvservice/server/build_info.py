"""What this server was built from and runs on: ``kvservice --version``, ``Ping``,
``GetKVCacheGroupMetadata`` (``build_info``) and the ``kvservice_build_info`` metric."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["build_info", "describe_version"]

_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _git_commit() -> str:
    """The commit of a source checkout (12 hex digits, ``+dirty`` not tracked), or "" when the
    package is not in one or git is missing."""
    if not (_ROOT / ".git").exists():
        return ""
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def build_info() -> dict[str, str]:
    """``version``, ``git_commit``, ``python_version``, ``grpc_version``, ``protobuf_version``,
    ``torch_version`` (the fields of the proto's ``BuildInfo``; "" where not known). Asking never
    loads torch: its version is the imported module's, else the installed distribution's (a
    ``meta`` server never imports torch)."""
    torch = sys.modules.get("torch")
    return {
        "version": _version("kvservice"),
        "git_commit": _git_commit(),
        "python_version": platform.python_version(),
        "grpc_version": _version("grpcio"),
        "protobuf_version": _version("protobuf"),
        "torch_version": str(getattr(torch, "__version__", "")) if torch is not None else _version("torch"),
    }


def describe_version() -> str:
    """One line: ``kvservice 0.1.0 (git 0123456789ab, Python 3.11.7, grpcio 1.85.1, protobuf 7.35.1)``."""
    info = build_info()
    parts = [f"git {info['git_commit']}"] if info["git_commit"] else []
    parts += [
        f"Python {info['python_version']}",
        f"grpcio {info['grpc_version']}",
        f"protobuf {info['protobuf_version']}",
    ]
    return f"kvservice {info['version'] or 'unknown'} ({', '.join(parts)})"
