"""Where and how the clients connect: default target, TLS credentials and bearer-token metadata."""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_TARGET = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
"""Duplicates kvserve.config.defaults GRPC_HOST/GRPC_PORT on purpose: clients import no kvserve code.
A test keeps the two equal."""

HEALTH_SERVICE = ""
"""The grpc.health.v1 service name asked by `health()`: "" is the server as a whole."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)
"""Long token-id prompts and large logprob chunks exceed gRPC's 4 MiB default."""


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying the bearer token. Sent per call so it also works on plaintext loopback."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def host_port(host: str, port: int) -> str:
    """Join host and port into a gRPC target, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
