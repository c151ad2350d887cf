"""TLS settings of a client channel: :class:`TLSConfig`, in place of five loose arguments."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["TLSConfig"]


@dataclass(frozen=True)
class TLSConfig:
    """How a client opens a TLS channel (server verification, and mutual TLS when a key is given).

    Attributes:
        root_certificates: PEM CA certificates the server's certificate must chain to (bytes;
            None: the system's root certificates).
        private_key: the client's PEM private key, for mutual TLS (bytes; with
            ``certificate_chain``).
        certificate_chain: the client's PEM certificate chain, for mutual TLS (bytes).
        target_name_override: check the server's certificate against this name instead of the
            target's host (the channel option ``grpc.ssl_target_name_override``).

    Raises:
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse.
    """

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    target_name_override: str | None = None

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("private_key and certificate_chain go together (the client's key and certificate)")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        *,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        target_name_override: str | None = None,
    ) -> TLSConfig:
        """Read the PEM files: ``ca`` (the CA bundle), ``cert`` and ``key`` (the client's, for
        mutual TLS).

        Raises:
            OSError: a file cannot be read.
            ValueError: ``cert`` without ``key``, or the reverse.
        """
        return cls(
            root_certificates=Path(ca).read_bytes() if ca is not None else None,
            private_key=Path(key).read_bytes() if key is not None else None,
            certificate_chain=Path(cert).read_bytes() if cert is not None else None,
            target_name_override=target_name_override,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The ``grpc.ChannelCredentials`` of these settings."""
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        """The channel options these settings add (the target name override, when set)."""
        if self.target_name_override is None:
            return []
        return [("grpc.ssl_target_name_override", self.target_name_override)]


def resolve_channel_security(
    tls: bool | TLSConfig,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
    credentials: grpc.ChannelCredentials | None,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """The credentials (None: plain text) and the extra channel options of the channel a client
    opens, from its ``tls`` argument, the three loose PEM arguments (still accepted) or ready
    ``credentials``.

    Raises:
        TypeError: ``credentials`` together with ``tls`` or PEM bytes; a :class:`TLSConfig`
            together with PEM bytes.
        ValueError: ``private_key`` without ``certificate_chain``, or the reverse.
    """
    pem = {"root_certificates": root_certificates, "private_key": private_key, "certificate_chain": certificate_chain}
    given = sorted(name for name, value in pem.items() if value is not None)
    if credentials is not None:
        if tls or given:
            raise TypeError(f"pass either credentials or tls/PEM bytes, not both (got {', '.join(given) or 'tls'})")
        return credentials, []
    if isinstance(tls, TLSConfig):
        if given:
            raise TypeError(f"pass either tls=TLSConfig(...) or PEM bytes, not both (got {', '.join(given)})")
        return tls.channel_credentials(), tls.channel_options()
    if not (tls or given):
        return None, []
    config = TLSConfig(
        root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
    )
    return config.channel_credentials(), []
