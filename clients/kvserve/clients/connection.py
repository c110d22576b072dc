"""What both clients hold of one server: where it is, how to authenticate, the default deadline,
and the channel with its two stubs.

The channel opens on first use rather than in the constructor: `grpc.aio` binds a channel to
the event loop running when it is made, so an `AsyncClient` built outside a loop must wait. The
blocking `Client` opens the same way, so the two share this class and differ only in `_open`.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.clients.calls import Call
from kvserve.clients.channel import DEFAULT_TARGET, bearer_metadata
from kvserve.protos.kvserve.v1 import api_pb2_grpc


class Connection:
    """The base of `Client` and `AsyncClient`. `token` is sent as `authorization: Bearer <token>`;
    `root_certificates` (PEM) turns on TLS. `timeout_s` is the default deadline of every call
    (None: no deadline); a call's own `timeout_s` overrides it."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        self._credentials = (
            None if root_certificates is None else grpc.ssl_channel_credentials(root_certificates=root_certificates)
        )
        self._channel: Any = None
        self._api: api_pb2_grpc.KVServeStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def _open(self, credentials: grpc.ChannelCredentials | None) -> Any:
        """A new channel to `target`: TLS with `credentials`, else plaintext."""
        raise NotImplementedError

    @property
    def _stub(self) -> api_pb2_grpc.KVServeStub:
        """The KVServe stub, opening the channel on first use."""
        if self._api is None:
            self._channel = self._open(self._credentials)
            self._api = api_pb2_grpc.KVServeStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._api

    def _stub_of(self, call: Call) -> Any:
        """The stub `call` is a method of: KVServe's, or grpc.health.v1's."""
        api = self._stub
        return self._health if call.health else api

    def _call_options(self, timeout_s: float | None) -> dict[str, Any]:
        """The deadline and metadata of one call."""
        return {"timeout": self.timeout_s if timeout_s is None else timeout_s, "metadata": self._metadata}

    def _forget_channel(self) -> Any:
        """The open channel (None if none), which the caller then closes; the next call opens a new one."""
        channel, self._channel, self._api, self._health = self._channel, None, None, None
        return channel
