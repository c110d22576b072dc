"""Which addresses the APIs (gRPC and the OpenAI-compatible HTTP API) may listen on, given their security options.

Both APIs share one token table and one set of TLS files, so one policy checks each
listener (`--host`, and `--http-host` when HTTP is on) the same way. Without
authentication anyone who can reach the port can generate text and read server
stats, so the unauthenticated default is safe only on loopback. A non-loopback `--host`
without `--auth-token-file` is refused with one clear error unless the operator says
`--allow-insecure-remote` (e.g. behind a gateway that authenticates). A non-loopback
listener with tokens but without TLS is allowed with a warning: the tokens then cross
the network in the clear.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from kvserve.link.endpoint import is_loopback_host

log = structlog.get_logger(__name__)


class InsecureBindError(ValueError):
    """The listen address is reachable from other hosts but no authentication is configured."""


@dataclass(slots=True, frozen=True)
class BindSecurity:
    host: str
    auth: bool
    tls: bool
    allow_insecure_remote: bool = False


def check_bind(security: BindSecurity) -> None:
    """Raise InsecureBindError when the combination is unsafe; warn when it is merely weak."""
    if is_loopback_host(security.host):
        return
    if not security.auth:
        if security.allow_insecure_remote:
            log.warning(
                "insecure_remote_listener",
                host=security.host,
                reason="no authentication on a non-loopback address (--allow-insecure-remote)",
            )
            return
        raise InsecureBindError(
            f"refusing to listen on {security.host!r} without authentication: anyone who can reach it could "
            "use the server. Give --auth-token-file (and --tls-cert/--tls-key), listen on 127.0.0.1, or pass "
            "--allow-insecure-remote if something in front of kvserve authenticates callers."
        )
    if not security.tls:
        log.warning(
            "plaintext_tokens",
            host=security.host,
            reason="bearer tokens cross the network unencrypted; add --tls-cert/--tls-key",
        )
