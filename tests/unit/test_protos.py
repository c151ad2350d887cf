"""The committed kvservice.v1 stubs: fresh, stamped, importable, one agreed generated version."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import google.protobuf
import grpc
import pytest
import tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_OUT = REPO_ROOT / "clients" / "python" / "kvservice_client" / "_proto"
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
PYPROJECTS = (REPO_ROOT / "pyproject.toml", REPO_ROOT / "clients" / "python" / "pyproject.toml")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _load_gen_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gen_protos_under_test", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_files(suffix: str) -> list[Path]:
    files = sorted(PROTO_OUT.rglob(f"*{suffix}"))
    assert files, f"no *{suffix} under {PROTO_OUT}"
    return files


def _grpc_generated_version(path: Path) -> str:
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", path.read_text(), re.M)
    assert match, f"{path.name} records no GRPC_GENERATED_VERSION"
    return match.group(1)


def _protobuf_gencode_version(path: Path) -> str:
    text = path.read_text()
    comment = re.search(r"^# Protobuf Python Version: (\S+)$", text, re.M)
    check = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)'",
        text,
    )
    assert comment and check, f"{path.name} has no protobuf gencode version check"
    checked = ".".join(check.group(1, 2, 3)) + check.group(4)
    assert checked == comment.group(1), f"{path.name}: header says {comment.group(1)}, check says {checked}"
    return checked


def _dependency_minimum(pyproject: Path, dist: str) -> str:
    data = tomllib.loads(pyproject.read_text())
    for requirement in data["project"]["dependencies"]:
        match = re.fullmatch(rf"{re.escape(dist)}\s*>=\s*([\w.]+)", requirement)
        if match:
            return match.group(1)
    raise AssertionError(f"{pyproject.relative_to(REPO_ROOT)} declares no {dist}>=... dependency")


def test_committed_stubs_are_not_stale() -> None:
    result = subprocess.run([sys.executable, str(GEN_SCRIPT), "--check"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, f"stale stubs:\n{result.stdout}{result.stderr}"
    assert "up to date (9 files)" in result.stdout  # 4 stubs, the RPC methods, 3 __init__.py, the .proto


def test_generated_tree_is_exactly_the_expected_files() -> None:
    files = sorted(
        p.relative_to(PROTO_OUT).as_posix()
        for p in PROTO_OUT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert files == [
        "__init__.py",
        "kvservice/__init__.py",
        "kvservice/v1/__init__.py",
        "kvservice/v1/kv_cache_service.proto",
        "kvservice/v1/kv_cache_service_pb2.py",
        "kvservice/v1/kv_cache_service_pb2.pyi",
        "kvservice/v1/kv_cache_service_pb2_grpc.py",
        "kvservice/v1/kv_cache_service_pb2_grpc.pyi",
        "kvservice/v1/kv_cache_service_rpcs.py",
    ]


def test_every_stub_records_one_agreed_grpc_version_within_the_runtime_and_the_floor() -> None:
    versions = {p.name: _grpc_generated_version(p) for p in _generated_files("_pb2_grpc.py")}
    assert len(set(versions.values())) == 1, f"stubs disagree on the grpc version: {versions}"
    (generated,) = set(versions.values())
    assert _version_tuple(generated) <= _version_tuple(grpc.__version__), (
        f"stubs need grpcio>={generated}; installed {grpc.__version__}"
    )
    for pyproject in PYPROJECTS:
        assert _dependency_minimum(pyproject, "grpcio") == generated, pyproject
    gen = _load_gen_script()
    assert gen.PINNED_VERSIONS["grpcio-tools"] == generated  # made in the script's own venv, not the dev one


def test_every_stub_records_one_agreed_protobuf_version_within_the_runtime_and_the_floor() -> None:
    versions = {p.name: _protobuf_gencode_version(p) for p in _generated_files("_pb2.py")}
    assert len(set(versions.values())) == 1, f"stubs disagree on the protobuf gencode version: {versions}"
    (generated,) = set(versions.values())
    assert _version_tuple(generated) <= _version_tuple(google.protobuf.__version__), (
        f"stubs need protobuf>={generated}; installed {google.protobuf.__version__}"
    )
    for pyproject in PYPROJECTS:
        assert _dependency_minimum(pyproject, "protobuf") == generated, pyproject


def test_every_generated_file_carries_the_do_not_edit_header() -> None:
    for path in sorted(p for p in PROTO_OUT.rglob("*") if p.suffix in (".py", ".pyi")):
        head = path.read_text().splitlines()[:3]
        assert any(
            line.startswith(
                "# DO NOT EDIT: generated by scripts/gen_protos.py (grpcio-tools 1.66.2, mypy-protobuf 5.1.0)"
            )
            for line in head
        ), f"{path.relative_to(REPO_ROOT)} lacks the header: {head}"


def test_grpc_module_imports_its_pb2_at_its_real_python_path() -> None:
    text = (PROTO_OUT / "kvservice" / "v1" / "kv_cache_service_pb2_grpc.py").read_text()
    assert "from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as " in text
    assert not re.search(r"^from kvservice\.v1 import", text, re.M)


def test_v1_package_reexports_messages_enums_and_service_with_a_sorted_all() -> None:
    from kvservice_client._proto.kvservice import v1
    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

    assert v1.__all__ == sorted(v1.__all__)
    expected = set(pb.DESCRIPTOR.message_types_by_name) | set(pb.DESCRIPTOR.enum_types_by_name)
    expected |= {value for enum in pb.DESCRIPTOR.enum_types_by_name.values() for value in enum.values_by_name}
    expected |= {"KVCacheServiceStub", "KVCacheServiceServicer", "add_KVCacheServiceServicer_to_server"}
    assert set(v1.__all__) == expected
    for name in v1.__all__:
        assert getattr(v1, name) is not None
    assert v1.BlockStored.DESCRIPTOR.full_name == "kvservice.v1.BlockStored"
    assert pb.DESCRIPTOR.package == "kvservice.v1"
    # The staged include root names the descriptor file after the Python path (see gen_protos.py).
    assert pb.DESCRIPTOR.name == "kvservice_client/_proto/kvservice/v1/kv_cache_service.proto"


def test_gen_script_refuses_other_tool_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _load_gen_script()
    installed = {"grpcio-tools": "1.86.0", "mypy-protobuf": "5.1.0"}
    monkeypatch.setattr(gen, "_installed_versions", lambda python: installed)
    with pytest.raises(gen.GenerationError, match=r"grpcio-tools==1\.66\.2 is required, found 1\.86\.0"):
        gen.check_pinned_versions(sys.executable)
    monkeypatch.setattr(gen, "tools_python", lambda: sys.executable)
    assert gen.main(["--check"]) == 2
