"""Where the scheduler <-> executor link listens, and which endpoints are safe by default.

Both sides check endpoints the same way: `ipc://` paths and tcp on a loopback address are
always fine; tcp to any other address (including the wildcard `*`) is refused unless the
operator asked for it explicitly (`allow_remote=True`), because the link carries prompts.
Over such a link, CURVE (`kvserve.link.curve`) can authenticate and encrypt it.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import tempfile
from pathlib import Path

from kvserve.config import defaults

IPC_PATH_MAX = 100
"""Unix socket paths are limited to ~107 bytes; stay safely below."""


class LinkEndpointError(ValueError):
    """An endpoint kvserve will not use (unknown scheme, or remote tcp not explicitly allowed)."""


def default_tcp_endpoint() -> str:
    """The loopback tcp endpoint used when scheduler and executor are started separately."""
    return f"tcp://127.0.0.1:{defaults.LINK_TCP_PORT}"


def private_ipc_endpoint(name: str = "executor") -> str:
    """An `ipc://` endpoint inside a fresh directory only this user can enter (mode 0700).

    The directory lives in $XDG_RUNTIME_DIR when that exists, else in the temp dir, and is
    removed when this process exits.
    """
    runtime_dir = _private_runtime_dir()
    path = runtime_dir / f"{name}.sock"
    if len(str(path)) > IPC_PATH_MAX:
        raise LinkEndpointError(f"ipc path too long for a unix socket: {path}")
    return f"ipc://{path}"


LINK_REMOTE_HINT = (
    "the link carries prompts; pass --allow-remote-link to use it on a private network, ideally with CURVE keys"
)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def check_endpoint(
    endpoint: str, *, allow_remote: bool = False, name: str = "link endpoint", remote_hint: str = LINK_REMOTE_HINT
) -> None:
    """Raise LinkEndpointError unless `endpoint` is ipc, inproc or loopback tcp (or remote is allowed).

    `name` and `remote_hint` word the error for other ZeroMQ endpoints kvserve binds (the KV
    events' `--kv-events-endpoint`): one check for every socket that must stay on loopback."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not rest:
        raise LinkEndpointError(f"{name} must look like ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise LinkEndpointError(f"{name} scheme must be ipc or tcp, got {scheme!r}")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not (port.isdigit() or port == "*"):
        raise LinkEndpointError(f"{name} needs tcp://HOST:PORT, got {endpoint!r}")
    if not allow_remote and not is_loopback_host(host):
        raise LinkEndpointError(f"refusing non-loopback {name} {endpoint!r}: {remote_hint}")


def is_loopback_host(host: str) -> bool:
    """True for loopback literals (127.0.0.0/8, ::1, bracketed or not) and `localhost`; wildcards
    (`0.0.0.0`, `*`) and other names are not: they may be reachable from anywhere."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _private_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    directory: Path | None = None
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        candidate = Path(base) / f"kvserve-{os.getpid()}"
        try:
            candidate.mkdir(mode=0o700)
            directory = candidate
        except FileExistsError:
            directory = Path(tempfile.mkdtemp(prefix=f"kvserve-{os.getpid()}-", dir=base))
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="kvserve-"))  # mkdtemp makes it 0700
    directory.chmod(0o700)
    atexit.register(shutil.rmtree, directory, True)
    return directory
