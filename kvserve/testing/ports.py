"""Free loopback ports for servers, links and metrics endpoints started by tests and benchmarks.

A port is picked below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), never
from it. A port handed out is only reserved until the server binds it; one taken from the ephemeral
range can meanwhile become the local end of any outgoing connection on the machine (a health check,
a ZeroMQ link, an HTTP client), and the server then fails to start with "address in use". Below that
range only listeners bind, so a pick is lost only to another pick: each pytest-xdist worker picks from
its own share of the range, and a process never hands out the same port twice.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

LOWEST_PORT = 10_000
"""The bottom of the range picked from: above the well-known and most registered services' ports."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, never handed out before by this process; bind it soon."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports (all held open while picking, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in _candidates():
            if _bind(stack, host, port):
                ports.append(port)
                if len(ports) == count:
                    _handed_out.update(ports)
                    return ports
    raise RuntimeError(f"no {count} free ports on {host} below the ephemeral range")


def free_port_range(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` consecutive free TCP ports, for servers that take a first port and count up from it
    (`kvserve serve --replica-ports-from`); bind them soon."""
    for first in _candidates():
        ports = range(first, first + count)
        if any(port in _handed_out for port in ports) or ports[-1] >= _share()[1]:
            continue
        with contextlib.ExitStack() as stack:
            if all(_bind(stack, host, port) for port in ports):
                _handed_out.update(ports)
                return list(ports)
    raise RuntimeError(f"no {count} consecutive free ports on {host} below the ephemeral range")


def _bind(stack: contextlib.ExitStack, host: str, port: int) -> bool:
    """Whether `port` can be bound now; held open by `stack` if so."""
    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    try:
        sock.bind((host, port))
    except OSError:
        return False
    return True


def _candidates() -> Iterator[int]:
    """This process's share of the range, in random order, less the ports it handed out already."""
    first, end = _share()
    ports = [port for port in range(first, end) if port not in _handed_out]
    random.shuffle(ports)
    yield from ports


def _share() -> tuple[int, int]:
    """[first, end) of the ports this process picks from: its pytest-xdist worker's share of the range
    below the ephemeral ports (all of it outside pytest-xdist)."""
    try:
        ephemeral_first = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_first = 32_768  # Linux's default
    top = max(ephemeral_first, LOWEST_PORT + 1_000)
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.removeprefix("gw").isdigit() and workers.isdigit()):
        return LOWEST_PORT, top
    index, count = int(worker.removeprefix("gw")), max(1, int(workers))
    share = (top - LOWEST_PORT) // count
    return LOWEST_PORT + index * share, LOWEST_PORT + (index + 1) * share
