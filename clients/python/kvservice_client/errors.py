"""The one error type of the client, :class:`KVServiceError`, and its status enum, :class:`StatusCode`.

A caller reads ``err.code`` against :class:`StatusCode` and never needs to import grpc. For the
code written before it, a :class:`StatusCode` also equals (and hashes as) the ``grpc.StatusCode``
of the same name: ``err.code == grpc.StatusCode.NOT_FOUND`` and ``err.code in {grpc.StatusCode.
UNAVAILABLE}`` keep working.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

    from kvservice_client._proto.kvservice.v1 import kv_cache_service_pb2 as pb

__all__ = ["KVServiceError", "StatusCode"]


class StatusCode(enum.Enum):
    """A gRPC status code: ``int(code)`` is its number in the gRPC spec; the value is
    ``(number, text)`` as ``grpc.StatusCode``'s.

    Equal to the ``grpc.StatusCode`` of the same name and hashed alike, so the two mix in sets and
    comparisons; :attr:`grpc_code` converts.
    """

    OK = (0, "ok")
    CANCELLED = (1, "cancelled")
    UNKNOWN = (2, "unknown")
    INVALID_ARGUMENT = (3, "invalid argument")
    DEADLINE_EXCEEDED = (4, "deadline exceeded")
    NOT_FOUND = (5, "not found")
    ALREADY_EXISTS = (6, "already exists")
    PERMISSION_DENIED = (7, "permission denied")
    RESOURCE_EXHAUSTED = (8, "resource exhausted")
    FAILED_PRECONDITION = (9, "failed precondition")
    ABORTED = (10, "aborted")
    OUT_OF_RANGE = (11, "out of range")
    UNIMPLEMENTED = (12, "unimplemented")
    INTERNAL = (13, "internal")
    UNAVAILABLE = (14, "unavailable")
    DATA_LOSS = (15, "data loss")
    UNAUTHENTICATED = (16, "unauthenticated")

    def __int__(self) -> int:
        return int(self.value[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StatusCode):
            return self is other
        if isinstance(other, enum.Enum) and type(other).__module__.startswith("grpc"):
            return self.name == other.name
        return NotImplemented

    def __hash__(self) -> int:
        # The hash of an Enum member (grpc.StatusCode's too) is the hash of its name.
        return hash(self._name_)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        """The ``grpc.StatusCode`` of the same name (imports grpc)."""
        import grpc

        return grpc.StatusCode[self.name]

    @classmethod
    def of(cls, code: Any) -> StatusCode:
        """The member for a ``StatusCode``, a ``grpc.StatusCode`` (by name) or a status number;
        anything else (an unknown number, None) is UNKNOWN."""
        if isinstance(code, StatusCode):
            return code
        if isinstance(code, enum.Enum):
            return cls.__members__.get(code.name, cls.UNKNOWN)
        if isinstance(code, int):
            return _BY_NUMBER.get(code, cls.UNKNOWN)
        return cls.UNKNOWN


_BY_NUMBER: dict[int, StatusCode] = {int(code): code for code in StatusCode}


class KVServiceError(Exception):
    """A kvservice call failed (any gRPC status other than OK, or a failed Step op).

    Args:
        code: the status: a :class:`StatusCode`, a ``grpc.StatusCode`` or a status number (kept as
            the :class:`StatusCode` of the same name; an unknown number is UNKNOWN).
        message: the server's message (names the field and bound for INVALID_ARGUMENT).
        trailing_metadata: the call's trailing metadata (``grpc-status-details-bin`` carries rich
            ``google.rpc.Status`` details when the server sends them); empty for a Step op.

    Attributes:
        code: the :class:`StatusCode` (equal to the ``grpc.StatusCode`` of the same name).
        message: as above.
        trailing_metadata: as above.
    """

    def __init__(
        self,
        code: StatusCode | grpc.StatusCode | int,
        message: str,
        *,
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        status = StatusCode.of(code)
        super().__init__(status, message)
        self.code = status
        self.message = message
        self.trailing_metadata = trailing_metadata

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> KVServiceError:
        """Build from a ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError`` (async); one without
        a code is UNKNOWN."""
        code_fn = getattr(err, "code", None)
        code = code_fn() if callable(code_fn) else None
        details_fn = getattr(err, "details", None)
        details = details_fn() if callable(details_fn) else None
        trailing_fn = getattr(err, "trailing_metadata", None)
        trailing = trailing_fn() if callable(trailing_fn) else None
        return cls(
            StatusCode.of(code), details if details is not None else str(err), trailing_metadata=tuple(trailing or ())
        )

    @classmethod
    def from_op_status(cls, status: pb.OpStatus) -> KVServiceError:
        """Build from the ``OpStatus`` of a failed Step op (an unknown code number -> UNKNOWN)."""
        return cls(StatusCode.of(status.code), status.message)
