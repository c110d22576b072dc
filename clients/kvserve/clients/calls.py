"""What each RPC sends and what its answer means, once for both clients.

The blocking `Client` and the asyncio `AsyncClient` differ only in how they wait for the
network. Everything else, which request a method builds, how the answer becomes a plain Python
value, when a call fails with `KVServeError`, and how `wait_until_serving` decides to go on, lives
here, so the two stay thin wrappers that cannot drift apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from kvserve.clients.channel import HEALTH_SERVICE
from kvserve.clients.errors import KVServeError
from kvserve.clients.request_builder import chat_prompt, message_to_dict
from kvserve.protos.kvserve.v1 import api_pb2


@dataclass(frozen=True, slots=True)
class Call:
    """One unary RPC: the stub method it calls, how its request is built and its answer read."""

    method: str
    build: Callable[..., Any]
    read: Callable[[Any], Any]
    health: bool = False
    """On the grpc.health.v1 stub rather than KVServe's."""


def _tokenize_request(text: str | None = None, messages: Iterable[Mapping[str, str]] | None = None) -> Any:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    if text is not None:
        return api_pb2.TokenizeRequest(text=text)
    return api_pb2.TokenizeRequest(chat=chat_prompt(messages or ()))


ABORT = Call("Abort", lambda request_id: api_pb2.AbortRequest(request_id=request_id), lambda r: r.found)
"""Abort a running request; True if the server knew it."""
TOKENIZE = Call("Tokenize", _tokenize_request, lambda r: list(r.token_ids))
"""Token ids of `text`, or of `messages` rendered with the chat template."""
MODEL_INFO = Call("ModelInfo", api_pb2.ModelInfoRequest, message_to_dict)
SERVER_STATS = Call("ServerStats", api_pb2.ServerStatsRequest, message_to_dict)
LOAD_LORA_ADAPTER = Call(
    "LoadLoraAdapter",
    lambda name, path: api_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
    lambda r: list(r.lora_names),
)
"""Load a LoRA adapter at run time (the server's --allow-runtime-lora); the adapters served then."""
UNLOAD_LORA_ADAPTER = Call(
    "UnloadLoraAdapter", lambda name: api_pb2.UnloadLoraAdapterRequest(lora_name=name), lambda r: list(r.lora_names)
)
"""Unload one (refused while requests run under it); the adapters served then."""
HEALTH = Call(
    "Check",
    lambda: health_pb2.HealthCheckRequest(service=HEALTH_SERVICE),
    lambda r: health_pb2.HealthCheckResponse.ServingStatus.Name(r.status),
    health=True,
)
"""The grpc.health.v1 status of the server: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""

WAIT_POLL_S = 0.1
"""How often `wait_until_serving` asks again."""
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ServingWait:
    """`wait_until_serving`'s decisions: ask health until SERVING, or fail with DEADLINE_EXCEEDED.

    The clients loop: `probe_timeout()` for each health call, `saw(status)` or `failed(error)`
    with its outcome, then `pause()` seconds, until `done`."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.done = False
        self._last = "no answer"

    def probe_timeout(self) -> float:
        """The next health call's deadline; raises once the wait's own has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise KVServeError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{self.target} not SERVING after {self.timeout_s:g}s (last: {self._last})",
            )
        return max(min(remaining, 1.0), 0.01)

    def saw(self, status: str) -> None:
        self._last = status
        self.done = status == "SERVING"

    def failed(self, error: KVServeError) -> None:
        """A server that is not up yet is waited for; any other failure is the caller's."""
        if error.code not in _TRANSIENT:
            raise error
        self._last = error.code.name

    def pause(self) -> float:
        return 0.0 if self.done else min(WAIT_POLL_S, max(self.deadline - time.monotonic(), 0))
