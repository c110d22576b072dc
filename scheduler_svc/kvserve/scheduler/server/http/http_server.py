"""uvicorn inside the scheduler's own event loop: one task, no second process, thread or loop.

The handlers then run on the loop that owns the engine, as the gRPC handlers do, so
they call `Engine.submit`/`abort` directly. We bind the socket ourselves, so a port in
use is one clear `HttpListenError` instead of uvicorn's `sys.exit`, and the port is
known at once. uvicorn's own signal handling is switched off: SIGTERM/SIGINT belong to
the service, which drains both APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator

import structlog
import uvicorn
from starlette.types import ASGIApp

from kvserve.scheduler.server.security.tls import TlsFiles

log = structlog.get_logger(__name__)

BACKLOG = 2048
SHUTDOWN_GRACE_S = 1
"""Seconds open connections get after the service stopped (the engine has drained by then)."""


class HttpListenError(OSError):
    """The HTTP API cannot listen on its address."""


class _EmbeddedServer(uvicorn.Server):
    """uvicorn.Server without its signal handlers, which would replace the service's drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port): IPv4 or IPv6 as `host` resolves."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise HttpListenError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise HttpListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


class HttpServer:
    """`start()` binds and serves in a task of the running loop; `stop()` ends it."""

    def __init__(self, app: ASGIApp, host: str, port: int, *, tls: TlsFiles | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls is not None
        options: dict = {}
        if tls is not None:
            options = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
            if tls.client_ca is not None:
                options.update(ssl_ca_certs=str(tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        self._config = uvicorn.Config(
            app,
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            server_header=False,
            backlog=BACKLOG,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            **options,
        )
        self._server = _EmbeddedServer(self._config)
        self._task: asyncio.Task | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self) -> int:
        """Listen and serve; returns the bound port. HttpListenError if the address is taken."""
        try:
            self._config.load()  # the TLS context: a bad file fails here, before anything listens
        except (OSError, ssl.SSLError) as exc:
            raise HttpListenError(f"cannot load the TLS files for HTTP: {exc}") from exc
        self._socket = bind_socket(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # surface why it stopped
                raise HttpListenError(f"the HTTP server on {self.host}:{self.port} stopped at start-up")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_GRACE_S + 2.0)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        except Exception as exc:  # pragma: no cover - shutting down anyway
            log.warning("http_server_stop_failed", error=str(exc))
        finally:
            if self._socket is not None:
                self._socket.close()
