"""CURVE keys for a link that leaves the machine (tcp to a non-loopback address).

The scheduler's ROUTER is the CURVE server and each executor a CURVE client. An executor
is configured with the scheduler's public key, so it can only ever talk to the holder of
the matching secret key: it refuses unauthenticated peers by construction. The scheduler
can in turn restrict which executor public keys it accepts (a ZAP allow-list).

Key files are ZeroMQ certificate files, as written by `zmq.auth.create_certificates`
(`NAME.key` holds the public key, `NAME.key_secret` both keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """This side's keypair plus the public keys of the peers it trusts (Z85-encoded bytes).

    Scheduler: `peer_public_keys` are the executors it accepts; empty accepts any client
    that knows the scheduler's public key. Executor: exactly one peer key, the scheduler's.
    """

    public_key: bytes
    secret_key: bytes
    peer_public_keys: tuple[bytes, ...] = ()


def load_keys(secret_key_file: str | Path, peer_key_files: Sequence[str | Path] = ()) -> CurveKeys:
    """Read this side's `.key_secret` certificate and the peers' public `.key` certificates."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(secret_key_file))
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key (use the .key_secret file)")
    peers = tuple(zmq.auth.load_certificate(str(f))[0] for f in peer_key_files)
    return CurveKeys(public_key=public, secret_key=secret, peer_public_keys=peers)
