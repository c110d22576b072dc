"""The scheduler's end of the executor link as a bare ZeroMQ socket: bind, CURVE, send, close.

This module exists so that executor_link.py can speak only the link protocol (who is
registered, who is alive, which step waits for what) while the pyzmq specifics live here:
the ROUTER options that make a vanished executor visible at once, the ZAP authenticator
behind CURVE, and the way zmq.asyncio reports a failed non-blocking send through the
future it returns instead of raising. Nothing here knows about plans or executors.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import structlog
import zmq
import zmq.asyncio

from kvserve.link.curve import CurveKeys

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
"""Larger frames are dropped by ZeroMQ before parsing (a garbage or hostile peer)."""


class Sent(enum.Enum):
    """What became of one non-blocking send."""

    OK = "ok"
    FULL = "full"
    """The peer's queue is full: it is not reading (liveness will tell)."""
    UNREACHABLE = "unreachable"
    """ZeroMQ knows no connection to this identity any more (ROUTER_MANDATORY)."""


class LinkSocketError(OSError):
    """A poll or receive of the link socket failed (zmq's error, so that callers need not import zmq)."""


class RouterSocket:
    """A bound ROUTER socket with its context and, with CURVE keys, its authenticator."""

    def __init__(self, endpoint: str, curve_keys: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self._curve_keys = curve_keys
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._authenticator: AsyncioAuthenticator | None = None

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    async def open(self) -> None:
        """Create the context and socket, start CURVE when configured, and bind."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished executor fails at once
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting executor keeps its identity
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self._curve_keys is not None:
            self._authenticator = await self._start_curve_server(sock, self._curve_keys)
        sock.bind(self.endpoint)
        self._sock = sock

    async def poll(self, timeout_ms: int) -> bool:
        """Whether a message is waiting, after at most `timeout_ms`."""
        assert self._sock is not None
        try:
            return bool(await self._sock.poll(timeout_ms, zmq.POLLIN))  # type: ignore[call-arg]  # zmq's stub lacks `flags`
        except zmq.ZMQError as exc:
            raise LinkSocketError(exc.errno, str(exc)) from exc

    async def recv(self) -> list:
        """The next message's frames (zero-copy `zmq.Frame`s)."""
        assert self._sock is not None
        try:
            return await self._sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise LinkSocketError(exc.errno, str(exc)) from exc

    def send_nowait(self, identity: bytes, data: bytes) -> Sent:
        """Send one message to `identity` without waiting; errors other than full/unreachable raise."""
        assert self._sock is not None
        # zmq.asyncio reports a failed NOBLOCK send through the returned (already done)
        # future, not by raising: read it here so errors are neither lost nor delayed.
        # (zmq's stub types the future as a bare Awaitable; zmq.asyncio returns an asyncio.Future)
        sent = cast(
            "asyncio.Future[zmq.MessageTracker | None]",
            self._sock.send_multipart([identity, data], zmq.NOBLOCK, copy=len(data) < 65536),
        )
        if not sent.done():  # only when another send is queued; we never queue one
            sent.add_done_callback(_consume_exception)
            return Sent.OK
        exc = sent.exception()
        if exc is None:
            return Sent.OK
        if isinstance(exc, zmq.Again):
            return Sent.FULL
        if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
            return Sent.UNREACHABLE
        raise exc

    async def close(self) -> None:
        """Stop the authenticator, close the socket and terminate the context."""
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            await asyncio.to_thread(self._ctx.term)

    async def _start_curve_server(self, sock: zmq.asyncio.Socket, keys: CurveKeys) -> AsyncioAuthenticator:
        from zmq.auth.asyncio import AsyncioAuthenticator

        authenticator = AsyncioAuthenticator(self._ctx)
        authenticator.start()
        allowed = set(keys.peer_public_keys)
        if allowed:
            authenticator.configure_curve_callback("*", credentials_provider=_AllowList(allowed))
        else:
            authenticator.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        sock.curve_secretkey = keys.secret_key
        sock.curve_publickey = keys.public_key
        sock.curve_server = True
        return authenticator


def _consume_exception(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("link send failed", error=str(future.exception()))


@dataclass(slots=True)
class _AllowList:
    """ZAP credentials provider: accept exactly these client public keys (Z85)."""

    keys: set[bytes]

    def callback(self, _domain: str, key: bytes) -> bool:
        return key in self.keys  # pyzmq passes the client key Z85-encoded
