"""Services that exist only in a test: kvservice.v1's own RPCs plus new ones, as if added to the proto.

:func:`service_with` builds a ``.proto`` file (as its ``FileDescriptorProto``) holding a copy of
``kvservice.v1.KVCacheService`` under another name with more methods, their messages those of the
real file (so the generated message classes serve it), and adds it to protobuf's default descriptor
pool, as importing a generated module would. What the project derives from a service descriptor
(the RPC table, the token check, the registration, the clients' generated methods) then sees the
new RPCs exactly as it would see ones added to ``protos/kvservice/v1/kv_cache_service.proto``.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

GEN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_protos.py"


@dataclass(frozen=True)
class Method:
    """A method to add: its name, request and response message names (of kvservice.v1), its
    ``(kvservice.v1.roles)`` option values and which sides stream."""

    name: str
    request: str
    response: str
    roles: tuple[int, ...] = ()
    client_streaming: bool = False
    server_streaming: bool = False


def _real_file() -> descriptor_pb2.FileDescriptorProto:
    real = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(real)
    return real


def service_with(
    name: str, methods: Iterable[Method], *, keep_kv_cache_service: bool = True
) -> tuple[descriptor_pb2.FileDescriptorProto, ServiceDescriptor]:
    """The file and the descriptor of service ``kvservice.v1.<name>``: KVCacheService's methods
    (unless ``keep_kv_cache_service`` is False) and then ``methods``.

    The file is added to the default pool once per process (a second call with the same ``name``
    returns what is there).
    """
    real = _real_file()
    file = descriptor_pb2.FileDescriptorProto(
        name=f"tests/fixtures/{name}.proto", package="kvservice.v1", syntax="proto3", dependency=[real.name]
    )
    service = file.service.add()
    if keep_kv_cache_service:
        service.CopyFrom(real.service[0])
    service.name = name
    for method in methods:
        added = service.method.add(
            name=method.name,
            input_type=f".kvservice.v1.{method.request}",
            output_type=f".kvservice.v1.{method.response}",
            client_streaming=method.client_streaming,
            server_streaming=method.server_streaming,
        )
        added.options.Extensions[pb.roles].extend(method.roles)
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(file.name)
    except KeyError:
        pool.AddSerializedFile(file.SerializeToString())
    return file, pool.FindServiceByName(f"kvservice.v1.{name}")


def generated_methods(file: descriptor_pb2.FileDescriptorProto) -> types.ModuleType:
    """What ``scripts/gen_protos.py`` generates for ``file`` (the clients' default methods of its
    service), imported."""
    spec = importlib.util.spec_from_file_location("_gen_protos_for_fixture", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    source = gen.rpcs_module(file, [_real_file(), file], "# generated for a test\n")
    module = types.ModuleType(f"tests_fixture_{file.service[0].name}_rpcs")
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module
