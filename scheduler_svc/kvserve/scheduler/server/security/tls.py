"""TLS for the gRPC API: server credentials from PEM files.

`--tls-cert` and `--tls-key` switch the listener to TLS; `--tls-client-ca` additionally
requires every client to present a certificate signed by that CA (mutual TLS). Files are
read once at start-up and every problem is reported as one `TlsConfigError` naming the
file, so a misconfigured server refuses to start instead of serving in plaintext.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

_PEM_MARKER = b"-----BEGIN "


class TlsConfigError(ValueError):
    """A TLS option is incomplete, or a PEM file is missing or not PEM."""


@dataclass(slots=True, frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None


def tls_files(cert: str | Path | None, key: str | Path | None, client_ca: str | Path | None = None) -> TlsFiles | None:
    """The configured files, None when TLS is off; half a configuration is an error."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
    return TlsFiles(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """gRPC server credentials; with a client CA, client certificates are required."""
    cert = _read_pem(files.cert, "--tls-cert")
    key = _read_pem(files.key, "--tls-key")
    client_ca = _read_pem(files.client_ca, "--tls-client-ca") if files.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _read_pem(path: Path, option: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{option} {path}: {exc.strerror or exc}") from exc
    if _PEM_MARKER not in data:
        raise TlsConfigError(f"{option} {path}: not a PEM file")
    return data
