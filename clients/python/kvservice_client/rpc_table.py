"""The RPC table: each RPC of ``kvservice.v1.KVCacheService`` as the proto defines it, read from the
service's descriptor, once.

The proto is the one place an RPC is defined: its request and response types, which side streams,
who may call it (the ``(kvservice.v1.roles)`` method option: the roles besides ``scheduler``) and
whether it is also a Step op (the ``StepOp`` oneof has a member of its request type). Everything
else is derived from :data:`KV_CACHE_SERVICE`:

* the server's token check (``kvservice.server.auth``: the methods each role may call);
* the server's registration (``KVCacheServicer.generic_handler``: one method handler per RPC, of
  the RPC's kind, with its request and response types).

So adding an RPC means: the ``rpc`` line in the proto (with its ``roles`` option when a watcher or
a worker may call it), then ``python scripts/gen_protos.py``; the servicer's handler of the same
name; its test. See docs/ARCHITECTURE.md §6.5.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from google.protobuf.descriptor import Descriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

__all__ = ["KV_CACHE_SERVICE", "ROLES", "RPC", "Role", "ServiceTable", "service_table", "snake_case"]

Role = Literal["scheduler", "watcher", "worker"]
ROLES: tuple[Role, ...] = ("scheduler", "watcher", "worker")
"""The roles a bearer token may have (the proto's ``Role`` values, lower case, without ``ROLE_``)."""

_ROLE_BY_VALUE: dict[int, Role] = {
    pb.ROLE_SCHEDULER: "scheduler",
    pb.ROLE_WATCHER: "watcher",
    pb.ROLE_WORKER: "worker",
}


def snake_case(name: str) -> str:
    """A proto method name in snake case, the client method's name (``GetKVCacheGroupMetadata`` ->
    ``get_kv_cache_group_metadata``; a run of capitals stays one word, as protoc's generators do)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


@dataclass(frozen=True)
class RPC:
    """One RPC as the proto defines it.

    Attributes:
        name: the proto method name (``GetComputedBlocks``); the servicer's handler has this name.
        method: the full method name on the wire (``/kvservice.v1.KVCacheService/GetComputedBlocks``).
        client_method: the client method's name (:func:`snake_case` of ``name``).
        request: the request message class (each message of a client stream).
        response: the response message class (each message of a server stream).
        request_streaming: the client streams its requests.
        response_streaming: the server streams its responses.
        roles: the roles whose tokens may call it (``scheduler`` always, plus the proto's ``roles``
            option).
        step_op: the ``StepOp`` oneof member whose message is this RPC's request (the same call,
            inside a Step), or None.
    """

    name: str
    method: str
    client_method: str
    request: type[Message]
    response: type[Message]
    request_streaming: bool
    response_streaming: bool
    roles: frozenset[Role]
    step_op: str | None

    @property
    def kind(self) -> str:
        """``unary_unary``, ``unary_stream``, ``stream_unary`` or ``stream_stream`` (gRPC's names)."""
        return f"{'stream' if self.request_streaming else 'unary'}_{'stream' if self.response_streaming else 'unary'}"


@dataclass(frozen=True)
class ServiceTable:
    """Every RPC of one service, in the proto's order.

    Attributes:
        name: the service's full name (``kvservice.v1.KVCacheService``).
        rpcs: RPC name -> :class:`RPC`.
    """

    name: str
    rpcs: Mapping[str, RPC]

    def __iter__(self) -> Iterator[RPC]:
        return iter(self.rpcs.values())

    def methods_of(self, role: Role) -> frozenset[str]:
        """The full method names ``role``'s tokens may call."""
        return frozenset(rpc.method for rpc in self if role in rpc.roles)

    def by_client_method(self, client_method: str) -> RPC:
        """The RPC whose client method is ``client_method``.

        Raises:
            KeyError: no RPC of the service has that client method name.
        """
        for rpc in self:
            if rpc.client_method == client_method:
                return rpc
        raise KeyError(f"{self.name} has no RPC whose client method is {client_method!r}")


def service_table(service: ServiceDescriptor, step_op: Descriptor | None = None) -> ServiceTable:
    """The table of ``service``, read from its descriptor and its methods' ``roles`` options.

    Args:
        service: the service's descriptor (``pb.DESCRIPTOR.services_by_name[...]``).
        step_op: the Step op message (``pb.StepOp``'s descriptor): an RPC whose request type is
            the type of one of its fields is that Step op; None: no RPC is.

    Raises:
        ValueError: a ``roles`` option naming ``ROLE_UNSPECIFIED`` (or a value this table does not
            know), or two RPCs with the same client method name.
    """
    ops_by_request = {f.message_type.full_name: f.name for f in step_op.fields if f.message_type} if step_op else {}
    rpcs: dict[str, RPC] = {}
    seen: set[str] = set()
    for method in service.methods:
        roles: set[Role] = {"scheduler"}
        for value in method.GetOptions().Extensions[pb.roles]:
            if value not in _ROLE_BY_VALUE:
                raise ValueError(
                    f"{method.full_name}: option (kvservice.v1.roles) names {pb.Role.Name(value)}; "
                    "name ROLE_WATCHER or ROLE_WORKER (ROLE_SCHEDULER may call every RPC)"
                )
            roles.add(_ROLE_BY_VALUE[value])
        client_method = snake_case(method.name)
        if client_method in seen:
            raise ValueError(f"{method.full_name}: a second RPC whose client method is {client_method!r}")
        seen.add(client_method)
        rpcs[method.name] = RPC(
            name=method.name,
            method=f"/{service.full_name}/{method.name}",
            client_method=client_method,
            request=GetMessageClass(method.input_type),
            response=GetMessageClass(method.output_type),
            request_streaming=method.client_streaming,
            response_streaming=method.server_streaming,
            roles=frozenset(roles),
            step_op=ops_by_request.get(method.input_type.full_name),
        )
    return ServiceTable(service.full_name, rpcs)


KV_CACHE_SERVICE = service_table(pb.DESCRIPTOR.services_by_name["KVCacheService"], pb.StepOp.DESCRIPTOR)
"""The table of ``kvservice.v1.KVCacheService``."""
