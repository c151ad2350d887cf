"""Which addresses reach only this machine, and the bind rule ZMQ's sockets follow.

Leaf rules, read by the settings (a ZMQ bind off loopback is refused when the configuration is
built, across the ``zmq`` and ``auth`` sections), by :mod:`kvservice.server.auth` (the gRPC bind
rule) and by :mod:`kvservice.server.zmq_publisher`. This module imports nothing of kvservice.
"""

from __future__ import annotations

import ipaddress

__all__ = ["check_endpoint_exposure", "is_bind_endpoint", "is_loopback_endpoint", "is_loopback_host"]


def is_loopback_host(host: str) -> bool:
    """Whether a bind address reaches only this machine: ``localhost``, 127.0.0.0/8 or ``::1``
    (brackets allowed). Wildcards (``0.0.0.0``, ``::``), other addresses and other names are not."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint with a wildcard (``*`` or ``::``) or an ``ipc://`` /
    ``inproc://`` one; connect to any other (e.g. ``tcp://indexer:5557``, a router's bound SUB)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether binding ``endpoint`` reaches only this machine: ``ipc://`` and ``inproc://``, or
    ``tcp://`` on a loopback host (``127.0.0.0/8``, ``[::1]``, ``localhost``; any port, ``*``
    included). Wildcard hosts (``*``, ``0.0.0.0``, ``[::]``), other addresses, interface names
    and other transports are not."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return is_loopback_host(host)


def check_endpoint_exposure(
    zmq_endpoint: str | None, zmq_replay_endpoint: str | None, *, allow_insecure_bind: bool
) -> list[str]:
    """Apply the bind rule to the PUB endpoint (bound or connected by :func:`is_bind_endpoint`)
    and the replay endpoint (always bound): a socket bound on a non-loopback address (see
    :func:`is_loopback_endpoint`) needs ``allow_insecure_bind``.

    Args:
        zmq_endpoint: the PUB endpoint, or None (off).
        zmq_replay_endpoint: the ROUTER endpoint, or None (no replay).
        allow_insecure_bind: bind non-loopback addresses anyway.

    Returns:
        One warning note per socket bound on a non-loopback address (empty when there is none).

    Raises:
        ValueError: such a bind without ``allow_insecure_bind`` (the message names the setting,
            the endpoint and ``allow_insecure_bind (--allow-insecure-bind)``).
    """
    notes = []
    for setting, endpoint, bind in (
        ("zmq_endpoint", zmq_endpoint, zmq_endpoint is not None and is_bind_endpoint(zmq_endpoint)),
        ("zmq_replay_endpoint", zmq_replay_endpoint, True),
    ):
        if endpoint is None or not bind or is_loopback_endpoint(endpoint):
            continue
        if not allow_insecure_bind:
            raise ValueError(
                f"{setting} {endpoint!r} binds a non-loopback address and ZMQ has no authentication or encryption: "
                "anyone who reaches the port reads the KV events (prompt token ids), whatever TLS or tokens the "
                "gRPC port has; bind loopback (e.g. tcp://127.0.0.1:*) or ipc://, or set allow_insecure_bind "
                "(--allow-insecure-bind) to bind anyway"
            )
        notes.append(
            f"{setting} {endpoint} bound on a non-loopback address (allow_insecure_bind): ZMQ carries no "
            "authentication or encryption; the KV events (token ids) are readable by anyone who reaches the port"
        )
    return notes
