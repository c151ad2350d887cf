"""Packaging: a LICENSE file in both distributions, the .proto inside the client wheel, the other
languages' package options in the .proto, and Go stubs generated from it with no flags."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "protos" / "kvservice" / "v1" / "kv_cache_service.proto"


def test_both_distributions_have_the_apache_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert (ROOT / "clients" / "python" / "LICENSE").read_text() == text


def test_the_proto_declares_every_languages_package():
    options = pb.DESCRIPTOR.GetOptions()
    assert (
        options.go_package,
        options.java_package,
        options.java_multiple_files,
        options.java_outer_classname,
        options.csharp_namespace,
        options.php_namespace,
        options.ruby_package,
        options.objc_class_prefix,
    ) == (
        "kvservice/gen/go/kvservice/v1;kvservicev1",
        "kvservice.v1",
        True,
        "KvCacheServiceProto",
        "Kvservice.V1",
        "Kvservice\\V1",
        "Kvservice::V1",
        "KVX",
    )


def test_the_client_package_carries_the_proto_source():
    shipped = ROOT / "clients/python/kvservice_client/_proto/kvservice/v1/kv_cache_service.proto"
    assert shipped.read_text() == PROTO.read_text()


@pytest.mark.slow
def test_the_client_wheel_contains_the_proto_and_the_license(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT / "clients" / "python"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("kvservice_client-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvservice_client/_proto/kvservice/v1/kv_cache_service.proto" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names


def test_go_stubs_generate_from_the_proto_without_flags(tmp_path):
    plugins = {name: shutil.which(name) for name in ("protoc-gen-go", "protoc-gen-go-grpc")}
    if plugins["protoc-gen-go"] is None:
        pytest.skip("protoc-gen-go is not installed (Debian: apt-get install protoc-gen-go protoc-gen-go-grpc)")
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"--go_out={tmp_path}",
        f"--plugin=protoc-gen-go={plugins['protoc-gen-go']}",
    ]
    if plugins["protoc-gen-go-grpc"] is not None:
        args += [f"--go-grpc_out={tmp_path}", f"--plugin=protoc-gen-go-grpc={plugins['protoc-gen-go-grpc']}"]
    result = subprocess.run([*args, str(PROTO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "kvservice" / "gen" / "go" / "kvservice" / "v1"
    stubs = out / "kv_cache_service.pb.go"
    assert stubs.read_text().count("package kvservicev1\n") == 1
    assert "type GetComputedBlocksRequest struct" in stubs.read_text()
    if plugins["protoc-gen-go-grpc"] is not None:
        assert "func NewKVCacheServiceClient(" in (out / "kv_cache_service_grpc.pb.go").read_text()


def test_the_client_on_python_3_9_says_it_needs_3_10():
    """pip prepares the client's metadata (setup.py) before it looks for protobuf and grpcio
    releases for that Python: the first error is the Python version, not a missing protobuf."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_client_pythons", ROOT / "scripts" / "check_client_pythons.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    python39 = module.find_python("3.9")
    if python39 is None:
        pytest.skip("no Python 3.9 on this machine")
    result = subprocess.run(
        [python39, "setup.py", "egg_info"], cwd=ROOT / "clients" / "python", capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "kvservice-client needs Python 3.10 or newer (requires-python >=3.10); this is Python 3.9: install it "
        "with python3.10 or newer"
    )
