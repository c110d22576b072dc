"""Free loopback ports for servers, links and metrics endpoints started by tests and benchmarks."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it); bind it soon, another process may."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports (all held open while picking, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port_range(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` consecutive free TCP ports, for servers that take a first port and count up from it
    (`kvserve serve --replica-ports-from`); bind them soon."""
    for _ in range(100):
        (first,) = free_ports(1, host)
        if first + count > 65536:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, port))
            except OSError:
                continue
            return list(range(first, first + count))
    raise RuntimeError(f"no {count} consecutive free ports on {host}")
