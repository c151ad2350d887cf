"""Domain errors. The server maps each class to one gRPC status (``kvservice/server/servicer.py``).

| class | gRPC status |
| --- | --- |
| :class:`InvalidArgumentError` | INVALID_ARGUMENT |
| :class:`RequestNotFoundError` | NOT_FOUND |
| :class:`RequestAlreadyExistsError` | ALREADY_EXISTS |
| :class:`EpochMismatchError` | FAILED_PRECONDITION |
| :class:`PreconditionFailedError` | FAILED_PRECONDITION |
| :class:`SeqOutOfRangeError` | OUT_OF_RANGE |
| :class:`CapacityExceededError` | RESOURCE_EXHAUSTED |
| :class:`ShuttingDownError` | UNAVAILABLE |

Every message names the field (or the resource) and the bound.
"""

from __future__ import annotations

__all__ = [
    "CapacityExceededError",
    "EpochMismatchError",
    "InvalidArgumentError",
    "KVServiceDomainError",
    "PreconditionFailedError",
    "RequestAlreadyExistsError",
    "RequestNotFoundError",
    "SeqOutOfRangeError",
    "ShuttingDownError",
]


class KVServiceDomainError(Exception):
    """Base class: a condition the caller can act on. ``str(err)`` is the message sent."""


class InvalidArgumentError(KVServiceDomainError, ValueError):
    """A malformed or out-of-range field.

    Attributes:
        field: the field's name (dotted for nested fields, e.g. ``lora.lora_name``).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class RequestNotFoundError(KVServiceDomainError, KeyError):
    """The request id is not registered."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request_id {request_id!r} is not registered (call GetComputedBlocks first)")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


class RequestAlreadyExistsError(KVServiceDomainError):
    """The request id is already registered (running, or waiting with another prompt)."""


class EpochMismatchError(KVServiceDomainError):
    """A resume position names another server epoch (the server restarted)."""


class PreconditionFailedError(KVServiceDomainError):
    """The call is well formed but the server's state refuses it as asked: the pool is claimed by
    another scheduler, or a prefix-cache hit the caller names is no longer what the cache holds."""


class SeqOutOfRangeError(KVServiceDomainError):
    """A start seq below the retained event log.

    Attributes:
        oldest_seq: the oldest seq the log still holds.
    """

    def __init__(self, message: str, oldest_seq: int) -> None:
        self.oldest_seq = oldest_seq
        super().__init__(message)


class CapacityExceededError(KVServiceDomainError):
    """A bound on a resource was reached (a subscriber fell too far behind, too many consumers...)."""


class ShuttingDownError(KVServiceDomainError):
    """The server is stopping."""
